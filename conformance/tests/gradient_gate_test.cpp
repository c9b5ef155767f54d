// The gate on gradients (TOLERANCE.md, "Gradients"): results made from the golden values, each
// with one planted change, judged by compare_case; and the limit of a one-key row worked by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "golden_results.hpp"

namespace attnoracle::conformance {
namespace {

// An F32 case with dout, smooth pseudo-random inputs; B = 2, Hq = 4 over Hkv = 2 heads.
SafeTensorsFile make_case(std::map<std::string, std::string> meta, bool bias, std::int64_t Nk = 7) {
  const std::int64_t B = 2, Hq = 4, Hkv = 2, Nq = 5, D = 4;
  SafeTensorsFile f;
  f.metadata = std::move(meta);
  f.metadata["attn.format"] = "1";
  auto put = [&](const char* name, std::vector<std::int64_t> shape, float seed) {
    RawTensor t{name, DType::F32, shape, {}};
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    t.data.resize(static_cast<std::size_t>(n) * 4);
    for (std::int64_t e = 0; e < n; ++e) {
      const float v = std::sin(seed * static_cast<float>(e + 1));
      std::memcpy(t.data.data() + 4 * e, &v, 4);
    }
    f.put(std::move(t));
  };
  put("q", {B, Hq, Nq, D}, 1.7f);
  put("k", {B, Hkv, Nk, D}, 0.9f);
  put("v", {B, Hkv, Nk, D}, 2.3f);
  put("dout", {B, Hq, Nq, D}, 0.37f);
  if (bias) put("bias", {B, 1, 1, Nk}, 1.3f);  // broadcast over heads and queries
  return f;
}

using testing::get;
using testing::golden_of;
using testing::set;
using testing::tensor;

JobResult golden_result(const SafeTensorsFile& golden) {
  return testing::golden_result(golden, {"out", "lse", "dq", "dk", "dv", "dbias"});
}

const TensorReport* report_of(const CaseReport& rep, const std::string& name) {
  for (const auto& t : rep.tensors)
    if (t.tensor == name) return &t;
  return nullptr;
}

const std::map<std::string, std::string> kGrad = {{"attn.outputs", "out,lse,dq,dk,dv"}, {"attn.causal", "bottom_right"}};

TEST(GradientGate, GoldenGradientsPassWithRatioZero) {
  const auto golden = golden_of(make_case({{"attn.outputs", "out,lse,dq,dk,dv,dbias"}}, true));
  const CaseReport rep = compare_case("c", golden, "ok", golden_result(golden), builtin_profile("fp32"));
  ASSERT_EQ(rep.status, CaseStatus::Pass) << rep.reason;
  for (const char* name : {"dq", "dk", "dv", "dbias"}) {
    const TensorReport* t = report_of(rep, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_GT(t->compared, 0) << name;
    EXPECT_EQ(t->worst_ratio, 0) << name;
    EXPECT_GT(t->largest_limit, 0) << name;
  }
  EXPECT_EQ(report_of(rep, "dbias")->compared, 2 * 7);  // bias [2,1,1,7]
}

// Each gradient, one element moved by a factor of its limit: within it passes, beyond it fails
// and the report names the tensor and the element.
TEST(GradientGate, AnElementBeyondItsLimitFailsNamingIt) {
  const auto golden = golden_of(make_case({{"attn.outputs", "out,lse,dq,dk,dv,dbias"}}, true));
  const CaseReport base = compare_case("c", golden, "ok", golden_result(golden), builtin_profile("fp32"));
  for (const char* name : {"dq", "dk", "dv", "dbias"}) {
    auto moved = [&](double by) {
      JobResult r = golden_result(golden);
      RawTensor& t = tensor(r, name);
      set(t, 3, static_cast<float>(get(t, 3) + by));
      return compare_case("c", golden, "ok", r, builtin_profile("fp32"));
    };
    // twice the largest limit: beyond element 3's own, which the report then gives
    const CaseReport rep = moved(2 * report_of(base, name)->largest_limit);
    ASSERT_EQ(rep.status, CaseStatus::Fail) << name;
    ASSERT_TRUE(rep.worst);
    EXPECT_EQ(rep.worst->tensor, name);
    EXPECT_EQ(rep.worst->index.size(), 4u);
    EXPECT_GT(rep.worst->limit_ratio, 1) << name;
    EXPECT_EQ(rep.failed_elements, 1) << name;
    const double own = rep.worst->limit;
    // Within its limit no element fails; but half a worst-case limit is many times the
    // statistical tier's scale, so a tensor large enough to be tested fails there, by name.
    const CaseReport half = moved(0.5 * own);
    EXPECT_EQ(half.failed_elements, 0) << name;
    EXPECT_NEAR(report_of(half, name)->worst_ratio, 0.5, 0.01) << name;
    if (report_of(half, name)->tier.tested) {
      EXPECT_EQ(half.status, CaseStatus::Fail) << name;
      EXPECT_EQ(half.reason.rfind(std::string(name) + ": ", 0), 0u) << half.reason;
    } else {
      EXPECT_EQ(half.status, CaseStatus::Pass) << name << ": " << half.reason;
    }
  }
}

// The statistical tier of the gradients: every element of a tensor 256 ulps off, each well
// within its worst-case limit, fails where the declared arithmetic's errors could not add up to
// that; one ulp off every element, a correct F32 kernel's final rounding, passes.
TEST(GradientGate, TierCatchesErrorsWithinTheLimits) {
  const auto golden = golden_of(make_case({{"attn.outputs", "out,lse,dq,dk,dv"}}, false, 40));
  auto shifted = [&](const char* name, int ulps) {
    JobResult r = golden_result(golden);
    RawTensor& t = tensor(r, name);
    for (std::size_t k = 0; k < t.data.size() / 4; ++k) {
      float x = get(t, k);
      for (int u = 0; u < ulps; ++u) x = std::nextafter(x, k % 2 ? INFINITY : -INFINITY);
      set(t, k, x);
    }
    return compare_case("c", golden, "ok", r, builtin_profile("fp32"));
  };
  for (const char* name : {"dq", "dk", "dv"}) {
    const CaseReport one = shifted(name, 1);
    EXPECT_EQ(one.status, CaseStatus::Pass) << name << ": " << one.reason;
    ASSERT_TRUE(report_of(one, name)->tier.tested) << name;
    const CaseReport many = shifted(name, 256);
    EXPECT_EQ(many.failed_elements, 0) << name << ": " << many.reason;
    EXPECT_EQ(many.status, CaseStatus::Fail) << name;
    EXPECT_EQ(many.reason.rfind(std::string(name) + ": ", 0), 0u) << many.reason;
    EXPECT_LT(report_of(many, name)->tier.headroom, 1) << name;
  }
}

// With sinks (a row masked to only its sink): every gradient and dsinks pass from the golden
// values; dsinks[1] moved beyond its limit fails naming it, within half of it passes.
TEST(GradientGate, DsinksJudgedAgainstItsLimit) {
  SafeTensorsFile f = make_case({{"attn.outputs", "out,lse,dq,dk,dv,dbias,dsinks"}}, true);
  RawTensor sinks{"sinks", DType::F32, {4}, std::vector<unsigned char>(16)};
  const float sv[4] = {0.5f, -1.0f, 1.5f, 0.0f};
  std::memcpy(sinks.data.data(), sv, 16);
  f.put(std::move(sinks));
  RawTensor mask{"mask", DType::BOOL, {1, 1, 5, 1}, {1, 1, 0, 1, 1}};  // row 2: no key, its sink
  f.put(std::move(mask));
  const auto golden = golden_of(f);
  auto result = [&] { return testing::golden_result(golden, {"out", "lse", "dq", "dk", "dv", "dbias", "dsinks"}); };
  const CaseReport base = compare_case("c", golden, "ok", result(), builtin_profile("fp32"));
  ASSERT_EQ(base.status, CaseStatus::Pass) << base.reason;
  const TensorReport* t = report_of(base, "dsinks");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->compared, 4);
  EXPECT_EQ(t->worst_ratio, 0);
  auto moved = [&](double by) {
    JobResult r = result();
    RawTensor& d = tensor(r, "dsinks");
    set(d, 1, static_cast<float>(get(d, 1) + by));
    return compare_case("c", golden, "ok", r, builtin_profile("fp32"));
  };
  const CaseReport rep = moved(2 * t->largest_limit);
  ASSERT_EQ(rep.status, CaseStatus::Fail);
  ASSERT_TRUE(rep.worst);
  EXPECT_EQ(rep.worst->tensor, "dsinks");
  EXPECT_EQ(rep.failed_elements, 1);
  const CaseReport half = moved(0.5 * rep.worst->limit);
  EXPECT_EQ(half.status, CaseStatus::Pass) << half.reason;
}

TEST(GradientGate, MissingOrDeclinedGradients) {
  const auto golden = golden_of(make_case(kGrad, false));
  JobResult r = golden_result(golden);
  r.output.tensors.erase(std::remove_if(r.output.tensors.begin(), r.output.tensors.end(),
                                        [](const RawTensor& t) { return t.name == "dk"; }),
                         r.output.tensors.end());
  const CaseReport rep = compare_case("c", golden, "ok", r, builtin_profile("fp32"));
  EXPECT_EQ(rep.status, CaseStatus::Fail);
  EXPECT_NE(rep.reason.find("no tensor 'dk'"), std::string::npos) << rep.reason;
  Profile p = builtin_profile("fp32");
  p.returns_gradients = false;
  const CaseReport declined = compare_case("c", golden, "ok", r, p);
  EXPECT_EQ(declined.status, CaseStatus::Pass) << declined.reason;
  EXPECT_NE(declined.reason.find("gradients not returned (declared)"), std::string::npos) << declined.reason;
}

// Padding queries: their dq is not compared, but dout on them must not reach dk and dv.
TEST(GradientGate, PaddingRowsAreNotComparedButMustNotContribute) {
  SafeTensorsFile f = make_case(kGrad, false);
  f.put(RawTensor{"seqlens_q", DType::I32, {2}, {5, 0, 0, 0, 3, 0, 0, 0}});  // batch 1: rows 3, 4 padding
  const auto golden = golden_of(f);
  JobResult r = golden_result(golden);
  RawTensor& dq = tensor(r, "dq");
  const std::size_t padding = ((1 * 4 + 2) * 5 + 4) * 4;  // dq[1, 2, 4, 0]
  set(dq, padding, 123.0f);
  EXPECT_EQ(compare_case("c", golden, "ok", r, builtin_profile("fp32")).status, CaseStatus::Pass);
  // a padding row's contribution to dv: dout[1, 2, 4] times its would-be weights, here about
  // 0.2 |dout| on key 0 of kv head 1
  RawTensor& dv = tensor(r, "dv");
  const std::size_t k0 = ((1 * 2 + 1) * 7 + 0) * 4;
  set(dv, k0, get(dv, k0) + 0.05f);
  const CaseReport rep = compare_case("c", golden, "ok", r, builtin_profile("fp32"));
  EXPECT_EQ(rep.status, CaseStatus::Fail);
  ASSERT_TRUE(rep.worst);
  EXPECT_EQ(rep.worst->tensor, "dv");
}

// A row with one key: P = 1, dS = 0, so dq = dk = 0 and dv = dout. dv's limit, by hand (fp32):
// err = (p_rel + u_ds) |dout| + p_abs |dout|, with p_rel = weight_rel + exp_ulps u (1 + M) +
// u (2M + log 1 + 1), then S (err + ((terms + 2) u + 0) |dout| + u |dout| + floor).
TEST(GradientGate, OneKeyRowWorkedByHand) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,dq,dk,dv"}};
  auto put = [&](const char* name, float x) {
    RawTensor t{name, DType::F32, {1, 1, 1, 1}, std::vector<unsigned char>(4)};
    std::memcpy(t.data.data(), &x, 4);
    f.put(std::move(t));
  };
  put("q", 0.5f);
  put("k", 0.25f);
  put("v", 3.0f);
  put("dout", 2.0f);
  const auto golden = golden_of(f);
  const Case c = case_from_file("c", f);
  const Profile p = builtin_profile("fp32");
  const auto mags = row_magnitudes(c);
  const RowLimits L = row_limits(p, c, mags[0]);
  const double u = 0x1p-24, M = 0.125;  // the one score: 0.5 * 0.25 / sqrt(1)
  EXPECT_EQ(mags[0].score_abs, M);
  const double p_rel = L.weight_rel + 4 * u * (1 + M) + u * (2 * M + 1);
  const double p_abs = L.p_sub + 0x1p-149;  // half F32's smallest subnormal, twice (softmax, grad_ds)
  const double err = (p_rel + u) * 2 + p_abs * 2;
  const GradientErrors ge = gradient_errors(p, c, mags, {L}, {3.0}, {3.0}, {});
  EXPECT_DOUBLE_EQ(ge.dv[0], err);
  const double floor = 2 * 0x1p-149 + 1 * 0x1p-126;
  const double lim = 4 * (err + (3 * u) * 2 + u * 2 + floor);
  EXPECT_DOUBLE_EQ(gradient_limit(p, ge.dv[0], 1, 0, 2, u, floor, 2), lim);
  // dq = dk = 0 and dv = dout exactly: the golden result passes
  const CaseReport ok = compare_case("c", golden, "ok", golden_result(golden), p);
  EXPECT_EQ(ok.status, CaseStatus::Pass) << ok.reason;
}

// Kind mha: a backward written out in T (float: an implementation in F32 arithmetic; double:
// the exact values to within far less than float's limits), and each element's G.bound as the
// contract defines it. dx_kv empty in self-attention, where dx_q holds both sums. A query_mask
// row is padding: its dout reaches nothing.
struct MhaGrads {
  std::vector<double> dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o;
};
enum class MhaBug { None, DwoTransposed, DxkvNoDv };
template <class T>
MhaGrads mha_backward(const Case& c, bool bounds, MhaBug bug = MhaBug::None) {
  const std::int64_t B = c.B, H = c.Hq, Nq = c.Nq, Nk = c.Nk, D = c.D, Dk = c.Dk, Dv = c.Dv, Do = c.Dout;
  const auto z = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const auto val = [&](const FloatTensor& t, std::size_t k) {
    return bounds ? static_cast<T>(std::fabs(t.values[k])) : static_cast<T>(t.values[k]);
  };
  const auto mag = [bounds](T x) { return bounds ? std::fabs(x) : x; };
  const T scale = static_cast<T>(1 / std::sqrt(static_cast<double>(Dk)));
  // the projections in T (Qs, Ks, Vs), and their magnitudes for the bounds (Q, K, V)
  std::vector<T> Qs(z(B * H * Nq * Dk)), Ks(z(B * H * Nk * Dk)), Vs(z(B * H * Nk * Dv));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d) {
        for (std::int64_t n = 0; n < Nq; ++n)
          for (std::int64_t e = 0; e < Dk; ++e)
            Qs[z(((b * H + h) * Nq + n) * Dk + e)] += static_cast<T>(c.x_q.values[z((b * Nq + n) * D + d)]) *
                                                     static_cast<T>(c.w_q.values[z((h * D + d) * Dk + e)]);
        for (std::int64_t n = 0; n < Nk; ++n) {
          const T x = static_cast<T>(c.x_kv.values[z((b * Nk + n) * D + d)]);
          for (std::int64_t e = 0; e < Dk; ++e)
            Ks[z(((b * H + h) * Nk + n) * Dk + e)] += x * static_cast<T>(c.w_k.values[z((h * D + d) * Dk + e)]);
          for (std::int64_t e = 0; e < Dv; ++e)
            Vs[z(((b * H + h) * Nk + n) * Dv + e)] += x * static_cast<T>(c.w_v.values[z((h * D + d) * Dv + e)]);
        }
      }
  std::vector<T> Q(Qs), K(Ks), V(Vs);
  for (auto* t : {&Q, &K, &V})
    for (T& x : *t) x = mag(x);
  std::vector<T> dq(Q.size()), dk(K.size()), dv(V.size()), dwo(c.w_o.values.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!c.query_valid(b, i)) continue;
        const std::size_t row = z((b * H + h) * Nq + i);
        std::vector<T> P(z(Nk)), O(z(Dv)), dO(z(Dv));
        T mx = -INFINITY, Z = 0;
        for (std::int64_t j = 0; j < Nk; ++j) {
          T s = 0;
          for (std::int64_t e = 0; e < Dk; ++e) s += Qs[row * z(Dk) + z(e)] * Ks[z(((b * H + h) * Nk + j) * Dk + e)];
          P[z(j)] = scale * s;
          mx = std::max(mx, P[z(j)]);
        }
        for (auto& x : P) Z += x = std::exp(x - mx);
        for (auto& x : P) x /= Z;
        for (std::int64_t j = 0; j < Nk; ++j)
          for (std::int64_t e = 0; e < Dv; ++e) O[z(e)] += P[z(j)] * Vs[z(((b * H + h) * Nk + j) * Dv + e)];
        for (std::int64_t e = 0; e < Dv; ++e) {
          for (std::int64_t f = 0; f < Do; ++f) {
            dO[z(e)] += static_cast<T>(c.dout->values[z((b * Nq + i) * Do + f)]) * static_cast<T>(c.w_o.values[z((h * Dv + e) * Do + f)]);
            // dw_o = O^T dout (bug: dout^T O, written in w_o's order)
            const std::size_t at = bug == MhaBug::DwoTransposed ? z(f * H * Dv + h * Dv + e) : z((h * Dv + e) * Do + f);
            dwo[at] += (bounds ? std::fabs(O[z(e)]) : O[z(e)]) * val(*c.dout, z((b * Nq + i) * Do + f));
          }
        }
        T Dsum = 0;
        for (std::int64_t e = 0; e < Dv; ++e) Dsum += mag(dO[z(e)] * O[z(e)]);
        for (std::int64_t j = 0; j < Nk; ++j) {
          T dP = 0;
          for (std::int64_t e = 0; e < Dv; ++e) dP += mag(dO[z(e)] * Vs[z(((b * H + h) * Nk + j) * Dv + e)]);
          const T dS = bounds ? P[z(j)] * (dP + Dsum) : P[z(j)] * (dP - Dsum);
          for (std::int64_t e = 0; e < Dk; ++e) {
            dq[row * z(Dk) + z(e)] += scale * dS * (bounds ? K : Ks)[z(((b * H + h) * Nk + j) * Dk + e)];
            dk[z(((b * H + h) * Nk + j) * Dk + e)] += scale * dS * (bounds ? Q : Qs)[row * z(Dk) + z(e)];
          }
          for (std::int64_t e = 0; e < Dv; ++e) dv[z(((b * H + h) * Nk + j) * Dv + e)] += P[z(j)] * mag(dO[z(e)]);
        }
      }
  MhaGrads g;
  const bool self = c.self_attention;
  std::vector<T> dxq(c.x_q.values.size()), dxkv(c.x_kv.values.size()), dwq(c.w_q.values.size()), dwk(c.w_k.values.size()),
      dwv(c.w_v.values.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t d = 0; d < D; ++d) {
        for (std::int64_t n = 0; n < Nq; ++n)
          for (std::int64_t e = 0; e < Dk; ++e) {
            const T x = dq[z(((b * H + h) * Nq + n) * Dk + e)];
            dxq[z((b * Nq + n) * D + d)] += x * val(c.w_q, z((h * D + d) * Dk + e));
            dwq[z((h * D + d) * Dk + e)] += val(c.x_q, z((b * Nq + n) * D + d)) * x;
          }
        for (std::int64_t n = 0; n < Nk; ++n) {
          for (std::int64_t e = 0; e < Dk; ++e) {
            const T x = dk[z(((b * H + h) * Nk + n) * Dk + e)];
            dxkv[z((b * Nk + n) * D + d)] += x * val(c.w_k, z((h * D + d) * Dk + e));
            dwk[z((h * D + d) * Dk + e)] += val(c.x_kv, z((b * Nk + n) * D + d)) * x;
          }
          for (std::int64_t e = 0; e < Dv; ++e) {
            const T x = dv[z(((b * H + h) * Nk + n) * Dv + e)];
            if (bug != MhaBug::DxkvNoDv) dxkv[z((b * Nk + n) * D + d)] += x * val(c.w_v, z((h * D + d) * Dv + e));
            dwv[z((h * D + d) * Dv + e)] += val(c.x_kv, z((b * Nk + n) * D + d)) * x;
          }
        }
      }
  const auto out = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
  if (self)
    for (std::size_t k = 0; k < dxq.size(); ++k) dxq[k] += dxkv[k];
  g.dx_q = out(dxq);
  if (!self) g.dx_kv = out(dxkv);
  g.dw_q = out(dwq);
  g.dw_k = out(dwk);
  g.dw_v = out(dwv);
  g.dw_o = out(dwo);
  return g;
}

