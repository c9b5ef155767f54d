// End to end: `attnoracle eval` on quantized and block-scaled K/V, v as a view of k, and FP8
// outputs (CONTRACT section 9): each form evaluates under the oracle, and every refusal is one
// line naming the tensor or key, exit status 2, and no output file.

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "eval_cli.hpp"

namespace attnoracle::testing {
namespace {

namespace fs = std::filesystem;
using Shape = std::vector<std::int64_t>;
using Bytes = std::vector<unsigned char>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

RawTensor floats(const std::string& name, Shape shape, const std::function<double(std::size_t)>& value,
                 DType t = DType::F32) {
  RawTensor r{name, t, std::move(shape), {}};
  const auto n = static_cast<std::size_t>(r.numel());
  r.data.resize(dtype_size(t) * n);
  for (std::size_t e = 0; e < n; ++e) {
    const double x = t == DType::F32 ? static_cast<double>(static_cast<float>(value(e))) : value(e);  // F32's nearest
    encode_float(t, x, r.data.data() + dtype_size(t) * e);
  }
  return r;
}
RawTensor scalar(const std::string& name, double x) { return floats(name, {}, [x](std::size_t) { return x; }); }
RawTensor bytes(const std::string& name, DType t, Shape shape, const std::function<unsigned char(std::size_t)>& b) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(static_cast<std::size_t>(r.numel()));
  for (std::size_t e = 0; e < r.data.size(); ++e) r.data[e] = b(e);
  return r;
}
RawTensor ints(const std::string& name, Shape shape, const std::vector<std::int32_t>& v) {
  RawTensor r{name, DType::I32, std::move(shape), {}};
  r.data.resize(4 * v.size());
  std::memcpy(r.data.data(), v.data(), r.data.size());
  return r;
}

double small(std::size_t e) { return 0.25 * static_cast<double>(e % 7) - 0.5; }  // exact in E4M3


// q F32 [1,4,3,4], k F8_E4M3 [1,2,5,4] with per-head scales, v [1,2,5,2] with one scale.
SafeTensorsFile scaled_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "BF16"}, {"attn.outputs", "out,lse"}};
  f.put(floats("q", {1, 4, 3, 4}, small));
  f.put(floats("k", {1, 2, 5, 4}, [](std::size_t e) { return small(e + 2) * 4; }, DType::F8_E4M3));
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return small(e + 1) * 8; }, DType::F8_E4M3));
  f.put(floats("k_scale", {1, 2, 1, 1}, [](std::size_t e) { return 0.25 + 0.125 * static_cast<double>(e); }));
  f.put(scalar("v_scale", 0.1));
  return f;
}

// mxfp8: D = 32, k and v F8_E4M3 [1,2,3,32], E8M0 block scales [1,2,3,1].
SafeTensorsFile mxfp8_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F32"}, {"attn.kv_block_scale", "mxfp8"}};
  f.put(floats("q", {1, 2, 2, 32}, small));
  f.put(floats("k", {1, 2, 3, 32}, small, DType::F8_E4M3));
  f.put(floats("v", {1, 2, 3, 32}, [](std::size_t e) { return small(e + 3); }, DType::F8_E4M3));
  f.put(bytes("k_block_scale", DType::U8, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(125 + e % 3); }));
  f.put(bytes("v_block_scale", DType::U8, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(128 - e % 2); }));
  return f;
}

