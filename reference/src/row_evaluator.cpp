// The interval kernel: enclosures of one row of attention at a given working precision.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "attnoracle/reference/dropout.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "interval.hpp"

namespace attnoracle {

using detail::MpfrVec;

FullyMaskedRow::FullyMaskedRow(std::int64_t b_, std::int64_t h_, std::int64_t i_)
    : std::runtime_error("fully masked row at b=" + std::to_string(b_) + ", h=" +
                         std::to_string(h_) + ", i=" + std::to_string(i_) +
                         " under attn.masked_rows=error"),
      b(b_), h(h_), i(i_) {}

Enclosure::Enclosure(mpfr_prec_t p) {
  mpfr_init2(lo, p);
  mpfr_init2(hi, p);
}
Enclosure::Enclosure(Enclosure&& o) noexcept {
  // Steal the limbs: swap with freshly initialised numbers that o will clear.
  mpfr_init2(lo, MPFR_PREC_MIN);
  mpfr_init2(hi, MPFR_PREC_MIN);
  mpfr_swap(lo, o.lo);
  mpfr_swap(hi, o.hi);
}
Enclosure::~Enclosure() {
  mpfr_clear(lo);
  mpfr_clear(hi);
}

namespace {

// An exactly stored real matrix [rows, cols]: doubles (inputs) or exact MPFR numbers (mha
// projections, whose exact values need more than 53 bits).
struct ExactMatrix {
  const double* d = nullptr;  // doubles, or
  std::vector<mpfr_t>* m = nullptr;
  std::size_t offset = 0;  // into m
  std::int64_t cols = 0;
  mpfr_prec_t prec = 53;   // an upper bound of every element's precision

