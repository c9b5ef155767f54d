// Findings of the serving kernels (CONTRACT section 8): the page, the split or the merge's
// empty split that the failing rows have in common. Each says nothing unless the pattern fits.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "attnoracle/conformance/diagnosis.hpp"

namespace attnoracle::conformance {

// Rows (b, h, i) of [B, Hq, Nq] in that order: compared (valid, with an allowed key) and failing.
struct RowFlags {
  std::vector<char> compared, failing;
};
// The rows of case c with a failing element in `d` (a failing out row of kind mha fails every
// head). Compared: valid and, unless `keyless`, with an allowed key.
RowFlags row_flags(const Case& c, const Diagnosis& d, bool keyless);

// A paged case (c.paged): the kind of page that every failing row reads and most rows reading it
// fail on (the partly filled last page, the last page, pages that differ from batch 0's, a page
// two batch rows share, one physical page, a page boundary), the pages named; and failing weights
// all at the first or last slot of their page. `elements`: the failing elements of the case.
std::vector<Finding> paged_findings(const Case& c, const RowFlags& rows, const Diagnosis& d);

// A case with splits (c.kv_split_size): out and lse failing only in rows with an empty split
// (no allowed key in it).
std::vector<Finding> empty_split_rows(const Case& c, const RowFlags& rows, std::int64_t elements);

// The partial states of a case with splits: per split s, the rows (as RowFlags::failing) whose
// out_partial or lse_partial failed, and the failing elements of split s. `inf_mismatch` marks
// the (split, row) pairs whose lse_partial is -inf where the exact value is not, or the reverse.
struct SplitFailures {
  std::vector<std::vector<char>> failing;  // [S][B * Hq * Nq]
  std::vector<std::int64_t> elements;      // [S]
  std::vector<std::vector<char>> inf_mismatch;  // [S][B * Hq * Nq], empty when none
  bool inf_mismatch_nan = true;                 // every such lse_partial is NaN
  double inf_mismatch_example = 0;              // the first such lse_partial
};
std::vector<Finding> split_findings(const Case& c, const SplitFailures& f);

// With sinks: the returned lse (`lse`, [B, H, Nq]) of every failing row is the log sum exp of
// the splits' lse_s (split_lse(s, row), S splits) without the sink.
std::optional<Finding> lse_without_sink(const Case& c, const RowFlags& rows,
                                        const std::function<double(std::int64_t, std::size_t)>& split_lse, std::int64_t S,
                                        const RawTensor* lse, std::int64_t elements);

// Kind merge: the failing rows (b, h, i) of [B, H, Nq] against the rows with a -inf split, a
// +inf split (attn.lse_posinf), every split empty, or a sink above every split; and, with sinks,
// the returned lse (`lse`, [B, H, Nq], null when absent) against the merge without the sink.
std::vector<Finding> merge_findings(const Case& m, const RowFlags& rows, const RawTensor* lse, std::int64_t elements);

}  // namespace attnoracle::conformance
