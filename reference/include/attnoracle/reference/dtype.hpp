// Element types of case files and their IEEE 754 binary formats.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace attnoracle {

// Every safetensors dtype name is recognised so that the reader can validate byte ranges of any
// file; only the floating formats and BOOL are accepted in case files. F8_E4M3 is OCP's E4M3FN
// (bias 7, subnormals, no infinities, largest finite 448, NaN 0x7F and 0xFF); F8_E5M2 is
// IEEE-style (bias 15, subnormals, infinities, NaN). Both are input dtypes only.
enum class DType { F64, F32, F16, BF16, BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F8_E4M3, F8_E5M2 };

std::optional<DType> dtype_from_name(std::string_view name);
std::string_view dtype_name(DType t);
std::size_t dtype_size(DType t);
bool is_float_format(DType t);  // F64, F32, F16 or BF16: the formats the reference rounds into
bool is_fp8(DType t);           // F8_E4M3 or F8_E5M2
bool is_input_format(DType t);  // is_float_format or is_fp8: the dtypes of q, k, v

// An IEEE 754 binary format in MPFR's conventions: p significand bits (hidden bit included);
// values m * 2^e with 1/2 <= m < 1 are normal-or-subnormal exactly when emin <= e <= emax.
struct FloatFormat {
  int precision;  // p
  long emin;      // MPFR exponent of the smallest subnormal: 3 - bias - p
  long emax;      // MPFR exponent bound: bias + 1
  int exponent_bits;
  int bias;
};
// Only for is_input_format(t). For F8_E4M3, emax admits the top binade's last pattern (480),
// which is NaN in E4M3FN: its largest finite value, 448, is enforced by round_double.
FloatFormat float_format(DType t);

// Exact decoding of a stored element into a double (every supported float format embeds in F64);
// FP8 NaN patterns give NaN, E5M2's infinities give infinities.
double decode_float(DType t, const unsigned char* bytes);
// Exact encoding of a double that is representable in the format t (checked: throws
// std::logic_error otherwise; no rounding ever happens here).
void encode_float(DType t, double value, unsigned char* bytes);
// Bit patterns for F16 and BF16 (little-endian storage is done by encode_float).
std::uint16_t f16_bits_exact(double value);
std::uint16_t bf16_bits_exact(double value);
double f16_from_bits(std::uint16_t bits);
double bf16_from_bits(std::uint16_t bits);
std::uint8_t f8_e4m3_bits_exact(double value);
std::uint8_t f8_e5m2_bits_exact(double value);
double f8_e4m3_from_bits(std::uint8_t bits);
double f8_e5m2_from_bits(std::uint8_t bits);

}  // namespace attnoracle
