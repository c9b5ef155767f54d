// A validated attention case (CONTRACT sections 1 and 2).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/kv_formats.hpp"
#include "attnoracle/reference/paged.hpp"
#include "attnoracle/reference/rotary.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle {

enum class Kind { Sdpa, Mha, Merge };
enum class Causal { None, TopLeft, BottomRight };
enum class MaskedRows { Error, Zero };

// A table of (enum, name) pairs read both ways: the name of e ("?" if absent), the enum of s.
template <class E, std::size_t N>
std::string_view table_name(const std::pair<E, std::string_view> (&table)[N], E e) {
  for (const auto& [x, n] : table)
    if (x == e) return n;
  return "?";
}
template <class E, std::size_t N>
std::optional<E> table_from_name(const std::pair<E, std::string_view> (&table)[N],
                                 std::string_view s) {
  for (const auto& [e, n] : table)
    if (n == s) return e;
  return std::nullopt;
}

// The metadata names of the enums (CONTRACT section 2), one table each.
std::string_view kind_name(Kind k);
std::optional<Kind> kind_from_name(std::string_view s);
std::string_view causal_name(Causal c);
std::optional<Causal> causal_from_name(std::string_view s);
std::string_view masked_rows_name(MaskedRows m);
std::optional<MaskedRows> masked_rows_from_name(std::string_view s);

// One row of one head: batch b, query head h, query i.
struct RowIndex {
  std::int64_t b = 0, h = 0, i = 0;
};

// A golden tensor the reference adds to a case (CONTRACT section 3).
struct GoldenSpec {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
};

// A floating input decoded exactly into doubles, row-major.
struct FloatTensor {
  DType dtype = DType::F64;
  std::vector<std::int64_t> shape;
  std::vector<double> values;
};

// A BOOL tensor (one byte per element, nonzero = true), row-major.
struct BoolTensor {
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> values;
};

struct Case {
  std::string path;  // for messages
  Kind kind = Kind::Sdpa;
  DType input_dtype = DType::F32;
  DType output_dtype = DType::F32;
  // attn.output_dtypes: outputs given their own dtype, overriding output_dtype for them.
  std::vector<std::pair<std::string, DType>> output_dtypes;
  // The dtype of output `name` (out, weights, lse, scores or a gradient): its own, else
  // output_dtype.
  DType dtype_of(std::string_view name) const {
    for (const auto& [n, t] : output_dtypes)
      if (n == name) return t;
    return output_dtype;
  }
  std::optional<std::string> scale;    // attn.scale text; empty = 1/sqrt(Dk)
  std::int64_t scale_features = 0;     // the Dk of that default scale where it is not Dk (0: Dk)
  std::optional<std::string> softcap;  // attn.softcap text when nonzero
  Causal causal = Causal::None;
  bool window = false;
  std::int64_t window_left = 0, window_right = 0;
  MaskedRows masked_rows = MaskedRows::Error;
  bool want_weights = false, want_lse = false, want_scores = false;
  // Gradients asked in attn.outputs (CONTRACT section 7): dq, dk, dv of kind sdpa; dx_q, dx_kv,
  // dw_q, dw_k, dw_v, dw_o of kind mha; dbias and dsinks of either.
  bool want_dq = false, want_dk = false, want_dv = false, want_dbias = false, want_dsinks = false;
  bool want_dx_q = false, want_dx_kv = false, want_dw_q = false, want_dw_k = false, want_dw_v = false,
       want_dw_o = false;
  bool wants_mha_gradients() const {
    return want_dx_q || want_dx_kv || want_dw_q || want_dw_k || want_dw_v || want_dw_o;
  }
  bool wants_gradients() const {
    return want_dq || want_dk || want_dv || want_dbias || want_dsinks || wants_mha_gradients();
  }
  // Kind mha with x_kv of x_q's shape and values: dx_q is then the whole gradient of x.
  bool self_attention = false;

