// Correct rounding into F64, F32, F16 and BF16 with MPFR, and Ziv's test on an enclosure.
#pragma once

#include <mpfr.h>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle {

// x rounded to nearest-even in format t (subnormals kept, overflow to infinity), as the double
// holding that value exactly. Uses MPFR with the format's precision and exponent range. FP8
// (for the generators): F8_E5M2 overflows to infinity likewise; F8_E4M3, which has no
// infinity, saturates to +-448 (OCP's saturating conversion).
double round_to_format(mpfr_srcptr x, DType t);
// The double x rounded to nearest-even in format t (NaN stays NaN, overflow to infinity).
double round_double(double x, DType t);

struct RoundedEnclosure {
  bool decided;  // every value of the enclosure rounds to `value`
  double value;  // when undecided: the rounding of the lower end
  double alt;    // when undecided: the rounding of the upper end
};

// Ziv's test: the rounding is proven when both ends of [lo, hi] round to the same value.
// Zeros of either sign count as one value (the sign of an exact zero cannot be proven by an
// enclosure): the result is +0 unless the whole enclosure is negative.
RoundedEnclosure round_enclosure(mpfr_srcptr lo, mpfr_srcptr hi, DType t);

}  // namespace attnoracle
