#include "random_case.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <stdexcept>

#include "attnoracle/reference/case_file.hpp"
#include "int_round.hpp"

namespace attnoracle::testing {
namespace {

using Shape = std::vector<std::int64_t>;

// splitmix64 and integer-derived doubles only: no libm and no std distributions, so that a seed
// gives the same problem everywhere.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed ^ 0x5DEECE66DULL) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }  // [0, 1)
  double uniform(double a, double b) { return a + (b - a) * uniform(); }
  std::int64_t range(std::int64_t lo, std::int64_t hi) {  // inclusive
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  int irange(int lo, int hi) { return static_cast<int>(range(lo, hi)); }
  bool chance(double p) { return uniform() < p; }
  double normal() {  // Irwin-Hall: sum of 12 uniforms - 6, mean 0, variance 1
    double s = 0;
    for (int k = 0; k < 12; ++k) s += uniform();
    return s - 6;
  }
  double sign() { return (next() & 1) ? -1.0 : 1.0; }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    if (v.empty()) throw std::invalid_argument("random_case: empty choice list");
    return v[next() % v.size()];
  }

 private:
  std::uint64_t s_;
};

double max_finite(DType t) {
  if (t == DType::F8_E4M3) return 448;  // E4M3FN: its top binade is normal but for NaN
  const BinaryFormat f = binary_format(t);
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  return std::ldexp(2.0 - std::ldexp(1.0, 1 - f.precision), bias);
}
int min_normal_exponent(DType t) { return 2 - (1 << (binary_format(t).exponent_bits - 1)); }

// x rounded to nearest into t (clamped to the finite range first): exactly representable.
double fit(double x, DType t) {
  const double m = max_finite(t);
  x = std::clamp(x, -m, m);
  return bits_to_double(round_double(x, t), t);
}

// A nonzero subnormal of t with random significand and sign.
double random_subnormal(Rng& rng, DType t) {
  const int p = binary_format(t).precision;
  const auto top = (std::uint64_t{1} << (p - 1)) - 1;
  const auto frac = 1 + rng.next() % top;
  return rng.sign() * std::ldexp(static_cast<double>(frac), min_normal_exponent(t) - (p - 1));
}

// sign * [1, 2) * 2^k, k uniform in [kmin, kmax]
double spread(Rng& rng, int kmin, int kmax) {
  return rng.sign() * std::ldexp(1 + rng.uniform(), rng.irange(kmin, kmax));
}

enum class Role { Score, Value, Input };

struct Problem {
  bool mha = false;
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1, D = 1, Dout = 1;
  bool self_attention = false;
  DType in = DType::F32, out = DType::F32;
  DataFamily family = DataFamily::Uniform;
};

// Draws the elements of one input tensor for the problem's family (before structure).
class ValueGen {
 public:
  ValueGen(Rng& rng, const Problem& p) : rng_(rng), p_(p) {
    amp_ = rng.pick(std::vector<double>{1.0, 0.5, 4.0, 1.0});
    // scores of magnitude ~T: each of Dk (x D for mha) products about a^2 / 3
    const double target = std::ldexp(1 + rng.uniform(), rng.irange(6, 13));
    const double terms = static_cast<double>(p.mha ? p.Dk * p.D * p.D : p.Dk);
    large_ = std::sqrt(3 * target / std::sqrt(terms));
    if (p.mha) large_ = std::sqrt(large_);  // x and w both scaled
    large_ = std::min(large_, 200.0);       // stays well inside F16's range
  }

