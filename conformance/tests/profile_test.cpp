// Profiles and profile sets: the built-ins, JSON files and families, and one gate run judging
// each input dtype under its own profile.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <string>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli_args.hpp"

namespace attnoracle::testing {
namespace {

namespace fs = std::filesystem;
using conformance::load_profile_set;
using conformance::Profile;
using conformance::ProfileSet;

class Profiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("attnoracle-profile-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name, const std::string& text) {
    write_text(dir_ / name, text);
    return (dir_ / name).string();
  }
  // The message of the InputError `f` throws, or "" when it throws none.
  template <class F>
  static std::string refusal(F f) {
    try {
      f();
    } catch (const InputError& e) {
      return e.message();
    }
    return "";
  }
  fs::path dir_;
};

TEST_F(Profiles, ListJudgesEachDtypeByItsMember) {
  const ProfileSet s = load_profile_set("fp32,flash-fp16,torch-cpu-bf16");
  ASSERT_EQ(s.members.size(), 3u);
  EXPECT_EQ(s.name, "fp32,flash-fp16,torch-cpu-bf16");
  EXPECT_EQ(s.for_dtype(DType::F32)->name, "fp32");
  EXPECT_EQ(s.for_dtype(DType::F16)->name, "flash-fp16");
  EXPECT_EQ(s.for_dtype(DType::BF16)->name, "torch-cpu-bf16");
  EXPECT_EQ(s.for_dtype(DType::F64), nullptr);
  EXPECT_EQ(s.for_dtype(DType::BF16)->softmax, DType::BF16);
  EXPECT_EQ(s.for_dtype(DType::BF16)->p, DType::BF16);
}

TEST_F(Profiles, Families) {
  const ProfileSet std_ = load_profile_set("standard"), flash = load_profile_set("flash");
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16}) {
    ASSERT_NE(std_.for_dtype(t), nullptr);
    ASSERT_NE(flash.for_dtype(t), nullptr);
  }
  EXPECT_EQ(std_.for_dtype(DType::F16)->name, "fp16");
  EXPECT_EQ(flash.for_dtype(DType::F16)->name, "flash-fp16");
  EXPECT_EQ(flash.for_dtype(DType::BF16)->p, DType::BF16);
  EXPECT_EQ(flash.for_dtype(DType::F64)->name, "fp64");
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
    EXPECT_EQ(std_.for_dtype(t), nullptr);
    ASSERT_NE(flash.for_dtype(t), nullptr);
    EXPECT_EQ(flash.for_dtype(t)->name, "flash-fp8");
    EXPECT_EQ(flash.for_dtype(t)->p, DType::F8_E4M3);
  }
  EXPECT_EQ(load_profile_set("fp8").for_dtype(DType::F8_E5M2)->p, DType::F32);
}

TEST_F(Profiles, Fp8Fields) {
  file("p8.json", R"({"name": "p8", "base": "fp8", "input_dtypes": ["F8_E5M2"], "p": "F8_E4M3"})");
  const Profile p = conformance::profile_from_json((dir_ / "p8.json").string());
  EXPECT_TRUE(p.covers(DType::F8_E5M2));
  EXPECT_FALSE(p.covers(DType::F8_E4M3));
  EXPECT_EQ(p.p, DType::F8_E4M3);
  file("s8.json", R"({"name": "s8", "softmax": "F8_E4M3"})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "s8.json").string()); })
                .find("s8.json: softmax: must be one of F64, F32, F16, BF16"),
            std::string::npos);
}

