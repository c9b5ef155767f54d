// Case files (CONTRACT sections 1 and 2): one test per refusal, broadcasting lookups and the
// causal and window rules worked by hand.
#include "attnoracle/reference/case_file.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attnoracle/reference/error.hpp"

namespace attnoracle::testing {
namespace {

using Shape = std::vector<std::int64_t>;
const std::string kPath = "case.safetensors";
constexpr double kInf = std::numeric_limits<double>::infinity();

// Small multiples of 1/4: exact in every input format.
RawTensor floats(const std::string& name, Shape shape, DType dtype = DType::F32,
                 std::vector<double> values = {}) {
  RawTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const auto n = static_cast<std::size_t>(t.numel());
  if (values.empty())
    for (std::size_t e = 0; e < n; ++e) values.push_back(0.25 * static_cast<double>(e % 9) - 1);
  const std::size_t size = dtype_size(dtype);
  t.data.resize(n * size);
  for (std::size_t e = 0; e < n; ++e) encode_float(dtype, values.at(e), t.data.data() + e * size);
  return t;
}

RawTensor bools(const std::string& name, Shape shape, std::vector<unsigned char> values = {}) {
  RawTensor t;
  t.name = name;
  t.dtype = DType::BOOL;
  t.shape = std::move(shape);
  t.data =
      values.empty() ? std::vector<unsigned char>(static_cast<std::size_t>(t.numel()), 1) : values;
  return t;
}

struct Dims {
  std::int64_t B = 2, Hq = 4, Hkv = 2, Nq = 3, Nk = 5, Dk = 2, Dv = 3;
};

SafeTensorsFile sdpa(Dims d = {}, DType dtype = DType::F32) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(floats("q", {d.B, d.Hq, d.Nq, d.Dk}, dtype));
  f.put(floats("k", {d.B, d.Hkv, d.Nk, d.Dk}, dtype));
  f.put(floats("v", {d.B, d.Hkv, d.Nk, d.Dv}, dtype));
  return f;
}

// B=2, H=3, Nq=4, Nk=5, D=6, Dk=2, Dv=3, Dout=7
SafeTensorsFile mha(DType dtype = DType::F32) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}};
  f.put(floats("x_q", {2, 4, 6}, dtype));
  f.put(floats("x_kv", {2, 5, 6}, dtype));
  f.put(floats("w_q", {3, 6, 2}, dtype));
  f.put(floats("w_k", {3, 6, 2}, dtype));
  f.put(floats("w_v", {3, 6, 3}, dtype));
  f.put(floats("w_o", {9, 7}, dtype));
  return f;
}

SafeTensorsFile with_meta(SafeTensorsFile f, const std::string& key, const std::string& value) {
  f.metadata[key] = value;
  return f;
}

SafeTensorsFile with(SafeTensorsFile f, RawTensor t) {
  f.put(std::move(t));
  return f;
}

SafeTensorsFile without(SafeTensorsFile f, const std::string& name) {
  std::erase_if(f.tensors, [&](const RawTensor& t) { return t.name == name; });
  return f;
}

Case accept(SafeTensorsFile f) { return case_from_file(kPath, std::move(f)); }

void expect_refused(SafeTensorsFile f, const std::string& field, const std::string& what) {
  try {
    case_from_file(kPath, std::move(f));
    ADD_FAILURE() << "accepted; expected " << field << ": " << what;
  } catch (const InputError& e) {
    EXPECT_EQ(e.file(), kPath);
    EXPECT_EQ(e.field(), field) << e.message();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.message();
  }
}

// ---- Valid cases ----

// B, Hq, Hkv, Nq, Nk, Dk, Dv, D, Dout
Shape sizes(const Case& c) { return {c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.Dk, c.Dv, c.D, c.Dout}; }

TEST(CaseAccept, SdpaDefaults) {
  const Case c = accept(sdpa());
  EXPECT_EQ(c.path, kPath);
  EXPECT_EQ(c.kind, Kind::Sdpa);
  EXPECT_EQ(c.input_dtype, DType::F32);
  EXPECT_EQ(c.output_dtype, DType::F32);
  EXPECT_FALSE(c.scale);
  EXPECT_FALSE(c.softcap);
  EXPECT_EQ(c.causal, Causal::None);
  EXPECT_FALSE(c.window);
  EXPECT_EQ(c.masked_rows, MaskedRows::Error);
  EXPECT_FALSE(c.want_weights);
  EXPECT_FALSE(c.want_lse);
  EXPECT_EQ(sizes(c), (Shape{2, 4, 2, 3, 5, 2, 3, 0, 0}));
  EXPECT_EQ(c.q.shape, (Shape{2, 4, 3, 2}));
  EXPECT_EQ(c.v.values.size(), 60u);
  EXPECT_EQ(c.q.values[5], 0.25);
  EXPECT_FALSE(c.mask || c.bias || c.query_mask);
  EXPECT_EQ(c.file.tensors.size(), 3u);
}

TEST(CaseAccept, Mha) {
  const Case c = accept(mha(DType::BF16));
  EXPECT_EQ(c.kind, Kind::Mha);
  EXPECT_EQ(c.input_dtype, DType::BF16);
  EXPECT_EQ(sizes(c), (Shape{2, 3, 3, 4, 5, 2, 3, 6, 7}));
  EXPECT_EQ(c.w_o.values.size(), 63u);
  const Case m = accept(with(mha(), bools("mask", {3, 4, 5})));
  EXPECT_TRUE(m.mask);
}

TEST(CaseAccept, DecodesExactly) {
  // Extremes of each format: largest finite, smallest subnormal, -0, a rounded 1/3 or 0.1.
  const std::vector<std::pair<DType, std::vector<double>>> cases = {
      {DType::F64, {0.1, -0.0, 0x1p-1074, 0x1.fffffffffffffp1023}},
      {DType::F32, {double(0.1f), -0.0, 0x1p-149, 0x1.fffffep127}},
      {DType::F16, {0.333251953125, -0.0, 0x1p-24, 65504}},
      {DType::BF16, {0.333984375, -0.0, 0x1p-133, 0x1.fep127}},
  };
  Dims d;
  d.B = d.Hq = d.Hkv = d.Nq = d.Dv = 1;
  d.Nk = d.Dk = 2;
  for (const auto& [t, values] : cases) {
    const Case c = accept(with(sdpa(d, t), floats("k", {1, 1, 2, 2}, t, values)));
    EXPECT_EQ(c.k.values, values) << dtype_name(t);
    EXPECT_EQ(c.k.dtype, t);
    EXPECT_TRUE(std::signbit(c.k.values[1]));
  }
}

TEST(CaseAccept, GoldenTensorsDropped) {
  auto f = sdpa();
  for (const char* name :
       {"out", "out.ref", "out.ref_lo", "out.bound", "row.valid", "weights", "weights.ref", "lse",
        "lse.ref", "out.undecided", "out.alt", "weights.ref.alt", "lse.undecided"})
    f.put(floats(name, {1}));
  f.metadata["attn.reference"] = "attnoracle 0.1.0";
  f.metadata["attn.undecided"] = "0";
  f.metadata["user.note"] = "kept";
  const Case c = accept(f);
  ASSERT_EQ(c.file.tensors.size(), 3u);
  for (const auto& t : c.file.tensors) EXPECT_TRUE(t.name == "q" || t.name == "k" || t.name == "v");
  EXPECT_EQ(c.file.metadata,
            (std::map<std::string, std::string>{{"attn.format", "1"}, {"user.note", "kept"}}));
}

