// Certified gradients (CONTRACT section 7) on examples worked by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::testing {
namespace {

RawTensor floats(const std::string& name, DType t, std::vector<std::int64_t> shape,
                 const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}

RawTensor bools(const std::string& name, std::vector<std::int64_t> shape, const std::vector<int>& v) {
  RawTensor r{name, DType::BOOL, std::move(shape), {}};
  for (int x : v) r.data.push_back(x ? 1 : 0);
  return r;
}

SafeTensorsFile file(std::vector<RawTensor> tensors, std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  // a string moved in: GCC 12 at -O3 reports a false -Wrestrict on assigning "1" (GCC bug 105329)
  f.metadata["attn.format"] = std::string("1");
  for (auto& t : tensors) f.put(std::move(t));
  return f;
}

EvalResult run(std::vector<RawTensor> tensors, std::map<std::string, std::string> md, int threads = 1) {
  const Case c = case_from_file("test.safetensors", file(std::move(tensors), std::move(md)));
  EvalOptions opt;
  opt.threads = threads;
  return evaluate(c, opt);
}

const RawTensor& find(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}
bool has(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return true;
  return false;
}
std::vector<double> values(const EvalResult& r, const std::string& name) {
  const RawTensor& t = find(r, name);
  std::vector<double> v(t.data.size() / dtype_size(t.dtype));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = decode_float(t.dtype, t.data.data() + i * dtype_size(t.dtype));
  return v;
}

// An expression evaluated at 300 bits, rounded to F64.
template <class F>
double exact(F f) {
  mpfr_t x;
  mpfr_init2(x, 300);
  f(x);
  const double d = round_to_format(x, DType::F64);
  mpfr_clear(x);
  return d;
}

const std::map<std::string, std::string> kAll = {{"attn.outputs", "out,dq,dk,dv"}, {"attn.scale", "1"}};

TEST(Backward, OneKeyGivesZeroDqDkAndDvEqualToDout) {
  auto r = run({floats("q", DType::F32, {1, 1, 1, 3}, {0.5, -2, 7}),
                floats("k", DType::F32, {1, 1, 1, 3}, {1, 1, 1}),
                floats("v", DType::F32, {1, 1, 1, 3}, {0.1f, -3e-20f, 123456.789f}),
                floats("dout", DType::F32, {1, 1, 1, 3}, {1.5f, -0.1f, 3e-30f})},
               {{"attn.outputs", "out,dq,dk,dv"}});
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{1.5f, -0.1f, 3e-30f}));
  EXPECT_EQ(values(r, "dv.ref"), (std::vector<double>{1.5f, -0.1f, 3e-30f}));
  EXPECT_EQ(values(r, "dv.bound"), (std::vector<double>{1.5f, 0.1f, 3e-30f}));
  EXPECT_FALSE(has(r, "dq.undecided"));
  EXPECT_EQ(r.stats.undecided, 0u);
}

// q = 1, keys 0 and 1, values 1 and 3, dout = 2: with s = e/(1+e) the weight of key 1,
// dS = 4 s (1 - s) (-1, 1), dq = 4 s (1 - s), dk = (-4 s (1 - s), 4 s (1 - s)), dv = 2 (1 - s, s).
TEST(Backward, TwoKeysWorkedByHand) {
  auto r = run({floats("q", DType::F64, {1, 1, 1, 1}, {1}), floats("k", DType::F64, {1, 1, 2, 1}, {0, 1}),
                floats("v", DType::F64, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F64, {1, 1, 1, 1}, {2})},
               kAll);
  auto s = [](mpfr_ptr x) {  // e / (1 + e)
    mpfr_set_ui(x, 1, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_t d;
    mpfr_init2(d, 300);
    mpfr_add_ui(d, x, 1, MPFR_RNDN);
    mpfr_div(x, x, d, MPFR_RNDN);
    mpfr_clear(d);
  };
  auto g = [&](mpfr_ptr x) {  // 4 s (1 - s)
    s(x);
    mpfr_t t;
    mpfr_init2(t, 300);
    mpfr_ui_sub(t, 1, x, MPFR_RNDN);
    mpfr_mul(x, x, t, MPFR_RNDN);
    mpfr_mul_ui(x, x, 4, MPFR_RNDN);
    mpfr_clear(t);
  };
  const double gv = exact(g);
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{gv}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{-gv, gv}));
  const double sv = exact([&](mpfr_ptr x) { s(x); mpfr_mul_ui(x, x, 2, MPFR_RNDN); });
  const double sv1 = exact([&](mpfr_ptr x) { s(x); mpfr_ui_sub(x, 1, x, MPFR_RNDN); mpfr_mul_ui(x, x, 2, MPFR_RNDN); });
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{sv1, sv}));
  // dq.bound = |scale| P_2 (|dout v_2| + |dout O|) |k_2| = s (6 + 2 + 4 s).
  const double bq = exact([&](mpfr_ptr x) {
    s(x);
    mpfr_t t;
    mpfr_init2(t, 300);
    mpfr_mul_ui(t, x, 4, MPFR_RNDN);
    mpfr_add_ui(t, t, 8, MPFR_RNDN);
    mpfr_mul(x, x, t, MPFR_RNDN);
    mpfr_clear(t);
  });
  EXPECT_NEAR(values(r, "dq.bound")[0], bq, 4e-16 * bq);
  EXPECT_GE(values(r, "dq.bound")[0], bq);
}

