// Independent check of the gradients: every golden element of dq, dk, dv, dbias and dsinks (and their
// .ref and .bound) of random problems computed a second way, by the plain formulas of CONTRACT
// section 7 in 600-bit MPFR through Boost.Multiprecision, rounded by the tests' own integer
// rounding (int_round), and compared bit for bit; every enclosure the reference reports must
// contain the value. Also: <gradient, direction> against an MPFR finite difference of out.
//
// ATTNORACLE_TEST_SCALE scales the problem count (default 1: 1000 problems).
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <boost/multiprecision/mpfr.hpp>
#include <gtest/gtest.h>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "int_round.hpp"
#include "random_case.hpp"

namespace attnoracle::testing {
namespace {

namespace bmp = boost::multiprecision;
using Real = bmp::number<bmp::mpfr_float_backend<181>, bmp::et_off>;  // >= 600 bits
// A second look where a 600-bit value is within its error of a rounding boundary: ~2500 bits.
using RealHi = bmp::number<bmp::mpfr_float_backend<760>, bmp::et_off>;
using Shape = std::vector<std::int64_t>;

std::vector<double> decode(const RawTensor& t) {
  std::vector<double> v;
  if (t.dtype == DType::BOOL) {
    for (unsigned char b : t.data) v.push_back(b ? 1.0 : 0.0);
    return v;
  }
  const auto size = static_cast<std::size_t>(format_width(t.dtype) / 8);
  for (std::size_t e = 0; e * size < t.data.size(); ++e)
    v.push_back(bits_to_double(load_bits(t.data.data() + e * size, t.dtype), t.dtype));
  return v;
}

double bcast(const std::vector<double>& a, const Shape& shape, std::int64_t b, std::int64_t h, std::int64_t i,
             std::int64_t j) {
  const std::int64_t idx[4] = {b, h, i, j};
  const std::size_t r = shape.size();
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < r; ++d) flat = flat * shape[d] + (shape[d] == 1 ? 0 : idx[4 - r + d]);
  return a[static_cast<std::size_t>(flat)];
}
std::int64_t bcast_flat(const Shape& shape, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  const std::int64_t idx[4] = {b, h, i, j};
  const std::size_t r = shape.size();
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < r; ++d) flat = flat * shape[d] + (shape[d] == 1 ? 0 : idx[4 - r + d]);
  return flat;
}

// The problem, re-read from the raw file by our own code.
struct Problem {
  std::int64_t B = 0, H = 0, Hkv = 0, Nq = 0, Nk = 0, Dk = 0, Dv = 0;
  std::vector<double> q, k, v, dout, mask, bias, qmask, sinks, keep;
  Shape mask_shape, bias_shape, keep_shape;
  std::string dropout_p;  // attn.dropout_p, with keep (dropout_mask): empty without dropout
  bool has_mask = false, has_bias = false, has_qmask = false, has_sinks = false;
  std::vector<std::int64_t> lq, lk;  // [B]: seqlens_q, seqlens_k, else Nq, Nk
  std::string causal = "none", scale, softcap;
  bool window = false;
  std::int64_t left = 0, right = 0;

