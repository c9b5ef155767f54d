// Dropout with a given keep mask (CONTRACT section 10): O = (A * keep / (1 - p)) V, with the
// weights and lse those of A.
#pragma once

#include <mpfr.h>

#include <string>

namespace attnoracle {

// Metadata key and tensor name.
inline constexpr const char* kDropoutPKey = "attn.dropout_p";
inline constexpr const char* kDropoutMaskName = "dropout_mask";

// Whether the exact value of `text` (a number as strtod reads it, decimal or C hex float) lies
// in [0, 1), decided on the text itself, not on its F64 rounding.
bool dropout_p_in_range(const std::string& text);

// [lo, hi] holds 1 / (1 - p) for the exact value p of `text` (in [0, 1)), at the precisions of
// lo and hi: the keep scale of every kept weight.
void enclose_keep_scale(mpfr_ptr lo, mpfr_ptr hi, const std::string& text);

}  // namespace attnoracle
