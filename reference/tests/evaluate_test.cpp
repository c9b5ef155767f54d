// Certified evaluation on examples worked by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
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

RawTensor bools(const std::string& name, std::vector<std::int64_t> shape,
                const std::vector<int>& v) {
  RawTensor r{name, DType::BOOL, std::move(shape), {}};
  for (int x : v) r.data.push_back(x ? 1 : 0);
  return r;
}

struct Built {
  Case c;
  EvalResult r;
};

Built run(std::vector<RawTensor> tensors, std::map<std::string, std::string> md, int threads = 1) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  // a string moved in: GCC 12 at -O3 reports a false -Wrestrict on assigning "1" (GCC bug 105329)
  f.metadata["attn.format"] = std::string("1");
  for (auto& t : tensors) f.put(std::move(t));
  Built b{case_from_file("test.safetensors", f), {}};
  EvalOptions opt;
  opt.threads = threads;
  b.r = evaluate(b.c, opt);
  return b;
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
double at(const EvalResult& r, const std::string& name, std::size_t i) {
  const RawTensor& t = find(r, name);
  return decode_float(t.dtype, t.data.data() + i * dtype_size(t.dtype));
}
bool valid(const EvalResult& r, std::size_t i) { return find(r, "row.valid").data.at(i) != 0; }

// The exact value of an expression, evaluated at 300 bits, rounded to F64.
template <class F>
double high_precision(F f) {
  mpfr_t x;
  mpfr_init2(x, 300);
  f(x);
  const double d = round_to_format(x, DType::F64);
  mpfr_clear(x);
  return d;
}

TEST(Evaluate, OneKeyGivesTheValueExactly) {
  auto b = run({floats("q", DType::F32, {1, 1, 1, 3}, {0.5, -2, 7}),
                floats("k", DType::F32, {1, 1, 1, 3}, {1, 1, 1}),
                floats("v", DType::F32, {1, 1, 1, 3}, {0.1f, -3e-20f, 123456.789f})},
               {{"attn.outputs", "out,weights,lse"}});
  EXPECT_EQ(at(b.r, "out", 0), static_cast<double>(0.1f));
  EXPECT_EQ(at(b.r, "out", 1), static_cast<double>(-3e-20f));
  EXPECT_EQ(at(b.r, "out", 2), static_cast<double>(123456.789f));
  EXPECT_EQ(at(b.r, "out.ref", 2), static_cast<double>(123456.789f));
  EXPECT_EQ(at(b.r, "weights", 0), 1.0);
  // lse of one key is its score: 5.5 / sqrt(3)
  EXPECT_EQ(at(b.r, "lse.ref", 0), high_precision([](mpfr_ptr x) {
              mpfr_set_ui(x, 3, MPFR_RNDN);
              mpfr_rec_sqrt(x, x, MPFR_RNDN);
              mpfr_mul_d(x, x, 5.5, MPFR_RNDN);
            }));
  EXPECT_EQ(b.r.stats.undecided, 0u);
}

TEST(Evaluate, EqualScoresGiveTheMean) {
  // q = 0: every score is 0, weights 1/3, output the mean (7/3 and 1/3), correctly rounded.
  auto b = run({floats("q", DType::F64, {1, 1, 1, 2}, {0, 0}),
                floats("k", DType::F64, {1, 1, 3, 2}, {1, 2, 3, 4, 5, 6}),
                floats("v", DType::F64, {1, 1, 3, 2}, {1, 1, 2, -1, 4, 1})},
               {{"attn.outputs", "out,weights"}});
  EXPECT_EQ(at(b.r, "out", 0), 7.0 / 3.0);
  EXPECT_EQ(at(b.r, "out", 1), 1.0 / 3.0);
  for (std::size_t j = 0; j < 3; ++j) EXPECT_EQ(at(b.r, "weights", j), 1.0 / 3.0);
  // out.ref_lo: the exact 7/3 minus its F64 rounding, rounded to F64
  EXPECT_EQ(at(b.r, "out.ref_lo", 0), high_precision([](mpfr_ptr x) {
              mpfr_set_ui(x, 7, MPFR_RNDN);
              mpfr_div_ui(x, x, 3, MPFR_RNDN);
              mpfr_sub_d(x, x, 7.0 / 3.0, MPFR_RNDN);
            }));
}

TEST(Evaluate, TwoKeysWeightIsLogistic) {
  // scores 1.5 and -0.5 (scale 1): weight of key 0 = 1 / (1 + exp(-2)).
  auto b = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                floats("k", DType::F32, {1, 1, 2, 1}, {3, -1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 0})},
               {{"attn.outputs", "out,weights"}, {"attn.scale", "1"}});
  const double w0 = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -2, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
  });
  EXPECT_EQ(at(b.r, "weights.ref", 0), w0);
  EXPECT_EQ(at(b.r, "out.ref", 0), w0);  // v = (1, 0)
  EXPECT_EQ(at(b.r, "weights", 0), static_cast<double>(static_cast<float>(w0)));
}

