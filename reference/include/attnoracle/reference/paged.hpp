// Paged KV caches (CONTRACT section 8): k_cache, v_cache and block_table in place of k and v.
// The case reader gathers the caches into the contiguous k and v of the Case; the record kept
// here serves messages and the oracle's independent re-gathering.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/kv_formats.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle {

enum class KvLayout { NHD, HND };  // [Npages, P, Hkv, D] or [Npages, Hkv, P, D]
std::string_view kv_layout_name(KvLayout l);
std::optional<KvLayout> kv_layout_from_name(std::string_view s);

// The metadata key of paged cases, and whether `name` is one of their tensors.
inline constexpr std::string_view kKvLayoutKey = "attn.kv_layout";
bool is_paged_tensor_name(std::string_view name);
// Whether the file gives any of k_cache, v_cache, block_table.
bool is_paged_file(const SafeTensorsFile& file);

struct PagedKv {
  KvLayout layout = KvLayout::NHD;
  std::int64_t pages = 0, page_size = 0, table_width = 0;  // Npages, P, Mpages
  std::int64_t B = 0, Hkv = 0, Dk = 0, Dv = 0;
  std::vector<std::int64_t> block_table;  // [B, Mpages]
  std::int64_t Nk() const { return table_width * page_size; }
  // The page and slot of key j of batch b (j < seqlens_k[b]: a used entry).
  std::int64_t page(std::int64_t b, std::int64_t j) const {
    return block_table[static_cast<std::size_t>(b * table_width + j / page_size)];
  }
  // The flat index in a cache of row width `d` of the first element of (page, slot, kv head g).
  std::int64_t cache_index(std::int64_t page, std::int64_t slot, std::int64_t g, std::int64_t d) const {
    return (layout == KvLayout::NHD ? (page * page_size + slot) * Hkv + g
                                    : (page * Hkv + g) * page_size + slot) * d;
  }
};

// Checks the dtypes and shapes of k_cache, v_cache and block_table against q (an input of the
// same dtype) and attn.kv_layout (`layout`, null when absent), and reads the table. The table's
// entries are checked by gather_paged, which knows which ones are used. With a stored `form`
// (CONTRACT section 9) the caches hold its elements (D counted in elements, two per byte for
// nvfp4), and with form->v_from_k there is no v_cache.
// Throws InputError(path, <tensor or key>, <what>).
PagedKv read_paged_layout(const std::string& path, const SafeTensorsFile& file, const RawTensor& q,
                          const std::string* layout, const KvForm* form = nullptr);

// The contiguous k [B, Hkv, Nk, Dk] and v [B, Hkv, Nk, Dv] of the cache's dtype, named "k" and
// "v": key j of batch b read through the table for j < seqlens_k[b], 0 past it. A used table
// entry outside [0, Npages) is refused, naming the entry.
// The used entries of the table (those of keys j < seqlens_k[b]) inside [0, Npages), else the
// refusal naming the first entry outside.
void check_block_table(const std::string& path, const PagedKv& p, const std::vector<std::int64_t>& seqlens_k);
struct Gathered {
  RawTensor k, v;
};
Gathered gather_paged(const std::string& path, const SafeTensorsFile& file, const PagedKv& p,
                      const std::vector<std::int64_t>& seqlens_k);

}  // namespace attnoracle
