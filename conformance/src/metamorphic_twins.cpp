// Twins of a problem at the file level: every twin is a valid case file. The first ones are
// exact transformations of the problem's inputs (moved bytes, flipped sign bits, exact additions);
// the reference twins change the exact results, by what the reference evaluates.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>


#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/oracle/oracle.hpp"
#include "twins.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle::conformance {
namespace {

RawTensor& need(SafeTensorsFile& f, const std::string& name) {
  RawTensor* t = f.find(name);
  if (!t) throw std::logic_error("twin: no tensor " + name);
  return *t;
}

// Strides of a row-major shape around dimension `dim`: (outer count, dim length, inner elems).
void split(const RawTensor& t, std::size_t dim, std::int64_t& outer, std::int64_t& len,
           std::int64_t& inner) {
  outer = 1, inner = 1;
  for (std::size_t d = 0; d < dim; ++d) outer *= t.shape[d];
  len = t.shape[dim];
  for (std::size_t d = dim + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
}

// Index n along `dim` goes to perm[n].
void permute_dim(RawTensor& t, std::size_t dim, const std::vector<std::int64_t>& perm) {
  std::int64_t outer, len, inner;
  split(t, dim, outer, len, inner);
  const std::size_t es = dtype_size(t.dtype), block = static_cast<std::size_t>(inner) * es;
  std::vector<unsigned char> out(t.data.size());
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t n = 0; n < len; ++n)
      std::memcpy(out.data() + static_cast<std::size_t>(o * len + perm[static_cast<std::size_t>(n)]) * block,
                  t.data.data() + static_cast<std::size_t>(o * len + n) * block, block);
  t.data = std::move(out);
}

// Flips the sign of every element whose index along `dim` is in [from, to): exact in every
// binary format (the sign is the top bit of the last byte).
void negate_range(RawTensor& t, std::size_t dim, std::int64_t from, std::int64_t to) {
  std::int64_t outer, len, inner;
  split(t, dim, outer, len, inner);
  const std::size_t es = dtype_size(t.dtype);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t n = from; n < to; ++n)
      for (std::int64_t k = 0; k < inner; ++k)
        t.data[static_cast<std::size_t>((o * len + n) * inner + k) * es + es - 1] ^= 0x80;
}

// Appends, along `dim`, a copy of index `src` (sign-flipped when `negate`).
void append_dim(RawTensor& t, std::size_t dim, std::int64_t src, bool negate) {
  std::int64_t outer, len, inner;
  split(t, dim, outer, len, inner);
  const std::size_t es = dtype_size(t.dtype), block = static_cast<std::size_t>(inner) * es;
  std::vector<unsigned char> out;
  out.reserve(t.data.size() + static_cast<std::size_t>(outer) * block);
  for (std::int64_t o = 0; o < outer; ++o) {
    const auto* row = t.data.data() + static_cast<std::size_t>(o * len) * block;
    out.insert(out.end(), row, row + static_cast<std::size_t>(len) * block);
    const std::size_t at = out.size();
    out.insert(out.end(), row + static_cast<std::size_t>(src) * block, row + static_cast<std::size_t>(src + 1) * block);
    if (negate)
      for (std::size_t k = at; k < out.size(); k += es) out[k + es - 1] ^= 0x80;
  }
  t.data = std::move(out);
  t.shape[dim] += 1;
}

// Reverses the elements of block r of a tensor [R, ...].
void reverse_block(RawTensor& t, std::int64_t r) {
  const std::size_t es = dtype_size(t.dtype);
  const std::size_t per = t.data.size() / static_cast<std::size_t>(t.shape[0]) / es;
  unsigned char* base = t.data.data() + static_cast<std::size_t>(r) * per * es;
  for (std::size_t a = 0, z = per - 1; a < z; ++a, --z)
    std::swap_ranges(base + a * es, base + (a + 1) * es, base + z * es);
}

// a + b is exact in F64 (Knuth's TwoSum leaves no error).
bool exact_sum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  return (a - (s - bb)) + (b - bb) == 0;
}

bool representable(DType t, double x) {
  unsigned char buf[8];
  try {
    encode_float(t, x, buf);
    return true;
  } catch (const std::logic_error&) {
    return false;
  }
}

