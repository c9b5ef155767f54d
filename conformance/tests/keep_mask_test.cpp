// The statistics of a keep mask an implementation drew (TOLERANCE.md, "The keep mask's
// statistics") on masks from a seeded generator: correct ones pass, a keep rate 1% off at
// Nq x Nk = 2^20 fails, masks repeated across heads or rows fail; and the gate judging a result
// against the golden values of the case with the mask it returned.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "golden_results.hpp"

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/keep_mask.hpp"

namespace attnoracle::conformance {
namespace {

// A case of H heads, N queries and N keys (Dk = Dv = 1), its given mask all kept.
SafeTensorsFile case_file(std::int64_t H, std::int64_t N, const std::string& p, const std::string& causal = "none") {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.dropout_p", p}, {"attn.causal", causal}};
  std::vector<float> x(static_cast<std::size_t>(H * N));
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = static_cast<float>(k % 7) / 8 - 0.375f;
  f.put(testing::f32_tensor("q", {1, H, N, 1}, x));
  f.put(testing::f32_tensor("k", {1, H, N, 1}, x));
  f.put(testing::f32_tensor("v", {1, H, N, 1}, x));
  f.put(RawTensor{"dropout_mask", DType::BOOL, {1}, {1}});
  return f;
}

// [1, H, N, N] drawn with keep probability q; `same_heads`/`same_rows` repeat head 0 / row 0.
RawTensor drawn(std::int64_t H, std::int64_t N, double q, std::uint64_t seed, bool same_heads = false,
                bool same_rows = false) {
  RawTensor m{"dropout_mask", DType::BOOL, {1, H, N, N}, std::vector<std::uint8_t>(static_cast<std::size_t>(H * N * N))};
  std::mt19937_64 g(seed);
  std::bernoulli_distribution keep(q);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        const auto k = static_cast<std::size_t>((h * N + i) * N + j);
        const std::int64_t h0 = same_heads ? 0 : h, i0 = same_rows ? 0 : i;
        m.data[k] = (h0 == h && i0 == i) ? keep(g) : m.data[static_cast<std::size_t>((h0 * N + i0) * N + j)];
      }
  return m;
}

std::vector<KeepTest> tests(const SafeTensorsFile& f, const RawTensor& m) { return keep_mask_tests(case_from_file("c", f), m); }

TEST(KeepMask, CorrectGeneratorsPassAndARateOnePercentOffFailsAt2To20) {
  for (const auto& [p, q] : {std::pair<std::string, double>{"0.1", 0.9}, {"0.5", 0.5}}) {
    const SafeTensorsFile f = case_file(1, 1024, p);  // Nq x Nk = 2^20
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      const auto t = tests(f, drawn(1, 1024, q, seed));
      EXPECT_EQ(t[0].count, 1 << 20);
      EXPECT_NEAR(t[0].allowed, 0.00273, 1e-5);
      EXPECT_EQ(keep_mask_verdict(t), "") << p << " seed " << seed;
    }
    const auto off = tests(f, drawn(1, 1024, q * 0.99, 7));  // the keep rate 1% low
    EXPECT_FALSE(off[0].ok()) << p;
    EXPECT_NE(keep_mask_verdict(off).find("dropout_mask: keep rate"), std::string::npos) << keep_mask_verdict(off);
  }
}

TEST(KeepMask, MasksRepeatedAcrossHeadsOrRowsFail) {
  const SafeTensorsFile f = case_file(4, 64, "0.1");
  EXPECT_EQ(keep_mask_verdict(tests(f, drawn(4, 64, 0.9, 3))), "");
  const auto heads = tests(f, drawn(4, 64, 0.9, 3, true));
  EXPECT_TRUE(heads[0].ok());
  EXPECT_FALSE(heads[1].ok());
  EXPECT_EQ(heads[1].observed, 1);
  EXPECT_NEAR(heads[1].expected, 0.82, 1e-12);
  EXPECT_NE(keep_mask_verdict(heads).find("agreement between heads 1 over"), std::string::npos) << keep_mask_verdict(heads);
  const auto rows = tests(f, drawn(4, 64, 0.9, 3, false, true));
  EXPECT_FALSE(rows[2].ok());
  EXPECT_EQ(rows[2].observed, 1);
}

// Only allowed keys count: causal rows draw for keys j <= i alone, and what the mask holds past
// them is not looked at.
TEST(KeepMask, OnlyAllowedKeysAreCounted) {
  const SafeTensorsFile f = case_file(2, 64, "0.5", "top_left");
  RawTensor m = drawn(2, 64, 0.5, 5);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 64; ++i)
      for (std::int64_t j = i + 1; j < 64; ++j) m.data[static_cast<std::size_t>((h * 64 + i) * 64 + j)] = 0;
  const auto t = tests(f, m);
  EXPECT_EQ(t[0].count, 2 * 64 * 65 / 2);
  EXPECT_EQ(t[1].count, 64 * 65 / 2);  // one pair of heads
  EXPECT_EQ(keep_mask_verdict(t), "");
}

// The gate with a returned mask: judged against the case evaluated with it.
TEST(KeepMask, TheGateJudgesAgainstTheReturnedMask) {
  set_case_evaluator([](const SafeTensorsFile& f) { return testing::golden_of(f); });
  SafeTensorsFile f = case_file(2, 8, "0.5");
  f.metadata["attn.outputs"] = "out";
  const SafeTensorsFile golden = testing::golden_of(f);  // all kept
  const Profile fp32 = builtin_profile("fp32");
  const RawTensor mask = drawn(2, 8, 0.5, 11);
  SafeTensorsFile g2 = f;
  g2.put(mask);
  JobResult right = testing::golden_result(testing::golden_of(g2), {"out"});
  right.output.put(mask);
  CaseReport r = compare_case("c", golden, "ok", right, fp32);
  EXPECT_EQ(r.status, CaseStatus::Pass) << r.reason;
  // the golden out of the given mask with another mask returned: off where they differ
  JobResult wrong = testing::golden_result(golden, {"out"});
  wrong.output.put(mask);
  EXPECT_EQ(compare_case("c", golden, "ok", wrong, fp32).status, CaseStatus::Fail);
  // a mask of another shape, or with no evaluator registered
  JobResult bad = testing::golden_result(golden, {"out"});
  bad.output.put(RawTensor{"dropout_mask", DType::BOOL, {8, 8}, std::vector<std::uint8_t>(64, 1)});
  r = compare_case("c", golden, "ok", bad, fp32);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  EXPECT_EQ(r.reason, "dropout_mask: returned as BOOL [8,8], expected BOOL [1,2,8,8]");
  RawTensor twos = mask;  // a byte other than 0 and 1: the case with it is bad input
  twos.data[3] = 2;
  JobResult odd = testing::golden_result(golden, {"out"});
  odd.output.put(twos);
  r = compare_case("c", golden, "ok", odd, fp32);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  EXPECT_EQ(r.reason.rfind("dropout_mask: returned, and the case with it is refused: ", 0), 0u) << r.reason;
  set_case_evaluator({});
  r = compare_case("c", golden, "ok", right, fp32);
  EXPECT_EQ(r.status, CaseStatus::Fail);
  EXPECT_EQ(r.reason, "dropout_mask: returned, but this program has no evaluator for its golden values");
}

}  // namespace
}  // namespace attnoracle::conformance
