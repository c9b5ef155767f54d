// dsinks (CONTRACT section 7), in interval arithmetic over MPFR. Row i of head h has
// P_sink_i = exp(sink_h - lse_i) and D_i = dout_i . O_i, with lse and O from RowEvaluator (its
// lse holds the sink's term), and
//   dsinks[h] = - sum over b and i of P_sink_i D_i:
// the sink enters only Z, and d(A_ij)/d(sink) = -A_ij P_sink_i, so dL/d(sink) = -P_sink_i
// sum_j A_ij dP_ij = -P_sink_i D_i. Rows without a key (only the sink) have O = 0, hence D_i = 0
// exactly; padding and fully masked rows (policy zero) are skipped. One Ziv loop per head.
#include <algorithm>
#include <cmath>

#include "attnoracle/reference/detail/progress.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/round.hpp"
#include "backward.hpp"
#include "golden_buffer.hpp"
#include "interval.hpp"

namespace attnoracle {
namespace {

// One head's value and bound at precision p; returns whether both roundings are decided.
bool dsinks_head(const Case& c, const EvalOptions& opt, const RowEvaluator& ev, std::int64_t h,
                 mpfr_prec_t p, const SinkGradientBuffers& out, std::vector<detail::Pending>& pend,
                 double& bound) {
  const std::size_t rows = static_cast<std::size_t>(c.B * c.Nq);
  detail::MpfrVec tlo, thi, blo, bhi;  // per row: -P_sink D, and P_sink sum_c |dout_c O_c|
  tlo.resize(rows, p), thi.resize(rows, p), blo.resize(rows, p), bhi.resize(rows, p);
  detail::MpfrVec dlo, dhi, alo, ahi;  // per column: dout_c O_c and |dout_c O_c|
  dlo.resize(static_cast<std::size_t>(c.Dv), p), dhi.resize(static_cast<std::size_t>(c.Dv), p);
  alo.resize(static_cast<std::size_t>(c.Dv), p), ahi.resize(static_cast<std::size_t>(c.Dv), p);
  Enclosure ps(p), d(p), da(p), oa(p);
  std::size_t n = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      if (!c.query_valid(b, i)) continue;
      const RowEnclosures r = ev.row(b, h, i, p);
      if (!r.valid) continue;
      const double* dout =
          c.dout->values.data() + static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Dv);
      for (std::int64_t cc = 0; cc < c.Dv; ++cc) {
        const auto k = static_cast<std::size_t>(cc);
        const Enclosure& o = r.out[k];
        const double x = dout[cc];
        mpfr_mul_d(dlo[k], x >= 0 ? o.lo : o.hi, x, MPFR_RNDD);
        mpfr_mul_d(dhi[k], x >= 0 ? o.hi : o.lo, x, MPFR_RNDU);
        // |O_c| enclosed: [0, max |end|] when O_c may be 0, else the ends' magnitudes.
        if (mpfr_sgn(o.lo) >= 0) {
          mpfr_set(oa.lo, o.lo, MPFR_RNDD), mpfr_set(oa.hi, o.hi, MPFR_RNDU);
        } else if (mpfr_sgn(o.hi) <= 0) {
          mpfr_neg(oa.lo, o.hi, MPFR_RNDD), mpfr_neg(oa.hi, o.lo, MPFR_RNDU);
        } else {
          mpfr_set_zero(oa.lo, 1);
          mpfr_neg(oa.hi, o.lo, MPFR_RNDU);
          if (mpfr_greater_p(o.hi, oa.hi)) mpfr_set(oa.hi, o.hi, MPFR_RNDU);
        }
        mpfr_mul_d(alo[k], oa.lo, std::fabs(x), MPFR_RNDD);
        mpfr_mul_d(ahi[k], oa.hi, std::fabs(x), MPFR_RNDU);
      }
      const auto dv = static_cast<unsigned long>(c.Dv);
      mpfr_sum(d.lo, dlo.ptrs(), dv, MPFR_RNDD), mpfr_sum(d.hi, dhi.ptrs(), dv, MPFR_RNDU);
      mpfr_sum(da.lo, alo.ptrs(), dv, MPFR_RNDD), mpfr_sum(da.hi, ahi.ptrs(), dv, MPFR_RNDU);
      // P_sink = exp(sink - lse) decreases with lse; it is a share of Z, at most 1.
      mpfr_d_sub(ps.lo, c.sink(h), r.lse[0].hi, MPFR_RNDD);
      mpfr_exp(ps.lo, ps.lo, MPFR_RNDD);
      mpfr_d_sub(ps.hi, c.sink(h), r.lse[0].lo, MPFR_RNDU);
      mpfr_exp(ps.hi, ps.hi, MPFR_RNDU);
      if (mpfr_cmp_ui(ps.hi, 1) > 0) mpfr_set_ui(ps.hi, 1, MPFR_RNDN);
      // -P_sink D: -D = [-hi, -lo] (exact), and as P_sink >= 0 the sign of each end of -D
      // picks the end of P_sink.
      mpfr_neg(d.lo, d.lo, MPFR_RNDN), mpfr_neg(d.hi, d.hi, MPFR_RNDN);
      mpfr_swap(d.lo, d.hi);
      mpfr_mul(tlo[n], mpfr_sgn(d.lo) >= 0 ? ps.lo : ps.hi, d.lo, MPFR_RNDD);
      mpfr_mul(thi[n], mpfr_sgn(d.hi) >= 0 ? ps.hi : ps.lo, d.hi, MPFR_RNDU);
      mpfr_mul(blo[n], ps.lo, da.lo, MPFR_RNDD);
      mpfr_mul(bhi[n], ps.hi, da.hi, MPFR_RNDU);
      ++n;
    }
  Enclosure v(p), bd(p);
  if (n == 0) {
    mpfr_set_zero(v.lo, 1), mpfr_set_zero(v.hi, 1), mpfr_set_zero(bd.lo, 1), mpfr_set_zero(bd.hi, 1);
  } else {
    mpfr_sum(v.lo, tlo.ptrs(), n, MPFR_RNDD), mpfr_sum(v.hi, thi.ptrs(), n, MPFR_RNDU);
    mpfr_sum(bd.lo, blo.ptrs(), n, MPFR_RNDD), mpfr_sum(bd.hi, bhi.ptrs(), n, MPFR_RNDU);
  }
  if (opt.gradient_check) opt.gradient_check("dsinks", h, v, bd);
  bool all = true;
  for (detail::GoldenBuffer* buf : {out.value, out.ref}) {
    pend.push_back({buf, h, round_enclosure(v.lo, v.hi, buf->dtype)});
    all = all && pend.back().r.decided;
  }
  // The bound's upper end rounded up, out of Ziv's test as for the other gradients.
  bound = mpfr_get_d(bd.hi, MPFR_RNDU);
  if (bound == 0) bound = 0.0;  // a zero bound is +0
  return all;
}

}  // namespace

