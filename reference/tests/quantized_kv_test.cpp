// Quantized and block-scaled K/V, v as a view of k, FP8 outputs (CONTRACT section 9): the
// formats decoded against this test's own tables, hand-worked cases per format, and random
// problems whose golden bytes equal those of their twins of F64 K/V dequantized by this test.
#include <gtest/gtest.h>
#include <mpfr.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/kv_formats.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::testing {
namespace {

using Shape = std::vector<std::int64_t>;
using Bytes = std::vector<std::uint8_t>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// 2^e by repeated multiplication (exact for the exponents used here).
double pow2(int e) {
  double r = 1;
  for (; e > 0; --e) r *= 2;
  for (; e < 0; ++e) r /= 2;
  return r;
}
// The formats from their definitions (OCP MX v1.0): value = significand x 2^exponent.
double my_e4m3(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return kNaN;
  const double v = e == 0 ? m * pow2(-9) : (8 + m) * pow2(e - 10);
  return (b & 0x80) ? -v : v;
}
double my_e5m2(std::uint8_t b) {
  const int e = (b >> 2) & 31, m = b & 3;
  const double v = e == 31 ? (m ? kNaN : INFINITY) : e == 0 ? m * pow2(-16) : (4 + m) * pow2(e - 17);
  return (b & 0x80) ? -v : v;
}
constexpr double kE2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
double my_e8m0(std::uint8_t b) { return b == 255 ? kNaN : pow2(b - 127); }
double my_i8(std::uint8_t b) { return b < 128 ? b : b - 256.0; }

bool same(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

TEST(KvFormats, EveryPatternAgainstTheDefinitions) {
  for (unsigned n = 0; n < 16; ++n) EXPECT_TRUE(same(e2m1_from_bits(static_cast<std::uint8_t>(n)), kE2M1[n])) << n;
  for (unsigned n = 0; n < 256; ++n) {
    const auto b = static_cast<std::uint8_t>(n);
    EXPECT_TRUE(same(f8_e4m3_from_bits(b), my_e4m3(b))) << n;
    EXPECT_TRUE(same(f8_e5m2_from_bits(b), my_e5m2(b))) << n;
    EXPECT_TRUE(same(e8m0_from_bits(b), my_e8m0(b))) << n;
    EXPECT_TRUE(same(i8_from_bits(b), my_i8(b))) << n;
    // the high nibble is ignored by e2m1_from_bits
    EXPECT_TRUE(same(e2m1_from_bits(b), kE2M1[n & 15])) << n;
  }
  // spot values
  EXPECT_EQ(f8_e4m3_from_bits(0x7E), 448);
  EXPECT_EQ(f8_e4m3_from_bits(0x01), 0x1p-9);
  EXPECT_EQ(f8_e4m3_from_bits(0x08), 0x1p-6);
  EXPECT_TRUE(std::isnan(f8_e4m3_from_bits(0xFF)));
  EXPECT_EQ(f8_e5m2_from_bits(0x7B), 57344);
  EXPECT_EQ(f8_e5m2_from_bits(0x01), 0x1p-16);
  EXPECT_EQ(f8_e5m2_from_bits(0xFC), -INFINITY);
  EXPECT_EQ(e8m0_from_bits(0), 0x1p-127);
  EXPECT_EQ(e8m0_from_bits(127), 1);
  EXPECT_EQ(e8m0_from_bits(254), 0x1p127);
  EXPECT_TRUE(std::isnan(e8m0_from_bits(255)));
  EXPECT_EQ(e2m1_from_bits(7), 6);
  EXPECT_EQ(e2m1_from_bits(9), -0.5);
  EXPECT_EQ(i8_from_bits(0x80), -128);
  EXPECT_EQ(i8_from_bits(0x7F), 127);
}

RawTensor bytes(const std::string& name, DType t, Shape shape, const Bytes& b) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.assign(b.begin(), b.end());
  return r;
}
RawTensor floats(const std::string& name, DType t, Shape shape, const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}
RawTensor f32(const std::string& name, Shape shape, const std::vector<double>& v) {
  return floats(name, DType::F32, std::move(shape), v);
}

EvalResult eval(const SafeTensorsFile& f) { return evaluate(case_from_file("quant.safetensors", f), EvalOptions{}); }

const RawTensor& golden(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return t;
  throw std::runtime_error("no " + name);
}
std::vector<double> values(const RawTensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t e = 0; e < v.size(); ++e) v[e] = decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype));
  return v;
}

SafeTensorsFile base(std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  f.metadata["attn.format"] = "1";
  f.metadata["attn.scale"] = "1";
  return f;
}

