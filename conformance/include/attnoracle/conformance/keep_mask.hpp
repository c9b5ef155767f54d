// A keep mask an implementation drew itself and returned (CONTRACT section 5, `dropout_mask`):
// its statistics against independent draws kept with probability 1 - p (TOLERANCE.md, "The keep
// mask's statistics"), and the golden values of the case with it in place of the given mask.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

// One Hoeffding test: `count` independent indicators whose mean should be `expected`.
struct KeepTest {
  std::string what;          // "keep rate", "agreement between heads", "agreement between rows"
  std::int64_t count = 0;
  double observed = 0, expected = 0, allowed = 0;  // |observed - expected| <= allowed passes
  bool ok() const { return !(std::fabs(observed - expected) > allowed); }
};
// Each test fails a correct generator with probability at most this, the three together at most
// kFailureProbability (statistics.hpp) by the union bound.
inline constexpr int kKeepTests = 3;
// The three tests on `mask` (BOOL [B, Hq, Nq, Nk], checked by the caller) over the allowed keys
// of the rows that are not padding, p the case's attn.dropout_p.
std::vector<KeepTest> keep_mask_tests(const Case& c, const RawTensor& mask);
// The first failing test as one line ("" when all pass).
std::string keep_mask_verdict(const std::vector<KeepTest>& tests);

// The gate's evaluator of a case file into its golden file (the reference's eval), registered by
// the program that links the reference (the command line, the Python module); none: a returned
// mask fails the case, saying so.
using CaseEvaluator = std::function<SafeTensorsFile(const SafeTensorsFile& case_file)>;
void set_case_evaluator(CaseEvaluator e);
const CaseEvaluator& case_evaluator();

}  // namespace attnoracle::conformance
