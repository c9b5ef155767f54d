// The statistical tier: its limits worked by hand, samples drawn from the model (pass), scaled or
// biased ones (fail), and end to end on the committed core suite.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/bin_order.hpp"
#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/statistics.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "cli_run.hpp"

#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

namespace attnoracle::conformance {
namespace {

double sq(double x) { return x * x; }

// weight_spread as plain loops, one key and one element at a time: the faster loops of
// statistics.cpp must give the same numbers bit for bit.
Spread plain_spread(const Case& c, const Profile& p) {
  Spread s;
  s.exact = true;
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double ub = p.bias ? unit_roundoff(*p.bias) : 0;
  const std::int64_t H = c.Hq, Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
  const double scale = 1 / std::sqrt(static_cast<double>(Dk));
  const double dot_k = std::sqrt(static_cast<double>(Dk) + 2) * uq * std::fabs(scale);
  const std::size_t rows = static_cast<std::size_t>(c.B * H * c.Nq);
  s.key_sum.assign(rows, 0.0);
  s.key_max.assign(rows, 0.0);
  s.z_part.assign(rows, 0.0);
  s.key.assign(rows * static_cast<std::size_t>(Dv), 0.0);
  s.wv = s.partial = s.key;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const std::int64_t g = c.kv_head(h);
        const auto row = static_cast<std::size_t>((b * H + h) * c.Nq + i);
        std::vector<std::int64_t> keys;
        std::vector<double> w, t, kr;
        for (std::int64_t j = 0; j < Nk; ++j) {
          if (!c.allowed(b, h, i, j)) continue;
          double dot = 0, dabs = 0;
          for (std::int64_t d = 0; d < Dk; ++d) {
            const double x = c.q.values[row * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d)] *
                             c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * Nk + j) * Dk + d)];
            dot += x;
            dabs += std::fabs(x);
          }
          const double tj = dot * scale, bj = c.bias_at(b, h, i, j);
          keys.push_back(j);
          t.push_back(tj);
          w.push_back(tj + bj);
          kr.push_back(std::hypot(dot_k * dabs, ub * bj));
        }
        if (keys.empty()) continue;
        const double m = *std::max_element(w.begin(), w.end());
        double z = 0;
        for (std::size_t j = 0; j < w.size(); ++j) {
          kr[j] = std::sqrt(sq(kr[j]) + sq(us * t[j]) + sq(us * w[j]) + sq(us * (w[j] - m)) + sq(p.exp_ulps * us) +
                            sq(us) + sq(up));
          z += (w[j] = std::exp(w[j] - m));
        }
        double ks = 0, km = 0, zp = 0, wk = 0;
        for (std::size_t j = 0; j < w.size(); ++j) {
          w[j] /= z;
          ks += sq(w[j] * kr[j]);
          km = std::max(km, kr[j]);
          wk += w[j];
          zp += wk * wk;
        }
        s.key_sum[row] = std::sqrt(ks);
        s.key_max[row] = km;
        s.z_part[row] = std::sqrt(zp);
        for (std::int64_t e = 0; e < Dv; ++e) {
          const std::size_t at = row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e);
          auto v = [&](std::size_t j) { return c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * Nk + keys[j]) * Dv + e)]; };
          double x = 0, run = 0;
          for (std::size_t j = 0; j < keys.size(); ++j) x += w[j] * v(j);
          for (std::size_t j = 0; j < keys.size(); ++j) {
            s.key[at] += sq(w[j] * (v(j) - x) * kr[j]);
            s.wv[at] += sq(w[j] * v(j));
            run += w[j] * v(j);
            s.partial[at] += sq(run);
          }
          s.key[at] = std::sqrt(s.key[at]);
          s.wv[at] = std::sqrt(s.wv[at]);
          s.partial[at] = std::sqrt(s.partial[at]);
        }
      }
  return s;
}