// FP8 worked by hand: q = (1.5), k = (2, -2) (E4M3), descales q 0.5, k 4: real q 0.75, k (8, -8),
// scores 6 and -6 (scale 1); v = (448, -0.001953125 = -2^-9, the smallest subnormal) times v
// descale 1. Weight of key 0: 1 / (1 + e^-12).
TEST(Evaluate, Fp8WithDescalesByHand) {
  const double w0 = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -12, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
  });
  const double out = high_precision([&](mpfr_ptr x) {  // 448 w0 - 2^-9 (1 - w0)
    mpfr_set_si(x, -12, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_t z;
    mpfr_init2(z, 300);
    mpfr_add_ui(z, x, 1, MPFR_RNDN);                         // Z = 1 + e^-12
    mpfr_mul_d(x, x, -0x1p-9, MPFR_RNDN);                    // -2^-9 e^-12
    mpfr_add_ui(x, x, 448, MPFR_RNDN);                       // 448 - 2^-9 e^-12
    mpfr_div(x, x, z, MPFR_RNDN);
    mpfr_clear(z);
  });
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {  // 448 = 1.75 * 2^8 and 2^-9 fit both
    auto b = run({floats("q", t, {1, 1, 1, 1}, {1.5}), floats("k", t, {1, 1, 2, 1}, {2, -2}),
                  floats("v", t, {1, 1, 2, 1}, {448, -0x1p-9}),
                  floats("q_descale", DType::F32, {1, 1}, {0.5}),
                  floats("k_descale", DType::F32, {1, 1}, {4})},
                 {{"attn.outputs", "out,weights"}, {"attn.scale", "1"}, {"attn.output_dtype", "F32"}});
    EXPECT_EQ(at(b.r, "weights.ref", 0), w0);
    EXPECT_EQ(at(b.r, "out.ref", 0), out);
    EXPECT_EQ(at(b.r, "out", 0), static_cast<double>(static_cast<float>(out)));
  }
}

// A descale of 2^k is exact: the output equals that of the prescaled inputs stored in F32, for
// every golden tensor, bit for bit (both FP8 formats, distinct descales per batch and kv head).
TEST(Evaluate, PowerOfTwoDescalesEqualPrescaledInputs) {
  const std::vector<double> q = {1.5, -0.25, 3, 0.5, -1, 0.125, 2, 1.75, -0.5, 1, 0.375, -2,
                                 0.75, 1.25, -3, 0.0625};  // [2, 2, 2, 2]
  const std::vector<double> k = {1, -0.5, 0.25, 2, -1.5, 0.75, 1, 1,  // [2, 1, 4, 2]
                                 -0.25, 0.5, 3, -1, 0.125, -2, 1.5, -0.75};
  const std::vector<double> v = {448, -0x1p-9, 1, -2, 0.5, 0.25, -4, 8,
                                 0x1p-6, 3, -1.5, 0.75, 2, -0.125, 1, -1};
  const std::vector<double> qd = {0.5, 8}, kd = {0x1p-3, 2}, vd = {4, 0x1p-6};  // [B=2, Hkv=1]
  auto scaled = [](const std::vector<double>& x, const std::vector<double>& d) {
    std::vector<double> r = x;
    for (std::size_t e = 0; e < r.size(); ++e) r[e] *= d[e / (r.size() / 2)];
    return r;
  };
  const std::map<std::string, std::string> md = {{"attn.outputs", "out,weights,lse"},
                                                 {"attn.output_dtype", "BF16"},
                                                 {"attn.causal", "bottom_right"}};
  // q [2, 2, 2, 2] (Hq 2 reading one kv head), k and v [2, 1, 4, 2]
  auto plain = run({floats("q", DType::F32, {2, 2, 2, 2}, scaled(q, qd)),
                    floats("k", DType::F32, {2, 1, 4, 2}, scaled(k, kd)),
                    floats("v", DType::F32, {2, 1, 4, 2}, scaled(v, vd))},
                   md);
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
    auto b = run({floats("q", t, {2, 2, 2, 2}, q), floats("k", t, {2, 1, 4, 2}, k),
                  floats("v", t, {2, 1, 4, 2}, v), floats("q_descale", DType::F32, {2, 1}, qd),
                  floats("k_descale", DType::F32, {2, 1}, kd),
                  floats("v_descale", DType::F32, {2, 1}, vd)},
                 md);
    ASSERT_EQ(b.r.golden.size(), plain.r.golden.size());
    for (std::size_t g = 0; g < b.r.golden.size(); ++g) {
      EXPECT_EQ(b.r.golden[g].name, plain.r.golden[g].name);
      EXPECT_EQ(b.r.golden[g].data, plain.r.golden[g].data) << b.r.golden[g].name;
    }
  }
}

