// FP8 (F8_E4M3, F8_E5M2): every bit pattern decoded against a table built here from the formats'
// definitions, named values, exact encoding, and round_double's nearest-even rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::testing {
namespace {

// The value of pattern b of a binary format with `ebits` exponent and `mbits` fraction bits,
// read from its definition: field e = 0 is 2^(1-bias) * 0.f, else 2^(e-bias) * 1.f. `ieee`
// makes the all-ones exponent infinities (f = 0) and NaN; else (E4M3FN) only all ones is NaN.
double by_definition(unsigned b, int ebits, int mbits, bool ieee) {
  const int bias = (1 << (ebits - 1)) - 1;
  const unsigned emask = (1u << ebits) - 1, mmask = (1u << mbits) - 1;
  const unsigned e = (b >> mbits) & emask, f = b & mmask;
  const double sign = (b >> (ebits + mbits)) & 1u ? -1.0 : 1.0;
  if (ieee && e == emask) return f ? NAN : sign * INFINITY;
  if (!ieee && e == emask && f == mmask) return NAN;
  const double frac = static_cast<double>(f) / static_cast<double>(1u << mbits);
  if (e == 0) return sign * std::ldexp(frac, 1 - bias);
  return sign * std::ldexp(1 + frac, static_cast<int>(e) - bias);
}

void expect_same(double got, double want, unsigned b) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "pattern 0x" << std::hex << b;
  } else {
    EXPECT_EQ(got, want) << "pattern 0x" << std::hex << b;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << "pattern 0x" << std::hex << b;
  }
}

TEST(Fp8Decode, EveryE4M3Pattern) {
  int nans = 0;
  for (unsigned b = 0; b < 256; ++b) {
    const auto byte = static_cast<unsigned char>(b);
    const double want = by_definition(b, 4, 3, false);
    expect_same(f8_e4m3_from_bits(static_cast<std::uint8_t>(b)), want, b);
    expect_same(decode_float(DType::F8_E4M3, &byte), want, b);
    nans += std::isnan(want);
    EXPECT_FALSE(std::isinf(f8_e4m3_from_bits(static_cast<std::uint8_t>(b))));
  }
  EXPECT_EQ(nans, 2);  // 0x7F and 0xFF
}

TEST(Fp8Decode, EveryE5M2Pattern) {
  int nans = 0, infs = 0;
  for (unsigned b = 0; b < 256; ++b) {
    const auto byte = static_cast<unsigned char>(b);
    const double want = by_definition(b, 5, 2, true);
    expect_same(f8_e5m2_from_bits(static_cast<std::uint8_t>(b)), want, b);
    expect_same(decode_float(DType::F8_E5M2, &byte), want, b);
    nans += std::isnan(want);
    infs += std::isinf(want);
  }
  EXPECT_EQ(nans, 6);
  EXPECT_EQ(infs, 2);
}

TEST(Fp8Decode, NamedValues) {
  EXPECT_EQ(f8_e4m3_from_bits(0x7E), 448.0);
  EXPECT_EQ(f8_e4m3_from_bits(0xFE), -448.0);
  EXPECT_EQ(f8_e4m3_from_bits(0x01), 0x1p-9);  // smallest subnormal
  EXPECT_EQ(f8_e4m3_from_bits(0x07), 7 * 0x1p-9);
  EXPECT_EQ(f8_e4m3_from_bits(0x08), 0x1p-6);  // smallest normal
  EXPECT_EQ(f8_e4m3_from_bits(0x38), 1.0);
  EXPECT_EQ(f8_e4m3_from_bits(0x78), 256.0);
  EXPECT_TRUE(std::isnan(f8_e4m3_from_bits(0x7F)));
  EXPECT_TRUE(std::isnan(f8_e4m3_from_bits(0xFF)));
  EXPECT_TRUE(std::signbit(f8_e4m3_from_bits(0x80)));
  EXPECT_EQ(f8_e5m2_from_bits(0x7B), 57344.0);  // largest finite
  EXPECT_EQ(f8_e5m2_from_bits(0xFB), -57344.0);
  EXPECT_EQ(f8_e5m2_from_bits(0x01), 0x1p-16);  // smallest subnormal
  EXPECT_EQ(f8_e5m2_from_bits(0x04), 0x1p-14);  // smallest normal
  EXPECT_EQ(f8_e5m2_from_bits(0x3C), 1.0);
  EXPECT_EQ(f8_e5m2_from_bits(0x7C), INFINITY);
  EXPECT_EQ(f8_e5m2_from_bits(0xFC), -INFINITY);
  EXPECT_TRUE(std::isnan(f8_e5m2_from_bits(0x7D)));
}

