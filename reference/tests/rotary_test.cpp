// Rotary embedding from given tables (CONTRACT section 10): hand-worked rotations for both
// pairings, a decode offset and rounding; one rotated pair decided exactly where F64 arithmetic
// would round twice; random problems whose golden bytes equal those of their twins of q and k
// rotated by this test's own exact rational arithmetic; dq and dk through quarter turns.
#include <gmp.h>
#include <gtest/gtest.h>
#include <mpfr.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/rotary.hpp"

namespace attnoracle::testing {
namespace {

using Shape = std::vector<std::int64_t>;

RawTensor floats(const std::string& name, DType t, Shape shape, const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}
RawTensor f32(const std::string& name, Shape shape, const std::vector<double>& v) {
  return floats(name, DType::F32, std::move(shape), v);
}
RawTensor i32(const std::string& name, const std::vector<std::int32_t>& v) {
  RawTensor r{name, DType::I32, {static_cast<std::int64_t>(v.size())}, {}};
  r.data.resize(4 * v.size());
  std::memcpy(r.data.data(), v.data(), 4 * v.size());
  return r;
}

SafeTensorsFile base(const std::string& pairing, const std::string& round) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.scale", "1"}, {"attn.rotary", pairing},
                {"attn.rotary_round", round}, {"attn.outputs", "out,lse"}};
  return f;
}

TEST(Rotary, InterleavedPairsWithADecodeOffset) {
  // Nq = 1 over Nk = 3: the query sits at position 2. Dk = 4, R = 4: pairs (0,1) and (2,3).
  // Position t turns pair f by cos, sin = tables[t, f].
  SafeTensorsFile f = base("interleaved", "F32");
  f.put(f32("q", {1, 1, 1, 4}, {1, 2, 3, 4}));
  f.put(f32("k", {1, 1, 3, 4}, {1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1}));
  f.put(f32("v", {1, 1, 3, 1}, {1, 2, 3}));
  f.put(f32("rotary_cos", {3, 2}, {1, 1, 0, 0.5, -1, 0}));
  f.put(f32("rotary_sin", {3, 2}, {0, 0, 1, 0.25, 0, -1}));
  const Case c = case_from_file("rot.safetensors", f);
  ASSERT_TRUE(c.rotary);
  EXPECT_EQ(c.rotary->R, 4);
  // q at 2: (1, 2) by (-1, 0) -> (-1, -2); (3, 4) by (0, -1) -> (4, -3).
  EXPECT_EQ(c.q.values, (std::vector<double>{-1, -2, 4, -3}));
  // k0 at 0 unchanged; k1 at 1: (1, 0) by (0, 1) -> (0, 1), (0, 1) by (0.5, 0.25) -> (-0.25, 0.5);
  // k2 at 2: (1, 0) -> (-1, 0), (0, 1) -> (1, 0).
  EXPECT_EQ(c.k.values, (std::vector<double>{1, 0, 0, 1, 0, 1, -0.25, 0.5, -1, 0, 1, 0}));
}

TEST(Rotary, HalfPairsLeaveTheFeaturesPastR) {
  // Dk = 6, R = 4: pairs (0, 2) and (1, 3); features 4 and 5 as given. Nq = Nk = 2, positions 0, 1.
  SafeTensorsFile f = base("half", "F32");
  f.put(f32("q", {1, 1, 2, 6}, {1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6}));
  f.put(f32("k", {1, 1, 2, 6}, {1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6}));
  f.put(f32("v", {1, 1, 2, 1}, {1, 2}));
  f.put(f32("rotary_cos", {2, 2}, {1, 1, 0, -1}));
  f.put(f32("rotary_sin", {2, 2}, {0, 0, 1, 0}));
  const Case c = case_from_file("rot.safetensors", f);
  // position 1: pair (x0, x2) = (1, 3) by a quarter turn -> (-3, 1); (x1, x3) = (2, 4) by a half
  // turn -> (-2, -4).
  const std::vector<double> want = {1, 2, 3, 4, 5, 6, -3, -2, 1, -4, 5, 6};
  EXPECT_EQ(c.q.values, want);
  EXPECT_EQ(c.k.values, want);
}

