// The interval kernel: enclosures of one row of attention at a given working precision.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

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
    const std::size_t idx = static_cast<std::size_t>(r * cols + c);
    if (d)
      mpfr_mul_d(dst, x, d[idx], MPFR_RNDN);
    else
      mpfr_mul(dst, x, (*m)[offset + idx], MPFR_RNDN);
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

// Encloses the exact decimal or hexadecimal value of a metadata number.
void enclose_text(mpfr_ptr lo, mpfr_ptr hi, const std::string& text) {
  mpfr_strtofr(lo, text.c_str(), nullptr, 0, MPFR_RNDD);
  mpfr_strtofr(hi, text.c_str(), nullptr, 0, MPFR_RNDU);
}

// r = bound of c*tanh(t/c) over c in [cl, ch]: lower (RNDD) or upper (RNDU). The function
// increases with t, and with c for t > 0 (decreases for t < 0), so the extremes over the box of
// t and c lie at its corners; each monotone step rounded the same way keeps the bound.
void softcap_bound(mpfr_ptr r, mpfr_srcptr t, mpfr_srcptr cl, mpfr_srcptr ch, mpfr_rnd_t rnd,
                   mpfr_ptr tmp) {
  mpfr_t best;
  mpfr_init2(best, mpfr_get_prec(r));
  for (int k = 0; k < 2; ++k) {
    mpfr_srcptr cap = k == 0 ? cl : ch;
    mpfr_div(tmp, t, cap, rnd);
    mpfr_tanh(tmp, tmp, rnd);
    mpfr_mul(tmp, tmp, cap, rnd);
    if (k == 0 || (rnd == MPFR_RNDD ? mpfr_less_p(tmp, best) : mpfr_greater_p(tmp, best)))
      mpfr_set(best, tmp, rnd);
  }
  mpfr_set(r, best, rnd);
  mpfr_clear(best);
}