  // dst = x * element(r, c), exact: dst's precision is at least prec(x) + prec.
  void mul_exact(mpfr_ptr dst, mpfr_srcptr x, std::int64_t r, std::int64_t c) const {
    mul(dst, x, r, c, MPFR_RNDN);
  }
  // dst = x * element(r, c) rounded in direction rnd.
  void mul(mpfr_ptr dst, mpfr_srcptr x, std::int64_t r, std::int64_t c, mpfr_rnd_t rnd) const {
    const std::size_t idx = static_cast<std::size_t>(r * cols + c);
    if (d)
      mpfr_mul_d(dst, x, d[idx], rnd);
    else
      mpfr_mul(dst, x, (*m)[offset + idx], rnd);
  }
  // dst = |x * element(r, c)| rounded in direction rnd, for x >= 0.
  void mul_abs(mpfr_ptr dst, mpfr_srcptr x, std::int64_t r, std::int64_t c, mpfr_rnd_t rnd) const {
    const bool neg = sgn(r, c) < 0;
    mul(dst, x, r, c, neg ? (rnd == MPFR_RNDD ? MPFR_RNDU : MPFR_RNDD) : rnd);
    if (neg) mpfr_neg(dst, dst, MPFR_RNDN);  // exact
  }
  int sgn(std::int64_t r, std::int64_t c) const {
    const std::size_t idx = static_cast<std::size_t>(r * cols + c);
    if (d) return (d[idx] > 0) - (d[idx] < 0);
    return mpfr_sgn((*m)[offset + idx]);
  }
  void get(mpfr_ptr dst, std::int64_t r, std::int64_t c, mpfr_rnd_t rnd) const {
    const std::size_t idx = static_cast<std::size_t>(r * cols + c);
    if (d)
      mpfr_set_d(dst, d[idx], rnd);
    else
      mpfr_set(dst, (*m)[offset + idx], rnd);
  }
  int cmp(std::int64_t r1, std::int64_t c1, std::int64_t r2, std::int64_t c2) const {
    const auto i1 = static_cast<std::size_t>(r1 * cols + c1);
    const auto i2 = static_cast<std::size_t>(r2 * cols + c2);
    if (d) return (d[i1] > d[i2]) - (d[i1] < d[i2]);
    return mpfr_cmp((*m)[offset + i1], (*m)[offset + i2]);
  }
  // The same on magnitudes.
  int cmpabs(std::int64_t r1, std::int64_t c1, std::int64_t r2, std::int64_t c2) const {
    const auto i1 = static_cast<std::size_t>(r1 * cols + c1);
    const auto i2 = static_cast<std::size_t>(r2 * cols + c2);
    if (d) return (std::fabs(d[i1]) > std::fabs(d[i2])) - (std::fabs(d[i1]) < std::fabs(d[i2]));
    return mpfr_cmpabs((*m)[offset + i1], (*m)[offset + i2]);
  }
};

using detail::enclose_text;
using detail::softcap_bound;

Enclosure copy_enclosure(const Enclosure& e) {
  Enclosure r(std::max(mpfr_get_prec(e.lo), mpfr_get_prec(e.hi)));
  mpfr_set(r.lo, e.lo, MPFR_RNDD);
  mpfr_set(r.hi, e.hi, MPFR_RNDU);
  return r;
}

// A scalar MPFR number, cleared on scope exit.
struct Mp {
  mpfr_t x;
  explicit Mp(mpfr_prec_t p) { mpfr_init2(x, p); }
  ~Mp() { mpfr_clear(x); }
  Mp(const Mp&) = delete;
  Mp& operator=(const Mp&) = delete;
};

// n enclosures at precision p, each [0, 0].
void zeros(std::vector<Enclosure>& v, std::int64_t n, mpfr_prec_t p) {
  for (std::int64_t k = 0; k < n; ++k) {
    v.emplace_back(p);
    mpfr_set_zero(v.back().lo, 1);
    mpfr_set_zero(v.back().hi, 1);
  }
}

// One head's row: its enclosures and what the oracle reads of them.
struct HeadRow {
  bool valid = true;
  std::vector<Enclosure> out, bound, weights, scores;
  Enclosure lse;
  HeadDetail detail;
  HeadRow(mpfr_prec_t p, std::int64_t Nk, std::int64_t Dv) : lse(p) {
    zeros(out, Dv, p);
    zeros(bound, Dv, p);
    zeros(weights, Nk, p);
    zeros(scores, Nk, p);
    for (Enclosure& e : scores) {  // -inf where not allowed
      mpfr_set_inf(e.lo, -1);
      mpfr_set_inf(e.hi, -1);
    }
    zeros(detail.dots, Nk, p);
    zeros(detail.raw_out, Dv, p);
    zeros(detail.hull, Dv, p);
    detail.allowed.assign(static_cast<std::size_t>(Nk), 0);
  }
};

// The state of one head row between the steps of head_row.
struct HeadWork {
  const Case& c;
  std::int64_t b, h, i;
  mpfr_prec_t p;
  ExactMatrix Q, K, V;
  std::vector<std::int64_t> allowed;  // the allowed keys
  std::vector<char> keep;             // per allowed key: kept by dropout (all without it)
  bool any_kept = true;
  MpfrVec slo, shi, elo, ehi, terms;  // scores S, exp(S - m), per allowed key
  Mp zlo, zhi, nlo, nhi, m, tmp, tmp2;
  Mp sink_lo, sink_hi;  // exp(sink - m), when the case has sinks
  Mp klo, khi;          // 1 / (1 - p), under dropout: enclosed, and exact in ks where it can be
  Rational ks;
  bool ks_exact = false;
  bool tie = false;  // every score provably equal
  HeadWork(const Case& cs, std::int64_t b_, std::int64_t h_, std::int64_t i_, mpfr_prec_t p_,
           ExactMatrix q, ExactMatrix k, ExactMatrix v)
      : c(cs), b(b_), h(h_), i(i_), p(p_), Q(q), K(k), V(v), zlo(p_), zhi(p_), nlo(p_),
        nhi(p_), m(p_), tmp(p_), tmp2(p_), sink_lo(p_), sink_hi(p_), klo(p_), khi(p_) {
    if (c.dropout) {
      enclose_keep_scale(klo.x, khi.x, c.dropout->p);
      ks_exact = exact_keep_scale(ks.q, c.dropout->p);
    }
  }
};

// The allowed keys; false when there is none.
bool find_keys(HeadWork& w, HeadDetail& det) {
  const Case::KeyRange r = w.c.key_range(w.b, w.i);
  for (std::int64_t j = r.first; j <= r.last; ++j)
    if (w.c.allowed(w.b, w.h, w.i, j)) {
      w.allowed.push_back(j);
      w.keep.push_back(w.c.kept(w.b, w.h, w.i, j) ? 1 : 0);
      det.allowed[static_cast<std::size_t>(j)] = 1;
    }
  return !w.allowed.empty();
}

// A row with no allowed key but a sink: weights and output exactly 0, lse = the sink (the
// only term of the denominator), a valid row.
void sink_only_row(const HeadWork& w, HeadRow& row) {
  mpfr_set_d(row.lse.lo, w.c.sink(w.h), MPFR_RNDN);  // exact: p >= 53
  mpfr_set_d(row.lse.hi, w.c.sink(w.h), MPFR_RNDN);
}

// A fully masked row: refused under policy error (unless padding), else zeros and lse = -inf.
void masked_row(const HeadWork& w, HeadRow& row) {
  if (w.c.masked_rows == MaskedRows::Error && w.c.query_valid(w.b, w.i))
    throw FullyMaskedRow(w.b, w.h, w.i);
  row.valid = false;
  mpfr_set_inf(row.lse.lo, -1);
  mpfr_set_inf(row.lse.hi, -1);
}

// Exact dot products q_i . k_j into [slo, shi]: each product is exact at prec(q) + prec(k)
// bits, and mpfr_sum rounds their sum correctly (downward), reporting exactness.
bool exact_dots(HeadWork& w, HeadDetail& det) {
  const std::int64_t Dk = w.c.Dk;
  const std::size_t n = w.allowed.size();
  MpfrVec qrow, prods;
  qrow.resize(static_cast<std::size_t>(Dk), w.Q.prec);
  for (std::int64_t d = 0; d < Dk; ++d) w.Q.get(qrow[d], w.i, d, MPFR_RNDN);  // exact
  prods.resize(static_cast<std::size_t>(Dk), w.Q.prec + w.K.prec);
  w.slo.resize(n, w.p);
  w.shi.resize(n, w.p);
  bool all_exact = true;
  for (std::size_t a = 0; a < n; ++a) {
    const std::int64_t j = w.allowed[a];
    for (std::int64_t d = 0; d < Dk; ++d) w.K.mul_exact(prods[d], qrow[d], j, d);
    const int t = mpfr_sum(w.slo[a], prods.ptrs(), static_cast<unsigned long>(Dk), MPFR_RNDD);
    mpfr_set(w.shi[a], w.slo[a], MPFR_RNDN);
    if (t != 0) {
      mpfr_nextabove(w.shi[a]);  // exact value in (lo, next above lo)
      all_exact = false;
    }
    mpfr_set(det.dots[static_cast<std::size_t>(j)].lo, w.slo[a], MPFR_RNDD);
    mpfr_set(det.dots[static_cast<std::size_t>(j)].hi, w.shi[a], MPFR_RNDU);
  }
  return all_exact;
}

// Every allowed score provably equal (one key, or exact equal dots and equal bias): the
// weights are exactly 1/n.
bool scores_tie(const HeadWork& w, bool all_exact) {
  const std::size_t n = w.allowed.size();
  bool tie = all_exact || n == 1;
  for (std::size_t a = 1; tie && a < n; ++a)
    tie = mpfr_equal_p(w.slo[a], w.slo[0]) &&
          w.c.bias_at(w.b, w.h, w.i, w.allowed[a]) == w.c.bias_at(w.b, w.h, w.i, w.allowed[0]);
  return tie;
}

// Scores S = softcap(scale * dot) + bias, as intervals, in place of the dots.
void scores(HeadWork& w) {
  const Case& c = w.c;
  Mp sclo(w.p), schi(w.p), cl(w.p), ch(w.p);
  if (c.scale) {
    enclose_text(sclo.x, schi.x, *c.scale);
  } else {  // 1/sqrt(Dk), correctly rounded each way
    mpfr_set_si(w.tmp.x, c.scale_features ? c.scale_features : c.Dk, MPFR_RNDN);
    mpfr_rec_sqrt(sclo.x, w.tmp.x, MPFR_RNDD);
    mpfr_rec_sqrt(schi.x, w.tmp.x, MPFR_RNDU);
  }
  if (c.softcap) enclose_text(cl.x, ch.x, *c.softcap);
  for (std::size_t a = 0; a < w.allowed.size(); ++a) {
    detail::mul_interval(w.slo[a], w.shi[a], w.slo[a], w.shi[a], sclo.x, schi.x, w.tmp.x);
    if (c.softcap) {
      softcap_bound(w.tmp2.x, w.slo[a], cl.x, ch.x, MPFR_RNDD, w.tmp.x);
      softcap_bound(w.shi[a], w.shi[a], cl.x, ch.x, MPFR_RNDU, w.tmp.x);
      mpfr_set(w.slo[a], w.tmp2.x, MPFR_RNDD);
    }
    const double bias = c.bias_at(w.b, w.h, w.i, w.allowed[a]);
    if (bias != 0) {
      mpfr_add_d(w.slo[a], w.slo[a], bias, MPFR_RNDD);
      mpfr_add_d(w.shi[a], w.shi[a], bias, MPFR_RNDU);
    }
  }
}

// m: any number near the row maximum; exp(S - m) then stays near 1 for the largest terms.
void row_constant(HeadWork& w) {
  mpfr_set(w.m.x, w.shi[0], MPFR_RNDN);
  for (std::size_t a = 1; a < w.allowed.size(); ++a)
    if (mpfr_greater_p(w.shi[a], w.m.x)) mpfr_set(w.m.x, w.shi[a], MPFR_RNDN);
  if (w.c.sinks && mpfr_cmp_d(w.m.x, w.c.sink(w.h)) < 0) mpfr_set_d(w.m.x, w.c.sink(w.h), MPFR_RNDN);
  mpfr_prec_round(w.m.x, 53, MPFR_RNDN);  // a short constant keeps S - m cheap; its value is free
}

// e_j = exp(S_j - m) and Z = sum_j e_j.
void sums(HeadWork& w) {
  const std::size_t n = w.allowed.size();
  w.elo.resize(n, w.p);
  w.ehi.resize(n, w.p);
  w.terms.resize(n, w.p);
  if (w.tie) {  // exp(S - m) is the same number e for all keys: A = e / (n e) = 1/n exactly.
    for (std::size_t a = 0; a < n; ++a) {
      mpfr_set_ui(w.elo[a], 1, MPFR_RNDN);
      mpfr_set_ui(w.ehi[a], 1, MPFR_RNDN);
    }
    mpfr_set_ui(w.zlo.x, n, MPFR_RNDD);
    mpfr_set_ui(w.zhi.x, n, MPFR_RNDU);
    if (w.c.sinks) {  // relative to the common score S: exp(sink - S), and Z = n + exp(sink - S)
      mpfr_d_sub(w.tmp.x, w.c.sink(w.h), w.shi[0], MPFR_RNDD);
      mpfr_exp(w.sink_lo.x, w.tmp.x, MPFR_RNDD);
      mpfr_d_sub(w.tmp.x, w.c.sink(w.h), w.slo[0], MPFR_RNDU);
      mpfr_exp(w.sink_hi.x, w.tmp.x, MPFR_RNDU);
      mpfr_add(w.zlo.x, w.zlo.x, w.sink_lo.x, MPFR_RNDD);
      mpfr_add(w.zhi.x, w.zhi.x, w.sink_hi.x, MPFR_RNDU);
    }
    return;
  }
  for (std::size_t a = 0; a < n; ++a) {
    mpfr_sub(w.tmp.x, w.slo[a], w.m.x, MPFR_RNDD);
    mpfr_exp(w.elo[a], w.tmp.x, MPFR_RNDD);  // exp is increasing
    mpfr_sub(w.tmp.x, w.shi[a], w.m.x, MPFR_RNDU);
    mpfr_exp(w.ehi[a], w.tmp.x, MPFR_RNDU);
  }
  mpfr_sum(w.zlo.x, w.elo.ptrs(), n, MPFR_RNDD);  // all terms positive: sum of lows is a low
  mpfr_sum(w.zhi.x, w.ehi.ptrs(), n, MPFR_RNDU);
  if (w.c.sinks) {  // the sink: one more positive term of Z
    mpfr_d_sub(w.tmp.x, w.c.sink(w.h), w.m.x, MPFR_RNDD);
    mpfr_exp(w.sink_lo.x, w.tmp.x, MPFR_RNDD);
    mpfr_d_sub(w.tmp.x, w.c.sink(w.h), w.m.x, MPFR_RNDU);
    mpfr_exp(w.sink_hi.x, w.tmp.x, MPFR_RNDU);
    mpfr_add(w.zlo.x, w.zlo.x, w.sink_lo.x, MPFR_RNDD);
    mpfr_add(w.zhi.x, w.zhi.x, w.sink_hi.x, MPFR_RNDU);
  }
}

// lse = m + log Z (tie: S + log n, the same thing).
void lse(HeadWork& w, HeadRow& row) {
  mpfr_log(w.tmp.x, w.zlo.x, MPFR_RNDD);
  mpfr_add(row.lse.lo, w.tmp.x, w.tie ? w.slo[0] : w.m.x, MPFR_RNDD);
  mpfr_log(w.tmp.x, w.zhi.x, MPFR_RNDU);
  mpfr_add(row.lse.hi, w.tmp.x, w.tie ? w.shi[0] : w.m.x, MPFR_RNDU);
}

// Weights: A_j = e_j / Z.
void weights(HeadWork& w, HeadRow& row) {
  for (std::size_t a = 0; a < w.allowed.size(); ++a) {
    Enclosure& e = row.weights[static_cast<std::size_t>(w.allowed[a])];
    mpfr_div(e.lo, w.elo[a], w.zhi.x, MPFR_RNDD);
    mpfr_div(e.hi, w.ehi[a], w.zlo.x, MPFR_RNDU);
  }
}

// N_c = sum_j e_j v_jc into [nlo, nhi]: each product bounded with the end of e_j that the sign
// of v_jc calls for.
void numerator(HeadWork& w, std::int64_t cc) {
  const std::size_t n = w.allowed.size();
  for (std::size_t a = 0; a < n; ++a)
    if (w.keep[a]) w.V.mul(w.terms[a], w.V.sgn(w.allowed[a], cc) >= 0 ? w.elo[a] : w.ehi[a], w.allowed[a], cc, MPFR_RNDD);
    else mpfr_set_zero(w.terms[a], 1);  // a dropped key's term
  mpfr_sum(w.nlo.x, w.terms.ptrs(), n, MPFR_RNDD);
  for (std::size_t a = 0; a < n; ++a)
    if (w.keep[a]) w.V.mul(w.terms[a], w.V.sgn(w.allowed[a], cc) >= 0 ? w.ehi[a] : w.elo[a], w.allowed[a], cc, MPFR_RNDU);
    else mpfr_set_zero(w.terms[a], 1);
  mpfr_sum(w.nhi.x, w.terms.ptrs(), n, MPFR_RNDU);
}

// Keys holding the extremes of column cc over the allowed keys, by value and by magnitude.
struct ColumnRange {
  std::size_t min = 0, max = 0, absmin = 0, absmax = 0;
};
// Over the kept keys only under dropout (at least one).
ColumnRange column_range(const HeadWork& w, std::int64_t cc) {
  ColumnRange r;
  const auto& k = w.allowed;
  while (!w.keep[r.min]) ++r.min;
  r.max = r.absmin = r.absmax = r.min;
  for (std::size_t a = r.min + 1; a < k.size(); ++a) {
    if (!w.keep[a]) continue;
    if (w.V.cmp(k[a], cc, k[r.min], cc) < 0) r.min = a;
    if (w.V.cmp(k[a], cc, k[r.max], cc) > 0) r.max = a;
    if (w.V.cmpabs(k[a], cc, k[r.absmin], cc) < 0) r.absmin = a;
    if (w.V.cmpabs(k[a], cc, k[r.absmax], cc) > 0) r.absmax = a;
  }
  return r;
}

// The exact O_c, a convex combination (with a sink, of 0 too), lies in the hull too: the intersection when it is not
// empty (an empty one is a broken evaluation, for the oracle to report).
void intersect_hull(Enclosure& o, const Enclosure& raw, const Enclosure& hull) {
  mpfr_set(o.lo, mpfr_greater_p(hull.lo, raw.lo) ? hull.lo : raw.lo, MPFR_RNDD);
  mpfr_set(o.hi, mpfr_less_p(hull.hi, raw.hi) ? hull.hi : raw.hi, MPFR_RNDU);
  if (mpfr_greater_p(o.lo, o.hi)) {
    mpfr_set(o.lo, raw.lo, MPFR_RNDD);
    mpfr_set(o.hi, raw.hi, MPFR_RNDU);
  }
}

// bound_c = sum_j A_j |v_jc|, a convex combination of the |v_jc| (with a sink, of 0 too):
// intersected with their range.
void magnitude_bound(HeadWork& w, Enclosure& bd, std::int64_t cc, const ColumnRange& cr) {
  const std::size_t n = w.allowed.size();
  for (std::size_t a = 0; a < n; ++a)
    if (w.keep[a]) w.V.mul_abs(w.terms[a], w.elo[a], w.allowed[a], cc, MPFR_RNDD);
    else mpfr_set_zero(w.terms[a], 1);
  mpfr_sum(w.nlo.x, w.terms.ptrs(), n, MPFR_RNDD);
  for (std::size_t a = 0; a < n; ++a)
    if (w.keep[a]) w.V.mul_abs(w.terms[a], w.ehi[a], w.allowed[a], cc, MPFR_RNDU);
    else mpfr_set_zero(w.terms[a], 1);
  mpfr_sum(w.nhi.x, w.terms.ptrs(), n, MPFR_RNDU);
  mpfr_div(bd.lo, w.nlo.x, w.zhi.x, MPFR_RNDD);
  mpfr_div(bd.hi, w.nhi.x, w.zlo.x, MPFR_RNDU);
  w.V.get(w.tmp.x, w.allowed[cr.absmin], cc, MPFR_RNDZ);  // |v| rounded down
  mpfr_abs(w.tmp.x, w.tmp.x, MPFR_RNDN);
  if (w.c.sinks || w.c.dropout) mpfr_set_zero(w.tmp.x, 1);
  w.V.get(w.tmp2.x, w.allowed[cr.absmax], cc, MPFR_RNDA);  // |v| rounded up
  mpfr_abs(w.tmp2.x, w.tmp2.x, MPFR_RNDN);
  if (mpfr_lessequal_p(w.tmp.x, bd.hi) && mpfr_lessequal_p(bd.lo, w.tmp2.x)) {
    if (mpfr_less_p(bd.lo, w.tmp.x)) mpfr_set(bd.lo, w.tmp.x, MPFR_RNDD);
    if (mpfr_greater_p(bd.hi, w.tmp2.x)) mpfr_set(bd.hi, w.tmp2.x, MPFR_RNDU);
  }
}

// [lo, hi] times the keep scale [klo, khi] (positive): the sign of each end picks the scale's end.
// With 1 / (1 - p) exact, each end is the correctly rounded product: an exact product that is
// representable stays a point (a bound equal to an F64 is then decided).
void scale_by_keep(Enclosure& e, const HeadWork& w, mpfr_ptr tmp) {
  if (w.ks_exact) return mul_keep_scale(e.lo, e.hi, e.lo, e.hi, w.ks.q);
  mpfr_mul(tmp, e.lo, mpfr_sgn(e.lo) >= 0 ? w.klo.x : w.khi.x, MPFR_RNDD);
  mpfr_mul(e.hi, e.hi, mpfr_sgn(e.hi) >= 0 ? w.khi.x : w.klo.x, MPFR_RNDU);
  mpfr_set(e.lo, tmp, MPFR_RNDD);
}

// Output column c: O_c = N_c / Z within the values' hull, and its magnitude bound. Under
// dropout N_c sums the kept keys only, a combination of 0 and their values (raw_out and hull
// hold it), and out and bound are then times 1 / (1 - p).
void output_column(HeadWork& w, HeadRow& row, std::int64_t cc) {
  const auto ci = static_cast<std::size_t>(cc);
  HeadDetail& det = row.detail;
  if (!w.any_kept) return;  // every allowed key dropped: out and bound exactly 0
  numerator(w, cc);
  detail::div_by_positive(det.raw_out[ci].lo, det.raw_out[ci].hi, w.nlo.x, w.nhi.x, w.zlo.x, w.zhi.x);
  const ColumnRange cr = column_range(w, cc);
  w.V.get(det.hull[ci].lo, w.allowed[cr.min], cc, MPFR_RNDD);
  w.V.get(det.hull[ci].hi, w.allowed[cr.max], cc, MPFR_RNDU);
  if (w.c.sinks || w.c.dropout) {  // the weights sum to less than 1: O_c = sum_j A_j v_jc + A_sink * 0
    if (mpfr_sgn(det.hull[ci].lo) > 0) mpfr_set_zero(det.hull[ci].lo, 1);
    if (mpfr_sgn(det.hull[ci].hi) < 0) mpfr_set_zero(det.hull[ci].hi, 1);
  }
  intersect_hull(row.out[ci], det.raw_out[ci], det.hull[ci]);
  magnitude_bound(w, row.bound[ci], cc, cr);
  if (w.c.dropout) {
    scale_by_keep(row.out[ci], w, w.tmp.x);
    scale_by_keep(row.bound[ci], w, w.tmp.x);
  }
}

}  // namespace

struct RowEvaluator::Impl {
  const Case& c;
  // Exact projections for kind mha, [B][H][N][D] flattened, computed for a batch index on its
  // first use; unused for sdpa. The precisions are per batch index.
  std::vector<mpfr_t> qp, kp, vp;
  std::vector<mpfr_prec_t> qp_prec, kp_prec, vp_prec;
  std::unique_ptr<std::once_flag[]> projected;