RC_GTEST_PROP(StatisticsSpread, SameAsThePlainLoopsBitForBit, ()) {
  Case c;
  c.kind = Kind::Sdpa;
  c.B = *rc::gen::inRange<std::int64_t>(1, 3);
  c.Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  c.Hq = c.Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  c.Nq = *rc::gen::inRange<std::int64_t>(1, 6);
  c.Nk = *rc::gen::inRange<std::int64_t>(1, 14);  // tails of the four-key blocks
  c.Dk = *rc::gen::inRange<std::int64_t>(1, 10);
  // the blocks of 4 and 1 vectors of 2, 4 or 8 lanes, and tails (uniform: inRange favours small sizes)
  std::vector<std::int64_t> widths(40);
  std::iota(widths.begin(), widths.end(), 1);
  c.Dv = *rc::gen::elementOf(widths);
  std::mt19937_64 gen(*rc::gen::arbitrary<std::uint32_t>());
  std::normal_distribution<double> normal;
  auto fill = [&](FloatTensor& t, std::vector<std::int64_t> shape) {
    t.shape = shape;
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    for (std::int64_t k = 0; k < n; ++k) t.values.push_back(normal(gen));
  };
  fill(c.q, {c.B, c.Hq, c.Nq, c.Dk});
  fill(c.k, {c.B, c.Hkv, c.Nk, c.Dk});
  fill(c.v, {c.B, c.Hkv, c.Nk, c.Dv});
  if (*rc::gen::arbitrary<bool>()) {
    BoolTensor m{{c.B, c.Hq, c.Nq, c.Nk}, {}};
    for (std::int64_t k = 0; k < c.B * c.Hq * c.Nq * c.Nk; ++k) m.values.push_back(gen() % 4 != 0);
    c.mask = std::move(m);
  }
  if (*rc::gen::arbitrary<bool>()) {
    c.bias = FloatTensor{};
    fill(*c.bias, {c.Nq, c.Nk});
    c.bias->values[0] = -INFINITY;
  }
  if (*rc::gen::arbitrary<bool>()) c.causal = Causal::BottomRight;
  for (const char* name : {"fp32", "fp16", "bf16"}) {
    const Profile p = builtin_profile(name);
    const Spread a = weight_spread(c, p), z = plain_spread(c, p);
    RC_ASSERT(a.key_sum == z.key_sum);
    RC_ASSERT(a.key_max == z.key_max);
    RC_ASSERT(a.z_part == z.z_part);
    RC_ASSERT(a.key == z.key);
    RC_ASSERT(a.wv == z.wv);
    RC_ASSERT(a.partial == z.partial);
  }
}

// `rows` rows of `per_row` normalised errors, each the sum of `roundings` independent roundings
// uniform in [-c, c] with c = 1 / roundings (their scales add to 1, as out_scale's terms do),
// times `factor`, plus `bias`.
Sample model_sample(std::uint32_t seed, int rows, int per_row, int roundings, double factor = 1, double bias = 0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  Sample s;
  for (int r = 0; r < rows; ++r)
    for (int e = 0; e < per_row; ++e) {
      double z = 0;
      for (int k = 0; k < roundings; ++k) z += u(gen) / roundings;
      s.add(r, factor * z + bias, 0);
    }
  return s;
}

TEST(StatisticsLimits, WorkedByHand) {
  Sample s = model_sample(1, 512, 8, 1);
  const Tier t = judge(s);
  EXPECT_TRUE(t.tested);
  EXPECT_EQ(t.n, 4096);
  EXPECT_EQ(t.rows, 512);
  // 100 * 2 exp(-l^2 / 2) = 1e-6: l^2 = 2 ln(2e8) = 38.227656
  EXPECT_NEAR(t.q99_limit, 6.182852, 1e-6);
  // 2 ln 2 + 4 ln(1e6) / 512 = 1.386294 + 0.107933
  EXPECT_NEAR(t.rms_limit, std::sqrt(1.494227), 1e-6);
  // over the 512 row means: sqrt(2 ln(2e6) / 512) = sqrt(29.017316 / 512)
  EXPECT_NEAR(t.mean_limit, 0.238064, 1e-6);
}

TEST(StatisticsLimits, FewElementsAreNotTested) {
  Sample s;
  for (int k = 0; k < kMinSample - 1; ++k) s.add(k, 100.0, 0);  // far beyond every limit
  const Tier t = judge(s);
  EXPECT_FALSE(t.tested);
  EXPECT_TRUE(t.ok);
  s.add(99, 100.0, 0);
  EXPECT_FALSE(judge(s).ok);
}