// q = 0: weights 1/4; values 1..4, dout 1: dS = (v - 5/2) / 4, dq = sum dS k, dk = 0, dv = 1/4.
TEST(Backward, EqualScoresAreExact) {
  auto r = run({floats("q", DType::F32, {1, 1, 1, 2}, {0, 0}),
                floats("k", DType::F32, {1, 1, 4, 2}, {1, 0, 0, 1, 1, 1, 2, 0}),
                floats("v", DType::F32, {1, 1, 4, 1}, {1, 2, 3, 4}), floats("dout", DType::F32, {1, 1, 1, 1}, {1})},
               kAll);
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{0.5, 0}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>(8, 0.0)));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>(4, 0.25)));
  EXPECT_EQ(r.stats.undecided, 0u);
}

// Causal top_left: row 0 sees key 0 only (dS = 0), row 1 both keys with equal scores.
TEST(Backward, CausalRows) {
  auto r = run({floats("q", DType::F32, {1, 1, 2, 1}, {3, 2}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})},
               {{"attn.outputs", "dq,dk,dv"}, {"attn.scale", "1"}, {"attn.causal", "top_left"}});
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{0, 0}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{-2, 2}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{2, 1}));
  // bottom_right with Nq = Nk: the same rows.
  auto br = run({floats("q", DType::F32, {1, 1, 2, 1}, {3, 2}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                 floats("v", DType::F32, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})},
                {{"attn.outputs", "dq,dk,dv"}, {"attn.scale", "1"}, {"attn.causal", "bottom_right"}});
  EXPECT_EQ(values(br, "dv"), (std::vector<double>{2, 1}));
  // bottom_right with one query and two keys: it sees both keys, as without causal.
  auto one = run({floats("q", DType::F32, {1, 1, 1, 1}, {2}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                  floats("v", DType::F32, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F32, {1, 1, 1, 1}, {2})},
                 {{"attn.outputs", "dq,dk,dv"}, {"attn.scale", "1"}, {"attn.causal", "bottom_right"}});
  EXPECT_EQ(values(one, "dk"), (std::vector<double>{-2, 2}));
  EXPECT_EQ(values(one, "dv"), (std::vector<double>{1, 1}));
}

// Two query heads read one kv head: dk and dv sum the heads' contributions.
TEST(Backward, GqaSumsOverTheGroup) {
  // head 0 as in CausalRows' row 1 (dk = (-2, 2), dv = (1, 1)); head 1 has q = 0 and dout 4
  // (dS = 2 (-1, 1), dk = 0, dv = (2, 2)).
  auto r = run({floats("q", DType::F32, {1, 2, 1, 1}, {2, 0}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F32, {1, 2, 1, 1}, {2, 4})},
               kAll);
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{-2, 2}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{3, 3}));
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{0, 0}));
}

