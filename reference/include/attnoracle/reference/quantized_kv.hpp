// Quantized and block-scaled K/V, and V as a view of K (CONTRACT section 9). The case reader
// computes each key and value as element x scale (exact in F64) when the case is read, so that
// the evaluation sees real inputs as it does for any other case. Nothing downstream assumes
// that k's values lie on the grid of k's stored dtype: the fast path tests each case's
// significand widths itself (short_significands) before it takes products as exact, and the
// MPFR path forms every product exactly from the F64 values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/kv_formats.hpp"
#include "attnoracle/reference/paged.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle {

struct FloatTensor;

// k_scale, v_scale, k_block_scale, v_block_scale, k_global_scale, v_global_scale.
bool is_kv_scale_tensor_name(std::string_view name);
// Whether the case stores its K/V in a form of section 9: a scale tensor, attn.kv_block_scale or
// attn.v_from_k, or k (k_cache) of dtype I8 or U8, or FP8 beside a float q.
bool uses_kv_form(const SafeTensorsFile& file, DType q_dtype);

// Reads attn.kv_block_scale and attn.v_from_k, and checks the dtypes of k and v (or k_cache,
// v_cache) and of their scales against q. Throws InputError(path, <tensor or key>, <what>).
KvForm read_kv_form(const std::string& path, const SafeTensorsFile& file, const RawTensor& q);

// Checks the shapes of k, v and every scale tensor, and computes the real k [B,Hkv,Nk,Dk] and v
// [B,Hkv,Nk,Dv] (F64 tensors; for KvScheme::Plain of the stored dtype). Contiguous K/V when
// `paged` is null; else the used slots of the cache (keys j < seqlens_k[b]), 0 past them. A
// scale that a used key reads must be finite and > 0 (block scales: not NaN; nvfp4's not
// negative, 0 allowed). Elements that are NaN or infinite (FP8) stay so, for the case's
// unused-position rules.
struct RealKv {
  FloatTensor* k = nullptr;
  FloatTensor* v = nullptr;
};
void dequantize_kv(const std::string& path, const SafeTensorsFile& file, const KvForm& form,
                   const RawTensor& q, const PagedKv* paged, const std::vector<std::int64_t>* seqlens_k,
                   RealKv out);

}  // namespace attnoracle
