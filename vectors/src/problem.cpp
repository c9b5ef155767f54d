// make_problem: shapes, masks, biases and metadata around the generated data.
#include "attnoracle/vectors/problem.hpp"

#include <mpfr.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "attnoracle/reference/dropout.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/round.hpp"
#include "data.hpp"
#include "numbers.hpp"
#include "prng.hpp"
#include "stored_kv.hpp"

namespace attnoracle::vectors {
namespace {

using Shape = std::vector<std::int64_t>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

RawTensor float_tensor(const std::string& name, DType t, Shape shape,
                       const std::vector<double>& values) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(values.size() * dtype_size(t));
  for (std::size_t e = 0; e < values.size(); ++e)
    encode_float(t, values[e], r.data.data() + e * dtype_size(t));  // checks exactness
  return r;
}

// The causal and window rules of CONTRACT section 1, before sequence lengths (the generators
// that use them draw masks and biases for every position).
bool position_allowed(const ProblemSpec& p, std::int64_t i, std::int64_t j) {
  const std::int64_t aligned = p.causal == Causal::BottomRight ? i + (p.Nk - p.Nq) : i;
  const std::int64_t d = j - aligned;
  if (p.causal != Causal::None && d > 0) return false;
  if (p.window && (d < -p.window->first || d > p.window->second)) return false;
  return true;
}

// A BOOL tensor broadcast (NumPy's rules, right-aligned) to [B, Hq, Nq, Nk] on lookup; no
// shape and no values: no mask.
struct BoolGrid {
  Shape shape;
  std::vector<unsigned char> v;
  bool at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (v.empty()) return true;
    const std::int64_t idx[4] = {b, h, i, j};
    std::int64_t flat = 0;
    for (std::size_t a = 0, r = shape.size(); a < r; ++a)
      flat = flat * shape[a] + (shape[a] == 1 ? 0 : idx[4 - r + a]);
    return v[sz(flat)] != 0;
  }
};

// Masks that broadcast over heads and queries: [B,1,1,Nk] (per batch a random number, 0 to
// Nk-1, of trailing keys masked) or [Nk] (each key allowed with probability 3/4, plus one key
// every query's causal and window rules allow when there is one).
BoolGrid make_broadcast_mask(const ProblemSpec& p, Rng& rng) {
  const std::int64_t B = p.B, Nk = p.Nk;
  BoolGrid m;
  if (p.mask == MaskKind::KeyPaddingBroadcast) {
    m.shape = {B, 1, 1, Nk};
    m.v.assign(sz(B * Nk), 1);
    for (std::int64_t b = 0; b < B; ++b) {
      const auto pad = static_cast<std::int64_t>(rng.below(sz(Nk)));  // keeps one key at least
      for (std::int64_t j = Nk - pad; j < Nk; ++j) m.v[sz(b * Nk + j)] = 0;
    }
  } else {
    m.shape = {Nk};
    m.v.assign(sz(Nk), 0);
    for (std::int64_t j = 0; j < Nk; ++j) m.v[sz(j)] = rng.chance(0.75);
    std::vector<std::int64_t> common;  // keys the positions allow to every query
    for (std::int64_t j = 0; j < Nk; ++j) {
      bool all = true;
      for (std::int64_t i = 0; i < p.Nq && all; ++i) all = position_allowed(p, i, j);
      if (all) common.push_back(j);
    }
    if (!common.empty()) m.v[sz(common[sz(static_cast<std::int64_t>(rng.below(common.size())))])] = 1;
  }
  return m;
}

BoolGrid make_mask(const ProblemSpec& p, Rng& rng) {
  BoolGrid m;
  const std::int64_t B = p.B, H = p.Hq, Nq = p.Nq, Nk = p.Nk;
  auto idx = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
    return sz(((b * m.shape[1] + h) * Nq + i) * Nk + j);
  };
  // A random key that position rules allow in row i, or -1.
  auto some_allowed = [&](std::int64_t i) -> std::int64_t {
    std::vector<std::int64_t> keys;
    for (std::int64_t j = 0; j < Nk; ++j)
      if (position_allowed(p, i, j)) keys.push_back(j);
    return keys.empty() ? -1 : keys[sz(static_cast<std::int64_t>(rng.below(keys.size())))];
  };
  switch (p.mask) {
    case MaskKind::None:
      break;
    case MaskKind::KeyPaddingBroadcast:
    case MaskKind::KeyVector:
      return make_broadcast_mask(p, rng);
    case MaskKind::KeyPadding:
      m.shape = {B, 1, Nq, Nk};
      m.v.assign(sz(B * Nq * Nk), 1);
      for (std::int64_t b = 0; b < B; ++b) {
        const auto pad = static_cast<std::int64_t>(rng.below(sz(Nk)));  // keeps one key at least
        for (std::int64_t i = 0; i < Nq; ++i)
          for (std::int64_t j = Nk - pad; j < Nk; ++j) m.v[idx(b, 0, i, j)] = 0;
      }
      break;
    case MaskKind::Random:
    case MaskKind::SingleKey:
      m.shape = {B, H, Nq, Nk};
      m.v.assign(sz(B * H * Nq * Nk), 0);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t i = 0; i < Nq; ++i) {
            if (p.mask == MaskKind::Random)
              for (std::int64_t j = 0; j < Nk; ++j) m.v[idx(b, h, i, j)] = rng.chance(0.75);
            // one key the position rules allow, so the mask alone empties no row
            if (const std::int64_t j = some_allowed(i); j >= 0) m.v[idx(b, h, i, j)] = 1;
          }
      break;
    case MaskKind::FullyMaskedRows: {
      m.shape = {B, 1, Nq, Nk};
      m.v.assign(sz(B * Nq * Nk), 1);
      const auto forced = static_cast<std::int64_t>(rng.below(sz(B * Nq)));
      for (std::int64_t r = 0; r < B * Nq; ++r)
        if (rng.chance(0.25) || r == forced)
          for (std::int64_t j = 0; j < Nk; ++j) m.v[sz(r * Nk + j)] = 0;
      break;
    }
    case MaskKind::TailBlock: {
      // The last block of 64 keys (full or partial): a kernel that skips the mask in its last
      // key block, or drops that block, changes every row that can see it.
      m.shape = {B, H, Nq, Nk};
      m.v.assign(sz(B * H * Nq * Nk), 1);
      const std::int64_t tail = (Nk - 1) / 64 * 64;
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t i = 0; i < Nq; ++i) {
            std::vector<std::int64_t> open;  // tail keys the position rules allow
            for (std::int64_t j = tail; j < Nk; ++j) {
              m.v[idx(b, h, i, j)] = rng.chance(0.5);
              if (position_allowed(p, i, j)) open.push_back(j);
            }
            // one open among them at least (the mask alone empties no row), and one masked
            // where there are two
            if (open.empty()) continue;
            const std::size_t a = rng.below(open.size());
            m.v[idx(b, h, i, open[a])] = 1;
            if (open.size() < 2) continue;
            std::size_t z = rng.below(open.size() - 1);
            z += z >= a;
            m.v[idx(b, h, i, open[z])] = 0;
          }
      break;
    }
    case MaskKind::CausalMask:
      m.shape = {Nq, Nk};
      m.v.assign(sz(Nq * Nk), 0);
      for (std::int64_t i = 0; i < Nq; ++i)
        for (std::int64_t j = 0; j < Nk; ++j) m.v[sz(i * Nk + j)] = j <= i + (Nk - Nq);
      break;
  }
  return m;
}

