// The twin builders behind make_twins: those of any case, those of a paged case, and the
// serving ones (page layout, split size, decode against prefill, batch rows).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

// Every row ([B, Hq, Nq]) and token ([B, Nq]) but the padding queries', which the contract
// leaves free.
std::vector<char> all_rows(const Case& c);
std::vector<char> all_tokens(const Case& c);
// Every gradient of `p` compared: dq on p.rows, dk and dv on every key, dsinks, dbias.
void all_gradients(const Case& c, TwinPair& p);

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

// The gate's limit of every element of each gradient a sdpa case asks (compare_gradients.cpp,
// its worst-case tier) and the reference's value, from the reference's results `golden` (out.ref,
// out.bound, dq.ref, dq.bound, ...), for the gradients in `dtypes` (as returned); mags and
// limits: row_magnitudes(c) and their row_limits. None for kind mha, nor where the gate judges
// none (fully masked rows under masked_rows nan or mean) (metamorphic_gradients.cpp).
struct GradientLimits {
  std::vector<double> ref, limit;
};
std::map<std::string, GradientLimits> gradient_limits(const Profile& p, const Case& c,
                                                      const std::vector<RowMagnitudes>& mags,
                                                      const std::vector<RowLimits>& limits,
                                                      const std::vector<RawTensor>& golden,
                                                      const std::map<std::string, DType>& dtypes);

}  // namespace attnoracle::conformance
