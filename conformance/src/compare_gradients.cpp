// The gradients of a case: each element against its limit (TOLERANCE.md, "Gradients" and
// "Gradients of kind mha"), and the statistical tier per tensor.
#include <algorithm>
#include <cmath>

#include "comparer.hpp"

namespace attnoracle::conformance::comparing {

void Comparer::gradients() {
  if (!profile.returns_gradients) {
    rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("gradients not returned (declared)");
    return;
  }
  const MaskedRowConvention conv = profile.masked_rows;
  if (conv == MaskedRowConvention::Nan || conv == MaskedRowConvention::Mean)
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) {
            rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("gradients not compared: fully masked rows under masked_rows=") +
                          std::string(convention_name(conv));
            return;
          }
  if (c.kind == Kind::Mha) {
    mha_gradients();
    return;
  }
  const RawTensor *oref = gold("out.ref"), *obound = gold("out.bound");
  std::vector<double> xr(oref->data.size() / 8), br(obound->data.size() / 8);
  for (std::size_t k = 0; k < xr.size(); ++k) xr[k] = value_of(*oref, k);
  for (std::size_t k = 0; k < br.size(); ++k) br[k] = value_of(*obound, k);
  bool underflows = false;
  for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
  const std::vector<double> vsum = underflows ? out_value_sum(c) : std::vector<double>{};
  // out's statistical bound per element (D_i = dout . out from the implementation's own out)
  std::vector<double> os(xr.size());
  for (std::size_t k = 0; k < os.size(); ++k) {
    const std::size_t row = k / static_cast<std::size_t>(c.Dv);
    os[k] = std::sqrt(3.0) * out_scale_at(row, k, xr[k], br[k], vsum.empty() ? 0 : vsum[k]);
  }
  const GradientErrors ge = gradient_errors(profile, c, mags, limits, xr, br, vsum, os);
  const double ug = unit_roundoff(profile.grad_accum);
  const double group = static_cast<double>(c.Hq / c.Hkv);
  // dq of padding rows is not compared (as their out); their contributions to dk, dv and
  // dbias are, through those tensors.
  auto skip = [&](const std::string& name, std::size_t k) {
    if (name != "dq") return false;
    const auto row = static_cast<std::int64_t>(k) / c.Dk;
    return !c.query_valid(row / (c.Hq * c.Nq), row % c.Nq);
  };
  // The statistical tier's groups: elements of different groups depend on disjoint rows.
  auto judge = [&](const std::string& name, bool wanted, const std::vector<std::int64_t>& shape,
                   const std::vector<double>& err, const GradientSpread& sp, std::size_t group_size,
                   auto terms_of, double partials) {
    if (!wanted) return;
    const RawTensor* got = returned(name, shape);
    if (!got) return;
    // in the gradient's own dtype: its rounding, its floor, and GQA's `partials` roundings
    const double uo = unit_roundoff(got->dtype), floor = 2 * min_subnormal(got->dtype);
    const double extra = partials * uo;
    const RawTensor *gg = gold(name), *gref = gold(name + ".ref"), *gb = gold(name + ".bound");
    const Undecided u = undecided(name);
    AltCursor u_at{u};
    Acc a;
    a.t.tensor = name;
    for (std::size_t k = 0; k < err.size(); ++k) {
      if (skip(name, k)) continue;
      const double x = value_of(*gref, k), bd = value_of(*gb, k), n = terms_of(k);
      // FTZ in the accumulation: n terms each flushed below grad_accum's smallest normal
      const double fl = floor + n * min_normal(profile.grad_accum);
      const double lim = gradient_limit(profile, err[k], n, extra, bd, uo, fl, x);
      // the random parts, the accumulation's n + 2 roundings on at most bd each (any order),
      // GQA's partial sums (extra = group u_out: group roundings of u_out bd), the final one
      const double var = sq(sp.random[k]) + (n + 2) * sq(ug * bd) + extra * uo * sq(bd) + sq(uo * x);
      const double scale = std::sqrt(var / 3) + sp.floor[k] + fl;
      element(a, *got, *gg, k, x, 0, bd, lim, -1, scale, static_cast<std::int64_t>(k / group_size), u_at.find(k));
    }
    finish(a);
  };
  // dq sums over the row's keys; dk and dv over the group's query heads and rows (GQA partial
  // sums per query head may be rounded to the output dtype first: group u_out more); dbias over
  // the entries its element was broadcast to.
  // Rotary: R^T taken in grad_accum, two products and a sum on the bound (G.bound is |R^T| of
  // the rotated one's): 3 terms more for dq and dk.
  const double rot = c.rotary ? 3 : 0;
  judge("dq", c.want_dq, c.q.shape, ge.dq, ge.dq_spread, static_cast<std::size_t>(c.Dk), [&](std::size_t k) {
    return limits[k / static_cast<std::size_t>(c.Dk)].keys + rot; }, 0.0);
  const double rows = group * static_cast<double>(c.Nq);
  const double gqa = group > 1 ? group : 0;
  const auto head = static_cast<std::size_t>(c.Nk);
  judge("dk", c.want_dk, c.k.shape, ge.dk, ge.dk_spread, head * static_cast<std::size_t>(c.Dk),
        [&](std::size_t) { return rows + rot; }, gqa);
  judge("dv", c.want_dv, c.v.shape, ge.dv, ge.dv_spread, head * static_cast<std::size_t>(c.Dv),
        [&](std::size_t) { return rows; }, gqa);
  if (c.bias) {
    const double per = static_cast<double>(c.B * c.Hq * c.Nq * c.Nk) / static_cast<double>(c.bias->values.size());
    // (the last extent is the keys'; the ones before it, where not broadcast, the rows')
    const std::size_t last = c.bias->shape.empty() ? ge.dbias.size() : static_cast<std::size_t>(c.bias->shape.back());
    judge("dbias", c.want_dbias, c.bias->shape, ge.dbias, ge.dbias_spread, std::max<std::size_t>(last, 1),
          [&](std::size_t) { return per; }, 0.0);
  }
  // dsinks[h] sums one term per row of the head over the batch.
  if (c.sinks)
    judge("dsinks", c.want_dsinks, {c.Hq}, ge.dsinks, ge.dsinks_spread, 1,
          [&](std::size_t) { return static_cast<double>(c.B * c.Nq); }, 0.0);
}

