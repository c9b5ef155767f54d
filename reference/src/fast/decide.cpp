// The fast row's roundings decided from its balls: committed only when every element is
// decided (the same values the MPFR path proves, since a correct rounding is unique).
#include "decide.hpp"

#include <mpfr.h>

#include <cmath>
#include <cstddef>

#include "attnoracle/reference/round.hpp"
#include "attnoracle/reference/scaled_output.hpp"

namespace attnoracle::fast {

bool decide(DD lo, DD hi, DType t, std::vector<double>& into) {
  const double a = round_dd(lo, t), z = round_dd(hi, t);
  if (a == 0 && z == 0) into.push_back((hi.hi < 0 || (hi.hi == 0 && hi.lo < 0)) ? -0.0 : 0.0);
  else if (a == z) into.push_back(a);
  else return false;
  return true;
}

namespace {

// out, out.ref, [out.ref_lo] and out.bound of element e.
bool decide_out(const Case& c, const FastRow& fr, std::size_t e, DecidedRow& d) {
  DD lo, hi;
  ends(fr.out[e], lo, hi, fr.vmin[e], fr.vmax[e]);
  const DType t = c.dtype_of("out");
  if (c.o_scale && is_fp8(t)) {  // O / o_scale, rounded from the ball's ends with MPFR
    const Enclosure o = enclosure_of(DDEnclosure{lo.hi, lo.lo, hi.hi, hi.lo});
    const RoundedEnclosure r = round_out_enclosure(c, o.lo, o.hi);
    if (!r.decided) return false;
    d.out.push_back(r.value);
  } else if (!decide(lo, hi, t, d.out)) {
    return false;
  }
  if (!decide(lo, hi, DType::F64, d.out_ref)) return false;
  if (t == DType::F64) {  // exact - ref: x.hi - ref is exact (Sterbenz) or we give up
    const double ref = d.out_ref.back();
    const DD dl = two_sum(lo.hi, -ref), dh = two_sum(hi.hi, -ref);
    if (dl.lo != 0 || dh.lo != 0) return false;
    if (!decide(DD{dl.hi, lo.lo}, DD{dh.hi, hi.lo}, DType::F64, d.out_ref_lo)) return false;
  }
  ends(fr.bound[e], lo, hi, fr.absmin[e], fr.absmax[e]);  // within the |v| range
  const double bound = round_up_dd(hi) + 0.0;              // a zero bound is +0
  d.bound.push_back(bound);
  return round_up_dd(lo) == bound;
}

bool decide_scores(const Case& c, const FastRow& fr, DecidedRow& d) {
  for (std::size_t j = 0; j < fr.scores.size(); ++j) {
    if (!fr.allowed[j]) {
      d.scores.push_back(-INFINITY);
      d.scores_ref.push_back(-INFINITY);
      continue;
    }
    const DD lo = lower(fr.scores[j]), hi = upper(fr.scores[j]);
    if (!decide(lo, hi, c.dtype_of("scores"), d.scores) || !decide(lo, hi, DType::F64, d.scores_ref))
      return false;
  }
  return true;
}

bool decide_weights(const Case& c, const FastRow& fr, DecidedRow& d) {
  for (std::size_t j = 0; j < fr.weights.size(); ++j) {
    if (!fr.allowed[j]) {  // exactly 0
      d.weights.push_back(0.0);
      d.weights_ref.push_back(0.0);
      continue;
    }
    DD lo, hi;
    ends(fr.weights[j], lo, hi, 0, 1);
    if (!decide(lo, hi, c.dtype_of("weights"), d.weights) || !decide(lo, hi, DType::F64, d.weights_ref))
      return false;
  }
  return true;
}

// A double-double as an MPFR enclosure end, rounded the given way.
void set_dd(mpfr_ptr x, DD d, mpfr_rnd_t rnd) {
  mpfr_set_d(x, d.hi, rnd);
  mpfr_add_d(x, x, d.lo, rnd);
}
Enclosure point_enclosure(double lo, double hi) {
  Enclosure e(128);
  mpfr_set_d(e.lo, lo, MPFR_RNDD);
  mpfr_set_d(e.hi, hi, MPFR_RNDU);
  return e;
}
// The ends of a ball intersected with [lo, hi].
DDEnclosure clamped_ends(const Ball& b, double lo, double hi) {
  DD l, h;
  ends(b, l, h, lo, hi);
  return {l.hi, l.lo, h.hi, h.lo};
}
DDEnclosure ball_ends(const Ball& b) {
  const DD l = lower(b), h = upper(b);
  return {l.hi, l.lo, h.hi, h.lo};
}
Enclosure clamped_enclosure(const Ball& b, double lo, double hi) { return enclosure_of(clamped_ends(b, lo, hi)); }

}  // namespace

Enclosure ball_enclosure(const Ball& b) { return enclosure_of(ball_ends(b)); }

}  // namespace attnoracle::fast

namespace attnoracle {
Enclosure enclosure_of(const DDEnclosure& d) {
  Enclosure e(128);
  fast::set_dd(e.lo, fast::DD{d.lo_hi, d.lo_lo}, MPFR_RNDD);
  fast::set_dd(e.hi, fast::DD{d.hi_hi, d.hi_lo}, MPFR_RNDU);
  return e;
}
}  // namespace attnoracle

