// Each element's error limit from a forward error analysis of the profile's arithmetic, and the
// metrics that report how far an implementation is from the exact value. The derivation, step
// by step, is conformance/TOLERANCE.md; tests check the code against its worked examples.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
  double bias_abs = 0;   // max over allowed j of |bias_j|
  double rotary_abs = 0; // rotary: max over allowed j of scale * sum_d qm_d km_d (Rotary's q_mag, k_mag)
};

// Rotary (TOLERANCE.md, "Rotary embedding"): eps_rot, the relative error (on the rotation's
// magnitudes q_mag, k_mag) of a kernel's rotated q and k against the case's: 0 without rotary.
double rotary_rel(const Profile& p, const Case& c);
// Error magnitudes e of one row of Dk (dq or dk) for the rotated row at position t, taken through
// R^T: e1 |cos| + e2 |sin|, e2 |cos| + e1 |sin| per pair (positions outside the tables untouched).
void rotate_back_errors(const Case& c, std::int64_t t, double* e);

// Per row of a case: [B, Hq, Nq] for sdpa, [B, Nq] for mha (the heads' maximum).
std::vector<RowMagnitudes> row_magnitudes(const Case& c);

// Coefficients of one row's limits, before the safety factor:
//   |out - exact| <= out_coef * out.bound + u_out |exact| + floor + p_sub (vsum + keys out.bound)
//   |weight - exact| <= weight_rel * exact + u_out * exact + floor + p_sub
//   |lse - exact| <= lse_abs + u_out |exact| + floor
// with vsum = sum over the allowed keys of |v_jc| (out_value_sum; for mha through |W_o|).
struct RowLimits {
  double score;       // absolute error of a score: (Dk + 2) u_qk A + u_sm |S|
  double weight_rel;  // relative error of a weight
  double out_coef;
  double lse_abs;
  double floor;       // underflow allowance of the output format
  double p_sub;       // absolute error of one weight rounded to `p`: s_p / 2 where a weight may
                      // fall below p's smallest normal (TOLERANCE.md step 4b), else 0
  double keys;        // n, the allowed keys of the row
};
RowLimits row_limits(const Profile& p, const Case& c, const RowMagnitudes& m);
// K/V stored scaled or block-scaled (CONTRACT section 9): each real element is an element
// times its scales, formed by the implementation in its own arithmetic.
bool stored_kv(const Case& c);

// Dropout (TOLERANCE.md, "Dropout"): the relative error of the kernel's keep scale 1 / (1 - p)
// formed from p in the softmax dtype, one factor for the whole case (0 for p = 0 and without
// dropout); and the relative error of one product by it (of a weight or of the output).
double dropout_scale_error(const Profile& p, const Case& c);
double dropout_product_error(const Profile& p, const Case& c);

// The limits of one element, the safety factor included (TOLERANCE.md, "The limits"): x the
// exact value, bound its out.bound, out the output dtype.
// The computing part of out's limit (before S): the analysis on out.bound, the floor, and P's
// underflow on vsum (out_value_sum; 0 is right only where L.p_sub is 0).
inline double out_compute(const RowLimits& L, double bound, double vsum) {
  return L.out_coef * bound + L.floor + L.p_sub * (vsum + L.keys * bound);
}
inline double out_limit(const Profile& p, const RowLimits& L, double u_out, double bound, double vsum, double x) {
  return p.safety * (out_compute(L, bound, vsum) + u_out * std::fabs(x));
}
inline double weight_limit(const Profile& p, const RowLimits& L, double u_out, double x) {
  return p.safety * (L.weight_rel * std::fabs(x) + u_out * std::fabs(x) + L.floor + L.p_sub);
}
inline double lse_limit(const Profile& p, const RowLimits& L, double u_out, double x) {
  return p.safety * (L.lse_abs + u_out * std::fabs(x) + L.floor);
}
// A score S before the softmax: step 1's error, then the rounding into the output dtype.
inline double score_limit(const Profile& p, const RowLimits& L, double u_out, double x) {
  return p.safety * (L.score + u_out * std::fabs(x) + L.floor);
}

// Without golden data: an upper bound of out.bound for every element of out (out_shape), from
// the inputs in double: for sdpa max |v_jc| over the allowed keys (the weights sum to 1), for
// mha sum_{r,c} max_j (|X| |W_v|)_{rjc} |W_o[r Dv + c, e]|.
std::vector<double> out_bound_above(const Case& c);
// For every element of out: vsum, for sdpa sum |v_jc| over the row's allowed keys, for mha
// sum_{r,c} (sum_j (|X| |W_v|)_{rjc}) |W_o[r Dv + c, e]| (every key), the weight of P's
// underflow term (TOLERANCE.md step 4b). Needed only where some row's p_sub is not 0.
std::vector<double> out_value_sum(const Case& c);

