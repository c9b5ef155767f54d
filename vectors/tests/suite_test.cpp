// Suite specs (expansion order, ids, seeds, tags, refusals with JSON paths), manifests and
// SHA-256.
#include "attnoracle/vectors/suite.hpp"

#include <gtest/gtest.h>

#include <algorithm>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/manifest.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::vectors;

std::string error_of(const std::string& text) {
  try {
    parse_suite("spec.json", text);
  } catch (const InputError& e) {
    return e.message();
  }
  return "(accepted)";
}

const char* kSpec = R"({"suite": "s", "seed": 9, "families": [
  {"name": "a", "generator": "normal", "tags": ["t"],
   "cross": {"dtype": ["F32", "F16"], "causal": ["none", "top_left", "bottom_right"]},
   "fixed": {"shape": [1, 2, 1, 3, 4, 5, 6]}, "seeds": 2},
  {"name": "b", "generator": "ties", "cross": {"params": [{}, {"distinct": 2}]},
   "fixed": {"kind": "mha", "shape": [2, 3, 4, 4, 5, 6, 7, 8], "self": true}}]})";

TEST(VectorsSuite, ExpansionOrderIdsAndOptions) {
  const Suite s = parse_suite("spec.json", kSpec);
  EXPECT_EQ(s.name, "s");
  EXPECT_EQ(s.seed, 9u);
  ASSERT_EQ(s.cases.size(), 2u * 3 * 2 + 2);
  // dtype turns slowest, then causal, then the seeds
  EXPECT_EQ(s.cases[0].id, "a-000");
  EXPECT_EQ(s.cases[11].id, "a-011");
  EXPECT_EQ(s.cases[0].problem.dtype, DType::F32);
  EXPECT_EQ(s.cases[0].problem.causal, Causal::None);
  EXPECT_EQ(s.cases[1].problem.causal, Causal::None);  // second seed
  EXPECT_NE(s.cases[0].seed, s.cases[1].seed);
  EXPECT_EQ(s.cases[2].problem.causal, Causal::TopLeft);
  EXPECT_EQ(s.cases[6].problem.dtype, DType::F16);
  const ProblemSpec& p = s.cases[0].problem;
  EXPECT_EQ(p.B, 1);
  EXPECT_EQ(p.Hq, 2);
  EXPECT_EQ(p.Hkv, 1);
  EXPECT_EQ(p.Nq, 3);
  EXPECT_EQ(p.Dv, 6);
  const ProblemSpec& m = s.cases[12].problem;
  EXPECT_EQ(s.cases[12].id, "b-000");
  EXPECT_EQ(m.kind, Kind::Mha);
  EXPECT_EQ(m.Hq, 3);
  EXPECT_EQ(m.D, 5);
  EXPECT_EQ(m.Dout, 8);
  EXPECT_TRUE(m.self_attention);
  EXPECT_TRUE(m.params.empty());
  EXPECT_EQ(s.cases[13].problem.params.at("distinct"), 2.0);
  EXPECT_EQ(s.cases[2].tags, (std::vector<std::string>{"t", "normal", "f32", "mqa",
                                                       "causal_top_left", "nq_lt_nk", "dv_ne_dk",
                                                       "head_dim_5_6"}));
}