TEST(Evaluate, FullyMaskedRowUnderEachPolicy) {
  std::vector<RawTensor> t = {floats("q", DType::F32, {1, 1, 2, 1}, {1, 2}),
                              floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                              floats("v", DType::F32, {1, 1, 2, 1}, {3, 5}),
                              bools("mask", {2, 2}, {1, 1, 0, 0})};
  try {
    run(t, {});
    FAIL() << "no refusal";
  } catch (const FullyMaskedRow& e) {
    EXPECT_EQ(e.b, 0);
    EXPECT_EQ(e.h, 0);
    EXPECT_EQ(e.i, 1);
  }
  auto b = run(t, {{"attn.masked_rows", "zero"}, {"attn.outputs", "out,weights,lse"}});
  EXPECT_TRUE(valid(b.r, 0));
  EXPECT_FALSE(valid(b.r, 1));
  EXPECT_EQ(at(b.r, "out", 1), 0.0);
  EXPECT_FALSE(std::signbit(at(b.r, "out", 1)));
  EXPECT_EQ(at(b.r, "weights", 2), 0.0);
  EXPECT_EQ(at(b.r, "weights", 3), 0.0);
  EXPECT_EQ(at(b.r, "lse", 1), -INFINITY);
  EXPECT_EQ(at(b.r, "out", 0), 4.0);  // equal scores: the mean of 3 and 5
}

// Which (i, j) receive weight, from the weights tensor of a one-head case.
std::vector<std::vector<int>> pattern(std::int64_t Nq, std::int64_t Nk,
                                      std::map<std::string, std::string> md) {
  std::vector<double> q(static_cast<std::size_t>(Nq), 1.0), k(static_cast<std::size_t>(Nk), 1.0);
  md["attn.outputs"] = "out,weights";
  md["attn.masked_rows"] = "zero";
  auto b = run({floats("q", DType::F32, {1, 1, Nq, 1}, q), floats("k", DType::F32, {1, 1, Nk, 1}, k),
                floats("v", DType::F32, {1, 1, Nk, 1}, k)},
               md);
  std::vector<std::vector<int>> p(static_cast<std::size_t>(Nq));
  for (std::int64_t i = 0; i < Nq; ++i)
    for (std::int64_t j = 0; j < Nk; ++j)
      p[static_cast<std::size_t>(i)].push_back(at(b.r, "weights", static_cast<std::size_t>(i * Nk + j)) > 0);
  return p;
}

TEST(Evaluate, CausalAlignments) {
  using P = std::vector<std::vector<int>>;
  // Nq > Nk
  EXPECT_EQ(pattern(3, 2, {{"attn.causal", "top_left"}}), (P{{1, 0}, {1, 1}, {1, 1}}));
  EXPECT_EQ(pattern(3, 2, {{"attn.causal", "bottom_right"}}), (P{{0, 0}, {1, 0}, {1, 1}}));
  // Nq < Nk
  EXPECT_EQ(pattern(2, 4, {{"attn.causal", "top_left"}}), (P{{1, 0, 0, 0}, {1, 1, 0, 0}}));
  EXPECT_EQ(pattern(2, 4, {{"attn.causal", "bottom_right"}}), (P{{1, 1, 1, 0}, {1, 1, 1, 1}}));
}

TEST(Evaluate, Windows) {
  using P = std::vector<std::vector<int>>;
  EXPECT_EQ(pattern(4, 4, {{"attn.window", "1,1"}}),
            (P{{1, 1, 0, 0}, {1, 1, 1, 0}, {0, 1, 1, 1}, {0, 0, 1, 1}}));
  EXPECT_EQ(pattern(2, 4, {{"attn.window", "1,0"}, {"attn.causal", "bottom_right"}}),
            (P{{0, 1, 1, 0}, {0, 0, 1, 1}}));
}

TEST(Evaluate, GqaHeadMapping) {
  // 4 query heads over 2 kv heads: heads 0 and 1 read kv head 0, heads 2 and 3 kv head 1.
  auto b = run({floats("q", DType::F32, {1, 4, 1, 1}, {1, 1, 1, 1}),
                floats("k", DType::F32, {1, 2, 1, 1}, {1, 1}),
                floats("v", DType::F32, {1, 2, 1, 1}, {10, 20})},
               {});
  EXPECT_EQ(at(b.r, "out", 0), 10.0);
  EXPECT_EQ(at(b.r, "out", 1), 10.0);
  EXPECT_EQ(at(b.r, "out", 2), 20.0);
  EXPECT_EQ(at(b.r, "out", 3), 20.0);
}

