// Stored K/V for generated cases (CONTRACT section 9): k and v drawn in q's dtype, then written
// in a scaled or block-scaled form; V as a view of K; FP8 out's o_scale.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::vectors {

// Replaces the float k and v of a contiguous sdpa case by p.kv_format's stored elements and
// scales (k_scale ... v_global_scale), drops v with p.v_from_k, puts o_scale, and writes the
// metadata of the form. Deterministic in (p, f, seed); a no-op for a case with none of them.
void store_kv(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed);

// The E2M1 nibble nearest y (ties to an even significand), saturating at +-6; 0 for zero.
std::uint8_t e2m1_nearest(double y);

// The [B, Hkv, Nk, X] tensors that hold one row per key: k and v (any stored dtype), their
// block scales, and their per-token scales (paging.cpp).
std::vector<std::string> key_row_tensors(const ProblemSpec& p, const SafeTensorsFile& f);

// Whether some query other than padding reads key j of kv head g in batch b, indexed
// (b Hkv + g) Nk + j (the others are unused positions, CONTRACT section 1).
std::vector<bool> used_key_rows(const Case& c);

// Writes an unused position's poison into the n elements at `row` of tensor `name` (dtype t):
// floats NaN, +inf and -inf in turn (nan_only: NaN); F8_E4M3, without infinities, its NaNs
// 0x7F and 0xFF; I8, without NaN, -128 and 127; an E8M0 block scale (U8 `*_block_scale`) 255,
// its NaN; nvfp4's packed elements (U8) the nibbles -6 and 6, E2M1's extremes.
void poison_row(const std::string& name, DType t, unsigned char* row, std::int64_t n, bool nan_only);

}  // namespace attnoracle::vectors