  explicit Problem(const SafeTensorsFile& f) {
    auto meta = [&](const char* key, const std::string& d) {
      auto it = f.metadata.find(key);
      return it == f.metadata.end() ? d : it->second;
    };
    const RawTensor& tq = *f.find("q");
    q = decode(tq), k = decode(*f.find("k")), v = decode(*f.find("v")), dout = decode(*f.find("dout"));
    B = tq.shape[0], H = tq.shape[1], Nq = tq.shape[2], Dk = tq.shape[3];
    Hkv = f.find("k")->shape[1], Nk = f.find("k")->shape[2], Dv = f.find("v")->shape[3];
    if (const RawTensor* t = f.find("mask")) has_mask = true, mask = decode(*t), mask_shape = t->shape;
    if (const RawTensor* t = f.find("bias")) has_bias = true, bias = decode(*t), bias_shape = t->shape;
    if (const RawTensor* t = f.find("query_mask")) has_qmask = true, qmask = decode(*t);
    if (const RawTensor* t = f.find("sinks")) has_sinks = true, sinks = decode(*t);
    if (const RawTensor* t = f.find("dropout_mask")) keep = decode(*t), keep_shape = t->shape, dropout_p = meta("attn.dropout_p", "");
    auto lengths = [&](const char* name, std::int64_t n) {  // I32 or I64, little-endian
      std::vector<std::int64_t> l(static_cast<std::size_t>(B), n);
      if (const RawTensor* t = f.find(name))
        for (std::size_t e = 0; e < l.size(); ++e) {
          std::int64_t x = 0;
          if (t->dtype == DType::I32) {
            std::int32_t y;
            std::memcpy(&y, t->data.data() + 4 * e, 4);
            x = y;
          } else {
            std::memcpy(&x, t->data.data() + 8 * e, 8);
          }
          l[e] = x;
        }
      return l;
    };
    lq = lengths("seqlens_q", Nq), lk = lengths("seqlens_k", Nk);
    causal = meta("attn.causal", "none");
    scale = meta("attn.scale", "");
    softcap = meta("attn.softcap", "");
    const std::string w = meta("attn.window", "none");
    if (w != "none") {
      window = true;
      left = std::stoll(w.substr(0, w.find(',')));
      right = std::stoll(w.substr(w.find(',') + 1));
    }
  }
  bool padding(std::int64_t b, std::int64_t i) const {
    return (has_qmask && qmask[static_cast<std::size_t>(b * Nq + i)] == 0) || i >= lq[static_cast<std::size_t>(b)];
  }
  bool allowed(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (has_mask && bcast(mask, mask_shape, b, h, i, j) == 0) return false;
    const auto n = static_cast<std::size_t>(b);
    if (j >= lk[n]) return false;
    const std::int64_t a = causal == "bottom_right" ? i + (lk[n] - lq[n]) : i;
    if (causal != "none" && j > a) return false;
    if (window && (j < a - left || j > a + right)) return false;
    if (has_bias && std::isinf(bcast(bias, bias_shape, b, h, i, j))) return false;
    return true;
  }
};

template <class Real>
Real parse_real(const std::string& text) {
  if (text.find_first_of("xX") != std::string::npos) return Real(std::strtod(text.c_str(), nullptr));
  return Real(text);
}

