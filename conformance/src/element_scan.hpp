// Reading the elements of a returned or golden tensor, and the fast paths of the comparison:
// elements whose bits equal the golden element's are recognised without decoding them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance::comparing {

// dtype_size, inline for the float formats the comparison reads element by element.
inline std::size_t width_of(DType t) {
  switch (t) {
    case DType::F64: return 8;
    case DType::F32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    default: return dtype_size(t);
  }
}
// The value of a finite element of a float format (exact, as decode_float).
inline double finite_value(DType t, const unsigned char* p) {
  switch (t) {
    case DType::F32: {
      float x;
      std::memcpy(&x, p, 4);
      return static_cast<double>(x);
    }
    case DType::BF16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const std::uint32_t w = static_cast<std::uint32_t>(b) << 16;
      float x;
      std::memcpy(&x, &w, 4);
      return static_cast<double>(x);
    }
    case DType::F16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const int e = (b >> 10) & 31, m = b & 1023;  // finite: e < 31
      const double mag = e == 0 ? static_cast<double>(m) * 0x1p-24 : static_cast<double>(1024 + m) * exp2i(e - 25);
      return (b & 0x8000) ? -mag : mag;
    }
    default: return decode_float(t, p);
  }
}

// decode_float, inline for finite F64, F32, F16 and BF16 elements.
inline double decode_value(DType t, const unsigned char* p) {
  switch (t) {
    case DType::F64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::F32: {
      float x;
      std::memcpy(&x, p, 4);
      return static_cast<double>(x);
    }
    case DType::F16:
    case DType::BF16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const std::uint16_t e = t == DType::F16 ? 0x7c00 : 0x7f80;  // all ones: infinite or NaN
      return (b & e) != e ? finite_value(t, p) : decode_float(t, p);
    }
    default: return decode_float(t, p);
  }
}

inline std::uint64_t bits_of(const RawTensor& t, std::size_t k) {
  std::uint64_t b = 0;
  const std::size_t w = width_of(t.dtype);
  std::memcpy(&b, t.data.data() + k * w, w);
  return b;
}
inline double sq(double x) { return x * x; }
inline double value_of(const RawTensor& t, std::size_t k) { return decode_value(t.dtype, t.data.data() + k * width_of(t.dtype)); }

inline std::vector<std::int64_t> unflatten(std::size_t k, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = static_cast<std::int64_t>(k) % shape[d];
    k /= static_cast<std::size_t>(shape[d]);
  }
  return idx;
}

// Fast paths of the comparison. An element whose bits equal the golden element's, with it and
// the reference value finite, has error 0 (the first case of Comparer::element): it only counts
// (and, for out, enters the statistics). Blocks of such elements are recognised 16 bytes at a
// time; any other element goes through Comparer::element.
constexpr std::size_t kBlock = 64;

typedef std::uint32_t u32x4 __attribute__((vector_size(16)));
typedef std::uint16_t u16x8 __attribute__((vector_size(16)));

// Are elements [k, k + kBlock) of y and g (dtype t) equal and finite, and those of ref (F64)
// finite? (Exponent fields all ones: infinite or NaN. For 8-byte elements the exponent is in
// the odd 32-bit word.)
inline bool block_trivial(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k) {
  const std::size_t w = dtype_size(t), bytes = kBlock * w;
  y += k * w;
  g += k * w;
  ref += k * 8;
  const u32x4 odd = {0, ~0u, 0, ~0u}, e64 = {0, 0x7ff0'0000u, 0, 0x7ff0'0000u};
  u32x4 bad = {0, 0, 0, 0};
  if (w == 2) {
    const std::uint16_t m = t == DType::F16 ? 0x7c00 : 0x7f80;
    const u16x8 e = {m, m, m, m, m, m, m, m};
    for (std::size_t off = 0; off < bytes; off += 16) {
      u16x8 a, b;
      std::memcpy(&a, y + off, 16);
      std::memcpy(&b, g + off, 16);
      const u16x8 r = (a ^ b) | reinterpret_cast<u16x8>((a & e) == e);
      u32x4 r32;
      std::memcpy(&r32, &r, 16);
      bad |= r32;
    }
  } else {
    const u32x4 e = w == 4 ? u32x4{0x7f80'0000u, 0x7f80'0000u, 0x7f80'0000u, 0x7f80'0000u} : e64;
    const u32x4 lanes = w == 4 ? u32x4{~0u, ~0u, ~0u, ~0u} : odd;
    for (std::size_t off = 0; off < bytes; off += 16) {
      u32x4 a, b;
      std::memcpy(&a, y + off, 16);
      std::memcpy(&b, g + off, 16);
      bad |= (a ^ b) | (reinterpret_cast<u32x4>((a & e) == e) & lanes);
    }
  }
  for (std::size_t off = 0; off < kBlock * 8; off += 16) {
    u32x4 r;
    std::memcpy(&r, ref + off, 16);
    bad |= reinterpret_cast<u32x4>((r & e64) == e64) & odd;
  }
  std::uint64_t words[2];
  std::memcpy(words, &bad, 16);
  return (words[0] | words[1]) == 0;
}