  explicit Impl(const Case& cs) : c(cs) {
    if (c.kind != Kind::Mha) return;
    const auto B = static_cast<std::size_t>(c.B);
    qp = std::vector<mpfr_t>(static_cast<std::size_t>(c.B * c.Hq * c.Nq * c.Dk));
    kp = std::vector<mpfr_t>(static_cast<std::size_t>(c.B * c.Hq * c.Nk * c.Dk));
    vp = std::vector<mpfr_t>(static_cast<std::size_t>(c.B * c.Hq * c.Nk * c.Dv));
    qp_prec.assign(B, 0);
    kp_prec.assign(B, 0);
    vp_prec.assign(B, 0);
    projected = std::make_unique<std::once_flag[]>(B);
  }
  ~Impl() {
    if (c.kind != Kind::Mha) return;
    for (std::size_t b = 0; b < qp_prec.size(); ++b) {
      if (qp_prec[b] == 0) continue;  // never projected
      auto clear = [&](std::vector<mpfr_t>& v, std::int64_t N, std::int64_t E) {
        const auto per = static_cast<std::size_t>(c.Hq * N * E);
        for (std::size_t k = 0; k < per; ++k) mpfr_clear(v[b * per + k]);
      };
      clear(qp, c.Nq, c.Dk);
      clear(kp, c.Nk, c.Dk);
      clear(vp, c.Nk, c.Dv);
    }
  }