  // Split-KV partial states (CONTRACT section 8): attn.kv_split_size (0: none), and whether
  // out_partial, lse_partial are asked.
  std::int64_t kv_split_size = 0;
  bool want_out_partial = false, want_lse_partial = false;
  bool wants_partials() const { return want_out_partial || want_lse_partial; }
  std::int64_t splits() const { return kv_split_size > 0 ? (Nk + kv_split_size - 1) / kv_split_size : 0; }
  // Keys outside [key_begin, key_end) are not allowed: one split of a case, as evaluated.
  std::int64_t key_begin = 0, key_end = INT64_MAX;
  // Kind merge (CONTRACT section 8): S partial states o_partial [S,B,H,Nq,Dv] and lse_partial
  // [S,B,H,Nq] (Hq = Hkv = H, Nk = S); +inf in lse_partial read as -inf (attn.lse_posinf empty).
  FloatTensor o_partial, lse_partial;
  bool lse_posinf_empty = false;

  // Problem sizes. For kind mha: Hq = Hkv = H, and D, Dout are set.
  std::int64_t B = 0, Hq = 0, Hkv = 0, Nq = 0, Nk = 0, Dk = 0, Dv = 0, D = 0, Dout = 0;

  // kind sdpa
  FloatTensor q, k, v;
  // kind mha
  FloatTensor x_q, x_kv, w_q, w_k, w_v, w_o;
  // optional
  std::optional<BoolTensor> mask;
  std::optional<FloatTensor> bias;  // may hold -inf
  std::optional<BoolTensor> query_mask;
  // [B] each: valid query and key counts per batch (padded varlen); absent = Nq, Nk.
  std::optional<std::vector<std::int64_t>> seqlens_q, seqlens_k;
  std::optional<FloatTensor> sinks;  // [Hq], finite: one logit per query head in the denominator
  // The upstream gradient dL/d(out), in out's shape; 0 on padding rows that held non-finite values.
  std::optional<FloatTensor> dout;