TEST(Evaluate, Softcap) {
  // scores t = 40 and 0 with cap 30: softcapped difference 30 tanh(4/3).
  auto b = run({floats("q", DType::F32, {1, 1, 1, 1}, {4}), floats("k", DType::F32, {1, 1, 2, 1}, {10, 0}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 0})},
               {{"attn.scale", "1"}, {"attn.softcap", "30"}});
  EXPECT_EQ(at(b.r, "out.ref", 0), high_precision([](mpfr_ptr x) {
              mpfr_set_ui(x, 4, MPFR_RNDN);
              mpfr_div_ui(x, x, 3, MPFR_RNDN);
              mpfr_tanh(x, x, MPFR_RNDN);
              mpfr_mul_si(x, x, -30, MPFR_RNDN);
              mpfr_exp(x, x, MPFR_RNDN);
              mpfr_add_ui(x, x, 1, MPFR_RNDN);
              mpfr_ui_div(x, 1, x, MPFR_RNDN);
            }));
}

TEST(Evaluate, MinusInfinityBiasMasksAKey) {
  auto b = run({floats("q", DType::F32, {1, 1, 1, 1}, {0}), floats("k", DType::F32, {1, 1, 3, 1}, {0, 0, 0}),
                floats("v", DType::F32, {1, 1, 3, 1}, {2, 1000, 4}),
                floats("bias", DType::F32, {1, 3}, {0, -INFINITY, 0})},
               {{"attn.outputs", "out,weights"}});
  EXPECT_EQ(at(b.r, "out", 0), 3.0);
  EXPECT_EQ(at(b.r, "weights", 1), 0.0);
  EXPECT_EQ(at(b.r, "weights", 0), 0.5);
}

TEST(Evaluate, F16AndBF16SubnormalOutputs) {
  // One key: the output is v exactly, rounded once into the output format.
  const std::vector<double> v = {0x3p-26, 0x1p-25, 0x3p-25, 0x1p-20};
  auto h = run({floats("q", DType::F32, {1, 1, 1, 1}, {1}), floats("k", DType::F32, {1, 1, 1, 1}, {1}),
                floats("v", DType::F32, {1, 1, 1, 4}, v)},
               {{"attn.output_dtype", "F16"}});
  EXPECT_EQ(at(h.r, "out", 0), 0x1p-24);  // 3/4 of the smallest subnormal rounds up
  EXPECT_EQ(at(h.r, "out", 1), 0.0);      // half of it: a tie, to even (0), proven
  EXPECT_EQ(at(h.r, "out", 2), 0x2p-24);  // 1.5 of it: a tie, to even (2)
  EXPECT_EQ(at(h.r, "out", 3), 0x1p-20);
  EXPECT_EQ(h.r.stats.undecided, 0u);
  auto g = run({floats("q", DType::F32, {1, 1, 1, 1}, {1}), floats("k", DType::F32, {1, 1, 1, 1}, {1}),
                floats("v", DType::F32, {1, 1, 1, 3}, {0x3p-135, 0x1p-140, 0x5p-133})},
               {{"attn.output_dtype", "BF16"}});
  EXPECT_EQ(at(g.r, "out", 0), 0x1p-133);
  EXPECT_EQ(at(g.r, "out", 1), 0.0);  // below half the smallest subnormal
  EXPECT_EQ(at(g.r, "out", 2), 0x5p-133);
}

TEST(Evaluate, HiddenMidpointIsUndecidedNotGuessed) {
  // Scores 0, 0, s with v = 1, 1 + 2^-10, 1 + 2^-11: the output is exactly 1 + 2^-11, the
  // midpoint of two F16 values, but no enclosure can prove which way the tie goes.
  auto b = run({floats("q", DType::F32, {1, 1, 1, 1}, {1}), floats("k", DType::F32, {1, 1, 3, 1}, {0, 0, 1}),
                floats("v", DType::F32, {1, 1, 3, 1}, {1, 0x1.004p0, 0x1.002p0})},
               {{"attn.output_dtype", "F16"}});
  EXPECT_EQ(b.r.stats.undecided, 1u);
  ASSERT_TRUE(has(b.r, "out.undecided"));
  const RawTensor& idx = find(b.r, "out.undecided");
  std::int64_t i0;
  std::memcpy(&i0, idx.data.data(), 8);
  EXPECT_EQ(i0, 0);
  const double a = at(b.r, "out", 0), alt = at(b.r, "out.alt", 0);
  EXPECT_EQ(std::min(a, alt), 1.0);
  EXPECT_EQ(std::max(a, alt), 0x1.004p0);
  EXPECT_EQ(at(b.r, "out.ref", 0), 0x1.002p0);  // in F64 it is proven
  EXPECT_FALSE(has(b.r, "out.ref.undecided"));
}