void Comparer::mha_gradients() {
  const MhaGradientErrors ge = mha_gradient_errors(profile, c, limits);
  const bool self = c.self_attention;
  const double ug = unit_roundoff(profile.grad_accum);
  // each head's gradients, rounded to `projection` before the chain rule: u_proj on G.bound
  const double up = unit_roundoff(profile.projection);
  const double H = static_cast<double>(c.Hq), Dk = static_cast<double>(c.Dk), Dv = static_cast<double>(c.Dv);
  auto judge = [&](const std::string& name, bool wanted, const std::vector<std::int64_t>& shape, const std::vector<double>& err,
                   const GradientSpread& sp, std::size_t group_size, double n, double extra, auto skip) {
    if (!wanted || err.empty()) return;
    const RawTensor* got = returned(name, shape);
    if (!got) return;
    const double uo = unit_roundoff(got->dtype), floor = 2 * min_subnormal(got->dtype);  // the gradient's own
    const RawTensor *gg = gold(name), *gref = gold(name + ".ref"), *gb = gold(name + ".bound");
    const Undecided u = undecided(name);
    AltCursor u_at{u};
    Acc a;
    a.t.tensor = name;
    const double fl = floor + n * min_normal(profile.grad_accum);
    for (std::size_t k = 0; k < err.size(); ++k) {
      if (skip(k)) continue;
      const double x = value_of(*gref, k), bd = value_of(*gb, k);
      const double lim = gradient_limit(profile, err[k], n, extra, bd, uo, fl, x);
      const double var = sq(sp.random[k]) + (n + 2) * sq(ug * bd) + sq(extra * bd) + sq(uo * x);
      const double scale = std::sqrt(var / 3) + sp.floor[k] + fl;
      element(a, *got, *gg, k, x, 0, bd, lim, -1, scale, static_cast<std::int64_t>(k / group_size), u_at.find(k));
    }
    finish(a);
  };
  const auto none = [](std::size_t) { return false; };
  const auto D = static_cast<std::size_t>(c.D);
  // dx_q of padding rows is 0 (not compared, as dq's) unless x is the keys too.
  const auto padding = [&](std::size_t k) {
    const auto row = static_cast<std::int64_t>(k / D);
    return !self && !c.query_valid(row / c.Nq, row % c.Nq);
  };
  // terms: the chain rule's products (H Dk, and H (Dk + Dv) for the keys), or the tokens; the
  // tier's groups: a token of dx_q (a batch in self-attention, whose keys mix the rows), a
  // batch of dx_kv, the whole of dw_*.
  judge("dx_q", c.want_dx_q, c.x_q.shape, ge.dx_q, ge.dx_q_spread, self ? D * static_cast<std::size_t>(c.Nq) : D,
        H * (self ? 2 * Dk + Dv : Dk), up, padding);
  judge("dx_kv", c.want_dx_kv, c.x_kv.shape, ge.dx_kv, ge.dx_kv_spread, D * static_cast<std::size_t>(c.Nk), H * (Dk + Dv), up, none);
  const double tq = static_cast<double>(c.B * c.Nq), tk = static_cast<double>(c.B * c.Nk);
  judge("dw_q", c.want_dw_q, c.w_q.shape, ge.dw_q, ge.dw_q_spread, ge.dw_q.size(), tq, up, none);
  judge("dw_k", c.want_dw_k, c.w_k.shape, ge.dw_k, ge.dw_k_spread, ge.dw_k.size(), tk, up, none);
  judge("dw_v", c.want_dw_v, c.w_v.shape, ge.dw_v, ge.dw_v_spread, ge.dw_v.size(), tk, up, none);
  judge("dw_o", c.want_dw_o, c.w_o.shape, ge.dw_o, ge.dw_o_spread, ge.dw_o.size(), tq, 0.0, none);
  if (c.bias) {
    const double per = static_cast<double>(c.B * c.Hq * c.Nq * c.Nk) / static_cast<double>(c.bias->values.size());
    const std::size_t last = c.bias->shape.empty() ? ge.dbias.size() : static_cast<std::size_t>(c.bias->shape.back());
    judge("dbias", c.want_dbias, c.bias->shape, ge.dbias, ge.dbias_spread, std::max<std::size_t>(last, 1), per, 0.0, none);
  }
  if (c.sinks) judge("dsinks", c.want_dsinks, {c.Hq}, ge.dsinks, ge.dsinks_spread, 1, tq, 0.0, none);
}

}  // namespace attnoracle::conformance::comparing
