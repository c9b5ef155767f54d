// The statistical tier: its limits worked by hand, samples drawn from the model (pass), scaled or
// biased ones (fail), and end to end on the committed core suite.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <random>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/statistics.hpp"
#include "cli_run.hpp"

namespace attnoracle::conformance {
namespace {

// `rows` rows of `per_row` normalised errors, each the sum of `roundings` independent roundings
// uniform in [-c, c] with c = 1 / roundings (their scales add to 1, as out_scale's terms do),
// times `factor`, plus `bias`.
Sample model_sample(std::uint32_t seed, int rows, int per_row, int roundings, double factor = 1, double bias = 0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  Sample s;
  for (int r = 0; r < rows; ++r)
    for (int e = 0; e < per_row; ++e) {
      double z = 0;
      for (int k = 0; k < roundings; ++k) z += u(gen) / roundings;
      s.add(r, factor * z + bias, 0);
    }
  return s;
}

TEST(StatisticsLimits, WorkedByHand) {
  Sample s = model_sample(1, 512, 8, 1);
  const Tier t = judge(s);
  EXPECT_TRUE(t.tested);
  EXPECT_EQ(t.n, 4096);
  EXPECT_EQ(t.rows, 512);
  // 100 * 2 exp(-l^2 / 2) = 1e-6: l^2 = 2 ln(2e8) = 38.227656
  EXPECT_NEAR(t.q99_limit, 6.182852, 1e-6);
  // 2 ln 2 + 4 ln(1e6) / 512 = 1.386294 + 0.107933
  EXPECT_NEAR(t.rms_limit, std::sqrt(1.494227), 1e-6);
  // over the 512 row means: sqrt(2 ln(2e6) / 512) = sqrt(29.017316 / 512)
  EXPECT_NEAR(t.mean_limit, 0.238064, 1e-6);
}

TEST(StatisticsLimits, FewElementsAreNotTested) {
  Sample s;
  for (int k = 0; k < kMinSample - 1; ++k) s.add(k, 100.0, 0);  // far beyond every limit
  const Tier t = judge(s);
  EXPECT_FALSE(t.tested);
  EXPECT_TRUE(t.ok);
  s.add(99, 100.0, 0);
  EXPECT_FALSE(judge(s).ok);
}

TEST(StatisticsLimits, ZerosCountInTheQuantile) {
  // 99 zeros and one error of 7 in 100 elements: the 99th percentile is 0, the maximum 7
  Sample s;
  for (int k = 0; k < 99; ++k) s.add(k, 0, 0);
  s.add(99, 7, 0);
  Tier t = judge(s);
  EXPECT_EQ(t.q99, 0);
  EXPECT_EQ(t.n, 100);
  // two of 100 at 7: the percentile is 7, beyond 6.18
  Sample s2;
  for (int k = 0; k < 98; ++k) s2.add(k, 0, 0);
  s2.add(98, 7, 0);
  s2.add(99, -7, 0);
  t = judge(s2);
  EXPECT_EQ(t.q99, 7);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("99th percentile"), std::string::npos) << t.note;
}

TEST(StatisticsSamples, FromTheModelPasses) {
  for (int roundings : {1, 2, 16}) {
    Sample s = model_sample(7, 512, 8, roundings);
    const Tier t = judge(s);
    EXPECT_TRUE(t.ok) << roundings << ": " << t.note;
    EXPECT_GT(t.headroom, 1) << roundings;
  }
}

TEST(StatisticsSamples, ScaledByFourFails) {
  // one rounding a term, uniform in [-4, 4]: rms 2.31 against a limit of 1.22
  Sample s = model_sample(7, 512, 8, 1, 4);
  const Tier t = judge(s);
  EXPECT_FALSE(t.ok);
  EXPECT_NEAR(t.rms, 4 / std::sqrt(3.0), 0.05);
  EXPECT_NE(t.note.find("root mean square"), std::string::npos) << t.note;
  EXPECT_LT(t.headroom, 1);
}

TEST(StatisticsSamples, BiasedFails) {
  // half the scale in one direction: 0.5 against 0.238
  Sample s = model_sample(7, 512, 8, 2, 1, 0.5);
  const Tier t = judge(s);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("biased"), std::string::npos) << t.note;
  Sample down = model_sample(7, 512, 8, 2, 1, -0.5);
  EXPECT_FALSE(judge(down).ok);
}

// Any sample of the model, whatever its shape, passes (each test fails with probability 1e-6).
RC_GTEST_PROP(StatisticsSamples, ModelSamplesPass, ()) {
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  const int rows = *rc::gen::inRange(1, 300), per_row = *rc::gen::inRange(1, 40), roundings = *rc::gen::inRange(1, 8);
  Sample s = model_sample(seed, rows, per_row, roundings);
  const Tier t = judge(s);
  RC_ASSERT(t.ok);
  RC_ASSERT(t.tested == (rows * per_row >= kMinSample));
}

// End to end: the FlashAttention-style NumPy kernel under flash-fp16 on the F16 cases of core,
// correct, then with its output rounded toward +inf (within every element's limit).
struct GateRun {
  int status;
  std::string out;
  nlohmann::json report;
};
GateRun gate_flash_fp16(const std::string& bug) {
  testing::TempDir dir;
  const std::string impl = "/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                           "/conformance/adapters/flash_numpy/attention.py --block 64 --arith fp16" + bug;
  const auto r = testing::run_cli({"run", std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core", "--tag", "f16", "--impl",
                                   impl, "--profile", "flash-fp16", "--json", (dir / "report.json").string()});
  return {r.status, r.out + r.err, nlohmann::json::parse(testing::read_text(dir / "report.json"))};
}

TEST(StatisticsEndToEnd, CorrectKernelPassesWithHeadroom) {
  const GateRun r = gate_flash_fp16("");
  EXPECT_EQ(r.status, 0) << r.out;
  int tested = 0;
  for (const auto& c : r.report["cases"])
    for (const auto& t : c["tensors"]) {
      const auto& tier = t["tier"];
      EXPECT_TRUE(tier["ok"].get<bool>()) << c["id"] << " " << t.dump();
      if (!tier["tested"].get<bool>()) continue;
      ++tested;
      EXPECT_LE(tier["q99"].get<double>(), tier["q99_limit"].get<double>());
      if (!tier["headroom"].is_null()) {
        EXPECT_GE(tier["headroom"].get<double>(), 1) << c["id"];
      }
    }
  EXPECT_GT(tested, 50);
  EXPECT_NE(r.out.find("statistical tier: "), std::string::npos) << r.out;
}

TEST(StatisticsEndToEnd, OutputRoundedUpFailsOnlyByTheTier) {
  const GateRun r = gate_flash_fp16(" --bug stat_round_up");
  EXPECT_EQ(r.status, 1) << r.out;
  int biased = 0;
  for (const auto& c : r.report["cases"]) {
    if (c["status"] != "fail") continue;
    EXPECT_EQ(c["failed_elements"], 0) << c["id"];  // every element within its limit
    if (c["reason"].get<std::string>().find("out: biased: mean normalised error") != std::string::npos) ++biased;
  }
  EXPECT_GE(biased, 3) << r.out;
  EXPECT_NE(r.out.find("out: headroom "), std::string::npos) << r.out;
}

}  // namespace
}  // namespace attnoracle::conformance
