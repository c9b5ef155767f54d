#include "attnoracle/reference/dtype.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace attnoracle {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 15> kTypes{{
    {DType::F64, "F64", 8},         {DType::F32, "F32", 4},     {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},       {DType::BOOL, "BOOL", 1},   {DType::U8, "U8", 1},
    {DType::I8, "I8", 1},           {DType::U16, "U16", 2},     {DType::I16, "I16", 2},
    {DType::U32, "U32", 4},         {DType::I32, "I32", 4},     {DType::U64, "U64", 8},
    {DType::I64, "I64", 8},         {DType::F8_E4M3, "F8_E4M3", 1},
    {DType::F8_E5M2, "F8_E5M2", 1},
}};

const DTypeInfo& info(DType t) {
  for (const auto& i : kTypes)
    if (i.type == t) return i;
  throw std::logic_error("unknown dtype");
}

// Encodes a double that is exactly representable in a binary format with `mant` stored
// significand bits and the given exponent width, into its bit pattern. Throws if not exact.
std::uint32_t encode_small(double x, int mant, int ebits, const char* what) {
  const int bias = (1 << (ebits - 1)) - 1;
  const std::uint32_t sign = std::signbit(x) ? 1u : 0u;
  std::uint32_t bits = sign << (mant + ebits);
  if (std::isnan(x)) return bits | (((1u << ebits) - 1) << mant) | (1u << (mant - 1));
  if (std::isinf(x)) return bits | (((1u << ebits) - 1) << mant);
  double a = std::fabs(x);
  if (a == 0) return bits;
  int e = std::ilogb(a);  // a = f * 2^e, 1 <= f < 2
  if (e > bias) throw std::logic_error(std::string(what) + ": value out of range");
  const int emin = 1 - bias;
  if (e < emin) {
    // subnormal: a = n * 2^(emin - mant), n < 2^mant
    double n = std::ldexp(a, mant - emin);
    if (n != std::floor(n) || n < 1)
      throw std::logic_error(std::string(what) + ": value not representable");
    return bits | static_cast<std::uint32_t>(n);
  }
  double n = std::ldexp(a, mant - e);  // in [2^mant, 2^(mant+1))
  if (n != std::floor(n)) throw std::logic_error(std::string(what) + ": value not representable");
  auto frac = static_cast<std::uint32_t>(n) - (1u << mant);
  return bits | (static_cast<std::uint32_t>(e + bias) << mant) | frac;
}

double decode_small(std::uint32_t bits, int mant, int ebits) {
  const int bias = (1 << (ebits - 1)) - 1;
  const bool neg = (bits >> (mant + ebits)) & 1u;
  const std::uint32_t e = (bits >> mant) & ((1u << ebits) - 1);
  const std::uint32_t f = bits & ((1u << mant) - 1);
  double v;
  if (e == (1u << ebits) - 1)
    v = f ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(f), 1 - bias - mant);
  else
    v = std::ldexp(static_cast<double>(f | (1u << mant)), static_cast<int>(e) - bias - mant);
  return neg ? -v : v;
}

template <class T>
T load_le(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the format is little-endian, as is every supported host
  return v;
}

}  // namespace

static_assert(std::endian::native == std::endian::little, "little-endian hosts only");

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kTypes)
    if (i.name == name) return i.type;
  return std::nullopt;
}
std::string_view dtype_name(DType t) { return info(t).name; }
std::size_t dtype_size(DType t) { return info(t).size; }
bool is_float_format(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16;
}
bool is_fp8(DType t) { return t == DType::F8_E4M3 || t == DType::F8_E5M2; }
bool is_input_format(DType t) { return is_float_format(t) || is_fp8(t); }

FloatFormat float_format(DType t) {
  switch (t) {
    case DType::F64: return {53, 3 - 1023 - 53, 1024, 11, 1023};
    case DType::F32: return {24, 3 - 127 - 24, 128, 8, 127};
    case DType::F16: return {11, 3 - 15 - 11, 16, 5, 15};
    case DType::BF16: return {8, 3 - 127 - 8, 128, 8, 127};
    case DType::F8_E4M3: return {4, 3 - 7 - 4, 9, 4, 7};
    case DType::F8_E5M2: return {3, 3 - 15 - 3, 16, 5, 15};
    default: throw std::logic_error("float_format: not a float format");
  }
}

