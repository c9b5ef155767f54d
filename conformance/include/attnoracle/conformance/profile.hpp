// What an implementation declares: the arithmetic it computes in (its precision profile), from
// which each element's error limit is derived, and its conventions. Derivation of the limits:
// conformance/TOLERANCE.md.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle::conformance {

enum class MaskedRowConvention { Error, Zero, Nan, Mean };

struct Profile {
  std::string name;
  std::vector<DType> input_dtypes;  // the cases it applies to; others are skipped
  DType projection = DType::F32;    // mha: dtype the projections Q, K, V are rounded to
  DType qk_accum = DType::F32;      // accumulation of Q K^T (and of the projections)
  DType softmax = DType::F32;       // scores, exp, their sum, the division
  DType p = DType::F32;             // dtype P is rounded to before P V
  DType pv_accum = DType::F32;      // accumulation of P V (and of the output projection)
  double exp_ulps = 4;              // accuracy claimed for exp and log, in ulps of `softmax`
  double safety = 4;                // factor on the derived bound
  // conventions
  MaskedRowConvention masked_rows = MaskedRowConvention::Zero;
  bool returns_weights = true;
  bool returns_lse = true;
};

// fp64, fp32, fp16 and bf16 (inputs in that dtype, fp32 accumulation and softmax), flash-fp16
// and flash-bf16 (as fp16/bf16, with P rounded to that dtype before P V). Throws InputError
// naming `what` for an unknown name.
Profile builtin_profile(const std::string& name, const std::string& what = "--profile");
std::vector<std::string> builtin_profile_names();
// A profile from a JSON file: {"name", "base" (a built-in to start from), and any field above
// by its name, dtypes as names, "masked_rows" as error|zero|nan|mean}.
Profile profile_from_json(const std::string& path);

// What `--profile P` means for every command: a JSON file when P ends in ".json", else a
// built-in name.
Profile load_profile(const std::string& name_or_path, const std::string& what = "--profile");

std::string_view convention_name(MaskedRowConvention c);
std::optional<MaskedRowConvention> convention_from_name(std::string_view s);  // error|zero|nan|mean

}  // namespace attnoracle::conformance
