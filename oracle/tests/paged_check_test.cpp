// paged_gather: the oracle's own gathering of a paged case against the k and v the reference
// evaluates; a tampered gather is caught, an honest one passes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::oracle {
namespace {

RawTensor floats(const std::string& name, DType t, std::vector<std::int64_t> shape, const std::vector<double>& v) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) encode_float(t, v[i], r.data.data() + i * dtype_size(t));
  return r;
}

RawTensor i32(const std::string& name, std::vector<std::int64_t> shape, const std::vector<std::int32_t>& v) {
  RawTensor r{name, DType::I32, std::move(shape), std::vector<unsigned char>(4 * v.size())};
  std::memcpy(r.data.data(), v.data(), 4 * v.size());
  return r;
}

// HND caches [3 pages, Hkv = 1, P = 2, D = 2] in BF16; row 0 reads pages 2, 0 (3 keys), row 1
// page 0 (shared) then an unused -1; slot 1 of page 1 is NaN (unused).
Case paged_case() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.kv_layout", "HND"}};
  f.put(floats("q", DType::BF16, {2, 2, 1, 2}, {0.5, 1, -1, 0.25, 2, 0, 1, 1}));
  f.put(floats("k_cache", DType::BF16, {3, 1, 2, 2}, {1, 2, 3, 4, 5, 6, nan, nan, 9, 10, 11, 12}));
  f.put(floats("v_cache", DType::BF16, {3, 1, 2, 2}, {-1, -2, -3, -4, -5, -6, nan, 0, -9, -10, -11, -12}));
  f.put(i32("block_table", {2, 2}, {2, 0, 0, -1}));
  f.put(i32("seqlens_k", {2}, {3, 2}));
  return case_from_file("paged.safetensors", f);
}

TEST(PagedGather, AnHonestGatherPasses) {
  const Case c = paged_case();
  EXPECT_TRUE(check_paged(c).empty());
  EXPECT_EQ(c.k.values[0], 9);   // row 0, key 0: page 2, slot 0
  EXPECT_EQ(c.k.values[4], 1);   // row 0, key 2: page 0, slot 0
  EXPECT_EQ(c.k.values[8], 1);   // row 1, key 0: page 0 again
  EXPECT_NO_THROW(certified_evaluate(c, {}, {}));
}

TEST(PagedGather, ATamperedGatherIsCaught) {
  Case c = paged_case();
  c.v.values[5] = -6;  // row 0, key 2's second value: page 0 holds -2
  const auto v = check_paged(c);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].invariant, Invariant::PagedGather);
  EXPECT_EQ(v[0].b, 0);
  EXPECT_EQ(v[0].j, 2);
  EXPECT_EQ(v[0].c, 1);
  EXPECT_THROW(certified_evaluate(c, {}, {}), InvariantViolation);
  Case d = paged_case();
  d.k.values[14] = 0.5;  // row 1, key 3: past seqlens_k, must be 0
  EXPECT_FALSE(check_paged(d).empty());
}

TEST(PagedGather, NotPagedNothingToCheck) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(floats("q", DType::F32, {1, 1, 1, 1}, {1}));
  f.put(floats("k", DType::F32, {1, 1, 1, 1}, {1}));
  f.put(floats("v", DType::F32, {1, 1, 1, 1}, {1}));
  EXPECT_TRUE(check_paged(case_from_file("c.safetensors", f)).empty());
}

}  // namespace
}  // namespace attnoracle::oracle