TEST(Evaluate, MultiHeadProjections) {
  // H = 2, D = 1, one token: V_r = x * w_v[r]; out = concat(V_0, V_1) W_o.
  auto b = run({floats("x_q", DType::F32, {1, 1, 1}, {1}), floats("x_kv", DType::F32, {1, 1, 1}, {2}),
                floats("w_q", DType::F32, {2, 1, 1}, {1, 1}), floats("w_k", DType::F32, {2, 1, 1}, {1, 1}),
                floats("w_v", DType::F32, {2, 1, 1}, {3, 5}),
                floats("w_o", DType::F32, {2, 2}, {1, 10, 100, 1000})},
               {{"attn.kind", "mha"}});
  // out[e] = 6 * w_o[0][e] + 10 * w_o[1][e]
  EXPECT_EQ(at(b.r, "out", 0), 6.0 + 1000.0);
  EXPECT_EQ(at(b.r, "out", 1), 60.0 + 10000.0);
  EXPECT_EQ(at(b.r, "out.bound", 1), 60.0 + 10000.0);
}

TEST(Evaluate, DecimalScaleIsExact) {
  // scale 0.1 is the exact decimal: weight of key 0 = 1 / (1 + exp(-0.1 * 3)).
  auto b = run({floats("q", DType::F64, {1, 1, 1, 1}, {1}), floats("k", DType::F64, {1, 1, 2, 1}, {3, 0}),
                floats("v", DType::F64, {1, 1, 2, 1}, {1, 0})},
               {{"attn.scale", "0.1"}});
  EXPECT_EQ(at(b.r, "out", 0), high_precision([](mpfr_ptr x) {
              mpfr_set_str(x, "-0.3", 10, MPFR_RNDN);
              mpfr_exp(x, x, MPFR_RNDN);
              mpfr_add_ui(x, x, 1, MPFR_RNDN);
              mpfr_ui_div(x, 1, x, MPFR_RNDN);
            }));
}

TEST(Evaluate, PaddingRowIsNotRefused) {
  auto b = run({floats("q", DType::F32, {1, 1, 2, 1}, {1, 2}), floats("k", DType::F32, {1, 1, 2, 1}, {1, 1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {3, 5}), bools("mask", {2, 2}, {1, 1, 0, 0}),
                bools("query_mask", {1, 2}, {1, 0})},
               {});
  EXPECT_TRUE(valid(b.r, 0));
  EXPECT_FALSE(valid(b.r, 1));
}

TEST(Evaluate, KeyPaddingMaskBroadcasts) {
  // mask [B,1,1,Nk] = [[1,1,0],[1,0,0]], equal scores: batch 0 averages v of keys 0 and 1,
  // batch 1 takes key 0, for both heads and both queries.
  auto b = run({floats("q", DType::F32, {2, 2, 2, 1}, std::vector<double>(8, 0)),
                floats("k", DType::F32, {2, 1, 3, 1}, std::vector<double>(6, 0)),
                floats("v", DType::F32, {2, 1, 3, 1}, {2, 6, 100, 8, 100, 100}),
                bools("mask", {2, 1, 1, 3}, {1, 1, 0, 1, 0, 0})},
               {});
  for (std::size_t r = 0; r < 4; ++r) {
    EXPECT_EQ(at(b.r, "out", r), 4.0) << r;
    EXPECT_EQ(at(b.r, "out", 4 + r), 8.0) << r;
  }
}

TEST(Evaluate, ScalarBiasChangesNothingButLse) {
  // A bias of shape [] adds one constant to every score: weights unchanged, lse shifted by it.
  auto plain = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                    floats("k", DType::F32, {1, 1, 2, 1}, {3, -1}),
                    floats("v", DType::F32, {1, 1, 2, 1}, {1, 0})},
                   {{"attn.outputs", "out,lse"}, {"attn.scale", "1"}});
  auto biased = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                     floats("k", DType::F32, {1, 1, 2, 1}, {3, -1}),
                     floats("v", DType::F32, {1, 1, 2, 1}, {1, 0}),
                     floats("bias", DType::F32, {}, {2})},
                    {{"attn.outputs", "out,lse"}, {"attn.scale", "1"}});
  EXPECT_EQ(at(biased.r, "out.ref", 0), at(plain.r, "out.ref", 0));
  // lse = log(e^1.5 + e^-0.5) + 2, computed at 300 bits.
  const double lse = high_precision([](mpfr_ptr x) {
    mpfr_t t;
    mpfr_init2(t, 300);
    mpfr_set_d(x, 1.5, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_set_d(t, -0.5, MPFR_RNDN);
    mpfr_exp(t, t, MPFR_RNDN);
    mpfr_add(x, x, t, MPFR_RNDN);
    mpfr_log(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 2, MPFR_RNDN);
    mpfr_clear(t);
  });
  EXPECT_EQ(at(biased.r, "lse.ref", 0), lse);
}

