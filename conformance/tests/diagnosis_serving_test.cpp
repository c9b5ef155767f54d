// The findings of the serving kernels' cases (CONTRACT section 8): results made by hand from the
// golden values of paged and split-KV cases, each with one planted pattern, and the serving
// kernels' planted bugs on the committed sample through `attnoracle run`.
#include <gtest/gtest.h>
#include <unistd.h>

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
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/manifest.hpp"

namespace attnoracle::conformance {
namespace {

namespace fs = std::filesystem;
using testing::get;
using testing::golden_of;
using testing::set;
using testing::tensor;
using testing::all;
using testing::change;
using testing::compare;
using testing::find;

RawTensor f32(const char* name, std::vector<std::int64_t> shape, float seed) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  RawTensor t{name, DType::F32, std::move(shape), std::vector<unsigned char>(static_cast<std::size_t>(n) * 4)};
  for (std::int64_t e = 0; e < n; ++e) {
    const float v = std::sin(seed * static_cast<float>(e + 1));
    std::memcpy(t.data.data() + 4 * e, &v, 4);
  }
  return t;
}
RawTensor i32(const char* name, std::vector<std::int64_t> shape, const std::vector<std::int32_t>& v) {
  RawTensor t{name, DType::I32, std::move(shape), std::vector<unsigned char>(v.size() * 4)};
  std::memcpy(t.data.data(), v.data(), v.size() * 4);
  return t;
}

// A paged F32 case: page size 4, D 4, one head, Nq queries per batch row (bottom-right causal
// when `causal`), block table `table` [B, 2] over 6 pages, lengths `seqlens`.
SafeTensorsFile paged_case(std::int64_t Nq, const std::vector<std::int32_t>& table, const std::vector<std::int32_t>& seqlens,
                           bool causal, const std::string& outputs = "out,lse") {
  const auto B = static_cast<std::int64_t>(seqlens.size());
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", outputs}};
  if (causal) f.metadata["attn.causal"] = "bottom_right";
  f.put(f32("q", {B, 1, Nq, 4}, 1.7f));
  f.put(f32("k_cache", {6, 4, 1, 4}, 0.9f));
  f.put(f32("v_cache", {6, 4, 1, 4}, 2.3f));
  f.put(i32("block_table", {B, 2}, table));
  f.put(i32("seqlens_k", {B}, seqlens));
  return f;
}

TEST(DiagnosisPaged, PartlyFilledLastPage) {
  // batch 0: pages 3, 0 full; batch 1: pages 5, 1 with 2 of 4 slots used; batch 2: page 2 alone
  const auto golden = golden_of(paged_case(2, {3, 0, 5, 1, 2, 4}, {8, 6, 4}, false));
  JobResult r = testing::golden_result(golden, {"out", "lse"});
  change(r, "out", [](auto b, auto...) { return b == 1; }, [](double x) { return x + 0.25; });
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* f = find(rep, "paged_partial_last_page");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures only in rows that read the partly filled last page of their block table: batch 1 entry 1 -> page 1 "
                     "(2 of 4 slots used) (2 of the 2 rows reading such a page fail; the 4 other rows pass): check the page a row's "
                     "last key reads and the slot count there (seqlens_k mod 4)")
      << f->text;
  // the same rows passing: nothing about pages
  EXPECT_TRUE(compare(golden, testing::golden_result(golden, {"out", "lse"})).diagnosis.findings.empty());
  // batch 0 failing too (full pages): not the partial page
  change(r, "out", [](auto b, auto...) { return b == 0; }, [](double x) { return x + 0.25; });
  const CaseReport rep2 = compare(golden, r);
  EXPECT_EQ(find(rep2, "paged_partial_last_page"), nullptr) << all(rep2);
}

