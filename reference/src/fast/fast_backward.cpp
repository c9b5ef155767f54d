// The gradients in ball arithmetic (ball.hpp), by the formulas of backward.cpp:
//   dS_ij = P_ij (dP_ij - D_i), dq = scale dS K, dk = scale dS^T Q, dv = P^T dout,
// with P_ij = exp(S_ij - lse_i) recomputed in the key and bias passes from the row's lse, whether
// the row pass enclosed it in balls or with MPFR.
#include "fast_backward.hpp"

#include <mpfr.h>

#include <cmath>
#include <memory>

#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "ball.hpp"
#include "decide.hpp"
#include "fast_row.hpp"

namespace attnoracle::fast {
namespace {

// What the key pass reads of a row: lse, D = dout . O and sum_c |dout_c O_c|.
struct RowStat {
  bool ok = false;
  Ball lse, d, dabs;
};

void absolute(const double* x, std::int64_t n, double* ax) {
  for (std::int64_t c = 0; c < n; ++c) ax[c] = std::fabs(x[c]);
}

bool finite(const Ball& x) { return std::isfinite(x.mid.hi) && std::isfinite(x.rad); }
constexpr double kOne[1] = {1.0};  // a term of a plain sum of balls

// s x, an exact 0 kept exact.
Ball scaled(const Ball& s, const Ball& x) { return x.mid.hi == 0 && x.rad == 0 ? x : mul(s, x); }

// The entry (i, j): dS = P (dP - D) and A = P (|dP| + |D|), the magnitude of its terms.
struct Entry {
  Ball dS, A;
};
// From the balls of dP = dout . v and of sum_c |dout_c v_c|.
Entry entry(const Ball& P, const Ball& dP, const Ball& dPabs, const RowStat& st) {
  return {mul(P, add(dP, neg(st.d))), mul(P, add(dPabs, st.dabs))};
}
// av holds |v|, adout |dout|.
Entry entry(const Ball& P, const double* dout, const double* adout, const double* v, const double* av,
            std::int64_t Dv, const RowStat& st) {
  return entry(P, dot2(dout, v, Dv), dot2(adout, av, Dv), st);
}

// Dot2 of x with every row of a transposed block matrix (simd.hpp's layout), as ball.hpp's dot2
// forms it bit for bit: the ball of row a is ball(a).
struct DotLanes {
  std::vector<double> sh, sl, sabs;
  double factor = 0;
  void run(const double* x, const double* t, std::int64_t len, std::int64_t blocks) {
    const auto n = static_cast<std::size_t>(blocks) * kKeyBlock;
    sh.resize(n), sl.resize(n), sabs.resize(n);
    factor = dot2_factor(len);
    dot2_blocks(x, t, len, blocks, sh.data(), sl.data(), sabs.data());
  }
  Ball ball(std::size_t a) const { return dot2_ball(sh[a], sl[a], sabs[a], factor); }
};

// Per column c of the keys K[., Dk]: whether K_jc - K_j0c is exact for every j of `keys` (j0 its
// first), so that the column may be centred on key j0 without a rounding.
std::vector<char> exact_differences(const double* K, std::int64_t Dk, const std::vector<std::int64_t>& keys) {
  std::vector<char> centred(static_cast<std::size_t>(Dk), 1);
  if (keys.empty()) return centred;  // no key (Nk = 0): nothing to centre
  for (std::int64_t cc = 0; cc < Dk; ++cc) {
    const double k0 = K[keys[0] * Dk + cc];
    for (std::int64_t j : keys) {
      const double kj = K[j * Dk + cc], dd = kj - k0;
      if (!(std::isfinite(dd) && dd + k0 == kj && kj - dd == k0)) {
        centred[static_cast<std::size_t>(cc)] = 0;
        break;
      }
    }
  }
  return centred;
}

std::vector<double> magnitudes(const std::vector<double>& x) {
  std::vector<double> a(x.size());
  absolute(x.data(), static_cast<std::int64_t>(x.size()), a.data());
  return a;
}

}  // namespace

struct FastBackward::Impl {
  const Case& c;
  const EvalOptions& opt;
  Setup s;
  Ball abs_scale;
  mutable std::vector<RowStat> stats;  // per row; each written by its own row unit only
  // Transposed in blocks (simd.hpp): V and |V| per kv head over its keys; Q, dout and |dout| per
  // kv head over the rows of its query heads. Row-major magnitudes |K|, |Q|, |dout|, and kc.
  std::vector<double> vt, avt, qt, doutt, adoutt, ak, aq, adout, kc;

