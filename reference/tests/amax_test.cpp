// amax's decision (CONTRACT section 9): F64 bounds of |O| that decide its F32 rounding at once,
// and bounds that straddle an F32 midpoint, resolved by evaluating the candidate rows again.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "amax.hpp"

namespace attnoracle::detail {
namespace {

// An F32 midpoint: 1 + 2^-24 (between 1 and 1 + 2^-23).
constexpr double kMid = 1 + 0x1p-24;

TEST(Amax, BoundsThatDecideAtOnce) {
  int calls = 0;
  const auto never = [&](std::int64_t, mpfr_prec_t) {
    ++calls;
    return std::vector<Enclosure>{};
  };
  // rows of width 2: |O| in [0.5, 0.5], [-3, -2.9999] (magnitude [2.9999, 3]), [1, 1], [0, 0]
  std::vector<double> lo(4), hi(4);
  magnitude(0.5, 0.5, lo[0], hi[0]);
  magnitude(-3, -2.9999999, lo[1], hi[1]);
  magnitude(1, 1, lo[2], hi[2]);
  magnitude(-0.25, 0.125, lo[3], hi[3]);
  EXPECT_EQ(lo[1], 2.9999999);
  EXPECT_EQ(hi[1], 3);
  EXPECT_EQ(lo[3], 0);
  EXPECT_EQ(hi[3], 0.25);
  const AmaxResult r = decide_amax(lo, hi, 2, never, 64, 256);
  EXPECT_TRUE(r.r.decided);
  EXPECT_EQ(r.r.value, 3);  // 2.9999999 and 3 both round to 3 in F32
  EXPECT_EQ(r.precision, 0);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(decide_amax({}, {}, 1, never, 64, 256).r.value, 0);  // an empty output
}

TEST(Amax, StraddlingBoundsEvaluateTheCandidateRowsAgain) {
  // Row 1 may hold the max: its bounds straddle the midpoint. Evaluated again it is exactly
  // above it: amax rounds up to 1 + 2^-23. Row 0 (below the other's lower bound) is not asked.
  const std::vector<double> lo = {0.5, kMid - 0x1p-40}, hi = {0.75, kMid + 0x1p-40};
  std::vector<std::int64_t> asked;
  const auto again = [&](std::int64_t row, mpfr_prec_t p) {
    asked.push_back(row);
    std::vector<Enclosure> out;
    out.emplace_back(p);
    mpfr_set_d(out.back().lo, kMid, MPFR_RNDN);
    mpfr_nextabove(out.back().lo);
    mpfr_set(out.back().hi, out.back().lo, MPFR_RNDN);
    mpfr_nextabove(out.back().hi);
    return out;
  };
  const AmaxResult r = decide_amax(lo, hi, 1, again, 64, 1024);
  EXPECT_TRUE(r.r.decided);
  EXPECT_EQ(r.r.value, 1 + 0x1p-23);
  EXPECT_EQ(r.precision, 128);
  EXPECT_EQ(asked, std::vector<std::int64_t>{1});
}

TEST(Amax, UndecidedAtTheCap) {
  // The exact max is the midpoint itself, never isolated from it: both neighbours reported.
  const std::vector<double> lo = {kMid - 0x1p-40}, hi = {kMid + 0x1p-40};
  const auto again = [&](std::int64_t, mpfr_prec_t p) {
    std::vector<Enclosure> out;
    out.emplace_back(p);
    mpfr_set_d(out.back().lo, kMid, MPFR_RNDN);
    mpfr_set_d(out.back().hi, kMid, MPFR_RNDN);
    mpfr_nextbelow(out.back().lo);
    mpfr_nextabove(out.back().hi);
    return out;
  };
  const AmaxResult r = decide_amax(lo, hi, 1, again, 64, 512);
  EXPECT_FALSE(r.r.decided);
  EXPECT_EQ(r.precision, 512);
  EXPECT_EQ(r.r.value, 1);
  EXPECT_EQ(r.r.alt, 1 + 0x1p-23);
}

}  // namespace
}  // namespace attnoracle::detail