TEST(DiagnosisPaged, PageSharedBetweenBatchRows) {
  // page 3: batch 0 entry 0 and batch 2 entry 1. Bottom-right causal, 6 queries: batch 0 and 2
  // (8 keys) give query i keys 0..i + 2, so queries 2..5 of batch 2 reach entry 1.
  const auto golden = golden_of(paged_case(6, {3, 0, 5, 1, 2, 3}, {8, 6, 8}, true));
  JobResult r = testing::golden_result(golden, {"out", "lse"});
  change(r, "out", [](auto b, auto, auto i, auto) { return b == 0 || (b == 2 && i >= 2); }, [](double x) { return x - 0.5; });
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* f = find(rep, "paged_shared_page");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("failures only in rows that read a page shared between block-table entries: page 3 (batch 0 entry 0; "
                          "batch 2 entry 1, its last) (10 of the 10 rows reading one fail; the 8 other rows pass)", 0),
            0u) << f->text;
  // one query of batch 2 that reads page 3 passes: still most of them fail
  change(r, "out", [](auto b, auto, auto i, auto) { return b == 2 && i == 5; }, [](double x) { return x + 0.5; });
  EXPECT_NE(find(compare(golden, r), "paged_shared_page"), nullptr);
  // a row that does not read page 3 fails: silent
  change(r, "out", [](auto b, auto, auto i, auto) { return b == 1 && i == 0; }, [](double x) { return x + 0.5; });
  const CaseReport rep3 = compare(golden, r);
  EXPECT_EQ(find(rep3, "paged_shared_page"), nullptr) << all(rep3);
  EXPECT_EQ(find(rep3, "paged_page"), nullptr) << all(rep3);
}

TEST(DiagnosisPaged, WeightsAtTheFirstSlotOfAPage) {
  const auto golden = golden_of(paged_case(2, {3, 0, 5, 1, 2, 4}, {8, 6, 4}, false, "out,weights"));
  JobResult r = testing::golden_result(golden, {"out", "weights"});
  change(r, "weights", [](auto b, auto, auto, auto j) { return b < 2 && j == 4; }, [](double x) { return x + 0.2; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "paged_slot_first");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("the 4 failing weights lie at slot 0 of a page past the first (batch 0 entry 1 -> page 0 (key 4), "
                          "batch 1 entry 1 -> page 1 (key 4))", 0),
            0u) << f->text;
  // key 5 too: not one slot
  change(r, "weights", [](auto b, auto, auto, auto j) { return b == 0 && j == 5; }, [](double x) { return x + 0.2; });
  EXPECT_EQ(find(compare(golden, r), "paged_slot_first"), nullptr);
}

// A contiguous F32 case of 12 queries and keys, top-left causal, splits of 4 keys with the
// partial states: split 2 (keys 8..11) is empty for queries 0..7, split 1 for queries 0..3.
SafeTensorsFile split_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,lse,out_partial,lse_partial"}, {"attn.causal", "top_left"},
                {"attn.kv_split_size", "4"}};
  f.put(f32("q", {1, 2, 12, 4}, 1.7f));
  f.put(f32("k", {1, 2, 12, 4}, 0.9f));
  f.put(f32("v", {1, 2, 12, 4}, 2.3f));
  return f;
}
// Element (s, b, h, i[, e]) of the partials [S, B, H, Nq(, Dv)] with B = 1, H = 2, Nq = 12, Dv = 4.
void change_partial(JobResult& r, const char* name, const std::function<bool(std::int64_t, std::int64_t, std::int64_t)>& where,
                    double value) {
  RawTensor& t = tensor(r, name);
  const std::int64_t w = t.shape.size() == 5 ? t.shape[4] : 1;
  for (std::size_t k = 0; k < t.data.size() / 4; ++k) {
    const auto n = static_cast<std::int64_t>(k) / w;
    if (where(n / 24, n / 12 % 2, n % 12)) set(t, k, value);
  }
}

TEST(DiagnosisSplit, OneSplitNamedWithItsKeys) {
  const auto golden = golden_of(split_case());
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  change_partial(r, "out_partial", [](auto s, auto, auto i) { return s == 1 && i >= 4; }, 3.0);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail) << all(rep);
  const Finding* f = find(rep, "one_split");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures in the partial states only in split 1 (keys 4..7) of 3 splits; the other splits pass");
  EXPECT_EQ(find(rep, "split_empty_partials"), nullptr) << all(rep);
}

