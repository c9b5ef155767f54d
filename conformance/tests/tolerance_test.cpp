// The limits against conformance/TOLERANCE.md's worked example, the metrics on values worked by
// hand, and the verdict on results that are right, slightly off, biased, or malformed.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/conformance/tolerance.hpp"

namespace attnoracle::conformance {
namespace {

TEST(Tolerance, WorkedExampleOfTheDocs) {
  Case c;
  c.kind = Kind::Sdpa;
  c.Dk = 4;
  c.output_dtype = DType::F32;
  const RowMagnitudes m{2.0, 3.0, 8};
  const RowLimits L = row_limits(builtin_profile("fp32"), c, m);
  const double u = 0x1p-24;
  EXPECT_DOUBLE_EQ(L.score, 18 * u);
  EXPECT_DOUBLE_EQ(L.weight_rel, 102 * u);
  EXPECT_DOUBLE_EQ(L.out_coef, 111 * u);
  EXPECT_DOUBLE_EQ(L.floor, 2 * 0x1p-149 + 8 * 0x1p-126);
  EXPECT_EQ(L.p_sub, 0);  // |S_j - m| <= 6: no weight near F32's smallest normal
  // the page's limit for bound 0.5 and x = 0.25: 223 u + 4 floor
  const double limit = 4 * (L.out_coef * 0.5 + u * 0.25 + L.floor);
  EXPECT_DOUBLE_EQ(limit, 223 * u + 4 * L.floor);
}

TEST(Tolerance, FlashProfileRoundsP) {
  Case c;
  c.Dk = 4;
  c.output_dtype = DType::F16;
  const RowMagnitudes m{2.0, 3.0, 8};
  const double a = row_limits(builtin_profile("fp16"), c, m).weight_rel;
  const double b = row_limits(builtin_profile("flash-fp16"), c, m).weight_rel;
  EXPECT_DOUBLE_EQ(b - a, 0x1p-11 - 0x1p-24);  // u_p: F16 instead of F32
  // 2M + 2 score + 1 + log 8 = 9.08... < -log 2^-14 = 9.70...: no weight reaches F16's
  // subnormals, and nothing else changes
  EXPECT_EQ(row_limits(builtin_profile("flash-fp16"), c, m).p_sub, 0);
  EXPECT_EQ(row_limits(builtin_profile("flash-fp16"), c, m).lse_abs, row_limits(builtin_profile("fp16"), c, m).lse_abs);
}

// Dropout (TOLERANCE.md, "Dropout"): the worked example's row with p = 0.5 and p = 0.1 under
// fp32 and flash-bf16; weights and lse keep their limits, p = 0 changes nothing.
TEST(Tolerance, DropoutAddsTheKeepScaleAndOneProduct) {
  Case c;
  c.kind = Kind::Sdpa;
  c.Dk = 4;
  c.output_dtype = DType::F32;
  const RowMagnitudes m{2.0, 3.0, 8};
  const double u = 0x1p-24;
  const RowLimits plain = row_limits(builtin_profile("fp32"), c, m);
  c.dropout = Case::Dropout{"0.5", {}};
  EXPECT_DOUBLE_EQ(dropout_scale_error(builtin_profile("fp32"), c), 3 * u / (1 - 2 * u));  // p / (1 - p) = 1
  EXPECT_DOUBLE_EQ(dropout_product_error(builtin_profile("fp32"), c), u);
  const RowLimits half = row_limits(builtin_profile("fp32"), c, m);
  EXPECT_DOUBLE_EQ(half.out_coef, 111 * u + 3 * u / (1 - 2 * u) + u);
  EXPECT_EQ(half.weight_rel, plain.weight_rel);
  EXPECT_EQ(half.lse_abs, plain.lse_abs);
  c.dropout->p = "0.1";  // p / (1 - p) = 1/9
  const double e9 = (1.0 / 9 + 2) * u / (1 - (1.0 / 9 + 1) * u);
  EXPECT_DOUBLE_EQ(dropout_scale_error(builtin_profile("fp32"), c), e9);
  // flash-bf16: the scale formed in F32 (softmax), P rounded to BF16 as before (u_p in weight_rel)
  c.output_dtype = DType::BF16;
  const Profile fb = builtin_profile("flash-bf16");
  Case nodrop = c;
  nodrop.dropout.reset();
  EXPECT_NEAR(row_limits(fb, c, m).out_coef - row_limits(fb, nodrop, m).out_coef, e9 + u, 1e-6 * u);
  // under torch-cpu-bf16 (the scale formed in BF16) p = 0.999 passes what the bound covers
  c.dropout->p = "0.999";
  EXPECT_EQ(dropout_scale_error(builtin_profile("torch-cpu-bf16"), c), INFINITY);
  c.dropout->p = "0";  // a mask without scaling: nothing is formed or multiplied
  EXPECT_EQ(dropout_scale_error(fb, c), 0);
  EXPECT_EQ(row_limits(fb, c, m).out_coef, row_limits(fb, nodrop, m).out_coef);
}

// partials (TOLERANCE.md, "A split-KV kernel's out and lse"): BF16 partials add u_part = 2^-8 and
// the merge's F32 terms to out's coefficient, and the merge's to lse; nothing else changes.
TEST(Tolerance, SplitKvPartialsAddTheirRoundingAndTheMerge) {
  Case c;
  c.Dk = 4;
  c.output_dtype = DType::BF16;
  const RowMagnitudes m{2.0, 3.0, 8};
  Profile p = builtin_profile("flash-bf16");
  const RowLimits a = row_limits(p, c, m);
  p.partials = DType::BF16;
  const RowLimits b = row_limits(p, c, m);
  const double us = 0x1p-24, w_rel = 2 * a.lse_abs + 2 * us * 3 + 4 * us;
  EXPECT_DOUBLE_EQ(b.out_coef - a.out_coef, 0x1p-8 + 2 * w_rel + 10 * (us + us));
  EXPECT_DOUBLE_EQ(b.lse_abs - a.lse_abs, w_rel + 9 * us + 4 * us * 4);
  EXPECT_EQ(b.weight_rel, a.weight_rel);
  EXPECT_EQ(b.score, a.score);
}

// FP8 (TOLERANCE.md, the fp8 profiles): descales add 3 u_qk A to a score and 2 u_pv to the output
// coefficient; flash-fp8 rounds P to E4M3 (u_p = 2^-4).
TEST(Tolerance, Fp8DescalesAndE4M3Weights) {
  Case c;
  c.Dk = 4;
  c.input_dtype = DType::F8_E4M3;
  c.output_dtype = DType::F32;
  const RowMagnitudes m{2.0, 3.0, 8};
  const RowLimits plain = row_limits(builtin_profile("fp8"), c, m);
  c.file.put(RawTensor{"q_descale", DType::F32, {1, 1}, {0, 0, 0x80, 0x3f}});
  c.file.put(RawTensor{"v_descale", DType::F32, {1, 1}, {0, 0, 0x80, 0x3f}});
  const RowLimits d = row_limits(builtin_profile("fp8"), c, m);
  const double u = 0x1p-24;
  EXPECT_DOUBLE_EQ(d.score - plain.score, 3 * u * 2.0);  // A = dot_abs = 2
  EXPECT_GT(d.out_coef - plain.out_coef, 2 * u);         // 2 u_pv, and the scores' share
  const RowLimits f = row_limits(builtin_profile("flash-fp8"), c, m);
  EXPECT_DOUBLE_EQ(f.weight_rel - d.weight_rel, 0x1p-4 - u);
}

// The smallest false failure the absolute term of P's rounding removes (TOLERANCE.md, step 4b):
// one F16 query over two keys, Dk = Dv = 1, q = 1, k = (0, -16.25), v = (0, 60000), scale 1, so
// scores (0, -16.25) and the exact output x = 60000 e / (1 + e), e = exp(-16.25) = 8.773e-8.
// A FlashAttention kernel (scores, exp and l in F32, P rounded to F16, P V in F32): P = (1,
// fl16(e)) and e = 1.47 * 2^-24 is subnormal in F16, so fl16(e) = 2^-24; O = 60000 * 2^-24 =
// 1875 * 2^-19 exactly, out = O / (1 + e) = (1875 - 1.6e-4) 2^-19, which rounds to F16 as
// 1875 * 2^-19 = 0.003576..., against x = 0.005263...: off by 0.001687, 0.57 of the 2^-25 * 60000
// that one subnormal rounding may lose.
TEST(Tolerance, SubnormalWeightsOfFlashFp16) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F16"}};  // scale 1 / sqrt(1)
  auto put = [&](const char* name, std::vector<std::int64_t> shape, std::vector<double> v) {
    RawTensor t{name, DType::F16, shape, {}};
    t.data.resize(v.size() * 2);
    for (std::size_t k = 0; k < v.size(); ++k) encode_float(DType::F16, v[k], t.data.data() + 2 * k);
    f.put(std::move(t));
  };
  put("q", {1, 1, 1, 1}, {1});
  put("k", {1, 1, 2, 1}, {0, -16.25});
  put("v", {1, 1, 2, 1}, {0, 60000});
  const Case c = case_from_file("t", f);
  const SafeTensorsFile golden = golden_file(c, evaluate(c, {}));
  const double e = std::exp(-16.25), x = 60000 * e / (1 + e);
  EXPECT_NEAR(decode_float(DType::F64, golden.find("out.ref")->data.data()), x, 1e-15);
  const double bound = decode_float(DType::F64, golden.find("out.bound")->data.data());
  EXPECT_NEAR(bound, x, 1e-15);  // sum_j w_j |v_j| = x: v_1 = 0, v_2 > 0

