// End to end: `attnoracle eval` on dropout with a given keep mask (CONTRACT section 10): a
// hand-worked case of two keys, one dropped, forward and gradients, under the oracle; the
// weights and lse those of the case without dropout; every refusal one line naming the tensor
// or key, exit status 2, and no output file.

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

RawTensor keep(Shape shape, const std::vector<unsigned char>& v, DType t = DType::BOOL) {
  return RawTensor{"dropout_mask", t, std::move(shape), v};
}

// One query q = (1, 0) and two keys k0 = (0, 1), k1 = (0, -1): both scores 0 (scale 1), so
// A = (1/2, 1/2) and lse = log 2. v0 = (2, 4), v1 = (6, 8), dout = (1, 1); key 1 dropped.
SafeTensorsFile two_keys(const std::string& p) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.scale", "1"}, {"attn.dropout_p", p},
                {"attn.outputs", "out,weights,lse,dq,dk,dv"}};
  f.put(floats("q", {1, 1, 1, 2}, {1, 0}));
  f.put(floats("k", {1, 1, 2, 2}, {0, 1, 0, -1}));
  f.put(floats("v", {1, 1, 2, 2}, {2, 4, 6, 8}));
  f.put(floats("dout", {1, 1, 1, 2}, {1, 1}));
  f.put(keep({2}, {1, 0}));  // [Nk]: broadcast over b, h and i
  return f;
}

class DropoutEval : public EvalCli {
 protected:
  SafeTensorsFile evaluated(const SafeTensorsFile& f, const std::string& name) {
    return EvalCli::evaluated(f, name, {"--oracle-gradient-slices", "1"});
  }
};