TEST(DiagnosisSplit, NanLseInEmptySplits) {
  const auto golden = golden_of(split_case());
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  // split 2 of queries 0..7 and split 1 of queries 0..3: 2 heads x 12 pairs
  change_partial(r, "lse_partial", [](auto s, auto, auto i) { return (s == 2 && i < 8) || (s == 1 && i < 4); }, NAN);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* f = find(rep, "split_empty_lse");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("lse_partial is NaN, not -inf, in 24 of the 24 (split, row) pairs without an allowed key (split 1 (keys 4..7) "
                          "of batch 0 head 0 query 0, split 1 (keys 4..7) of batch 0 head 0 query 1): a split with no key must give",
                          0),
            0u) << f->text;
  EXPECT_EQ(f->elements, 24);
}

TEST(DiagnosisSplit, NanOutPartialInEmptySplits) {
  const auto golden = golden_of(split_case());
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  change_partial(r, "out_partial", [](auto s, auto, auto i) { return (s == 2 && i < 8) || (s == 1 && i < 4); }, NAN);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* f = find(rep, "split_empty_partials");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text, "failures in the partial states only where the split has no allowed key of the row (split 1 (keys 4..7) of "
                     "batch 0 head 0 query 0) (24 of the 24 such (split, row) pairs fail; the 48 other pairs pass): such a split must "
                     "give O_s = 0 and lse_s = -inf (no exp(-inf - -inf), no 0 / 0)");
  // split 2 alone: 16 of the 24 pairs, too few to say it
  JobResult r2 = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  change_partial(r2, "out_partial", [](auto s, auto, auto i) { return s == 2 && i < 8; }, NAN);
  EXPECT_EQ(find(compare(golden, r2), "split_empty_partials"), nullptr);
  // a pair with keys fails too: silent
  change_partial(r, "out_partial", [](auto s, auto h, auto i) { return s == 0 && h == 1 && i == 11; }, 5.0);
  EXPECT_EQ(find(compare(golden, r), "split_empty_partials"), nullptr);
}

TEST(DiagnosisSplit, SplitReadingTheNextKey) {
  // each split's partials wrong where the row allows the key after it (query i >= 4 (s + 1))
  const auto golden = golden_of(split_case());
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  change_partial(r, "lse_partial", [](auto s, auto, auto i) { return i >= 4 * (s + 1); }, 9.0);
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "split_next_key");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("failures in the partial states only where the row allows the key just past the split (key 4 for split 0, "
                          "key 8 for split 1, ...) (24 of the 24 such (split, row) pairs fail; the 48 other pairs pass)", 0),
            0u) << f->text;
}

TEST(DiagnosisSplit, OutFailingInRowsWithAnEmptySplit) {
  const auto golden = golden_of(split_case());
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  change(r, "out", [](auto, auto, auto i, auto) { return i < 8; }, [](double x) { return x + 0.5; });
  const CaseReport rep = compare(golden, r);
  const Finding* f = find(rep, "split_empty_rows");
  ASSERT_NE(f, nullptr) << all(rep);
  EXPECT_EQ(f->text.rfind("failures only in rows with an empty split, one without an allowed key of the row (batch 0 head 0 query 0: "
                          "split 1 (keys 4..7), split 2 (keys 8..11)) (16 of the 16 rows with one fail; the 8 other rows pass)", 0),
            0u) << f->text;
}

TEST(DiagnosisSplit, LseWithoutTheSink) {
  SafeTensorsFile f = split_case();
  f.put(f32("sinks", {2}, 0.4f));
  const auto golden = golden_of(f);
  JobResult r = testing::golden_result(golden, {"out", "lse", "out_partial", "lse_partial"});
  // lse of queries 6..11 of head 1: log sum exp of the exact lse_s, the sink left out
  const RawTensor& ref = *golden.find("lse_partial.ref");
  change(r, "lse", [](auto, auto h, auto i, auto) { return h == 1 && i >= 6; }, [](double) { return 0.0; });
  RawTensor& lse = tensor(r, "lse");
  for (std::size_t k = 18; k < 24; ++k) {
    double sum = 0;
    for (std::size_t s = 0; s < 3; ++s) {
      double x;
      std::memcpy(&x, ref.data.data() + 8 * (s * 24 + k), 8);
      sum += std::exp(x);
    }
    set(lse, k, std::log(sum));
  }
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  const Finding* fd = find(rep, "lse_without_sink");
  ASSERT_NE(fd, nullptr) << all(rep);
  EXPECT_EQ(fd->text.rfind("lse of the 6 failing rows are the merge of the splits without the sink", 0), 0u) << fd->text;
  // lse off by another amount: silent
  change(r, "lse", [](auto, auto h, auto i, auto) { return h == 1 && i == 11; }, [](double x) { return x + 0.1; });
  EXPECT_EQ(find(compare(golden, r), "lse_without_sink"), nullptr);
}

