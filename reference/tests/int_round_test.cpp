// The tests' integer rounding routine: hand-worked examples, then random values against two
// other roundings (the hardware's conversions, and MPFR with the format's exponent range).
#include "int_round.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace attnoracle::testing {
namespace {

using boost::multiprecision::mpz_int;

// Shorthand for the examples.
std::uint64_t rd(double x, DType t) { return round_double(x, t); }

// An MPFR number of 600 bits equal to m * 2^e + s * 2^f (exact).
struct Big {
  mpfr_t v;
  Big() { mpfr_init2(v, 600); }
  ~Big() { mpfr_clear(v); }
  Big(const Big&) = delete;
  Big& operator=(const Big&) = delete;
};
void set_sum(mpfr_t r, double a, long ea, double b, long eb) {
  mpfr_t t;
  mpfr_init2(t, 600);
  mpfr_set_d(r, a, MPFR_RNDN);
  mpfr_mul_2si(r, r, ea, MPFR_RNDN);
  mpfr_set_d(t, b, MPFR_RNDN);
  mpfr_mul_2si(t, t, eb, MPFR_RNDN);
  mpfr_add(r, r, t, MPFR_RNDN);  // exact: the operands fit in 600 bits together here
  mpfr_clear(t);
}

TEST(IntRound, F16Examples) {
  EXPECT_EQ(rd(65520, DType::F16), 0x7C00u);         // max + half ulp: tie to even goes up, inf
  EXPECT_EQ(rd(65519.99, DType::F16), 0x7BFFu);      // below the tie: 65504
  EXPECT_EQ(rd(-65520, DType::F16), 0xFC00u);
  EXPECT_EQ(rd(1e300, DType::F16), 0x7C00u);
  EXPECT_EQ(rd(std::ldexp(1.0, -25), DType::F16), 0x0000u);     // half the smallest: to even 0
  EXPECT_EQ(rd(-std::ldexp(1.0, -25), DType::F16), 0x8000u);    // keeps the sign
  EXPECT_EQ(rd(3 * std::ldexp(1.0, -26), DType::F16), 0x0001u);  // 0.75 of the smallest
  EXPECT_EQ(rd(std::ldexp(1.0, -24), DType::F16), 0x0001u);
  EXPECT_EQ(rd(3 * std::ldexp(1.0, -25), DType::F16), 0x0002u);  // 1.5 units: tie to even 2
  EXPECT_EQ(rd(5 * std::ldexp(1.0, -25), DType::F16), 0x0002u);  // 2.5 units: tie to even 2
  EXPECT_EQ(rd(std::ldexp(1.0, -14), DType::F16), 0x0400u);      // smallest normal
  // largest subnormal + half unit: 1023.5 units, odd, carries into the smallest normal
  EXPECT_EQ(rd(1023.5 * std::ldexp(1.0, -24), DType::F16), 0x0400u);
  EXPECT_EQ(rd(1.0 + std::ldexp(1.0, -11), DType::F16), 0x3C00u);      // tie to even: 1
  EXPECT_EQ(rd(1.0 + 3 * std::ldexp(1.0, -11), DType::F16), 0x3C02u);  // tie to even: up
  EXPECT_EQ(rd(-2.0, DType::F16), 0xC000u);
  EXPECT_EQ(rd(0.1, DType::F16), 0x2E66u);
}

TEST(IntRound, BF16Examples) {
  EXPECT_EQ(rd(1.0 + std::ldexp(1.0, -8), DType::BF16), 0x3F80u);       // tie to even: 1
  EXPECT_EQ(rd(1.0 + 3 * std::ldexp(1.0, -8), DType::BF16), 0x3F82u);   // 1 + 2^-6
  EXPECT_EQ(rd(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), DType::BF16), 0x3F81u);
  EXPECT_EQ(rd(std::ldexp(1.0, -133), DType::BF16), 0x0001u);  // smallest subnormal
  EXPECT_EQ(rd(std::ldexp(1.0, -134), DType::BF16), 0x0000u);  // half of it: to even 0
  // largest finite: (2 - 2^-7) 2^127; + half ulp (2^119) rounds to inf
  const double maxbf = std::ldexp(255.0, 120);
  EXPECT_EQ(rd(maxbf, DType::BF16), 0x7F7Fu);
  EXPECT_EQ(rd(maxbf + std::ldexp(1.0, 119), DType::BF16), 0x7F80u);
  EXPECT_EQ(rd(maxbf + std::ldexp(1.0, 118), DType::BF16), 0x7F7Fu);
  EXPECT_EQ(rd(-3.0, DType::BF16), 0xC040u);
}