TEST(StatisticsLimits, ZerosCountInTheQuantile) {
  // 99 zeros and one error of 7 in 100 elements: the 99th percentile is 0, the maximum 7
  Sample s;
  for (int k = 0; k < 99; ++k) s.add(k, 0, 0);
  s.add(99, 7, 0);
  Tier t = judge(s);
  EXPECT_EQ(t.q99, 0);
  EXPECT_EQ(t.n, 100);
  // two of 100 at 7: the percentile is 7, beyond 6.18
  Sample s2;
  for (int k = 0; k < 98; ++k) s2.add(k, 0, 0);
  s2.add(98, 7, 0);
  s2.add(99, -7, 0);
  t = judge(s2);
  EXPECT_EQ(t.q99, 7);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("99th percentile"), std::string::npos) << t.note;
}

TEST(StatisticsSamples, FromTheModelPasses) {
  for (int roundings : {1, 2, 16}) {
    Sample s = model_sample(7, 512, 8, roundings);
    const Tier t = judge(s);
    EXPECT_TRUE(t.ok) << roundings << ": " << t.note;
    EXPECT_GT(t.headroom, 1) << roundings;
  }
}

TEST(StatisticsSamples, ScaledByFourFails) {
  // one rounding a term, uniform in [-4, 4]: rms 2.31 against a limit of 1.22
  Sample s = model_sample(7, 512, 8, 1, 4);
  const Tier t = judge(s);
  EXPECT_FALSE(t.ok);
  EXPECT_NEAR(t.rms, 4 / std::sqrt(3.0), 0.05);
  EXPECT_NE(t.note.find("root mean square"), std::string::npos) << t.note;
  EXPECT_LT(t.headroom, 1);
}

TEST(StatisticsSamples, BiasedFails) {
  // half the scale in one direction: 0.5 against 0.238
  Sample s = model_sample(7, 512, 8, 2, 1, 0.5);
  const Tier t = judge(s);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("biased"), std::string::npos) << t.note;
  Sample down = model_sample(7, 512, 8, 2, 1, -0.5);
  EXPECT_FALSE(judge(down).ok);
}

// Any sample of the model, whatever its shape, passes (each test fails with probability 1e-6).
RC_GTEST_PROP(StatisticsSamples, ModelSamplesPass, ()) {
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  const int rows = *rc::gen::inRange(1, 300), per_row = *rc::gen::inRange(1, 40), roundings = *rc::gen::inRange(1, 8);
  Sample s = model_sample(seed, rows, per_row, roundings);
  const Tier t = judge(s);
  RC_ASSERT(t.ok);
  RC_ASSERT(t.tested == (rows * per_row >= kMinSample));
}

// P rounded to a format of `precision` bits and smallest normal 2^emin: to nearest (ties to
// even), or toward zero (truncation); x >= 0.
double round_p(double x, int precision, int emin, bool truncate) {
  if (x == 0) return 0;
  int e;
  std::frexp(x, &e);
  const double ulp = std::ldexp(1.0, std::max(e - 1, emin) - precision + 1);
  return (truncate ? std::floor(x / ulp) : std::nearbyint(x / ulp)) * ulp;
}