// The gradients by the plain formulas, with their magnitude bounds (as the reference defines
// them) and the magnitudes our own rounding errors scale with.
template <class Real>
struct Grad {
  std::vector<Real> val, bound, err;
  explicit Grad(std::size_t n) : val(n, Real(0)), bound(n, Real(0)), err(n, Real(0)) {}
};
template <class Real>
struct Model {
  Grad<Real> dq, dk, dv, dbias, dsinks, out;
  double smag = 0;
  Model(const Problem& p)
      : dq(static_cast<std::size_t>(p.B * p.H * p.Nq * p.Dk)), dk(static_cast<std::size_t>(p.B * p.Hkv * p.Nk * p.Dk)),
        dv(static_cast<std::size_t>(p.B * p.Hkv * p.Nk * p.Dv)),
        dbias(p.has_bias ? p.bias.size() : 0), dsinks(p.has_sinks ? static_cast<std::size_t>(p.H) : 0),
        out(static_cast<std::size_t>(p.B * p.H * p.Nq * p.Dv)) {
    const Real scale = p.scale.empty() ? Real(1) / sqrt(Real(p.Dk)) : parse_real<Real>(p.scale);
    // Dropout: Z = P keep / (1 - p) in place of P in O, dP and dv.
    const Real ks = p.dropout_p.empty() ? Real(1) : 1 / (1 - parse_real<Real>(p.dropout_p));
    std::optional<Real> cap;
    if (!p.softcap.empty() && parse_real<Real>(p.softcap) != 0) cap = parse_real<Real>(p.softcap);
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t h = 0; h < p.H; ++h)
        for (std::int64_t i = 0; i < p.Nq; ++i) {
          if (p.padding(b, i)) continue;
          const std::int64_t g = h / (p.H / p.Hkv);
          auto Q = [&](std::int64_t c) { return p.q[static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dk + c)]; };
          auto K = [&](std::int64_t j, std::int64_t c) { return p.k[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dk + c)]; };
          auto V = [&](std::int64_t j, std::int64_t c) { return p.v[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dv + c)]; };
          auto dO = [&](std::int64_t c) { return p.dout[static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dv + c)]; };
          std::vector<std::int64_t> keys;
          for (std::int64_t j = 0; j < p.Nk; ++j)
            if (p.allowed(b, h, i, j)) keys.push_back(j);
          if (keys.empty()) continue;
          const std::size_t n = keys.size();
          std::vector<Real> T(n), S(n), P(n), dP(n), dPabs(n);
          Real m;
          for (std::size_t a = 0; a < n; ++a) {
            Real dot = 0;
            for (std::int64_t c = 0; c < p.Dk; ++c) dot += Real(Q(c)) * Real(K(keys[a], c));
            T[a] = scale * dot;
            const double bias = p.has_bias ? bcast(p.bias, p.bias_shape, b, h, i, keys[a]) : 0.0;
            S[a] = (cap ? *cap * tanh(T[a] / *cap) : T[a]) + Real(bias);
            smag = std::max(smag, abs(T[a]).template convert_to<double>() + std::fabs(bias));
            if (a == 0 || S[a] > m) m = S[a];
          }
          // With a sink: one more term of Z, and P_sink its share.
          const Real sink = p.has_sinks ? Real(p.sinks[static_cast<std::size_t>(h)]) : Real(0);
          if (p.has_sinks && sink > m) m = sink;
          Real Z = p.has_sinks ? exp(sink - m) : Real(0);
          for (std::size_t a = 0; a < n; ++a) Z += (P[a] = exp(S[a] - m));
          for (std::size_t a = 0; a < n; ++a) P[a] /= Z;
          const Real Psink = p.has_sinks ? exp(sink - m) / Z : Real(0);
          std::vector<Real> Zk(n);  // P keep / (1 - p)
          for (std::size_t a = 0; a < n; ++a)
            Zk[a] = p.dropout_p.empty() || bcast(p.keep, p.keep_shape, b, h, i, keys[a]) != 0 ? P[a] * ks : Real(0);
          Real D = 0, Dabs = 0, Dmag = 0;  // D, sum_c |dout_c O_c|, sum_c |dout_c| sum_j P_j |V_jc|
          for (std::int64_t c = 0; c < p.Dv; ++c) {
            Real o = 0, ob = 0;
            for (std::size_t a = 0; a < n; ++a) o += Zk[a] * Real(V(keys[a], c)), ob += Zk[a] * abs(Real(V(keys[a], c)));
            const auto io = static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dv + c);
            out.val[io] = o, out.bound[io] = ob, out.err[io] = ob;
            D += Real(dO(c)) * o;
            Dabs += std::fabs(dO(c)) * abs(o);
            Dmag += std::fabs(dO(c)) * ob;
          }
          if (p.has_sinks) {  // dsinks[h] = - sum_i P_sink D_i
            const auto ih = static_cast<std::size_t>(h);
            dsinks.val[ih] -= Psink * D;
            dsinks.bound[ih] += Psink * Dabs;
            dsinks.err[ih] += Psink * Dmag;
          }
          for (std::size_t a = 0; a < n; ++a) {
            dP[a] = 0, dPabs[a] = 0;
            for (std::int64_t c = 0; c < p.Dv; ++c)
              dP[a] += Real(dO(c)) * Real(V(keys[a], c)), dPabs[a] += abs(Real(dO(c)) * Real(V(keys[a], c)));
            if (!p.dropout_p.empty()) dP[a] *= Zk[a] / P[a], dPabs[a] *= Zk[a] / P[a];  // keep / (1 - p)
          }
          for (std::size_t a = 0; a < n; ++a) {
            const std::int64_t j = keys[a];
            const Real dS = P[a] * (dP[a] - D);
            const Real slope = cap ? 1 - pow(tanh(T[a] / *cap), 2) : Real(1);
            const Real dT = dS * slope;
            const Real A = P[a] * (dPabs[a] + Dabs), At = A * slope;
            const Real E = P[a] * (dPabs[a] + Dmag);  // what our rounding errors scale with
            for (std::int64_t c = 0; c < p.Dk; ++c) {
              const auto iq = static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dk + c);
              dq.val[iq] += scale * dT * Real(K(j, c));
              dq.bound[iq] += abs(scale) * At * abs(Real(K(j, c)));
              dq.err[iq] += abs(scale) * E * abs(Real(K(j, c)));
              const auto ik = static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dk + c);
              dk.val[ik] += scale * dT * Real(Q(c));
              dk.bound[ik] += abs(scale) * At * abs(Real(Q(c)));
              dk.err[ik] += abs(scale) * E * abs(Real(Q(c)));
            }
            for (std::int64_t c = 0; c < p.Dv; ++c) {
              const auto iv = static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dv + c);
              dv.val[iv] += Zk[a] * Real(dO(c));
              dv.bound[iv] += Zk[a] * abs(Real(dO(c)));
              dv.err[iv] += Zk[a] * abs(Real(dO(c)));
            }
            if (p.has_bias) {
              const auto ib = static_cast<std::size_t>(bcast_flat(p.bias_shape, b, h, i, j));
              dbias.val[ib] += dS;
              dbias.bound[ib] += A;
              dbias.err[ib] += E;
            }
          }
        }
  }
};

