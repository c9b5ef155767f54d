// The gradients' error terms (TOLERANCE.md, "Gradients"), computed in double from the inputs and
// the golden out: a magnitude to within a few ulps of double, far inside the safety factor.
#include <cmath>
#include <cstdlib>

#include "attnoracle/conformance/tolerance.hpp"

namespace attnoracle::conformance {

namespace {
double sq(double x) { return x * x; }
void size_spread(GradientSpread& s, std::size_t n) {
  s.random.assign(n, 0);
  s.floor.assign(n, 0);
}
}  // namespace

GradientErrors gradient_errors(const Profile& p, const Case& c, const std::vector<RowMagnitudes>& mags,
                               const std::vector<RowLimits>& limits, const std::vector<double>& out_ref,
                               const std::vector<double>& out_bound, const std::vector<double>& vsum,
                               const std::vector<double>& out_spread) {
  const std::int64_t H = c.Hq, Hk = c.Hkv, Nq = c.Nq, Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
  const double sscale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double scale = std::fabs(sscale);
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  const double us = unit_roundoff(p.softmax), ug = unit_roundoff(p.grad_accum);
  const double u_dp = unit_roundoff(p.grad_dp), u_ds = unit_roundoff(p.grad_ds);
  const double u_out = unit_roundoff(c.dtype_of("out"));
  GradientErrors g;
  g.dq.assign(static_cast<std::size_t>(c.B * H * Nq * Dk), 0);
  g.dk.assign(static_cast<std::size_t>(c.B * Hk * Nk * Dk), 0);
  g.dv.assign(static_cast<std::size_t>(c.B * Hk * Nk * Dv), 0);
  if (c.bias) g.dbias.assign(c.bias->values.size(), 0);
  if (c.sinks) g.dsinks.assign(static_cast<std::size_t>(H), 0);
  size_spread(g.dq_spread, g.dq.size());
  size_spread(g.dk_spread, g.dk.size());
  size_spread(g.dv_spread, g.dv.size());
  size_spread(g.dbias_spread, g.dbias.size());
  size_spread(g.dsinks_spread, g.dsinks.size());
  // The statistical model's parts of the roundings (statistics.cpp's weight_spread, per key).
  const double uq = unit_roundoff(p.qk_accum), up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double ub = p.bias ? unit_roundoff(*p.bias) : 0;
  const double dot_k = std::sqrt(static_cast<double>(Dk) + 2) * uq * scale;
  const double root_dv = std::sqrt(static_cast<double>(Dv) + 1);
  // Dropout: dP and Z = P keep / (1 - p) carry the keep scale, kept keys only; its relative
  // error (formed in `softmax`) and one product by it on each (TOLERANCE.md, "Dropout").
  const double keep_scale = c.dropout ? 1 / (1 - std::strtod(c.dropout->p.c_str(), nullptr)) : 1;
  const double u_keep = dropout_product_error(p, c), e_keep = dropout_scale_error(p, c) + u_keep;
  std::vector<double> kc(static_cast<std::size_t>(Nk), 1.0);
  std::vector<double> s(static_cast<std::size_t>(Nk)), t(s), P(s), a(s), dabs(s), own(s), dS(s);
  std::vector<char> on(s.size());
  std::vector<double> sum_p(static_cast<std::size_t>(Dk)), sum_s(sum_p), osq(sum_p), flr(sum_p);
  std::vector<double> b_p(g.dbias.size()), b_s(b_p), b_osq(b_p), b_fl(b_p);
  std::vector<char> b_on(g.dbias.size());
  std::vector<std::size_t> touched;
  // Rotary: the kernel's rotated k (in dq) and q (in dk) are off by eps_rot on their magnitudes.
  const double e_rot = rotary_rel(p, c);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!c.query_valid(b, i)) continue;  // padding rows: gradient 0, no contribution
        const auto row = static_cast<std::size_t>((b * H + h) * Nq + i);
        const RowLimits& L = limits[row];
        const RowMagnitudes& m = mags[row];
        const std::int64_t gk = c.kv_head(h);
        const double* q = &c.q.values[row * static_cast<std::size_t>(Dk)];
        const double* dout = &c.dout->values[row * static_cast<std::size_t>(Dv)];
        const double* kb = &c.k.values[static_cast<std::size_t>((b * Hk + gk) * Nk * Dk)];
        const double* vb = &c.v.values[static_cast<std::size_t>((b * Hk + gk) * Nk * Dv)];
        const Case::KeyRange r = c.key_range(b, i);
        double mx = -INFINITY;
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          on[jj] = c.allowed(b, h, i, j);
          if (!on[jj]) continue;
          double dot = 0, da = 0;
          for (std::int64_t d = 0; d < Dk; ++d) {
            dot += q[d] * kb[j * Dk + d];
            da += std::fabs(q[d] * kb[j * Dk + d]);
          }
          dabs[jj] = da;
          double T = sscale * dot;
          t[jj] = 1;
          if (cap > 0) {
            const double th = std::tanh(T / cap);
            T = cap * th;
            t[jj] = 1 - th * th;
          }
          s[jj] = T + c.bias_at(b, h, i, j);
          mx = std::max(mx, s[jj]);
          // weight j's own relative error: the dot, scale and softcap, the bias's rounding, the
          // rounding into `softmax` of T and of S (the subtraction, exp, division and P's
          // rounding follow once the row's maximum is known)
          const double ebias = ub * (s[jj] - T);
          own[jj] = sq(dot_k * da) + sq(ebias) + sq(us * T) + sq(us * s[jj]);
        }
        // No allowed key: gradient 0 under policy zero; with a sink O = 0, so D = 0 and the row
        // adds 0 to dsinks.
        if (mx == -INFINITY) continue;
        if (c.sinks) mx = std::max(mx, c.sink(h));
        double Z = c.sinks ? std::exp(c.sink(h) - mx) : 0, R = 0, A = 0;
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (on[static_cast<std::size_t>(j)]) Z += P[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - mx);
        const double lse = mx + std::log(Z);
        // P's common relative error in the row (the statistical tier): sum_j P_j eps_j of the
        // forward's weights, Z's summation u_sm sqrt(sum W_k^2) (the sink's term first), log's
        // own on log n, lse's addition of the maximum and its rounding into `softmax` (P
        // recomputed from it); each a sum of independent roundings, in quadrature.
        const double sink_own = c.sinks ? sq(us * (c.sink(h) - lse)) + sq(p.exp_ulps * us) + sq(us) + sq(up) : 0;
        double key_sq = 0, W = c.sinks ? std::exp(c.sink(h) - mx) / Z : 0, zp = sq(W);
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          if (!on[jj]) continue;
          P[jj] /= Z;
          // |S - lse| >= |S - m|: the subtraction of either, then exp, the division, P's rounding
          own[jj] = std::sqrt(own[jj] + sq(us * (s[jj] - lse)) + sq(p.exp_ulps * us) + sq(us) + sq(up));
          key_sq += sq(P[jj] * own[jj]);
          W += P[jj];
          zp += sq(W);
          a[jj] = dS[jj] = 0;
          for (std::int64_t e = 0; e < Dv; ++e) {
            a[jj] += std::fabs(dout[e] * vb[j * Dv + e]);
            dS[jj] += dout[e] * vb[j * Dv + e];  // dP_ij, made dS_ij below
          }
          if (c.dropout) {  // dP = (dout V^T) keep / (1 - p)
            kc[jj] = c.kept(b, h, i, j) ? keep_scale : 0;
            a[jj] *= kc[jj];
            dS[jj] *= kc[jj];
          }
          R += P[jj] * a[jj];
          A += a[jj];
        }
        // D_i = sum_c dout_c O_c, from the forward's out (each O_c within its own limit before S)
        // in Dv + 1 roundings, or as sum_j P_j dP_j (a softmax's backward) in n + 1 roundings on
        // R = sum_j P_j a_j with P's and dP's errors: E covers either.
        const double n = L.keys;
        // P as the forward rounded it (weight_rel) or recomputed as exp(S - lse): S's and lse's
        // errors (steps 1 and 5) and one exp, which these terms bound.
        const double p_rel = L.weight_rel + p.exp_ulps * us * (1 + m.score_abs) + us * (2 * m.score_abs + std::log(n) + 1);
        const double p_abs = L.p_sub + min_subnormal(p.softmax) / 2 + min_subnormal(p.grad_ds) / 2;
        double o = 0, E_flash = 0, Dx = 0;
        for (std::int64_t e = 0; e < Dv; ++e) {
          const std::size_t k = row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e);
          const double vs = vsum.empty() ? 0 : vsum[k];
          o += std::fabs(dout[e] * out_ref[k]);
          Dx += dout[e] * out_ref[k];
          E_flash += std::fabs(dout[e]) * (out_compute(L, out_bound[k], vs) + u_out * std::fabs(out_ref[k]));
        }
        E_flash += (static_cast<double>(Dv) + 1) * ug * o;
        const double E_math = ((n + 1) * ug + p_rel + (static_cast<double>(Dv) + 1) * ug + u_dp + e_keep) * R + p_abs * A;
        const double E = std::max(E_flash, E_math);
        if (c.sinks) key_sq += sq(std::exp(c.sink(h) - mx) / Z) * sink_own;
        const double pc = std::sqrt(key_sq + sq(us * std::sqrt(zp)) + sq(p.exp_ulps * us * std::log(n)) +
                                    2 * sq(us * lse));
        // D_i's random part: from the implementation's out (each element's statistical bound,
        // the elements of a row dependent: added linearly) and its Dv + 1 roundings, or as
        // sum_j P_j dP_j (P's common relative error c makes it (1 + c) D, the own errors and dP's roundings of the keys in
        // quadrature, the n + 1 roundings of the sum); its underflow part stays in E_fl.
        double Es_flash = root_dv * ug * o, Es_math_sq = 0;
        for (std::int64_t e = 0; e < Dv; ++e) {
          const std::size_t k = row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e);
          const double vs = vsum.empty() ? 0 : vsum[k];
          Es_flash += std::fabs(dout[e]) * (out_spread.empty() ? out_compute(L, out_bound[k], vs) + u_out * std::fabs(out_ref[k])
                                                               : out_spread[k]);
        }
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (on[static_cast<std::size_t>(j)]) {
            const auto jj = static_cast<std::size_t>(j);
            Es_math_sq += sq(P[jj] * a[jj]) * (sq(own[jj]) + (static_cast<double>(Dv) + 1) * sq(ug) + sq(u_dp) + sq(u_keep));
          }
        const double Es = std::max(Es_flash, pc * std::fabs(Dx) + std::sqrt(Es_math_sq) + std::sqrt(n + 1) * ug * R);
        const double E_fl = p_abs * A;
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (on[static_cast<std::size_t>(j)]) dS[static_cast<std::size_t>(j)] = P[static_cast<std::size_t>(j)] * (dS[static_cast<std::size_t>(j)] - Dx);
        // dS = P (dP - D): P's error on |dP - D| <= a_j + o, dP's Dv + 1 roundings and its rounding
        // to grad_dp, the subtraction and product (2 u_g), dS rounded to grad_ds.
        const double c1 = p_rel + (static_cast<double>(Dv) + 3) * ug + u_dp + u_ds + e_keep;
        // softcap: 1 - tanh^2(T/c) from a tanh off by score/c (tanh' <= 1) and exp_ulps, squared
        // and subtracted: an absolute error of at most twice that.
        const double f_abs = cap > 0 ? 2 * L.score / cap + 2 * (p.exp_ulps + 1) * us : 0;
        double* dq = &g.dq[row * static_cast<std::size_t>(Dk)];
        std::fill(sum_p.begin(), sum_p.end(), 0.0);
        std::fill(sum_s.begin(), sum_s.end(), 0.0);
        std::fill(osq.begin(), osq.end(), 0.0);
        std::fill(flr.begin(), flr.end(), 0.0);
        touched.clear();
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          if (!on[jj]) continue;
          const double M = P[jj] * (a[jj] + o);
          const double d_ds = c1 * M + P[jj] * E + p_abs * (a[jj] + o);
          const double d_dt = d_ds * t[jj] + M * f_abs;
          // The statistical tier's dS_ij: the row's common part (D's error dD takes -P_ij dD, P's
          // common relative error c makes dS c dS: to first order one variable each for the whole
          // row, so a sum over the row's keys takes them on the signed sums), its own roundings
          // (P's, dP's Dv + 1 and its rounding to grad_dp, the subtraction, the product, dS's
          // rounding to grad_ds; in quadrature, independent of the other keys'), and the
          // underflow terms.
          const double Cs = P[jj] * Es + pc * std::fabs(dS[jj]);
          const double Os = P[jj] * std::sqrt(sq(own[jj] * (a[jj] + o)) + (static_cast<double>(Dv) + 1) * sq(ug * a[jj]) +
                                              sq(u_dp * a[jj]) + sq(u_keep * a[jj]) + (2 * sq(ug) + sq(u_ds)) * sq(a[jj] + o));
          const double Fs = p_abs * (a[jj] + o) + P[jj] * E_fl;
          // dT = dS t, the softcap's factor off by f_abs (the key's own tanh)
          const double C = Cs * t[jj], O = std::hypot(Os * t[jj], M * f_abs), F = Fs * t[jj];
          const std::size_t kj = static_cast<std::size_t>((b * Hk + gk) * Nk + j);
          for (std::int64_t d = 0; d < Dk; ++d) {
            const double ak = scale * std::fabs(kb[j * Dk + d]), aq = scale * std::fabs(q[d]);
            dq[d] += d_dt * ak;
            if (e_rot > 0) {  // |dT| <= M t on a k (q) off by eps_rot km (qm)
              const auto row_d = row * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d);
              dq[d] += e_rot * M * t[jj] * scale * c.rotary->k_mag[kj * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d)];
              g.dk[kj * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d)] +=
                  e_rot * M * t[jj] * scale * c.rotary->q_mag[row_d];
            }
            sum_p[static_cast<std::size_t>(d)] += P[jj] * t[jj] * kb[j * Dk + d];
            sum_s[static_cast<std::size_t>(d)] += dS[jj] * t[jj] * kb[j * Dk + d];
            osq[static_cast<std::size_t>(d)] += sq(O * ak);
            flr[static_cast<std::size_t>(d)] += F * ak;
            const std::size_t kd = kj * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d);
            g.dk[kd] += d_dt * aq;
            // the rows of a kv head's group are independent: one row's part, squared
            g.dk_spread.random[kd] += sq((C + O) * aq);
            g.dk_spread.floor[kd] += F * aq;
          }
          // dv = P^T dout with P off by p_rel, rounded to grad_ds, and P's underflow; under dropout
          // Z = P kc in its place (a dropped key adds 0; a kept one P's errors times the scale,
          // and the scale's own)
          const double pr = P[jj] * kc[jj] * (pc + std::hypot(std::hypot(own[jj], u_ds), u_keep));
          const double z_abs = p_abs * kc[jj];
          for (std::int64_t e = 0; e < Dv; ++e) {
            const std::size_t ke = kj * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e);
            g.dv[ke] += ((p_rel + u_ds + e_keep) * P[jj] * kc[jj] + z_abs) * std::fabs(dout[e]);
            g.dv_spread.random[ke] += sq(pr * dout[e]);
            g.dv_spread.floor[ke] += z_abs * std::fabs(dout[e]);
          }
          if (c.bias) {
            const std::size_t bi = c.bias_index(b, h, i, j);
            g.dbias[bi] += d_ds;
            // within the row the common parts on the signed sums, the own ones in quadrature
            if (!b_on[bi]) touched.push_back(bi);
            b_on[bi] = 1;
            b_p[bi] += P[jj];  // dbias takes dS, not dT
            b_s[bi] += dS[jj];
            b_osq[bi] += sq(Os);
            b_fl[bi] += Fs;
          }
        }
        for (std::int64_t d = 0; d < Dk; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          g.dq_spread.random[row * static_cast<std::size_t>(Dk) + ud] =
              scale * (Es * std::fabs(sum_p[ud]) + pc * std::fabs(sum_s[ud])) + std::sqrt(osq[ud]);
          g.dq_spread.floor[row * static_cast<std::size_t>(Dk) + ud] = flr[ud];
        }
        if (c.rotary) {  // dq = R^T dq' (TOLERANCE.md, "Rotary embedding")
          const std::int64_t pos = rotary_query_position(c, b, i);
          const std::size_t at = row * static_cast<std::size_t>(Dk);
          for (std::vector<double>* e : {&g.dq, &g.dq_spread.random, &g.dq_spread.floor}) rotate_back_errors(c, pos, e->data() + at);
        }
        for (const std::size_t bi : touched) {
          g.dbias_spread.random[bi] += sq(Es * std::fabs(b_p[bi]) + pc * std::fabs(b_s[bi]) + std::sqrt(b_osq[bi]));
          g.dbias_spread.floor[bi] += b_fl[bi];
          b_p[bi] = b_s[bi] = b_osq[bi] = b_fl[bi] = 0;
          b_on[bi] = 0;
        }
        // dsinks[h] -= P_sink D: P_sink = exp(sink - lse) off by p_rel (S exact here, lse's error
        // and one exp) and p_abs, D off by E, the product rounded to grad_ds.
        if (c.sinks) {
          const double ps = std::exp(c.sink(h) - mx) / Z;
          g.dsinks[static_cast<std::size_t>(h)] += (p_rel + u_ds) * ps * o + ps * E + p_abs * o;
          g.dsinks_spread.random[static_cast<std::size_t>(h)] +=
              sq(ps * ((pc + std::sqrt(sink_own + sq(u_ds))) * o + Es));
          g.dsinks_spread.floor[static_cast<std::size_t>(h)] += p_abs * o + ps * E_fl;
        }
      }
  // dk, dv, dbias, dsinks summed squares over independent rows: their roots
  for (GradientSpread* sp : {&g.dk_spread, &g.dv_spread, &g.dbias_spread, &g.dsinks_spread})
    for (double& x : sp->random) x = std::sqrt(x);
  if (c.rotary)  // dk = R^T dk', key j at position j
    for (std::int64_t kj = 0; kj < c.B * Hk * Nk; ++kj) {
      const std::size_t at = static_cast<std::size_t>(kj * Dk);
      for (std::vector<double>* e : {&g.dk, &g.dk_spread.random, &g.dk_spread.floor})
        rotate_back_errors(c, kj % Nk, e->data() + at);
    }
  return g;
}