TEST(IntRound, F32Examples) {
  EXPECT_EQ(rd(1.0 + std::ldexp(1.0, -24), DType::F32), 0x3F800000u);
  EXPECT_EQ(rd(1.0 + 3 * std::ldexp(1.0, -24), DType::F32), 0x3F800002u);
  EXPECT_EQ(rd(std::ldexp(1.0, -149), DType::F32), 0x00000001u);
  EXPECT_EQ(rd(std::ldexp(1.0, -150), DType::F32), 0x00000000u);
  EXPECT_EQ(rd(std::ldexp(1.0, -150) * (1 + std::ldexp(1.0, -40)), DType::F32), 0x00000001u);
  EXPECT_EQ(rd(std::ldexp(8388607.5, -149), DType::F32), 0x00800000u);  // carry to normal
  const double maxf = static_cast<double>(std::numeric_limits<float>::max());
  EXPECT_EQ(rd(maxf, DType::F32), 0x7F7FFFFFu);
  EXPECT_EQ(rd(maxf + std::ldexp(1.0, 103), DType::F32), 0x7F800000u);  // + half ulp
  EXPECT_EQ(rd(maxf + std::ldexp(1.0, 102), DType::F32), 0x7F7FFFFFu);
  EXPECT_EQ(rd(-0.0, DType::F32), 0x80000000u);
  EXPECT_EQ(rd(-std::numeric_limits<double>::infinity(), DType::F32), 0xFF800000u);
}

TEST(IntRound, F64FromWideValues) {
  Big x;
  auto r64 = [&](double a, long ea, double b, long eb) {
    set_sum(x.v, a, ea, b, eb);
    return round_mpfr(x.v, DType::F64);
  };
  EXPECT_EQ(r64(1, 0, 1, -53).bits, 0x3FF0000000000000u);           // tie to even
  EXPECT_EQ(r64(1, 0, 1, -53).discarded, Discarded::Half);
  EXPECT_EQ(r64(1, 0, 1.5, -53).bits, 0x3FF0000000000001u);
  EXPECT_EQ(r64(1, 0, 1, -54).discarded, Discarded::BelowHalf);
  EXPECT_EQ(r64(1, -52, 1, -300).bits, 0x3CB0000000000000u);        // 2^-52 + tiny
  EXPECT_EQ(r64(1, -1075, 0, 0).bits, 0u);                          // half the smallest
  EXPECT_EQ(r64(3, -1076, 0, 0).bits, 1u);                          // 0.75 of it
  EXPECT_EQ(r64(1, -1075, 1, -1300).bits, 1u);                      // just above half
  EXPECT_EQ(r64(1, -2000, 0, 0).bits, 0u);                          // far below
  EXPECT_EQ(r64(-1, -2000, 0, 0).bits, 0x8000000000000000u);
  const double maxd = std::numeric_limits<double>::max();
  EXPECT_EQ(r64(maxd, 0, 1, 970).bits, 0x7FF0000000000000u);        // + half ulp: inf
  EXPECT_EQ(r64(maxd, 0, 1, 969).bits, 0x7FEFFFFFFFFFFFFFu);
  EXPECT_EQ(r64(1, 1024, 0, 0).bits, 0x7FF0000000000000u);
  EXPECT_EQ(r64(-1, 5000, 0, 0).bits, 0xFFF0000000000000u);
  EXPECT_EQ(r64(1, 0, 0, 0).discarded, Discarded::None);
  // the integer form directly: 3 * 2^-2 = 0.75
  EXPECT_EQ(round_scaled_integer(false, mpz_int(3), -2, DType::F64).bits, 0x3FE8000000000000u);
  // 2^60 + 1 at exponent 0: 61 bits, the 8 low bits below half of the 53-bit place
  EXPECT_EQ(round_scaled_integer(false, (mpz_int(1) << 60) + 1, 0, DType::F64).bits,
            0x43B0000000000000u);
}