// nvfp4: D = 16 packed [1,2,3,8], F8_E4M3 block scales [1,2,3,1], global scales.
SafeTensorsFile nvfp4_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F16"}, {"attn.kv_block_scale", "nvfp4"}};
  f.put(floats("q", {1, 2, 2, 16}, small));
  f.put(bytes("k", DType::U8, {1, 2, 3, 8}, [](std::size_t e) { return static_cast<unsigned char>(e * 37 % 256); }));
  f.put(bytes("v", DType::U8, {1, 2, 3, 8}, [](std::size_t e) { return static_cast<unsigned char>(e * 91 % 256); }));
  f.put(bytes("k_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(0x30 + e); }));
  f.put(bytes("v_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(0x38 - e); }));
  f.put(scalar("k_global_scale", 0.25));
  f.put(scalar("v_global_scale", 0.5));
  return f;
}

// v_from_k: k [1,1,3,4], v = k[..., 0:2]; FP8 out with o_scale and amax.
SafeTensorsFile view_fp8_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.v_from_k", "2"}, {"attn.output_dtype", "F8_E4M3"},
                {"attn.outputs", "out,lse,amax"}};
  f.put(floats("q", {1, 2, 2, 4}, small));
  f.put(floats("k", {1, 1, 3, 4}, [](std::size_t e) { return small(e + 1); }));
  f.put(scalar("o_scale", 0.01));
  return f;
}

// A paged cache of I8 with per-slot scales beside the pages (NHD [Npages,P,Hkv]); page 0's
// slot 1 is unused: its scale is NaN.
SafeTensorsFile paged_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F32"}};
  f.put(floats("q", {1, 2, 2, 4}, small));
  f.put(bytes("k_cache", DType::I8, {2, 2, 1, 4}, [](std::size_t e) { return static_cast<unsigned char>(e * 53 % 256); }));
  f.put(bytes("v_cache", DType::I8, {2, 2, 1, 2}, [](std::size_t e) { return static_cast<unsigned char>(e * 29 % 256); }));
  f.put(floats("k_scale", {2, 2, 1}, [](std::size_t e) { return e == 1 ? kNaN : 0.01 * static_cast<double>(e + 1); }));
  f.put(scalar("v_scale", 0.05));
  f.put(ints("block_table", {1, 2}, {1, 0}));
  f.put(ints("seqlens_k", {1}, {3}));
  return f;
}

using QuantizedEval = EvalCli;

TEST_F(QuantizedEval, EachFormEvaluatesUnderTheOracleInputsUnchanged) {
  const std::pair<const char*, SafeTensorsFile> cases[] = {
      {"scaled", scaled_case()}, {"mxfp8", mxfp8_case()}, {"nvfp4", nvfp4_case()},
      {"view_fp8", view_fp8_case()}, {"paged", paged_case()}};
  for (const auto& [name, f] : cases) {
    const SafeTensorsFile g = evaluated(f, name);
    ASSERT_TRUE(g.find("out")) << name;
    for (const RawTensor& t : f.tensors) {  // the inputs as given
      ASSERT_TRUE(g.find(t.name)) << name << " " << t.name;
      EXPECT_EQ(g.find(t.name)->data, t.data) << name << " " << t.name;
    }
  }
  const SafeTensorsFile g = evaluated(view_fp8_case(), "view_fp8");
  EXPECT_EQ(g.find("out")->dtype, DType::F8_E4M3);
  EXPECT_EQ(g.find("out")->shape, (Shape{1, 2, 2, 2}));
  EXPECT_EQ(g.find("lse")->dtype, DType::F32);
  ASSERT_TRUE(g.find("amax"));
  EXPECT_EQ(g.find("amax")->dtype, DType::F32);
  EXPECT_EQ(g.find("amax")->shape, Shape{});
}

