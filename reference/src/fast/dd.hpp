// Double-double ("double-word") arithmetic with the error-free transformations it rests on.
// Relative error bounds, with u = 2^-53, from Joldes, Muller and Popescu, "Tight and rigorous
// error bounds for basic building blocks of double-word arithmetic", ACM TOMS 44(2), 2017
// (JMP below); the constants the fast path uses are in error_bounds.hpp, each above the
// published bound. Valid without underflow and overflow, which the fast path rules out first.
// Compiled with -ffp-contract=off: a fused a*b+c would break the error-free transformations.
#pragma once

#include <cmath>

namespace attnoracle::fast {

struct DD {
  double hi = 0, lo = 0;  // value hi + lo with |lo| <= ulp(hi) / 2
};

// s + e = a + b exactly (Knuth's TwoSum).
inline DD two_sum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  return {s, (a - (s - bb)) + (b - bb)};
}

// s + e = a + b exactly, when |a| >= |b| or a = 0 (Dekker's Fast2Sum).
inline DD fast_two_sum(double a, double b) {
  const double s = a + b;
  return {s, b - (s - a)};
}

// p + e = a * b exactly (the fma computes the product's error exactly).
inline DD two_prod(double a, double b) {
  const double p = a * b;
  return {p, std::fma(a, b, -p)};
}

// DWPlusFP (JMP Algorithm 4): relative error <= 2u^2.
inline DD add(DD x, double y) {
  const DD s = two_sum(x.hi, y);
  return fast_two_sum(s.hi, x.lo + s.lo);
}

// AccurateDWPlusDW (JMP Algorithm 6): relative error <= 3u^2 / (1 - 4u).
inline DD add(DD x, DD y) {
  const DD s = two_sum(x.hi, y.hi);
  const DD t = two_sum(x.lo, y.lo);
  const DD v = fast_two_sum(s.hi, s.lo + t.hi);
  return fast_two_sum(v.hi, t.lo + v.lo);
}

inline DD neg(DD x) { return {-x.hi, -x.lo}; }

// DWTimesFP3 (JMP Algorithm 9, with fma): relative error <= 2u^2.
inline DD mul(DD x, double y) {
  const DD c = two_prod(x.hi, y);
  const double cl3 = std::fma(x.lo, y, c.lo);
  return fast_two_sum(c.hi, cl3);
}

// DWTimesDW3 (JMP Algorithm 12, with fma): relative error <= 5u^2.
inline DD mul(DD x, DD y) {
  const DD c = two_prod(x.hi, y.hi);
  const double tl0 = x.lo * y.lo;
  const double tl1 = std::fma(x.hi, y.lo, tl0);
  const double cl2 = std::fma(x.lo, y.hi, tl1);
  const double cl3 = c.lo + cl2;
  return fast_two_sum(c.hi, cl3);
}

// DWDivDW2 (JMP Algorithm 17), with DWTimesFP3 inside where the paper uses DWTimesFP1: the
// paper's 15u^2 + 56u^3 is for its variant; this one is proven within 12u^2
// (reference/proofs/dd_div.g).
inline DD div(DD x, DD y) {
  const double th = x.hi / y.hi;
  const DD r = mul(y, th);
  const double pih = x.hi - r.hi;
  const double dl = x.lo - r.lo;
  const double d = pih + dl;
  const double tl = d / y.hi;
  return fast_two_sum(th, tl);
}

// 2^k x, exact while both parts stay normal.
inline DD scale2(DD x, int k) { return {std::ldexp(x.hi, k), std::ldexp(x.lo, k)}; }

}  // namespace attnoracle::fast
