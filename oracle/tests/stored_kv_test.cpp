// stored_kv: the oracle's own decoding of stored K/V (CONTRACT section 9) accepts the case the
// reader computed and catches a k or v one element off.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::oracle {
namespace {

using Shape = std::vector<std::int64_t>;

RawTensor f32(const std::string& name, Shape shape, const std::function<double(std::size_t)>& value) {
  RawTensor r{name, DType::F32, std::move(shape), {}};
  r.data.resize(4 * static_cast<std::size_t>(r.numel()));
  for (std::size_t e = 0; e < r.data.size() / 4; ++e) encode_float(DType::F32, static_cast<float>(value(e)), r.data.data() + 4 * e);
  return r;
}
RawTensor bytes(const std::string& name, DType t, Shape shape, const std::function<unsigned char(std::size_t)>& b) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(static_cast<std::size_t>(r.numel()));
  for (std::size_t e = 0; e < r.data.size(); ++e) r.data[e] = b(e);
  return r;
}
RawTensor i32(const std::string& name, Shape shape, const std::vector<std::int32_t>& v) {
  RawTensor r{name, DType::I32, std::move(shape), {}};
  r.data.resize(4 * v.size());
  std::memcpy(r.data.data(), v.data(), r.data.size());
  return r;
}
double small(std::size_t e) { return 0.25 * static_cast<double>(e % 7) - 0.5; }
unsigned char finite_e4m3(std::size_t e) { return static_cast<unsigned char>(e * 37 % 0x7F); }

SafeTensorsFile base(std::int64_t d) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.output_dtype", "F32"}};
  f.put(f32("q", {1, 2, 2, d}, small));
  return f;
}

std::vector<SafeTensorsFile> cases() {
  std::vector<SafeTensorsFile> all;
  SafeTensorsFile s = base(4);  // scaled I8, per-token k scales; v a view of k
  s.metadata["attn.v_from_k"] = "3";
  s.put(bytes("k", DType::I8, {1, 2, 3, 4}, [](std::size_t e) { return static_cast<unsigned char>(e * 53); }));
  s.put(f32("k_scale", {1, 2, 3, 1}, [](std::size_t e) { return 0.01 * static_cast<double>(e + 1); }));
  all.push_back(s);
  SafeTensorsFile m = base(32);  // mxfp8
  m.metadata["attn.kv_block_scale"] = "mxfp8";
  m.put(bytes("k", DType::F8_E4M3, {1, 2, 3, 32}, finite_e4m3));
  m.put(bytes("v", DType::F8_E4M3, {1, 2, 3, 32}, [](std::size_t e) { return finite_e4m3(e + 5); }));
  m.put(bytes("k_block_scale", DType::U8, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(120 + e); }));
  m.put(bytes("v_block_scale", DType::U8, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(125 - e); }));
  all.push_back(m);
  SafeTensorsFile n = base(16);  // nvfp4
  n.metadata["attn.kv_block_scale"] = "nvfp4";
  n.put(bytes("k", DType::U8, {1, 2, 3, 8}, [](std::size_t e) { return static_cast<unsigned char>(e * 91); }));
  n.put(bytes("v", DType::U8, {1, 2, 3, 8}, [](std::size_t e) { return static_cast<unsigned char>(e * 13); }));
  n.put(bytes("k_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(0x30 + e); }));
  n.put(bytes("v_block_scale", DType::F8_E4M3, {1, 2, 3, 1}, [](std::size_t e) { return static_cast<unsigned char>(0x28 + e); }));
  n.put(f32("k_global_scale", {}, [](std::size_t) { return 0.75; }));
  n.put(f32("v_global_scale", {}, [](std::size_t) { return 0.5; }));
  all.push_back(n);
  SafeTensorsFile p = base(4);  // paged E5M2, HND, per-slot scales
  p.metadata["attn.kv_layout"] = "HND";
  p.put(bytes("k_cache", DType::F8_E5M2, {3, 2, 2, 4}, [](std::size_t e) { return static_cast<unsigned char>(e * 7 % 0x7B); }));
  p.put(bytes("v_cache", DType::F8_E5M2, {3, 2, 2, 4}, [](std::size_t e) { return static_cast<unsigned char>(e * 11 % 0x7B); }));
  p.put(f32("k_scale", {3, 2, 2}, [](std::size_t e) { return 0.125 * static_cast<double>(e + 1); }));
  p.put(f32("v_scale", {1, 2, 1}, [](std::size_t e) { return 0.5 + static_cast<double>(e); }));
  p.put(i32("block_table", {1, 2}, {2, 0}));
  p.put(i32("seqlens_k", {1}, {3}));
  all.push_back(p);
  return all;
}

TEST(StoredKv, TheReadersValuesPass) {
  for (const SafeTensorsFile& f : cases()) {
    const Case c = case_from_file("stored.safetensors", f);
    EXPECT_TRUE(check_stored_kv(c).empty()) << check_stored_kv(c).front().message();
  }
}

TEST(StoredKv, OneElementOffIsCaught) {
  for (const SafeTensorsFile& f : cases())
    for (bool in_v : {false, true}) {
      Case c = case_from_file("stored.safetensors", f);
      FloatTensor& t = in_v ? c.v : c.k;
      t.values[t.values.size() / 2 + 1] *= 1.0 + 0x1p-40;
      if (t.values[t.values.size() / 2 + 1] == 0) t.values[t.values.size() / 2 + 1] = 0x1p-60;
      const auto v = check_stored_kv(c);
      ASSERT_FALSE(v.empty()) << f.metadata.size() << (in_v ? " v" : " k");
      EXPECT_EQ(v.front().invariant, Invariant::StoredKv);
      EXPECT_EQ(invariant_name(v.front().invariant), "stored_kv");
    }
}

TEST(StoredKv, OtherCasesHaveNothingToCheck) {
  SafeTensorsFile f = base(4);
  f.put(f32("k", {1, 2, 3, 4}, small));
  f.put(f32("v", {1, 2, 3, 4}, small));
  EXPECT_TRUE(check_stored_kv(case_from_file("plain.safetensors", f)).empty());
}

}  // namespace
}  // namespace attnoracle::oracle