TEST(IsGoldenTensorName, Names) {
  for (const char* name : {"out", "out.ref", "out.ref_lo", "out.bound", "row.valid", "weights",
                           "weights.ref", "lse", "lse.ref", "out.undecided", "lse.ref.alt"})
    EXPECT_TRUE(is_golden_tensor_name(name)) << name;
  for (const char* name : {"q", "mask", "out.foo", "outs", ".alt", "out.alt.alt", "x.undecided",
                           "out.ref_lo.undecided.alt"})
    EXPECT_FALSE(is_golden_tensor_name(name)) << name;
}

TEST(CaseTensors, UnknownGoldenLookalike) {
  expect_refused(with(sdpa(), floats("out.foo", {1})), "out.foo", "unknown tensor");
}

// ---- Metadata ----

TEST(CaseMetadata, FormatRequired) {
  auto f = sdpa();
  f.metadata.clear();
  expect_refused(f, "attn.format", "missing");
}

TEST(CaseMetadata, FormatVersion) {
  expect_refused(with_meta(sdpa(), "attn.format", "2"), "attn.format",
                 "format \"2\" is not supported");
  expect_refused(with_meta(sdpa(), "attn.format", "1.0"), "attn.format", "not supported");
}

TEST(CaseMetadata, Kind) {
  expect_refused(with_meta(sdpa(), "attn.kind", "gqa"), "attn.kind",
                 "value \"gqa\" is not sdpa, mha or merge");
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.kind", "sdpa")).kind, Kind::Sdpa);
}

TEST(CaseMetadata, ScaleKeptAsText) {
  for (const char* text : {"0.125", "0x1.8p-3", "-2", "1e-400", "0", "+7.5e+2"})
    EXPECT_EQ(*accept(with_meta(sdpa(), "attn.scale", text)).scale, text);
}

TEST(CaseMetadata, ScaleNotANumber) {
  for (const char* text : {"", "abc", "1.5x", " 1", "1 ", "0.1,2", "1/8"})
    expect_refused(with_meta(sdpa(), "attn.scale", text), "attn.scale",
                   "is not a number (decimal or C hex float)");
}

TEST(CaseMetadata, ScaleNotFinite) {
  for (const char* text : {"inf", "-Infinity", "nan"})
    expect_refused(with_meta(sdpa(), "attn.scale", text), "attn.scale", "is not a finite number");
  // Finite texts beyond F64's range are said to be so, not "not finite".
  for (const std::string& text : {std::string("1e400"), std::string(10000, '1'), std::string("-0x1p1024")})
    expect_refused(with_meta(sdpa(), "attn.scale", text), "attn.scale",
                   "is not a number of magnitude at most 0x1.fffffffffffffp+1023 (the F64 range)");
}

TEST(CaseMetadata, Causal) {
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.causal", "top_left")).causal, Causal::TopLeft);
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.causal", "bottom_right")).causal, Causal::BottomRight);
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.causal", "none")).causal, Causal::None);
  expect_refused(with_meta(sdpa(), "attn.causal", "true"), "attn.causal",
                 "value \"true\" is not none, top_left or bottom_right");
}

TEST(CaseMetadata, Window) {
  const Case c = accept(with_meta(sdpa(), "attn.window", "3,0"));
  EXPECT_TRUE(c.window);
  EXPECT_EQ(c.window_left, 3);
  EXPECT_EQ(c.window_right, 0);
  EXPECT_FALSE(accept(with_meta(sdpa(), "attn.window", "none")).window);
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.window", "999999999999999999,0")).window_left,
            999999999999999999);
}

TEST(CaseMetadata, WindowBad) {
  for (const char* text : {"", "3", "3,", ",3", "a,b", "-1,2", "1,-2", "1,2,3", " 1,2", "1, 2",
                           "+1,2", "1.0,2", "9999999999999999999,0", "None"})
    expect_refused(with_meta(sdpa(), "attn.window", text), "attn.window",
                   "is not none or L,R with L and R non-negative integers");
}

TEST(CaseMetadata, Softcap) {
  for (const char* off : {"0", "0.0", "-0", "0x0p+0", "0e5"})
    EXPECT_FALSE(accept(with_meta(sdpa(), "attn.softcap", off)).softcap) << off;
  for (const char* on : {"30", "0x1.8p4", "1e-400"})
    EXPECT_EQ(*accept(with_meta(sdpa(), "attn.softcap", on)).softcap, on);
}

TEST(CaseMetadata, SoftcapBad) {
  expect_refused(with_meta(sdpa(), "attn.softcap", "-1"), "attn.softcap", "is not a number >= 0");
  expect_refused(with_meta(sdpa(), "attn.softcap", "-1e-400"), "attn.softcap",
                 "is not a number >= 0");
  expect_refused(with_meta(sdpa(), "attn.softcap", "inf"), "attn.softcap",
                 "is not a finite number");
  expect_refused(with_meta(sdpa(), "attn.softcap", "off"), "attn.softcap", "is not a number");
}

TEST(CaseMetadata, MaskedRows) {
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.masked_rows", "zero")).masked_rows, MaskedRows::Zero);
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.masked_rows", "error")).masked_rows, MaskedRows::Error);
  expect_refused(with_meta(sdpa(), "attn.masked_rows", "nan"), "attn.masked_rows",
                 "value \"nan\" is not error or zero");
}

TEST(CaseMetadata, OutputDtype) {
  EXPECT_EQ(accept(sdpa({}, DType::F16)).output_dtype, DType::F16);
  EXPECT_EQ(accept(with_meta(sdpa({}, DType::F16), "attn.output_dtype", "F64")).output_dtype,
            DType::F64);
  EXPECT_EQ(accept(with_meta(sdpa(), "attn.output_dtype", "BF16")).output_dtype, DType::BF16);
  for (const char* bad : {"U8", "I32", "BOOL", "f32", ""})
    expect_refused(with_meta(sdpa(), "attn.output_dtype", bad), "attn.output_dtype",
                   "is not F64, F32, F16, BF16, F8_E4M3 or F8_E5M2");
  // FP8 out (CONTRACT section 9) needs o_scale, and kind sdpa
  expect_refused(with_meta(sdpa(), "attn.output_dtype", "F8_E4M3"), "o_scale",
                 "missing (required with attn.output_dtype F8_E4M3)");
}

TEST(CaseMetadata, Outputs) {
  Case c = accept(with_meta(sdpa(), "attn.outputs", "out,weights,lse"));
  EXPECT_TRUE(c.want_weights && c.want_lse);
  c = accept(with_meta(sdpa(), "attn.outputs", "lse,out"));
  EXPECT_TRUE(!c.want_weights && c.want_lse);
  c = accept(with_meta(sdpa(), "attn.outputs", "out"));
  EXPECT_TRUE(!c.want_weights && !c.want_lse);
}

