// The oracle passes the reference, and each invariant catches a deliberately broken evaluation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>

#include "attnoracle/oracle/oracle.hpp"
#include "../src/detail.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::oracle;

RawTensor floats(const std::string& name, std::vector<std::int64_t> shape, const std::vector<double>& v) {
  RawTensor r{name, DType::F64, std::move(shape), {}};
  r.data.resize(v.size() * 8);
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(DType::F64, v[i], r.data.data() + 8 * i);
  return r;
}
RawTensor bools(const std::string& name, std::vector<std::int64_t> shape, const std::vector<int>& v) {
  RawTensor r{name, DType::BOOL, std::move(shape), {}};
  for (int x : v) r.data.push_back(x ? 1 : 0);
  return r;
}
RawTensor lengths(const std::string& name, std::int64_t n) {  // [B = 1], I64
  RawTensor r{name, DType::I64, {1}, std::vector<unsigned char>(8)};
  std::memcpy(r.data.data(), &n, 8);
  return r;
}
std::vector<double> ramp(std::size_t n, double a, double b) {  // deterministic, no two equal
  std::vector<double> v(n);
  for (std::size_t k = 0; k < n; ++k) v[k] = std::ldexp(std::round(std::ldexp(std::sin(a * static_cast<double>(k) + b), 10)), -10);
  return v;
}

Case make(std::vector<RawTensor> t, std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  f.metadata["attn.format"] = "1";
  for (auto& x : t) f.put(std::move(x));
  return case_from_file("test.safetensors", f);
}

// sdpa: B=1, Hq=4, Hkv=2, Nq=5, Nk=6, Dk=3, Dv=2, with values in [1, 2].
Case sdpa(std::map<std::string, std::string> md = {}, std::vector<RawTensor> extra = {}) {
  std::vector<double> v = ramp(2 * 6 * 2, 0.7, 0.1);
  for (double& x : v) x = 1.5 + 0.5 * x;
  std::vector<RawTensor> t = {floats("q", {1, 4, 5, 3}, ramp(60, 0.37, 0.2)),
                              floats("k", {1, 2, 6, 3}, ramp(36, 0.91, 1.1)),
                              floats("v", {1, 2, 6, 2}, v)};
  for (auto& e : extra) t.push_back(std::move(e));
  return make(std::move(t), md);
}

Case mha() {
  return make({floats("x_q", {1, 4, 3}, ramp(12, 0.4, 0.3)), floats("x_kv", {1, 4, 3}, ramp(12, 0.8, 0.5)),
               floats("w_q", {2, 3, 2}, ramp(12, 1.3, 0.2)), floats("w_k", {2, 3, 2}, ramp(12, 0.6, 0.9)),
               floats("w_v", {2, 3, 2}, ramp(12, 0.5, 0.4)), floats("w_o", {4, 3}, ramp(12, 0.2, 0.7))},
              {{"attn.kind", "mha"}, {"attn.causal", "top_left"}});
}

// A broken evaluation: f gets the case, a reference evaluator of it and the unit.
using BrokenFn = std::function<RowEnclosures(const Case&, RowEvaluator&, std::int64_t, std::int64_t,
                                             std::int64_t)>;
class Broken : public RowSource {
 public:
  Broken(const Case& c, BrokenFn f) : c_(c), ev_(c), f_(std::move(f)) {}
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i) override { return f_(c_, ev_, b, h, i); }

 private:
  const Case& c_;
  RowEvaluator ev_;
  BrokenFn f_;
};
RowSourceFactory broken(BrokenFn f) {
  return [f](const Case& c) { return std::make_unique<Broken>(c, f); };
}

// Evaluates a modified copy of the case (a broken implementation's reading of it).
RowEnclosures eval_modified(const Case& c, const std::function<void(Case&)>& change, std::int64_t b,
                            std::int64_t h, std::int64_t i) {
  Case m = c;
  change(m);
  return RowEvaluator(m).row(b, h, i, 128);
}

void scale_enclosure(Enclosure& e, double f) {
  mpfr_mul_d(e.lo, e.lo, f, MPFR_RNDD);
  mpfr_mul_d(e.hi, e.hi, f, MPFR_RNDU);
}

bool names(const std::vector<Violation>& v, Invariant inv) {
  for (const auto& x : v)
    if (x.invariant == inv) return true;
  return false;
}
std::string list(const std::vector<Violation>& v) {
  std::string s;
  for (const auto& x : v) s += x.message() + "\n";
  return s.empty() ? "(none)" : s;
}

TEST(Oracle, ReferencePassesEveryInvariant) {
  std::vector<Case> cases;
  cases.push_back(sdpa());
  cases.push_back(sdpa({{"attn.causal", "bottom_right"}, {"attn.softcap", "2.5"}}));
  cases.push_back(sdpa({{"attn.causal", "top_left"}, {"attn.window", "2,0"}, {"attn.masked_rows", "zero"}}));
  cases.push_back(sdpa({{"attn.masked_rows", "zero"}},
                       {bools("mask", {5, 6}, {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0,
                                               0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1}),
                        floats("bias", {6}, {0, 0.5, -INFINITY, 1, 0, -2})}));
  cases.push_back(mha());
  // sequence lengths: 3 queries and 4 keys of 5 and 6, bottom_right aligned to 4 - 3
  cases.push_back(sdpa({{"attn.causal", "bottom_right"}}, {lengths("seqlens_q", 3), lengths("seqlens_k", 4)}));
  cases.push_back(sdpa({{"attn.window", "1,1"}}, {lengths("seqlens_k", 2)}));
  for (const Case& c : cases) {
    const auto v = check_case(c, reference_rows(), {});
    EXPECT_TRUE(v.empty()) << list(v);
  }
}

TEST(Oracle, RowSumCatchesUnnormalisedWeights) {
  auto v = check_case(sdpa(), broken([](const Case&, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        for (auto& e : r.weights[0]) scale_enclosure(e, 1.01);
                        return r;
                      }));
  EXPECT_TRUE(names(v, Invariant::RowSum)) << list(v);
}

TEST(Oracle, WeightRangeCatchesANegativeWeight) {
  auto v = check_case(sdpa(), broken([](const Case&, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        scale_enclosure(r.weights[0][0], -1);
                        mpfr_swap(r.weights[0][0].lo, r.weights[0][0].hi);
                        return r;
                      }));
  EXPECT_TRUE(names(v, Invariant::WeightRange)) << list(v);
}

