// One row in double-double ball arithmetic. Each operation's midpoint error comes from its
// published bound (error_bounds.hpp); each radius formula says in a comment why it holds.
#include "fast_row.hpp"

#include "simd.hpp"

#include <mpfr.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace attnoracle::fast {
namespace {

// x compared with y: -1, 0, 1.
int cmp(DD x, double y) {
  if (x.hi != y) return x.hi < y ? -1 : 1;
  return (x.lo > 0) - (x.lo < 0);
}

// Rounds a double to nearest-even in a narrower format (p bits, emin the exponent of its
// smallest normal, emax of its largest binade): scaling by the quantum is exact, nearbyint
// rounds to nearest-even, and a result reaching 2^(emax+1) has overflowed.
double round_double(double r, int p, int emin, int emax) {
  if (r == 0 || !std::isfinite(r)) return r;
  const int e = std::max(std::ilogb(r), emin);
  const double quantum = std::ldexp(1.0, e - p + 1);
  const double y = std::nearbyint(r / quantum) * quantum;
  return std::fabs(y) >= std::ldexp(1.0, emax + 1) ? std::copysign(INFINITY, r) : y;
}

bool in_range(double x) {
  const double a = std::fabs(x);
  return a == 0 || (a >= kMinInput && a <= kMaxInput);
}
}  // namespace

bool all_in_range(const std::vector<double>& v) { return out_of_range(v.data(), v.size()) == 0; }

double round_dd(DD x, DType t) {
  const DD s = two_sum(x.hi, x.lo);
  if (t == DType::F64) return s.hi;  // one addition rounds the exact sum correctly
  // Round to odd in F64: when inexact, step from an even result to the odd neighbour on the
  // side of the exact value. With 53 >= p + 2 bits, rounding that to p bits is correct.
  double r = s.hi;
  if (s.lo != 0) {
    std::uint64_t bits;
    std::memcpy(&bits, &r, 8);
    if ((bits & 1) == 0) r = std::nextafter(r, s.lo > 0 ? INFINITY : -INFINITY);
  }
  const FloatFormat f = float_format(t);
  return round_double(r, f.precision, 1 - f.bias, f.bias);
}

Ball ball_of(mpfr_srcptr lo, mpfr_srcptr hi) {
  if (!mpfr_number_p(lo) || !mpfr_number_p(hi)) return {DD{NAN, 0}, NAN};
  mpfr_t t, u;
  mpfr_inits2(std::max<mpfr_prec_t>({256, mpfr_get_prec(lo), mpfr_get_prec(hi)}) + 64, t, u,
              static_cast<mpfr_ptr>(nullptr));
  Ball b;
  b.mid.hi = mpfr_get_d(lo, MPFR_RNDN);
  mpfr_sub_d(t, lo, b.mid.hi, MPFR_RNDN);  // exact: lo and its nearest double share the top bits
  b.mid.lo = mpfr_get_d(t, MPFR_RNDN);
  // rad >= |x - mid| for x = lo, hi: x - mid rounded both ways bounds it on either side.
  double rad = 0;
  for (mpfr_srcptr x : {lo, hi})
    for (mpfr_rnd_t rnd : {MPFR_RNDD, MPFR_RNDU}) {
      mpfr_sub_d(t, x, b.mid.hi, rnd);
      mpfr_sub_d(u, t, b.mid.lo, rnd);
      mpfr_abs(u, u, MPFR_RNDU);
      rad = std::max(rad, mpfr_get_d(u, MPFR_RNDU));
    }
  // rad is 0 only when both ends equal mid exactly (a nonzero |x - mid| rounds up to nonzero):
  // an exact ball, whose zero radius keeps products of radii out of the subnormal range.
  b.rad = rad == 0 ? 0 : radius_up(rad);
  mpfr_clears(t, u, static_cast<mpfr_ptr>(nullptr));
  return b;
}

