// The gradients' error terms (TOLERANCE.md, "Gradients"), computed in double from the inputs and
// the golden out: a magnitude to within a few ulps of double, far inside the safety factor.
#include <cmath>
#include <cstdlib>

#include "attnoracle/conformance/tolerance.hpp"

namespace attnoracle::conformance {

GradientErrors gradient_errors(const Profile& p, const Case& c, const std::vector<RowMagnitudes>& mags,
                               const std::vector<RowLimits>& limits, const std::vector<double>& out_ref,
                               const std::vector<double>& out_bound, const std::vector<double>& vsum) {
  const std::int64_t H = c.Hq, Hk = c.Hkv, Nq = c.Nq, Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
  const double sscale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double scale = std::fabs(sscale);
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  const double us = unit_roundoff(p.softmax), ug = unit_roundoff(p.grad_accum);
  const double u_dp = unit_roundoff(p.grad_dp), u_ds = unit_roundoff(p.grad_ds);
  const double u_out = unit_roundoff(c.output_dtype);
  GradientErrors g;
  g.dq.assign(static_cast<std::size_t>(c.B * H * Nq * Dk), 0);
  g.dk.assign(static_cast<std::size_t>(c.B * Hk * Nk * Dk), 0);
  g.dv.assign(static_cast<std::size_t>(c.B * Hk * Nk * Dv), 0);
  if (c.bias) g.dbias.assign(c.bias->values.size(), 0);
  if (c.sinks) g.dsinks.assign(static_cast<std::size_t>(H), 0);
  std::vector<double> s(static_cast<std::size_t>(Nk)), t(s), P(s), a(s);
  std::vector<char> on(s.size());
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
          double dot = 0;
          for (std::int64_t d = 0; d < Dk; ++d) dot += q[d] * kb[j * Dk + d];
          double T = sscale * dot;
          t[jj] = 1;
          if (cap > 0) {
            const double th = std::tanh(T / cap);
            T = cap * th;
            t[jj] = 1 - th * th;
          }
          s[jj] = T + c.bias_at(b, h, i, j);
          mx = std::max(mx, s[jj]);
        }
        // No allowed key: gradient 0 under policy zero; with a sink O = 0, so D = 0 and the row
        // adds 0 to dsinks.
        if (mx == -INFINITY) continue;
        if (c.sinks) mx = std::max(mx, c.sink(h));
        double Z = c.sinks ? std::exp(c.sink(h) - mx) : 0, R = 0, A = 0;
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (on[static_cast<std::size_t>(j)]) Z += P[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - mx);
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          if (!on[jj]) continue;
          P[jj] /= Z;
          a[jj] = 0;
          for (std::int64_t e = 0; e < Dv; ++e) a[jj] += std::fabs(dout[e] * vb[j * Dv + e]);
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
        double o = 0, E_flash = 0;
        for (std::int64_t e = 0; e < Dv; ++e) {
          const std::size_t k = row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e);
          const double vs = vsum.empty() ? 0 : vsum[k];
          o += std::fabs(dout[e] * out_ref[k]);
          E_flash += std::fabs(dout[e]) * (out_compute(L, out_bound[k], vs) + u_out * std::fabs(out_ref[k]));
        }
        E_flash += (static_cast<double>(Dv) + 1) * ug * o;
        const double E_math = ((n + 1) * ug + p_rel + (static_cast<double>(Dv) + 1) * ug + u_dp) * R + p_abs * A;
        const double E = std::max(E_flash, E_math);
        // dS = P (dP - D): P's error on |dP - D| <= a_j + o, dP's Dv + 1 roundings and its rounding
        // to grad_dp, the subtraction and product (2 u_g), dS rounded to grad_ds.
        const double c1 = p_rel + (static_cast<double>(Dv) + 3) * ug + u_dp + u_ds;
        // softcap: 1 - tanh^2(T/c) from a tanh off by score/c (tanh' <= 1) and exp_ulps, squared
        // and subtracted: an absolute error of at most twice that.
        const double f_abs = cap > 0 ? 2 * L.score / cap + 2 * (p.exp_ulps + 1) * us : 0;
        double* dq = &g.dq[row * static_cast<std::size_t>(Dk)];
        for (std::int64_t j = r.first; j <= r.last; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          if (!on[jj]) continue;
          const double M = P[jj] * (a[jj] + o);
          const double d_ds = c1 * M + P[jj] * E + p_abs * (a[jj] + o);
          const double d_dt = d_ds * t[jj] + M * f_abs;
          const std::size_t kj = static_cast<std::size_t>((b * Hk + gk) * Nk + j);
          for (std::int64_t d = 0; d < Dk; ++d) {
            dq[d] += scale * d_dt * std::fabs(kb[j * Dk + d]);
            g.dk[kj * static_cast<std::size_t>(Dk) + static_cast<std::size_t>(d)] += scale * d_dt * std::fabs(q[d]);
          }
          // dv = P^T dout with P off by p_rel, rounded to grad_ds, and P's underflow
          for (std::int64_t e = 0; e < Dv; ++e)
            g.dv[kj * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(e)] +=
                ((p_rel + u_ds) * P[jj] + p_abs) * std::fabs(dout[e]);
          if (c.bias) g.dbias[c.bias_index(b, h, i, j)] += d_ds;
        }
        // dsinks[h] -= P_sink D: P_sink = exp(sink - lse) off by p_rel (S exact here, lse's error
        // and one exp) and p_abs, D off by E, the product rounded to grad_ds.
        if (c.sinks) {
          const double ps = std::exp(c.sink(h) - mx) / Z;
          g.dsinks[static_cast<std::size_t>(h)] += (p_rel + u_ds) * ps * o + ps * E + p_abs * o;
        }
      }
  return g;
}

}  // namespace attnoracle::conformance
