// The row checks of check_row.cpp on a fast-path row's F64 intervals (rounded outward, so every
// violation reported here is one of the exact enclosure too).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {
using detail::show;

namespace {
// [mn, mx] widened column by column to hold the values v (restrict: distinct arrays, so the
// loop vectorizes; min and max give the same result in any lane order).
void widen_range(std::size_t n, const double* __restrict v, double* __restrict mn, double* __restrict mx) {
  for (std::size_t col = 0; col < n; ++col) {
    mn[col] = std::min(mn[col], v[col]);
    mx[col] = std::max(mx[col], v[col]);
  }
}
// -1, 0, 1 as x < y, x == y, x > y; a NaN (never an allowed key's input) after every number,
// so that the order stays total.
int compare(double x, double y) {
  if (x == y) return 0;
  if (x < y) return -1;
  if (y < x) return 1;
  return std::isnan(x) - std::isnan(y);
}

// For each position a of keys, the position of the first earlier key with an equal (key
// vector, bias), or -1. The keys sorted by (key vector, bias) in lexicographic order, ties by
// index: each run of equal ones starts at its first key.
std::vector<std::int64_t> first_equal(const Case& c, const double* K, const std::vector<std::int64_t>& keys,
                                      const std::vector<double>& bias) {
  // -1, 0, 1 as (key vector, bias) of positions a and z compare (zeros of either sign equal)
  auto order = [&](std::int64_t a, std::int64_t z) {
    const double* ka = K + keys[static_cast<std::size_t>(a)] * c.Dk;
    const double* kz = K + keys[static_cast<std::size_t>(z)] * c.Dk;
    for (std::int64_t d = 0; d < c.Dk; ++d)
      if (const int o = compare(ka[d], kz[d])) return o;
    return compare(bias[static_cast<std::size_t>(a)], bias[static_cast<std::size_t>(z)]);
  };
  std::vector<std::int64_t> sorted(keys.size());
  for (std::size_t a = 0; a < keys.size(); ++a) sorted[a] = static_cast<std::int64_t>(a);
  // the first components side by side, so that most comparisons read no key row
  std::vector<double> lead(keys.size(), 0.0);
  if (c.Dk > 0)
    for (std::size_t a = 0; a < keys.size(); ++a) lead[a] = K[keys[a] * c.Dk];
  std::sort(sorted.begin(), sorted.end(), [&](std::int64_t a, std::int64_t z) {
    int o = compare(lead[static_cast<std::size_t>(a)], lead[static_cast<std::size_t>(z)]);
    if (o == 0) o = order(a, z);
    return o != 0 ? o < 0 : a < z;
  });
  std::vector<std::int64_t> first(keys.size(), -1);
  for (std::size_t k = 1, run = 0; k < sorted.size(); ++k) {
    if (order(sorted[run], sorted[k]) != 0) {
      run = k;
      continue;
    }
    first[static_cast<std::size_t>(sorted[k])] = sorted[run];
  }
  return first;
}
}  // namespace

KeyGroups key_groups(const Case& c) {
  KeyGroups g;
  const auto nv = static_cast<std::size_t>(c.Dv);
  g.vmin.assign(static_cast<std::size_t>(c.B * c.Hkv) * nv, INFINITY);
  g.vmax.assign(g.vmin.size(), -INFINITY);
  for (std::int64_t bg = 0; bg < c.B * c.Hkv; ++bg)
    for (std::int64_t j = 0; j < c.Nk; ++j)
      widen_range(nv, c.v.values.data() + (bg * c.Nk + j) * c.Dv, g.vmin.data() + bg * c.Dv,
                  g.vmax.data() + bg * c.Dv);
  if (c.bias) return g;
  std::vector<std::int64_t> all(static_cast<std::size_t>(c.Nk));
  for (std::int64_t j = 0; j < c.Nk; ++j) all[static_cast<std::size_t>(j)] = j;
  const std::vector<double> zero(all.size(), 0.0);
  for (std::int64_t bg = 0; bg < c.B * c.Hkv; ++bg) {
    const auto f = first_equal(c, c.k.values.data() + bg * c.Nk * c.Dk, all, zero);
    g.first.insert(g.first.end(), f.begin(), f.end());
  }
  return g;
}

