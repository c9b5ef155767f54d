// Certified evaluation of a case: interval arithmetic over MPFR, correct rounding proven by
// Ziv's test, streamed row by row.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <mpfr.h>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle {

struct RowEnclosures;
struct RowIntervals;

struct EvalOptions {
  int threads = 1;
  mpfr_prec_t start_precision = 0;    // 0: chosen from the output format and the row length
  mpfr_prec_t max_precision = 2048;   // Ziv's cap; past it an element is recorded undecided
  bool fast_path = true;              // try the double-double path first (same golden bytes)
  // Called from the worker threads on the final enclosures of every row unit, before they are
  // rounded; an exception thrown here refuses the case (the first failing unit is reported).
  std::function<void(std::int64_t b, std::int64_t h, std::int64_t i, const RowEnclosures&)>
      row_check;
  // The same for rows the fast path decided, on F64 intervals; when unset, those rows are
  // converted to RowEnclosures for row_check.
  std::function<void(std::int64_t b, std::int64_t h, std::int64_t i, const RowIntervals&)>
      row_check_fast;
};

// One sdpa row as the fast path encloses it, in F64 intervals rounded outward.
struct RowIntervals {
  std::vector<char> allowed;           // [Nk]
  std::vector<double> dot_lo, dot_hi;  // [Nk] q_i . k_j
  std::vector<double> w_lo, w_hi;      // [Nk] weights (exactly 0 where not allowed)
  std::vector<double> out_lo, out_hi;  // [Dv] before the intersection with the values' range
  double lse_lo = 0, lse_hi = 0;
};

struct EvalStats {
  std::uint64_t elements = 0;         // golden elements rounded (all rounded tensors)
  std::uint64_t undecided = 0;        // of which could not be proven correctly rounded
  std::uint64_t rows = 0;
  std::uint64_t rows_raised = 0;      // rows that needed more than the starting precision
  std::uint64_t rows_fast = 0;        // rows decided entirely by the fast path
  std::uint64_t rows_fallback = 0;    // rows the fast path applied to but could not decide
  std::string fast_path_note;         // why the fast path did not apply, if it did not
  mpfr_prec_t max_precision_reached = 0;
  double seconds = 0;
};

// A fully masked row under policy `error`: the case is refused.
class FullyMaskedRow : public std::runtime_error {
 public:
  FullyMaskedRow(std::int64_t b, std::int64_t h, std::int64_t i);
  std::int64_t b, h, i;
};

struct EvalResult {
  std::vector<RawTensor> golden;  // out, out.ref, [out.ref_lo], out.bound, row.valid, ...
  EvalStats stats;
};

// Throws FullyMaskedRow, or InputError for metadata values that cannot be evaluated.
EvalResult evaluate(const Case& c, const EvalOptions& opt);

// The case file with its golden tensors and metadata added (attn.reference, attn.undecided).
SafeTensorsFile golden_file(const Case& c, const EvalResult& r);
// The same, written to `path` (atomically) without copying the tensors.
void write_golden_file(const std::string& path, const Case& c, const EvalResult& r);

// ---- Row-level access, for tests and for the oracle ----

// An enclosure [lo, hi] of one exact real value.
struct Enclosure {
  mpfr_t lo, hi;
  explicit Enclosure(mpfr_prec_t p);
  Enclosure(const Enclosure&) = delete;
  Enclosure& operator=(const Enclosure&) = delete;
  Enclosure(Enclosure&& o) noexcept;
  Enclosure& operator=(Enclosure&& o) noexcept {
    mpfr_swap(lo, o.lo);
    mpfr_swap(hi, o.hi);
    return *this;
  }
  ~Enclosure();
  bool contains(const mpfr_t x) const { return mpfr_lessequal_p(lo, x) && mpfr_lessequal_p(x, hi); }
};

// What one head's row is made of, for the oracle.
struct HeadDetail {
  std::vector<char> allowed;       // [Nk]: key j may be attended
  std::vector<Enclosure> dots;     // [Nk]: q_i . k_j (a point when exact); 0 where not allowed
  std::vector<Enclosure> raw_out;  // [Dv]: N_c / Z before the intersection with the hull
  std::vector<Enclosure> hull;     // [Dv]: [min, max] of v_jc over the allowed keys
  std::vector<Enclosure> out;      // [Dv]: the head's output O (the row's out for sdpa)
};

// Enclosures of one row unit at one working precision. A unit is (b, h, i) for kind sdpa and
// (b, i) for kind mha (all heads, as the output mixes them; h is then ignored).
struct RowEnclosures {
  bool valid = true;                  // false: fully masked (policy zero, or a padding row)
  std::vector<Enclosure> out;         // Dv (sdpa) or Dout (mha)
  std::vector<Enclosure> bound;       // the magnitude bound of each output element
  // per head for mha (H rows), one for sdpa: each Nk long (0 where not allowed), one lse per head
  std::vector<std::vector<Enclosure>> weights;
  std::vector<Enclosure> lse;
  std::vector<bool> head_valid;       // per head (mha) or one (sdpa)
  std::vector<HeadDetail> heads;      // per head (mha) or one (sdpa)
};

class RowEvaluator {
 public:
  explicit RowEvaluator(const Case& c);  // precomputes exact projections for mha
  ~RowEvaluator();
  RowEvaluator(const RowEvaluator&) = delete;
  RowEvaluator& operator=(const RowEvaluator&) = delete;
  // Throws FullyMaskedRow under policy error (unless the row is padding).
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace attnoracle
