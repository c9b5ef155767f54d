// The findings of a failing case's report: results made by hand from the golden values, each
// with one planted pattern, and the NumPy adapter's planted bugs through `attnoracle run`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_args.hpp"
#include "diagnosis_results.hpp"

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/manifest.hpp"

namespace attnoracle::conformance {
namespace {

namespace fs = std::filesystem;

struct Shape {
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 6, Nk = 6, D = 4;
};

// An F32 case of smooth pseudo-random inputs; q's row i (every batch and head) scaled by
// q_row_scale(i).
SafeTensorsFile make_case(const Shape& s, std::map<std::string, std::string> meta,
                          const std::function<double(std::int64_t)>& q_row_scale = nullptr) {
  SafeTensorsFile f;
  f.metadata = std::move(meta);
  f.metadata["attn.format"] = "1";
  auto put = [&](const char* name, std::int64_t H, std::int64_t N, float seed, bool scaled) {
    RawTensor t{name, DType::F32, {s.B, H, N, s.D}, {}};
    const std::int64_t n = s.B * H * N * s.D;
    t.data.resize(static_cast<std::size_t>(n) * 4);
    for (std::int64_t e = 0; e < n; ++e) {
      float v = std::sin(seed * static_cast<float>(e + 1));
      if (scaled && q_row_scale) v *= static_cast<float>(q_row_scale(e / s.D % N));
      std::memcpy(t.data.data() + 4 * e, &v, 4);
    }
    f.put(std::move(t));
  };
  put("q", s.Hq, s.Nq, 1.7f, true);
  put("k", s.Hkv, s.Nk, 0.9f, false);
  put("v", s.Hkv, s.Nk, 2.3f, false);
  return f;
}

using testing::get;
using testing::golden_of;
using testing::set;
using testing::tensor;
using testing::all;
using testing::change;
using testing::compare;
using testing::find;

// The golden tensors returned as the result.
JobResult golden_result(const SafeTensorsFile& golden) { return testing::golden_result(golden, {"out", "weights", "lse"}); }

TEST(Diagnosis, PassHasSummariesAndNoFinding) {
  const auto golden = golden_of(make_case({2, 4, 2, 5, 7, 4}, {{"attn.outputs", "out,weights,lse"}, {"attn.causal", "top_left"}}));
  const CaseReport rep = compare(golden, golden_result(golden));
  ASSERT_EQ(rep.status, CaseStatus::Pass) << all(rep);
  EXPECT_TRUE(rep.diagnosis.findings.empty()) << all(rep);
  EXPECT_EQ(rep.diagnosis.failing_rows, 0);
  EXPECT_TRUE(rep.diagnosis.rows.empty());
  EXPECT_EQ(rep.diagnosis.heads.size(), 3u * 2 * 4);  // out, weights, lse; B = 2, Hq = 4
  for (const auto& h : rep.diagnosis.heads) EXPECT_EQ(h.failed, 0);
}

TEST(Diagnosis, WeightPastSeqlensKNamesTheRule) {
  // seqlens_k = 4 of Nk = 6, bottom_right aligned to 4 - 6: keys 4 and 5 get weight 0.1 in
  // every row; key 3 in row 0 (causal: i' = i - 2) too.
  SafeTensorsFile f = make_case({}, {{"attn.outputs", "out,weights"}, {"attn.causal", "bottom_right"},
                                     {"attn.masked_rows", "zero"}});
  f.put(RawTensor{"seqlens_k", DType::I32, {1}, {4, 0, 0, 0}});
  const auto golden = golden_of(f);
  JobResult r = golden_result(golden);
  change(r, "weights", [](auto, auto, auto i, auto j) { return j >= 4 || (i == 2 && j == 1); },
         [](double) { return 0.1; });
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* fd = find(rep, "masked_weight");
  ASSERT_NE(fd, nullptr) << all(rep);
  EXPECT_EQ(fd->text, "13 masked positions got weight (largest 0.1): masked by seqlens_k (12), causal (bottom_right) (1)")
      << all(rep);
}

TEST(Diagnosis, CausalLeakInWeightsNamesTheRule) {
  const auto golden = golden_of(make_case({}, {{"attn.outputs", "out,weights"}, {"attn.causal", "top_left"}}));
  JobResult r = golden_result(golden);
  // key i + 1 of every row i gets weight 0.1 (the out kept golden)
  change(r, "weights", [](auto, auto, auto i, auto j) { return j == i + 1; }, [](double) { return 0.1; });
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* f = find(rep, "masked_weight");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "5 masked positions got weight (largest 0.1): masked by causal (top_left)") << all(rep);
  EXPECT_EQ(f->elements, 5);
  // the per-row summary: rows 0..4 of weights, one element each
  EXPECT_EQ(rep.diagnosis.failing_rows, 5);
  ASSERT_EQ(rep.diagnosis.rows.size(), 5u);
  EXPECT_EQ(rep.diagnosis.rows[4].tensor, "weights");
  EXPECT_EQ(rep.diagnosis.rows[4].i, 4);
  EXPECT_EQ(rep.diagnosis.rows[4].failed, 1);
}

TEST(Diagnosis, CausalLeakInOutAloneNamesTheRule) {
  const auto golden = golden_of(make_case({1, 1, 1, 6, 6, 4}, {{"attn.outputs", "out"}, {"attn.causal", "bottom_right"}}));
  JobResult r = golden_result(golden);
  // rows 0..4 have keys masked by causal; row 5 sees every key and stays right
  change(r, "out", [](auto, auto, auto i, auto) { return i < 5; }, [](double x) { return x + 0.25; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "masked_rows");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "every failing row (5) has keys masked by causal (bottom_right); the 1 row without such keys passes");
}

TEST(Diagnosis, WindowAndKeyPaddingAreTold) {
  SafeTensorsFile f = make_case({1, 1, 1, 6, 6, 4}, {{"attn.outputs", "out,weights"}, {"attn.window", "1,0"}});
  RawTensor mask{"mask", DType::BOOL, {1, 1, 6, 6}, {}};  // key 5 is padding
  for (int k = 0; k < 36; ++k) mask.data.push_back(k % 6 != 5);
  f.put(std::move(mask));
  const auto golden = golden_of(f);
  JobResult r = golden_result(golden);
  // weight at key 0 for rows 2..4 (outside the window), at key 5 for row 5 (padding)
  change(r, "weights", [](auto, auto, auto i, auto j) { return (i >= 2 && i <= 4 && j == 0) || (i == 5 && j == 5); },
         [](double) { return 0.5; });
  const CaseReport rep = compare(golden, r);
  const Finding* fd = find(rep, "masked_weight");
  ASSERT_NE(fd, nullptr) << all(rep);
  EXPECT_EQ(fd->text, "4 masked positions got weight (largest 0.5): masked by window (1, 0) (3), mask (key padding) (1)");
}

TEST(Diagnosis, WrongKvMappingNamesTheHeads) {
  // Hq 4, Hkv 2: the grouped mapping reads kv heads 0, 0, 1, 1; a tiled one 0, 1, 0, 1 is wrong
  // in heads 1 and 2 only
  const auto golden = golden_of(make_case({1, 4, 2, 5, 7, 4}, {{"attn.outputs", "out"}}));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto, auto h, auto, auto) { return h == 1 || h == 2; }, [](double x) { return x * 0.5 + 0.3; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "some_heads");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures only in query heads 1, 2 of 4 (kv heads, grouped mapping h / 2: 1 -> 0, 2 -> 1); the other heads pass");
  EXPECT_EQ(find(rep, "one_batch"), nullptr);  // one batch only: nothing to say
  // per (batch, head) of out: failed counts 0, 35, 35, 0
  ASSERT_EQ(rep.diagnosis.heads.size(), 4u);
  EXPECT_EQ(rep.diagnosis.heads[0].failed, 0);
  EXPECT_EQ(rep.diagnosis.heads[1].failed, 5 * 4);
  EXPECT_EQ(rep.diagnosis.heads[2].failed, 5 * 4);
  EXPECT_GT(rep.diagnosis.heads[1].worst_ratio, 1);
  EXPECT_LE(rep.diagnosis.heads[3].worst_ratio, 1);
}

