// Certified gradients of kind sdpa (CONTRACT section 7), in interval arithmetic over MPFR.
// With P the weights, O = P V, D_i = dout_i . O_i and dP_ij = dout_i . V_j:
//   dS_ij = P_ij (dP_ij - D_i) on allowed keys (0 elsewhere), dT = dS * sech^2(T/c) (softcap c),
//   dq = scale dT K, dk = scale dT^T Q, dv = P^T dout (summed over a kv head's query heads),
//   dbias = dS summed over the bias's broadcast dimensions.
// Three passes, each streamed and threaded: rows (the row statistics lse_i and D_i, and dq_i),
// keys (dk_j and dv_j, P_ij recomputed from lse_i), and the columns of the bias (dbias). The
// units of each go first to the fast path (fast/fast_backward.cpp), which commits a unit when
// its balls decide every rounding; the others run their own Ziv loop, and a unit past the
// starting precision recomputes the statistics of the rows it reads at its own precision.
#include "backward.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>

#include "attnoracle/reference/detail/progress.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/round.hpp"
#include "fast/dd.hpp"
#include "fast/fast_backward.hpp"
#include "golden_buffer.hpp"
#include "backward_parts.hpp"
#include "interval.hpp"
#include "rotary_grad.hpp"

namespace attnoracle {
namespace {

using detail::GoldenBuffer;
using detail::MpfrVec;
using detail::Pending;
using namespace detail::backward;

constexpr const char* kGradients[] = {"dq", "dk", "dv", "dbias"};

// [lo, hi] holds sum_d a[d] b[d] (doubles): each product is exact in 106 bits and mpfr_sum
// rounds the sum down, reporting exactness. Returns whether lo is the exact value.
bool dot(Enclosure& e, const double* a, const double* b, std::int64_t n, MpfrVec& prods) {
  prods.resize(static_cast<std::size_t>(n), 106);
  for (std::int64_t d = 0; d < n; ++d) {
    mpfr_set_d(prods[static_cast<std::size_t>(d)], a[d], MPFR_RNDN);
    mpfr_mul_d(prods[static_cast<std::size_t>(d)], prods[static_cast<std::size_t>(d)], b[d], MPFR_RNDN);
  }
  const int t = mpfr_sum(e.lo, prods.ptrs(), static_cast<unsigned long>(n), MPFR_RNDD);
  mpfr_set(e.hi, e.lo, MPFR_RNDU);
  if (t != 0) mpfr_nextabove(e.hi);  // the exact value lies in (lo, next above lo)
  return t == 0;
}
// The same for sum_d |a[d] b[d]|.
void dot_abs(Enclosure& e, const double* a, const double* b, std::int64_t n, MpfrVec& prods) {
  prods.resize(static_cast<std::size_t>(n), 106);
  for (std::int64_t d = 0; d < n; ++d) {
    mpfr_set_d(prods[static_cast<std::size_t>(d)], std::fabs(a[d]), MPFR_RNDN);
    mpfr_mul_d(prods[static_cast<std::size_t>(d)], prods[static_cast<std::size_t>(d)], std::fabs(b[d]), MPFR_RNDN);
  }
  if (mpfr_sum(e.lo, prods.ptrs(), static_cast<unsigned long>(n), MPFR_RNDD) == 0) {
    mpfr_set(e.hi, e.lo, MPFR_RNDU);
  } else {
    mpfr_set(e.hi, e.lo, MPFR_RNDU);
    mpfr_nextabove(e.hi);
  }
}

// sum_d a[d] b[d] exactly, as the expansion e (Shewchuk's Grow-Expansion of each product's
// TwoProd parts, zeros dropped): every TwoProd and TwoSum is error-free, so the parts sum to the
// exact dot, while no product underflows and nothing overflows (the fast path's input range).
void expansion_dot(const double* a, const double* b, std::int64_t n, std::vector<double>& e) {
  e.clear();
  auto grow = [&e](double x) {
    if (x == 0) return;
    std::size_t k = 0;
    for (std::size_t m = 0; m < e.size(); ++m) {
      const fast::DD t = fast::two_sum(x, e[m]);
      x = t.hi;
      if (t.lo != 0) e[k++] = t.lo;
    }
    e.resize(k);
    if (x != 0) e.push_back(x);
  };
  for (std::int64_t d = 0; d < n; ++d) {
    const fast::DD p = fast::two_prod(a[d], b[d]);
    grow(p.hi);
    grow(p.lo);
  }
}
// [lo, hi] holds the expansion's sum: each part is exact at 53 bits, mpfr_sum rounds each way.
// False where a part is not finite (the expansion is then not exact).
bool enclose_sum(Enclosure& r, const std::vector<double>& e, MpfrVec& parts) {
  if (e.empty()) {
    set_zero(r);
    return true;
  }
  parts.resize(e.size(), 53);
  for (std::size_t m = 0; m < e.size(); ++m) {
    if (!std::isfinite(e[m])) return false;
    mpfr_set_d(parts[m], e[m], MPFR_RNDN);
  }
  mpfr_sum(r.lo, parts.ptrs(), e.size(), MPFR_RNDD);
  mpfr_sum(r.hi, parts.ptrs(), e.size(), MPFR_RNDU);
  return true;
}

class Backward {
 public:
  Backward(const Case& c, const EvalOptions& opt)
      : c_(c),
        opt_(opt),
        ev_(c),
        fast_(c, opt),
        G_(c.Hq / c.Hkv),
        stats_(static_cast<std::size_t>(c.B * c.Hq * c.Nq)),
        once_(new std::once_flag[stats_.size()]),
        lean_(stats_.size()),
        lean_once_(new std::once_flag[stats_.size()]) {
    auto lg = [](std::int64_t n) {
      return static_cast<mpfr_prec_t>(std::ceil(std::log2(static_cast<double>(n) + 1.0)));
    };
    // Room for the cancellation in dP - D and for sums over Nq and Nk terms of Dk-long dots.
    p0_ = opt.start_precision > 0 ? opt.start_precision
                                   : 128 + 2 * lg(c.Nk) + lg(c.Nq * G_) + lg(c.Dk) + lg(c.Dv);
    bool f64 = false;  // an F64 gradient: its rounding needs ~53 more bits decided
    for (const GoldenSpec& g : c.golden_tensors())
      if (is_gradient_golden(g.name)) {
        bufs_.push_back(std::make_unique<GoldenBuffer>(g));
        if (g.dtype == DType::F64 && g.name.find('.') == std::string::npos) f64 = true;
      }
    if (f64) p0_ += 64;
    cap_ = std::max(opt.max_precision, p0_);
    for (std::size_t k = 0; k < 4; ++k) {
      val_[k] = find(kGradients[k]);
      ref_[k] = find(std::string(kGradients[k]) + ".ref");
      bound_[k] = find(std::string(kGradients[k]) + ".bound");
    }
    if (c.bias) {
      const auto& s = c.bias->shape;
      for (std::size_t a = 0; a < 4; ++a) ext_[a] = a + s.size() >= 4 ? s[a + s.size() - 4] : 1;
    }
  }

