// Independent check of kind mha's gradients: every golden element of dx_q, dx_kv, dw_q, dw_k,
// dw_v, dw_o, dbias and dsinks (and their .ref) of 1000 random problems computed a second way,
// by the plain formulas of CONTRACT section 7 in 600-bit MPFR through Boost.Multiprecision
// (projections, softmax, backward and chain rule written out again, no code shared with the
// reference), rounded by the tests' own integer rounding (int_round), and compared bit for bit.
// An exact 0 of the formulas must be exactly 0; an element whose 600-bit value lies within its
// error of a rounding boundary must be one of the two roundings (counted); every bound must hold
// the value's magnitude; no element may be undecided.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <boost/multiprecision/mpfr.hpp>
#include <gtest/gtest.h>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "int_round.hpp"

namespace attnoracle::testing {
namespace {

namespace bmp = boost::multiprecision;
using Real = bmp::number<bmp::mpfr_float_backend<181>, bmp::et_off>;  // >= 600 bits
using Shape = std::vector<std::int64_t>;

// A small deterministic generator (splitmix64).
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uni() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }
  double normal() {  // Irwin-Hall: enough for test data
    double x = -6;
    for (int k = 0; k < 12; ++k) x += uni();
    return x;
  }
};

RawTensor tensor(const std::string& name, DType t, Shape shape, std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  const auto w = static_cast<std::size_t>(format_width(t) / 8);
  r.data.resize(v.size() * w);
  for (std::size_t e = 0; e < v.size(); ++e) {
    const std::uint64_t bits = round_double(v[e], t);
    v[e] = bits_to_double(bits, t);  // the value the file holds
    store_bits(bits, t, r.data.data() + e * w);
  }
  return r;
}

// One random problem: the file, and the values it holds.
struct Problem {
  std::int64_t B, H, Nq, Nk, D, Dk, Dv, Dout;
  std::vector<double> xq, xkv, wq, wk, wv, wo, dout, bias, sinks;
  std::vector<int> qmask;
  bool self = false, has_bias = false, has_sinks = false, has_qmask = false;
  std::string causal = "none";
  double softcap = 0;
  DType in = DType::F32, out = DType::F32;
  SafeTensorsFile file;

  explicit Problem(std::uint64_t seed) {
    Rng r{seed * 7919 + 17};
    B = 1 + r.below(2), H = 1 + r.below(3), Nq = 1 + r.below(6), Nk = 1 + r.below(7);
    D = 1 + r.below(4), Dk = 1 + r.below(3), Dv = 1 + r.below(3), Dout = 1 + r.below(3);
    self = r.below(5) == 0;
    if (self) Nk = Nq;
    const DType ins[] = {DType::F64, DType::F32, DType::F16, DType::BF16};
    in = ins[r.below(4)];
    out = r.below(3) == 0 ? DType::F32 : in;
    auto fill = [&](std::size_t n, double s) {
      std::vector<double> v(n);
      for (auto& x : v) x = s * r.normal();
      return v;
    };
    const auto z = [](std::int64_t n) { return static_cast<std::size_t>(n); };
    xq = fill(z(B * Nq * D), 1), wq = fill(z(H * D * Dk), 1), wk = fill(z(H * D * Dk), 1);
    wv = fill(z(H * D * Dv), 1), wo = fill(z(H * Dv * Dout), 1), dout = fill(z(B * Nq * Dout), 1);
    xkv = self ? xq : fill(z(B * Nk * D), 1);
    std::string outs = self ? "out,dx_q,dw_q,dw_k,dw_v,dw_o" : "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o";
    file.metadata["attn.format"] = std::string("1");
    file.metadata["attn.kind"] = std::string("mha");
    file.metadata["attn.masked_rows"] = std::string("zero");
    const std::int64_t c = r.below(3);
    causal = c == 0 ? "none" : c == 1 ? "top_left" : "bottom_right";
    if (c) file.metadata["attn.causal"] = causal;
    if (r.below(4) == 0) {
      softcap = 1.5;
      file.metadata["attn.softcap"] = std::string("1.5");
    }
    file.put(tensor("x_q", in, {B, Nq, D}, xq));
    file.put(tensor("x_kv", in, {B, Nk, D}, self ? xq : xkv));
    if (self) xkv = xq;
    file.put(tensor("w_q", in, {H, D, Dk}, wq));
    file.put(tensor("w_k", in, {H, D, Dk}, wk));
    file.put(tensor("w_v", in, {H, D, Dv}, wv));
    file.put(tensor("w_o", in, {H * Dv, Dout}, wo));
    file.put(tensor("dout", in, {B, Nq, Dout}, dout));
    if (r.below(3) == 0) {  // a full bias [B, H, Nq, Nk]
      has_bias = true;
      bias = fill(z(B * H * Nq * Nk), 1);
      file.put(tensor("bias", DType::F64, {B, H, Nq, Nk}, bias));
      outs += ",dbias";
    }
    if (r.below(3) == 0) {
      has_sinks = true;
      sinks = fill(z(H), 1);
      file.put(tensor("sinks", DType::F64, {H}, sinks));
      outs += ",dsinks";
    }
    if (Nq > 1 && r.below(4) == 0) {
      has_qmask = true;
      qmask.assign(z(B * Nq), 1);
      qmask[z(r.below(B * Nq))] = 0;
      RawTensor m{"query_mask", DType::BOOL, {B, Nq}, {}};
      for (int x : qmask) m.data.push_back(static_cast<unsigned char>(x));
      file.put(std::move(m));
    }
    if (out != in) file.metadata["attn.output_dtype"] = std::string("F32");
    file.metadata["attn.outputs"] = outs;
  }
  bool allowed(std::int64_t i, std::int64_t j) const {
    const std::int64_t a = causal == "bottom_right" ? i + Nk - Nq : i;
    return causal == "none" || j <= a;
  }
  bool padding(std::int64_t b, std::int64_t i) const {
    return has_qmask && qmask[static_cast<std::size_t>(b * Nq + i)] == 0;
  }
};

