// The statistical model's magnitudes stored with the golden tensors (CONTRACT section 3, "The
// model's magnitudes"): what row_magnitudes and weight_spread compute from q, k and v in
// O(Nq Nk D) per head, kept in a form that no profile's constants enter, so that a check reads
// them instead of computing them again. The profile's unit roundoffs combine with the stored
// sums at check time; every combined value is at least the one computed from the inputs (a
// limit or a scale may only grow), sdpa only.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/statistics.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

// Per row [B, Hq, Nq, kModelRowFields] in F64: the row magnitudes (dot_abs, score_abs, keys,
// bias_abs, exactly as row_magnitudes), z_part (exactly as weight_spread), then the roots of the
// parts of key_sum^2 and of the bound of key_max^2 (below), rounded up.
inline constexpr std::int64_t kModelRowFields = 12;
// Per element of out [B, Hq, Nq, Dv, kModelOutFields] in F32 rounded up: the roots of the parts of
// key^2 and of wv^2 + partial^2.
inline constexpr std::int64_t kModelOutFields = 5;
// The P dtypes p_bias is stored for, in this order ([4, 4] F64, model.p_bias); P in F64 has none.
inline constexpr DType kModelPDTypes[] = {DType::F32, DType::F16, DType::BF16, DType::F8_E4M3};

// Adds model.rows, model.out and model.p_bias to `golden` for a case of kind sdpa (nothing for
// another kind).
void put_model(const Case& c, SafeTensorsFile& golden);

// The stored model of a golden file, checked against the case's shapes (InputError naming the
// file and the tensor when it is there but wrong); nullopt when the file has none.
struct StoredModel {
  const RawTensor* rows = nullptr;
  const RawTensor* out = nullptr;
  const RawTensor* p_bias = nullptr;
};
std::optional<StoredModel> stored_model(const Case& c, const SafeTensorsFile& golden, const std::string& file);

// row_magnitudes(c), bit for bit, from the stored rows.
std::vector<RowMagnitudes> stored_magnitudes(const StoredModel& m);
// A Spread for profile p whose every scale term is at least weight_spread(c, p)'s; nullopt for a
// P dtype without a stored p_bias. Its `partial` is empty: `wv` holds sqrt(wv^2 + partial^2).
std::optional<Spread> stored_spread(const StoredModel& m, const Profile& p);

}  // namespace attnoracle::conformance