  void run() {
    const int t = opt_.threads;
    // Each pass over its units, counted for the progress as they finish.
    auto pass = [&](const char* unit, std::int64_t n, auto&& body) {
      detail::PassProgress done(opt_, unit, static_cast<std::uint64_t>(n));
      parallel_for(static_cast<std::size_t>(n), t, [&](std::size_t u) {
        body(u);
        done.unit_done();
      });
    };
    pass("gradient rows", c_.B * c_.Hq * c_.Nq, [&](std::size_t u) { row_unit(u); });
    if (c_.want_dk || c_.want_dv)
      pass("gradient keys", c_.B * c_.Hkv * c_.Nk, [&](std::size_t u) { key_unit(u); });
    if (c_.want_dbias)
      pass("dbias columns", ext_[0] * ext_[1] * ext_[3], [&](std::size_t u) { bias_unit(u); });
    if (c_.want_dsinks) {
      const SinkGradientStats s =
          evaluate_dsinks(c_, opt_, ev_, {find("dsinks"), find("dsinks.ref"), find("dsinks.bound")}, p0_, cap_);
      elements_.fetch_add(s.elements);
      undecided_.fetch_add(s.undecided);
      if (s.reached > reached_.load()) reached_.store(s.reached);
    }
    mpfr_free_cache();
  }

  void finish(EvalResult& res) {
    for (auto& g : bufs_) detail::append_golden(*g, res.golden);
    res.stats.elements += elements_.load();
    res.stats.undecided += undecided_.load();
    res.stats.max_precision_reached = std::max(res.stats.max_precision_reached, reached_.load());
    res.stats.grad_units_fast += fast_units_.load();
    res.stats.grad_units_fallback += fallback_units_.load();
  }

 private:
  GoldenBuffer* find(const std::string& name) {
    for (auto& g : bufs_)
      if (g->name == name) return g.get();
    return nullptr;
  }
  std::size_t row_id(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * c_.Hq + h) * c_.Nq + i);
  }
  const double* dout_row(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return c_.dout->values.data() + row_id(b, h, i) * static_cast<std::size_t>(c_.Dv);
  }
  const double* q_row(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return c_.q.values.data() + row_id(b, h, i) * static_cast<std::size_t>(c_.Dk);
  }
  std::size_t key_id(std::int64_t b, std::int64_t g, std::int64_t j) const {
    return static_cast<std::size_t>((b * c_.Hkv + g) * c_.Nk + j);
  }
  const double* k_row(std::int64_t b, std::int64_t g, std::int64_t j) const {
    return c_.k.values.data() + key_id(b, g, j) * static_cast<std::size_t>(c_.Dk);
  }
  const double* v_row(std::int64_t b, std::int64_t g, std::int64_t j) const {
    return c_.v.values.data() + key_id(b, g, j) * static_cast<std::size_t>(c_.Dv);
  }

  // The row's statistics at precision p from the forward's enclosures: lse, and D = dout . O.
  // Returns the forward row for the row pass (empty rows for the others).
  std::optional<RowEnclosures> stat_at(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p,
                                       RowStat& st) const {
    st.valid = false;
    if (!c_.query_valid(b, i)) return std::nullopt;
    RowEnclosures r = ev_.row(b, h, i, p);
    if (!r.valid) return std::nullopt;
    st.valid = true;
    st.lse = Enclosure(p);
    copy_to(st.lse, r.lse[0]);
    st.d = Enclosure(p);
    st.dabs = Enclosure(p);
    Terms t, ta;
    t.reset(static_cast<std::size_t>(c_.Dv), p);
    ta.reset(static_cast<std::size_t>(c_.Dv), p);
    Enclosure oabs(p);
    const double* dout = dout_row(b, h, i);
    for (std::int64_t cc = 0; cc < c_.Dv; ++cc, ++t.n, ++ta.n) {
      const Enclosure& o = r.out[static_cast<std::size_t>(cc)];
      mul_d(t.lo[t.n], t.hi[t.n], o.lo, o.hi, dout[cc]);
      abs_of(oabs, o);
      mul_d(ta.lo[ta.n], ta.hi[ta.n], oabs.lo, oabs.hi, std::fabs(dout[cc]));
    }
    t.sum(st.d);
    ta.sum(st.dabs);
    return r;
  }