const double kLse = static_cast<float>(1 + std::log(2.0));  // two equal scores of 1

TEST(QuantizedKv, ScaledE4M3PerToken) {
  // keys 2 x 0.5 and 4 x 0.25 are both 1: equal weights; values 1 and 3 times 0.5.
  SafeTensorsFile f = base({{"attn.output_dtype", "F32"}, {"attn.outputs", "out,weights,lse"}});
  f.put(f32("q", {1, 1, 1, 1}, {1}));
  f.put(bytes("k", DType::F8_E4M3, {1, 1, 2, 1}, {0x40, 0x48}));
  f.put(bytes("v", DType::F8_E4M3, {1, 1, 2, 1}, {0x38, 0x44}));
  f.put(f32("k_scale", {1, 1, 2, 1}, {0.5, 0.25}));
  f.put(f32("v_scale", {}, {0.5}));
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>{1.0});
  EXPECT_EQ(values(golden(r, "weights")), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(values(golden(r, "lse")), std::vector<double>{kLse});
}

TEST(QuantizedKv, ScaledI8PerHead) {
  SafeTensorsFile f = base({{"attn.output_dtype", "F32"}, {"attn.outputs", "out,lse"}});
  f.put(f32("q", {1, 2, 1, 1}, {1, 1}));
  f.put(bytes("k", DType::I8, {1, 2, 2, 1}, {2, 2, 0xFF, 0xFF}));  // 2, 2 | -1, -1
  f.put(bytes("v", DType::I8, {1, 2, 2, 1}, {0xFD, 5, 7, 9}));     // -3, 5 | 7, 9
  f.put(f32("k_scale", {1, 2, 1, 1}, {0.5, 2}));                   // keys 1 | -2
  f.put(f32("v_scale", {1, 2, 1, 1}, {0.25, 0.5}));                // -0.75, 1.25 | 3.5, 4.5
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), (std::vector<double>{0.25, 4.0}));
  EXPECT_EQ(values(golden(r, "lse")),
            (std::vector<double>{kLse, static_cast<float>(-2 + std::log(2.0))}));
}

TEST(QuantizedKv, ScaledE5M2PerTensor) {
  SafeTensorsFile f = base({{"attn.output_dtype", "BF16"}, {"attn.outputs", "out,lse"}});
  f.put(floats("q", DType::BF16, {1, 1, 1, 1}, {1}));
  f.put(bytes("k", DType::F8_E5M2, {1, 1, 2, 1}, {0x3C, 0x3C}));  // 1, 1 (x 3)
  f.put(bytes("v", DType::F8_E5M2, {1, 1, 2, 1}, {0x40, 0x44}));  // 2, 4 (x 0.5)
  f.put(f32("k_scale", {}, {3}));
  f.put(f32("v_scale", {}, {0.5}));
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>{1.5});
  EXPECT_EQ(values(golden(r, "lse")), std::vector<double>{round_double(3 + std::log(2.0), DType::BF16)});
}

TEST(QuantizedKv, Mxfp8) {
  // D = 32, one block: key 0 is 2 x 2^-1, key 1 is 1 x 2^0 in element 0; values all 1 x 2 and
  // 4 x 2^-2.
  SafeTensorsFile f = base({{"attn.output_dtype", "F32"}, {"attn.outputs", "out,lse"}, {"attn.kv_block_scale", "mxfp8"}});
  std::vector<double> q(32, 0.0);
  q[0] = 1;
  f.put(f32("q", {1, 1, 1, 32}, q));
  Bytes k(64, 0), v(64, 0x38);
  k[0] = 0x40, k[32] = 0x38;
  std::fill(v.begin() + 32, v.end(), 0x48);
  f.put(bytes("k", DType::F8_E4M3, {1, 1, 2, 32}, k));
  f.put(bytes("v", DType::F8_E4M3, {1, 1, 2, 32}, v));
  f.put(bytes("k_block_scale", DType::U8, {1, 1, 2, 1}, {126, 127}));
  f.put(bytes("v_block_scale", DType::U8, {1, 1, 2, 1}, {128, 125}));
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>(32, 1.5));
  EXPECT_EQ(values(golden(r, "lse")), std::vector<double>{kLse});
}

