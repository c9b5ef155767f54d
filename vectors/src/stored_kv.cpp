// Stored K/V for generated cases: quantizers into F8_E4M3, F8_E5M2, I8, mxfp8 and nvfp4 with the
// scales that fit each group, moved by a random number of binades (vectors/SUITES.md).
#include "stored_kv.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attnoracle/reference/round.hpp"
#include "numbers.hpp"
#include "prng.hpp"

namespace attnoracle::vectors {
namespace {

using Shape = std::vector<std::int64_t>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

// The largest finite element of a stored dtype, and the exponent of its top power of two.
double largest(DType t) { return t == DType::F8_E4M3 ? 448 : t == DType::F8_E5M2 ? 57344 : 127; }
int top_exponent(DType t) { return t == DType::F8_E4M3 ? 8 : t == DType::F8_E5M2 ? 15 : 6; }

// y rounded to nearest-even into F8 or I8, saturating at the largest finite element.
double quantize(double y, DType t) {
  const double m = largest(t);
  if (t == DType::I8) return std::nearbyint(std::clamp(y, -128.0, 127.0));
  return round_double(std::clamp(y, -m, m), t);
}

// 2^(ceil(log2 a) - top): a / fit lies in (2^(top-1), 2^top], below the format's largest element.
double fit_scale(double a, int top) {
  if (!(a > 0)) return std::ldexp(1.0, -top);
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m 2^e, 1/2 <= m < 1
  return std::ldexp(1.0, (m == 0.5 ? e - 1 : e) - top);
}

// The binades a scale moves by: t uniform in [-W, W].
int binade_shift(const ProblemSpec& p, Rng& rng) {
  const std::int64_t w = p.kv_scale_binades;
  return w == 0 ? 0 : static_cast<int>(static_cast<std::int64_t>(rng.below(sz(2 * w + 1))) - w);
}

RawTensor raw(const std::string& name, DType t, Shape shape, const std::vector<double>& values) {
  RawTensor r{name, t, std::move(shape), std::vector<unsigned char>(values.size() * dtype_size(t))};
  for (std::size_t e = 0; e < values.size(); ++e) {
    if (t == DType::I8 || t == DType::U8)
      r.data[e] = static_cast<unsigned char>(static_cast<std::int64_t>(values[e]) & 0xff);
    else
      encode_float(t, values[e], r.data.data() + e * dtype_size(t));  // checks exactness
  }
  return r;
}

struct Rows {  // a [B, Hkv, N, D] tensor's values, row by row
  Shape shape;
  std::vector<double> x;
  std::int64_t rows() const { return shape[0] * shape[1] * shape[2]; }
  std::int64_t width() const { return shape[3]; }
};

Rows read_rows(const RawTensor& t) {
  Rows r{t.shape, std::vector<double>(sz(t.numel()))};
  for (std::size_t e = 0; e < r.x.size(); ++e) r.x[e] = decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype));
  return r;
}