  // One element's enclosures rounded: the value into G and G.ref, the bound rounded up.
  // `strict`: the bound counts as decided only where both its ends round up alike (the
  // smallest F64 at or above the exact bound, as the fast path requires).
  void round_element(std::size_t gk, std::int64_t idx, const Enclosure& v, const Enclosure& bd,
                     std::vector<Pending>& pend, std::vector<std::pair<std::int64_t, double>>& bounds,
                     bool& all, bool strict = false) const {
    if (opt_.gradient_check) opt_.gradient_check(kGradients[gk], idx, v, bd);
    for (GoldenBuffer* buf : {val_[gk], ref_[gk]}) {
      pend.push_back({buf, idx, round_enclosure(v.lo, v.hi, buf->dtype)});
      all = all && pend.back().r.decided;
    }
    // The bound's upper end rounded up: never below the exact magnitude. It takes no part in
    // Ziv's test (an exactly representable magnitude would never be decided).
    const double bhi = mpfr_get_d(bd.hi, MPFR_RNDU);
    bounds.emplace_back(idx, bhi == 0 ? 0.0 : bhi);  // a zero bound is +0
    if (strict) all = all && mpfr_get_d(bd.lo, MPFR_RNDU) + 0.0 == bhi + 0.0;
  }

  // A row of gradient gk (dq or dk: flat index base + cc) rounded, rotated back first where
  // rotary applies at position t (the rotated row's gradient taken through R^T).
  void round_row(std::size_t gk, std::int64_t base, std::int64_t t, std::vector<Enclosure>& v,
                 std::vector<Enclosure>& bd, mpfr_prec_t p, std::vector<Pending>& pend,
                 std::vector<std::pair<std::int64_t, double>>& bounds, bool& all, bool strict = false) const {
    if (c_.rotary && t >= 0 && t < c_.rotary->Nrot) rotate_back(*c_.rotary, t, v, bd, p);
    for (std::size_t cc = 0; cc < v.size(); ++cc)
      round_element(gk, base + static_cast<std::int64_t>(cc), v[cc], bd[cc], pend, bounds, all, strict);
  }

  void commit(std::size_t gk, mpfr_prec_t p, const std::vector<Pending>& pend,
              const std::vector<std::pair<std::int64_t, double>>& bounds) {
    std::uint64_t und = 0;
    for (const Pending& x : pend) {
      x.buf->set(x.idx, x.r.value);
      if (!x.r.decided) {
        ++und;
        std::lock_guard<std::mutex> lk(x.buf->mu);
        x.buf->undecided.emplace_back(x.idx, x.r.alt);
      }
    }
    for (const auto& [idx, bd] : bounds) bound_[gk]->set(idx, bd);
    elements_.fetch_add(pend.size());
    undecided_.fetch_add(und);
    mpfr_prec_t cur = reached_.load();
    while (p > cur && !reached_.compare_exchange_weak(cur, p)) {
    }
  }

  // A unit's elements of gradient gk decided by the fast path, from flat index `base` on.
  void commit_fast(std::size_t gk, std::int64_t base, const fast::DecidedGrad& d) {
    val_[gk]->set_all(base, d.value);
    ref_[gk]->set_all(base, d.ref);
    bound_[gk]->set_all(base, d.bound);
    elements_.fetch_add(d.value.size() + d.ref.size());
  }

  // The statistics of row u at the starting precision, computed once, by whichever unit needs
  // them first (the row pass, or a unit of the other passes after a fast row).
  const RowStat& base_stat(std::size_t u) {
    std::call_once(once_[u], [&] {
      const auto uu = static_cast<std::int64_t>(u);
      const std::int64_t b = uu / (c_.Hq * c_.Nq), h = uu / c_.Nq % c_.Hq, i = uu % c_.Nq;
      RowStat st;
      std::optional<RowEnclosures> r = stat_at(b, h, i, p0_, st);
      if (st.valid && fast_.applies() && fast_.dp_differ(b, h, i)) {
        st.zero_ds = false;  // proven without MPFR's dot products
      } else {
        std::vector<Pending> pend;
        std::vector<std::pair<std::int64_t, double>> bounds;
        dq_row(b, h, i, p0_, st, r ? &*r : nullptr, pend, bounds, false);
      }
      stats_[u] = std::move(st);
    });
    return stats_[u];
  }

  // The row pass: the fast path, else the row's statistics at the starting precision and dq_i
  // by Ziv's loop.
  void row_unit(std::size_t u) {
    const auto uu = static_cast<std::int64_t>(u);
    const std::int64_t b = uu / (c_.Hq * c_.Nq), h = uu / c_.Nq % c_.Hq, i = uu % c_.Nq;
    if (fast_.applies() && c_.query_valid(b, i) && c_.row_has_key(b, h, i)) {
      fast::DecidedGrad dq;
      const bool done = fast_.row(b, h, i, dq);
      if (!fast_.has_row_stat(b, h, i)) {  // the balls did not hold the forward row: MPFR's
        const RowStat& st = base_stat(u);
        if (st.valid) fast_.set_row_stat(b, h, i, st.lse, st.d, st.dabs);
      }
      if (!c_.want_dq) return;  // the statistics are all the row pass was for
      if (done && !c_.rotary) {  // the balls hold the rotated row's dq only
        commit_fast(0, static_cast<std::int64_t>(u) * c_.Dk, dq);
        fast_units_.fetch_add(1);
        return;
      }
      fallback_units_.fetch_add(1);
    }
    std::vector<Pending> pend;
    std::vector<std::pair<std::int64_t, double>> bounds;
    for (mpfr_prec_t p = p0_;; p = std::min(2 * p, cap_)) {
      RowStat st;
      std::optional<RowEnclosures> r = stat_at(b, h, i, p, st);
      const bool done = dq_row(b, h, i, p, st, r ? &*r : nullptr, pend, bounds, c_.want_dq);
      if (p == p0_) std::call_once(once_[u], [&] { stats_[u] = std::move(st); });
      if (!c_.want_dq) return;
      if (!done && p < cap_) continue;
      commit(0, p, pend, bounds);
      return;
    }
  }

