// Split-KV partial states and kind merge (CONTRACT section 8): hand-worked cases, refusals, and
// a RapidCheck property against an independent evaluation (plain formulas in 320-bit MPFR, the
// tests' own integer rounding), bit for bit.
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <mpfr.h>
#include <rapidcheck/gtest.h>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "int_round.hpp"

namespace attnoracle::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
using Shape = std::vector<std::int64_t>;

RawTensor tensor(const std::string& name, DType t, Shape shape, const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), std::vector<unsigned char>(v.size() * dtype_size(t))};
  for (std::size_t e = 0; e < v.size(); ++e) encode_float(t, v[e], r.data.data() + e * dtype_size(t));
  return r;
}

SafeTensorsFile file(std::vector<RawTensor> ts, std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  md["attn.format"] = "1";
  f.metadata = std::move(md);
  for (auto& t : ts) f.put(std::move(t));
  return f;
}

EvalResult certified(const SafeTensorsFile& f) {
  const Case c = case_from_file("case", f);
  EvalOptions opt;
  opt.threads = 2;
  return oracle::certified_evaluate(c, opt, oracle::CheckOptions{});
}

const RawTensor& golden(const EvalResult& r, const std::string& name) {
  for (const RawTensor& t : r.golden)
    if (t.name == name) return t;
  throw std::runtime_error("no golden tensor " + name);
}

std::vector<double> values(const RawTensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t e = 0; e < v.size(); ++e) v[e] = decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype));
  return v;
}

// A merge case: o_partial [S,1,H,Nq,Dv] F32, lse_partial F32, optional sinks F64.
SafeTensorsFile merge_case(Shape shape, const std::vector<double>& o, const std::vector<double>& l,
                           std::map<std::string, std::string> md = {}, const std::vector<double>& sinks = {}) {
  md["attn.kind"] = "merge";
  if (!md.count("attn.outputs")) md["attn.outputs"] = "out,lse";
  std::vector<RawTensor> ts = {tensor("o_partial", DType::F32, shape, o),
                               tensor("lse_partial", DType::F32, Shape(shape.begin(), shape.end() - 1), l)};
  if (!sinks.empty()) ts.push_back(tensor("sinks", DType::F64, {static_cast<std::int64_t>(sinks.size())}, sinks));
  return file(std::move(ts), md);
}

// Two keys of equal score (k = 0), one per split: each split is its key alone (O = v_j,
// lse 0); the whole row is their mean with lse log 2, and so is their merge.
TEST(SplitKv, TwoSplitsOfOneKeyEach) {
  const SafeTensorsFile f = file({tensor("q", DType::F32, {1, 1, 1, 1}, {1}), tensor("k", DType::F32, {1, 1, 2, 1}, {0, 0}),
                                  tensor("v", DType::F32, {1, 1, 2, 1}, {2, 4})},
                                 {{"attn.kv_split_size", "1"}, {"attn.outputs", "out,lse,out_partial,lse_partial"}});
  const EvalResult r = certified(f);
  EXPECT_EQ(values(golden(r, "out_partial")), (std::vector<double>{2, 4}));
  EXPECT_EQ(values(golden(r, "out_partial.ref")), (std::vector<double>{2, 4}));
  EXPECT_EQ(values(golden(r, "out_partial.bound")), (std::vector<double>{2, 4}));
  EXPECT_EQ(values(golden(r, "lse_partial")), (std::vector<double>{0, 0}));
  EXPECT_EQ(golden(r, "out_partial").shape, (Shape{2, 1, 1, 1, 1}));
  EXPECT_EQ(golden(r, "lse_partial").shape, (Shape{2, 1, 1, 1}));
  EXPECT_EQ(values(golden(r, "out")), (std::vector<double>{3}));
  EXPECT_EQ(values(golden(r, "lse.ref")), (std::vector<double>{0x1.62e42fefa39efp-1}));  // log 2
  // The merge of those partials: weights exp(0 - log 2) = 1/2 each.
  const EvalResult m = certified(merge_case({2, 1, 1, 1, 1}, {2, 4}, {0, 0}, {{"attn.output_dtype", "F64"}}));
  EXPECT_EQ(values(golden(m, "out")), (std::vector<double>{3}));
  EXPECT_EQ(values(golden(m, "out.bound")), (std::vector<double>{3}));
  EXPECT_EQ(values(golden(m, "lse")), (std::vector<double>{0x1.62e42fefa39efp-1}));
  EXPECT_EQ(golden(m, "out").shape, (Shape{1, 1, 1, 1}));
  EXPECT_EQ(golden(m, "lse").shape, (Shape{1, 1, 1}));
}