  double draw(Role role) {
    const DType t = p_.in;
    switch (p_.family) {
      case DataFamily::Uniform: return fit(rng_.uniform(-amp_, amp_), t);
      case DataFamily::Normal: return fit(amp_ * rng_.normal(), t);
      case DataFamily::LargeScores:
        return fit(role == Role::Value ? rng_.uniform(-1, 1) : rng_.uniform(-large_, large_), t);
      case DataFamily::Ties:
        if (role == Role::Value && rng_.chance(0.5))
          return static_cast<double>(rng_.irange(-8, 8)) / 4;  // exact in every format
        return fit(rng_.uniform(-1, 1), t);
      case DataFamily::Subnormal: {
        if (rng_.chance(0.5)) return random_subnormal(rng_, t);
        if (role == Role::Value && rng_.chance(0.6)) return fit(random_subnormal(rng_, p_.out), t);
        return fit(rng_.uniform(-1, 1), t);
      }
      case DataFamily::WideRange: {
        if (t == DType::F8_E4M3) return fit(spread(rng_, role == Role::Value ? -9 : -6, 8), t);
        if (t == DType::F8_E5M2) return fit(spread(rng_, role == Role::Value ? -16 : -10, 15), t);
        if (role != Role::Value) return fit(spread(rng_, t == DType::F16 ? -14 : -20, 4), t);
        switch (t) {
          case DType::F16: return fit(spread(rng_, -24, 15), t);
          case DType::F64: return fit(spread(rng_, p_.mha ? -60 : -200, p_.mha ? 60 : 200), t);
          default: return fit(spread(rng_, -60, 60), t);
        }
      }
      case DataFamily::Cancel:
        if (role != Role::Value) return fit(rng_.uniform(-1, 1), t);
        return fit(rng_.uniform(-1, 1) * std::ldexp(1.0, rng_.irange(0, 10)), t);
    }
    return 0;
  }

  std::vector<double> tensor(std::int64_t n, Role role) {
    std::vector<double> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = draw(role);
    return v;
  }

