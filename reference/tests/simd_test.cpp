// The fast path's SIMD loops (fast/simd.cpp) against the scalar code they replace: every
// instruction set Highway compiled and this processor runs must give the same bits, so that the
// golden bytes do not depend on the machine.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fast/ball.hpp"
#include "fast/exp_dd.hpp"
#include "fast/fast_row.hpp"
#include "fast/simd.hpp"

namespace attnoracle::testing {
namespace {

using fast::kKeyBlock;

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Runs f once under each instruction set this processor supports (then restores the default).
template <class F>
void for_each_target(F f) {
  for (const std::int64_t t : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    f(std::string(fast::simd_target()));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// A double of magnitude 2^e, e drawn in [lo, hi], with a random significand and sign.
rc::Gen<double> scaled(int lo, int hi) {
  return rc::gen::map(rc::gen::tuple(rc::gen::inRange(lo, hi + 1), rc::gen::inRange<std::int64_t>(0, 1LL << 52),
                                     rc::gen::arbitrary<bool>()),
                      [](const std::tuple<int, std::int64_t, bool>& t) {
                        const double m = 1 + static_cast<double>(std::get<1>(t)) * 0x1p-52;
                        return (std::get<2>(t) ? -1 : 1) * std::ldexp(m, std::get<0>(t));
                      });
}

TEST(Simd, EveryTargetIsTested) {
  std::vector<std::string> names;
  for_each_target([&](const std::string& name) { names.push_back(name); });
  ASSERT_FALSE(names.empty());
  std::string all;
  for (const auto& n : names) all += n + " ";
  std::printf("instruction sets tested: %s\n", all.c_str());
}

RC_GTEST_PROP(Simd, Dot2BlocksMatchesScalarDot2, ()) {
  const auto len = *rc::gen::inRange<std::int64_t>(1, 140);
  const auto blocks = *rc::gen::inRange<std::int64_t>(1, 4);
  const int spread = *rc::gen::element(2, 60, 400);  // magnitudes 2^-spread .. 2^spread
  const auto q = *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(len), scaled(-spread, spread));
  const auto kt = *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(len * blocks) * kKeyBlock,
                                                           scaled(-spread, spread));
  const std::size_t n = static_cast<std::size_t>(blocks) * kKeyBlock;
  std::vector<double> h0(n), l0(n), a0(n);
  fast::dot2_blocks_scalar(q.data(), kt.data(), len, blocks, h0.data(), l0.data(), a0.data());
  // The block code is ball.hpp's dot2 on each key.
  for (std::size_t o = 0; o < n; ++o) {
    std::vector<double> k(static_cast<std::size_t>(len));
    const std::size_t b = o / kKeyBlock, l = o % kKeyBlock;
    for (std::int64_t e = 0; e < len; ++e) k[static_cast<std::size_t>(e)] = kt[(b * static_cast<std::size_t>(len) + static_cast<std::size_t>(e)) * kKeyBlock + l];
    const fast::Ball want = fast::dot2(q.data(), k.data(), len);
    const fast::Ball got = fast::dot2_ball(h0[o], l0[o], a0[o], fast::dot2_factor(len));
    RC_ASSERT(same_bits(want.mid.hi, got.mid.hi) && same_bits(want.mid.lo, got.mid.lo) && same_bits(want.rad, got.rad));
  }
  for_each_target([&](const std::string& target) {
    std::vector<double> h(n), l(n), a(n);
    fast::dot2_blocks(q.data(), kt.data(), len, blocks, h.data(), l.data(), a.data());
    for (std::size_t o = 0; o < n; ++o) {
      if (!(same_bits(h[o], h0[o]) && same_bits(l[o], l0[o]) && same_bits(a[o], a0[o])))
        RC_FAIL("dot2_blocks differs under " + target + " at key " + std::to_string(o));
    }
  });
}

// With inputs of short significands (F32 values here, sometimes one element of 27 bits), the
// exact-product Dot2 gives the general one's values where short_significands allows it, and the
// lanes give the scalar code's bits.
RC_GTEST_PROP(Simd, Dot2BlocksWithExactProductsMatchesDot2, ()) {
  const auto len = *rc::gen::inRange<std::int64_t>(1, 140);
  const auto blocks = *rc::gen::inRange<std::int64_t>(1, 4);
  const int spread = *rc::gen::element(2, 60, 120);
  const auto f32 = rc::gen::map(scaled(-spread, spread), [](double x) { return static_cast<double>(static_cast<float>(x)); });
  auto q = *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(len), f32);
  auto kt = *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(len * blocks) * kKeyBlock, f32);
  if (*rc::gen::element(0, 1, 2, 3) == 0) {  // one element with a 27-bit significand
    auto& x = *rc::gen::element(0, 1) ? q[0] : kt[kt.size() / 2];
    x = (x == 0 ? 1.0 : x) * (1 + 0x1p-26);
  }
  const bool exact = fast::short_significands(q.data(), q.size()) && fast::short_significands(kt.data(), kt.size());
  RC_ASSERT(exact == (std::all_of(q.begin(), q.end(), [](double x) { return x == static_cast<float>(x); }) &&
                      std::all_of(kt.begin(), kt.end(), [](double x) { return x == static_cast<float>(x); })));
  RC_PRE(exact);
  const std::size_t n = static_cast<std::size_t>(blocks) * kKeyBlock;
  std::vector<double> h0(n), l0(n), a0(n), h1(n), l1(n), a1(n);
  fast::dot2_blocks_scalar(q.data(), kt.data(), len, blocks, h0.data(), l0.data(), a0.data());
  fast::dot2_blocks_scalar(q.data(), kt.data(), len, blocks, h1.data(), l1.data(), a1.data(), true);
  for (std::size_t o = 0; o < n; ++o)
    RC_ASSERT(same_bits(h1[o], h0[o]) && l1[o] == l0[o] && same_bits(a1[o], a0[o]));
  for_each_target([&](const std::string& target) {
    std::vector<double> h(n), l(n), a(n);
    fast::dot2_blocks(q.data(), kt.data(), len, blocks, h.data(), l.data(), a.data(), true);
    for (std::size_t o = 0; o < n; ++o)
      if (!(same_bits(h[o], h1[o]) && same_bits(l[o], l1[o]) && same_bits(a[o], a1[o])))
        RC_FAIL("dot2_blocks with exact products differs under " + target + " at key " + std::to_string(o));
  });
}