  const Profile p = builtin_profile("flash-fp16");
  const RowMagnitudes m = row_magnitudes(c)[0];
  EXPECT_EQ(m.dot_abs, 16.25);
  EXPECT_EQ(m.score_abs, 16.25);
  EXPECT_EQ(m.keys, 2);
  const RowLimits L = row_limits(p, c, m);
  EXPECT_EQ(L.p_sub, 0x1p-25);  // half F16's subnormal spacing 2^-24
  const double vsum = out_value_sum(c)[0];
  EXPECT_EQ(vsum, 60000);
  const double term = 0x1p-25 * (60000 + 2 * bound);  // s_p / 2 (sum_j |v_j| + n out.bound)
  EXPECT_DOUBLE_EQ(out_compute(L, bound, vsum) - (L.out_coef * bound + L.floor), term);
  const double u = 0x1p-24, uo = 0x1p-11;
  // by hand: score 3u A + 2u M = 81.25u, e_rel 162.5u + 32.5u + 4u = 199u, eps_w 398u + 3u + u_p,
  // out_coef eps_w + 3u
  EXPECT_DOUBLE_EQ(L.out_coef, 404 * u + 0x1p-11);
  const double before = 4 * (L.out_coef * bound + uo * x + L.floor);  // without the term
  const double after = out_limit(p, L, uo, bound, vsum, x);
  EXPECT_DOUBLE_EQ(after, before + 4 * term);