  // dq_ic = scale sum_j dT_ij K_jc. Without softcap, dS_i sums to 0 over j, so K_jc may be
  // replaced by K_jc - K_j0c exactly; that is done for the columns where every difference is
  // exact in F64, and makes dq exactly 0 where the column is constant. Also sets st.zero_ds.
  // Without `values`, only st.zero_ds is set.
  bool dq_row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p, RowStat& st,
              const RowEnclosures* r, std::vector<Pending>& pend,
              std::vector<std::pair<std::int64_t, double>>& bounds, bool values) const {
    pend.clear();
    bounds.clear();
    const std::int64_t Dk = c_.Dk, g = c_.kv_head(h);
    const std::int64_t base = static_cast<std::int64_t>(row_id(b, h, i)) * Dk;
    Enclosure zero(p);
    set_zero(zero);
    bool all = true;
    std::vector<std::int64_t> keys;
    if (st.valid)
      for (std::int64_t j = 0; j < c_.Nk; ++j)
        if (r->heads[0].allowed[static_cast<std::size_t>(j)]) keys.push_back(j);
    const std::size_t n = keys.size();
    // dP for every allowed key, and whether all are the same exact number.
    std::vector<Enclosure> dP, dPabs;
    MpfrVec prods;
    bool all_exact = true, all_kept = true;
    const double* dout = n ? dout_row(b, h, i) : nullptr;
    const Consts k(c_, p);
    Enclosure scaled(p);
    for (std::size_t a = 0; a < n; ++a) {
      dP.emplace_back(p);
      all_exact = dot(dP.back(), dout, v_row(b, g, keys[a]), c_.Dv, prods) && all_exact;
      const bool kept = c_.kept(b, h, i, keys[a]);
      all_kept = all_kept && kept;
      if (values) {
        dPabs.emplace_back(p);
        dot_abs(dPabs.back(), dout, v_row(b, g, keys[a]), c_.Dv, prods);
        keep_scaled(dP.back(), kept, k, scaled);
        keep_scaled(dPabs.back(), kept, k, scaled);
      }
    }
    // With a sink, D_i = (1 - P_sink) dP and dS_ij = P_ij P_sink dP: 0 only when dP is 0. Under
    // dropout every key kept: dP and D both times 1 / (1 - p).
    st.zero_ds = n > 0 && all_exact && all_kept &&
                 std::all_of(dP.begin(), dP.end(), [&](const Enclosure& e) { return mpfr_equal_p(e.lo, dP[0].lo); }) &&
                 (!c_.sinks || mpfr_zero_p(dP[0].lo));
    if (!values) return true;
    if (n == 0) {  // padding or fully masked: dq = 0, bound 0
      for (std::int64_t cc = 0; cc < Dk; ++cc) round_element(0, base + cc, zero, zero, pend, bounds, all);
      return all;
    }
    MpfrVec dTlo, dThi, Alo, Ahi;
    dTlo.resize(n, p), dThi.resize(n, p), Alo.resize(n, p), Ahi.resize(n, p);
    Entry e(p);
    Enclosure T(p);
    for (std::size_t a = 0; a < n; ++a) {
      const auto j = static_cast<std::size_t>(keys[a]);
      copy_to(e.P, r->weights[0][j]);
      copy_to(e.dP, dP[a]);
      copy_to(e.dPabs, dPabs[a]);
      const Enclosure& dots = r->heads[0].dots[j];
      detail::mul_interval(T.lo, T.hi, dots.lo, dots.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
      backward_entry(e, st, &T, k);
      mpfr_set(dTlo[a], e.dT.lo, MPFR_RNDD);
      mpfr_set(dThi[a], e.dT.hi, MPFR_RNDU);
      mpfr_set(Alo[a], e.At.lo, MPFR_RNDD);
      mpfr_set(Ahi[a], e.At.hi, MPFR_RNDU);
    }
    Terms t, tb;
    std::vector<Enclosure> vs, bds;
    vs.reserve(static_cast<std::size_t>(Dk)), bds.reserve(static_cast<std::size_t>(Dk));
    std::vector<double> kc(n);
    for (std::int64_t cc = 0; cc < Dk; ++cc) {
      Enclosure& v = vs.emplace_back(p);
      Enclosure& bd = bds.emplace_back(p);
      // With a sink, sum_j dS_ij = D_i - D_i (1 - P_sink_i) = P_sink_i D_i: no centring.
      bool centred = !k.softcap && !c_.sinks;
      const double k0 = k_row(b, g, keys[0])[cc];
      for (std::size_t a = 0; a < n; ++a) {
        const double kj = k_row(b, g, keys[a])[cc];
        kc[a] = kj;
        if (centred) {
          const double d = kj - k0;
          centred = std::isfinite(d) && d + k0 == kj && kj - d == k0;  // exact difference
          kc[a] = d;
        }
      }
      if (!centred)
        for (std::size_t a = 0; a < n; ++a) kc[a] = k_row(b, g, keys[a])[cc];
      t.reset(n, p);
      tb.reset(n, p);
      for (std::size_t a = 0; a < n; ++a, ++t.n, ++tb.n) {
        mul_d(t.lo[t.n], t.hi[t.n], dTlo[a], dThi[a], kc[a]);
        const double ak = std::fabs(k_row(b, g, keys[a])[cc]);
        mpfr_mul_d(tb.lo[tb.n], Alo[a], ak, MPFR_RNDD);
        mpfr_mul_d(tb.hi[tb.n], Ahi[a], ak, MPFR_RNDU);
      }
      t.sum(v);
      tb.sum(bd);
      detail::mul_interval(v.lo, v.hi, v.lo, v.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
      mpfr_mul(bd.lo, bd.lo, k.abs_scale.lo, MPFR_RNDD);
      mpfr_mul(bd.hi, bd.hi, k.abs_scale.hi, MPFR_RNDU);
    }
    round_row(0, base, c_.rotary ? rotary_query_position(c_, b, i) : -1, vs, bds, p, pend, bounds, all);
    return all;
  }

  // The statistics of row (b, h, i) at precision p: the stored ones at the starting precision,
  // else recomputed into `fresh`.
  const RowStat& stat(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p,
                      std::vector<std::unique_ptr<RowStat>>& fresh, std::size_t slot) {
    const RowStat& st = base_stat(row_id(b, h, i));
    if (p == p0_ || !st.valid) return st;
    if (!fresh[slot]) {
      fresh[slot] = std::make_unique<RowStat>();
      stat_at(b, h, i, p, *fresh[slot]);
      fresh[slot]->zero_ds = st.zero_ds;  // a property of the exact values
    }
    return *fresh[slot];
  }

  // Row u's statistics at the starting precision for the key pass, computed once per row from
  // exact dots instead of a forward pass: with E_j = exp(S_j - m), lse = m + log sum_j E_j and
  // D = sum_j E_j dP_j / sum_j E_j, which is sum_j P_j dP_j = dout . O; dabs, which only enters
  // the bounds, from the balls. zero_ds false, as on the balls' statistics. Null where the row
  // takes no part or has no ball statistics (fast path only: no softcap, no sinks).
  const RowStat* lean_stat(std::size_t u) {
    std::call_once(lean_once_[u], [&] {
      const auto uu = static_cast<std::int64_t>(u);
      const std::int64_t b = uu / (c_.Hq * c_.Nq), h = uu / c_.Nq % c_.Hq, i = uu % c_.Nq;
      if (!c_.query_valid(b, i) || !c_.row_has_key(b, h, i)) return;
      const mpfr_prec_t p = p0_;
      auto st = std::make_unique<RowStat>();
      st->lse = Enclosure(p), st->d = Enclosure(p), st->dabs = Enclosure(p);
      Enclosure x(p), y(p);
      if (!fast_.row_stat(b, h, i, x, y, st->dabs)) return;
      const Consts k(c_, p);
      const bool exact_scale = mpfr_equal_p(k.scale.lo, k.scale.hi);
      const std::int64_t g = c_.kv_head(h);
      std::vector<std::int64_t> keys;
      for (std::int64_t j = 0; j < c_.Nk; ++j)
        if (c_.allowed(b, h, i, j)) keys.push_back(j);
      const std::size_t n = keys.size();
      MpfrVec Slo, Shi, Elo, Ehi, Nlo, Nhi, parts;
      Slo.resize(n, p), Shi.resize(n, p), Elo.resize(n, p), Ehi.resize(n, p), Nlo.resize(n, p), Nhi.resize(n, p);
      std::vector<double> e;
      double m = -INFINITY;
      for (std::size_t a = 0; a < n; ++a) {  // S_j = scale q . k_j + bias_j
        expansion_dot(q_row(b, h, i), k_row(b, g, keys[a]), c_.Dk, e);
        if (!enclose_sum(x, e, parts)) return;
        if (exact_scale) {
          mpfr_mul(x.lo, x.lo, k.scale.lo, MPFR_RNDD);
          mpfr_mul(x.hi, x.hi, k.scale.hi, MPFR_RNDU);
        } else {
          detail::mul_interval(x.lo, x.hi, x.lo, x.hi, k.scale.lo, k.scale.hi, y.lo);
        }
        const double bias = c_.bias_at(b, h, i, keys[a]);
        mpfr_add_d(Slo[a], x.lo, bias, MPFR_RNDD);
        mpfr_add_d(Shi[a], x.hi, bias, MPFR_RNDU);
        m = std::max(m, mpfr_get_d(Shi[a], MPFR_RNDN));
      }
      if (!std::isfinite(m)) return;
      for (std::size_t a = 0; a < n; ++a) {
        mpfr_sub_d(x.lo, Slo[a], m, MPFR_RNDD);
        mpfr_sub_d(x.hi, Shi[a], m, MPFR_RNDU);
        if (mpfr_equal_p(x.lo, x.hi)) {  // one exp: the exact value lies in [RD, next above RD]
          const int t = mpfr_exp(Elo[a], x.lo, MPFR_RNDD);
          mpfr_set(Ehi[a], Elo[a], MPFR_RNDU);
          if (t != 0) mpfr_nextabove(Ehi[a]);
        } else {
          mpfr_exp(Elo[a], x.lo, MPFR_RNDD);
          mpfr_exp(Ehi[a], x.hi, MPFR_RNDU);
        }
        expansion_dot(dout_row(b, h, i), v_row(b, g, keys[a]), c_.Dv, e);
        if (!enclose_sum(x, e, parts)) return;
        // E_j dP_j with E_j >= 0: the sign of dP's ends picks E's ends.
        mpfr_mul(Nlo[a], mpfr_sgn(x.lo) >= 0 ? Elo[a] : Ehi[a], x.lo, MPFR_RNDD);
        mpfr_mul(Nhi[a], mpfr_sgn(x.hi) >= 0 ? Ehi[a] : Elo[a], x.hi, MPFR_RNDU);
      }
      // Z = sum_j E_j in x, N = sum_j E_j dP_j in y.
      mpfr_sum(x.lo, Elo.ptrs(), n, MPFR_RNDD);
      mpfr_sum(x.hi, Ehi.ptrs(), n, MPFR_RNDU);
      mpfr_sum(y.lo, Nlo.ptrs(), n, MPFR_RNDD);
      mpfr_sum(y.hi, Nhi.ptrs(), n, MPFR_RNDU);
      if (!(mpfr_sgn(x.lo) > 0) || !mpfr_number_p(x.hi) || !mpfr_number_p(y.lo) || !mpfr_number_p(y.hi)) return;
      mpfr_log(st->lse.lo, x.lo, MPFR_RNDD);
      mpfr_add_d(st->lse.lo, st->lse.lo, m, MPFR_RNDD);
      mpfr_log(st->lse.hi, x.hi, MPFR_RNDU);
      mpfr_add_d(st->lse.hi, st->lse.hi, m, MPFR_RNDU);
      // D = N / Z with Z > 0: the sign of N's ends picks Z's ends.
      mpfr_div(st->d.lo, y.lo, mpfr_sgn(y.lo) >= 0 ? x.hi : x.lo, MPFR_RNDD);
      mpfr_div(st->d.hi, y.hi, mpfr_sgn(y.hi) >= 0 ? x.lo : x.hi, MPFR_RNDU);
      st->valid = true;
      lean_[u] = std::move(st);
    });
    return lean_[u].get();
  }

  // Entry (b, h, i, j) from the key's side: S_ij recomputed, P_ij = exp(S_ij - lse_i).
  void key_entry(Entry& e, Enclosure& T, std::int64_t b, std::int64_t h, std::int64_t i,
                 std::int64_t j, const RowStat& st, const Consts& k, MpfrVec& prods) const {
    const std::int64_t g = c_.kv_head(h);
    dot(T, q_row(b, h, i), k_row(b, g, j), c_.Dk, prods);
    weight_from_dot(e, T, st, k, c_.bias_at(b, h, i, j));
    dot(e.dP, dout_row(b, h, i), v_row(b, g, j), c_.Dv, prods);
    dot_abs(e.dPabs, dout_row(b, h, i), v_row(b, g, j), c_.Dv, prods);
    const bool kept = c_.kept(b, h, i, j);
    keep_scaled(e.dP, kept, k, e.tmp);
    keep_scaled(e.dPabs, kept, k, e.tmp);
    backward_entry(e, st, &T, k);
  }

  // The key pass: dk_j and dv_j over the query heads of kv head g, by Ziv's loop.
  void key_unit(std::size_t u) {
    const auto uu = static_cast<std::int64_t>(u);
    const std::int64_t b = uu / (c_.Hkv * c_.Nk), g = uu / c_.Nk % c_.Hkv, j = uu % c_.Nk;
    std::vector<std::unique_ptr<RowStat>> fresh(static_cast<std::size_t>(G_ * c_.Nq));
    if (fast_.applies()) {
      fast::DecidedGrad dk, dv;
      if (!(c_.rotary && c_.want_dk) && fast_.key(b, g, j, dk, dv)) {  // the balls hold the rotated key's dk
        const auto key = static_cast<std::int64_t>(key_id(b, g, j));
        if (c_.want_dk) commit_fast(1, key * c_.Dk, dk);
        if (c_.want_dv) commit_fast(2, key * c_.Dv, dv);
        fast_units_.fetch_add(1);
        return;
      }
      fallback_units_.fetch_add(1);
      // First at the starting precision on the rows' statistics from the balls, where every row
      // that sees key j has them: no MPFR forward pass over those rows. Committed only if every
      // value and every bound is decided (the bounds as on the fast path), so the bytes are
      // those of the MPFR statistics; else those are computed, once for all units, in parallel.
      std::vector<std::size_t> need;
      for (std::int64_t h = g * G_; h < (g + 1) * G_; ++h)
        for (std::int64_t i = 0; i < c_.Nq; ++i)
          if (c_.allowed(b, h, i, j)) need.push_back(row_id(b, h, i));
      bool balls = true;
      for (std::int64_t h = g * G_; h < (g + 1) * G_ && balls; ++h)
        for (std::int64_t i = 0; i < c_.Nq && balls; ++i) {
          if (!c_.query_valid(b, i) || !c_.allowed(b, h, i, j)) continue;
          auto st = std::make_unique<RowStat>();
          st->lse = Enclosure(p0_), st->d = Enclosure(p0_), st->dabs = Enclosure(p0_);
          // zero_ds false: an exact 0 of dS is then not decided, and the MPFR statistics take over
          balls = fast_.row_stat(b, h, i, st->lse, st->d, st->dabs);
          st->valid = true;
          fresh[static_cast<std::size_t>((h - g * G_) * c_.Nq + i)] = std::move(st);
        }
      if (balls && key_attempt(b, g, j, p0_, [&](std::int64_t h, std::int64_t i) -> const RowStat* {
            return fresh[static_cast<std::size_t>((h - g * G_) * c_.Nq + i)].get();
          }, true))
        return;
      // Then, under the same rule, on the rows' statistics from exact dots (each row's computed
      // once for all units, in parallel): far narrower than the balls' at a fraction of the
      // cost of the MPFR forward pass.
      parallel_for(need.size(), opt_.threads, [&](std::size_t k) { lean_stat(need[k]); });
      bool lean = true;
      for (std::size_t r : need) lean = lean && (lean_[r] || !c_.query_valid(b, static_cast<std::int64_t>(r) % c_.Nq));
      if (lean && key_attempt(b, g, j, p0_, [&](std::int64_t h, std::int64_t i) -> const RowStat* {
            return lean_[row_id(b, h, i)].get();
          }, true))
        return;
      parallel_for(need.size(), opt_.threads, [&](std::size_t k) { base_stat(need[k]); });
    }
    for (mpfr_prec_t p = p0_;; p = std::min(2 * p, cap_)) {
      for (auto& f : fresh) f.reset();
      const auto stat_of = [&](std::int64_t h, std::int64_t i) -> const RowStat* {
        if (!base_stat(row_id(b, h, i)).valid) return nullptr;
        return &stat(b, h, i, p, fresh, static_cast<std::size_t>((h - g * G_) * c_.Nq + i));
      };
      if (key_attempt(b, g, j, p, stat_of, false) || p >= cap_) return;
    }
  }

  // One precision of the key pass with the rows' statistics stat_of(h, i) (null: the row takes
  // no part). Commits and returns true when every element is decided (or at the cap, with
  // `strict` false: the undecided ones recorded).
  template <class StatOf>
  bool key_attempt(std::int64_t b, std::int64_t g, std::int64_t j, mpfr_prec_t p, const StatOf& stat_of, bool strict) {
    std::vector<Pending> pk, pv;
    std::vector<std::pair<std::int64_t, double>> bk, bv;
    const Consts k(c_, p);
    // The entries of every row that sees key j.
    std::vector<std::pair<std::int64_t, std::int64_t>> rows;  // (h, i)
    MpfrVec Plo, Phi, dTlo, dThi, Alo, Ahi, prods;
    const std::size_t most = static_cast<std::size_t>(G_ * c_.Nq);
    Plo.resize(most, p), Phi.resize(most, p), dTlo.resize(most, p), dThi.resize(most, p);
    Alo.resize(most, p), Ahi.resize(most, p);
    Entry e(p);
    Enclosure T(p);
    for (std::int64_t h = g * G_; h < (g + 1) * G_; ++h)
      for (std::int64_t i = 0; i < c_.Nq; ++i) {
        if (!c_.allowed(b, h, i, j)) continue;
        const RowStat* st = stat_of(h, i);
        if (!st) continue;
        key_entry(e, T, b, h, i, j, *st, k, prods);
        const std::size_t a = rows.size();
        rows.emplace_back(h, i);
        keep_scaled(e.P, c_.kept(b, h, i, j), k, e.tmp);  // dv reads Z = P keep / (1 - p); dT is done
        mpfr_set(Plo[a], e.P.lo, MPFR_RNDD), mpfr_set(Phi[a], e.P.hi, MPFR_RNDU);
        mpfr_set(dTlo[a], e.dT.lo, MPFR_RNDD), mpfr_set(dThi[a], e.dT.hi, MPFR_RNDU);
        mpfr_set(Alo[a], e.At.lo, MPFR_RNDD), mpfr_set(Ahi[a], e.At.hi, MPFR_RNDU);
      }
    const std::size_t n = rows.size();
    bool all = true;
    Terms t, tb;
    if (c_.want_dk) {
      std::vector<Enclosure> vs, bds;
      vs.reserve(static_cast<std::size_t>(c_.Dk)), bds.reserve(static_cast<std::size_t>(c_.Dk));
      for (std::int64_t cc = 0; cc < c_.Dk; ++cc) {
        Enclosure& v = vs.emplace_back(p);
        Enclosure& bd = bds.emplace_back(p);
        t.reset(n, p), tb.reset(n, p);
        for (std::size_t a = 0; a < n; ++a, ++t.n, ++tb.n) {
          const double x = q_row(b, rows[a].first, rows[a].second)[cc];
          mul_d(t.lo[a], t.hi[a], dTlo[a], dThi[a], x);
          mpfr_mul_d(tb.lo[a], Alo[a], std::fabs(x), MPFR_RNDD);
          mpfr_mul_d(tb.hi[a], Ahi[a], std::fabs(x), MPFR_RNDU);
        }
        t.sum(v), tb.sum(bd);
        detail::mul_interval(v.lo, v.hi, v.lo, v.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
        mpfr_mul(bd.lo, bd.lo, k.abs_scale.lo, MPFR_RNDD);
        mpfr_mul(bd.hi, bd.hi, k.abs_scale.hi, MPFR_RNDU);
      }
      round_row(1, static_cast<std::int64_t>(key_id(b, g, j)) * c_.Dk, j, vs, bds, p, pk, bk, all, strict);
      if (strict && !all) return false;
    }
    Enclosure v(p), bd(p);
    if (c_.want_dv)
      for (std::int64_t cc = 0; cc < c_.Dv; ++cc) {
        t.reset(n, p), tb.reset(n, p);
        for (std::size_t a = 0; a < n; ++a, ++t.n, ++tb.n) {
          const double x = dout_row(b, rows[a].first, rows[a].second)[cc];
          mul_d(t.lo[a], t.hi[a], Plo[a], Phi[a], x);
          mpfr_mul_d(tb.lo[a], Plo[a], std::fabs(x), MPFR_RNDD);
          mpfr_mul_d(tb.hi[a], Phi[a], std::fabs(x), MPFR_RNDU);
        }
        t.sum(v), tb.sum(bd);
        round_element(2, static_cast<std::int64_t>(key_id(b, g, j)) * c_.Dv + cc, v, bd, pv, bv, all, strict);
        if (strict && !all) return false;
      }
    if (!all && (strict || p < cap_)) return false;
    if (c_.want_dk) commit(1, p, pk, bk);
    if (c_.want_dv) commit(2, p, pv, bv);
    return true;
  }

  // The bias pass: unit (b', h', j') of the bias's own extents [Eb, Eh, Ei, Ej], Ei elements.
  // Each sums dS over the (b, h, i, j) that read it, row by row; with Ej = 1 every row's dS is
  // summed whole, and that sum is exactly 0 (sum_j P_ij dP_ij - D_i sum_j P_ij = D_i - D_i).
  void bias_unit(std::size_t u) {
    const auto uu = static_cast<std::int64_t>(u);
    const std::int64_t Eh = ext_[1], Ei = ext_[2], Ej = ext_[3];
    const std::int64_t bb = uu / (Eh * Ej), hb = uu / Ej % Eh, jb = uu % Ej;
    auto span = [](std::int64_t e, std::int64_t x, std::int64_t full) {
      return e == 1 ? std::pair<std::int64_t, std::int64_t>{0, full - 1} : std::pair{x, x};
    };
    const auto [b0, b1] = span(ext_[0], bb, c_.B);
    const auto [h0, h1] = span(Eh, hb, c_.Hq);
    const auto [j0, j1] = span(Ej, jb, c_.Nk);
    if (fast_.applies()) {
      fast::DecidedGrad db;
      if (fast_.bias(bb, hb, jb, db)) {
        for (std::int64_t ib = 0; ib < Ei; ++ib) {
          const auto k = static_cast<std::size_t>(ib);
          const std::int64_t idx = ((bb * Eh + hb) * Ei + ib) * Ej + jb;
          val_[3]->set(idx, db.value[k]);
          ref_[3]->set(idx, db.ref[k]);
          bound_[3]->set(idx, db.bound[k]);
        }
        elements_.fetch_add(db.value.size() + db.ref.size());
        fast_units_.fetch_add(1);
        return;
      }
      fallback_units_.fetch_add(1);
    }
    std::vector<Pending> pend;
    std::vector<std::pair<std::int64_t, double>> bounds;
    std::vector<std::unique_ptr<RowStat>> fresh(static_cast<std::size_t>(c_.B * c_.Hq * c_.Nq));
    for (mpfr_prec_t p = p0_;; p = std::min(2 * p, cap_)) {
      pend.clear(), bounds.clear();
      for (auto& f : fresh) f.reset();
      const Consts k(c_, p);
      std::vector<Terms> parts(static_cast<std::size_t>(Ei)), bparts(static_cast<std::size_t>(Ei));
      const auto per = static_cast<std::size_t>((b1 - b0 + 1) * (h1 - h0 + 1) * (Ei == 1 ? c_.Nq : 1));
      for (auto& t : parts) t.reset(per, p);
      for (auto& t : bparts) t.reset(per, p);
      Entry e(p);
      Enclosure T(p), rs(p), rb(p);
      Terms row, brow;
      MpfrVec prods;
      for (std::int64_t b = b0; b <= b1; ++b)
        for (std::int64_t h = h0; h <= h1; ++h)
          for (std::int64_t i = 0; i < c_.Nq; ++i) {
            if (!base_stat(row_id(b, h, i)).valid) continue;
            const RowStat& st = stat(b, h, i, p, fresh, row_id(b, h, i));
            row.reset(static_cast<std::size_t>(j1 - j0 + 1), p);
            brow.reset(static_cast<std::size_t>(j1 - j0 + 1), p);
            for (std::int64_t j = j0; j <= j1; ++j) {
              if (!c_.allowed(b, h, i, j)) continue;
              key_entry(e, T, b, h, i, j, st, k, prods);
              mpfr_set(row.lo[row.n], e.dS.lo, MPFR_RNDD), mpfr_set(row.hi[row.n++], e.dS.hi, MPFR_RNDU);
              mpfr_set(brow.lo[brow.n], e.A.lo, MPFR_RNDD), mpfr_set(brow.hi[brow.n++], e.A.hi, MPFR_RNDU);
            }
            row.sum(rs), brow.sum(rb);
            Terms& t = parts[static_cast<std::size_t>(Ei == 1 ? 0 : i)];
            Terms& tb = bparts[static_cast<std::size_t>(Ei == 1 ? 0 : i)];
            mpfr_set(t.lo[t.n], rs.lo, MPFR_RNDD), mpfr_set(t.hi[t.n++], rs.hi, MPFR_RNDU);
            mpfr_set(tb.lo[tb.n], rb.lo, MPFR_RNDD), mpfr_set(tb.hi[tb.n++], rb.hi, MPFR_RNDU);
          }
      bool all = true;
      Enclosure v(p), bd(p);
      for (std::int64_t ib = 0; ib < Ei; ++ib) {
        parts[static_cast<std::size_t>(ib)].sum(v);
        if (Ej == 1 && !c_.sinks) set_zero(v);  // with a sink a row sums to P_sink_i D_i
        bparts[static_cast<std::size_t>(ib)].sum(bd);
        const std::int64_t idx = ((bb * Eh + hb) * Ei + ib) * Ej + jb;
        round_element(3, idx, v, bd, pend, bounds, all);
      }
      if (!all && p < cap_) continue;
      commit(3, p, pend, bounds);
      return;
    }
  }

  const Case& c_;
  const EvalOptions& opt_;
  RowEvaluator ev_;
  fast::FastBackward fast_;
  const std::int64_t G_;  // query heads per kv head
  mpfr_prec_t p0_ = 0, cap_ = 0;
  std::vector<std::unique_ptr<GoldenBuffer>> bufs_;
  std::array<GoldenBuffer*, 4> val_{}, ref_{}, bound_{};
  std::array<std::int64_t, 4> ext_{1, 1, 1, 1};  // the bias's extents over [B, Hq, Nq, Nk]
  std::vector<RowStat> stats_;                   // per row, at the starting precision (base_stat)
  std::unique_ptr<std::once_flag[]> once_;       // per row: stats_ computed
  std::vector<std::unique_ptr<RowStat>> lean_;   // per row, from exact dots (lean_stat)
  std::unique_ptr<std::once_flag[]> lean_once_;  // per row: lean_ computed
  std::atomic<std::uint64_t> elements_{0}, undecided_{0}, fast_units_{0}, fallback_units_{0};
  std::atomic<mpfr_prec_t> reached_{0};
};

}  // namespace

bool is_gradient_golden(const std::string& name) {
  for (const char* g : {"dq", "dk", "dv", "dbias", "dsinks", "dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o"}) {
    const std::string s(g);
    if (name == s || name == s + ".ref" || name == s + ".bound") return true;
  }
  return false;
}

void evaluate_gradients(const Case& c, const EvalOptions& opt, EvalResult& res) {
  if (c.kind == Kind::Mha) return evaluate_mha_gradients(c, opt, res);
  Backward bw(c, opt);
  bw.run();
  bw.finish(res);
}

}  // namespace attnoracle