TEST(Oracle, MaskedZeroCatchesAnIgnoredMask) {
  std::vector<int> pattern;
  for (int r = 0; r < 5; ++r) pattern.insert(pattern.end(), {1, 0, 1, 1, 0, 1});
  Case c = sdpa({}, {bools("mask", {5, 6}, pattern)});
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator&, auto b, auto h, auto i) {
                        return eval_modified(cs, [](Case& m) { m.mask.reset(); }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::MaskedZero)) << list(v);
}

TEST(Oracle, ConvexHullCatchesAnOutputOutsideTheValues) {
  auto v = check_case(sdpa(), broken([](const Case&, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        for (auto& e : r.heads[0].raw_out) scale_enclosure(e, 2);  // values in [1, 2]
                        return r;
                      }));
  EXPECT_TRUE(names(v, Invariant::ConvexHull)) << list(v);
}

TEST(Oracle, ViolationsGiveTheirValuesInHexToo) {
  auto v = check_case(sdpa(), broken([](const Case&, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        for (auto& e : r.heads[0].raw_out) scale_enclosure(e, 2);
                        return r;
                      }));
  ASSERT_FALSE(v.empty());
  // "[lo, hi] (hex [lo, hi])": each value twice, the hex one exact
  const std::regex pair(R"(\[([^,\]]+), ([^\]]+)\] \(hex \[(0x[^,]+), (0x[^\]]+)\]\))");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(v.front().detail, m, pair)) << v.front().detail;
  for (int k : {1, 2}) {
    const double dec = std::strtod(m[k].str().c_str(), nullptr);
    const double hex = std::strtod(m[k + 2].str().c_str(), nullptr);
    EXPECT_LE(std::fabs(dec - hex), 1e-15 * std::fabs(hex)) << v.front().detail;
  }
}

TEST(Oracle, EqualScoresCatchesTwoEqualKeysWeightedDifferently) {
  Case c = sdpa();
  for (std::int64_t d = 0; d < c.Dk; ++d) c.k.values[static_cast<std::size_t>(3 + d)] = c.k.values[static_cast<std::size_t>(d)];  // keys 0 and 1 equal
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator&, auto b, auto h, auto i) {
                        return eval_modified(cs, [](Case& m) {
                          m.bias = FloatTensor{DType::F64, {6}, {0, 1e-3, 0, 0, 0, 0}};
                        }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::EqualScores)) << list(v);
}

TEST(Oracle, MaskedRowPolicyCatchesAComputedMaskedRow) {
  Case c = sdpa({{"attn.masked_rows", "zero"}},
                {bools("mask", {5, 6}, {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                        1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})});
  // A broken implementation that gives a fully masked row the mean of the values.
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator& ev, auto b, auto h, auto i) {
                        if (i != 1) return ev.row(b, h, i, 128);
                        return eval_modified(cs, [](Case& m) { m.mask.reset(); }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::MaskedRowPolicy)) << list(v);
  // ... and one that does not refuse it under policy error.
  Case e = sdpa({}, {bools("mask", {5, 6}, {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})});
  v = check_case(e, broken([](const Case& cs, RowEvaluator&, auto b, auto h, auto i) {
                   return eval_modified(cs, [](Case& m) { m.masked_rows = MaskedRows::Zero; }, b, h, i);
                 }));
  EXPECT_TRUE(names(v, Invariant::MaskedRowPolicy)) << list(v);
}

TEST(Oracle, ShiftInvarianceCatchesAShiftAppliedToOneKeyOnly) {
  // exp(s_0) instead of exp(s_0 - m): key 0's score is in effect raised by the row's level m,
  // taken here as the midpoint of the correct lse.
  auto v = check_case(sdpa(), broken([](const Case& cs, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        const double m = mpfr_get_d(r.lse[0].lo, MPFR_RNDN);
                        return eval_modified(cs, [&](Case& x) {
                          std::vector<double> bias(static_cast<std::size_t>(x.B * x.Hq * x.Nq * x.Nk));
                          for (std::int64_t bb = 0; bb < x.B; ++bb)
                            for (std::int64_t hh = 0; hh < x.Hq; ++hh)
                              for (std::int64_t ii = 0; ii < x.Nq; ++ii)
                                for (std::int64_t j = 0; j < x.Nk; ++j)
                                  bias[static_cast<std::size_t>(((bb * x.Hq + hh) * x.Nq + ii) * x.Nk + j)] =
                                      cs.bias_at(bb, hh, ii, j) + (bb == b && hh == h && ii == i && j == 0 ? m : 0);
                          x.bias = FloatTensor{DType::F64, {x.B, x.Hq, x.Nq, x.Nk}, bias};
                        }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::ShiftInvariance)) << list(v);
}

TEST(Oracle, CausalDependenceCatchesALeakFromTheFuture) {
  // Weights are right, but the output takes a little of the next (future) key's value.
  Case c = sdpa({{"attn.causal", "top_left"}});
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        if (i + 1 < cs.Nk) {
                          const std::int64_t g = cs.kv_head(h);
                          for (std::int64_t col = 0; col < cs.Dv; ++col) {
                            const double leak = 1e-3 * cs.v.values[static_cast<std::size_t>(((b * cs.Hkv + g) * cs.Nk + i + 1) * cs.Dv + col)];
                            for (auto* e : {&r.heads[0].out[static_cast<std::size_t>(col)], &r.heads[0].raw_out[static_cast<std::size_t>(col)]}) {
                              mpfr_add_d(e->lo, e->lo, leak, MPFR_RNDD);
                              mpfr_add_d(e->hi, e->hi, leak, MPFR_RNDU);
                            }
                          }
                        }
                        return r;
                      }));
  EXPECT_TRUE(names(v, Invariant::CausalDependence)) << list(v);
  EXPECT_FALSE(names(v, Invariant::MaskedZero)) << list(v);
}

TEST(Oracle, SeqlensKeysPastTheLengthHaveWeightZero) {
  // An evaluation that ignores seqlens_k gives keys 4 and 5 weight.
  Case c = sdpa({}, {lengths("seqlens_k", 4)});
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator&, auto b, auto h, auto i) {
                        return eval_modified(cs, [](Case& m) { m.seqlens_k.reset(); }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::MaskedZero)) << list(v);
}