TEST(QuantizedKv, Nvfp4LowNibbleFirst) {
  // D = 16, packed into 8 bytes. Keys: element 0 is 1.0 (code 2) x 2 x 0.25 and 2.0 (code 4)
  // x 1 x 0.25. Values: key 0 bytes 0x21 (elements 0.5, 1.0) then 0x33 (1.5, 1.5), x 2 x 0.5;
  // key 1 all 0xBB (-1.5), x 1 x 0.5.
  SafeTensorsFile f = base({{"attn.output_dtype", "F32"}, {"attn.outputs", "out,lse"}, {"attn.kv_block_scale", "nvfp4"}});
  std::vector<double> q(16, 0.0);
  q[0] = 2;
  f.put(f32("q", {1, 1, 1, 16}, q));
  Bytes k(16, 0), v(16, 0x33);
  k[0] = 0x02, k[8] = 0x04;
  v[0] = 0x21;
  std::fill(v.begin() + 8, v.end(), 0xBB);
  f.put(bytes("k", DType::U8, {1, 1, 2, 8}, k));
  f.put(bytes("v", DType::U8, {1, 1, 2, 8}, v));
  f.put(bytes("k_block_scale", DType::F8_E4M3, {1, 1, 2, 1}, {0x40, 0x38}));
  f.put(bytes("v_block_scale", DType::F8_E4M3, {1, 1, 2, 1}, {0x40, 0x38}));
  f.put(f32("k_global_scale", {}, {0.25}));
  f.put(f32("v_global_scale", {}, {0.5}));
  const EvalResult r = eval(f);
  std::vector<double> want(16, 0.375);  // (1.5 - 0.75) / 2
  want[0] = -0.125, want[1] = 0.125;    // (0.5 - 0.75) / 2, (1 - 0.75) / 2
  EXPECT_EQ(values(golden(r, "out")), want);
  EXPECT_EQ(values(golden(r, "lse")), std::vector<double>{kLse});
}

TEST(QuantizedKv, VFromK) {
  SafeTensorsFile f = base({{"attn.v_from_k", "2"}});
  f.put(f32("q", {1, 1, 1, 3}, {0, 0, 0}));
  f.put(f32("k", {1, 1, 2, 3}, {1, 2, 9, 3, 4, 9}));
  const EvalResult r = eval(f);
  EXPECT_EQ(golden(r, "out").shape, (Shape{1, 1, 1, 2}));
  EXPECT_EQ(values(golden(r, "out")), (std::vector<double>{2, 3}));
}

TEST(QuantizedKv, Fp8OutputsWithScaleAndAmax) {
  // O = 0.75, 350, 0.53125 over o_scale 0.5: 1.5 exactly, 700 (E4M3 saturates to 448, E5M2
  // rounds to 640), 1.0625 (a tie in E4M3: to 1, the even neighbour; E5M2 1). amax = 350.
  for (const auto& [dtype, mid, sat] : {std::tuple{"F8_E4M3", 1.0, 448.0}, std::tuple{"F8_E5M2", 1.0, 640.0}}) {
    SafeTensorsFile f = base({{"attn.output_dtype", dtype}, {"attn.outputs", "out,lse,amax"}});
    f.put(f32("q", {1, 1, 1, 1}, {0}));
    f.put(f32("k", {1, 1, 2, 1}, {1, 2}));
    f.put(f32("v", {1, 1, 2, 3}, {0.5, 300, 0.5, 1, 400, 0.5625}));
    f.put(f32("o_scale", {}, {0.5}));
    const EvalResult r = eval(f);
    const RawTensor& out = golden(r, "out");
    EXPECT_EQ(dtype_name(out.dtype), dtype);
    EXPECT_EQ(values(out), (std::vector<double>{1.5, sat, mid})) << dtype;
    EXPECT_EQ(golden(r, "lse").dtype, DType::F32);  // the other outputs default to F32
    EXPECT_EQ(values(golden(r, "out.ref")), (std::vector<double>{0.75, 350, 0.53125}));  // O itself
    const RawTensor& amax = golden(r, "amax");
    EXPECT_EQ(amax.dtype, DType::F32);
    EXPECT_EQ(amax.shape, Shape{});
    EXPECT_EQ(values(amax), std::vector<double>{350});
  }
}

TEST(QuantizedKv, Fp8OutputsPartialsInF32) {
  // Split-KV partials beside an FP8 out: both F32 (either asked), each split's out not scaled.
  SafeTensorsFile f = base({{"attn.output_dtype", "F8_E4M3"}, {"attn.outputs", "out,out_partial"}, {"attn.kv_split_size", "1"}});
  f.put(f32("q", {1, 1, 1, 1}, {0}));
  f.put(f32("k", {1, 1, 2, 1}, {1, 2}));
  f.put(f32("v", {1, 1, 2, 1}, {3, 5}));
  f.put(f32("o_scale", {}, {0.5}));
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>{8});  // 4 / 0.5
  EXPECT_EQ(golden(r, "out_partial").dtype, DType::F32);
  EXPECT_EQ(values(golden(r, "out_partial")), (std::vector<double>{3, 5}));
  EXPECT_EQ(golden(r, "lse_partial").dtype, DType::F32);
}

