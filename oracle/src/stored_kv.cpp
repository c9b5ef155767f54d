// stored_kv: a case whose K/V are stored in a form of CONTRACT section 9 evaluates the real
// keys and values, element x scale. The oracle decodes every element and scale of the file
// again with its own tables (each format's values computed from its sign, exponent and
// significand fields), reads paged caches through the block table by its own loop, and
// compares each element of the k and v that the reference evaluates.
#include <cmath>
#include <cstring>
#include <optional>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::oracle {
namespace {

// The value of an 8-bit (or 4-bit) pattern of a binary format with `e` exponent and `m`
// significand bits and bias `bias`: top exponent field NaN/infinite where `ieee_top`, else
// E4M3's single NaN pattern where `has_nan` (E2M1 has none).
double field_value(unsigned bits, int e, int m, int bias, bool ieee_top, bool has_nan = true) {
  const unsigned frac = bits & ((1u << m) - 1), ex = (bits >> m) & ((1u << e) - 1);
  const bool neg = (bits >> (m + e)) & 1u;
  double v;
  if (ieee_top && ex == (1u << e) - 1) v = frac ? NAN : INFINITY;
  else if (!ieee_top && has_nan && ex == (1u << e) - 1 && frac == (1u << m) - 1) v = NAN;
  else if (ex == 0) v = std::ldexp(static_cast<double>(frac), 1 - bias - m);
  else v = std::ldexp(static_cast<double>(frac + (1u << m)), static_cast<int>(ex) - bias - m);
  return neg ? -v : v;
}

struct Tables {
  double e4m3[256], e5m2[256], i8[256], e8m0[256], e2m1[16];
  Tables() {
    for (unsigned b = 0; b < 256; ++b) {
      e4m3[b] = field_value(b, 4, 3, 7, false);
      e5m2[b] = field_value(b, 5, 2, 15, true);
      i8[b] = b < 128 ? b : static_cast<double>(b) - 256.0;
      e8m0[b] = b == 255 ? NAN : std::ldexp(1.0, static_cast<int>(b) - 127);
    }
    for (unsigned b = 0; b < 16; ++b) e2m1[b] = field_value(b, 2, 1, 1, false, false);
  }
  const double* of(DType t) const {
    return t == DType::F8_E4M3 ? e4m3 : t == DType::F8_E5M2 ? e5m2 : t == DType::I8 ? i8 : nullptr;
  }
};

double f32(const RawTensor& t, std::size_t e) {
  float x;
  std::memcpy(&x, t.data.data() + 4 * e, 4);
  return x;
}

}  // namespace