TEST(Rotary, DecodeOffsetFollowsSeqlens) {
  // Nq = 2, Nk = 4 with seqlens_q = 1, seqlens_k = 3: query 0 sits at 0 + 3 - 1 = 2; query 1 is
  // padding, at 3, still in the table; key 3 is past seqlens_k, at 3.
  SafeTensorsFile f = base("interleaved", "F32");
  f.put(f32("q", {1, 1, 2, 2}, {1, 0, 1, 0}));
  f.put(f32("k", {1, 1, 4, 2}, {1, 0, 1, 0, 1, 0, 1, 0}));
  f.put(f32("v", {1, 1, 4, 1}, {1, 2, 3, 4}));
  f.put(i32("seqlens_q", {1}));
  f.put(i32("seqlens_k", {3}));
  f.put(f32("rotary_cos", {4, 1}, {1, 0, -1, 0.5}));
  f.put(f32("rotary_sin", {4, 1}, {0, 1, 0, 0.5}));
  const Case c = case_from_file("rot.safetensors", f);
  EXPECT_EQ(c.q.values, (std::vector<double>{-1, 0, 0.5, 0.5}));
  EXPECT_EQ(c.k.values, (std::vector<double>{1, 0, 0, 1, -1, 0, 0.5, 0.5}));
  // A table of 3 rows still holds every used position: the padding query and key 3 stay as given.
  f.put(f32("rotary_cos", {3, 1}, {1, 0, -1}));
  f.put(f32("rotary_sin", {3, 1}, {0, 1, 0}));
  const Case d = case_from_file("rot.safetensors", f);
  EXPECT_EQ(d.q.values, (std::vector<double>{-1, 0, 1, 0}));
  EXPECT_EQ(d.k.values, (std::vector<double>{1, 0, 0, 1, -1, 0, 1, 0}));
}

TEST(Rotary, NonFiniteOnlyOnPaddingRows) {
  // seqlens_q = 1: query 1 is padding. Its NaN turns its whole pair to NaN, left unused;
  // the same NaN in query 0 is refused by the unused-position rules.
  auto file = [](std::vector<double> q) {
    SafeTensorsFile f = base("interleaved", "F32");
    RawTensor t = f32("q", {1, 1, 2, 2}, {0, 0, 0, 0});
    const float nan = NAN;
    for (std::size_t e = 0; e < q.size(); ++e)
      if (std::isnan(q[e]))
        std::memcpy(t.data.data() + 4 * e, &nan, 4);
      else
        encode_float(DType::F32, q[e], t.data.data() + 4 * e);
    f.put(t);
    f.put(f32("k", {1, 1, 2, 2}, {1, 0, 0, 1}));
    f.put(f32("v", {1, 1, 2, 1}, {1, 2}));
    f.put(i32("seqlens_q", {1}));
    f.put(f32("rotary_cos", {3, 1}, {1, 0, 1}));  // query 1 sits at 2, in the table
    f.put(f32("rotary_sin", {3, 1}, {0, 1, 0}));
    return f;
  };
  const Case c = case_from_file("rot.safetensors", file({1, 0, 2, NAN}));
  EXPECT_EQ(c.q.values[0], 0);  // query 0 at position 1: (1, 0) -> (0, 1)
  EXPECT_EQ(c.q.values[1], 1);
  // The padding pair (2, NaN) became NaN, NaN, then 0, 0 as unused non-finite inputs are.
  EXPECT_EQ(c.q.values[2], 0);
  EXPECT_EQ(c.q.values[3], 0);
  EXPECT_EQ(evaluate(c, EvalOptions{}).golden.empty(), false);
  try {
    case_from_file("rot.safetensors", file({NAN, 0, 2, 1}));
    ADD_FAILURE() << "a NaN in query 0 was accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "q");
    EXPECT_NE(std::string(e.what()).find("element 0 is NaN, in query 0 of b=0, h=0, which is not padding"), std::string::npos)
        << e.what();
  }
}

TEST(Rotary, RoundedOnceToTheRoundDtype) {
  // cos = sin = F32(sqrt(1/2)): (1, 1) -> (0, 2 F32(sqrt(1/2))), the second BF16 1.4140625.
  const double s = static_cast<float>(std::sqrt(0.5));
  double y1, y2;
  rotate_pair(1, 1, s, s, DType::BF16, y1, y2);
  EXPECT_EQ(y1, 0);
  EXPECT_EQ(y2, 1.4140625);
  rotate_pair(1, 1, s, s, DType::F32, y1, y2);
  EXPECT_EQ(y2, 2 * s);
  rotate_pair(1, 1, s, s, DType::F16, y1, y2);
  EXPECT_EQ(y2, 1.4140625);  // 1 + 424/1024 is F16's nearest too
}

