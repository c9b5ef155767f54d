// Certified gradients of kind mha (CONTRACT section 7), in interval arithmetic over MPFR. With
// the exact projections Q_h = x_q W_q[h], K_h = x_kv W_k[h], V_h = x_kv W_v[h] and
// dO_h = dout W_o[h]^T (W_o[h] the rows h Dv .. h Dv + Dv - 1), head h's backward is that of kind
// sdpa (backward.cpp) on Q_h, K_h, V_h and dO_h, and the chain rule carries it on:
//   dx_q = sum_h dq_h W_q[h]^T,  dw_q[h] = x_q^T dq_h (over b and i),
//   dx_kv = sum_h dk_h W_k[h]^T + dv_h W_v[h]^T,  dw_k[h] = x_kv^T dk_h,  dw_v[h] = x_kv^T dv_h,
//   dw_o[h Dv + c, e] = sum over b and the rows i of O_h[b,i,c] dout[b,i,e],
// and, in self-attention, dx_q is the sum of both gradients of x. The heads' gradients are kept
// as enclosures, in the size of the inputs (no Nq x Nk matrix). Passes: rows (lse, D and dq_h
// from the forward's row), keys (dk_h and dv_h, P recomputed from lse), bias elements (dbias),
// then the chained gradients; the whole case is one Ziv loop, redone at twice the precision
// while an element is undecided.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>

#include "attnoracle/reference/detail/progress.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/round.hpp"
#include "backward.hpp"
#include "backward_parts.hpp"
#include "golden_buffer.hpp"
#include "interval.hpp"

namespace attnoracle {
namespace {

using detail::GoldenBuffer;
using detail::MpfrVec;
using detail::Pending;
using namespace detail::backward;

// Exact real numbers, each at its own precision; `prec` bounds them all.
class ExactArray {
 public:
  explicit ExactArray(std::size_t n) : v_(n) {
    for (auto& x : v_) mpfr_init2(x.x, MPFR_PREC_MIN);
  }
  ExactArray(const ExactArray&) = delete;
  ExactArray& operator=(const ExactArray&) = delete;
  ~ExactArray() {
    for (auto& x : v_) mpfr_clear(x.x);
  }
  mpfr_ptr operator[](std::size_t i) { return v_[i].x; }
  mpfr_srcptr operator[](std::size_t i) const { return v_[i].x; }
  mpfr_prec_t prec = MPFR_PREC_MIN;

