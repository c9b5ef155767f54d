// Rounding into the binary formats F64, F32, F16, BF16 and FP8 (E4M3FN: no infinities) by
// integer arithmetic on the significand: the tests' own rounding, sharing no code with the
// reference's (round.cpp).
// A value is (-1)^s * M * 2^E with M an integer; the kept part and the discarded remainder are
// found by shifting M, and the remainder is compared with one half of the last kept place.
#pragma once

#include <cstdint>

#include <boost/multiprecision/gmp.hpp>
#include <mpfr.h>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle::testing {

// The discarded part of a rounded value, against half a unit in the last kept place.
enum class Discarded { None, BelowHalf, Half, AboveHalf };

struct IntRounded {
  std::uint64_t bits = 0;  // the result's bit pattern, sign included, in the low bits
  Discarded discarded = Discarded::None;
};

// p (hidden bit included) and the exponent field's width.
struct BinaryFormat {
  int precision;
  int exponent_bits;
};
BinaryFormat binary_format(DType t);  // F64, F32, F16, BF16, F8_E4M3, F8_E5M2
int format_width(DType t);            // 64, 32, 16 or 8

// (-1)^negative * magnitude * 2^exp2 rounded to nearest, ties to even, into t: subnormals kept,
// overflow to infinity. A zero result keeps the sign.
IntRounded round_scaled_integer(bool negative, const boost::multiprecision::mpz_int& magnitude,
                                long exp2, DType t);
// An MPFR number (finite or infinite; NaN throws std::logic_error) rounded into t.
IntRounded round_mpfr(mpfr_srcptr x, DType t);
// A double rounded into t (the generator's "round to the input dtype").
std::uint64_t round_double(double x, DType t);

// Exact decoding of a bit pattern of t (every format embeds in F64).
double bits_to_double(std::uint64_t bits, DType t);
bool bits_are_nan(std::uint64_t bits, DType t);
// Little-endian element storage.
std::uint64_t load_bits(const unsigned char* p, DType t);
void store_bits(std::uint64_t bits, DType t, unsigned char* p);

}  // namespace attnoracle::testing