MhaGradientErrors mha_gradient_errors(const Profile& p, const Case& c, const std::vector<RowLimits>& limits) {
  const std::int64_t B = c.B, H = c.Hq, Nq = c.Nq, Nk = c.Nk, D = c.D, Dk = c.Dk, Dv = c.Dv, Do = c.Dout;
  const auto z = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const double ug = unit_roundoff(p.grad_accum), uq = unit_roundoff(p.qk_accum);
  // a projection's element: D products summed in qk_accum, rounded to `projection`
  const double e_p = (static_cast<double>(D) + 1) * uq + unit_roundoff(p.projection);
  // O_h kept in pv_accum or `projection` before W_o and dw_o
  const double u_o = std::max(unit_roundoff(p.pv_accum), unit_roundoff(p.projection));
  const double sscale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double scale = std::fabs(sscale);
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  // X W per head [B, H, N, E], on values or on magnitudes
  auto project = [&](const FloatTensor& x, const FloatTensor& w, std::int64_t N, std::int64_t E, bool abs) {
    std::vector<double> r(z(B * H * N * E));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t n = 0; n < N; ++n)
          for (std::int64_t d = 0; d < D; ++d) {
            const double xv = x.values[z((b * N + n) * D + d)];
            for (std::int64_t e = 0; e < E; ++e) {
              const double wv = w.values[z((h * D + d) * E + e)];
              r[z(((b * H + h) * N + n) * E + e)] += abs ? std::fabs(xv * wv) : xv * wv;
            }
          }
    return r;
  };
  // Each head as a case of kind sdpa (Hq = Hkv = H) on the exact projections, dout -> dO_h.
  Case s;
  s.path = c.path;
  s.input_dtype = c.input_dtype;
  s.output_dtype = c.output_dtype;
  s.output_dtypes = c.output_dtypes;
  s.scale = c.scale;
  s.softcap = c.softcap;
  s.causal = c.causal;
  s.window = c.window;
  s.window_left = c.window_left;
  s.window_right = c.window_right;
  s.masked_rows = c.masked_rows;
  s.B = B, s.Hq = s.Hkv = H, s.Nq = Nq, s.Nk = Nk, s.Dk = Dk, s.Dv = Dv;
  s.q = {c.x_q.dtype, {B, H, Nq, Dk}, project(c.x_q, c.w_q, Nq, Dk, false)};
  s.k = {c.x_kv.dtype, {B, H, Nk, Dk}, project(c.x_kv, c.w_k, Nk, Dk, false)};
  s.v = {c.x_kv.dtype, {B, H, Nk, Dv}, project(c.x_kv, c.w_v, Nk, Dv, false)};
  s.mask = c.mask;
  s.bias = c.bias;
  s.query_mask = c.query_mask;
  s.seqlens_q = c.seqlens_q;
  s.seqlens_k = c.seqlens_k;
  s.sinks = c.sinks;
  const std::vector<double> qa = project(c.x_q, c.w_q, Nq, Dk, true), ka = project(c.x_kv, c.w_k, Nk, Dk, true);
  const std::vector<double> va = project(c.x_kv, c.w_v, Nk, Dv, true);
  // dO_h = dout W_o[h Dv .. h Dv + Dv)^T, Do products in grad_accum: eO = (Do + 1) u_g sum |dout| |W_o|.
  std::vector<double> dO(z(B * H * Nq * Dv)), eO(dO.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Nq; ++i) {
      if (!c.query_valid(b, i)) continue;  // padding rows' dout reaches nothing
      const double* dr = &c.dout->values[z((b * Nq + i) * Do)];
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t cc = 0; cc < Dv; ++cc) {
          const double* wo = &c.w_o.values[z((h * Dv + cc) * Do)];
          double x = 0, a = 0;
          for (std::int64_t e = 0; e < Do; ++e) {
            x += dr[e] * wo[e];
            a += std::fabs(dr[e] * wo[e]);
          }
          dO[z(((b * H + h) * Nq + i) * Dv + cc)] = x;
          eO[z(((b * H + h) * Nq + i) * Dv + cc)] = (static_cast<double>(Do) + 1) * ug * a;
        }
    }
  s.dout = FloatTensor{c.dout->dtype, {B, H, Nq, Dv}, dO};
  // Per head row: P, O_h and its bound sum_j P |V|, in double; the rows' limits are the token's
  // (row_limits of kind mha: the heads' maximum, the projections' errors included).
  const std::vector<RowMagnitudes> mags = row_magnitudes(s);
  std::vector<RowLimits> lim(z(B * H * Nq));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i) lim[z((b * H + h) * Nq + i)] = limits[z(b * Nq + i)];
  bool underflows = false;
  for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
  const std::vector<double> vsum = underflows ? out_value_sum(s) : std::vector<double>{};
  std::vector<double> O(z(B * H * Nq * Dv)), Ob(O.size()), eOut(O.size());
  // first-order terms the per-head analysis does not see: dO's rounding eO and the projections'
  // e_p on K, Q (in dq, dk) and V (in dP)
  std::vector<double> xdq(s.q.values.size()), xdk(s.k.values.size()), xdv(s.v.values.size());
  std::vector<double> xdbias(c.bias ? c.bias->values.size() : 0), xdsinks(c.sinks ? z(H) : 0);
  std::vector<double> S(z(Nk)), P(S), t(S);
  std::vector<char> on(S.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!c.query_valid(b, i)) continue;
        const std::size_t row = z((b * H + h) * Nq + i);
        const double* q = &s.q.values[row * z(Dk)];
        const double* kb = &s.k.values[z((b * H + h) * Nk * Dk)];
        const double* vb = &s.v.values[z((b * H + h) * Nk * Dv)];
        const Case::KeyRange r = c.key_range(b, i);
        double mx = -INFINITY;
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = z(j);
          on[jj] = c.allowed(b, h, i, j);
          if (!on[jj]) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < Dk; ++d) dot += q[d] * kb[j * Dk + d];
          double T = sscale * dot;
          t[jj] = 1;
          if (cap > 0) {
            const double th = std::tanh(T / cap);
            T = cap * th;
            t[jj] = 1 - th * th;
          }
          S[jj] = T + c.bias_at(b, h, i, j);
          mx = std::max(mx, S[jj]);
        }
        if (mx == -INFINITY) continue;  // no allowed key: gradient 0, O_h = 0
        if (c.sinks) mx = std::max(mx, c.sink(h));
        double Z = c.sinks ? std::exp(c.sink(h) - mx) : 0;
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (on[z(j)]) Z += P[z(j)] = std::exp(S[z(j)] - mx);
        double* o = &O[row * z(Dv)];
        double* ob = &Ob[row * z(Dv)];
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          if (!on[z(j)]) continue;
          P[z(j)] /= Z;
          for (std::int64_t e = 0; e < Dv; ++e) {
            o[e] += P[z(j)] * vb[j * Dv + e];
            ob[e] += P[z(j)] * std::fabs(vb[j * Dv + e]);
          }
        }
        const RowLimits& L = lim[row];
        const double* d_o = &dO[row * z(Dv)];
        const double* e_o = &eO[row * z(Dv)];
        double oabs = 0, eoo = 0;
        for (std::int64_t e = 0; e < Dv; ++e) {
          const std::size_t k = row * z(Dv) + z(e);
          // O_h within its forward limit (before the output's rounding), then kept in u_o
          eOut[k] = out_compute(L, ob[e], vsum.empty() ? 0 : vsum[k]) + u_o * ob[e];
          oabs += std::fabs(d_o[e] * o[e]);
          eoo += e_o[e] * std::fabs(o[e]);
        }
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = z(j);
          if (!on[jj]) continue;
          double a = 0, x = eoo;
          for (std::int64_t e = 0; e < Dv; ++e) {
            a += std::fabs(d_o[e] * vb[j * Dv + e]);
            // dP and D from the rounded dO; dP from the rounded V
            x += e_o[e] * std::fabs(vb[j * Dv + e]) + e_p * std::fabs(d_o[e]) * va[z((b * H + h) * Nk + j) * z(Dv) + z(e)];
          }
          const double M = P[jj] * (a + oabs), X = P[jj] * x;
          for (std::int64_t d = 0; d < Dk; ++d) {
            const std::size_t kd = z((b * H + h) * Nk + j) * z(Dk) + z(d);
            xdq[row * z(Dk) + z(d)] += scale * t[jj] * (X * std::fabs(kb[j * Dk + d]) + M * e_p * ka[kd]);
            xdk[kd] += scale * t[jj] * (X * std::fabs(q[d]) + M * e_p * qa[row * z(Dk) + z(d)]);
          }
          for (std::int64_t e = 0; e < Dv; ++e) xdv[z((b * H + h) * Nk + j) * z(Dv) + z(e)] += P[jj] * e_o[e];
          if (c.bias) xdbias[c.bias_index(b, h, i, j)] += X;
        }
        if (c.sinks) xdsinks[z(h)] += std::exp(c.sink(h) - mx) / Z * eoo;
      }
  const GradientErrors ge = gradient_errors(p, s, mags, lim, O, Ob, vsum);
  const bool self = c.self_attention;
  MhaGradientErrors g;
  auto sized = [](std::vector<double>& v, GradientSpread& sp, std::size_t n) {
    v.assign(n, 0);
    sp.random.assign(n, 0);
    sp.floor.assign(n, 0);
  };
  sized(g.dx_q, g.dx_q_spread, c.x_q.values.size());
  if (!self) sized(g.dx_kv, g.dx_kv_spread, c.x_kv.values.size());
  sized(g.dw_q, g.dw_q_spread, c.w_q.values.size());
  sized(g.dw_k, g.dw_k_spread, c.w_k.values.size());
  sized(g.dw_v, g.dw_v_spread, c.w_v.values.size());
  sized(g.dw_o, g.dw_o_spread, c.w_o.values.size());
  // dx_q, dx_kv: per token, over the heads (independent: in quadrature) and their columns (one
  // head's columns share the row's common parts: added linearly).
  auto through = [&](std::vector<double>& err, GradientSpread& sp, std::int64_t N, const std::vector<double>& e1,
                     const std::vector<double>& x1, const GradientSpread& s1, const FloatTensor& w1, std::int64_t E1,
                     const std::vector<double>* e2, const std::vector<double>* x2, const GradientSpread* s2,
                     const FloatTensor* w2, std::int64_t E2) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::size_t k = z((b * N + n) * D + d);
          double rsq = 0;
          for (std::int64_t h = 0; h < H; ++h) {
            double rh = 0;
            for (std::int64_t cc = 0; cc < E1; ++cc) {
              const std::size_t m = z(((b * H + h) * N + n) * E1 + cc);
              const double w = std::fabs(w1.values[z((h * D + d) * E1 + cc)]);
              err[k] += (e1[m] + x1[m]) * w;
              rh += (s1.random[m] + x1[m]) * w;
              sp.floor[k] += s1.floor[m] * w;
            }
            for (std::int64_t cc = 0; e2 && cc < E2; ++cc) {
              const std::size_t m = z(((b * H + h) * N + n) * E2 + cc);
              const double w = std::fabs(w2->values[z((h * D + d) * E2 + cc)]);
              err[k] += ((*e2)[m] + (*x2)[m]) * w;
              rh += (s2->random[m] + (*x2)[m]) * w;
              sp.floor[k] += s2->floor[m] * w;
            }
            rsq += sq(rh);
          }
          sp.random[k] += rsq;
        }
  };
  through(g.dx_q, g.dx_q_spread, Nq, ge.dq, xdq, ge.dq_spread, c.w_q, Dk, nullptr, nullptr, nullptr, nullptr, 0);
  if (self) {  // x is the keys too: add dx_kv's terms (the same rows, so linearly per head)
    MhaGradientErrors t2;
    sized(t2.dx_kv, t2.dx_kv_spread, c.x_kv.values.size());
    through(t2.dx_kv, t2.dx_kv_spread, Nk, ge.dk, xdk, ge.dk_spread, c.w_k, Dk, &ge.dv, &xdv, &ge.dv_spread, &c.w_v, Dv);
    for (std::size_t k = 0; k < g.dx_q.size(); ++k) {
      g.dx_q[k] += t2.dx_kv[k];
      g.dx_q_spread.random[k] = sq(std::sqrt(g.dx_q_spread.random[k]) + std::sqrt(t2.dx_kv_spread.random[k]));
      g.dx_q_spread.floor[k] += t2.dx_kv_spread.floor[k];
    }
  } else {
    through(g.dx_kv, g.dx_kv_spread, Nk, ge.dk, xdk, ge.dk_spread, c.w_k, Dk, &ge.dv, &xdv, &ge.dv_spread, &c.w_v, Dv);
  }
  // dw_q, dw_k, dw_v: over the tokens of every batch; dq_h's rows are independent (quadrature
  // over b, i), dk_h's and dv_h's keys share the rows that see them (linear over j, quadrature
  // over b).
  auto weights = [&](std::vector<double>& err, GradientSpread& sp, const FloatTensor& x, std::int64_t N, std::int64_t E,
                     const std::vector<double>& e1, const std::vector<double>& x1, const GradientSpread& s1, bool rows) {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d)
        for (std::int64_t cc = 0; cc < E; ++cc) {
          const std::size_t k = z((h * D + d) * E + cc);
          double rsq = 0;
          for (std::int64_t b = 0; b < B; ++b) {
            double rb = 0;
            for (std::int64_t n = 0; n < N; ++n) {
              const std::size_t m = z(((b * H + h) * N + n) * E + cc);
              const double xa = std::fabs(x.values[z((b * N + n) * D + d)]);
              err[k] += (e1[m] + x1[m]) * xa;
              sp.floor[k] += s1.floor[m] * xa;
              if (rows)
                rsq += sq((s1.random[m] + x1[m]) * xa);
              else
                rb += (s1.random[m] + x1[m]) * xa;
            }
            rsq += sq(rb);
          }
          sp.random[k] = rsq;
        }
  };
  weights(g.dw_q, g.dw_q_spread, c.x_q, Nq, Dk, ge.dq, xdq, ge.dq_spread, true);
  weights(g.dw_k, g.dw_k_spread, c.x_kv, Nk, Dk, ge.dk, xdk, ge.dk_spread, false);
  weights(g.dw_v, g.dw_v_spread, c.x_kv, Nk, Dv, ge.dv, xdv, ge.dv_spread, false);
  // dw_o[h Dv + c, e] = sum over the rows of O_h[b,i,c] dout[b,i,e]: O_h's forward error on
  // |dout|, the rows independent.
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Nq; ++i) {
      if (!c.query_valid(b, i)) continue;
      const double* dr = &c.dout->values[z((b * Nq + i) * Do)];
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t cc = 0; cc < Dv; ++cc) {
          const double eo = eOut[z(((b * H + h) * Nq + i) * Dv + cc)];
          for (std::int64_t e = 0; e < Do; ++e) {
            const std::size_t k = z((h * Dv + cc) * Do + e);
            g.dw_o[k] += eo * std::fabs(dr[e]);
            g.dw_o_spread.random[k] += sq(eo * dr[e]);
          }
        }
    }
  g.dbias = ge.dbias;
  g.dbias_spread = ge.dbias_spread;
  for (std::size_t k = 0; k < g.dbias.size(); ++k) {
    g.dbias[k] += xdbias[k];
    g.dbias_spread.random[k] += xdbias[k];
  }
  g.dsinks = ge.dsinks;
  g.dsinks_spread = ge.dsinks_spread;
  for (std::size_t k = 0; k < g.dsinks.size(); ++k) {
    g.dsinks[k] += xdsinks[k];
    g.dsinks_spread.random[k] += xdsinks[k];
  }
  for (GradientSpread* sp : {&g.dx_q_spread, &g.dx_kv_spread, &g.dw_q_spread, &g.dw_k_spread, &g.dw_v_spread, &g.dw_o_spread})
    for (double& x : sp->random) x = std::sqrt(x);
  return g;
}

}  // namespace attnoracle::conformance
