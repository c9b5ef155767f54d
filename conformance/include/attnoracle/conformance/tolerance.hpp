// Each element's error limit from a forward error analysis of the profile's arithmetic, and the
// metrics that report how far an implementation is from the exact value. The derivation, step
// by step, is conformance/TOLERANCE.md; tests check the code against its worked examples.
#pragma once

#include <cstdint>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/conformance/profile.hpp"

namespace attnoracle::conformance {

// What the bound needs to know of one row, computed in double from the inputs (for mha: the
// largest over the heads of the token).
struct RowMagnitudes {
  double dot_abs = 0;    // max over allowed j of scale * sum_d |q_d k_jd|
  double score_abs = 0;  // max over allowed j of |S_j| (after softcap and bias)
  std::int64_t keys = 0; // allowed keys
};

// Per row of a case: [B, Hq, Nq] for sdpa, [B, Nq] for mha (the heads' maximum).
std::vector<RowMagnitudes> row_magnitudes(const Case& c);

// Coefficients of one row's limits, before the safety factor:
//   |out - exact| <= out_coef * out.bound + u_out |exact| + floor
//   |weight - exact| <= weight_rel * exact + u_out * exact + floor
//   |lse - exact| <= lse_abs + u_out |exact| + floor
struct RowLimits {
  double score;       // absolute error of a score: (Dk + 2) u_qk A + u_sm |S|
  double weight_rel;  // relative error of a weight
  double out_coef;
  double lse_abs;
  double floor;       // underflow allowance of the output format
};
RowLimits row_limits(const Profile& p, const Case& c, const RowMagnitudes& m);

double unit_roundoff(DType t);   // 2^-p
double min_normal(DType t);
double min_subnormal(DType t);

// TOSA's ulp: |y - x| / 2^(max(e(x), e(min normal)) - p + 1), e the binade exponent; x given as
// a double-double x_hi + x_lo. Infinite when y is NaN or infinite and x is not that value.
double ulp_error(double y, double x_hi, double x_lo, DType t);
// (y - x) / max(bound 2^-p, min normal): immune to cancellation in x.
double signed_bound_error(double y, double x_hi, double x_lo, double bound, DType t);

}  // namespace attnoracle::conformance
