// Cases with stored K/V, FP8 outputs with amax, and dropout are judged: the golden result
// passes, and the judgement is not a skip.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "golden_results.hpp"

#include "attnoracle/conformance/compare.hpp"

namespace attnoracle::conformance {
namespace {

// One query over two keys, F32: q = (1, 0), k = (0.5, 1), (0, -1), v = (2, 4), (6, 8).
SafeTensorsFile plain() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(testing::f32_tensor("q", {1, 1, 1, 2}, {1, 0}));
  f.put(testing::f32_tensor("k", {1, 1, 2, 2}, {0.5f, 1, 0, -1}));
  f.put(testing::f32_tensor("v", {1, 1, 2, 2}, {2, 4, 6, 8}));
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
  f.put(testing::f32_tensor("k_scale", {}, {1}));
  f.put(testing::f32_tensor("v_scale", {}, {1}));
  f.put(RawTensor{"v", DType::F8_E4M3, {1, 1, 2, 2}, {0x40, 0x48, 0x4C, 0x50}});  // 2, 4, 6, 8
  f.metadata["attn.output_dtype"] = "F32";
  const CaseReport r = judged(f);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
}

TEST(Unmodelled, Fp8OutAndAmaxAreJudged) {
  SafeTensorsFile f = plain();
  f.metadata["attn.output_dtype"] = "F8_E4M3";
  f.put(testing::f32_tensor("o_scale", {}, {0.25f}));
  EXPECT_EQ(judged(f).status, CaseStatus::Pass);
  f.metadata["attn.outputs"] = "out,amax";
  EXPECT_EQ(judged(f).status, CaseStatus::Pass);
}

// Dropout is judged (TOLERANCE.md, "Dropout"): the golden result passes; an out without the
// keep scale 1 / (1 - p) = 2 (half the golden one) fails.
TEST(Unmodelled, DropoutIsJudged) {
  SafeTensorsFile f = plain();
  f.metadata["attn.dropout_p"] = "0.5";
  f.put(RawTensor{"dropout_mask", DType::BOOL, {2}, {1, 0}});
  const SafeTensorsFile golden = testing::golden_of(f);
  const Profile fp32 = builtin_profile("fp32");
  EXPECT_EQ(compare_case("c", golden, "ok", testing::golden_result(golden, {"out"}), fp32).status, CaseStatus::Pass);
  JobResult half = testing::golden_result(golden, {"out"});
  RawTensor& out = testing::tensor(half, "out");
  for (std::size_t k = 0; k < out.data.size() / 4; ++k) testing::set(out, k, testing::get(out, k) / 2.0);
  const CaseReport r = compare_case("c", golden, "ok", half, fp32);
  EXPECT_EQ(r.status, CaseStatus::Fail) << r.reason;
}

}  // namespace
}  // namespace attnoracle::conformance