  Impl(const Case& cs, const EvalOptions& o) : c(cs), opt(o) {
    if (!opt.fast_path) {
      s.why_not = "off";
      return;
    }
    s = prepare(c);
    const char* refused = !s.applies                       ? nullptr
                          : c.sinks                        ? "sinks"
                          : !all_in_range(c.dout->values) ? "dout outside [2^-480, 2^480]"
                                                           : nullptr;
    if (refused) s = Setup{false, refused, {}, {}, 0, {}, {}, {}, {}};
    abs_scale = abs(s.scale);
    if (!s.applies) return;
    stats.resize(static_cast<std::size_t>(c.B * c.Hq * c.Nq));
    const std::int64_t heads = c.B * c.Hkv, G = c.Hq / c.Hkv;
    if (c.want_dq) {  // the row pass's dP over a head's keys in lanes, and K centred on its key 0
      vt = transpose_keys(c.v.values.data(), heads, c.Nk, c.Dv);
      const std::vector<double> av = magnitudes(c.v.values);
      avt = transpose_keys(av.data(), heads, c.Nk, c.Dv);
      ak = magnitudes(c.k.values);
      centre_keys();
    }
    if (c.want_dk || c.want_dv) {  // the key pass's dots over a kv head's rows in lanes
      qt = transpose_keys(c.q.values.data(), heads, G * c.Nq, c.Dk);
      doutt = transpose_keys(c.dout->values.data(), heads, G * c.Nq, c.Dv);
      adout = magnitudes(c.dout->values);
      adoutt = transpose_keys(adout.data(), heads, G * c.Nq, c.Dv);
      aq = magnitudes(c.q.values);
    }
  }

  // kc holds K_jc - K_0c per (batch, kv head) where every such difference over its keys is exact
  // (exact_differences), else K_jc: what row() uses for a row that allows every key.
  void centre_keys() {
    const std::int64_t Nk = c.Nk, Dk = c.Dk;
    kc = c.k.values;
    std::vector<std::int64_t> all(static_cast<std::size_t>(Nk));
    for (std::int64_t j = 0; j < Nk; ++j) all[static_cast<std::size_t>(j)] = j;
    for (std::int64_t hd = 0; hd < c.B * c.Hkv; ++hd) {
      const double* K = c.k.values.data() + hd * Nk * Dk;
      const std::vector<char> cen = exact_differences(K, Dk, all);
      for (std::int64_t j = 0; j < Nk; ++j)
        for (std::int64_t cc = 0; cc < Dk; ++cc)
          if (cen[static_cast<std::size_t>(cc)]) kc[static_cast<std::size_t>((hd * Nk + j) * Dk + cc)] = K[j * Dk + cc] - K[cc];
    }
  }

  std::size_t row_id(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i);
  }
  const double* dout_row(std::size_t r) const { return c.dout->values.data() + r * static_cast<std::size_t>(c.Dv); }

  // P_ij = exp(scale q.k + bias - lse).
  bool weight(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, const double* q, const double* k,
              const RowStat& st, Ball& P) const {
    return weight(b, h, i, j, dot2(q, k, c.Dk), st, P);
  }
  // The same from the ball of q.k.
  bool weight(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, const Ball& dot, const RowStat& st,
              Ball& P) const {
    Ball x;
    if (!exponent(b, h, i, j, dot, st, x)) return false;
    P = exp(x);
    return true;
  }
  // Its argument x = scale q.k + bias - lse, false where exp's ball rule does not hold for it.
  bool exponent(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, const Ball& dot, const RowStat& st,
                Ball& x) const {
    Ball sc = mul(s.scale, dot);
    const double bias = c.bias_at(b, h, i, j);
    if (bias != 0) sc = add(sc, bias);
    x = add(sc, neg(st.lse));
    return finite(x) && exp_applies(x);
  }

