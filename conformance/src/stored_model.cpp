// The model's magnitudes stored with the golden tensors (stored_model.hpp). weight_spread's kr_j
// is the root of
//   kr_j^2 = u_qk^2 A_j + u_b^2 B_j + u_sm^2 C_j + c1,
//   A_j = (sqrt(Dk + 2) |scale| dabs_j)^2, B_j = bias_j^2, C_j = t_j^2 + s_j^2 + (s_j - m)^2,
//   c1 = (exp_ulps u_sm)^2 + u_sm^2 + u_p^2,
// (t_j the softcapped score, s_j = t_j + bias_j, m their maximum), so every sum over the keys of
// a weight-dependent term times kr_j^2 is the same combination of four sums no profile enters:
//   key_c^2 = sum_j w_j^2 (v_jc - x_c)^2 kr_j^2 = u_qk^2 KA_c + u_b^2 KB_c + u_sm^2 KC_c + c1 K1_c,
// and likewise key_sum^2 per row; max_j kr_j^2 is at most the same combination of max_j A_j,
// max_j B_j, max_j C_j and c1. P's part of the bias test depends on P's dtype alone: stored for
// each P dtype a profile may declare.
#include "attnoracle/conformance/stored_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "attnoracle/reference/error.hpp"
#include "no_contraction.hpp"