TEST(Diagnosis, WholeKvGroupIsNamed) {
  const auto golden = golden_of(make_case({1, 6, 3, 4, 5, 4}, {{"attn.outputs", "out"}}));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto, auto h, auto, auto) { return h == 2 || h == 3; }, [](double x) { return x + 0.5; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "one_kv_group");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures only in the query heads of kv head 1 of 3 (query heads 2, 3)");
}

TEST(Diagnosis, OutOfAnotherHeadIsRecognised) {
  const auto golden = golden_of(make_case({1, 3, 3, 4, 5, 4}, {{"attn.outputs", "out"}}));
  JobResult r = golden_result(golden);
  // head 2's out replaced by head 0's
  RawTensor& out = tensor(r, "out");
  for (std::size_t k = 0; k < 4 * 4; ++k) set(out, 2 * 16 + k, get(out, k));
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "other_head");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "out of 1 failing head matches the reference of another head: head 2 = reference of head 0");
  EXPECT_NE(find(rep, "one_head"), nullptr) << all(rep);
}

TEST(Diagnosis, LseInLog2NamesTheFactor) {
  const auto golden = golden_of(make_case({1, 2, 2, 5, 6, 4}, {{"attn.outputs", "out,lse"}}));
  JobResult r = golden_result(golden);
  change(r, "lse", [](auto...) { return true; }, [](double x) { return x / std::log(2.0); });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "lse_factor");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("lse is the exact value times a constant 1.443 = 1 / ln 2: log2 in place of ln (", 0), 0u)
      << f->text;
  EXPECT_EQ(find(rep, "lse_shift"), nullptr) << all(rep);
}