Case mha_case(bool self) {
  Case c;
  c.kind = Kind::Mha;
  c.input_dtype = c.output_dtype = DType::F32;
  c.B = 2, c.Hq = c.Hkv = 2, c.Nq = 4, c.Nk = self ? 4 : 5, c.D = 3, c.Dk = 2, c.Dv = 3, c.Dout = 4;
  auto fill = [](std::vector<std::int64_t> shape, float seed) {
    FloatTensor t{DType::F32, shape, {}};
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    for (std::int64_t e = 0; e < n; ++e) t.values.push_back(static_cast<double>(std::sin(seed * static_cast<float>(e + 1))));
    return t;
  };
  c.x_q = fill({c.B, c.Nq, c.D}, 1.1f);
  c.x_kv = self ? c.x_q : fill({c.B, c.Nk, c.D}, 0.7f);
  c.self_attention = self;
  c.w_q = fill({c.Hq, c.D, c.Dk}, 1.9f);
  c.w_k = fill({c.Hq, c.D, c.Dk}, 2.3f);
  c.w_v = fill({c.Hq, c.D, c.Dv}, 0.45f);
  c.w_o = fill({c.Hq * c.Dv, c.Dout}, 1.37f);
  c.dout = fill({c.B, c.Nq, c.Dout}, 0.61f);
  BoolTensor qm{{c.B, c.Nq}, std::vector<unsigned char>(static_cast<std::size_t>(c.B * c.Nq), 1)};
  qm.values[1] = 0;  // b = 0, i = 1: padding
  c.query_mask = qm;
  for (std::int64_t e = 0; e < c.Dout; ++e) c.dout->values[static_cast<std::size_t>(c.Dout + e)] = 1e6;
  return c;
}