  const double y = 1875 * 0x1p-19;  // the kernel's F16 result, worked above
  EXPECT_GT(std::fabs(y - x) / before, 75);  // the false failure: 78 times the old limit
  EXPECT_LT(std::fabs(y - x), after);
  auto result = [&](double out) {
    JobResult j;
    j.outcome = Outcome::Output;
    RawTensor t = *golden.find("out");
    encode_float(DType::F16, out, t.data.data());
    j.output.put(t);
    return j;
  };
  CaseReport r = compare_case("t", golden, "ok", result(y), p);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  // The profile's arithmetic, so P in F32 (fp16): the subnormal loss is not allowed there.
  EXPECT_EQ(compare_case("t", golden, "ok", result(y), builtin_profile("fp16")).status, CaseStatus::Fail);
  // Off by 4 times the new term more: beyond what even four subnormal roundings could lose.
  const double bad = std::nearbyint((y - 4 * term) * 0x1p19) * 0x1p-19;  // -0.003576..., into F16
  EXPECT_GT(std::fabs(bad - x), after);
  r = compare_case("t", golden, "ok", result(bad), p);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  ASSERT_TRUE(r.worst);
  EXPECT_GT(r.worst->limit_ratio, 1);
  // BF16 weights have F32's exponent range: the same scores leave them normal.
  EXPECT_EQ(row_limits(builtin_profile("flash-bf16"), c, m).p_sub, 0);
}

// Sequence lengths: keys past seqlens_k add nothing to a row's magnitudes (key 1 holds the
// largest score and value, but seqlens_k = 1), and the rows past seqlens_q are padding: not
// compared, whatever they hold.
TEST(Tolerance, SeqlensInRowMagnitudesAndPadding) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.scale", "1"}};
  auto put = [&](const char* name, std::vector<std::int64_t> shape, std::vector<double> v) {
    RawTensor t{name, DType::F32, shape, {}};
    t.data.resize(v.size() * 4);
    for (std::size_t k = 0; k < v.size(); ++k) encode_float(DType::F32, v[k], t.data.data() + 4 * k);
    f.put(std::move(t));
  };
  put("q", {1, 1, 2, 1}, {2, 1});
  put("k", {1, 1, 2, 1}, {0.5, 100});
  put("v", {1, 1, 2, 1}, {3, 1000});
  const Case full = case_from_file("t", f);
  EXPECT_EQ(row_magnitudes(full)[0].dot_abs, 200);
  EXPECT_EQ(row_magnitudes(full)[0].keys, 2);
  RawTensor lq{"seqlens_q", DType::I32, {1}, {1, 0, 0, 0}}, lk{"seqlens_k", DType::I64, {1}, {1, 0, 0, 0, 0, 0, 0, 0}};
  f.put(lq);
  f.put(lk);
  const Case c = case_from_file("t", f);
  const RowMagnitudes m = row_magnitudes(c)[0];
  EXPECT_EQ(m.dot_abs, 1);  // |2 * 0.5|: key 1 is past seqlens_k
  EXPECT_EQ(m.score_abs, 1);
  EXPECT_EQ(m.keys, 1);
  EXPECT_EQ(out_value_sum(c)[0], 3);
  const SafeTensorsFile golden = golden_file(c, evaluate(c, {}));
  EXPECT_EQ(decode_float(DType::F64, golden.find("out.ref")->data.data()), 3);
  JobResult j;
  j.outcome = Outcome::Output;
  RawTensor out = *golden.find("out");
  encode_float(DType::F32, std::nan(""), out.data.data() + 4);  // query 1: padding
  j.output.put(out);
  CaseReport r = compare_case("t", golden, "ok", j, builtin_profile("fp32"));
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  encode_float(DType::F32, 3.5, j.output.find("out")->data.data());  // query 0 is compared
  EXPECT_EQ(compare_case("t", golden, "ok", j, builtin_profile("fp32")).status, CaseStatus::Fail);
}