RC_GTEST_PROP(Simd, ExpDDManyMatchesExpDD, ()) {
  const auto count = *rc::gen::inRange<std::size_t>(1, 80);
  std::vector<double> xh(count), xl(count);
  for (std::size_t i = 0; i < count; ++i) {
    // Arguments across [kExpMin, kExpMax], with a low part below half an ulp of the high part.
    xh[i] = fast::kExpMin + (fast::kExpMax - fast::kExpMin) * (*rc::gen::inRange(0, 1 << 30)) * 0x1p-30;
    if (*rc::gen::element(0, 1, 2) == 0) xh[i] = std::nearbyint(xh[i] * 4) / 4;  // near k ln2 cuts too
    xl[i] = std::ldexp(*rc::gen::inRange(-(1 << 20), 1 << 20) * 0x1p-20, std::ilogb(xh[i] == 0 ? 1 : xh[i]) - 54);
  }
  for_each_target([&](const std::string& target) {
    std::vector<double> rh(count), rl(count);
    fast::exp_dd_many(xh.data(), xl.data(), count, rh.data(), rl.data());
    for (std::size_t i = 0; i < count; ++i) {
      const fast::DD want = fast::exp_dd(fast::DD{xh[i], xl[i]});
      if (!(same_bits(rh[i], want.hi) && same_bits(rl[i], want.lo)))
        RC_FAIL("exp_dd_many differs under " + target + " at x = " + std::to_string(xh[i]));
    }
  });
}

