// The forward error analysis of one row (TOLERANCE.md, steps 1 to 5): row_limits.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "attnoracle/conformance/tolerance.hpp"
#include "no_contraction.hpp"

namespace attnoracle::conformance {

// Called per element: the usual formats' values written out (2^-p, 2^(1 - bias) and
// 2^(2 - bias - p) of float_format's fields), the others computed.
double unit_roundoff(DType t) {
  switch (t) {
    case DType::F64: return 0x1p-53;
    case DType::F32: return 0x1p-24;
    case DType::F16: return 0x1p-11;
    case DType::BF16: return 0x1p-8;
    default: return std::ldexp(1.0, -float_format(t).precision);
  }
}
double min_normal(DType t) {
  switch (t) {
    case DType::F64: return 0x1p-1022;
    case DType::F32:
    case DType::BF16: return 0x1p-126;
    case DType::F16: return 0x1p-14;
    default: return std::ldexp(1.0, 1 - float_format(t).bias);
  }
}
double min_subnormal(DType t) {
  switch (t) {
    case DType::F64: return 0x1p-1074;
    case DType::F32: return 0x1p-149;
    case DType::F16: return 0x1p-24;
    case DType::BF16: return 0x1p-133;
    default: {
      const FloatFormat f = float_format(t);
      return std::ldexp(1.0, 2 - f.bias - f.precision);
    }
  }
}

bool stored_kv(const Case& c) { return c.kv_form && c.kv_form->scheme != KvScheme::Plain; }

double rotary_rel(const Profile& p, const Case& c) {
  if (!c.rotary) return 0;
  // The kernel's rotated value: two products and a sum in qk_accum (within 3 u_qk of the
  // magnitude m = |x1 c| + |x2 s|), rounded to `projection`; the case's: the exact value
  // rounded once to rotary_round. Both within those of the exact value, the kernel's rounding to
  // either dtype: u_r + max(u_r, u_proj) + 4 u_qk.
  // An exact rotation (no rotary_round): the kernel's rounding and sum alone.
  if (c.rotary->exact) return unit_roundoff(p.projection) + 4 * unit_roundoff(p.qk_accum);
  const double ur = unit_roundoff(c.rotary->round);
  return ur + std::max(ur, unit_roundoff(p.projection)) + 4 * unit_roundoff(p.qk_accum);
}

void rotate_back_errors(const Case& c, std::int64_t t, double* e) {
  if (!c.rotary || t < 0 || t >= c.rotary->Nrot) return;
  const Rotary& r = *c.rotary;
  const std::int64_t half = r.R / 2;
  for (std::int64_t f = 0; f < half; ++f) {
    const auto k = static_cast<std::size_t>(t * half + f);
    const double cs = std::fabs(r.cos[k]), sn = std::fabs(r.sin[k]);
    double& e1 = e[r.first(f)];
    double& e2 = e[r.second(f)];
    const double a = e1 * cs + e2 * sn, b = e2 * cs + e1 * sn;
    e1 = a, e2 = b;
  }
}

namespace {
bool scaled_dropout(const Case& c) { return c.dropout && std::strtod(c.dropout->p.c_str(), nullptr) != 0; }
}  // namespace

double dropout_scale_error(const Profile& p, const Case& c) {
  if (!scaled_dropout(c)) return 0;
  // fl(1 / fl(1 - fl(p))) = c (1 + t): fl(p) = p (1 + d) moves 1 - p by a relative d r (r = p /
  // (1 - p)), the subtraction and the division round once each, so 1 + t lies between
  // (1 - u) / ((1 + r u)(1 + u)) and (1 + u) / ((1 - r u)(1 - u)): |t| <= (r + 2) u / (1 - (r + 1) u)
  const double pv = std::strtod(c.dropout->p.c_str(), nullptr), r = pv / (1 - pv), u = unit_roundoff(p.softmax);
  return (r + 1) * u < 1 ? (r + 2) * u / (1 - (r + 1) * u) : INFINITY;
}

double dropout_product_error(const Profile& p, const Case& c) {
  // a kept weight times the scale, rounded in `softmax`, or the output times it in `pv_accum`
  return scaled_dropout(c) ? std::max(unit_roundoff(p.softmax), unit_roundoff(p.pv_accum)) : 0;
}

RowLimits row_limits(const Profile& p, const Case& c, const RowMagnitudes& row) {
  // A sink is one more term exp(sink - m) of Z, with no value vector: n + 1 terms, and m the
  // maximum over the scores and the sink, so max |S| covers |sink| too. The kernel keeps the
  // sink in its dtype or rounds it once into the softmax dtype (u_s |sink|, within the 2 u_s
  // max|S| of (1)); every step below then holds with these n and max |S|.
  RowMagnitudes m = row;
  if (c.sinks) {
    m.keys += 1;
    for (double s : c.sinks->values) m.score_abs = std::max(m.score_abs, std::fabs(s));
  }
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double upv = unit_roundoff(p.pv_accum);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double n = static_cast<double>(std::max<std::int64_t>(m.keys, 1));
  const DType out = c.dtype_of("out");
  RowLimits r;
  // (1) a score: Dk products and sums (gamma_Dk), the scale and softcap (2 more roundings) on
  // the dot's magnitude A, then rounding into the softmax dtype and the bias addition.
  double proj = 0;
  if (c.kind == Kind::Mha)  // q and k each carry (D + 1) u_qk + u_proj relative error first
    proj = 2 * ((static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection));
  r.score = (static_cast<double>(c.Dk) + 2) * uq * m.dot_abs + proj * m.dot_abs + 2 * us * m.score_abs;
  // a bias rounded to its dtype first: |fl(b) - b| <= u_b |b| where fl(b) is normal, and at most
  // half the smallest spacing below (so the sum of both bounds it everywhere).
  if (p.bias) r.score += unit_roundoff(*p.bias) * m.bias_abs + min_subnormal(*p.bias) / 2;
  // FP8 descales applied in the qk dtype: q and k each rounded once after scaling (a product off
  // by (1 + u)^2 - 1 <= 3u), or dq dk formed and multiplied into the score (two roundings, 2u):
  // 3u on the dot's magnitude covers both. v's descale: one rounding of each v (or of the
  // output), u_pv on the bound, added in (4).
  // K/V stored scaled or block-scaled (CONTRACT section 9): element x scale formed in the qk
  // dtype (one rounding of k; nvfp4's E2M1 x E4M3 is exact, its global scale one more), or the
  // scale multiplied into the score (one or two roundings): 3u on the dot's magnitude covers each.
  const bool descaled = c.file.find("q_descale") || c.file.find("k_descale") || stored_kv(c);
  if (descaled) r.score += 3 * uq * m.dot_abs;
  // Rotary: q and k each off by eps_rot on their magnitudes, so a product q_d k_d by at most
  // (2 eps_rot (1 + u_r) + eps_rot^2) qm_d km_d <= 3 eps_rot qm_d km_d (eps_rot <= 1/2).
  r.score += 3 * rotary_rel(p, c) * m.rotary_abs;
  // (2) exp(S_j - m): both S_j and the row maximum m are off by `score`, the subtraction rounds
  // (us |S_j - m| <= 2 us max|S|), exp adds exp_ulps: a relative error of e_j of
  double e_rel = 2 * r.score + 2 * us * m.score_abs + p.exp_ulps * us;
  // (2b) an online softmax over nb key blocks rescales the earlier blocks' partial sums by
  // alpha = exp(m_old - m_new) up to nb - 1 times: an error of alpha scales those blocks' weights
  // like one of exp (exp_ulps each), and the arguments' roundings add up to u_sm sum |dm| <= 2 u_sm M.
  const double nb = p.key_block > 0 ? std::ceil(n / static_cast<double>(p.key_block)) : 1;
  if (nb > 1) e_rel += (nb - 1) * p.exp_ulps * us + 2 * us * m.score_abs;
  // (3) a weight e_j / Z: Z carries e_rel plus the sum's gamma_n; the division rounds; P is
  // rounded to its dtype.
  // A term's sum sees at most n + nb - 1 roundings: those of its block, then a product by alpha
  // and an addition per later block (gamma_{n+nb-1} <= (n + nb) u; n + 1 for one pass).
  r.weight_rel = 2 * e_rel + (n + nb) * us + up;
  // (4) the output: P V over n terms (gamma_n of the accumulation) on sum_j A_j |v_j| = bound;
  // mha adds the projection of V and the output projection over H Dv terms.
  r.out_coef = r.weight_rel + (n + nb) * upv;
  // one rounding of v or of the output (v_descale, v's stored scales; nvfp4: two of v's)
  if (c.file.find("v_descale") || stored_kv(c)) r.out_coef += 2 * upv;
  // an FP8 out: O divided by o_scale (or times its reciprocal, rounded first) in pv_accum
  if (c.o_scale) r.out_coef += 2 * upv;
  // (4d) dropout: the keep scale's own error and one product by it, relative to the kept terms,
  // whose magnitude out.bound is (it includes keep / (1 - p)); weights and lse keep their limits
  r.out_coef += dropout_scale_error(p, c) + dropout_product_error(p, c);
  if (c.kind == Kind::Mha)
    r.out_coef += (static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection) +
                  (static_cast<double>(c.Hq * c.Dv) + 1) * upv;
  // (5) lse = m + log Z: the score error, Z's relative error, log's own.
  r.lse_abs = r.score + e_rel + (n + nb) * us + p.exp_ulps * us * (1 + m.score_abs);
  // (5c) a split-KV merge: out = sum_s w_s fl(O_s) / W, w_s = exp(lse_s - M). Each O_s rounded to
  // `partials` is off by u |O_s| <= u bound_s, and sum_s w_s bound_s / W = bound; lse_s is off by
  // at most lse_abs (its split has fewer keys), the subtraction rounds (2 u_sm M) and exp adds
  // exp_ulps: a relative error of w_s; W and out's sums are over S <= n splits (gamma_n), the
  // division rounds. lse = M + log W: W's error and log's own again.
  if (p.partials) {
    const double w_rel = 2 * r.lse_abs + 2 * us * m.score_abs + p.exp_ulps * us;
    r.out_coef += unit_roundoff(*p.partials) + 2 * w_rel + (n + 2) * (us + upv);
    r.lse_abs += w_rel + (n + 1) * us + p.exp_ulps * us * (1 + m.score_abs);
  }
  // underflow: the output format's subnormal spacing, and flushed tiny weights in P V.
  r.floor = 2 * min_subnormal(out) + n * min_normal(p.pv_accum);
  // (4b) P's underflow (Higham (2.8)): a weight rounded to p below its smallest normal m_p is
  // off by up to s_p / 2 absolutely. Every computed score is in [-M - score, M + score] and so
  // is any maximum of them (running or final), so s_j - m' >= -(2M + 2 score); the weights
  // rounded are exp(s_j - m') or those over Z <= n, so none is below exp(-reach) (the 1 covers
  // the subtraction's and exp's roundings): when that is at least m_p, or the row has one key
  // (its weight is 1), no weight underflows and the term is 0.
  r.keys = n;
  const double reach = 2 * m.score_abs + 2 * r.score + 1 + std::log(n);
  r.p_sub = n > 1 && !(reach < -std::log(min_normal(p.p))) ? min_subnormal(p.p) / 2 : 0;
  // lse when l sums the rounded weights: l >= 1 (the maximum's weight is exp(0) = 1, exact in
  // every format), so n absolute errors of s_p / 2 are a relative n s_p / 2 of l, in log l.
  r.lse_abs += n * r.p_sub;
  return r;
}

}  // namespace attnoracle::conformance