// lse in its own dtype (TOLERANCE.md, "Each output in its own dtype"): flash-bf16 declares lse
// in F32, so a BF16 case asking for lse is given to the implementation with lse:F32, and lse is
// judged in F32 against lse.ref: an lse kept in BF16 (within a BF16 ulp, many F32 ulps off) fails
// there, and passes where lse is judged in BF16.
TEST(Tolerance, LseInF32UnderFlashBf16) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,lse"}};
  auto put = [&](const char* name, std::vector<std::int64_t> shape, std::vector<double> v) {
    RawTensor t{name, DType::BF16, shape, {}};
    t.data.resize(v.size() * 2);
    for (std::size_t k = 0; k < v.size(); ++k) encode_float(DType::BF16, v[k], t.data.data() + 2 * k);
    f.put(std::move(t));
  };
  put("q", {1, 1, 2, 2}, {1.5, -0.75, 2.25, 1});
  put("k", {1, 1, 3, 2}, {1, 2, -0.5, 1.25, 3, -1});
  put("v", {1, 1, 3, 2}, {0.5, 1, -2, 0.25, 1.5, -1});
  const Case c = case_from_file("t", f);
  const SafeTensorsFile golden = golden_file(c, evaluate(c, {}));
  ASSERT_EQ(golden.find("lse")->dtype, DType::BF16);
  const Profile flash = builtin_profile("flash-bf16");
  ASSERT_EQ(flash.lse_dtype, DType::F32);
  EXPECT_EQ(case_for(golden, flash).metadata.at("attn.output_dtypes"), "lse:F32");
  Profile own = flash;  // lse in the case's dtype
  own.lse_dtype.reset();
  EXPECT_EQ(case_for(golden, own).metadata.count("attn.output_dtypes"), 0u);
  EXPECT_EQ(case_for(golden, own).metadata, strip_golden(golden).metadata);

  const RawTensor& ref = *golden.find("lse.ref");
  auto result = [&](DType t, DType through) {  // lse.ref rounded through `through`, stored in t
    JobResult j;
    j.outcome = Outcome::Output;
    j.output.put(*golden.find("out"));
    RawTensor lse{"lse", t, ref.shape, std::vector<unsigned char>(2 * dtype_size(t))};
    for (std::size_t k = 0; k < 2; ++k)
      encode_float(t, round_double(decode_float(DType::F64, ref.data.data() + 8 * k), through),
                   lse.data.data() + k * dtype_size(t));
    j.output.put(lse);
    return j;
  };
  CaseReport r = compare_case("t", golden, "ok", result(DType::F32, DType::F32), flash);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  ASSERT_EQ(r.tensors.size(), 2u);
  EXPECT_EQ(r.tensors[1].tensor, "lse");
  EXPECT_EQ(r.tensors[1].dtype, DType::F32);
  EXPECT_EQ(r.tensors[0].dtype, DType::BF16);
  r = compare_case("t", golden, "ok", result(DType::BF16, DType::BF16), flash);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  EXPECT_EQ(r.reason, "lse is BF16 [1,1,2], expected F32 [1,1,2]");
  r = compare_case("t", golden, "ok", result(DType::F32, DType::BF16), flash);
  EXPECT_EQ(r.status, CaseStatus::Fail) << r.reason;
  ASSERT_TRUE(r.worst);
  EXPECT_EQ(r.worst->tensor, "lse");
  EXPECT_EQ(r.worst->dtype, DType::F32);
  EXPECT_GT(r.worst->limit_ratio, 10);
  EXPECT_EQ(compare_case("t", golden, "ok", result(DType::BF16, DType::BF16), own).status, CaseStatus::Pass);
}

