// The statistics of a keep mask an implementation drew (TOLERANCE.md, "The keep mask's
// statistics"): three Hoeffding tests, each at kFailureProbability / kKeepTests.
#include "attnoracle/conformance/keep_mask.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "attnoracle/conformance/statistics.hpp"

namespace attnoracle::conformance {

namespace {

CaseEvaluator& evaluator() {
  static CaseEvaluator e;
  return e;
}

struct Counter {
  std::int64_t n = 0, hits = 0;
  void add(bool hit) {
    ++n;
    hits += hit ? 1 : 0;
  }
};

// Hoeffding: n independent indicators of mean q have P(|mean - q| >= t) <= 2 exp(-2 n t^2); t for
// the probability delta.
KeepTest test(std::string what, const Counter& k, double expected) {
  KeepTest t;
  t.what = std::move(what);
  t.count = k.n;
  t.expected = expected;
  t.observed = k.n > 0 ? static_cast<double>(k.hits) / static_cast<double>(k.n) : expected;
  const double delta = kFailureProbability / kKeepTests;
  t.allowed = k.n > 0 ? std::sqrt(std::log(2 / delta) / (2 * static_cast<double>(k.n))) : INFINITY;
  return t;
}

}  // namespace

std::vector<KeepTest> keep_mask_tests(const Case& c, const RawTensor& mask) {
  const double p = std::strtod(c.dropout->p.c_str(), nullptr), q = 1 - p;
  auto kept = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
    return mask.data[static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Nk + j)] != 0;
  };
  auto used = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
    return c.query_valid(b, i) && c.allowed(b, h, i, j);
  };
  // The rate over every used draw; agreement of disjoint pairs of heads (2m, 2m + 1) at one
  // position, and of rows (2m, 2m + 1) of one head at one key: independent draws agree with
  // probability q^2 + (1 - q)^2, identical ones always.
  Counter rate, heads, rows;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          if (!used(b, h, i, j)) continue;
          rate.add(kept(b, h, i, j));
          if (h % 2 == 0 && h + 1 < c.Hq && used(b, h + 1, i, j)) heads.add(kept(b, h, i, j) == kept(b, h + 1, i, j));
          if (i % 2 == 0 && i + 1 < c.Nq && used(b, h, i + 1, j)) rows.add(kept(b, h, i, j) == kept(b, h, i + 1, j));
        }
  const double agree = q * q + p * p;
  return {test("keep rate", rate, q), test("agreement between heads", heads, agree),
          test("agreement between rows", rows, agree)};
}

std::string keep_mask_verdict(const std::vector<KeepTest>& tests) {
  for (const KeepTest& t : tests)
    if (!t.ok()) {
      char buf[240];
      std::snprintf(buf, sizeof buf, "dropout_mask: %s %.5g over %lld draws, expected %.5g within %.3g",
                    t.what.c_str(), t.observed, static_cast<long long>(t.count), t.expected, t.allowed);
      return buf;
    }
  return "";
}

void set_case_evaluator(CaseEvaluator e) { evaluator() = std::move(e); }
const CaseEvaluator& case_evaluator() { return evaluator(); }

}  // namespace attnoracle::conformance