// Softcap c = 2: T = (0, 1), S = (0, 2 tanh(1/2)); dT_2 = dS_2 sech^2(1/2), dT_1 = dS_1.
TEST(Backward, SoftcapDerivative) {
  auto r = run({floats("q", DType::F64, {1, 1, 1, 1}, {1}), floats("k", DType::F64, {1, 1, 2, 1}, {0, 1}),
                floats("v", DType::F64, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F64, {1, 1, 1, 1}, {2})},
               {{"attn.outputs", "dq,dk"}, {"attn.scale", "1"}, {"attn.softcap", "2"}});
  // s = 1 / (1 + exp(-S_2)), dS_2 = 4 s (1 - s).
  auto ds = [](mpfr_ptr x) {
    mpfr_t t;
    mpfr_init2(t, 300);
    mpfr_set_d(x, 0.5, MPFR_RNDN);
    mpfr_tanh(x, x, MPFR_RNDN);
    mpfr_mul_ui(x, x, 2, MPFR_RNDN);
    mpfr_neg(x, x, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
    mpfr_ui_sub(t, 1, x, MPFR_RNDN);
    mpfr_mul(x, x, t, MPFR_RNDN);
    mpfr_mul_ui(x, x, 4, MPFR_RNDN);
    mpfr_clear(t);
  };
  auto dt = [&](mpfr_ptr x) {
    ds(x);
    mpfr_t t;
    mpfr_init2(t, 300);
    mpfr_set_d(t, 0.5, MPFR_RNDN);
    mpfr_sech(t, t, MPFR_RNDN);
    mpfr_sqr(t, t, MPFR_RNDN);
    mpfr_mul(x, x, t, MPFR_RNDN);
    mpfr_clear(t);
  };
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{exact(dt)}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{-exact(ds), exact(dt)}));
}

// A -inf bias masks key 1: its dk, dv and dbias are 0; q = 0 gives weights (1/2, 0, 1/2).
TEST(Backward, MinusInfinityBiasAndDbias) {
  const double inf = std::numeric_limits<double>::infinity();
  auto r = run({floats("q", DType::F32, {1, 1, 1, 1}, {0}), floats("k", DType::F32, {1, 1, 3, 1}, {1, 5, 3}),
                floats("v", DType::F32, {1, 1, 3, 1}, {1, 100, 3}), floats("dout", DType::F32, {1, 1, 1, 1}, {1}),
                floats("bias", DType::F32, {1, 1, 1, 3}, {0, -inf, 0})},
               {{"attn.outputs", "dq,dk,dv,dbias"}, {"attn.scale", "1"}});
  EXPECT_EQ(values(r, "dbias"), (std::vector<double>{-0.5, 0, 0.5}));
  EXPECT_EQ(values(r, "dbias.ref"), (std::vector<double>{-0.5, 0, 0.5}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{0.5, 0, 0.5}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{1}));
  // dbias.bound = P (|dout v_j| + |dout O|) = 1/2 (1 + 2), 0, 1/2 (3 + 2), rounded up.
  const auto bd = values(r, "dbias.bound");
  EXPECT_TRUE(bd[0] == 1.5 || bd[0] == std::nextafter(1.5, 2.0)) << bd[0];
  EXPECT_EQ(bd[1], 0);
  EXPECT_TRUE(bd[2] == 2.5 || bd[2] == std::nextafter(2.5, 3.0)) << bd[2];
}

// A bias broadcast along the keys: each element sums whole rows of dS, exactly 0.
TEST(Backward, DbiasReducedOverBroadcastDimensionsOfAScalarBias) {
  auto r = run({floats("q", DType::F32, {1, 2, 2, 1}, {1, -2, 0.5, 3}), floats("k", DType::F32, {1, 1, 3, 1}, {1, 5, 3}),
                floats("v", DType::F32, {1, 1, 3, 1}, {1, 7, 3}), floats("dout", DType::F32, {1, 2, 2, 1}, {1, 2, 3, 4}),
                floats("bias", DType::F32, {}, {0.25})},
               {{"attn.outputs", "dbias"}, {"attn.scale", "0.5"}});
  EXPECT_EQ(find(r, "dbias").shape, (std::vector<std::int64_t>{}));
  EXPECT_EQ(values(r, "dbias"), (std::vector<double>{0}));
  EXPECT_GT(values(r, "dbias.bound")[0], 0);
  // Per key [Nk]: dbias_j sums dS_ij over b, h and i; it sums to 0 over j (exactly, here).
  auto rk = run({floats("q", DType::F32, {1, 2, 2, 1}, {1, -2, 0.5, 3}), floats("k", DType::F32, {1, 1, 3, 1}, {1, 5, 3}),
                 floats("v", DType::F32, {1, 1, 3, 1}, {1, 7, 3}), floats("dout", DType::F32, {1, 2, 2, 1}, {1, 2, 3, 4}),
                 floats("bias", DType::F32, {3}, {0.25, 0, -1})},
                {{"attn.outputs", "dbias"}, {"attn.scale", "0.5"}});
  const auto d = values(rk, "dbias.ref");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_NEAR(d[0] + d[1] + d[2], 0, 1e-15 * (std::fabs(d[0]) + std::fabs(d[1]) + std::fabs(d[2])));
  EXPECT_NE(d[0], 0);
}

