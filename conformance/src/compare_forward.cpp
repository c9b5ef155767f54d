// The forward outputs of a case: out per element (with its fast path for elements equal to the
// golden ones), weights and lse per head row, scores per element; then the gradients and the
// case's reason.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "attnoracle/conformance/stored_model.hpp"
#include "attnoracle/reference/file.hpp"
#include "comparer.hpp"

namespace attnoracle::conformance::comparing {

namespace {

// The weights [0, n) of a block (n <= kBlock), ref their exact values, slowed[e] set for those
// element() compared: the largest limit over all of them, and the others (error 0) into the
// sample with their shares; the element-wise path's operations in the same order, split into
// loops without branches (the first vectorizes on whole blocks).
void zero_error_weights(Comparer::Acc& a, const unsigned char* ref, std::size_t n, const char* slowed,
                        const Profile& p, const RowLimits& L, double u, const RowWeightScale& ws, std::int64_t row) {
  double lim[kBlock], f2[kBlock];
  const auto at = [&](std::size_t e) {
    double x;
    std::memcpy(&x, ref + 8 * e, 8);
    lim[e] = weight_limit(p, L, u, x);
    const double f = u * std::fabs(x) / std::sqrt(3.0) / ws.at(x);  // final_share before its min
    f2[e] = f * f;
  };
  if (n == kBlock)
    for (std::size_t e = 0; e < kBlock; ++e) at(e);
  else
    for (std::size_t e = 0; e < n; ++e) at(e);
  double big = a.t.largest_limit;
  for (std::size_t e = 0; e < n; ++e) big = std::max(big, lim[e]);
  a.t.largest_limit = big;
  for (std::size_t e = 0; e < n; ++e)
    if (!slowed[e]) a.sample.add(row, 0, std::min(1.0, f2[e]));
}

}  // namespace

void Comparer::run() {
  const bool mha = c.kind == Kind::Mha;
  const std::int64_t H = c.Hq, W = mha ? c.Dout : c.Dv;
  // the model's magnitudes stored with the golden tensors, else computed from the inputs
  const std::optional<StoredModel> stored = stored_model(c, golden, c.path);
  std::optional<Spread> stored_sp = stored ? stored_spread(*stored, profile) : std::nullopt;
  mags = stored ? stored_magnitudes(*stored) : row_magnitudes(c);
  limits.reserve(mags.size());
  for (const auto& m : mags) limits.push_back(row_limits(profile, c, m));
  scales.reserve(mags.size());
  for (const auto& m : mags) scales.push_back(row_scales(profile, c, m));
  // dropout: the exact weights' spread does not see the keep mask; the linear bounds on out.bound
  // (which does) serve instead (TOLERANCE.md, "Dropout")
  spread = c.dropout ? Spread{} : stored_sp ? std::move(*stored_sp) : weight_spread(c, profile);
  bound_lse_shared(c, profile, mags, spread);  // a stored model's
  sys_rel = dropout_scale_error(profile, c);
  // P's underflow term needs sum_j |v_jc| per element, only where some row may underflow.
  bool underflows = false;
  for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
  const std::vector<double> vsum = underflows ? out_value_sum(c) : std::vector<double>{};
  auto vsum_at = [&](std::size_t k) { return underflows ? vsum[k] : 0.0; };
  const FloatFormat fmt = float_format(c.dtype_of("out"));
  emin = 1 - fmt.bias;
  precision = fmt.precision;
  const RawTensor* valid = gold("row.valid");
  auto head_valid = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    return valid->data[static_cast<std::size_t>((b * H + h) * c.Nq + i)] != 0;
  };
  const double uo = unit_roundoff(c.dtype_of("out")), S = profile.safety;
  const MaskedRowConvention conv = profile.masked_rows;

