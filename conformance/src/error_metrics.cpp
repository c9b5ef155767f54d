// The metrics of an element's error (TOLERANCE.md, "What is reported").
#include <cmath>

#include "attnoracle/conformance/tolerance.hpp"
#include "no_contraction.hpp"

namespace attnoracle::conformance {

double ulp_of(double x_hi, double x_lo, DType t) {
  const FloatFormat f = float_format(t);
  return ulp_of(x_hi, x_lo, 1 - f.bias, f.precision);
}

double abs_error(double y, double x_hi, double x_lo, DType t) {
  if (std::isnan(x_hi)) return std::isnan(y) ? 0 : INFINITY;
  if (std::isnan(y)) return INFINITY;
  if (std::isinf(x_hi)) return y == x_hi ? 0 : INFINITY;
  if (std::isinf(y)) {
    // Round to nearest overflows from halfway between the largest finite value and 2^(emax + 1).
    const FloatFormat f = float_format(t);
    const double big = std::ldexp(2 - std::ldexp(1.0, 1 - f.precision), f.bias);  // largest finite
    const double half = std::ldexp(1.0, f.bias - f.precision);                      // half its ulp
    const double ax = std::fabs(x_hi), axl = std::signbit(x_hi) ? -x_lo : x_lo;
    // ax - big is exact (Sterbenz: big <= ax <= 2 big)
    const bool overflows = ax > big ? (ax - big) + axl >= half : ax == big && axl >= half;
    return overflows && std::signbit(y) == std::signbit(x_hi) ? 0 : INFINITY;
  }
  return std::fabs((y - x_hi) - x_lo);
}

double ulp_error(double y, double x_hi, double x_lo, DType t) {
  const double d = abs_error(y, x_hi, x_lo, t);
  return d == 0 || std::isinf(d) ? d : d / ulp_of(x_hi, x_lo, t);
}

double bound_error(double y, double x_hi, double x_lo, double bound, DType t) {
  const double d = abs_error(y, x_hi, x_lo, t);
  return d == 0 || std::isinf(d) ? d : d / std::max(bound * unit_roundoff(t), min_normal(t));
}

}  // namespace attnoracle::conformance
