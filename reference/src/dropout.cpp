#include "attnoracle/reference/dropout.hpp"

#include <algorithm>

namespace attnoracle {

bool dropout_p_in_range(const std::string& text) {
  // MPFR's exponent range holds any decimal text: the value rounded down is negative exactly
  // when p < 0, and at least 1 exactly when p >= 1 (a p in [1 - ulp, 1) rounds down below 1).
  mpfr_t x;
  mpfr_init2(x, 64);
  mpfr_strtofr(x, text.c_str(), nullptr, 0, MPFR_RNDD);
  const bool ok = mpfr_sgn(x) >= 0 && mpfr_cmp_ui(x, 1) < 0;
  mpfr_clear(x);
  return ok;
}

void enclose_keep_scale(mpfr_ptr lo, mpfr_ptr hi, const std::string& text) {
  // 1 / (1 - p) increases with p: the lower end from p rounded down, each step rounded down
  // (1 - p down is 1 - (p up)), the upper end the same way up. 1 - p_hi can reach 0 only at a
  // precision too low to tell p from 1; the upper end is then +inf, and Ziv's loop goes on.
  const mpfr_prec_t prec = std::max(mpfr_get_prec(lo), mpfr_get_prec(hi)) + 8;
  mpfr_t plo, phi;
  mpfr_inits2(prec, plo, phi, static_cast<mpfr_ptr>(nullptr));
  mpfr_strtofr(plo, text.c_str(), nullptr, 0, MPFR_RNDD);
  mpfr_strtofr(phi, text.c_str(), nullptr, 0, MPFR_RNDU);
  mpfr_ui_sub(plo, 1, plo, MPFR_RNDU);  // 1 - p_lo >= 1 - p
  mpfr_ui_sub(phi, 1, phi, MPFR_RNDD);  // 1 - p_hi <= 1 - p
  mpfr_ui_div(lo, 1, plo, MPFR_RNDD);
  if (mpfr_sgn(phi) > 0)
    mpfr_ui_div(hi, 1, phi, MPFR_RNDU);
  else
    mpfr_set_inf(hi, 1);
  mpfr_clears(plo, phi, static_cast<mpfr_ptr>(nullptr));
}

}  // namespace attnoracle