TEST_F(Profiles, BackwardFields) {
  // the built-ins: FlashAttention 2 rounds P and dS to the input dtype for the gradient products
  EXPECT_EQ(conformance::builtin_profile("flash-fp16").grad_ds, DType::F16);
  EXPECT_EQ(conformance::builtin_profile("flash-bf16").grad_ds, DType::BF16);
  EXPECT_EQ(conformance::builtin_profile("fp16").grad_ds, DType::F32);
  EXPECT_EQ(conformance::builtin_profile("fp64").grad_accum, DType::F64);
  EXPECT_EQ(conformance::builtin_profile("torch-cpu-bf16").grad_dp, DType::BF16);
  file("g.json", R"({"name": "g", "base": "bf16", "grad_ds": "BF16", "grad_dp": "F32", "grad_accum": "F32", "returns_gradients": false})");
  const Profile p = conformance::profile_from_json((dir_ / "g.json").string());
  EXPECT_EQ(p.grad_ds, DType::BF16);
  EXPECT_FALSE(p.returns_gradients);
  file("g2.json", R"({"name": "g2", "grad_accum": "F8_E4M3"})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "g2.json").string()); })
                .find("g2.json: grad_accum: must be one of F64, F32, F16, BF16"),
            std::string::npos);
  file("g3.json", R"({"name": "g3", "returns_gradients": "yes"})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "g3.json").string()); })
                .find("g3.json: returns_gradients: must be true or false"),
            std::string::npos);
}

TEST_F(Profiles, DeclaredDeterminismAndBatchInvariance) {
  // no built-in declares either; a JSON profile may, each on its own
  for (const std::string& name : conformance::builtin_profile_names()) {
    EXPECT_FALSE(conformance::builtin_profile(name).deterministic) << name;
    EXPECT_FALSE(conformance::builtin_profile(name).batch_invariant) << name;
  }
  file("d.json", R"({"name": "d", "base": "fp32", "deterministic": true})");
  const Profile p = conformance::profile_from_json((dir_ / "d.json").string());
  EXPECT_TRUE(p.deterministic);
  EXPECT_FALSE(p.batch_invariant);
  file("d2.json", R"({"name": "d2", "batch_invariant": 1})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "d2.json").string()); })
                .find("d2.json: batch_invariant: must be true or false"),
            std::string::npos);
}

// lse_dtype: the flash profiles (and so the flash family) return lse in F32; a JSON profile sets
// it by name, or clears it with null.
TEST_F(Profiles, LseDtype) {
  for (const char* n : {"flash-fp16", "flash-bf16", "flash-fp8"})
    EXPECT_EQ(conformance::builtin_profile(n).lse_dtype, DType::F32) << n;
  for (const char* n : {"fp64", "fp32", "fp16", "bf16", "torch-cpu-bf16", "fp8"})
    EXPECT_FALSE(conformance::builtin_profile(n).lse_dtype) << n;
  const auto flash = conformance::load_profile_set("flash");
  EXPECT_EQ(flash.for_dtype(DType::BF16)->lse_dtype, DType::F32);
  EXPECT_FALSE(flash.for_dtype(DType::F64)->lse_dtype);
  file("l.json", R"({"name": "l", "base": "bf16", "lse_dtype": "F32"})");
  EXPECT_EQ(conformance::profile_from_json((dir_ / "l.json").string()).lse_dtype, DType::F32);
  file("l2.json", R"({"name": "l2", "base": "flash-bf16", "lse_dtype": null})");
  EXPECT_FALSE(conformance::profile_from_json((dir_ / "l2.json").string()).lse_dtype);
  file("l3.json", R"({"name": "l3", "lse_dtype": "I32"})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "l3.json").string()); })
                .find("l3.json: lse_dtype: must be one of F64, F32, F16, BF16"),
            std::string::npos);
}

// partials: a split-KV kernel's stored O_s dtype, none in the built-in profiles; set by name,
// cleared with null, refused when not a float dtype.
TEST_F(Profiles, Partials) {
  for (const auto& n : conformance::builtin_profile_names()) EXPECT_FALSE(conformance::builtin_profile(n).partials) << n;
  file("p.json", R"({"name": "p", "base": "flash-bf16", "partials": "BF16"})");
  EXPECT_EQ(conformance::profile_from_json((dir_ / "p.json").string()).partials, DType::BF16);
  file("p2.json", R"({"name": "p2", "base": "flash-bf16", "partials": null})");
  EXPECT_FALSE(conformance::profile_from_json((dir_ / "p2.json").string()).partials);
  file("p3.json", R"({"name": "p3", "partials": "I32"})");
  EXPECT_NE(refusal([&] { conformance::profile_from_json((dir_ / "p3.json").string()); })
                .find("p3.json: partials: must be one of F64, F32, F16, BF16"),
            std::string::npos);
}

