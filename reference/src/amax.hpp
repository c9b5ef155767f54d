// amax (CONTRACT section 9): max |O| over the whole output, rounded once to F32, decided on
// the rows' enclosures, rows evaluated again at rising precision where those do not decide it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <mpfr.h>

#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::detail {

// Bounds of |O| over an enclosure [lo, hi] of O.
inline void magnitude(double lo, double hi, double& alo, double& ahi) {
  if (lo >= 0) alo = lo, ahi = hi;
  else if (hi <= 0) alo = -hi, ahi = -lo;
  else alo = 0, ahi = std::max(-lo, hi);
}

struct AmaxResult {
  RoundedEnclosure r;
  mpfr_prec_t precision = 0;  // the highest precision rows were evaluated again at (0: none)
};

// `lo`, `hi`: F64 bounds of every |O_e| (row-major, `width` per row); `out_at(row, p)` the
// enclosures of a row's out at precision p. An empty output has amax 0.
AmaxResult decide_amax(const std::vector<double>& lo, const std::vector<double>& hi, std::int64_t width,
                       const std::function<std::vector<Enclosure>(std::int64_t row, mpfr_prec_t p)>& out_at,
                       mpfr_prec_t p0, mpfr_prec_t cap);

}  // namespace attnoracle::detail
