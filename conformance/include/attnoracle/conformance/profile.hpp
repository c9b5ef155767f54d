// What an implementation declares: the arithmetic it computes in (its precision profile), from
// which each element's error limit is derived, and its conventions. Derivation of the limits:
// conformance/TOLERANCE.md.
#pragma once

#include <cstdint>
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
  std::optional<DType> bias;        // dtype the bias is rounded to before it is added (none: exact)
  double exp_ulps = 4;              // accuracy claimed for exp and log, in ulps of `softmax`
  // smallest key block of an online softmax the limits cover (rescaled partial sums); 0: one pass
  std::int64_t key_block = 16;
  double safety = 4;                // factor on the derived bound
  // conventions
  MaskedRowConvention masked_rows = MaskedRowConvention::Zero;
  bool returns_weights = true;
  bool returns_lse = true;
  bool returns_scores = true;
  bool returns_gradients = true;  // dq, dk, dv, dbias when a case asks for them
  // declared by the implementation: invariants then checks relation deterministic (3 runs of
  // every problem) and relation batch_invariance without being asked
  bool deterministic = false;
  bool batch_invariant = false;
  // The dtype it returns lse in, whatever the case's output dtype (FlashAttention: F32); none:
  // the case's. The runner then asks for it in attn.output_dtypes and lse is judged in it.
  std::optional<DType> lse_dtype;
  // A split-KV kernel: the dtype it stores each split's partial output O_s in before the merge
  // (lse_s in `softmax`); none: one pass over the keys, or partials exact enough to leave out.
  std::optional<DType> partials;
  // backward (TOLERANCE.md, "Gradients"): dP = dout V^T is rounded to grad_dp; P (as the forward
  // gave it or recomputed from lse) and dS are rounded to grad_ds before the products giving
  // dq, dk, dv; those products and D = rowsum(dout out) are accumulated in grad_accum.
  DType grad_dp = DType::F32;
  DType grad_ds = DType::F32;
  DType grad_accum = DType::F32;
  // The cases it judges: those of its input dtypes (every dtype when none is listed).
  bool covers(DType t) const;
};

// fp64, fp32, fp16 and bf16 (inputs in that dtype, fp32 accumulation and softmax), flash-fp16
// and flash-bf16 (as fp16/bf16, with P rounded to that dtype before P V, lse returned in F32),
// torch-cpu-bf16
// (PyTorch's CPU BF16 arithmetic: scores, softmax, P and P V in BF16). Throws InputError naming
// `what` for an unknown name.
Profile builtin_profile(const std::string& name, const std::string& what = "--profile");
std::vector<std::string> builtin_profile_names();
// A profile from a JSON file: {"name", "base" (a built-in to start from), and any field above
// by its name, dtypes as names, "masked_rows" as error|zero|nan|mean}.
Profile profile_from_json(const std::string& path);
// The same from the text of one profile object; `what` names it in errors.
Profile profile_from_json_text(std::string_view text, const std::string& what);

// What `--profile P` means for `invariants`: a JSON file when P ends in ".json", else a
// built-in name.
Profile load_profile(const std::string& name_or_path, const std::string& what = "--profile");

// Profiles for several input dtypes in one run: a case is judged by the member that covers its
// input dtype; a case no member covers is skipped, and never given to the implementation.
struct ProfileSet {
  std::string name;
  std::vector<Profile> members;  // their input dtypes are disjoint
  const Profile* for_dtype(DType t) const;
  std::vector<DType> dtypes() const;  // every input dtype a member covers, in member order
};

// What `--profile P` means for `run` and `check`: a comma-separated list of profiles (built-in
// names or JSON files), a family (`standard`: fp64, fp32, fp16, bf16; `flash`: fp64, fp32,
// flash-fp16, flash-bf16), or a JSON file {"name", "profiles": [name, file or profile object]}.
// Throws InputError when two members cover the same input dtype.
ProfileSet load_profile_set(const std::string& spec, const std::string& what = "--profile");
std::vector<std::string> builtin_family_names();

// What `--returns LIST` declares (a comma list among weights, lse, scores, gradients): the
// optional outputs the implementation returns; those not listed are not asked for.
void declare_returns(Profile& p, std::string_view list);

// The profile set as a run declares it: load_profile_set(spec, what), then on every member the
// convention for fully masked rows (`masked_rows`, empty: each profile's own; InputError naming
// `masked_what` otherwise) and declare_returns(`returns`, when not empty).
ProfileSet declared_profile_set(const std::string& spec, const std::string& masked_rows, const std::string& returns,
                                const std::string& what = "--profile", const std::string& masked_what = "--masked-rows");

std::string_view convention_name(MaskedRowConvention c);
std::optional<MaskedRowConvention> convention_from_name(std::string_view s);  // error|zero|nan|mean

}  // namespace attnoracle::conformance