SinkGradientStats evaluate_dsinks(const Case& c, const EvalOptions& opt, const RowEvaluator& ev,
                                  const SinkGradientBuffers& out, mpfr_prec_t p0, mpfr_prec_t cap) {
  std::vector<SinkGradientStats> per(static_cast<std::size_t>(c.Hq));
  detail::PassProgress done(opt, "dsinks heads", static_cast<std::uint64_t>(c.Hq));
  parallel_for(static_cast<std::size_t>(c.Hq), opt.threads, [&](std::size_t u) {
    const auto h = static_cast<std::int64_t>(u);
    std::vector<detail::Pending> pend;
    double bound = 0;
    for (mpfr_prec_t p = p0;; p = std::min(2 * p, cap)) {
      pend.clear();
      const bool all = dsinks_head(c, opt, ev, h, p, out, pend, bound);
      if (!all && p < cap) continue;
      for (const detail::Pending& x : pend) {
        x.buf->set(x.idx, x.r.value);
        if (!x.r.decided) {
          ++per[u].undecided;
          std::lock_guard<std::mutex> lk(x.buf->mu);
          x.buf->undecided.emplace_back(x.idx, x.r.alt);
        }
      }
      out.bound->set(h, bound);
      per[u].elements = pend.size();
      per[u].reached = p;
      done.unit_done();
      return;
    }
  });
  mpfr_free_cache();
  SinkGradientStats s;
  for (const SinkGradientStats& x : per) {
    s.elements += x.elements;
    s.undecided += x.undecided;
    s.reached = std::max(s.reached, x.reached);
  }
  return s;
}

}  // namespace attnoracle
