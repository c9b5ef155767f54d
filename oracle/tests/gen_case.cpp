#include "gen_case.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace attnoracle::testing {

namespace gen = rc::gen;
using I = std::int64_t;

namespace {

// IEEE 754 binary formats: stored significand bits, exponent bits, bytes.
struct Fmt {
  int mant;
  int ebits;
  std::size_t size;
  int bias() const { return (1 << (ebits - 1)) - 1; }
  int precision() const { return mant + 1; }
  int emin() const { return 1 - bias(); }  // exponent of the smallest normal
};

Fmt fmt(DType t) {
  switch (t) {
    case DType::F64: return {52, 11, 8};
    case DType::F32: return {23, 8, 4};
    case DType::F16: return {10, 5, 2};
    case DType::BF16: return {7, 8, 2};
    default: throw std::logic_error("not a floating dtype");
  }
}

std::string dtype_text(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::BOOL: return "BOOL";
    case DType::I64: return "I64";
    default: return "?";
  }
}

std::optional<DType> dtype_of_text(const std::string& s) {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16})
    if (dtype_text(t) == s) return t;
  return std::nullopt;
}

I numel(const std::vector<I>& shape) {
  I n = 1;
  for (I d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<I>& shape) {
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  // (GCC bug 105329).
  std::string s = "[";
  for (std::size_t a = 0; a < shape.size(); ++a) {
    if (a) s += ',';
    s += std::to_string(shape[a]);
  }
  return s + "]";
}

std::string hex(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

// Bit pattern of a finite value: sign, exponent field in [elo, ehi], and `random_bits` random
// leading bits of the stored significand (the rest zero).
rc::Gen<std::uint64_t> gen_pattern(DType t, int elo, int ehi, int random_bits) {
  const Fmt f = fmt(t);
  const int rb = std::min(random_bits, f.mant);
  return gen::map(gen::tuple(gen::element(0, 1), uniform(elo, ehi + 1),
                             uniform<std::uint64_t>(0, std::uint64_t{1} << rb)),
                  [f, rb](const std::tuple<int, int, std::uint64_t>& x) {
                    const auto sign = static_cast<std::uint64_t>(std::get<0>(x));
                    const auto e = static_cast<std::uint64_t>(std::get<1>(x));
                    const std::uint64_t m = std::get<2>(x) << (f.mant - rb);
                    return (sign << (f.mant + f.ebits)) | (e << f.mant) | m;
                  });
}

rc::Gen<std::uint64_t> gen_bits(DType t, Values style) {
  const Fmt f = fmt(t);
  const int b = f.bias();
  switch (style) {
    case Values::Normal: return gen_pattern(t, b - 3, b + 1, f.mant);
    case Values::Dyadic: return gen_pattern(t, b - 3, b + 1, 3);
    case Values::Large: return gen_pattern(t, b + 2, b + 5, f.mant);
    case Values::Subnormal: return gen_pattern(t, 0, 0, f.mant);
    case Values::Adjacent: return gen_pattern(t, b - 3, b + 1, f.mant);  // per tensor: gen_float_tensor
    case Values::Mixed:
      return gen::weightedOneOf<std::uint64_t>({
          {4, gen_pattern(t, b - 3, b + 1, f.mant)},
          {2, gen_pattern(t, b - 3, b + 1, 3)},
          {1, gen_pattern(t, 0, 0, f.mant)},  // subnormals
          {1, gen_pattern(t, 0, 0, 0)},       // zeros of either sign
          {1, gen_pattern(t, 1, 2, f.mant)},  // the smallest normals
          {1, gen_pattern(t, b + 2, b + 5, f.mant)},
      });
  }
  throw std::logic_error("unknown value style");
}

rc::Gen<bool> percent(int p) {
  if (p <= 0) return gen::just(false);
  if (p >= 100) return gen::just(true);
  return gen::weightedElement<bool>({{static_cast<std::size_t>(100 - p), false},
                                     {static_cast<std::size_t>(p), true}});
}

// Some keys become copies of earlier keys of their block (exact ties), some of those then
// differ in the last bit of one element (near ties). Blocks of N keys of E elements.
void apply_ties(RawTensor& t, I blocks, I N, I E, int tie_percent, int near_percent) {
  if (tie_percent <= 0 || N < 2) return;
  const std::size_t es = dtype_size(t.dtype);
  for (I blk = 0; blk < blocks; ++blk)
    for (I j = 1; j < N; ++j) {
      if (!*percent(tie_percent)) continue;
      const I src = *uniform<I>(0, j);
      std::memcpy(t.data.data() + static_cast<std::size_t>((blk * N + j) * E) * es,
                  t.data.data() + static_cast<std::size_t>((blk * N + src) * E) * es,
                  static_cast<std::size_t>(E) * es);
      if (*percent(near_percent)) {
        const I d = *uniform<I>(0, E);
        t.data[static_cast<std::size_t>((blk * N + j) * E + d) * es] ^= 1;  // last significand bit
      }
    }
}

// A size in [1, hi], uniform whatever RapidCheck's size (1 more often); shrinks towards 1.
rc::Gen<I> gen_size(I hi) { return uniform<I>(1, hi + 1); }
I dim(int hi) { return *gen::weightedOneOf<I>({{1, gen::just<I>(1)}, {4, gen_size(hi)}}); }

std::vector<I> divisors(I n) {
  std::vector<I> d;
  for (I k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

}  // namespace

// ---- numbers ----

std::uint64_t bits_of(DType t, const unsigned char* p) {
  std::uint64_t b = 0;
  const std::size_t n = dtype_size(t);
  for (std::size_t k = 0; k < n; ++k) b |= static_cast<std::uint64_t>(p[k]) << (8 * k);
  return b;
}

void store_bits(DType t, std::uint64_t bits, unsigned char* p) {
  const std::size_t n = dtype_size(t);
  for (std::size_t k = 0; k < n; ++k) p[k] = static_cast<unsigned char>(bits >> (8 * k));
}

double decode(DType t, std::uint64_t bits) {
  if (t == DType::F64) {
    double d;
    std::memcpy(&d, &bits, 8);
    return d;
  }
  if (t == DType::F32) {
    const auto u = static_cast<std::uint32_t>(bits);
    float x;
    std::memcpy(&x, &u, 4);
    return static_cast<double>(x);
  }
  const Fmt f = fmt(t);
  const bool neg = (bits >> (f.mant + f.ebits)) & 1;
  const auto e = static_cast<int>((bits >> f.mant) & ((1u << f.ebits) - 1));
  const std::uint64_t m = bits & ((std::uint64_t{1} << f.mant) - 1);
  double v;
  if (e == (1 << f.ebits) - 1)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), f.emin() - f.mant);
  else
    v = std::ldexp(static_cast<double>(m | (std::uint64_t{1} << f.mant)), e - f.bias() - f.mant);
  return neg ? -v : v;
}

std::uint64_t encode(DType t, double x) {
  if (t == DType::F64) {
    std::uint64_t b;
    std::memcpy(&b, &x, 8);
    return b;
  }
  if (t == DType::F32) {
    const auto f = static_cast<float>(x);
    if (static_cast<double>(f) != x && !std::isnan(x)) throw std::logic_error("not an F32 value");
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  }
  const Fmt f = fmt(t);
  std::uint64_t bits = (std::signbit(x) ? std::uint64_t{1} : 0) << (f.mant + f.ebits);
  const std::uint64_t all_ones = (std::uint64_t{1} << f.ebits) - 1;
  if (std::isnan(x)) return bits | (all_ones << f.mant) | 1;
  if (std::isinf(x)) return bits | (all_ones << f.mant);
  const double a = std::fabs(x);
  if (a == 0) return bits;
  const int e = std::max(std::ilogb(a), f.emin());
  const double n = std::ldexp(a, f.mant - e);  // the significand as an integer (subnormal: < 2^mant)
  if (n != std::floor(n) || e > f.bias()) throw std::logic_error("not a value of " + dtype_text(t));
  const auto ni = static_cast<std::uint64_t>(n);
  if (ni < (std::uint64_t{1} << f.mant)) return bits | ni;  // subnormal
  return bits | (static_cast<std::uint64_t>(e + f.bias()) << f.mant) | (ni - (std::uint64_t{1} << f.mant));
}

double round_to(DType t, double x) {
  if (t == DType::F64 || x == 0 || !std::isfinite(x)) return x;
  const Fmt f = fmt(t);
  const double a = std::fabs(x);
  const int q = std::max(std::ilogb(a), f.emin()) - (f.precision() - 1);  // exponent of the quantum
  const double s = std::ldexp(a, -q);  // exact; s < 2^precision
  double n = std::floor(s);
  const double frac = s - n;  // exact
  if (frac > 0.5 || (frac == 0.5 && std::fmod(n, 2.0) != 0)) n += 1;
  double r = std::ldexp(n, q);
  const double max_finite = std::ldexp(std::ldexp(1.0, f.precision()) - 1, f.bias() - (f.precision() - 1));
  if (r > max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

double spacing(DType t, double x) {
  const Fmt f = fmt(t);
  const double a = std::fabs(x);
  const int e = a == 0 ? f.emin() : std::max(std::ilogb(a), f.emin());
  return std::ldexp(1.0, e - (f.precision() - 1));
}

std::vector<double> decode_all(const RawTensor& t) {
  const std::size_t es = dtype_size(t.dtype);
  std::vector<double> v(t.data.size() / es);
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = decode(t.dtype, bits_of(t.dtype, t.data.data() + k * es));
  return v;
}

// ---- byte-level tensor twins ----

namespace {
I stride_of(const std::vector<I>& shape, std::size_t axis) {
  I s = 1;
  for (std::size_t a = axis + 1; a < shape.size(); ++a) s *= shape[a];
  return s;
}
}  // namespace

RawTensor permute_axis(const RawTensor& src, std::size_t axis, const std::vector<I>& perm) {
  RawTensor dst = src;
  const std::size_t es = dtype_size(src.dtype);
  const I stride = stride_of(src.shape, axis), n = numel(src.shape), d = src.shape.at(axis);
  for (I flat = 0; flat < n; ++flat) {
    const I j = (flat / stride) % d;
    const I to = flat + (perm[static_cast<std::size_t>(j)] - j) * stride;
    std::memcpy(dst.data.data() + static_cast<std::size_t>(to) * es,
                src.data.data() + static_cast<std::size_t>(flat) * es, es);
  }
  return dst;
}

void splice_axis(RawTensor& dst, const RawTensor& src, std::size_t axis, I from, I to) {
  const std::size_t es = dtype_size(src.dtype);
  const I stride = stride_of(src.shape, axis), n = numel(src.shape), d = src.shape.at(axis);
  for (I flat = 0; flat < n; ++flat) {
    const I j = (flat / stride) % d;
    if (j >= from && j < to)
      std::memcpy(dst.data.data() + static_cast<std::size_t>(flat) * es,
                  src.data.data() + static_cast<std::size_t>(flat) * es, es);
  }
}

RawTensor repeat_axis0(const RawTensor& t) {
  RawTensor r = t;
  r.shape.at(0) *= 2;
  r.data.insert(r.data.end(), t.data.begin(), t.data.end());
  return r;
}

// ---- generators ----

rc::Gen<RawTensor> gen_float_tensor(const std::string& name, DType dtype, std::vector<I> shape,
                                    Values style) {
  const auto n = static_cast<std::size_t>(numel(shape));
  rc::Gen<std::vector<std::uint64_t>> elements =
      gen::container<std::vector<std::uint64_t>>(n, gen_bits(dtype, style));
  if (style == Values::Adjacent) {  // x or the next value up; x normal, so x + 1 ulp is finite
    const Fmt f = fmt(dtype);
    elements = gen::map(gen::tuple(gen_pattern(dtype, f.bias() - 3, f.bias() + 1, f.mant),
                                   gen::container<std::vector<int>>(n, gen::element(0, 1))),
                        [](const std::tuple<std::uint64_t, std::vector<int>>& x) {
                          std::vector<std::uint64_t> bits;
                          for (int up : std::get<1>(x)) bits.push_back(std::get<0>(x) + static_cast<std::uint64_t>(up));
                          return bits;
                        });
  }
  return gen::map(std::move(elements), [name, dtype, shape](const std::vector<std::uint64_t>& bits) {
                    RawTensor t{name, dtype, shape, {}};
                    const std::size_t es = dtype_size(dtype);
                    t.data.resize(bits.size() * es);
                    for (std::size_t k = 0; k < bits.size(); ++k) store_bits(dtype, bits[k], t.data.data() + k * es);
                    return t;
                  });
}

rc::Gen<Spec> gen_spec() {
  return gen::exec([] {
    Spec s;
    s.kind = *gen::weightedElement<Kind>({{3, Kind::Sdpa}, {1, Kind::Mha}});
    s.input = *gen::element(DType::F32, DType::F64, DType::F16, DType::BF16);
    if (*percent(35)) s.output = *gen::element(DType::F64, DType::F32, DType::F16, DType::BF16);
    // F64 scores equal up to products of subnormals, values a rounding step apart: outputs
    // within far less than 2^-2048 of a rounding midpoint, which Ziv's test cannot settle
    const bool undecidable = *percent(5);
    if (undecidable) {
      s.input = DType::F64;
      s.output.reset();
    }
    s.B = *gen_size(2);
    if (s.kind == Kind::Sdpa) {
      s.Hq = *gen_size(4);
      s.Hkv = *gen::elementOf(divisors(s.Hq));
    } else {
      s.Hq = s.Hkv = *gen_size(4);
      s.D = dim(8);
      s.Dout = dim(8);
    }
    s.Nq = dim(12);
    s.Nk = dim(12);
    s.Dk = dim(8);
    s.Dv = dim(8);

    s.scale = *gen::weightedElement<std::string>(
        {{8, ""}, {1, "1"}, {1, "0.125"}, {1, "0x1p-4"}, {1, "0.1"}, {1, "-0.5"}, {1, "2"},
         {1, "0x1.6a09e667f3bcdp-3"}, {1, "1e-3"}, {1, "16"}});
    s.softcap = *gen::weightedElement<std::string>(
        {{8, ""}, {1, "0"}, {1, "2.5"}, {1, "0x1p+4"}, {1, "30"}, {1, "0.5"}, {1, "1e4"}});
    s.causal = *gen::weightedElement<std::string>({{3, ""}, {1, "none"}, {2, "top_left"}, {2, "bottom_right"}});
    const int w = *gen::weightedElement<int>({{4, 0}, {1, 1}, {3, 2}});
    if (w == 1) s.window = "none";
    if (w == 2) s.window = std::to_string(*gen_size(13) - 1) + "," + std::to_string(*gen_size(13) - 1);
    s.masked_rows = *gen::weightedElement<std::string>({{3, ""}, {2, "error"}, {4, "zero"}});
    if (*percent(70)) {
      std::vector<std::string> names;
      if (*percent(85)) names.push_back("out");
      if (*percent(60)) names.push_back("weights");
      if (*percent(60)) names.push_back("lse");
      if (names.empty()) names.push_back("out");
      std::rotate(names.begin(), names.begin() + *uniform<std::size_t>(0, names.size()), names.end());
      for (std::size_t k = 0; k < names.size(); ++k) s.outputs += (k ? "," : "") + names[k];
    }

    s.mask_rank = *gen::weightedElement<int>({{3, 0}, {1, 1}, {2, 2}, {1, 3}, {2, 4}});
    s.mask_b_full = *gen::element(false, true);
    s.mask_h_full = *gen::element(false, true);
    s.mask_q_full = *gen::weightedElement<bool>({{3, true}, {1, false}});  // [B,1,1,Nk] among them
    s.mask_k_full = *gen::weightedElement<bool>({{5, true}, {1, false}});
    s.mask_values = *gen::weightedElement<MaskValues>(
        {{1, MaskValues::AllTrue}, {4, MaskValues::Dense}, {2, MaskValues::Sparse}, {2, MaskValues::OneHot}});
    s.bias_rank = *gen::weightedElement<int>({{3, 0}, {1, 1}, {1, 2}, {1, 3}, {1, 4}});
    for (auto& x : s.bias_full) x = *gen::element(false, true);
    s.bias_dtype = *gen::element(DType::F64, DType::F32, s.input);
    s.bias_values = *gen::weightedElement<BiasValues>(
        {{3, BiasValues::Dyadic}, {2, BiasValues::Random}, {1, BiasValues::Large}});
    s.bias_neg_inf_percent = *gen::element(0, 10, 30);
    s.query_mask = *percent(25);
    s.padding_percent = *gen::element(25, 50);

    const auto qk = gen::weightedElement<Values>({{4, Values::Normal}, {2, Values::Dyadic}, {2, Values::Large},
                                                  {1, Values::Subnormal}, {2, Values::Mixed}});
    const auto vs = gen::weightedElement<Values>({{4, Values::Normal}, {2, Values::Dyadic}, {1, Values::Large},
                                                  {1, Values::Subnormal}, {2, Values::Mixed}, {1, Values::Adjacent}});
    const auto xw = gen::weightedElement<Values>(
        {{4, Values::Normal}, {2, Values::Dyadic}, {1, Values::Subnormal}, {2, Values::Mixed}});
    s.q_values = *qk;
    s.k_values = *qk;
    s.v_values = *vs;
    s.x_values = *xw;
    s.w_values = *xw;
    if (undecidable) {
      s.q_values = s.k_values = Values::Subnormal;
      s.v_values = Values::Adjacent;
    }
    s.tie_percent = *gen::element(0, 0, 30, 60);
    s.near_tie_percent = *gen::element(0, 50, 100);
    return s;
  });
}

std::map<std::string, std::string> metadata_of(const Spec& s) {
  std::map<std::string, std::string> md;
  md["attn.format"] = "1";
  if (s.kind == Kind::Mha) md["attn.kind"] = "mha";
  if (s.output) md["attn.output_dtype"] = dtype_text(*s.output);
  if (!s.scale.empty()) md["attn.scale"] = s.scale;
  if (!s.softcap.empty()) md["attn.softcap"] = s.softcap;
  if (!s.causal.empty()) md["attn.causal"] = s.causal;
  if (!s.window.empty()) md["attn.window"] = s.window;
  if (!s.masked_rows.empty()) md["attn.masked_rows"] = s.masked_rows;
  if (!s.outputs.empty()) md["attn.outputs"] = s.outputs;
  return md;
}

rc::Gen<SafeTensorsFile> gen_file(const Spec& spec) {
  return gen::exec([s = spec] {
    SafeTensorsFile f;
    f.metadata = metadata_of(s);
    if (s.kind == Kind::Sdpa) {
      f.put(*gen_float_tensor("q", s.input, {s.B, s.Hq, s.Nq, s.Dk}, s.q_values));
      RawTensor k = *gen_float_tensor("k", s.input, {s.B, s.Hkv, s.Nk, s.Dk}, s.k_values);
      apply_ties(k, s.B * s.Hkv, s.Nk, s.Dk, s.tie_percent, s.near_tie_percent);
      f.put(std::move(k));
      f.put(*gen_float_tensor("v", s.input, {s.B, s.Hkv, s.Nk, s.Dv}, s.v_values));
    } else {
      const I H = s.Hq;
      f.put(*gen_float_tensor("x_q", s.input, {s.B, s.Nq, s.D}, s.x_values));
      RawTensor x = *gen_float_tensor("x_kv", s.input, {s.B, s.Nk, s.D}, s.x_values);
      apply_ties(x, s.B, s.Nk, s.D, s.tie_percent, s.near_tie_percent);
      f.put(std::move(x));
      f.put(*gen_float_tensor("w_q", s.input, {H, s.D, s.Dk}, s.w_values));
      f.put(*gen_float_tensor("w_k", s.input, {H, s.D, s.Dk}, s.w_values));
      f.put(*gen_float_tensor("w_v", s.input, {H, s.D, s.Dv}, s.w_values));
      f.put(*gen_float_tensor("w_o", s.input, {H * s.Dv, s.Dout}, s.w_values));
    }

    if (s.mask_rank >= 1) {
      const std::array<I, 4> full = {s.B, s.Hq, s.Nq, s.Nk};
      const std::array<bool, 4> is_full = {s.mask_b_full, s.mask_h_full, s.mask_q_full, s.mask_k_full};
      std::vector<I> shape;
      for (std::size_t d = 4 - static_cast<std::size_t>(s.mask_rank); d < 4; ++d)
        shape.push_back(is_full[d] ? full[d] : 1);
      RawTensor m{"mask", DType::BOOL, shape, {}};
      const I len = shape.back(), rows = numel(shape) / len;
      for (I r = 0; r < rows; ++r) {
        const I one = s.mask_values == MaskValues::OneHot ? *uniform<I>(0, len) : -1;
        for (I j = 0; j < len; ++j) {
          bool on = true;
          if (s.mask_values == MaskValues::OneHot) on = j == one;
          if (s.mask_values == MaskValues::Dense) on = !*percent(15);
          if (s.mask_values == MaskValues::Sparse) on = *percent(35);
          m.data.push_back(on ? 1 : 0);
        }
      }
      f.put(std::move(m));
    }

    if (s.bias_rank >= 1) {
      const std::array<I, 4> full = {s.B, s.Hq, s.Nq, s.Nk};
      std::vector<I> shape;
      for (std::size_t d = 4 - static_cast<std::size_t>(s.bias_rank); d < 4; ++d)
        shape.push_back(s.bias_full[d] ? full[d] : 1);
      const I n = numel(shape);
      RawTensor b{"bias", s.bias_dtype, shape, {}};
      const std::size_t es = dtype_size(s.bias_dtype);
      b.data.resize(static_cast<std::size_t>(n) * es);
      for (I e = 0; e < n; ++e) {
        std::uint64_t bits;
        if (*percent(s.bias_neg_inf_percent)) {
          bits = encode(s.bias_dtype, -std::numeric_limits<double>::infinity());
        } else if (s.bias_values == BiasValues::Random) {
          bits = *gen_bits(s.bias_dtype, Values::Normal);
        } else {
          const double sign = *gen::element(1.0, -1.0);
          const double x = s.bias_values == BiasValues::Dyadic
                               ? static_cast<double>(*uniform(0, 33)) / 8
                               : static_cast<double>(*uniform(1, 16)) * 1024;
          bits = encode(s.bias_dtype, sign * x);
        }
        store_bits(s.bias_dtype, bits, b.data.data() + static_cast<std::size_t>(e) * es);
      }
      f.put(std::move(b));
    }

    if (s.query_mask) {
      RawTensor qm{"query_mask", DType::BOOL, {s.B, s.Nq}, {}};
      for (I e = 0; e < s.B * s.Nq; ++e) qm.data.push_back(*percent(s.padding_percent) ? 0 : 1);
      f.put(std::move(qm));
    }
    return f;
  });
}

rc::Gen<SafeTensorsFile> gen_case() {
  return gen::mapcat(gen_spec(), [](const Spec& s) { return gen_file(s); });
}

// ---- reading ----

namespace {
std::size_t broadcast_index(const std::vector<I>& shape, const std::array<I, 4>& index) {
  const std::size_t r = shape.size();
  I flat = 0;
  for (std::size_t a = 0; a < r; ++a) flat = flat * shape[a] + (shape[a] == 1 ? 0 : index[4 - r + a]);
  return static_cast<std::size_t>(flat);
}

const RawTensor& need(const SafeTensorsFile& f, const char* name) {
  const RawTensor* t = f.find(name);
  if (!t) throw std::logic_error(std::string("the case has no tensor ") + name);
  return *t;
}
}  // namespace

bool Reading::positional(I i, I j) const {
  const I ip = causal == Causal::BottomRight ? i + (Nk - Nq) : i;
  if (causal != Causal::None && j > ip) return false;
  if (window && (j < ip - L || j > ip + R)) return false;
  return true;
}

double Reading::bias_value(I b, I h, I i, I j) const {
  return bias.empty() ? 0.0 : bias[broadcast_index(bias_shape, {b, h, i, j})];
}

bool Reading::allowed(I b, I h, I i, I j) const {
  if (!positional(i, j)) return false;
  if (!mask.empty() && !mask[broadcast_index(mask_shape, {b, h, i, j})]) return false;
  return bias_value(b, h, i, j) != -std::numeric_limits<double>::infinity();
}

bool Reading::has_key(I b, I h, I i) const {
  for (I j = 0; j < Nk; ++j)
    if (allowed(b, h, i, j)) return true;
  return false;
}

bool Reading::query_valid(I b, I i) const {
  return query_mask.empty() || query_mask[static_cast<std::size_t>(b * Nq + i)] != 0;
}

std::optional<std::array<I, 3>> Reading::first_refused() const {
  if (policy != MaskedRows::Error) return std::nullopt;
  for (I b = 0; b < B; ++b)
    for (I h = 0; h < Hq; ++h)
      for (I i = 0; i < Nq; ++i)
        if (query_valid(b, i) && !has_key(b, h, i)) return std::array<I, 3>{b, h, i};
  return std::nullopt;
}

Reading read(const SafeTensorsFile& f) {
  Reading r;
  auto md = [&](const char* key, const std::string& dflt) {
    auto it = f.metadata.find(key);
    return it == f.metadata.end() ? dflt : it->second;
  };
  r.kind = md("attn.kind", "sdpa") == "mha" ? Kind::Mha : Kind::Sdpa;
  const std::string causal = md("attn.causal", "none");
  r.causal = causal == "top_left" ? Causal::TopLeft : causal == "bottom_right" ? Causal::BottomRight : Causal::None;
  const std::string window = md("attn.window", "none");
  if (window != "none") {
    const auto comma = window.find(',');
    r.window = true;
    r.L = std::stoll(window.substr(0, comma));
    r.R = std::stoll(window.substr(comma + 1));
  }
  r.policy = md("attn.masked_rows", "error") == "zero" ? MaskedRows::Zero : MaskedRows::Error;
  const std::string outputs = "," + md("attn.outputs", "out") + ",";
  r.want_weights = outputs.find(",weights,") != std::string::npos;
  r.want_lse = outputs.find(",lse,") != std::string::npos;
  if (r.kind == Kind::Sdpa) {
    const RawTensor &q = need(f, "q"), &k = need(f, "k"), &v = need(f, "v");
    r.input = q.dtype;
    r.B = q.shape[0], r.Hq = q.shape[1], r.Nq = q.shape[2], r.Dk = q.shape[3];
    r.Hkv = k.shape[1], r.Nk = k.shape[2], r.Dv = v.shape[3];
    r.v = decode_all(v);
  } else {
    const RawTensor &xq = need(f, "x_q"), &xkv = need(f, "x_kv"), &wq = need(f, "w_q"),
                    &wv = need(f, "w_v"), &wo = need(f, "w_o");
    r.input = xq.dtype;
    r.B = xq.shape[0], r.Nq = xq.shape[1], r.D = xq.shape[2], r.Nk = xkv.shape[1];
    r.Hq = r.Hkv = wq.shape[0], r.Dk = wq.shape[2], r.Dv = wv.shape[2], r.Dout = wo.shape[1];
  }
  const auto odt = dtype_of_text(md("attn.output_dtype", ""));
  r.output = odt ? *odt : r.input;
  if (const RawTensor* m = f.find("mask")) {
    r.mask_shape = m->shape;
    r.mask = m->data;
  }
  if (const RawTensor* b = f.find("bias")) {
    r.bias_shape = b->shape;
    r.bias = decode_all(*b);
  }
  if (const RawTensor* qm = f.find("query_mask")) r.query_mask = qm->data;
  return r;
}

// ---- showing ----

std::string summary(const SafeTensorsFile& f) {
  std::string s;
  for (const auto& [k, v] : f.metadata) s += k + "=" + v + " ";
  for (const auto& t : f.tensors) s += t.name + ":" + dtype_text(t.dtype) + shape_text(t.shape) + " ";
  if (!s.empty()) s.pop_back();
  return s;
}

std::string describe(const SafeTensorsFile& f, std::size_t max_elements) {
  std::ostringstream os;
  os << summary(f) << "\n";
  for (const auto& t : f.tensors) {
    os << "  " << t.name << " " << dtype_text(t.dtype) << shape_text(t.shape) << " = {";
    const std::size_t es = dtype_size(t.dtype);
    const std::size_t n = t.data.size() / es;
    for (std::size_t k = 0; k < n && k < max_elements; ++k) {
      if (k) os << ", ";
      if (t.dtype == DType::BOOL)
        os << int(t.data[k]);
      else if (t.dtype == DType::I64)
        os << static_cast<std::int64_t>(bits_of(DType::I64, t.data.data() + k * 8));
      else if (is_float_format(t.dtype))
        os << hex(decode(t.dtype, bits_of(t.dtype, t.data.data() + k * es)));
      else
        os << "?";
    }
    if (n > max_elements) os << ", ... (" << n << " elements)";
    os << "}\n";
  }
  return os.str();
}

std::string summary(const Spec& s) {
  SafeTensorsFile f;
  f.metadata = metadata_of(s);
  std::ostringstream os;
  os << summary(f) << " B=" << s.B << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " Nq=" << s.Nq
     << " Nk=" << s.Nk << " Dk=" << s.Dk << " Dv=" << s.Dv;
  if (s.kind == Kind::Mha) os << " D=" << s.D << " Dout=" << s.Dout;
  os << " input=" << dtype_text(s.input) << " mask_rank=" << s.mask_rank << " mask_full=" << s.mask_b_full << s.mask_h_full
     << s.mask_q_full << s.mask_k_full << " bias_rank=" << s.bias_rank
     << " bias_dtype=" << dtype_text(s.bias_dtype) << " query_mask=" << s.query_mask
     << " ties=" << s.tie_percent << "%/" << s.near_tie_percent << "%";
  static const char* const names[] = {"normal", "dyadic", "large", "subnormal", "mixed", "adjacent"};
  auto name = [](Values v) { return names[static_cast<int>(v)]; };
  if (s.kind == Kind::Sdpa)
    os << " values q=" << name(s.q_values) << " k=" << name(s.k_values) << " v=" << name(s.v_values);
  else
    os << " values x=" << name(s.x_values) << " w=" << name(s.w_values);
  return os.str();
}

void showValue(const Spec& s, std::ostream& os) { os << summary(s); }

}  // namespace attnoracle::testing

namespace attnoracle {
void showValue(const SafeTensorsFile& f, std::ostream& os) { os << testing::describe(f, 256); }
void showValue(const RawTensor& t, std::ostream& os) {
  SafeTensorsFile f;
  f.tensors.push_back(t);
  os << testing::describe(f, 256);
}
}  // namespace attnoracle