TEST(CaseMetadata, OutputsBad) {
  expect_refused(with_meta(sdpa(), "attn.outputs", "out,attn"), "attn.outputs", "(\"attn\"?)");
  expect_refused(with_meta(sdpa(), "attn.outputs", "out,,lse"), "attn.outputs", "(\"\"?)");
  expect_refused(with_meta(sdpa(), "attn.outputs", ""), "attn.outputs", "a comma list");
  expect_refused(with_meta(sdpa(), "attn.outputs", "out, lse"), "attn.outputs", "(\" lse\"?)");
  expect_refused(with_meta(sdpa(), "attn.outputs", "out,out"), "attn.outputs", "\"out\" twice");
}

TEST(CaseMetadata, UnknownAttnKey) {
  expect_refused(with_meta(sdpa(), "attn.casual", "top_left"), "attn.casual",
                 "unknown key (did you mean attn.causal?)");
  expect_refused(with_meta(sdpa(), "attn.dropout", "0"), "attn.dropout", "unknown key");
}

TEST(CaseMetadata, OtherKeysIgnored) {
  const Case c = accept(with_meta(with_meta(sdpa(), "format", "pt"), "attn", "x"));
  EXPECT_EQ(c.file.metadata.at("format"), "pt");
}

// ---- Required tensors ----

TEST(CaseTensors, Missing) {
  expect_refused(without(sdpa(), "q"), "q", "missing (required for attn.kind sdpa)");
  expect_refused(without(sdpa(), "k"), "k", "missing");
  expect_refused(without(sdpa(), "v"), "v", "missing");
  expect_refused(without(mha(), "x_kv"), "x_kv", "missing (required for attn.kind mha)");
  expect_refused(without(mha(), "w_o"), "w_o", "missing");
}

TEST(CaseTensors, Unknown) {
  expect_refused(with(sdpa(), floats("qq", {1})), "qq",
                 "unknown tensor (expected q, k, v, and optionally mask, bias, query_mask, seqlens_q, "
                 "seqlens_k, sinks, dout, dropout_mask, rotary_cos, rotary_sin, q_descale, k_descale, "
                 "v_descale, o_scale, k_cache, v_cache, block_table, k_scale, v_scale, k_block_scale, "
                 "v_block_scale, k_global_scale, v_global_scale)");
  expect_refused(with(mha(), floats("k_scale", {1})), "k_scale",
                 "unknown tensor (expected x_q, x_kv, w_q, w_k, w_v, w_o, and optionally mask, bias, "
                 "query_mask, seqlens_q, seqlens_k, sinks, dout, dropout_mask)");
}

TEST(CaseTensors, OtherKind) {
  expect_refused(with(sdpa(), floats("x_q", {1, 3, 2})), "x_q",
                 "is an input of kind mha but attn.kind is sdpa");
  expect_refused(with(mha(), floats("q", {1, 3, 2, 2})), "q",
                 "is an input of kind sdpa but attn.kind is mha");
}

TEST(CaseTensors, UnsupportedDtype) {
  auto f = sdpa();
  RawTensor q = *f.find("q");
  q.dtype = DType::U8;
  q.data.resize(static_cast<std::size_t>(q.numel()));
  expect_refused(with(f, q), "q",
                 "dtype U8 is not supported (inputs must be F64, F32, F16, BF16, F8_E4M3 or F8_E5M2)");
  q.dtype = DType::I32;
  q.data.resize(static_cast<std::size_t>(q.numel()) * 4);
  expect_refused(with(f, q), "q", "dtype I32 is not supported");
}

TEST(CaseTensors, DtypesDiffer) {
  expect_refused(with(sdpa(), floats("v", {2, 2, 5, 3}, DType::F16)), "v",
                 "dtype F16 differs from q's F32");
  expect_refused(with(mha(), floats("w_o", {9, 7}, DType::F64)), "w_o",
                 "dtype F64 differs from x_q's F32");
}

TEST(CaseTensors, InMemoryShapeAgainstBytes) {
  auto f = sdpa();
  f.find("v")->data.pop_back();
  expect_refused(f, "v", "shape [2,2,5,3] does not match its 239 bytes of data");
  f = sdpa();
  f.find("v")->shape[1] = -2;
  expect_refused(f, "v", "does not match");
}

TEST(CaseTensors, Rank) {
  expect_refused(with(sdpa(), floats("q", {4, 3, 2})), "q",
                 "shape [4,3,2] has rank 3, expected 4 [B,Hq,Nq,Dk]");
  expect_refused(with(mha(), floats("w_o", {9, 7, 1})), "w_o", "expected 2 [H*Dv,Dout]");
}

TEST(CaseTensors, ZeroDimension) {
  // B, Nq and Nk may be 0 (empty shapes); heads and widths may not.
  expect_refused(with(sdpa(), floats("k", {2, 0, 5, 2})), "k",
                 "shape [2,0,5,2] has dimension 1 equal to 0");
  expect_refused(with(sdpa(), floats("q", {2, 4, 3, 0})), "q",
                 "shape [2,4,3,0] has dimension 3 equal to 0");
}

TEST(CaseTensors, SdpaShapes) {
  expect_refused(with(sdpa(), floats("k", {1, 2, 5, 2})), "k", "B is 1 but q has B 2");
  expect_refused(with(sdpa(), floats("k", {2, 2, 5, 8})), "k", "Dk is 8 but q has Dk 2");
  expect_refused(with(sdpa(), floats("v", {3, 2, 5, 3})), "v", "B is 3 but q has B 2");
  expect_refused(with(sdpa(), floats("v", {2, 1, 5, 3})), "v", "Hkv is 1 but k has Hkv 2");
  expect_refused(with(sdpa(), floats("v", {2, 2, 4, 3})), "v", "Nk is 4 but k has Nk 5");
}

TEST(CaseTensors, HqMultipleOfHkv) {
  expect_refused(with(with(sdpa(), floats("k", {2, 3, 5, 2})), floats("v", {2, 3, 5, 3})), "k",
                 "Hkv is 3, which does not divide Hq 4 of q");
  Dims mqa;
  mqa.Hkv = 1;
  EXPECT_EQ(accept(sdpa(mqa)).Hkv, 1);
  Dims more_kv;
  more_kv.Hq = 2;
  more_kv.Hkv = 4;
  expect_refused(sdpa(more_kv), "k", "Hkv is 4, which does not divide Hq 2 of q");
}

TEST(CaseTensors, MhaShapes) {
  expect_refused(with(mha(), floats("x_kv", {1, 5, 6})), "x_kv", "B is 1 but x_q has B 2");
  expect_refused(with(mha(), floats("x_kv", {2, 5, 5})), "x_kv", "D is 5 but x_q has D 6");
  expect_refused(with(mha(), floats("w_q", {3, 5, 2})), "w_q", "D is 5 but x_q has D 6");
  expect_refused(with(mha(), floats("w_k", {2, 6, 2})), "w_k", "H is 2 but w_q has H 3");
  expect_refused(with(mha(), floats("w_k", {3, 6, 3})), "w_k", "Dk is 3 but w_q has Dk 2");
  expect_refused(with(mha(), floats("w_v", {3, 7, 3})), "w_v", "D is 7 but x_q has D 6");
  expect_refused(with(mha(), floats("w_v", {4, 6, 3})), "w_v", "H is 4 but w_q has H 3");
  expect_refused(with(mha(), floats("w_o", {8, 7})), "w_o", "dimension 0 is 8 but H*Dv = 3*3 = 9");
}