// A normal F16 number is a double of exponent -14 .. 15 whose significand ends in 42 zero bits:
// its fields, shifted, are the F16 fields; anything else (zero, subnormal, out of range, not
// representable, infinite, NaN) takes the general rule.
std::uint16_t f16_bits_exact(double x) {
  const auto bits = std::bit_cast<std::uint64_t>(x);
  const auto e = static_cast<int>((bits >> 52) & 0x7ff) - 1023;
  const std::uint64_t frac = bits & ((std::uint64_t{1} << 52) - 1);
  if (e >= -14 && e <= 15 && (frac & ((std::uint64_t{1} << 42) - 1)) == 0)
    return static_cast<std::uint16_t>(((bits >> 48) & 0x8000u) | (static_cast<std::uint64_t>(e + 15) << 10) |
                                      (frac >> 42));
  return static_cast<std::uint16_t>(encode_small(x, 10, 5, "F16"));
}
// A BF16 number is an F32 number whose lower half is 0 (decoding's rule backwards); anything
// else (NaN, a value BF16 cannot hold) takes the general rule.
std::uint16_t bf16_bits_exact(double x) {
  const auto f = static_cast<float>(x);
  const auto bits = std::bit_cast<std::uint32_t>(f);
  if (static_cast<double>(f) == x && (bits & 0xffffu) == 0) return static_cast<std::uint16_t>(bits >> 16);
  return static_cast<std::uint16_t>(encode_small(x, 7, 8, "BF16"));
}
// A normal F16 number's fields, shifted into a double's (exponent rebiased, 42 zero bits below
// the significand); a subnormal one is its significand times 2^-24, exact; infinities and NaN
// take the general rule.
double f16_from_bits(std::uint16_t b) {
  const std::uint32_t e = (b >> 10) & 0x1fu;
  if (e == 0x1f) return decode_small(b, 10, 5);
  const std::uint64_t sign = static_cast<std::uint64_t>(b & 0x8000u) << 48;
  if (e == 0) {
    const double v = static_cast<double>(b & 0x3ffu) * 0x1p-24;
    return std::bit_cast<double>(std::bit_cast<std::uint64_t>(v) | sign);
  }
  return std::bit_cast<double>(sign | (static_cast<std::uint64_t>(e - 15 + 1023) << 52) |
                               (static_cast<std::uint64_t>(b & 0x3ffu) << 42));
}
// A finite BF16 number is the F32 number whose upper half has its bits (F32 embeds exactly in
// F64); infinities and NaN take the general rule.
double bf16_from_bits(std::uint16_t b) {
  if ((b & 0x7f80u) == 0x7f80u) return decode_small(b, 7, 8);
  return static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16));
}

// E4M3FN: s eeee mmm, value (-1)^s 2^(e-7) (1 + m/8), or 2^-6 (m/8) when e = 0; s 1111 111 is NaN
// and exponent 15 is otherwise a normal binade (up to 1.75 * 2^8 = 448).
double f8_e4m3_from_bits(std::uint8_t b) {
  const unsigned e = (b >> 3) & 0xFu, m = b & 7u;
  double v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -9);
  else
    v = std::ldexp(static_cast<double>(8 + m), static_cast<int>(e) - 10);
  return (b & 0x80u) ? -v : v;
}
double f8_e5m2_from_bits(std::uint8_t b) { return decode_small(b, 2, 5); }

std::uint8_t f8_e4m3_bits_exact(double x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  if (!(std::fabs(x) <= 448)) throw std::logic_error("F8_E4M3: value out of range");
  // Below 2^8 the layout is IEEE's with bias 7; the binade [256, 448] continues it.
  if (std::fabs(x) < 256) return static_cast<std::uint8_t>(encode_small(x, 3, 4, "F8_E4M3"));
  const double n = std::ldexp(std::fabs(x), -5);  // in [8, 14]
  if (n != std::floor(n)) throw std::logic_error("F8_E4M3: value not representable");
  return static_cast<std::uint8_t>(sign | (15u << 3) | (static_cast<unsigned>(n) - 8));
}
std::uint8_t f8_e5m2_bits_exact(double x) {
  return static_cast<std::uint8_t>(encode_small(x, 2, 5, "F8_E5M2"));
}

double decode_float(DType t, const unsigned char* p) {
  switch (t) {
    case DType::F64: return load_le<double>(p);
    case DType::F32: return static_cast<double>(load_le<float>(p));  // exact widening
    case DType::F16: return f16_from_bits(load_le<std::uint16_t>(p));
    case DType::BF16: return bf16_from_bits(load_le<std::uint16_t>(p));
    case DType::F8_E4M3: return f8_e4m3_from_bits(*p);
    case DType::F8_E5M2: return f8_e5m2_from_bits(*p);
    default: throw std::logic_error("decode_float: not a float format");
  }
}

void encode_float(DType t, double x, unsigned char* p) {
  switch (t) {
    case DType::F64: std::memcpy(p, &x, 8); return;
    case DType::F32: {
      auto f = static_cast<float>(x);
      if (!std::isnan(x) && static_cast<double>(f) != x)
        throw std::logic_error("F32: value not representable");
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::F16: {
      std::uint16_t b = f16_bits_exact(x);
      std::memcpy(p, &b, 2);
      return;
    }
    case DType::BF16: {
      std::uint16_t b = bf16_bits_exact(x);
      std::memcpy(p, &b, 2);
      return;
    }
    case DType::F8_E4M3: *p = f8_e4m3_bits_exact(x); return;
    case DType::F8_E5M2: *p = f8_e5m2_bits_exact(x); return;
    default: throw std::logic_error("encode_float: not a float format");
  }
}

}  // namespace attnoracle