// A fully masked row under policy zero and a padding row with NaN dout: gradient 0, nothing
// contributed.
TEST(Backward, MaskedAndPaddingRowsGiveZero) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto r = run({floats("q", DType::F32, {1, 1, 3, 1}, {1, 2, 3}), floats("k", DType::F32, {1, 1, 1, 1}, {1}),
                floats("v", DType::F32, {1, 1, 1, 1}, {2}), floats("dout", DType::F32, {1, 1, 3, 1}, {4, 5, nan}),
                bools("mask", {1, 1, 3, 1}, {1, 0, 1}), bools("query_mask", {1, 3}, {1, 1, 0})},
               {{"attn.outputs", "dq,dk,dv"}, {"attn.masked_rows", "zero"}});
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{4}));  // row 0 only
  // Row 0's dq is 0 but its terms are not: |scale| P (|dout v| + |dout O|) |k| = 8 + 8.
  EXPECT_EQ(values(r, "dq.bound"), (std::vector<double>{16, 0, 0}));
}

// 2 dout gives exactly twice every golden gradient (doubling is exact away from overflow).
TEST(Backward, LinearInDout) {
  auto make = [](double f) {
    return run({floats("q", DType::F64, {1, 1, 2, 2}, {0.3, -1.7, 2.5, 0.125}),
                floats("k", DType::F64, {1, 1, 3, 2}, {1, 0.5, -0.25, 2, 3, -1}),
                floats("v", DType::F64, {1, 1, 3, 2}, {1, 2, -3, 0.5, 7, 0.1}),
                floats("dout", DType::F64, {1, 1, 2, 2}, {f * 0.7, f * -1.3, f * 2.1, f * 0.01})},
               {{"attn.outputs", "dq,dk,dv"}, {"attn.softcap", "3"}}, 2);
  };
  const auto a = make(1), b = make(2);
  for (const char* g : {"dq.ref", "dk.ref", "dv.ref"}) {
    const auto x = values(a, g), y = values(b, g);
    ASSERT_EQ(x.size(), y.size());
    for (std::size_t e = 0; e < x.size(); ++e) EXPECT_EQ(2 * x[e], y[e]) << g << "[" << e << "]";
  }
}

TEST(Backward, ThreadCountDoesNotChangeBytes) {
  auto make = [](int threads) {
    return run({floats("q", DType::F64, {1, 2, 3, 2}, {0.3, -1.7, 2.5, 0.125, 1, 2, 3, 4, 5, 6, 7, 8}),
                floats("k", DType::F64, {1, 1, 3, 2}, {1, 0.5, -0.25, 2, 3, -1}),
                floats("v", DType::F64, {1, 1, 3, 2}, {1, 2, -3, 0.5, 7, 0.1}),
                floats("dout", DType::F64, {1, 2, 3, 2}, {0.7f, -1.3f, 2.1f, 0.01f, 1, 2, 3, 4, 5, 6, 7, 8}),
                floats("bias", DType::F64, {3, 1}, {0.5, 0, 1})},
               {{"attn.outputs", "dq,dk,dv,dbias"}, {"attn.causal", "bottom_right"}}, threads);
  };
  const auto a = make(1), b = make(3);
  ASSERT_EQ(a.golden.size(), b.golden.size());
  for (std::size_t t = 0; t < a.golden.size(); ++t) {
    EXPECT_EQ(a.golden[t].name, b.golden[t].name);
    EXPECT_EQ(a.golden[t].data, b.golden[t].data) << a.golden[t].name;
  }
}