// The gradients by the plain formulas, with the magnitudes their 600-bit errors scale with.
struct Values {
  std::map<std::string, std::vector<Real>> val, mag;
};

Values model(const Problem& p) {
  Values out;
  const auto z = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  auto grad = [&](const std::string& n, std::size_t size) {
    out.val[n].assign(size, Real(0));
    out.mag[n].assign(size, Real(0));
  };
  const Real scale = Real(1) / sqrt(Real(p.Dk));
  // Projections Q[b][h][n][c], and dO.
  std::vector<Real> Q(z(p.B * p.H * p.Nq * p.Dk)), K(z(p.B * p.H * p.Nk * p.Dk)), V(z(p.B * p.H * p.Nk * p.Dv)),
      dO(z(p.B * p.H * p.Nq * p.Dv)), dq(Q.size(), Real(0)), dk(K.size(), Real(0)), dv(V.size(), Real(0)),
      dqm(Q.size(), Real(0)), dkm(K.size(), Real(0)), dvm(V.size(), Real(0)), O(dO.size(), Real(0));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h) {
      for (std::int64_t n = 0; n < p.Nq; ++n) {
        for (std::int64_t c = 0; c < p.Dk; ++c)
          for (std::int64_t d = 0; d < p.D; ++d)
            Q[z(((b * p.H + h) * p.Nq + n) * p.Dk + c)] += Real(p.xq[z((b * p.Nq + n) * p.D + d)]) * p.wq[z((h * p.D + d) * p.Dk + c)];
        for (std::int64_t c = 0; c < p.Dv; ++c)
          for (std::int64_t e = 0; e < p.Dout; ++e)
            if (!p.padding(b, n))
              dO[z(((b * p.H + h) * p.Nq + n) * p.Dv + c)] += Real(p.dout[z((b * p.Nq + n) * p.Dout + e)]) * p.wo[z((h * p.Dv + c) * p.Dout + e)];
      }
      for (std::int64_t n = 0; n < p.Nk; ++n) {
        for (std::int64_t c = 0; c < p.Dk; ++c)
          for (std::int64_t d = 0; d < p.D; ++d)
            K[z(((b * p.H + h) * p.Nk + n) * p.Dk + c)] += Real(p.xkv[z((b * p.Nk + n) * p.D + d)]) * p.wk[z((h * p.D + d) * p.Dk + c)];
        for (std::int64_t c = 0; c < p.Dv; ++c)
          for (std::int64_t d = 0; d < p.D; ++d)
            V[z(((b * p.H + h) * p.Nk + n) * p.Dv + c)] += Real(p.xkv[z((b * p.Nk + n) * p.D + d)]) * p.wv[z((h * p.D + d) * p.Dv + c)];
      }
    }
  if (p.has_bias) grad("dbias", p.bias.size());
  if (p.has_sinks) grad("dsinks", z(p.H));
  std::vector<char> valid(z(p.B * p.H * p.Nq), 0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t i = 0; i < p.Nq; ++i) {
        if (p.padding(b, i)) continue;
        std::vector<std::int64_t> keys;
        for (std::int64_t j = 0; j < p.Nk; ++j)
          if (p.allowed(i, j)) keys.push_back(j);
        if (keys.empty() && !p.has_sinks) continue;
        valid[z((b * p.H + h) * p.Nq + i)] = 1;
        const std::size_t n = keys.size();
        const std::size_t row = z((b * p.H + h) * p.Nq + i);
        std::vector<Real> T(n), S(n), P(n);
        Real Z = p.has_sinks ? exp(Real(p.sinks[z(h)])) : Real(0);
        for (std::size_t a = 0; a < n; ++a) {
          Real dot = 0;
          for (std::int64_t c = 0; c < p.Dk; ++c) dot += Q[row * z(p.Dk) + z(c)] * K[z(((b * p.H + h) * p.Nk + keys[a]) * p.Dk + c)];
          T[a] = scale * dot;
          S[a] = (p.softcap ? p.softcap * tanh(T[a] / p.softcap) : T[a]) +
                 (p.has_bias ? Real(p.bias[z(((b * p.H + h) * p.Nq + i) * p.Nk + keys[a])]) : Real(0));
          Z += (P[a] = exp(S[a]));  // scores are small: no row constant needed at 600 bits
        }
        for (auto& x : P) x /= Z;
        Real D = 0, Dm = 0;
        for (std::int64_t c = 0; c < p.Dv; ++c) {
          Real o = 0, om = 0;
          for (std::size_t a = 0; a < n; ++a) {
            const Real& v = V[z(((b * p.H + h) * p.Nk + keys[a]) * p.Dv + c)];
            o += P[a] * v, om += P[a] * abs(v);
          }
          O[row * z(p.Dv) + z(c)] = o;
          D += dO[row * z(p.Dv) + z(c)] * o;
          Dm += abs(dO[row * z(p.Dv) + z(c)]) * om;
        }
        if (p.has_sinks) {
          const Real ps = exp(Real(p.sinks[z(h)])) / Z;
          out.val["dsinks"][z(h)] -= ps * D;
          out.mag["dsinks"][z(h)] += ps * Dm;
        }
        for (std::size_t a = 0; a < n; ++a) {
          const std::size_t key = z((b * p.H + h) * p.Nk + keys[a]);
          Real dP = 0, dPm = 0;
          for (std::int64_t c = 0; c < p.Dv; ++c) {
            dP += dO[row * z(p.Dv) + z(c)] * V[key * z(p.Dv) + z(c)];
            dPm += abs(dO[row * z(p.Dv) + z(c)] * V[key * z(p.Dv) + z(c)]);
          }
          const Real dS = P[a] * (dP - D), M = P[a] * (dPm + Dm);
          const Real slope = p.softcap ? 1 - pow(tanh(T[a] / p.softcap), 2) : Real(1);
          for (std::int64_t c = 0; c < p.Dk; ++c) {
            dq[row * z(p.Dk) + z(c)] += scale * dS * slope * K[key * z(p.Dk) + z(c)];
            dqm[row * z(p.Dk) + z(c)] += scale * M * abs(K[key * z(p.Dk) + z(c)]);
            dk[key * z(p.Dk) + z(c)] += scale * dS * slope * Q[row * z(p.Dk) + z(c)];
            dkm[key * z(p.Dk) + z(c)] += scale * M * abs(Q[row * z(p.Dk) + z(c)]);
          }
          for (std::int64_t c = 0; c < p.Dv; ++c) {
            dv[key * z(p.Dv) + z(c)] += P[a] * dO[row * z(p.Dv) + z(c)];
            dvm[key * z(p.Dv) + z(c)] += P[a] * abs(dO[row * z(p.Dv) + z(c)]);
          }
          if (p.has_bias) {
            out.val["dbias"][z(((b * p.H + h) * p.Nq + i) * p.Nk + keys[a])] += dS;
            out.mag["dbias"][z(((b * p.H + h) * p.Nq + i) * p.Nk + keys[a])] += M;
          }
        }
      }
  // The chain rule.
  grad("dx_q", z(p.B * p.Nq * p.D));
  if (!p.self) grad("dx_kv", z(p.B * p.Nk * p.D));
  grad("dw_q", z(p.H * p.D * p.Dk)), grad("dw_k", z(p.H * p.D * p.Dk)), grad("dw_v", z(p.H * p.D * p.Dv));
  grad("dw_o", z(p.H * p.Dv * p.Dout));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t d = 0; d < p.D; ++d) {
        for (std::int64_t i = 0; i < p.Nq; ++i)
          for (std::int64_t c = 0; c < p.Dk; ++c) {
            const std::size_t x = z(((b * p.H + h) * p.Nq + i) * p.Dk + c);
            const double w = p.wq[z((h * p.D + d) * p.Dk + c)], xin = p.xq[z((b * p.Nq + i) * p.D + d)];
            out.val["dx_q"][z((b * p.Nq + i) * p.D + d)] += dq[x] * w;
            out.mag["dx_q"][z((b * p.Nq + i) * p.D + d)] += dqm[x] * std::fabs(w);
            out.val["dw_q"][z((h * p.D + d) * p.Dk + c)] += dq[x] * xin;
            out.mag["dw_q"][z((h * p.D + d) * p.Dk + c)] += dqm[x] * std::fabs(xin);
          }
        const std::string dx = p.self ? "dx_q" : "dx_kv";
        for (std::int64_t j = 0; j < p.Nk; ++j) {
          const double xin = p.xkv[z((b * p.Nk + j) * p.D + d)];
          for (std::int64_t c = 0; c < p.Dk; ++c) {
            const std::size_t x = z(((b * p.H + h) * p.Nk + j) * p.Dk + c);
            const double w = p.wk[z((h * p.D + d) * p.Dk + c)];
            out.val[dx][z((b * p.Nk + j) * p.D + d)] += dk[x] * w;
            out.mag[dx][z((b * p.Nk + j) * p.D + d)] += dkm[x] * std::fabs(w);
            out.val["dw_k"][z((h * p.D + d) * p.Dk + c)] += dk[x] * xin;
            out.mag["dw_k"][z((h * p.D + d) * p.Dk + c)] += dkm[x] * std::fabs(xin);
          }
          for (std::int64_t c = 0; c < p.Dv; ++c) {
            const std::size_t x = z(((b * p.H + h) * p.Nk + j) * p.Dv + c);
            const double w = p.wv[z((h * p.D + d) * p.Dv + c)];
            out.val[dx][z((b * p.Nk + j) * p.D + d)] += dv[x] * w;
            out.mag[dx][z((b * p.Nk + j) * p.D + d)] += dvm[x] * std::fabs(w);
            out.val["dw_v"][z((h * p.D + d) * p.Dv + c)] += dv[x] * xin;
            out.mag["dw_v"][z((h * p.D + d) * p.Dv + c)] += dvm[x] * std::fabs(xin);
          }
        }
      }
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t i = 0; i < p.Nq; ++i)
        if (valid[z((b * p.H + h) * p.Nq + i)])
          for (std::int64_t c = 0; c < p.Dv; ++c)
            for (std::int64_t e = 0; e < p.Dout; ++e) {
              const Real& o = O[z(((b * p.H + h) * p.Nq + i) * p.Dv + c)];
              const double g = p.dout[z((b * p.Nq + i) * p.Dout + e)];
              out.val["dw_o"][z((h * p.Dv + c) * p.Dout + e)] += o * g;
              out.mag["dw_o"][z((h * p.Dv + c) * p.Dout + e)] += abs(o) * std::fabs(g);
            }
  return out;
}