TEST(Oracle, SeqlensCausalDependenceAlignsPerBatch) {
  // bottom_right with Lq = 3 of Nq = 5 and Lk = Nk = 6: query i sees keys up to i + 3 (not
  // i + 1, the alignment of the padded sizes, under which the reference itself would fail the
  // causal twin: ReferencePassesEveryInvariant). A leak from key i + 4 is caught.
  Case c = sdpa({{"attn.causal", "bottom_right"}}, {lengths("seqlens_q", 3)});
  EXPECT_EQ(c.aligned_position(0, 0), 3);
  auto v = check_case(c, broken([](const Case& cs, RowEvaluator& ev, auto b, auto h, auto i) {
                        auto r = ev.row(b, h, i, 128);
                        if (i + 4 < cs.Nk) {
                          const std::int64_t g = cs.kv_head(h);
                          for (std::int64_t col = 0; col < cs.Dv; ++col) {
                            const double leak = 1e-3 * cs.v.values[static_cast<std::size_t>(((b * cs.Hkv + g) * cs.Nk + i + 4) * cs.Dv + col)];
                            for (auto* e : {&r.heads[0].out[static_cast<std::size_t>(col)], &r.heads[0].raw_out[static_cast<std::size_t>(col)]}) {
                              mpfr_add_d(e->lo, e->lo, leak, MPFR_RNDD);
                              mpfr_add_d(e->hi, e->hi, leak, MPFR_RNDU);
                            }
                          }
                        }
                        return r;
                      }));
  EXPECT_TRUE(names(v, Invariant::CausalDependence)) << list(v);
}

TEST(Oracle, KeyPermutationCatchesAPositionDependentScore) {
  auto v = check_case(sdpa(), broken([](const Case& cs, RowEvaluator&, auto b, auto h, auto i) {
                        return eval_modified(cs, [](Case& m) {
                          m.bias = FloatTensor{DType::F64, {6}, {0, 0x1p-8, 0x2p-8, 0x3p-8, 0x4p-8, 0x5p-8}};
                        }, b, h, i);
                      }));
  EXPECT_TRUE(names(v, Invariant::KeyPermutation)) << list(v);
}

TEST(Oracle, HeadIndependenceCatchesSwappedHeads) {
  auto v = check_case(sdpa(), broken([](const Case& cs, RowEvaluator& ev, auto b, auto h, auto i) {
                        return ev.row(b, (h + 1) % cs.Hq, i, 128);
                      }));
  EXPECT_TRUE(names(v, Invariant::HeadIndependence)) << list(v);
  // mha: heads 0 and 1 swapped in every row.
  v = check_case(mha(), broken([](const Case&, RowEvaluator& ev, auto b, auto h, auto i) {
                   auto r = ev.row(b, h, i, 128);
                   std::swap(r.heads[0], r.heads[1]);
                   std::swap(r.weights[0], r.weights[1]);
                   std::swap(r.lse[0], r.lse[1]);
                   return r;
                 }));
  EXPECT_TRUE(names(v, Invariant::HeadIndependence)) << list(v);
}

TEST(Oracle, CertifiedEvaluateRefusesABrokenRow) {
  Case c = sdpa();
  EvalOptions e;
  e.row_check = [](std::int64_t, std::int64_t, std::int64_t i, const RowEnclosures& r) {
    if (i == 2) {  // corrupt the enclosures the oracle sees for one row
      auto& w = const_cast<RowEnclosures&>(r).weights[0][0];
      scale_enclosure(w, 3);
    }
  };
  try {
    certified_evaluate(c, e, {});
    FAIL() << "no violation";
  } catch (const InvariantViolation& x) {
    EXPECT_EQ(x.violations().front().invariant, Invariant::RowSum);
    EXPECT_EQ(x.violations().front().i, 2);
  }
  EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
}

// A broken evaluation on eval's tiers: the tiered reference of a modified copy of each case.
class BrokenTiered : public RowSource {
 public:
  BrokenTiered(const Case& c, const std::function<void(Case&)>& change) : m_(c) {
    change(m_);
    ev_ = std::make_unique<TieredRowEvaluator>(m_);
  }
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i) override { return ev_->row(b, h, i, 128); }

 private:
  Case m_;
  std::unique_ptr<TieredRowEvaluator> ev_;
};
RowSourceFactory broken_tiered(std::function<void(Case&)> change) {
  return [change](const Case& c) { return std::make_unique<BrokenTiered>(c, change); };
}

double width(const Enclosure& e) {
  mpfr_t w;
  mpfr_init2(w, 64);
  mpfr_sub(w, e.hi, e.lo, MPFR_RNDU);
  const double d = mpfr_get_d(w, MPFR_RNDU);
  mpfr_clear(w);
  return d;
}

TEST(OracleTiered, RowsComeFromTheFastPathWhereItApplies) {
  const Case c = sdpa({{"attn.output_dtype", "F32"}});  // F64 outputs need out.ref_lo: MPFR here
  const RowEnclosures t = TieredRowEvaluator(c).row(0, 1, 2, 128);
  const RowEnclosures m = RowEvaluator(c).row(0, 1, 2, 128);
  ASSERT_EQ(t.weights[0].size(), 6u);
  for (std::size_t j = 0; j < 6; ++j) {
    EXPECT_TRUE(oracle::detail::overlap(t.weights[0][j], m.weights[0][j])) << j;
    // the fast path's balls, not MPFR's enclosures, and as tight as the roundings need
    EXPECT_FALSE(mpfr_equal_p(t.weights[0][j].lo, m.weights[0][j].lo) &&
                 mpfr_equal_p(t.weights[0][j].hi, m.weights[0][j].hi)) << j;
    EXPECT_LT(width(t.weights[0][j]), 0x1p-80) << j;
  }
  // softcap: no fast path, the MPFR enclosures themselves
  const Case s = sdpa({{"attn.output_dtype", "F32"}, {"attn.softcap", "2.5"}});
  const RowEnclosures ts = TieredRowEvaluator(s).row(0, 1, 2, 128);
  const RowEnclosures ms = RowEvaluator(s).row(0, 1, 2, 128);
  for (std::size_t j = 0; j < 6; ++j)
    EXPECT_TRUE(mpfr_equal_p(ts.weights[0][j].lo, ms.weights[0][j].lo) &&
                mpfr_equal_p(ts.weights[0][j].hi, ms.weights[0][j].hi)) << j;
}

// Two batches, a mask per batch and head, a bias per batch broadcast over heads, causal: the
// twins' slices of the mask and bias rows.
Case sliced_options() {
  std::vector<int> mask;
  for (int k = 0; k < 2 * 4 * 5 * 6; ++k) mask.push_back(k % 7 != 3);
  std::vector<double> bias = ramp(2 * 5 * 6, 0.3, 0.6);
  bias[4] = -INFINITY;
  std::vector<double> v = ramp(2 * 2 * 6 * 2, 0.7, 0.1);
  return make({floats("q", {2, 4, 5, 3}, ramp(120, 0.37, 0.2)), floats("k", {2, 2, 6, 3}, ramp(72, 0.91, 1.1)),
               floats("v", {2, 2, 6, 2}, v), bools("mask", {2, 4, 5, 6}, mask),
               floats("bias", {2, 1, 5, 6}, bias)},
              {{"attn.causal", "bottom_right"}, {"attn.masked_rows", "zero"}, {"attn.output_dtype", "F32"}});
}

