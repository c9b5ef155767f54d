#include "numbers.hpp"

#include <mpfr.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "attnoracle/reference/round.hpp"

namespace attnoracle::vectors {

Limits limits(DType t) {
  const FloatFormat f = float_format(t);
  // MPFR's exponents: values m*2^e with 1/2 <= m < 1, so the smallest subnormal is 2^(emin-1).
  return {f.precision, 1 - f.bias, static_cast<int>(f.emin) - 1, static_cast<int>(f.emax)};
}

double round_into(double x, DType t) {
  if (t == DType::F64) {
    if (!std::isfinite(x)) throw std::invalid_argument("a generated value is not finite");
    return x;
  }
  const double r = round_double(x, t);
  if (!std::isfinite(r))
    throw std::invalid_argument("a generated value overflows " + std::string(dtype_name(t)));
  return r;
}

double away_ulp(double x, DType t) {
  const Limits l = limits(t);
  int e = 0;
  std::frexp(x, &e);  // |x| = m 2^e, 1/2 <= m < 1: exact
  // A unit in the last place of t at |x|: 2^(e-p), but never below the subnormal spacing.
  const int ulp_exp = e - l.precision < l.min_sub_exp ? l.min_sub_exp : e - l.precision;
  const double u = std::ldexp(1.0, ulp_exp);
  return round_into(x < 0 ? x - u : x + u, t);  // exact: moving away from zero stays in t
}

std::string hexf(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

double sqrt_rn(double x) {
  mpfr_t m;
  mpfr_init2(m, 53);
  mpfr_set_d(m, x, MPFR_RNDN);
  mpfr_sqrt(m, m, MPFR_RNDN);
  const double r = mpfr_get_d(m, MPFR_RNDN);
  mpfr_clear(m);
  return r;
}

double exp2_rn(double num, double den) {
  // The exponent at 128 bits, then 2^e at 128 bits: the final rounding to 53 bits is the only
  // one that matters, and it is the same on every platform.
  mpfr_t e;
  mpfr_init2(e, 128);
  mpfr_set_d(e, num, MPFR_RNDN);
  mpfr_div_d(e, e, den, MPFR_RNDN);
  mpfr_exp2(e, e, MPFR_RNDN);
  const double r = mpfr_get_d(e, MPFR_RNDN);
  mpfr_clear(e);
  return r;
}

double scale_value(const std::string& scale_text, long dk) {
  mpfr_t s;
  mpfr_init2(s, 53);
  if (scale_text.empty()) {
    mpfr_set_si(s, dk, MPFR_RNDN);
    mpfr_rec_sqrt(s, s, MPFR_RNDN);
  } else if (mpfr_set_str(s, scale_text.c_str(), 0, MPFR_RNDN) != 0) {
    mpfr_clear(s);
    throw std::invalid_argument("scale \"" + scale_text + "\" is not a number");
  }
  const double r = mpfr_get_d(s, MPFR_RNDN);
  mpfr_clear(s);
  return r;
}

}  // namespace attnoracle::vectors