// TOLERANCE.md's worked lse limit in F32: the page's row (Dk = 4, A = 2, M = 3, n = 8) has
// lse_abs = 18u + 46u + 9u + 16u = 89u under flash-bf16 as under fp32 (u = 2^-24), so lse = 3.5
// has the limit 4 (89 + 3.5) u in F32, against 4 (89u + 3.5 2^-8) in BF16.
TEST(Tolerance, LseLimitInF32OfTheDocs) {
  Case c;
  c.Dk = 4;
  c.output_dtype = DType::BF16;
  const RowMagnitudes m{2.0, 3.0, 8};
  const Profile p = builtin_profile("flash-bf16");
  const RowLimits L = row_limits(p, c, m);
  const double u = 0x1p-24;
  EXPECT_DOUBLE_EQ(L.lse_abs, 89 * u);
  EXPECT_DOUBLE_EQ(L.lse_abs, row_limits(builtin_profile("fp32"), c, m).lse_abs);
  RowLimits f32 = L;
  f32.floor = 2 * 0x1p-149 + 8 * 0x1p-126;  // the floor in F32's spacing
  EXPECT_NEAR(lse_limit(p, f32, u, 3.5), 4 * 92.5 * u, 1e-15);
  EXPECT_NEAR(lse_limit(p, L, 0x1p-8, 3.5), 4 * (89 * u + 3.5 * 0x1p-8), 1e-15);
  EXPECT_GT(3.5e-4, 15 * lse_limit(p, f32, u, 3.5));  // 1e-4 relative: 16 times the F32 limit
  EXPECT_LT(3.5e-4, lse_limit(p, L, 0x1p-8, 3.5) / 100);  // and within 1% of the BF16 one
}

TEST(Tolerance, UlpErrorFollowsTosa) {
  // F32: x = 1, y = 1 + 2^-23 is one ulp; near the smallest normal the ulp stays 2^-149.
  EXPECT_DOUBLE_EQ(ulp_error(1 + 0x1p-23, 1, 0, DType::F32), 1.0);
  EXPECT_DOUBLE_EQ(ulp_error(0x1p-149, 0, 0, DType::F32), 1.0);
  EXPECT_DOUBLE_EQ(ulp_error(0x1p-130, 0x1p-131, 0, DType::F32), 0x1p-131 / 0x1p-149);
  // F16: x = 1000, ulp 0.5; x given as a double-double
  EXPECT_DOUBLE_EQ(ulp_error(1001, 1000, 0.25, DType::F16), 1.5);
  EXPECT_TRUE(std::isinf(ulp_error(NAN, 1, 0, DType::F32)));
  EXPECT_EQ(ulp_error(-INFINITY, -INFINITY, 0, DType::F32), 0);
}

TEST(Tolerance, BoundErrorIsImmuneToCancellation) {
  // x near 0 from cancellation, bound 1: an error of 2^-24 is one unit of bound 2^-24 in F32.
  EXPECT_DOUBLE_EQ(bound_error(0x1p-40 + 0x1p-24, 0x1p-40, 0, 1.0, DType::F32), 1.0);
  EXPECT_DOUBLE_EQ(bound_error(0x1p-40 - 0x1p-24, 0x1p-40, 0, 1.0, DType::F32), 1.0);
}

// The formats by hand: precision p, smallest normal 2^emin, smallest subnormal, largest finite
// value, its ulp, and half of it (round to nearest overflows from max + half).
struct Fmt {
  DType t;
  int p, emin;
  double sub, max, ulp_max, half;
};
const Fmt kFormats[] = {
    {DType::F64, 53, -1022, 0x1p-1074, 0x1.fffffffffffffp1023, 0x1p971, 0x1p970},
    {DType::F32, 24, -126, 0x1p-149, 0x1.fffffep127, 0x1p104, 0x1p103},
    {DType::F16, 11, -14, 0x1p-24, 65504.0, 32.0, 16.0},
    {DType::BF16, 8, -126, 0x1p-133, 0x1.fep127, 0x1p120, 0x1p119},
};

TEST(Tolerance, UlpAtPowersOfTwo) {
  for (const Fmt& f : kFormats) {
    SCOPED_TRACE(std::string(dtype_name(f.t)));
    const double up = std::ldexp(1.0, 1 - f.p);  // ulp of [1, 2)
    const double down = std::ldexp(1.0, -f.p);   // ulp of [1/2, 1)
    // x = 1 exactly: 1's ulp from either side, so the next value below is half an ulp away.
    EXPECT_EQ(ulp_of(1, 0, f.t), up);
    EXPECT_EQ(ulp_error(1 + up, 1, 0, f.t), 1.0);
    EXPECT_EQ(ulp_error(1 - down, 1, 0, f.t), 0.5);
    EXPECT_EQ(ulp_error(-1 + down, -1, 0, f.t), 0.5);
    EXPECT_EQ(ulp_error(-1 - up, -1, 0, f.t), 1.0);
    // x just below 1 (x_hi = 1, x_lo pointing toward zero): the binade below, ulp `down`.
    EXPECT_EQ(ulp_of(1, -0x1p-70, f.t), down);
    EXPECT_EQ(ulp_of(-1, 0x1p-70, f.t), down);
    EXPECT_EQ(ulp_of(1, 0x1p-70, f.t), up);   // just above: 1's binade
    EXPECT_EQ(ulp_of(-1, -0x1p-70, f.t), up);
    EXPECT_EQ(ulp_error(1 - down, 1, -0x1p-70, f.t), (down - 0x1p-70) / down);
    // x_lo beside a value that is not a power of two changes nothing
    EXPECT_EQ(ulp_of(1.5, -0x1p-70, f.t), up);
    // other powers of two, the largest finite value
    EXPECT_EQ(ulp_of(0.125, 0, f.t), std::ldexp(up, -3));
    EXPECT_EQ(ulp_of(f.max, 0, f.t), f.ulp_max);
    EXPECT_EQ(ulp_error(f.max - f.ulp_max, f.max, 0, f.t), 1.0);
  }
}

