// The bias test's (bin, coefficient) pairs in ascending order, in time linear in their number.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace attnoracle::conformance {

// Leaves `bins` exactly as std::sort(bins.begin(), bins.end()) would (pairs compared by bin, then
// by coefficient; coefficients not NaN): a stable LSD radix sort on the bin (8 bits a pass,
// skipping the digits all bins share), then each run of one bin sorted by its coefficient (runs
// are short: the values of a bin round alike).
void sort_bin_pairs(std::vector<std::pair<std::uint64_t, double>>& bins);

}  // namespace attnoracle::conformance
