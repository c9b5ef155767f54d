// merge_reports: the JSON reports of the shards of a report give back its JSON, text and JUnit
// reports (property over drawn reports), and what is not one run's shards is refused.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/reference/error.hpp"

namespace attnoracle::conformance {
namespace {

double value() {
  const int kind = *rc::gen::inRange(0, 10);
  if (kind == 0) return std::numeric_limits<double>::infinity();  // JSON null
  if (kind == 1) return 0;
  return std::ldexp(static_cast<double>(*rc::gen::inRange(-1000000, 1000000)), *rc::gen::inRange(-40, 10));
}

ElementReport element(DType t) {
  ElementReport e;
  e.tensor = *rc::gen::element<std::string>("out", "weights", "lse");
  e.index = {*rc::gen::inRange<std::int64_t>(0, 4), *rc::gen::inRange<std::int64_t>(0, 9)};
  e.dtype = t;
  const std::uint64_t mask = dtype_size(t) == 8 ? ~std::uint64_t{0} : (std::uint64_t{1} << (8 * dtype_size(t))) - 1;
  // a finite value, or NaN or an infinity with its bits (the report gives those as null)
  auto draw = [&](double& v, std::uint64_t& bits) {
    bits = *rc::gen::arbitrary<std::uint64_t>() & mask;
    v = value();
    if (std::isfinite(v)) return;
    const bool nan = t == DType::F8_E4M3 || *rc::gen::arbitrary<bool>();
    v = nan ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    switch (t) {
      case DType::F64: bits = nan ? 0x7ff8000000000000 : 0x7ff0000000000000; break;
      case DType::F16: bits = nan ? 0x7e00 : 0x7c00; break;
      case DType::BF16: bits = nan ? 0x7fc0 : 0x7f80; break;
      case DType::F8_E4M3: bits = 0x7f; break;
      default: bits = nan ? 0x7fc00000 : 0x7f800000; break;
    }
  };
  draw(e.expected, e.expected_bits);
  draw(e.actual, e.actual_bits);
  e.ulp = value(), e.bound_error = value();
  e.limit_ratio = value(), e.error = value(), e.limit = value();
  return e;
}

CaseReport drawn_case(std::size_t position) {
  CaseReport c;
  c.id = "case-" + std::to_string(position);
  c.position = position;
  c.dtype = *rc::gen::element(DType::F64, DType::F32, DType::F16, DType::BF16, DType::F8_E4M3);
  c.status = *rc::gen::element(CaseStatus::Pass, CaseStatus::Fail, CaseStatus::Skip);
  c.profile = c.status == CaseStatus::Skip ? "" : "fp32";
  c.tags = {*rc::gen::element<std::string>("plain", "causal", "window")};
  c.reason = *rc::gen::element<std::string>("", "refused: no", "unsupported: softcap", "3 elements beyond the limit",
                                            "crashed: \xc3\xbc\n<&>");
  c.failed_elements = *rc::gen::inRange<std::int64_t>(0, 100);
  const int tensors = c.status == CaseStatus::Skip ? 0 : *rc::gen::inRange(0, 3);
  for (int t = 0; t < tensors; ++t) {
    TensorReport r;
    r.tensor = t == 0 ? "out" : t == 1 ? "weights" : "lse";
    r.compared = *rc::gen::inRange<std::int64_t>(0, 1000);
    r.worst_ulp = value(), r.worst_bound_error = value(), r.worst_ratio = value();
    r.mean_bound_error = value(), r.rms_bound_error = value(), r.mean_toward_zero = value();
    r.largest_limit = value();
    r.tier.tested = *rc::gen::arbitrary<bool>();
    r.tier.n = *rc::gen::inRange<std::int64_t>(0, 1000);
    r.tier.rms = value(), r.tier.rms_limit = value(), r.tier.q99 = value(), r.tier.q99_limit = value();
    r.tier.mean = value(), r.tier.mean_limit = value(), r.tier.headroom = value();
    if (*rc::gen::arbitrary<bool>()) r.worst = element(c.dtype);
    c.tensors.push_back(std::move(r));
  }
  if (tensors > 0 && *rc::gen::arbitrary<bool>()) c.worst = element(c.dtype);
  if (c.status == CaseStatus::Fail && *rc::gen::arbitrary<bool>()) {
    c.diagnosis.failing_rows = 2;
    c.diagnosis.findings.push_back({"one_head", "head 1 alone <fails> & \"so\"", 7});
  }
  return c;
}

void count(GateReport& r, const CaseReport& c) {
  if (c.status == CaseStatus::Pass) ++r.passed;
  else if (c.status == CaseStatus::Fail) ++r.failed;
  else ++r.skipped;
}

RC_GTEST_PROP(Merge, ShardsGiveBackTheWholeReport, ()) {
  GateReport whole;
  whole.suite = "core";
  whole.dir = "vectors/core";
  whole.implementation = "python3 a.py";
  whole.profile = "standard";
  whole.require_all = *rc::gen::arbitrary<bool>();
  const int n = *rc::gen::inRange(1, 6);
  const auto cases = *rc::gen::inRange<std::size_t>(0, 12);
  // the selected cases are a subset of the manifest's, in its order
  std::size_t position = 0;
  for (std::size_t k = 0; k < cases; ++k) {
    position += *rc::gen::inRange<std::size_t>(0, 3);
    whole.cases.push_back(drawn_case(position++));
    count(whole, whole.cases.back());
  }
  std::vector<std::string> paths, texts;
  for (int k = 0; k < n; ++k) {
    GateReport s = whole;
    s.cases.clear();
    s.passed = s.failed = s.skipped = 0;
    s.shard = k;
    s.shards = n;
    s.selected = cases + 7;
    s.seconds = *rc::gen::inRange(0, 1000) / 8.0;
    for (const auto& c : whole.cases)
      if (c.position % static_cast<std::size_t>(n) == static_cast<std::size_t>(k)) {
        s.cases.push_back(c);
        count(s, c);
      }
    paths.push_back("shard" + std::to_string(k) + ".json");
    texts.push_back(json_report(s));
  }
  for (const auto& t : texts) whole.seconds += nlohmann::json::parse(t)["seconds"].get<double>();
  // in any order
  const auto turn = static_cast<std::size_t>(*rc::gen::inRange(0, n));
  std::rotate(paths.begin(), paths.begin() + static_cast<std::ptrdiff_t>(turn), paths.end());
  std::rotate(texts.begin(), texts.begin() + static_cast<std::ptrdiff_t>(turn), texts.end());
  const MergedReport m = merge_reports(paths, texts);
  RC_ASSERT(nlohmann::json::parse(m.json) == nlohmann::json::parse(json_report(whole)));
  RC_ASSERT(text_report(m.report, true) == text_report(whole, true));
  RC_ASSERT(text_report(m.report, false) == text_report(whole, false));
  RC_ASSERT(junit_report(m.report) == junit_report(whole));
  RC_ASSERT(gate_exit_status(m.report, m.report.require_all) == gate_exit_status(whole, whole.require_all));
}

std::string refusal(const std::vector<std::string>& texts) {
  std::vector<std::string> paths;
  for (std::size_t k = 0; k < texts.size(); ++k) paths.push_back("r" + std::to_string(k) + ".json");
  try {
    merge_reports(paths, texts);
  } catch (const InputError& e) {
    return e.message();
  }
  return "";
}

TEST(Merge, Refusals) {
  GateReport r;
  r.suite = "core";
  r.profile = "fp32";
  r.implementation = "x";
  r.shards = 3;
  r.selected = 0;
  auto shard = [&](int k) {
    GateReport s = r;
    s.shard = k;
    return json_report(s);
  };
  EXPECT_EQ(refusal({shard(0), shard(1), shard(2)}), "");
  EXPECT_EQ(refusal({}), "merge: no report given");
  EXPECT_EQ(refusal({shard(2)}), "r0.json: shard: shards 0, 1 of 3 are missing: give every shard's report");
  EXPECT_EQ(refusal({shard(0), shard(1), shard(1), shard(2)}), "r2.json: shard: shard 1/3 is also r1.json");
  EXPECT_EQ(refusal({"{}"}), "r0.json: schema: missing");
  EXPECT_EQ(refusal({"[1"}), "r0.json: not JSON (a report written by run or check with --json)");
  nlohmann::json j = nlohmann::json::parse(shard(1));
  j["shard"]["index"] = 3;
  EXPECT_EQ(refusal({shard(0), j.dump(), shard(2)}), "r1.json: shard: index not below count");
  j["shard"] = "1/3";
  EXPECT_EQ(refusal({shard(0), j.dump(), shard(2)}), "r1.json: shard.index: missing or not a non-negative integer");
  j = nlohmann::json::parse(shard(1));
  j["require_all"] = true;
  EXPECT_EQ(refusal({shard(0), j.dump(), shard(2)}), "r1.json: require_all: true differs from false in r0.json");
  r.cases.push_back(CaseReport{});
  r.cases.back().id = "a";
  j = nlohmann::json::parse(shard(1));
  j["cases"][0].erase("position");
  EXPECT_EQ(refusal({shard(0), j.dump(), shard(2)}), "r1.json: cases[0].position: missing or not a non-negative integer");
}

}  // namespace
}  // namespace attnoracle::conformance