// Elements [k0, k0 + n) one by one: the trivially equal ones are counted, slow(k) is called for
// the others, in order.
template <class U, class F>
inline void scan_elements(const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k0,
                   std::size_t n, U expmask, std::int64_t& counted, F&& slow) {
  for (std::size_t k = k0; k < k0 + n; ++k) {
    U a, b;
    std::uint64_t r;
    std::memcpy(&a, y + k * sizeof(U), sizeof(U));
    std::memcpy(&b, g + k * sizeof(U), sizeof(U));
    std::memcpy(&r, ref + 8 * k, 8);
    if (a == b && (a & expmask) != expmask && (r & 0x7ff0'0000'0000'0000ull) != 0x7ff0'0000'0000'0000ull) ++counted;
    else slow(k);
  }
}
template <class F>
inline void scan_elements(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k0,
                   std::size_t n, std::int64_t& counted, F&& slow) {
  switch (t) {
    case DType::F64: return scan_elements<std::uint64_t>(y, g, ref, k0, n, 0x7ff0'0000'0000'0000ull, counted, slow);
    case DType::F32: return scan_elements<std::uint32_t>(y, g, ref, k0, n, 0x7f80'0000u, counted, slow);
    case DType::F16: return scan_elements<std::uint16_t>(y, g, ref, k0, n, 0x7c00, counted, slow);
    case DType::BF16: return scan_elements<std::uint16_t>(y, g, ref, k0, n, 0x7f80, counted, slow);
    default:
      for (std::size_t k = k0; k < k0 + n; ++k) slow(k);
  }
}

// One element: trivially equal (as in scan_elements)?
inline bool trivial_at(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k) {
  std::int64_t n = 0;
  scan_elements(t, y, g, ref, k, 1, n, [](std::size_t) {});
  return n == 1;
}

// The undecided elements of a golden tensor: (flat index, other candidate's bits), sorted by
// index; for a repeated index the last one listed counts (as a map assignment would).
using Undecided = std::vector<std::pair<std::int64_t, std::uint64_t>>;
// Looks indices up in order: galloping forward from the last one, from the start when k goes back.
struct AltCursor {
  const Undecided& u;
  std::size_t pos = 0;
  const std::uint64_t* find(std::size_t k) {
    if (u.empty()) return nullptr;
    const auto key = static_cast<std::int64_t>(k);
    if (pos > 0 && u[pos - 1].first >= key) pos = 0;
    std::size_t hi = pos, step = 1;
    while (hi < u.size() && u[hi].first < key) {
      pos = hi + 1;
      hi += step;
      step *= 2;
    }
    const auto end = u.begin() + static_cast<std::ptrdiff_t>(std::min(hi, u.size()));
    const auto it = std::lower_bound(u.begin() + static_cast<std::ptrdiff_t>(pos), end, key,
                                     [](const auto& e, std::int64_t v) { return e.first < v; });
    pos = static_cast<std::size_t>(it - u.begin());
    return pos < u.size() && it->first == key ? &it->second : nullptr;
  }
};

}  // namespace attnoracle::conformance::comparing