 private:
  struct Elem {
    mpfr_t x;
  };
  std::vector<Elem> v_;
};

// [lo, hi] = [xlo, xhi] * y for an exact y: the sign of y picks the ends.
void mul_exact(mpfr_ptr lo, mpfr_ptr hi, mpfr_srcptr xlo, mpfr_srcptr xhi, mpfr_srcptr y) {
  const bool pos = mpfr_sgn(y) >= 0;
  mpfr_mul(lo, pos ? xlo : xhi, y, MPFR_RNDD);
  mpfr_mul(hi, pos ? xhi : xlo, y, MPFR_RNDU);
}

// [lo, hi] = [xlo, xhi] |y| for x >= 0 and an exact y: for y < 0 the products x y are rounded
// the other way, so that their negations bound x |y|.
void mul_abs_exact(mpfr_ptr lo, mpfr_ptr hi, mpfr_srcptr xlo, mpfr_srcptr xhi, mpfr_srcptr y) {
  const bool neg = mpfr_sgn(y) < 0;
  mpfr_mul(lo, xlo, y, neg ? MPFR_RNDU : MPFR_RNDD);
  mpfr_mul(hi, xhi, y, neg ? MPFR_RNDD : MPFR_RNDU);
  if (neg) mpfr_neg(lo, lo, MPFR_RNDN), mpfr_neg(hi, hi, MPFR_RNDN);  // exact
}

// e encloses sum_c a[ia + c] b[ib + c] (|a b| with `abs`) over n terms: each product is exact at
// the sum of the precisions, and mpfr_sum rounds down, reporting exactness. Returns whether
// the enclosure is the exact value.
bool exact_sum(Enclosure& e, const ExactArray& a, std::size_t ia, const ExactArray& b, std::size_t ib,
               std::int64_t n, MpfrVec& prods, bool abs = false) {
  prods.resize(static_cast<std::size_t>(n), a.prec + b.prec);
  for (std::size_t c = 0; c < static_cast<std::size_t>(n); ++c) {
    mpfr_mul(prods[c], a[ia + c], b[ib + c], MPFR_RNDN);  // exact
    if (abs) mpfr_abs(prods[c], prods[c], MPFR_RNDN);
  }
  const int t = mpfr_sum(e.lo, prods.ptrs(), static_cast<unsigned long>(n), MPFR_RNDD);
  mpfr_set(e.hi, e.lo, MPFR_RNDU);
  if (t != 0) mpfr_nextabove(e.hi);  // the exact value lies in (lo, next above lo)
  return t == 0;
}

// Enclosures of a gradient's value and bound, element by element.
struct Grad {
  std::vector<Enclosure> v, bd;
  void reset(std::size_t n, mpfr_prec_t p) {
    v.clear(), bd.clear();
    v.reserve(n), bd.reserve(n);
    for (std::size_t k = 0; k < n; ++k) {
      v.emplace_back(p), bd.emplace_back(p);
      set_zero(v.back()), set_zero(bd.back());  // rows and keys that take no part stay 0
    }
  }
};

// The sum of the terms of one chained element: value and bound.
struct Chain {
  Terms t, tb;
  void reset(std::size_t n, mpfr_prec_t p) { t.reset(n, p), tb.reset(n, p); }
  // + x * w for an enclosed x with bound xb, and a double w.
  void add(const Enclosure& x, const Enclosure& xb, double w) {
    mul_d(t.lo[t.n], t.hi[t.n], x.lo, x.hi, w);
    mpfr_mul_d(tb.lo[tb.n], xb.lo, std::fabs(w), MPFR_RNDD);
    mpfr_mul_d(tb.hi[tb.n], xb.hi, std::fabs(w), MPFR_RNDU);
    ++t.n, ++tb.n;
  }
};

class MhaBackward {
 public:
  MhaBackward(const Case& c, const EvalOptions& opt)
      : c_(c),
        opt_(opt),
        ev_(c),
        H_(c.Hq),
        q_(n_rows() * static_cast<std::size_t>(c.Dk)),
        k_(n_keys() * static_cast<std::size_t>(c.Dk)),
        v_(n_keys() * static_cast<std::size_t>(c.Dv)),
        dO_(n_rows() * static_cast<std::size_t>(c.Dv)) {
    auto lg = [](std::int64_t n) {
      return static_cast<mpfr_prec_t>(std::ceil(std::log2(static_cast<double>(n) + 1.0)));
    };
    // Room for dP - D's cancellation, the sums over the rows and keys, and the chain's sums.
    p0_ = opt.start_precision > 0
              ? opt.start_precision
              : 128 + 2 * lg(c.Nk) + lg(c.B * c.Nq) + lg(c.Dk) + lg(c.Dv) + lg(c.Hq * c.D) + lg(c.Dout);
    bool f64 = false;  // an F64 gradient: its rounding needs ~53 more bits decided
    for (const GoldenSpec& g : c.golden_tensors())
      if (is_gradient_golden(g.name)) {
        bufs_.push_back(std::make_unique<GoldenBuffer>(g));
        if (g.dtype == DType::F64 && g.name.find('.') == std::string::npos) f64 = true;
      }
    if (f64) p0_ += 64;
    cap_ = std::max(opt.max_precision, p0_);
    if (c.bias) {
      const auto& s = c.bias->shape;
      for (std::size_t a = 0; a < 4; ++a) ext_[a] = a + s.size() >= 4 ? s[a + s.size() - 4] : 1;
    }
    project();
  }

  void run() {
    for (mpfr_prec_t p = p0_;; p = std::min(2 * p, cap_)) {
      pend_.clear(), bounds_.clear(), all_.store(true);
      rows_pass(p);
      keys_pass(p);
      if (c_.want_dbias) bias_pass(p);
      chained(p);
      reached_ = p;
      if (all_.load() || p >= cap_) break;
    }
    std::uint64_t und = 0;
    for (const auto& per : pend_)
      for (const Pending& x : per) {
        x.buf->set(x.idx, x.r.value);
        if (!x.r.decided) {
          ++und;
          x.buf->undecided.emplace_back(x.idx, x.r.alt);
        }
        ++elements_;
      }
    for (const auto& per : bounds_)
      for (const auto& [buf, idx, bd] : per) buf->set(idx, bd);
    undecided_ = und;
    mpfr_free_cache();
  }

  void finish(EvalResult& res) {
    for (auto& g : bufs_) detail::append_golden(*g, res.golden);
    res.stats.elements += elements_;
    res.stats.undecided += undecided_;
    res.stats.max_precision_reached = std::max(res.stats.max_precision_reached, reached_);
  }