TEST(OracleTiered, ReferencePassesEveryInvariantOnTheFastTier) {
  for (const Case& c : {sdpa({{"attn.output_dtype", "F32"}}), sliced_options(), 
                        sdpa({{"attn.causal", "top_left"}, {"attn.window", "2,0"}, {"attn.masked_rows", "zero"}, {"attn.output_dtype", "F32"}}),
                        mha()})
    for (const auto& rows : {tiered_rows(), reference_rows()}) {
      CheckOptions all;
      all.twin_units = 1000;
      const auto v = check_case(c, rows, all);
      EXPECT_TRUE(v.empty()) << list(v);
    }
  EXPECT_NO_THROW(certified_evaluate(sliced_options(), {}, {}));
}

// Distinct sinks per head with sequence lengths: every twin is built on its unit's slice, which
// must carry that head's sink (a slice without it, or with another head's, changes the row).
TEST(OracleTiered, TwinsOfSinksAndSequenceLengths) {
  const std::vector<RawTensor> sinks = {floats("sinks", {4}, {0.25, -0.5, 1.0, 0.75})};
  std::vector<Case> cases = {sdpa({{"attn.output_dtype", "F32"}}, sinks),
                             sdpa({{"attn.causal", "bottom_right"}, {"attn.output_dtype", "F32"}},
                                  {sinks[0], lengths("seqlens_q", 3), lengths("seqlens_k", 4)}),
                             sdpa({{"attn.window", "1,1"}}, {sinks[0], lengths("seqlens_k", 0)})};
  for (const Case& c : cases)
    for (const auto& rows : {tiered_rows(), reference_rows()}) {
      CheckOptions all;
      all.twin_units = 1000;
      const auto v = check_case(c, rows, all);
      EXPECT_TRUE(v.empty()) << list(v);
    }
  // head 2's sink changed in the whole case's evaluation, not in the slices': the twins differ
  CheckOptions all;
  all.twin_units = 1000;
  const auto v = check_case(cases[1], broken_tiered([](Case& m) {
    if (m.Hq == 4) m.sinks->values[2] += 1;
  }), all);
  EXPECT_TRUE(names(v, Invariant::ShiftInvariance)) << list(v);
}

TEST(TwinBuffers, TakesTheSmallestThatFitsElseTheLargest) {
  TwinBuffers pool;
  EXPECT_EQ(pool.take(5).size(), 5u);  // empty pool: a new buffer
  for (std::size_t n : {100u, 10u, 40u}) pool.give(std::vector<double>(n, 1.0));
  pool.give(std::vector<double>());  // nothing to keep
  std::vector<double> a = pool.take(30);
  EXPECT_EQ(a.size(), 30u);
  EXPECT_EQ(a.capacity(), 40u);
  std::vector<double> b = pool.take(200);  // none fits: the largest grows
  EXPECT_EQ(b.size(), 200u);
  std::vector<double> c = pool.take(10);
  EXPECT_EQ(c.capacity(), 10u);
  EXPECT_EQ(pool.take(1).capacity(), 1u);  // the pool is empty again
}

// Twins built on buffers left by other twins (here: NaN, of every size) must not see any of it:
// the reference passes, and a broken evaluation is still caught.
TEST(TwinBuffers, TwinsOnRecycledBuffersSeeNoneOfTheirOldContents) {
  auto dirty = [](TwinBuffers& pool) {
    for (std::size_t n : {1u, 7u, 64u, 300u, 4096u}) pool.give(std::vector<double>(n, std::nan("")));
  };
  for (const Case& c : {sdpa({{"attn.output_dtype", "F32"}}), sliced_options()})
    for (const auto& rows : {tiered_rows(), reference_rows()})
      for (std::int64_t u = 0; u < unit_count(c); ++u) {
        std::int64_t b, h, i;
        unit_position(c, u, b, h, i);
        TwinBuffers pool;
        dirty(pool);
        const auto v = check_twins(c, b, h, i, rows, &pool);
        EXPECT_TRUE(v.empty()) << list(v);
      }
  CheckOptions all;
  all.twin_units = 1000;
  const auto v = check_case(sliced_options(), broken_tiered([](Case& m) { m.causal = Causal::None; }), all);
  EXPECT_TRUE(names(v, Invariant::CausalDependence)) << list(v);
}

// Rows as a fast row of RowParts::Compared gives them, made by hand: every output of the unit's
// own row (on the case, Hq heads) has the ends `base`, a twin's (on a slice, fewer heads)
// `twin`; weights [0, 1] and lse (-inf, inf), which always agree.
RowSourceFactory rows_with_ends(DDEnclosure base, DDEnclosure twin, std::int64_t Hq) {
  struct Fixed : RowSource {
    const Case& t;
    DDEnclosure e;
    Fixed(const Case& c, DDEnclosure x) : t(c), e(x) {}
    RowEnclosures row(std::int64_t, std::int64_t, std::int64_t) override {
      RowEnclosures r;
      r.head_valid = {true};
      HeadDetail d;
      d.allowed.assign(static_cast<std::size_t>(t.Nk), 1);
      r.heads.push_back(std::move(d));
      r.weights.emplace_back();
      r.weight_ends.emplace_back(static_cast<std::size_t>(t.Nk), DDEnclosure{0, 0, 1, 0});
      r.out_ends.emplace_back(static_cast<std::size_t>(t.Dv), e);
      Enclosure l(128);
      mpfr_set_inf(l.lo, -1);
      mpfr_set_inf(l.hi, 1);
      r.lse.push_back(std::move(l));
      return r;
    }
  };
  return [=](const Case& t) { return std::make_unique<Fixed>(t, t.Hq == Hq ? base : twin); };
}

