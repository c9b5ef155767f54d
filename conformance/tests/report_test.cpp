// The text report's wording, worked by hand: durations, lists of ids, the first line of a case
// by what decided it, and cases that compared nothing folded into one entry.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/conformance/text.hpp"

namespace attnoracle::conformance {
namespace {

TEST(DurationText, AsPeopleWriteThem) {
  EXPECT_EQ(duration_text(0), "0 s");
  EXPECT_EQ(duration_text(0.25), "250 ms");
  EXPECT_EQ(duration_text(0.6612), "661 ms");
  EXPECT_EQ(duration_text(0.0015), "1.5 ms");
  EXPECT_EQ(duration_text(5), "5 s");
  EXPECT_EQ(duration_text(5.000000), "5 s");
  EXPECT_EQ(duration_text(1.5), "1.5 s");
  EXPECT_EQ(duration_text(12.34), "12.3 s");
  EXPECT_EQ(duration_text(0.9996), "1 s");     // 999.6 ms rounds to a second
  EXPECT_EQ(duration_text(59.97), "1 min");    // 59.97 s rounds to a minute
  EXPECT_EQ(duration_text(60), "1 min");
  EXPECT_EQ(duration_text(125), "2 min 5 s");
  EXPECT_EQ(duration_text(125.4), "2 min 5 s");
  EXPECT_EQ(duration_text(600), "10 min");
  EXPECT_EQ(duration_text(3599.4), "59 min 59 s");
  EXPECT_EQ(duration_text(3599.6), "1 h");
  EXPECT_EQ(duration_text(3900), "1 h 5 min");
  EXPECT_EQ(duration_text(1e7), "2777 h 47 min");
  EXPECT_EQ(duration_text(NAN), "an unknown time");
}

TEST(ShortList, NamesTheFirstThenCountsTheRest) {
  EXPECT_EQ(short_list({}, 3), "");
  EXPECT_EQ(short_list({"a"}, 3), "a");
  EXPECT_EQ(short_list({"a", "b", "c"}, 3), "a, b, c");
  EXPECT_EQ(short_list({"a", "b", "c", "d"}, 3), "a, b, c, d");  // "and 1 more" is no shorter
  EXPECT_EQ(short_list({"a", "b", "c", "d", "e"}, 3), "a, b, c and 2 more");
}

CaseReport failed_case(const std::string& id, const std::string& reason) {
  CaseReport c;
  c.id = id;
  c.status = CaseStatus::Fail;
  c.reason = reason;
  return c;
}

GateReport gate_of(std::vector<CaseReport> cases) {
  GateReport g;
  g.suite = "s";
  g.dir = "d";
  g.implementation = "impl";
  g.profile = "fp32";
  for (auto& c : cases) (c.status == CaseStatus::Fail ? g.failed : c.status == CaseStatus::Pass ? g.passed : g.skipped)++;
  g.cases = std::move(cases);
  g.seconds = 5.000000;
  return g;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TextReport, IdenticalCrashesAreOneEntryWithoutFigures) {
  std::vector<CaseReport> cases;
  const std::string crashed = "crashed: no output: the implementation was killed by SIGSEGV";
  for (int k = 0; k < 163; ++k) cases.push_back(failed_case("case-" + std::to_string(k), crashed));
  cases.insert(cases.begin() + 2, failed_case("other", "timed_out: no output: the run timed out after 5 s and was killed"));
  const std::string text = text_report(gate_of(cases), true);
  EXPECT_EQ(count(text, "FAIL  163 cases: " + crashed + "\n"), 1u) << text;
  EXPECT_NE(text.find("      case-0, case-1, case-2, case-3, case-4, case-5, case-6, case-7 and 155 more\n"), std::string::npos)
      << text;
  // a reason of its own: its own entry, after the first crash (where it stands), without figures
  EXPECT_NE(text.find("FAIL  other                                    F32\n      timed_out: no output: the run timed out after 5 s and was killed\n"),
            std::string::npos) << text;
  EXPECT_LT(text.find("FAIL  163 cases"), text.find("FAIL  other")) << text;
  EXPECT_EQ(count(text, "ulp"), 0u) << text;
  EXPECT_EQ(count(text, "worst"), 0u) << text;
  EXPECT_NE(text.find("164 cases in 5 s: 0 passed, 164 failed, 0 skipped\n"), std::string::npos) << text;
  // one case alone is not folded
  const std::string one = text_report(gate_of({failed_case("only", crashed)}), false);
  EXPECT_NE(one.find("FAIL  only"), std::string::npos) << one;
  EXPECT_EQ(count(one, "cases:"), 0u) << one;
}

TEST(TextReport, SkipsFoldUnderRequireAll) {
  std::vector<CaseReport> cases;
  std::string ids;
  for (int k = 0; k < 12; ++k) {
    CaseReport c = failed_case("c" + std::to_string(k), "profile fp16 does not cover F32 inputs");
    c.status = CaseStatus::Skip;
    cases.push_back(c);
    ids += (k ? ", c" : "c") + std::to_string(k);
  }
  GateReport g = gate_of(cases);
  g.require_all = true;
  const std::string text = text_report(g, false);
  // each one a failure: every id named, not the first 8
  EXPECT_NE(text.find("SKIP  12 cases: profile fp16 does not cover F32 inputs\n      " + ids + "\n      failures under --require-all\n"),
            std::string::npos) << text;
  // without --require-all the skips are counted, as before
  EXPECT_NE(text_report(gate_of(cases), false).find("skipped 12: profile fp16 does not cover F32 inputs\n"), std::string::npos);
}

// A case beyond its limit at an element whose exact value is 0: the ulp error (the error over the
// smallest subnormal) and the ratio to a limit of underflow floors are left out, the absolute
// error, the limit and the bound error said instead.
TEST(TextReport, NoUlpWhereTheExactValueIsZero) {
  CaseReport c = failed_case("zero", "1 element beyond the limit; worst 3.5 times the limit");
  TensorReport t;
  t.tensor = "out";
  t.compared = 40;
  t.worst_ulp = 5.02e39;
  t.worst_bound_error = 0.875;
  t.worst_ratio = 3.5;
  t.over_limit = 1;
  c.tensors.push_back(t);
  c.failed_elements = 1;
  ElementReport w;
  w.tensor = "out";
  w.index = {0, 0, 3, 1};
  w.expected = 0;
  w.actual = 7.03e-6;
  w.actual_bits = 0x36ebe4c6;
  w.error = 7.03e-6;
  w.ulp = 5.02e39;
  w.bound_error = 0.875;
  w.limit = 7.03e-6 / 3.5;
  w.limit_ratio = 3.5;
  c.worst = w;
  const std::string text = text_report(gate_of({c}), false);
  EXPECT_EQ(count(text, "e+39"), 0u) << text;
  EXPECT_EQ(count(text, "ulp"), 0u) << text;
  EXPECT_EQ(count(text, " x limit"), 0u) << text;
  EXPECT_NE(text.find("  worst: error 7.03e-06 at exact 0 (limit 2.01e-06), bound error 0.875\n"), std::string::npos) << text;
  EXPECT_NE(text.find("worst: out[0,0,3,1]: expected 0 (0x00000000), got 7.03e-06 (0x36ebe4c6); error 7.03e-06, "
                      "limit 2.00857143e-06, bound error 0.875\n"), std::string::npos) << text;
  // a normal exact value keeps its ulps
  c.worst->expected = 0.25;
  c.worst->ulp = 236;
  const std::string normal = text_report(gate_of({c}), false);
  EXPECT_NE(normal.find("  worst 3.5 x limit (236 ulp)\n"), std::string::npos) << normal;
  EXPECT_NE(normal.find("; 236 ulp, bound error 0.875, 3.5 x limit\n"), std::string::npos) << normal;
  // a subnormal exact value (F32: below 2^-126) is at the floor too
  c.worst->expected = 1e-40;
  const std::string subnormal = text_report(gate_of({c}), false);
  EXPECT_EQ(count(subnormal, "ulp"), 0u) << subnormal;
  EXPECT_NE(subnormal.find("  worst: error 7.03e-06 at exact 1e-40 (limit 2.01e-06), bound error 0.875\n"), std::string::npos)
      << subnormal;
  // a limit of 0: no ratio
  c.worst->expected = 0.25;
  c.worst->limit = 0;
  c.worst->limit_ratio = INFINITY;
  const std::string zero_limit = text_report(gate_of({c}), false);
  EXPECT_NE(zero_limit.find("  worst: error 7.03e-06, limit 0\n"), std::string::npos) << zero_limit;
  EXPECT_EQ(count(zero_limit, "inf"), 0u) << zero_limit;
}

// A case that fails the statistical tier alone is headed by the tier's finding, not by a figure
// of an element within its limit.
TEST(TextReport, StatisticalFailureHeadsTheCase) {
  const std::string note = "root mean square normalised error 2.1 exceeds 1.3 over 2048 rows";
  CaseReport c = failed_case("stat", "out: " + note);
  c.dtype = DType::BF16;
  TensorReport t;
  t.tensor = "out";
  t.compared = 4096;
  t.worst_ulp = 5.02e39;  // at an exact 0, within its limit
  t.worst_ratio = 0.8;
  t.tier.tested = true;
  t.tier.ok = false;
  // no tier.note: a report merged from JSON has the reason only
  t.tier.headroom = 0.62;
  c.tensors.push_back(t);
  ElementReport w;
  w.tensor = "out";
  w.index = {0, 0, 0, 0};
  w.dtype = DType::BF16;
  w.expected = 0.5;
  w.error = 0.0025;
  w.ulp = 0.64;
  w.bound_error = 0.3;
  w.limit = 0.003125;
  w.limit_ratio = 0.8;
  c.worst = w;
  const std::string text = text_report(gate_of({c}), false);
  const std::string first = text.substr(text.find("FAIL"), text.find('\n', text.find("FAIL")) - text.find("FAIL"));
  EXPECT_EQ(first, "FAIL  stat                                     BF16  statistical tier, out: " + note) << text;
  EXPECT_EQ(count(text, note), 1u) << text;  // the reason is not said twice
  EXPECT_NE(text.find("      every element within its limit: worst 0.8 x limit (0.64 ulp)\n"), std::string::npos) << text;
  EXPECT_EQ(count(text, "e+39"), 0u) << text;
}

}  // namespace
}  // namespace attnoracle::conformance
