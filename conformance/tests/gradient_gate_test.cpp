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

}  // namespace
}  // namespace attnoracle::conformance
