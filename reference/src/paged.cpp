#include "attnoracle/reference/paged.hpp"

#include <cstring>
#include <utility>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"

namespace attnoracle {
namespace {

constexpr std::pair<KvLayout, std::string_view> kLayoutNames[] = {{KvLayout::NHD, "NHD"},
                                                                   {KvLayout::HND, "HND"}};

}  // namespace

std::string_view kv_layout_name(KvLayout l) { return table_name(kLayoutNames, l); }
std::optional<KvLayout> kv_layout_from_name(std::string_view s) { return table_from_name(kLayoutNames, s); }

bool is_paged_tensor_name(std::string_view name) {
  return name == "k_cache" || name == "v_cache" || name == "block_table";
}

bool is_paged_file(const SafeTensorsFile& file) {
  return file.find("k_cache") || file.find("v_cache") || file.find("block_table");
}

PagedKv read_paged_layout(const std::string& path, const SafeTensorsFile& file, const RawTensor& q,
                          const std::string* layout, const KvForm* form) {
  auto fail = [&](const std::string& field, const std::string& what) {
    throw InputError(path, field, what);
  };
  for (const char* name : {"k", "v"})
    if (file.find(name))
      fail(name, "given beside a paged KV cache (k_cache, v_cache, block_table): give one or the other");
  const bool v_view = form && form->v_from_k;  // no v_cache: v is a view of k (CONTRACT section 9)
  for (const char* name : {"k_cache", "v_cache", "block_table"})
    if (!file.find(name) && !(v_view && std::string_view(name) == "v_cache"))
      fail(name, "missing (a paged KV cache gives k_cache, v_cache and block_table together)");
  if (!file.find("seqlens_k")) fail("seqlens_k", "missing (required with a paged KV cache)");
  PagedKv p;
  if (layout) {
    const auto l = kv_layout_from_name(*layout);
    if (!l) fail(std::string(kKvLayoutKey), "value \"" + printable(*layout) + "\" is not NHD or HND");
    p.layout = *l;
  }
  const char* shape_name = p.layout == KvLayout::NHD ? "[Npages,P,Hkv,D] (attn.kv_layout NHD)"
                                                     : "[Npages,Hkv,P,D] (attn.kv_layout HND)";
  const RawTensor& kc = *file.find("k_cache");
  const RawTensor& vc = *file.find(v_view ? "k_cache" : "v_cache");
  const RawTensor& bt = *file.find("block_table");
  const std::int64_t per = form ? form->per_stored() : 1;  // elements per stored element along D
  for (const RawTensor* t : {&kc, &vc}) {
    if (!form && t->dtype != q.dtype)  // a stored form's dtypes are checked by read_kv_form
      fail(t->name, "dtype " + std::string(dtype_name(t->dtype)) + " differs from q's " +
                        std::string(dtype_name(q.dtype)));
    if (t->shape.size() != 4)
      fail(t->name, "shape " + shape_string(t->shape) + " has rank " + std::to_string(t->shape.size()) +
                        ", expected 4 " + shape_name);
    for (std::size_t a = 1; a < 4; ++a)  // Npages may be 0 (no used page)
      if (t->shape[a] < 1)
        fail(t->name, "shape " + shape_string(t->shape) + " has dimension " + std::to_string(a) +
                          " equal to 0; only Npages may be 0");
  }
  const std::size_t ph = p.layout == KvLayout::NHD ? 1 : 2, hh = p.layout == KvLayout::NHD ? 2 : 1;
  p.pages = kc.shape[0], p.page_size = kc.shape[ph], p.Hkv = kc.shape[hh];
  p.Dk = kc.shape[3] * per, p.Dv = v_view ? form->v_from_k : vc.shape[3] * per;
  if (p.Dk != q.shape[3])
    fail("k_cache", "Dk is " + std::to_string(p.Dk) + (per > 1 ? " (2 per byte)" : "") + " but q has Dk " +
                        std::to_string(q.shape[3]));
  const std::vector<std::int64_t> want_v = {kc.shape[0], kc.shape[1], kc.shape[2], vc.shape[3]};
  if (vc.shape != want_v)
    fail("v_cache", "shape " + shape_string(vc.shape) + " does not match k_cache's " +
                        shape_string(kc.shape) + " but in its last dimension (expected " +
                        shape_string(want_v) + ")");
  if (q.shape[1] % p.Hkv != 0)
    fail("k_cache", "Hkv is " + std::to_string(p.Hkv) + ", which does not divide Hq " +
                        std::to_string(q.shape[1]) + " of q");
  if (bt.dtype != DType::I32)
    fail("block_table", "dtype " + std::string(dtype_name(bt.dtype)) + " is not I32");
  if (bt.shape.size() != 2 || bt.shape[0] != q.shape[0])
    fail("block_table", "shape " + shape_string(bt.shape) + " is not [B,Mpages] with B = " +
                            std::to_string(q.shape[0]) + " (q's)");
  p.B = bt.shape[0], p.table_width = bt.shape[1];
  p.block_table.resize(static_cast<std::size_t>(p.B * p.table_width));
  for (std::size_t e = 0; e < p.block_table.size(); ++e) {
    std::int32_t x;
    std::memcpy(&x, bt.data.data() + 4 * e, 4);
    p.block_table[e] = x;
  }
  return p;
}

void check_block_table(const std::string& path, const PagedKv& p, const std::vector<std::int64_t>& seqlens_k) {
  for (std::int64_t b = 0; b < p.B; ++b) {
    const std::int64_t used = (seqlens_k[static_cast<std::size_t>(b)] + p.page_size - 1) / p.page_size;
    for (std::int64_t m = 0; m < used; ++m) {
      const std::int64_t x = p.block_table[static_cast<std::size_t>(b * p.table_width + m)];
      if (x < 0 || x >= p.pages)
        throw InputError(path, "block_table",
                         "entry [" + std::to_string(b) + ", " + std::to_string(m) + "] = " +
                             std::to_string(x) + " is outside [0, " + std::to_string(p.pages) +
                             ") (Npages), and batch " + std::to_string(b) + " uses it (seqlens_k " +
                             std::to_string(seqlens_k[static_cast<std::size_t>(b)]) + ", page size " +
                             std::to_string(p.page_size) + ")");
    }
  }
}

Gathered gather_paged(const std::string& path, const SafeTensorsFile& file, const PagedKv& p,
                      const std::vector<std::int64_t>& seqlens_k) {
  check_block_table(path, p, seqlens_k);  // first, so that no copy reads outside a cache
  const std::int64_t nk = p.Nk();
  auto gather = [&](const RawTensor& cache, const char* name, std::int64_t d) {
    RawTensor t;
    t.name = name;
    t.dtype = cache.dtype;
    t.shape = {p.B, p.Hkv, nk, d};
    const std::size_t w = dtype_size(cache.dtype), row = static_cast<std::size_t>(d) * w;
    reserve_large(t.data, static_cast<std::size_t>(p.B * p.Hkv * nk) * row);
    t.data.resize(static_cast<std::size_t>(p.B * p.Hkv * nk) * row);  // zero bytes: 0 in every dtype
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t g = 0; g < p.Hkv; ++g) {
        unsigned char* dst = t.data.data() + static_cast<std::size_t>((b * p.Hkv + g) * nk) * row;
        for (std::int64_t j = 0; j < seqlens_k[static_cast<std::size_t>(b)]; ++j)
          std::memcpy(dst + static_cast<std::size_t>(j) * row,
                      cache.data.data() +
                          static_cast<std::size_t>(p.cache_index(p.page(b, j), j % p.page_size, g, d)) * w,
                      row);
      }
    return t;
  };
  return {gather(*file.find("k_cache"), "k", p.Dk), gather(*file.find("v_cache"), "v", p.Dv)};
}

}  // namespace attnoracle