TEST(Diagnosis, LseShiftedIsAShift) {
  const auto golden = golden_of(make_case({1, 2, 2, 5, 6, 4}, {{"attn.outputs", "out,lse"}}));
  JobResult r = golden_result(golden);
  change(r, "lse", [](auto...) { return true; }, [](double x) { return x + 0.5; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "lse_shift");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "lse is the exact value plus a constant +0.5 (0.5..0.5 over 10 failing elements)");
  EXPECT_EQ(find(rep, "lse_factor"), nullptr) << all(rep);
  const Finding* s = find(rep, "lse_one_sign");
  ASSERT_NE(s, nullptr) << all(rep);
  EXPECT_EQ(s->text, "errors in one direction: 10 of 10 failing lse elements are above the exact values");
}

TEST(Diagnosis, FewElementsGiveNoConstant) {
  const auto golden = golden_of(make_case({1, 1, 1, 5, 6, 4}, {{"attn.outputs", "out,lse"}}));
  JobResult r = golden_result(golden);
  // 3 of 5 lse elements times 2: too few to say it is a constant
  change(r, "lse", [](auto, auto, auto i, auto) { return i < 3; }, [](double x) { return 2 * x; });
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  EXPECT_EQ(find(rep, "lse_factor"), nullptr) << all(rep);
  EXPECT_EQ(find(rep, "lse_shift"), nullptr) << all(rep);
}

TEST(Diagnosis, OneBatchWrong) {
  const auto golden = golden_of(make_case({3, 2, 1, 4, 5, 4}, {{"attn.outputs", "out"}}));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto b, auto, auto, auto) { return b == 1; }, [](double x) { return 1.25 * x; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "one_batch");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures only in batch 1 of 3; the other batches pass");
  const Finding* k = find(rep, "out_factor");
  ASSERT_NE(k, nullptr) << all(rep);
  EXPECT_EQ(k->text.rfind("out is the exact value times a constant 1.25 (", 0), 0u) << k->text;
  EXPECT_EQ(find(rep, "some_heads"), nullptr) << all(rep);  // both heads fail
}