RC_GTEST_PROP(Simd, BallSumLanesMatchScalar, ()) {
  const auto cols = *rc::gen::inRange<std::size_t>(1, 70);
  const auto keys = *rc::gen::inRange(1, 12);
  const bool absolute = *rc::gen::arbitrary<bool>();
  std::vector<std::vector<double>> y(static_cast<std::size_t>(keys));
  std::vector<fast::Ball> x(static_cast<std::size_t>(keys));
  for (int j = 0; j < keys; ++j) {
    y[static_cast<std::size_t>(j)] = *rc::gen::container<std::vector<double>>(cols, scaled(-30, 30));
    const double h = std::fabs(*scaled(-40, 0));
    x[static_cast<std::size_t>(j)] = {fast::DD{h, h * *rc::gen::inRange(-1000, 1000) * 0x1p-63}, h * 0x1p-70};
  }
  std::vector<double> s0(cols * 5, 0.0);
  for (int j = 0; j < keys; ++j) {
    const auto& b = x[static_cast<std::size_t>(j)];
    fast::ball_sum_lanes_scalar(0, cols, y[static_cast<std::size_t>(j)].data(), absolute, b.mid.hi, b.mid.lo, b.rad,
                                s0.data(), s0.data() + cols, s0.data() + 2 * cols, s0.data() + 3 * cols,
                                s0.data() + 4 * cols);
  }
  for_each_target([&](const std::string& target) {
    std::vector<double> s(cols * 5, 0.0);
    for (int j = 0; j < keys; ++j) {
      const auto& b = x[static_cast<std::size_t>(j)];
      fast::ball_sum_lanes(cols, y[static_cast<std::size_t>(j)].data(), absolute, b.mid.hi, b.mid.lo, b.rad,
                           s.data(), s.data() + cols, s.data() + 2 * cols, s.data() + 3 * cols, s.data() + 4 * cols);
    }
    for (std::size_t i = 0; i < s.size(); ++i)
      if (!same_bits(s[i], s0[i])) RC_FAIL("ball_sum_lanes differs under " + target + " at " + std::to_string(i));
  });
}

// Many terms in one pass: the bits of one ball_sum_lanes_scalar step per term, under every
// target (columns past four vectors of lanes, and a remainder); BallSums' add of many terms is
// its add term after term, exact zeros left out alike.
RC_GTEST_PROP(Simd, BallSumTermsMatchScalar, ()) {
  const auto cols = *rc::gen::inRange<std::size_t>(1, 140);
  const auto n = *rc::gen::inRange<std::size_t>(0, 12);
  const bool absolute = *rc::gen::arbitrary<bool>();
  std::vector<std::vector<double>> y(n);
  std::vector<const double*> rows(n);
  std::vector<fast::Ball> x(n);
  std::vector<double> xh(n), xl(n), xr(n);
  for (std::size_t a = 0; a < n; ++a) {
    y[a] = *rc::gen::container<std::vector<double>>(cols, scaled(-30, 30));
    rows[a] = y[a].data();
    const double h = *rc::gen::element(0.0, 1.0) * *scaled(-40, 0);  // some exact zeros
    x[a] = {fast::DD{h, h * *rc::gen::inRange(-1000, 1000) * 0x1p-63}, std::fabs(h) * 0x1p-70};
    xh[a] = x[a].mid.hi, xl[a] = x[a].mid.lo, xr[a] = x[a].rad;
  }
  std::vector<double> s0(cols * 5, 0.0);
  for (std::size_t a = 0; a < n; ++a)
    fast::ball_sum_lanes_scalar(0, cols, rows[a], absolute, xh[a], xl[a], xr[a], s0.data(), s0.data() + cols,
                                s0.data() + 2 * cols, s0.data() + 3 * cols, s0.data() + 4 * cols);
  for_each_target([&](const std::string& target) {
    std::vector<double> s(cols * 5, 0.0);
    fast::ball_sum_terms(cols, n, rows.data(), absolute, xh.data(), xl.data(), xr.data(), s.data(), s.data() + cols,
                         s.data() + 2 * cols, s.data() + 3 * cols, s.data() + 4 * cols);
    for (std::size_t i = 0; i < s.size(); ++i)
      if (!same_bits(s[i], s0[i])) RC_FAIL("ball_sum_terms differs under " + target + " at " + std::to_string(i));
  });
  fast::BallSums one(cols), many(cols);
  for (std::size_t a = 0; a < n; ++a) one.add(x[a], rows[a], absolute);
  many.add(n, x.data(), rows.data(), absolute);
  for (std::size_t c = 0; c < cols; ++c) {
    const fast::Ball p = one.ball(c), q = many.ball(c);
    RC_ASSERT(same_bits(p.mid.hi, q.mid.hi));
    RC_ASSERT(same_bits(p.mid.lo, q.mid.lo));
    RC_ASSERT(same_bits(p.rad, q.rad));
  }
}