// ---- mask, bias, query_mask ----

TEST(CaseMask, Shapes) {
  // Every NumPy-broadcastable shape, [B,1,1,Nk] (key padding per batch) and [] included.
  for (Shape s : {Shape{3, 5}, Shape{4, 3, 5}, Shape{1, 3, 5}, Shape{2, 4, 3, 5}, Shape{1, 4, 3, 5},
                  Shape{2, 1, 3, 5}, Shape{1, 1, 3, 5}, Shape{2, 1, 1, 5}, Shape{5}, Shape{1},
                  Shape{}, Shape{3, 1}, Shape{4, 1, 1}, Shape{2, 4, 3, 1}, Shape{1, 1, 1, 1}})
    EXPECT_TRUE(accept(with(sdpa(), bools("mask", s))).mask) << shape_string(s);
}

TEST(CaseMask, KeyPaddingMaskBroadcasts) {
  // [B,1,1,Nk]: batch 0 allows keys 0..2, batch 1 keys 0..4, for every head and query.
  std::vector<unsigned char> values = {1, 1, 1, 0, 0, 1, 1, 1, 1, 1};
  const Case c = accept(with(sdpa(), bools("mask", {2, 1, 1, 5}, values)));
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 5; ++j) {
        EXPECT_EQ(c.mask_at(0, h, i, j), j < 3);
        EXPECT_TRUE(c.mask_at(1, h, i, j));
      }
}

TEST(CaseBias, ScalarBroadcasts) {
  const Case c = accept(with(sdpa(), floats("bias", {}, DType::F32, {0.25})));
  EXPECT_EQ(c.bias_at(1, 3, 2, 4), 0.25);
  EXPECT_EQ(c.bias_at(0, 0, 0, 0), 0.25);
}

TEST(CaseMask, NotBool) {
  expect_refused(with(sdpa(), floats("mask", {3, 5})), "mask", "dtype F32 is not BOOL");
}

TEST(CaseMask, Rank) {
  expect_refused(with(sdpa(), bools("mask", {1, 2, 4, 3, 5})), "mask",
                 "shape [1,2,4,3,5] has rank 5, expected 0 to 4 broadcastable to [B,Hq,Nq,Nk]");
}

TEST(CaseMask, TrailingDims) {
  expect_refused(with(sdpa(), bools("mask", {3, 2})), "mask",
                 "shape [3,2] does not broadcast to [B,Hq,Nq,Nk] = [2,4,3,5]: dimension 1 is 2, "
                 "must be 1 or Nk = 5");
  expect_refused(with(sdpa(), bools("mask", {5, 3})), "mask", "dimension 0 is 5, must be 1 or Nq = 3");
  expect_refused(with(sdpa(), bools("mask", {7})), "mask", "dimension 0 is 7, must be 1 or Nk = 5");
}

TEST(CaseMask, NotBroadcastable) {
  expect_refused(with(sdpa(), bools("mask", {2, 3, 5})), "mask",
                 "shape [2,3,5] does not broadcast to [B,Hq,Nq,Nk] = [2,4,3,5]: dimension 0 is 2, "
                 "must be 1 or Hq = 4");
  expect_refused(with(sdpa(), bools("mask", {4, 4, 3, 5})), "mask",
                 "dimension 0 is 4, must be 1 or B = 2");
}

TEST(CaseMask, BoolBytes) {
  std::vector<unsigned char> values(15, 1);
  values[7] = 2;
  expect_refused(with(sdpa(), bools("mask", {3, 5}, values)), "mask",
                 "element 7 is 2; BOOL elements must be 0 or 1");
}

TEST(CaseBias, Dtypes) {
  EXPECT_TRUE(accept(with(sdpa({}, DType::F16), floats("bias", {5}, DType::F16))).bias);
  EXPECT_TRUE(accept(with(sdpa({}, DType::F16), floats("bias", {5}, DType::F64))).bias);
  EXPECT_TRUE(accept(with(sdpa({}, DType::BF16), floats("bias", {5}, DType::F32))).bias);
  expect_refused(with(sdpa(), floats("bias", {5}, DType::BF16)), "bias",
                 "dtype BF16 is not F64, F32 or F32 (the input dtype)");
  expect_refused(with(sdpa({}, DType::F16), floats("bias", {5}, DType::BF16)), "bias",
                 "dtype BF16 is not F64, F32 or F16");
  expect_refused(with(sdpa(), bools("bias", {5})), "bias", "dtype BOOL is not");
}

TEST(CaseBias, Shapes) {
  for (Shape s : {Shape{}, Shape{1}, Shape{5}, Shape{3, 1}, Shape{3, 5}, Shape{4, 1, 1},
                  Shape{2, 1, 1, 5}, Shape{2, 4, 3, 5}})
    EXPECT_TRUE(accept(with(sdpa(), floats("bias", s))).bias);
  expect_refused(with(sdpa(), floats("bias", {1, 1, 1, 1, 1})), "bias",
                 "shape [1,1,1,1,1] has rank 5, expected 0 to 4 broadcastable to [B,Hq,Nq,Nk]");
  expect_refused(with(sdpa(), floats("bias", {3})), "bias",
                 "shape [3] does not broadcast to [B,Hq,Nq,Nk] = [2,4,3,5]: dimension 0 is 3, "
                 "must be 1 or Nk = 5");
  expect_refused(with(sdpa(), floats("bias", {2, 3, 5})), "bias", "must be 1 or Hq = 4");
}

TEST(CaseBias, Infinities) {
  std::vector<double> values(5, 0.5);
  values[1] = -kInf;
  EXPECT_EQ(accept(with(sdpa(), floats("bias", {5}, DType::F32, values))).bias->values[1], -kInf);
  values[3] = kInf;
  expect_refused(with(sdpa(), floats("bias", {5}, DType::F32, values)), "bias",
                 "element 3 is +infinity, on query 0 of b=0, which is not padding (only -infinity "
                 "is allowed, other than on padding rows)");
  values[3] = std::nan("");
  expect_refused(with(sdpa(), floats("bias", {5}, DType::F64, values)), "bias", "element 3 is NaN");
}

TEST(CaseQueryMask, Shape) {
  EXPECT_TRUE(accept(with(sdpa(), bools("query_mask", {2, 3}))).query_mask);
  expect_refused(with(sdpa(), bools("query_mask", {2, 4})), "query_mask",
                 "shape [2,4] is not [B,Nq] = [2,3]");
  expect_refused(with(sdpa(), bools("query_mask", {1, 3})), "query_mask", "is not [B,Nq]");
  expect_refused(with(sdpa(), bools("query_mask", {3})), "query_mask", "has rank 1, expected 2");
}

TEST(CaseQueryMask, Dtype) {
  expect_refused(with(sdpa(), floats("query_mask", {2, 3})), "query_mask", "dtype F32 is not BOOL");
}