TEST_F(Profiles, JsonFamilyWithNamesFilesAndObjects) {
  file("f16.json", R"({"name": "my-f16", "base": "fp16", "softmax": "F16", "bias": "F16"})");
  const std::string fam = file("fam.json", R"({"name": "mine", "profiles": ["fp32", "f16.json",
      {"name": "my-bf16", "base": "bf16", "p": "BF16", "masked_rows": "nan"}]})");
  const ProfileSet s = load_profile_set(fam);
  EXPECT_EQ(s.name, "mine");
  ASSERT_EQ(s.members.size(), 3u);
  const Profile* f16 = s.for_dtype(DType::F16);
  ASSERT_NE(f16, nullptr);
  EXPECT_EQ(f16->name, "my-f16");
  EXPECT_EQ(f16->softmax, DType::F16);
  ASSERT_TRUE(f16->bias.has_value());
  EXPECT_EQ(*f16->bias, DType::F16);
  EXPECT_EQ(s.for_dtype(DType::BF16)->masked_rows, conformance::MaskedRowConvention::Nan);
  EXPECT_FALSE(s.for_dtype(DType::F32)->bias.has_value());
  // a single profile file is a set of one
  EXPECT_EQ(load_profile_set((dir_ / "f16.json").string()).members.size(), 1u);
}