TEST(QuantizedKv, Fp8OutputOfNoRowIsAmaxZero) {
  // Nk = 0 under policy zero: out 0, amax 0.
  SafeTensorsFile f = base({{"attn.output_dtype", "F8_E5M2"}, {"attn.outputs", "out,amax"}, {"attn.masked_rows", "zero"}});
  f.put(f32("q", {1, 1, 2, 1}, {1, 2}));
  f.put(bytes("k", DType::I8, {1, 1, 0, 1}, {}));
  f.put(bytes("v", DType::I8, {1, 1, 0, 2}, {}));
  f.put(f32("k_scale", {}, {1}));
  f.put(f32("v_scale", {}, {1}));
  f.put(f32("o_scale", {}, {3}));
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>(4, 0.0));
  EXPECT_EQ(values(golden(r, "amax")), std::vector<double>{0});
}

TEST(QuantizedKv, PagedPerSlotScales) {
  // Two pages of two slots, NHD, one kv head; batch 0 reads page 1 then page 0, 3 keys. Slot
  // scales beside the pages; the unused slot holds NaN in the cache and 0 as its scale.
  SafeTensorsFile f = base({{"attn.output_dtype", "F32"}, {"attn.outputs", "out,weights"}});
  f.put(f32("q", {1, 1, 1, 1}, {0}));
  f.put(bytes("k_cache", DType::F8_E4M3, {2, 2, 1, 1}, {0x38, 0x7F, 0x38, 0x38}));
  f.put(bytes("v_cache", DType::F8_E4M3, {2, 2, 1, 1}, {0x40, 0x7F, 0x38, 0x44}));  // 2, NaN | 1, 3
  f.put(f32("k_scale", {}, {1}));
  f.put(f32("v_scale", {2, 2, 1}, {0.5, 0, 2, 1}));  // keys: page 1 (1 x 2, 3 x 1), page 0 (2 x 0.5)
  RawTensor table{"block_table", DType::I32, {1, 2}, {}};
  table.data.resize(8);
  const std::int32_t t[2] = {1, 0};
  std::memcpy(table.data.data(), t, 8);
  f.put(table);
  RawTensor lens{"seqlens_k", DType::I32, {1}, {}};
  lens.data.resize(4);
  const std::int32_t three = 3;
  std::memcpy(lens.data.data(), &three, 4);
  f.put(lens);
  const EvalResult r = eval(f);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>{2});  // (2 + 3 + 1) / 3
}

// ---- Random problems against their dequantized twins ----

// A random problem whose K/V are stored in `scheme` (contiguous or paged), and its twin: the
// same case with F64 k and v holding the real values, computed by this test's decoders.
struct Problem {
  KvScheme scheme = KvScheme::Scaled;
  DType stored = DType::F8_E4M3, qtype = DType::F32, out = DType::F32;
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1, v_from_k = 0;
  bool paged = false, hnd = false;
  std::int64_t P = 1, width = 1, pages = 1;
  std::vector<std::int32_t> table, seqlens;
  std::string granularity;  // tensor, head, token, broadcast (scaled)
  std::map<std::string, std::string> md;
  std::vector<double> q;
  SafeTensorsFile file;  // the stored case
  std::vector<double> k, v;  // the real values, [B,Hkv,Nk,D]
  double o_scale = 0;        // > 0 with an FP8 out
};

std::uint8_t finite_byte(DType t, std::uint8_t b) {
  if (t == DType::F8_E4M3 && (b & 0x7F) == 0x7F) return b ^ 1;  // not NaN
  if (t == DType::F8_E5M2 && ((b >> 2) & 31) == 31) return b & 0xBF;  // exponent 15
  return b;
}
double element(DType t, std::uint8_t b) {
  return t == DType::F8_E4M3 ? my_e4m3(b) : t == DType::F8_E5M2 ? my_e5m2(b) : my_i8(b);
}
// An F32 number m 2^e, m of 24 bits.
double random_f32(int e_lo, int e_hi) {
  const auto m = *rc::gen::inRange<std::int64_t>(1 << 23, 1 << 24);
  return static_cast<double>(m) * pow2(*rc::gen::inRange(e_lo, e_hi + 1) - 23);
}