  // Decides element e of gradient `name` from the value's and the bound's balls; calls the
  // oracle's hook on what is decided.
  bool decide_element(const char* name, std::int64_t flat, const Ball& v, const Ball& bd, DecidedGrad& g) const {
    if (!finite(v) || !finite(bd)) return false;
    const DD lo = lower(v), hi = upper(v);
    if (!decide(lo, hi, c.dtype_of(name), g.value) || !decide(lo, hi, DType::F64, g.ref)) return false;
    // The bound's upper end rounded up, as the MPFR path gives it once it is decided there:
    // accepted when both ends round up alike (the smallest F64 at or above the exact bound).
    const double up = round_up_dd(upper(bd)) + 0.0, down = round_up_dd(lower(bd)) + 0.0;
    if (up != down) return false;
    g.bound.push_back(up);
    if (opt.gradient_check) opt.gradient_check(name, flat, ball_enclosure(v), ball_enclosure(bd));
    return true;
  }
};

FastBackward::FastBackward(const Case& c, const EvalOptions& opt) : impl_(new Impl(c, opt)) {}
FastBackward::~FastBackward() { delete impl_; }
bool FastBackward::applies() const { return impl_->s.applies; }
const std::string& FastBackward::why_not() const { return impl_->s.why_not; }

bool FastBackward::dp_differ(std::int64_t b, std::int64_t h, std::int64_t i) const {
  const Case& c = impl_->c;
  const double* dout = impl_->dout_row(impl_->row_id(b, h, i));
  const double* V = c.v.values.data() + (b * c.Hkv + c.kv_head(h)) * c.Nk * c.Dv;
  bool first = true;
  DD lo0, hi0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    if (!c.allowed(b, h, i, j)) continue;
    const Ball dP = dot2(dout, V + j * c.Dv, c.Dv);
    if (!finite(dP)) return false;
    const DD lo = lower(dP), hi = upper(dP);
    if (first) {
      lo0 = lo, hi0 = hi, first = false;
    } else if (hi.hi + hi.lo < lo0.hi + lo0.lo || lo.hi + lo.lo > hi0.hi + hi0.lo) {
      return true;  // rounding to nearest is monotone: RN(hi) < RN(lo0) implies hi < lo0
    }
  }
  return false;
}

bool FastBackward::has_row_stat(std::int64_t b, std::int64_t h, std::int64_t i) const {
  return impl_->stats[impl_->row_id(b, h, i)].ok;
}

void FastBackward::set_row_stat(std::int64_t b, std::int64_t h, std::int64_t i, const Enclosure& lse,
                                const Enclosure& d, const Enclosure& dabs) {
  RowStat& st = impl_->stats[impl_->row_id(b, h, i)];
  st.lse = ball_of(lse.lo, lse.hi);
  st.d = ball_of(d.lo, d.hi);
  st.dabs = ball_of(dabs.lo, dabs.hi);
  st.ok = finite(st.lse) && finite(st.d) && finite(st.dabs);
}

bool FastBackward::row_stat(std::int64_t b, std::int64_t h, std::int64_t i, Enclosure& lse, Enclosure& d,
                           Enclosure& dabs) const {
  const RowStat& st = impl_->stats[impl_->row_id(b, h, i)];
  if (!st.ok) return false;
  for (auto [ball, out] : {std::pair{&st.lse, &lse}, std::pair{&st.d, &d}, std::pair{&st.dabs, &dabs}}) {
    const Enclosure e = ball_enclosure(*ball);
    mpfr_set(out->lo, e.lo, MPFR_RNDD);
    mpfr_set(out->hi, e.hi, MPFR_RNDU);
  }
  return true;
}