// `attnoracle run` on the serving kernels with planted bugs over cases of the committed sample.
class DiagnosisServingRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("attnoracle-diagnosis-serving-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "set" / "cases");
    vectors::Manifest m;
    m.suite = "serving-sample";
    m.generator = "test";
    for (const char* id : {"page_sizes-005", "merge_inf-003", "merge_sinks-000", "split_paged-001"}) {
      const fs::path from = fs::path(ATTNORACLE_SOURCE_DIR) / "vectors" / "serving" / "sample" / (std::string(id) + ".safetensors");
      const std::vector<unsigned char> bytes = read_regular_file(from.string());
      write_file_atomic((dir_ / "set" / "cases" / (std::string(id) + ".safetensors")).string(), bytes);
      m.cases.push_back({id, "cases/" + std::string(id) + ".safetensors", vectors::sha256_hex(bytes), "ok", {"serving"}});
    }
    testing::write_text(dir_ / "set" / "manifest.json", vectors::manifest_text(m));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  // The finding `name` of case `id` with kernel bug `bug`, its text ("" when absent).
  std::string finding(const std::string& bug, const std::string& id, const std::string& name) {
    const fs::path json = dir_ / (bug + ".json");
    const int st = testing::run("run " + (dir_ / "set").string() + " --case " + id + " --profile flash --impl '/usr/bin/python3 " +
                                    std::string(ATTNORACLE_SOURCE_DIR) +
                                    "/conformance/adapters/serving_numpy/attention.py --structure splitkv --split 64 --chunk 16 "
                                    "--partials f32 --arith input --bug " + bug + "' --json " + json.string(),
                                out_);
    EXPECT_EQ(st, 1) << out_;
    const auto r = nlohmann::json::parse(std::ifstream(json));
    for (const auto& c : r["cases"])
      if (c["id"] == id && c.contains("diagnosis"))
        for (const auto& f : c["diagnosis"]["findings"])
          if (f["name"] == name) return f["text"];
    return "";
  }
  static fs::path dir_;
  std::string out_;
};
fs::path DiagnosisServingRun::dir_;

TEST_F(DiagnosisServingRun, LastPageWrongNamesThePages) {
  const std::string t = finding("last_page_wrong", "page_sizes-005", "paged_partial_last_page");
  EXPECT_EQ(t.rfind("failures only in rows that read the partly filled last page of a block table of several pages: "
                    "batch 2 entry 1 -> page 0 (1 of 16 slots used), batch 3 entry 1 -> page 0 (9 of 16 slots used)", 0),
            0u) << t << "\n" << out_;
  EXPECT_NE(out_.find("      finding: failures only in rows that read the partly filled last page"), std::string::npos) << out_;
}

TEST_F(DiagnosisServingRun, SplitOffByOneNamesTheNextKey) {
  const std::string t = finding("split_off_by_one", "split_paged-001", "split_next_key");
  EXPECT_EQ(t.rfind("failures in the partial states only where the row allows the key just past the split (key 256 for split 0", 0), 0u)
      << t << "\n" << out_;
}

TEST_F(DiagnosisServingRun, MergeNanOnNegInfNamesTheEmptySplits) {
  const std::string t = finding("merge_nan_on_neginf", "merge_inf-003", "merge_neginf_split");
  EXPECT_EQ(t.rfind("failures only in rows with an empty split (lse_s -inf)", 0), 0u) << t << "\n" << out_;
}

TEST_F(DiagnosisServingRun, MergeIgnoringTheSink) {
  const std::string t = finding("merge_ignores_sink", "merge_sinks-000", "lse_without_sink");
  EXPECT_EQ(t.rfind("lse of the 144 failing rows are the merge of the splits without the sink", 0), 0u) << t << "\n" << out_;
}

}  // namespace
}  // namespace attnoracle::conformance