TEST(Diagnosis, BlockedBugShowsPastTheBlock) {
  // causal, 100 queries: row i spans i + 1 keys; rows of more than 64 keys wrong
  const auto golden = golden_of(make_case({1, 1, 1, 100, 100, 4}, {{"attn.outputs", "out"}, {"attn.causal", "top_left"}}));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto, auto, auto i, auto) { return i >= 64 && i % 3 == 0; }, [](double x) { return x + 0.1; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "rows_beyond_keys");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures only in rows of more than 64 keys: the 12 failing rows span 67..100 keys; the 64 rows "
                     "of at most 64 keys pass");
  // 12 failing rows, all listed (fewer than the cap)
  EXPECT_EQ(rep.diagnosis.failing_rows, 12);
  EXPECT_EQ(rep.diagnosis.rows.size(), 12u);
}

TEST(Diagnosis, RowsWhoseMaximumIsPastTheFirstBlock) {
  // 40 keys: the rows whose largest reference weight is at key 16 or later made wrong
  const auto golden = golden_of(make_case({1, 1, 1, 12, 40, 4}, {{"attn.outputs", "out,weights"}}));
  const RawTensor* w = golden.find("weights.ref");
  std::vector<bool> past(12);
  std::int64_t n_past = 0;
  for (std::size_t i = 0; i < 12; ++i) {
    std::size_t at = 0;
    for (std::size_t j = 1; j < 40; ++j)
      if (decode_float(DType::F64, w->data.data() + 8 * (i * 40 + j)) > decode_float(DType::F64, w->data.data() + 8 * (i * 40 + at))) at = j;
    past[i] = at >= 16;
    n_past += past[i];
  }
  ASSERT_GT(n_past, 0);
  ASSERT_LT(n_past, 12);
  JobResult r = golden_result(golden);
  change(r, "out", [&](auto, auto, auto i, auto) { return past[static_cast<std::size_t>(i)]; }, [](double x) { return x + 0.1; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "max_past_block");
  ASSERT_NE(f, nullptr) << all(rep);
  const std::string n = std::to_string(n_past), m = std::to_string(12 - n_past);
  EXPECT_EQ(f->text, "every failing row (" + n + ") has its largest weight past the first 16 keys (" + n + " of the " + n +
                         " such rows fail); the " + m + " rows with it in keys 0..15 pass") << all(rep);
  // one row with its maximum in the first block wrong too: silent
  change(r, "out", [&](auto, auto, auto i, auto) { return i == std::find(past.begin(), past.end(), false) - past.begin(); },
         [](double x) { return x + 0.1; });
  EXPECT_EQ(find(compare(golden, r), "max_past_block"), nullptr);
}

TEST(Diagnosis, RowsListedUpToTheCap) {
  const auto golden = golden_of(make_case({1, 1, 1, 100, 3, 4}, {{"attn.outputs", "out"}}));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto...) { return true; }, [](double x) { return x + 1; });
  const CaseReport rep = compare(golden, r);
  EXPECT_EQ(rep.diagnosis.failing_rows, 100);
  EXPECT_EQ(rep.diagnosis.rows.size(), Diagnosis::kMaxRows);
  const Finding* f = find(rep, "out_shift");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_NE(find(rep, "out_one_sign"), nullptr) << all(rep);
  EXPECT_EQ(find(rep, "rows_beyond_keys"), nullptr) << all(rep);  // every row fails
}

TEST(Diagnosis, ErrorsInTheRowsOfLargestScores) {
  // q's row i scaled by 4^i: the scores grow with i; rows 6 and 7 wrong
  const auto golden = golden_of(make_case({1, 1, 1, 8, 5, 4}, {{"attn.outputs", "out"}}, [](std::int64_t i) { return std::ldexp(1.0, 2 * static_cast<int>(i)); }));
  JobResult r = golden_result(golden);
  change(r, "out", [](auto, auto, auto i, auto) { return i >= 6; }, [](double x) { return x * 1.5 + 0.01; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "large_scores");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("failures only in the rows of largest scores: the 2 failing rows have max |S| ", 0), 0u) << f->text;
  // rows 0 and 7 wrong: not the largest scores
  JobResult r2 = golden_result(golden);
  change(r2, "out", [](auto, auto, auto i, auto) { return i == 0 || i == 7; }, [](double x) { return x + 0.5; });
  EXPECT_EQ(find(compare(golden, r2), "large_scores"), nullptr);
}