TEST(Fp8Encode, RoundTripsEveryFinitePattern) {
  for (unsigned b = 0; b < 256; ++b) {
    const auto u = static_cast<std::uint8_t>(b);
    const double x = f8_e4m3_from_bits(u);
    if (!std::isnan(x)) {
      EXPECT_EQ(f8_e4m3_bits_exact(x), u) << b;
      unsigned char out = 0;
      encode_float(DType::F8_E4M3, x, &out);
      EXPECT_EQ(out, u);
    }
    const double y = f8_e5m2_from_bits(u);
    if (!std::isnan(y)) {
      EXPECT_EQ(f8_e5m2_bits_exact(y), u) << b;
    }
  }
  EXPECT_THROW(f8_e4m3_bits_exact(480), std::logic_error);
  EXPECT_THROW(f8_e4m3_bits_exact(INFINITY), std::logic_error);
  EXPECT_THROW(f8_e4m3_bits_exact(1.0625), std::logic_error);  // 1 + 2^-4: 4 bits needed
  EXPECT_THROW(f8_e4m3_bits_exact(0x1p-10), std::logic_error);
  EXPECT_THROW(f8_e5m2_bits_exact(1.125), std::logic_error);
  EXPECT_THROW(f8_e5m2_bits_exact(0x1p-17), std::logic_error);
}

// The finite values of a format in increasing order, from the table.
std::vector<double> finite_values(double (*from_bits)(std::uint8_t)) {
  std::vector<double> v;
  for (unsigned b = 0; b < 256; ++b) {
    const double x = from_bits(static_cast<std::uint8_t>(b));
    if (std::isfinite(x) && !(x == 0 && std::signbit(x))) v.push_back(x);
  }
  std::sort(v.begin(), v.end());
  return v;
}

// Nearest-even against the table: each value is kept, a point just inside either side of a
// midpoint goes to the nearer neighbour, the midpoint to the one with an even pattern.
void check_rounding(DType t, double (*from_bits)(std::uint8_t), std::uint8_t (*bits)(double)) {
  const std::vector<double> v = finite_values(from_bits);
  for (std::size_t a = 0; a < v.size(); ++a) {
    EXPECT_EQ(round_double(v[a], t), v[a]);
    EXPECT_EQ(round_double(-v[a], t), -v[a]);
    if (a + 1 == v.size()) break;
    const double lo = v[a], hi = v[a + 1], mid = (lo + hi) / 2;  // exact in a double
    EXPECT_EQ(round_double(std::nextafter(mid, lo), t), lo) << mid;
    EXPECT_EQ(round_double(std::nextafter(mid, hi), t), hi) << mid;
    EXPECT_EQ(round_double(mid, t), (bits(lo) & 1) == 0 ? lo : hi) << mid;
    EXPECT_EQ(round_double(-mid, t), (bits(lo) & 1) == 0 ? -lo : -hi) << mid;
  }
}

TEST(Fp8Round, NearestEvenAgainstTheTable) {
  check_rounding(DType::F8_E4M3, f8_e4m3_from_bits, f8_e4m3_bits_exact);
  check_rounding(DType::F8_E5M2, f8_e5m2_from_bits, f8_e5m2_bits_exact);
}

TEST(Fp8Round, RangeEnds) {
  // E4M3 saturates (no infinity); E5M2 overflows as IEEE does, past 57344 + 4096 (the tie).
  EXPECT_EQ(round_double(460, DType::F8_E4M3), 448.0);
  EXPECT_EQ(round_double(464, DType::F8_E4M3), 448.0);
  EXPECT_EQ(round_double(1e6, DType::F8_E4M3), 448.0);
  EXPECT_EQ(round_double(-1e6, DType::F8_E4M3), -448.0);
  EXPECT_EQ(round_double(INFINITY, DType::F8_E4M3), 448.0);
  EXPECT_EQ(round_double(61439, DType::F8_E5M2), 57344.0);
  EXPECT_EQ(round_double(61440, DType::F8_E5M2), INFINITY);
  EXPECT_EQ(round_double(-1e9, DType::F8_E5M2), -INFINITY);
  // below the smallest subnormal: half of it is a tie, to even 0; above half, up
  EXPECT_EQ(round_double(0x1p-10, DType::F8_E4M3), 0.0);
  EXPECT_EQ(round_double(0x1.0001p-10, DType::F8_E4M3), 0x1p-9);
  EXPECT_EQ(round_double(0x1p-17, DType::F8_E5M2), 0.0);
  EXPECT_EQ(round_double(0x1.0001p-17, DType::F8_E5M2), 0x1p-16);
  EXPECT_TRUE(std::isnan(round_double(NAN, DType::F8_E4M3)));
}

TEST(Fp8DType, NamesAndClasses) {
  EXPECT_EQ(dtype_from_name("F8_E4M3"), DType::F8_E4M3);
  EXPECT_EQ(dtype_from_name("F8_E5M2"), DType::F8_E5M2);
  EXPECT_EQ(dtype_size(DType::F8_E4M3), 1u);
  EXPECT_TRUE(is_fp8(DType::F8_E5M2));
  EXPECT_TRUE(is_input_format(DType::F8_E4M3));
  EXPECT_FALSE(is_float_format(DType::F8_E4M3));  // never an output dtype
  EXPECT_TRUE(is_input_format(DType::BF16));
  EXPECT_FALSE(is_input_format(DType::I8));
}

}  // namespace
}  // namespace attnoracle::testing