// A split where the row has no allowed key: O 0 exactly, lse -inf, no policy (error is the
// case's); the sink stays out of the partials.
TEST(SplitKv, EmptySplitAndNoSink) {
  const EvalResult r = certified(file({tensor("q", DType::F32, {1, 1, 1, 1}, {1}), tensor("k", DType::F32, {1, 1, 3, 1}, {0, 0, 0}),
                                       tensor("v", DType::F32, {1, 1, 3, 1}, {2, 4, 8}), RawTensor{"mask", DType::BOOL, {3}, {1, 1, 0}},
                                       tensor("sinks", DType::F64, {1}, {0})},
                                      {{"attn.kv_split_size", "2"}, {"attn.outputs", "out,out_partial,lse_partial"}}));
  EXPECT_EQ(values(golden(r, "out_partial")), (std::vector<double>{3, 0}));
  EXPECT_EQ(values(golden(r, "lse_partial.ref")), (std::vector<double>{0x1.62e42fefa39efp-1, -kInf}));
  EXPECT_EQ(values(golden(r, "out")), (std::vector<double>{2}));  // (2 + 4) / 3 with the sink's share
}

TEST(Merge, MinusInfSplitHoldingNaN) {
  const float l1 = 0.7f;
  const EvalResult m = certified(merge_case({2, 1, 1, 1, 2}, {NAN, NAN, 5, -1}, {-kInf, l1}));
  EXPECT_EQ(values(golden(m, "out")), (std::vector<double>{5, -1}));
  EXPECT_EQ(values(golden(m, "lse.ref")), (std::vector<double>{static_cast<double>(l1)}));
}

TEST(Merge, WithSink) {  // lse_s = 0, 0 and sink 0: weights 1/3 each
  const EvalResult m = certified(merge_case({2, 1, 1, 1, 1}, {1, 2}, {0, 0}, {}, {0}));
  EXPECT_EQ(values(golden(m, "out")), (std::vector<double>{1}));
  EXPECT_EQ(values(golden(m, "lse.ref")), (std::vector<double>{0x1.193ea7aad030bp+0}));  // log 3
  // every split -inf: the sink alone, out 0 and lse = the sink, not a fully masked row
  const EvalResult s = certified(merge_case({1, 1, 1, 1, 1}, {NAN}, {-kInf}, {}, {0.5}));
  EXPECT_EQ(values(golden(s, "out")), (std::vector<double>{0}));
  EXPECT_EQ(values(golden(s, "lse.ref")), (std::vector<double>{0.5}));
}

// Rows (b, h, i) = (0, 1, 0) with every split -inf: policy zero gives 0 and -inf; error names it.
TEST(Merge, AllMinusInfUnderPolicies) {
  const std::vector<double> o(2 * 2 * 2, 1.0);  // S=2, H=2, Nq=2, Dv=1
  std::vector<double> l(8, 0.25);
  l[0 * 4 + 2] = l[1 * 4 + 2] = -kInf;  // h=1, i=0 in both splits
  const EvalResult z = certified(merge_case({2, 1, 2, 2, 1}, o, l, {{"attn.masked_rows", "zero"}}));
  EXPECT_EQ(values(golden(z, "out")), (std::vector<double>{1, 1, 0, 1}));
  EXPECT_EQ(values(golden(z, "lse.ref"))[2], -kInf);
  EXPECT_EQ(golden(z, "row.valid").data, (std::vector<unsigned char>{1, 1, 0, 1}));
  try {
    certified(merge_case({2, 1, 2, 2, 1}, o, l));
    FAIL() << "not refused";
  } catch (const FullyMaskedRow& e) {
    EXPECT_EQ(e.b, 0);
    EXPECT_EQ(e.h, 1);
    EXPECT_EQ(e.i, 0);
  }
}

