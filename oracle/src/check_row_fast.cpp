// The row checks of check_row.cpp on a fast-path row's F64 intervals (rounded outward, so every
// violation reported here is one of the exact enclosure too).
#include <algorithm>
#include <cmath>
#include <map>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {
using detail::show;

std::vector<Violation> check_row_fast(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                      const RowIntervals& r) {
  std::vector<Violation> out;
  auto add = [&](Invariant inv, std::int64_t j, std::int64_t col, std::string d) {
    out.push_back(Violation{inv, b, h, i, j, col, std::move(d)});
  };
  std::vector<std::int64_t> keys;
  for (std::int64_t j = 0; j < c.Nk; ++j)
    if (detail::allowed(c, b, h, i, j)) keys.push_back(j);
  if (keys.empty()) {
    add(Invariant::MaskedRowPolicy, -1, -1, "a row with no allowed key was evaluated");
    return out;
  }
  // weights: masked exactly 0, allowed in (0, 1], sum enclosing 1. A sum of n nonnegative F64
  // numbers rounded to nearest is within gamma_n of the exact sum.
  double lo = 0, hi = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    const auto jj = static_cast<std::size_t>(j);
    const bool ok = std::binary_search(keys.begin(), keys.end(), j);
    if (!ok) {
      if (r.w_lo[jj] != 0 || r.w_hi[jj] != 0)
        add(Invariant::MaskedZero, j, -1, "weight of a key that is not allowed is " + show(r.w_lo[jj], r.w_hi[jj]));
      continue;
    }
    if (r.w_hi[jj] <= 0 || r.w_lo[jj] > 1)
      add(Invariant::WeightRange, j, -1, "weight " + show(r.w_lo[jj], r.w_hi[jj]) + " is not within (0, 1]");
    lo += std::max(r.w_lo[jj], 0.0);
    hi += r.w_hi[jj];
  }
  if (c.sinks) {
    // The sink's weight exp(sink - lse): the subtraction errs by |d| 2^-53, which exp turns into
    // as much relative error, and libm's exp by under 2^-52: (|d| + 1) 2^-50 covers both.
    const double dl = c.sink(h) - r.lse_hi, dh = c.sink(h) - r.lse_lo;
    lo += std::exp(dl) * (1 - (std::fabs(dl) + 1) * 0x1p-50);
    hi += std::exp(dh) * (1 + (std::fabs(dh) + 1) * 0x1p-50);
  }
  const double n = static_cast<double>(c.Nk + 1);
  const double g = n * 0x1p-53 / (1 - n * 0x1p-53);
  if (lo / (1 + g) > 1 || hi * (1 + g) < 1)
    add(Invariant::RowSum, -1, -1, "weights of the " + std::to_string(keys.size()) + " allowed keys sum to " + show(lo, hi));
  // convex hull, with the oracle's own reading of the values
  const std::int64_t gk = c.kv_head(h);
  for (std::int64_t col = 0; col < c.Dv; ++col) {
    double mn = INFINITY, mx = -INFINITY;
    for (auto j : keys) {
      const double x = c.v.values[static_cast<std::size_t>(((b * c.Hkv + gk) * c.Nk + j) * c.Dv + col)];
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    if (c.sinks) {  // with a sink the output combines 0 and the allowed values
      mn = std::min(mn, 0.0);
      mx = std::max(mx, 0.0);
    }
    const auto cc = static_cast<std::size_t>(col);
    if (r.out_lo[cc] > mx || r.out_hi[cc] < mn)
      add(Invariant::ConvexHull, -1, col, "output " + show(r.out_lo[cc], r.out_hi[cc]) +
                                               " lies outside the allowed values' range " + show(mn, mx));
  }
  // equal scores: identical key vectors and bias
  std::map<std::vector<double>, std::int64_t> first;
  for (auto j : keys) {
    const double* k = c.k.values.data() + ((b * c.Hkv + gk) * c.Nk + j) * c.Dk;
    std::vector<double> id(k, k + c.Dk);
    id.push_back(c.bias_at(b, h, i, j));
    auto [it, fresh] = first.emplace(std::move(id), j);
    if (fresh) continue;
    const auto a = static_cast<std::size_t>(it->second), z = static_cast<std::size_t>(j);
    if (r.w_lo[a] > r.w_hi[z] || r.w_lo[z] > r.w_hi[a])
      add(Invariant::EqualScores, j, -1,
          "keys " + std::to_string(it->second) + " and " + std::to_string(j) +
              " (equal key vectors and bias) have weights " + show(r.w_lo[a], r.w_hi[a]) + " and " + show(r.w_lo[z], r.w_hi[z]));
  }
  return out;
}

}  // namespace attnoracle::oracle