bool FastBackward::row(std::int64_t b, std::int64_t h, std::int64_t i, DecidedGrad& dq) const {
  const Impl& m = *impl_;
  const Case& c = m.c;
  const std::size_t r = m.row_id(b, h, i);
  RowStat& st = m.stats[r];
  st = RowStat{};
  const FastRow fr = fast_row(c, m.s, b, h, i);
  if (!fr.ok) return false;
  const std::int64_t Dk = c.Dk, Dv = c.Dv, g = c.kv_head(h);
  const double* dout = m.dout_row(r);
  std::vector<double> adout(static_cast<std::size_t>(Dv));
  BallSums d(1), dabs(1);  // one column: the sums over c
  for (std::int64_t cc = 0; cc < Dv; ++cc) {
    const auto ci = static_cast<std::size_t>(cc);
    adout[ci] = std::fabs(dout[cc]);
    d.add(fr.out[ci], &dout[cc]);
    dabs.add(abs(fr.out[ci]), &adout[ci]);
  }
  const Enclosure lse = lse_enclosure(fr);
  st.lse = ball_of(lse.lo, lse.hi);
  st.d = d.ball(0);
  st.dabs = dabs.ball(0);
  st.ok = finite(st.lse) && finite(st.d) && finite(st.dabs);
  if (!st.ok) return false;
  if (!c.want_dq) return true;

  // dq_c = scale sum_j dS_j K_jc. dS_i sums to 0 over j (no softcap, no sinks here), so K_jc
  // may be replaced by K_jc - K_j0c, where every difference is exact: a constant column gives 0.
  std::vector<std::int64_t> keys;
  for (std::int64_t j = 0; j < c.Nk; ++j)
    if (fr.allowed[static_cast<std::size_t>(j)]) keys.push_back(j);
  const std::int64_t head = b * c.Hkv + g;
  const double* K = c.k.values.data() + head * c.Nk * Dk;
  const double* AK = m.ak.data() + head * c.Nk * Dk;
  // Every key allowed: K centred on key 0 as the constructor left it; else centred here on the
  // row's first key, over its allowed keys.
  const bool whole = static_cast<std::int64_t>(keys.size()) == c.Nk;
  std::vector<double> kc;
  const std::vector<char> centred = whole ? std::vector<char>{} : exact_differences(K, Dk, keys);
  // dP_j = dout . v_j and sum_c |dout_c v_jc| for every key of the head, in lanes.
  const std::int64_t blocks = key_blocks(c.Nk);
  DotLanes dp, dpabs;
  dp.run(dout, m.vt.data() + head * blocks * Dv * static_cast<std::int64_t>(kKeyBlock), Dv, blocks);
  dpabs.run(adout.data(), m.avt.data() + head * blocks * Dv * static_cast<std::int64_t>(kKeyBlock), Dv, blocks);
  BallSums val(static_cast<std::size_t>(Dk)), bnd(static_cast<std::size_t>(Dk));
  const double* k0 = K + keys[0] * Dk;
  const std::size_t n = keys.size();
  std::vector<Ball> dS(n), A(n);
  std::vector<const double*> kr(n), akr(n);
  if (!whole) kc.resize(n * static_cast<std::size_t>(Dk));
  for (std::size_t t = 0; t < n; ++t) {
    const auto j = static_cast<std::size_t>(keys[t]);
    const Entry e = entry(fr.weights[j], dp.ball(j), dpabs.ball(j), st);
    dS[t] = e.dS, A[t] = e.A;
    const double* k = K + keys[t] * Dk;
    if (whole) {
      kr[t] = m.kc.data() + (head * c.Nk + keys[t]) * Dk;
    } else {
      double* row = kc.data() + t * static_cast<std::size_t>(Dk);
      for (std::int64_t ci = 0; ci < Dk; ++ci) row[ci] = centred[static_cast<std::size_t>(ci)] ? k[ci] - k0[ci] : k[ci];
      kr[t] = row;
    }
    akr[t] = AK + keys[t] * Dk;
  }
  val.add(n, dS.data(), kr.data());
  bnd.add(n, A.data(), akr.data());
  dq = DecidedGrad{};
  const auto base = static_cast<std::int64_t>(r) * Dk;
  for (std::int64_t cc = 0; cc < Dk; ++cc) {
    const auto ci = static_cast<std::size_t>(cc);
    if (!m.decide_element("dq", base + cc, scaled(m.s.scale, val.ball(ci)), scaled(m.abs_scale, bnd.ball(ci)), dq))
      return false;
  }
  return true;
}