TEST(IntRound, DecodeAndStorage) {
  EXPECT_EQ(bits_to_double(0x7BFF, DType::F16), 65504.0);
  EXPECT_EQ(bits_to_double(0x0001, DType::F16), std::ldexp(1.0, -24));
  EXPECT_EQ(bits_to_double(0x8001, DType::BF16), -std::ldexp(1.0, -133));
  EXPECT_TRUE(std::isinf(bits_to_double(0xFC00, DType::F16)));
  EXPECT_TRUE(bits_are_nan(0x7FC0, DType::BF16));
  unsigned char b[8] = {};
  store_bits(0x3C01, DType::F16, b);
  EXPECT_EQ(b[0], 0x01);
  EXPECT_EQ(b[1], 0x3C);
  EXPECT_EQ(load_bits(b, DType::F16), 0x3C01u);
}

// F32 and F16 against the hardware / libgcc conversions from double, on random doubles near
// and inside each format's range (including ties built from a format value and half its ulp).
// F16 only where the compiler has _Float16; RandomAgainstMpfr checks it everywhere.
TEST(IntRound, RandomAgainstHardware) {
  std::mt19937_64 rng(12345);
  for (int it = 0; it < 200000; ++it) {
    const std::uint64_t u = rng();
    const int e = static_cast<int>(rng() % 340) - 170;
    double x = std::ldexp(1.0 + static_cast<double>(u >> 12) * std::ldexp(1.0, -52), e);
    if (it % 3 == 0 && std::fabs(x) < 1e38) {
      // a float and half its last place, possibly a tie
      const auto f = static_cast<float>(x);
      x = static_cast<double>(f) + std::ldexp(static_cast<double>(std::nextafter(f, 1e30f) - f),
                                              -1) * static_cast<double>(rng() % 3);
    }
    if (rng() & 1) x = -x;
    const float f = static_cast<float>(x);
    std::uint32_t fb;
    std::memcpy(&fb, &f, 4);
    ASSERT_EQ(rd(x, DType::F32), fb) << std::hexfloat << x;
#ifdef __FLT16_MAX__  // a compiler with _Float16 (GCC; clang 14 has none on x86-64)
    const double y = std::ldexp(x, -(e / 6) * 5);  // spread over F16's narrower range
    const auto h = static_cast<_Float16>(y);
    std::uint16_t hb;
    std::memcpy(&hb, &h, 2);
    ASSERT_EQ(rd(y, DType::F16), hb) << std::hexfloat << y;
#endif
  }
}

// All four formats from 600-bit values against MPFR's own rounding in the format's exponent
// range (mpfr_check_range + mpfr_subnormalize, the documented idiom).
TEST(IntRound, RandomAgainstMpfr) {
  std::mt19937_64 rng(777);
  gmp_randstate_t gs;
  gmp_randinit_default(gs);
  gmp_randseed_ui(gs, 99);
  Big x;
  mpfr_t y;
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16}) {
    const BinaryFormat f = binary_format(t);
    const long bias = (1L << (f.exponent_bits - 1)) - 1;
    const long emin = 3 - bias - f.precision, emax = bias + 1;  // MPFR's conventions
    mpfr_init2(y, f.precision);
    for (int it = 0; it < 20000; ++it) {
      mpfr_urandomb(x.v, gs);  // [0, 1), 600 random bits
      if (it % 4 == 0) mpfr_prec_round(x.v, f.precision + 1, MPFR_RNDZ);  // exact midpoints
      mpfr_prec_round(x.v, 600, MPFR_RNDN);
      const long span = emax - emin + 8;
      mpfr_mul_2si(x.v, x.v, emin - 4 + static_cast<long>(rng() % static_cast<std::uint64_t>(span)),
                   MPFR_RNDN);
      if (rng() & 1) mpfr_neg(x.v, x.v, MPFR_RNDN);
      int inex = mpfr_set(y, x.v, MPFR_RNDN);
      const mpfr_exp_t old_min = mpfr_get_emin(), old_max = mpfr_get_emax();
      mpfr_set_emin(emin);
      mpfr_set_emax(emax);
      inex = mpfr_check_range(y, inex, MPFR_RNDN);
      mpfr_subnormalize(y, inex, MPFR_RNDN);
      mpfr_set_emin(old_min);
      mpfr_set_emax(old_max);
      const double want = mpfr_get_d(y, MPFR_RNDN);  // exact: p <= 53, in F64's range
      const double got = bits_to_double(round_mpfr(x.v, t).bits, t);
      ASSERT_TRUE(want == got && std::signbit(want) == std::signbit(got))
          << "format " << f.precision << " x=" << mpfr_get_d(x.v, MPFR_RNDN) << " want " << want
          << " got " << got;
    }
    mpfr_clear(y);
  }
  gmp_randclear(gs);
}

}  // namespace
}  // namespace attnoracle::testing
