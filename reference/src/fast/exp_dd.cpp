// exp in double-double: x = k ln2 + r with |r| <= 0.3466 + 2^-40, t = r / 2^10, a degree-9
// Taylor polynomial for exp(t), ten squarings, and 2^k.
//
// Error tally, relative, u = 2^-53, for kExpMin <= x <= 8 (so |k| <= 895 < 2^10):
//   reduction   r = x + (-k) LN2: DWTimesFP 2u^2 |k ln2| <= 2^-105 * 621, LN2's own error
//               |k| 2^-107, DWPlusDW 3u^2 |r|; together |dr| <= 2^-94.8, and exp(r + dr)
//               = exp(r) (1 + 2^-94.8 at most).
//   polynomial  |t| <= 2^-11.5: truncation |t|^10 / 10! e^|t| < 2^-136; Horner steps
//               (DWTimesDW 5u^2 on |p t| <= 2^-11.5 |p|, DWPlusDW 3u^2, coefficients within
//               2^-107) leave at most 5u^2 = 2^-103.7 of the result.
//   squarings   (1 + e)^1024 with e the polynomial's error, plus 5u^2 per squaring weighted by
//               the squarings after it: 1024 * 5u^2 + 1023 * 5u^2 < 2^-92.68.
//   2^k         exact for the high part; a low part scaled below the normal range may round,
//               by at most 2^-180 of the result (reference/proofs/exp_dd.g).
// Sum < 2^-92.2; the constant used is kExpRel = 2^-88.
#include "exp_dd.hpp"

#include <mpfr.h>


namespace attnoracle::fast {
namespace {

// A real constant as the nearest double-double: hi = RN(c), lo = RN(c - hi), within 2^-107 c.
DD dd_of(mpfr_srcptr c) {
  mpfr_t r;
  mpfr_init2(r, 256);
  DD d;
  d.hi = mpfr_get_d(c, MPFR_RNDN);
  mpfr_sub_d(r, c, d.hi, MPFR_RNDN);  // exact at 256 bits
  d.lo = mpfr_get_d(r, MPFR_RNDN);
  mpfr_clear(r);
  return d;
}

struct Constants : ExpConstants {
  Constants() {
    mpfr_t c;
    mpfr_init2(c, 256);
    mpfr_const_log2(c, MPFR_RNDN);
    ln2 = dd_of(c);
    mpfr_set_ui(c, 1, MPFR_RNDN);
    for (unsigned i = 0; i < inv_fact.size(); ++i) {
      if (i > 1) mpfr_div_ui(c, c, i, MPFR_RNDN);
      inv_fact[i] = dd_of(c);
    }
    mpfr_clear(c);
    mpfr_free_cache();
  }
};

}  // namespace

const ExpConstants& exp_constants() {
  static const Constants k;  // thread-safe initialisation
  return k;
}

DD exp_dd(DD x) {
  const ExpConstants& K = exp_constants();
  const double k = std::nearbyint(x.hi * 1.4426950408889634);  // x / ln2 to nearest
  const DD r = add(x, mul(K.ln2, -k));                          // x - k ln2
  const DD t = scale2(r, -10);                                  // exact
  DD p = K.inv_fact[9];
  for (int i = 8; i >= 0; --i) p = add(mul(p, t), K.inv_fact[static_cast<unsigned>(i)]);
  for (int s = 0; s < 10; ++s) p = mul(p, p);  // exp(t)^(2^10) = exp(r)
  return scale2(p, static_cast<int>(k));
}

}  // namespace attnoracle::fast
