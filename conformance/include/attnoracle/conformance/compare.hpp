// The verdict on one case: an implementation's result against the golden tensors, element by
// element within the profile's limits, with the statistics of the signed errors.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/conformance/diagnosis.hpp"
#include "attnoracle/conformance/pictures.hpp"
#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/statistics.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {

struct ElementReport {
  std::string tensor;
  std::vector<std::int64_t> index;
  DType dtype = DType::F32;
  double expected = 0;            // the exact value rounded to F64 (the .ref tensor)
  std::uint64_t expected_bits = 0;  // the golden element in the tensor's dtype
  double actual = 0;
  std::uint64_t actual_bits = 0;
  double ulp = 0;                 // ulp error (TOSA's definition)
  double bound_error = 0;         // |y - x| / max(bound 2^-p, min normal)
  double limit_ratio = 0;         // |y - x| / limit: above 1 fails
  double error = 0;               // |y - x| (abs_error)
  double limit = 0;               // the element's limit, the safety factor included
};

struct TensorReport {
  std::string tensor;
  DType dtype = DType::F32;       // the dtype it is judged in (the case's for that output)
  std::int64_t compared = 0;
  double worst_ulp = 0, worst_bound_error = 0, worst_ratio = 0;
  // Over the elements where the final rounding dominates, in ulps of the output: the mean and
  // root mean square of the signed errors, and the mean error toward zero (truncation).
  double mean_bound_error = 0, rms_bound_error = 0;
  double mean_toward_zero = 0;
  bool statistics_ok = true;
  std::string statistics_note;
  // The statistical tier: the normalised errors against the probabilistic model, the limits,
  // and the headroom (the smallest limit / observed of its three tests).
  Tier tier;
  double largest_limit = 0;       // over the compared elements that have a limit
  std::int64_t over_limit = 0;    // compared elements beyond their limit (ratio above 1)
  std::optional<ElementReport> worst;  // the element of largest ratio; none when every error is 0
};

// Whether the ulp error and the limit ratio of an element say something: its exact value is a
// normal number. At 0 and below the smallest normal every value has the ulp of the smallest
// subnormal and the limit may be little more than the underflow floors (a masked weight's): both
// figures are then huge and say nothing, the absolute error, the limit and the bound error do.
bool exact_is_normal(const ElementReport& w);

enum class CaseStatus { Pass, Fail, Skip };

struct CaseReport {
  std::string id;
  std::vector<std::string> tags;
  DType dtype = DType::F32;
  std::string profile;            // the profile that judged it (none when no profile covers it)
  CaseStatus status = CaseStatus::Pass;
  std::string reason;             // why it failed or was skipped; notes for a pass
  std::vector<TensorReport> tensors;
  std::optional<ElementReport> worst;  // the element with the largest limit ratio
  std::int64_t failed_elements = 0;
  Diagnosis diagnosis;            // per-head and per-row summaries; findings when it failed
  Pictures pictures;              // what the HTML report draws; only for a failing case, when asked
  std::size_t position = 0;       // its place in the manifest's list of cases, from 0
};

std::string_view status_name(CaseStatus s);

// The golden file (inputs and golden tensors) of a case with expectation `expect` ("ok" or
// "error"), and what the implementation did with it. With `pictures`, a failing case's report
// carries the data of its pictures.
CaseReport compare_case(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                        const JobResult& result, const Profile& profile, bool pictures = false);

// compare_case without the serving kernels (CONTRACT section 8): a case of kind merge is judged
// as its sdpa case, and each split of out_partial, lse_partial as a case of its own
// (split_kv_compare.cpp); this judges the rest.
CaseReport compare_plain_case(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                              const JobResult& result, const Profile& profile, bool pictures = false);

// The case file an implementation receives: inputs and the case's own metadata only.
SafeTensorsFile strip_golden(const SafeTensorsFile& golden);
// The same for an implementation judged by `profile`: where it declares an lse dtype
// (lse_dtype) and the case asks for lse, attn.output_dtypes gives lse that dtype. compare_case
// expects the outputs of this case.
SafeTensorsFile case_for(const SafeTensorsFile& golden, const Profile& profile);

}  // namespace attnoracle::conformance