Problem random_problem(KvScheme scheme, bool allow_paged, bool view, std::optional<DType> scaled = std::nullopt) {
  Problem p;
  p.scheme = scheme;
  p.stored = scheme == KvScheme::Mxfp8 ? DType::F8_E4M3 : scheme == KvScheme::Nvfp4 ? DType::U8
             : scaled ? *scaled : *rc::gen::element(DType::F8_E4M3, DType::F8_E5M2, DType::I8);
  p.qtype = *rc::gen::element(DType::F32, DType::F16, DType::BF16);
  p.out = *rc::gen::element(DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::F8_E5M2);
  p.B = *rc::gen::inRange<std::int64_t>(1, 3);
  p.Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  p.Hq = p.Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  p.Nq = *rc::gen::inRange<std::int64_t>(1, 4);
  const std::int64_t blk = scheme == KvScheme::Mxfp8 ? 32 : scheme == KvScheme::Nvfp4 ? 16 : 1;
  p.Dk = blk > 1 ? blk * *rc::gen::inRange<std::int64_t>(1, 3) : *rc::gen::inRange<std::int64_t>(1, 7);
  p.Dv = blk > 1 ? blk * *rc::gen::inRange<std::int64_t>(1, 3) : *rc::gen::inRange<std::int64_t>(1, 7);
  if (view) p.v_from_k = p.Dv = *rc::gen::inRange<std::int64_t>(1, p.Dk + 1);
  p.paged = allow_paged && *rc::gen::arbitrary<bool>();
  if (p.paged) {
    p.hnd = *rc::gen::arbitrary<bool>();
    p.P = *rc::gen::inRange<std::int64_t>(1, 4);
    p.width = *rc::gen::inRange<std::int64_t>(1, 4);
    p.Nk = p.P * p.width;
    p.pages = p.B * p.width + 1;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(p.pages));
    std::iota(perm.begin(), perm.end(), 0);
    for (std::size_t a = perm.size(); a-- > 1;)
      std::swap(perm[a], perm[static_cast<std::size_t>(*rc::gen::inRange<std::int64_t>(0, static_cast<std::int64_t>(a) + 1))]);
    p.table.assign(perm.begin(), perm.begin() + p.B * p.width);
    for (std::int64_t b = 0; b < p.B; ++b)
      p.seqlens.push_back(static_cast<std::int32_t>(*rc::gen::inRange<std::int64_t>(0, p.Nk + 1)));
  } else {
    p.Nk = *rc::gen::inRange<std::int64_t>(1, 6);
  }
  p.md = {{"attn.format", "1"}, {"attn.output_dtype", std::string(dtype_name(p.out))},
          {"attn.masked_rows", "zero"},
          {"attn.causal", *rc::gen::element<std::string>("none", "top_left", "bottom_right")}};
  const bool fp8_out = is_fp8(p.out);
  p.md["attn.outputs"] = fp8_out ? *rc::gen::element<std::string>("out,amax", "out,lse,amax", "out,weights")
                                 : *rc::gen::element<std::string>("out,lse", "out,weights,lse");
  if (fp8_out)
    p.o_scale = *rc::gen::arbitrary<bool>() ? pow2(*rc::gen::inRange(-4, 4)) : random_f32(-6, 2);

  // The file's rows of keys: [B,Hkv,Nk] contiguous, the cache's [Npages,P,Hkv] or [Npages,Hkv,P].
  const std::int64_t rows = p.paged ? p.pages * p.P * p.Hkv : p.B * p.Hkv * p.Nk;
  auto row_of = [&](std::int64_t b, std::int64_t g, std::int64_t j) -> std::int64_t {
    if (!p.paged) return (b * p.Hkv + g) * p.Nk + j;
    if (j >= p.seqlens[static_cast<std::size_t>(b)]) return -1;
    const std::int64_t page = p.table[static_cast<std::size_t>(b * p.width + j / p.P)], slot = j % p.P;
    return p.hnd ? (page * p.Hkv + g) * p.P + slot : (page * p.P + slot) * p.Hkv + g;
  };
  std::vector<char> used(static_cast<std::size_t>(rows), 0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t g = 0; g < p.Hkv; ++g)
      for (std::int64_t j = 0; j < p.Nk; ++j)
        if (const auto r = row_of(b, g, j); r >= 0) used[static_cast<std::size_t>(r)] = 1;
  const std::string kn = p.paged ? "k_cache" : "k", vn = p.paged ? "v_cache" : "v";
  const Shape lead = p.paged ? (p.hnd ? Shape{p.pages, p.Hkv, p.P} : Shape{p.pages, p.P, p.Hkv}) : Shape{p.B, p.Hkv, p.Nk};
  auto with = [&](std::int64_t last) {
    Shape s = lead;
    s.push_back(last);
    return s;
  };
  SafeTensorsFile& f = p.file;
  f.metadata = p.md;
  if (p.paged && p.hnd) f.metadata["attn.kv_layout"] = "HND";
  if (scheme == KvScheme::Mxfp8) f.metadata["attn.kv_block_scale"] = "mxfp8";
  if (scheme == KvScheme::Nvfp4) f.metadata["attn.kv_block_scale"] = "nvfp4";
  if (view) f.metadata["attn.v_from_k"] = std::to_string(p.v_from_k);
  p.q.resize(static_cast<std::size_t>(p.B * p.Hq * p.Nq * p.Dk));
  for (auto& x : p.q) x = static_cast<double>(*rc::gen::inRange(-8, 9)) / 8;
  f.put(floats("q", p.qtype, {p.B, p.Hq, p.Nq, p.Dk}, p.q));
  if (fp8_out) f.put(f32("o_scale", {}, {p.o_scale}));
  if (p.paged) {
    RawTensor t{"block_table", DType::I32, {p.B, p.width}, {}};
    t.data.resize(4 * p.table.size());
    std::memcpy(t.data.data(), p.table.data(), t.data.size());
    f.put(t);
    RawTensor l{"seqlens_k", DType::I32, {p.B}, {}};
    l.data.resize(4 * p.seqlens.size());
    std::memcpy(l.data.data(), p.seqlens.data(), l.data.size());
    f.put(l);
  }
  // One side (k or v): elements and scales written to the file, real values returned.
  auto side = [&](const std::string& name, const std::string& prefix, std::int64_t D) {
    const std::int64_t per = scheme == KvScheme::Nvfp4 ? 2 : 1, nb = blk > 1 ? D / blk : 0;
    Bytes el(static_cast<std::size_t>(rows * D / per)), bs(static_cast<std::size_t>(rows * nb));
    for (std::size_t e = 0; e < el.size(); ++e) {
      const auto b = *rc::gen::arbitrary<std::uint8_t>();
      // unused slots of a cache may hold anything (NaN included)
      el[e] = used[e / static_cast<std::size_t>(D / per)] || scheme == KvScheme::Nvfp4 ? finite_byte(p.stored, b) : b;
    }
    for (std::size_t e = 0; e < bs.size(); ++e) {
      const bool u = used[e / static_cast<std::size_t>(nb)];
      bs[e] = scheme == KvScheme::Mxfp8 ? (u ? static_cast<std::uint8_t>(*rc::gen::inRange(113, 121)) : 255)
                                        : (u ? static_cast<std::uint8_t>(*rc::gen::inRange(0, 0x41)) : 0xFF);
    }
    f.put(bytes(name, p.stored, with(D / per), el));
    // Per-key scale (scaled): the tensor and the element a row reads.
    std::vector<double> scale;
    Shape sshape;
    std::function<std::size_t(std::int64_t, std::int64_t)> pick;  // (row, g) -> element
    double global = 1;
    if (scheme == KvScheme::Scaled) {
      const std::string gr = *rc::gen::element<std::string>("tensor", "head", "token", "broadcast");
      p.granularity = gr;
      const int e_hi = p.stored == DType::F8_E5M2 ? -14 : p.stored == DType::I8 ? -5 : -7;
      if (gr == "tensor") {
        sshape = {}, scale = {random_f32(e_hi - 2, e_hi)};
        pick = [](std::int64_t, std::int64_t) { return std::size_t{0}; };
      } else if (gr == "head" || gr == "broadcast") {
        // per head: [1,Hkv,1,1], or broadcast from fewer dimensions ([Hkv,1] and the cache's)
        sshape = p.paged ? (p.hnd ? Shape{p.Hkv, 1} : Shape{1, p.Hkv}) : (gr == "head" ? Shape{1, p.Hkv, 1, 1} : Shape{p.Hkv, 1, 1});
        for (std::int64_t g = 0; g < p.Hkv; ++g) scale.push_back(random_f32(e_hi - 2, e_hi));
        pick = [](std::int64_t, std::int64_t g) { return static_cast<std::size_t>(g); };
      } else {
        sshape = p.paged ? lead : with(1);
        for (std::int64_t r = 0; r < rows; ++r)
          scale.push_back(used[static_cast<std::size_t>(r)] ? random_f32(e_hi - 2, e_hi) : *rc::gen::element(0.0, kNaN, -1.0));
        pick = [](std::int64_t r, std::int64_t) { return static_cast<std::size_t>(r); };
      }
      f.put(f32(prefix + "_scale", sshape, scale));
    } else if (scheme == KvScheme::Mxfp8) {
      f.put(bytes(prefix + "_block_scale", DType::U8, with(nb), bs));
    } else {
      f.put(bytes(prefix + "_block_scale", DType::F8_E4M3, with(nb), bs));
      global = random_f32(-8, -5);
      f.put(f32(prefix + "_global_scale", {}, {global}));
    }
    std::vector<double> real(static_cast<std::size_t>(p.B * p.Hkv * p.Nk * D), 0.0);
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t g = 0; g < p.Hkv; ++g)
        for (std::int64_t j = 0; j < p.Nk; ++j) {
          const std::int64_t r = row_of(b, g, j);
          if (r < 0) continue;
          for (std::int64_t d = 0; d < D; ++d) {
            double x;
            if (scheme == KvScheme::Scaled) {
              x = element(p.stored, el[static_cast<std::size_t>(r * D + d)]) * scale[pick(r, g)];
            } else if (scheme == KvScheme::Mxfp8) {
              x = my_e4m3(el[static_cast<std::size_t>(r * D + d)]) * my_e8m0(bs[static_cast<std::size_t>(r * nb + d / blk)]);
            } else {
              const std::uint8_t byte = el[static_cast<std::size_t>(r * D / 2 + d / 2)];
              x = kE2M1[d % 2 ? byte >> 4 : byte & 15] * my_e4m3(bs[static_cast<std::size_t>(r * nb + d / blk)]) * global;
            }
            real[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * D + d)] = x;
          }
        }
    return real;
  };
  p.k = side(kn, "k", p.Dk);
  if (view) {
    for (std::int64_t r = 0; r < p.B * p.Hkv * p.Nk; ++r)
      for (std::int64_t d = 0; d < p.Dv; ++d) p.v.push_back(p.k[static_cast<std::size_t>(r * p.Dk + d)]);
  } else {
    p.v = side(vn, "v", p.Dv);
  }
  return p;
}