TEST(Evaluate, NaNInAMaskedValueRowChangesNothing) {
  // Scores 1.5 and -0.5 on keys 0 and 1; key 2 is masked out for every query, and its k and v
  // rows hold NaN and infinity. The result is that of the two keys alone, byte for byte.
  auto clean = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                    floats("k", DType::F32, {1, 1, 3, 1}, {3, -1, 7}),
                    floats("v", DType::F32, {1, 1, 3, 1}, {1, 0, 5}),
                    bools("mask", {3}, {1, 1, 0})},
                   {{"attn.outputs", "out,weights,lse"}, {"attn.scale", "1"}});
  auto poisoned = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                       floats("k", DType::F32, {1, 1, 3, 1}, {3, -1, INFINITY}),
                       floats("v", DType::F32, {1, 1, 3, 1}, {1, 0, NAN}),
                       bools("mask", {3}, {1, 1, 0})},
                      {{"attn.outputs", "out,weights,lse"}, {"attn.scale", "1"}});
  const double w0 = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -2, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
  });
  EXPECT_EQ(at(poisoned.r, "out.ref", 0), w0);  // v = (1, 0, NaN): w0 * 1
  EXPECT_EQ(at(poisoned.r, "weights", 2), 0.0);
  ASSERT_EQ(poisoned.r.golden.size(), clean.r.golden.size());
  for (std::size_t t = 0; t < clean.r.golden.size(); ++t) {
    EXPECT_EQ(poisoned.r.golden[t].name, clean.r.golden[t].name);
    EXPECT_EQ(poisoned.r.golden[t].data, clean.r.golden[t].data) << clean.r.golden[t].name;
  }
}

TEST(Evaluate, NaNInAPaddingQueryGivesZerosMarkedInvalid) {
  // Query 1 is padding and its q row is NaN: its row is 0 with row.valid false; query 0 is as
  // without it.
  auto b = run({floats("q", DType::F32, {1, 1, 2, 1}, {0.5, NAN}),
                floats("k", DType::F32, {1, 1, 2, 1}, {3, -1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 0}), bools("query_mask", {1, 2}, {1, 0})},
               {{"attn.outputs", "out,lse"}, {"attn.scale", "1"}});
  EXPECT_TRUE(valid(b.r, 0));
  EXPECT_FALSE(valid(b.r, 1));
  EXPECT_EQ(at(b.r, "out", 1), 0.0);
  EXPECT_EQ(at(b.r, "lse.ref", 1), -INFINITY);
  EXPECT_GT(at(b.r, "out.ref", 0), 0.88);  // 1 / (1 + e^-2) = 0.8808
}

RawTensor ints(const std::string& name, DType t, const std::vector<std::int64_t>& v) {
  RawTensor r{name, t, {static_cast<std::int64_t>(v.size())}, {}};
  for (std::int64_t x : v)
    for (std::size_t byte = 0; byte < dtype_size(t); ++byte)
      r.data.push_back(static_cast<unsigned char>(static_cast<std::uint64_t>(x) >> (8 * byte)));
  return r;
}

TEST(Evaluate, SeqlensAlignCausalPerBatch) {
  // Batch 0 holds Lq = 2 queries and Lk = 5 keys padded to Nq = 4, Nk = 8; batch 1 is full.
  // Every score is 0 (q = 0) and v_j = j, so each output is the mean of its allowed keys.
  // bottom_right aligns batch 0 to Lk - Lq = 3: query 0 sees keys 0..3 (mean 1.5), query 1
  // keys 0..4 (mean 2); Nk - Nq = 4 would give 2 and 2.5. Keys 5..7 of batch 0 hold NaN and
  // infinity: they are past seqlens_k, so unused. Batch 1 aligns to 4: query i sees 0..i+4.
  std::vector<double> k(16, 1.0), v(16);
  for (int j = 0; j < 8; ++j) v[static_cast<std::size_t>(j)] = v[static_cast<std::size_t>(8 + j)] = j;
  k[5] = NAN, k[6] = INFINITY, v[7] = -INFINITY, v[5] = NAN;
  auto b = run({floats("q", DType::F32, {2, 1, 4, 1}, std::vector<double>(8, 0.0)),
                floats("k", DType::F32, {2, 1, 8, 1}, k), floats("v", DType::F32, {2, 1, 8, 1}, v),
                ints("seqlens_q", DType::I32, {2, 4}), ints("seqlens_k", DType::I64, {5, 8})},
               {{"attn.causal", "bottom_right"}, {"attn.outputs", "out,weights"}});
  EXPECT_EQ(at(b.r, "out", 0), 1.5);
  EXPECT_EQ(at(b.r, "out", 1), 2.0);
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(at(b.r, "weights", static_cast<std::size_t>(j)), j <= 3 ? 0.25 : 0.0) << j;
    EXPECT_EQ(at(b.r, "weights", static_cast<std::size_t>(8 + j)), j <= 4 ? 0.2f : 0.0f) << j;
  }
  for (int i = 0; i < 4; ++i) EXPECT_EQ(at(b.r, "out", static_cast<std::size_t>(4 + i)), (i + 4) / 2.0) << i;
  // The same without seqlens, the padded keys given finite values, aligns to Nk - Nq = 4.
  k[5] = k[6] = 1, v[5] = 5, v[7] = 7;
  auto plain = run({floats("q", DType::F32, {2, 1, 4, 1}, std::vector<double>(8, 0.0)),
                    floats("k", DType::F32, {2, 1, 8, 1}, k), floats("v", DType::F32, {2, 1, 8, 1}, v)},
                   {{"attn.causal", "bottom_right"}});
  EXPECT_EQ(at(plain.r, "out", 0), 2.0);
  EXPECT_EQ(at(plain.r, "out", 1), 2.5);
}