// The P V column sums in lanes against the scalar code, and the scalar code against the blocks
// it stands for: each block of kSumBlock rows summed from zero (Dot2's steps), its TwoSum added
// to the column's double-double total.
RC_GTEST_PROP(Simd, PVSumsMatchScalarBlocks, ()) {
  const auto cols = *rc::gen::inRange<std::size_t>(1, 70);
  const auto n = *rc::gen::inRange<std::size_t>(0, 200);  // past three blocks of rows (64)
  const auto nrows = *rc::gen::inRange<std::size_t>(1, 40);
  const auto y = *rc::gen::container<std::vector<double>>(nrows * cols, scaled(-30, 30));
  std::vector<std::int64_t> rows(n);
  std::vector<double> xh(n), xl(n);
  for (std::size_t a = 0; a < n; ++a) {
    rows[a] = *rc::gen::inRange<std::int64_t>(0, static_cast<std::int64_t>(nrows));
    xh[a] = std::fabs(*scaled(-40, 0));
    xl[a] = xh[a] * *rc::gen::inRange(-1000, 1000) * 0x1p-63;
  }
  // The blocks written out: column by column, with dd.hpp's operations.
  std::vector<double> want(cols * 4, 0.0);
  for (std::size_t c = 0; c < cols; ++c)
    for (int absolute = 0; absolute < 2; ++absolute) {
      fast::DD total{};
      for (std::size_t a0 = 0; a0 < n; a0 += fast::kSumBlock) {
        double hi = 0, lo = 0;
        for (std::size_t a = a0; a < std::min(n, a0 + fast::kSumBlock); ++a) {
          const double v = y[static_cast<std::size_t>(rows[a]) * cols + c], yc = absolute ? std::fabs(v) : v;
          const fast::DD p = fast::two_prod(xh[a], yc);
          const fast::DD t = fast::two_sum(hi, p.hi);
          hi = t.hi;
          lo = lo + std::fma(xl[a], yc, t.lo + p.lo);
        }
        total = fast::add(total, fast::two_sum(hi, lo));
      }
      want[(2 * absolute) * cols + c] = total.hi;
      want[(2 * absolute + 1) * cols + c] = total.lo;
    }
  auto check = [&](const std::vector<double>& s, const std::string& what) {
    for (int k = 0; k < 4; ++k)
      for (std::size_t c = 0; c < cols; ++c)
        if (!same_bits(s[static_cast<std::size_t>(k) * cols + c], want[static_cast<std::size_t>(k) * cols + c]))
          RC_FAIL(what + " differs in sum " + std::to_string(k) + ", column " + std::to_string(c));
  };
  auto columns = [&](std::vector<double>& s) {
    return fast::PVColumns{s.data(), s.data() + cols, s.data() + 2 * cols, s.data() + 3 * cols};
  };
  std::vector<double> s0(cols * 4, 0.0);
  fast::pv_sums_scalar(0, cols, n, y.data(), rows.data(), cols, xh.data(), xl.data(), columns(s0));
  check(s0, "pv_sums_scalar");
  for_each_target([&](const std::string& target) {
    std::vector<double> s(cols * 4, 0.0);
    fast::pv_sums(cols, n, y.data(), rows.data(), cols, xh.data(), xl.data(), columns(s));
    check(s, "pv_sums under " + target);
  });
}

// The balls' ends rounded outwards to F64 (the oracle's intervals) in lanes against fast_row.hpp's
// lower(), upper() and their roundings: exact balls, zero midpoints, radii from far below an ulp
// to past the midpoint.
RC_GTEST_PROP(Simd, BallEndsMatchScalarEnds, ()) {
  const auto n = *rc::gen::inRange<std::size_t>(0, 40);
  std::vector<fast::Ball> balls(n);
  for (auto& b : balls) {
    const int kind = *rc::gen::inRange(0, 8);
    const double hi = kind == 0 ? 0.0 : *scaled(-60, 60);
    const double lo = hi * *rc::gen::inRange(-1000, 1000) * 0x1p-63;
    const double rad = kind == 1 ? 0.0 : std::ldexp(std::fabs(kind == 0 ? 1.0 : hi), -*rc::gen::inRange(-2, 110));
    b = {fast::DD{hi, lo}, rad};
  }
  std::vector<double> lo0(n), hi0(n);
  for (std::size_t i = 0; i < n; ++i) {
    lo0[i] = fast::round_down_dd(fast::lower(balls[i]));
    hi0[i] = fast::round_up_dd(fast::upper(balls[i]));
  }
  for_each_target([&](const std::string& target) {
    std::vector<double> lo(n), hi(n);
    fast::ball_ends(reinterpret_cast<const double*>(balls.data()), n, lo.data(), hi.data());
    for (std::size_t i = 0; i < n; ++i)
      if (!same_bits(lo[i], lo0[i]) || !same_bits(hi[i], hi0[i]))
        RC_FAIL("ball_ends under " + target + " differs at " + std::to_string(i));
  });
}