// The twins compare a fast row's ends as double-doubles, at their resolution, finer than F64's;
// ends whose hi is not their sum rounded go to MPFR, which compares their exact values.
TEST(OracleTiered, TwinsCompareFastRowsAtTheResolutionOfTheirBalls) {
  const Case c = sdpa({{"attn.output_dtype", "F32"}});
  ASSERT_GT(c.Hq, 1);
  auto violations = [&](DDEnclosure base, DDEnclosure twin) {
    return check_twins(c, 0, 1, 1, rows_with_ends(base, twin, c.Hq));
  };
  // [1 + 2^-60, 1 + 2^-59] and [1 + 2^-58, 1 + 2^-57]: the same F64 interval, yet disjoint
  auto v = violations({1, 0x1p-60, 1, 0x1p-59}, {1, 0x1p-58, 1, 0x1p-57});
  EXPECT_TRUE(names(v, Invariant::ShiftInvariance)) << list(v);
  EXPECT_TRUE(names(v, Invariant::HeadIndependence)) << list(v);
  // touching at 1 + 2^-59 and nested: they agree
  EXPECT_TRUE(violations({1, 0x1p-60, 1, 0x1p-59}, {1, 0x1p-59, 1, 0x1p-58}).empty());
  EXPECT_TRUE(violations({1, -0x1p-60, 1, 0x1p-59}, {1, 0, 1, 0}).empty());
  // below 1 the lo parts are negative: 1 - 2^-55 - 2^-110 against 1 - 2^-55 - 2^-108
  v = violations({1 - 0x1p-55, -0x1p-110, 1 - 0x1p-55, -0x1p-110}, {1 - 0x1p-55, -0x1p-108, 1 - 0x1p-55, -0x1p-108});
  EXPECT_TRUE(names(v, Invariant::ShiftInvariance)) << list(v);
  // ends 1 + 1 and 2 + 0.5 (hi not the rounded sum) against [1.5, 1.9]: read by (hi, lo) they
  // would seem to overlap; their values, [2, 2.5], do not
  v = violations({1, 1, 2, 0.5}, {1.5, 0, 1.9, 0});
  EXPECT_TRUE(names(v, Invariant::ShiftInvariance)) << list(v);
  EXPECT_TRUE(violations({1, 1, 2, 0.5}, {1.5, 0, 2.1, 0}).empty());
}

TEST(OracleTiered, TwinsOnTheFastTierCatchBrokenEvaluations) {
  // a score that depends on the key's position
  auto v = check_case(sliced_options(), broken_tiered([](Case& m) {
    for (std::size_t k = 0; k < m.bias->values.size(); ++k) m.bias->values[k] += 0x1p-8 * static_cast<double>(k % 6);
  }));
  EXPECT_TRUE(names(v, Invariant::KeyPermutation)) << list(v);
  // the causal option ignored
  v = check_case(sliced_options(), broken_tiered([](Case& m) { m.causal = Causal::None; }));
  EXPECT_TRUE(names(v, Invariant::CausalDependence)) << list(v);
  // one kv head reading the other's values
  v = check_case(sdpa({{"attn.output_dtype", "F32"}}), broken_tiered([](Case& m) {
    if (m.Hkv > 1) m.Hq = m.Hkv;  // every query head reads kv head h: GQA ignored
  }));
  EXPECT_TRUE(names(v, Invariant::HeadIndependence)) << list(v);
}

// The gradient checks: the reference passes them, and broken enclosures are caught.
TEST(Oracle, GradientChecks) {
  // Key 5 masked for every query, query 4 padding; a bias [Nq, Nk].
  std::vector<int> pattern;
  for (int r = 0; r < 5; ++r) pattern.insert(pattern.end(), {1, 1, 1, 1, 1, 0});
  Case c = sdpa({{"attn.outputs", "dq,dk,dv,dbias"}},
                {bools("mask", {5, 6}, pattern), bools("query_mask", {1, 5}, {1, 1, 1, 1, 0}),
                 floats("dout", {1, 4, 5, 2}, ramp(40, 0.53, 0.3)), floats("bias", {5, 6}, ramp(30, 0.29, 0.7))});
  EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
  GradientChecks g(c);
  Enclosure one(64);
  mpfr_set_ui(one.lo, 1, MPFR_RNDN);
  mpfr_set_ui(one.hi, 1, MPFR_RNDN);
  auto zero_violation = [&](const std::string& t, std::int64_t flat) {
    try {
      g.element(t, flat, one);
      ADD_FAILURE() << t << "[" << flat << "] accepted";
    } catch (const InvariantViolation& x) {
      EXPECT_EQ(x.violations().front().invariant, Invariant::GradientZero) << x.what();
    }
  };
  zero_violation("dq", 4 * 3);  // b=0, h=0, i=4: padding
  zero_violation("dk", 5 * 3);  // kv head 0, key 5: masked
  zero_violation("dv", 5 * 2 + 1);
  EXPECT_NO_THROW(g.element("dq", 0, one));  // a row that sees keys
  // A row of dbias that does not sum to 0.
  for (std::int64_t e = 0; e < 30; ++e) g.element("dbias", e, one);
  const auto v = g.finish();
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v.front().invariant, Invariant::GradientRowSum);
}

// Kind mha: dx_q of a row padding in every head and dx_kv of a key no head sees must be 0.
TEST(Oracle, GradientChecksOfKindMha) {
  Case c = make({floats("x_q", {1, 4, 3}, ramp(12, 0.4, 0.3)), floats("x_kv", {1, 4, 3}, ramp(12, 0.8, 0.5)),
                 floats("w_q", {2, 3, 2}, ramp(12, 1.3, 0.2)), floats("w_k", {2, 3, 2}, ramp(12, 0.6, 0.9)),
                 floats("w_v", {2, 3, 2}, ramp(12, 0.5, 0.4)), floats("w_o", {4, 3}, ramp(12, 0.2, 0.7)),
                 floats("dout", {1, 4, 3}, ramp(12, 0.53, 0.3)), bools("query_mask", {1, 4}, {1, 1, 0, 1}),
                 bools("mask", {1, 1, 1, 4}, {1, 1, 1, 0})},
                {{"attn.kind", "mha"}, {"attn.outputs", "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o"}});
  EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
  GradientChecks g(c);
  Enclosure one(64);
  mpfr_set_ui(one.lo, 1, MPFR_RNDN);
  mpfr_set_ui(one.hi, 1, MPFR_RNDN);
  for (const auto& [t, flat] : {std::pair<std::string, std::int64_t>{"dx_q", 2 * 3 + 1}, {"dx_kv", 3 * 3}}) {
    try {
      g.element(t, flat, one);
      ADD_FAILURE() << t << "[" << flat << "] accepted";
    } catch (const InvariantViolation& x) {
      EXPECT_EQ(x.violations().front().invariant, Invariant::GradientZero) << x.what();
    }
  }
  EXPECT_NO_THROW(g.element("dx_q", 0, one));   // a row that sees keys
  EXPECT_NO_THROW(g.element("dx_kv", 0, one));  // a key rows see
}