// One key (score 2) and a sink of 2: A = P_sink = 1/2, O = 3/2, D = dout O = 3, dP = 6,
// dS = A (dP - D) = 3/2 (not 0: the weights sum to 1/2), dq = dS k = 3 (k not centred away),
// dk = dS q = 3/2, dv = A dout = 1, dbias (a scalar) = dS = 3/2, dsinks = -P_sink D = -3/2 with
// bound P_sink |dout O| = 3/2. dS + (-P_sink D) = 0: the row's shares with the sink sum to 0.
TEST(Backward, OneKeyAndASinkWorkedByHand) {
  auto r = run({floats("q", DType::F32, {1, 1, 1, 1}, {1}), floats("k", DType::F32, {1, 1, 1, 1}, {2}),
                floats("v", DType::F32, {1, 1, 1, 1}, {3}), floats("dout", DType::F32, {1, 1, 1, 1}, {2}),
                floats("bias", DType::F32, {}, {0}), floats("sinks", DType::F32, {1}, {2})},
               {{"attn.outputs", "out,dq,dk,dv,dbias,dsinks"}, {"attn.scale", "1"}});
  EXPECT_EQ(values(r, "out"), (std::vector<double>{1.5}));
  EXPECT_EQ(values(r, "dq"), (std::vector<double>{3}));
  EXPECT_EQ(values(r, "dk"), (std::vector<double>{1.5}));
  EXPECT_EQ(values(r, "dv"), (std::vector<double>{1}));
  EXPECT_EQ(values(r, "dbias"), (std::vector<double>{1.5}));
  EXPECT_EQ(values(r, "dsinks"), (std::vector<double>{-1.5}));
  EXPECT_EQ(values(r, "dsinks.ref"), (std::vector<double>{-1.5}));
  // The bound: never below 3/2, at most one unit above it (P_sink comes from an inexact lse).
  const double bound = values(r, "dsinks.bound").at(0);
  EXPECT_GE(bound, 1.5);
  EXPECT_LE(bound, std::nextafter(1.5, 2.0));
  EXPECT_EQ(find(r, "dsinks").dtype, DType::F32);
  EXPECT_EQ(find(r, "dsinks").shape, (std::vector<std::int64_t>{1}));
  EXPECT_EQ(find(r, "dsinks.ref").dtype, DType::F64);
  EXPECT_EQ(r.stats.undecided, 0u);
}

// Row 1 of both heads has its key masked: only the sink is left, O = 0 and D = 0, so it adds
// nothing to dsinks and its dq is 0 (dout there is 5 and 7). Head 0 is the example above
// (dsinks -3/2); head 1 has the sink 2 + x with x = sinks[1] - 2 (exact): with e = exp(x),
// A = 1/(1+e), P_sink = e/(1+e), O = 3A, D = 6A and dsinks = -6 e / (1+e)^2.
TEST(Backward, SinkWithAMaskedRow) {
  const double sink1 = 2 + std::log(2.0);
  auto r = run({floats("q", DType::F64, {1, 2, 2, 1}, {1, 4, 1, -4}), floats("k", DType::F64, {1, 1, 1, 1}, {2}),
                floats("v", DType::F64, {1, 1, 1, 1}, {3}), floats("dout", DType::F64, {1, 2, 2, 1}, {2, 5, 2, 7}),
                bools("mask", {1, 2, 2, 1}, {1, 0, 1, 0}), floats("sinks", DType::F64, {2}, {2, sink1})},
               {{"attn.outputs", "out,dq,dsinks"}, {"attn.scale", "1"}});
  const double want = exact([&](mpfr_ptr x) {
    mpfr_set_d(x, sink1, MPFR_RNDN);
    mpfr_sub_ui(x, x, 2, MPFR_RNDN);  // exact
    mpfr_exp(x, x, MPFR_RNDN);        // e
    mpfr_t d;
    mpfr_init2(d, 300);
    mpfr_add_ui(d, x, 1, MPFR_RNDN);
    mpfr_sqr(d, d, MPFR_RNDN);
    mpfr_mul_si(x, x, -6, MPFR_RNDN);
    mpfr_div(x, x, d, MPFR_RNDN);
    mpfr_clear(d);
  });
  EXPECT_EQ(values(r, "dsinks"), (std::vector<double>{-1.5, want}));
  EXPECT_NEAR(want, -4.0 / 3, 1e-15);
  const std::vector<double> dq = values(r, "dq");
  EXPECT_EQ(dq[1], 0);
  EXPECT_EQ(dq[3], 0);
  EXPECT_EQ(values(r, "out")[1], 0);
  EXPECT_EQ(values(r, "out")[3], 0);
}