// The twin: F64 q, k and v of the real values, contiguous, under the same metadata but the form's.
SafeTensorsFile twin(const Problem& p, DType out) {
  SafeTensorsFile f;
  f.metadata = p.md;
  f.metadata["attn.output_dtype"] = std::string(dtype_name(out));
  if (out == DType::F64) f.metadata["attn.outputs"] = "out";
  f.put(floats("q", DType::F64, {p.B, p.Hq, p.Nq, p.Dk}, p.q));  // the same values (inputs share a dtype)
  f.put(floats("k", DType::F64, {p.B, p.Hkv, p.Nk, p.Dk}, p.k));
  f.put(floats("v", DType::F64, {p.B, p.Hkv, p.Nk, p.Dv}, p.v));
  if (p.o_scale > 0 && out != DType::F64) f.put(f32("o_scale", {}, {p.o_scale}));
  if (p.paged) f.put(*p.file.find("seqlens_k"));
  return f;
}

// x rounded to nearest-even in the FP8 dtype t (E4M3 saturating), by the neighbours on the grid
// of this test's decoder; false when x lies too near a midpoint to be told from it.
bool my_round_fp8(mpfr_srcptr x, DType t, double& r) {
  std::vector<std::pair<double, int>> grid;  // finite non-negative values and their patterns
  for (int b = 0; b < 128; ++b) {
    const double v = t == DType::F8_E4M3 ? my_e4m3(static_cast<std::uint8_t>(b)) : my_e5m2(static_cast<std::uint8_t>(b));
    if (std::isfinite(v)) grid.emplace_back(v, b);
  }
  if (t == DType::F8_E5M2) grid.emplace_back(65536.0, 0x7C);  // infinity's place on the grid
  const bool neg = mpfr_sgn(x) < 0;
  if (mpfr_zero_p(x)) {
    r = 0;
    return true;
  }
  mpfr_t a, d;
  mpfr_init2(a, mpfr_get_prec(x));
  mpfr_init2(d, mpfr_get_prec(x));
  mpfr_abs(a, x, MPFR_RNDN);
  std::size_t lo = 0;  // the largest grid value <= |x|
  while (lo + 1 < grid.size() && mpfr_cmp_d(a, grid[lo + 1].first) >= 0) ++lo;
  double v = grid[lo].first;
  bool near = false;
  if (lo + 1 < grid.size()) {
    const double mid = (grid[lo].first + grid[lo + 1].first) / 2;  // exact
    mpfr_sub_d(d, a, mid, MPFR_RNDN);
    near = mpfr_zero_p(d) || mpfr_get_exp(d) < mpfr_get_exp(a) - 100;
    if (mpfr_sgn(d) > 0) v = grid[lo + 1].first;
  } else if (t == DType::F8_E4M3) {
    v = 448;  // saturation
  }
  mpfr_clear(a);
  mpfr_clear(d);
  if (near) return false;
  if (t == DType::F8_E5M2 && v == 65536.0) v = INFINITY;
  r = neg ? -v : v;
  return true;
}