 private:
  Rng& rng_;
  const Problem& p_;
  double amp_ = 1, large_ = 1;
};

// Row-major tensor [rows, cols] views for the structural edits.
struct Rows {
  std::vector<double>& v;
  std::int64_t cols;
  double& at(std::int64_t r, std::int64_t c) { return v[static_cast<std::size_t>(r * cols + c)]; }
};

// Pairs of columns cancel in dot products: q[2t+1] = q[2t], k[2t+1] ~ -k[2t].
void cancel_columns(Rng& rng, Rows q, std::int64_t q_rows, Rows k, std::int64_t k_rows, DType t) {
  for (std::int64_t c = 0; c + 1 < q.cols; c += 2) {
    for (std::int64_t r = 0; r < q_rows; ++r) q.at(r, c + 1) = q.at(r, c);
    for (std::int64_t r = 0; r < k_rows; ++r)
      k.at(r, c + 1) = fit(-k.at(r, c) * (1 + rng.uniform(-0x1p-6, 0x1p-6)), t);
  }
}

// Pairs of rows nearly cancel: v[2m+1] = -v[2m] + small.
void cancel_rows(Rng& rng, Rows v, std::int64_t rows, DType t) {
  for (std::int64_t r = 0; r + 1 < rows; r += 2)
    for (std::int64_t c = 0; c < v.cols; ++c)
      v.at(r + 1, c) = fit(-v.at(r, c) * (1 + rng.uniform(-0x1p-8, 0x1p-8)), t);
}

// Rows of k drawn from a few distinct ones: equal keys, equal scores.
void tie_rows(Rng& rng, Rows k, std::int64_t rows) {
  const std::int64_t distinct = rng.range(1, 3);
  for (std::int64_t r = distinct; r < rows; ++r) {
    const std::int64_t from = rng.range(0, distinct - 1);
    for (std::int64_t c = 0; c < k.cols; ++c) k.at(r, c) = k.at(from, c);
  }
}

// ---- masking ----

struct Masking {
  std::optional<Shape> mask_shape;
  std::vector<unsigned char> mask;
  std::string causal = "none";
  bool window = false;
  std::int64_t left = 0, right = 0;
  std::optional<Shape> bias_shape;
  DType bias_dtype = DType::F32;
  std::vector<double> bias;
  std::optional<std::vector<unsigned char>> query_mask;  // [B, Nq]
  std::optional<Shape> seqlens_q, seqlens_k;            // [B]
  DType seqlens_dtype = DType::I32;
  std::int64_t lq(const Problem& p, std::int64_t b) const {
    return seqlens_q ? (*seqlens_q)[static_cast<std::size_t>(b)] : p.Nq;
  }
  std::int64_t lk(const Problem& p, std::int64_t b) const {
    return seqlens_k ? (*seqlens_k)[static_cast<std::size_t>(b)] : p.Nk;
  }
  bool padding(const Problem& p, std::int64_t b, std::int64_t i) const {
    return i >= lq(p, b) || (query_mask && !(*query_mask)[static_cast<std::size_t>(b * p.Nq + i)]);
  }
};

// Flat index of a tensor of `shape` broadcast (right-aligned) against [B, H, Nq, Nk].
std::size_t bcast(const Shape& shape, std::array<std::int64_t, 4> idx) {
  std::int64_t flat = 0;
  const std::size_t r = shape.size();
  for (std::size_t a = 0; a < r; ++a) flat = flat * shape[a] + (shape[a] == 1 ? 0 : idx[4 - r + a]);
  return static_cast<std::size_t>(flat);
}

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

// A broadcastable shape of rank lo..hi against full = [B, H, Nq, Nk]; trailing dims kept when
// keep_trailing, else each dim is 1 or full.
Shape broadcast_shape(Rng& rng, const std::array<std::int64_t, 4>& full, int lo,
                      bool keep_trailing) {
  const int rank = rng.irange(lo, 4);
  Shape s;
  for (int a = 4 - rank; a < 4; ++a) {
    const bool trailing = a >= 2;
    s.push_back((trailing && keep_trailing) || rng.chance(trailing ? 0.8 : 0.5) ? full[a] : 1);
  }
  return s;
}

struct RowStats {
  bool fully_masked = false;  // a non-padding row with no allowed key
  bool padding_masked = false;
};

bool allowed(const Problem& p, const Masking& m, std::int64_t b, std::int64_t h, std::int64_t i,
             std::int64_t j) {
  if (m.mask_shape && !m.mask[bcast(*m.mask_shape, {b, h, i, j})]) return false;
  if (j >= m.lk(p, b)) return false;
  const std::int64_t aligned = m.causal == "bottom_right" ? i + (m.lk(p, b) - m.lq(p, b)) : i;
  if (m.causal != "none" && j > aligned) return false;
  if (m.window && (j < aligned - m.left || j > aligned + m.right)) return false;
  if (m.bias_shape && std::isinf(m.bias[bcast(*m.bias_shape, {b, h, i, j})])) return false;
  return true;
}

bool row_masked(const Problem& p, const Masking& m, std::int64_t b, std::int64_t h,
                std::int64_t i) {
  for (std::int64_t j = 0; j < p.Nk; ++j)
    if (allowed(p, m, b, h, i, j)) return false;
  return true;
}

RowStats row_stats(const Problem& p, const Masking& m) {
  RowStats s;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Nq; ++i) {
        if (!row_masked(p, m, b, h, i)) continue;
        (m.padding(p, b, i) ? s.padding_masked : s.fully_masked) = true;
      }
  return s;
}

// Lengths of B sequences padded to n: distinct where they can be, one full (B > 1), one short.
Shape random_lengths(Rng& rng, std::int64_t B, std::int64_t n, bool decode) {
  Shape l(static_cast<std::size_t>(B));
  for (auto& x : l) x = decode && rng.chance(0.5) ? std::min<std::int64_t>(1, n) : rng.range(0, n);
  if (B > 1) {
    l[static_cast<std::size_t>(rng.range(0, B - 1))] = n;
    l[static_cast<std::size_t>(rng.range(0, B - 1))] = rng.range(0, std::min<std::int64_t>(2, n));
  }
  return l;
}

