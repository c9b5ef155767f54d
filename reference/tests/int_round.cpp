#include "int_round.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace attnoracle::testing {

using boost::multiprecision::mpz_int;

BinaryFormat binary_format(DType t) {
  switch (t) {
    case DType::F64: return {53, 11};
    case DType::F32: return {24, 8};
    case DType::F16: return {11, 5};
    case DType::BF16: return {8, 8};
    case DType::F8_E4M3: return {4, 4};
    case DType::F8_E5M2: return {3, 5};
    default: throw std::logic_error("int_round: not a binary float format");
  }
}

int format_width(DType t) {
  const BinaryFormat f = binary_format(t);
  return f.precision + f.exponent_bits;  // stored fraction (p - 1) + exponent + sign
}

IntRounded round_scaled_integer(bool negative, const mpz_int& magnitude, long exp2, DType t) {
  const BinaryFormat f = binary_format(t);
  const int p = f.precision;
  const long bias = (1L << (f.exponent_bits - 1)) - 1;
  const long emin = 1 - bias;  // exponent of the smallest normal number
  const std::uint64_t sign = negative ? std::uint64_t{1} << (format_width(t) - 1) : 0;
  const std::uint64_t exp_all_ones = (std::uint64_t{1} << f.exponent_bits) - 1;
  const std::uint64_t inf_bits = sign | (exp_all_ones << (p - 1));
  if (magnitude < 0) throw std::logic_error("round_scaled_integer: negative magnitude");
  if (magnitude == 0) return {sign, Discarded::None};
  // E4M3FN: the all-ones exponent is a normal binade (up to 448; 480 would be its NaN), no
  // infinities. Past 448 is refused: the tests round only clamped values into it.
  const bool fn = t == DType::F8_E4M3;
  const long top_exp = fn ? bias + 1 : bias;

  // The value lies in [2^e, 2^(e+1)).
  const long top = static_cast<long>(boost::multiprecision::msb(magnitude));
  const long e = exp2 + top;
  if (e > top_exp) {  // >= 2^(emax+1): beyond any rounding
    if (fn) throw std::logic_error("round_scaled_integer: past F8_E4M3's range");
    return {inf_bits, Discarded::AboveHalf};
  }
  // Exponent of the unit in the last kept place: p bits for normals, fixed for subnormals.
  long q = std::max(e, emin) - (p - 1);
  const long shift = q - exp2;  // bits of the magnitude to discard
  mpz_int n;
  Discarded d = Discarded::None;
  if (shift <= 0) {
    n = magnitude << static_cast<unsigned>(-shift);
  } else if (shift > top + 1) {
    // below half the last place (magnitude < 2^(top+1) <= 2^(shift-1)): rounds to zero
    n = 0;
    d = Discarded::BelowHalf;
  } else {
    const auto s = static_cast<unsigned>(shift);
    n = magnitude >> s;
    const mpz_int rem = magnitude - (n << s);
    const mpz_int half = mpz_int(1) << (s - 1);
    if (rem == 0)
      d = Discarded::None;
    else if (rem < half)
      d = Discarded::BelowHalf;
    else if (rem == half)
      d = Discarded::Half;
    else
      d = Discarded::AboveHalf;
    // nearest, ties to even
    const bool odd = boost::multiprecision::bit_test(n, 0);
    if (d == Discarded::AboveHalf || (d == Discarded::Half && odd)) n += 1;
  }
  const mpz_int hidden = mpz_int(1) << static_cast<unsigned>(p - 1);
  if (n == (hidden << 1)) {  // the carry went past p bits
    n >>= 1;
    q += 1;
  }
  if (n < hidden) {  // subnormal or zero: the exponent field is 0
    return {sign | n.convert_to<std::uint64_t>(), d};
  }
  const long biased = q + (p - 1) + bias;
  const auto frac = static_cast<std::uint64_t>((n - hidden).convert_to<std::uint64_t>());
  if (fn && (biased > static_cast<long>(exp_all_ones) ||
             (biased == static_cast<long>(exp_all_ones) && frac == 7)))
    throw std::logic_error("round_scaled_integer: past F8_E4M3's range");
  if (!fn && biased >= static_cast<long>(exp_all_ones)) return {inf_bits, d};
  return {sign | (static_cast<std::uint64_t>(biased) << (p - 1)) | frac, d};
}