TEST_F(QuantizedEval, ScaledRefusals) {
  const SafeTensorsFile s = scaled_case();
  expect_refused(without(s, "k_scale"), "k_scale", "missing (required for F8_E4M3 k (scaled K/V))");
  expect_refused(without_meta(s, "attn.output_dtype"), "attn.output_dtype", "missing (required for scaled F8_E4M3 K/V)");
  expect_refused(with(s, floats("q", {1, 4, 3, 4}, small, DType::F8_E4M3)), "q", "dtype F8_E4M3 is not F64, F32, F16 or BF16");
  expect_refused(with(s, bytes("q", DType::I8, {1, 4, 3, 4}, [](std::size_t) { return 1; })), "q", "dtype I8 is not supported");
  expect_refused(with(s, floats("k_scale", {3, 1, 1}, small)), "k_scale", "does not broadcast to [B,Hkv,Nk,1]");
  expect_refused(with(s, floats("k_scale", {1, 2, 1, 1}, [](std::size_t e) { return e ? kNaN : 1.0; })), "k_scale",
                 "element 1 is nan, read by key 0 of b=0, kv head 1; scales must be finite and > 0");
  expect_refused(with(s, scalar("v_scale", INFINITY)), "v_scale", "element 0 is inf");
  expect_refused(with(s, scalar("v_scale", -0.5)), "v_scale", "element 0 is -0.5");
  expect_refused(with(s, scalar("v_scale", 0)), "v_scale", "element 0 is 0, read by key 0 of b=0, kv head 0; scales must be finite and > 0");
  expect_refused(with(s, floats("v_scale", {}, small, DType::F64)), "v_scale", "dtype F64 is not F32");
  expect_refused(with(s, floats("v", {1, 2, 5, 2}, small, DType::F8_E5M2)), "v", "dtype F8_E5M2 differs from k's F8_E4M3");
  expect_refused(with(s, bytes("k_block_scale", DType::U8, {1, 2, 5, 1}, [](std::size_t) { return 127; })),
                 "k_block_scale", "given, but F8_E4M3 k (scaled K/V) has no k_block_scale");
  expect_refused(with(s, floats("k_descale", {1, 2}, [](std::size_t) { return 1.0; })), "k_descale", "is for FP8 inputs only");
  expect_refused(with(with_meta(s, "attn.outputs", "out,dq"), floats("dout", {1, 4, 3, 2}, small)), "attn.outputs",
                 "asks for gradients, which are not defined for scaled K/V");
  SafeTensorsFile plain;
  plain.metadata = {{"attn.format", "1"}};
  plain.put(floats("q", {1, 1, 1, 4}, small));
  plain.put(floats("k", {1, 1, 2, 4}, small));
  plain.put(floats("v", {1, 1, 2, 4}, small));
  expect_refused(with(plain, scalar("k_scale", 1)), "k_scale", "given, but k has dtype F32");
}