// output_dtypes: BF16 out with an F32 lse, tagged lse_f32; "none" clears it.
TEST(VectorsSuite, OutputDtypesOption) {
  const Suite s = parse_suite("spec.json", R"({"suite": "s", "seed": 1, "families": [
    {"name": "a", "generator": "normal",
     "cross": {"output_dtypes": ["lse:F32", "none", "lse:F32,out:F32"]},
     "fixed": {"dtype": "BF16", "outputs": "out,lse", "shape": [1, 2, 2, 3, 4, 8, 8]}}]})");
  ASSERT_EQ(s.cases.size(), 3u);
  EXPECT_EQ(s.cases[0].problem.output_dtypes, "lse:F32");
  EXPECT_EQ(s.cases[1].problem.output_dtypes, "");
  const auto& tags = s.cases[0].tags;
  EXPECT_NE(std::find(tags.begin(), tags.end(), "lse_f32"), tags.end());
  const auto& both = s.cases[2].tags;
  EXPECT_NE(std::find(both.begin(), both.end(), "out_f32"), both.end());
  for (const auto& t : s.cases[1].tags) EXPECT_EQ(t.find("lse_"), std::string::npos) << t;
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"outputs": "out", "output_dtypes": "lse:F32"}}]})"),
            "spec.json: families[0]: case a-000: output_dtypes gives a dtype to \"lse\", which is not among outputs out");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"outputs": "out,lse", "output_dtypes": "lse:F12"}}]})"),
            "spec.json: families[0]: case a-000: output_dtypes must be a comma list of name:DTYPE, DTYPE F64, F32, F16 "
            "or BF16 (F32, F16 or BF16 for FP8 inputs), not \"lse:F12\"");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"outputs": "out,lse", "output_dtypes": "lse:F32,lse:F16"}}]})"),
            "spec.json: families[0]: case a-000: output_dtypes names \"lse\" twice");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"output_dtypes": 3}}]})").rfind("spec.json: families[0].fixed.output_dtypes: ", 0), 0u);
}

TEST(VectorsSuite, SeedsDependOnSuiteFamilyAndIndexOnly) {
  const Suite s = parse_suite("spec.json", kSpec);
  // Another family in front changes neither ids nor seeds of the others.
  std::string more = kSpec;
  more.insert(more.find("[\n") + 2,
              R"(  {"name": "z", "generator": "uniform", "cross": {"dtype": ["F64", "F32"]}},)");
  const Suite t = parse_suite("spec.json", more);
  ASSERT_EQ(t.cases.size(), s.cases.size() + 2);
  for (std::size_t k = 0; k < s.cases.size(); ++k) {
    EXPECT_EQ(t.cases[k + 2].id, s.cases[k].id);
    EXPECT_EQ(t.cases[k + 2].seed, s.cases[k].seed);
  }
  EXPECT_EQ(s.cases[3].seed, case_seed(9, "a", 3));
  EXPECT_NE(case_seed(9, "a", 3), case_seed(10, "a", 3));
  EXPECT_NE(case_seed(9, "a", 3), case_seed(9, "b", 3));
}

TEST(VectorsSuite, RefusalsNameTheJsonPath) {
  EXPECT_EQ(error_of("{\"suite\": \"s\",\n \"seed\": 1,, }").rfind("spec.json: line 2, column ", 0),
            0u);
  EXPECT_EQ(
      error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "gauss"}]})"),
      "spec.json: families[0].generator: unknown generator \"gauss\" (known: uniform, normal, "
      "large_scores, ties, near_ties, dominant, cancel, wide_range, subnormal, score_jump)");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "cross": {"dtype": ["F32", "F12"]}}]})"),
            "spec.json: families[0].cross.dtype[1]: \"F12\" is not one of F64, F32, F16, BF16, "
            "F8_E4M3, F8_E5M2");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"casual": "top_left"}}]})")
                .rfind("spec.json: families[0].fixed.casual: unknown option", 0),
            0u);
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"shape": [1, 4, 3, 2, 2, 2, 2]}}]})"),
            "spec.json: families[0].fixed.shape: Hkv 3 does not divide Hq 4");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "cross": {"kind": ["sdpa", "mha"]}, "fixed": {"shape": [1, 1, 1, 2, 2, 2, 2]}}]})"),
            "spec.json: families[0].fixed.shape: kind mha needs 8 sizes [B,H,Nq,Nk,D,Dk,Dv,Dout]");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"params": {"offset": 3}}}]})"),
            "spec.json: families[0]: case a-000: generator normal has no parameter \"offset\"");
  // the parameter's name escaped: the message stays one line
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"params": {"off\nset": 3}}}]})"),
            "spec.json: families[0]: case a-000: generator normal has no parameter \"off\\x0aset\"");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "cross": {"dtype": []}}]})"),
            "spec.json: families[0].cross.dtype: must be a non-empty array of values, not []");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal"},
      {"name": "a", "generator": "normal"}]})"),
            "spec.json: families[1].name: family \"a\" appears twice");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "seed": 2, "families": []})"),
            "spec.json: seed: key appears twice in its object");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": -1, "families": []})"),
            "spec.json: seed: must be a non-negative integer, not -1");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"self": true}}]})"),
            "spec.json: families[0]: case a-000: self attention needs kind mha and Nq = Nk");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"window": [1, -2]}}]})"),
            "spec.json: families[0].fixed.window[1]: must be between 0 and 16777216, not -2");
  // zero is below the bound too (a head count of 0 divided by zero; 0 seeds made no case)
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"shape": [1, 2, 0, 2, 2, 2, 2]}}]})"),
            "spec.json: families[0].fixed.shape[2]: must be between 1 and 16777216, not 0");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "seeds": 0}]})"),
            "spec.json: families[0].seeds: must be between 1 and 10000, not 0");
  EXPECT_EQ(error_of("[]"), "spec.json: $: must be a JSON object, not a JSON array");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"bias": "random", "bias_fill": "-1e4"}}]})"),
            "spec.json: families[0].fixed.bias_fill: needs bias fill, not random");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"dtype": "F16", "bias": "fill", "bias_dtype": "F16"},
      "cross": {"bias_fill": [-1e4, "-1e5"]}}]})"),
            "spec.json: families[0].cross.bias_fill[1]: bias_fill -1e5 overflows bias_dtype F16");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal",
      "fixed": {"bias": "fill", "bias_fill": true}}]})"),
            "spec.json: families[0].fixed.bias_fill: must be a number or a string holding one, not "
            "true");
}