TEST(Tolerance, UlpAtZeroAndSubnormals) {
  for (const Fmt& f : kFormats) {
    SCOPED_TRACE(std::string(dtype_name(f.t)));
    const double normal = std::ldexp(1.0, f.emin);
    // +0 and -0 are equal; the ulp of 0 is the smallest subnormal (the floor).
    EXPECT_EQ(ulp_error(-0.0, 0.0, 0, f.t), 0);
    EXPECT_EQ(ulp_error(0.0, -0.0, 0, f.t), 0);
    EXPECT_EQ(ulp_of(0.0, 0, f.t), f.sub);
    EXPECT_EQ(ulp_of(-0.0, 0, f.t), f.sub);
    EXPECT_EQ(ulp_error(f.sub, -0.0, 0, f.t), 1.0);
    EXPECT_EQ(ulp_error(-f.sub, 0.0, 0, f.t), 1.0);
    // subnormals: the spacing is the smallest subnormal throughout
    EXPECT_EQ(ulp_error(4 * f.sub, 3 * f.sub, 0, f.t), 1.0);
    EXPECT_EQ(ulp_of(normal / 2, 0, f.t), f.sub);
    // the smallest normal: its ulp is the smallest subnormal, from above and from below
    EXPECT_EQ(ulp_of(normal, 0, f.t), f.sub);
    EXPECT_EQ(ulp_of(normal, -f.sub / 4, f.t), f.sub);
    EXPECT_EQ(ulp_error(normal - f.sub, normal, 0, f.t), 1.0);
    EXPECT_EQ(ulp_of(2 * normal, 0, f.t), 2 * f.sub);
    // bound error: 2^-p of the bound, never below the smallest normal
    EXPECT_EQ(bound_error(f.sub, 0, 0, 0, f.t), f.sub / normal);
    EXPECT_EQ(bound_error(-0.0, 0, 0, 1, f.t), 0);
    EXPECT_EQ(bound_error(1 + std::ldexp(1.0, 1 - f.p), 1, 0, 1, f.t), 2.0);
  }
}

// The constants unit_roundoff, min_normal and min_subnormal return, against float_format's fields.
TEST(Tolerance, FormatConstantsFollowTheirFields) {
  for (const DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::F8_E5M2}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const FloatFormat f = float_format(t);
    EXPECT_EQ(unit_roundoff(t), std::ldexp(1.0, -f.precision));
    EXPECT_EQ(min_normal(t), std::ldexp(1.0, 1 - f.bias));
    EXPECT_EQ(min_subnormal(t), std::ldexp(1.0, 2 - f.bias - f.precision));
  }
  EXPECT_EQ(unit_roundoff(DType::F32), 0x1p-24);  // by hand: 24 bits of precision
  EXPECT_EQ(min_subnormal(DType::F16), 0x1p-24);  // 2^-14 over 2^10
}

TEST(Tolerance, InfinitiesAndNan) {
  for (const Fmt& f : kFormats) {
    SCOPED_TRACE(std::string(dtype_name(f.t)));
    // the exact value overflows to +inf in the format when x >= max + half (ties go to inf)
    const double over_hi = f.t == DType::F64 ? f.max : f.max + f.half;
    const double over_lo = f.t == DType::F64 ? f.half : 0;
    EXPECT_EQ(ulp_error(INFINITY, over_hi, over_lo, f.t), 0);
    EXPECT_EQ(bound_error(INFINITY, over_hi, over_lo, 1, f.t), 0);
    EXPECT_EQ(ulp_error(-INFINITY, -over_hi, -over_lo, f.t), 0);
    // just below: rounds to max, so inf is infinitely wrong
    const double under_hi = f.t == DType::F64 ? f.max : f.max + f.half / 2;
    const double under_lo = f.t == DType::F64 ? f.half / 2 : 0;
    EXPECT_TRUE(std::isinf(ulp_error(INFINITY, under_hi, under_lo, f.t)));
    EXPECT_TRUE(std::isinf(ulp_error(INFINITY, f.max, 0, f.t)));
    // the wrong sign
    EXPECT_TRUE(std::isinf(ulp_error(-INFINITY, over_hi, over_lo, f.t)));
    EXPECT_TRUE(std::isinf(ulp_error(-INFINITY, INFINITY, 0, f.t)));
    EXPECT_TRUE(std::isinf(bound_error(INFINITY, -INFINITY, 0, 1, f.t)));
    EXPECT_EQ(ulp_error(INFINITY, INFINITY, 0, f.t), 0);
    // a finite result where the exact value overflows: measured as it is
    EXPECT_EQ(ulp_error(f.max, over_hi, over_lo, f.t), f.half / f.ulp_max);
    EXPECT_TRUE(std::isinf(ulp_error(f.max, INFINITY, 0, f.t)));
    // NaN: only against NaN
    EXPECT_TRUE(std::isinf(ulp_error(NAN, 1, 0, f.t)));
    EXPECT_TRUE(std::isinf(ulp_error(NAN, INFINITY, 0, f.t)));
    EXPECT_TRUE(std::isinf(ulp_error(1, NAN, 0, f.t)));
    EXPECT_EQ(ulp_error(NAN, NAN, 0, f.t), 0);
    EXPECT_TRUE(std::isinf(bound_error(NAN, 0, 0, 1, f.t)));
    EXPECT_EQ(abs_error(NAN, NAN, 0, f.t), 0);
  }
}