TEST(Evaluate, NaNPastSeqlensKChangesNothing) {
  // Key 2 is past seqlens_k = 2: its k and v rows hold NaN and the result is that of the two
  // keys alone, byte for byte, as with a mask.
  auto clean = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                    floats("k", DType::F32, {1, 1, 2, 1}, {3, -1}),
                    floats("v", DType::F32, {1, 1, 2, 1}, {1, 0})},
                   {{"attn.outputs", "out,lse"}, {"attn.scale", "1"}});
  auto poisoned = run({floats("q", DType::F32, {1, 1, 1, 1}, {0.5}),
                       floats("k", DType::F32, {1, 1, 3, 1}, {3, -1, NAN}),
                       floats("v", DType::F32, {1, 1, 3, 1}, {1, 0, NAN}), ints("seqlens_k", DType::I32, {2})},
                      {{"attn.outputs", "out,lse"}, {"attn.scale", "1"}});
  for (const char* t : {"out", "out.ref", "out.bound", "lse", "lse.ref", "row.valid"})
    EXPECT_EQ(find(poisoned.r, t).data, find(clean.r, t).data) << t;
}

TEST(Evaluate, ThreadCountDoesNotChangeBytes) {
  std::vector<double> q, k, v;
  for (int i = 0; i < 7 * 5; ++i) q.push_back(std::ldexp(std::sin(i * 1.7) , 2));
  for (int i = 0; i < 9 * 5; ++i) k.push_back(std::ldexp(std::cos(i * 0.3), 1));
  for (int i = 0; i < 9 * 3; ++i) v.push_back(std::sin(i * 0.9));
  std::vector<RawTensor> t = {floats("q", DType::F64, {1, 1, 7, 5}, q),
                              floats("k", DType::F64, {1, 1, 9, 5}, k),
                              floats("v", DType::F64, {1, 1, 9, 3}, v)};
  auto one = run(t, {{"attn.outputs", "out,weights,lse"}}, 1);
  auto two = run(t, {{"attn.outputs", "out,weights,lse"}}, 2);
  EXPECT_EQ(serialize_safetensors(golden_file(one.c, one.r)),
            serialize_safetensors(golden_file(two.c, two.r)));
}

// One key and a sink: the weight is 1/(1 + exp(sink - s)), here s = 2 (scale 1), sink = 1, so
// 1/(1 + e^-1); lse = log(e^2 + e^1) = 2 + log(1 + e^-1); out = weight * v.
TEST(Evaluate, OneKeyWithASink) {
  auto b = run({floats("q", DType::F64, {1, 1, 1, 2}, {1, 0}),
                floats("k", DType::F64, {1, 1, 1, 2}, {2, 5}),
                floats("v", DType::F64, {1, 1, 1, 2}, {3, -0.5}),
                floats("sinks", DType::F32, {1}, {1})},
               {{"attn.scale", "1"}, {"attn.outputs", "out,weights,lse"}});
  const double w = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -1, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 1, x, MPFR_RNDN);
  });
  EXPECT_EQ(at(b.r, "weights", 0), w);
  EXPECT_NEAR(w, 0.7310585786300049, 1e-16);
  const double o0 = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -1, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 1, MPFR_RNDN);
    mpfr_ui_div(x, 3, x, MPFR_RNDN);
  });
  EXPECT_EQ(at(b.r, "out", 0), o0);
  EXPECT_EQ(at(b.r, "out", 1), -w / 2);  // halving is exact
  const double lse = high_precision([](mpfr_ptr x) {
    mpfr_set_si(x, -1, MPFR_RNDN);
    mpfr_exp(x, x, MPFR_RNDN);
    mpfr_log1p(x, x, MPFR_RNDN);
    mpfr_add_ui(x, x, 2, MPFR_RNDN);
  });
  EXPECT_EQ(at(b.r, "lse", 0), lse);
  EXPECT_NEAR(lse, 2.3132616875182228, 1e-15);
  EXPECT_TRUE(valid(b.r, 0));
}