// The options of stored K/V and FP8 outputs: bad values refused at their JSON path.
TEST(VectorsSuite, StoredKvOptionsRefusals) {
  const std::string head = R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "normal", )";
  EXPECT_EQ(error_of(head + R"("cross": {"kv_format": ["I8", "I4"]}}]})"),
            "spec.json: families[0].cross.kv_format[1]: \"I4\" is not one of none, F8_E4M3, F8_E5M2, I8, mxfp8, nvfp4");
  EXPECT_EQ(error_of(head + R"("fixed": {"kv_format": "I8", "kv_scale": "page"}}]})"),
            "spec.json: families[0].fixed.kv_scale: \"page\" is not one of tensor, head, token");
  EXPECT_EQ(error_of(head + R"("fixed": {"kv_format": "I8", "kv_scale_binades": 31}}]})"),
            "spec.json: families[0].fixed.kv_scale_binades: must be between 0 and 30, not 31");
  EXPECT_EQ(error_of(head + R"("fixed": {"v_from_k": 1}}]})"),
            "spec.json: families[0].fixed.v_from_k: must be true or false, not 1");
  EXPECT_EQ(error_of(head + R"("fixed": {"o_scale": [1]}}]})"),
            "spec.json: families[0].fixed.o_scale: must be a number or a string holding one, not [1]");
  EXPECT_EQ(error_of(head + R"("fixed": {"kv_format": "mxfp8", "shape": [1, 1, 1, 1, 2, 16, 16]}}]})"),
            "spec.json: families[0]: case a-000: kv_format mxfp8 needs Dk and Dv multiples of 32");
  EXPECT_EQ(error_of(head + R"("fixed": {"output_dtype": "F8_E4M3", "o_scale": 0}}]})"),
            "spec.json: families[0]: case a-000: o_scale \"0\" is not a number > 0 that F32 holds (rounded to nearest)");
  EXPECT_EQ(error_of(head + R"("fixed": {"outputs": "out,amax"}}]})"),
            "spec.json: families[0]: case a-000: amax needs an FP8 output_dtype (F8_E4M3 or F8_E5M2)");
  EXPECT_EQ(error_of(head + R"("fixed": {"params": {"jump": 8}}}]})"),
            "spec.json: families[0]: case a-000: generator normal has no parameter \"jump\"");
  EXPECT_EQ(error_of(R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "score_jump",
      "fixed": {"params": {"at": 1.5}}}]})"),
            "spec.json: families[0]: case a-000: score_jump needs jump > 0 and an integer at >= 0");
}