 private:
  std::size_t n_rows() const { return static_cast<std::size_t>(c_.B * c_.Hq * c_.Nq); }
  std::size_t n_keys() const { return static_cast<std::size_t>(c_.B * c_.Hq * c_.Nk); }
  std::size_t row_id(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * H_ + h) * c_.Nq + i);
  }
  std::size_t key_id(std::int64_t b, std::int64_t h, std::int64_t j) const {
    return static_cast<std::size_t>((b * H_ + h) * c_.Nk + j);
  }
  GoldenBuffer* find(const std::string& name) {
    for (auto& g : bufs_)
      if (g->name == name) return g.get();
    return nullptr;
  }

  // Q_h, K_h, V_h and dO_h exactly (dO_h is 0 on padding rows, which reach nothing).
  void project() {
    const std::int64_t D = c_.D, Dk = c_.Dk, Dv = c_.Dv, Dout = c_.Dout;
    std::array<std::atomic<mpfr_prec_t>, 4> prec{};
    for (auto& x : prec) x.store(MPFR_PREC_MIN);
    auto raise = [](std::atomic<mpfr_prec_t>& a, mpfr_prec_t p) {
      mpfr_prec_t cur = a.load();
      while (p > cur && !a.compare_exchange_weak(cur, p)) {
      }
    };
    parallel_for(static_cast<std::size_t>(c_.B * H_), opt_.threads, [&](std::size_t u) {
      const auto b = static_cast<std::int64_t>(u) / H_, h = static_cast<std::int64_t>(u) % H_;
      MpfrVec prods;
      for (std::int64_t i = 0; i < c_.Nq; ++i) {
        const double* x = c_.x_q.values.data() + (b * c_.Nq + i) * D;
        for (std::int64_t cc = 0; cc < Dk; ++cc)
          raise(prec[0], detail::exact_dot(q_[row_id(b, h, i) * Dk + cc], x, 1,
                                           c_.w_q.values.data() + h * D * Dk + cc, Dk, D, prods));
        const double* g = c_.dout->values.data() + (b * c_.Nq + i) * Dout;
        for (std::int64_t cc = 0; cc < Dv; ++cc) {
          mpfr_ptr o = dO_[row_id(b, h, i) * Dv + cc];
          if (!c_.query_valid(b, i)) {
            mpfr_set_zero(o, 1);
            continue;
          }
          raise(prec[3], detail::exact_dot(o, g, 1, c_.w_o.values.data() + (h * Dv + cc) * Dout, 1, Dout, prods));
        }
      }
      for (std::int64_t j = 0; j < c_.Nk; ++j) {
        const double* x = c_.x_kv.values.data() + (b * c_.Nk + j) * D;
        for (std::int64_t cc = 0; cc < Dk; ++cc)
          raise(prec[1], detail::exact_dot(k_[key_id(b, h, j) * Dk + cc], x, 1,
                                           c_.w_k.values.data() + h * D * Dk + cc, Dk, D, prods));
        for (std::int64_t cc = 0; cc < Dv; ++cc)
          raise(prec[2], detail::exact_dot(v_[key_id(b, h, j) * Dv + cc], x, 1,
                                           c_.w_v.values.data() + h * D * Dv + cc, Dv, D, prods));
      }
    });
    q_.prec = prec[0].load(), k_.prec = prec[1].load(), v_.prec = prec[2].load(), dO_.prec = prec[3].load();
  }

  // The rows' pass at precision p: per head, the statistics (lse, D = dO . O, sum |dO O|), O,
  // whether dS is exactly 0, and dq_h[i] = scale sum_j dT_ij K_j (K_j - K_j0 without softcap
  // and sinks, as dS_i then sums to 0: a key column constant over the allowed keys gives 0).
  void rows_pass(mpfr_prec_t p) {
    const std::int64_t Dk = c_.Dk, Dv = c_.Dv;
    stats_.clear();
    stats_.resize(n_rows());
    keys_.assign(n_rows(), 0);
    o_.reset(n_rows() * static_cast<std::size_t>(Dv), p);
    dq_.reset(n_rows() * static_cast<std::size_t>(Dk), p);
    detail::PassProgress done(opt_, "gradient rows", static_cast<std::uint64_t>(c_.B * c_.Nq));
    parallel_for(static_cast<std::size_t>(c_.B * c_.Nq), opt_.threads, [&](std::size_t u) {
      const auto b = static_cast<std::int64_t>(u) / c_.Nq, i = static_cast<std::int64_t>(u) % c_.Nq;
      if (c_.query_valid(b, i)) {
        const RowEnclosures r = ev_.row(b, 0, i, p);
        if (r.valid)
          for (std::int64_t h = 0; h < H_; ++h)
            if (r.head_valid[static_cast<std::size_t>(h)]) head_row(r, b, h, i, p);
      }
      done.unit_done();
    });
  }