// A kernel of flash-bf16's or flash-fp16's arithmetic, exact but for P: p_j = exp(s_j - m)
// rounded to `p` (to nearest, or toward zero), l the sum of the unrounded p_j, out = sum_j
// fl(p_j) v_j / l rounded to F32; judged by the tier, the bias test included, against out in
// double.
Tier kernel_tier(const Case& c, const Profile& p, bool truncate) {
  const int precision = p.p == DType::F16 ? 11 : 8, emin = p.p == DType::F16 ? -14 : -126;
  const Spread sp = weight_spread(c, p);
  const auto mags = row_magnitudes(c);
  const double uo = unit_roundoff(DType::F32), scale = 1 / std::sqrt(static_cast<double>(c.Dk));
  Sample sample;
  BiasSample bias;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const auto row = static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i);
        const RowLimits L = row_limits(p, c, mags[row]);
        const RowScales R = row_scales(p, c, mags[row]);
        const std::int64_t g = c.kv_head(h);
        std::vector<std::int64_t> keys;
        std::vector<double> s;
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          if (!c.allowed(b, h, i, j)) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < c.Dk; ++d)
            dot += c.q.values[row * static_cast<std::size_t>(c.Dk) + static_cast<std::size_t>(d)] *
                   c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dk + d)];
          keys.push_back(j);
          s.push_back(dot * scale);
        }
        if (keys.empty()) continue;
        const double m = *std::max_element(s.begin(), s.end());
        double l = 0;
        for (double& t : s) l += (t = std::exp(t - m));
        for (std::int64_t e = 0; e < c.Dv; ++e) {
          double x = 0, y = 0, bound = 0, vsum = 0;
          for (std::size_t a = 0; a < keys.size(); ++a) {
            const double v = c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + keys[a]) * c.Dv + e)];
            x += s[a] * v;
            y += round_p(s[a], precision, emin, truncate) * v;
            bound += s[a] * std::fabs(v);
            vsum += std::fabs(v);
          }
          x /= l;
          y = static_cast<float>(y / l);
          bound /= l;
          const auto k = row * static_cast<std::size_t>(c.Dv) + static_cast<std::size_t>(e);
          const double sc = out_scale(p, sp, R, L, uo, row, k, x, bound, vsum);
          sample.add(static_cast<std::int64_t>(row), (y - x) / sc, final_share(uo, x, sc));
          bias.add(static_cast<std::int64_t>(row), y - x, x, out_rest_scale(p, sp, R, L, row, k, x, bound, vsum), uo,
                   0x1p-149, 24);
        }
      }
  return judge(sample, bias, sp);
}

Case normal_case(std::uint64_t seed, std::int64_t H, std::int64_t Nq, std::int64_t Nk, std::int64_t D) {
  Case c;
  c.kind = Kind::Sdpa;
  c.B = 1;
  c.Hq = c.Hkv = H;
  c.Nq = Nq;
  c.Nk = Nk;
  c.Dk = c.Dv = D;
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal;
  auto fill = [&](FloatTensor& t, std::vector<std::int64_t> shape) {
    t.shape = shape;
    for (std::int64_t k = 0; k < shape[0] * shape[1] * shape[2] * shape[3]; ++k) t.values.push_back(normal(gen));
  };
  fill(c.q, {1, H, Nq, D});
  fill(c.k, {1, H, Nk, D});
  fill(c.v, {1, H, Nk, D});
  return c;
}

TEST(StatisticsBias, PTruncatedFailsRoundedToNearestPasses) {
  for (const char* name : {"flash-bf16", "flash-fp16"}) {
    const Profile p = builtin_profile(name);
    const Case c = normal_case(3, 2, 32, 256, 64);
    const Tier right = kernel_tier(c, p, false), wrong = kernel_tier(c, p, true);
    EXPECT_TRUE(right.ok) << name << ": " << right.note;
    EXPECT_TRUE(right.bias_tested);
    EXPECT_NEAR(right.bias_limit, std::sqrt(2 * std::log(2e6)), 1e-12);
    EXPECT_GT(right.headroom, 1) << name;
    EXPECT_FALSE(wrong.ok) << name;
    EXPECT_EQ(wrong.bias_direction, 1) << name;
    EXPECT_LT(wrong.bias, -wrong.bias_limit) << name;
    EXPECT_NE(wrong.note.find("biased toward zero"), std::string::npos) << name << ": " << wrong.note;
  }
}

// Any kernel of the model (P rounded to nearest) passes the bias test, whatever the shape.
RC_GTEST_PROP(StatisticsBias, PRoundedToNearestPasses, ()) {
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  const std::int64_t H = *rc::gen::inRange<std::int64_t>(1, 3), Nq = *rc::gen::inRange<std::int64_t>(1, 17);
  const std::int64_t Nk = *rc::gen::inRange<std::int64_t>(1, 200), D = *rc::gen::inRange<std::int64_t>(1, 65);
  const Profile p = builtin_profile(*rc::gen::element(std::string("flash-bf16"), std::string("flash-fp16")));
  const Tier t = kernel_tier(normal_case(seed, H, Nq, Nk, D), p, false);
  RC_ASSERT(std::fabs(t.bias) <= t.bias_limit);
  RC_ASSERT(t.bias_tested == (t.tested && H * Nq * D >= kMinSample));
}