struct Report {
  std::vector<std::string> failures;
  std::uint64_t elements = 0, near = 0, near_zero = 0, undecided = 0, enclosures = 0;
  std::vector<std::string> notes;  // a few undecided and near elements, shown at the end
  void fail(const std::string& s) {
    if (failures.size() < 20) failures.push_back(s);
  }
};

const RawTensor* find(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return &t;
  return nullptr;
}

// Compares one gradient's tensors G, G.ref, G.bound with the model.
// What the rounding of a value known to within `margin` into t is: both ends' roundings.
template <class T>
std::pair<double, double> rounding(const T& x, const T& margin, DType t) {
  const T lo = x - margin, hi = x + margin;
  return {bits_to_double(round_mpfr(lo.backend().data(), t).bits, t),
          bits_to_double(round_mpfr(hi.backend().data(), t).bits, t)};
}

void compare(Report& rep, const EvalResult& r, const std::string& name, const Grad<Real>& g, double smag,
             const std::string& ctx, const std::function<const Grad<RealHi>&()>& hi) {
  const Real eps = ldexp(Real(1), -520);  // our error: far below 2^-520 (1 + smag) err
  for (const std::string& tn : {name, name + ".ref"}) {
    const RawTensor* t = find(r, tn);
    if (!t) return rep.fail(ctx + ": missing " + tn);
    if (t->data.size() != g.val.size() * dtype_size(t->dtype)) return rep.fail(ctx + ": " + tn + " has the wrong size");
    std::map<std::int64_t, double> alt;
    if (const RawTensor* u = find(r, tn + ".undecided")) {
      const RawTensor* a = find(r, tn + ".alt");
      for (std::size_t e = 0; e < u->data.size() / 8; ++e) {
        std::int64_t x;
        std::memcpy(&x, u->data.data() + 8 * e, 8);
        alt[x] = bits_to_double(load_bits(a->data.data() + e * dtype_size(a->dtype), a->dtype), a->dtype);
      }
    }
    for (std::size_t e = 0; e < g.val.size(); ++e) {
      ++rep.elements;
      const double got = bits_to_double(load_bits(t->data.data() + e * dtype_size(t->dtype), t->dtype), t->dtype);
      const Real margin = eps * (1 + smag) * g.err[e];
      auto [rlo, rhi] = rounding(g.val[e], margin, t->dtype);
      if (rlo != rhi) {  // the second look
        const Grad<RealHi>& G = hi();
        std::tie(rlo, rhi) = rounding(G.val[e], RealHi(ldexp(RealHi(1), -2400) * (1 + smag) * G.err[e]), t->dtype);
      }
      auto it = alt.find(static_cast<std::int64_t>(e));
      if (it != alt.end()) {
        ++rep.undecided;
        if (rep.notes.size() < 8)
          rep.notes.push_back(ctx + ": " + tn + "[" + std::to_string(e) + "] undecided: " + std::to_string(got) +
                              " / " + std::to_string(it->second) + ", value " + g.val[e].str(12));
        if (!(std::min(got, it->second) <= rhi && rlo <= std::max(got, it->second)))
          rep.fail(ctx + ": " + tn + "[" + std::to_string(e) + "] undecided but far from the value");
        continue;
      }
      if (rlo == rhi) {
        if (got != rlo)
          rep.fail(ctx + ": " + tn + "[" + std::to_string(e) + "] reference " + std::to_string(got) + " (" +
                   std::to_string(got) + "), expected " + std::to_string(rlo));
      } else {
        ++rep.near;
        if (got == 0 && rlo <= 0 && 0 <= rhi) ++rep.near_zero;
        else if (rep.notes.size() < 16)
          rep.notes.push_back(ctx + ": " + tn + "[" + std::to_string(e) + "] near: " + std::to_string(got) +
                              ", value " + g.val[e].str(12) + " +- " + margin.str(3));
        if (!(rlo <= got && got <= rhi)) rep.fail(ctx + ": " + tn + "[" + std::to_string(e) + "] outside the value's range");
      }
    }
  }
  const RawTensor* t = find(r, name + ".bound");
  if (!t) return rep.fail(ctx + ": missing " + name + ".bound");
  for (std::size_t e = 0; e < g.val.size(); ++e) {
    const Real got(bits_to_double(load_bits(t->data.data() + e * 8, DType::F64), DType::F64));
    const Real x = g.bound[e], margin = eps * (1 + smag) * g.err[e];
    if (!(got >= x - margin && got <= x + x * Real(1e-15) + margin + ldexp(Real(1), -1074)))
      rep.fail(ctx + ": " + name + ".bound[" + std::to_string(e) + "] not the bound rounded up");
  }
}

