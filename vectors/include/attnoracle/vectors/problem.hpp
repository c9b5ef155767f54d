// Problems for golden vector suites: a ProblemSpec describes shapes, options, masks, biases and
// the data generator; make_problem turns it and a seed into the inputs of one case file.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::vectors {

enum class MaskKind {
  None,
  KeyPadding,       // per batch a random number of trailing keys masked; [B,1,Nq,Nk]
  Random,           // each key allowed with probability 3/4; [B,Hq,Nq,Nk]
  SingleKey,        // exactly one allowed key per row; [B,Hq,Nq,Nk]
  FullyMaskedRows,  // some rows with no allowed key; [B,1,Nq,Nk]
  CausalMask,       // bottom-right causal written as an explicit mask; [Nq,Nk]
  KeyPaddingBroadcast,  // per batch a random number of trailing keys masked; [B,1,1,Nk]
  KeyVector,            // one random key pattern for every batch, head and query; [Nk]
  TailBlock,            // keys of the last 64-key block half masked per row, the others open; [B,Hq,Nq,Nk]
};
enum class BiasKind {
  None,
  Alibi,   // -m_h |i' - j| with m_h = 2^(-8(h+1)/Hq); [1,Hq,Nq,Nk]
  Random,  // uniform [-2,2) with some -inf entries; [B,Hq,Nq,Nk]
  Fill,    // a mask written as a bias: 0, or bias_fill on about a quarter of keys; [B,Hq,Nq,Nk]
  Scalar,  // one value uniform in [-2,2) for every score; []
  PerKey,  // uniform [-2,2) per batch and key; [B,1,1,Nk]
  // one offset per row, 0, -1e5 (1 + U) or -1e31 (1 + U) in turn at random: every allowed score
  // of the row far below a finite mask sentinel (-5e4, -1e30); [B,Hq,Nq,1]
  RowOffset,
};
// Sequence lengths seqlens_q, seqlens_k [B] (padded varlen). Batch 0 is full (Lk = Nk), batch 1
// has few keys (Lk = min(2, Nk)), the others distinct random key counts.
enum class SeqlensKind {
  None,
  Varlen,   // Lq = max(1, Lk Nq / Nk): Lq = Lk when Nq = Nk
  Decode,   // Lq = 1 in every batch
  Chunked,  // chunked prefill: Lq random in [1, min(Nq, Lk)], Lk - Lq keys of earlier chunks
  Keys,     // seqlens_k only
};

// Kind mha's gradients, as attn.outputs names them.
inline constexpr std::array<const char*, 6> kMhaGradients = {"dx_q", "dx_kv", "dw_q", "dw_k", "dw_v", "dw_o"};