// The input scans of prepare(): range and short significands over values of every kind (zeros
// of both signs, the range's ends and their neighbours, subnormals, infinities, NaN, F32
// values and full F64 ones), and the column ranges, with ties between zeros of either sign.
RC_GTEST_PROP(Simd, InputScansMatchScalar, ()) {
  const auto n = *rc::gen::inRange<std::size_t>(0, 70);
  const double specials[] = {0.0, -0.0, fast::kMinInput, -fast::kMaxInput, std::nextafter(fast::kMinInput, 0.0),
                             std::nextafter(fast::kMaxInput, INFINITY), 0x1p-1074, INFINITY, -INFINITY,
                             std::nan(""), 1.0, -2.5};
  std::vector<double> x(n);
  // 0: anything, 1: in range F32 values, 2: in range F64 values, 3: few values, many ties
  const int mode = *rc::gen::inRange(0, 4);
  for (auto& e : x) {
    const int kind = *rc::gen::inRange(0, 10);
    if (mode == 0 && kind < 3) e = specials[*rc::gen::inRange<std::size_t>(0, std::size(specials))];
    else if (mode == 3) e = *rc::gen::element(0.0, -0.0, 1.0, 2.0);
    else if (mode == 1 || kind < 6) e = static_cast<double>(static_cast<float>(*scaled(-100, 100)));
    else e = *scaled(-500, 500);
    if (mode > 0 && kind == 9) e = *rc::gen::element(0.0, -0.0);
  }
  const std::size_t nd = *rc::gen::inRange<std::size_t>(1, 20), rows = n / nd;
  std::vector<double> r0(4 * nd);
  for (std::size_t c = 0; c < nd; ++c) r0[c] = INFINITY, r0[nd + c] = -INFINITY, r0[2 * nd + c] = INFINITY, r0[3 * nd + c] = 0;
  std::vector<double> want = r0;
  if (mode > 0)  // the ranges are taken of in-range values only
    fast::value_ranges_scalar(0, nd, rows, x.data(), want.data(), want.data() + nd, want.data() + 2 * nd, want.data() + 3 * nd);
  for_each_target([&](const std::string& target) {
    if (fast::out_of_range(x.data(), n) != fast::out_of_range_scalar(x.data(), n))
      RC_FAIL("out_of_range under " + target);
    if (fast::short_significands(x.data(), n) != (fast::low_bits_scalar(x.data(), n) == 0))
      RC_FAIL("short_significands under " + target);
    bool short_sig = false;  // the fused scans: the same count and the same ranges
    if (fast::input_scan(x.data(), n, short_sig) != fast::out_of_range_scalar(x.data(), n) ||
        short_sig != (fast::low_bits_scalar(x.data(), n) == 0))
      RC_FAIL("input_scan under " + target);
    std::vector<double> scanned = r0;
    if (fast::value_scan(nd, rows, x.data(), scanned.data(), scanned.data() + nd, scanned.data() + 2 * nd,
                         scanned.data() + 3 * nd) != fast::out_of_range_scalar(x.data(), rows * nd))
      RC_FAIL("value_scan's count under " + target);
    if (mode == 0) return;
    for (std::size_t k = 0; k < scanned.size(); ++k)
      if (!same_bits(scanned[k], want[k])) RC_FAIL("value_scan under " + target + " differs at " + std::to_string(k));
    std::vector<double> got = r0;
    fast::value_ranges(nd, rows, x.data(), got.data(), got.data() + nd, got.data() + 2 * nd, got.data() + 3 * nd);
    for (std::size_t k = 0; k < got.size(); ++k)
      if (!same_bits(got[k], want[k])) RC_FAIL("value_ranges under " + target + " differs at " + std::to_string(k));
  });
}