namespace attnoracle::conformance {

namespace {

double sq(double x) { return x * x; }

// The sums here and weight_spread's, of n nonnegative terms of at most 20 roundings each, each
// err by less than (n + 20) 2^-53 relative, and by n 2^-1074 absolute where terms underflow: a
// stored root of (S (1 + (2n + 64) 2^-53) + n 2^-1070), rounded up, is at least either's root.
double inflated_root(double S, std::int64_t n) {
  const double nd = static_cast<double>(n);
  const double r = std::sqrt(S * (1 + (2 * nd + 64) * 0x1p-53) + nd * 0x1p-1070) * (1 + 0x1p-52);
  return std::nextafter(r, INFINITY);
}
float up_f32(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafterf(f, INFINITY);
  return f;
}

Profile with_p(DType t) {
  Profile p = builtin_profile("fp32");
  p.p = t;
  return p;
}

}  // namespace

void put_model(const Case& c, SafeTensorsFile& golden) {
  if (c.kind != Kind::Sdpa) return;
  const std::int64_t H = c.Hq, Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
  const auto rows = static_cast<std::size_t>(c.B * H * c.Nq), dv = static_cast<std::size_t>(Dv);
  const std::vector<RowMagnitudes> mags = row_magnitudes(c);
  // z_part, wv, partial (no profile enters them) and P's part for each P dtype
  Spread base;
  RawTensor pb{"model.p_bias", DType::F64, {std::size(kModelPDTypes), 4}, {}};
  pb.data.resize(std::size(kModelPDTypes) * 4 * 8);
  for (std::size_t t = 0; t < std::size(kModelPDTypes); ++t) {
    Spread s = weight_spread(c, with_p(kModelPDTypes[t]));
    std::memcpy(pb.data.data() + t * 32, s.p_bias, 32);
    if (t == 0) base = std::move(s);
  }

  RawTensor rt{"model.rows", DType::F64, {c.B, H, c.Nq, kModelRowFields}, {}};
  RawTensor ot{"model.out", DType::F32, {c.B, H, c.Nq, Dv, kModelOutFields}, {}};
  rt.data.assign(rows * kModelRowFields * 8, 0);
  ot.data.assign(rows * dv * kModelOutFields * 4, 0);
  const double scale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  const double akey = std::sqrt(static_cast<double>(Dk) + 2) * std::fabs(scale);
  const bool plain = !c.mask && !c.bias;
  std::vector<std::int64_t> keys;
  std::vector<double> w, t, s, A, B, C, x(dv), sums(4 * dv);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = c.kv_head(h);
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const auto row = static_cast<std::size_t>((b * H + h) * c.Nq + i);
        double field[kModelRowFields] = {mags[row].dot_abs, mags[row].score_abs,
                                         static_cast<double>(mags[row].keys), mags[row].bias_abs,
                                         base.z_part[row]};
        const double* q = &c.q.values[row * static_cast<std::size_t>(Dk)];
        keys.clear();
        const Case::KeyRange r = c.key_range(b, i);
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (plain ? c.position_allowed(b, i, j) : c.allowed(b, h, i, j)) keys.push_back(j);
        const std::size_t n = keys.size();
        w.assign(n, 0), t.assign(n, 0), s.assign(n, 0), A.assign(n, 0), B.assign(n, 0), C.assign(n, 0);
        // the weights as weight_spread computes them (dots summed in d order)
        for (std::size_t a = 0; a < n; ++a) {
          const double* k = &c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * Nk + keys[a]) * Dk)];
          double dot = 0, dabs = 0;
          for (std::int64_t d = 0; d < Dk; ++d) {
            dot += q[d] * k[d];
            dabs += std::fabs(q[d]) * std::fabs(k[d]);
          }
          double tj = dot * scale;
          if (cap > 0) tj = cap * std::tanh(tj / cap);
          const double bj = plain ? 0.0 : c.bias_at(b, h, i, keys[a]);
          t[a] = tj;
          s[a] = tj + bj;
          A[a] = sq(akey * dabs);
          B[a] = sq(bj);
        }
        const std::int64_t nn = static_cast<std::int64_t>(n);
        if (n > 0) {
          const double m = *std::max_element(s.begin(), s.end());
          double z = 0;
          for (std::size_t j = 0; j < n; ++j) {
            C[j] = sq(t[j]) + sq(s[j]) + sq(s[j] - m);
            z += (w[j] = std::exp(s[j] - m));
          }
          double rs[4] = {0, 0, 0, 0}, mx[3] = {0, 0, 0};
          for (std::size_t j = 0; j < n; ++j) {
            w[j] /= z;
            const double w2 = sq(w[j]);
            rs[0] += w2 * A[j], rs[1] += w2 * B[j], rs[2] += w2 * C[j], rs[3] += w2;
            mx[0] = std::max(mx[0], A[j]), mx[1] = std::max(mx[1], B[j]), mx[2] = std::max(mx[2], C[j]);
          }
          for (int f = 0; f < 4; ++f) field[5 + f] = inflated_root(rs[f], nn);
          for (int f = 0; f < 3; ++f) field[9 + f] = inflated_root(mx[f], 1);
          // per element: x_c in key order, then the four sums
          const double* vb = &c.v.values[static_cast<std::size_t>((b * c.Hkv + g) * Nk * Dv)];
          std::fill(x.begin(), x.end(), 0.0);
          for (std::size_t j = 0; j < n; ++j) {
            const double* v = vb + keys[j] * Dv;
            for (std::size_t e = 0; e < dv; ++e) x[e] += w[j] * v[e];
          }
          std::fill(sums.begin(), sums.end(), 0.0);
          double *ka = sums.data(), *kb = ka + dv, *kc = kb + dv, *k1 = kc + dv;
          for (std::size_t j = 0; j < n; ++j) {
            const double* v = vb + keys[j] * Dv;
            const double aj = A[j], bj = B[j], cj = C[j], wj = w[j];
            for (std::size_t e = 0; e < dv; ++e) {
              const double d = sq(wj * (v[e] - x[e]));
              ka[e] += d * aj;
              kb[e] += d * bj;
              kc[e] += d * cj;
              k1[e] += d;
            }
          }
          float* o = reinterpret_cast<float*>(ot.data.data()) + row * dv * kModelOutFields;
          for (std::size_t e = 0; e < dv; ++e) {
            const float parts[kModelOutFields] = {
                up_f32(inflated_root(ka[e], nn)), up_f32(inflated_root(kb[e], nn)), up_f32(inflated_root(kc[e], nn)),
                up_f32(inflated_root(k1[e], nn)),
                // sq of the stored root is at least sq(wv) + sq(partial) as out_scale adds them
                up_f32(std::sqrt(sq(base.wv[row * dv + e]) + sq(base.partial[row * dv + e])) * (1 + 0x1p-50))};
            std::memcpy(o + e * kModelOutFields, parts, sizeof parts);
          }
        }
        std::memcpy(rt.data.data() + row * kModelRowFields * 8, field, sizeof field);
      }
    }
  golden.put(std::move(rt));
  golden.put(std::move(ot));
  golden.put(std::move(pb));
}

