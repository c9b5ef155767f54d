// Rounding into F64, F32, F16 and BF16 with MPFR, worked by hand, and Ziv's test.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::testing {
namespace {

// Rounds the exact value of a decimal or hex-float string.
double round_text(const char* text, DType t) {
  mpfr_t x;
  mpfr_init2(x, 400);
  mpfr_strtofr(x, text, nullptr, 0, MPFR_RNDN);  // exact for these short strings
  const double r = round_to_format(x, t);
  mpfr_clear(x);
  return r;
}

TEST(RoundToFormat, F16NormalTiesToEven) {
  EXPECT_EQ(round_text("1", DType::F16), 1.0);
  EXPECT_EQ(round_text("0x1.002p0", DType::F16), 1.0);              // 1 + 2^-11: tie, to even
  EXPECT_EQ(round_text("0x1.006p0", DType::F16), 0x1.008p0);        // 1 + 3*2^-11: tie, up to even
  EXPECT_EQ(round_text("0x1.0021p0", DType::F16), 0x1.004p0);       // just above the tie
}

TEST(RoundToFormat, F16OverflowAndMax) {
  EXPECT_EQ(round_text("65504", DType::F16), 65504.0);
  EXPECT_EQ(round_text("65519.99", DType::F16), 65504.0);
  EXPECT_TRUE(std::isinf(round_text("65520", DType::F16)));  // the tie rounds to 2^16: overflow
  EXPECT_TRUE(std::isinf(round_text("-1e6", DType::F16)));
  EXPECT_LT(round_text("-1e6", DType::F16), 0);
}

TEST(RoundToFormat, F16Subnormals) {
  EXPECT_EQ(round_text("0x1p-24", DType::F16), 0x1p-24);       // smallest subnormal
  EXPECT_EQ(round_text("0x1p-25", DType::F16), 0.0);           // half of it: tie, to even 0
  EXPECT_EQ(round_text("0x1.8p-25", DType::F16), 0x1p-24);     // 3/4 of it
  EXPECT_EQ(round_text("0x3p-25", DType::F16), 0x2p-24);       // 1.5 ulp: tie, to even 2
  EXPECT_EQ(round_text("0x1.ff8p-15", DType::F16), 0x1.ff8p-15);  // largest subnormal
  EXPECT_EQ(round_text("0x1.ffcp-15", DType::F16), 0x1p-14);  // tie above it: up to the normal
  EXPECT_TRUE(std::signbit(round_text("-0x1p-30", DType::F16)));
}

TEST(RoundToFormat, BF16) {
  EXPECT_EQ(round_text("0x1.01p0", DType::BF16), 1.0);          // 1 + 2^-8: tie, to even
  EXPECT_EQ(round_text("0x1.03p0", DType::BF16), 0x1.04p0);     // 1 + 3*2^-8: tie, up
  EXPECT_EQ(round_text("0x1p-133", DType::BF16), 0x1p-133);     // smallest subnormal
  EXPECT_EQ(round_text("0x1p-134", DType::BF16), 0.0);
  EXPECT_TRUE(std::isinf(round_text("0x1.ffp127", DType::BF16)));  // tie above the maximum
  EXPECT_EQ(round_text("0x1.fep127", DType::BF16), 0x1.fep127);
}

TEST(RoundToFormat, F32AndF64) {
  EXPECT_EQ(round_text("0.1", DType::F32), static_cast<double>(0.1f));
  EXPECT_EQ(round_text("0.1", DType::F64), 0.1);
  EXPECT_EQ(round_text("0x1p-149", DType::F32), 0x1p-149);
  EXPECT_EQ(round_text("0x1p-150", DType::F32), 0.0);
  EXPECT_EQ(round_text("0x1.8p-150", DType::F32), 0x1p-149);
  EXPECT_EQ(round_text("0x1p-1074", DType::F64), 0x1p-1074);
  EXPECT_EQ(round_text("0x1p-1075", DType::F64), 0.0);
  EXPECT_EQ(round_text("0x1.0000000000001p-1074", DType::F64), 0x1p-1074);
  EXPECT_TRUE(std::isinf(round_text("0x1.fffffffffffff8p1023", DType::F64)));
}

TEST(RoundEnclosure, DecidedAndUndecided) {
  mpfr_t lo, hi;
  mpfr_inits2(200, lo, hi, static_cast<mpfr_ptr>(nullptr));
  // [1 + 2^-11 - 2^-100, 1 + 2^-11 + 2^-100] straddles an F16 midpoint: undecided.
  mpfr_set_str(lo, "0x1.002p0", 0, MPFR_RNDN);
  mpfr_set(hi, lo, MPFR_RNDN);
  mpfr_sub_d(lo, lo, 0x1p-100, MPFR_RNDD);
  mpfr_add_d(hi, hi, 0x1p-100, MPFR_RNDU);
  RoundedEnclosure r = round_enclosure(lo, hi, DType::F16);
  EXPECT_FALSE(r.decided);
  EXPECT_EQ(r.value, 1.0);
  EXPECT_EQ(r.alt, 0x1.004p0);
  // The same interval is well inside one F32 rounding interval: decided.
  r = round_enclosure(lo, hi, DType::F32);
  EXPECT_TRUE(r.decided);
  EXPECT_EQ(r.value, 0x1.002p0);
  // An enclosure of zero from both sides: zero is decided, its sign is +0.
  mpfr_set_d(lo, -0x1p-200, MPFR_RNDN);
  mpfr_set_d(hi, 0x1p-200, MPFR_RNDN);
  r = round_enclosure(lo, hi, DType::BF16);
  EXPECT_TRUE(r.decided);
  EXPECT_EQ(r.value, 0.0);
  EXPECT_FALSE(std::signbit(r.value));
  mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr));
}