Masking random_masking(Rng& rng, const Problem& p, const RandomCaseOptions& opt, bool large_bias) {
  Masking m;
  if (opt.seqlens_fraction > 0 && rng.chance(opt.seqlens_fraction)) {
    m.seqlens_dtype = rng.chance(0.5) ? DType::I32 : DType::I64;
    const int which = rng.irange(0, 2);  // q only, k only, both
    if (which != 1) m.seqlens_q = random_lengths(rng, p.B, p.Nq, true);
    if (which != 0) m.seqlens_k = random_lengths(rng, p.B, p.Nk, false);
  }
  const std::array<std::int64_t, 4> full = {p.B, p.Hq, p.Nq, p.Nk};
  if (rng.chance(opt.mask_fraction)) {
    m.mask_shape = rng.chance(opt.key_padding_mask_fraction)
                       ? Shape{p.B, 1, 1, p.Nk}
                       : broadcast_shape(rng, full, opt.mask_min_rank, opt.mask_keeps_trailing);
    const double density = rng.pick(std::vector<double>{0.3, 0.7, 0.95, 0.95});
    m.mask.resize(static_cast<std::size_t>(numel(*m.mask_shape)));
    for (auto& x : m.mask) x = rng.chance(density) ? 1 : 0;
    if (rng.chance(0.3)) {  // every mask entry of one row false: a fully masked row
      const std::int64_t b = rng.range(0, p.B - 1), h = rng.range(0, p.Hq - 1),
                         i = rng.range(0, p.Nq - 1);
      for (std::int64_t j = 0; j < p.Nk; ++j) m.mask[bcast(*m.mask_shape, {b, h, i, j})] = 0;
    }
  }
  if (rng.chance(opt.causal_fraction)) m.causal = rng.chance(0.5) ? "top_left" : "bottom_right";
  if (rng.chance(opt.window_fraction)) {
    m.window = true;
    m.left = rng.range(0, p.Nk);
    m.right = rng.range(0, p.Nk);
  }
  if (rng.chance(opt.bias_fraction)) {
    m.bias_shape = broadcast_shape(rng, full, opt.bias_min_rank, false);
    m.bias_dtype = rng.pick(std::vector<DType>{DType::F32, DType::F64, p.in});
    if (m.bias_dtype == DType::F8_E4M3) m.bias_dtype = DType::F32;  // no -inf in E4M3
    const double minus_inf = rng.pick(std::vector<double>{0.0, 0.05, 0.3});
    const double a = large_bias ? 30 : 3;
    m.bias.resize(static_cast<std::size_t>(numel(*m.bias_shape)));
    for (auto& x : m.bias)
      x = rng.chance(minus_inf) ? -std::numeric_limits<double>::infinity()
                                : fit(rng.uniform(-a, a), m.bias_dtype);
  }
  if (rng.chance(opt.query_mask_fraction)) {
    std::vector<unsigned char> qm(static_cast<std::size_t>(p.B * p.Nq));
    for (auto& x : qm) x = rng.chance(0.75) ? 1 : 0;
    m.query_mask = qm;
    if (rng.chance(0.5)) {  // fully masked rows become padding (no refusal under policy error)
      for (std::int64_t b = 0; b < p.B; ++b)
        for (std::int64_t i = 0; i < p.Nq; ++i)
          for (std::int64_t h = 0; h < p.Hq; ++h)
            if (row_masked(p, m, b, h, i))
              (*m.query_mask)[static_cast<std::size_t>(b * p.Nq + i)] = 0;
    }
  }
  if (m.seqlens_k && rng.chance(0.5)) {  // rows with no key become padding: Lq at most Lk
    if (!m.seqlens_q) m.seqlens_q = Shape(static_cast<std::size_t>(p.B), p.Nq);
    for (std::int64_t b = 0; b < p.B; ++b) {
      auto& lq = (*m.seqlens_q)[static_cast<std::size_t>(b)];
      lq = std::min(lq, (*m.seqlens_k)[static_cast<std::size_t>(b)]);
    }
  }
  return m;
}

// ---- file assembly ----

RawTensor int_tensor(const std::string& name, DType t, const Shape& values) {
  RawTensor r;
  r.name = name;
  r.dtype = t;
  r.shape = {static_cast<std::int64_t>(values.size())};
  const std::size_t size = t == DType::I32 ? 4 : 8;
  r.data.resize(values.size() * size);
  for (std::size_t e = 0; e < values.size(); ++e) {
    const auto x = static_cast<std::uint64_t>(values[e]);
    for (std::size_t byte = 0; byte < size; ++byte)  // little-endian
      r.data[e * size + byte] = static_cast<unsigned char>(x >> (8 * byte));
  }
  return r;
}