  // out[b][r][n][e] = sum_d x[b][n][d] * w[r][d][e], exactly (exact_dot).
  void project(std::int64_t b, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
               std::int64_t E, std::vector<mpfr_t>& out, mpfr_prec_t& maxprec) {
    const std::int64_t H = c.Hq, D = c.D;
    MpfrVec prods;
    maxprec = 53;
    auto idx = static_cast<std::size_t>(b * H * N * E);
    for (std::int64_t r = 0; r < H; ++r)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t e = 0; e < E; ++e, ++idx) {
          mpfr_init2(out[idx], 128);
          const double* xr = x.values.data() + (b * N + n) * D;
          const double* wc = w.values.data() + r * D * E + e;
          maxprec = std::max(maxprec, detail::exact_dot(out[idx], xr, 1, wc, E, D, prods));
        }
  }

  void ensure_projected(std::int64_t b) {
    const auto bi = static_cast<std::size_t>(b);
    std::call_once(projected[bi], [&] {
      project(b, c.x_q, c.w_q, c.Nq, c.Dk, qp, qp_prec[bi]);
      project(b, c.x_kv, c.w_k, c.Nk, c.Dk, kp, kp_prec[bi]);
      project(b, c.x_kv, c.w_v, c.Nk, c.Dv, vp, vp_prec[bi]);
    });
  }

