// Helpers shared by the oracle's checks.
#pragma once

#include <mpfr.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::oracle::detail {

// "[lo, hi]" with 17 significant digits each, then in hex to be replayed exactly.
inline std::string show(const Enclosure& e) {
  char* s = nullptr;
  if (mpfr_asprintf(&s, "[%.17Rg, %.17Rg] (hex [%Ra, %Ra])", e.lo, e.hi, e.lo, e.hi) < 0)
    return "[?]";
  std::string r(s);
  mpfr_free_str(s);
  return r;
}
inline std::string show(double lo, double hi) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "[%.17g, %.17g] (hex [%a, %a])", lo, hi, lo, hi);
  return buf;
}

inline bool overlap(const Enclosure& a, const Enclosure& b) {
  return mpfr_lessequal_p(a.lo, b.hi) && mpfr_lessequal_p(b.lo, a.hi);
}

inline bool exactly_zero(const Enclosure& e) { return mpfr_zero_p(e.lo) && mpfr_zero_p(e.hi); }

// The oracle's own reading of the contract's positional rules (CONTRACT section 1), a
// deliberate second reading beside Case::position_allowed: a bug in either shows as a violation.
inline bool positional(const Case& c, std::int64_t b, std::int64_t i, std::int64_t j) {
  const auto at = [b](const auto& lengths, std::int64_t n) {
    return lengths ? lengths->at(static_cast<std::size_t>(b)) : n;
  };
  const std::int64_t lq = at(c.seqlens_q, c.Nq), lk = at(c.seqlens_k, c.Nk);
  if (j >= lk) return false;  // past the sequence's keys
  if (j < c.key_begin || j >= c.key_end) return false;  // outside the split evaluated
  const bool bottom = c.causal == Causal::BottomRight;
  const std::int64_t ip = bottom ? i + (lk - lq) : i;  // the query's aligned position
  if (c.causal != Causal::None && j > ip) return false;
  if (c.window && (j < ip - c.window_left || j > ip + c.window_right)) return false;
  return true;
}

inline bool allowed(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                    std::int64_t j) {
  return positional(c, b, i, j) && c.mask_at(b, h, i, j) && c.bias_at(b, h, i, j) != -INFINITY;
}

// A case's options (kind, dtypes, scale, softcap, causal, window, masked rows) without its
// tensors, its outputs or the file it was read from: the start of every twin.
inline Case options_only(const Case& c) {
  Case t;
  t.path = c.path;
  t.kind = c.kind;
  t.input_dtype = c.input_dtype;
  t.output_dtype = c.output_dtype;
  t.output_dtypes = c.output_dtypes;
  t.o_scale = c.o_scale;  // an FP8 out is decided on O / o_scale
  t.scale = c.scale;
  t.softcap = c.softcap;
  t.causal = c.causal;
  t.window = c.window;
  t.window_left = c.window_left;
  t.window_right = c.window_right;
  t.masked_rows = c.masked_rows;
  t.key_begin = c.key_begin;
  t.key_end = c.key_end;
  return t;
}

}  // namespace attnoracle::oracle::detail