TEST_F(Profiles, Refusals) {
  EXPECT_NE(refusal([] { load_profile_set("fp16,flash-fp16"); }).find("profiles fp16 and flash-fp16 both cover F16 inputs"),
            std::string::npos);
  EXPECT_NE(refusal([] { load_profile_set("fp32,"); }).find("--profile: an empty profile name"), std::string::npos);
  EXPECT_NE(refusal([] { load_profile_set("fp32,fp7"); }).find("unknown profile 'fp7'"), std::string::npos);
  const std::string all = file("all.json", R"({"base": "fp32", "input_dtypes": []})");
  EXPECT_NE(refusal([&] { load_profile_set("fp16," + all); }).find("both cover F16 inputs"), std::string::npos);
  const std::string bad_field = file("bad1.json", R"({"name": "x", "profiles": ["fp32"], "safety": 2})");
  EXPECT_NE(refusal([&] { load_profile_set(bad_field); }).find("bad1.json: safety: unknown field of a profile family"),
            std::string::npos);
  const std::string empty = file("bad2.json", R"({"profiles": []})");
  EXPECT_NE(refusal([&] { load_profile_set(empty); }).find("bad2.json: profiles: must be a non-empty list"),
            std::string::npos);
  const std::string number = file("bad3.json", R"({"profiles": [3]})");
  EXPECT_NE(refusal([&] { load_profile_set(number); }).find("bad3.json: profiles: each member is"), std::string::npos);
  const std::string member = file("bad4.json", R"({"profiles": [{"base": "fp16", "softmax": "F8"}]})");
  EXPECT_NE(refusal([&] { load_profile_set(member); }).find("bad4.json: profiles[0]: softmax: must be one of"),
            std::string::npos);
  const std::string bias = file("bad5.json", R"({"base": "fp16", "bias": "I64"})");
  EXPECT_NE(refusal([&] { load_profile_set(bias); }).find("bad5.json: bias: must be one of F64, F32, F16, BF16"),
            std::string::npos);
  // names of the wrong type and text from the file, escaped: one line naming the file and field
  const std::string base = file("bad6.json", R"({"base": 3})");
  EXPECT_EQ(refusal([&] { load_profile_set(base); }), base + ": base: must be a string, not a JSON number");
  const std::string name = file("bad7.json", R"({"name": ["x"], "profiles": ["fp32"]})");
  EXPECT_EQ(refusal([&] { load_profile_set(name); }), name + ": name: must be a string, not a JSON array");
  const std::string key = file("bad8.json", R"({"bad\nkey": 1})");
  EXPECT_EQ(refusal([&] { load_profile_set(key); }), key + ": bad\\x0akey: unknown profile field");
  const std::string unknown = file("bad9.json", R"({"base": "fp\n16"})");
  EXPECT_EQ(refusal([&] { load_profile_set(unknown); }).rfind(unknown + ": base: unknown profile 'fp\\x0a16' (", 0), 0u);
  const std::string names = file("bad10.json", R"({"profiles": [{"name": "a\nb"}, {"name": "c"}]})");
  EXPECT_NE(refusal([&] { load_profile_set(names); }).find("profiles a\\x0ab and c both cover"), std::string::npos);
  const std::string member_file = file("bad11.json", R"({"profiles": ["x\n.json"]})");
  EXPECT_EQ(refusal([&] { load_profile_set(member_file); }),
            member_file + ": profiles[0]: \"x\\x0a.json\" is not a profile name or a file name");
  // invariants takes one profile, not a family
  EXPECT_NE(refusal([&] { conformance::load_profile((dir_ / "bad1.json").string()); }).find("a profile family"),
            std::string::npos);
  // through the command line: one line, exit status 2
  std::string out;
  EXPECT_EQ(run("run " + std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core --impl true --profile bf16,torch-cpu-bf16", out), 2);
  EXPECT_NE(out.find("attnoracle: error: --profile: profiles bf16 and torch-cpu-bf16 both cover BF16 inputs"),
            std::string::npos)
      << out;
}

// A bias rounded to F16 first adds u_F16 |bias_j| (and half F16's smallest spacing) to each score.
TEST_F(Profiles, BiasDtypeWidensTheScoreBound) {
  Profile p = conformance::builtin_profile("fp16");
  Case c;
  c.Dk = 8;
  c.output_dtype = DType::F16;
  conformance::RowMagnitudes m;
  m.dot_abs = 3;
  m.score_abs = 10;
  m.bias_abs = 64;
  m.keys = 16;
  const double exact = conformance::row_limits(p, c, m).score;
  p.bias = DType::F16;
  const double rounded = conformance::row_limits(p, c, m).score;
  EXPECT_DOUBLE_EQ(rounded - exact, 64 * 0x1p-11 + 0x1p-25);
}

// Online softmax over blocks of 16: 64 keys are 4 blocks, 3 rescales by alpha (exp_ulps each,
// and 2 u M for their arguments, in eps_e, twice in eps_w) and 3 more roundings in the row sum.
TEST_F(Profiles, KeyBlocksWidenTheWeightBound) {
  Profile p = conformance::builtin_profile("fp32");
  EXPECT_EQ(p.key_block, 16);
  Case c;
  c.Dk = 4;
  const conformance::RowMagnitudes m{2.0, 3.0, 64};
  const double blocked = conformance::row_limits(p, c, m).weight_rel;
  p.key_block = 0;
  const double one_pass = conformance::row_limits(p, c, m).weight_rel;
  const double u = 0x1p-24;
  EXPECT_DOUBLE_EQ(blocked - one_pass, 2 * (3 * 4 * u + 2 * u * 3) + 3 * u);
  // a row within one block: no rescale
  const conformance::RowMagnitudes m16{2.0, 3.0, 16};
  p.key_block = 16;
  const double in_one = conformance::row_limits(p, c, m16).weight_rel;
  p.key_block = 0;
  EXPECT_DOUBLE_EQ(in_one, conformance::row_limits(p, c, m16).weight_rel);
  const std::string bad = file("kb.json", R"({"base": "fp32", "key_block": -1})");
  EXPECT_NE(refusal([&] { conformance::load_profile(bad); }).find("kb.json: key_block: must be an integer >= 0"),
            std::string::npos);
  file("kb2.json", R"({"base": "fp32", "key_block": 1})");
  EXPECT_EQ(conformance::load_profile((dir_ / "kb2.json").string()).key_block, 1);
}

// A one-row F32 case: q [1,1,1,2], k [1,1,3,2], the given bias [1,1,1,3] and metadata.
Case one_row(const std::vector<float>& bias, const std::map<std::string, std::string>& meta) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  for (const auto& [key, v] : meta) f.metadata[key] = v;
  auto put = [&](const char* name, std::vector<std::int64_t> shape, std::vector<float> values) {
    RawTensor t{name, DType::F32, shape, std::vector<unsigned char>(values.size() * 4)};
    std::memcpy(t.data.data(), values.data(), t.data.size());
    f.put(std::move(t));
  };
  put("q", {1, 1, 1, 2}, {1, 2});
  put("k", {1, 1, 3, 2}, {3, 1, -1, 2, 0.5f, 0.5f});  // dots 5, 3, 1.5
  put("v", {1, 1, 3, 2}, {1, 0, 0, 1, 1, 1});
  put("bias", {1, 1, 1, 3}, bias);
  return case_from_file("one-row", f);
}

// Keys whose scores sit far below the row's (a finite bias used as a mask) leave M, in the
// float-filtered path and in the exact one (softcap), and a negative scale keeps its sign.
TEST_F(Profiles, FarBelowKeysAndNegativeScales) {
  for (const char* cap : {"", "1000"}) {
    std::map<std::string, std::string> meta = {{"attn.scale", "0.5"}};
    if (*cap) meta["attn.softcap"] = cap;
    auto M = [&](std::vector<float> bias) { return conformance::row_magnitudes(one_row(bias, meta))[0].score_abs; };
    auto capped = [&](double t) { return *cap ? 1000 * std::tanh(t / 1000) : t; };
    // scores 2.5, 1.5 + b, 0.75: with b = -FLT_MAX or -1e4 the second key is negligible
    EXPECT_DOUBLE_EQ(M({0, -FLT_MAX, 0}), capped(2.5)) << cap;
    EXPECT_DOUBLE_EQ(M({0, -1e4f, 0}), capped(2.5)) << cap;
    EXPECT_DOUBLE_EQ(M({0, -6, 0}), std::fabs(capped(1.5) - 6)) << cap;  // not far: kept
    // every key far below: none is negligible (the row's own maximum is that far down)
    EXPECT_GT(M({-FLT_MAX, -FLT_MAX, -FLT_MAX}), 1e38) << cap;
    // a negative scale: scores -2.5 + 3, -1.5, -0.75; |S| is 1.5, not |2.5 + 3|
    meta["attn.scale"] = "-0.5";
    EXPECT_DOUBLE_EQ(M({3, 0, 0}), std::fabs(capped(-1.5))) << cap;
  }
}

// One run, three input dtypes, each under its own profile; the cases of a dtype no profile
// covers are skipped and never given to the implementation.
TEST_F(Profiles, OneRunGatesSeveralDtypes) {
  const std::string jobs_seen = (dir_ / "seen.txt").string();
  const std::string impl = file("impl.sh", "cat \"$1\" >> " + jobs_seen + "\nexec /usr/bin/python3 " +
                                               std::string(ATTNORACLE_SOURCE_DIR) +
                                               "/conformance/adapters/numpy/attention.py \"$1\"\n");
  const std::string json = (dir_ / "r.json").string();
  std::string out;
  ASSERT_EQ(run("run " + std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core --tag uniform --impl '/bin/sh " + impl +
                    "' --profile fp32,fp16,bf16 --json " + json, out),
            0)
      << out;
  const auto r = nlohmann::json::parse(std::ifstream(json));
  EXPECT_EQ(r["profile"], "fp32,fp16,bf16");
  std::set<std::string> judged;
  std::set<std::string> skipped_ids;
  for (const auto& c : r["cases"]) {
    const std::string dt = c["dtype"];
    if (dt == "F64" || dt.rfind("F8_", 0) == 0) {  // F64 and FP8: no member covers them
      EXPECT_EQ(c["status"], "skip");
      EXPECT_EQ(c["reason"], "profile fp32,fp16,bf16 does not cover " + dt + " inputs");
      EXPECT_FALSE(c.contains("profile"));
      skipped_ids.insert(c["id"].get<std::string>());
      continue;
    }
    EXPECT_EQ(c["status"], "pass") << c.dump();
    EXPECT_EQ(c["profile"], dt == "F32" ? "fp32" : dt == "F16" ? "fp16" : "bf16");
    judged.insert(dt);
  }
  EXPECT_EQ(judged, (std::set<std::string>{"F32", "F16", "BF16"}));
  ASSERT_FALSE(skipped_ids.empty());
  std::ifstream seen(jobs_seen);
  const std::string jobs((std::istreambuf_iterator<char>(seen)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(jobs.empty());
  for (const auto& id : skipped_ids) EXPECT_EQ(jobs.find("\"" + id + "\""), std::string::npos) << id << " was run";
}

}  // namespace
}  // namespace attnoracle::testing
