// The oracle: the invariants of attention's definition, checked on enclosures of the reference
// (every row, before anything is written) and, through twin cases, as metamorphic relations.
// Statements: oracle/INVARIANTS.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::oracle {

enum class Invariant {
  RowSum,            // allowed weights of a row sum to 1
  WeightRange,       // each allowed weight lies in (0, 1]
  MaskedZero,        // weights of keys that are not allowed are exactly 0
  ConvexHull,        // each output coordinate lies within [min, max] of the allowed values
  EqualScores,       // equal scores in a row give equal weights
  MaskedRowPolicy,   // fully masked rows follow the case's policy
  ShiftInvariance,   // a constant added to every score changes nothing
  CausalDependence,  // under causal, output i ignores inputs after the last key i may see
  KeyPermutation,    // permuting keys and values together (and mask columns) changes nothing
  HeadIndependence,  // changing one head's inputs changes only that head's output
  GradientZero,      // padding and fully masked rows, and keys no query sees, have gradient 0
  GradientRowSum,    // each row of dbias (over the keys) sums to 0, as each row of dS does
  GradientLinearity,  // twice dout gives exactly twice every gradient
  GradientCausalDependence,  // queries that cannot see key j leave dk_j, dv_j unchanged
  PagedGather,       // a paged case's k and v are its caches read through the block table
  PartialMerge,      // merging a row's golden partial states gives its whole out and lse
  StoredKv,          // K/V stored scaled or block-scaled (or v a view of k) are element x scale
  Dropout,           // dropout keeps weights and lse, and scales the kept part of A V by 1 / (1 - p)
};
std::string_view invariant_name(Invariant v);
std::vector<Invariant> all_invariants();

struct Violation {
  Invariant invariant;
  std::int64_t b = 0, h = 0, i = 0;
  std::int64_t j = -1;  // key index, when the invariant is about a key
  std::int64_t c = -1;  // output coordinate, when it is about one
  std::string detail;   // the numbers involved
  std::string message() const;  // "<invariant>: b=.. h=.. i=.. [j=..|c=..]: <detail>"
};

class InvariantViolation : public std::runtime_error {
 public:
  explicit InvariantViolation(std::vector<Violation> v);
  const std::vector<Violation>& violations() const { return v_; }

 private:
  std::vector<Violation> v_;
};

// One row unit's evaluation: (b, h, i) for kind sdpa, (b, i) with all heads for kind mha.
class RowSource {
 public:
  virtual ~RowSource() = default;
  virtual RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i) = 0;
};
using RowSourceFactory = std::function<std::unique_ptr<RowSource>(const Case&)>;
// The reference itself at working precision p.
RowSourceFactory reference_rows(mpfr_prec_t p = 128);
// The reference on eval's tiers: the fast path's balls where they decide the row, else MPFR at p.
RowSourceFactory tiered_rows(mpfr_prec_t p = 128);

// The checks that need no second evaluation, on one row unit's enclosures. The oracle derives
// which keys are allowed from the case itself (its own reading of mask, causal, window, bias).
std::vector<Violation> check_row(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                 const RowEnclosures& r);

// What the checks of a row that allows every key need, computed once per (batch, kv head):
// for a case without bias, per key the first key with an equal key vector ([B * Hkv * Nk]; -1
// where none comes earlier; empty with a bias), and the values' range per column
// ([B * Hkv * Dv]).
struct KeyGroups {
  std::vector<std::int64_t> first;
  std::vector<double> vmin, vmax;
};
KeyGroups key_groups(const Case& c);

// The same checks on a fast-path row's F64 intervals (kind sdpa). groups, when given, is
// key_groups(c).
std::vector<Violation> check_row_fast(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                      const RowIntervals& r, const KeyGroups* groups = nullptr);

// The metamorphic relations on one row unit: its evaluation is compared with evaluations of
// twin cases (shifted bias, perturbed future keys, permuted keys, one head changed).
// Kind sdpa twins are built on the inputs the unit reads (its batch, heads and rows), not on a
// copy of the case; the unit's own evaluation is rows(c)'s, or `base` when given.
// Buffers handed from a finished twin to the next one, shared by the threads of one oracle pass:
// a twin's copies of its unit's queries, keys and values then land on memory already touched,
// where fresh memory costs a page fault per page, several times the copy itself.
class TwinBuffers {
 public:
  std::vector<double> take(std::size_t n);  // size n, contents unspecified
  void give(std::vector<double>&& v);