TEST(Rotary, DecidedExactlyWhereF64WouldRoundTwice) {
  // x1 cos = 1 + 2^-26 + 2^-27 + 2^-53: a tie in F64, which rounds it to even (down); the
  // exact sum with -x2 sin = +2^-80 lies above the tie, so the correct F64 result rounds up.
  const double x1 = 1 + 0x1p-26, c = 1 + 0x1p-27, x2 = 0x1p-80, s = -1;
  double y1, y2;
  rotate_pair(x1, x2, c, s, DType::F64, y1, y2);
  EXPECT_EQ(y1, 1 + 0x1p-26 + 0x1p-27 + 0x1p-52);
  EXPECT_EQ(x1 * c - x2 * s, 1 + 0x1p-26 + 0x1p-27);  // what F64 arithmetic gives
}

// This test's rotation: x1 cos - x2 sin (sign -1) or x1 sin + x2 cos (sign +1) as an exact
// rational, rounded to the format's precision by mpfr_set_q (no subnormal or overflow arises
// for the values drawn below).
double my_rotated(double a, double b, double c, double d, int sign, DType t) {
  mpq_t x, y;
  mpq_inits(x, y, nullptr);
  mpq_set_d(x, a);
  mpq_set_d(y, c);
  mpq_mul(x, x, y);
  mpq_set_d(y, b);
  mpq_t z;
  mpq_init(z);
  mpq_set_d(z, d);
  mpq_mul(y, y, z);
  if (sign < 0)
    mpq_sub(x, x, y);
  else
    mpq_add(x, x, y);
  const mpfr_prec_t prec = t == DType::F32 ? 24 : t == DType::F16 ? 11 : 8;
  mpfr_t r;
  mpfr_init2(r, prec);
  mpfr_set_q(r, x, MPFR_RNDN);
  const double out = mpfr_get_d(r, MPFR_RNDN);
  mpfr_clear(r);
  mpq_clears(x, y, z, nullptr);
  return out;
}

