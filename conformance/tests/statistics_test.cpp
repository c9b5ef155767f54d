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
      s.add(r, factor * z + bias);
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
  // sqrt(2 ln(2e6) / 4096) = sqrt(29.017316 / 4096) = 0.084168, above the floor 1/16
  EXPECT_NEAR(t.mean_limit, 0.084168, 1e-6);
}

TEST(StatisticsLimits, FewElementsAreNotTested) {
  Sample s;
  for (int k = 0; k < kMinSample - 1; ++k) s.add(k, 100.0);  // far beyond every limit
  const Tier t = judge(s);
  EXPECT_FALSE(t.tested);
  EXPECT_TRUE(t.ok);
  s.add(99, 100.0);
  EXPECT_FALSE(judge(s).ok);
}

TEST(StatisticsLimits, ZerosCountInTheQuantile) {
  // 99 zeros and one error of 7 in 100 elements: the 99th percentile is 0, the maximum 7
  Sample s;
  for (int k = 0; k < 99; ++k) s.add(k, 0);
  s.add(99, 7);
  Tier t = judge(s);
  EXPECT_EQ(t.q99, 0);
  EXPECT_EQ(t.n, 100);
  // two of 100 at 7: the percentile is 7, beyond 6.18
  Sample s2;
  for (int k = 0; k < 98; ++k) s2.add(k, 0);
  s2.add(98, 7);
  s2.add(99, -7);
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
  // an eighth of the scale in one direction: 0.125 against 0.0842
  Sample s = model_sample(7, 512, 8, 2, 1, 0.125);
  const Tier t = judge(s);
  EXPECT_FALSE(t.ok);
  EXPECT_NE(t.note.find("biased"), std::string::npos) << t.note;
  Sample down = model_sample(7, 512, 8, 2, 1, -0.125);
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

}  // namespace
}  // namespace attnoracle::conformance