// The ALiBi slope of head h: 2^(-8(h+1)/H), computed with MPFR and rounded once.
double alibi_slope(std::int64_t h, std::int64_t H) {
  return exp2_rn(-8.0 * static_cast<double>(h + 1), static_cast<double>(H));
}

// bias fill: a mask as frameworks write it into an additive bias (-inf, -1e4, the lowest
// finite value). Each entry is the fill value with probability 1/4, otherwise 0; one key that
// the mask and the position rules allow stays 0, so a finite fill never decides the row alone.
std::vector<double> make_fill_bias(const ProblemSpec& p, const BoolGrid& mask, Rng& rng,
                                   Shape& shape) {
  const std::int64_t B = p.B, H = p.Hq, Nq = p.Nq, Nk = p.Nk;
  const double fill = bias_fill_value(p).value;
  shape = {B, H, Nq, Nk};
  std::vector<double> bias(sz(B * H * Nq * Nk), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i) {
        double* row = bias.data() + sz(((b * H + h) * Nq + i) * Nk);
        std::vector<std::int64_t> open;
        bool any = false;
        for (std::int64_t j = 0; j < Nk; ++j) {
          if (rng.chance(0.25)) row[j] = fill;
          if (position_allowed(p, i, j) && mask.at(b, h, i, j)) {
            open.push_back(j);
            any = any || row[j] == 0;
          }
        }
        if (!any && !open.empty())
          row[open[sz(static_cast<std::int64_t>(rng.below(open.size())))]] = 0;
      }
  return bias;
}

// Biases that broadcast: [] (one value) or [B,1,1,Nk] (a value per batch and key), uniform in
// [-2, 2) in the bias dtype, finite.
std::vector<double> make_broadcast_bias(const ProblemSpec& p, Rng& rng, Shape& shape) {
  shape = p.bias == BiasKind::Scalar ? Shape{} : Shape{p.B, 1, 1, p.Nk};
  std::vector<double> bias(p.bias == BiasKind::Scalar ? 1 : sz(p.B * p.Nk));
  for (double& x : bias) x = round_into(rng.uniform(-2.0, 2.0), p.bias_dtype);
  return bias;
}

std::vector<double> make_bias(const ProblemSpec& p, const BoolGrid& mask, Rng& rng, Shape& shape) {
  const std::int64_t B = p.B, H = p.Hq, Nq = p.Nq, Nk = p.Nk;
  std::vector<double> bias;
  if (p.bias == BiasKind::Fill) return make_fill_bias(p, mask, rng, shape);
  if (p.bias == BiasKind::Scalar || p.bias == BiasKind::PerKey)
    return make_broadcast_bias(p, rng, shape);
  if (p.bias == BiasKind::RowOffset) {
    shape = {B, H, Nq, 1};
    bias.resize(sz(B * H * Nq));
    for (double& x : bias) {
      const std::uint64_t pick = rng.below(3);
      const double u = rng.uniform();
      x = pick == 0 ? 0.0 : round_into((pick == 1 ? -1e5 : -1e31) * (1 + u), p.bias_dtype);
    }
    return bias;
  }
  if (p.bias == BiasKind::Alibi) {
    shape = {1, H, Nq, Nk};
    bias.resize(sz(H * Nq * Nk));
    mpfr_t x;
    mpfr_init2(x, 128);
    for (std::int64_t h = 0; h < H; ++h) {
      const double m = alibi_slope(h, H);
      for (std::int64_t i = 0; i < Nq; ++i) {
        const std::int64_t aligned = p.causal == Causal::BottomRight ? i + (Nk - Nq) : i;
        for (std::int64_t j = 0; j < Nk; ++j) {
          // -m |i' - j| is exact at 128 bits (53 x 64 bits); one rounding into the bias dtype
          mpfr_set_d(x, m, MPFR_RNDN);
          mpfr_mul_si(x, x, -std::abs(aligned - j), MPFR_RNDN);
          bias[sz((h * Nq + i) * Nk + j)] = round_to_format(x, p.bias_dtype);
        }
      }
    }
    mpfr_clear(x);
  } else if (p.bias == BiasKind::Random) {
    shape = {B, H, Nq, Nk};
    bias.resize(sz(B * H * Nq * Nk));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < Nq; ++i) {
          double* row = bias.data() + sz(((b * H + h) * Nq + i) * Nk);
          std::vector<std::int64_t> open;  // keys that mask and positions allow
          for (std::int64_t j = 0; j < Nk; ++j) {
            const bool masked = rng.chance(0.15);
            row[j] = masked ? -INFINITY : round_into(rng.uniform(-2.0, 2.0), p.bias_dtype);
            if (position_allowed(p, i, j) && mask.at(b, h, i, j)) open.push_back(j);
          }
          // The bias alone empties no row: one open key keeps a finite bias.
          bool any = false;
          for (auto j : open) any = any || row[j] != -INFINITY;
          if (!any && !open.empty()) {
            const std::int64_t j = open[sz(static_cast<std::int64_t>(rng.below(open.size())))];
            row[j] = round_into(rng.uniform(-2.0, 2.0), p.bias_dtype);
          }
        }
  }
  return bias;
}