TEST(CaseQueryMask, BoolBytes) {
  expect_refused(with(sdpa(), bools("query_mask", {2, 3}, {1, 1, 0, 255, 1, 1})), "query_mask",
                 "element 3 is 255");
}

// ---- Finiteness ----

TEST(CaseFinite, NaN) {
  std::vector<double> values(48, 1);
  values[17] = std::nan("");
  expect_refused(with(sdpa(), floats("q", {2, 4, 3, 2}, DType::F32, values)), "q",
                 "element 17 is NaN");
}

TEST(CaseFinite, Infinity) {
  std::vector<double> values(40, 1);
  values[39] = kInf;
  expect_refused(with(sdpa(), floats("k", {2, 2, 5, 2}, DType::F32, values)), "k",
                 "element 39 is +infinity");
  values[39] = 1;
  values[0] = -kInf;
  expect_refused(with(sdpa({}, DType::F16), floats("k", {2, 2, 5, 2}, DType::F16, values)), "k",
                 "element 0 is -infinity");
}

// F32 and F64 inputs are widened and checked by blocks of 64 elements, then the rest: q of 160
// elements (two blocks and 32 more) read exactly, subnormals and -0 included, and a non-finite
// element refused by its index in a block, on a block's edge and in the rest.
TEST(CaseFinite, InputsReadByBlocks) {
  Dims d;
  d.Nq = 10;
  for (const DType t : {DType::F32, DType::F64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    std::vector<double> values(160);
    for (std::size_t e = 0; e < values.size(); ++e) values[e] = 0.25 * static_cast<double>(e % 9) - 1;
    values[1] = -0.0;
    values[100] = std::ldexp(1.0, t == DType::F32 ? -140 : -1070);  // subnormal
    const Case c = accept(with(sdpa(d, t), floats("q", {2, 4, 10, 2}, t, values)));
    ASSERT_EQ(c.q.values.size(), values.size());
    for (std::size_t e = 0; e < values.size(); ++e) EXPECT_EQ(c.q.values[e], values[e]) << e;
    EXPECT_TRUE(std::signbit(c.q.values[1]));
    for (const std::size_t at : {std::size_t{5}, std::size_t{63}, std::size_t{64}, std::size_t{130}, std::size_t{159}}) {
      std::vector<double> bad = values;
      bad[at] = at % 2 ? std::nan("") : -kInf;
      expect_refused(with(sdpa(d, t), floats("q", {2, 4, 10, 2}, t, bad)), "q",
                     "element " + std::to_string(at) + " is " + (at % 2 ? "NaN" : "-infinity"));
    }
  }
}

TEST(CaseFinite, MhaWeights) {
  std::vector<double> values(63, 0);
  values[62] = std::nan("");
  expect_refused(with(mha(DType::BF16), floats("w_o", {9, 7}, DType::BF16, values)), "w_o",
                 "element 62 is NaN");
}

// ---- Non-finite values at unused positions (sdpa: B=2, Hq=4, Hkv=2, Nq=3, Nk=5, Dk=2, Dv=3) ----

// The sdpa case with element e of `name` (of that shape) set to x.
SafeTensorsFile poisoned(SafeTensorsFile f, const std::string& name, Shape shape, std::size_t e,
                         double x = std::nan("")) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  std::vector<double> values(n, 0.5);
  values.at(e) = x;
  return with(std::move(f), floats(name, std::move(shape), DType::F32, values));
}

TEST(CaseUnused, MaskedKeyMayHoldNaN) {
  // mask [Nk]: key 4 masked for every query; its k and v rows (b=1, kv head 0) hold NaN and
  // infinity. The case holds 0 there instead.
  SafeTensorsFile f = with(sdpa(), bools("mask", {5}, {1, 1, 1, 1, 0}));
  f = poisoned(f, "k", {2, 2, 5, 2}, (1 * 2 + 0) * 10 + 4 * 2 + 1);
  f = poisoned(f, "v", {2, 2, 5, 3}, (1 * 2 + 0) * 15 + 4 * 3, kInf);
  const Case c = accept(f);
  EXPECT_EQ(c.k.values[29], 0);
  EXPECT_EQ(c.v.values[42], 0);
  for (std::int64_t i = 0; i < 3; ++i) EXPECT_TRUE(c.row_has_key(1, 0, i));
}

TEST(CaseUnused, KeyBeyondCausalMayHoldNaN) {
  // top_left causal, Nq = 3 < Nk = 5: keys 3 and 4 are seen by no query.
  SafeTensorsFile f = with_meta(sdpa(), "attn.causal", "top_left");
  EXPECT_NO_THROW(accept(poisoned(f, "v", {2, 2, 5, 3}, 4 * 3)));
  expect_refused(poisoned(f, "v", {2, 2, 5, 3}, 2 * 3), "v",
                 "element 6 is NaN, in key 2 of b=0, kv head 0, which query 2 of head 0 attends "
                 "(non-finite values are allowed only at unused positions)");
}

TEST(CaseUnused, AttendedKeyIsRefused) {
  // Key 4 masked for head 0 only: head 1 reads the same kv head and attends it.
  std::vector<unsigned char> m(4 * 5, 1);
  m[4] = 0;  // mask [Hq, 1, Nk]: head 0, key 4
  SafeTensorsFile f = with(sdpa(), bools("mask", {4, 1, 5}, m));
  expect_refused(poisoned(f, "k", {2, 2, 5, 2}, 8), "k",
                 "element 8 is NaN, in key 4 of b=0, kv head 0, which query 0 of head 1 attends");
  m[5 + 4] = 0;  // head 1 too: now unused
  f = with(sdpa(), bools("mask", {4, 1, 5}, m));
  EXPECT_NO_THROW(accept(poisoned(f, "k", {2, 2, 5, 2}, 8)));
}

TEST(CaseUnused, MinusInfinityBiasFreesAKey) {
  std::vector<double> b(5, 0);
  b[2] = -kInf;
  SafeTensorsFile f = with(sdpa(), floats("bias", {5}, DType::F32, b));
  EXPECT_NO_THROW(accept(poisoned(f, "v", {2, 2, 5, 3}, 2 * 3 + 1, -kInf)));
}

TEST(CaseUnused, PaddingQueryMayHoldNaN) {
  // query 1 of batch 0 is padding: its q rows (every head) may hold anything; its row is then
  // masked out (zeros, row.valid false) and query 0 keeps its keys.
  SafeTensorsFile f = with(sdpa(), bools("query_mask", {2, 3}, {1, 0, 1, 1, 1, 1}));
  const std::size_t e = ((0 * 4 + 2) * 3 + 1) * 2;  // q[0, 2, 1, 0]
  const Case c = accept(poisoned(f, "q", {2, 4, 3, 2}, e));
  EXPECT_EQ(c.q.values[e], 0);
  EXPECT_FALSE(c.row_has_key(0, 2, 1));
  EXPECT_TRUE(c.row_has_key(0, 1, 1));  // another head of the same query: its q is finite
  EXPECT_TRUE(c.row_has_key(0, 2, 0));
  EXPECT_EQ(c.first_refused_row(), std::nullopt);
  expect_refused(poisoned(f, "q", {2, 4, 3, 2}, e - 2), "q",
                 "element 12 is NaN, in query 0 of b=0, h=2, which is not padding (non-finite "
                 "values are allowed only at unused positions)");
}

