#include "attnoracle/reference/scaled_output.hpp"

#include <algorithm>

namespace attnoracle {

RoundedEnclosure round_scaled_enclosure(mpfr_srcptr lo, mpfr_srcptr hi, double s, DType t) {
  const mpfr_prec_t p = std::max(mpfr_get_prec(lo), mpfr_get_prec(hi)) + 8;
  mpfr_t a, b;
  mpfr_init2(a, p);
  mpfr_init2(b, p);
  // O in [lo, hi] and s > 0: O / s in [lo / s rounded down, hi / s rounded up].
  mpfr_div_d(a, lo, s, MPFR_RNDD);
  mpfr_div_d(b, hi, s, MPFR_RNDU);
  const RoundedEnclosure r = round_enclosure(a, b, t);
  mpfr_clear(a);
  mpfr_clear(b);
  return r;
}

RoundedEnclosure round_out_enclosure(const Case& c, mpfr_srcptr lo, mpfr_srcptr hi) {
  if (c.o_scale && is_fp8(c.dtype_of("out"))) return round_scaled_enclosure(lo, hi, *c.o_scale, c.dtype_of("out"));
  return round_enclosure(lo, hi, c.dtype_of("out"));
}

}  // namespace attnoracle
