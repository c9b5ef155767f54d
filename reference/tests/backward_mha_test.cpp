// Certified gradients of kind mha (CONTRACT section 7) on examples worked by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::testing {
namespace {

RawTensor floats(const std::string& name, std::vector<std::int64_t> shape, const std::vector<double>& v,
                 DType t = DType::F64) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}

SafeTensorsFile file(std::vector<RawTensor> tensors, std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  f.metadata["attn.format"] = std::string("1");
  f.metadata["attn.kind"] = std::string("mha");
  for (auto& t : tensors) f.put(std::move(t));
  return f;
}

EvalResult run(std::vector<RawTensor> tensors, std::map<std::string, std::string> md, int threads = 1) {
  const Case c = case_from_file("test.safetensors", file(std::move(tensors), std::move(md)));
  EvalOptions opt;
  opt.threads = threads;
  return evaluate(c, opt);
}

std::vector<double> values(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) {
      std::vector<double> v(t.data.size() / dtype_size(t.dtype));
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = decode_float(t.dtype, t.data.data() + i * dtype_size(t.dtype));
      return v;
    }
  throw std::runtime_error("no tensor " + name);
}

// One head of width 1: q = 2 x_q, k = 3 x_kv, v = 5 x_kv, out = 7 O.
std::vector<RawTensor> scalars(std::vector<double> xq, std::vector<double> xkv, std::vector<double> dout) {
  const auto nq = static_cast<std::int64_t>(xq.size()), nk = static_cast<std::int64_t>(xkv.size());
  return {floats("x_q", {1, nq, 1}, xq),        floats("x_kv", {1, nk, 1}, xkv), floats("w_q", {1, 1, 1}, {2}),
          floats("w_k", {1, 1, 1}, {3}),        floats("w_v", {1, 1, 1}, {5}),   floats("w_o", {1, 1}, {7}),
          floats("dout", {1, nq, 1}, dout)};
}

const std::map<std::string, std::string> kAll = {{"attn.outputs", "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o"},
                                                  {"attn.scale", "1"}};

// One key: P = 1 whatever the scores, so dS = 0: dq = dk = 0 and dv = dO = 7 dout.
TEST(MhaBackward, OneKeyWorkedByHand) {
  const EvalResult r = run(scalars({1}, {2}, {1}), kAll);
  EXPECT_EQ(values(r, "out"), std::vector<double>{70});       // 7 v = 7 * 5 * 2
  EXPECT_EQ(values(r, "dx_q"), std::vector<double>{0});       // dq W_q
  EXPECT_EQ(values(r, "dw_q"), std::vector<double>{0});       // x_q dq
  EXPECT_EQ(values(r, "dw_k"), std::vector<double>{0});       // x_kv dk
  EXPECT_EQ(values(r, "dx_kv"), std::vector<double>{35});     // dk W_k + dv W_v = 0 + 7 * 5
  EXPECT_EQ(values(r, "dw_v"), std::vector<double>{14});      // x_kv dv = 2 * 7
  EXPECT_EQ(values(r, "dw_o"), std::vector<double>{10});      // O dout = v = 10
  // P (|dO v| + |dO O|) |k| |w_q| = (70 + 70) * 6 * 2: the terms dS is made of, though they cancel
  EXPECT_EQ(values(r, "dx_q.bound"), std::vector<double>{1680});
  EXPECT_EQ(r.stats.undecided, 0u);
}