void check_problem(const Problem& p) {
  const EvalResult a = eval(p.file), b = eval(twin(p, p.out));
  RC_ASSERT(a.golden.size() == b.golden.size());
  for (std::size_t t = 0; t < a.golden.size(); ++t) {
    RC_ASSERT(a.golden[t].name == b.golden[t].name);
    RC_ASSERT(a.golden[t].dtype == b.golden[t].dtype);
    RC_ASSERT(a.golden[t].shape == b.golden[t].shape);
    RC_ASSERT(a.golden[t].data == b.golden[t].data);  // byte for byte
  }
  if (!is_fp8(p.out)) return;
  // FP8 out and amax by this test's own rounding of O = out.ref + out.ref_lo of the F64 twin.
  const EvalResult w = eval(twin(p, DType::F64));
  const std::vector<double> ref = values(golden(w, "out")), lo = values(golden(w, "out.ref_lo"));
  const std::vector<double> got = values(golden(a, "out"));
  mpfr_t x, m;
  mpfr_init2(x, 400);
  mpfr_init2(m, 400);
  mpfr_set_zero(m, 1);
  for (std::size_t e = 0; e < ref.size(); ++e) {
    mpfr_set_d(x, ref[e], MPFR_RNDN);
    mpfr_add_d(x, x, lo[e], MPFR_RNDN);  // exact at 400 bits
    if (mpfr_cmpabs(x, m) > 0) mpfr_abs(m, x, MPFR_RNDN);
    mpfr_div_d(x, x, p.o_scale, MPFR_RNDN);
    double want;
    if (my_round_fp8(x, p.out, want)) RC_ASSERT(same(got[e], want) || (got[e] == 0 && want == 0));
  }
  if (p.md.at("attn.outputs").find("amax") != std::string::npos) {
    const double amax = values(golden(a, "amax"))[0];
    if (mpfr_zero_p(m)) {
      RC_ASSERT(amax == 0);
    } else {
      // the F32 neighbours f0 <= max |O| < f1, and their midpoint (exact in F64)
      const double d = mpfr_get_d(m, MPFR_RNDZ);
      float f0 = static_cast<float>(d);
      if (static_cast<double>(f0) > d) f0 = std::nextafter(f0, 0.0f);
      const float f1 = std::nextafter(f0, INFINITY);
      mpfr_sub_d(x, m, (static_cast<double>(f0) + static_cast<double>(f1)) / 2, MPFR_RNDN);
      if (!mpfr_zero_p(x) && mpfr_get_exp(x) >= mpfr_get_exp(m) - 100)
        RC_ASSERT(amax == static_cast<double>(mpfr_sgn(x) > 0 ? f1 : f0));
    }
  }
  mpfr_clear(x);
  mpfr_clear(m);
}