// The linear order of the bias test's pairs is std::sort's, element for element, and so are the
// roots over it, bit for bit: random bins (few distinct ones: long runs of ties) and coefficients.
RC_GTEST_PROP(StatisticsBias, BinOrderIsTheSortsOrder, ()) {
  const std::uint64_t seed = *rc::gen::arbitrary<std::uint64_t>();
  const std::size_t n = *rc::gen::inRange<std::size_t>(0, 5000);
  const int bits = *rc::gen::inRange(1, 64);
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::uint64_t, double>> bins(n);
  for (auto& b : bins) {
    b.first = bits == 64 ? rng() : rng() & ((1ull << bits) - 1);
    if (rng() % 3 == 0) b.first <<= rng() % 64;  // high digits set, some bins shared again
    b.second = std::ldexp(static_cast<double>(rng() >> 11), -static_cast<int>(rng() % 80));
  }
  auto sorted = bins;
  std::sort(sorted.begin(), sorted.end());
  auto linear = bins;
  sort_bin_pairs(linear);
  RC_ASSERT(linear == sorted);
  // binned_parts on the unsorted pairs against the same sums over std::sort's order
  RootSumSquares parity[2];
  for (std::size_t a = 0; a < sorted.size();) {
    double c = 0;
    std::size_t e = a;
    for (; e < sorted.size() && sorted[e].first == sorted[a].first; ++e) c += sorted[e].second;
    parity[sorted[a].first & 1].add(c);
    a = e;
  }
  const auto [even, odd] = binned_parts(bins);
  RC_ASSERT(even == parity[0].root());
  RC_ASSERT(odd == parity[1].root());
}

TEST(StatisticsBias, BinOrderWorkedByHand) {
  // 70 pairs (past the short-input path): bins 300, 2 and 2^40 + 2, coefficients descending
  std::vector<std::pair<std::uint64_t, double>> bins;
  for (int k = 0; k < 70; ++k) bins.emplace_back(k % 3 == 0 ? 300 : (k % 3 == 1 ? 2 : (1ull << 40) + 2), 70.0 - k);
  sort_bin_pairs(bins);
  ASSERT_EQ(bins.size(), 70u);
  EXPECT_EQ(bins.front(), (std::pair<std::uint64_t, double>{2, 70.0 - 67}));
  EXPECT_EQ(bins[22], (std::pair<std::uint64_t, double>{2, 70.0 - 1}));
  EXPECT_EQ(bins[23], (std::pair<std::uint64_t, double>{300, 70.0 - 69}));
  EXPECT_EQ(bins.back(), (std::pair<std::uint64_t, double>{(1ull << 40) + 2, 70.0 - 2}));
}

TEST(StatisticsBias, BinnedRootWorkedByHand) {
  // bins 4 and 4 (one group of 3), 5 (odd, 4), 6 (even, with 4's group: independent of it)
  std::vector<std::pair<std::uint64_t, double>> bins{{6, 2}, {4, 1}, {5, 4}, {4, 2}};
  EXPECT_DOUBLE_EQ(binned_root(bins), std::sqrt(3.0 * 3 + 2 * 2) + 4);
  std::vector<std::pair<std::uint64_t, double>> none;
  EXPECT_EQ(binned_root(none), 0);
  // |x| in bins of 2^(precision - 2) a binade: 1 and 1 + 2^-6 share F16's bin 1 + k 2^-9
  EXPECT_EQ(BiasSample::value_bin(1.0, 11), BiasSample::value_bin(1 + 0x1p-10, 11));
  EXPECT_EQ(BiasSample::value_bin(1.0, 11) + 1, BiasSample::value_bin(1 + 0x1p-9, 11));
  EXPECT_EQ(BiasSample::value_bin(-3.0, 8), BiasSample::value_bin(3.0, 8));
}

