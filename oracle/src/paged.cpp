// paged_gather: a paged case's contiguous k and v are its caches read through the block table.
// The oracle reads the table and caches from the file again, by its own loop over the keys,
// rather than trusting the reader's gather.
#include <cmath>
#include <cstring>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::oracle {

std::vector<Violation> check_paged(const Case& c) {
  std::vector<Violation> v;
  if (!c.paged || c.kv_form) return v;  // a stored form's caches: check_stored_kv
  const RawTensor* bt = c.file.find("block_table");
  const bool nhd = c.file.metadata.count("attn.kv_layout") == 0 || c.file.metadata.at("attn.kv_layout") == "NHD";
  auto table = [&](std::int64_t b, std::int64_t m) {
    std::int32_t x;
    std::memcpy(&x, bt->data.data() + 4 * static_cast<std::size_t>(b * bt->shape[1] + m), 4);
    return static_cast<std::int64_t>(x);
  };
  struct Side {
    const char* name;
    const FloatTensor& gathered;
    std::int64_t d;
    const char* descale;
  };
  for (const Side& s : {Side{"k_cache", c.k, c.Dk, "k_descale"}, Side{"v_cache", c.v, c.Dv, "v_descale"}}) {
    const RawTensor* cache = c.file.find(s.name);
    const RawTensor* ds = c.file.find(s.descale);
    const std::size_t w = dtype_size(cache->dtype);
    // 8- and 16-bit dtypes decoded through a table of every bit pattern (cheap per element).
    std::vector<double> lut;
    if (w <= 2) {
      lut.resize(std::size_t{1} << (8 * w));
      for (std::size_t bits = 0; bits < lut.size(); ++bits) {
        const unsigned char raw[2] = {static_cast<unsigned char>(bits & 255), static_cast<unsigned char>(bits >> 8)};
        lut[bits] = decode_float(cache->dtype, raw);
      }
    }
    auto decode = [&](std::size_t e) {
      const unsigned char* p = cache->data.data() + e * w;
      return w == 1 ? lut[p[0]] : w == 2 ? lut[p[0] | std::size_t{p[1]} << 8] : decode_float(cache->dtype, p);
    };
    // NHD [Npages, P, Hkv, D], HND [Npages, Hkv, P, D]
    const std::int64_t P = nhd ? cache->shape[1] : cache->shape[2];
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t g = 0; g < c.Hkv; ++g) {
        double scale = 1;
        if (ds) {
          float f;
          std::memcpy(&f, ds->data.data() + 4 * static_cast<std::size_t>(b * c.Hkv + g), 4);
          scale = f;
        }
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          const bool used = j < c.key_length(b);
          const std::int64_t page = used ? table(b, j / P) : 0, slot = j % P;
          const std::int64_t at = nhd ? ((page * P + slot) * c.Hkv + g) * s.d : ((page * c.Hkv + g) * P + slot) * s.d;
          for (std::int64_t e = 0; e < s.d; ++e) {
            const double got = s.gathered.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * s.d + e)];
            double want = 0;  // past seqlens_k, and where a non-finite value sits at an unused position
            if (used) {
              const double x = decode(static_cast<std::size_t>(at + e));
              if (std::isfinite(x)) want = x * scale;
            }
            if (got == want) continue;
            Violation x{Invariant::PagedGather, b, g, 0, j, e,
                        std::string(s.name) + ": the case evaluated " + std::to_string(got) + " where page " +
                            std::to_string(page) + " slot " + std::to_string(slot) + " holds " + std::to_string(want)};
            v.push_back(std::move(x));
            return v;  // one is enough
          }
        }
      }
  }
  return v;
}

}  // namespace attnoracle::oracle
