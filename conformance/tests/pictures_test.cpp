// The data of the HTML report's pictures, worked by hand: golden results with planted errors at
// known elements, compared with pictures asked for.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::conformance {
namespace {

// An F32 case [B, H, N, 4] of pseudo-random inputs, golden tensors included.
SafeTensorsFile golden_case(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t Nq, std::int64_t Nk,
                            std::map<std::string, std::string> meta) {
  SafeTensorsFile f;
  f.metadata = std::move(meta);
  f.metadata["attn.format"] = "1";
  auto put = [&](const char* name, std::int64_t H, std::int64_t N, float seed) {
    RawTensor t{name, DType::F32, {B, H, N, 4}, {}};
    const std::int64_t n = B * H * N * 4;
    t.data.resize(static_cast<std::size_t>(n) * 4);
    for (std::int64_t e = 0; e < n; ++e) {
      const float v = std::sin(seed * static_cast<float>(e + 1));
      std::memcpy(t.data.data() + 4 * e, &v, 4);
    }
    f.put(std::move(t));
  };
  put("q", Hq, Nq, 1.7f);
  put("k", Hkv, Nk, 0.9f);
  put("v", Hkv, Nk, 2.3f);
  const Case c = case_from_file("c", f);
  return golden_file(c, evaluate(c, {}));
}

JobResult golden_result(const SafeTensorsFile& golden) {
  JobResult r;
  r.outcome = Outcome::Output;
  for (const char* name : {"out", "weights", "lse"})
    if (const RawTensor* t = golden.find(name)) r.output.put(*t);
  return r;
}

// Multiplies element k of result tensor `name` by f.
void scale(JobResult& r, const char* name, std::size_t k, float f) {
  for (auto& t : r.output.tensors)
    if (t.name == name) {
      float x;
      std::memcpy(&x, t.data.data() + 4 * k, 4);
      x *= f;
      std::memcpy(t.data.data() + 4 * k, &x, 4);
    }
}

CaseReport compare(const SafeTensorsFile& golden, const JobResult& r, bool pictures = true) {
  return compare_case("c", golden, "ok", r, builtin_profile("fp32"), pictures);
}

const ErrorMap* map_of(const Pictures& p, const std::string& tensor, std::int64_t h) {
  for (const auto& m : p.maps)
    if (m.tensor == tensor && m.h == h) return &m;
  return nullptr;
}

// A map's means: each cell's sum of ratios over its elements (every row and column whose cell it
// is), where the cells keep the largest.
TEST(Pictures, MeansAverageOverTheCellsElements) {
  const auto golden = golden_case(1, 1, 1, 200, 6, {{"attn.outputs", "out,weights"}});
  JobResult r = golden_result(golden);
  // 200 queries in 128 cell rows: cell 96 holds queries 150 and 151 (ceil(96 * 200 / 128) = 150,
  // ceil(97 * 200 / 128) = 152), cell 95 query 149 alone
  scale(r, "weights", 151 * 6 + 5, 1.5f);
  scale(r, "weights", 149 * 6 + 0, 1.5f);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail) << rep.reason;
  const ErrorMap* m = map_of(rep.pictures, "weights", 0);
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->means.size(), m->cells.size());
  const std::size_t two = 96 * 6 + 5, one = 95 * 6 + 0;
  EXPECT_GT(m->cells[two], 1);
  EXPECT_FLOAT_EQ(m->means[two], m->cells[two] / 2);  // the other element of the cell is golden
  EXPECT_GT(m->cells[one], 1);
  EXPECT_FLOAT_EQ(m->means[one], m->cells[one]);
  for (std::size_t k = 0; k < m->cells.size(); ++k)
    if (k != two && k != one) {
      EXPECT_EQ(m->cells[k], 0) << k;
      EXPECT_EQ(m->means[k], 0) << k;
    }
}

