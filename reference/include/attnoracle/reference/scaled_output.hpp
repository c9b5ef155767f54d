// FP8 outputs (CONTRACT section 9): the golden out is O / o_scale rounded once in out's FP8
// dtype, decided on an enclosure of O as every rounding of the reference is.
#pragma once

#include <mpfr.h>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle {

// Ziv's test on [lo, hi] / s (s > 0): both ends divided outward, then rounded in t.
RoundedEnclosure round_scaled_enclosure(mpfr_srcptr lo, mpfr_srcptr hi, double s, DType t);
// out's rounding of an enclosure of O: scaled by 1 / o_scale when the case has one.
RoundedEnclosure round_out_enclosure(const Case& c, mpfr_srcptr lo, mpfr_srcptr hi);

}  // namespace attnoracle
