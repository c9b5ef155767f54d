// Paged KV caches and empty shapes (CONTRACT section 8): a paged case gives the golden bytes of
// its contiguous twin, gathered here by the test's own loop; empty shapes give empty outputs.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::testing {
namespace {

using Shape = std::vector<std::int64_t>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

RawTensor floats(const std::string& name, DType t, Shape shape, const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}

RawTensor i32(const std::string& name, Shape shape, const std::vector<std::int32_t>& v) {
  RawTensor r{name, DType::I32, std::move(shape), {}};
  r.data.resize(4 * v.size());
  if (!v.empty()) std::memcpy(r.data.data(), v.data(), 4 * v.size());
  return r;
}

// A paged problem: caches [Npages, P, Hkv, D] (NHD) or [Npages, Hkv, P, D] (HND) with NaN in
// every slot no used key maps to, and its contiguous twin gathered by this test's own loop.
struct Paged {
  DType dtype = DType::F32;
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Dk = 1, Dv = 1, P = 1, pages = 1, width = 1;
  bool hnd = false;
  std::vector<std::int32_t> table;     // [B, width]
  std::vector<std::int32_t> seqlens;   // [B]
  std::vector<double> q, k_cache, v_cache;
  std::map<std::string, std::string> md;

  std::int64_t Nk() const { return width * P; }
  std::size_t at(std::int64_t page, std::int64_t slot, std::int64_t g, std::int64_t d) const {
    return static_cast<std::size_t>((hnd ? (page * Hkv + g) * P + slot : (page * P + slot) * Hkv + g) * d);
  }
  // Caches filled by value(e) (exact in dtype) where used, NaN elsewhere.
  template <class F>
  void fill(F value) {
    k_cache.assign(static_cast<std::size_t>(pages * P * Hkv * Dk), kNaN);
    v_cache.assign(static_cast<std::size_t>(pages * P * Hkv * Dv), kNaN);
    std::size_t n = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < seqlens[static_cast<std::size_t>(b)]; ++j)
        for (std::int64_t g = 0; g < Hkv; ++g) {
          const std::int64_t page = table[static_cast<std::size_t>(b * width + j / P)];
          for (std::int64_t e = 0; e < Dk; ++e) {
            double& x = k_cache[at(page, j % P, g, Dk) + static_cast<std::size_t>(e)];
            if (std::isnan(x)) x = value(n++);
          }
          for (std::int64_t e = 0; e < Dv; ++e) {
            double& x = v_cache[at(page, j % P, g, Dv) + static_cast<std::size_t>(e)];
            if (std::isnan(x)) x = value(n++);
          }
        }
    q.resize(static_cast<std::size_t>(B * Hq * Nq * Dk));
    for (auto& x : q) x = value(n++);
  }
  SafeTensorsFile paged() const {
    SafeTensorsFile f;
    f.metadata = md;
    f.metadata["attn.format"] = std::string("1");
    if (hnd) f.metadata["attn.kv_layout"] = std::string("HND");
    f.put(floats("q", dtype, {B, Hq, Nq, Dk}, q));
    const Shape ks = hnd ? Shape{pages, Hkv, P, Dk} : Shape{pages, P, Hkv, Dk};
    const Shape vs = hnd ? Shape{pages, Hkv, P, Dv} : Shape{pages, P, Hkv, Dv};
    f.put(floats("k_cache", dtype, ks, k_cache));
    f.put(floats("v_cache", dtype, vs, v_cache));
    f.put(i32("block_table", {B, width}, table));
    f.put(i32("seqlens_k", {B}, seqlens));
    return f;
  }
  SafeTensorsFile contiguous() const {
    SafeTensorsFile f;
    f.metadata = md;
    f.metadata["attn.format"] = std::string("1");
    std::vector<double> k(static_cast<std::size_t>(B * Hkv * Nk() * Dk)), v(static_cast<std::size_t>(B * Hkv * Nk() * Dv));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t g = 0; g < Hkv; ++g)
        for (std::int64_t j = 0; j < seqlens[static_cast<std::size_t>(b)]; ++j) {
          const std::int64_t page = table[static_cast<std::size_t>(b * width + j / P)];
          for (std::int64_t e = 0; e < Dk; ++e)
            k[static_cast<std::size_t>(((b * Hkv + g) * Nk() + j) * Dk + e)] = k_cache[at(page, j % P, g, Dk) + static_cast<std::size_t>(e)];
          for (std::int64_t e = 0; e < Dv; ++e)
            v[static_cast<std::size_t>(((b * Hkv + g) * Nk() + j) * Dv + e)] = v_cache[at(page, j % P, g, Dv) + static_cast<std::size_t>(e)];
        }
    f.put(floats("q", dtype, {B, Hq, Nq, Dk}, q));
    f.put(floats("k", dtype, {B, Hkv, Nk(), Dk}, k));
    f.put(floats("v", dtype, {B, Hkv, Nk(), Dv}, v));
    f.put(i32("seqlens_k", {B}, seqlens));
    return f;
  }
};