// A random dout exact in dtype t: normal, wide-range, or cancelling (entries of opposite signs
// in pairs), never a constant.
RawTensor random_dout(std::uint64_t seed, DType t, const Shape& shape) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 12345;
  auto next = [&] {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  auto uni = [&] { return static_cast<double>(next() >> 11) * 0x1p-53; };
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  std::vector<double> v(n);
  const int kind = static_cast<int>(next() % 3);
  const int range = t == DType::F16 || t == DType::BF16 ? 6 : 24;
  for (std::size_t e = 0; e < n; ++e) {
    double x = 0;
    for (int k = 0; k < 12; ++k) x += uni();
    x -= 6;
    if (kind == 1) x = std::ldexp(x, static_cast<int>(next() % (2 * range + 1)) - range);
    if (kind == 2 && e % 2 == 1) x = -v[e - 1] * (1 + std::ldexp(uni(), -8));
    v[e] = bits_to_double(round_double(x, t), t);
  }
  return float_tensor("dout", t, shape, v);
}

int scale_factor() {
  const char* s = std::getenv("ATTNORACLE_TEST_SCALE");
  return s ? std::max(1, std::atoi(s)) : 1;
}

RandomCaseOptions gradient_options() {
  RandomCaseOptions opt;
  opt.mha_fraction = 0;
  opt.max_seq = 24, opt.small_seq = 8, opt.max_dim = 12, opt.small_dim = 6;
  opt.allow_refusal = false;
  opt.weights_fraction = 0, opt.lse_fraction = 0;
  opt.sinks_fraction = 0.3;
  return opt;
}

