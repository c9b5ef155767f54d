// End to end: `attnoracle eval` on paged KV caches and empty shapes (CONTRACT section 8). A
// paged case's output file holds its inputs as given (the caches, not a gathered k and v) and
// the golden tensors of its contiguous twin; every refusal is one line, exit status 2, and no
// output file.

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
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

RawTensor floats(const std::string& name, Shape shape, const std::function<double(std::size_t)>& value,
                 DType t = DType::F32) {
  RawTensor r{name, t, std::move(shape), {}};
  const auto n = static_cast<std::size_t>(r.numel());
  r.data.resize(dtype_size(t) * n);
  for (std::size_t e = 0; e < n; ++e) encode_float(t, value(e), r.data.data() + dtype_size(t) * e);
  return r;
}

RawTensor ints(const std::string& name, Shape shape, const std::vector<std::int32_t>& v, DType t = DType::I32) {
  RawTensor r{name, t, std::move(shape), {}};
  for (std::int32_t x : v) {
    const std::int64_t y = x;
    const auto* p = reinterpret_cast<const unsigned char*>(&y);
    r.data.insert(r.data.end(), p, p + dtype_size(t));  // little-endian
  }
  return r;
}

double small(std::size_t e) { return 0.25 * static_cast<double>(e % 7) - 0.5; }

// q [2,4,3,4]; caches NHD [4 pages, P = 2, Hkv = 2, D] (Nk = 2 * 2 = 4); seqlens_k [3, 4];
// block_table [[2, 0], [1, 3]]. Slot 1 of page 0 is unused (row 0 has 3 keys): NaN.
SafeTensorsFile paged_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(floats("q", {2, 4, 3, 4}, small));
  // page 0 slot 1 = elements [(0*2+1)*2*D, (0*2+2)*2*D)
  f.put(floats("k_cache", {4, 2, 2, 4}, [](std::size_t e) { return e >= 8 && e < 16 ? kNaN : small(e + 3); }));
  f.put(floats("v_cache", {4, 2, 2, 2}, [](std::size_t e) { return e >= 4 && e < 8 ? kNaN : small(e + 5); }));
  f.put(ints("block_table", {2, 2}, {2, 0, 1, 3}));
  f.put(ints("seqlens_k", {2}, {3, 4}));
  return f;
}

// The same problem with k and v gathered by hand.
SafeTensorsFile contiguous_twin() {
  const SafeTensorsFile p = paged_case();
  SafeTensorsFile f;
  f.metadata = p.metadata;
  f.put(*p.find("q"));
  f.put(*p.find("seqlens_k"));
  const int table[2][2] = {{2, 0}, {1, 3}}, lk[2] = {3, 4};
  auto gather = [&](const char* name, const char* cache, std::int64_t d) {
    const RawTensor& c = *p.find(cache);
    RawTensor t{name, DType::F32, {2, 2, 4, d}, std::vector<unsigned char>(static_cast<std::size_t>(2 * 2 * 4 * d * 4), 0)};
    for (int b = 0; b < 2; ++b)
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < lk[b]; ++j)
          std::memcpy(t.data.data() + ((b * 2 + g) * 4 + j) * d * 4,
                      c.data.data() + ((table[b][j / 2] * 2 + j % 2) * 2 + g) * d * 4, static_cast<std::size_t>(d) * 4);
    f.put(std::move(t));
  };
  gather("k", "k_cache", 4);
  gather("v", "v_cache", 2);
  return f;
}

SafeTensorsFile with(SafeTensorsFile f, RawTensor t) {
  f.put(std::move(t));
  return f;
}

using PagedEval = EvalCli;

TEST_F(PagedEval, GoldenOfTheContiguousTwinInputsUnchanged) {
  const SafeTensorsFile p = evaluated(with_meta(paged_case(), "attn.outputs", "out,weights,lse"), "paged");
  const SafeTensorsFile c = evaluated(with_meta(contiguous_twin(), "attn.outputs", "out,weights,lse"), "twin");
  for (const char* name : {"out", "out.ref", "out.bound", "row.valid", "weights", "weights.ref", "lse", "lse.ref"}) {
    ASSERT_TRUE(p.find(name)) << name;
    EXPECT_EQ(p.find(name)->data, c.find(name)->data) << name;
    EXPECT_EQ(p.find(name)->shape, c.find(name)->shape) << name;
  }
  EXPECT_FALSE(p.find("k"));
  EXPECT_FALSE(p.find("v"));
  const SafeTensorsFile in = paged_case();
  for (const char* name : {"q", "k_cache", "v_cache", "block_table", "seqlens_k"})
    EXPECT_EQ(p.find(name)->data, in.find(name)->data) << name;
  // evaluated again from its own output: the same file
  const SafeTensorsFile again = evaluated(p, "again");
  EXPECT_EQ(serialize_safetensors(again), serialize_safetensors(p));
}