  // A paged KV cache (CONTRACT section 8): k and v above hold its gathered contents.
  std::optional<PagedKv> paged;
  // K/V stored in a form of CONTRACT section 9 (scaled, block-scaled, v a view of k): k and v
  // above hold the real values, element x scale.
  std::optional<KvForm> kv_form;
  // FP8 out (CONTRACT section 9): out is O / o_scale rounded once in out's FP8 dtype; amax,
  // max |O| over the whole output, rounded once to F32, when asked.
  std::optional<double> o_scale;
  bool want_amax = false;
  // Dropout with a given keep mask (CONTRACT section 10): attn.dropout_p as written, and
  // dropout_mask broadcast to [B, Hq, Nq, Nk]; O = (A * keep / (1 - p)) V.
  struct Dropout {
    std::string p;
    BoolTensor keep;
  };
  std::optional<Dropout> dropout;
  // Rotary embedding (CONTRACT section 10): q and k above hold the rotated values.
  std::optional<Rotary> rotary;
  // Whether key j's weight in row (b, h, i) is kept (true without dropout).
  bool kept(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;

  // The file as read (inputs and metadata), so that eval writes them back unchanged.
  SafeTensorsFile file;

  // mask/bias lookup with broadcasting to [B, Hq, Nq, Nk]
  bool mask_at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  double bias_at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  // The flat index of bias's element that (b, h, i, j) reads (bias present).
  std::size_t bias_index(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  // Whether query i of batch b is compared: query_mask true and i < seqlens_q[b].
  bool query_valid(std::int64_t b, std::int64_t i) const;
  double sink(std::int64_t h) const { return sinks->values[static_cast<std::size_t>(h)]; }
  // GQA/MQA: the kv head query head h reads (CONTRACT section 1); h itself for kind mha.
  std::int64_t kv_head(std::int64_t h) const { return h / (Hq / Hkv); }
  // The sequence lengths of batch b: seqlens_q[b] (else Nq) and seqlens_k[b] (else Nk).
  std::int64_t query_length(std::int64_t b) const {
    return seqlens_q ? (*seqlens_q)[static_cast<std::size_t>(b)] : Nq;
  }
  std::int64_t key_length(std::int64_t b) const {
    return seqlens_k ? (*seqlens_k)[static_cast<std::size_t>(b)] : Nk;
  }
  // The position of query i of batch b on the key axis: i (top_left, none) or
  // i + (Lk - Lq) (bottom_right), with Lk, Lq the lengths of batch b.
  std::int64_t aligned_position(std::int64_t b, std::int64_t i) const {
    return causal == Causal::BottomRight ? i + (key_length(b) - query_length(b)) : i;
  }
  // causal, window and seqlens_k rules of CONTRACT section 1
  bool position_allowed(std::int64_t b, std::int64_t i, std::int64_t j) const;
  // The keys [first, last] that causal, window and seqlens_k leave to query i of batch b,
  // clipped to [0, Nk - 1]; empty when first > last. Every allowed key of row i lies in it.
  struct KeyRange {
    std::int64_t first = 0, last = -1;
  };
  KeyRange key_range(std::int64_t b, std::int64_t i) const;
  // The shape of out_partial [S, B, Hq, Nq, Dv] and lse_partial [S, B, Hq, Nq].
  std::vector<std::int64_t> partial_out_shape() const { return {splits(), B, Hq, Nq, Dv}; }
  std::vector<std::int64_t> partial_row_shape() const { return {splits(), B, Hq, Nq}; }
  // allowed() for a key j of key_range(b, i), where the position allows it: the mask and a
  // bias other than -inf decide (each looked up only when the case has one).
  bool allowed_in_range(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return (!mask || mask_at(b, h, i, j)) && (!bias || bias_at(b, h, i, j) != -INFINITY);
  }
  // Whether query i of head h attends key j: position, mask, and a bias other than -inf.
  bool allowed(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return position_allowed(b, i, j) && allowed_in_range(b, h, i, j);
  }
  // Whether the row has any allowed key (else it is fully masked).
  bool row_has_key(std::int64_t b, std::int64_t h, std::int64_t i) const {
    const KeyRange r = key_range(b, i);
    for (std::int64_t j = r.first; j <= r.last; ++j)
      if (allowed_in_range(b, h, i, j)) return true;
    return false;
  }
  // The first row, in (b, h, i) order, that evaluation refuses: a fully masked row that is
  // not padding, under policy error. None under policy zero, and with sinks (a row without an
  // allowed key then still has the sink: it is not fully masked).
  std::optional<RowIndex> first_refused_row() const;

  // Shapes of the golden tensors (scores and weights: [B, Hq, Nq, Nk]): out ([B, Hq, Nq, Dv], or [B, Nq, Dout] for mha) and the rows
  // ([B, Hq, Nq]: row.valid, lse).
  std::vector<std::int64_t> out_shape() const;
  std::vector<std::int64_t> row_shape() const { return {B, Hq, Nq}; }
  // The golden tensors the reference adds to this case, in the order it writes them (without
  // the .undecided and .alt companions).
  std::vector<GoldenSpec> golden_tensors() const;
};

// Validates a parsed file as a case. Golden tensors already present (out, out.ref, ...) are
// ignored and dropped from `file`, so that a case can be evaluated again.
// Throws InputError(path, <tensor or key>, <what>).
Case case_from_file(const std::string& path, SafeTensorsFile file);
Case read_case(const std::string& path);

// A shape as the messages write it: "[2,3,4]".
std::string shape_string(const std::vector<std::int64_t>& shape);

// Names of the tensors that the reference adds (CONTRACT section 3), and their companions.
bool is_golden_tensor_name(const std::string& name);

}  // namespace attnoracle