bool FastBackward::key(std::int64_t b, std::int64_t g, std::int64_t j, DecidedGrad& dk, DecidedGrad& dv) const {
  const Impl& m = *impl_;
  const Case& c = m.c;
  const std::int64_t Dk = c.Dk, Dv = c.Dv, G = c.Hq / c.Hkv;
  const std::size_t key = static_cast<std::size_t>((b * c.Hkv + g) * c.Nk + j);
  const double* k = c.k.values.data() + key * static_cast<std::size_t>(Dk);
  const double* v = c.v.values.data() + key * static_cast<std::size_t>(Dv);
  BallSums kval(static_cast<std::size_t>(c.want_dk ? Dk : 0)), kbnd(kval.size());
  BallSums vval(static_cast<std::size_t>(c.want_dv ? Dv : 0)), vbnd(vval.size());
  std::vector<double> av(static_cast<std::size_t>(Dv));
  absolute(v, Dv, av.data());  // the key's |v|, once for all its rows
  // q_r . k_j, dP = dout_r . v_j and sum_c |dout_rc v_jc| for every row r of the kv head's query
  // heads, in lanes.
  const std::int64_t head = b * c.Hkv + g, blocks = key_blocks(G * c.Nq), kb = kKeyBlock;
  DotLanes qk, dp, dpabs;
  qk.run(k, m.qt.data() + head * blocks * Dk * kb, Dk, blocks);
  dp.run(v, m.doutt.data() + head * blocks * Dv * kb, Dv, blocks);
  dpabs.run(av.data(), m.adoutt.data() + head * blocks * Dv * kb, Dv, blocks);
  // The rows that see key j and the arguments of their weights, then the weights' exp_dd in lanes.
  std::vector<std::size_t> rows, slots;
  std::vector<Ball> x;
  std::vector<double> xh, xl;
  for (std::int64_t h = g * G; h < (g + 1) * G; ++h)
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      if (!c.query_valid(b, i) || !c.allowed(b, h, i, j)) continue;  // row_has_key follows
      const std::size_t r = m.row_id(b, h, i), a = static_cast<std::size_t>((h - g * G) * c.Nq + i);
      const RowStat& st = m.stats[r];
      if (!st.ok) return false;
      Ball xa;
      if (!m.exponent(b, h, i, j, qk.ball(a), st, xa)) return false;
      rows.push_back(r), slots.push_back(a), x.push_back(xa);
      xh.push_back(xa.mid.hi < kExpMin ? 0 : xa.mid.hi), xl.push_back(xa.mid.hi < kExpMin ? 0 : xa.mid.lo);
    }
  const std::size_t n = rows.size();
  std::vector<double> eh(n), el(n);
  exp_dd_many(xh.data(), xl.data(), n, eh.data(), el.data());
  std::vector<Ball> P(n), dS(n), A(n);
  std::vector<const double*> qr(n), aqr(n), dr(n), adr(n);
  for (std::size_t t = 0; t < n; ++t) {
    // exp(x): exp_ball on exp_dd of the midpoint, or [0, kTinyExp] below kExpMin (ball.hpp)
    P[t] = x[t].mid.hi < kExpMin ? Ball{DD{}, kTinyExp} : exp_ball(x[t], DD{eh[t], el[t]});
    const Entry e = entry(P[t], dp.ball(slots[t]), dpabs.ball(slots[t]), m.stats[rows[t]]);
    dS[t] = e.dS, A[t] = e.A;
    qr[t] = c.q.values.data() + rows[t] * static_cast<std::size_t>(Dk);
    aqr[t] = m.aq.data() + rows[t] * static_cast<std::size_t>(Dk);
    dr[t] = m.dout_row(rows[t]);
    adr[t] = m.adout.data() + rows[t] * static_cast<std::size_t>(Dv);
  }
  if (kval.size()) {
    kval.add(n, dS.data(), qr.data());
    kbnd.add(n, A.data(), aqr.data());
  }
  if (vval.size()) {
    vval.add(n, P.data(), dr.data());
    vbnd.add(n, P.data(), adr.data());
  }
  dk = DecidedGrad{};
  dv = DecidedGrad{};
  for (std::size_t cc = 0; cc < kval.size(); ++cc)
    if (!m.decide_element("dk", static_cast<std::int64_t>(key) * Dk + static_cast<std::int64_t>(cc),
                          scaled(m.s.scale, kval.ball(cc)), scaled(m.abs_scale, kbnd.ball(cc)), dk))
      return false;
  for (std::size_t cc = 0; cc < vval.size(); ++cc)
    if (!m.decide_element("dv", static_cast<std::int64_t>(key) * Dv + static_cast<std::int64_t>(cc),
                          vval.ball(cc), vbnd.ball(cc), dv))
      return false;
  return true;
}