TEST(Tolerance, ProfilesFromNamesAndRefusals) {
  for (const auto& n : builtin_profile_names()) EXPECT_EQ(builtin_profile(n).name, n);
  EXPECT_THROW(builtin_profile("fp7"), InputError);
}

// A case with golden tensors, and results made from its golden values.
struct Fixture {
  SafeTensorsFile golden;
  Case c;
  Fixture(DType in, DType out, std::int64_t Nq, std::int64_t Nk, std::int64_t D) {
    SafeTensorsFile f;
    f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", std::string(dtype_name(out))}};
    auto put = [&](const char* name, std::vector<std::int64_t> shape, double a) {
      RawTensor t{name, in, shape, {}};
      std::int64_t n = 1;
      for (auto d : shape) n *= d;
      t.data.resize(static_cast<std::size_t>(n) * dtype_size(in));
      for (std::int64_t k = 0; k < n; ++k) {
        // values exactly representable in every format: multiples of 1/8 in [-2, 2)
        const double v = std::fmod(std::floor(std::fabs(std::sin(a * static_cast<double>(k + 1))) * 32) / 8, 4) - 2;
        encode_float(in, v, t.data.data() + static_cast<std::size_t>(k) * dtype_size(in));
      }
      f.put(std::move(t));
    };
    put("q", {1, 1, Nq, D}, 1.3);
    put("k", {1, 1, Nk, D}, 2.1);
    put("v", {1, 1, Nk, D}, 0.7);
    c = case_from_file("t", f);
    const EvalResult r = evaluate(c, {});
    golden = golden_file(c, r);
  }
  // A result whose `out` is f(out.ref) rounded into the output dtype the way `round` says.
  JobResult result(const std::function<double(double)>& f) const {
    JobResult j;
    j.outcome = Outcome::Output;
    const RawTensor* ref = golden.find("out.ref");
    RawTensor out = *golden.find("out");
    for (std::size_t k = 0; k < out.data.size() / dtype_size(out.dtype); ++k)
      encode_float(out.dtype, f(decode_float(DType::F64, ref->data.data() + 8 * k)),
                   out.data.data() + k * dtype_size(out.dtype));
    j.output.put(out);
    return j;
  }
};

// Rounds toward zero into F16 (a truncating implementation).
double truncate_f16(double x) {
  if (x == 0) return x;
  const int e = std::max(std::ilogb(x), -14);
  const double q = std::ldexp(1.0, e - 10);
  return std::trunc(x / q) * q;
}
double nearest_f16(double x) {
  const int e = std::max(std::ilogb(x == 0 ? 1 : x), -14);
  const double q = std::ldexp(1.0, e - 10);
  return std::nearbyint(x / q) * q;
}

TEST(Compare, GoldenPassesAndSlightErrorsPass) {
  Fixture fx(DType::F32, DType::F32, 16, 16, 8);
  const Profile p = builtin_profile("fp32");
  CaseReport r = compare_case("t", fx.golden, "ok", fx.result([](double x) { return static_cast<double>(static_cast<float>(x)); }), p);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  r = compare_case("t", fx.golden, "ok", fx.result([](double x) {
                     return static_cast<double>(static_cast<float>(x * (1 + 0x1p-21)));
                   }), p);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  EXPECT_GT(r.worst->ulp, 1);
}

TEST(Compare, LargeErrorFailsWithTheWorstElement) {
  Fixture fx(DType::F32, DType::F32, 4, 5, 3);
  CaseReport r = compare_case("t", fx.golden, "ok", fx.result([](double x) { return static_cast<double>(static_cast<float>(x + 1e-3)); }), builtin_profile("fp32"));
  EXPECT_EQ(r.status, CaseStatus::Fail);
  ASSERT_TRUE(r.worst);
  EXPECT_GT(r.worst->limit_ratio, 1);
  EXPECT_EQ(r.worst->tensor, "out");
  EXPECT_EQ(r.worst->index.size(), 4u);
}

