// Seeded random attention problems as case files in memory (CONTRACT section 2), for the tests:
// every input exactly representable in its dtype and finite (bias may hold -inf).
// The same seed and options give the same file on every platform (own RNG, no std
// distributions).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::testing {

// How the floating inputs are drawn.
enum class DataFamily {
  Uniform,      // U(-a, a)
  Normal,       // N(0, s)
  LargeScores,  // |scores| up to ~1e2..1e4
  Ties,         // equal keys (or zero queries): equal scores, outputs are exact means
  Subnormal,    // half the elements subnormal in the input dtype (values also in the output's)
  WideRange,    // magnitudes spread over most of the dtype's exponent range (values)
  Cancel,       // score terms and value rows that nearly cancel
};
std::string_view family_name(DataFamily f);

struct RandomCaseOptions {
  // Sizes: most problems "small", a fraction "large" (up to the maxima).
  int max_seq = 64;  // Nq, Nk
  int max_dim = 24;  // Dk, Dv (mha: D, Dk, Dv, Dout)
  int small_seq = 12;
  int small_dim = 8;
  double large_fraction = 0.04;
  int max_batch = 2;
  int max_heads = 4;  // Hq (mha: H <= 3)
  double mha_fraction = 0.25;
  std::vector<DType> input_dtypes = {DType::F64, DType::F32, DType::F16, DType::BF16};
  std::vector<DType> output_dtypes = {DType::F64, DType::F32, DType::F16, DType::BF16};
  double other_output_fraction = 0.3;  // output dtype drawn from output_dtypes, else the input's
  // FP8 inputs (F8_E4M3, F8_E5M2; sdpa only, so with mha_fraction 0): the output dtype is F32,
  // F16 or BF16, and each of q_descale, k_descale, v_descale is present with this chance.
  double descale_fraction = 0.8;
  std::vector<DataFamily> families = {DataFamily::Uniform,     DataFamily::Normal,
                                      DataFamily::LargeScores, DataFamily::Ties,
                                      DataFamily::Subnormal,   DataFamily::WideRange,
                                      DataFamily::Cancel};
  double mask_fraction = 0.3, causal_fraction = 0.3, window_fraction = 0.2;
  double bias_fraction = 0.3, query_mask_fraction = 0.15;
  // Mask and bias shapes broadcast to [B, H, Nq, Nk] (CONTRACT section 1): ranks from the
  // minimum to 4, each dimension 1 or full (the mask's last two full when it keeps trailing);
  // a fraction of the masks are key padding masks [B, 1, 1, Nk].
  int mask_min_rank = 0, bias_min_rank = 0;
  bool mask_keeps_trailing = false;
  double key_padding_mask_fraction = 0.15;
  double scale_fraction = 0.5, softcap_fraction = 0.2;
  double weights_fraction = 0.5, lse_fraction = 0.5;
  // Sinks [Hq] (near the scores, dominating, negligible or 0) and the scores output; at 0 they
  // draw nothing, so the other options' problems stay the same.
  double sinks_fraction = 0, scores_fraction = 0;
  // Fully masked (non-padding) rows: under policy zero when allowed; a fraction of those
  // problems get policy error instead (they must be refused) when allow_refusal.
  bool allow_masked_rows = true;
  bool allow_refusal = true;
  double refusal_fraction = 0.1;
  // Sequence lengths seqlens_q, seqlens_k [B] (I32 or I64): each batch its own lengths, one of
  // them full where B > 1, some decode (Lq = 1) or with few keys. 0: never drawn (the random
  // stream of the other options is then unchanged).
  double seqlens_fraction = 0;
  // kind sdpa: unused positions (q rows of padding queries, k and v rows of keys no compared
  // query attends) filled with NaN and infinities; RandomCaseInfo::clean then holds the same
  // case with zeros there. 0: never drawn.
  double poison_fraction = 0;
};

struct RandomCaseInfo {
  DataFamily family = DataFamily::Uniform;
  bool fully_masked_row = false;  // some non-padding row has no allowed key
  bool padding_masked_row = false;  // some padding row (query_mask false) has none
  bool expect_refusal = false;      // policy error and fully_masked_row, without sinks
  bool sinks = false;
  std::string summary;              // one line: kind, sizes, dtypes, family, options
  bool seqlens = false;             // seqlens_q or seqlens_k present
  std::size_t poisoned = 0;         // non-finite elements at unused positions
  std::optional<SafeTensorsFile> clean;  // when poisoned: the case with zeros in their place
};

SafeTensorsFile random_case(std::uint64_t seed, const RandomCaseOptions& opt,
                            RandomCaseInfo* info = nullptr);

// A floating tensor holding `values`, each of which must be exact in t.
RawTensor float_tensor(const std::string& name, DType t, std::vector<std::int64_t> shape,
                       const std::vector<double>& values);

// One line describing a case file: metadata, then each tensor's dtype and shape.
std::string describe_case(const SafeTensorsFile& f);

}  // namespace attnoracle::testing