// A sink equal to the one score: the weight is exactly 1/2 and the output exactly half the value.
TEST(Evaluate, SinkEqualToTheScoreHalvesExactly) {
  auto b = run({floats("q", DType::F16, {1, 1, 1, 1}, {1}),
                floats("k", DType::F16, {1, 1, 1, 1}, {1.5}),
                floats("v", DType::F16, {1, 1, 1, 1}, {1.5}),
                floats("sinks", DType::F16, {1}, {1.5})},
               {{"attn.scale", "1"}, {"attn.outputs", "out,weights"}});
  EXPECT_EQ(at(b.r, "weights", 0), 0.5);
  EXPECT_EQ(at(b.r, "out", 0), 0.75);
  EXPECT_EQ(b.r.stats.undecided, 0u);
}

// A row with no allowed key but a sink is not fully masked: under policy error it is evaluated,
// with weights and output exactly 0, lse = the sink, row.valid true; the other row is ordinary.
TEST(Evaluate, RowWithOnlyItsSink) {
  auto b = run({floats("q", DType::F32, {1, 2, 2, 1}, {1, 2, 3, 4}),
                floats("k", DType::F32, {1, 1, 2, 1}, {1, -1}),
                floats("v", DType::F32, {1, 1, 2, 1}, {5, 7}),
                bools("mask", {1, 1, 2, 2}, {0, 0, 1, 1}),
                floats("sinks", DType::F32, {2}, {-0.75f, 3})},
               {{"attn.outputs", "out,weights,lse"}});
  for (std::size_t row : {0u, 2u}) {  // (h=0, i=0) and (h=1, i=0)
    EXPECT_TRUE(valid(b.r, row));
    const double out = at(b.r, "out", row);
    EXPECT_EQ(out, 0.0);
    EXPECT_FALSE(std::signbit(out));
    EXPECT_EQ(at(b.r, "weights", 2 * row), 0.0);
    EXPECT_EQ(at(b.r, "weights", 2 * row + 1), 0.0);
  }
  EXPECT_EQ(at(b.r, "lse", 0), -0.75);
  EXPECT_EQ(at(b.r, "lse", 2), 3.0);
  EXPECT_TRUE(valid(b.r, 1));
  EXPECT_GT(at(b.r, "weights", 2) + at(b.r, "weights", 3), 0.0);
  EXPECT_LT(at(b.r, "weights", 2) + at(b.r, "weights", 3), 1.0);  // the sink takes its share
}

// scores: scale * q.k plus bias, -inf where not allowed (causal here), in the output dtype
// and in F64.
TEST(Evaluate, ScoresOutputMasksWithMinusInfinity) {
  auto b = run({floats("q", DType::F32, {1, 1, 2, 2}, {1, 2, 0.5, -1}),
                floats("k", DType::F32, {1, 1, 2, 2}, {3, 1, -2, 4}),
                floats("v", DType::F32, {1, 1, 2, 1}, {1, 2}),
                floats("bias", DType::F32, {2}, {0.25, -1})},
               {{"attn.scale", "0.5"}, {"attn.causal", "top_left"}, {"attn.outputs", "scores"},
                {"attn.output_dtype", "F16"}});
  ASSERT_TRUE(has(b.r, "scores"));
  EXPECT_EQ(find(b.r, "scores").dtype, DType::F16);
  EXPECT_EQ(find(b.r, "scores.ref").shape, (std::vector<std::int64_t>{1, 1, 2, 2}));
  // row 0: 0.5 * (3 + 2) + 0.25 = 2.75; key 1 is in the future
  EXPECT_EQ(at(b.r, "scores", 0), 2.75);
  EXPECT_EQ(at(b.r, "scores", 1), -INFINITY);
  // row 1: 0.5 * (1.5 - 1) + 0.25 = 0.5, and 0.5 * (-1 - 4) - 1 = -3.5
  EXPECT_EQ(at(b.r, "scores", 2), 0.5);
  EXPECT_EQ(at(b.r, "scores.ref", 3), -3.5);
  EXPECT_FALSE(has(b.r, "weights"));
}

// A scores element exactly halfway between two F16 numbers rounds to even: the MPFR path
// proves it from an exact enclosure.
TEST(Evaluate, ExactScoreAtAMidpointRoundsToEven) {
  // 1 + 2^-11 is halfway between 1 and the next F16 (1 + 2^-10): ties to even give 1.
  auto b = run({floats("q", DType::F32, {1, 1, 1, 1}, {1}),
                floats("k", DType::F32, {1, 1, 1, 1}, {1 + 0x1p-11}),
                floats("v", DType::F32, {1, 1, 1, 1}, {1})},
               {{"attn.scale", "1"}, {"attn.outputs", "out,scores"}, {"attn.output_dtype", "F16"}});
  EXPECT_EQ(at(b.r, "scores", 0), 1.0);
  EXPECT_EQ(at(b.r, "scores.ref", 0), 1 + 0x1p-11);
  EXPECT_EQ(b.r.stats.undecided, 0u);
}

}  // namespace
}  // namespace attnoracle::testing
