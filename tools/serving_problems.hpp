// The problems of `attnoracle invariants --shapes serving`: paged KV caches and split-KV at the
// shapes of serving kernels.
#pragma once

#include <cstdint>
#include <functional>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::cli {

// Problem k (kind sdpa, input dtype `dtype`): `draw(lo, hi)` gives the seeded sizes, uniform in
// [lo, hi]. Outputs the profile does not return are not asked; the partial states are asked
// when the profile declares a split-KV kernel (`partials`).
vectors::ProblemSpec serving_problem(int k, DType dtype, const conformance::Profile& profile,
                                     const std::function<std::int64_t(std::int64_t, std::int64_t)>& draw);

}  // namespace attnoracle::cli