namespace attnoracle::fast {

std::uint64_t DecidedRow::rounded() const {
  return out.size() + out_ref.size() + out_ref_lo.size() + weights.size() + weights_ref.size() +
         lse.size() + lse_ref.size() + scores.size() + scores_ref.size();
}

Enclosure lse_enclosure(const FastRow& fr) {
  Enclosure lse(128);
  set_dd(lse.lo, lower(fr.z), MPFR_RNDD);
  mpfr_log(lse.lo, lse.lo, MPFR_RNDD);  // log is increasing
  mpfr_add_d(lse.lo, lse.lo, fr.m, MPFR_RNDD);
  set_dd(lse.hi, upper(fr.z), MPFR_RNDU);
  mpfr_log(lse.hi, lse.hi, MPFR_RNDU);
  mpfr_add_d(lse.hi, lse.hi, fr.m, MPFR_RNDU);
  return lse;
}

bool decide_row(const Case& c, const FastRow& fr, const Enclosure& lse, DecidedRow& d) {
  return decide_row(c, fr, lse, d, c.want_weights, c.want_lse);
}

bool decide_row(const Case& c, const FastRow& fr, const Enclosure& lse, DecidedRow& d,
                bool weights, bool with_lse) {
  d = DecidedRow{};
  for (std::size_t e = 0; e < fr.out.size(); ++e)
    if (!decide_out(c, fr, e, d)) return false;
  if (weights && !decide_weights(c, fr, d)) return false;
  if (c.want_scores && !decide_scores(c, fr, d)) return false;
  if (with_lse)
    for (auto [t, into] : {std::pair{c.dtype_of("lse"), &d.lse}, std::pair{DType::F64, &d.lse_ref}}) {
      const RoundedEnclosure re = round_enclosure(lse.lo, lse.hi, t);
      if (!re.decided) return false;
      into->push_back(re.value);
    }
  return true;
}

void ball_ends_scalar(std::size_t from, std::size_t n, const double* balls, double* lo, double* hi) {
  for (std::size_t i = from; i < n; ++i) {
    const Ball b{DD{balls[3 * i], balls[3 * i + 1]}, balls[3 * i + 2]};
    lo[i] = round_down_dd(lower(b));
    hi[i] = round_up_dd(upper(b));
  }
}

RowIntervals row_intervals(const FastRow& fr, const Enclosure& lse) {
  RowIntervals r;
  r.allowed = fr.allowed;
  // The ends in SIMD lanes, on the balls' three doubles each.
  static_assert(sizeof(Ball) == 3 * sizeof(double) && offsetof(Ball, rad) == 2 * sizeof(double));
  const auto ends = [](const std::vector<Ball>& balls, std::vector<double>& lo, std::vector<double>& hi) {
    lo.resize(balls.size());
    hi.resize(balls.size());
    ball_ends(reinterpret_cast<const double*>(balls.data()), balls.size(), lo.data(), hi.data());
  };
  ends(fr.weights, r.w_lo, r.w_hi);
  ends(fr.out, r.out_lo, r.out_hi);
  r.lse_lo = mpfr_get_d(lse.lo, MPFR_RNDD);
  r.lse_hi = mpfr_get_d(lse.hi, MPFR_RNDU);
  return r;
}

RowEnclosures row_enclosures(const FastRow& fr, const Enclosure& lse) {
  return row_enclosures(fr, lse, RowParts::All);
}

RowEnclosures row_enclosures(const FastRow& fr, const Enclosure& lse, RowParts parts) {
  const bool all = parts == RowParts::All;
  RowEnclosures r;
  if (!all) {  // the compared parts as ends
    std::vector<DDEnclosure> w(fr.weights.size()), o(fr.out.size());
    for (std::size_t j = 0; j < w.size(); ++j) w[j] = ball_ends(fr.weights[j]);
    for (std::size_t e = 0; e < o.size(); ++e) o[e] = clamped_ends(fr.out[e], fr.vmin[e], fr.vmax[e]);
    r.weights.emplace_back();
    r.weight_ends.push_back(std::move(w));
    r.out_ends.push_back(std::move(o));
    Enclosure l(128);
    mpfr_set(l.lo, lse.lo, MPFR_RNDD);
    mpfr_set(l.hi, lse.hi, MPFR_RNDU);
    r.lse.push_back(std::move(l));
    r.head_valid.push_back(true);
    HeadDetail d;
    d.allowed = fr.allowed;
    r.heads.push_back(std::move(d));
    return r;
  }
  HeadDetail d;
  d.allowed = fr.allowed;
  std::vector<Enclosure> w, s;
  w.reserve(fr.weights.size());
  if (all) {
    d.dots.reserve(fr.weights.size());
    s.reserve(fr.weights.size());
  }
  for (std::size_t j = 0; j < fr.weights.size(); ++j) {
    w.push_back(ball_enclosure(fr.weights[j]));
    if (!all) continue;
    d.dots.push_back(ball_enclosure(fr.dots[j]));
    s.push_back(fr.allowed[j] ? ball_enclosure(fr.scores[j]) : point_enclosure(-INFINITY, -INFINITY));
  }
  for (std::size_t e = 0; e < fr.out.size(); ++e) {
    d.out.push_back(clamped_enclosure(fr.out[e], fr.vmin[e], fr.vmax[e]));
    r.out.push_back(clamped_enclosure(fr.out[e], fr.vmin[e], fr.vmax[e]));
    if (!all) continue;
    d.raw_out.push_back(ball_enclosure(fr.out[e]));
    d.hull.push_back(point_enclosure(fr.vmin[e], fr.vmax[e]));
    r.bound.push_back(ball_enclosure(fr.bound[e]));
  }
  Enclosure l(128);
  mpfr_set(l.lo, lse.lo, MPFR_RNDD);
  mpfr_set(l.hi, lse.hi, MPFR_RNDU);
  r.weights.push_back(std::move(w));
  r.scores.push_back(std::move(s));
  r.lse.push_back(std::move(l));
  r.head_valid.push_back(true);
  r.heads.push_back(std::move(d));
  return r;
}

}  // namespace attnoracle::fast