// Two keys with q = 1 (w_q = 1, unlike scalars()), k = v = (0, 1), dout = 1: with s = sigma(1),
// P = (1 - s, s), O = s, dS = (-s(1 - s), s(1 - s)), dq = s(1 - s), dk = dS, dv = P.
TEST(MhaBackward, TwoKeysWorkedByHand) {
  const EvalResult r = run({floats("x_q", {1, 1, 1}, {1}), floats("x_kv", {1, 2, 1}, {0, 1}),
                            floats("w_q", {1, 1, 1}, {1}), floats("w_k", {1, 1, 1}, {1}),
                            floats("w_v", {1, 1, 1}, {1}), floats("w_o", {1, 1}, {1}), floats("dout", {1, 1, 1}, {1})},
                           kAll);
  mpfr_t s, t;
  mpfr_inits2(300, s, t, static_cast<mpfr_ptr>(nullptr));
  auto sigma = [&](mpfr_ptr x) {  // x = 1 / (1 + e^-1)
    mpfr_set_si(x, -1, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
  };
  sigma(s);
  auto f64 = [](mpfr_srcptr x) { return round_to_format(x, DType::F64); };
  mpfr_ui_sub(t, 1, s, MPFR_RNDN);
  mpfr_mul(t, t, s, MPFR_RNDN);  // s (1 - s)
  const double ds = f64(t);
  mpfr_ui_sub(t, 1, s, MPFR_RNDN);
  mpfr_sqr(t, t, MPFR_RNDN);  // (1 - s)^2
  const double kv0 = f64(t);
  mpfr_ui_sub(t, 2, s, MPFR_RNDN);
  mpfr_mul(t, t, s, MPFR_RNDN);  // s (2 - s)
  const double kv1 = f64(t);
  const double sd = f64(s);
  mpfr_clears(s, t, static_cast<mpfr_ptr>(nullptr));
  EXPECT_EQ(values(r, "dx_q.ref"), std::vector<double>{ds});
  EXPECT_EQ(values(r, "dw_q.ref"), std::vector<double>{ds});
  EXPECT_EQ(values(r, "dw_k.ref"), std::vector<double>{ds});            // x_kv . dk = dk_1
  EXPECT_EQ(values(r, "dx_kv.ref"), (std::vector<double>{kv0, kv1}));   // dk_j + dv_j
  EXPECT_EQ(values(r, "dw_v.ref"), std::vector<double>{sd});            // x_kv . dv = P_1
  EXPECT_EQ(values(r, "dw_o.ref"), std::vector<double>{sd});            // O dout
  EXPECT_EQ(values(r, "dx_q"), std::vector<double>{ds});  // F64 inputs: F64 outputs
}

// Causal rows: row 0 sees one key (dS = 0, dx_q exactly 0 there); key 1 is seen by row 1 only.
TEST(MhaBackward, CausalFirstRowIsExactlyZero) {
  std::map<std::string, std::string> md = kAll;
  md["attn.causal"] = "top_left";
  const EvalResult r = run(scalars({0.5, -1.5}, {1, 2}, {1, -2}), md);
  EXPECT_EQ(values(r, "dx_q")[0], 0.0);
  EXPECT_NE(values(r, "dx_q")[1], 0.0);
  EXPECT_EQ(r.stats.undecided, 0u);
}

// Self-attention: dx_q is the whole gradient of x, dx_kv is refused; the bytes do not depend
// on the threads.
TEST(MhaBackward, SelfAttentionAndThreads) {
  std::map<std::string, std::string> md = {{"attn.outputs", "out,dx_q,dw_q,dw_k,dw_v,dw_o"}, {"attn.causal", "bottom_right"}};
  auto tensors = [] {
    std::vector<RawTensor> t;
    std::vector<double> x, w, wo, d;
    for (int i = 0; i < 3 * 4; ++i) x.push_back(std::sin(1.0 + i));
    for (int i = 0; i < 2 * 4 * 2; ++i) w.push_back(std::cos(0.5 * i));
    for (int i = 0; i < 4 * 3; ++i) wo.push_back(std::sin(2.0 * i));
    for (int i = 0; i < 3 * 3; ++i) d.push_back(std::cos(1.0 + 3 * i));
    return std::vector<RawTensor>{floats("x_q", {1, 3, 4}, x), floats("x_kv", {1, 3, 4}, x), floats("w_q", {2, 4, 2}, w),
                                  floats("w_k", {2, 4, 2}, w), floats("w_v", {2, 4, 2}, w), floats("w_o", {4, 3}, wo),
                                  floats("dout", {1, 3, 3}, d)};
  };
  const EvalResult one = run(tensors(), md, 1), two = run(tensors(), md, 2);
  ASSERT_EQ(one.golden.size(), two.golden.size());
  for (std::size_t k = 0; k < one.golden.size(); ++k) EXPECT_EQ(one.golden[k].data, two.golden[k].data) << one.golden[k].name;
  md["attn.outputs"] = "out,dx_kv";
  try {
    run(tensors(), md);
    FAIL() << "dx_kv of self-attention accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("dx_kv is asked but the case is self-attention"), std::string::npos) << e.what();
  }
}

void expect_refused(std::vector<RawTensor> t, std::map<std::string, std::string> md, const std::string& what) {
  try {
    run(std::move(t), std::move(md));
    FAIL() << "accepted; expected: " << what;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(MhaBackward, Refusals) {
  expect_refused(scalars({1}, {2}, {1}), {{"attn.outputs", "out,dq"}}, "asks for dq, a gradient of kind sdpa");
  auto no_dout = scalars({1}, {2}, {1});
  no_dout.pop_back();
  expect_refused(std::move(no_dout), {{"attn.outputs", "dw_o"}}, "required when attn.outputs asks for a gradient: dw_o");
  auto wide = scalars({1}, {2}, {1});
  wide.back() = floats("dout", {1, 1, 2}, {1, 2});
  expect_refused(std::move(wide), {{"attn.outputs", "dx_q"}}, "the shape of out [B,Nq,Dout]");
}

}  // namespace
}  // namespace attnoracle::testing
