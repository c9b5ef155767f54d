#include <string>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::oracle {

std::string_view invariant_name(Invariant v) {
  switch (v) {
    case Invariant::RowSum: return "row_sum";
    case Invariant::WeightRange: return "weight_range";
    case Invariant::MaskedZero: return "masked_zero";
    case Invariant::ConvexHull: return "convex_hull";
    case Invariant::EqualScores: return "equal_scores";
    case Invariant::MaskedRowPolicy: return "masked_row_policy";
    case Invariant::ShiftInvariance: return "shift_invariance";
    case Invariant::CausalDependence: return "causal_dependence";
    case Invariant::KeyPermutation: return "key_permutation";
    case Invariant::HeadIndependence: return "head_independence";
    case Invariant::GradientZero: return "gradient_zero";
    case Invariant::GradientRowSum: return "gradient_row_sum";
    case Invariant::GradientLinearity: return "gradient_linearity";
    case Invariant::GradientCausalDependence: return "gradient_causal_dependence";
    case Invariant::PagedGather: return "paged_gather";
    case Invariant::PartialMerge: return "partial_merge";
    case Invariant::StoredKv: return "stored_kv";
    case Invariant::Dropout: return "dropout";
  }
  return "unknown";
}

std::vector<Invariant> all_invariants() {
  return {Invariant::RowSum,          Invariant::WeightRange,      Invariant::MaskedZero,
          Invariant::ConvexHull,      Invariant::EqualScores,      Invariant::MaskedRowPolicy,
          Invariant::ShiftInvariance, Invariant::CausalDependence, Invariant::KeyPermutation,
          Invariant::HeadIndependence, Invariant::GradientZero, Invariant::GradientRowSum,
          Invariant::GradientLinearity, Invariant::GradientCausalDependence, Invariant::PagedGather,
          Invariant::PartialMerge, Invariant::StoredKv, Invariant::Dropout};
}

std::string Violation::message() const {
  std::string m = std::string(invariant_name(invariant)) + ": b=" + std::to_string(b) +
                  " h=" + std::to_string(h) + " i=" + std::to_string(i);
  if (j >= 0) m += " j=" + std::to_string(j);
  if (c >= 0) m += " c=" + std::to_string(c);
  return m + ": " + detail;
}

namespace {
std::string summary(const std::vector<Violation>& v) {
  if (v.empty()) return "no violation";
  std::string m = "invariant violated: " + v.front().message();
  if (v.size() > 1) m += " (and " + std::to_string(v.size() - 1) + " more)";
  return m;
}
}  // namespace

InvariantViolation::InvariantViolation(std::vector<Violation> v)
    : std::runtime_error(summary(v)), v_(std::move(v)) {}

}  // namespace attnoracle::oracle