std::vector<Violation> check_stored_kv(const Case& c) {
  std::vector<Violation> out;
  if (!c.kv_form) return out;
  static const Tables tab;
  const KvForm& f = *c.kv_form;
  const SafeTensorsFile& file = c.file;
  const bool paged = c.paged.has_value();
  const RawTensor* bt = file.find("block_table");
  const bool nhd = !file.metadata.count("attn.kv_layout") || file.metadata.at("attn.kv_layout") == "NHD";
  const std::int64_t P = paged ? c.paged->page_size : 1, pages = paged ? c.paged->pages : 0;
  // The file's row (over [B,Hkv,Nk] or the cache's [Npages,P,Hkv] / [Npages,Hkv,P]) of a key.
  auto row_of = [&](std::int64_t b, std::int64_t g, std::int64_t j) -> std::optional<std::int64_t> {
    if (!paged) return (b * c.Hkv + g) * c.Nk + j;
    if (j >= c.key_length(b)) return std::nullopt;
    std::int32_t page;
    std::memcpy(&page, bt->data.data() + 4 * static_cast<std::size_t>(b * bt->shape[1] + j / P), 4);
    return nhd ? (page * P + j % P) * c.Hkv + g : (page * c.Hkv + g) * P + j % P;
  };
  // A per-key scale's element for file row r: r's coordinates over the full shape, each taken
  // as 0 where the scale's (right-aligned) dimension is 1.
  const std::vector<std::int64_t> full = paged ? (nhd ? std::vector<std::int64_t>{pages, P, c.Hkv}
                                                      : std::vector<std::int64_t>{pages, c.Hkv, P})
                                               : std::vector<std::int64_t>{c.B, c.Hkv, c.Nk, 1};
  auto scale_at = [&](const RawTensor& s, std::int64_t r) {
    std::vector<std::int64_t> idx(full.size());
    for (std::size_t a = full.size(); a-- > 0;) idx[a] = r % full[a], r /= full[a];
    std::int64_t flat = 0;
    const std::size_t off = full.size() - s.shape.size();
    for (std::size_t a = 0; a < s.shape.size(); ++a) flat = flat * s.shape[a] + (s.shape[a] == 1 ? 0 : idx[off + a]);
    return f32(s, static_cast<std::size_t>(flat));
  };
  const char* kname = paged ? "k_cache" : "k";
  const char* vname = paged ? "v_cache" : "v";
  struct Side {
    const char* stored;  // the tensor the elements come from
    const char* scales;  // "k" or "v": the prefix of its scale tensors
    const FloatTensor& real;
    std::int64_t d, width;  // elements compared per key, and per key in the stored tensor
  };
  const std::int64_t kw = c.Dk;
  std::vector<Side> sides = {{kname, "k", c.k, c.Dk, kw}};
  if (f.v_from_k) sides.push_back({kname, "k", c.v, c.Dv, kw});
  else sides.push_back({vname, "v", c.v, c.Dv, c.Dv});
  for (const Side& s : sides) {
    const RawTensor& el = *file.find(s.stored);
    const std::string p(s.scales);
    const RawTensor* ks = file.find(p + "_scale");
    const RawTensor* bs = file.find(p + "_block_scale");
    const RawTensor* gs = file.find(p + "_global_scale");
    const std::int64_t blk = f.scheme == KvScheme::Mxfp8 ? 32 : 16, nb = s.width / blk;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t g = 0; g < c.Hkv; ++g)
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          const auto r = row_of(b, g, j);
          for (std::int64_t e = 0; e < s.d; ++e) {
            double want = 0;  // past seqlens_k in a paged cache
            if (r) {
              double x;
              if (f.scheme == KvScheme::Nvfp4) {
                const unsigned byte = el.data[static_cast<std::size_t>(*r * s.width / 2 + e / 2)];
                x = tab.e2m1[(e & 1) ? byte >> 4 : byte & 15u] * tab.e4m3[bs->data[static_cast<std::size_t>(*r * nb + e / blk)]] * f32(*gs, 0);
              } else if (f.scheme == KvScheme::Mxfp8) {
                x = tab.e4m3[el.data[static_cast<std::size_t>(*r * s.width + e)]] *
                    tab.e8m0[bs->data[static_cast<std::size_t>(*r * nb + e / blk)]];
              } else if (const double* t = tab.of(el.dtype)) {
                x = t[el.data[static_cast<std::size_t>(*r * s.width + e)]] * (ks ? scale_at(*ks, *r) : 1.0);
              } else {
                x = decode_float(el.dtype, el.data.data() + static_cast<std::size_t>(*r * s.width + e) * dtype_size(el.dtype));
              }
              // FP8 q, k and v with a view: k_descale [B,Hkv] scales k and so its view
              if (const RawTensor* ds = file.find("k_descale"); ds && f.scheme == KvScheme::Plain)
                x *= f32(*ds, static_cast<std::size_t>(b * c.Hkv + g));
              if (std::isfinite(x)) want = x;  // non-finite at an unused position: 0 in the case
            }
            const double got = s.real.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * s.d + e)];
            if (got == want) continue;
            out.push_back(Violation{Invariant::StoredKv, b, g, 0, j, e,
                                    std::string(s.real.values.data() == c.k.values.data() ? "k" : "v") +
                                        ": the case evaluated " + std::to_string(got) + " where " + s.stored +
                                        " and its scales give " + std::to_string(want)});
            return out;  // one is enough
          }
        }
  }
  return out;
}

}  // namespace attnoracle::oracle