TEST(Compare, TruncationIsCaughtByTheStatistics) {
  // F16 outputs computed in F32: the final rounding dominates. Truncated results are within
  // each element's limit, but biased toward zero.
  Fixture fx(DType::F16, DType::F16, 32, 16, 8);
  const Profile p = builtin_profile("fp16");
  CaseReport good = compare_case("t", fx.golden, "ok", fx.result(nearest_f16), p);
  EXPECT_EQ(good.status, CaseStatus::Pass) << good.reason;
  CaseReport bad = compare_case("t", fx.golden, "ok", fx.result(truncate_f16), p);
  EXPECT_EQ(bad.status, CaseStatus::Fail);
  EXPECT_EQ(bad.failed_elements, 0);
  EXPECT_NE(bad.reason.find("biased"), std::string::npos) << bad.reason;
}

TEST(Compare, MalformedResultsFail) {
  Fixture fx(DType::F32, DType::F32, 3, 4, 2);
  const Profile p = builtin_profile("fp32");
  JobResult j = fx.result([](double x) { return static_cast<double>(static_cast<float>(x)); });
  j.output.find("out")->shape = {1, 1, 4, 2};  // wrong shape (same bytes)
  EXPECT_EQ(compare_case("t", fx.golden, "ok", j, p).status, CaseStatus::Fail);
  JobResult nan = fx.result([](double) { return NAN; });
  CaseReport r = compare_case("t", fx.golden, "ok", nan, p);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  EXPECT_TRUE(std::isinf(r.worst->limit_ratio));
  JobResult none;
  none.outcome = Outcome::Output;
  EXPECT_NE(compare_case("t", fx.golden, "ok", none, p).reason.find("no tensor 'out'"), std::string::npos);
  for (Outcome o : {Outcome::Missing, Outcome::Crashed, Outcome::TimedOut, Outcome::Invalid}) {
    JobResult x;
    x.outcome = o;
    x.reason = "because";
    EXPECT_EQ(compare_case("t", fx.golden, "ok", x, p).status, CaseStatus::Fail);
  }
  JobResult u;
  u.outcome = Outcome::Unsupported;
  EXPECT_EQ(compare_case("t", fx.golden, "ok", u, p).status, CaseStatus::Skip);
  JobResult refused;
  refused.outcome = Outcome::Refused;
  EXPECT_EQ(compare_case("t", fx.golden, "ok", refused, p).status, CaseStatus::Fail);
  EXPECT_EQ(compare_case("t", fx.golden, "error", refused, p).status, CaseStatus::Pass);
  // a profile for other dtypes skips the case
  EXPECT_EQ(compare_case("t", fx.golden, "ok", j, builtin_profile("fp16")).status, CaseStatus::Skip);
}

// Rotary (TOLERANCE.md, "Rotary embedding"): eps_rot = u_r + max(u_r, u_proj) + 4 u_qk, the
// score's 3 eps_rot A_rot on top of the plain row's, and R^T on a pair's error magnitudes.
TEST(Tolerance, RotaryTermsOfTheDocs) {
  Case c;
  c.kind = Kind::Sdpa;
  c.Dk = 4;
  c.output_dtype = DType::F32;
  RowMagnitudes m{2.0, 3.0, 8};
  m.rotary_abs = 1.5;
  const double plain = row_limits(builtin_profile("fp32"), c, m).score;
  EXPECT_EQ(rotary_rel(builtin_profile("fp32"), c), 0);
  c.rotary = Rotary{RotaryPairing::Half, 2, 1, DType::BF16, {0.5}, {-0.25}, {}, {}, false, {}, {}};
  const double eps = 0x1p-8 + 0x1p-8 + 4 * 0x1p-24;  // u_r BF16, u_proj F32 < u_r, u_qk F32
  EXPECT_DOUBLE_EQ(rotary_rel(builtin_profile("fp32"), c), eps);
  EXPECT_DOUBLE_EQ(row_limits(builtin_profile("fp32"), c, m).score, plain + 3 * eps * 1.5);
  c.rotary->round = DType::F32;  // fp16: u_proj F16 above u_r
  EXPECT_DOUBLE_EQ(rotary_rel(builtin_profile("fp16"), c), 0x1p-24 + 0x1p-11 + 4 * 0x1p-24);
  // pair (0, 1) at position 0: e1 |cos| + e2 |sin|, e2 |cos| + e1 |sin|; features past R kept
  double e[4] = {4, 8, 1, 1};
  c.Dk = 4;
  rotate_back_errors(c, 0, e);
  EXPECT_EQ(e[0], 4 * 0.5 + 8 * 0.25);
  EXPECT_EQ(e[1], 8 * 0.5 + 4 * 0.25);
  EXPECT_EQ(e[2], 1);
  rotate_back_errors(c, 1, e);  // past the table: untouched
  EXPECT_EQ(e[0], 4);
}

}  // namespace
}  // namespace attnoracle::conformance