// `count` random problems from `first_seed` on: every gradient element bit-identical to our own
// evaluation's rounding and enclosed by the reference's enclosures.
// Returns how many of them have sequence lengths.
int check_random_gradients(const RandomCaseOptions& opt, int count, std::uint64_t first_seed, bool dropout = false) {
  Report rep;
  std::uint64_t problems = 0, fast_units = 0, fallback_units = 0;
  int both = 0;
  int with_seqlens = 0, with_sinks = 0;
  for (int n = 0; n < count; ++n) {
    const auto seed = static_cast<std::uint64_t>(n) + first_seed;
    RandomCaseInfo info;
    SafeTensorsFile f = random_case(seed, opt, &info);
    with_seqlens += info.seqlens ? 1 : 0;
    const RawTensor& q = *f.find("q");
    const RawTensor& v = *f.find("v");
    const DType dt = seed % 4 == 0 ? DType::F64 : seed % 4 == 1 ? DType::F32 : q.dtype;
    f.put(random_dout(seed, dt, {q.shape[0], q.shape[1], q.shape[2], v.shape[3]}));
    f.metadata["attn.outputs"] = std::string(f.find("bias") ? "out,dq,dk,dv,dbias" : "out,dq,dk,dv") +
                                 (f.find("sinks") ? ",dsinks" : "");
    with_sinks += f.find("sinks") ? 1 : 0;
    if (dropout) {  // a keep mask of full shape, about 3 keys in 4 kept, and p from texts exact or not
      RawTensor keep{"dropout_mask", DType::BOOL, {q.shape[0], q.shape[1], q.shape[2], f.find("k")->shape[2]}, {}};
      keep.data.resize(static_cast<std::size_t>(keep.numel()));
      std::uint64_t z = seed * 0x9E3779B97F4A7C15ULL + 99;
      for (auto& x : keep.data) x = ((z = z * 6364136223846793005ULL + 1442695040888963407ULL) >> 33) % 4 != 0;
      f.put(std::move(keep));
      static const char* kP[] = {"0", "0.1", "0.25", "0.5", "0x1.8p-1", "0.9", "0.333"};
      f.metadata["attn.dropout_p"] = kP[seed % 7];
    }
    const std::string ctx = "seed " + std::to_string(seed) + " (" + info.summary + ")";
    const Case c = case_from_file("random.safetensors", f);
    EvalOptions eo;
    eo.threads = 2;
    const Problem p(f);
    const Model<Real> m(p);
    std::optional<Model<RealHi>> mh;
    auto precise = [&](const Grad<Real>& g) -> const Grad<RealHi>& {
      if (!mh) mh.emplace(p);
      return &g == &m.out ? mh->out : &g == &m.dq ? mh->dq : &g == &m.dk ? mh->dk : &g == &m.dv ? mh->dv : &g == &m.dbias ? mh->dbias : mh->dsinks;
    };
    std::mutex mu;
    eo.gradient_check = [&](const std::string& tensor, std::int64_t flat, const Enclosure& e, const Enclosure&) {
      const Grad<Real>& g = tensor == "dq"   ? m.dq
                            : tensor == "dk" ? m.dk
                            : tensor == "dv" ? m.dv
                            : tensor == "dbias" ? m.dbias : m.dsinks;
      const Real x = g.val[static_cast<std::size_t>(flat)];
      const Real margin = ldexp(Real(1), -520) * (1 + m.smag) * g.err[static_cast<std::size_t>(flat)];
      Real lo, hi;
      mpfr_set(lo.backend().data(), e.lo, MPFR_RNDD);
      mpfr_set(hi.backend().data(), e.hi, MPFR_RNDU);
      std::lock_guard<std::mutex> lk(mu);
      ++rep.enclosures;
      if (!(lo - margin <= x && x <= hi + margin))
        rep.fail(ctx + ": enclosure of " + tensor + "[" + std::to_string(flat) + "] misses the value");
    };
    const EvalResult r = evaluate(c, eo);
    ++problems;
    fast_units += r.stats.grad_units_fast;
    fallback_units += r.stats.grad_units_fallback;
    if (n % 4 == 0) {  // the fast path's bytes against the MPFR path's, every tensor
      EvalOptions mp = eo;
      mp.fast_path = false;
      mp.gradient_check = nullptr;
      const EvalResult rm = evaluate(c, mp);
      ++both;
      for (const RawTensor& t : r.golden) {
        const RawTensor* u = find(rm, t.name);
        if (!u || u->data != t.data) rep.fail(ctx + ": " + t.name + " differs between the fast and the MPFR path");
      }
    }
    if (dropout) compare(rep, r, "out", m.out, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.out); });
    compare(rep, r, "dq", m.dq, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.dq); });
    compare(rep, r, "dk", m.dk, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.dk); });
    compare(rep, r, "dv", m.dv, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.dv); });
    if (p.has_bias) compare(rep, r, "dbias", m.dbias, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.dbias); });
    if (p.has_sinks) compare(rep, r, "dsinks", m.dsinks, m.smag, ctx, [&]() -> const Grad<RealHi>& { return precise(m.dsinks); });
  }
  std::printf("%d of %d problems with sinks\n", with_sinks, count);
  EXPECT_GT(with_sinks, count / 10);
  for (const auto& n : rep.notes) std::printf("%s\n", n.c_str());
  std::printf("gradient units: %llu by the fast path, %llu fell back to MPFR; %d problems also by MPFR alone\n",
              static_cast<unsigned long long>(fast_units), static_cast<unsigned long long>(fallback_units), both);
  std::printf("%llu problems, %llu gradient elements compared (%llu within our error of a boundary, %llu of them "
              "an exact 0; %llu undecided), %llu enclosures\n",
              static_cast<unsigned long long>(problems), static_cast<unsigned long long>(rep.elements),
              static_cast<unsigned long long>(rep.near), static_cast<unsigned long long>(rep.near_zero),
              static_cast<unsigned long long>(rep.undecided),
              static_cast<unsigned long long>(rep.enclosures));
  EXPECT_EQ(problems, static_cast<std::uint64_t>(count));
  EXPECT_GT(rep.enclosures, rep.elements / 4);
  if (!dropout) {
    EXPECT_GT(fast_units, problems);  // the fast path takes part in what is compared
  }
  for (const auto& s : rep.failures) ADD_FAILURE() << s;
  return with_seqlens;
}