  void head_row(const RowEnclosures& r, std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) {
    const std::int64_t Dk = c_.Dk, Dv = c_.Dv;
    const std::size_t row = row_id(b, h, i), hh = static_cast<std::size_t>(h);
    RowStat& st = stats_[row];
    st.valid = true;
    st.lse = Enclosure(p), st.d = Enclosure(p), st.dabs = Enclosure(p);
    copy_to(st.lse, r.lse[hh]);
    Terms t, ta;
    t.reset(static_cast<std::size_t>(Dv), p), ta.reset(static_cast<std::size_t>(Dv), p);
    Enclosure oabs(p);
    for (std::int64_t cc = 0; cc < Dv; ++cc, ++t.n, ++ta.n) {
      const Enclosure& o = r.heads[hh].out[static_cast<std::size_t>(cc)];
      copy_to(o_.v[row * Dv + cc], o);
      mpfr_srcptr g = dO_[row * Dv + cc];
      mul_exact(t.lo[t.n], t.hi[t.n], o.lo, o.hi, g);
      abs_of(oabs, o);
      mul_abs_exact(ta.lo[ta.n], ta.hi[ta.n], oabs.lo, oabs.hi, g);
    }
    t.sum(st.d), ta.sum(st.dabs);

    std::vector<std::int64_t> keys;
    for (std::int64_t j = 0; j < c_.Nk; ++j)
      if (r.heads[hh].allowed[static_cast<std::size_t>(j)]) keys.push_back(j);
    const std::size_t n = keys.size();
    keys_[row] = static_cast<std::int64_t>(n);
    std::vector<Enclosure> dP, dPabs;
    MpfrVec prods;
    bool all_exact = true;
    for (std::size_t a = 0; a < n; ++a) {
      dP.emplace_back(p), dPabs.emplace_back(p);
      all_exact = exact_sum(dP.back(), dO_, row * Dv, v_, key_id(b, h, keys[a]) * Dv, Dv, prods) && all_exact;
      exact_sum(dPabs.back(), dO_, row * Dv, v_, key_id(b, h, keys[a]) * Dv, Dv, prods, true);
    }
    // With a sink, dS_ij = P_ij P_sink dP: 0 only when dP is 0.
    st.zero_ds = n > 0 && all_exact &&
                 std::all_of(dP.begin(), dP.end(), [&](const Enclosure& e) { return mpfr_equal_p(e.lo, dP[0].lo); }) &&
                 (!c_.sinks || mpfr_zero_p(dP[0].lo));
    const Consts k(c_, p);
    Entry e(p);
    Enclosure T(p);
    std::vector<Enclosure> dT, At;
    for (std::size_t a = 0; a < n; ++a) {
      const auto j = static_cast<std::size_t>(keys[a]);
      copy_to(e.P, r.weights[hh][j]);
      copy_to(e.dP, dP[a]);
      copy_to(e.dPabs, dPabs[a]);
      const Enclosure& dots = r.heads[hh].dots[j];
      detail::mul_interval(T.lo, T.hi, dots.lo, dots.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
      backward_entry(e, st, &T, k);
      dT.emplace_back(p), At.emplace_back(p);
      copy_to(dT.back(), e.dT), copy_to(At.back(), e.At);
    }
    const bool centred = !k.softcap && !c_.sinks && n > 0;
    Terms tq, tb;
    Enclosure diff(p);
    for (std::int64_t cc = 0; cc < Dk; ++cc) {
      tq.reset(n, p), tb.reset(n, p);
      for (std::size_t a = 0; a < n; ++a, ++tq.n, ++tb.n) {
        mpfr_srcptr kj = k_[key_id(b, h, keys[a]) * Dk + cc];
        if (centred) {
          mpfr_srcptr k0 = k_[key_id(b, h, keys[0]) * Dk + cc];
          mpfr_sub(diff.lo, kj, k0, MPFR_RNDD), mpfr_sub(diff.hi, kj, k0, MPFR_RNDU);
          detail::mul_interval(tq.lo[a], tq.hi[a], dT[a].lo, dT[a].hi, diff.lo, diff.hi, e.tmp.lo);
        } else {
          mul_exact(tq.lo[a], tq.hi[a], dT[a].lo, dT[a].hi, kj);
        }
        mul_abs_exact(tb.lo[a], tb.hi[a], At[a].lo, At[a].hi, kj);
      }
      Enclosure& v = dq_.v[row * Dk + cc];
      Enclosure& bd = dq_.bd[row * Dk + cc];
      tq.sum(v), tb.sum(bd);
      detail::mul_interval(v.lo, v.hi, v.lo, v.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
      mpfr_mul(bd.lo, bd.lo, k.abs_scale.lo, MPFR_RNDD), mpfr_mul(bd.hi, bd.hi, k.abs_scale.hi, MPFR_RNDU);
    }
  }

  // Entry (b, h, i, j) from the key's side: S_ij recomputed from Q_h and K_h, P_ij = exp(S_ij - lse_i).
  void key_entry(Entry& e, Enclosure& T, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j,
                 const RowStat& st, const Consts& k, MpfrVec& prods) const {
    const std::size_t row = row_id(b, h, i), key = key_id(b, h, j);
    exact_sum(T, q_, row * c_.Dk, k_, key * c_.Dk, c_.Dk, prods);
    weight_from_dot(e, T, st, k, c_.bias_at(b, h, i, j));
    if (keys_[row] == 1 && !c_.sinks) mpfr_set_ui(e.P.lo, 1, MPFR_RNDN);  // a row's only key: exactly 1
    exact_sum(e.dP, dO_, row * c_.Dv, v_, key * c_.Dv, c_.Dv, prods);
    exact_sum(e.dPabs, dO_, row * c_.Dv, v_, key * c_.Dv, c_.Dv, prods, true);
    backward_entry(e, st, &T, k);
  }

  // The keys' pass: dk_h[j] = scale sum_i dT_ij Q_i and dv_h[j] = sum_i P_ij dO_i over the rows
  // that see key j (none: exactly 0).
  void keys_pass(mpfr_prec_t p) {
    const std::int64_t Dk = c_.Dk, Dv = c_.Dv;
    dk_.reset(n_keys() * static_cast<std::size_t>(Dk), p);
    dv_.reset(n_keys() * static_cast<std::size_t>(Dv), p);
    detail::PassProgress done(opt_, "gradient keys", static_cast<std::uint64_t>(n_keys()));
    parallel_for(n_keys(), opt_.threads, [&](std::size_t u) {
      const auto uu = static_cast<std::int64_t>(u);
      const std::int64_t b = uu / (H_ * c_.Nk), h = uu / c_.Nk % H_, j = uu % c_.Nk;
      const Consts k(c_, p);
      Entry e(p);
      Enclosure T(p);
      MpfrVec prods;
      std::vector<std::int64_t> rows;
      std::vector<Enclosure> P, dT, At;
      for (std::int64_t i = 0; i < c_.Nq; ++i) {
        const RowStat& st = stats_[row_id(b, h, i)];
        if (!st.valid || !c_.allowed(b, h, i, j)) continue;
        key_entry(e, T, b, h, i, j, st, k, prods);
        rows.push_back(i);
        P.emplace_back(p), dT.emplace_back(p), At.emplace_back(p);
        copy_to(P.back(), e.P), copy_to(dT.back(), e.dT), copy_to(At.back(), e.At);
      }
      const std::size_t n = rows.size();
      Terms t, tb;
      for (std::int64_t cc = 0; cc < Dk; ++cc) {
        t.reset(n, p), tb.reset(n, p);
        for (std::size_t a = 0; a < n; ++a, ++t.n, ++tb.n) {
          mpfr_srcptr x = q_[row_id(b, h, rows[a]) * Dk + cc];
          mul_exact(t.lo[a], t.hi[a], dT[a].lo, dT[a].hi, x);
          mul_abs_exact(tb.lo[a], tb.hi[a], At[a].lo, At[a].hi, x);
        }
        Enclosure& v = dk_.v[u * Dk + cc];
        Enclosure& bd = dk_.bd[u * Dk + cc];
        t.sum(v), tb.sum(bd);
        detail::mul_interval(v.lo, v.hi, v.lo, v.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
        mpfr_mul(bd.lo, bd.lo, k.abs_scale.lo, MPFR_RNDD), mpfr_mul(bd.hi, bd.hi, k.abs_scale.hi, MPFR_RNDU);
      }
      for (std::int64_t cc = 0; cc < Dv; ++cc) {
        t.reset(n, p), tb.reset(n, p);
        for (std::size_t a = 0; a < n; ++a, ++t.n, ++tb.n) {
          mpfr_srcptr x = dO_[row_id(b, h, rows[a]) * Dv + cc];
          mul_exact(t.lo[a], t.hi[a], P[a].lo, P[a].hi, x);
          mul_abs_exact(tb.lo[a], tb.hi[a], P[a].lo, P[a].hi, x);
        }
        t.sum(dv_.v[u * Dv + cc]), tb.sum(dv_.bd[u * Dv + cc]);
      }
      done.unit_done();
    });
  }

  // dbias: each element sums dS over the (b, h, i, j) that read it; with the keys broadcast and
  // no sink, each row's dS is summed whole, which is exactly 0.
  void bias_pass(mpfr_prec_t p) {
    GoldenBuffer* val = find("dbias");
    const std::size_t n = static_cast<std::size_t>(val->bytes.size() / dtype_size(val->dtype));
    const std::int64_t Eh = ext_[1], Ei = ext_[2], Ej = ext_[3];
    std::vector<std::vector<Pending>> pend(n);
    std::vector<std::vector<Bound>> bounds(n);
    detail::PassProgress done(opt_, "dbias elements", n);
    parallel_for(n, opt_.threads, [&](std::size_t u) {
      const auto uu = static_cast<std::int64_t>(u);
      const std::int64_t eb = uu / (Eh * Ei * Ej), eh = uu / (Ei * Ej) % Eh, ei = uu / Ej % Ei, ej = uu % Ej;
      auto span = [](std::int64_t e, std::int64_t x, std::int64_t full) {
        return e == 1 ? std::pair<std::int64_t, std::int64_t>{0, full - 1} : std::pair{x, x};
      };
      const auto [b0, b1] = span(ext_[0], eb, c_.B);
      const auto [h0, h1] = span(Eh, eh, H_);
      const auto [i0, i1] = span(Ei, ei, c_.Nq);
      const auto [j0, j1] = span(Ej, ej, c_.Nk);
      const Consts k(c_, p);
      Entry e(p);
      Enclosure T(p), v(p), bd(p);
      MpfrVec prods;
      Terms t, tb;
      t.reset(static_cast<std::size_t>((b1 - b0 + 1) * (h1 - h0 + 1) * (i1 - i0 + 1) * (j1 - j0 + 1)), p);
      tb.reset(t.lo.size(), p);
      for (std::int64_t b = b0; b <= b1; ++b)
        for (std::int64_t h = h0; h <= h1; ++h)
          for (std::int64_t i = i0; i <= i1; ++i) {
            const RowStat& st = stats_[row_id(b, h, i)];
            if (!st.valid) continue;
            for (std::int64_t j = j0; j <= j1; ++j) {
              if (!c_.allowed(b, h, i, j)) continue;
              key_entry(e, T, b, h, i, j, st, k, prods);
              mpfr_set(t.lo[t.n], e.dS.lo, MPFR_RNDD), mpfr_set(t.hi[t.n++], e.dS.hi, MPFR_RNDU);
              mpfr_set(tb.lo[tb.n], e.A.lo, MPFR_RNDD), mpfr_set(tb.hi[tb.n++], e.A.hi, MPFR_RNDU);
            }
          }
      t.sum(v), tb.sum(bd);
      if (Ej == 1 && !c_.sinks) set_zero(v);  // with a sink a row sums to P_sink_i D_i
      round_element("dbias", static_cast<std::int64_t>(u), v, bd, pend[u], bounds[u]);
      done.unit_done();
    });
    keep(std::move(pend), std::move(bounds));
  }

  // The chained gradients and dsinks, each element a sum of enclosed terms.
  void chained(mpfr_prec_t p) {
    const std::int64_t B = c_.B, Nq = c_.Nq, Nk = c_.Nk, D = c_.D, Dk = c_.Dk, Dv = c_.Dv, Dout = c_.Dout;
    const bool self = c_.self_attention;
    const auto& wq = c_.w_q.values;
    const auto& wk = c_.w_k.values;
    const auto& wv = c_.w_v.values;
    // dx[b, n, d] from the heads' gradients (dq_h of row n, or dk_h and dv_h of key n).
    auto dx = [&](Chain& ch, std::int64_t b, std::int64_t n, std::int64_t d, bool from_q, bool from_kv) {
      for (std::int64_t h = 0; h < H_; ++h) {
        if (from_q)
          for (std::int64_t cc = 0; cc < Dk; ++cc) {
            const std::size_t x = row_id(b, h, n) * Dk + cc;
            ch.add(dq_.v[x], dq_.bd[x], wq[(h * D + d) * Dk + cc]);
          }
        if (from_kv) {
          for (std::int64_t cc = 0; cc < Dk; ++cc) {
            const std::size_t x = key_id(b, h, n) * Dk + cc;
            ch.add(dk_.v[x], dk_.bd[x], wk[(h * D + d) * Dk + cc]);
          }
          for (std::int64_t cc = 0; cc < Dv; ++cc) {
            const std::size_t x = key_id(b, h, n) * Dv + cc;
            ch.add(dv_.v[x], dv_.bd[x], wv[(h * D + d) * Dv + cc]);
          }
        }
      }
    };
    const std::size_t per_x = static_cast<std::size_t>(H_ * (Dk + (self ? Dk + Dv : 0)));
    if (c_.want_dx_q)
      tensor("dx_q", B * Nq * D, per_x, p, [&](Chain& ch, std::int64_t u) {
        dx(ch, u / (Nq * D), u / D % Nq, u % D, true, self);
      });
    if (c_.want_dx_kv)
      tensor("dx_kv", B * Nk * D, static_cast<std::size_t>(H_ * (Dk + Dv)), p, [&](Chain& ch, std::int64_t u) {
        dx(ch, u / (Nk * D), u / D % Nk, u % D, false, true);
      });
    // dw[h, d, c] = sum over b and n of x[b, n, d] G_h[b, n, c].
    auto dw = [&](const char* name, const Grad& G, const FloatTensor& x, std::int64_t N, std::int64_t E, bool rows) {
      tensor(name, H_ * D * E, static_cast<std::size_t>(B * N), p, [&, N, E, rows](Chain& ch, std::int64_t u) {
        const std::int64_t h = u / (D * E), d = u / E % D, cc = u % E;
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t n = 0; n < N; ++n) {
            const std::size_t at = (rows ? row_id(b, h, n) : key_id(b, h, n)) * E + cc;
            ch.add(G.v[at], G.bd[at], x.values[static_cast<std::size_t>((b * N + n) * D + d)]);
          }
      });
    };
    if (c_.want_dw_q) dw("dw_q", dq_, c_.x_q, Nq, Dk, true);
    if (c_.want_dw_k) dw("dw_k", dk_, c_.x_kv, Nk, Dk, false);
    if (c_.want_dw_v) dw("dw_v", dv_, c_.x_kv, Nk, Dv, false);
    if (c_.want_dw_o) {
      Grad oabs;  // O with its magnitude as the bound
      oabs.reset(o_.v.size(), p);
      for (std::size_t x = 0; x < o_.v.size(); ++x) copy_to(oabs.v[x], o_.v[x]), abs_of(oabs.bd[x], o_.v[x]);
      tensor("dw_o", H_ * Dv * Dout, static_cast<std::size_t>(B * Nq), p, [&](Chain& ch, std::int64_t u) {
        const std::int64_t h = u / (Dv * Dout), cc = u / Dout % Dv, eo = u % Dout;
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t i = 0; i < Nq; ++i)
            if (stats_[row_id(b, h, i)].valid) {
              const std::size_t at = row_id(b, h, i) * Dv + cc;
              ch.add(oabs.v[at], oabs.bd[at], c_.dout->values[static_cast<std::size_t>((b * Nq + i) * Dout + eo)]);
            }
      });
    }
    if (c_.want_dsinks) dsinks(p);
  }

  // dsinks[h] = - sum over b and the rows i of P_sink_i D_i, P_sink_i = exp(sink_h - lse_i)
  // (decreasing with lse, a share of Z: at most 1); bound sum P_sink_i sum_c |dO_ic O_ic|.
  void dsinks(mpfr_prec_t p) {
    std::vector<std::vector<Pending>> pend(static_cast<std::size_t>(H_));
    std::vector<std::vector<Bound>> bounds(pend.size());
    for (std::int64_t h = 0; h < H_; ++h) {
      Terms t, tb;
      t.reset(static_cast<std::size_t>(c_.B * c_.Nq), p), tb.reset(t.lo.size(), p);
      Enclosure ps(p), nd(p), v(p), bd(p);
      for (std::int64_t b = 0; b < c_.B; ++b)
        for (std::int64_t i = 0; i < c_.Nq; ++i) {
          const RowStat& st = stats_[row_id(b, h, i)];
          if (!st.valid) continue;
          mpfr_d_sub(ps.lo, c_.sink(h), st.lse.hi, MPFR_RNDD), mpfr_exp(ps.lo, ps.lo, MPFR_RNDD);
          mpfr_d_sub(ps.hi, c_.sink(h), st.lse.lo, MPFR_RNDU), mpfr_exp(ps.hi, ps.hi, MPFR_RNDU);
          if (mpfr_cmp_ui(ps.hi, 1) > 0) mpfr_set_ui(ps.hi, 1, MPFR_RNDN);
          mpfr_neg(nd.lo, st.d.hi, MPFR_RNDN), mpfr_neg(nd.hi, st.d.lo, MPFR_RNDN);  // -D, exact
          mpfr_mul(t.lo[t.n], mpfr_sgn(nd.lo) >= 0 ? ps.lo : ps.hi, nd.lo, MPFR_RNDD);
          mpfr_mul(t.hi[t.n++], mpfr_sgn(nd.hi) >= 0 ? ps.hi : ps.lo, nd.hi, MPFR_RNDU);
          mpfr_mul(tb.lo[tb.n], ps.lo, st.dabs.lo, MPFR_RNDD), mpfr_mul(tb.hi[tb.n++], ps.hi, st.dabs.hi, MPFR_RNDU);
        }
      t.sum(v), tb.sum(bd);
      const auto u = static_cast<std::size_t>(h);
      round_element("dsinks", h, v, bd, pend[u], bounds[u]);
    }
    keep(std::move(pend), std::move(bounds));
  }

  // Every element of tensor `name` (n of them) as the sum that term(chain, flat index) adds up,
  // at most `terms` terms, rounded.
  template <class Term>
  void tensor(const char* name, std::int64_t n, std::size_t terms, mpfr_prec_t p, const Term& term) {
    std::vector<std::vector<Pending>> pend(static_cast<std::size_t>(n));
    std::vector<std::vector<Bound>> bounds(pend.size());
    detail::PassProgress done(opt_, std::string(name) + " elements", static_cast<std::uint64_t>(n));
    parallel_for(pend.size(), opt_.threads, [&](std::size_t u) {
      Chain ch;
      ch.reset(terms, p);
      term(ch, static_cast<std::int64_t>(u));
      Enclosure v(p), bd(p);
      ch.t.sum(v), ch.tb.sum(bd);
      round_element(name, static_cast<std::int64_t>(u), v, bd, pend[u], bounds[u]);
      done.unit_done();
    });
    keep(std::move(pend), std::move(bounds));
  }

  struct Bound {
    GoldenBuffer* buf;
    std::int64_t idx;
    double value;
  };

  // One element rounded into G and G.ref; its bound's upper end rounded up (out of Ziv's test:
  // an exactly representable bound would never be decided).
  void round_element(const char* name, std::int64_t idx, const Enclosure& v, const Enclosure& bd,
                     std::vector<Pending>& pend, std::vector<Bound>& bounds) {
    if (opt_.gradient_check) opt_.gradient_check(name, idx, v, bd);
    bool all = true;
    for (GoldenBuffer* buf : {find(name), find(std::string(name) + ".ref")}) {
      pend.push_back({buf, idx, round_enclosure(v.lo, v.hi, buf->dtype)});
      all = all && pend.back().r.decided;
    }
    const double bhi = mpfr_get_d(bd.hi, MPFR_RNDU);
    bounds.push_back({find(std::string(name) + ".bound"), idx, bhi == 0 ? 0.0 : bhi});  // a zero bound is +0
    if (!all) all_.store(false);
  }

  void keep(std::vector<std::vector<Pending>> pend, std::vector<std::vector<Bound>> bounds) {
    for (auto& x : pend) pend_.push_back(std::move(x));
    for (auto& x : bounds) bounds_.push_back(std::move(x));
  }

  const Case& c_;
  const EvalOptions& opt_;
  RowEvaluator ev_;
  const std::int64_t H_;
  ExactArray q_, k_, v_, dO_;
  mpfr_prec_t p0_ = 0, cap_ = 0, reached_ = 0;
  std::vector<std::unique_ptr<GoldenBuffer>> bufs_;
  std::array<std::int64_t, 4> ext_{1, 1, 1, 1};  // the bias's extents over [B, H, Nq, Nk]
  std::vector<RowStat> stats_;                   // per (b, h, i) at the current precision
  std::vector<std::int64_t> keys_;               // per (b, h, i): its allowed keys
  Grad o_, dq_, dk_, dv_;                        // O_h (bound unused), and the heads' gradients
  std::vector<std::vector<Pending>> pend_;
  std::vector<std::vector<Bound>> bounds_;
  std::atomic<bool> all_{true};
  std::uint64_t elements_ = 0, undecided_ = 0;
};

}  // namespace

void evaluate_mha_gradients(const Case& c, const EvalOptions& opt, EvalResult& res) {
  MhaBackward bw(c, opt);
  bw.run();
  bw.finish(res);
}

}  // namespace attnoracle
