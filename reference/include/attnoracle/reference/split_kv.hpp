// Split-KV partial states and kind merge (CONTRACT section 8), both evaluated as sdpa cases by
// the certified evaluator itself.
#pragma once

#include <cstdint>
#include <string_view>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/merge_case.hpp"

namespace attnoracle {

// Golden tensors of the partial states: out_partial, lse_partial and their companions.
bool is_partial_golden(std::string_view name);

// The case of the splits of c (kind sdpa, attn.kv_split_size set): c without sinks, gradients,
// weights or scores, asking out and lse in the dtypes of out_partial and lse_partial, under
// policy zero (a row with no key in a split is 0 with lse -inf). select_split(t, s) then restricts
// it to the keys of split s.
Case split_template(const Case& c);
void select_split(const Case& c, Case& t, std::int64_t s);

// out_partial, lse_partial and their companions, split by split, appended to res.golden.
void evaluate_partials(const Case& c, const EvalOptions& opt, EvalResult& res);

// The golden tensors of the sdpa case above under the merge's shapes.
EvalResult merge_result(const Case& m, EvalResult inner);
// A refusal of the sdpa case named by the merge's (b, h, i).
FullyMaskedRow merge_row(const Case& m, const FullyMaskedRow& inner);
// evaluate() on kind merge.
EvalResult evaluate_merge(const Case& m, const EvalOptions& opt);

}  // namespace attnoracle