// The gradient twins: the reference passes them on every slice, and evaluations that break
// linearity in dout or let a query reach a key it cannot see are caught.
Case gradient_case(std::map<std::string, std::string> md, std::vector<RawTensor> extra = {}) {
  extra.push_back(floats("dout", {1, 4, 5, 2}, ramp(40, 0.53, 0.3)));
  if (!md.count("attn.outputs")) md["attn.outputs"] = "dq,dk,dv";
  return sdpa(md, std::move(extra));
}
TwinEvaluator reference_twins(int* calls = nullptr) {
  return [calls](const Case& t) {
    if (calls) ++*calls;
    return evaluate(t, {});
  };
}
// The golden element `flat` of tensor `name` moved to the next value of its dtype (F32, F64).
void nudge(EvalResult& r, const std::string& name, std::int64_t flat) {
  for (RawTensor& t : r.golden) {
    if (t.name != name) continue;
    unsigned char* p = t.data.data() + static_cast<std::size_t>(flat) * dtype_size(t.dtype);
    const double x = decode_float(t.dtype, p);
    encode_float(t.dtype, t.dtype == DType::F32 ? double(std::nextafter(float(x), INFINITY)) : std::nextafter(x, INFINITY), p);
    return;
  }
  ADD_FAILURE() << name << " is not in the evaluation";
}

TEST(Oracle, GradientTwinsPassTheReference) {
  std::vector<Case> cases;
  cases.push_back(gradient_case({{"attn.causal", "top_left"}}));
  cases.push_back(gradient_case({{"attn.causal", "bottom_right"}, {"attn.output_dtype", "F16"}}));
  cases.push_back(gradient_case({{"attn.window", "1,2"}, {"attn.output_dtype", "BF16"}}));
  cases.push_back(gradient_case({{"attn.causal", "top_left"}, {"attn.window", "2,0"}, {"attn.softcap", "2.5"}}));
  // a bias of every head (its dbias is the slice's), and one broadcast over the heads
  cases.push_back(gradient_case({{"attn.causal", "bottom_right"}, {"attn.outputs", "dq,dk,dv,dbias"}},
                                {floats("bias", {1, 4, 5, 6}, ramp(120, 0.29, 0.7))}));
  cases.push_back(gradient_case({{"attn.outputs", "dbias,dv"}, {"attn.masked_rows", "zero"}},
                                {floats("bias", {5, 6}, ramp(30, 0.29, 0.7)), bools("query_mask", {1, 5}, {1, 0, 1, 1, 0})}));
  cases.push_back(gradient_case({{"attn.causal", "top_left"}}, {lengths("seqlens_q", 4), lengths("seqlens_k", 3)}));
  // sinks: the slice keeps its heads' sinks (a row with no key keeps its sink's mass)
  cases.push_back(gradient_case({{"attn.causal", "bottom_right"}, {"attn.outputs", "dq,dk,dv,dsinks"}},
                                {floats("sinks", {4}, ramp(4, 0.61, 0.4))}));
  for (const Case& c : cases) {
    const EvalResult res = evaluate(c, {});
    for (std::int64_t g = 0; g < c.Hkv; ++g) {
      int calls = 0;
      const auto v = check_gradient_twins(c, res, 0, g, reference_twins(&calls));
      EXPECT_TRUE(v.empty()) << c.file.metadata.at("attn.outputs") << "\n" << list(v);
      EXPECT_EQ(calls, c.causal != Causal::None || c.window || c.query_mask || c.seqlens_q ? 2 : 1);
    }
    CheckOptions all;
    all.gradient_twin_slices = 2;
    EXPECT_NO_THROW(certified_evaluate(c, {}, all));
  }
}

TEST(Oracle, GradientLinearityCatchesANonlinearEvaluation) {
  const Case c = gradient_case({{"attn.causal", "top_left"}});
  const EvalResult res = evaluate(c, {});
  // dout clipped to [-1, 1] (twice dout reaches 2)
  auto v = check_gradient_twins(c, res, 0, 1, [](const Case& t) {
    Case m = t;
    for (double& x : m.dout->values) x = std::clamp(x, -1.0, 1.0);
    return evaluate(m, {});
  });
  EXPECT_TRUE(names(v, Invariant::GradientLinearity)) << list(v);
  // one element of dq.ref off by one unit in the last place, in the doubled twin only
  int calls = 0;
  v = check_gradient_twins(c, res, 0, 1, [&calls](const Case& t) {
    EvalResult r = evaluate(t, {});
    if (++calls == 1) nudge(r, "dq.ref", 1 * 5 * 3 + 1 * 3 + 1);  // slice head 1, row 1 (changed in the second), c 1
    return r;
  });
  ASSERT_EQ(v.size(), 1u) << list(v);
  EXPECT_EQ(v[0].invariant, Invariant::GradientLinearity);
  EXPECT_EQ(v[0].message().rfind("gradient_linearity: b=0 h=3 i=1 c=1: dq.ref: twice dout gives", 0), 0u) << v[0].message();
  // dbias of a bias [1, Hq, Nq, Nk]: the slice of kv head 1 holds heads 2 and 3; its entry
  // (head 2, query 0, key 0) is the case's flat 60, and query 0 changes in the second twin
  const Case cb = gradient_case({{"attn.causal", "bottom_right"}, {"attn.outputs", "dbias"}},
                                {floats("bias", {1, 4, 5, 6}, ramp(120, 0.29, 0.7))});
  calls = 0;
  v = check_gradient_twins(cb, evaluate(cb, {}), 0, 1, [&calls](const Case& t) {
    EvalResult r = evaluate(t, {});
    if (++calls == 1) nudge(r, "dbias", 0);
    return r;
  });
  ASSERT_EQ(v.size(), 1u) << list(v);
  EXPECT_EQ(v[0].message().rfind("gradient_linearity: b=-1 h=-1 i=60: dbias (i: its flat index): twice dout", 0), 0u)
      << v[0].message();
}