TEST(Pictures, AWeightLandsInItsCellOfItsHead) {
  // GQA: 4 query heads on 2 kv heads; 200 queries are more than 128 cells
  const auto golden = golden_case(1, 4, 2, 200, 6, {{"attn.outputs", "out,weights,lse"}});
  JobResult r = golden_result(golden);
  // weights[0, 3, 151, 5]: flat ((0 * 4 + 3) * 200 + 151) * 6 + 5
  scale(r, "weights", static_cast<std::size_t>((3 * 200 + 151) * 6 + 5), 1.5f);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail) << rep.reason;
  ASSERT_TRUE(rep.worst);
  ASSERT_EQ(rep.worst->index, (std::vector<std::int64_t>{0, 3, 151, 5}));
  const Pictures& p = rep.pictures;
  ASSERT_EQ(p.maps.size(), 8u);  // out and weights, 4 heads each
  const ErrorMap* m = map_of(p, "weights", 3);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->kv, 1);  // heads 2 and 3 read kv head 1
  EXPECT_EQ(map_of(p, "weights", 1)->kv, 0);
  EXPECT_EQ(m->rows, 200);
  EXPECT_EQ(m->cols, 6);
  ASSERT_EQ(m->cell_rows, 128);
  ASSERT_EQ(m->cell_cols, 6);
  // query 151 in cell row floor(151 * 128 / 200) = 96
  const auto at = static_cast<std::size_t>(96 * 6 + 5);
  EXPECT_FLOAT_EQ(m->cells[at], static_cast<float>(rep.worst->limit_ratio));
  EXPECT_FLOAT_EQ(static_cast<float>(m->worst), static_cast<float>(rep.worst->limit_ratio));
  for (std::size_t k = 0; k < m->cells.size(); ++k)
    if (k != at) {
      EXPECT_LE(m->cells[k], 1) << k;
    }
  for (const auto& other : p.maps)
    if (&other != m) {
      EXPECT_LE(other.worst, 1) << other.tensor << " head " << other.h;
    }
  // rows: every row of every head; row (3, 151) fails with the worst ratio, with all 6 keys
  for (const auto& s : p.rows) {
    EXPECT_EQ(s.rows, 4 * 200) << s.tensor;
    EXPECT_EQ(s.points.size(), 4u * 200) << s.tensor;
    for (const auto& pt : s.points) {
      EXPECT_EQ(pt.keys, 6);
      EXPECT_GT(pt.score_abs, 0);
      if (s.tensor == "weights" && pt.h == 3 && pt.i == 151) {
        EXPECT_DOUBLE_EQ(pt.ratio, static_cast<float>(rep.worst->limit_ratio));
      } else if (s.tensor == "weights") {
        EXPECT_LE(pt.ratio, 1);
      }
    }
  }
  // histograms: every compared element once; one weight beyond the limit, in the bin of its ratio
  ASSERT_EQ(p.histograms.size(), 3u);
  for (const auto& h : p.histograms) {
    std::int64_t n = h.zero + h.below + h.above + h.infinite, beyond = h.above + h.infinite;
    for (std::size_t k = 0; k < h.bins.size(); ++k) {
      n += h.bins[k];
      if (static_cast<int>(k) + Histogram::kLog2From >= 0) beyond += h.bins[k];
    }
    for (const auto& t : rep.tensors)
      if (t.tensor == h.tensor) {
        EXPECT_EQ(n, t.compared) << h.tensor;
        EXPECT_EQ(beyond, t.over_limit) << h.tensor;
      }
  }
  const Histogram& hw = p.histograms[1];
  ASSERT_EQ(hw.tensor, "weights");
  const int e = std::ilogb(rep.worst->limit_ratio);
  EXPECT_EQ(hw.bins[static_cast<std::size_t>(e - Histogram::kLog2From)], 1);
}

TEST(Pictures, AtMostSixteenHeadsKeepingTheWorst) {
  // 18 query heads on one kv head, errors in heads 2 and 17 only
  const auto golden = golden_case(1, 18, 1, 5, 7, {{"attn.outputs", "out"}, {"attn.causal", "bottom_right"}});
  JobResult r = golden_result(golden);
  scale(r, "out", static_cast<std::size_t>((2 * 5 + 1) * 4 + 0), 1.01f);
  scale(r, "out", static_cast<std::size_t>((17 * 5 + 4) * 4 + 3), 1.01f);
  const CaseReport rep = compare(golden, r);
  ASSERT_EQ(rep.status, CaseStatus::Fail) << rep.reason;
  const Pictures& p = rep.pictures;
  ASSERT_EQ(p.maps.size(), Pictures::kMaxMaps);
  ASSERT_NE(map_of(p, "out", 2), nullptr);
  ASSERT_NE(map_of(p, "out", 17), nullptr);
  for (std::size_t k = 1; k < p.maps.size(); ++k) EXPECT_LT(p.maps[k - 1].h, p.maps[k].h);  // in head order
  EXPECT_GT(map_of(p, "out", 2)->cells[1 * 4 + 0], 1);
  EXPECT_GT(map_of(p, "out", 17)->cells[4 * 4 + 3], 1);
  // causal bottom right with Nq = 5, Nk = 7: query i has i + 3 keys
  ASSERT_EQ(p.rows.size(), 1u);  // out only
  for (const auto& pt : p.rows[0].points) EXPECT_EQ(pt.keys, pt.i + 3);
}

TEST(Pictures, OnlyForAFailingCaseWhenAsked) {
  const auto golden = golden_case(1, 2, 2, 4, 4, {{"attn.outputs", "out,weights"}});
  EXPECT_TRUE(compare(golden, golden_result(golden)).pictures.empty());
  JobResult r = golden_result(golden);
  scale(r, "out", 3, 2.0f);
  const CaseReport without = compare(golden, r, false);
  ASSERT_EQ(without.status, CaseStatus::Fail);
  EXPECT_TRUE(without.pictures.empty());
  EXPECT_FALSE(compare(golden, r).pictures.empty());
}

}  // namespace
}  // namespace attnoracle::conformance