Setup prepare(const Case& c, bool transposed) {
  Setup s;
  if (c.kind != Kind::Sdpa) {
    s.why_not = "kind mha";
    return s;
  }
  if (c.softcap) {
    s.why_not = "softcap";
    return s;
  }
  if (c.dropout) {  // the keep scale is evaluated by MPFR only
    s.why_not = "dropout";
    return s;
  }
  // One pass over each input: the keys' range and significands, the values' range and their
  // column ranges (per batch and kv head, for rows that allow every key).
  bool short_keys = false;
  const std::size_t bad_keys = input_scan(c.k.values.data(), c.k.values.size(), short_keys);
  const auto nv = static_cast<std::size_t>(c.B * c.Hkv * c.Dv), dv = static_cast<std::size_t>(c.Dv);
  s.vmin.assign(nv, INFINITY);
  s.vmax.assign(nv, -INFINITY);
  s.absmin.assign(nv, INFINITY);
  s.absmax.assign(nv, 0);
  std::size_t bad_values = 0;
  for (std::int64_t bg = 0; bg < c.B * c.Hkv && bad_values == 0; ++bg) {
    const std::size_t o = static_cast<std::size_t>(bg) * dv;
    bad_values += value_scan(dv, static_cast<std::size_t>(c.Nk), c.v.values.data() + static_cast<std::size_t>(bg * c.Nk) * dv,
                             s.vmin.data() + o, s.vmax.data() + o, s.absmin.data() + o, s.absmax.data() + o);
  }
  if (!all_in_range(c.q.values) || bad_keys != 0 || bad_values != 0) {
    s.why_not = "inputs outside [2^-480, 2^480]";
    return s;
  }
  if (c.bias)
    for (double x : c.bias->values)
      if (x != -INFINITY && !in_range(x)) {
        s.why_not = "bias outside [2^-480, 2^480]";
        return s;
      }
  if (c.sinks && !all_in_range(c.sinks->values)) {
    s.why_not = "sinks outside [2^-480, 2^480]";
    return s;
  }
  // The scale, enclosed at 256 bits by MPFR, as a double-double ball.
  mpfr_t lo, hi, t;
  mpfr_inits2(256, lo, hi, t, static_cast<mpfr_ptr>(nullptr));
  if (c.scale) {
    mpfr_strtofr(lo, c.scale->c_str(), nullptr, 0, MPFR_RNDD);
    mpfr_strtofr(hi, c.scale->c_str(), nullptr, 0, MPFR_RNDU);
  } else {
    mpfr_set_si(t, c.Dk, MPFR_RNDN);
    mpfr_rec_sqrt(lo, t, MPFR_RNDD);
    mpfr_rec_sqrt(hi, t, MPFR_RNDU);
  }
  s.scale = ball_of(lo, hi);
  mpfr_clears(lo, hi, t, static_cast<mpfr_ptr>(nullptr));
  if (!(std::fabs(s.scale.mid.hi) <= kMaxInput) || (s.scale.mid.hi != 0 && std::fabs(s.scale.mid.hi) < kMinInput)) {
    s.why_not = "scale out of range";
    return s;
  }
  if (!__builtin_cpu_supports("fma")) {
    s.why_not = "no fma on this processor";
    return s;
  }
  s.applies = true;
  s.key_blocks = key_blocks(c.Nk);
  s.short_keys = short_keys;
  if (transposed) s.kt = transpose_keys(c.k.values.data(), c.B * c.Hkv, c.Nk, c.Dk);
  return s;
}