std::optional<double> parse_text_number(const std::string& s) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::string shortest(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

RawTensor int_tensor(const std::string& name, DType t, const std::vector<std::int64_t>& v) {
  RawTensor r{name, t, {static_cast<std::int64_t>(v.size())}, {}};
  const std::size_t size = dtype_size(t);
  for (std::int64_t x : v)
    for (std::size_t byte = 0; byte < size; ++byte)  // little-endian
      r.data.push_back(static_cast<unsigned char>(static_cast<std::uint64_t>(x) >> (8 * byte)));
  return r;
}

// seqlens_q and seqlens_k of the spec's kind (SeqlensKind): batch 0 full, batch 1 with few keys,
// the other batches distinct key counts where Nk allows.
void put_seqlens(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int64_t> lq(sz(p.B)), lk(sz(p.B));
  for (std::int64_t b = 0; b < p.B; ++b) {
    std::int64_t k = b == 0 ? p.Nk : b == 1 ? std::min<std::int64_t>(2, p.Nk) : 0;
    for (int attempt = 0; k == 0 && attempt < 64; ++attempt) {
      const auto c = 1 + static_cast<std::int64_t>(rng.below(sz(p.Nk)));
      if (std::find(lk.begin(), lk.begin() + b, c) == lk.begin() + b || attempt == 63) k = c;
    }
    lk[sz(b)] = k;
    switch (p.seqlens) {
      case SeqlensKind::Decode: lq[sz(b)] = 1; break;
      case SeqlensKind::Chunked:
        lq[sz(b)] = b == 0 ? p.Nq
                           : 1 + static_cast<std::int64_t>(rng.below(sz(std::min(p.Nq, k))));
        break;
      default: lq[sz(b)] = b == 0 ? p.Nq : std::max<std::int64_t>(1, k * p.Nq / p.Nk);
    }
  }
  if (p.seqlens != SeqlensKind::Keys) f.put(int_tensor("seqlens_q", p.seqlens_dtype, lq));
  f.put(int_tensor("seqlens_k", p.seqlens_dtype, lk));
}

// Rotary tables [Nk, R/2] in F32: cos and sin of t 10000^(-2f/R), each computed at 256 bits and
// correctly rounded, so the bytes are the same on every machine.
void put_rotary_tables(const ProblemSpec& p, SafeTensorsFile& f) {
  const std::int64_t R = p.rotary_dim > 0 ? p.rotary_dim : p.Dk, half = R / 2;
  std::vector<double> cs(sz(p.Nk * half)), sn(cs.size());
  mpfr_t inv, a, x;
  mpfr_inits2(256, inv, a, x, static_cast<mpfr_ptr>(nullptr));
  for (std::int64_t fq = 0; fq < half; ++fq) {
    mpfr_set_si(a, -2 * fq, MPFR_RNDN);
    mpfr_div_si(a, a, R, MPFR_RNDN);
    mpfr_ui_pow(inv, 10000, a, MPFR_RNDN);
    for (std::int64_t t = 0; t < p.Nk; ++t) {
      mpfr_mul_si(a, inv, t, MPFR_RNDN);
      mpfr_cos(x, a, MPFR_RNDN);
      cs[sz(t * half + fq)] = mpfr_get_flt(x, MPFR_RNDN);
      mpfr_sin(x, a, MPFR_RNDN);
      sn[sz(t * half + fq)] = mpfr_get_flt(x, MPFR_RNDN);
    }
  }
  mpfr_clears(inv, a, x, static_cast<mpfr_ptr>(nullptr));
  f.metadata["attn.rotary"] = p.rotary;
  f.metadata["attn.rotary_round"] = std::string(dtype_name(p.rotary_round));
  f.put(float_tensor("rotary_cos", DType::F32, {p.Nk, half}, cs));
  f.put(float_tensor("rotary_sin", DType::F32, {p.Nk, half}, sn));
}

std::string mha_outputs(const ProblemSpec& p) {
  std::string s;
  for (std::size_t k = 0; k < kMhaGradients.size(); ++k)
    if (p.want_mha[k]) s += std::string(",") + kMhaGradients[k];
  return s;
}

std::string outputs_text(const ProblemSpec& p) {
  return std::string("out") + (p.want_weights ? ",weights" : "") + (p.want_lse ? ",lse" : "") +
         (p.want_scores ? ",scores" : "") + (p.want_dq ? ",dq" : "") + (p.want_dk ? ",dk" : "") +
         (p.want_dv ? ",dv" : "") + mha_outputs(p) + (p.want_dbias ? ",dbias" : "") +
         (p.want_dsinks ? ",dsinks" : "") + (p.want_out_partial ? ",out_partial" : "") +
         (p.want_lse_partial ? ",lse_partial" : "") + (p.want_amax ? ",amax" : "");
}

}  // namespace

