#include "attnoracle/reference/dropout.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

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

namespace attnoracle {

bool exact_keep_scale(mpq_t s, const std::string& text) {
  // The grammar parse_number accepted (strtod's): [sign] digits [. digits] [e|p [sign] digits],
  // hex after 0x with a binary exponent. p in [0, 1) rules out inf and nan here.
  std::size_t at = 0;
  bool negative = false;
  if (at < text.size() && (text[at] == '+' || text[at] == '-')) negative = text[at++] == '-';
  const bool hex = text.size() >= at + 2 && text[at] == '0' && (text[at + 1] == 'x' || text[at + 1] == 'X');
  if (hex) at += 2;
  const int base = hex ? 16 : 10;
  std::vector<char> digits;  // a vector, not a string: GCC 12 reports a false -Wrestrict on appends (bug 105329)
  long fraction = 0;  // digits after the point
  bool point = false;
  for (; at < text.size(); ++at) {
    const char ch = text[at];
    if (ch == '.') {
      point = true;
      continue;
    }
    if (!std::isxdigit(static_cast<unsigned char>(ch)) || (!hex && !std::isdigit(static_cast<unsigned char>(ch)))) break;
    digits.push_back(ch);
    fraction += point ? 1 : 0;
  }
  long exponent = 0;
  if (at < text.size()) {  // e or p, then a signed integer
    if (text.size() - at - 1 > 6) return false;  // beyond 10^6: |exponent| too large for an exact rational
    exponent = std::strtol(text.c_str() + at + 1, nullptr, 10);
  }
  if (digits.empty()) digits.push_back('0');
  digits.push_back('\0');
  // value = digits * base^-fraction * (10 or 2)^exponent
  const long pow10 = hex ? 0 : exponent - fraction, pow2 = hex ? exponent - 4 * fraction : 0;
  if (std::labs(pow10) > 10000 || std::labs(pow2) > 40000) return false;
  mpq_t p, one;
  mpq_inits(p, one, static_cast<mpq_ptr>(nullptr));
  mpz_set_str(mpq_numref(p), digits.data(), base);
  mpz_t scale;
  mpz_init(scale);
  if (pow10 != 0) {
    mpz_ui_pow_ui(scale, 10, static_cast<unsigned long>(std::labs(pow10)));
    if (pow10 > 0) mpz_mul(mpq_numref(p), mpq_numref(p), scale);
    else mpz_set(mpq_denref(p), scale);
  }
  if (pow2 > 0) mpz_mul_2exp(mpq_numref(p), mpq_numref(p), static_cast<mp_bitcnt_t>(pow2));
  if (pow2 < 0) mpz_mul_2exp(mpq_denref(p), mpq_denref(p), static_cast<mp_bitcnt_t>(-pow2));
  mpq_canonicalize(p);
  if (negative) mpq_neg(p, p);
  mpq_set_ui(one, 1, 1);
  mpq_sub(p, one, p);  // 1 - p > 0
  mpq_inv(s, p);
  mpz_clear(scale);
  mpq_clears(p, one, static_cast<mpq_ptr>(nullptr));
  return true;
}

}  // namespace attnoracle
