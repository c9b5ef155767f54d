// Deterministic numbers in a dtype: correct rounding with MPFR, format limits, and the few
// transcendental values the generators need (computed with MPFR, then rounded).
#pragma once

#include <string>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle::vectors {

struct Limits {
  int precision;       // p, hidden bit included
  int min_normal_exp;  // min normal = 2^min_normal_exp
  int min_sub_exp;     // smallest subnormal = 2^min_sub_exp
  int max_exp;         // every finite value < 2^max_exp
};
Limits limits(DType t);

// x rounded to nearest-even into t (the reference's round_to_format); throws
// std::invalid_argument when the result is not finite.
double round_into(double x, DType t);
// The neighbour of x (a value of t, x != 0) one unit in the last place further from zero.
double away_ulp(double x, DType t);

// x in C hex float ("%a"), exactly.
std::string hexf(double x);

// Correctly rounded double results, computed with MPFR.
double sqrt_rn(double x);
double exp2_rn(double num, double den);                      // 2^(num/den)
double scale_value(const std::string& scale_text, long dk);  // attn.scale, or 1/sqrt(Dk)

}  // namespace attnoracle::vectors