TEST_F(PagedEval, HndLayout) {
  // The same caches transposed to [Npages, Hkv, P, D]: the same golden bytes.
  const SafeTensorsFile nhd = paged_case();
  SafeTensorsFile hnd = with_meta(nhd, "attn.kv_layout", "HND");
  for (auto [name, d] : {std::pair<const char*, std::int64_t>{"k_cache", 4}, {"v_cache", 2}}) {
    const RawTensor& c = *nhd.find(name);
    RawTensor t{name, DType::F32, {4, 2, 2, d}, c.data};
    for (int page = 0; page < 4; ++page)
      for (int slot = 0; slot < 2; ++slot)
        for (int g = 0; g < 2; ++g)
          std::memcpy(t.data.data() + ((page * 2 + g) * 2 + slot) * d * 4,
                      c.data.data() + ((page * 2 + slot) * 2 + g) * d * 4, static_cast<std::size_t>(d) * 4);
    hnd.put(std::move(t));
  }
  const SafeTensorsFile a = evaluated(nhd, "nhd"), b = evaluated(hnd, "hnd");
  EXPECT_EQ(a.find("out")->data, b.find("out")->data);
  EXPECT_EQ(a.find("out.ref")->data, b.find("out.ref")->data);
}

TEST_F(PagedEval, Refusals) {
  const SafeTensorsFile p = paged_case();
  const SafeTensorsFile twin = contiguous_twin();
  expect_refused(with(p, *twin.find("k")), "k", "given beside a paged KV cache");
  expect_refused(without(p, "seqlens_k"), "seqlens_k", "missing (required with a paged KV cache)");
  expect_refused(without(p, "v_cache"), "v_cache", "missing (a paged KV cache gives");
  expect_refused(without(p, "block_table"), "block_table", "missing");
  expect_refused(with(p, ints("block_table", {2, 2}, {2, 0, 1, 3}, DType::I64)), "block_table",
                 "dtype I64 is not I32");
  expect_refused(with(p, ints("block_table", {1, 2}, {2, 0})), "block_table", "shape [1,2] is not [B,Mpages] with B = 2");
  expect_refused(with(p, ints("block_table", {2, 2}, {2, 0, 1, 7})), "block_table",
                 "entry [1, 1] = 7 is outside [0, 4)");
  expect_refused(with(p, ints("block_table", {2, 2}, {-1, 0, 1, 3})), "block_table",
                 "entry [0, 0] = -1 is outside [0, 4)");
  expect_refused(with(p, floats("k_cache", {4, 2, 8}, small)), "k_cache", "has rank 3, expected 4 [Npages,P,Hkv,D]");
  expect_refused(with(p, floats("k_cache", {4, 0, 2, 4}, small)), "k_cache", "has dimension 1 equal to 0");
  expect_refused(with(p, floats("k_cache", {4, 2, 2, 4}, small, DType::F16)), "k_cache", "dtype F16 differs from q's F32");
  expect_refused(with(p, floats("k_cache", {4, 2, 2, 3}, small)), "k_cache", "Dk is 3 but q has Dk 4");
  expect_refused(with(with(p, floats("k_cache", {4, 2, 3, 4}, small)), floats("v_cache", {4, 2, 3, 2}, small)),
                 "k_cache", "Hkv is 3, which does not divide Hq 4");
  expect_refused(with(p, floats("v_cache", {4, 1, 2, 2}, small)), "v_cache", "does not match k_cache's [4,2,2,4]");
  expect_refused(with(p, floats("v_cache", {4, 2, 2, 2}, [](std::size_t e) { return e == 9 ? kNaN : 1.0; })),
                 "v_cache", "element 9 (page 1, slot 0) is NaN, in key 0 of b=1");
  expect_refused(with(p, ints("seqlens_k", {2}, {3, 5})), "seqlens_k", "element 1 is 5, more than Nk = 4");
  expect_refused(with_meta(p, "attn.kv_layout", "NDH"), "attn.kv_layout", "value \"NDH\" is not NHD or HND");
  expect_refused(with_meta(twin, "attn.kv_layout", "NHD"), "attn.kv_layout", "given, but the case has no paged KV cache");
  expect_refused(with(with_meta(p, "attn.outputs", "out,dq"), floats("dout", {2, 4, 3, 2}, small)), "attn.outputs",
                 "not defined for a paged KV cache");
  SafeTensorsFile mha;
  mha.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}};
  mha.put(*p.find("k_cache"));
  expect_refused(mha, "k_cache", "is an input of kind sdpa (a paged KV cache) but attn.kind is mha");
}

TEST_F(PagedEval, EmptyShapes) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.masked_rows", "zero"}, {"attn.outputs", "out,weights,lse"}};
  f.put(floats("q", {2, 2, 3, 4}, small));
  f.put(floats("k", {2, 1, 0, 4}, small));
  f.put(floats("v", {2, 1, 0, 2}, small));
  const SafeTensorsFile z = evaluated(f, "nk0");
  EXPECT_EQ(z.find("weights")->shape, (Shape{2, 2, 3, 0}));
  for (std::size_t e = 0; e < 12; ++e) EXPECT_EQ(decode_float(DType::F32, z.find("lse")->data.data() + 4 * e), -INFINITY);
  expect_refused(with_meta(f, "attn.masked_rows", "error"), "mask", "b=0, h=0, i=0");
  for (Shape q : {Shape{0, 2, 3, 4}, Shape{2, 2, 0, 4}}) {
    SafeTensorsFile e;
    e.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,lse"}};
    e.put(floats("q", q, small));
    e.put(floats("k", {q[0], 1, 5, 4}, small));
    e.put(floats("v", {q[0], 1, 5, 2}, small));
    const SafeTensorsFile r = evaluated(e, "empty");
    EXPECT_EQ(r.find("out")->shape, (Shape{q[0], 2, q[2], 2}));
    EXPECT_TRUE(r.find("out")->data.empty());
  }
}

}  // namespace
}  // namespace attnoracle::testing