TEST(Merge, PlusInf) {
  const std::vector<double> o = {4, 7};
  EXPECT_THROW(case_from_file("case", merge_case({2, 1, 1, 1, 1}, o, {kInf, 0})), InputError);
  EXPECT_THROW(case_from_file("case", merge_case({2, 1, 1, 1, 1}, o, {NAN, 0}, {{"attn.lse_posinf", "empty"}})), InputError);
  const EvalResult m = certified(merge_case({2, 1, 1, 1, 1}, o, {kInf, 0}, {{"attn.lse_posinf", "empty"}}));
  EXPECT_EQ(values(golden(m, "out")), (std::vector<double>{7}));
}

TEST(SplitKv, Refusals) {
  const std::vector<RawTensor> qkv = {tensor("q", DType::F32, {1, 1, 1, 1}, {1}), tensor("k", DType::F32, {1, 1, 2, 1}, {0, 0}),
                                      tensor("v", DType::F32, {1, 1, 2, 1}, {2, 4})};
  auto field = [&](std::map<std::string, std::string> md) {
    try {
      case_from_file("case", file(qkv, md));
    } catch (const InputError& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  EXPECT_NE(field({{"attn.kv_split_size", "0"}}).find("attn.kv_split_size"), std::string::npos);
  EXPECT_NE(field({{"attn.kv_split_size", "1.5"}}).find("attn.kv_split_size"), std::string::npos);
  EXPECT_NE(field({{"attn.outputs", "out_partial"}}).find("attn.kv_split_size is missing"), std::string::npos);
  EXPECT_NE(field({{"attn.kv_split_size", "1"}, {"attn.outputs", "lse_partial,dq"}}).find("no gradients"), std::string::npos);
  EXPECT_NE(field({{"attn.lse_posinf", "empty"}}).find("attn.lse_posinf"), std::string::npos);
}

// partial_merge catches golden partials off by one part in 10^12, and a split without a key made finite.
TEST(SplitKv, PartialMergeCatchesBrokenPartials) {
  const SafeTensorsFile f = file({tensor("q", DType::F32, {1, 1, 2, 2}, {1, 0.5, -1, 2}),
                                  tensor("k", DType::F32, {1, 1, 3, 2}, {0.25, 1, -2, 0.5, 1, 1}),
                                  tensor("v", DType::F32, {1, 1, 3, 1}, {2, 4, 8})},
                                 {{"attn.kv_split_size", "2"}, {"attn.causal", "top_left"},
                                  {"attn.outputs", "out,lse,out_partial,lse_partial"}});
  const Case c = case_from_file("case", f);
  const EvalResult r = certified(f);
  EXPECT_TRUE(oracle::check_partials(c, r).empty());
  auto broken = [&](const std::string& name, std::size_t e, double x) {
    EvalResult b = r;
    for (RawTensor& t : b.golden)
      if (t.name == name) std::memcpy(t.data.data() + 8 * e, &x, 8);
    const auto v = oracle::check_partials(c, b);
    return !v.empty() && v.front().invariant == oracle::Invariant::PartialMerge;
  };
  const double o0 = values(golden(r, "out_partial.ref"))[0], l0 = values(golden(r, "lse_partial.ref"))[0];
  // each weight is known to about an ulp of lse_s (relative): one part in 10^12 stands out
  EXPECT_TRUE(broken("out_partial.ref", 0, o0 * (1 + 1e-12)));
  EXPECT_TRUE(broken("lse_partial.ref", 0, l0 + 1e-12));
  EXPECT_TRUE(broken("lse_partial.ref", 2, 0.0));  // split 1 of query 0 (causal): no key, lse -inf
}

// ---------------------------------------------------------------------------------------------
// The independent evaluation: plain formulas at 320 bits, rounded by int_round.

struct Big {
  mpfr_t x;
  Big() { mpfr_init2(x, 320), mpfr_set_zero(x, 1); }
  ~Big() { mpfr_clear(x); }
  Big(const Big& o) { mpfr_init2(x, 320), mpfr_set(x, o.x, MPFR_RNDN); }
  Big& operator=(const Big&) = delete;
};

std::uint64_t bits_of(const RawTensor& t, std::size_t e) {
  std::uint64_t b = 0;
  std::memcpy(&b, t.data.data() + e * dtype_size(t.dtype), dtype_size(t.dtype));
  return b;
}

// Softmax-weighted mean of `vals` ([n, D]) with logits `s` (-inf: left out) and an optional
// extra denominator logit: (out [D], lse). lse -inf and out 0 with no finite logit.
void softmax_mean(const std::vector<double>& s, const std::vector<double>& vals, std::int64_t D, const double* extra,
                  std::vector<Big>& out, Big& lse) {
  double m = extra ? *extra : -kInf;
  for (double x : s) m = std::max(m, x);
  out.clear();
  out.resize(static_cast<std::size_t>(D));
  if (m == -kInf) {
    mpfr_set_inf(lse.x, -1);
    return;
  }
  Big E, w, t;
  for (std::size_t j = 0; j < s.size(); ++j) {
    if (s[j] == -kInf) continue;
    mpfr_set_d(t.x, s[j], MPFR_RNDN);
    mpfr_sub_d(t.x, t.x, m, MPFR_RNDN);
    mpfr_exp(w.x, t.x, MPFR_RNDN);
    mpfr_add(E.x, E.x, w.x, MPFR_RNDN);
    for (std::int64_t c = 0; c < D; ++c) {
      mpfr_mul_d(t.x, w.x, vals[j * static_cast<std::size_t>(D) + static_cast<std::size_t>(c)], MPFR_RNDN);
      mpfr_add(out[static_cast<std::size_t>(c)].x, out[static_cast<std::size_t>(c)].x, t.x, MPFR_RNDN);
    }
  }
  if (extra) {
    mpfr_set_d(t.x, *extra, MPFR_RNDN);
    mpfr_sub_d(t.x, t.x, m, MPFR_RNDN);
    mpfr_exp(w.x, t.x, MPFR_RNDN);
    mpfr_add(E.x, E.x, w.x, MPFR_RNDN);
  }
  for (auto& o : out) mpfr_div(o.x, o.x, E.x, MPFR_RNDN);
  mpfr_log(lse.x, E.x, MPFR_RNDN);
  mpfr_add_d(lse.x, lse.x, m, MPFR_RNDN);
}

// The golden element e of t equals x rounded (or is undecided with x's rounding as its alt).
void expect_rounded(const EvalResult& r, const std::string& name, std::size_t e, const Big& x) {
  const RawTensor& t = golden(r, name);
  const std::uint64_t want = round_mpfr(x.x, t.dtype).bits, got = bits_of(t, e);
  if (want == got) return;
  for (const RawTensor& u : r.golden)
    if (u.name == name + ".undecided")
      for (std::size_t k = 0; k < u.data.size() / 8; ++k) {
        std::int64_t idx;
        std::memcpy(&idx, u.data.data() + 8 * k, 8);
        if (idx == static_cast<std::int64_t>(e) && bits_of(golden(r, name + ".alt"), k) == want) return;
      }
  char buf[128];
  mpfr_snprintf(buf, sizeof buf, "%.30Rg", x.x);
  RC_FAIL(name + " element " + std::to_string(e) + ": golden bits " + std::to_string(got) + ", independent " +
          std::to_string(want) + " (" + buf + ")");
}

// Random sdpa problems with partials: B, H <= 2, Nq <= 3, Nk <= 9, Dk, Dv <= 3, F32 or BF16
// inputs, a random mask, causal or not, sinks or not, split size 1..Nk+1.
void partial_problem() {
  const auto B = *rc::gen::inRange<std::int64_t>(1, 3), H = *rc::gen::inRange<std::int64_t>(1, 3),
             Nq = *rc::gen::inRange<std::int64_t>(1, 4), Nk = *rc::gen::inRange<std::int64_t>(1, 10),
             Dk = *rc::gen::inRange<std::int64_t>(1, 4), Dv = *rc::gen::inRange<std::int64_t>(1, 4),
             n = *rc::gen::inRange<std::int64_t>(1, Nk + 2);
  const DType in = *rc::gen::element(DType::F32, DType::BF16);
  const DType od = *rc::gen::element(DType::F32, DType::BF16, DType::F16);
  const bool causal = *rc::gen::arbitrary<bool>(), sinks = *rc::gen::arbitrary<bool>();
  auto draw = [&](std::int64_t count, DType t) {
    std::vector<double> v(static_cast<std::size_t>(count));
    (void)t;  // multiples of 1/64 in [-3, 3]: 8 significant bits, exact in BF16 and F32, and
    // every dot product below exact in a double
    for (auto& x : v) x = *rc::gen::inRange(-192, 193) / 64.0;
    return v;
  };
  const auto q = draw(B * H * Nq * Dk, in), k = draw(B * H * Nk * Dk, in), v = draw(B * H * Nk * Dv, in);
  std::vector<unsigned char> mask(static_cast<std::size_t>(B * Nk));
  for (auto& x : mask) x = *rc::gen::inRange(0, 5) > 0 ? 1 : 0;
  std::vector<RawTensor> ts = {tensor("q", in, {B, H, Nq, Dk}, q), tensor("k", in, {B, H, Nk, Dk}, k),
                               tensor("v", in, {B, H, Nk, Dv}, v), tensor("mask", DType::BOOL, {B, 1, 1, Nk}, {})};
  ts.back().data.assign(mask.begin(), mask.end());
  if (sinks) ts.push_back(tensor("sinks", DType::F32, {H}, draw(H, DType::F32)));
  std::map<std::string, std::string> md = {{"attn.kv_split_size", std::to_string(n)}, {"attn.scale", "0.5"},
                                           {"attn.masked_rows", "zero"},
                                           {"attn.outputs", "out,lse,out_partial,lse_partial"},
                                           {"attn.output_dtypes", "out_partial:" + std::string(dtype_name(od)) + ",lse_partial:F32"}};
  if (causal) md["attn.causal"] = "bottom_right";
  const EvalResult r = certified(file(std::move(ts), md));
  const std::int64_t S = (Nk + n - 1) / n;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < Nq; ++i) {
          std::vector<double> logits, vals;
          for (std::int64_t j = s * n; j < std::min(Nk, (s + 1) * n); ++j) {
            const bool ok = mask[static_cast<std::size_t>(b * Nk + j)] != 0 && (!causal || j <= i + (Nk - Nq));
            double dot = 0;
            for (std::int64_t d = 0; d < Dk; ++d)
              dot += q[static_cast<std::size_t>(((b * H + h) * Nq + i) * Dk + d)] * k[static_cast<std::size_t>(((b * H + h) * Nk + j) * Dk + d)];
            logits.push_back(ok ? 0.5 * dot : -kInf);
            for (std::int64_t c = 0; c < Dv; ++c) vals.push_back(v[static_cast<std::size_t>(((b * H + h) * Nk + j) * Dv + c)]);
          }
          std::vector<Big> o;
          Big lse;
          softmax_mean(logits, vals, Dv, nullptr, o, lse);
          const auto row = static_cast<std::size_t>(((s * B + b) * H + h) * Nq + i);
          expect_rounded(r, "lse_partial", row, lse);
          expect_rounded(r, "lse_partial.ref", row, lse);
          for (std::int64_t c = 0; c < Dv; ++c) {
            expect_rounded(r, "out_partial", row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(c), o[static_cast<std::size_t>(c)]);
            expect_rounded(r, "out_partial.ref", row * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(c), o[static_cast<std::size_t>(c)]);
          }
        }
}

// Random merges: S <= 4, H, Nq <= 2, Dv <= 3, o_partial F32, BF16 or F16, lse_partial F32
// (some -inf, their O NaN), sinks or not, output F32, BF16 or F64.
void merge_problem() {
  const auto S = *rc::gen::inRange<std::int64_t>(1, 5), B = *rc::gen::inRange<std::int64_t>(1, 3),
             H = *rc::gen::inRange<std::int64_t>(1, 3), Nq = *rc::gen::inRange<std::int64_t>(1, 3),
             Dv = *rc::gen::inRange<std::int64_t>(1, 4);
  const DType ot = *rc::gen::element(DType::F32, DType::BF16, DType::F16);
  const DType od = *rc::gen::element(DType::F32, DType::BF16, DType::F64);
  const bool sinks = *rc::gen::arbitrary<bool>();
  auto value = [](DType t, double y) {  // y rounded into t by the tests' own rounding
    const std::uint64_t b = round_double(y, t);
    unsigned char buf[8];
    std::memcpy(buf, &b, 8);
    return decode_float(t, buf);
  };
  std::vector<double> l(static_cast<std::size_t>(S * B * H * Nq)), o(l.size() * static_cast<std::size_t>(Dv));
  for (std::size_t r = 0; r < l.size(); ++r) {
    const bool empty = *rc::gen::inRange(0, 4) == 0;
    l[r] = empty ? -kInf : value(DType::F32, *rc::gen::inRange(-20000, 20001) / 1000.0);
    for (std::int64_t c = 0; c < Dv; ++c)
      o[r * static_cast<std::size_t>(Dv) + static_cast<std::size_t>(c)] = empty ? NAN : value(ot, *rc::gen::inRange(-4000, 4001) / 1000.0);
  }
  std::vector<double> sk;
  if (sinks)
    for (std::int64_t h = 0; h < H; ++h) sk.push_back(*rc::gen::inRange(-3000, 3001) / 1000.0);
  std::vector<RawTensor> ts = {tensor("o_partial", ot, {S, B, H, Nq, Dv}, o), tensor("lse_partial", DType::F32, {S, B, H, Nq}, l)};
  if (sinks) ts.push_back(tensor("sinks", DType::F64, {H}, sk));
  const EvalResult r = certified(file(std::move(ts), {{"attn.kind", "merge"}, {"attn.masked_rows", "zero"},
                                                     {"attn.outputs", "out,lse"}, {"attn.output_dtype", std::string(dtype_name(od))}}));
  const std::int64_t R = B * H * Nq;
  for (std::int64_t row = 0; row < R; ++row) {
    std::vector<double> logits, vals;
    for (std::int64_t s = 0; s < S; ++s) {
      logits.push_back(l[static_cast<std::size_t>(s * R + row)]);
      for (std::int64_t c = 0; c < Dv; ++c) {
        const double x = o[static_cast<std::size_t>((s * R + row) * Dv + c)];
        vals.push_back(std::isnan(x) ? 0 : x);
      }
    }
    const double sink = sinks ? sk[static_cast<std::size_t>(row / Nq % H)] : 0;
    std::vector<Big> out;
    Big lse;
    softmax_mean(logits, vals, Dv, sinks ? &sink : nullptr, out, lse);
    expect_rounded(r, "lse", static_cast<std::size_t>(row), lse);
    expect_rounded(r, "lse.ref", static_cast<std::size_t>(row), lse);
    for (std::int64_t c = 0; c < Dv; ++c) {
      expect_rounded(r, "out", static_cast<std::size_t>(row * Dv + c), out[static_cast<std::size_t>(c)]);
      expect_rounded(r, "out.ref", static_cast<std::size_t>(row * Dv + c), out[static_cast<std::size_t>(c)]);
    }
  }
}

RC_GTEST_PROP(SplitKvIndependent, PartialsMatchBitForBit, ()) {
  for (int k = 0; k < 3; ++k) partial_problem();  // 3 problems per run: 300 by default
}

RC_GTEST_PROP(SplitKvIndependent, MergesMatchBitForBit, ()) {
  for (int k = 0; k < 3; ++k) merge_problem();
}

}  // namespace
}  // namespace attnoracle::testing
