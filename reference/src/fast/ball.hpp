// Ball arithmetic on double-doubles: a midpoint and an F64 radius that bounds the distance to
// the exact value. Each operation's midpoint error comes from its published bound
// (error_bounds.hpp); each radius formula says in a comment why it holds. Used by the forward
// rows (fast_row.cpp) and the gradients (fast_backward.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dd.hpp"
#include "error_bounds.hpp"
#include "exp_dd.hpp"
#include "simd.hpp"

namespace attnoracle::fast {

// The exact value lies in [mid - rad, mid + rad].
struct Ball {
  DD mid;
  double rad = 0;
};

// A radius computed with rounding to nearest, made an upper bound (error_bounds.hpp).
inline double radius_up(double r) { return r * (1 + kRadiusSlack) + kRadiusFloor; }
// |x| <= |hi| (1 + u) for a normalised double-double.
inline double mag(DD x) { return std::fabs(x.hi) * (1 + kMagRel); }

// Sums and products of balls: the midpoint's own error plus the radii carried through.
inline Ball add(const Ball& a, const Ball& b) {
  const DD m = fast::add(a.mid, b.mid);
  return {m, radius_up(a.rad + b.rad + kAddDD * mag(m))};
}
inline Ball add(const Ball& a, double y) {
  const DD m = fast::add(a.mid, y);
  return {m, radius_up(a.rad + kAddFP * mag(m))};
}
inline Ball neg(const Ball& a) { return {fast::neg(a.mid), a.rad}; }
// ||x| - |m|| <= |x - m|: the same radius holds |x|.
inline Ball abs(const Ball& a) { return a.mid.hi < 0 ? neg(a) : a; }
inline Ball mul(const Ball& a, double y) {
  const DD m = fast::mul(a.mid, y);
  return {m, radius_up(a.rad * std::fabs(y) + kMulFP * mag(m))};
}
// |a b - am bm| <= |am| rb + |bm| ra + ra rb
inline Ball mul(const Ball& a, const Ball& b) {
  const DD m = fast::mul(a.mid, b.mid);
  return {m, radius_up(mag(a.mid) * b.rad + mag(b.mid) * a.rad + a.rad * b.rad + kMulDD * mag(m))};
}
// For bm > 2 rb > 0: |a/b - am/bm| <= (ra + |am/bm| rb) / (bm - rb).
inline Ball div(const Ball& a, const Ball& b) {
  const DD m = fast::div(a.mid, b.mid);
  const double q = mag(m) * (1 + kDivQuotient);  // |am/bm| <= |m| / (1 - kDivDD)
  const double den = std::fabs(b.mid.hi) * (1 - kMagRel) - b.rad;  // >= bm/2: rounding relative
  return {m, radius_up((a.rad + q * b.rad) / den + kDivDD * mag(m))};
}
// exp(am + d) = exp(am) e^d and |e^d - 1| <= r (1 + r) for |d| <= r <= 1.
// exp_ball(a, exp_dd(a.mid)) is exp(a), for a.mid.hi >= kExpMin.
inline Ball exp_ball(const Ball& a, DD m) {
  const double e = mag(m) * (1 + kExpMid);  // exp(am) <= |m| / (1 - kExpRel)
  return {m, radius_up(e * (a.rad * (1 + a.rad) + kExpRel))};
}
inline Ball exp(const Ball& a) {
  if (a.mid.hi < kExpMin) return {DD{}, kTinyExp};  // exp(a) < exp(kExpMin + 2 kExpMaxRad) <= kTinyExp
  return exp_ball(a, exp_dd(a.mid));
}
// Whether exp's ball rule and exp_dd's range hold for a (else the caller goes to MPFR).
inline bool exp_applies(const Ball& a) { return a.rad <= kExpMaxRad && a.mid.hi <= kExpMax; }

// sum_d q[d] k[d] by Dot2: s + c encloses the dot within gamma_n^2 sum |q_d k_d| (Ogita, Rump,
// Oishi), used with factor 2; sum |q_d k_d| is itself rounded, by at most gamma_n relative.
inline double dot2_factor(std::int64_t len) {
  const double n = static_cast<double>(len);
  const double gam = n * kU / (1 - n * kU);
  return 2 * gam * gam * (1 + 2 * gam);
}
// The ball of Dot2's running sum sh, compensation sl and rounded sum |q_d k_d| sabs.
inline Ball dot2_ball(double sh, double sl, double sabs, double dot_factor) {
  return {two_sum(sh, sl), radius_up(dot_factor * sabs)};
}
inline Ball dot2(const double* q, const double* k, std::int64_t len) {
  const double dot_factor = dot2_factor(len);
  double sh = 0, sl = 0, sabs = 0;
  for (std::int64_t d = 0; d < len; ++d) {
    const DD p = two_prod(q[d], k[d]);
    const DD t = two_sum(sh, p.hi);
    sh = t.hi;
    sl += t.lo + p.lo;
    sabs += std::fabs(p.hi);
  }
  return dot2_ball(sh, sl, sabs, dot_factor);
}

// Column sums S_c = sum_j x_j y_jc for balls x_j and doubles y_jc, accumulated like Dot2 on the
// midpoints' high parts (TwoProd, TwoSum, error-free) plus, in plain F64, their residuals and the
// low parts' products. Only that F64 chain rounds: with a running error bound each of its three
// roundings per key misses at most u times its own computed result, so the error is within
// u E_c, E_c = sum_j (|a_j| + |w_j| + |lo_j|) (docs/PROOFS.md, section 9), plus the radii's share
// sum_j x_j.rad |y_jc|; E_c and that sum are themselves rounded (gamma_{n+2} relative). Exactly
// zero balls are left out (they add nothing), and a column whose every y is 0 is an exact 0.
class BallSums {
 public:
  explicit BallSums(std::size_t columns = 0)
      : hi_(columns), lo_(columns), errsum_(columns), radsum_(columns), ymax_(columns) {}
  std::size_t size() const { return hi_.size(); }