TEST(VectorsSuite, StoredKvOptionsExpandAndTag) {
  const Suite s = parse_suite("spec.json", R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "normal", "cross": {"kv_format": ["F8_E5M2", "nvfp4"]},
      "fixed": {"shape": [1, 2, 1, 1, 4, 32, 16], "v_from_k": true, "output_dtype": "F8_E4M3",
                "o_scale": "0x1p-3", "outputs": "out,amax", "kv_scale_binades": 2}}]})");
  ASSERT_EQ(s.cases.size(), 2u);
  EXPECT_EQ(s.cases[0].problem.kv_format, "F8_E5M2");
  EXPECT_EQ(s.cases[1].problem.kv_format, "nvfp4");
  EXPECT_TRUE(s.cases[0].problem.v_from_k && s.cases[0].problem.want_amax);
  EXPECT_EQ(s.cases[0].problem.o_scale, "0x1p-3");
  const auto& t0 = s.cases[0].tags;
  for (const char* t : {"stored_kv", "kv_f8_e5m2", "kv_scale_tensor", "kv_scale_binades", "v_from_k", "o_scale", "amax", "out_f8_e4m3"})
    EXPECT_NE(std::find(t0.begin(), t0.end(), t), t0.end()) << t;
  const auto& t1 = s.cases[1].tags;
  EXPECT_NE(std::find(t1.begin(), t1.end(), "kv_nvfp4"), t1.end());
  EXPECT_EQ(std::find(t1.begin(), t1.end(), "kv_scale_tensor"), t1.end());  // block forms have none
}

TEST(VectorsSuite, CommittedSpecsParse) {
  const std::string dir = std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/suites/";
  const Suite core = read_suite(dir + "core.json");
  EXPECT_EQ(core.name, "core");
  EXPECT_GT(core.cases.size(), 200u);
  const Suite extended = read_suite(dir + "extended.json");
  EXPECT_EQ(extended.name, "extended");
  EXPECT_GT(extended.cases.size(), 500u);
  // every data generator appears in both
  for (const auto& g : generators()) {
    bool in_core = false, in_extended = false;
    for (const auto& c : core.cases) in_core = in_core || c.problem.generator == g.name;
    for (const auto& c : extended.cases) in_extended = in_extended || c.problem.generator == g.name;
    EXPECT_TRUE(in_core && in_extended) << g.name;
  }
}

TEST(VectorsManifest, TextRoundTripsAndIsStable) {
  Manifest m;
  m.suite = "s";
  m.generator = "attnoracle 9";
  m.seed = 18446744073709551615ULL;
  m.spec_sha256 = std::string(64, 'a');
  m.cases.push_back({"x-000", "cases/x-000.safetensors", std::string(64, '0'), "ok", {"a", "b"}});
  m.cases.push_back({"x-001", "cases/x-001.safetensors", std::string(64, 'f'), "error", {}});
  const std::string text = manifest_text(m);
  EXPECT_EQ(text.rfind("{\"format\": \"attnoracle-vectors/1\", \"suite\": \"s\"", 0), 0u);
  std::string problem;
  const Manifest back = parse_manifest("m.json", text, problem);
  EXPECT_EQ(problem, "");
  EXPECT_EQ(manifest_text(back), text);
  EXPECT_EQ(back.seed, m.seed);

  auto problem_of = [&](std::string t) {
    std::string p;
    parse_manifest("m.json", t, p);
    return p;
  };
  std::string bad = text;
  bad.replace(bad.find("vectors/1"), 9, "vectors/2");
  EXPECT_EQ(problem_of(bad), "format: \"attnoracle-vectors/2\" is not \"attnoracle-vectors/1\"");
  bad = text;
  bad.replace(bad.find("\"error\""), 7, "\"maybe\"");
  EXPECT_EQ(problem_of(bad), "cases[1].expect: missing or not \"ok\" or \"error\"");
  bad = text;
  bad.replace(bad.find("cases/x-001"), 11, "cases/x-002");
  EXPECT_EQ(problem_of(bad), "cases[1].file: missing or not \"cases/x-001.safetensors\"");
  bad = text;
  bad.replace(bad.find(std::string(64, 'f')), 1, "g");
  EXPECT_EQ(problem_of(bad), "cases[1].sha256: missing or not 64 lowercase hex digits");
  EXPECT_THROW(problem_of("{"), InputError);
}

TEST(VectorsSha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(std::string_view("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(std::string_view("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

}  // namespace
}  // namespace attnoracle::testing
