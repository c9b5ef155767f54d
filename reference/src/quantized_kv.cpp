#include "attnoracle/reference/quantized_kv.hpp"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"

namespace attnoracle {
namespace {

using Shape = std::vector<std::int64_t>;

constexpr std::array<std::string_view, 6> kScaleNames = {"k_scale",       "v_scale",        "k_block_scale",
                                                         "v_block_scale", "k_global_scale", "v_global_scale"};

std::string decimal(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::string str(DType t) { return std::string(dtype_name(t)); }

[[noreturn]] void fail(const std::string& path, const std::string& field, const std::string& what) {
  throw InputError(path, field, what);
}

bool is_scaled_element(DType t) { return t == DType::I8 || is_fp8(t); }

// attn.v_from_k: a positive integer of at most 18 digits.
std::int64_t parse_dv(const std::string& path, const std::string& text) {
  std::int64_t n = 0;
  bool ok = !text.empty() && text.size() <= 18;
  for (char ch : text) {
    ok = ok && ch >= '0' && ch <= '9';
    if (ok) n = n * 10 + (ch - '0');
  }
  if (!ok || n < 1)
    fail(path, std::string(kVFromKKey), "value \"" + printable(text) + "\" is not an integer >= 1 (Dv, at most 18 digits)");
  return n;
}

// The flat index into `shape`, broadcast right-aligned to `full`, of the element at `idx` of full.
std::size_t broadcast_flat(const Shape& shape, const Shape& full, const Shape& idx) {
  const std::size_t r = shape.size(), f = full.size();
  std::int64_t flat = 0;
  for (std::size_t a = 0; a < r; ++a) flat = flat * shape[a] + (shape[a] == 1 ? 0 : idx[f - r + a]);
  return static_cast<std::size_t>(flat);
}

double f32_at(const RawTensor& t, std::size_t e) {
  float x;
  std::memcpy(&x, t.data.data() + 4 * e, 4);
  return static_cast<double>(x);  // exact
}

}  // namespace

bool is_kv_scale_tensor_name(std::string_view name) {
  for (auto n : kScaleNames)
    if (n == name) return true;
  return false;
}

bool uses_kv_form(const SafeTensorsFile& file, DType q_dtype) {
  if (file.metadata.count(std::string(kKvBlockScaleKey)) || file.metadata.count(std::string(kVFromKKey))) return true;
  for (auto n : kScaleNames)
    if (file.find(std::string(n))) return true;
  for (const char* n : {"k", "k_cache"})
    if (const RawTensor* t = file.find(n))
      return t->dtype == DType::I8 || t->dtype == DType::U8 || (is_fp8(t->dtype) && !is_fp8(q_dtype));
  return false;
}

KvForm read_kv_form(const std::string& path, const SafeTensorsFile& file, const RawTensor& q) {
  KvForm form;
  const bool paged = is_paged_file(file);
  const std::string kn = paged ? "k_cache" : "k", vn = paged ? "v_cache" : "v";
  const auto& md = file.metadata;
  if (const auto it = md.find(std::string(kVFromKKey)); it != md.end()) {
    form.v_from_k = parse_dv(path, it->second);
    if (file.find(vn)) fail(path, vn, "given with attn.v_from_k (v is then the view k[..., 0:Dv]): give one or the other");
    for (const char* n : {"v_scale", "v_block_scale", "v_global_scale"})
      if (file.find(n)) fail(path, n, "given with attn.v_from_k (v is a view of k and takes k's scales)");
  }
  const RawTensor* k = file.find(kn);
  if (!k) fail(path, kn, "missing (required for attn.kind sdpa)");
  const RawTensor* v = form.v_from_k ? nullptr : file.find(vn);
  if (!form.v_from_k && !v) fail(path, vn, "missing (required for attn.kind sdpa; attn.v_from_k makes v a view of k)");
  form.stored = k->dtype;
  if (v && v->dtype != k->dtype)
    fail(path, vn, "dtype " + str(v->dtype) + " differs from " + kn + "'s " + str(k->dtype));
  auto given = [&](const char* n) { return file.find(n) != nullptr; };
  // The scale tensors of a scheme: required (v's unless v_from_k), of their dtype; the others refused.
  auto scales = [&](std::initializer_list<std::pair<const char*, DType>> wanted, const std::string& why) {
    for (auto n : kScaleNames) {
      bool want = false;
      for (const auto& [w, t] : wanted) {
        if (n != w) continue;
        want = true;
        const bool of_v = n[0] == 'v';
        const RawTensor* s = file.find(std::string(n));
        if (!s && !(of_v && form.v_from_k)) fail(path, std::string(n), "missing (required for " + why + ")");
        if (s && s->dtype != t)
          fail(path, std::string(n), "dtype " + str(s->dtype) + " is not " + str(t) + " (" + why + ")");
      }
      if (!want && file.find(std::string(n)))
        fail(path, std::string(n), "given, but " + why + " has no " + std::string(n));
    }
  };
  const auto block = md.find(std::string(kKvBlockScaleKey));
  const bool q_float = is_float_format(q.dtype);
  if (block != md.end()) {
    if (block->second == "mxfp8") form.scheme = KvScheme::Mxfp8;
    else if (block->second == "nvfp4") form.scheme = KvScheme::Nvfp4;
    else fail(path, std::string(kKvBlockScaleKey), "value \"" + printable(block->second) + "\" is not mxfp8 or nvfp4");
  } else if (is_scaled_element(k->dtype) && (q_float || given("k_scale") || given("v_scale"))) {
    form.scheme = KvScheme::Scaled;
  }
  const std::string scheme(kv_scheme_name(form.scheme));
  if (form.scheme != KvScheme::Plain && !q_float)
    fail(path, "q", "dtype " + str(q.dtype) + " is not F64, F32, F16 or BF16 (the query of " +
                        (form.scheme == KvScheme::Scaled ? std::string("scaled") : "attn.kv_block_scale " + scheme) +
                        " K/V is a float tensor)");
  switch (form.scheme) {
    case KvScheme::Mxfp8:
      if (k->dtype != DType::F8_E4M3)
        fail(path, kn, "dtype " + str(k->dtype) + " is not F8_E4M3 (attn.kv_block_scale mxfp8)");
      scales({{"k_block_scale", DType::U8}, {"v_block_scale", DType::U8}}, "attn.kv_block_scale mxfp8");
      break;
    case KvScheme::Nvfp4:
      if (k->dtype != DType::U8)
        fail(path, kn, "dtype " + str(k->dtype) + " is not U8 (attn.kv_block_scale nvfp4: E2M1 packed two per byte)");
      scales({{"k_block_scale", DType::F8_E4M3}, {"v_block_scale", DType::F8_E4M3},
              {"k_global_scale", DType::F32}, {"v_global_scale", DType::F32}},
             "attn.kv_block_scale nvfp4");
      break;
    case KvScheme::Scaled:
      scales({{"k_scale", DType::F32}, {"v_scale", DType::F32}}, str(k->dtype) + " " + kn + " (scaled K/V)");
      break;
    case KvScheme::Plain:
      for (auto n : kScaleNames)
        if (given(std::string(n).c_str()))
          fail(path, std::string(n), "given, but " + kn + " has dtype " + str(k->dtype) +
                                         " (scales are for I8, F8_E4M3 and F8_E5M2 K/V, or attn.kv_block_scale)");
      if (k->dtype == DType::U8)
        fail(path, kn, "dtype U8 is for attn.kv_block_scale nvfp4 (E2M1 packed two per byte)");
      if (k->dtype != q.dtype)
        fail(path, kn, "dtype " + str(k->dtype) + " differs from q's " + str(q.dtype));
      break;
  }
  return form;
}

void dequantize_kv(const std::string& path, const SafeTensorsFile& file, const KvForm& form, const RawTensor& q,
                   const PagedKv* paged, const std::vector<std::int64_t>* seqlens_k, RealKv out) {
  const std::string kn = paged ? "k_cache" : "k", vn = paged ? "v_cache" : "v";
  const RawTensor& k = *file.find(kn);
  const RawTensor* v = form.v_from_k ? nullptr : file.find(vn);
  const std::int64_t per = form.per_stored(), blk = form.block();
  std::int64_t B, Hkv, Nk, Dk, Dv;
  Shape full;  // what per-key scales broadcast to
  if (paged) {
    B = paged->B, Hkv = paged->Hkv, Nk = paged->Nk(), Dk = paged->Dk, Dv = paged->Dv;
    full = paged->layout == KvLayout::NHD ? Shape{paged->pages, paged->page_size, Hkv}
                                          : Shape{paged->pages, Hkv, paged->page_size};
  } else {
    for (const RawTensor* t : {&k, v}) {
      if (!t) continue;
      if (t->shape.size() != 4)
        fail(path, t->name, "shape " + shape_string(t->shape) + " has rank " + std::to_string(t->shape.size()) +
                                ", expected 4 [B,Hkv,Nk,D]");
      for (std::size_t a : {std::size_t{1}, std::size_t{3}})
        if (t->shape[a] < 1)
          fail(path, t->name, "shape " + shape_string(t->shape) + " has dimension " + std::to_string(a) +
                                  " equal to 0; only B and Nk may be 0");
      if (t->shape[0] != q.shape[0])
        fail(path, t->name, "B is " + std::to_string(t->shape[0]) + " but q has B " + std::to_string(q.shape[0]));
    }
    B = k.shape[0], Hkv = k.shape[1], Nk = k.shape[2], Dk = k.shape[3] * per;
    if (Dk != q.shape[3])
      fail(path, "k", "Dk is " + std::to_string(Dk) + (per > 1 ? " (2 per byte)" : "") + " but q has Dk " +
                          std::to_string(q.shape[3]));
    if (v && (v->shape[1] != Hkv || v->shape[2] != Nk))
      fail(path, "v", "shape " + shape_string(v->shape) + " does not match k's " + shape_string(k.shape) +
                          " in Hkv and Nk");
    if (q.shape[1] % Hkv != 0)
      fail(path, "k", "Hkv is " + std::to_string(Hkv) + ", which does not divide Hq " + std::to_string(q.shape[1]) + " of q");
    Dv = form.v_from_k ? form.v_from_k : v->shape[3] * per;
    full = {B, Hkv, Nk, 1};
  }
  if (form.v_from_k && form.v_from_k > Dk)
    fail(path, std::string(kVFromKKey), "value " + std::to_string(form.v_from_k) + " is more than Dk = " +
                                            std::to_string(Dk) + " (v is the view k[..., 0:Dv])");
  if (blk)
    for (const auto& [name, d] : {std::pair{kn, Dk}, std::pair{vn, Dv}})
      if (!(form.v_from_k && name == vn) && d % blk != 0)
        fail(path, name, std::string(name[0] == 'k' ? "Dk" : "Dv") + " is " + std::to_string(d) +
                             ", not a multiple of " + std::to_string(blk) + " (the attn.kv_block_scale " +
                             std::string(kv_scheme_name(form.scheme)) + " block)");
  // The file's row of key j of batch b, kv head g (a row of `full`), or none past seqlens_k.
  auto source = [&](std::int64_t b, std::int64_t g, std::int64_t j) -> std::optional<std::int64_t> {
    if (!paged) return (b * Hkv + g) * Nk + j;
    if (j >= (*seqlens_k)[static_cast<std::size_t>(b)]) return std::nullopt;
    return paged->cache_index(paged->page(b, j), j % paged->page_size, g, 1);
  };
  auto unravel = [&](std::int64_t r) {
    Shape idx(full.size());
    for (std::size_t a = full.size(); a-- > 0;) {
      idx[a] = r % full[a];
      r /= full[a];
    }
    return idx;
  };
  const std::string full_text = paged ? (paged->layout == KvLayout::NHD ? "[Npages,P,Hkv]" : "[Npages,Hkv,P]")
                                      : "[B,Hkv,Nk,1]";
  // Shapes of the scale tensors, and the global scales.
  auto per_key_scale = [&](const RawTensor& s) {
    bool ok = s.shape.size() <= full.size();
    for (std::size_t a = 0; ok && a < s.shape.size(); ++a) {
      const std::int64_t f = full[full.size() - s.shape.size() + a];
      ok = s.shape[a] == 1 || s.shape[a] == f;
    }
    if (!ok)
      fail(path, s.name, "shape " + shape_string(s.shape) + " does not broadcast to " + full_text + " = " +
                             shape_string(full) +
                             (paged ? std::string(" (per tensor [], per head, or per slot beside the pages)")
                                    : std::string(" (per tensor [], per head [1,Hkv,1,1], per token [B,Hkv,Nk,1])")));
  };
  auto block_shape = [&](const RawTensor& s, const RawTensor& elements, std::int64_t d) {
    Shape want = elements.shape;
    want.back() = d / blk;
    if (s.shape != want)
      fail(path, s.name, "shape " + shape_string(s.shape) + " is not " + elements.name + "'s with D / " +
                             std::to_string(blk) + " in the last dimension = " + shape_string(want));
  };
  auto global = [&](const char* name) {
    const RawTensor& s = *file.find(name);
    if (!s.shape.empty()) fail(path, name, "shape " + shape_string(s.shape) + " is not [] (a scalar)");
    const double x = f32_at(s, 0);
    if (!std::isfinite(x) || !(x > 0))
      fail(path, name, "element 0 is " + decimal(x) + "; scales must be finite and > 0");
    return x;
  };
  auto fill = [&](FloatTensor& dst, const RawTensor& elements, std::int64_t D, const char* side) {
    const std::string sn(side);
    const RawTensor* scale = form.scheme == KvScheme::Scaled ? file.find(sn + "_scale") : nullptr;
    const RawTensor* bs = blk ? file.find(sn + "_block_scale") : nullptr;
    if (scale) per_key_scale(*scale);
    if (bs) block_shape(*bs, elements, D);
    const double gs = form.scheme == KvScheme::Nvfp4 ? global((sn + "_global_scale").c_str()) : 1.0;
    const std::int64_t Ds = D / per, nb = blk ? D / blk : 0;
    dst.dtype = form.scheme == KvScheme::Plain ? form.stored : DType::F64;
    dst.shape = {B, Hkv, Nk, D};
    reserve_large(dst.values, static_cast<std::size_t>(B * Hkv * Nk * D));
    dst.values.assign(static_cast<std::size_t>(B * Hkv * Nk * D), 0.0);  // 0 past seqlens_k
    const std::size_t w = dtype_size(elements.dtype);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t g = 0; g < Hkv; ++g)
        for (std::int64_t j = 0; j < Nk; ++j) {
          const auto r = source(b, g, j);
          if (!r) continue;
          auto where = [&] {
            return ", read by key " + std::to_string(j) + " of b=" + std::to_string(b) + ", kv head " + std::to_string(g);
          };
          double s = 1;
          if (scale) {
            const std::size_t e = broadcast_flat(scale->shape, full, unravel(*r));
            s = f32_at(*scale, e);
            if (!std::isfinite(s) || !(s > 0))
              fail(path, scale->name, "element " + std::to_string(e) + " is " + decimal(s) + where() +
                                          "; scales must be finite and > 0");
          }
          const unsigned char* row = elements.data.data() + static_cast<std::size_t>(*r * Ds) * w;
          double* out_row = dst.values.data() + ((b * Hkv + g) * Nk + j) * D;
          for (std::int64_t blkno = 0; blkno < (nb ? nb : 1); ++blkno) {
            double f = s;
            if (bs) {
              const std::size_t e = static_cast<std::size_t>(*r * nb + blkno);
              const std::uint8_t bits = bs->data[e];
              if (form.scheme == KvScheme::Mxfp8) {
                if (bits == 255)
                  fail(path, bs->name, "element " + std::to_string(e) + " is 255, the E8M0 NaN" + where());
                f = e8m0_from_bits(bits);
              } else {
                f = f8_e4m3_from_bits(bits);
                if (std::isnan(f) || std::signbit(f))
                  fail(path, bs->name, "element " + std::to_string(e) + " is " + (std::isnan(f) ? "NaN" : decimal(f)) +
                                           where() + "; nvfp4 block scales must be >= 0 (not -0)");
                f *= gs;  // exact: 4 and 24 significant bits, within F64's range
              }
            }
            const std::int64_t d0 = nb ? blkno * blk : 0, d1 = nb ? d0 + blk : D;
            for (std::int64_t d = d0; d < d1; ++d) {
              double x;
              switch (form.scheme) {
                case KvScheme::Nvfp4: {
                  const std::uint8_t byte = row[d / 2];
                  x = e2m1_from_bits(static_cast<std::uint8_t>(d % 2 ? byte >> 4 : byte & 15u));
                  break;
                }
                case KvScheme::Scaled:
                  x = elements.dtype == DType::I8 ? i8_from_bits(row[d]) : decode_float(elements.dtype, row + d);
                  break;
                default: x = decode_float(elements.dtype, row + static_cast<std::size_t>(d) * w);
              }
              // Exact: at most 8 significant bits (I8) times an F32 scale's 24, or E2M1's 2 times
              // the 28 of the nvfp4 factor above, within F64's exponent range.
              out_row[d] = form.scheme == KvScheme::Plain ? x : x * f;
            }
          }
        }
  };
  fill(*out.k, k, Dk, "k");
  if (form.v_from_k) {
    FloatTensor& dst = *out.v;
    dst.dtype = out.k->dtype;
    dst.shape = {B, Hkv, Nk, Dv};
    reserve_large(dst.values, static_cast<std::size_t>(B * Hkv * Nk * Dv));
    dst.values.resize(static_cast<std::size_t>(B * Hkv * Nk * Dv));
    for (std::int64_t r = 0; r < B * Hkv * Nk; ++r)
      std::memcpy(dst.values.data() + r * Dv, out.k->values.data() + r * Dk, static_cast<std::size_t>(Dv) * 8);
  } else {
    fill(*out.v, *v, Dv, "v");
  }
}

}  // namespace attnoracle
