// End to end: `attnoracle eval` on rotary embedding from given tables (CONTRACT section 10): a
// hand-worked decode query rotated to its position in the cache, under the oracle; every
// refusal one line naming the tensor or key, exit status 2, and no output file.

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
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


// One query q = (1, 0) decoding after two keys k0 = (0, 1), k1 = (1, 0); the tables turn a pair
// by 0 at position 0 and by a quarter turn at position 1. The query sits at position 1 (Nk - Nq):
// q' = (0, 1), k0' = k0, k1' = (0, 1), so both scores are 1 (unrotated they are 0 and 1):
// A = (1/2, 1/2), lse = 1 + log 2, out = (2 + 4) / 2 = 3, dv = A dout = (1/2, 1/2).
SafeTensorsFile decode_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.scale", "1"}, {"attn.rotary", "interleaved"},
                {"attn.rotary_round", "F32"}, {"attn.outputs", "out,weights,lse,dv"}};
  f.put(floats("q", {1, 1, 1, 2}, {1, 0}));
  f.put(floats("k", {1, 1, 2, 2}, {0, 1, 1, 0}));
  f.put(floats("v", {1, 1, 2, 1}, {2, 4}));
  f.put(floats("dout", {1, 1, 1, 1}, {1}));
  f.put(floats("rotary_cos", {2, 1}, {1, 0}));
  f.put(floats("rotary_sin", {2, 1}, {0, 1}));
  return f;
}

class RotaryEval : public EvalCli {
 protected:
  SafeTensorsFile evaluated(const SafeTensorsFile& f, const std::string& name) {
    return EvalCli::evaluated(f, name, {"--oracle-gradient-slices", "1"});
  }
};