TEST(Simd, InputScansByHand) {
  std::vector<double> x(19, 1.5);  // past two vectors of 8 lanes
  EXPECT_EQ(fast::out_of_range(x.data(), x.size()), 0u);
  EXPECT_TRUE(fast::short_significands(x.data(), x.size()));
  x[17] = std::nan("");
  x[3] = 0x1p-481;
  EXPECT_EQ(fast::out_of_range(x.data(), x.size()), 2u);
  x[9] = 1 + 0x1p-40;  // a significand of 41 bits
  EXPECT_FALSE(fast::short_significands(x.data(), x.size()));
  // [3 rows, 19 columns], every column as the first two: -0 before 0 stays the minimum (and
  // 0 before -0), as std::min keeps the first of equal values; likewise std::max
  const std::size_t nd = 19;
  std::vector<double> v(3 * nd);
  for (std::size_t c = 0; c < nd; ++c) {
    const bool even = c % 2 == 0;
    v[c] = even ? -0.0 : 3, v[nd + c] = even ? 0.0 : -4, v[2 * nd + c] = even ? 0.0 : 1;
  }
  std::vector<double> vmin(nd, INFINITY), vmax(nd, -INFINITY), amin(nd, INFINITY), amax(nd, 0);
  for_each_target([&](const std::string&) {
    std::fill(vmin.begin(), vmin.end(), INFINITY), std::fill(vmax.begin(), vmax.end(), -INFINITY);
    std::fill(amin.begin(), amin.end(), INFINITY), std::fill(amax.begin(), amax.end(), 0);
    fast::value_ranges(nd, 3, v.data(), vmin.data(), vmax.data(), amin.data(), amax.data());
    for (std::size_t c = 0; c < nd; ++c) {
      if (c % 2 == 0) {
        EXPECT_TRUE(same_bits(vmin[c], -0.0)) << c;
        EXPECT_TRUE(same_bits(vmax[c], -0.0)) << c;  // then 0 and -0 are not larger
        EXPECT_TRUE(same_bits(amin[c], 0.0) && same_bits(amax[c], 0.0)) << c;
      } else {
        EXPECT_EQ(vmin[c], -4) << c;
        EXPECT_EQ(vmax[c], 3) << c;
        EXPECT_EQ(amin[c], 1) << c;
        EXPECT_EQ(amax[c], 4) << c;
      }
    }
  });
}