// Kind mha: one twin, the whole case with dout doubled; the reference passes it, and one
// element off by a unit in the twin, or dout clipped, is caught.
TEST(Oracle, MhaGradientLinearity) {
  const Case c = make({floats("x_q", {1, 4, 3}, ramp(12, 0.4, 0.3)), floats("x_kv", {1, 4, 3}, ramp(12, 0.8, 0.5)),
                       floats("w_q", {2, 3, 2}, ramp(12, 1.3, 0.2)), floats("w_k", {2, 3, 2}, ramp(12, 0.6, 0.9)),
                       floats("w_v", {2, 3, 2}, ramp(12, 0.5, 0.4)), floats("w_o", {4, 3}, ramp(12, 0.2, 0.7)),
                       floats("dout", {1, 4, 3}, ramp(12, 0.53, 0.3))},
                      {{"attn.kind", "mha"}, {"attn.causal", "top_left"}, {"attn.outputs", "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o"}});
  const EvalResult res = evaluate(c, {});
  int calls = 0;
  EXPECT_TRUE(check_gradient_twins(c, res, 0, 0, reference_twins(&calls)).empty());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(check_gradient_twins(c, res, 0, 1, reference_twins(&calls)).empty());
  EXPECT_EQ(calls, 1) << "one twin per case";
  auto v = check_gradient_twins(c, res, 0, 0, [](const Case& t) {
    EvalResult r = evaluate(t, {});
    nudge(r, "dw_o.ref", 5);
    return r;
  });
  ASSERT_EQ(v.size(), 1u) << list(v);
  EXPECT_EQ(v[0].message().rfind("gradient_linearity: b=-1 h=-1 i=5: dw_o.ref (i: its flat index): twice dout", 0), 0u)
      << v[0].message();
  v = check_gradient_twins(c, res, 0, 0, [](const Case& t) {
    Case m = t;
    for (double& x : m.dout->values) x = std::clamp(x, -1.0, 1.0);
    return evaluate(m, {});
  });
  EXPECT_TRUE(names(v, Invariant::GradientLinearity)) << list(v);
  EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
}

TEST(Oracle, GradientCausalDependenceCatchesALeak) {
  const Case c = gradient_case({{"attn.causal", "top_left"}, {"attn.output_dtype", "F32"}});
  const EvalResult res = evaluate(c, {});
  // causal ignored when the queries that cannot see the key are changed (the second twin)
  int calls = 0;
  auto v = check_gradient_twins(c, res, 0, 0, [&calls](const Case& t) {
    Case m = t;
    if (++calls == 2) m.causal = Causal::None;
    return evaluate(m, {});
  });
  EXPECT_TRUE(names(v, Invariant::GradientCausalDependence)) << list(v);
  EXPECT_FALSE(names(v, Invariant::GradientLinearity)) << list(v);
  // one element of dk moved in the second twin: the key chosen is 2 (seen by rows 2 to 4 of
  // both heads), so rows 0 and 1 change and keys 2 to 5 must keep their gradients
  calls = 0;
  v = check_gradient_twins(c, res, 0, 0, [&calls](const Case& t) {
    EvalResult r = evaluate(t, {});
    if (++calls == 2) nudge(r, "dk", 4 * 3 + 2);  // key 4 (seen by query 4 only), c 2
    return r;
  });
  ASSERT_EQ(v.size(), 1u) << list(v);
  EXPECT_EQ(v[0].message().rfind("gradient_causal_dependence: b=0 h=0 i=-1 j=4 c=2: dk: changing the queries that cannot see key", 0), 0u)
      << v[0].message();
  // padding rows' dout reaching dv: query_mask ignored in the second twin
  const Case p = gradient_case({{"attn.outputs", "dv"}}, {bools("query_mask", {1, 5}, {1, 1, 0, 1, 0})});
  calls = 0;
  v = check_gradient_twins(p, evaluate(p, {}), 0, 1, [&calls](const Case& t) {
    Case m = t;
    if (++calls == 2) m.query_mask.reset();
    return evaluate(m, {});
  });
  EXPECT_TRUE(names(v, Invariant::GradientCausalDependence)) << list(v);
}


// With sinks: the reference passes, dbias and dsinks of a head must sum to 0 together, and a
// head whose rows have only the sink (head 1: every key masked) has dsinks exactly 0.
TEST(Oracle, GradientChecksWithSinks) {
  const std::vector<RawTensor> extra = {floats("dout", {1, 4, 5, 2}, ramp(40, 0.53, 0.3)),
                                        floats("sinks", {4}, {0.5, -1, 2, 0}), bools("mask", {4, 1, 1}, {1, 0, 1, 1})};
  auto with = [&](RawTensor bias) {
    std::vector<RawTensor> t = extra;
    t.push_back(std::move(bias));
    return sdpa({{"attn.outputs", "dq,dk,dv,dbias,dsinks"}}, std::move(t));
  };
  Enclosure one(64);
  mpfr_set_ui(one.lo, 1, MPFR_RNDN);
  mpfr_set_ui(one.hi, 1, MPFR_RNDN);
  {  // a bias per head: one sum per head
    Case c = with(floats("bias", {4, 5, 6}, ramp(120, 0.29, 0.7)));
    EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
    GradientChecks g(c);
    EXPECT_THROW(g.element("dsinks", 1, one), InvariantViolation);
    for (std::int64_t e = 0; e < 120; ++e) g.element("dbias", e, one);
    for (std::int64_t h : {0, 2, 3}) g.element("dsinks", h, one);
    const auto v = g.finish();
    ASSERT_EQ(v.size(), 4u);  // head 1: dbias 1 everywhere and no dsinks enclosure
    EXPECT_EQ(v.front().invariant, Invariant::GradientRowSum);
  }
  {  // a bias broadcast over the heads: one sum over all of them; -30 from the bias, +30 back
    Case c = with(floats("bias", {5, 6}, ramp(30, 0.29, 0.7)));
    EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
    GradientChecks g(c);
    Enclosure minus(64);
    mpfr_set_si(minus.lo, -1, MPFR_RNDN);
    mpfr_set_si(minus.hi, -1, MPFR_RNDN);
    for (std::int64_t e = 0; e < 30; ++e) g.element("dbias", e, minus);
    for (std::int64_t h : {0, 2, 3}) g.element("dsinks", h, one);
    EXPECT_EQ(g.finish().size(), 1u);
    Enclosure back(64);
    mpfr_set_si(back.lo, 28, MPFR_RNDN);
    mpfr_set_si(back.hi, 28, MPFR_RNDN);
    g.element("dsinks", 3, back);
    EXPECT_TRUE(g.finish().empty());
  }
}

TEST(Oracle, InvariantNamesAreDistinct) {
  std::set<std::string_view> seen;
  for (auto v : all_invariants()) EXPECT_TRUE(seen.insert(invariant_name(v)).second);
  EXPECT_EQ(seen.size(), 18u);  // paged_gather, partial_merge, stored_kv and dropout the 15th to 18th
}

