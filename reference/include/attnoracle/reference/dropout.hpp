// Dropout with a given keep mask (CONTRACT section 10): O = (A * keep / (1 - p)) V, with the
// weights and lse those of A.
#pragma once

#include <gmp.h>
#include <mpfr.h>

#include <string>

namespace attnoracle {

// Metadata key and tensor name.
inline constexpr const char* kDropoutPKey = "attn.dropout_p";
inline constexpr const char* kDropoutMaskName = "dropout_mask";

// An mpq_t cleared on scope exit.
struct Rational {
  mpq_t q;
  Rational() { mpq_init(q); }
  ~Rational() { mpq_clear(q); }
  Rational(const Rational&) = delete;
  Rational& operator=(const Rational&) = delete;
};

// Whether the exact value of `text` (a number as strtod reads it, decimal or C hex float) lies
// in [0, 1), decided on the text itself, not on its F64 rounding.
bool dropout_p_in_range(const std::string& text);

// [lo, hi] holds 1 / (1 - p) for the exact value p of `text` (in [0, 1)), at the precisions of
// lo and hi: the keep scale of every kept weight.
void enclose_keep_scale(mpfr_ptr lo, mpfr_ptr hi, const std::string& text);

}  // namespace attnoracle

namespace attnoracle {

// 1 / (1 - p) as an exact rational, for the exact value p of `text` (in [0, 1), decimal or C
// hex float). False (s untouched) where the text's exponent is so large in magnitude (beyond
// 10^4) that the rational would be huge: enclose_keep_scale serves then.
bool exact_keep_scale(mpq_t s, const std::string& text);

// [lo, hi] = [xlo, xhi] * s for a rational s > 0: each end the correctly rounded product in its
// direction, so a point x whose product is representable stays a point (lo, hi distinct from
// xlo, xhi or the same objects).
inline void mul_keep_scale(mpfr_ptr lo, mpfr_ptr hi, mpfr_srcptr xlo, mpfr_srcptr xhi, mpq_srcptr s) {
  mpfr_mul_q(lo, xlo, s, MPFR_RNDD);
  mpfr_mul_q(hi, xhi, s, MPFR_RNDU);
}

}  // namespace attnoracle