IntRounded round_mpfr(mpfr_srcptr x, DType t) {
  if (mpfr_nan_p(x)) throw std::logic_error("round_mpfr: NaN");
  const bool neg = mpfr_signbit(x) != 0;
  if (mpfr_inf_p(x)) {
    const BinaryFormat f = binary_format(t);
    const std::uint64_t sign = neg ? std::uint64_t{1} << (format_width(t) - 1) : 0;
    return {sign | (((std::uint64_t{1} << f.exponent_bits) - 1) << (f.precision - 1)),
            Discarded::None};
  }
  if (mpfr_zero_p(x)) return round_scaled_integer(neg, mpz_int(0), 0, t);
  mpz_int m;
  // x = m * 2^e exactly, m an integer holding the whole significand
  const mpfr_exp_t e = mpfr_get_z_2exp(m.backend().data(), x);
  if (m < 0) m = -m;
  return round_scaled_integer(neg, m, static_cast<long>(e), t);
}

std::uint64_t round_double(double x, DType t) {
  if (std::isnan(x)) throw std::logic_error("round_double: NaN");
  const bool neg = std::signbit(x);
  if (std::isinf(x)) {
    if (t == DType::F8_E4M3) throw std::logic_error("round_double: F8_E4M3 has no infinity");
    const BinaryFormat f = binary_format(t);
    const std::uint64_t sign = neg ? std::uint64_t{1} << (format_width(t) - 1) : 0;
    return sign | (((std::uint64_t{1} << f.exponent_bits) - 1) << (f.precision - 1));
  }
  // |x| = m * 2^e with m < 2^53 an integer, read from the bit pattern
  const auto u = std::bit_cast<std::uint64_t>(x);
  const auto field = static_cast<long>((u >> 52) & 0x7FF);
  std::uint64_t m = u & ((std::uint64_t{1} << 52) - 1);
  long e = -1074;
  if (field != 0) {
    m |= std::uint64_t{1} << 52;
    e = field - 1075;
  }
  return round_scaled_integer(neg, mpz_int(m), e, t).bits;
}

double bits_to_double(std::uint64_t bits, DType t) {
  if (t == DType::F64) return std::bit_cast<double>(bits);
  const BinaryFormat f = binary_format(t);
  const int p = f.precision;
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const bool neg = (bits >> (format_width(t) - 1)) & 1;
  const auto field = static_cast<int>((bits >> (p - 1)) & ((1u << f.exponent_bits) - 1));
  const std::uint64_t frac = bits & ((std::uint64_t{1} << (p - 1)) - 1);
  double v;
  if (t == DType::F8_E4M3 && field == 15 && frac == 7)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (t == DType::F8_E4M3 && field == 15)
    v = std::ldexp(static_cast<double>(frac | 8), 15 - bias - 3);
  else if (field == (1 << f.exponent_bits) - 1)
    v = frac ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (field == 0)
    v = std::ldexp(static_cast<double>(frac), 1 - bias - (p - 1));
  else
    v = std::ldexp(static_cast<double>(frac | (std::uint64_t{1} << (p - 1))),
                   field - bias - (p - 1));
  return neg ? -v : v;
}

bool bits_are_nan(std::uint64_t bits, DType t) { return std::isnan(bits_to_double(bits, t)); }

std::uint64_t load_bits(const unsigned char* p, DType t) {
  const int bytes = format_width(t) / 8;
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_bits(std::uint64_t bits, DType t, unsigned char* p) {
  const int bytes = format_width(t) / 8;
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(bits >> (8 * i));
}

}  // namespace attnoracle::testing