namespace {

// One row of a tile between the passes.
struct RowState {
  std::int64_t i = 0;
  std::vector<std::int64_t> keys;
  std::int64_t first = 0, blocks = 0;      // the key blocks its Dot2 covers
  std::vector<double> sh, sl, sabs;        // per key of those blocks
  std::vector<double> wh, wl;              // the weights of nonzero midpoint, and their keys
  std::vector<std::int64_t> rows;
  double rho = 0, zero_rad = 0, zero_count = 0;
  std::vector<double> sums;                // the P V totals (PVColumns, 4 x Dv)
  bool live = false;                       // still on the fast path
  const double* q = nullptr;               // the query row
  bool exact_products = false;             // every q_e k_e of the row exact (dot2_blocks)
};

// Everything from the dots to the weights, and the lists the P V sums take; false: MPFR. The
// per-key steps run in SIMD lanes (simd.hpp's score_balls .. mul_balls) on arrays of the row's
// allowed keys, in the order of `keys`.
bool row_weights(const Case& c, const Setup& s, std::int64_t b, std::int64_t h, RowState& w, FastRow& r) {
  const std::int64_t Nk = c.Nk, Dv = c.Dv, g = c.kv_head(h), i = w.i;
  const double* V = c.v.values.data() + (b * c.Hkv + g) * Nk * Dv;
  const std::vector<std::int64_t>& keys = w.keys;  // freed at the end
  const std::size_t n = keys.size();
  const auto kb = static_cast<std::int64_t>(kKeyBlock);

  // Dot2's sums of the allowed keys: in place where they are consecutive, else gathered.
  std::vector<double> buf(12 * n);
  const auto part = [&](std::size_t k) { return buf.data() + k * n; };
  const double *sh = w.sh.data(), *sl = w.sl.data(), *sabs = w.sabs.data();
  const auto o0 = static_cast<std::size_t>(keys.front() - w.first * kb);
  if (keys.back() - keys.front() + 1 == static_cast<std::int64_t>(n)) {
    sh += o0, sl += o0, sabs += o0;
  } else {
    for (std::size_t a = 0; a < n; ++a) {
      const auto o = static_cast<std::size_t>(keys[a] - w.first * kb);
      part(8)[a] = w.sh[o];
      part(9)[a] = w.sl[o];
      part(10)[a] = w.sabs[o];
    }
    sh = part(8), sl = part(9), sabs = part(10);
  }
  const double* bias = nullptr;
  if (c.bias) {
    for (std::size_t a = 0; a < n; ++a) part(11)[a] = c.bias_at(b, h, i, keys[a]);
    bias = part(11);
  }
  const BallArrays one{part(0), part(1), part(2)}, two{part(3), part(4), part(5)};
  double m = -INFINITY;
  // Dots into `one`, scores into `two`; an overflow goes to MPFR.
  if (!score_balls(n, sh, sl, sabs, bias, dot2_factor(c.Dk), s.scale, one, two, &m)) return false;
  for (std::size_t a = 0; a < n; ++a) {
    const auto j = static_cast<std::size_t>(keys[a]);
    r.dots[j] = {DD{one.hi[a], one.lo[a]}, one.rad[a]};
    r.scores[j] = {DD{two.hi[a], two.lo[a]}, two.rad[a]};
  }
  w.sh = {}, w.sl = {}, w.sabs = {};
  if (c.sinks) m = std::max(m, c.sink(h));
  r.m = m;
  // e_j = exp(S_j - m) with m any number (the identity is exact); then Z, the weights.
  // x_j = S_j - m into `one`, exp_dd's arguments into parts 6 and 7 (a tiny one, below kExpMin,
  // takes exp(0), unused), their exp_dd into parts 8 and 9, the balls e_j into `two`.
  double *xh = part(6), *xl = part(7), *eh = part(8), *el = part(9);
  if (!exp_args(n, two, m, one, xh, xl)) return false;  // outside exp's ball rule: MPFR
  exp_dd_many(xh, xl, n, eh, el);
  exp_balls(n, one, eh, el, two);
  Ball z = ball_total(n, two);
  if (c.sinks) {  // the sink: one more term of Z, exp(sink - m), with no value vector
    const Ball xs = add(Ball{DD{c.sink(h), 0}, 0}, -m);
    if (!exp_applies(xs)) return false;
    z = add(z, exp(xs));
  }
  if (!(z.mid.hi > kDivMargin * z.rad)) return false;
  r.z = z;
  // e_j / Z as e_j times the ball of 1/Z: one division per row, not per key (into `one`).
  mul_balls(n, two, div(Ball{DD{1, 0}, 0}, z), one);
  for (std::size_t a = 0; a < n; ++a)
    r.weights[static_cast<std::size_t>(keys[a])] = {DD{one.hi[a], one.lo[a]}, one.rad[a]};

  const auto nd = static_cast<std::size_t>(Dv);
  if (keys.size() == static_cast<std::size_t>(Nk)) {  // every key: the ranges of prepare()
    const auto o = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b * c.Hkv + g) * nd);
    const auto nn = static_cast<std::ptrdiff_t>(nd);
    r.vmin.assign(s.vmin.begin() + o, s.vmin.begin() + o + nn);
    r.vmax.assign(s.vmax.begin() + o, s.vmax.begin() + o + nn);
    r.absmin.assign(s.absmin.begin() + o, s.absmin.begin() + o + nn);
    r.absmax.assign(s.absmax.begin() + o, s.absmax.begin() + o + nn);
  } else {
    r.vmin.assign(nd, INFINITY);
    r.vmax.assign(nd, -INFINITY);
    r.absmin.assign(nd, INFINITY);
    r.absmax.assign(nd, 0);
    for (std::size_t a = 0, e; a < n; a = e) {  // by runs of consecutive keys, row after row
      for (e = a + 1; e < n && keys[e] == keys[e - 1] + 1;) ++e;
      value_ranges(nd, e - a, V + keys[a] * Dv, r.vmin.data(), r.vmax.data(), r.absmin.data(), r.absmax.data());
    }
  }
  // The weights' midpoints enter the sums; their radii enter the radius as rho A (rad_j <=
  // rho x_j), and a weight of midpoint 0 (exp below kExpMin) as its radius times max |v_c|.
  w.wh.resize(n), w.wl.resize(n), w.rows.resize(n);
  double rho = 0, zero_rad = 0;
  std::size_t k = 0;
  for (std::size_t a = 0; a < n; ++a) {
    if (two.hi[a] == 0) {
      zero_rad = std::max(zero_rad, two.rad[a]);
      continue;
    }
    w.wh[k] = two.hi[a];
    w.wl[k] = two.lo[a];
    w.rows[k++] = keys[a];
    rho = std::max(rho, two.rad[a] / two.hi[a]);  // e_j > 0
  }
  w.wh.resize(k), w.wl.resize(k), w.rows.resize(k);
  w.rho = rho, w.zero_rad = zero_rad, w.zero_count = static_cast<double>(n - k);
  w.keys = {};
  const auto sum_blocks = static_cast<double>((w.rows.size() + kSumBlock - 1) / kSumBlock);
  if (sum_blocks > kMaxSumBlocks) return false;
  w.sums.assign(4 * nd, 0.0);
  return true;
}

