// The magnitudes of the values: out_bound_above and out_value_sum.
#include <algorithm>
#include <cmath>

#include "attnoracle/conformance/tolerance.hpp"
#include "magnitude_kernels.hpp"
#include "no_contraction.hpp"

namespace attnoracle::conformance {

namespace magnitudes {

std::vector<double> project(const Case& c, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
                            std::int64_t E, bool abs) {
  std::vector<double> p(static_cast<std::size_t>(c.B * c.Hq * N * E));
  std::vector<double> wa(abs ? w.values.size() : 0);
  for (std::size_t k = 0; k < wa.size(); ++k) wa[k] = std::fabs(w.values[k]);
  const double* W = abs ? wa.data() : w.values.data();
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t r = 0; r < c.Hq; ++r)
      for (std::int64_t n = 0; n < N; ++n) {
        double* s = &p[static_cast<std::size_t>(((b * c.Hq + r) * N + n) * E)];
        for (std::int64_t d = 0; d < c.D; ++d) {
          const double xv = x.values[static_cast<std::size_t>((b * N + n) * c.D + d)];
          const double a = abs ? std::fabs(xv) : xv;
          const double* wr = W + (r * c.D + d) * E;
          for (std::int64_t e = 0; e < E; ++e) s[e] += a * wr[e];
        }
      }
  return p;
}

}  // namespace magnitudes

namespace {
// max_j (sum = false) or sum_j (sum = true) of |v_jc| over the allowed keys, through |W_o| for mha.
std::vector<double> value_magnitude(const Case& c, bool sum) {
  const std::int64_t H = c.Hq, Nk = c.Nk, Dv = c.Dv;
  auto join = [sum](double& acc, double v) { acc = sum ? acc + v : std::max(acc, v); };
  if (c.kind == Kind::Sdpa) {
    std::vector<double> out(static_cast<std::size_t>(c.B * H * c.Nq * Dv), 0);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          double* o = &out[static_cast<std::size_t>(((b * H + h) * c.Nq + i) * Dv)];
          const Case::KeyRange r = c.key_range(b, i);
          for (std::int64_t j = r.first; j <= r.last; ++j) {
            if (!c.allowed(b, h, i, j)) continue;
            const double* v = &c.v.values[static_cast<std::size_t>(((b * c.Hkv + c.kv_head(h)) * Nk + j) * Dv)];
            for (std::int64_t e = 0; e < Dv; ++e) join(o[e], std::fabs(v[e]));
          }
        }
    return out;
  }
  // |V_r| <= |X| |W_v| element by element; its largest over the keys, through |W_o|.
  const std::vector<double> va = magnitudes::project(c, c.x_kv, c.w_v, Nk, Dv, true);
  std::vector<double> vmax(static_cast<std::size_t>(c.B * H * Dv), 0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t r = 0; r < H; ++r)
      for (std::int64_t j = 0; j < Nk; ++j)
        for (std::int64_t e = 0; e < Dv; ++e) {
          double& m = vmax[static_cast<std::size_t>((b * H + r) * Dv + e)];
          join(m, std::fabs(va[static_cast<std::size_t>(((b * H + r) * Nk + j) * Dv + e)]));
        }
  std::vector<double> out(static_cast<std::size_t>(c.B * c.Nq * c.Dout), 0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t e = 0; e < c.Dout; ++e) {
      double s = 0;
      for (std::int64_t rc = 0; rc < H * Dv; ++rc)
        s += vmax[static_cast<std::size_t>(b * H * Dv + rc)] *
             std::fabs(c.w_o.values[static_cast<std::size_t>(rc * c.Dout + e)]);
      for (std::int64_t i = 0; i < c.Nq; ++i) out[static_cast<std::size_t>((b * c.Nq + i) * c.Dout + e)] = s;
    }
  return out;
}
}  // namespace

std::vector<double> out_bound_above(const Case& c) { return value_magnitude(c, false); }
std::vector<double> out_value_sum(const Case& c) { return value_magnitude(c, true); }

}  // namespace attnoracle::conformance