  // out
  const std::vector<std::int64_t> oshape = mha ? std::vector<std::int64_t>{c.B, c.Nq, W}
                                               : std::vector<std::int64_t>{c.B, H, c.Nq, W};
  const RawTensor* out = returned("out", oshape);
  if (!out) return;
  const RawTensor *g = gold("out"), *ref = gold("out.ref"), *bound = gold("out.bound");
  const RawTensor* lo = golden.find("out.ref_lo");
  const Undecided und = undecided("out");
  AltCursor und_at{und};
  // Flat F64 views (the shapes are the golden file's; out's was checked above).
  const auto f64 = [&](const RawTensor* t) -> const unsigned char* {
    return t && t->dtype == DType::F64 && t->data.size() == out->data.size() / dtype_size(out->dtype) * 8
               ? t->data.data()
               : nullptr;
  };
  const unsigned char *xr = f64(ref), *xlr = f64(lo), *br = f64(bound);
  const bool fast = xr && br && (!lo || xlr) && g->dtype == out->dtype && g->data.size() == out->data.size() &&
                    !c.o_scale;
  // An FP8 out is O / o_scale (CONTRACT section 9): each element is judged in out's units, the
  // exact value, its bound, limit and scale divided by o_scale; E4M3 saturates at 448 (the
  // saturated element is compared with the saturated exact value, which clamping can only bring
  // closer, and takes no part in the statistics). The output format's floor is in out's units.
  const double os = c.o_scale ? *c.o_scale : 1;
  const bool saturates = c.o_scale && c.dtype_of("out") == DType::F8_E4M3;
  const double fp8_floor = c.o_scale ? 2 * min_subnormal(c.dtype_of("out")) * (os - 1) : 0;
  // amax = max |O| before the division (F32): |max|a| - max|b|| <= max |a - b|, so the largest of
  // out's limits with O rounded to F32 in place of out's dtype (then amax's own rounding)
  double amax_lim = 0;
  auto scaled_element = [&](Acc& a, std::size_t k, double x, double xl, double bd, double lim, double compute,
                            double sc, std::int64_t row, const std::uint64_t* alt) {
    if (!c.o_scale) return element(a, *out, *g, k, x, xl, bd, lim, compute, sc, row, alt);
    double xs = x / os, xls = xl / os;
    double ls = (lim + S * fp8_floor) / os;
    // past the largest finite value (E4M3 saturates, E5M2 overflows): no statistics; where even
    // |x| - limit is past it, every result within the limit saturates (overflows): limit 0
    const double top = saturates ? 448.0 : 57344.0, edge = saturates ? 448.0 : 61440.0;
    if (std::fabs(xs) > top) compute = sc = -1;
    if (std::fabs(xs) > edge) ls = std::max(0.0, edge - (std::fabs(xs) - ls));
    if (saturates && std::fabs(xs) > 448) xs = std::copysign(448.0, xs), xls = 0;
    // E5M2: where |x| + limit reaches the overflow threshold, infinity of x's sign is within
    std::uint64_t inf_bits = std::signbit(xs) ? 0xFC : 0x7C;
    if (!saturates && std::fabs(xs) + ls >= edge) alt = &inf_bits;
    element(a, *out, *g, k, xs, xls, bd / os, ls, compute < 0 ? compute : compute / os,
            sc < 0 ? sc : (sc + fp8_floor) / os, row, alt);
  };
  const std::size_t w = dtype_size(out->dtype);
  Acc acc;
  acc.t.tensor = "out";
  acc.sample.z.reserve(out->data.size() / w);  // as for weights below
  if (spread.exact) {  // one per compared element at most
    acc.bias.finals.reserve(out->data.size() / w);
    advise_huge_pages(acc.bias.finals.data(), acc.bias.finals.capacity() * sizeof(acc.bias.finals[0]));
  }
  advise_huge_pages(acc.sample.z.data(), acc.sample.z.capacity() * sizeof(double));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      if (!c.query_valid(b, i)) continue;  // padding rows are not compared
      for (std::int64_t h = 0; h < (mha ? 1 : H); ++h) {
        bool masked = false;  // some head of the row (token) is fully masked
        for (std::int64_t hh = (mha ? 0 : h); hh < (mha ? H : h + 1); ++hh) masked = masked || !head_valid(b, hh, i);
        const std::size_t row = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
        const RowLimits& L = limits[row];
        for (std::int64_t e = 0; e < W; ++e) {
          const auto k = static_cast<std::size_t>(static_cast<std::int64_t>(row) * W + e);
          if (fast && !masked && rep.worst && trivial_at(out->dtype, out->data.data(), g->data.data(), xr, k)) {
            // bits equal to the golden element, both it and the reference finite: error 0;
            // the statistics as in element()
            ++acc.t.compared;
            double x, bd, xl = 0;
            std::memcpy(&x, xr + 8 * k, 8);
            std::memcpy(&bd, br + 8 * k, 8);
            acc.t.largest_limit = std::max(acc.t.largest_limit, out_limit(profile, L, uo, bd, vsum_at(k), x));
            const double sc = out_scale_at(row, k, x, bd, vsum_at(k));
            acc.sample.add(static_cast<std::int64_t>(row), 0, final_share(uo, x, sc), 1, shift_of(x, sc));
            if (x != 0) {
              if (xlr) std::memcpy(&xl, xlr + 8 * k, 8);
              const double compute = out_compute(L, bd, vsum_at(k));
              const double y = finite_value(out->dtype, out->data.data() + k * w);
              if (compute >= 0) statistics(acc, y, x, xl, compute);
              if (spread.exact) bias_add(acc, row, k, y, x, xl, bd, vsum_at(k));
            }
            continue;
          }
          const double y = value_of(*out, k);
          if (masked && conv == MaskedRowConvention::Error) {
            fail("returned an output for a fully masked row, where it declares refusal");
            return;
          }
          if (masked && conv == MaskedRowConvention::Nan) {
            if (!std::isnan(y)) fail("a fully masked row gives " + std::to_string(y) + ", not NaN as declared");
            continue;
          }
          if (masked && conv == MaskedRowConvention::Mean) {
            if (mha) continue;  // the mean of one head's values, mixed by W_o: not compared
            const std::int64_t gk = c.kv_head(h);
            double s = 0, sa = 0;
            for (std::int64_t j = 0; j < c.Nk; ++j) {
              const double v = c.v.values[static_cast<std::size_t>(((b * c.Hkv + gk) * c.Nk + j) * c.Dv + e)];
              s += v;
              sa += std::fabs(v);
            }
            const double n = static_cast<double>(c.Nk);
            const double lim = S * ((L.out_coef + (n + 2) * unit_roundoff(profile.pv_accum)) * sa / n + uo * std::fabs(s / n) + L.floor);
            scaled_element(acc, k, s / n, 0, sa / n, lim, -1, -1, 0, nullptr);
            continue;
          }
          const double x = value_of(*ref, k), xl = lo ? value_of(*lo, k) : 0, bd = value_of(*bound, k);
          const double lim = out_limit(profile, L, uo, bd, vsum_at(k), x);
          if (c.want_amax)
            amax_lim = std::max(amax_lim, out_limit(profile, limits_in(row, DType::F32), unit_roundoff(DType::F32), bd,
                                                    vsum_at(k), x));
          scaled_element(acc, k, x, xl, bd, lim, masked ? -1 : out_compute(L, bd, vsum_at(k)),
                         masked ? -1 : out_scale_at(row, k, x, bd, vsum_at(k)), static_cast<std::int64_t>(row),
                         und_at.find(k));
          // (the bias test's P part is in O's units: not run on an out scaled by o_scale)
          if (spread.exact && !masked && !c.o_scale && std::isfinite(y) && std::isfinite(x) && std::isfinite(xl))
            bias_add(acc, row, k, y, x, xl, bd, vsum_at(k));
        }
      }
    }
  finish(acc);
  if (c.want_amax) {
    if (const RawTensor* got = result.find("amax"); !got || got->dtype != DType::F32 || !got->shape.empty()) {
      fail("the result has no amax of dtype F32 and shape []");
    } else {
      const RawTensor* ga = gold("amax");
      const double x = value_of(*ga, 0);  // the exact amax rounded once to F32: u |x| more
      Acc a;
      a.t.tensor = "amax";
      element(a, *got, *ga, 0, x, 0, x, amax_lim + S * unit_roundoff(DType::F32) * std::fabs(x), -1, -1, 0);
      finish(a);
    }
  }
  sys_rel = 0;  // weights, lse and scores are those without dropout

  // weights and lse, per head row
  auto per_row = [&](const std::string& name, bool wanted, bool returns, bool weights) {
    if (!wanted) return;
    if (!returns) {
      rep.reason += (rep.reason.empty() ? "" : "; ") + name + " not returned (declared)";
      return;
    }
    const std::vector<std::int64_t> shape = weights ? std::vector<std::int64_t>{c.B, H, c.Nq, c.Nk}
                                                    : std::vector<std::int64_t>{c.B, H, c.Nq};
    const RawTensor* got = returned(name, shape);
    if (!got) return;
    const RawTensor *gg = gold(name), *gref = gold(name + ".ref");
    // Judged in its own dtype (that of the case given to the implementation): against the
    // golden tensor when that is in the same dtype, else against the .ref alone.
    const DType t = got->dtype;
    const double u_t = unit_roundoff(t);
    const Undecided u = gg->dtype == t ? undecided(name) : Undecided{};
    AltCursor u_at{u};
    const std::size_t n_el = got->data.size() / dtype_size(got->dtype);
    const bool blocks = gg->dtype == got->dtype && gg->data.size() == got->data.size() &&
                        gref->dtype == DType::F64 && gref->data.size() == n_el * 8;
    Acc a;
    a.t.tensor = name;
    a.sample.z.reserve(n_el);  // at most one normalised error per element, without regrowing
    advise_huge_pages(a.sample.z.data(), a.sample.z.capacity() * sizeof(double));
    const std::int64_t per = weights ? c.Nk : 1;
    std::vector<char> slowed;  // per element of a block: compared by element()
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          if (!c.query_valid(b, i)) continue;
          const bool masked = !head_valid(b, h, i);
          const auto lrow = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
          const auto hrow = static_cast<std::size_t>((b * H + h) * c.Nq + i);
          const RowLimits L = limits_in(lrow, t);
          const auto row0 = static_cast<std::size_t>(((b * H + h) * c.Nq + i) * per);
          const RowWeightScale ws = weights ? row_weight_scale(profile, spread, scales[lrow], L, u_t, hrow)
                                            : RowWeightScale{};
          auto slow = [&](std::size_t k) {  // one element, as it has always been compared
            const double y = value_of(*got, k);
            if (masked && conv == MaskedRowConvention::Nan) {  // lse: NaN, or -inf as log 0
              if (!std::isnan(y) && (weights || y != -INFINITY))
                fail("a fully masked row's " + name + " is " + std::to_string(y) + ", not NaN" +
                     (weights ? "" : " or -inf") + " as declared");
              return;
            }
            if (masked && conv == MaskedRowConvention::Mean) return;   // 1/Nk or log Nk + S: not compared
            if (masked && conv == MaskedRowConvention::Error) return;  // reported on out
            const double x = value_of(*gref, k);
            const double lim = weights ? weight_limit(profile, L, u_t, x) : lse_limit(profile, L, u_t, x);
            const RowScales& R = scales[lrow];
            const double sc = weights ? ws.at(x) : lse_scale(profile, spread, R, L, u_t, hrow, x);
            element(a, *got, *gg, k, x, 0, weights ? 1.0 : std::max(1.0, std::fabs(x)), lim, -1, sc,
                    static_cast<std::int64_t>(hrow), u_at.find(k));
          };
          for (std::int64_t j = 0; j < per;) {
            const auto k = row0 + static_cast<std::size_t>(j);
            if (!blocks || masked || !rep.worst) {
              slow(k);
              ++j;
              continue;
            }
            // Elements equal to the golden ones (finite, reference finite) have error 0 and
            // only count: by blocks, and one by one in a block with another element.
            const auto n = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(kBlock), per - j));
            const unsigned char *yd = got->data.data(), *gd = gg->data.data(), *rd = gref->data.data();
            slowed.assign(n, 0);
            if (n == kBlock && block_trivial(got->dtype, yd, gd, rd, k)) a.t.compared += static_cast<std::int64_t>(n);
            else
              scan_elements(got->dtype, yd, gd, rd, k, n, a.t.compared, [&](std::size_t kk) {
                slowed[kk - k] = 1;
                slow(kk);
              });
            // the largest limit, over the elements counted without their limit too; those
            // (error 0) join the statistical tier's sample
            if (weights) {
              zero_error_weights(a, rd + 8 * k, n, slowed.data(), profile, L, u_t, ws, static_cast<std::int64_t>(hrow));
              j += static_cast<std::int64_t>(n);
              continue;
            }
            const RowScales& R = scales[lrow];
            for (std::size_t e = k; e < k + n; ++e) {
              double x;
              std::memcpy(&x, rd + 8 * e, 8);
              a.t.largest_limit = std::max(a.t.largest_limit, weights ? weight_limit(profile, L, u_t, x) : lse_limit(profile, L, u_t, x));
              if (slowed[e - k]) continue;
              const double sc = weights ? ws.at(x) : lse_scale(profile, spread, R, L, u_t, hrow, x);
              a.sample.add(static_cast<std::int64_t>(hrow), 0, final_share(u_t, x, sc));
            }
            j += static_cast<std::int64_t>(n);
          }
        }
    if (!weights) a.sample.add_row_shifts(spread.lse_shared);  // roundings shared across rows
    finish(a);
  };
  per_row("weights", c.want_weights, profile.returns_weights, true);
  per_row("lse", c.want_lse, profile.returns_lse, false);

  // scores, per element: step 1's error (TOLERANCE.md), -inf exactly where not allowed
  if (c.want_scores && !profile.returns_scores)
    rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("scores not returned (declared)");
  if (c.want_scores && profile.returns_scores)
    if (const RawTensor* got = returned("scores", {c.B, H, c.Nq, c.Nk})) {
      const RawTensor *gg = gold("scores"), *gref = gold("scores.ref");
      const double u_t = unit_roundoff(got->dtype);
      const Undecided u = gg->dtype == got->dtype ? undecided("scores") : Undecided{};
      AltCursor u_at{u};
      Acc a;
      a.t.tensor = "scores";
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            if (!c.query_valid(b, i)) continue;
            const auto lrow = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
            const auto hrow = static_cast<std::int64_t>((b * H + h) * c.Nq + i);
            for (std::int64_t j = 0; j < c.Nk; ++j) {
              const auto k = static_cast<std::size_t>(hrow * c.Nk + j);
              const double x = value_of(*gref, k);
              element(a, *got, *gg, k, x, 0, std::max(1.0, std::fabs(x)),
                      score_limit(profile, limits_in(lrow, got->dtype), u_t, x), -1, -1, hrow, u_at.find(k));
            }
          }
      finish(a);
    }

  sys_rel = dropout_scale_error(profile, c);  // every gradient carries the keep scale
  if (c.wants_gradients()) gradients();

  if (rep.failed_elements > 0 && rep.worst) {
    char buf[200];
    const ElementReport& we = *rep.worst;
    if (exact_is_normal(we) || !std::isfinite(we.error))
      std::snprintf(buf, sizeof buf, "%lld element%s beyond the limit; worst %.3g times the limit",
                    static_cast<long long>(rep.failed_elements), rep.failed_elements == 1 ? "" : "s", we.limit_ratio);
    else
      std::snprintf(buf, sizeof buf, "%lld element%s beyond the limit; worst: error %.3g where the exact value is %.3g (limit %.3g)",
                    static_cast<long long>(rep.failed_elements), rep.failed_elements == 1 ? "" : "s", we.error, we.expected,
                    we.limit);
    // the elements beyond their limits say more than the statistics that follow from them
    const std::string earlier = rep.reason;
    rep.reason.clear();
    fail(buf);
    if (!earlier.empty() && earlier != rep.reason) rep.reason += "; " + earlier;
  }
}

}  // namespace attnoracle::conformance::comparing
