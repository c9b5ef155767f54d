// Cases whose arithmetic no profile declares yet (dropout) are skipped with the reason, even
// when the result is the golden one; stored K/V and FP8 outputs with amax are judged and pass.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "golden_results.hpp"

#include "attnoracle/conformance/compare.hpp"

namespace attnoracle::conformance {
namespace {

using Shape = std::vector<std::int64_t>;

RawTensor f32(const std::string& name, Shape shape, const std::vector<float>& v) {
  RawTensor r{name, DType::F32, std::move(shape), {}};
  r.data.resize(4 * v.size());
  std::memcpy(r.data.data(), v.data(), r.data.size());
  return r;
}

// One query over two keys, F32: q = (1, 0), k = (0.5, 1), (0, -1), v = (2, 4), (6, 8).
SafeTensorsFile plain() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(f32("q", {1, 1, 1, 2}, {1, 0}));
  f.put(f32("k", {1, 1, 2, 2}, {0.5f, 1, 0, -1}));
  f.put(f32("v", {1, 1, 2, 2}, {2, 4, 6, 8}));
  return f;
}

CaseReport judged(const SafeTensorsFile& f) {
  const SafeTensorsFile golden = testing::golden_of(f);
  return compare_case("c", golden, "ok", testing::golden_result(golden, {"out", "amax"}), builtin_profile("fp32"));
}

TEST(Unmodelled, ThePlainCasePasses) { EXPECT_EQ(judged(plain()).status, CaseStatus::Pass); }

TEST(Unmodelled, StoredKvIsJudged) {
  SafeTensorsFile f = plain();
  // k as E4M3 patterns of 0.5, 1, 0, -1 (exponent bias 7) with a per-tensor scale of 1
  f.put(RawTensor{"k", DType::F8_E4M3, {1, 1, 2, 2}, {0x30, 0x38, 0x00, 0xB8}});
  f.put(f32("k_scale", {}, {1}));
  f.put(f32("v_scale", {}, {1}));
  f.put(RawTensor{"v", DType::F8_E4M3, {1, 1, 2, 2}, {0x40, 0x48, 0x4C, 0x50}});  // 2, 4, 6, 8
  f.metadata["attn.output_dtype"] = "F32";
  const CaseReport r = judged(f);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
}

TEST(Unmodelled, Fp8OutAndAmaxAreJudged) {
  SafeTensorsFile f = plain();
  f.metadata["attn.output_dtype"] = "F8_E4M3";
  f.put(f32("o_scale", {}, {0.25f}));
  EXPECT_EQ(judged(f).status, CaseStatus::Pass);
  f.metadata["attn.outputs"] = "out,amax";
  EXPECT_EQ(judged(f).status, CaseStatus::Pass);
}

TEST(Unmodelled, DropoutIsSkipped) {
  SafeTensorsFile f = plain();
  f.metadata["attn.dropout_p"] = "0.5";
  f.put(RawTensor{"dropout_mask", DType::BOOL, {2}, {1, 0}});
  const CaseReport r = judged(f);
  EXPECT_EQ(r.status, CaseStatus::Skip);
  EXPECT_EQ(r.reason, "dropout: no profile declares its scaling yet");
}

}  // namespace
}  // namespace attnoracle::conformance