EvalResult eval(const SafeTensorsFile& f) {
  EvalOptions opt;
  return evaluate(case_from_file("paged.safetensors", f), opt);
}

// Every golden tensor of the paged case equals its twin's, byte for byte.
::testing::AssertionResult same_golden(const Paged& p) {
  const EvalResult a = eval(p.paged()), b = eval(p.contiguous());
  if (a.golden.size() != b.golden.size()) return ::testing::AssertionFailure() << "golden tensor counts differ";
  for (std::size_t t = 0; t < a.golden.size(); ++t)
    if (a.golden[t].name != b.golden[t].name || a.golden[t].shape != b.golden[t].shape ||
        a.golden[t].data != b.golden[t].data)
      return ::testing::AssertionFailure() << a.golden[t].name << " differs from the contiguous twin's";
  return ::testing::AssertionSuccess();
}

double small(std::size_t n) { return static_cast<double>(static_cast<int>(n * 7 % 17) - 8) / 8; }

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

TEST(Paged, TwoPagesByHand) {
  // Keys 0, 1 on page 1, key 2 on page 0 slot 0; page 0 slot 1 unused (NaN). q = 0: every
  // score is 0, the weights are 1/3 each and out is the mean of v = (1 + 2 + 6) / 3 = 3.
  Paged p;
  p.P = 2, p.pages = 2, p.width = 2;
  p.table = {1, 0};
  p.seqlens = {3};
  p.md["attn.outputs"] = "out,weights,lse";
  p.q = {0};
  p.k_cache = {5, kNaN, -1, 3};  // page 0: key 2, unused; page 1: keys 0, 1
  p.v_cache = {6, kNaN, 1, 2};
  const EvalResult r = eval(p.paged());
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>{3});
  const double third = static_cast<float>(1.0 / 3);
  EXPECT_EQ(values(golden(r, "weights")), (std::vector<double>{third, third, third, 0}));  // Nk = 4
  EXPECT_EQ(values(golden(r, "lse")), std::vector<double>{static_cast<float>(std::log(3.0))});
  EXPECT_TRUE(same_golden(p));
}

TEST(Paged, ShuffledPagesNhdAndHnd) {
  for (bool hnd : {false, true}) {
    Paged p;
    p.dtype = DType::BF16, p.B = 2, p.Hq = 4, p.Hkv = 2, p.Nq = 3, p.Dk = 3, p.Dv = 2;
    p.P = 3, p.pages = 6, p.width = 3, p.hnd = hnd;
    p.table = {4, 0, 5, 2, 3, 1};
    p.seqlens = {8, 9};
    p.md["attn.outputs"] = "out,lse";
    p.md["attn.causal"] = "bottom_right";
    p.fill(small);
    EXPECT_TRUE(same_golden(p)) << (hnd ? "HND" : "NHD");
  }
}

TEST(Paged, SharedPagesAndUnusedEntries) {
  // Batch rows 0 and 1 share the prefix pages 2 and 0; row 1's last entry and row 2's second
  // are unused (-1, and 7: past Npages) and must not be read.
  Paged p;
  p.dtype = DType::F16, p.B = 3, p.Hq = 2, p.Hkv = 1, p.Nq = 2, p.Dk = 2, p.Dv = 2;
  p.P = 4, p.pages = 4, p.width = 3;
  p.table = {2, 0, 1, 2, 0, -1, 3, 7, -1};
  p.seqlens = {11, 6, 4};
  p.md["attn.outputs"] = "out,weights,lse";
  p.fill(small);
  EXPECT_TRUE(same_golden(p));
  // The shared slots hold one value, read by both rows: their keys are equal.
  const Case c = case_from_file("paged.safetensors", p.paged());
  for (std::int64_t j = 0; j < 6; ++j)
    for (std::int64_t e = 0; e < 2; ++e)
      EXPECT_EQ(c.k.values[static_cast<std::size_t>(j * 2 + e)], c.k.values[static_cast<std::size_t>((12 + j) * 2 + e)]);
  ASSERT_TRUE(c.paged);
  EXPECT_EQ(c.paged->page_size, 4);
  EXPECT_EQ(c.Nk, 12);
}