// The worst ratio |got - exact| / limit of each tensor, with the limits compare_case takes.
std::map<std::string, double> mha_ratios(const Case& c, const MhaGrads& got) {
  const Profile p = builtin_profile("fp32");
  std::vector<RowLimits> limits;
  for (const auto& m : row_magnitudes(c)) limits.push_back(row_limits(p, c, m));
  const MhaGradientErrors ge = mha_gradient_errors(p, c, limits);
  const MhaGrads exact = mha_backward<double>(c, false), bound = mha_backward<double>(c, true);
  const bool self = c.self_attention;
  const double H = static_cast<double>(c.Hq), Dk = static_cast<double>(c.Dk), Dv = static_cast<double>(c.Dv);
  const double uo = unit_roundoff(DType::F32), up = unit_roundoff(p.projection);
  std::map<std::string, double> worst;
  auto judge = [&](const char* name, const std::vector<double>& y, const std::vector<double>& x,
                   const std::vector<double>& bd, const std::vector<double>& err, double n, double extra) {
    ASSERT_EQ(y.size(), err.size()) << name;
    const double fl = 2 * min_subnormal(DType::F32) + n * min_normal(p.grad_accum);
    double& w = worst[name];
    for (std::size_t k = 0; k < y.size(); ++k) {
      const double y32 = static_cast<double>(static_cast<float>(y[k]));  // the output's rounding
      w = std::max(w, std::fabs(y32 - x[k]) / gradient_limit(p, err[k], n, extra, bd[k], uo, fl, x[k]));
    }
  };
  judge("dx_q", got.dx_q, exact.dx_q, bound.dx_q, ge.dx_q, H * (self ? 2 * Dk + Dv : Dk), up);
  if (!self) judge("dx_kv", got.dx_kv, exact.dx_kv, bound.dx_kv, ge.dx_kv, H * (Dk + Dv), up);
  judge("dw_q", got.dw_q, exact.dw_q, bound.dw_q, ge.dw_q, static_cast<double>(c.B * c.Nq), up);
  judge("dw_k", got.dw_k, exact.dw_k, bound.dw_k, ge.dw_k, static_cast<double>(c.B * c.Nk), up);
  judge("dw_v", got.dw_v, exact.dw_v, bound.dw_v, ge.dw_v, static_cast<double>(c.B * c.Nk), up);
  judge("dw_o", got.dw_o, exact.dw_o, bound.dw_o, ge.dw_o, static_cast<double>(c.B * c.Nq), 0);
  return worst;
}