TEST_F(DropoutEval, TwoKeysOneDroppedByHand) {
  // p = 1/2: Z = A keep / (1 - p) = (1, 0), O = v0 = (2, 4). dP = (dout . v) keep / (1 - p)
  // = (12, 0), D = dout . O = 6, dS = A (dP - D) = (3, -3): dq = 3 k0 - 3 k1 = (0, 6),
  // dk0 = 3 q = (3, 0), dk1 = (-3, 0), dv0 = Z_0 dout = (1, 1), dv1 = 0.
  const SafeTensorsFile g = evaluated(two_keys("0.5"), "half");
  EXPECT_EQ(values(g, "out"), (std::vector<double>{2, 4}));
  EXPECT_EQ(values(g, "out.bound"), (std::vector<double>{2, 4}));
  EXPECT_EQ(values(g, "weights"), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(values(g, "lse"), std::vector<double>{static_cast<double>(std::log(2.0f))});
  EXPECT_EQ(values(g, "dq"), (std::vector<double>{0, 6}));
  EXPECT_EQ(values(g, "dk"), (std::vector<double>{3, 0, -3, 0}));
  EXPECT_EQ(values(g, "dv"), (std::vector<double>{1, 1, 0, 0}));
  // p = 0.1 (not a binary fraction): 1 / (1 - p) = 10/9, Z = (5/9, 0), O = (10/9, 20/9), each
  // rounded once to F32; dP0 = 6 * 10/9 = 20/3, D = 10/3, dS = (5/3, -5/3): dq = (0, 10/3),
  // dv0 = (5/9, 5/9).
  const SafeTensorsFile t = evaluated(two_keys("0.1"), "tenth");
  EXPECT_EQ(values(t, "out"), (std::vector<double>{static_cast<float>(10.0 / 9), static_cast<float>(20.0 / 9)}));
  EXPECT_EQ(values(t, "out.ref"), (std::vector<double>{10.0 / 9, 20.0 / 9}));
  EXPECT_EQ(values(t, "weights"), (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(values(t, "dq"), (std::vector<double>{0, static_cast<float>(10.0 / 3)}));
  EXPECT_EQ(values(t, "dv"), (std::vector<double>{static_cast<float>(5.0 / 9), static_cast<float>(5.0 / 9), 0, 0}));
  // p = 0.1 with v0 = (4.5, 9): O = (2.5, 5) exactly, an exact F64 bound is the bound itself (the
  // product by 1 / (1 - p) taken exactly, not through an enclosure that would never decide it).
  const SafeTensorsFile x = evaluated(with(two_keys("0.1"), floats("v", {1, 1, 2, 2}, {4.5, 9, 6, 8})), "exact");
  EXPECT_EQ(values(x, "out"), (std::vector<double>{2.5, 5}));
  EXPECT_EQ(values(x, "out.ref"), (std::vector<double>{2.5, 5}));
  EXPECT_EQ(values(x, "out.bound"), (std::vector<double>{2.5, 5}));
  // Every key kept with p = 0: the case without dropout, byte for byte.
  const SafeTensorsFile a = evaluated(with(two_keys("0"), keep({1, 1, 1, 2}, {1, 1})), "all");
  const SafeTensorsFile b = evaluated(without_meta(without(two_keys("0"), "dropout_mask"), "attn.dropout_p"), "none");
  for (const char* name : {"out", "out.ref", "out.bound", "weights", "lse", "dq", "dk", "dv", "dv.bound"})
    EXPECT_EQ(a.find(name)->data, b.find(name)->data) << name;
  // Every key kept with p = 3/4 (hex): out four times the case's, weights and lse unchanged.
  const SafeTensorsFile k = evaluated(with(two_keys("0x1.8p-1"), keep({1, 1, 1, 2}, {1, 1})), "scaled");
  EXPECT_EQ(values(k, "out"), (std::vector<double>{16, 24}));
  EXPECT_EQ(k.find("weights")->data, b.find("weights")->data);
  EXPECT_EQ(k.find("lse")->data, b.find("lse")->data);
}

TEST_F(DropoutEval, WithGqaCausalBiasSinksSeqlensAndSoftcapUnderEveryTwin) {
  // Hq = 4 over Hkv = 2, causal bottom_right, a bias, sinks, seqlens_k, softcap, a keep mask
  // broadcast over the batch [Hq, Nq, Nk]: every gradient, every row given the twins and every
  // slice the gradient twins; the weights and lse are those of the case without dropout.
  auto small = [](std::size_t e) { return 0.25 * static_cast<double>(e * 5 % 11) - 1.25; };
  auto tensor = [&](const std::string& name, Shape shape, std::size_t salt) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    std::vector<double> v(n);
    for (std::size_t e = 0; e < n; ++e) v[e] = small(e * 3 + salt);
    return floats(name, std::move(shape), v);
  };
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.causal", "bottom_right"}, {"attn.softcap", "5"},
                {"attn.dropout_p", "0.2"}, {"attn.outputs", "out,weights,lse,dq,dk,dv,dbias,dsinks"}};
  f.put(tensor("q", {2, 4, 3, 4}, 1));
  f.put(tensor("k", {2, 2, 6, 4}, 2));
  f.put(tensor("v", {2, 2, 6, 3}, 3));
  f.put(tensor("dout", {2, 4, 3, 3}, 4));
  f.put(tensor("bias", {1, 4, 1, 6}, 5));
  f.put(floats("sinks", {4}, {0.5, -1, 0, 2}));
  RawTensor lk{"seqlens_k", DType::I32, {2}, std::vector<unsigned char>(8, 0)};
  lk.data[0] = 6, lk.data[4] = 4;
  f.put(lk);
  std::vector<unsigned char> m(4 * 3 * 6);
  for (std::size_t e = 0; e < m.size(); ++e) m[e] = e % 4 != 2;
  f.put(keep({4, 3, 6}, m));
  const std::string in = dir_ / "mix.safetensors", out = dir_ / "mix.out.safetensors";
  write_bytes(in, serialize_safetensors(f));
  const CliResult r = run_cli({"eval", in, "-o", out, "-q", "--oracle-rows", "100", "--oracle-gradient-slices", "4"});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile g = read_safetensors(out);
  const SafeTensorsFile b = evaluated(without_meta(without(f, "dropout_mask"), "attn.dropout_p"), "mix_plain");
  for (const char* name : {"weights", "lse", "row.valid"}) EXPECT_EQ(g.find(name)->data, b.find(name)->data) << name;
  for (const char* name : {"out", "dq", "dk", "dv", "dbias", "dsinks"}) EXPECT_NE(g.find(name)->data, b.find(name)->data) << name;
}

TEST_F(DropoutEval, Refusals) {
  const SafeTensorsFile f = two_keys("0.5");
  expect_refused(with_meta(f, "attn.dropout_p", "1"), "attn.dropout_p", "value \"1\" is not a number in [0, 1)");
  expect_refused(with_meta(f, "attn.dropout_p", "-0.25"), "attn.dropout_p", "is not a number in [0, 1)");
  expect_refused(with_meta(f, "attn.dropout_p", "-1e-400"), "attn.dropout_p", "is not a number in [0, 1)");
  expect_refused(with_meta(f, "attn.dropout_p", "0x1p0"), "attn.dropout_p", "is not a number in [0, 1)");
  expect_refused(with_meta(f, "attn.dropout_p", "nan"), "attn.dropout_p", "is not a number in [0, 1)");
  expect_refused(with_meta(f, "attn.dropout_p", "half"), "attn.dropout_p", "is not a number (decimal or C hex float)");
  expect_refused(without_meta(f, "attn.dropout_p"), "dropout_mask", "given, but attn.dropout_p is missing");
  expect_refused(without(f, "dropout_mask"), "attn.dropout_p", "given, but the case has no dropout_mask tensor");
  expect_refused(with(f, keep({2}, {1, 0}, DType::U8)), "dropout_mask", "dtype U8 is not BOOL");
  expect_refused(with(f, keep({3}, {1, 0, 1})), "dropout_mask", "does not broadcast to [B,Hq,Nq,Nk] = [1,1,1,2]");
  expect_refused(with(f, keep({2}, {1, 2})), "dropout_mask", "element 1 is 2; BOOL elements must be 0 or 1");
  expect_refused(with_meta(with_meta(f, "attn.kv_split_size", "1"), "attn.outputs", "out,out_partial"), "dropout_mask",
                 "asks for partial states, which dropout does not have");
  SafeTensorsFile mha;
  mha.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}, {"attn.dropout_p", "0.5"}};
  mha.put(floats("x_q", {1, 1, 2}, {1, 0}));
  mha.put(floats("x_kv", {1, 2, 2}, {0, 1, 1, 0}));
  for (const char* w : {"w_q", "w_k", "w_v"}) mha.put(floats(w, {1, 2, 2}, {1, 0, 0, 1}));
  mha.put(floats("w_o", {2, 2}, {1, 0, 0, 1}));
  mha.put(keep({2}, {1, 0}));
  expect_refused(mha, "dropout_mask", "is for attn.kind sdpa only");
}

}  // namespace
}  // namespace attnoracle::testing
