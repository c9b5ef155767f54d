#include "attnoracle/reference/round.hpp"

#include <cmath>

namespace attnoracle {

double round_to_format(mpfr_srcptr x, DType t) {
  const FloatFormat f = float_format(t);
  mpfr_t y;
  mpfr_init2(y, f.precision);
  // Round to p bits in the full exponent range, then let MPFR apply the format's range: the
  // ternary value lets check_range and subnormalize avoid double rounding.
  int inex = mpfr_set(y, x, MPFR_RNDN);
  const mpfr_exp_t old_emin = mpfr_get_emin(), old_emax = mpfr_get_emax();
  mpfr_set_emin(f.emin);
  mpfr_set_emax(f.emax);
  inex = mpfr_check_range(y, inex, MPFR_RNDN);
  mpfr_subnormalize(y, inex, MPFR_RNDN);
  mpfr_set_emin(old_emin);
  mpfr_set_emax(old_emax);
  double d = mpfr_get_d(y, MPFR_RNDN);  // exact: y is a value of a format inside F64
  mpfr_clear(y);
  mpfr_clear_flags();
  // E4M3FN has no infinity and 480 is NaN: what rounds past 448 saturates to +-448.
  if (t == DType::F8_E4M3 && std::fabs(d) > 448) d = std::copysign(448.0, d);
  return d;
}

double round_double(double x, DType t) {
  if (t == DType::F64 || std::isnan(x)) return x;
  mpfr_t m;
  mpfr_init2(m, 53);
  mpfr_set_d(m, x, MPFR_RNDN);  // exact
  const double r = round_to_format(m, t);
  mpfr_clear(m);
  return r;
}

RoundedEnclosure round_enclosure(mpfr_srcptr lo, mpfr_srcptr hi, DType t) {
  const double a = round_to_format(lo, t);
  const double b = round_to_format(hi, t);
  // -0 only when the whole enclosure is negative: an exact zero (even computed as -0) is +0.
  if (a == 0 && b == 0) return {true, mpfr_sgn(hi) < 0 ? -0.0 : 0.0, 0.0};
  if (a == b) return {true, a, a};  // rounding to nearest is monotone
  return {false, a, b};
}

}  // namespace attnoracle