const RawTensor* find(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return &t;
  return nullptr;
}

TEST(MhaBackwardIndependent, RandomProblemsBitIdentical) {
  std::uint64_t elements = 0, near = 0, zeros = 0, problems = 0;
  std::vector<std::string> failures;
  for (std::uint64_t seed = 1; seed <= 1000; ++seed) {
    const Problem p(seed);
    const Case c = case_from_file("random.safetensors", p.file);
    EvalOptions eo;
    eo.threads = 2;
    const EvalResult r = evaluate(c, eo);
    const Values m = model(p);
    ++problems;
    for (const auto& [name, val] : m.val) {
      const std::vector<Real>& mag = m.mag.at(name);
      for (const std::string& tn : {name, name + ".ref"}) {
        const RawTensor* t = find(r, tn);
        if (!t) {
          failures.push_back("seed " + std::to_string(seed) + ": no " + tn);
          continue;
        }
        if (const RawTensor* u = find(r, tn + ".undecided"))
          for (std::size_t k = 0; k < u->data.size() / 8; ++k) {
            std::int64_t e;
            std::memcpy(&e, u->data.data() + 8 * k, 8);
            failures.push_back("seed " + std::to_string(seed) + ": " + tn + "[" + std::to_string(e) +
                               "] undecided, value " + val[static_cast<std::size_t>(e)].str(20));
          }
        const auto w = static_cast<std::size_t>(format_width(t->dtype) / 8);
        for (std::size_t e = 0; e < val.size(); ++e) {
          ++elements;
          // 600-bit error of sums of at most a few hundred terms: far below 2^-500 of their magnitude.
          const Real margin = ldexp(Real(1), -500) * (mag[e] + 1e-300);
          const Real lo = val[e] - margin, hi = val[e] + margin;
          const double rlo = bits_to_double(round_mpfr(lo.backend().data(), t->dtype).bits, t->dtype);
          const double rhi = bits_to_double(round_mpfr(hi.backend().data(), t->dtype).bits, t->dtype);
          const double got = bits_to_double(load_bits(t->data.data() + e * w, t->dtype), t->dtype);
          if (val[e] == 0) {  // an exact 0 of the plain formulas: exactly 0 in the reference too
            ++zeros;
            if (got != 0) failures.push_back("seed " + std::to_string(seed) + ": " + tn + "[" + std::to_string(e) + "] is " + std::to_string(got) + ", not exactly 0");
          } else if (rlo != rhi) {
            ++near;
            if (!(rlo <= got && got <= rhi)) failures.push_back("seed " + std::to_string(seed) + ": " + tn + "[" + std::to_string(e) + "] outside the value's range");
          } else if (got != rlo) {  // an exact 0 may carry either sign
            failures.push_back("seed " + std::to_string(seed) + ": " + tn + "[" + std::to_string(e) + "] is " +
                               std::to_string(got) + ", the plain formulas give " + std::to_string(rlo));
          }
        }
      }
      const RawTensor* bd = find(r, name + ".bound");
      for (std::size_t e = 0; bd && e < val.size(); ++e) {
        const double got = bits_to_double(load_bits(bd->data.data() + e * 8, DType::F64), DType::F64);
        if (!(Real(got) >= abs(val[e]) - ldexp(Real(1), -500) * mag[e]))
          failures.push_back("seed " + std::to_string(seed) + ": " + name + ".bound[" + std::to_string(e) + "] below |value|");
      }
    }
    if (failures.size() > 20) break;
  }
  std::printf("%llu problems, %llu elements compared (%llu exact zeros), %llu within 2^-500 of a rounding boundary\n",
              static_cast<unsigned long long>(problems), static_cast<unsigned long long>(elements),
              static_cast<unsigned long long>(zeros), static_cast<unsigned long long>(near));
  EXPECT_EQ(problems, 1000u);
  for (const auto& f : failures) ADD_FAILURE() << f;
}

}  // namespace
}  // namespace attnoracle::testing