TEST(Encode, F16AndBF16BitPatterns) {
  EXPECT_EQ(f16_bits_exact(1.0), 0x3c00);
  EXPECT_EQ(f16_bits_exact(-2.0), 0xc000);
  EXPECT_EQ(f16_bits_exact(65504.0), 0x7bff);
  EXPECT_EQ(f16_bits_exact(0x1p-24), 0x0001);
  EXPECT_EQ(f16_bits_exact(0x1p-14), 0x0400);
  EXPECT_EQ(f16_bits_exact(INFINITY), 0x7c00);
  EXPECT_EQ(f16_bits_exact(-0.0), 0x8000);
  EXPECT_EQ(bf16_bits_exact(1.0), 0x3f80);
  EXPECT_EQ(bf16_bits_exact(0x1p-133), 0x0001);
  EXPECT_EQ(bf16_bits_exact(-INFINITY), 0xff80);
  EXPECT_THROW(f16_bits_exact(0x1.001p0), std::logic_error);  // not representable: never rounds
  EXPECT_THROW(bf16_bits_exact(0x1.01p0), std::logic_error);    // an F32 number, not a BF16 one
  EXPECT_THROW(bf16_bits_exact(1 + 0x1p-30), std::logic_error);  // not even an F32 number
  EXPECT_THROW(bf16_bits_exact(0x1p-134), std::logic_error);     // below BF16's smallest
  for (unsigned b = 0; b < 0x10000; ++b) {  // decode and encode are inverse on every non-NaN
    const auto bits = static_cast<std::uint16_t>(b);
    const double h = f16_from_bits(bits);
    if (!std::isnan(h)) {
      ASSERT_EQ(f16_bits_exact(h), bits) << b;
    }
    const double g = bf16_from_bits(bits);
    if (!std::isnan(g)) {
      ASSERT_EQ(bf16_bits_exact(g), bits) << b;
    }
  }
}

// Every F16 pattern against the format's definition, worked with ldexp: (-1)^s 2^(e-15)
// (1 + f/1024), or 2^-14 f/1024 for e = 0; and a value a little off each one is refused.
TEST(Encode, F16DecodesByDefinitionAndRefusesNeighbours) {
  for (unsigned b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const unsigned e = (b >> 10) & 31, f = b & 1023;
    if (e == 31) continue;
    const double mag = e == 0 ? std::ldexp(f, -24) : std::ldexp(1024 + f, static_cast<int>(e) - 25);
    const double want = (b & 0x8000) ? -mag : mag;
    const double got = f16_from_bits(bits);
    ASSERT_EQ(got, want) << b;
    ASSERT_EQ(std::signbit(got), std::signbit(want)) << b;
    if (want != 0) {
      EXPECT_THROW(f16_bits_exact(want * (1 + 0x1p-20)), std::logic_error) << b;
      EXPECT_THROW(f16_bits_exact(want * (1 - 0x1p-40)), std::logic_error) << b;
    }
  }
  EXPECT_THROW(f16_bits_exact(65536.0), std::logic_error);   // 2^16: past the largest binade
  EXPECT_THROW(f16_bits_exact(0x1p-25), std::logic_error);   // half the smallest subnormal
  EXPECT_EQ(f16_bits_exact(0x1.ff8p-15), 0x03ff);            // the largest subnormal
  EXPECT_EQ(f16_bits_exact(-0x1p-14), 0x8400);               // the smallest normal, negative
}

}  // namespace
}  // namespace attnoracle::testing