  // x y_c added to every column c: the columns are independent lanes (the same operations in
  // the same order in each), run in SIMD lanes without changing a bit (simd.cpp).
  void add(const Ball& x, const double* y, bool absolute = false) {
    if (x.mid.hi == 0 && x.rad == 0) return;
    ++n_;
    ball_sum_lanes(hi_.size(), y, absolute, x.mid.hi, x.mid.lo, x.rad, hi_.data(), lo_.data(), errsum_.data(),
                   radsum_.data(), ymax_.data());
  }
  // x |y_c| added to every column c.
  void add_abs(const Ball& x, const double* y) { add(x, y, true); }
  // add(x[a], y[a], absolute) for a in [0, n), in that order, in one pass over the columns.
  void add(std::size_t n, const Ball* x, const double* const* y, bool absolute = false) {
    th_.clear(), tl_.clear(), tr_.clear(), ty_.clear();
    for (std::size_t a = 0; a < n; ++a) {
      if (x[a].mid.hi == 0 && x[a].rad == 0) continue;
      th_.push_back(x[a].mid.hi), tl_.push_back(x[a].mid.lo), tr_.push_back(x[a].rad), ty_.push_back(y[a]);
    }
    n_ += static_cast<std::int64_t>(th_.size());
    ball_sum_terms(hi_.size(), th_.size(), ty_.data(), absolute, th_.data(), tl_.data(), tr_.data(), hi_.data(),
                   lo_.data(), errsum_.data(), radsum_.data(), ymax_.data());
  }
  Ball ball(std::size_t c) const {
    if (n_ == 0 || ymax_[c] == 0) return {};
    const double nk = static_cast<double>(n_) + 2;
    const double gk = nk * kU / (1 - nk * kU);
    return {two_sum(hi_[c], lo_[c]), radius_up((radsum_[c] + kU * errsum_[c]) * (1 + 2 * gk))};
  }

 private:
  std::vector<double> hi_, lo_, errsum_, radsum_, ymax_;
  std::int64_t n_ = 0;
  std::vector<double> th_, tl_, tr_;  // the nonzero terms of add(n, x, y)
  std::vector<const double*> ty_;
};

}  // namespace attnoracle::fast