TEST(CaseUnused, KeyOnlyPaddingAttendsMasksThatRow) {
  // Key 4 allowed only to query 1 of batch 0 (padding), by a mask [B,1,Nq,Nk]: NaN there is
  // accepted, and that padding row of the heads reading the kv head is masked out.
  std::vector<unsigned char> m(2 * 3 * 5, 1);
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i) m[static_cast<std::size_t>((b * 3 + i) * 5 + 4)] = b == 0 && i == 1;
  SafeTensorsFile f = with(with(sdpa(), bools("mask", {2, 1, 3, 5}, m)),
                           bools("query_mask", {2, 3}, {1, 0, 1, 1, 1, 1}));
  const Case c = accept(poisoned(f, "v", {2, 2, 5, 3}, 4 * 3));  // b=0, kv head 0, key 4
  EXPECT_FALSE(c.row_has_key(0, 0, 1));
  EXPECT_FALSE(c.row_has_key(0, 1, 1));
  EXPECT_TRUE(c.row_has_key(0, 2, 1));  // kv head 1 has no NaN
}

TEST(CaseUnused, BiasOnPaddingRows) {
  // bias [B,1,Nq,1]: entry (b=0, i=1) covers only padding rows; (b=0, i=0) does not.
  SafeTensorsFile f = with(sdpa(), bools("query_mask", {2, 3}, {1, 0, 1, 1, 1, 1}));
  const Case c = accept(poisoned(f, "bias", {2, 1, 3, 1}, 1, kInf));
  EXPECT_EQ(c.bias->values[1], 0);
  EXPECT_FALSE(c.row_has_key(0, 3, 1));
  expect_refused(poisoned(f, "bias", {2, 1, 3, 1}, 0), "bias",
                 "element 0 is NaN, on query 0 of b=0, which is not padding");
  // bias [Nq, 1]: entry i=1 covers query 1 of batch 1 as well, which is not padding
  expect_refused(poisoned(f, "bias", {3, 1}, 1), "bias", "on query 1 of b=1, which is not padding");
}

RawTensor ints(const std::string& name, DType dtype, Shape shape, const std::vector<std::int64_t>& v) {
  RawTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const std::size_t size = dtype_size(dtype);
  for (std::int64_t x : v)
    for (std::size_t byte = 0; byte < size; ++byte)
      t.data.push_back(static_cast<unsigned char>(static_cast<std::uint64_t>(x) >> (8 * byte)));
  return t;
}

TEST(CaseSeqlens, Accepted) {
  const Case c = accept(with(with(sdpa(), ints("seqlens_q", DType::I32, {2}, {1, 3})),
                             ints("seqlens_k", DType::I64, {2}, {0, 5})));
  EXPECT_EQ(*c.seqlens_q, (std::vector<std::int64_t>{1, 3}));
  EXPECT_EQ(*c.seqlens_k, (std::vector<std::int64_t>{0, 5}));
  EXPECT_TRUE(c.query_valid(0, 0));
  EXPECT_FALSE(c.query_valid(0, 1));
  EXPECT_TRUE(c.query_valid(1, 2));
  EXPECT_FALSE(c.row_has_key(0, 0, 0));  // no key in batch 0
  ASSERT_TRUE(c.first_refused_row());  // query 0 of batch 0 is compared and has no key
  EXPECT_EQ(c.first_refused_row()->b, 0);
  EXPECT_EQ(c.first_refused_row()->i, 0);
  EXPECT_TRUE(c.row_has_key(1, 0, 0));
  const Case m = accept(with(mha(), ints("seqlens_k", DType::I32, {2}, {2, 5})));
  EXPECT_FALSE(m.position_allowed(0, 0, 2));
  EXPECT_TRUE(m.position_allowed(1, 0, 4));
}

TEST(CaseSeqlens, Refusals) {
  expect_refused(with(sdpa(), ints("seqlens_q", DType::I16, {2}, {1, 1})), "seqlens_q",
                 "dtype I16 is not I32 or I64");
  expect_refused(with(sdpa(), floats("seqlens_k", {2})), "seqlens_k", "dtype F32 is not I32 or I64");
  expect_refused(with(sdpa(), ints("seqlens_q", DType::I32, {3}, {1, 1, 1})), "seqlens_q",
                 "shape [3] is not [B] = [2]");
  expect_refused(with(sdpa(), ints("seqlens_k", DType::I64, {2, 1}, {1, 1})), "seqlens_k",
                 "shape [2,1] is not [B] = [2]");
  expect_refused(with(sdpa(), ints("seqlens_q", DType::I32, {2}, {1, -1})), "seqlens_q",
                 "element 1 is -1; sequence lengths must be at least 0");
  expect_refused(with(sdpa(), ints("seqlens_q", DType::I64, {2}, {4, 1})), "seqlens_q",
                 "element 0 is 4, more than Nq = 3");
  expect_refused(with(sdpa(), ints("seqlens_k", DType::I32, {2}, {5, 6})), "seqlens_k",
                 "element 1 is 6, more than Nk = 5");
}

TEST(CaseSeqlens, NonFiniteValuesOnlyWhereUnused) {
  // seqlens_k = {3, 5}: keys 3 and 4 of batch 0 are unused, key 2 is used.
  SafeTensorsFile f = with(sdpa(), ints("seqlens_k", DType::I32, {2}, {3, 5}));
  const std::size_t key3 = (0 * 2 + 1) * 5 + 3;  // b=0, kv head 1, key 3
  const Case c = accept(poisoned(f, "k", {2, 2, 5, 2}, key3 * 2 + 1, kInf));
  EXPECT_EQ(c.k.values[key3 * 2 + 1], 0);
  EXPECT_TRUE(c.row_has_key(0, 2, 0));  // no row is masked out: none attends key 3
  EXPECT_NO_THROW(accept(poisoned(f, "v", {2, 2, 5, 3}, 4 * 3)));
  expect_refused(poisoned(f, "v", {2, 2, 5, 3}, 2 * 3), "v",
                 "element 6 is NaN, in key 2 of b=0, kv head 0, which query 0 of head 0 attends");
  // seqlens_q = {1, 3}: queries 1 and 2 of batch 0 are padding
  SafeTensorsFile g = with(sdpa(), ints("seqlens_q", DType::I64, {2}, {1, 3}));
  const std::size_t e = ((0 * 4 + 3) * 3 + 2) * 2;  // q[0, 3, 2, 0]
  const Case d = accept(poisoned(g, "q", {2, 4, 3, 2}, e));
  EXPECT_FALSE(d.row_has_key(0, 3, 2));
  expect_refused(poisoned(g, "q", {2, 4, 3, 2}, e - 4), "q",
                 "in query 0 of b=0, h=3, which is not padding");
}

TEST(CaseUnused, MhaInputsMustBeFinite) {
  std::vector<double> values(2 * 5 * 6, 0);
  values[59] = std::nan("");
  expect_refused(with(mha(), floats("x_kv", {2, 5, 6}, DType::F32, values)), "x_kv",
                 "element 59 is NaN");
}

// ---- Lookups with broadcasting ----