TEST(Diagnosis, ReportsCarryTheFindings) {
  const auto golden = golden_of(make_case({}, {{"attn.outputs", "out,weights"}, {"attn.causal", "top_left"}}));
  JobResult r = golden_result(golden);
  change(r, "weights", [](auto, auto, auto i, auto j) { return j == i + 1; }, [](double) { return 0.1; });
  GateReport g;
  g.suite = "s";
  g.cases.push_back(compare(golden, r));
  g.failed = 1;
  const std::string text = text_report(g, false);
  EXPECT_NE(text.find("      finding: 5 masked positions got weight (largest 0.1): masked by causal (top_left)\n"), std::string::npos)
      << text;
  const auto j = nlohmann::json::parse(json_report(g));
  const auto& c = j["cases"][0];
  ASSERT_TRUE(c.contains("diagnosis")) << c.dump(1);
  EXPECT_EQ(c["diagnosis"]["failing_rows"], 5);
  EXPECT_EQ(c["diagnosis"]["rows_listed_at_most"], Diagnosis::kMaxRows);
  EXPECT_EQ(c["diagnosis"]["rows"].size(), 5u);
  EXPECT_EQ(c["diagnosis"]["rows"][0], nlohmann::json({{"tensor", "weights"}, {"batch", 0}, {"head", 0}, {"query", 0},
                                                        {"failed", 1}, {"worst_limit_ratio", c["diagnosis"]["rows"][0]["worst_limit_ratio"]}}));
  EXPECT_GT(c["diagnosis"]["rows"][0]["worst_limit_ratio"].get<double>(), 1);
  EXPECT_EQ(c["diagnosis"]["findings"][0]["name"], "masked_weight");
  EXPECT_EQ(c["diagnosis"]["findings"][0]["elements"], 5);
  for (const auto& t : c["tensors"]) {
    ASSERT_EQ(t["heads"].size(), 1u) << t.dump();
    EXPECT_EQ(t["heads"][0]["failed"], t["tensor"] == "weights" ? 5 : 0);
  }
  EXPECT_NE(junit_report(g).find("finding: 5 masked positions got weight"), std::string::npos);
}

// `attnoracle run` on the NumPy adapter with a planted bug: the report names the pattern.
class DiagnosisRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("attnoracle-diagnosis-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "set" / "cases");
    vectors::Manifest m;
    m.suite = "diag";
    m.generator = "test";
    auto add = [&](const std::string& id, const SafeTensorsFile& f, const std::string& tag) {
      const std::vector<unsigned char> bytes = serialize_safetensors(golden_of(f));
      write_file_atomic((dir_ / "set" / "cases" / (id + ".safetensors")).string(), bytes);
      m.cases.push_back({id, "cases/" + id + ".safetensors", vectors::sha256_hex(bytes), "ok", {tag}});
    };
    add("causal", make_case({1, 2, 2, 6, 6, 4}, {{"attn.outputs", "out,weights"}, {"attn.causal", "top_left"}}), "causal");
    add("gqa", make_case({1, 4, 2, 5, 7, 4}, {{"attn.outputs", "out"}}), "gqa");
    add("long", make_case({1, 1, 1, 12, 40, 4}, {{"attn.outputs", "out,weights"}}), "long");
    testing::write_text(dir_ / "set" / "manifest.json", vectors::manifest_text(m));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  int gate(const std::string& bug, nlohmann::json& report, const std::string& adapter = "numpy", const std::string& extra = "") {
    const fs::path json = dir_ / (bug + ".json");
    const int st = testing::run("run " + (dir_ / "set").string() + " --impl '/usr/bin/python3 " +
                                    std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/" + adapter +
                                    "/attention.py" + extra + " --bug " + bug + "' --json " + json.string(), out_);
    if (fs::exists(json)) report = nlohmann::json::parse(std::ifstream(json));
    return st;
  }
  static const nlohmann::json& case_of(const nlohmann::json& r, const std::string& id) {
    for (const auto& c : r["cases"])
      if (c["id"] == id) return c;
    throw std::runtime_error("no case " + id);
  }
  static fs::path dir_;
  std::string out_;
};
fs::path DiagnosisRun::dir_;

