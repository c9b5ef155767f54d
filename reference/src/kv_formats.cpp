#include "attnoracle/reference/kv_formats.hpp"

#include <cmath>
#include <limits>

namespace attnoracle {

double e2m1_from_bits(std::uint8_t nibble) {
  const unsigned e = (nibble >> 1) & 3u, m = nibble & 1u;
  const double v = e == 0 ? 0.5 * m : std::ldexp(2.0 + m, static_cast<int>(e) - 2);
  return (nibble & 8u) ? -v : v;
}

double e8m0_from_bits(std::uint8_t bits) {
  if (bits == 255) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, static_cast<int>(bits) - 127);  // 2^-127 .. 2^127: normal doubles
}

double i8_from_bits(std::uint8_t bits) { return static_cast<double>(static_cast<std::int8_t>(bits)); }

std::string_view kv_scheme_name(KvScheme s) {
  switch (s) {
    case KvScheme::Scaled: return "scaled";
    case KvScheme::Mxfp8: return "mxfp8";
    case KvScheme::Nvfp4: return "nvfp4";
    default: return "plain";
  }
}

}  // namespace attnoracle