std::optional<StoredModel> stored_model(const Case& c, const SafeTensorsFile& golden, const std::string& file) {
  StoredModel m{golden.find("model.rows"), golden.find("model.out"), golden.find("model.p_bias")};
  if (!m.rows && !m.out && !m.p_bias) return std::nullopt;
  auto check = [&](const RawTensor* t, const char* name, DType dt, const std::vector<std::int64_t>& shape) {
    if (!t) throw InputError(file, name, "missing: model.rows, model.out and model.p_bias come together");
    if (c.kind != Kind::Sdpa) throw InputError(file, name, "a stored model is for kind sdpa only");
    if (t->dtype != dt || t->shape != shape)
      throw InputError(file, name, "must be " + std::string(dtype_name(dt)) + " of the shape the case gives it");
  };
  check(m.rows, "model.rows", DType::F64, {c.B, c.Hq, c.Nq, kModelRowFields});
  check(m.out, "model.out", DType::F32, {c.B, c.Hq, c.Nq, c.Dv, kModelOutFields});
  check(m.p_bias, "model.p_bias", DType::F64, {static_cast<std::int64_t>(std::size(kModelPDTypes)), 4});
  return m;
}

std::vector<RowMagnitudes> stored_magnitudes(const StoredModel& m) {
  const auto rows = static_cast<std::size_t>(m.rows->numel() / kModelRowFields);
  std::vector<RowMagnitudes> out(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    double f[4];
    std::memcpy(f, m.rows->data.data() + r * kModelRowFields * 8, sizeof f);
    out[r] = {f[0], f[1], static_cast<std::int64_t>(f[2]), f[3]};
  }
  return out;
}

std::optional<Spread> stored_spread(const StoredModel& m, const Profile& p) {
  Spread sp;
  sp.exact = true;
  if (p.p != DType::F64) {
    const auto* at = std::find(std::begin(kModelPDTypes), std::end(kModelPDTypes), p.p);
    if (at == std::end(kModelPDTypes)) return std::nullopt;
    std::memcpy(sp.p_bias, m.p_bias->data.data() + static_cast<std::size_t>(at - std::begin(kModelPDTypes)) * 32, 32);
  }
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double ub = p.bias ? unit_roundoff(*p.bias) : 0;
  const double coef[4] = {uq, ub, us, std::sqrt(sq(p.exp_ulps * us) + sq(us) + sq(up)) * (1 + 0x1p-50)};
  // (a zero coefficient leaves its term out: an infinite stored root times 0 is no bound)
  auto combine = [&](const double r[4]) {
    double v = 0;
    for (int t = 0; t < 4; ++t)
      if (coef[t] > 0) v += sq(coef[t] * r[t]);
    return std::sqrt(v) * (1 + 0x1p-48);  // above the few roundings of this combination
  };
  const auto rows = static_cast<std::size_t>(m.rows->numel() / kModelRowFields);
  const auto dv = static_cast<std::size_t>(m.out->shape[3]);
  sp.key_sum.resize(rows);
  sp.key_max.resize(rows);
  sp.z_part.resize(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    double f[kModelRowFields];
    std::memcpy(f, m.rows->data.data() + r * kModelRowFields * 8, sizeof f);
    sp.z_part[r] = f[4];
    if (!(f[8] > 0)) {  // no key (a row with one has a positive root of sum w^2): weight_spread's 0
      sp.key_sum[r] = sp.key_max[r] = 0;
      continue;
    }
    sp.key_sum[r] = combine(f + 5);
    const double mx[4] = {f[9], f[10], f[11], 1};
    sp.key_max[r] = combine(mx);
  }
  sp.key.resize(rows * dv);
  sp.wv.resize(rows * dv);
  const auto* o = reinterpret_cast<const float*>(m.out->data.data());
  for (std::size_t k = 0; k < rows * dv; ++k) {
    const float* e = o + k * kModelOutFields;
    const double r[4] = {e[0], e[1], e[2], e[3]};
    sp.key[k] = combine(r);
    sp.wv[k] = e[4];
  }
  return sp;
}

}  // namespace attnoracle::conformance