  // The [rows, cols] matrix of head `head` of batch b: the input itself (sdpa) or its exact
  // projection (mha).
  ExactMatrix matrix(const FloatTensor& in, std::vector<mpfr_t>& proj,
                     const std::vector<mpfr_prec_t>& prec, std::int64_t heads, std::int64_t b,
                     std::int64_t head, std::int64_t rows, std::int64_t cols) {
    ExactMatrix m;
    m.cols = cols;
    const std::int64_t at = (b * heads + head) * rows * cols;
    if (c.kind == Kind::Sdpa) {
      m.d = in.values.data() + at;
    } else {
      m.m = &proj;
      m.offset = static_cast<std::size_t>(at);
      m.prec = prec[static_cast<std::size_t>(b)];
    }
    return m;
  }
  ExactMatrix q_of(std::int64_t b, std::int64_t h) {
    return matrix(c.q, qp, qp_prec, c.Hq, b, h, c.Nq, c.Dk);
  }
  ExactMatrix k_of(std::int64_t b, std::int64_t g) {
    return matrix(c.k, kp, kp_prec, c.Hkv, b, g, c.Nk, c.Dk);
  }
  ExactMatrix v_of(std::int64_t b, std::int64_t g) {
    return matrix(c.v, vp, vp_prec, c.Hkv, b, g, c.Nk, c.Dv);
  }