TEST(Paged, UsedEntryOutsideThePagesIsRefused) {
  Paged p;
  p.P = 2, p.pages = 4, p.width = 2;
  p.table = {0, 7};
  p.seqlens = {3};
  p.fill(small);
  try {
    case_from_file("paged.safetensors", p.paged());
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "block_table");
    EXPECT_NE(std::string(e.what()).find("entry [0, 1] = 7 is outside [0, 4)"), std::string::npos) << e.what();
  }
}

TEST(Paged, NonFiniteInAUsedSlotIsNamedInTheCache) {
  Paged p;
  p.P = 2, p.pages = 2, p.width = 2, p.hnd = true;
  p.table = {1, 0};
  p.seqlens = {3};
  p.fill(small);
  p.v_cache[p.at(0, 0, 0, 1)] = kNaN;  // key 2
  try {
    case_from_file("paged.safetensors", p.paged());
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "v_cache");
    EXPECT_NE(std::string(e.what()).find("element 0 (page 0, slot 0) is NaN, in key 2"), std::string::npos) << e.what();
  }
}

// Random paged cases: page sizes 1 to 9, pages shuffled and shared between batch rows, unused
// table entries -1 or out of range, NaN in every unused slot, either layout.
RC_GTEST_PROP(PagedProperty, GoldenBytesOfTheContiguousTwin, ()) {
  Paged p;
  p.dtype = *rc::gen::element(DType::F32, DType::F16, DType::BF16, DType::F64);
  p.B = *rc::gen::inRange<std::int64_t>(1, 4);
  p.Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  p.Hq = p.Hkv * *rc::gen::inRange<std::int64_t>(1, 3);
  p.Nq = *rc::gen::inRange<std::int64_t>(1, 4);
  p.Dk = *rc::gen::inRange<std::int64_t>(1, 5);
  p.Dv = *rc::gen::inRange<std::int64_t>(1, 5);
  p.P = *rc::gen::inRange<std::int64_t>(1, 10);
  p.width = *rc::gen::inRange<std::int64_t>(1, 5);
  p.hnd = *rc::gen::arbitrary<bool>();
  p.pages = *rc::gen::inRange<std::int64_t>(1, p.B * p.width + 2);
  for (std::int64_t b = 0; b < p.B; ++b) {
    const auto lk = *rc::gen::inRange<std::int64_t>(0, p.Nk() + 1);
    p.seqlens.push_back(static_cast<std::int32_t>(lk));
    const std::int64_t used = (lk + p.P - 1) / p.P;
    for (std::int64_t m = 0; m < p.width; ++m)
      p.table.push_back(m < used ? *rc::gen::inRange<std::int32_t>(0, static_cast<std::int32_t>(p.pages))
                                 : *rc::gen::element<std::int32_t>(-1, static_cast<std::int32_t>(p.pages), 1000));
  }
  const auto seed = *rc::gen::inRange<std::uint32_t>(0, 1000);
  p.fill([seed](std::size_t n) { return static_cast<double>(static_cast<int>((n * 2654435761u + seed) % 33) - 16) / 16; });
  p.md["attn.masked_rows"] = "zero";  // Lk = 0 leaves rows without keys
  p.md["attn.outputs"] = *rc::gen::element<std::string>("out", "out,lse", "out,weights,lse");
  p.md["attn.causal"] = *rc::gen::element<std::string>("none", "top_left", "bottom_right");
  RC_ASSERT(same_golden(p));
}

// Empty shapes (CONTRACT section 8).
Paged tiny(std::int64_t B, std::int64_t Nq) {
  Paged p;
  p.B = B, p.Nq = Nq, p.Hq = 2, p.Hkv = 1, p.Dk = 2, p.Dv = 3;
  return p;
}

SafeTensorsFile contiguous(std::int64_t B, std::int64_t Nq, std::int64_t Nk, const std::string& policy) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.masked_rows", policy}, {"attn.outputs", "out,weights,lse"}};
  f.put(floats("q", DType::F32, {B, 2, Nq, 2}, std::vector<double>(static_cast<std::size_t>(B * 2 * Nq * 2), 0.5)));
  f.put(floats("k", DType::F32, {B, 1, Nk, 2}, std::vector<double>(static_cast<std::size_t>(B * Nk * 2), 0.25)));
  f.put(floats("v", DType::F32, {B, 1, Nk, 3}, std::vector<double>(static_cast<std::size_t>(B * Nk * 3), 1)));
  return f;
}

