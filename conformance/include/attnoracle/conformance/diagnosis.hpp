// What the failing elements of a case have in common: per-head and per-row summaries gathered
// while comparing, and short named findings (a masking rule that leaks, rows past a block of
// keys, one head or batch, lse off by a constant, ...), each with its evidence.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {

struct CaseReport;

struct Finding {
  std::string name;           // a stable identifier, e.g. "masked_weight", "one_head"
  std::string text;           // one line for people, with the evidence
  std::int64_t elements = 0;  // failing elements it accounts for
};

// One (batch, head) of one tensor; head -1 for the out of kind mha (no head axis).
struct HeadSummary {
  std::string tensor;
  std::int64_t b = 0, h = 0;
  std::int64_t failed = 0;
  double worst_ratio = 0;
};

// One row (batch, head, query) of one tensor with elements beyond their limits.
struct RowSummary {
  std::string tensor;
  std::int64_t b = 0, h = 0, i = 0;
  std::int64_t failed = 0;
  double worst_ratio = 0;
};

// An element beyond its limit: its coordinates ([b, h, i, j] with j the key or the output
// column; h -1 for mha's out, j -1 for lse) and values.
struct FailedElement {
  int tensor = 0;  // 0 out, 1 weights, 2 lse
  std::int64_t b = 0, h = 0, i = 0, j = 0;
  double expected = 0, actual = 0, ratio = 0;
};

struct Diagnosis {
  static constexpr std::size_t kMaxRows = 64;           // rows listed in `rows`
  static constexpr std::size_t kMaxElements = 1 << 16;  // failing elements kept for the findings

  std::vector<HeadSummary> heads;  // every (tensor, b, h) compared, in that order
  std::vector<RowSummary> rows;    // the first kMaxRows failing rows in (tensor, b, h, i) order
  std::int64_t failing_rows = 0;   // all of them
  std::vector<Finding> findings;   // only for a failing case

  // While comparing: one compared element of tensor `name` (shape `shape`), flat index k.
  void record(const std::string& name, const std::vector<std::int64_t>& shape, std::size_t k, double expected,
              double actual, double ratio) {
    record(tensor_index(name), shape, k, expected, actual, ratio);
  }
  // The same with the tensor's index (tensor_index(name)), for a caller that looks it up once.
  void record(int tensor, const std::vector<std::int64_t>& shape, std::size_t k, double expected, double actual,
              double ratio);
  static int tensor_index(const std::string& name);  // 0 out, 1 weights, 2 lse, -1 another

  // Gathered by record.
  std::vector<FailedElement> failed;  // at most kMaxElements
  std::int64_t failed_total = 0;
  struct Acc {
    std::int64_t failed = 0;
    double worst = 0;
  };
  std::vector<Acc> head_acc[3];                     // per tensor, index b * H + h (H 1 for mha's out)
  std::unordered_map<std::int64_t, Acc> row_acc[3];  // failing rows, key (b * H + h) * Nq + i
};

// Fills rep.diagnosis's summaries and, when rep failed, its findings. `golden` is the case's
// golden file, `result` what the implementation returned.
void diagnose(const Case& c, const SafeTensorsFile& golden, const SafeTensorsFile& result, CaseReport& rep);

// The findings on the failing elements of `d` (gathered by record) for case c. golden and
// result may lack tensors: detectors that need them stay silent.
std::vector<Finding> find_patterns(const Case& c, const Diagnosis& d, const SafeTensorsFile& golden,
                                   const SafeTensorsFile& result);

}  // namespace attnoracle::conformance