// The mask with the causal and window rules written into it (they follow positions, not keys),
// of shape [mB, mH, Nq, Nk]: the case's mask's batch and head extents (1 where it broadcasts
// or is absent); the metadata then says none.
void fold_positions(const Case& c, SafeTensorsFile& f) {
  const std::vector<std::int64_t> ms = c.mask ? c.mask->shape : std::vector<std::int64_t>{};
  auto extent = [&](std::size_t from_right) {
    return ms.size() > from_right ? ms[ms.size() - 1 - from_right] : std::int64_t{1};
  };
  // with sequence lengths the positions differ per batch
  const bool varlen = c.seqlens_q || c.seqlens_k;
  const std::int64_t mb = varlen ? c.B : extent(3), mh = extent(2);
  RawTensor m{"mask", DType::BOOL, {mb, mh, c.Nq, c.Nk}, {}};
  m.data.resize(static_cast<std::size_t>(mb * mh * c.Nq * c.Nk));
  for (std::int64_t b = 0; b < mb; ++b)
    for (std::int64_t h = 0; h < mh; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          m.data[static_cast<std::size_t>(((b * mh + h) * c.Nq + i) * c.Nk + j)] =
              (c.mask_at(b, h, i, j) && c.position_allowed(b, i, j)) ? 1 : 0;
  f.put(std::move(m));
  std::erase_if(f.tensors, [](const RawTensor& t) { return t.name == "seqlens_k"; });
  f.metadata["attn.causal"] = "none";
  f.metadata["attn.window"] = "none";
}

// Whether a mask or bias of this shape varies along the keys (else it broadcasts over them).
bool along_keys(const RawTensor& t, std::int64_t Nk) { return !t.shape.empty() && t.shape.back() == Nk; }

std::string hexf(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

// A metadata number (decimal or C hex float) as the nearest double.
double number(const std::string& text) { return std::strtod(text.c_str(), nullptr); }

// Tensors whose dimension `dim` runs over the keys.
std::vector<std::pair<std::string, std::size_t>> key_tensors(const Case& c) {
  if (c.kind == Kind::Sdpa) return {{"k", 2}, {"v", 2}};
  return {{"x_kv", 1}};
}

std::string name(oracle::Invariant v) { return std::string(oracle::invariant_name(v)); }

}  // namespace

std::vector<char> all_rows(const Case& c) {
  std::vector<char> r(static_cast<std::size_t>(c.B * c.Hq * c.Nq));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) r[static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i)] = c.query_valid(b, i);
  return r;
}
std::vector<char> all_tokens(const Case& c) {
  std::vector<char> r(static_cast<std::size_t>(c.B * c.Nq));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.Nq; ++i) r[static_cast<std::size_t>(b * c.Nq + i)] = c.query_valid(b, i);
  return r;
}

void all_gradients(const Case& c, TwinPair& p) {
  p.dq = p.dbias = true;
  p.key_rows.assign(static_cast<std::size_t>(c.B * c.Hkv * c.Nk), 1);
  p.sink_heads.assign(static_cast<std::size_t>(c.Hq), 1);
}