TEST(StatisticsBias, SumsWorkedByHand) {
  // two rows of 20 elements: x = +-1 alternately, errors -0.25 (toward zero on the positive
  // ones, away on the negative ones), rest 0.01 each, F32 final roundings
  BiasSample b;
  Sample s;
  for (int r = 0; r < 2; ++r)
    for (int e = 0; e < 20; ++e) {
      const double x = e % 2 ? -1 : 1;
      b.add(r, -0.25, x, 0.01, 0x1p-24, 0x1p-149, 24);
      s.add(r, 0.1, 0);
    }
  Spread sp;
  sp.exact = true;
  sp.p_bias[0] = 0.6;  // P's roundings, direction 0: even bins, odd bins
  sp.p_bias[1] = 0.8;
  sp.p_bias[2] = 1.2;
  sp.p_bias[3] = 1.6;
  const Tier t = judge(s, b, sp);
  ASSERT_TRUE(t.bias_tested);
  EXPECT_EQ(b.t[0], -10);
  EXPECT_EQ(b.t[1], 0);
  // the final roundings: 40 values of |x| = 1 in one bin (even: 1's bits >> 30), 40 2^-24 /
  // sqrt 3, with P's even bins in quadrature; the rest: two rows of 20 * 0.01 = 0.2, sqrt(0.08)
  EXPECT_EQ(BiasSample::value_bin(1.0, 24) % 2, 0u);
  const double scale = std::hypot(0.6, 40 * 0x1p-24 / std::sqrt(3.0)) + 0.8 + std::sqrt(0.08);
  EXPECT_DOUBLE_EQ(t.bias, -10 / scale);
  EXPECT_EQ(t.bias_direction, 0);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("biased down"), std::string::npos) << t.note;
  Spread mha;  // no weights: no bias test
  BiasSample b2 = b;
  Sample s2 = s;
  EXPECT_FALSE(judge(s2, b2, mha).bias_tested);
}

// End to end: the FlashAttention-style NumPy kernel under flash-fp16 on the F16 cases of core,
// correct, then with its output rounded toward +inf (within every element's limit).
struct GateRun {
  int status;
  std::string out;
  nlohmann::json report;
};
GateRun gate_flash_fp16(const std::string& bug) {
  testing::TempDir dir;
  const std::string impl = "/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                           "/conformance/adapters/flash_numpy/attention.py --block 64 --arith fp16" + bug;
  const auto r = testing::run_cli({"run", std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core", "--tag", "f16", "--impl",
                                   impl, "--profile", "flash-fp16", "--json", (dir / "report.json").string()});
  return {r.status, r.out + r.err, nlohmann::json::parse(testing::read_text(dir / "report.json"))};
}

TEST(StatisticsEndToEnd, CorrectKernelPassesWithHeadroom) {
  const GateRun r = gate_flash_fp16("");
  EXPECT_EQ(r.status, 0) << r.out;
  int tested = 0;
  for (const auto& c : r.report["cases"])
    for (const auto& t : c["tensors"]) {
      const auto& tier = t["tier"];
      EXPECT_TRUE(tier["ok"].get<bool>()) << c["id"] << " " << t.dump();
      if (!tier["tested"].get<bool>()) continue;
      ++tested;
      EXPECT_LE(tier["q99"].get<double>(), tier["q99_limit"].get<double>());
      if (!tier["headroom"].is_null()) {
        EXPECT_GE(tier["headroom"].get<double>(), 1) << c["id"];
      }
    }
  EXPECT_GT(tested, 50);
  EXPECT_NE(r.out.find("statistical tier: "), std::string::npos) << r.out;
}

TEST(StatisticsEndToEnd, OutputRoundedUpFailsOnlyByTheTier) {
  const GateRun r = gate_flash_fp16(" --bug stat_round_up");
  EXPECT_EQ(r.status, 1) << r.out;
  int biased = 0;
  for (const auto& c : r.report["cases"]) {
    if (c["status"] != "fail") continue;
    EXPECT_EQ(c["failed_elements"], 0) << c["id"];  // every element within its limit
    if (c["reason"].get<std::string>().find("out: biased: mean normalised error") != std::string::npos) ++biased;
  }
  EXPECT_GE(biased, 3) << r.out;
  EXPECT_NE(r.out.find("out: headroom "), std::string::npos) << r.out;
}

// P converted to F16 by truncation instead of to nearest: every element within its limit, the
// bias test fails the larger normal cases (TOLERANCE.md, "P's roundings: the bias test").
// Rows whose scores share a large part (q and k near a common direction, as score_jump's rows
// after their jump): many keys of like weight, so each row's own errors average out in lse while
// an error shared by every score does not.
Case shared_case(std::uint64_t seed, std::int64_t H, std::int64_t Nq, std::int64_t Nk, std::int64_t D) {
  Case c = normal_case(seed, H, Nq, Nk, D);
  for (FloatTensor* t : {&c.q, &c.k})
    for (double& x : t->values) x = 1.5 + x / 8;
  return c;
}

