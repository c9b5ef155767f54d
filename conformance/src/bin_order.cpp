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
  // a digit all bins share needs no pass: the bits set in some bin and clear in another
  std::uint64_t any = 0, all = ~std::uint64_t{0};
  for (const auto& b : bins) any |= b.first, all &= b.first;
  const std::uint64_t varies = any ^ all;
  int digits[8], nd = 0;
  for (int d = 0; d < 8; ++d)
    if ((varies >> (8 * d)) & 0xff) digits[nd++] = d;
  // the counts of every varying digit in one pass
  std::vector<std::size_t> at(8 * 257, 0);
  for (const auto& b : bins)
    for (int m = 0; m < nd; ++m) ++at[257 * m + ((b.first >> (8 * digits[m])) & 0xff) + 1];
  std::vector<std::pair<std::uint64_t, double>> spare;
  for (int m = 0; m < nd; ++m) {
    const int d = digits[m];
    std::size_t* const digit = at.data() + 257 * m;
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