TEST(EmptyShapes, NoKeysUnderZero) {
  const EvalResult r = eval(contiguous(2, 3, 0, "zero"));
  EXPECT_EQ(golden(r, "out").shape, (Shape{2, 2, 3, 3}));
  for (double x : values(golden(r, "out"))) EXPECT_EQ(x, 0);
  EXPECT_EQ(golden(r, "weights").shape, (Shape{2, 2, 3, 0}));
  EXPECT_TRUE(golden(r, "weights").data.empty());
  for (double x : values(golden(r, "lse"))) EXPECT_EQ(x, -INFINITY);
  for (unsigned char x : golden(r, "row.valid").data) EXPECT_EQ(x, 0);
}

TEST(EmptyShapes, NoKeysUnderErrorIsRefusedNamingTheRow) {
  const Case c = case_from_file("empty.safetensors", contiguous(2, 3, 0, "error"));
  const auto row = c.first_refused_row();
  ASSERT_TRUE(row);
  EXPECT_EQ(row->b, 0);
  EXPECT_EQ(row->h, 0);
  EXPECT_EQ(row->i, 0);
  EXPECT_THROW(evaluate(c, {}), FullyMaskedRow);
}

TEST(EmptyShapes, NoBatchAndNoQueries) {
  for (auto [B, Nq] : {std::pair<std::int64_t, std::int64_t>{0, 3}, {2, 0}, {0, 0}}) {
    const EvalResult r = eval(contiguous(B, Nq, 4, "error"));
    EXPECT_EQ(golden(r, "out").shape, (Shape{B, 2, Nq, 3}));
    EXPECT_TRUE(golden(r, "out").data.empty());
    EXPECT_EQ(golden(r, "weights").shape, (Shape{B, 2, Nq, 4}));
    EXPECT_EQ(golden(r, "lse").shape, (Shape{B, 2, Nq}));
    EXPECT_EQ(r.stats.rows, 0u);
  }
}

TEST(EmptyShapes, GradientsAndKindMha) {
  // No keys: dq 0 (every row fully masked, policy zero), dk and dv [B, Hkv, 0, D]; no batch:
  // every gradient empty.
  for (auto [B, Nk] : {std::pair<std::int64_t, std::int64_t>{2, 0}, {0, 4}}) {
    SafeTensorsFile f = contiguous(B, 3, Nk, "zero");
    f.metadata["attn.outputs"] = "out,dq,dk,dv";
    f.put(floats("dout", DType::F32, {B, 2, 3, 3}, std::vector<double>(static_cast<std::size_t>(B * 2 * 3 * 3), 1)));
    const EvalResult r = eval(f);
    EXPECT_EQ(golden(r, "dk").shape, (Shape{B, 1, Nk, 2}));
    for (double x : values(golden(r, "dq"))) EXPECT_EQ(x, 0);
  }
  SafeTensorsFile m;
  m.metadata = {{"attn.format", "1"}, {"attn.kind", "mha"}, {"attn.masked_rows", "zero"}, {"attn.outputs", "out,lse"}};
  m.put(floats("x_q", DType::F32, {1, 2, 3}, std::vector<double>(6, 1)));
  m.put(floats("x_kv", DType::F32, {1, 0, 3}, {}));
  for (const char* w : {"w_q", "w_k", "w_v"}) m.put(floats(w, DType::F32, {2, 3, 2}, std::vector<double>(12, 1)));
  m.put(floats("w_o", DType::F32, {4, 3}, std::vector<double>(12, 1)));
  const EvalResult r = eval(m);
  EXPECT_EQ(values(golden(r, "out")), std::vector<double>(6, 0));
  for (double x : values(golden(r, "lse"))) EXPECT_EQ(x, -INFINITY);
}

TEST(EmptyShapes, PagedWithoutUsedPages) {
  // Every seqlens_k 0: no entry used, the table may hold anything, the caches no page at all.
  Paged p = tiny(2, 1);
  p.P = 4, p.pages = 0, p.width = 2;
  p.table = {-1, -1, 5, 9};
  p.seqlens = {0, 0};
  p.md["attn.masked_rows"] = "zero";
  p.fill(small);
  const EvalResult r = eval(p.paged());
  for (double x : values(golden(r, "out"))) EXPECT_EQ(x, 0);
  EXPECT_TRUE(same_golden(p));
}

TEST(EmptyShapes, SafetensorsRoundTrip) {
  SafeTensorsFile f = contiguous(0, 3, 0, "zero");
  const SafeTensorsFile g = parse_safetensors("empty", serialize_safetensors(f));
  ASSERT_EQ(g.tensors.size(), 3u);
  EXPECT_EQ(g.find("k")->shape, (Shape{0, 1, 0, 2}));
  EXPECT_TRUE(g.find("k")->data.empty());
}

}  // namespace
}  // namespace attnoracle::testing