// The bits of a NaN (quiet) or an infinity in t.
std::uint64_t bad_bits(double x, DType t) {
  if (!std::isnan(x)) return round_double(x, t);
  const BinaryFormat f = binary_format(t);
  return ((std::uint64_t{1} << f.exponent_bits) - 1) << (f.precision - 1) |
         std::uint64_t{1} << (f.precision - 2);
}

// Non-finite values at the unused positions of an sdpa case (CONTRACT section 1): q rows of
// padding queries, k and v rows of keys that no compared query of a head reading them attends.
// Some rows are poisoned, or all; returns the count of elements set.
std::size_t poison(Rng& rng, const Problem& p, const Masking& m, SafeTensorsFile& f) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> bad = {std::numeric_limits<double>::quiet_NaN(), inf, -inf};
  const bool all = rng.chance(0.5);
  std::size_t n = 0;
  auto fill = [&](const char* name, std::int64_t row, std::int64_t width) {
    if (!all && !rng.chance(0.5)) return;
    RawTensor& t = *f.find(name);
    const auto size = static_cast<std::size_t>(format_width(t.dtype) / 8);
    for (std::int64_t e = row * width; e < (row + 1) * width; ++e, ++n)
      store_bits(bad_bits(rng.pick(bad), t.dtype), t.dtype,
                 t.data.data() + static_cast<std::size_t>(e) * size);
  };
  const std::int64_t group = p.Hq / p.Hkv;
  for (std::int64_t b = 0; b < p.B; ++b) {
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Nq; ++i)
        if (m.padding(p, b, i)) fill("q", (b * p.Hq + h) * p.Nq + i, p.Dk);
    for (std::int64_t g = 0; g < p.Hkv; ++g)
      for (std::int64_t j = 0; j < p.Nk; ++j) {
        bool used = false;
        for (std::int64_t h = g * group; h < (g + 1) * group && !used; ++h)
          for (std::int64_t i = 0; i < p.Nq && !used; ++i)
            used = !m.padding(p, b, i) && allowed(p, m, b, h, i, j);
        if (used) continue;
        fill("k", (b * p.Hkv + g) * p.Nk + j, p.Dk);
        fill("v", (b * p.Hkv + g) * p.Nk + j, p.Dv);
      }
  }
  return n;
}

RawTensor bool_tensor(const std::string& name, Shape shape, std::vector<unsigned char> values) {
  RawTensor r;
  r.name = name;
  r.dtype = DType::BOOL;
  r.shape = std::move(shape);
  r.data = std::move(values);
  return r;
}

std::string hex_float(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

}  // namespace

RawTensor float_tensor(const std::string& name, DType t, Shape shape,
                       const std::vector<double>& values) {
  RawTensor r;
  r.name = name;
  r.dtype = t;
  r.shape = std::move(shape);
  const auto size = static_cast<std::size_t>(format_width(t) / 8);
  r.data.resize(values.size() * size);
  for (std::size_t e = 0; e < values.size(); ++e) {
    const std::uint64_t bits = round_double(values[e], t);
    if (bits_to_double(bits, t) != values[e] && !std::isnan(values[e]))
      throw std::logic_error("random_case: " + name + " element not representable");
    store_bits(bits, t, r.data.data() + e * size);
  }
  return r;
}

constexpr std::pair<DataFamily, std::string_view> kFamilyNames[] = {
    {DataFamily::Uniform, "uniform"},     {DataFamily::Normal, "normal"},
    {DataFamily::LargeScores, "large_scores"}, {DataFamily::Ties, "ties"},
    {DataFamily::Subnormal, "subnormal"}, {DataFamily::WideRange, "wide_range"},
    {DataFamily::Cancel, "cancel"}};

std::string_view family_name(DataFamily f) { return table_name(kFamilyNames, f); }