TEST(BackwardIndependent, RandomProblemsBitIdenticalAndEnclosed) {
  check_random_gradients(gradient_options(), 1000 * scale_factor(), 7000);
}

// Dropout with a keep mask (CONTRACT section 10): out, dq, dk, dv (dbias, dsinks) by the plain
// formulas with Z = A keep / (1 - p), bit for bit; padding rows left out (their out is free).
TEST(BackwardIndependent, DropoutBitIdenticalAndEnclosed) {
  RandomCaseOptions opt = gradient_options();
  opt.query_mask_fraction = 0;
  check_random_gradients(opt, 300 * scale_factor(), 91000, true);
}

// Padded varlen batches (seqlens_q, seqlens_k over up to 3 batches, causal aligned per batch):
// padding queries and keys past seqlens_k have gradient 0, the rest as above.
TEST(BackwardIndependent, SequenceLengths) {
  RandomCaseOptions opt = gradient_options();
  opt.seqlens_fraction = 1;
  opt.max_batch = 3;
  const int count = 300 * scale_factor();
  const int with_seqlens = check_random_gradients(opt, count, 9000);
  std::printf("%d of %d problems with sequence lengths\n", with_seqlens, count);
  EXPECT_GT(with_seqlens, count / 2);
}

// L = sum over rows that take part of <dout_i, out_i>, at inputs x + t R (Real inputs).
template <class Real>
Real loss(const Problem& p, const std::vector<Real>& q, const std::vector<Real>& k, const std::vector<Real>& v,
          const std::vector<Real>& bias, const std::vector<Real>& sinks) {
  const Real scale = p.scale.empty() ? Real(1) / sqrt(Real(p.Dk)) : parse_real<Real>(p.scale);
  std::optional<Real> cap;
  if (!p.softcap.empty() && parse_real<Real>(p.softcap) != 0) cap = parse_real<Real>(p.softcap);
  Real L = 0;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t i = 0; i < p.Nq; ++i) {
        if (p.padding(b, i)) continue;
        const std::int64_t g = h / (p.H / p.Hkv);
        std::vector<std::int64_t> keys;
        for (std::int64_t j = 0; j < p.Nk; ++j)
          if (p.allowed(b, h, i, j)) keys.push_back(j);
        if (keys.empty()) continue;
        std::vector<Real> S(keys.size());
        Real m;
        for (std::size_t a = 0; a < keys.size(); ++a) {
          Real dot = 0;
          for (std::int64_t c = 0; c < p.Dk; ++c)
            dot += q[static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dk + c)] *
                   k[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + keys[a]) * p.Dk + c)];
          const Real t = scale * dot;
          S[a] = (cap ? *cap * tanh(t / *cap) : t) +
                 (p.has_bias ? bias[static_cast<std::size_t>(bcast_flat(p.bias_shape, b, h, i, keys[a]))] : Real(0));
          if (a == 0 || S[a] > m) m = S[a];
        }
        const auto ih = static_cast<std::size_t>(h);
        if (p.has_sinks && sinks[ih] > m) m = sinks[ih];
        Real Z = p.has_sinks ? exp(sinks[ih] - m) : Real(0);  // the sink: a term of Z only
        for (auto& x : S) Z += (x = exp(x - m));
        for (std::int64_t c = 0; c < p.Dv; ++c) {
          Real o = 0;
          for (std::size_t a = 0; a < keys.size(); ++a)
            o += S[a] * v[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + keys[a]) * p.Dv + c)];
          L += Real(p.dout[static_cast<std::size_t>(((b * p.H + h) * p.Nq + i) * p.Dv + c)]) * o / Z;
        }
      }
  return L;
}