// A random case with rotary tables, and its twin: q and k rotated by my_rotated, no tables.
void check_random_problem() {
  const std::int64_t B = *rc::gen::inRange<std::int64_t>(1, 3), Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  const std::int64_t Hq = Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  const std::int64_t Nk = *rc::gen::inRange<std::int64_t>(1, 6), Nq = *rc::gen::inRange<std::int64_t>(1, Nk + 1);
  const std::int64_t half = *rc::gen::inRange<std::int64_t>(1, 4), Dk = 2 * half + *rc::gen::inRange<std::int64_t>(0, 3);
  const std::int64_t Dv = *rc::gen::inRange<std::int64_t>(1, 3), Nrot = Nk + *rc::gen::inRange<std::int64_t>(0, 3);
  const bool interleaved = *rc::gen::arbitrary<bool>();
  const DType round = *rc::gen::element(DType::F32, DType::F16, DType::BF16);
  const DType in = *rc::gen::element(DType::F32, DType::BF16);
  // Tables in multiples of 2^-8 under F16 (every nonzero rotated value then at least 2^-12,
  // F16-normal), else 2^-20 so that F32 rounds too.
  const int grain = round == DType::F16 ? 8 : 20;
  const auto table = [&] {
    return *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(Nrot * half), rc::gen::map(
        rc::gen::inRange(-(1 << grain), (1 << grain) + 1), [&](int n) { return std::ldexp(n, -grain); }));
  };
  const auto small = [](std::size_t n) {  // multiples of 1/16 in [-4, 4]: exact in BF16
    return *rc::gen::container<std::vector<double>>(n, rc::gen::map(rc::gen::inRange(-64, 65), [](int m) { return m / 16.0; }));
  };
  const std::vector<double> cosv = table(), sinv = table();
  std::vector<double> q = small(static_cast<std::size_t>(B * Hq * Nq * Dk)), k = small(static_cast<std::size_t>(B * Hkv * Nk * Dk));
  const std::vector<double> v = small(static_cast<std::size_t>(B * Hkv * Nk * Dv)), dout = small(static_cast<std::size_t>(B * Hq * Nq * Dv));
  std::vector<std::int32_t> lq(static_cast<std::size_t>(B)), lk(lq.size());
  const bool seqlens = *rc::gen::arbitrary<bool>();
  for (std::size_t b = 0; b < lq.size(); ++b) {
    lk[b] = seqlens ? *rc::gen::inRange<std::int32_t>(1, static_cast<std::int32_t>(Nk) + 1) : static_cast<std::int32_t>(Nk);
    lq[b] = seqlens ? *rc::gen::inRange<std::int32_t>(1, static_cast<std::int32_t>(std::min(Nq, std::int64_t{lk[b]})) + 1)
                    : static_cast<std::int32_t>(Nq);
  }
  std::map<std::string, std::string> md = {{"attn.format", "1"}, {"attn.output_dtype", "F32"},
                                           {"attn.outputs", "out,weights,lse,dv"}, {"attn.masked_rows", "zero"}};
  if (*rc::gen::arbitrary<bool>()) md["attn.causal"] = "bottom_right";
  SafeTensorsFile twin;
  twin.metadata = md;
  SafeTensorsFile f;
  f.metadata = md;
  f.metadata["attn.rotary"] = interleaved ? "interleaved" : "half";
  f.metadata["attn.rotary_round"] = std::string(dtype_name(round));
  f.put(floats("q", in, {B, Hq, Nq, Dk}, q));
  f.put(floats("k", in, {B, Hkv, Nk, Dk}, k));
  f.put(floats("rotary_cos", DType::F32, {Nrot, half}, cosv));
  f.put(floats("rotary_sin", DType::F32, {Nrot, half}, sinv));
  const auto rotate = [&](std::vector<double>& x, std::int64_t H, std::int64_t N, bool queries) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t n = 0; n < N; ++n) {
          const std::int64_t t = queries ? n + lk[static_cast<std::size_t>(b)] - lq[static_cast<std::size_t>(b)] : n;
          if (t < 0 || t >= Nrot) continue;
          const auto row = static_cast<std::size_t>(((b * H + h) * N + n) * Dk);
          for (std::int64_t j = 0; j < half; ++j) {
            const auto i1 = row + static_cast<std::size_t>(interleaved ? 2 * j : j);
            const auto i2 = row + static_cast<std::size_t>(interleaved ? 2 * j + 1 : j + half);
            const double c = cosv[static_cast<std::size_t>(t * half + j)], s = sinv[static_cast<std::size_t>(t * half + j)];
            const double x1 = x[i1], x2 = x[i2];
            x[i1] = my_rotated(x1, x2, c, s, -1, round);
            x[i2] = my_rotated(x1, x2, s, c, +1, round);
          }
        }
  };
  rotate(q, Hq, Nq, true);
  rotate(k, Hkv, Nk, false);
  twin.put(f32("q", {B, Hq, Nq, Dk}, q));
  twin.put(f32("k", {B, Hkv, Nk, Dk}, k));
  f.put(floats("v", in, {B, Hkv, Nk, Dv}, v));
  twin.put(f32("v", {B, Hkv, Nk, Dv}, v));
  for (SafeTensorsFile* g : {&f, &twin}) {
    g->put(f32("dout", {B, Hq, Nq, Dv}, dout));
    if (seqlens) g->put(i32("seqlens_q", lq)), g->put(i32("seqlens_k", lk));
  }
  const EvalResult a = evaluate(case_from_file("rot.safetensors", f), EvalOptions{});
  const EvalResult b = evaluate(case_from_file("twin.safetensors", twin), EvalOptions{});
  RC_ASSERT(a.golden.size() == b.golden.size());
  for (std::size_t t = 0; t < a.golden.size(); ++t) {
    RC_ASSERT(a.golden[t].name == b.golden[t].name);
    RC_ASSERT(a.golden[t].shape == b.golden[t].shape);
    RC_ASSERT(a.golden[t].data == b.golden[t].data);  // byte for byte
  }
}

// Three problems per run: 300 at RapidCheck's 100 runs.
RC_GTEST_PROP(RotaryProperty, EqualsItsTwinRotatedByThisTest, ()) {
  for (int n = 0; n < 3; ++n) check_random_problem();
}