TEST_F(DiagnosisRun, CausalLeak) {
  nlohmann::json r;
  ASSERT_EQ(gate("causal_leak", r), 1) << out_;
  EXPECT_NE(out_.find("FAIL  causal"), std::string::npos) << out_;
  // j <= i + 1: key i + 1 of rows 0..4 in both heads
  EXPECT_NE(out_.find("      finding: 10 masked positions got weight (largest "), std::string::npos) << out_;
  EXPECT_NE(out_.find("): masked by causal (top_left)\n"), std::string::npos) << out_;
  ASSERT_EQ(r["cases"].size(), 3u);
  const auto& c = case_of(r, "causal");
  EXPECT_EQ(c["diagnosis"]["findings"][0]["name"], "masked_weight") << c.dump(1);
}

TEST_F(DiagnosisRun, TiledGqa) {
  nlohmann::json r;
  ASSERT_EQ(gate("gqa_tiled", r), 1) << out_;
  EXPECT_NE(out_.find("      finding: failures only in query heads 1, 2 of 4 (kv heads, grouped mapping h / 2: 1 -> 0, 2 -> 1)"),
            std::string::npos) << out_;
  const auto& c = case_of(r, "gqa");
  ASSERT_EQ(c["status"], "fail");
  ASSERT_EQ(c["tensors"][0]["heads"].size(), 4u);
  EXPECT_EQ(c["tensors"][0]["heads"][0]["failed"], 0);
  EXPECT_GT(c["tensors"][0]["heads"][1]["failed"].get<int>(), 0);
}

TEST_F(DiagnosisRun, CheckReportsTheFindingsToo) {
  // results made offline: the golden values with key i + 1 of every row i given weight 0.1
  const fs::path results = dir_ / "results";
  fs::create_directories(results);
  const SafeTensorsFile golden = read_safetensors((dir_ / "set" / "cases" / "causal.safetensors").string());
  JobResult r = golden_result(golden);
  change(r, "weights", [](auto, auto, auto i, auto j) { return j == i + 1; }, [](double) { return 0.1; });
  write_file_atomic((results / "causal.safetensors").string(), serialize_safetensors(r.output));
  const fs::path json = dir_ / "check.json";
  ASSERT_EQ(testing::run("check " + (dir_ / "set").string() + " --results " + results.string() + " --case causal --json " +
                             json.string(), out_), 1) << out_;
  EXPECT_NE(out_.find("      finding: 10 masked positions got weight (largest 0.1): masked by causal (top_left)\n"),
            std::string::npos) << out_;
  const auto rep = nlohmann::json::parse(std::ifstream(json));
  const auto& c = case_of(rep, "causal");
  EXPECT_EQ(c["diagnosis"]["failing_rows"], 10) << c.dump(1);  // rows 0..4 of both heads
  EXPECT_EQ(c["diagnosis"]["findings"][0]["text"], "10 masked positions got weight (largest 0.1): masked by causal (top_left)");
}

TEST_F(DiagnosisRun, FlashKernelWithoutRescaling) {
  nlohmann::json r;
  ASSERT_EQ(gate("no_rescale", r, "flash_numpy", " --block 16"), 1) << out_;
  EXPECT_NE(out_.find("FAIL  long"), std::string::npos) << out_;
  EXPECT_NE(out_.find("      finding: every failing row ("), std::string::npos) << out_;
  EXPECT_NE(out_.find(") has its largest weight past the first 16 keys ("), std::string::npos) << out_;
  EXPECT_EQ(case_of(r, "long")["diagnosis"]["findings"][0]["name"], "max_past_block") << case_of(r, "long").dump(1);
}

}  // namespace
}  // namespace attnoracle::conformance
