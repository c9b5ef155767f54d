#include "attnoracle/conformance/bin_order.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>

namespace attnoracle::conformance {

void sort_bin_pairs(std::vector<std::pair<std::uint64_t, double>>& bins) {
  const std::size_t n = bins.size();
  if (n < 64) {
    std::sort(bins.begin(), bins.end());
    return;
  }
  // every digit's counts in one pass; a digit all bins share needs no pass
  std::vector<std::size_t> at(8 * 257, 0);
  for (const auto& b : bins)
    for (int d = 0; d < 8; ++d) ++at[257 * d + ((b.first >> (8 * d)) & 0xff) + 1];
  std::vector<std::pair<std::uint64_t, double>> spare;
  for (int d = 0; d < 8; ++d) {
    std::size_t* const digit = at.data() + 257 * d;
    if (std::count(digit + 1, digit + 257, n) == 1) continue;  // the same digit everywhere
    if (spare.empty()) spare.resize(n);
    for (int k = 0; k < 256; ++k) digit[k + 1] += digit[k];
    const int shift = 8 * d;
    for (const auto& b : bins) spare[digit[(b.first >> shift) & 0xff]++] = b;
    bins.swap(spare);
  }
  // equal bins now stand together in the input's order; std::sort orders them by coefficient
  for (std::size_t a = 0; a < n;) {
    std::size_t e = a + 1;
    while (e < n && bins[e].first == bins[a].first) ++e;
    if (e - a > 1) std::sort(bins.begin() + static_cast<std::ptrdiff_t>(a), bins.begin() + static_cast<std::ptrdiff_t>(e));
    a = e;
  }
}

}  // namespace attnoracle::conformance