// dq and dk through quarter turns: with every (cos, sin) in {(1, 0), (0, 1), (-1, 0), (0, -1)}
// the rotation permutes and negates exactly, so the case is its twin of q and k turned by this
// test, and dq, dk must be the twin's taken back by R^T, (g1, g2) -> (g1 c + g2 s, g2 c - g1 s)
// (exact here), their bounds permuted (|c| b1 + |s| b2). dv is the twin's byte for byte.
void check_quarter_turns() {
  const std::int64_t Hkv = *rc::gen::inRange<std::int64_t>(1, 3), Hq = Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  const std::int64_t Nk = *rc::gen::inRange<std::int64_t>(1, 6), Nq = *rc::gen::inRange<std::int64_t>(1, Nk + 1);
  const std::int64_t half = *rc::gen::inRange<std::int64_t>(1, 4), Dk = 2 * half + *rc::gen::inRange<std::int64_t>(0, 3);
  const std::int64_t Dv = *rc::gen::inRange<std::int64_t>(1, 3);
  const bool interleaved = *rc::gen::arbitrary<bool>();
  const auto small = [](std::int64_t n) {  // multiples of 1/16 in [-4, 4]
    return *rc::gen::container<std::vector<double>>(static_cast<std::size_t>(n),
                                                    rc::gen::map(rc::gen::inRange(-64, 65), [](int m) { return m / 16.0; }));
  };
  const auto turns = *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(Nk * half), rc::gen::inRange(0, 4));
  std::vector<double> cosv, sinv;
  for (int t : turns) cosv.push_back(t == 0 ? 1 : t == 2 ? -1 : 0), sinv.push_back(t == 1 ? 1 : t == 3 ? -1 : 0);
  std::vector<double> q = small(Hq * Nq * Dk), k = small(Hkv * Nk * Dk);
  const std::vector<double> v = small(Hkv * Nk * Dv), dout = small(Hq * Nq * Dv);
  SafeTensorsFile f, twin;
  f.metadata = twin.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,dq,dk,dv"}};
  f.metadata["attn.rotary"] = interleaved ? "interleaved" : "half";
  f.metadata["attn.rotary_round"] = "F32";
  f.put(f32("q", {1, Hq, Nq, Dk}, q));
  f.put(f32("k", {1, Hkv, Nk, Dk}, k));
  f.put(f32("rotary_cos", {Nk, half}, cosv));
  f.put(f32("rotary_sin", {Nk, half}, sinv));
  const auto pair = [&](std::int64_t fq) {
    return interleaved ? std::pair{2 * fq, 2 * fq + 1} : std::pair{fq, fq + half};
  };
  // x's rows [H, N, Dk] turned at their positions: forward (sign 1) or back by R^T (sign -1).
  const auto turn = [&](std::vector<double>& x, std::int64_t H, std::int64_t N, bool queries, double sign) {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t fq = 0; fq < half; ++fq) {
          const std::int64_t t = queries ? n + Nk - Nq : n;
          const auto e = static_cast<std::size_t>(t * half + fq);
          const double c = cosv[e], s = sign * sinv[e];
          const auto [i1, i2] = pair(fq);
          double& x1 = x[static_cast<std::size_t>((h * N + n) * Dk + i1)];
          double& x2 = x[static_cast<std::size_t>((h * N + n) * Dk + i2)];
          const double y1 = x1 * c - x2 * s, y2 = x1 * s + x2 * c;
          x1 = y1, x2 = y2;
        }
  };
  turn(q, Hq, Nq, true, 1);
  turn(k, Hkv, Nk, false, 1);
  twin.put(f32("q", {1, Hq, Nq, Dk}, q));
  twin.put(f32("k", {1, Hkv, Nk, Dk}, k));
  for (SafeTensorsFile* g : {&f, &twin}) g->put(f32("v", {1, Hkv, Nk, Dv}, v)), g->put(f32("dout", {1, Hq, Nq, Dv}, dout));
  const EvalResult a = evaluate(case_from_file("rot.safetensors", f), EvalOptions{});
  const EvalResult b = evaluate(case_from_file("twin.safetensors", twin), EvalOptions{});
  RC_ASSERT(a.stats.undecided == 0u);
  const auto values = [](const EvalResult& r, const std::string& name) {
    for (const RawTensor& t : r.golden)
      if (t.name == name) {
        std::vector<double> x(t.data.size() / dtype_size(t.dtype));
        for (std::size_t e = 0; e < x.size(); ++e) x[e] = decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype));
        return x;
      }
    RC_FAIL("no golden " + name);
    return std::vector<double>{};
  };
  for (const std::string g : {"dq", "dk"}) {
    const bool queries = g == "dq";
    for (const std::string part : {"", ".ref"}) {
      std::vector<double> want = values(b, g + part);
      turn(want, queries ? Hq : Hkv, queries ? Nq : Nk, queries, -1);
      RC_ASSERT(values(a, g + part) == want);
    }
    std::vector<double> bound = values(b, g + ".bound"), got = values(a, g + ".bound");
    turn(bound, queries ? Hq : Hkv, queries ? Nq : Nk, queries, -1);
    for (double& x : bound) x = std::fabs(x);
    RC_ASSERT(got == bound);
  }
  RC_ASSERT(values(a, "dv") == values(b, "dv"));
}

RC_GTEST_PROP(RotaryProperty, QuarterTurnsGradientsAreTheTwinsTurnedBack, ()) {
  for (int n = 0; n < 3; ++n) check_quarter_turns();
}

}  // namespace
}  // namespace attnoracle::testing