// Scaled F8 or I8: one F32 scale per tensor, kv head or token (row), each the power of two that
// fits its group's largest magnitude, times (1 + n 2^-20) (not a BF16 or F16 value), times 2^t.
void store_scaled(const ProblemSpec& p, SafeTensorsFile& f, const std::string& name, Rng& rng) {
  const DType t = *dtype_from_name(p.kv_format);
  Rows r = read_rows(*f.find(name));
  const std::string g = p.kv_scale.empty() ? "tensor" : p.kv_scale;
  const std::int64_t Hkv = r.shape[1], N = r.shape[2];
  auto group = [&](std::int64_t row) {
    return g == "tensor" ? 0 : g == "head" ? row / N % Hkv : row;
  };
  const std::int64_t groups = g == "tensor" ? 1 : g == "head" ? Hkv : r.rows();
  std::vector<double> amax(sz(groups), 0.0), scale(sz(groups));
  for (std::int64_t row = 0; row < r.rows(); ++row)
    for (std::int64_t c = 0; c < r.width(); ++c)
      amax[sz(group(row))] = std::max(amax[sz(group(row))], std::fabs(r.x[sz(row * r.width() + c)]));
  for (std::int64_t a = 0; a < groups; ++a) {
    const double n = static_cast<double>(rng.below(std::uint64_t{1} << 20));
    // exact: a power of two times 21 significant bits, within F32's normal range (W <= 30)
    scale[sz(a)] = std::ldexp(fit_scale(amax[sz(a)], top_exponent(t)) * (1 + n / 0x1p20), binade_shift(p, rng));
  }
  std::vector<double> q(r.x.size());
  for (std::int64_t row = 0; row < r.rows(); ++row)
    for (std::int64_t c = 0; c < r.width(); ++c)
      q[sz(row * r.width() + c)] = quantize(r.x[sz(row * r.width() + c)] / scale[sz(group(row))], t);
  f.put(raw(name, t, r.shape, q));
  const Shape s = g == "tensor" ? Shape{} : g == "head" ? Shape{1, Hkv, 1, 1} : Shape{r.shape[0], Hkv, N, 1};
  f.put(raw(name + "_scale", DType::F32, s, scale));
}

// mxfp8: per 32 elements an E8M0 exponent floor(log2 amax) - 8 + t (OCP's shared exponent for
// E4M3, moved by t binades) and E4M3 elements x / 2^exponent, saturating.
void store_mxfp8(const ProblemSpec& p, SafeTensorsFile& f, const std::string& name, Rng& rng) {
  Rows r = read_rows(*f.find(name));
  const std::int64_t blocks = r.width() / 32;
  std::vector<double> q(r.x.size()), bits(sz(r.rows() * blocks));
  for (std::int64_t row = 0; row < r.rows(); ++row)
    for (std::int64_t k = 0; k < blocks; ++k) {
      const double* x = r.x.data() + sz(row * r.width() + 32 * k);
      double amax = 0;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[e]));
      int exp = 0;
      std::frexp(amax, &exp);  // amax = m 2^exp, 1/2 <= m < 1: floor(log2 amax) = exp - 1
      const int shift = binade_shift(p, rng);
      const int b = amax > 0 ? std::clamp(exp - 1 - 8 + shift + 127, 0, 254) : 0;
      bits[sz(row * blocks + k)] = b;
      for (int e = 0; e < 32; ++e)
        q[sz(row * r.width() + 32 * k + e)] = quantize(std::ldexp(x[e], 127 - b), DType::F8_E4M3);
    }
  f.put(raw(name, DType::F8_E4M3, r.shape, q));
  f.put(raw(name + "_block_scale", DType::U8, {r.shape[0], r.shape[1], r.shape[2], blocks}, bits));
}

// nvfp4: a global F32 scale amax / (448 6) per tensor, per 16 elements an E4M3 block scale
// amax_block / (6 global) 2^t (saturating; 0 makes a block of zeros), and E2M1 elements
// x / (block global) packed two per byte, low nibble first.
void store_nvfp4(const ProblemSpec& p, SafeTensorsFile& f, const std::string& name, Rng& rng) {
  Rows r = read_rows(*f.find(name));
  double amax = 0;
  for (double x : r.x) amax = std::max(amax, std::fabs(x));
  const double global = amax > 0 ? round_into(amax / (448 * 6), DType::F32) : 1;
  const std::int64_t blocks = r.width() / 16;
  std::vector<double> packed(sz(r.rows() * r.width() / 2)), block(sz(r.rows() * blocks));
  for (std::int64_t row = 0; row < r.rows(); ++row)
    for (std::int64_t k = 0; k < blocks; ++k) {
      const double* x = r.x.data() + sz(row * r.width() + 16 * k);
      double a = 0;
      for (int e = 0; e < 16; ++e) a = std::max(a, std::fabs(x[e]));
      const double s = quantize(std::ldexp(a / (6 * global), binade_shift(p, rng)), DType::F8_E4M3);
      block[sz(row * blocks + k)] = s;
      for (int e = 0; e < 16; e += 2) {
        // s global is exact (4 + 24 significant bits); one division, then the nearest nibble
        const std::uint8_t lo = s > 0 ? e2m1_nearest(x[e] / (s * global)) : 0;
        const std::uint8_t hi = s > 0 ? e2m1_nearest(x[e + 1] / (s * global)) : 0;
        packed[sz((row * r.width() + 16 * k + e) / 2)] = lo | (hi << 4);
      }
    }
  f.put(raw(name, DType::U8, {r.shape[0], r.shape[1], r.shape[2], r.width() / 2}, packed));
  f.put(raw(name + "_block_scale", DType::F8_E4M3, {r.shape[0], r.shape[1], r.shape[2], blocks}, block));
  f.put(raw(name + "_global_scale", DType::F32, {}, {global}));
}

}  // namespace

