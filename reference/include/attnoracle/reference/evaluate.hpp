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

// Row enclosures (attnoracle/reference/detail/row_evaluator.hpp), for the row_check hooks.
struct RowEnclosures;
struct RowIntervals;
struct Enclosure;

// Progress of an evaluation: the units of a pass done (from 1 to total) and what they are
// ("rows", "gradient rows", "gradient keys", "dbias columns", "dsinks heads").
using EvalProgress =
    std::function<void(const std::string& unit, std::uint64_t done, std::uint64_t total)>;

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
  // Called from the worker threads on the enclosures of every gradient element (tensor dq,
  // dk, dv, dbias or dsinks, flat index) and of its magnitude bound, at each working precision tried.
  std::function<void(const std::string& tensor, std::int64_t flat, const Enclosure& value,
                     const Enclosure& bound)>
      gradient_check;
  // Called from the worker threads after each unit of each pass, one call at a time; it only
  // reports: the golden bytes do not depend on it.
  EvalProgress progress;
  // Split-KV partial states: each split is evaluated as a case of its own (split_case) with
  // options holding none of the hooks above; when set, this wires its own into them first.
  std::function<void(const Case& split, EvalOptions& opt)> split_options;
};

struct EvalStats {
  std::uint64_t elements = 0;         // golden elements rounded (all rounded tensors)
  std::uint64_t undecided = 0;        // of which could not be proven correctly rounded
  std::uint64_t rows = 0;
  std::uint64_t rows_raised = 0;      // rows that needed more than the starting precision
  std::uint64_t rows_fast = 0;        // rows decided entirely by the fast path
  std::uint64_t rows_fallback = 0;    // rows the fast path applied to but could not decide
  std::uint64_t grad_units_fast = 0;      // gradient units (rows for dq, keys for dk, dv) decided fast
  std::uint64_t grad_units_fallback = 0;  // gradient units the fast path applied to but did not decide
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

}  // namespace attnoracle