 private:
  std::mutex mu_;
  std::vector<std::vector<double>> free_;
};

std::vector<Violation> check_twins(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                   const RowSourceFactory& rows, TwinBuffers* buffers = nullptr);
std::vector<Violation> check_twins(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                   const RowSourceFactory& rows, RowEnclosures base,
                                   TwinBuffers* buffers = nullptr);

struct CheckOptions {
  std::int64_t twin_units = 16;  // row units given the metamorphic checks (evenly spread)
  mpfr_prec_t twin_precision = 128;
  // (batch, kv head) slices given the gradient twins (evenly spread), each two backward
  // evaluations of 1 / (B Hkv) of the case
  std::int64_t gradient_twin_slices = 1;
};

// The gradient twins of batch entry b and kv head g of an sdpa case with gradients, whose
// evaluation is `res`: its slice (B = 1, the query heads of kv head g) evaluated by
// `evaluate_twin` with dout doubled, then again with the rows that cannot see a chosen key
// changed (when some can and some cannot), the golden gradients compared bit for bit.
using TwinEvaluator = std::function<EvalResult(const Case&)>;
std::vector<Violation> check_gradient_twins(const Case& c, const EvalResult& res, std::int64_t b,
                                            std::int64_t g, const TwinEvaluator& evaluate_twin);

// The gradient invariants of one evaluation, fed the enclosure of every gradient element
// (EvalOptions::gradient_check; thread-safe). element() throws InvariantViolation at once on
// a nonzero gradient where nothing contributes; finish() checks the rows of dbias.
class GradientChecks {
 public:
  explicit GradientChecks(const Case& c);
  void element(const std::string& tensor, std::int64_t flat, const Enclosure& value);
  std::vector<Violation> finish() const;

 private:
  const Case& c_;
  std::vector<char> seen_;                          // [B, Hkv, Nk]: some query may see the key
  std::vector<std::unique_ptr<Enclosure>> dbias_;  // the latest enclosure of each element
  std::vector<std::unique_ptr<Enclosure>> dsinks_;  // the same for dsinks [Hq]
  std::vector<char> head_has_key_;                  // [Hq]: some row of the head has a key
  std::mutex mu_;
  std::vector<Violation> sums_with_sinks() const;
};

// Row units given the twin checks: all when there are few, else `n` evenly spread, first and
// last included.
std::vector<std::int64_t> sample_units(std::int64_t units, std::int64_t n);
std::int64_t unit_count(const Case& c);
void unit_position(const Case& c, std::int64_t u, std::int64_t& b, std::int64_t& h, std::int64_t& i);

// A paged case (CONTRACT section 8): the k and v it holds against the caches of its file,
// gathered again here (h of a violation is the kv head); empty for any other case.
std::vector<Violation> check_paged(const Case& c);
// K/V stored in a form of CONTRACT section 9: the k and v the case holds against the file's
// elements and scales, decoded again here (h of a violation is the kv head); empty otherwise.
std::vector<Violation> check_stored_kv(const Case& c);
// Split-KV partial states (a case with out_partial and lse_partial, evaluated as `res`): per row,
// the merge of the golden partials (each F64 .ref within one unit in the last place of its exact
// value) in interval arithmetic encloses a value within one unit of out.ref, and of lse.ref when
// asked; a row without a key in a split has lse_partial -inf and out_partial 0 there.
std::vector<Violation> check_partials(const Case& c, const EvalResult& res);
// Dropout (CONTRACT section 10): the case without dropout (dropout_mask and attn.dropout_p
// dropped), on which the metamorphic twins of a dropout case run; and row (b, h, i) of the case
// against that twin's, both by MPFR at precision p: lse and weights overlap, and each output
// coordinate overlaps 1 / (1 - p) sum_j keep_j A_j v_j with A the twin's weights.
Case without_dropout(const Case& c);
std::vector<Violation> check_dropout(const Case& c, const Case& plain, std::int64_t b, std::int64_t h,
                                     std::int64_t i, mpfr_prec_t p);

// Every check on every row unit, and the twin checks on the sampled units, for any evaluation.
std::vector<Violation> check_case(const Case& c, const RowSourceFactory& rows,
                                  const CheckOptions& opt = {});

// The reference with the oracle wired in: the row checks run on the final enclosures of every
// row before rounding, the twin checks after; throws InvariantViolation (nothing is written).
EvalResult certified_evaluate(const Case& c, const EvalOptions& eval, const CheckOptions& check);

}  // namespace attnoracle::oracle