std::uint8_t e2m1_nearest(double y) {
  static constexpr double kGrid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double a = std::fabs(y);
  unsigned best = 0;
  for (unsigned c = 1; c < 8; ++c) {
    const double d = std::fabs(a - kGrid[c]), db = std::fabs(a - kGrid[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;  // a tie goes to the even significand
  }
  return static_cast<std::uint8_t>(best == 0 ? 0 : (y < 0 ? 8u : 0u) | best);
}

std::vector<bool> used_key_rows(const Case& c) {
  std::vector<bool> used(sz(c.B * c.Hkv * c.Nk));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t g = 0; g < c.Hkv; ++g)
      for (std::int64_t j = 0; j < c.Nk; ++j) {
        bool u = false;
        for (std::int64_t h = 0; h < c.Hq && !u; ++h)
          for (std::int64_t i = 0; i < c.Nq && !u; ++i)
            u = c.kv_head(h) == g && c.query_valid(b, i) && c.allowed(b, h, i, j);
        used[sz((b * c.Hkv + g) * c.Nk + j)] = u;
      }
  return used;
}

void poison_row(const std::string& name, DType t, unsigned char* row, std::int64_t n, bool nan_only) {
  const bool block_scale = name.size() > 12 && name.compare(name.size() - 12, 12, "_block_scale") == 0;
  for (std::int64_t e = 0; e < n; ++e) {
    unsigned char* to = row + sz(e) * dtype_size(t);
    if (t == DType::F8_E4M3)
      *to = nan_only || e % 2 == 0 ? 0x7F : 0xFF;
    else if (t == DType::I8)
      *to = e % 2 == 0 ? 0x80 : 0x7F;
    else if (t == DType::U8)
      *to = block_scale ? 0xFF : 0x7F;  // nvfp4: low nibble 0xF (-6), high 0x7 (6)
    else
      encode_float(t, nan_only || e % 3 == 0 ? NAN : e % 3 == 1 ? INFINITY : -INFINITY, to);
  }
}

void store_kv(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed) {
  if (p.v_from_k) {
    f.tensors.erase(std::remove_if(f.tensors.begin(), f.tensors.end(), [](const RawTensor& t) { return t.name == "v"; }),
                    f.tensors.end());
    f.metadata["attn.v_from_k"] = std::to_string(p.Dv);
  }
  if (!p.o_scale.empty()) f.put(raw("o_scale", DType::F32, {}, {round_into(std::stod(p.o_scale), DType::F32)}));
  if (p.kv_format.empty()) return;
  Rng rng(seed);
  if (p.kv_format == "mxfp8" || p.kv_format == "nvfp4") f.metadata["attn.kv_block_scale"] = p.kv_format;
  for (const char* name : {"k", "v"}) {
    if (!f.find(name)) continue;  // v_from_k
    if (p.kv_format == "mxfp8")
      store_mxfp8(p, f, name, rng);
    else if (p.kv_format == "nvfp4")
      store_nvfp4(p, f, name, rng);
    else
      store_scaled(p, f, name, rng);
  }
}

}  // namespace attnoracle::vectors