TEST_F(QuantizedEval, BlockScaleRefusals) {
  const SafeTensorsFile m = mxfp8_case(), n = nvfp4_case();
  expect_refused(with_meta(m, "attn.kv_block_scale", "mxfp4"), "attn.kv_block_scale", "value \"mxfp4\" is not mxfp8 or nvfp4");
  expect_refused(with(m, bytes("k_block_scale", DType::U8, {1, 2, 3, 1}, [](std::size_t e) { return e == 4 ? 255 : 127; })),
                 "k_block_scale", "element 4 is 255, the E8M0 NaN, read by key 1 of b=0, kv head 1");
  expect_refused(with(m, bytes("v_block_scale", DType::U8, {1, 2, 3, 2}, [](std::size_t) { return 127; })),
                 "v_block_scale", "is not v's with D / 32 in the last dimension = [1,2,3,1]");
  expect_refused(without(m, "v_block_scale"), "v_block_scale", "missing (required for attn.kv_block_scale mxfp8)");
  expect_refused(with(with(m, floats("k", {1, 2, 3, 32}, small, DType::F8_E5M2)), floats("v", {1, 2, 3, 32}, small, DType::F8_E5M2)),
                 "k", "dtype F8_E5M2 is not F8_E4M3");
  SafeTensorsFile d16 = m;
  d16.put(floats("q", {1, 2, 2, 16}, small));
  d16.put(floats("k", {1, 2, 3, 16}, small, DType::F8_E4M3));
  expect_refused(d16, "k", "Dk is 16, not a multiple of 32 (the attn.kv_block_scale mxfp8 block)");
  SafeTensorsFile d8 = n;
  d8.put(floats("q", {1, 2, 2, 8}, small));
  d8.put(bytes("k", DType::U8, {1, 2, 3, 4}, [](std::size_t) { return 0x11; }));
  expect_refused(d8, "k", "Dk is 8, not a multiple of 16 (the attn.kv_block_scale nvfp4 block)");
  expect_refused(with(n, bytes("k", DType::U8, {1, 2, 3, 16}, [](std::size_t) { return 0x11; })), "k",
                 "Dk is 32 (2 per byte) but q has Dk 16");
  expect_refused(with(n, bytes("v_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return e == 2 ? 0xB8 : 0x38; })),
                 "v_block_scale", "element 2 is -1, read by key 2 of b=0, kv head 0; nvfp4 block scales must be >= 0");
  expect_refused(with(n, bytes("k_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return e == 0 ? 0x7F : 0x38; })),
                 "k_block_scale", "element 0 is NaN");
  expect_refused(with(n, scalar("k_global_scale", 0)), "k_global_scale", "element 0 is 0; scales must be finite and > 0");
  expect_refused(with(n, floats("k_global_scale", {1}, [](std::size_t) { return 1.0; })), "k_global_scale", "is not [] (a scalar)");
  expect_refused(without(n, "v_global_scale"), "v_global_scale", "missing (required for attn.kv_block_scale nvfp4)");
  expect_refused(with(n, scalar("k_scale", 1)), "k_scale", "given, but attn.kv_block_scale nvfp4 has no k_scale");
}

TEST_F(QuantizedEval, ViewAndFp8OutputRefusals) {
  const SafeTensorsFile v = view_fp8_case();
  expect_refused(with(v, floats("v", {1, 1, 3, 2}, small)), "v", "given with attn.v_from_k");
  expect_refused(with_meta(v, "attn.v_from_k", "5"), "attn.v_from_k", "value 5 is more than Dk = 4");
  expect_refused(with_meta(v, "attn.v_from_k", "0"), "attn.v_from_k", "is not an integer >= 1");
  expect_refused(with_meta(v, "attn.v_from_k", "two"), "attn.v_from_k", "is not an integer >= 1");
  expect_refused(with(mxfp8_case(), bytes("x", DType::U8, {}, [](std::size_t) { return 0; })), "x", "unknown tensor");
  SafeTensorsFile sv = with_meta(without(scaled_case(), "v"), "attn.v_from_k", "2");
  expect_refused(sv, "v_scale", "given with attn.v_from_k (v is a view of k and takes k's scales)");
  expect_refused(without(v, "o_scale"), "o_scale", "missing (required with attn.output_dtype F8_E4M3)");
  expect_refused(with(v, scalar("o_scale", -1)), "o_scale", "element 0 is -1; o_scale must be finite and > 0");
  expect_refused(with(v, scalar("o_scale", kNaN)), "o_scale", "element 0 is nan");
  expect_refused(with(v, scalar("o_scale", 0)), "o_scale", "element 0 is 0");
  expect_refused(with(v, floats("o_scale", {1}, [](std::size_t) { return 1.0; })), "o_scale", "is not [] (a scalar)");
  expect_refused(with_meta(v, "attn.output_dtype", "F32"), "attn.outputs", "asks for amax, which needs attn.output_dtype");
  expect_refused(with_meta(with_meta(v, "attn.output_dtype", "F32"), "attn.outputs", "out"), "o_scale",
                 "given, but out's dtype is F32");
  expect_refused(with(with_meta(v, "attn.outputs", "out,dq"), floats("dout", {1, 2, 2, 2}, small)), "attn.outputs",
                 "asks for gradients, which FP8 outputs (attn.output_dtype F8_E4M3) do not have");
}

// FP8 q, k with the 1.1 descales and v a view of k: k_descale scales the view too.
SafeTensorsFile fp8_view_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.v_from_k", "3"}, {"attn.output_dtype", "F32"}};
  f.put(floats("q", {1, 2, 2, 4}, small, DType::F8_E4M3));
  f.put(floats("k", {1, 1, 3, 4}, [](std::size_t e) { return small(e + 2); }, DType::F8_E4M3));
  f.put(floats("k_descale", {1, 1}, [](std::size_t) { return 0.375; }));
  return f;
}

TEST_F(QuantizedEval, Fp8ViewWithDescales) {
  const SafeTensorsFile g = evaluated(fp8_view_case(), "fp8_view");
  ASSERT_TRUE(g.find("out"));
  EXPECT_EQ(g.find("out")->shape, (Shape{1, 2, 2, 3}));
  expect_refused(with(fp8_view_case(), floats("v_descale", {1, 1}, [](std::size_t) { return 1.0; })), "v_descale",
                 "given with attn.v_from_k (v is a view of k and takes k_descale)");
}

TEST_F(QuantizedEval, StoredFormsAreForKindSdpa) {
  SafeTensorsFile mha;
  mha.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}, {"attn.v_from_k", "2"}};
  mha.put(floats("x_q", {1, 2, 4}, small));
  expect_refused(mha, "attn.v_from_k", "is for attn.kind sdpa only");
  mha.metadata.erase("attn.v_from_k");
  mha.metadata["attn.kv_block_scale"] = "mxfp8";
  expect_refused(mha, "attn.kv_block_scale", "is for attn.kind sdpa only");
  mha.metadata.erase("attn.kv_block_scale");
  mha.metadata["attn.output_dtype"] = "F8_E4M3";
  expect_refused(mha, "attn.output_dtype", "value \"F8_E4M3\" is for attn.kind sdpa only");
}

TEST_F(QuantizedEval, TensorShapeAndDtypeRefusals) {
  const SafeTensorsFile s = scaled_case();
  auto e4m3 = [](const std::string& name, Shape shape) { return floats(name, std::move(shape), small, DType::F8_E4M3); };
  expect_refused(without(s, "k"), "k", "missing (required for attn.kind sdpa)");
  expect_refused(without(s, "v"), "v", "missing (required for attn.kind sdpa; attn.v_from_k makes v a view of k)");
  expect_refused(with(s, e4m3("k", {2, 5, 4})), "k", "shape [2,5,4] has rank 3, expected 4 [B,Hkv,Nk,D]");
  expect_refused(with(s, e4m3("v", {1, 2, 5, 0})), "v", "has dimension 3 equal to 0; only B and Nk may be 0");
  expect_refused(with(with(s, e4m3("k", {2, 2, 5, 4})), e4m3("v", {2, 2, 5, 2})), "k", "B is 2 but q has B 1");
  expect_refused(with(s, e4m3("v", {1, 2, 4, 2})), "v", "does not match k's [1,2,5,4] in Hkv and Nk");
  expect_refused(with(with(with(s, e4m3("k", {1, 3, 5, 4})), e4m3("v", {1, 3, 5, 2})), floats("k_scale", {}, small)),
                 "k", "Hkv is 3, which does not divide Hq 4 of q");
  expect_refused(with(with(nvfp4_case(), floats("k", {1, 2, 3, 16}, small, DType::F8_E4M3)),
                      floats("v", {1, 2, 3, 16}, small, DType::F8_E4M3)),
                 "k",
                 "dtype F8_E4M3 is not U8 (attn.kv_block_scale nvfp4");
  expect_refused(without_meta(nvfp4_case(), "attn.kv_block_scale"), "k_block_scale",
                 "given, but k has dtype U8 (scales are for I8, F8_E4M3 and F8_E5M2 K/V, or attn.kv_block_scale)");
  SafeTensorsFile u8;
  u8.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F32"}};
  u8.put(floats("q", {1, 1, 1, 4}, small));
  u8.put(bytes("k", DType::U8, {1, 1, 2, 2}, [](std::size_t) { return 0x11; }));
  u8.put(bytes("v", DType::U8, {1, 1, 2, 2}, [](std::size_t) { return 0x11; }));
  expect_refused(u8, "k", "dtype U8 is for attn.kv_block_scale nvfp4 (E2M1 packed two per byte)");
  expect_refused(with(view_fp8_case(), floats("k", {1, 1, 3, 4}, small, DType::F16)), "k", "dtype F16 differs from q's F32");
  expect_refused(with(view_fp8_case(), floats("o_scale", {}, small, DType::F64)), "o_scale", "dtype F64 is not F32");
}

TEST_F(QuantizedEval, PagedRefusals) {
  const SafeTensorsFile p = paged_case();
  // the unused slot's NaN scale is not read; a used slot's is refused, named in the scale tensor
  expect_refused(with(p, floats("k_scale", {2, 2, 1}, [](std::size_t e) { return e == 2 ? kNaN : 1.0; })), "k_scale",
                 "element 2 is nan, read by key 0 of b=0, kv head 0");
  expect_refused(with(p, floats("k_scale", {2, 2, 2}, [](std::size_t) { return 1.0; })), "k_scale",
                 "does not broadcast to [Npages,P,Hkv]");
  expect_refused(with(p, ints("block_table", {1, 2}, {1, 5})), "block_table", "entry [0, 1] = 5 is outside [0, 2)");
}

}  // namespace
}  // namespace attnoracle::testing