  // One query row of one head: scores, softmax and the weighted sum of values.
  HeadRow head_row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) {
    if (c.kind == Kind::Mha) ensure_projected(b);
    const std::int64_t g = c.kv_head(h);
    HeadWork w(c, b, h, i, p, q_of(b, h), k_of(b, g), v_of(b, g));
    HeadRow row(p, c.Nk, c.Dv);
    if (!find_keys(w, row.detail)) {
      if (c.sinks)
        sink_only_row(w, row);
      else
        masked_row(w, row);
      return row;
    }
    w.any_kept = std::any_of(w.keep.begin(), w.keep.end(), [](char k) { return k != 0; });
    const bool exact = exact_dots(w, row.detail);
    w.tie = scores_tie(w, exact);
    scores(w);
    if (c.want_scores)
      for (std::size_t a = 0; a < w.allowed.size(); ++a) {
        Enclosure& e = row.scores[static_cast<std::size_t>(w.allowed[a])];
        mpfr_set(e.lo, w.slo[a], MPFR_RNDD);
        mpfr_set(e.hi, w.shi[a], MPFR_RNDU);
      }
    row_constant(w);
    sums(w);
    lse(w, row);
    weights(w, row);
    for (std::int64_t cc = 0; cc < c.Dv; ++cc) output_column(w, row, cc);
    return row;
  }
};