// The output and its bound from the P V totals.
void row_out(const Case& c, const RowState& w, FastRow& r) {
  const auto nd = static_cast<std::size_t>(c.Dv);
  const double* num_hi = w.sums.data();
  const double* num_lo = num_hi + nd;
  const double* mag_hi = num_lo + nd;
  const double* mag_lo = mag_hi + nd;
  const auto sum_blocks = static_cast<double>((w.rows.size() + kSumBlock - 1) / kSumBlock);
  // |N_c - total| <= (rho + kBlockSum + nb kAddDD (1 + kSumMag)) A + zero_count zero_rad max |v_c|.
  const double factor = w.rho + (kBlockSum + sum_blocks * kAddDD * (1 + kSumMag));
  if (c.sinks)  // the weights sum to less than 1: the output is a combination of 0 and the values
    for (std::size_t ci = 0; ci < nd; ++ci) {
      r.vmin[ci] = std::min(r.vmin[ci], 0.0);
      r.vmax[ci] = std::max(r.vmax[ci], 0.0);
      r.absmin[ci] = 0;
    }
  r.out.resize(nd);
  r.bound.resize(nd);
  for (std::size_t ci = 0; ci < nd; ++ci) {
    Ball num, mag_sum;  // a column whose every allowed value is 0: both sums are exactly 0
    if (r.absmax[ci] != 0) {
      const double sum_abs = std::fabs(mag_hi[ci]) * (1 + kSumMag);
      const double rad = radius_up(factor * sum_abs + w.zero_count * w.zero_rad * r.absmax[ci]);
      num = {DD{num_hi[ci], num_lo[ci]}, rad};
      mag_sum = {DD{mag_hi[ci], mag_lo[ci]}, rad};
    }
    r.out[ci] = div(num, r.z);
    r.bound[ci] = div(mag_sum, r.z);
  }
  r.ok = true;
}

}  // namespace