bool FastBackward::bias(std::int64_t bb, std::int64_t hb, std::int64_t jb, DecidedGrad& db) const {
  const Impl& m = *impl_;
  const Case& c = m.c;
  const auto& shape = c.bias->shape;
  std::int64_t ext[4];
  for (std::size_t a = 0; a < 4; ++a) ext[a] = a + shape.size() >= 4 ? shape[a + shape.size() - 4] : 1;
  const std::int64_t Eh = ext[1], Ei = ext[2], Ej = ext[3], Dv = c.Dv;
  // The dimensions the bias was broadcast along are summed whole, the others are this unit's.
  auto span = [](std::int64_t e, std::int64_t x, std::int64_t full) {
    return e == 1 ? std::pair<std::int64_t, std::int64_t>{0, full - 1} : std::pair{x, x};
  };
  const auto [b0, b1] = span(ext[0], bb, c.B);
  const auto [h0, h1] = span(Eh, hb, c.Hq);
  const auto [j0, j1] = span(Ej, jb, c.Nk);
  std::vector<BallSums> val(static_cast<std::size_t>(Ei), BallSums(1)), bnd(val.size(), BallSums(1));
  std::vector<double> adout(static_cast<std::size_t>(Dv)), av(static_cast<std::size_t>(Dv));
  for (std::int64_t b = b0; b <= b1; ++b)
    for (std::int64_t h = h0; h <= h1; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        if (!c.query_valid(b, i) || !c.row_has_key(b, h, i)) continue;
        const std::size_t r = m.row_id(b, h, i);
        const RowStat& st = m.stats[r];
        if (!st.ok) return false;
        const double* q = c.q.values.data() + r * static_cast<std::size_t>(c.Dk);
        const double* dout = m.dout_row(r);
        for (std::int64_t cc = 0; cc < Dv; ++cc) adout[static_cast<std::size_t>(cc)] = std::fabs(dout[cc]);
        const std::int64_t g = c.kv_head(h);
        const auto slot = static_cast<std::size_t>(Ei == 1 ? 0 : i);
        for (std::int64_t j = j0; j <= j1; ++j) {
          if (!c.allowed(b, h, i, j)) continue;
          const std::size_t key = static_cast<std::size_t>((b * c.Hkv + g) * c.Nk + j);
          const double* v = c.v.values.data() + key * static_cast<std::size_t>(Dv);
          Ball P;
          if (!m.weight(b, h, i, j, q, c.k.values.data() + key * static_cast<std::size_t>(c.Dk), st, P)) return false;
          absolute(v, Dv, av.data());
          const Entry e = entry(P, dout, adout.data(), v, av.data(), Dv, st);
          val[slot].add(e.dS, kOne);
          bnd[slot].add(e.A, kOne);
        }
      }
  db = DecidedGrad{};
  for (std::int64_t ib = 0; ib < Ei; ++ib) {
    const auto sl = static_cast<std::size_t>(ib);
    // Along the keys whole (Ej = 1), each row of dS sums to 0 exactly (no sinks here).
    const Ball v = Ej == 1 ? Ball{} : val[sl].ball(0);
    if (!m.decide_element("dbias", ((bb * Eh + hb) * Ei + ib) * Ej + jb, v, bnd[sl].ball(0), db)) return false;
  }
  return true;
}

}  // namespace attnoracle::fast