// Refusals: one clear error naming the field.
void expect_refused(std::vector<RawTensor> t, std::map<std::string, std::string> md, const std::string& field,
                    const std::string& part) {
  try {
    (void)case_from_file("test.safetensors", file(std::move(t), std::move(md)));
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), field) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

std::vector<RawTensor> basic(std::vector<RawTensor> extra = {}) {
  std::vector<RawTensor> t = {floats("q", DType::F32, {1, 1, 2, 1}, {1, 2}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                              floats("v", DType::F32, {1, 1, 2, 1}, {1, 3})};
  for (auto& x : extra) t.push_back(std::move(x));
  return t;
}

TEST(Backward, Refusals) {
  expect_refused(basic(), {{"attn.outputs", "out,dv"}}, "dout", "required when attn.outputs asks for a gradient: dv");
  expect_refused(basic({floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})}), {{"attn.outputs", "dbias"}},
                 "attn.outputs", "dbias is asked but the case has no bias");
  expect_refused(basic({floats("dout", DType::F32, {1, 1, 1, 1}, {1})}), {{"attn.outputs", "dq"}}, "dout",
                 "is not the shape of out");
  expect_refused(basic({floats("dout", DType::F16, {1, 1, 2, 1}, {1, 2})}), {{"attn.outputs", "dq"}}, "dout",
                 "is not F64, F32 or F32");
  expect_refused(basic({floats("dout", DType::F32, {1, 1, 2, 1}, {1, std::nan("")})}), {{"attn.outputs", "dq"}},
                 "dout", "element 1 is NaN, in query 1");
  expect_refused(basic(), {{"attn.outputs", "dw"}}, "attn.outputs", "dq, dk, dv, dbias");
  expect_refused({floats("x_q", DType::F32, {1, 1, 1}, {1}), floats("x_kv", DType::F32, {1, 1, 1}, {1}),
                  floats("w_q", DType::F32, {1, 1, 1}, {1}), floats("w_k", DType::F32, {1, 1, 1}, {1}),
                  floats("w_v", DType::F32, {1, 1, 1}, {1}), floats("w_o", DType::F32, {1, 1}, {1})},
                 {{"attn.outputs", "dq"}, {"attn.kind", "mha"}}, "attn.outputs", "asks for dq, a gradient of kind sdpa");
  expect_refused(basic({floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})}), {{"attn.outputs", "out,dw_o"}},
                 "attn.outputs", "asks for dw_o, a gradient of kind mha");
  expect_refused(basic({floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})}), {{"attn.outputs", "out,dsinks"}},
                 "attn.outputs", "dsinks is asked but the case has no sinks tensor");
  expect_refused(basic({floats("sinks", DType::F32, {1}, {0.5})}), {{"attn.outputs", "dsinks"}}, "dout",
                 "required when attn.outputs asks for a gradient: dsinks");
  expect_refused({floats("q", DType::F8_E4M3, {1, 1, 2, 1}, {1, 2}), floats("k", DType::F8_E4M3, {1, 1, 2, 1}, {1, 1}),
                  floats("v", DType::F8_E4M3, {1, 1, 2, 1}, {1, 3}), floats("dout", DType::F32, {1, 1, 2, 1}, {1, 2})},
                 {{"attn.outputs", "dk"}, {"attn.output_dtype", "F32"}}, "attn.outputs",
                 "gradients of F8_E4M3 inputs are not supported");
}

}  // namespace
}  // namespace attnoracle::testing