std::vector<FastRow> fast_rows(const Case& c, const Setup& s, std::int64_t b, std::int64_t h, std::int64_t i0,
                               std::int64_t count) {
  std::vector<FastRow> out(static_cast<std::size_t>(count));
  std::vector<RowState> ws(static_cast<std::size_t>(count));
  const std::int64_t Nk = c.Nk, Dk = c.Dk, Dv = c.Dv, g = c.kv_head(h);
  const auto kb = static_cast<std::int64_t>(kKeyBlock);
  std::int64_t lo_block = std::numeric_limits<std::int64_t>::max(), hi_block = 0;  // the tile's blocks
  for (std::size_t t = 0; t < ws.size(); ++t) {
    RowState& w = ws[t];
    FastRow& r = out[t];
    w.i = i0 + static_cast<std::int64_t>(t);
    r.allowed.assign(static_cast<std::size_t>(Nk), 0);
    r.dots.assign(static_cast<std::size_t>(Nk), Ball{});
    r.weights.assign(static_cast<std::size_t>(Nk), Ball{});
    r.scores.assign(static_cast<std::size_t>(Nk), Ball{});
    const Case::KeyRange kr = c.key_range(b, w.i);
    for (std::int64_t j = kr.first; j <= kr.last; ++j)
      if (c.allowed_in_range(b, h, w.i, j)) {
        w.keys.push_back(j);
        r.allowed[static_cast<std::size_t>(j)] = 1;
      }
    if (w.keys.empty()) continue;  // a fully masked (or sink-only) row: the MPFR path
    w.live = true;
    w.q = c.q.values.data() + ((b * c.Hq + h) * c.Nq + w.i) * Dk;
    w.exact_products = s.short_keys && short_significands(w.q, static_cast<std::size_t>(Dk));
    // Dot2 of every key in the blocks from the first allowed key's to the last's.
    w.first = w.keys.front() / kb;
    w.blocks = w.keys.back() / kb - w.first + 1;
    const auto n = static_cast<std::size_t>(w.blocks * kb);
    w.sh.resize(n), w.sl.resize(n), w.sabs.resize(n);
    lo_block = std::min(lo_block, w.first);
    hi_block = std::max(hi_block, w.first + w.blocks);
  }

  // Dot2 in SIMD lanes, a chunk of key blocks at a time for every row of the tile. Without
  // prepare()'s transposed keys, each chunk is transposed in turn, as transpose_keys lays it
  // out (0 past the last key).
  std::vector<double> kt;
  for (std::int64_t c0 = lo_block; c0 < hi_block; c0 += kDotChunkBlocks) {
    const std::int64_t c1 = std::min(hi_block, c0 + kDotChunkBlocks);
    const double* chunk;
    if (!s.kt.empty()) {
      chunk = s.kt.data() + ((b * c.Hkv + g) * s.key_blocks + c0) * Dk * kb;
    } else {
      kt.resize(static_cast<std::size_t>((c1 - c0) * Dk * kb));
      transpose_key_blocks(c.k.values.data() + (b * c.Hkv + g) * Nk * Dk, Nk, Dk, c0, c1, kt.data());
      chunk = kt.data();
    }
    for (RowState& w : ws) {
      if (!w.live) continue;
      const std::int64_t a = std::max(c0, w.first), z = std::min(c1, w.first + w.blocks);
      if (a >= z) continue;
      const auto o = static_cast<std::size_t>((a - w.first) * kb);
      dot2_blocks(w.q, chunk + (a - c0) * Dk * kb, Dk, z - a, w.sh.data() + o, w.sl.data() + o, w.sabs.data() + o,
                  w.exact_products);
    }
  }

  std::size_t most = 0;  // the longest list of weights
  for (std::size_t t = 0; t < ws.size(); ++t) {
    RowState& w = ws[t];
    if (w.live) w.live = row_weights(c, s, b, h, w, out[t]);
    if (w.live) most = std::max(most, w.rows.size());
  }

  // Output and bound: N_c = sum_j e_j v_jc and B_c = sum_j e_j |v_jc| (pv_sums), over Z; a
  // chunk of whole blocks at a time for every row (the same blocks, so the same bits, as one call).
  const double* V = c.v.values.data() + (b * c.Hkv + g) * Nk * Dv;
  const auto nd = static_cast<std::size_t>(Dv);
  for (std::size_t a0 = 0; a0 < most; a0 += kSumChunk)
    for (RowState& w : ws) {
      if (!w.live || a0 >= w.rows.size()) continue;
      const std::size_t len = std::min(kSumChunk, w.rows.size() - a0);
      double* sums = w.sums.data();
      pv_sums(nd, len, V, w.rows.data() + a0, nd, w.wh.data() + a0, w.wl.data() + a0,
              PVColumns{sums, sums + nd, sums + 2 * nd, sums + 3 * nd});
    }
  for (std::size_t t = 0; t < ws.size(); ++t)
    if (ws[t].live) row_out(c, ws[t], out[t]);
  return out;
}

FastRow fast_row(const Case& c, const Setup& s, std::int64_t b, std::int64_t h, std::int64_t i) {
  return std::move(fast_rows(c, s, b, h, i, 1).front());
}

void ends(const Ball& b, DD& lo, DD& hi, double clamp_lo, double clamp_hi) {
  lo = lower(b);
  hi = upper(b);
  const DD l = cmp(lo, clamp_lo) < 0 ? DD{clamp_lo, 0} : lo;
  const DD u = cmp(hi, clamp_hi) > 0 ? DD{clamp_hi, 0} : hi;
  if (cmp(l, u.hi) < 0 || (l.hi == u.hi && l.lo <= u.lo)) {  // not empty
    lo = l;
    hi = u;
  }
}

}  // namespace attnoracle::fast