namespace {

constexpr std::pair<MaskKind, std::string_view> kMaskKindNames[] = {
    {MaskKind::None, "none"},
    {MaskKind::KeyPadding, "key_padding"},
    {MaskKind::Random, "random"},
    {MaskKind::SingleKey, "single_key"},
    {MaskKind::FullyMaskedRows, "fully_masked_rows"},
    {MaskKind::CausalMask, "causal_mask"},
    {MaskKind::KeyPaddingBroadcast, "key_padding_broadcast"},
    {MaskKind::KeyVector, "key_vector"},
    {MaskKind::TailBlock, "tail_block"}};
constexpr std::pair<SeqlensKind, std::string_view> kSeqlensKindNames[] = {
    {SeqlensKind::None, "none"},       {SeqlensKind::Varlen, "varlen"}, {SeqlensKind::Decode, "decode"},
    {SeqlensKind::Chunked, "chunked"}, {SeqlensKind::Keys, "keys"}};
constexpr std::pair<BiasKind, std::string_view> kBiasKindNames[] = {
    {BiasKind::None, "none"}, {BiasKind::Alibi, "alibi"}, {BiasKind::Random, "random"},
    {BiasKind::Fill, "fill"}, {BiasKind::Scalar, "scalar"}, {BiasKind::PerKey, "per_key"},
    {BiasKind::RowOffset, "row_offset"}};

}  // namespace

std::string_view mask_kind_name(MaskKind m) { return table_name(kMaskKindNames, m); }
std::optional<MaskKind> mask_kind_from_name(std::string_view s) {
  return table_from_name(kMaskKindNames, s);
}
std::string_view seqlens_kind_name(SeqlensKind k) { return table_name(kSeqlensKindNames, k); }
std::optional<SeqlensKind> seqlens_kind_from_name(std::string_view s) {
  return table_from_name(kSeqlensKindNames, s);
}
std::string_view bias_kind_name(BiasKind b) { return table_name(kBiasKindNames, b); }
std::optional<BiasKind> bias_kind_from_name(std::string_view s) {
  return table_from_name(kBiasKindNames, s);
}

FillValue bias_fill_value(const ProblemSpec& p) {
  const std::string& t = p.bias_fill;
  if (t.empty() || t == "-inf") return {-INFINITY, ""};
  const Limits l = limits(p.bias_dtype);
  if (t == "-max") return {-std::ldexp(2.0 - std::ldexp(1.0, 1 - l.precision), l.max_exp - 1), ""};
  const auto v = parse_text_number(t);
  if (!v || !(*v < 0))
    return {0, "bias_fill \"" + printable(t) + "\" is not -inf, -max or a negative finite number"};
  try {
    return {round_into(*v, p.bias_dtype), ""};
  } catch (const std::invalid_argument&) {
    return {0, "bias_fill " + printable(t) + " overflows bias_dtype " + std::string(dtype_name(p.bias_dtype))};
  }
}

// Fills every unused position of a valid sdpa case (CONTRACT section 1) with poison_row's
// values: the k and v rows of keys that no query other than padding attends, through any head
// reading their kv head, in any stored dtype, and the q rows of padding queries. A key's scales
// are read by every key of contiguous K/V and by the used slots of a paged cache (section 9):
// they are poisoned only past seqlens_k of a paged case; an I8 key's per-token scale elsewhere
// becomes F32's largest, so that element x scale overflows F32 (I8 has no NaN).
void poison_unused(const ProblemSpec& p, const Case& c, const std::vector<bool>& used, SafeTensorsFile& f) {
  auto row_of = [&](RawTensor& t, std::int64_t row) {
    return t.data.data() + sz(row * t.shape.back()) * dtype_size(t.dtype);
  };
  for (const std::string& name : key_row_tensors(p, f)) {
    RawTensor& t = *f.find(name);
    const bool elements = name == "k" || name == "v";
    const bool i8_scale = t.dtype == DType::F32 && p.kv_format == "I8";
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t g = 0; g < c.Hkv; ++g)
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          const std::int64_t row = (b * c.Hkv + g) * c.Nk + j;
          if (used[sz(row)]) continue;
          if (elements || (p.page_size > 0 && j >= c.key_length(b)))
            poison_row(name, t.dtype, row_of(t, row), t.shape.back(), false);
          else if (i8_scale)
            encode_float(DType::F32, std::ldexp(2 - std::ldexp(1.0, -23), 127), row_of(t, row));
        }
  }
  RawTensor& q = *f.find("q");
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.Nq; ++i)
      if (!c.query_valid(b, i))
        for (std::int64_t h = 0; h < c.Hq; ++h) poison_row("q", q.dtype, row_of(q, (b * c.Hq + h) * c.Nq + i), c.Dk, false);
}

