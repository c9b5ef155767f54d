// The model's magnitudes stored with the golden tensors: the magnitudes bit for bit, every scale
// term at least the computed one (and within F32's rounding of it) on random cases; the verdicts
// and the statistical tier's figures of the committed core suite with the model stored bound
// those without; a malformed stored model refused by name.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/statistics.hpp"
#include "attnoracle/conformance/stored_model.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/manifest.hpp"

namespace attnoracle::conformance {
namespace {

double sq(double x) { return x * x; }

Case random_case(std::mt19937_64& gen, bool mask, bool bias, bool causal, std::int64_t Dv) {
  Case c;
  c.kind = Kind::Sdpa;
  c.B = *rc::gen::inRange<std::int64_t>(1, 3);
  c.Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  c.Hq = c.Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  c.Nq = *rc::gen::inRange<std::int64_t>(1, 6);
  c.Nk = *rc::gen::inRange<std::int64_t>(1, 14);
  c.Dk = *rc::gen::inRange<std::int64_t>(1, 10);
  c.Dv = Dv;
  std::normal_distribution<double> normal;
  auto fill = [&](FloatTensor& t, std::vector<std::int64_t> shape) {
    t.shape = shape;
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    for (std::int64_t k = 0; k < n; ++k) t.values.push_back(normal(gen));
  };
  fill(c.q, {c.B, c.Hq, c.Nq, c.Dk});
  fill(c.k, {c.B, c.Hkv, c.Nk, c.Dk});
  fill(c.v, {c.B, c.Hkv, c.Nk, c.Dv});
  if (mask) {
    BoolTensor m{{c.B, c.Hq, c.Nq, c.Nk}, {}};
    for (std::int64_t k = 0; k < c.B * c.Hq * c.Nq * c.Nk; ++k) m.values.push_back(gen() % 4 != 0);
    c.mask = std::move(m);
  }
  if (bias) {
    c.bias = FloatTensor{};
    fill(*c.bias, {c.Nq, c.Nk});
    c.bias->values[0] = -INFINITY;
  }
  if (causal) c.causal = Causal::BottomRight;
  return c;
}

// a >= b, and a within `rel` of b (plus an underflow's few subnormals)
::testing::AssertionResult bounds(double a, double b, double rel) {
  if (a >= b && a <= b * (1 + rel) + 0x1p-140) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << a << " does not bound " << b;
}

RC_GTEST_PROP(StoredModel, BoundsTheComputedModel, ()) {
  std::mt19937_64 gen(*rc::gen::arbitrary<std::uint32_t>());
  std::vector<std::int64_t> widths(40);
  std::iota(widths.begin(), widths.end(), 1);
  const Case c = random_case(gen, *rc::gen::arbitrary<bool>(), *rc::gen::arbitrary<bool>(),
                             *rc::gen::arbitrary<bool>(), *rc::gen::elementOf(widths));
  SafeTensorsFile f;
  put_model(c, f);
  const std::optional<StoredModel> m = stored_model(c, f, "case");
  RC_ASSERT(m.has_value());
  const auto mags = row_magnitudes(c), smags = stored_magnitudes(*m);
  RC_ASSERT(mags.size() == smags.size());
  for (std::size_t r = 0; r < mags.size(); ++r) {
    RC_ASSERT(mags[r].dot_abs == smags[r].dot_abs);
    RC_ASSERT(mags[r].score_abs == smags[r].score_abs);
    RC_ASSERT(mags[r].keys == smags[r].keys);
    RC_ASSERT(mags[r].bias_abs == smags[r].bias_abs);
  }
  std::vector<Profile> profiles = {builtin_profile("fp32"), builtin_profile("fp16"), builtin_profile("bf16")};
  Profile odd = builtin_profile("fp16");  // a bias dtype, P in F8 and a wider exp
  odd.bias = DType::BF16;
  odd.p = DType::F8_E4M3;
  odd.exp_ulps = 4;
  profiles.push_back(odd);
  odd.p = DType::F64;  // no rounding of P
  profiles.push_back(odd);
  for (const Profile& p : profiles) {
    const Spread a = weight_spread(c, p);
    const std::optional<Spread> s = stored_spread(*m, p);
    RC_ASSERT(s.has_value());
    RC_ASSERT(s->z_part == a.z_part);
    for (int k = 0; k < 4; ++k) RC_ASSERT(s->p_bias[k] == a.p_bias[k]);
    for (std::size_t r = 0; r < a.key_sum.size(); ++r) {
      RC_ASSERT(bounds(s->key_sum[r], a.key_sum[r], 1e-6));
      RC_ASSERT(s->key_max[r] >= a.key_max[r]);
      RC_ASSERT(s->key_max[r] <= 2 * a.key_max[r] + 0x1p-140);  // the sum of the maxima, at most 4 terms
    }
    RC_ASSERT(s->partial.empty());
    for (std::size_t k = 0; k < a.key.size(); ++k) {
      RC_ASSERT(bounds(s->key[k], a.key[k], 1e-6));
      RC_ASSERT(bounds(sq(s->wv[k]), sq(a.wv[k]) + sq(a.partial[k]), 1e-6));
    }
  }
}

TEST(StoredModel, MalformedIsRefusedByName) {
  std::mt19937_64 gen(7);
  Case c;
  c.kind = Kind::Sdpa;
  c.B = c.Hq = c.Hkv = 1;
  c.Nq = 3, c.Nk = 4, c.Dk = 2, c.Dv = 3;
  for (auto* t : {&c.q, &c.k, &c.v}) t->values.assign(24, 0.5);
  c.q.shape = {1, 1, 3, 2}, c.k.shape = {1, 1, 4, 2}, c.v.shape = {1, 1, 4, 3};
  c.q.values.resize(6), c.k.values.resize(8), c.v.values.resize(12);
  SafeTensorsFile f;
  EXPECT_FALSE(stored_model(c, f, "g.safetensors").has_value());
  put_model(c, f);
  EXPECT_TRUE(stored_model(c, f, "g.safetensors").has_value());
  auto refusal = [&](const SafeTensorsFile& g) {
    try {
      stored_model(c, g, "g.safetensors");
    } catch (const InputError& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  SafeTensorsFile wrong = f;
  wrong.find("model.rows")->shape = {1, 1, 4, kModelRowFields};
  EXPECT_EQ(refusal(wrong), "g.safetensors: model.rows: must be F64 of the shape the case gives it");
  wrong = f;
  wrong.find("model.out")->dtype = DType::F64;
  EXPECT_EQ(refusal(wrong), "g.safetensors: model.out: must be F32 of the shape the case gives it");
  wrong = f;
  std::erase_if(wrong.tensors, [](const RawTensor& t) { return t.name == "model.p_bias"; });
  EXPECT_EQ(refusal(wrong), "g.safetensors: model.p_bias: missing: model.rows, model.out and model.p_bias come together");
}

// The core suite's sdpa cases, each judged on its golden values with every third element of out,
// weights and lse one ulp off, under the profile of its dtype: with the model stored, the same
// verdict and failed elements, and each tensor's statistical figures at most those computed.
TEST(StoredModel, CoreVerdictsBoundTheComputedOnes) {
  const std::string dir = std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core";
  std::ifstream in(dir + "/manifest.json");
  std::stringstream text;
  text << in.rdbuf();
  std::string problem;
  const vectors::Manifest man = vectors::parse_manifest(dir, text.str(), problem);
  ASSERT_EQ(problem, "");
  int judged = 0, tested = 0;
  for (const auto& mc : man.cases) {
    if (mc.expect != "ok") continue;
    SafeTensorsFile golden = vectors::read_set_case(dir, mc.file, mc.sha256);
    const auto kind = golden.metadata.find("attn.kind");
    if (kind != golden.metadata.end() && kind->second != "sdpa") continue;
    const RawTensor* q = golden.find("q");
    if (!q || !is_float_format(q->dtype) || golden.find("out_partial")) continue;
    JobResult result;
    result.outcome = Outcome::Output;
    for (const char* name : {"out", "weights", "lse"}) {
      const RawTensor* g = golden.find(name);
      if (!g) continue;
      RawTensor y = *g;
      const std::size_t w = dtype_size(y.dtype);
      for (std::size_t e = 0; e * w < y.data.size(); e += 3) {
        std::uint64_t bits = 0;
        std::memcpy(&bits, y.data.data() + e * w, w);
        const std::uint64_t mag = bits & ((std::uint64_t{1} << (8 * w - 1)) - 1);
        if (mag == 0 || mag >= (std::uint64_t{1} << (8 * w - 1)) - (std::uint64_t{1} << (8 * w - 12))) continue;
        bits += (e / 3) % 2 ? 1 : -1;
        std::memcpy(y.data.data() + e * w, &bits, w);
      }
      result.output.put(std::move(y));
    }
    const Profile p = builtin_profile(q->dtype == DType::F16 ? "fp16" : q->dtype == DType::BF16 ? "bf16" : "fp32");
    const CaseReport plain = compare_case(mc.id, golden, mc.expect, result, p);
    SafeTensorsFile stored = golden;
    put_model(case_from_file(mc.id, golden), stored);
    const CaseReport fast = compare_case(mc.id, stored, mc.expect, result, p);
    ++judged;
    ASSERT_EQ(fast.status, plain.status) << mc.id << ": " << plain.reason << " / " << fast.reason;
    EXPECT_EQ(fast.failed_elements, plain.failed_elements) << mc.id;
    ASSERT_EQ(fast.tensors.size(), plain.tensors.size()) << mc.id;
    for (std::size_t t = 0; t < plain.tensors.size(); ++t) {
      const Tier &a = plain.tensors[t].tier, &b = fast.tensors[t].tier;
      EXPECT_EQ(a.tested, b.tested) << mc.id;
      const std::string& name = plain.tensors[t].tensor;
      // lse: the stored model bounds the roundings shared across rows by the row's A (TOLERANCE.md,
      // "Roundings shared across rows"), a larger shift than the computed one: it passes at least
      // what the computed model passes
      if (name == "lse") EXPECT_TRUE(!a.ok || b.ok) << mc.id;
      else EXPECT_EQ(a.ok, b.ok) << mc.id << " " << name;
      if (!a.tested) continue;
      ++tested;
      const double rel = 1e-6;
      EXPECT_LE(b.q99, a.q99 * (1 + rel)) << mc.id << " " << name;
      EXPECT_LE(b.rms, a.rms * (1 + rel)) << mc.id << " " << name;
      EXPECT_LE(std::fabs(b.bias), std::fabs(a.bias) * (1 + rel) + 1e-12) << mc.id;
      EXPECT_GE(b.headroom, a.headroom * (1 - 1e-5)) << mc.id << " " << name;
      // out and lse: F32's rounding apart, the same; the weights' scale takes a bound of max_j kr_j
      // (the sum of the maxima of its parts: at most twice it)
      const double close = name == "weights" ? 0.5 : 1e-5;
      EXPECT_GE(b.q99, a.q99 * (1 - close)) << mc.id << " " << name;
      if (std::isfinite(a.headroom) && name != "lse") {
        EXPECT_LE(b.headroom, a.headroom * (1 + close) + 1e-300) << mc.id << " " << name;
      }
    }
  }
  EXPECT_GT(judged, 100);
  EXPECT_GT(tested, 50);
}

}  // namespace
}  // namespace attnoracle::conformance
