// The fast path's decisions on one row: whether its balls decide every rounding of the row,
// and the row as the oracle checks it.
#pragma once

#include <cstdint>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "fast_row.hpp"

namespace attnoracle::fast {

// Both ends round alike in t: the rounding is proven and appended to `into` (zeros: +0 unless
// the whole ball is < 0).
bool decide(DD lo, DD hi, DType t, std::vector<double>& into);
// A ball as an enclosure (128 bits).
Enclosure ball_enclosure(const Ball& b);

// lse = m + log Z, enclosed with MPFR (128 bits) from the ends of Z's ball.
Enclosure lse_enclosure(const FastRow& fr);

// The golden values of one row unit, each proven correctly rounded from the balls. Vectors are
// empty for tensors the case does not ask for.
struct DecidedRow {
  std::vector<double> out, out_ref, out_ref_lo, bound;  // [Dv]
  std::vector<double> weights, weights_ref;             // [Nk]
  std::vector<double> lse, lse_ref;                     // [1]
  std::vector<double> scores, scores_ref;               // [Nk], -inf where not allowed
  std::uint64_t rounded() const;  // elements rounded (out.bound aside)
};

// Fills d when every element of the row is decided; false sends the row to MPFR.
bool decide_row(const Case& c, const FastRow& fr, const Enclosure& lse, DecidedRow& d);
// The same with weights and lse decided or not whatever the case asks for.
bool decide_row(const Case& c, const FastRow& fr, const Enclosure& lse, DecidedRow& d,
                bool weights, bool with_lse);

// The row in F64 intervals rounded outward, and as the enclosures the oracle checks.
RowIntervals row_intervals(const FastRow& fr, const Enclosure& lse);
RowEnclosures row_enclosures(const FastRow& fr, const Enclosure& lse);
RowEnclosures row_enclosures(const FastRow& fr, const Enclosure& lse, RowParts parts);

}  // namespace attnoracle::fast