Enclosure copy_enclosure(const Enclosure& e) {
  Enclosure r(std::max(mpfr_get_prec(e.lo), mpfr_get_prec(e.hi)));
  mpfr_set(r.lo, e.lo, MPFR_RNDD);
  mpfr_set(r.hi, e.hi, MPFR_RNDU);
  return r;
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

  // out[b][r][n][e] = sum_d x[b][n][d] * w[r][d][e], exactly: mpfr_sum is correctly rounded and
  // reports exactness, so the precision doubles until the sum is exact.
  void project(std::int64_t b, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
               std::int64_t E, std::vector<mpfr_t>& out, mpfr_prec_t& maxprec) {
    const std::int64_t H = c.Hq, D = c.D;
    MpfrVec prods;
    prods.resize(static_cast<std::size_t>(D), 106);  // a product of two doubles is exact in 106 bits
    maxprec = 53;
    auto idx = static_cast<std::size_t>(b * H * N * E);
    for (std::int64_t r = 0; r < H; ++r)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t e = 0; e < E; ++e, ++idx) {
          for (std::int64_t d = 0; d < D; ++d) {
            mpfr_set_d(prods[d], x.values[static_cast<std::size_t>((b * N + n) * D + d)],
                       MPFR_RNDN);
            mpfr_mul_d(prods[d], prods[d], w.values[static_cast<std::size_t>((r * D + d) * E + e)],
                       MPFR_RNDN);
          }
          mpfr_prec_t p = 128;
          mpfr_init2(out[idx], p);
          while (mpfr_sum(out[idx], prods.ptrs(), static_cast<unsigned long>(D), MPFR_RNDN) != 0) {
            p *= 2;
            mpfr_set_prec(out[idx], p);
          }
          // Keep only the bits in use, so that later exact products stay small.
          const mpfr_prec_t used = std::max<mpfr_prec_t>(mpfr_min_prec(out[idx]), MPFR_PREC_MIN);
          mpfr_prec_round(out[idx], used, MPFR_RNDN);  // exact: the value fits in `used` bits
          maxprec = std::max(maxprec, used);
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

  ExactMatrix q_of(std::int64_t b, std::int64_t h) {
    ExactMatrix m;
    m.cols = c.Dk;
    if (c.kind == Kind::Sdpa) {
      m.d = c.q.values.data() + (b * c.Hq + h) * c.Nq * c.Dk;
    } else {
      m.m = &qp;
      m.offset = static_cast<std::size_t>((b * c.Hq + h) * c.Nq * c.Dk);
      m.prec = qp_prec[static_cast<std::size_t>(b)];
    }
    return m;
  }
  ExactMatrix k_of(std::int64_t b, std::int64_t g) {
    ExactMatrix m;
    m.cols = c.Dk;
    if (c.kind == Kind::Sdpa) {
      m.d = c.k.values.data() + (b * c.Hkv + g) * c.Nk * c.Dk;
    } else {
      m.m = &kp;
      m.offset = static_cast<std::size_t>((b * c.Hkv + g) * c.Nk * c.Dk);
      m.prec = kp_prec[static_cast<std::size_t>(b)];
    }
    return m;
  }
  ExactMatrix v_of(std::int64_t b, std::int64_t g) {
    ExactMatrix m;
    m.cols = c.Dv;
    if (c.kind == Kind::Sdpa) {
      m.d = c.v.values.data() + (b * c.Hkv + g) * c.Nk * c.Dv;
    } else {
      m.m = &vp;
      m.offset = static_cast<std::size_t>((b * c.Hkv + g) * c.Nk * c.Dv);
      m.prec = vp_prec[static_cast<std::size_t>(b)];
    }
    return m;
  }

  struct HeadRow {
    bool valid = true;
    std::vector<Enclosure> out, bound, weights;
    Enclosure lse;
    HeadDetail detail;
    explicit HeadRow(mpfr_prec_t p) : lse(p) {}
  };

  // One query row of one head: scores, softmax and the weighted sum of values.
  HeadRow head_row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) {
    const std::int64_t Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
    const std::int64_t g = h / (c.Hq / c.Hkv);
    if (c.kind == Kind::Mha) ensure_projected(b);
    const ExactMatrix Q = q_of(b, h), K = k_of(b, g), V = v_of(b, g);
    HeadRow row(p);
    for (std::int64_t cc = 0; cc < Dv; ++cc) {
      row.out.emplace_back(p);
      row.bound.emplace_back(p);
    }
    HeadDetail& det = row.detail;
    det.allowed.assign(static_cast<std::size_t>(Nk), 0);
    for (std::int64_t j = 0; j < Nk; ++j) {
      row.weights.emplace_back(p);
      det.dots.emplace_back(p);
      mpfr_set_zero(row.weights.back().lo, 1);
      mpfr_set_zero(row.weights.back().hi, 1);
      mpfr_set_zero(det.dots.back().lo, 1);
      mpfr_set_zero(det.dots.back().hi, 1);
    }
    for (std::int64_t cc = 0; cc < Dv; ++cc) {
      det.raw_out.emplace_back(p);
      det.hull.emplace_back(p);
      mpfr_set_zero(det.raw_out.back().lo, 1);
      mpfr_set_zero(det.raw_out.back().hi, 1);
      mpfr_set_zero(det.hull.back().lo, 1);
      mpfr_set_zero(det.hull.back().hi, 1);
    }

    std::vector<std::int64_t> allowed;
    for (std::int64_t j = 0; j < Nk; ++j)
      if (c.allowed(b, h, i, j)) {
        allowed.push_back(j);
        det.allowed[static_cast<std::size_t>(j)] = 1;
      }
    const auto n = allowed.size();
    if (n == 0) {
      if (c.masked_rows == MaskedRows::Error && c.query_valid(b, i)) throw FullyMaskedRow(b, h, i);
      row.valid = false;
      for (auto& e : row.out) mpfr_set_zero(e.lo, 1), mpfr_set_zero(e.hi, 1);
      for (auto& e : row.bound) mpfr_set_zero(e.lo, 1), mpfr_set_zero(e.hi, 1);
      mpfr_set_inf(row.lse.lo, -1);
      mpfr_set_inf(row.lse.hi, -1);
      return row;
    }

    // Exact dot products q_i . k_j: each product is exact at prec(q) + prec(k) bits, and
    // mpfr_sum rounds their sum correctly (downward), reporting exactness.
    MpfrVec qrow, prods, slo, shi;
    qrow.resize(static_cast<std::size_t>(Dk), Q.prec);
    for (std::int64_t d = 0; d < Dk; ++d) Q.get(qrow[d], i, d, MPFR_RNDN);  // exact
    prods.resize(static_cast<std::size_t>(Dk), Q.prec + K.prec);
    slo.resize(n, p);
    shi.resize(n, p);
    bool all_exact = true;
    for (std::size_t a = 0; a < n; ++a) {
      const std::int64_t j = allowed[a];
      for (std::int64_t d = 0; d < Dk; ++d) K.mul_exact(prods[d], qrow[d], j, d);
      const int t = mpfr_sum(slo[a], prods.ptrs(), static_cast<unsigned long>(Dk), MPFR_RNDD);
      mpfr_set(shi[a], slo[a], MPFR_RNDN);
      if (t != 0) {
        mpfr_nextabove(shi[a]);  // exact value in (lo, next above lo)
        all_exact = false;
      }
      mpfr_set(det.dots[static_cast<std::size_t>(j)].lo, slo[a], MPFR_RNDD);
      mpfr_set(det.dots[static_cast<std::size_t>(j)].hi, shi[a], MPFR_RNDU);
    }
    // Every allowed score provably equal (one key, or exact equal dots and equal bias): the
    // weights are exactly 1/n.
    bool tie = all_exact || n == 1;
    for (std::size_t a = 1; tie && a < n; ++a)
      tie = mpfr_equal_p(slo[a], slo[0]) &&
            c.bias_at(b, h, i, allowed[a]) == c.bias_at(b, h, i, allowed[0]);

    // Scores S = softcap(scale * dot) + bias, as intervals.
    mpfr_t sclo, schi, tmp, tmp2, m;
    mpfr_inits2(p, sclo, schi, tmp, tmp2, m, static_cast<mpfr_ptr>(nullptr));
    if (c.scale) {
      enclose_text(sclo, schi, *c.scale);
    } else {  // 1/sqrt(Dk), correctly rounded each way
      mpfr_set_si(tmp, Dk, MPFR_RNDN);
      mpfr_rec_sqrt(sclo, tmp, MPFR_RNDD);
      mpfr_rec_sqrt(schi, tmp, MPFR_RNDU);
    }
    mpfr_t cl, ch;
    mpfr_inits2(p, cl, ch, static_cast<mpfr_ptr>(nullptr));
    if (c.softcap) enclose_text(cl, ch, *c.softcap);
    for (std::size_t a = 0; a < n; ++a) {
      detail::mul_interval(slo[a], shi[a], slo[a], shi[a], sclo, schi, tmp);
      if (c.softcap) {
        softcap_bound(tmp2, slo[a], cl, ch, MPFR_RNDD, tmp);
        softcap_bound(shi[a], shi[a], cl, ch, MPFR_RNDU, tmp);
        mpfr_set(slo[a], tmp2, MPFR_RNDD);
      }
      const double bias = c.bias_at(b, h, i, allowed[a]);
      if (bias != 0) {
        mpfr_add_d(slo[a], slo[a], bias, MPFR_RNDD);
        mpfr_add_d(shi[a], shi[a], bias, MPFR_RNDU);
      }
    }

    // m: any number near the row maximum; exp(S - m) then stays near 1 for the largest terms.
    mpfr_set(m, shi[0], MPFR_RNDN);
    for (std::size_t a = 1; a < n; ++a)
      if (mpfr_greater_p(shi[a], m)) mpfr_set(m, shi[a], MPFR_RNDN);
    mpfr_prec_round(m, 53, MPFR_RNDN);  // a short constant keeps S - m cheap; its value is free

    MpfrVec elo, ehi, terms;
    elo.resize(n, p);
    ehi.resize(n, p);
    terms.resize(n, p);
    mpfr_t zlo, zhi, nlo, nhi;
    mpfr_inits2(p, zlo, zhi, nlo, nhi, static_cast<mpfr_ptr>(nullptr));
    if (tie) {
      // exp(S - m) is the same number e for all keys: A = e / (n e) = 1/n exactly.
      for (std::size_t a = 0; a < n; ++a) {
        mpfr_set_ui(elo[a], 1, MPFR_RNDN);
        mpfr_set_ui(ehi[a], 1, MPFR_RNDN);
      }
      mpfr_set_ui(zlo, n, MPFR_RNDD);
      mpfr_set_ui(zhi, n, MPFR_RNDU);
    } else {
      for (std::size_t a = 0; a < n; ++a) {
        mpfr_sub(tmp, slo[a], m, MPFR_RNDD);
        mpfr_exp(elo[a], tmp, MPFR_RNDD);  // exp is increasing
        mpfr_sub(tmp, shi[a], m, MPFR_RNDU);
        mpfr_exp(ehi[a], tmp, MPFR_RNDU);
      }
      mpfr_sum(zlo, elo.ptrs(), n, MPFR_RNDD);  // all terms positive: sum of lows is a low
      mpfr_sum(zhi, ehi.ptrs(), n, MPFR_RNDU);
    }

    // lse = m + log Z (tie: S + log n, the same thing).
    mpfr_log(tmp, zlo, MPFR_RNDD);
    mpfr_add(row.lse.lo, tmp, tie ? slo[0] : m, MPFR_RNDD);
    mpfr_log(tmp, zhi, MPFR_RNDU);
    mpfr_add(row.lse.hi, tmp, tie ? shi[0] : m, MPFR_RNDU);

    // Weights: A_j = e_j / Z.
    for (std::size_t a = 0; a < n; ++a) {
      Enclosure& w = row.weights[static_cast<std::size_t>(allowed[a])];
      mpfr_div(w.lo, elo[a], zhi, MPFR_RNDD);
      mpfr_div(w.hi, ehi[a], zlo, MPFR_RNDU);
    }

    // Output: O_c = N_c / Z with N_c = sum_j e_j v_jc; each product is bounded with the end
    // of e_j that the sign of v_jc calls for. The exact O_c also lies within [min v, max v].
    for (std::int64_t cc = 0; cc < Dv; ++cc) {
      for (std::size_t a = 0; a < n; ++a)
        V.mul(terms[a], V.sgn(allowed[a], cc) >= 0 ? elo[a] : ehi[a], allowed[a], cc, MPFR_RNDD);
      mpfr_sum(nlo, terms.ptrs(), n, MPFR_RNDD);
      for (std::size_t a = 0; a < n; ++a)
        V.mul(terms[a], V.sgn(allowed[a], cc) >= 0 ? ehi[a] : elo[a], allowed[a], cc, MPFR_RNDU);
      mpfr_sum(nhi, terms.ptrs(), n, MPFR_RNDU);
      const auto ci = static_cast<std::size_t>(cc);
      Enclosure& raw = det.raw_out[ci];
      detail::div_by_positive(raw.lo, raw.hi, nlo, nhi, zlo, zhi);
      // The allowed values' range, and that of their magnitudes (for the bound below).
      std::size_t amin = 0, amax = 0, bmin = 0, bmax = 0;
      for (std::size_t a = 1; a < n; ++a) {
        if (V.cmp(allowed[a], cc, allowed[amin], cc) < 0) amin = a;
        if (V.cmp(allowed[a], cc, allowed[amax], cc) > 0) amax = a;
        if (V.cmpabs(allowed[a], cc, allowed[bmin], cc) < 0) bmin = a;
        if (V.cmpabs(allowed[a], cc, allowed[bmax], cc) > 0) bmax = a;
      }
      V.get(det.hull[ci].lo, allowed[amin], cc, MPFR_RNDD);
      V.get(det.hull[ci].hi, allowed[amax], cc, MPFR_RNDU);
      // The exact O_c, a convex combination, lies in the hull too: use the intersection when it
      // is not empty (an empty one is a broken evaluation, for the oracle to report).
      Enclosure& o = row.out[ci];
      mpfr_set(o.lo, mpfr_greater_p(det.hull[ci].lo, raw.lo) ? det.hull[ci].lo : raw.lo, MPFR_RNDD);
      mpfr_set(o.hi, mpfr_less_p(det.hull[ci].hi, raw.hi) ? det.hull[ci].hi : raw.hi, MPFR_RNDU);
      if (mpfr_greater_p(o.lo, o.hi)) {
        mpfr_set(o.lo, raw.lo, MPFR_RNDD);
        mpfr_set(o.hi, raw.hi, MPFR_RNDU);
      }

      // bound_c = sum_j A_j |v_jc|
      for (std::size_t a = 0; a < n; ++a) V.mul_abs(terms[a], elo[a], allowed[a], cc, MPFR_RNDD);
      mpfr_sum(nlo, terms.ptrs(), n, MPFR_RNDD);
      for (std::size_t a = 0; a < n; ++a) V.mul_abs(terms[a], ehi[a], allowed[a], cc, MPFR_RNDU);
      mpfr_sum(nhi, terms.ptrs(), n, MPFR_RNDU);
      Enclosure& bd = row.bound[static_cast<std::size_t>(cc)];
      mpfr_div(bd.lo, nlo, zhi, MPFR_RNDD);
      mpfr_div(bd.hi, nhi, zlo, MPFR_RNDU);
      // The bound is a convex combination of the |v_jc| too: intersect with their range.
      V.get(tmp, allowed[bmin], cc, MPFR_RNDZ);  // |v| rounded down
      mpfr_abs(tmp, tmp, MPFR_RNDN);
      V.get(tmp2, allowed[bmax], cc, MPFR_RNDA);  // |v| rounded up
      mpfr_abs(tmp2, tmp2, MPFR_RNDN);
      if (mpfr_lessequal_p(tmp, bd.hi) && mpfr_lessequal_p(bd.lo, tmp2)) {
        if (mpfr_less_p(bd.lo, tmp)) mpfr_set(bd.lo, tmp, MPFR_RNDD);
        if (mpfr_greater_p(bd.hi, tmp2)) mpfr_set(bd.hi, tmp2, MPFR_RNDU);
      }
    }
    mpfr_clears(sclo, schi, tmp, tmp2, m, cl, ch, zlo, zhi, nlo, nhi,
                static_cast<mpfr_ptr>(nullptr));
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
    Impl::HeadRow hr = impl_->head_row(b, h, i, p);
    r.valid = hr.valid;
    r.out = std::move(hr.out);
    r.bound = std::move(hr.bound);
    r.weights.push_back(std::move(hr.weights));
    r.lse.push_back(std::move(hr.lse));
    r.head_valid.push_back(hr.valid);
    hr.detail.out = std::vector<Enclosure>();
    for (const Enclosure& e : r.out) hr.detail.out.push_back(copy_enclosure(e));
    r.heads.push_back(std::move(hr.detail));
    return r;
  }
  // mha: out_e = sum_{r,c} O_r[c] W_o[r*Dv + c, e], bound_e = sum bound_r[c] |W_o[r*Dv + c, e]|.
  const std::int64_t H = c.Hq, Dv = c.Dv, Dout = c.Dout;
  std::vector<Impl::HeadRow> heads;
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
    r.head_valid.push_back(hr.valid);
  }
  return r;
}

}  // namespace attnoracle
