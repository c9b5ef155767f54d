// The twin builders behind make_twins: those of any case, those of a paged case, and the
// serving ones (page layout, split size, decode against prefill, batch rows).
#pragma once

#include <vector>

#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

// Every row ([B, Hq, Nq]) and token ([B, Nq]) but the padding queries', which the contract
// leaves free.
std::vector<char> all_rows(const Case& c);
std::vector<char> all_tokens(const Case& c);

// The twins of a contiguous case (metamorphic_twins.cpp).
std::vector<TwinPair> plain_twins(const Case& c);
// A paged case: the twins of its contiguous form, paged again where both sides allow it, and
// the same keys in another layout, page order, page size, and contiguous (serving_twins.cpp).
std::vector<TwinPair> paged_twins(const Case& c);
// Any case of kind sdpa: another split size, one query alone (decode), another batch row
// changed (serving_twins.cpp).
std::vector<TwinPair> serving_twins(const Case& c);
// Bitwise, declared batch invariance: batch row 0 alone, and among other rows (serving_twins.cpp).
std::vector<TwinPair> batch_twins(const Case& c);

}  // namespace attnoracle::conformance
