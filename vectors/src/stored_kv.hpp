// Stored K/V for generated cases (CONTRACT section 9): k and v drawn in q's dtype, then written
// in a scaled or block-scaled form; V as a view of K; FP8 out's o_scale.
#pragma once

#include <cstdint>

#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::vectors {

// Replaces the float k and v of a contiguous sdpa case by p.kv_format's stored elements and
// scales (k_scale ... v_global_scale), drops v with p.v_from_k, puts o_scale, and writes the
// metadata of the form. Deterministic in (p, f, seed); a no-op for a case with none of them.
void store_kv(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed);

// The E2M1 nibble nearest y (ties to an even significand), saturating at +-6; 0 for zero.
std::uint8_t e2m1_nearest(double y);

}  // namespace attnoracle::vectors