// A row allowing every key reads its values' range from the groups (once per kv head): the
// same range as the row's own reading, and the same verdicts at its ends and past them.
TEST(OracleFast, ConvexHullOfAFullRowFromTheGroups) {
  const Case c = sdpa();
  const KeyGroups g = key_groups(c);
  ASSERT_EQ(g.vmin.size(), static_cast<std::size_t>(c.B * c.Hkv * c.Dv));
  for (std::int64_t bg = 0; bg < c.B * c.Hkv; ++bg)
    for (std::int64_t col = 0; col < c.Dv; ++col) {
      double mn = INFINITY, mx = -INFINITY;
      for (std::int64_t j = 0; j < c.Nk; ++j) {
        const double x = c.v.values[static_cast<std::size_t>((bg * c.Nk + j) * c.Dv + col)];
        mn = std::min(mn, x), mx = std::max(mx, x);
      }
      EXPECT_EQ(g.vmin[static_cast<std::size_t>(bg * c.Dv + col)], mn);
      EXPECT_EQ(g.vmax[static_cast<std::size_t>(bg * c.Dv + col)], mx);
    }
  RowIntervals r;
  r.allowed = std::vector<char>(static_cast<std::size_t>(c.Nk), 1);
  r.w_lo = r.w_hi = std::vector<double>(static_cast<std::size_t>(c.Nk), 1.0 / static_cast<double>(c.Nk));
  r.w_lo[0] = 0, r.w_hi[0] = 1;  // sums enclosing 1 whatever Nk
  r.out_lo = r.out_hi = std::vector<double>(g.vmax.begin(), g.vmax.begin() + c.Dv);  // at the top
  auto hull = [&](const RowIntervals& x, const KeyGroups* groups) {
    int n = 0;
    for (const auto& v : check_row_fast(c, 0, 0, 0, x, groups)) n += v.invariant == Invariant::ConvexHull;
    return n;
  };
  EXPECT_EQ(hull(r, &g), 0);
  EXPECT_EQ(hull(r, nullptr), 0);
  r.out_lo[1] = r.out_hi[1] = std::nextafter(g.vmax[1], INFINITY);
  r.out_lo[0] = r.out_hi[0] = std::nextafter(g.vmin[0], -INFINITY);
  EXPECT_EQ(hull(r, &g), 2);
  EXPECT_EQ(hull(r, nullptr), 2);
}

}  // namespace
}  // namespace attnoracle::testing

namespace attnoracle::testing {
namespace {

using namespace attnoracle::oracle;

// The interval form of the row checks (fast-path rows) catches the same breakages.
TEST(OracleFast, IntervalChecksCatchBrokenRows) {
  std::vector<int> pattern;
  for (int r = 0; r < 5; ++r) pattern.insert(pattern.end(), {1, 0, 1, 1, 1, 1});
  Case c = sdpa({}, {bools("mask", {5, 6}, pattern)});
  for (std::int64_t d = 0; d < c.Dk; ++d)  // keys 2 and 3 equal
    c.k.values[static_cast<std::size_t>(3 * c.Dk + d)] = c.k.values[static_cast<std::size_t>(2 * c.Dk + d)];
  // A consistent row: allowed weights 0.25 each, outputs inside the values' range [1, 2].
  RowIntervals good;
  good.allowed = {1, 0, 1, 1, 1, 1};
  good.w_lo = {0.2, 0, 0.2, 0.2, 0.2, 0.2};
  good.w_hi = {0.2, 0, 0.2, 0.2, 0.2, 0.2};
  good.out_lo = {1.5, 1.5};
  good.out_hi = {1.5, 1.5};
  EXPECT_TRUE(check_row_fast(c, 0, 0, 0, good).empty()) << list(check_row_fast(c, 0, 0, 0, good));
  auto with = [&](const std::function<void(RowIntervals&)>& f, Invariant inv) {
    RowIntervals r = good;
    f(r);
    const auto v = check_row_fast(c, 0, 0, 0, r);
    EXPECT_TRUE(names(v, inv)) << invariant_name(inv) << ": " << list(v);
  };
  with([](RowIntervals& r) { r.w_lo[0] = r.w_hi[0] = 0.3; }, Invariant::RowSum);
  with([](RowIntervals& r) { r.w_lo[4] = -0.2, r.w_hi[4] = -0.1; }, Invariant::WeightRange);
  with([](RowIntervals& r) { r.w_hi[1] = 1e-30; }, Invariant::MaskedZero);
  with([](RowIntervals& r) { r.out_lo[1] = r.out_hi[1] = 3; }, Invariant::ConvexHull);
  with([](RowIntervals& r) { r.w_lo[3] = r.w_hi[3] = 0.1, r.w_lo[4] = r.w_hi[4] = 0.3; }, Invariant::EqualScores);
}

// Equal keys wherever they stand (zeros of either sign alike), each paired with the first key
// equal to it; keys equal but for one component are not paired.
TEST(OracleFast, EqualScoresPairEachKeyWithTheFirstEqualOne) {
  Case c = sdpa();
  const auto Dk = static_cast<std::size_t>(c.Dk);
  auto key = [&](std::size_t j, std::size_t d) -> double& { return c.k.values[j * Dk + d]; };
  for (std::size_t d = 0; d < Dk; ++d) key(1, d) = key(5, d) = key(4, d) = key(3, d);
  key(1, 0) = 0.0, key(5, 0) = -0.0, key(4, 0) = 0.0, key(3, 0) = 0.0;
  key(4, 2) = std::nextafter(key(3, 2), 2.0);  // one ulp apart: another score
  RowIntervals r;
  r.allowed = std::vector<char>(6, 1);
  r.w_lo = r.w_hi = {0.2, 0.1, 0.1, 0.1, 0.2, 0.3};
  r.w_lo[0] = r.w_lo[2] = r.w_lo[4] = 0.1;  // sums of 0.8 to 1.1: no RowSum violation
  r.out_lo = r.out_hi = {1.5, 1.5};
  std::vector<std::string> pairs;
  for (const auto& v : check_row_fast(c, 0, 0, 0, r))
    if (v.invariant == Invariant::EqualScores) pairs.push_back(v.detail.substr(0, v.detail.find(" (")));
  EXPECT_EQ(pairs, (std::vector<std::string>{"keys 1 and 5"})) << list(check_row_fast(c, 0, 0, 0, r));
  // The groups computed once per head (a row allowing every key, no bias) pair them alike.
  const KeyGroups g = key_groups(c);
  ASSERT_EQ(g.first.size(), static_cast<std::size_t>(c.B * c.Hkv * c.Nk));
  EXPECT_EQ(std::vector<std::int64_t>(g.first.begin(), g.first.begin() + 6),
            (std::vector<std::int64_t>{-1, -1, -1, 1, -1, 1}));  // head (0, 0)
  std::vector<std::string> grouped;
  for (const auto& v : check_row_fast(c, 0, 0, 0, r, &g))
    if (v.invariant == Invariant::EqualScores) grouped.push_back(v.detail.substr(0, v.detail.find(" (")));
  EXPECT_EQ(grouped, pairs);
}

}  // namespace
}  // namespace attnoracle::testing
