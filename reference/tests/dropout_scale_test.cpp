// Dropout's p read from its text (CONTRACT section 10): the range [0, 1) decided on the exact
// value, 1 / (1 - p) as an exact rational and as an enclosure.
#include <gtest/gtest.h>

#include <string>

#include "attnoracle/reference/dropout.hpp"

namespace attnoracle {
namespace {

TEST(DropoutScale, RangeDecidedOnTheText) {
  for (const char* ok : {"0", "-0", "0.5", "0.999999999999999999999999", "0x1.fffffffffffffp-1", "1e-400", ".25", "0X.8P0"})
    EXPECT_TRUE(dropout_p_in_range(ok)) << ok;
  // 1 - 1e-30 rounds to 1 in F64 but is below 1; -1e-400 rounds to -0 in F64 but is below 0.
  for (const char* bad : {"1", "1.0", "0x1p0", "1.0000000000000000000001", "-1e-400", "-0.5", "inf", "nan", "2"})
    EXPECT_FALSE(dropout_p_in_range(bad)) << bad;
}

TEST(DropoutScale, ExactRationalOfTheText) {
  const std::pair<const char*, const char*> cases[] = {
      {"0", "1"},          {"-0", "1"},          {"0.5", "2"},       {".5", "2"},
      {"0.1", "10/9"},     {"25e-2", "4/3"},     {"0x1.8p-1", "4"},  {"0X.8P0", "2"},
      {"1e-5", "100000/99999"}, {"0.333", "1000/667"}, {"0x0.1p+0", "16/15"}, {"+0.9", "10"}};
  for (const auto& [text, want] : cases) {
    Rational s, w;
    ASSERT_TRUE(exact_keep_scale(s.q, text)) << text;
    mpq_set_str(w.q, want, 10);
    EXPECT_TRUE(mpq_equal(s.q, w.q)) << text << " gives " << mpq_get_str(nullptr, 10, s.q);
  }
  Rational s;
  EXPECT_FALSE(exact_keep_scale(s.q, "1e-123456"));  // too large a rational: the enclosure serves
}

TEST(DropoutScale, EnclosureHoldsTheRational) {
  for (const char* text : {"0.1", "0.9", "0x1.8p-1", "1e-400", "0.999999999999999999999999"}) {
    mpfr_t lo, hi;
    mpfr_inits2(200, lo, hi, static_cast<mpfr_ptr>(nullptr));
    enclose_keep_scale(lo, hi, text);
    Rational s;
    if (exact_keep_scale(s.q, text)) {
      EXPECT_LE(mpfr_cmp_q(lo, s.q), 0) << text;
      EXPECT_GE(mpfr_cmp_q(hi, s.q), 0) << text;
    }
    EXPECT_TRUE(mpfr_lessequal_p(lo, hi)) << text;
    mpfr_sub(hi, hi, lo, MPFR_RNDU);
    mpfr_div(hi, hi, lo, MPFR_RNDU);
    EXPECT_LT(mpfr_cmp_d(hi, 0x1p-100), 0) << text << ": wider than needed";  // 1 - p near 1 loses ~80 bits
    mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr));
  }
}

}  // namespace
}  // namespace attnoracle
