#include "attnoracle/tolerance.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace attnoracle::conformance {

double unit_roundoff(DType t) { return std::ldexp(1.0, -float_format(t).precision); }
double min_normal(DType t) { return std::ldexp(1.0, 1 - float_format(t).bias); }
double min_subnormal(DType t) {
  const FloatFormat f = float_format(t);
  return std::ldexp(1.0, 2 - f.bias - f.precision);
}

namespace {

bool allowed(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  return c.position_allowed(i, j) && c.mask_at(b, h, i, j) && c.bias_at(b, h, i, j) != -INFINITY;
}

// X W per head, in double, on values (abs = false) or on magnitudes |X| |W| (abs = true).
std::vector<double> project(const Case& c, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
                            std::int64_t E, bool abs) {
  std::vector<double> p(static_cast<std::size_t>(c.B * c.Hq * N * E));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t r = 0; r < c.Hq; ++r)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t e = 0; e < E; ++e) {
          double s = 0;
          for (std::int64_t d = 0; d < c.D; ++d) {
            const double a = x.values[static_cast<std::size_t>((b * N + n) * c.D + d)];
            const double z = w.values[static_cast<std::size_t>((r * c.D + d) * E + e)];
            s += abs ? std::fabs(a) * std::fabs(z) : a * z;
          }
          p[static_cast<std::size_t>(((b * c.Hq + r) * N + n) * E + e)] = s;
        }
  return p;
}

}  // namespace

std::vector<RowMagnitudes> row_magnitudes(const Case& c) {
  const bool mha = c.kind == Kind::Mha;
  const std::int64_t H = c.Hq, Hk = mha ? c.Hq : c.Hkv;
  std::vector<double> Q, K, Qa, Ka;
  if (mha) {
    Q = project(c, c.x_q, c.w_q, c.Nq, c.Dk, false);
    K = project(c, c.x_kv, c.w_k, c.Nk, c.Dk, false);
    Qa = project(c, c.x_q, c.w_q, c.Nq, c.Dk, true);
    Ka = project(c, c.x_kv, c.w_k, c.Nk, c.Dk, true);
  }
  const std::vector<double>& q = mha ? Q : c.q.values;
  const std::vector<double>& k = mha ? K : c.k.values;
  const std::vector<double>& qa = mha ? Qa : c.q.values;
  const std::vector<double>& ka = mha ? Ka : c.k.values;
  const double scale = c.scale ? std::fabs(std::strtod(c.scale->c_str(), nullptr))
                               : 1 / std::sqrt(static_cast<double>(c.Dk));
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  std::vector<RowMagnitudes> out(static_cast<std::size_t>(mha ? c.B * c.Nq : c.B * H * c.Nq));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / (H / Hk);
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        RowMagnitudes& m = out[static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i)];
        std::int64_t keys = 0;
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          if (!allowed(c, b, h, i, j)) continue;
          ++keys;
          double dot = 0, dabs = 0;
          for (std::int64_t d = 0; d < c.Dk; ++d) {
            const auto iq = static_cast<std::size_t>(((b * H + h) * c.Nq + i) * c.Dk + d);
            const auto ik = static_cast<std::size_t>(((b * Hk + g) * c.Nk + j) * c.Dk + d);
            dot += q[iq] * k[ik];
            dabs += std::fabs(qa[iq]) * std::fabs(ka[ik]);
          }
          double t = dot * scale;
          if (cap > 0) t = cap * std::tanh(t / cap);
          m.dot_abs = std::max(m.dot_abs, dabs * scale);
          m.score_abs = std::max(m.score_abs, std::fabs(t + c.bias_at(b, h, i, j)));
        }
        m.keys = std::max(m.keys, keys);
      }
    }
  return out;
}

RowLimits row_limits(const Profile& p, const Case& c, const RowMagnitudes& m) {
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double upv = unit_roundoff(p.pv_accum);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double n = static_cast<double>(std::max<std::int64_t>(m.keys, 1));
  const DType out = c.output_dtype;
  RowLimits r;
  // (1) a score: Dk products and sums (gamma_Dk), the scale and softcap (2 more roundings) on
  // the dot's magnitude A, then rounding into the softmax dtype and the bias addition.
  double proj = 0;
  if (c.kind == Kind::Mha)  // q and k each carry (D + 1) u_qk + u_proj relative error first
    proj = 2 * ((static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection));
  r.score = (static_cast<double>(c.Dk) + 2) * uq * m.dot_abs + proj * m.dot_abs + 2 * us * m.score_abs;
  // (2) exp(S_j - m): both S_j and the row maximum m are off by `score`, the subtraction rounds
  // (us |S_j - m| <= 2 us max|S|), exp adds exp_ulps: a relative error of e_j of
  double e_rel = 2 * r.score + 2 * us * m.score_abs + p.exp_ulps * us;
  // (3) a weight e_j / Z: Z carries e_rel plus the sum's gamma_n; the division rounds; P is
  // rounded to its dtype.
  r.weight_rel = 2 * e_rel + (n + 1) * us + up;
  // (4) the output: P V over n terms (gamma_n of the accumulation) on sum_j A_j |v_j| = bound;
  // mha adds the projection of V and the output projection over H Dv terms.
  r.out_coef = r.weight_rel + (n + 1) * upv;
  if (c.kind == Kind::Mha)
    r.out_coef += (static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection) +
                  (static_cast<double>(c.Hq * c.Dv) + 1) * upv;
  // (5) lse = m + log Z: the score error, Z's relative error, log's own.
  r.lse_abs = r.score + e_rel + (n + 1) * us + p.exp_ulps * us * (1 + m.score_abs);
  // underflow: the output format's subnormal spacing, and flushed tiny weights in P V.
  r.floor = 2 * min_subnormal(out) + n * min_normal(p.pv_accum);
  return r;
}

double ulp_error(double y, double x_hi, double x_lo, DType t) {
  if (std::isnan(y) || std::isinf(y) || std::isinf(x_hi))
    return (y == x_hi) ? 0 : INFINITY;
  const FloatFormat f = float_format(t);
  const double d = std::fabs((y - x_hi) - x_lo);
  const int e = x_hi == 0 ? -100000 : std::ilogb(x_hi);
  const int emin = 1 - f.bias;  // binade of the smallest normal
  return d / std::ldexp(1.0, std::max(e, emin) - f.precision + 1);
}

double signed_bound_error(double y, double x_hi, double x_lo, double bound, DType t) {
  if (std::isnan(y) || std::isinf(y) || std::isinf(x_hi)) return (y == x_hi) ? 0 : INFINITY;
  const double denom = std::max(bound * unit_roundoff(t), min_normal(t));
  return ((y - x_hi) - x_lo) / denom;
}

}  // namespace attnoracle::conformance