// The directional derivative of L along a random direction R of (q, k, v, bias), by a central
// difference with step 2^-150 at 600 bits (its error, O(2^-300), and the cancellation's, about
// 2^-450 relative, lie far below F64's), against <G.ref, R> summed over every gradient.
TEST(BackwardIndependent, DirectionalDerivativeMatchesFiniteDifference) {
  RandomCaseOptions opt;
  opt.mha_fraction = 0;
  opt.max_seq = 12, opt.small_seq = 6, opt.max_dim = 6, opt.small_dim = 4;
  opt.allow_refusal = false;
  opt.weights_fraction = 0, opt.lse_fraction = 0;
  opt.families = {DataFamily::Uniform, DataFamily::Normal, DataFamily::LargeScores, DataFamily::Cancel};
  opt.sinks_fraction = 0.4;
  int checked = 0, with_sinks = 0;
  for (std::uint64_t seed = 500; seed < 560; ++seed) {
    SafeTensorsFile f = random_case(seed, opt, nullptr);
    const RawTensor& qt = *f.find("q");
    f.put(random_dout(seed, DType::F64, {qt.shape[0], qt.shape[1], qt.shape[2], f.find("v")->shape[3]}));
    f.metadata["attn.outputs"] = std::string(f.find("bias") ? "dq,dk,dv,dbias" : "dq,dk,dv") +
                                 (f.find("sinks") ? ",dsinks" : "");
    f.metadata["attn.output_dtype"] = "F64";
    const Case c = case_from_file("random.safetensors", f);
    EvalOptions eo;
    eo.threads = 2;
    const EvalResult r = evaluate(c, eo);
    const Problem p(f);
    std::uint64_t s = seed;
    auto dir = [&](std::size_t n) {
      std::vector<double> d(n);
      for (auto& x : d) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        x = static_cast<double>(s >> 11) * 0x1p-52 - 1;
      }
      return d;
    };
    const auto Rq = dir(p.q.size()), Rk = dir(p.k.size()), Rv = dir(p.v.size()), Rb = dir(p.bias.size()),
               Rs = dir(p.sinks.size());
    auto shifted = [](const std::vector<double>& x, const std::vector<double>& R, const Real& t) {
      std::vector<Real> y(x.size());
      for (std::size_t e = 0; e < x.size(); ++e)
        y[e] = std::isinf(x[e]) ? Real(x[e]) : Real(x[e]) + t * Real(R[e]);
      return y;
    };
    const Real t = ldexp(Real(1), -150);
    const Real fd = (loss<Real>(p, shifted(p.q, Rq, t), shifted(p.k, Rk, t), shifted(p.v, Rv, t), shifted(p.bias, Rb, t),
                                shifted(p.sinks, Rs, t)) -
                     loss<Real>(p, shifted(p.q, Rq, -t), shifted(p.k, Rk, -t), shifted(p.v, Rv, -t), shifted(p.bias, Rb, -t),
                                shifted(p.sinks, Rs, -t))) /
                    (2 * t);
    Real ip = 0, mag = 0;
    auto add = [&](const char* name, const std::vector<double>& R) {
      const RawTensor* g = find(r, std::string(name) + ".ref");
      const RawTensor* bd = find(r, std::string(name) + ".bound");
      ASSERT_TRUE(g && bd) << name;
      const auto gv = decode(*g), bv = decode(*bd);
      for (std::size_t e = 0; e < gv.size(); ++e) {
        ip += Real(gv[e]) * Real(R[e]);
        mag += (Real(std::fabs(gv[e])) + Real(bv[e])) * Real(std::fabs(R[e]));
      }
    };
    add("dq", Rq);
    add("dk", Rk);
    add("dv", Rv);
    if (p.has_bias) add("dbias", Rb);
    if (p.has_sinks) add("dsinks", Rs), ++with_sinks;
    // Each G.ref is within half an F64 ulp of the exact gradient.
    EXPECT_LE(abs(ip - fd), ldexp(mag, -52) + ldexp(Real(1), -400))
        << "seed " << seed << ": <G, R> = " << ip.str(20) << ", finite difference " << fd.str(20);
    ++checked;
  }
  EXPECT_EQ(checked, 60);
  EXPECT_GT(with_sinks, 10);  // the sink direction too
}

}  // namespace
}  // namespace attnoracle::testing