// A backward in F32 arithmetic is within the limits of every mha gradient (cross and self-
// attention, a padding row with dout 1e6); the same with dw_o transposed, or dx_kv without its dv
// term, is beyond them in that tensor only.
TEST(MhaGradientLimits, F32BackwardWithinPlantedMistakesBeyond) {
  for (const bool self : {false, true}) {
    const Case c = mha_case(self);
    for (const auto& [name, r] : mha_ratios(c, mha_backward<float>(c, false))) {
      EXPECT_LE(r, 1) << name << (self ? " (self)" : "");
      EXPECT_GT(r, 0) << name;  // F32 differs from the exact value somewhere
    }
    const auto t = mha_ratios(c, mha_backward<float>(c, false, MhaBug::DwoTransposed));
    EXPECT_GT(t.at("dw_o"), 1);
    EXPECT_LE(t.at("dw_q"), 1);
    const auto n = mha_ratios(c, mha_backward<float>(c, false, MhaBug::DxkvNoDv));
    EXPECT_GT(n.at(self ? "dx_q" : "dx_kv"), 1);
    EXPECT_LE(n.at("dw_v"), 1);
  }
}

// The limits are those of each head's backward carried through the projections: doubling w_o
// doubles dO_h, and with it every error but dw_o's (O_h does not depend on w_o); no error of a
// padding row's dout reaches dw_o.
TEST(MhaGradientLimits, ScaleWithWoAndIgnorePaddingRows) {
  const Profile p = builtin_profile("fp32");
  Case c = mha_case(false);
  auto errors = [&](const Case& cc) {
    std::vector<RowLimits> limits;
    for (const auto& m : row_magnitudes(cc)) limits.push_back(row_limits(p, cc, m));
    return mha_gradient_errors(p, cc, limits);
  };
  const MhaGradientErrors a = errors(c);
  Case twice = c;
  for (double& w : twice.w_o.values) w *= 2;
  const MhaGradientErrors b = errors(twice);
  for (std::size_t k = 0; k < a.dw_q.size(); ++k) EXPECT_NEAR(b.dw_q[k], 2 * a.dw_q[k], 1e-9 * a.dw_q[k]) << k;
  for (std::size_t k = 0; k < a.dx_kv.size(); ++k) EXPECT_NEAR(b.dx_kv[k], 2 * a.dx_kv[k], 1e-9 * a.dx_kv[k]) << k;
  for (std::size_t k = 0; k < a.dw_o.size(); ++k) EXPECT_DOUBLE_EQ(b.dw_o[k], a.dw_o[k]) << k;
  Case e = c;
  for (std::int64_t f = 0; f < c.Dout; ++f) e.dout->values[static_cast<std::size_t>(c.Dout + f)] = 1e12;
  const MhaGradientErrors g = errors(e);
  EXPECT_EQ(g.dw_o, a.dw_o);
  EXPECT_EQ(g.dw_k, a.dw_k);
  // dx_q of the padding row carries nothing
  for (std::int64_t d = 0; d < c.D; ++d) EXPECT_EQ(a.dx_q[static_cast<std::size_t>(c.D + d)], 0);
}

}  // namespace
}  // namespace attnoracle::conformance