TEST(CaseLookup, MaskPerHead) {
  // [Hq=4, Nq=3, Nk=5]: element (h, i, j) true iff (h + i + j) % 3 == 0.
  std::vector<unsigned char> values;
  for (int h = 0; h < 4; ++h)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 5; ++j) values.push_back((h + i + j) % 3 == 0);
  const Case c = accept(with(sdpa(), bools("mask", {4, 3, 5}, values)));
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 5; ++j) EXPECT_EQ(c.mask_at(b, h, i, j), (h + i + j) % 3 == 0);
}

TEST(CaseLookup, MaskPerBatch) {
  // [B=2, 1, Nq=3, Nk=5]: batch 0 all true, batch 1 only j == i.
  std::vector<unsigned char> values(15, 1);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) values.push_back(i == j);
  const Case c = accept(with(sdpa(), bools("mask", {2, 1, 3, 5}, values)));
  EXPECT_TRUE(c.mask_at(0, 3, 2, 4));
  EXPECT_TRUE(c.mask_at(1, 3, 2, 2));
  EXPECT_FALSE(c.mask_at(1, 0, 2, 4));
  EXPECT_FALSE(c.mask_at(1, 2, 0, 1));
}

TEST(CaseLookup, NoMaskNoBiasNoQueryMask) {
  const Case c = accept(sdpa());
  EXPECT_TRUE(c.mask_at(1, 3, 2, 4));
  EXPECT_EQ(c.bias_at(1, 3, 2, 4), 0);
  EXPECT_TRUE(c.query_valid(1, 2));
}

TEST(CaseLookup, BiasRows) {
  // [Nq=3, 1]: one value per query row, broadcast over keys, heads and batches.
  const Case c = accept(with(sdpa(), floats("bias", {3, 1}, DType::F64, {-1, 2.5, -kInf})));
  EXPECT_EQ(c.bias_at(0, 0, 0, 4), -1);
  EXPECT_EQ(c.bias_at(1, 3, 1, 0), 2.5);
  EXPECT_EQ(c.bias_at(1, 2, 2, 3), -kInf);
}

TEST(CaseLookup, BiasBatchAndKeys) {
  // [B=2, 1, 1, Nk=5]: value 10 b + j.
  std::vector<double> values;
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < 5; ++j) values.push_back(10 * b + j);
  const Case c = accept(with(sdpa(), floats("bias", {2, 1, 1, 5}, DType::F32, values)));
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 5; ++j) EXPECT_EQ(c.bias_at(b, h, i, j), 10 * b + j);
}

TEST(CaseLookup, BiasFull) {
  const Case c = accept(with(sdpa(), floats("bias", {2, 4, 3, 5})));
  // flat index of (1, 2, 1, 3) = ((1*4 + 2)*3 + 1)*5 + 3 = 98; value 0.25 * (98 % 9) - 1
  EXPECT_EQ(c.bias_at(1, 2, 1, 3), 0.25 * (98 % 9) - 1);
}

TEST(CaseLookup, QueryValid) {
  const Case c = accept(with(sdpa(), bools("query_mask", {2, 3}, {1, 0, 1, 0, 0, 1})));
  EXPECT_TRUE(c.query_valid(0, 0));
  EXPECT_FALSE(c.query_valid(0, 1));
  EXPECT_TRUE(c.query_valid(0, 2));
  EXPECT_FALSE(c.query_valid(1, 0));
  EXPECT_FALSE(c.query_valid(1, 1));
  EXPECT_TRUE(c.query_valid(1, 2));
}

// ---- Causal and window rules, worked by hand ----

// rows[i][j] == '1' where (i, j) is allowed
void expect_pattern(const std::string& causal, const std::string& window, std::int64_t nq,
                    std::int64_t nk, const std::vector<std::string>& rows) {
  Dims d;
  d.Nq = nq;
  d.Nk = nk;
  const Case c =
      accept(with_meta(with_meta(sdpa(d), "attn.causal", causal), "attn.window", window));
  ASSERT_EQ(rows.size(), static_cast<std::size_t>(nq));
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j)
      EXPECT_EQ(c.position_allowed(0, i, j),
                rows[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] == '1')
          << causal << " window " << window << " Nq " << nq << " Nk " << nk << " at " << i << ","
          << j;
}

TEST(CasePosition, NoRule) { expect_pattern("none", "none", 2, 3, {"111", "111"}); }

TEST(CasePosition, CausalMoreKeys) {
  expect_pattern("top_left", "none", 3, 5, {"10000", "11000", "11100"});
  expect_pattern("bottom_right", "none", 3, 5, {"11100", "11110", "11111"});
}

TEST(CasePosition, CausalMoreQueries) {
  expect_pattern("top_left", "none", 5, 3, {"100", "110", "111", "111", "111"});
  expect_pattern("bottom_right", "none", 5, 3, {"000", "000", "100", "110", "111"});
}

TEST(CasePosition, WindowAlone) {
  // top_left alignment when causal is none: i - L <= j <= i + R
  expect_pattern("none", "1,0", 3, 5, {"10000", "11000", "01100"});
  expect_pattern("none", "1,1", 3, 5, {"11000", "11100", "01110"});
  expect_pattern("none", "0,2", 5, 3, {"111", "011", "001", "000", "000"});
  expect_pattern("none", "0,0", 3, 3, {"100", "010", "001"});
}

TEST(CasePosition, WindowWithCausal) {
  expect_pattern("top_left", "0,5", 3, 5, {"10000", "01000", "00100"});
  expect_pattern("top_left", "1,1", 5, 3, {"100", "110", "011", "001", "000"});
  // bottom_right: i' = i + (Nk - Nq)
  expect_pattern("bottom_right", "1,1", 3, 5, {"01100", "00110", "00011"});
  expect_pattern("bottom_right", "1,0", 5, 3, {"000", "000", "100", "110", "011"});
}

TEST(CasePosition, HugeWindowNoOverflow) {
  expect_pattern("none", "999999999999999999,999999999999999999", 2, 3, {"111", "111"});
  expect_pattern("bottom_right", "999999999999999999,0", 3, 2, {"00", "10", "11"});
}

TEST(CaseSinks, DtypesShapesAndValues) {
  const Case c = accept(with(sdpa(), floats("sinks", {4}, DType::F64, {0.5, -1, 2, 0})));
  ASSERT_TRUE(c.sinks);
  EXPECT_EQ(c.sink(2), 2.0);
  EXPECT_FALSE(accept(sdpa()).sinks);
  EXPECT_TRUE(accept(with(sdpa({}, DType::BF16), floats("sinks", {4}, DType::BF16))).sinks);
  EXPECT_TRUE(accept(with(sdpa({}, DType::F16), floats("sinks", {4}, DType::F32))).sinks);
  EXPECT_TRUE(accept(with(mha(), floats("sinks", {3}))).sinks);
  expect_refused(with(sdpa(), floats("sinks", {4}, DType::F16)), "sinks",
                 "dtype F16 is not F64, F32 or F32 (the input dtype)");
  expect_refused(with(sdpa(), bools("sinks", {4})), "sinks", "dtype BOOL is not");
  expect_refused(with(sdpa(), floats("sinks", {2})), "sinks", "shape [2] is not [Hq] = [4]");
  expect_refused(with(sdpa(), floats("sinks", {1, 4})), "sinks", "shape [1,4] has rank 2, expected 1 [Hq]");
  expect_refused(with(mha(), floats("sinks", {4})), "sinks", "shape [4] is not [H] = [3]");
  expect_refused(with(sdpa(), floats("sinks", {4}, DType::F32, {0, std::nan(""), 0, 0})), "sinks",
                 "element 1 is NaN");
  expect_refused(with(sdpa(), floats("sinks", {4}, DType::F32, {0, 0, 0, -kInf})), "sinks",
                 "element 3 is -infinity");
}

