// Kind merge (CONTRACT section 8) as the sdpa case it is.
#pragma once

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle {

// Kind merge as an sdpa case: per row (b, h, i) one query row of head h*Nq+i with Dk = 1,
// q = k = 0, scale 1, bias lse_partial[s, b, h, i] (-inf: not allowed) and values
// o_partial[s, b, h, i, :] over S keys, sinks[h] as its sink. Its out [B, H*Nq, 1, Dv] and lse
// [B, H*Nq, 1] lie in the memory order of the merge's out [B, H, Nq, Dv] and lse [B, H, Nq].
Case merge_sdpa_case(const Case& m);
}  // namespace attnoracle