// Gradients (TOLERANCE.md, "Gradients"): per element of dq, dk, dv, dbias and dsinks (the
// shapes of q, k, v, bias and sinks; dbias, dsinks empty without them), the part of the error that dS's and P's errors
// carry into it, before the safety factor. out_ref and out_bound: the golden out.ref and
// out.bound; vsum: out_value_sum (empty when no row's p_sub is nonzero).
//
// For the statistical tier ("Gradients" there), per element: `random`, the root of the summed
// squared bounds of the independent groups of roundings that reach it (a group's parts that may
// depend on each other added linearly), before the accumulation and the final rounding; `floor`,
// the underflow terms, added as they are. out_spread: per element of out, the root of its
// statistical tier's proxy times sqrt 3 (empty: out's worst-case computing part instead).
struct GradientSpread {
  std::vector<double> random, floor;
};
struct GradientErrors {
  std::vector<double> dq, dk, dv, dbias, dsinks;
  GradientSpread dq_spread, dk_spread, dv_spread, dbias_spread, dsinks_spread;
};
GradientErrors gradient_errors(const Profile& p, const Case& c, const std::vector<RowMagnitudes>& mags,
                               const std::vector<RowLimits>& limits, const std::vector<double>& out_ref,
                               const std::vector<double>& out_bound, const std::vector<double>& vsum,
                               const std::vector<double>& out_spread = {});
// Kind mha (TOLERANCE.md, "Gradients of kind mha"): per element of dx_q, dx_kv, dw_q, dw_k, dw_v,
// dw_o (the shapes of those inputs; dx_kv empty in self-attention, c.self_attention) and of dbias, dsinks, the part
// of the error before the safety factor and the accumulation of the element's own sum: each
// head's backward (gradient_errors on the head's projections, with dout -> dO_h), dO_h's and the
// projections' roundings, carried through |w_q|, |w_k|, |w_v|, |x_q|, |x_kv| and, for dw_o, O_h's
// forward error through |dout|. limits: the case's rows [B, Nq] (row_limits of kind mha).
struct MhaGradientErrors {
  std::vector<double> dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, dbias, dsinks;
  GradientSpread dx_q_spread, dx_kv_spread, dw_q_spread, dw_k_spread, dw_v_spread, dw_o_spread,
      dbias_spread, dsinks_spread;
};
MhaGradientErrors mha_gradient_errors(const Profile& p, const Case& c, const std::vector<RowLimits>& limits);
// The limit of a gradient element: err from gradient_errors, `terms` the number of products the
// element sums (the accumulation's gamma on its G.bound), `extra` a further relative term on the
// bound (GQA partial sums rounded to the output dtype), x its exact value.
inline double gradient_limit(const Profile& p, double err, double terms, double extra, double bound, double u_out,
                             double floor, double x);

double unit_roundoff(DType t);   // 2^-p
double min_normal(DType t);
double min_subnormal(DType t);

// The metrics (conformance/TOLERANCE.md, "What is reported"). x = x_hi + x_lo is the exact value
// as a double-double, y the result.
//
// The binade exponent of x: x_hi's, one less when x_hi is a power of two and x_lo points toward
// zero (x is then just below it), floored at emin = 1 - bias, the smallest normal's; for x = 0
// (and for x_hi below F64's smallest normal, below every format's) the floor.
inline int ulp_exponent(double x_hi, double x_lo, int emin) {
  std::uint64_t bits;
  std::memcpy(&bits, &x_hi, 8);
  const int field = static_cast<int>((bits >> 52) & 0x7ff);
  if (field == 0) return emin;
  int e = field - 1023;
  if ((bits & 0x000f'ffff'ffff'ffffull) == 0 && x_lo != 0 && std::signbit(x_lo) != std::signbit(x_hi)) --e;
  return std::max(e, emin);
}
// 2^e, exactly (subnormal and out-of-range results through ldexp).
inline double exp2i(int e) {
  if (e < -1022 || e > 1023) return std::ldexp(1.0, e);
  const std::uint64_t bits = static_cast<std::uint64_t>(e + 1023) << 52;
  double x;
  std::memcpy(&x, &bits, 8);
  return x;
}
// The ulp of x in a format of precision p and smallest normal 2^emin: 2^(ulp_exponent - p + 1).
inline double ulp_of(double x_hi, double x_lo, int emin, int precision) {
  return exp2i(ulp_exponent(x_hi, x_lo, emin) - precision + 1);
}
double ulp_of(double x_hi, double x_lo, DType t);
// |y - x|, rounded to nearest in double. NaN x: 0 for a NaN y, else infinite; infinite x: 0 for
// the same infinity, else infinite; NaN y (x not NaN): infinite; infinite y, x finite: 0 when x
// rounds to that infinity in t (|x| >= (2 - 2^-p) 2^emax, same sign), else infinite. +0 and -0
// are equal.
double abs_error(double y, double x_hi, double x_lo, DType t);
// TOSA's ulp error: abs_error / ulp_of(x).
double ulp_error(double y, double x_hi, double x_lo, DType t);
// abs_error / max(bound 2^-p, min normal): immune to cancellation in x.
double bound_error(double y, double x_hi, double x_lo, double bound, DType t);

inline double gradient_limit(const Profile& p, double err, double terms, double extra, double bound, double u_out,
                             double floor, double x) {
  return p.safety * (err + ((terms + 2) * unit_roundoff(p.grad_accum) + extra) * bound + u_out * std::fabs(x) + floor);
}

}  // namespace attnoracle::conformance
