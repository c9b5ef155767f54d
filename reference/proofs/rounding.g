# Rounding to nearest in binary64 (IEEE 754, ties to even, with subnormals): the facts every
# other proof and every a-priori bound of the fast path rest on.
#   (1) Relative error: for |x| >= 2^-1021, RN(x) = x (1 + d) with |d| <= u = 2^-53.
#       (Gappa needs |x| >= 2^-1021 for its relative theorem; (2) covers the binade below.)
#   (2) Underflow: for |y| <= 2^-1021, |RN(y) - y| <= 2^-1075 (half the smallest subnormal).
#       Together: |RN(x) - x| <= u |x| + 2^-1075 for every real x (Higham's model with
#       its underflow term, eq. (2.8) of "Accuracy and Stability of Numerical Algorithms").
#   (3) A sum of two doubles below 2^-1021 in magnitude (so at most 2^-1021 - 2^-1074, as it is
#       a multiple of 2^-1074) is a double: a multiple of 2^-1074 with at most 53 bits. With (1),
#       RN(a + b) = (a + b)(1 + d), |d| <= u, for all doubles a, b: additions and subtractions
#       have no underflow term.
#   (4) TwoProd: for doubles c, d in [1, 2], the fma residual c d - RN(c d) is a double, so
#       fma(c, d, -RN(c d)) is exact. Signs and powers of two scale out of every step, so this
#       holds for all c, d whose product's error stays above the underflow threshold: by
#       Boldo and Muller's condition (Flocq, Mult_error.mult_error_FLT), whenever
#       |c d| >= 2^(emin + 2p - 1) = 2^-969. The fast path's inputs satisfy it: every product
#       of two inputs is at least kMinInput^2 in magnitude.
# establishes: unit_roundoff = 0x1p-53
# covers: kU >= unit_roundoff
# covers: kMinInput * kMinInput >= 2^-969
# code: dd.hpp: inline DD two_sum(double a, double b) { const double s = a + b; const double bb = s - a; return {s, (a - (s - bb)) + (b - bb)}; }
# code: dd.hpp: inline DD fast_two_sum(double a, double b) { const double s = a + b; return {s, b - (s - a)}; }
# code: dd.hpp: inline DD two_prod(double a, double b) { const double p = a * b; return {p, std::fma(a, b, -p)}; }
# code: fast_row.cpp: return a == 0 || (a >= kMinInput && a <= kMaxInput);
#@-Eno-auto-dichotomy
@rnd = float<ieee_64, ne>;
a = rnd(a_);
b = rnd(b_);
c = rnd(c_);
d = rnd(d_);
p = rnd(c * d);
{ |x| in [0x1p-1021, 0x1p1024] /\ |y| <= 0x1p-1021 /\ |a + b| <= 0x1.fffffffffffffp-1022
  /\ c in [1, 2] /\ d in [1, 2]
  -> rnd(x) -/ x in [-@unit_roundoff@, @unit_roundoff@]
  /\ rnd(y) - y in [-0x1p-1075, 0x1p-1075]
  /\ @FIX(a + b, -1074) /\ @FLT(a + b, 53)
  /\ rnd(c * d - p) - (c * d - p) in [0, 0] }