struct ProblemSpec {
  Kind kind = Kind::Sdpa;
  DType dtype = DType::F32;
  std::optional<DType> output_dtype;  // empty: the input dtype
  // attn.output_dtypes text (name:DTYPE,..., e.g. "lse:F32"): outputs in dtypes of their own;
  // empty: none
  std::string output_dtypes;
  // sdpa sizes; for mha Hq = Hkv = H, and D, Dout are set as well
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1, D = 0, Dout = 0;
  bool self_attention = false;  // mha: x_kv = x_q (needs Nq = Nk)
  Causal causal = Causal::None;
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // left, right
  std::string softcap;                                          // metadata text; empty: off
  std::string scale;                                            // metadata text; empty: 1/sqrt(Dk)
  MaskedRows masked_rows = MaskedRows::Error;
  bool want_weights = false, want_lse = false, want_scores = false;
  // Gradients (no FP8): dout [B, Hq, Nq, Dv] in the input dtype drawn by
  // `dout`: "normal" N(0,1); "wide_range" +-(1 + U[0,1)) 2^e, e in [-8, 8); "cancel" 8 + N(0,1)/16 (a common
  // part that dP - D cancels); "tiny" N(0,1) 2^-12 (near-zero gradients).
  bool want_dq = false, want_dk = false, want_dv = false, want_dbias = false, want_dsinks = false;
  // Kind mha's gradients, in the order of kMhaGradients (dout then [B, Nq, Dout]).
  std::array<bool, 6> want_mha{};
  std::string dout = "normal";
  bool wants_mha_gradients() const {
    return std::any_of(want_mha.begin(), want_mha.end(), [](bool w) { return w; });
  }
  bool wants_gradients() const {
    return want_dq || want_dk || want_dv || want_dbias || want_dsinks || wants_mha_gradients();
  }
  // Sinks [Hq] in sinks_dtype: empty none; "near" U[-2,2) per head (the scores' range),
  // "dominant" 12 + U[0,4) (the sink takes most of each row), "negligible" -40 + U[0,4), or a
  // number (every head).
  std::string sinks;
  DType sinks_dtype = DType::F32;
  // Rotary (sdpa): empty none, else "interleaved" or "half"; rotary_dim R (0: Dk); rotary_round
  // the dtype rotated q and k are rounded to. Tables [Nk, R/2] in F32: cos and sin of
  // t 10000^(-2f/R), correctly rounded.
  std::string rotary;
  std::int64_t rotary_dim = 0;
  DType rotary_round = DType::F32;
  // Dropout (CONTRACT section 10): attn.dropout_p as written (empty: none), with a keep mask
  // [B, Hq, Nq, Nk] drawn from its own stream, each weight kept with probability 1 - p.
  std::string dropout;
  MaskKind mask = MaskKind::None;
  BiasKind bias = BiasKind::None;
  DType bias_dtype = DType::F32;
  std::string bias_fill;  // bias fill: "-inf", "-max" (lowest finite) or a number; empty: -inf
  bool query_mask = false;
  SeqlensKind seqlens = SeqlensKind::None;
  DType seqlens_dtype = DType::I32;  // I32 or I64
  // kind sdpa: NaN, +inf and -inf in turn at every unused position (the k and v rows of keys no
  // query other than padding attends, the q rows of padding queries): they must change nothing
  bool poison = false;
  // FP8 inputs: q_descale, k_descale, v_descale [B, Hkv] (F32), distinct per batch and kv head,
  // none equal to 1, so that a kernel that drops them or reads one kv head's for all fails
  bool descales = false;
  // Paged KV cache (k_cache, v_cache, block_table in place of k and v): page size, 0 for a
  // contiguous k and v; HND layout ([Npages, Hkv, P, D]) instead of NHD; pages in order,
  // shuffled, or shuffled with batch rows >= 1 sharing batch 0's leading pages (prefix sharing).
  std::int64_t page_size = 0;
  bool kv_layout_hnd = false;
  enum class Pages { Ordered, Shuffled, Shared } pages = Pages::Ordered;
  // Split-KV: attn.kv_split_size (0: none), and the partial states among the outputs.
  std::int64_t kv_split_size = 0;
  bool want_out_partial = false, want_lse_partial = false;
  // Kind merge (shape [S, B, H, Nq, Dv]: Nk holds S, Dk is 1): lse_partial per row a level in
  // [-4, 12) plus, per split, "normal" 2 N(0,1) or "wide" U[-90, 10); "neg_inf" about a quarter
  // of the splits empty (-inf, one split of each row kept), "pos_inf" the same written +inf
  // (attn.lse_posinf empty), "all_neg_inf" a quarter of the rows with every split empty. An
  // empty split's o_partial holds NaN, inf and 0.
  std::string lse_partial = "normal";
  // Stored K/V (CONTRACT section 9), written after the data are drawn in q's dtype: empty for
  // float k and v, or F8_E4M3, F8_E5M2, I8 (scaled), mxfp8, nvfp4 (block-scaled). kv_scale:
  // the granularity of a scaled form's k_scale and v_scale, "tensor", "head" or "token" (per
  // cache slot on a paged cache); empty: tensor. kv_scale_binades W: each scale (block scale)
  // moved from the one that fits its elements by 2^t, t uniform in [-W, W].
  std::string kv_format;
  std::string kv_scale;
  std::int64_t kv_scale_binades = 0;
  bool v_from_k = false;  // no v: v is k[..., 0:Dv] (attn.v_from_k)
  // FP8 out: o_scale's text (an F32 scalar; empty: none), and amax among the outputs.
  std::string o_scale;
  bool want_amax = false;
  std::string generator = "normal";
  std::map<std::string, double> params;  // generator parameters; absent ones take defaults
};

// A data generator: its name, parameters with their defaults, and a one-line summary.
struct GeneratorInfo {
  std::string_view name;
  std::vector<std::pair<std::string_view, double>> params;
  std::string_view summary;
};
const std::vector<GeneratorInfo>& generators();
const GeneratorInfo* find_generator(std::string_view name);

std::string_view mask_kind_name(MaskKind m);
std::optional<MaskKind> mask_kind_from_name(std::string_view s);
std::string_view bias_kind_name(BiasKind b);
std::optional<BiasKind> bias_kind_from_name(std::string_view s);
std::string_view seqlens_kind_name(SeqlensKind k);
std::optional<SeqlensKind> seqlens_kind_from_name(std::string_view s);

// The value of masked entries of bias fill in bias_dtype, or the reason it cannot be built.
struct FillValue {
  double value = 0;
  std::string error;  // empty when value is usable
};
FillValue bias_fill_value(const ProblemSpec& p);

// Checks a spec for what make_problem cannot build (sizes, generator parameters, dtypes);
// returns the first problem as text, or nothing.
std::optional<std::string> problem_error(const ProblemSpec& p);

// The inputs and metadata of the case: deterministic in (spec, seed) on every platform (own
// PRNG, arithmetic limited to + - * /, every value rounded into its dtype with MPFR).
// Throws std::invalid_argument when a value cannot be represented (a generator parameter too
// large for the dtype, say).
SafeTensorsFile make_problem(const ProblemSpec& p, std::uint64_t seed);

// The inputs of a case of kind merge.
SafeTensorsFile make_merge_problem(const ProblemSpec& p, std::uint64_t seed);

// Replaces k and v of a generated sdpa case by a paged cache (CONTRACT section 8) holding the
// same keys: the golden values do not change. Unused block-table entries get -1, 0 or an index
// past the cache; one spare page and the slots past each row's length hold what the unused rows
// of k and v held (NaN, inf with `poison`). `read`: with `poison`, whether a query reads each key
// row, (b Hkv + g) Nk + j (the others poisoned); empty: every row. Deterministic in (spec, seed).
void page_kv_cache(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed, const std::vector<bool>& read = {});
// Batch rows >= 1 take batch 0's keys and values on the pages they will share with it.
void share_prefix(const ProblemSpec& p, SafeTensorsFile& f);

// True when some row (padding or not) has no allowed key, whatever the policy; whether
// evaluation refuses the case is Case::first_refused_row.
bool has_fully_masked_row(const Case& c);

}  // namespace attnoracle::vectors