std::vector<TwinPair> plain_twins(const Case& c) {
  SafeTensorsFile inputs = c.file;  // golden tensors dropped
  std::vector<TwinPair> out;

  // Permuted keys and values (and mask and bias columns).
  if (c.Nk > 1) {
    TwinPair p{name(oracle::Invariant::KeyPermutation), "permuted", "keys and values permuted", inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
    all_gradients(c, p);  // dk, dv and the bias's key columns move with the keys
    p.perm.resize(static_cast<std::size_t>(c.Nk));
    std::iota(p.perm.begin(), p.perm.end(), 0);
    std::reverse(p.perm.begin(), p.perm.end());
    if (c.Nk > 2) std::rotate(p.perm.begin(), p.perm.begin() + 1, p.perm.end());
    if (c.causal != Causal::None || c.window || c.seqlens_k) fold_positions(c, p.b);
    for (auto& [name, dim] : key_tensors(c)) permute_dim(need(p.b, name), dim, p.perm);
    if (RawTensor* m = p.b.find("mask"); m && along_keys(*m, c.Nk)) permute_dim(*m, m->shape.size() - 1, p.perm);
    if (RawTensor* bt = p.b.find("bias"); bt && along_keys(*bt, c.Nk))
      permute_dim(*bt, bt->shape.size() - 1, p.perm);
    out.push_back(std::move(p));
  }

  // A constant added to every score through the bias, exactly in the bias's dtype, and to every
  // sink in its dtype (shift invariance holds only when the sinks move with the scores).
  for (double cst : {1.5, 1.0, 0.5, 0.25, 0x1p-8}) {
    const DType bt = c.bias ? c.bias->dtype : DType::F32;
    bool exact = true;
    if (c.bias)
      for (double x : c.bias->values)
        if (std::isfinite(x) && !(exact_sum(x, cst) && representable(bt, x + cst))) {
          exact = false;
          break;
        }
    if (c.sinks)
      for (double x : c.sinks->values)
        exact = exact && exact_sum(x, cst) && representable(c.sinks->dtype, x + cst);
    if (!exact) continue;
    TwinPair p{name(oracle::Invariant::ShiftInvariance), "shifted", "every score raised by " + std::to_string(cst) + " through the bias",
               inputs, inputs, {}, cst, false, all_rows(c), all_tokens(c), false, {}};
    RawTensor nb{"bias", bt, c.bias ? c.bias->shape : std::vector<std::int64_t>{1}, {}};
    const std::vector<double> vals = c.bias ? c.bias->values : std::vector<double>{0.0};
    nb.data.resize(vals.size() * dtype_size(bt));
    for (std::size_t k = 0; k < vals.size(); ++k)
      encode_float(bt, vals[k] + cst, nb.data.data() + k * dtype_size(bt));  // -inf stays -inf
    p.b.put(std::move(nb));
    all_gradients(c, p);  // P, and so every gradient, unchanged
    if (c.sinks) {
      const DType st = c.sinks->dtype;
      RawTensor ns{"sinks", st, c.sinks->shape, std::vector<unsigned char>(c.sinks->values.size() * dtype_size(st))};
      for (std::size_t k = 0; k < c.sinks->values.size(); ++k)
        encode_float(st, c.sinks->values[k] + cst, ns.data.data() + k * dtype_size(st));
      p.b.put(std::move(ns));
    }
    out.push_back(std::move(p));
    break;
  }

  // Under causal: keys after the last one the middle query may see change sign.
  if (c.causal != Causal::None) {
    const std::int64_t mid = c.Nq / 2;
    std::int64_t last = -1;
    for (std::int64_t j = 0; j < c.Nk; ++j)
      if (c.position_allowed(0, mid, j)) last = j;
    const std::int64_t from = last + 1;
    if (from < c.Nk) {
      TwinPair p{name(oracle::Invariant::CausalDependence), "future",
                 "keys " + std::to_string(from) + ".." + std::to_string(c.Nk - 1) + " changed",
                 inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
      for (auto& [name, dim] : key_tensors(c)) negate_range(need(p.b, name), dim, from, c.Nk);
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            std::int64_t li = -1;
            for (std::int64_t j = 0; j < c.Nk; ++j)
              if (c.position_allowed(b, i, j)) li = j;
            p.rows[static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i)] = li < from && c.query_valid(b, i);
            p.out_rows[static_cast<std::size_t>(b * c.Nq + i)] = li < from && c.query_valid(b, i);
          }
      p.dq = true;  // of the rows that see no changed key; dk and dv sum over every row
      out.push_back(std::move(p));
    }
  }

  // A padding key appended and masked out: its values must not matter.
  {
    TwinPair p{name(oracle::Invariant::MaskedZero), "padding", "a masked padding key appended", inputs, inputs, {}, 0, true, all_rows(c), all_tokens(c), false, {}};
    all_gradients(c, p);  // the padding key's own gradients are not compared
    fold_positions(c, p.b);
    for (auto& [name, dim] : key_tensors(c)) append_dim(need(p.b, name), dim, 0, true);
    RawTensor& m = need(p.b, "mask");
    append_dim(m, m.shape.size() - 1, 0, false);
    {  // the new column is false everywhere
      std::int64_t outer, len, inner;
      split(m, m.shape.size() - 1, outer, len, inner);
      for (std::int64_t o = 0; o < outer; ++o) m.data[static_cast<std::size_t>(o * len + len - 1)] = 0;
    }
    if (RawTensor* bt = p.b.find("bias"); bt && along_keys(*bt, c.Nk))
      append_dim(*bt, bt->shape.size() - 1, 0, false);
    if (c.kind == Kind::Sdpa) {  // the same key with NaN keys and values: an unused position
      TwinPair nan = p;
      nan.tag = "poisoned";
      nan.what = "a masked padding key appended, its k and v rows NaN";
      for (const char* name : {"k", "v"}) {
        RawTensor& t = need(nan.b, name);
        std::int64_t outer, len, inner;
        split(t, 2, outer, len, inner);
        const std::size_t es = dtype_size(t.dtype);
        for (std::int64_t o = 0; o < outer; ++o)
          for (std::int64_t e = 0; e < inner; ++e)
            encode_float(t.dtype, std::nan(""),
                         t.data.data() + static_cast<std::size_t>((o * len + len - 1) * inner + e) * es);
      }
      out.push_back(std::move(nan));
    }
    out.push_back(std::move(p));
  }

  // sdpa: every unused position of the case (keys past seqlens_k, keys no compared query
  // attends, q rows of padding queries) refilled with NaN: nothing compared may change.
  if (c.kind == Kind::Sdpa) {
    TwinPair p{name(oracle::Invariant::MaskedZero), "unused", "unused positions refilled with NaN", inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
    std::size_t filled = 0;
    auto fill = [&](const char* tensor, std::int64_t row, std::int64_t width) {
      RawTensor& t = need(p.b, tensor);
      const std::size_t es = dtype_size(t.dtype);
      for (std::int64_t e = 0; e < width; ++e, ++filled)
        encode_float(t.dtype, std::nan(""), t.data.data() + static_cast<std::size_t>(row * width + e) * es);
    };
    for (std::int64_t b = 0; b < c.B; ++b) {
      for (std::int64_t g = 0; g < c.Hkv; ++g)
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          bool used = false;
          for (std::int64_t h = 0; h < c.Hq && !used; ++h)
            for (std::int64_t i = 0; i < c.Nq && !used; ++i)
              used = c.kv_head(h) == g && c.query_valid(b, i) && c.allowed(b, h, i, j);
          if (used) continue;
          fill("k", (b * c.Hkv + g) * c.Nk + j, c.Dk);
          fill("v", (b * c.Hkv + g) * c.Nk + j, c.Dv);
        }
      for (std::int64_t i = 0; i < c.Nq; ++i)
        if (!c.query_valid(b, i))
          for (std::int64_t h = 0; h < c.Hq; ++h) fill("q", (b * c.Hq + h) * c.Nq + i, c.Dk);
    }
    p.dq = true;  // dk and dv take the NaN queries of padding rows
    if (filled > 0) out.push_back(std::move(p));
  }

  // One head changed.
  if (c.kind == Kind::Sdpa && c.Hq > 1) {
    const std::int64_t r = c.Hq - 1;
    TwinPair p{name(oracle::Invariant::HeadIndependence), "head", "queries of head " + std::to_string(r) + " changed",
               inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
    RawTensor& q = need(p.b, "q");
    for (std::int64_t b = 0; b < c.B; ++b) {  // q[b, r] negated: the block of head r in batch b
      std::int64_t outer, len, inner;
      split(q, 1, outer, len, inner);
      const std::size_t es = dtype_size(q.dtype);
      for (std::int64_t k = 0; k < inner; ++k)
        q.data[static_cast<std::size_t>((b * len + r) * inner + k) * es + es - 1] ^= 0x80;
    }
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        p.rows[static_cast<std::size_t>((b * c.Hq + r) * c.Nq + i)] = 0;
    all_gradients(c, p);  // but the kv head head r reads, head r's sink, and a bias's sums
    p.dbias = false;
    p.sink_heads[static_cast<std::size_t>(r)] = 0;
    for (std::size_t k = 0; k < p.key_rows.size(); ++k)
      if (static_cast<std::int64_t>(k) / c.Nk % c.Hkv == c.kv_head(r)) p.key_rows[k] = 0;
    out.push_back(std::move(p));
  } else if (c.kind == Kind::Mha && c.Hq > 1) {
    // W_o's rows of head r zeroed in both, so that out no longer depends on head r; then head
    // r's projections change in one of them.
    const std::int64_t r = c.Hq - 1;
    TwinPair p{name(oracle::Invariant::HeadIndependence), "head", "projections of head " + std::to_string(r) + " changed",
               inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
    RawTensor& wo = need(p.a, "w_o");
    const std::size_t es = dtype_size(wo.dtype);
    const auto row_bytes = static_cast<std::size_t>(c.Dout) * es;
    std::fill(wo.data.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r * c.Dv) * row_bytes),
              wo.data.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>((r + 1) * c.Dv) * row_bytes), 0);
    p.b.put(wo);
    for (const char* name : {"w_q", "w_k", "w_v"}) reverse_block(need(p.b, name), r);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        p.rows[static_cast<std::size_t>((b * c.Hq + r) * c.Nq + i)] = 0;
    out.push_back(std::move(p));
  }

  // Related through the reference: the exact results change, b - a must be the reference's.
  auto ref_twin = [&](const char* relation, const char* tag, const std::string& what) {
    TwinPair p{relation, tag, what, inputs, inputs, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
    p.reference = true;
    all_gradients(c, p);
    return p;
  };

  // One kv head's keys and values change sign: exactly the query heads mapped to it change.
  if (c.kind == Kind::Sdpa && c.Hkv > 1) {
    const std::int64_t r = c.Hkv - 1, g = c.Hq / c.Hkv;
    TwinPair p = ref_twin("kv_head_locality", "kvhead",
                          "keys and values of kv head " + std::to_string(r) + " changed (query heads " +
                              std::to_string(r * g) + ".." + std::to_string(r * g + g - 1) + " read it)");
    for (const char* t : {"k", "v"}) negate_range(need(p.b, t), 1, r, r + 1);
    out.push_back(std::move(p));
  }

  // The scale doubled (the default 1/sqrt(Dk) written out).
  {
    const double s = c.scale ? number(*c.scale) : 1.0 / std::sqrt(static_cast<double>(c.Dk));
    TwinPair p = ref_twin("scale_sensitivity", "scale", "scale " + hexf(s) + " doubled");
    p.b.metadata["attn.scale"] = hexf(2 * s);
    out.push_back(std::move(p));
  }

  // The softcap set to 1, or a quarter of the problem's.
  {
    const double cap = c.softcap ? number(*c.softcap) : 0, to = cap > 0 ? cap / 4 : 1;
    TwinPair p = ref_twin("softcap_sensitivity", "softcap",
                          (c.softcap ? "softcap " + hexf(cap) : std::string("no softcap")) + " changed to " + hexf(to));
    p.b.metadata["attn.softcap"] = hexf(to);
    out.push_back(std::move(p));
  }

  // Head 0's bias raised by 1 on even keys (rounded into the bias's dtype), in every batch.
  {
    const DType bt = c.bias ? c.bias->dtype : DType::F32;
    const std::size_t es = dtype_size(bt);
    RawTensor nb{"bias", bt, {c.B, c.Hq, c.Nq, c.Nk}, {}};
    nb.data.resize(static_cast<std::size_t>(c.B * c.Hq * c.Nq * c.Nk) * es);
    std::size_t at = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          for (std::int64_t j = 0; j < c.Nk; ++j, at += es) {
            double x = c.bias ? c.bias_at(b, h, i, j) : 0.0;
            if (h == 0 && j % 2 == 0 && std::isfinite(x)) x = round_double(x + 1, bt);
            encode_float(bt, x, nb.data.data() + at);
          }
    TwinPair p = ref_twin("bias_sensitivity", "bias", "the bias of head 0 raised by 1 on even keys");
    p.b.put(std::move(nb));
    out.push_back(std::move(p));
  }

  // Head 0's sink raised by 2 (rounded into the sinks' dtype): that head's rows change as the
  // reference says, the others not at all.
  if (c.sinks) {
    const DType st = c.sinks->dtype;
    RawTensor ns{"sinks", st, c.sinks->shape, std::vector<unsigned char>(c.sinks->values.size() * dtype_size(st))};
    for (std::size_t k = 0; k < c.sinks->values.size(); ++k)
      encode_float(st, k == 0 ? round_double(c.sinks->values[k] + 2, st) : c.sinks->values[k],
                   ns.data.data() + k * dtype_size(st));
    TwinPair p = ref_twin("sink_sensitivity", "sink", "the sink of head 0 raised by 2");
    p.b.put(std::move(ns));
    out.push_back(std::move(p));
  }

  // The window widened by one key on each side.
  if (c.window) {
    const std::string w = std::to_string(c.window_left + 1) + "," + std::to_string(c.window_right + 1);
    TwinPair p = ref_twin("window_sensitivity", "window",
                          "window " + std::to_string(c.window_left) + "," + std::to_string(c.window_right) +
                              " widened to " + w);
    p.b.metadata["attn.window"] = w;
    try {  // the wider window may reach a key holding NaN (an unused position of the problem)
      case_from_file(c.path, p.b);
      out.push_back(std::move(p));
    } catch (const InputError&) {
    }
  }
  return out;
}

std::vector<TwinPair> make_twins(const std::string& path, const SafeTensorsFile& base, bool batch_invariance) {
  const Case c = case_from_file(path, base);
  std::vector<TwinPair> out = c.paged ? paged_twins(c) : plain_twins(c);
  for (TwinPair& p : serving_twins(c)) out.push_back(std::move(p));
  if (batch_invariance)
    for (TwinPair& p : batch_twins(c)) out.push_back(std::move(p));
  return out;
}

}  // namespace attnoracle::conformance