RowEvaluator::RowEvaluator(const Case& c) : impl_(new Impl(c)) {}
RowEvaluator::~RowEvaluator() { delete impl_; }

RowEnclosures RowEvaluator::row(std::int64_t b, std::int64_t h, std::int64_t i,
                                mpfr_prec_t p) const {
  const Case& c = impl_->c;
  RowEnclosures r;
  if (c.kind == Kind::Sdpa) {
    HeadRow hr = impl_->head_row(b, h, i, p);
    r.valid = hr.valid;
    r.out = std::move(hr.out);
    r.bound = std::move(hr.bound);
    r.weights.push_back(std::move(hr.weights));
    r.lse.push_back(std::move(hr.lse));
    r.scores.push_back(std::move(hr.scores));
    r.head_valid.push_back(hr.valid);
    hr.detail.out = std::vector<Enclosure>();
    for (const Enclosure& e : r.out) hr.detail.out.push_back(copy_enclosure(e));
    r.heads.push_back(std::move(hr.detail));
    return r;
  }
  // mha: out_e = sum_{r,c} O_r[c] W_o[r*Dv + c, e], bound_e = sum bound_r[c] |W_o[r*Dv + c, e]|.
  const std::int64_t H = c.Hq, Dv = c.Dv, Dout = c.Dout;
  std::vector<HeadRow> heads;
  bool any_valid = false;
  for (std::int64_t hh = 0; hh < H; ++hh) {
    heads.push_back(impl_->head_row(b, hh, i, p));
    any_valid = any_valid || heads.back().valid;
  }
  r.valid = any_valid;
  const auto nt = static_cast<std::size_t>(H * Dv);
  MpfrVec tlo, thi, blo, bhi;
  tlo.resize(nt, p);
  thi.resize(nt, p);
  blo.resize(nt, p);
  bhi.resize(nt, p);
  for (std::int64_t e = 0; e < Dout; ++e) {
    for (std::int64_t hh = 0; hh < H; ++hh)
      for (std::int64_t cc = 0; cc < Dv; ++cc) {
        const auto t = static_cast<std::size_t>(hh * Dv + cc);
        const double w = c.w_o.values[static_cast<std::size_t>((hh * Dv + cc) * Dout + e)];
        const Enclosure& o = heads[static_cast<std::size_t>(hh)].out[static_cast<std::size_t>(cc)];
        const Enclosure& bd =
            heads[static_cast<std::size_t>(hh)].bound[static_cast<std::size_t>(cc)];
        mpfr_mul_d(tlo[t], w >= 0 ? o.lo : o.hi, w, MPFR_RNDD);
        mpfr_mul_d(thi[t], w >= 0 ? o.hi : o.lo, w, MPFR_RNDU);
        mpfr_mul_d(blo[t], bd.lo, std::fabs(w), MPFR_RNDD);
        mpfr_mul_d(bhi[t], bd.hi, std::fabs(w), MPFR_RNDU);
      }
    r.out.emplace_back(p);
    r.bound.emplace_back(p);
    mpfr_sum(r.out.back().lo, tlo.ptrs(), nt, MPFR_RNDD);
    mpfr_sum(r.out.back().hi, thi.ptrs(), nt, MPFR_RNDU);
    mpfr_sum(r.bound.back().lo, blo.ptrs(), nt, MPFR_RNDD);
    mpfr_sum(r.bound.back().hi, bhi.ptrs(), nt, MPFR_RNDU);
  }
  for (auto& hr : heads) {
    hr.detail.out = std::move(hr.out);
    r.heads.push_back(std::move(hr.detail));
    r.weights.push_back(std::move(hr.weights));
    r.lse.push_back(std::move(hr.lse));
    r.scores.push_back(std::move(hr.scores));
    r.head_valid.push_back(hr.valid);
  }
  return r;
}

}  // namespace attnoracle