// With sinks no row is fully masked: policy error refuses nothing.
TEST(CaseSinks, NoRowIsRefused) {
  std::vector<unsigned char> none(5, 0);
  const SafeTensorsFile masked = with(sdpa(), bools("mask", {5}, none));
  EXPECT_TRUE(accept(masked).first_refused_row());
  EXPECT_FALSE(accept(with(masked, floats("sinks", {4}))).first_refused_row());
}

TEST(CaseOutputs, Scores) {
  const Case c = accept(with_meta(sdpa(), "attn.outputs", "scores,out"));
  EXPECT_TRUE(c.want_scores);
  EXPECT_FALSE(c.want_weights);
  std::vector<std::string> names;
  for (const auto& g : c.golden_tensors()) names.push_back(g.name);
  EXPECT_EQ(names.back(), "scores.ref");
  EXPECT_EQ(c.golden_tensors().back().shape, (Shape{2, 4, 3, 5}));
  EXPECT_TRUE(is_golden_tensor_name("scores.undecided"));
  expect_refused(with_meta(sdpa(), "attn.outputs", "out,score"), "attn.outputs",
                 "is not a comma list of out, weights, lse, scores, dq, dk, dv, dbias, dsinks, dx_q, dx_kv, dw_q, "
                 "dw_k, dw_v, dw_o, out_partial, lse_partial, amax (\"score\"?)");
}

}  // namespace
}  // namespace attnoracle::testing

namespace attnoracle::testing {
namespace {

// ---- FP8 inputs and descales ----

SafeTensorsFile fp8(DType t = DType::F8_E4M3, const char* out = "F32") {
  return with_meta(sdpa({}, t), "attn.output_dtype", out);
}

// [B=2, Hkv=2] descales 2^-1, 2^2, 3, 0.75 (F32)
RawTensor descale(const std::string& name, std::vector<double> v = {0.5, 4, 3, 0.75},
                  Shape shape = {2, 2}, DType t = DType::F32) {
  return floats(name, std::move(shape), t, std::move(v));
}

TEST(CaseFp8, AcceptsBothFormatsAndAppliesDescales) {
  for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
    const Case plain = accept(fp8(t));
    EXPECT_EQ(plain.input_dtype, t);
    EXPECT_EQ(plain.output_dtype, DType::F32);
    const std::vector<double> qk = {0.5, 4, 3, 0.75}, vs = {1, 2, 0.25, 8};
    const Case c = accept(with(with(with(fp8(t), descale("q_descale")), descale("k_descale")),
                               descale("v_descale", vs)));
    // q [2, 4, 3, 2]: query head h reads kv head h / 2; k, v [2, 2, 5, *]
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t e = 0; e < 6; ++e) {
          const auto at = static_cast<std::size_t>((b * 4 + h) * 6 + e);
          const double f = qk[static_cast<std::size_t>(b * 2 + h / 2)];
          EXPECT_EQ(c.q.values[at], plain.q.values[at] * f);
        }
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t g = 0; g < 2; ++g) {
        const auto bg = static_cast<std::size_t>(b * 2 + g);
        for (std::int64_t e = 0; e < 10; ++e) {
          const auto at = bg * 10 + static_cast<std::size_t>(e);
          EXPECT_EQ(c.k.values[at], plain.k.values[at] * qk[bg]);
        }
        for (std::int64_t e = 0; e < 15; ++e) {
          const auto at = bg * 15 + static_cast<std::size_t>(e);
          EXPECT_EQ(c.v.values[at], plain.v.values[at] * vs[bg]);
        }
      }
  }
}

TEST(CaseFp8, OutputDtypeRequired) {
  expect_refused(sdpa({}, DType::F8_E4M3), "attn.output_dtype",
                 "missing (required for F8_E4M3 inputs: F32, F16 or BF16)");
  expect_refused(fp8(DType::F8_E5M2, "F64"), "attn.output_dtype",
                 "value \"F64\" is not F32, F16, BF16 or FP8 (the output dtypes of F8_E5M2 inputs)");
  expect_refused(fp8(DType::F8_E4M3, "F8_E4M3"), "o_scale", "missing (required with attn.output_dtype F8_E4M3)");
  for (const char* out : {"F16", "BF16"}) EXPECT_EQ(accept(fp8(DType::F8_E4M3, out)).input_dtype, DType::F8_E4M3);
}

TEST(CaseFp8, KindMhaRefused) {
  expect_refused(with_meta(mha(DType::F8_E4M3), "attn.output_dtype", "F32"), "x_q",
                 "dtype F8_E4M3 is for attn.kind sdpa only");
}

TEST(CaseFp8, DescaleRefusals) {
  expect_refused(with(sdpa(), descale("k_descale")), "k_descale",
                 "is for FP8 inputs only (F8_E4M3, F8_E5M2), but the inputs are F32");
  expect_refused(with(fp8(), descale("q_descale", {1, 1}, {2})), "q_descale",
                 "shape [2] has rank 1, expected 2 [B,Hkv]");
  expect_refused(with(fp8(), descale("v_descale", {1, 1, 1, 1, 1, 1}, {2, 3})), "v_descale",
                 "shape [2,3] is not [B,Hkv] = [2,2]");
  expect_refused(with(fp8(), descale("q_descale", {1, 1, 1, 1}, {2, 2}, DType::F16)),
                 "q_descale", "dtype F16 is not F32");
  expect_refused(with(fp8(), descale("k_descale", {1, kInf, 1, 1})), "k_descale",
                 "element 1 is +infinity");
  expect_refused(with(fp8(), descale("k_descale", {1, 1, std::nan(""), 1})), "k_descale",
                 "element 2 is NaN");
  expect_refused(with(fp8(), descale("v_descale", {1, 1, 1, 0})), "v_descale",
                 "element 3 is 0; descales must be > 0");
  expect_refused(with(fp8(), descale("q_descale", {-0.5, 1, 1, 1})), "q_descale",
                 "element 0 is -0.5; descales must be > 0");
  expect_refused(with(with_meta(mha(DType::F8_E4M3), "attn.output_dtype", "F32"),
                      descale("q_descale")),
                 "q_descale", "unknown tensor");
}

TEST(CaseFp8, NanPatternRefusedWhereUsed) {
  auto f = fp8();
  RawTensor k = *f.find("k");
  k.data[3] = 0x7F;  // E4M3 NaN in key 1 of b=0, kv head 0, which every query attends
  expect_refused(with(f, k), "k", "element 3 is NaN");
}

}  // namespace
}  // namespace attnoracle::testing