std::vector<Violation> check_row_fast(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                      const RowIntervals& r, const KeyGroups* groups) {
  std::vector<Violation> out;
  auto add = [&](Invariant inv, std::int64_t j, std::int64_t col, std::string d) {
    out.push_back(Violation{inv, b, h, i, j, col, std::move(d)});
  };
  std::vector<std::int64_t> keys;
  std::vector<char> is_key(static_cast<std::size_t>(c.Nk), 0);
  for (std::int64_t j = 0; j < c.Nk; ++j)
    if (detail::allowed(c, b, h, i, j)) keys.push_back(j), is_key[static_cast<std::size_t>(j)] = 1;
  if (keys.empty()) {
    add(Invariant::MaskedRowPolicy, -1, -1, "a row with no allowed key was evaluated");
    return out;
  }
  // weights: masked exactly 0, allowed in (0, 1], sum enclosing 1. A sum of n nonnegative F64
  // numbers rounded to nearest is within gamma_n of the exact sum.
  double lo = 0, hi = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    const auto jj = static_cast<std::size_t>(j);
    const bool ok = is_key[jj] != 0;
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
  // convex hull, with the oracle's own reading of the values (key by key, as they are stored;
  // each column sees the allowed keys in ascending order, so min and max pick the same zeros)
  const std::int64_t gk = c.kv_head(h);
  const double* V = c.v.values.data() + (b * c.Hkv + gk) * c.Nk * c.Dv;
  const auto nv = static_cast<std::size_t>(c.Dv);
  const bool full = keys.size() == static_cast<std::size_t>(c.Nk);  // every key allowed
  std::vector<double> mn(nv, INFINITY), mx(nv, -INFINITY);
  if (full && groups && !groups->vmin.empty()) {
    const auto o = static_cast<std::ptrdiff_t>((b * c.Hkv + gk) * c.Dv);
    std::copy_n(groups->vmin.begin() + o, nv, mn.begin());
    std::copy_n(groups->vmax.begin() + o, nv, mx.begin());
  } else {
    for (auto j : keys) widen_range(nv, V + j * c.Dv, mn.data(), mx.data());
  }
  for (std::size_t col = 0; col < nv; ++col) {
    if (c.sinks) {  // with a sink the output combines 0 and the allowed values
      mn[col] = std::min(mn[col], 0.0);
      mx[col] = std::max(mx[col], 0.0);
    }
    if (r.out_lo[col] > mx[col] || r.out_hi[col] < mn[col])
      add(Invariant::ConvexHull, -1, static_cast<std::int64_t>(col),
          "output " + show(r.out_lo[col], r.out_hi[col]) + " lies outside the allowed values' range " +
              show(mn[col], mx[col]));
  }
  // equal scores: identical key vectors and bias
  const double* K = c.k.values.data() + (b * c.Hkv + gk) * c.Nk * c.Dk;
  std::vector<std::int64_t> first;
  if (full && groups && !groups->first.empty() && !c.bias) {
    const auto o = static_cast<std::ptrdiff_t>((b * c.Hkv + gk) * c.Nk);  // positions are keys here
    first.assign(groups->first.begin() + o, groups->first.begin() + o + c.Nk);
  } else {
    std::vector<double> bias(keys.size());
    for (std::size_t a = 0; a < keys.size(); ++a) bias[a] = c.bias_at(b, h, i, keys[a]);
    first = first_equal(c, K, keys, bias);
  }
  for (std::size_t pz = 0; pz < keys.size(); ++pz) {
    if (first[pz] < 0) continue;
    const std::int64_t ja = keys[static_cast<std::size_t>(first[pz])], j = keys[pz];
    const auto a = static_cast<std::size_t>(ja), z = static_cast<std::size_t>(j);
    if (r.w_lo[a] > r.w_hi[z] || r.w_lo[z] > r.w_hi[a])
      add(Invariant::EqualScores, j, -1,
          "keys " + std::to_string(ja) + " and " + std::to_string(j) +
              " (equal key vectors and bias) have weights " + show(r.w_lo[a], r.w_hi[a]) + " and " + show(r.w_lo[z], r.w_hi[z]));
  }
  return out;
}

}  // namespace attnoracle::oracle