// Three problems per run: 300 per format at RapidCheck's 100 runs, two in five with an FP8 out.
RC_GTEST_PROP(QuantizedKvProperty, ScaledE4M3EqualsItsDequantizedTwin, ()) {
  for (int n = 0; n < 3; ++n) check_problem(random_problem(KvScheme::Scaled, true, false, DType::F8_E4M3));
}
RC_GTEST_PROP(QuantizedKvProperty, ScaledE5M2EqualsItsDequantizedTwin, ()) {
  for (int n = 0; n < 3; ++n) check_problem(random_problem(KvScheme::Scaled, true, false, DType::F8_E5M2));
}
RC_GTEST_PROP(QuantizedKvProperty, ScaledI8EqualsItsDequantizedTwin, ()) {
  for (int n = 0; n < 3; ++n) check_problem(random_problem(KvScheme::Scaled, true, false, DType::I8));
}
RC_GTEST_PROP(QuantizedKvProperty, Mxfp8EqualsItsDequantizedTwin, ()) {
  for (int n = 0; n < 3; ++n) check_problem(random_problem(KvScheme::Mxfp8, true, false));
}
RC_GTEST_PROP(QuantizedKvProperty, Nvfp4EqualsItsDequantizedTwin, ()) {
  for (int n = 0; n < 3; ++n) check_problem(random_problem(KvScheme::Nvfp4, true, false));
}
RC_GTEST_PROP(QuantizedKvProperty, VFromKEqualsItsTwin, ()) {
  for (int n = 0; n < 3; ++n)
    check_problem(random_problem(*rc::gen::element(KvScheme::Scaled, KvScheme::Mxfp8, KvScheme::Nvfp4), true, true));
}

}  // namespace
}  // namespace attnoracle::testing
