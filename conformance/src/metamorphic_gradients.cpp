// The gate's gradient limits of a twin's side (compare_gradients.cpp's worst-case tier), from
// the reference's results of that side.
#include <cmath>

#include "twins.hpp"

namespace attnoracle::conformance {
namespace {

const RawTensor* golden_tensor(const std::vector<RawTensor>& golden, const std::string& name) {
  for (const RawTensor& t : golden)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<double> values(const RawTensor& t) {
  const std::size_t es = dtype_size(t.dtype);
  std::vector<double> v(t.data.size() / es);
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = decode_float(t.dtype, t.data.data() + k * es);
  return v;
}

}  // namespace

std::map<std::string, GradientLimits> gradient_limits(const Profile& p, const Case& c,
                                                      const std::vector<RowMagnitudes>& mags,
                                                      const std::vector<RowLimits>& limits,
                                                      const std::vector<RawTensor>& golden,
                                                      const std::map<std::string, DType>& dtypes) {
  std::map<std::string, GradientLimits> out;
  const RawTensor *oref = golden_tensor(golden, "out.ref"), *obound = golden_tensor(golden, "out.bound");
  if (c.kind != Kind::Sdpa || !oref || !obound) return out;
  const MaskedRowConvention conv = p.masked_rows;  // as the gate: then no gradient is judged
  if (conv == MaskedRowConvention::Nan || conv == MaskedRowConvention::Mean)
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) return out;
  bool underflows = false;
  for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
  const GradientErrors ge = gradient_errors(p, c, mags, limits, values(*oref), values(*obound),
                                            underflows ? out_value_sum(c) : std::vector<double>{});
  const double group = static_cast<double>(c.Hq / c.Hkv), rows = group * static_cast<double>(c.Nq);
  const double rot = c.rotary ? 3 : 0, gqa = group > 1 ? group : 0;
  // the terms each element sums and GQA's partial sums, as the gate counts them
  auto one = [&](const std::string& name, const std::vector<double>& err, auto terms_of, double partials) {
    const auto dt = dtypes.find(name);
    const RawTensor *gref = golden_tensor(golden, name + ".ref"), *gb = golden_tensor(golden, name + ".bound");
    if (dt == dtypes.end() || !gref || !gb || err.empty()) return;
    const double uo = unit_roundoff(dt->second), floor = 2 * min_subnormal(dt->second);
    GradientLimits& g = out[name];
    g.ref = values(*gref);
    const std::vector<double> bound = values(*gb);
    g.limit.resize(err.size());
    for (std::size_t k = 0; k < err.size(); ++k) {
      const double n = terms_of(k);
      g.limit[k] = gradient_limit(p, err[k], n, partials * uo, bound[k], uo,
                                  floor + n * min_normal(p.grad_accum), g.ref[k]);
    }
  };
  one("dq", ge.dq, [&](std::size_t k) { return limits[k / static_cast<std::size_t>(c.Dk)].keys + rot; }, 0);
  one("dk", ge.dk, [&](std::size_t) { return rows + rot; }, gqa);
  one("dv", ge.dv, [&](std::size_t) { return rows; }, gqa);
  if (c.bias) {
    const double per = static_cast<double>(c.B * c.Hq * c.Nq * c.Nk) / static_cast<double>(c.bias->values.size());
    one("dbias", ge.dbias, [&](std::size_t) { return per; }, 0);
  }
  if (c.sinks) one("dsinks", ge.dsinks, [&](std::size_t) { return static_cast<double>(c.B * c.Nq); }, 0);
  return out;
}

}  // namespace attnoracle::conformance