// The row's per-key ball steps (score_balls, exp_args, exp_balls, ball_total, mul_balls)
// against ball.hpp's operations, chained as row_weights chains them, with biases zero and not,
// and rows with a key whose radius overflows, whose radius is past exp's ball rule, or whose
// weight is tiny.
RC_GTEST_PROP(Simd, RowBallStepsMatchScalarBalls, ()) {
  const auto n = *rc::gen::inRange<std::size_t>(0, 40);
  // One key of the row may be made to break a rule: 1, its radius overflows; 2, its radius is
  // past exp's rule; 3, its dot is far below the others', so that its weight is tiny.
  const int fault = n ? *rc::gen::element(0, 1, 2, 3) : 0;
  const std::size_t at = n ? *rc::gen::inRange<std::size_t>(0, n) : 0;
  std::vector<double> sh(n), sl(n), sabs(n), bias(n);
  for (std::size_t a = 0; a < n; ++a) {
    sh[a] = *scaled(-30, 4);
    if (fault == 3 && a == at) sh[a] = -std::fabs(*scaled(16, 17));
    sl[a] = sh[a] * *rc::gen::inRange(-1000, 1000) * 0x1p-63;
    sabs[a] = std::ldexp(std::fabs(sh[a]), *rc::gen::inRange(0, 20));
    if (fault == 1 && a == at) sabs[a] = INFINITY;
    if (fault == 2 && a == at) sabs[a] = 0x1p100;
    bias[a] = *rc::gen::inRange(0, 2) ? 0.0 : *scaled(-8, 8);
  }
  const bool with_bias = *rc::gen::arbitrary<bool>();
  // Radii from exact (0) to half the midpoint, so that every term of a product's radius counts.
  const auto ball = [](int lo, int hi) {
    const double mid = *scaled(lo, hi);
    const int r = *rc::gen::element(0, 1, 2, 3);
    const double rad = r == 0 ? 0.0 : std::ldexp(std::fabs(mid), -*rc::gen::inRange(r == 1 ? 1 : 30, r == 3 ? 110 : 60));
    return fast::Ball{fast::DD{mid, mid * *rc::gen::inRange(-1000, 1000) * 0x1p-63}, rad};
  };
  const fast::Ball scale = ball(-4, 0);
  const double factor = fast::dot2_factor(*rc::gen::inRange<std::int64_t>(1, 256));
  const fast::Ball y = ball(-4, 4);

  struct Steps {
    std::vector<double> v;
    bool score_ok = false, args_ok = false;
    double m = 0;
  };
  // Parts: dot 0-2, score 3-5, x 6-8, xh xl 9-10, eh el 11-12, e 13-15, w 16-18, then Z.
  const auto run = [&](bool lanes) {
    Steps s;
    s.v.assign(19 * n + 1, 0.0);
    const auto p = [&](std::size_t k) { return s.v.data() + k * n; };
    const auto balls = [&](std::size_t k) { return fast::BallArrays{p(k), p(k + 1), p(k + 2)}; };
    const double* b = with_bias ? bias.data() : nullptr;
    s.score_ok = lanes ? fast::score_balls(n, sh.data(), sl.data(), sabs.data(), b, factor, scale, balls(0),
                                           balls(3), &s.m)
                       : fast::score_balls_scalar(0, n, sh.data(), sl.data(), sabs.data(), b, factor, scale,
                                                  balls(0), balls(3), &s.m);
    const double m = std::isfinite(s.m) ? s.m : 0;
    s.args_ok = lanes ? fast::exp_args(n, balls(3), m, balls(6), p(9), p(10))
                      : fast::exp_args_scalar(0, n, balls(3), m, balls(6), p(9), p(10));
    for (std::size_t a = 0; a < n; ++a) {  // exp_dd's range, so that the steps after run on anything
      p(9)[a] = std::clamp(p(9)[a], fast::kExpMin, fast::kExpMax);
      if (!std::isfinite(p(10)[a]) || p(9)[a] != p(6)[a]) p(10)[a] = 0;
    }
    fast::exp_dd_many(p(9), p(10), n, p(11), p(12));
    if (lanes) fast::exp_balls(n, balls(6), p(11), p(12), balls(13));
    else fast::exp_balls_scalar(0, n, balls(6), p(11), p(12), balls(13));
    const fast::Ball z = lanes ? fast::ball_total(n, balls(13)) : fast::ball_total_scalar(n, balls(13));
    s.v.back() = z.mid.hi;  // the total's three doubles replace the last one and follow it
    s.v.insert(s.v.end(), {z.mid.lo, z.rad});
    if (lanes) fast::mul_balls(n, balls(13), y, balls(16));
    else fast::mul_balls_scalar(0, n, balls(13), y, balls(16));
    return s;
  };
  const Steps want = run(false);
  bool tiny = false;
  for (std::size_t a = 0; a < n; ++a) tiny = tiny || want.v[6 * n + a] < fast::kExpMin;
  RC_CLASSIFY(!want.score_ok, "a score overflows");
  RC_CLASSIFY(want.score_ok && !want.args_ok, "exp's rule fails");
  RC_CLASSIFY(tiny, "a tiny weight");
  RC_ASSERT(fault != 1 || !want.score_ok);
  RC_ASSERT(fault != 2 || !want.args_ok);
  RC_ASSERT(fault != 3 || n == 1 || tiny);  // one key alone is the maximum
  for_each_target([&](const std::string& target) {
    const Steps got = run(true);
    RC_ASSERT(got.score_ok == want.score_ok);
    RC_ASSERT(got.args_ok == want.args_ok);
    if (want.score_ok) RC_ASSERT(same_bits(got.m, want.m));
    for (std::size_t k = 0; k < want.v.size(); ++k)
      if (!same_bits(got.v[k], want.v[k]) && !(std::isnan(got.v[k]) && std::isnan(want.v[k])))
        RC_FAIL("row ball steps under " + target + " differ in part " + std::to_string(n ? k / n : 0) +
                ", key " + std::to_string(n ? k % n : 0));
  });
}

}  // namespace
}  // namespace attnoracle::testing