SafeTensorsFile random_case(std::uint64_t seed, const RandomCaseOptions& opt,
                            RandomCaseInfo* info) {
  Rng rng(seed);
  Problem p;
  p.mha = rng.chance(opt.mha_fraction);
  const bool large = rng.chance(opt.large_fraction);
  const int max_seq = large ? opt.max_seq : std::min(opt.small_seq, opt.max_seq);
  const int max_dim = large ? opt.max_dim : std::min(opt.small_dim, opt.max_dim);
  auto length = [&](int hi) -> std::int64_t {
    if (rng.chance(0.1)) return 1;
    if (large && rng.chance(0.5)) return rng.range(std::max(1, hi / 2), hi);
    return rng.range(1, hi);
  };
  p.Nq = length(max_seq);
  p.Nk = rng.chance(0.3) ? p.Nq : length(max_seq);
  p.B = large ? 1 : rng.range(1, opt.max_batch);
  if (p.mha) {
    p.Hq = p.Hkv = rng.range(1, std::min(3, std::max(1, large ? 2 : opt.max_heads)));
    p.self_attention = rng.chance(0.5);
    if (p.self_attention) p.Nk = p.Nq;
    p.D = length(max_dim);
    p.Dk = length(std::max(1, max_dim / 2));
    p.Dv = length(std::max(1, max_dim / 2));
    p.Dout = length(max_dim);
  } else {
    const int heads = std::max(1, large ? std::min(2, opt.max_heads) : opt.max_heads);
    p.Hkv = rng.range(1, std::min(2, heads));
    p.Hq = p.Hkv * rng.range(1, std::max<std::int64_t>(1, heads / p.Hkv));
    p.Dk = length(max_dim);
    p.Dv = length(max_dim);
  }
  p.in = rng.pick(opt.input_dtypes);
  p.out = rng.chance(opt.other_output_fraction) ? rng.pick(opt.output_dtypes) : p.in;
  if (is_fp8(p.in)) {
    if (p.mha) throw std::invalid_argument("random_case: FP8 inputs are for kind sdpa only");
    // an output dtype is required, F32, F16 or BF16
    p.out = rng.pick(std::vector<DType>{DType::F32, DType::F16, DType::BF16});
  }
  p.family = rng.pick(opt.families);

  // ---- inputs ----
  SafeTensorsFile f;
  ValueGen gen(rng, p);
  if (!p.mha) {
    auto q = gen.tensor(p.B * p.Hq * p.Nq * p.Dk, Role::Score);
    auto k = gen.tensor(p.B * p.Hkv * p.Nk * p.Dk, Role::Score);
    auto v = gen.tensor(p.B * p.Hkv * p.Nk * p.Dv, Role::Value);
    if (p.family == DataFamily::Ties) {
      if (rng.chance(0.3)) std::fill(q.begin(), q.end(), 0.0);
      for (std::int64_t g = 0; g < p.B * p.Hkv; ++g) {
        std::vector<double> rows(k.begin() + g * p.Nk * p.Dk, k.begin() + (g + 1) * p.Nk * p.Dk);
        tie_rows(rng, Rows{rows, p.Dk}, p.Nk);
        std::copy(rows.begin(), rows.end(), k.begin() + g * p.Nk * p.Dk);
      }
    } else if (p.family == DataFamily::Cancel) {
      cancel_columns(rng, Rows{q, p.Dk}, p.B * p.Hq * p.Nq, Rows{k, p.Dk}, p.B * p.Hkv * p.Nk,
                     p.in);
      if (rng.chance(0.7)) cancel_rows(rng, Rows{v, p.Dv}, p.B * p.Hkv * p.Nk, p.in);
    }
    f.put(float_tensor("q", p.in, {p.B, p.Hq, p.Nq, p.Dk}, q));
    f.put(float_tensor("k", p.in, {p.B, p.Hkv, p.Nk, p.Dk}, k));
    f.put(float_tensor("v", p.in, {p.B, p.Hkv, p.Nk, p.Dv}, v));
    if (is_fp8(p.in))
      for (const char* name : {"q_descale", "k_descale", "v_descale"}) {
        if (!rng.chance(opt.descale_fraction)) continue;
        // one F32 per (batch, kv head), full 24-bit significands: distinct, never 1
        std::vector<double> d(static_cast<std::size_t>(p.B * p.Hkv));
        for (auto& x : d) x = fit(std::ldexp(1 + rng.uniform(), rng.irange(-6, 5)), DType::F32);
        f.put(float_tensor(name, DType::F32, {p.B, p.Hkv}, d));
      }
  } else {
    const Role x_role = p.family == DataFamily::WideRange ? Role::Score : Role::Input;
    auto x_q = gen.tensor(p.B * p.Nq * p.D, x_role);
    auto x_kv = p.self_attention ? x_q : gen.tensor(p.B * p.Nk * p.D, x_role);
    auto w_q = gen.tensor(p.Hq * p.D * p.Dk, Role::Score);
    auto w_k = gen.tensor(p.Hq * p.D * p.Dk, Role::Score);
    auto w_v = gen.tensor(p.Hq * p.D * p.Dv, Role::Value);
    auto w_o = gen.tensor(p.Hq * p.Dv * p.Dout, Role::Value);
    if (p.family == DataFamily::Ties) {
      // zero query or key projections: every score 0 (some heads only, sometimes)
      auto& w = rng.chance(0.5) ? w_q : w_k;
      const std::int64_t heads = rng.chance(0.5) ? p.Hq : rng.range(1, p.Hq);
      std::fill(w.begin(), w.begin() + heads * p.D * p.Dk, 0.0);
    } else if (p.family == DataFamily::Cancel && !p.self_attention) {
      cancel_rows(rng, Rows{x_kv, p.D}, p.B * p.Nk, p.in);
    }
    f.put(float_tensor("x_q", p.in, {p.B, p.Nq, p.D}, x_q));
    f.put(float_tensor("x_kv", p.in, {p.B, p.Nk, p.D}, x_kv));
    f.put(float_tensor("w_q", p.in, {p.Hq, p.D, p.Dk}, w_q));
    f.put(float_tensor("w_k", p.in, {p.Hq, p.D, p.Dk}, w_k));
    f.put(float_tensor("w_v", p.in, {p.Hq, p.D, p.Dv}, w_v));
    f.put(float_tensor("w_o", p.in, {p.Hq * p.Dv, p.Dout}, w_o));
  }

  // ---- masking, and the policy for fully masked rows ----
  const bool large_bias = p.family == DataFamily::LargeScores;
  Masking m = random_masking(rng, p, opt, large_bias);
  RowStats rows = row_stats(p, m);
  if (!opt.allow_masked_rows) {
    for (int attempt = 0; attempt < 10 && (rows.fully_masked || rows.padding_masked); ++attempt) {
      m = random_masking(rng, p, opt, large_bias);
      rows = row_stats(p, m);
    }
    if (rows.fully_masked || rows.padding_masked) {
      m = Masking{};
      rows = RowStats{};
    }
  }
  std::string policy;
  if (rows.fully_masked)
    policy = opt.allow_refusal && rng.chance(opt.refusal_fraction) ? "error" : "zero";
  else
    policy = rng.chance(0.5) ? "error" : "zero";

  if (m.mask_shape) f.put(bool_tensor("mask", *m.mask_shape, m.mask));
  if (m.bias_shape) f.put(float_tensor("bias", m.bias_dtype, *m.bias_shape, m.bias));
  if (m.query_mask) f.put(bool_tensor("query_mask", {p.B, p.Nq}, *m.query_mask));
  if (m.seqlens_q) f.put(int_tensor("seqlens_q", m.seqlens_dtype, *m.seqlens_q));
  if (m.seqlens_k) f.put(int_tensor("seqlens_k", m.seqlens_dtype, *m.seqlens_k));

  // ---- metadata ----
  auto& md = f.metadata;
  md["attn.format"] = "1";
  if (p.mha || rng.chance(0.5)) md["attn.kind"] = p.mha ? "mha" : "sdpa";
  if (rng.chance(opt.scale_fraction)) {
    if (rng.chance(0.5)) {
      // a random double (full or short significand), as C hex float text
      double s = rng.uniform(0.05, 1.0);
      if (rng.chance(0.5)) s = fit(s, DType::BF16);
      md["attn.scale"] = hex_float(s);
    } else {
      md["attn.scale"] = rng.pick(std::vector<std::string>{"0.3", "0.1", "0.7", "1.5", "0.25",
                                                           "0.05", "1", "0.333"});
    }
  }
  if (rng.chance(opt.softcap_fraction))
    md["attn.softcap"] = rng.pick(std::vector<std::string>{"5", "30", "0x1.4p+3", "2.5", "50"});
  else if (rng.chance(0.1))
    md["attn.softcap"] = "0";
  if (m.causal != "none" || rng.chance(0.2)) md["attn.causal"] = m.causal;
  if (m.window)
    md["attn.window"] = std::to_string(m.left) + "," + std::to_string(m.right);
  else if (rng.chance(0.1))
    md["attn.window"] = "none";
  if (policy == "zero" || rng.chance(0.5)) md["attn.masked_rows"] = policy;
  if (p.out != p.in || rng.chance(0.2)) md["attn.output_dtype"] = std::string(dtype_name(p.out));
  std::vector<std::string> outputs = {"out"};
  if (rng.chance(opt.weights_fraction)) outputs.push_back("weights");
  if (rng.chance(opt.lse_fraction)) outputs.push_back("lse");
  if (opt.scores_fraction > 0 && rng.chance(opt.scores_fraction)) outputs.push_back("scores");
  if (outputs.size() > 1 || rng.chance(0.5)) {
    std::swap(outputs[0], outputs[rng.next() % outputs.size()]);
    std::string list;
    for (const auto& o : outputs) list += (list.empty() ? "" : ",") + o;
    md["attn.outputs"] = list;
  }

  const bool sinks = opt.sinks_fraction > 0 && rng.chance(opt.sinks_fraction);
  if (sinks) {
    const DType t = is_fp8(p.in) ? rng.pick(std::vector<DType>{DType::F64, DType::F32})
                               : rng.pick(std::vector<DType>{DType::F64, DType::F32, p.in});
    std::vector<double> v(static_cast<std::size_t>(p.Hq));
    for (auto& x : v) {
      switch (rng.irange(0, 4)) {
        case 0: x = fit(rng.uniform(-3, 3), t); break;    // near the scores
        case 1: x = fit(rng.uniform(20, 60), t); break;   // dominating
        case 2: x = fit(rng.uniform(-60, -20), t); break; // negligible
        case 3: x = 0; break;
        default: x = fit(rng.uniform(-300, 300), t); break;
      }
    }
    f.put(float_tensor("sinks", t, {p.Hq}, v));
  }

  std::size_t poisoned = 0;
  if (!p.mha && opt.poison_fraction > 0 && rng.chance(opt.poison_fraction)) {
    SafeTensorsFile clean = f;
    poisoned = poison(rng, p, m, f);
    if (poisoned > 0 && info) info->clean = std::move(clean);
  }

  if (info) {
    info->seqlens = m.seqlens_q || m.seqlens_k;
    info->poisoned = poisoned;
    info->family = p.family;
    info->sinks = sinks;
    info->fully_masked_row = rows.fully_masked;
    info->padding_masked_row = rows.padding_masked;
    info->expect_refusal = rows.fully_masked && policy == "error" && !sinks;
    std::string s = std::string("seed=") + std::to_string(seed) + (p.mha ? " mha" : " sdpa") +
                    " B=" + std::to_string(p.B) + " H=" + std::to_string(p.Hq) + "/" +
                    std::to_string(p.Hkv) + " Nq=" + std::to_string(p.Nq) +
                    " Nk=" + std::to_string(p.Nk) + " Dk=" + std::to_string(p.Dk) +
                    " Dv=" + std::to_string(p.Dv);
    if (p.mha)
      s += " D=" + std::to_string(p.D) + " Dout=" + std::to_string(p.Dout) +
           (p.self_attention ? " self" : " cross");
    s += " in=" + std::string(dtype_name(p.in)) + " out=" + std::string(dtype_name(p.out)) +
         " family=" + std::string(family_name(p.family)) + " policy=" + policy;
    info->summary = s;
  }
  return f;
}

std::string describe_case(const SafeTensorsFile& f) {
  std::string s;
  for (const auto& [k, v] : f.metadata) s += (s.empty() ? "" : " ") + k + "=" + v;
  for (const auto& t : f.tensors)
    s += " " + t.name + ":" + std::string(dtype_name(t.dtype)) + shape_string(t.shape);
  return s;
}

}  // namespace attnoracle::testing