TEST_F(RotaryEval, DecodeQueryAtItsPositionByHand) {
  const SafeTensorsFile g = evaluated(decode_case(), "decode");
  EXPECT_EQ(values(g, "out"), std::vector<double>{3});
  EXPECT_EQ(values(g, "weights"), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(values(g, "lse"), std::vector<double>{static_cast<float>(1 + std::log(2.0))});
  EXPECT_EQ(values(g, "dv"), (std::vector<double>{0.5, 0.5}));
  // The inputs are written back as given, tables included.
  EXPECT_EQ(g.find("q")->data, decode_case().find("q")->data);
  EXPECT_EQ(g.find("rotary_sin")->data, decode_case().find("rotary_sin")->data);
  // Without the rotation the scores are 0 and 1.
  SafeTensorsFile plain = without(without(decode_case(), "rotary_cos"), "rotary_sin");
  plain = without_meta(without_meta(plain, "attn.rotary"), "attn.rotary_round");
  EXPECT_NE(values(evaluated(plain, "plain"), "weights"), (std::vector<double>{0.5, 0.5}));
}

// The exact rotation (no attn.rotary_round) of the case above: quarter turns are exact, so the
// results are those of the rounded rotation.
TEST_F(RotaryEval, ExactRotationByHand) {
  const SafeTensorsFile f =
      with_meta(without_meta(decode_case(), "attn.rotary_round"), "attn.outputs", "out,weights,lse");
  const SafeTensorsFile g = evaluated(f, "exact");
  EXPECT_EQ(values(g, "out"), std::vector<double>{3});
  EXPECT_EQ(values(g, "weights"), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(values(g, "lse"), std::vector<double>{static_cast<float>(1 + std::log(2.0))});
}

// dq and dk through the rotation: the case above with k0 = (1, 1), so k0' = (1, 1), k1' = (0, 1),
// q' = (0, 1) and still both scores 1, A = (1/2, 1/2), dP = (2, 4), D = 3, dS = (-1/2, 1/2).
// dq' = dS k' = (-1/2, 0), and R^T at position 1 (cos 0, sin 1) gives dq = (0, 1/2): q' = (-x2,
// x1), so the scores are x1 - x2 and x1. dk0' = dS0 q' = (0, -1/2) at position 0 (no turn);
// dk1' = (0, 1/2), and R^T gives dk1 = (1/2, 0): the score of k1 = (a, b) is q' . (-b, a) = a.
TEST_F(RotaryEval, DqDkThroughTheRotationByHand) {
  const SafeTensorsFile f =
      with(with_meta(decode_case(), "attn.outputs", "out,dq,dk,dv"), floats("k", {1, 1, 2, 2}, {1, 1, 1, 0}));
  const SafeTensorsFile g = evaluated(f, "grads");
  EXPECT_EQ(values(g, "out"), std::vector<double>{3});
  EXPECT_EQ(values(g, "dq"), (std::vector<double>{0, 0.5}));
  EXPECT_EQ(values(g, "dk"), (std::vector<double>{0, -0.5, 0.5, 0}));
  EXPECT_EQ(values(g, "dv"), (std::vector<double>{0.5, 0.5}));
  // Half pairing is the same pairing at Dk = 2.
  EXPECT_EQ(values(evaluated(with_meta(f, "attn.rotary", "half"), "half"), "dk"), values(g, "dk"));
}

TEST_F(RotaryEval, Refusals) {
  const SafeTensorsFile f = decode_case();
  expect_refused(with_meta(f, "attn.rotary", "neox"), "attn.rotary", "value \"neox\" is not interleaved or half");
  expect_refused(without_meta(f, "attn.rotary"), "rotary_cos", "given, but attn.rotary is missing");
  // An exact rotation (no attn.rotary_round): no gradient, no F64 input.
  expect_refused(without_meta(f, "attn.rotary_round"), "attn.rotary",
                 "given without attn.rotary_round: the gradients of an exact rotation are not evaluated");
  const SafeTensorsFile exact = with_meta(without_meta(f, "attn.rotary_round"), "attn.outputs", "out");
  expect_refused(with(with(with(exact, floats("q", {1, 1, 1, 2}, {1, 0}, DType::F64)),
                           floats("k", {1, 1, 2, 2}, {0, 1, 1, 0}, DType::F64)),
                      floats("v", {1, 1, 2, 1}, {2, 4}, DType::F64)),
                 "attn.rotary", "given without attn.rotary_round on F64 inputs");
  expect_refused(with_meta(f, "attn.rotary_round", "F8_E4M3"), "attn.rotary_round",
                 "value \"F8_E4M3\" is not F64, F32, F16 or BF16");
  expect_refused(without(f, "rotary_sin"), "rotary_cos", "given, but the case has no rotary_sin tensor");
  expect_refused(without(f, "rotary_cos"), "rotary_sin", "given, but the case has no rotary_cos tensor");
  expect_refused(without(without(f, "rotary_cos"), "rotary_sin"), "attn.rotary",
                 "given, but the case has no rotary_cos and rotary_sin tensors");
  expect_refused(with(f, floats("rotary_cos", {2, 1}, {1, 0}, DType::F16)), "rotary_cos",
                 "dtype F16 is not F32");
  expect_refused(with(f, floats("rotary_cos", {2}, {1, 0})), "rotary_cos", "shape [2] is not [Nrot,R/2]");
  expect_refused(with(f, floats("rotary_sin", {1, 2}, {0, 1})), "rotary_sin",
                 "shape [1,2] is not that of rotary_cos [2,1]");
  expect_refused(with(with(f, floats("rotary_cos", {2, 0}, {})), floats("rotary_sin", {2, 0}, {})), "rotary_cos",
                 "has R/2 = 0");
  expect_refused(with(with(f, floats("rotary_cos", {2, 2}, {1, 1, 0, 0})), floats("rotary_sin", {2, 2}, {0, 0, 1, 1})),
                 "rotary_cos", "gives R = 4, more than Dk = 2");
  RawTensor nan_cos = floats("rotary_cos", {2, 1}, {1, 0});
  const float nan = NAN;
  std::memcpy(nan_cos.data.data() + 4, &nan, 4);
  expect_refused(with(f, nan_cos), "rotary_cos", "element 1 is NaN");
  // One row: the query sits at position 1, past the table.
  expect_refused(with(with(f, floats("rotary_cos", {1, 1}, {1})), floats("rotary_sin", {1, 1}, {0})), "rotary_cos",
                 "has Nrot = 1 positions, but query 0 of b=0 sits at position 1");
  // Two queries over one key: query 0 sits at position -1.
  expect_refused(with(with(with(f, floats("q", {1, 1, 2, 2}, {1, 0, 0, 1})), floats("k", {1, 1, 1, 2}, {0, 1})),
                      floats("v", {1, 1, 1, 1}, {2})),
                 "rotary_cos", "query 0 of b=0 sits at position -1");
  // Position 1 turns (x1, x2) into (x1 - x2, x1 + x2): 2^128 is past F32's largest value.
  expect_refused(with(with(f, floats("q", {1, 1, 1, 2}, {0x1p127, 0x1p127})), floats("rotary_cos", {2, 1}, {1, 1})),
                 "attn.rotary_round",
                 "rotated q element 1 overflows F32");
  // No compared query (seqlens_q = 0): the keys alone need the table's rows.
  const auto i32 = [](const std::string& name, Shape shape, std::vector<std::int32_t> v) {
    RawTensor r{name, DType::I32, std::move(shape), std::vector<unsigned char>(4 * v.size())};
    std::memcpy(r.data.data(), v.data(), r.data.size());
    return r;
  };
  expect_refused(with(with(with(f, i32("seqlens_q", {1}, {0})), floats("rotary_cos", {1, 1}, {1})),
                      floats("rotary_sin", {1, 1}, {0})),
                 "rotary_cos", "has Nrot = 1 positions, but b=0 has 2 keys");
  // A paged KV cache: one page of two slots.
  SafeTensorsFile paged = without(without(f, "k"), "v");
  paged.put(floats("k_cache", {1, 2, 1, 2}, {0, 1, 1, 0}));
  paged.put(floats("v_cache", {1, 2, 1, 1}, {2, 4}));
  paged.put(i32("block_table", {1, 1}, {0}));
  paged.put(i32("seqlens_k", {1}, {2}));
  expect_refused(with_meta(paged, "attn.outputs", "out"), "rotary_cos", "given with a paged KV cache");
  // Scaled I8 K/V.
  SafeTensorsFile scaled = with_meta(with_meta(f, "attn.output_dtype", "F32"), "attn.outputs", "out");
  scaled.put(RawTensor{"k", DType::I8, {1, 1, 2, 2}, {0, 1, 1, 0}});
  scaled.put(RawTensor{"v", DType::I8, {1, 1, 2, 1}, {2, 4}});
  scaled.put(floats("k_scale", {1, 1, 1, 1}, {1}));
  scaled.put(floats("v_scale", {1, 1, 1, 1}, {1}));
  expect_refused(scaled, "rotary_cos", "given with K/V in a stored form of section 9");
  SafeTensorsFile mha;
  mha.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}, {"attn.rotary", "half"}, {"attn.rotary_round", "F32"}};
  mha.put(floats("x_q", {1, 1, 2}, {1, 0}));
  mha.put(floats("x_kv", {1, 2, 2}, {0, 1, 1, 0}));
  for (const char* w : {"w_q", "w_k", "w_v"}) mha.put(floats(w, {1, 2, 2}, {1, 0, 0, 1}));
  mha.put(floats("w_o", {2, 2}, {1, 0, 0, 1}));
  mha.put(floats("rotary_cos", {2, 1}, {1, 0}));
  mha.put(floats("rotary_sin", {2, 1}, {0, 1}));
  expect_refused(mha, "rotary_cos", "is for attn.kind sdpa only");
  expect_refused(without(without(mha, "rotary_cos"), "rotary_sin"), "attn.rotary", "is for attn.kind sdpa only");
}

}  // namespace
}  // namespace attnoracle::testing
