// Quantized K/V storage (CONTRACT section 9): the element and scale formats, and the form a
// case stores its keys and values in.
#pragma once

#include <cstdint>
#include <string_view>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle {

// E2M1 (OCP FP4): s ee m, bias 1; value (-1)^s 2^(e-1) (1 + m/2), or m/2 when e = 0. The 16
// values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; no infinity, no NaN.
double e2m1_from_bits(std::uint8_t nibble);  // the low 4 bits
// E8M0 (OCP scale): 2^(e - 127) for e = 0 .. 254; 255 is NaN.
double e8m0_from_bits(std::uint8_t bits);
// I8: the two's-complement byte as an integer.
double i8_from_bits(std::uint8_t bits);

enum class KvScheme {
  Plain,   // k and v in q's float dtype (attn.v_from_k alone)
  Scaled,  // F8_E4M3, F8_E5M2 or I8 times k_scale, v_scale
  Mxfp8,   // F8_E4M3 times an E8M0 block scale per 32 elements
  Nvfp4,   // E2M1 packed two per byte times an F8_E4M3 block scale per 16, times a global scale
};

// The metadata keys of section 9.
inline constexpr std::string_view kKvBlockScaleKey = "attn.kv_block_scale";
inline constexpr std::string_view kVFromKKey = "attn.v_from_k";

struct KvForm {
  KvScheme scheme = KvScheme::Plain;
  DType stored = DType::F32;   // the dtype of k and v (k_cache, v_cache) in the file
  std::int64_t v_from_k = 0;   // Dv when v[b,g,j,:] = k[b,g,j,0:Dv]; 0: v is a tensor
  // Elements per stored element along D (2 for nvfp4's packed bytes), and the block length.
  std::int64_t per_stored() const { return scheme == KvScheme::Nvfp4 ? 2 : 1; }
  std::int64_t block() const {
    return scheme == KvScheme::Mxfp8 ? 32 : scheme == KvScheme::Nvfp4 ? 16 : 0;
  }
};

std::string_view kv_scheme_name(KvScheme s);  // "scaled", "mxfp8", "nvfp4" ("plain")

}  // namespace attnoracle