namespace {

// output_dtypes: name:DTYPE entries, each an output the problem asks for (out always), once, in
// F64, F32, F16 or BF16 (not F64 for FP8 inputs).
std::optional<std::string> output_dtypes_error(const ProblemSpec& p) {
  if (p.output_dtypes.empty()) return std::nullopt;
  const std::string asked = outputs_text(p) + ",";
  std::string rest = p.output_dtypes + ",", seen = ",";
  for (std::size_t comma; (comma = rest.find(',')) != std::string::npos; rest.erase(0, comma + 1)) {
    const std::string entry = rest.substr(0, comma);
    const auto colon = entry.find(':');
    const std::string name = entry.substr(0, colon);
    const auto t = colon == std::string::npos ? std::nullopt : dtype_from_name(entry.substr(colon + 1));
    if (!t || !is_float_format(*t) || (is_fp8(p.dtype) && *t == DType::F64))
      return "output_dtypes must be a comma list of name:DTYPE, DTYPE F64, F32, F16 or BF16 (F32, F16 or BF16 for "
             "FP8 inputs), not \"" + printable(p.output_dtypes) + "\"";
    if (("," + asked).find("," + name + ",") == std::string::npos)
      return "output_dtypes gives a dtype to \"" + printable(name) + "\", which is not among outputs " + outputs_text(p);
    if (seen.find("," + name + ",") != std::string::npos)
      return "output_dtypes names \"" + printable(name) + "\" twice";
    seen += name + ",";
  }
  return std::nullopt;
}

// Stored K/V, V as a view of K and FP8 outputs (CONTRACT section 9).
std::optional<std::string> stored_kv_error(const ProblemSpec& p) {
  const bool fp8_out = p.output_dtype && is_fp8(*p.output_dtype);
  if (fp8_out && p.kind != Kind::Sdpa) return "an FP8 output_dtype needs kind sdpa";
  if (fp8_out != !p.o_scale.empty()) return "o_scale goes with an FP8 output_dtype (F8_E4M3, F8_E5M2), and only there";
  if (!p.o_scale.empty()) {
    const auto s = parse_text_number(p.o_scale);
    if (!s || !(*s > 0) || !std::isfinite(round_double(*s, DType::F32)) || round_double(*s, DType::F32) == 0)
      return "o_scale \"" + printable(p.o_scale) + "\" is not a number > 0 that F32 holds (rounded to nearest)";
  }
  if (p.want_amax && !fp8_out) return "amax needs an FP8 output_dtype (F8_E4M3 or F8_E5M2)";
  if (fp8_out && (p.wants_gradients() || is_fp8(p.dtype)))
    return "an FP8 output_dtype takes a float input dtype and no gradients";
  const bool stored = !p.kv_format.empty();
  if (!p.kv_scale.empty() && p.kv_format != "F8_E4M3" && p.kv_format != "F8_E5M2" && p.kv_format != "I8")
    return "kv_scale needs kv_format F8_E4M3, F8_E5M2 or I8";
  if (p.kv_scale_binades != 0 && !stored) return "kv_scale_binades needs a kv_format";
  if (!stored && !p.v_from_k) return std::nullopt;
  if (p.kind != Kind::Sdpa) return "kv_format and v_from_k need kind sdpa";
  if (stored && is_fp8(p.dtype)) return "kv_format needs a float dtype (q's: F64, F32, F16 or BF16)";
  if (stored && (p.generator == "subnormal" || p.generator == "wide_range"))
    return "kv_format is not built for generator " + p.generator + " (its scales would leave F32's normal range)";
  if (p.wants_gradients()) return "stored K/V and v_from_k have no gradients";
  if (p.descales && p.v_from_k) return "v_from_k takes no descales (v_descale is refused)";
  if (p.v_from_k && p.Dv > p.Dk) return "v_from_k needs Dv <= Dk";
  const std::int64_t block = p.kv_format == "mxfp8" ? 32 : p.kv_format == "nvfp4" ? 16 : 1;
  if (p.Dk % block != 0 || (!p.v_from_k && p.Dv % block != 0))
    return "kv_format " + p.kv_format + " needs Dk and Dv multiples of " + std::to_string(block);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> problem_error(const ProblemSpec& p) {
  if (p.kind == Kind::Merge) {
    if (p.Hkv != p.Hq || p.Dk != 1) return "kind merge has the shape [S, B, H, Nq, Dv]";
    if (p.dtype != DType::F32 && p.dtype != DType::F16 && p.dtype != DType::BF16)
      return "kind merge needs dtype F32, F16 or BF16 (o_partial's)";
    if (p.causal != Causal::None || p.window || !p.softcap.empty() || !p.scale.empty() ||
        p.mask != MaskKind::None || p.bias != BiasKind::None || p.query_mask ||
        p.seqlens != SeqlensKind::None || p.poison || p.descales || p.page_size > 0 ||
        p.kv_split_size > 0 || p.want_weights || p.want_scores || p.wants_gradients() ||
        p.want_out_partial || p.want_lse_partial)
      return "kind merge takes no option of attention itself (out and lse, sinks, masked_rows only)";
    if (!p.sinks.empty() && p.sinks != "near" && p.sinks != "dominant" && p.sinks != "negligible")
      return "kind merge takes sinks near, dominant or negligible";
    if (p.lse_partial != "normal" && p.lse_partial != "wide" && p.lse_partial != "neg_inf" &&
        p.lse_partial != "pos_inf" && p.lse_partial != "all_neg_inf")
      return "lse_partial \"" + printable(p.lse_partial) + "\" is not normal, wide, neg_inf, pos_inf or all_neg_inf";
  } else if (p.lse_partial != "normal") {
    return "lse_partial needs kind merge";
  }
  if (!p.dropout.empty()) {
    if (p.kind != Kind::Sdpa) return "dropout needs kind sdpa";
    if (!dropout_p_in_range(p.dropout)) return "dropout \"" + printable(p.dropout) + "\" is not a number in [0, 1)";
    if (p.want_out_partial || p.want_lse_partial) return "dropout has no partial states (out_partial, lse_partial)";
  }
  const bool mha = p.kind == Kind::Mha;
  for (auto d : {p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.Dk, p.Dv})
    if (d < 1) return "every size must be at least 1";
  if (mha && (p.D < 1 || p.Dout < 1)) return "every size must be at least 1";
  if (mha && p.Hkv != p.Hq) return "kind mha has one head count H";
  if (p.Hq % p.Hkv != 0)
    return "Hkv " + std::to_string(p.Hkv) + " does not divide Hq " + std::to_string(p.Hq);
  // A bound on the size of any one tensor keeps every index product within int64.
  const double limit = 1 << 28;
  const double dims = static_cast<double>(p.B) * static_cast<double>(p.Hq) *
                      static_cast<double>(p.Nq) * static_cast<double>(p.Nk);
  if (dims > limit || static_cast<double>(p.B * p.Hq) * static_cast<double>(std::max(p.Nq, p.Nk)) *
                              static_cast<double>(std::max({p.Dk, p.Dv, p.D, p.Dout})) >
                          limit)
    return "the problem is too large (a tensor over 2^28 elements)";
  if (!is_input_format(p.dtype)) return "dtype must be F64, F32, F16, BF16, F8_E4M3 or F8_E5M2";
  if (p.output_dtype && !is_float_format(*p.output_dtype) && !is_fp8(*p.output_dtype))
    return "output_dtype must be F64, F32, F16, BF16, F8_E4M3 or F8_E5M2";
  if (auto e = stored_kv_error(p)) return e;
  if (auto e = output_dtypes_error(p)) return e;
  if (is_fp8(p.dtype)) {
    if (mha) return "FP8 dtypes need kind sdpa";
    if (!p.output_dtype || *p.output_dtype == DType::F64)
      return "FP8 dtypes need output_dtype F32, F16 or BF16";
    if (p.poison) return "poison is not built for FP8 dtypes";
  }
  if (p.descales && !is_fp8(p.dtype)) return "descales need an FP8 dtype";
  if (p.bias_dtype != DType::F64 && p.bias_dtype != DType::F32 &&
      (p.bias_dtype != p.dtype || is_fp8(p.dtype)))
    return "bias_dtype must be F64, F32 or the input dtype (F64 or F32 for FP8 inputs)";
  if (!p.bias_fill.empty() && p.bias != BiasKind::Fill) return "bias_fill needs bias fill";
  if (p.bias == BiasKind::RowOffset && p.bias_dtype != DType::F64 && p.bias_dtype != DType::F32)
    return "bias row_offset needs bias_dtype F64 or F32 (its offsets reach -2e31)";
  if (p.bias == BiasKind::Fill)
    if (auto f = bias_fill_value(p); !f.error.empty()) return f.error;
  if (p.seqlens_dtype != DType::I32 && p.seqlens_dtype != DType::I64)
    return "seqlens_dtype must be I32 or I64";
  if (p.sinks_dtype != DType::F64 && p.sinks_dtype != DType::F32 &&
      (p.sinks_dtype != p.dtype || is_fp8(p.dtype)))
    return "sinks_dtype must be F64, F32 or the input dtype (F64 or F32 for FP8 inputs)";
  if (!p.sinks.empty() && p.sinks != "near" && p.sinks != "dominant" && p.sinks != "negligible" &&
      !parse_text_number(p.sinks))
    return "sinks \"" + printable(p.sinks) + "\" is not near, dominant, negligible or a finite number";
  if (!p.rotary.empty()) {
    const std::int64_t R = p.rotary_dim > 0 ? p.rotary_dim : p.Dk;
    if (mha) return "rotary needs kind sdpa";
    if (is_fp8(p.dtype) || p.page_size > 0) return "rotary needs plain K/V (not FP8, not paged)";
    if (R % 2 != 0 || R > p.Dk) return "rotary_dim must be even and at most Dk";
    if (p.seqlens != SeqlensKind::None || p.Nq > p.Nk) return "rotary needs Nq <= Nk and no seqlens";
    if (!is_float_format(p.rotary_round)) return "rotary_round must be F64, F32, F16 or BF16";
  }
  if (p.poison && mha) return "poison needs kind sdpa (kind mha inputs are all finite)";
  if (p.page_size > 0) {
    if (mha) return "page_size needs kind sdpa";
    if (p.seqlens == SeqlensKind::None) return "page_size needs seqlens (a paged cache has seqlens_k)";
    if (p.Nk % p.page_size != 0) return "page_size must divide Nk (Nk = pages per row x page size)";
    if (p.wants_gradients()) return "paged cases have no gradients";
  }
  if (p.kv_split_size > 0 && mha) return "kv_split_size needs kind sdpa";
  if ((p.want_out_partial || p.want_lse_partial) && p.kv_split_size <= 0)
    return "out_partial and lse_partial need kv_split_size";
  if (p.wants_gradients()) {
    if (mha && (p.want_dq || p.want_dk || p.want_dv)) return "dq, dk and dv are gradients of kind sdpa (kind mha: dx_q ... dw_o)";
    if (!mha && p.wants_mha_gradients()) return "dx_q, dx_kv, dw_q, dw_k, dw_v and dw_o are gradients of kind mha";
    if (p.self_attention && p.want_mha[1]) return "self attention has no dx_kv (dx_q is the whole gradient of x)";
    if (is_fp8(p.dtype)) return "gradients are not built for FP8 dtypes";
    if (p.poison) return "gradients are not built with poison";
    if (p.want_dbias && p.bias == BiasKind::None) return "dbias needs a bias";
    if (p.want_dsinks && p.sinks.empty()) return "dsinks needs sinks";
    if (p.dout != "normal" && p.dout != "wide_range" && p.dout != "cancel" && p.dout != "tiny")
      return "dout \"" + printable(p.dout) + "\" is not normal, wide_range, cancel or tiny";
  }
  if (p.self_attention && (!mha || p.Nq != p.Nk))
    return "self attention needs kind mha and Nq = Nk";
  if (p.window && (p.window->first < 0 || p.window->second < 0))
    return "window sizes must be non-negative";
  if (!p.scale.empty() && !parse_text_number(p.scale)) return "scale is not a finite number";
  if (!p.softcap.empty()) {
    const auto c = parse_text_number(p.softcap);
    if (!c || *c < 0) return "softcap is not a finite number >= 0";
  }
  const GeneratorInfo* g = find_generator(p.generator);
  if (!g) return "unknown generator \"" + printable(p.generator) + "\"";
  for (const auto& [name, value] : p.params) {
    bool known = false;
    for (const auto& [n, v] : g->params) known = known || n == name;
    if (!known) return "generator " + p.generator + " has no parameter \"" + printable(name) + "\"";
    if (!std::isfinite(value)) return "parameter " + printable(name) + " is not finite";
  }
  auto par = [&](std::string_view n) { return param(p, n); };
  const std::string_view gn = p.generator;
  if (gn == "uniform" && !(par("lo") < par("hi"))) return "uniform needs lo < hi";
  if (gn == "normal" && !(par("sigma") > 0)) return "normal needs sigma > 0";
  if (gn == "large_scores" && (!(par("offset") > 0) || !(par("spread") >= 0)))
    return "large_scores needs offset > 0 and spread >= 0";
  auto integer = [](double x, double lo, double hi) {
    return x >= lo && x <= hi && x == static_cast<double>(static_cast<std::int64_t>(x));
  };
  if (gn == "ties" && !integer(par("distinct"), 0, 1e9))
    return "ties needs an integer distinct >= 0";
  if (gn == "near_ties" && !integer(par("ulps"), 1, 1 << 20))
    return "near_ties needs an integer ulps in [1, 2^20]";
  if (gn == "score_jump" && (!(par("jump") > 0) || !integer(par("at"), 0, 1 << 24)))
    return "score_jump needs jump > 0 and an integer at >= 0";
  // The largest magnitude a generator draws must be finite in the input dtype.
  const Limits l = limits(p.dtype);
  const double max_finite = p.dtype == DType::F8_E4M3
                                ? 448  // E4M3FN: its top binade ends at 448 (480 is NaN)
                                : std::ldexp(2.0 - std::ldexp(1.0, 1 - l.precision), l.max_exp - 1);
  double scale = 0;
  try {
    scale = scale_value(p.scale, static_cast<long>(p.Dk));
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  double largest = 6;  // normal data elsewhere: Irwin-Hall stays within 6
  if (gn == "uniform") largest = std::max(std::fabs(par("lo")), std::fabs(par("hi")));
  if (gn == "normal") largest = 6 * par("sigma");
  if (gn == "score_jump") largest = std::max(6.0, sqrt_rn(par("jump") / std::fabs(scale)));
  if (gn == "large_scores")
    largest = std::max(sqrt_rn(par("offset") / std::fabs(scale)), 6 * par("spread"));
  if (gn == "dominant") {
    const Limits out = limits(p.output_dtype.value_or(p.dtype));
    largest = (-out.min_sub_exp * 0.6931471805599453 / 2 + 2) / std::fabs(scale);
  }
  if (!(largest < max_finite))
    return "generator " + p.generator + " draws values up to " + shortest(largest) +
           ", which overflow " + std::string(dtype_name(p.dtype));
  return std::nullopt;
}

SafeTensorsFile make_problem(const ProblemSpec& p, std::uint64_t seed) {
  if (auto e = problem_error(p)) throw std::invalid_argument(*e);
  if (p.kind == Kind::Merge) return make_merge_problem(p, seed);
  // Independent streams: changing the mask kind does not change the data, and so on.
  Rng data_rng(mix64(seed, 1)), mask_rng(mix64(seed, 2)), bias_rng(mix64(seed, 3)),
      query_rng(mix64(seed, 4)), sinks_rng(mix64(seed, 5));
  const InputData d = generate_data(p, data_rng);

  SafeTensorsFile f;
  f.metadata["attn.format"] = "1";
  f.metadata["attn.kind"] = p.kind == Kind::Mha ? "mha" : "sdpa";
  f.metadata["attn.causal"] = std::string(causal_name(p.causal));
  f.metadata["attn.window"] =
      p.window ? std::to_string(p.window->first) + "," + std::to_string(p.window->second) : "none";
  f.metadata["attn.softcap"] = p.softcap.empty() ? "0" : p.softcap;
  if (!p.scale.empty()) f.metadata["attn.scale"] = p.scale;
  f.metadata["attn.masked_rows"] = std::string(masked_rows_name(p.masked_rows));
  f.metadata["attn.output_dtype"] = std::string(dtype_name(p.output_dtype.value_or(p.dtype)));
  f.metadata["attn.outputs"] = outputs_text(p);
  if (!p.output_dtypes.empty()) f.metadata["attn.output_dtypes"] = p.output_dtypes;
  if (p.kv_split_size > 0) f.metadata["attn.kv_split_size"] = std::to_string(p.kv_split_size);
  f.metadata["gen.generator"] = p.generator;
  f.metadata["gen.seed"] = std::to_string(seed);

  const DType t = p.dtype;
  if (p.kind == Kind::Sdpa) {
    f.put(float_tensor("q", t, {p.B, p.Hq, p.Nq, p.Dk}, d.q));
    f.put(float_tensor("k", t, {p.B, p.Hkv, p.Nk, p.Dk}, d.k));
    f.put(float_tensor("v", t, {p.B, p.Hkv, p.Nk, p.Dv}, d.v));
  } else {
    f.put(float_tensor("x_q", t, {p.B, p.Nq, p.D}, d.x_q));
    f.put(float_tensor("x_kv", t, {p.B, p.Nk, p.D}, d.x_kv));
    f.put(float_tensor("w_q", t, {p.Hq, p.D, p.Dk}, d.w_q));
    f.put(float_tensor("w_k", t, {p.Hq, p.D, p.Dk}, d.w_k));
    f.put(float_tensor("w_v", t, {p.Hq, p.D, p.Dv}, d.w_v));
    f.put(float_tensor("w_o", t, {p.Hq * p.Dv, p.Dout}, d.w_o));
  }
  if (p.descales) {
    // (1 + n/64) 2^e, n in [1, 63], e in [-4, 3]: distinct within each tensor, none 1
    Rng rng(mix64(seed, 5));
    for (const char* name : {"q_descale", "k_descale", "v_descale"}) {
      std::vector<double> ds;
      while (ds.size() < sz(p.B * p.Hkv)) {
        const double n = static_cast<double>(1 + rng.below(63));
        const int e = static_cast<int>(rng.below(8)) - 4;
        const double x = std::ldexp(1 + n / 64, e);
        if (std::find(ds.begin(), ds.end(), x) == ds.end()) ds.push_back(x);
      }
      f.put(float_tensor(name, DType::F32, {p.B, p.Hkv}, ds));
    }
  }
  const BoolGrid mask = make_mask(p, mask_rng);
  if (!mask.v.empty()) f.put(RawTensor{"mask", DType::BOOL, mask.shape, mask.v});
  Shape bias_shape;
  const std::vector<double> bias = make_bias(p, mask, bias_rng, bias_shape);
  if (p.bias != BiasKind::None) f.put(float_tensor("bias", p.bias_dtype, bias_shape, bias));
  if (p.query_mask) {
    // Per batch a random number of trailing padding rows, one valid row at least; batch 0 has
    // one padding row at least when it can.
    RawTensor qm{
        "query_mask", DType::BOOL, {p.B, p.Nq}, std::vector<unsigned char>(sz(p.B * p.Nq), 1)};
    for (std::int64_t b = 0; b < p.B; ++b) {
      std::int64_t pad = static_cast<std::int64_t>(query_rng.below(sz(p.Nq)));
      if (b == 0 && pad == 0 && p.Nq > 1) pad = 1;
      for (std::int64_t i = p.Nq - pad; i < p.Nq; ++i) qm.data[sz(b * p.Nq + i)] = 0;
    }
    f.put(std::move(qm));
  }
  if (p.seqlens != SeqlensKind::None) put_seqlens(p, f, mix64(seed, 5));
  if (!p.sinks.empty()) {
    std::vector<double> s(sz(p.Hq));
    for (auto& x : s) {
      double v = 0;
      if (p.sinks == "near") v = -2 + 4 * sinks_rng.uniform();
      else if (p.sinks == "dominant") v = 12 + 4 * sinks_rng.uniform();
      else if (p.sinks == "negligible") v = -40 + 4 * sinks_rng.uniform();
      else v = *parse_text_number(p.sinks);
      x = round_into(v, p.sinks_dtype);
    }
    f.put(float_tensor("sinks", p.sinks_dtype, {p.Hq}, s));
  }
  if (!p.rotary.empty()) put_rotary_tables(p, f);
  if (!p.dropout.empty()) {  // its own stream: kept with probability 1 - p
    Rng rng(mix64(seed, 12));
    const double pv = std::strtod(p.dropout.c_str(), nullptr);
    RawTensor keep{"dropout_mask", DType::BOOL, {p.B, p.Hq, p.Nq, p.Nk}, std::vector<unsigned char>(sz(p.B * p.Hq * p.Nq * p.Nk))};
    for (auto& x : keep.data) x = rng.uniform() >= pv ? 1 : 0;
    f.put(std::move(keep));
    f.metadata["attn.dropout_p"] = p.dropout;
  }
  if (p.wants_gradients()) {
    // its own stream: the other inputs keep their values
    Rng rng(mix64(seed, 6));
    const bool mha = p.kind == Kind::Mha;
    std::vector<double> g(sz(mha ? p.B * p.Nq * p.Dout : p.B * p.Hq * p.Nq * p.Dv));
    for (double& x : g) {
      if (p.dout == "wide_range") {  // the draws in sequence (an argument order differs between compilers)
        const double sign = rng.below(2) ? -1 : 1;
        const int e = static_cast<int>(rng.below(16)) - 8;
        x = sign * std::ldexp(1 + rng.uniform(), e);
      }
      else if (p.dout == "cancel")
        x = 8 + rng.normal() / 16;
      else if (p.dout == "tiny")
        x = std::ldexp(rng.normal(), -12);
      else
        x = rng.normal();
      x = round_into(x, p.dtype);
    }
    f.put(float_tensor("dout", p.dtype, mha ? std::vector<std::int64_t>{p.B, p.Nq, p.Dout}
                                            : std::vector<std::int64_t>{p.B, p.Hq, p.Nq, p.Dv}, g));
  }
  store_kv(p, f, mix64(seed, 8));
  share_prefix(p, f);
  std::vector<bool> used;  // with poison, the key rows a query reads (the paging needs them too)
  if (p.poison) {
    const Case c = case_from_file("poison", f);
    used = used_key_rows(c);
    poison_unused(p, c, used, f);
  }
  page_kv_cache(p, f, mix64(seed, 7), used);
  return f;
}

bool has_fully_masked_row(const Case& c) {
  if (c.sinks) return false;  // a row without keys still has its sink
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        if (!c.row_has_key(b, h, i)) return true;
  return false;
}

}  // namespace attnoracle::vectors