// lse of a kernel exact but for the softmax scale, formed once in F32 and so off by `delta`
// relative in every score (d lse = delta sum_j w_j t_j), then `shift` times u_F32 |lse| more,
// rounded to F32; judged by the tier under fp32.
Tier lse_tier(const Case& c, double delta, double shift, bool shared_rows) {
  const Profile p = builtin_profile("fp32");
  const Spread sp = weight_spread(c, p);
  const auto mags = row_magnitudes(c);
  const double uo = unit_roundoff(DType::F32), scale = 1 / std::sqrt(static_cast<double>(c.Dk));
  Sample sample;
  for (std::int64_t h = 0; h < c.Hq; ++h)
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      const auto row = static_cast<std::size_t>(h * c.Nq + i);
      std::vector<double> t;
      for (std::int64_t j = 0; j < c.Nk; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < c.Dk; ++d)
          dot += c.q.values[row * static_cast<std::size_t>(c.Dk) + static_cast<std::size_t>(d)] *
                 c.k.values[static_cast<std::size_t>((c.kv_head(h) * c.Nk + j) * c.Dk + d)];
        t.push_back(dot * scale);
      }
      const double m = *std::max_element(t.begin(), t.end());
      double z = 0, zt = 0;
      for (double tj : t) z += std::exp(tj - m), zt += std::exp(tj - m) * tj;
      const double x = m + std::log(z);
      const double y = static_cast<float>(x + delta * zt / z + shift * uo * std::fabs(x));
      const double sc = lse_scale(p, sp, row_scales(p, c, mags[row]), row_limits(p, c, mags[row]), uo, row, x);
      sample.add(static_cast<std::int64_t>(row), (y - x) / sc, final_share(uo, x, sc));
    }
  if (shared_rows) sample.add_row_shifts(sp.lse_shared);
  return judge(sample);
}

TEST(StatisticsShared, ScaleRoundedOnceForEveryRowPasses) {
  const Case c = shared_case(5, 8, 128, 256, 64);  // 1024 rows
  const double u = unit_roundoff(DType::F32);
  for (double delta : {u, -u, u / 2}) {
    const Tier t = lse_tier(c, delta, 0, true);
    EXPECT_TRUE(t.tested);
    EXPECT_TRUE(t.ok) << delta / u << ": " << t.note;
  }
  // rows taken as independent, the shared rounding fails the mean test
  const Tier without = lse_tier(c, u, 0, false);
  EXPECT_FALSE(without.ok) << without.mean << " / " << without.mean_limit << " rms " << without.rms << " / " << without.rms_limit;
  EXPECT_NE(without.note.find("biased"), std::string::npos) << without.note;
  // the rounding to nearest alone passes with the shift taken
  EXPECT_TRUE(lse_tier(c, 0, 0, true).ok);
}

TEST(StatisticsShared, LseShiftedBeyondTheSharedRoundingsFails) {
  const Case c = shared_case(5, 8, 128, 256, 64);
  const double u = unit_roundoff(DType::F32);
  // lse off by 8 u |lse| on top of the largest shared rounding: more than it can explain
  for (double shift : {8.0, -8.0}) {
    const Tier t = lse_tier(c, shift > 0 ? u : -u, shift, true);
    EXPECT_FALSE(t.ok) << shift;
    EXPECT_NE(t.note.find("biased"), std::string::npos) << t.note;
  }
}

TEST(StatisticsEndToEnd, PTruncatedFailsOnlyByTheBiasTest) {
  const GateRun r = gate_flash_fp16(" --bug p_truncate");
  EXPECT_EQ(r.status, 1) << r.out;
  int biased = 0;
  for (const auto& c : r.report["cases"]) {
    if (c["status"] != "fail") continue;
    EXPECT_EQ(c["failed_elements"], 0) << c["id"];
    if (c["reason"].get<std::string>().find("out: biased toward zero") == std::string::npos) continue;
    ++biased;
    for (const auto& t : c["tensors"])
      if (t["tensor"] == "out") {
        EXPECT_LT(t["tier"]["bias"].get<double>(), -t["tier"]["bias_limit"].get<double>());
      }
  }
  EXPECT_GE(biased, 3) << r.out;
  EXPECT_NE(r.out.find(", bias "), std::string::npos) << r.out;
}

}  // namespace
}  // namespace attnoracle::conformance
