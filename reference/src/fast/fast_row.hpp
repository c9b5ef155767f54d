// The fast certified path: one row of attention in double-double ball arithmetic (a
// double-double midpoint and an F64 radius that bounds the distance to the exact value),
// from a-priori error bounds of every step. Where its enclosures decide every rounding the row
// is done; otherwise (or where the path does not apply) the row goes to the MPFR path.
#pragma once

#include <mpfr.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "ball.hpp"

namespace attnoracle::fast {

// Lower and upper ends of a ball as double-doubles no further in than the exact ends (inline:
// the oracle's intervals take them for every key of every row).
inline DD lower(const Ball& b) {
  if (b.rad == 0) return b.mid;  // an exact ball (a masked key's weight)
  // mid - rad, computed in double-double, then moved down by that subtraction's own error
  // (kAddFP of a result at most |mid| + rad in size, within kEndRel: widen.g).
  const double s = radius_up(b.rad + kEndRel * (mag(b.mid) + b.rad));
  return fast::add(b.mid, -s);
}
inline DD upper(const Ball& b) {
  if (b.rad == 0) return b.mid;
  const double s = radius_up(b.rad + kEndRel * (mag(b.mid) + b.rad));
  return fast::add(b.mid, s);
}

// What a case needs for the fast path, checked once.
struct Setup {
  bool applies = false;
  std::string why_not;  // when it does not apply
  Ball scale;
  // The keys of every (batch, kv head), transposed in blocks (simd.hpp): key_blocks blocks each;
  // empty when prepare() was asked not to (each row then transposes its blocks in turn).
  std::vector<double> kt;
  std::int64_t key_blocks = 0;
  // Over all keys of each (batch, kv head), per value column: the range of the values and of
  // their magnitudes ([B * Hkv * Dv] each), for rows that allow every key.
  std::vector<double> vmin, vmax, absmin, absmax;
  // Whether every key's elements have significands of at most 26 bits (short_significands).
  bool short_keys = false;
};
// Applies to kind sdpa without softcap, with every input (sinks too) of magnitude 0 or within
// [kMinInput, kMaxInput], on a processor with fma. `transposed`: whether to keep a transposed
// copy of every key (faster per row; an evaluator of a few rows does without its memory).
Setup prepare(const Case& c, bool transposed = true);

struct FastRow {
  bool ok = false;                 // false: the row goes to the MPFR path
  std::vector<char> allowed;       // [Nk]
  std::vector<Ball> dots;          // [Nk] q.k (0 where not allowed)
  std::vector<Ball> scores;        // [Nk] S = scale q.k + bias (0 where not allowed)
  std::vector<Ball> weights;       // [Nk] (exact 0 where not allowed)
  std::vector<Ball> out;           // [Dv] before the intersection with the hull
  std::vector<double> vmin, vmax;  // [Dv] the allowed values' range
  std::vector<double> absmin, absmax;  // [Dv] the range of their magnitudes
  std::vector<Ball> bound;         // [Dv] sum_j A_j |v_jc|
  Ball z;                          // sum_j exp(S_j - m)
  double m = 0;                    // the row constant
};

// Whether every value is 0 or of magnitude within [kMinInput, kMaxInput] (the fast path's inputs).
bool all_in_range(const std::vector<double>& v);

// The ball of an enclosure [lo, hi] (not finite if an end is not).
Ball ball_of(mpfr_srcptr lo, mpfr_srcptr hi);

FastRow fast_row(const Case& c, const Setup& s, std::int64_t b, std::int64_t h, std::int64_t i);
// Rows i0 .. i0 + count - 1 of head h, each exactly as fast_row evaluates it: the Dot2 and the
// P V passes run over the keys and values a chunk at a time for every row of the tile, so that
// each chunk is read from memory once per tile rather than once per row.
std::vector<FastRow> fast_rows(const Case& c, const Setup& s, std::int64_t b, std::int64_t h, std::int64_t i0,
                               std::int64_t count);

// The ends of a ball, intersected with [clamp_lo, clamp_hi] (which must hold the exact value;
// an empty intersection, a broken evaluation, keeps the ball's own ends).
void ends(const Ball& b, DD& lo, DD& hi, double clamp_lo = -INFINITY, double clamp_hi = INFINITY);

// The next double above a finite x (nextafter(x, +inf) without the library call): the bit
// pattern of a positive double grows with it, of a negative one shrinks.
inline double next_up(double x) {
  if (x == 0) return std::numeric_limits<double>::denorm_min();
  std::uint64_t bits;
  std::memcpy(&bits, &x, 8);
  bits = x > 0 ? bits + 1 : bits - 1;
  std::memcpy(&x, &bits, 8);
  return x;
}

// The smallest F64 number >= x, and the largest <= x.
inline double round_up_dd(DD x) {
  const DD s = two_sum(x.hi, x.lo);
  return s.lo > 0 ? next_up(s.hi) : s.hi;
}
inline double round_down_dd(DD x) {
  const DD s = two_sum(x.hi, x.lo);
  return s.lo < 0 ? -next_up(-s.hi) : s.hi;
}

// Rounding a double-double to nearest-even in an output format: F64 directly (one IEEE
// addition of the two parts is the correctly rounded sum), the narrower formats through
// rounding to odd in F64 first (which leaves no double-rounding error).
double round_dd(DD x, DType t);

}  // namespace attnoracle::fast
