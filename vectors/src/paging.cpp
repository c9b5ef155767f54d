// Paged KV caches for generated cases: the contiguous k and v of make_problem cut into pages
// and scattered through a block table (CONTRACT section 8).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "attnoracle/vectors/problem.hpp"
#include "prng.hpp"
#include "stored_kv.hpp"

namespace attnoracle::vectors {
namespace {

using Shape = std::vector<std::int64_t>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

std::vector<std::int64_t> int_values(const RawTensor& t) {
  std::vector<std::int64_t> out(sz(t.numel()));
  const std::size_t size = dtype_size(t.dtype);
  for (std::size_t e = 0; e < out.size(); ++e) {
    std::uint64_t u = 0;
    for (std::size_t byte = 0; byte < size; ++byte)  // little-endian
      u |= static_cast<std::uint64_t>(t.data[e * size + byte]) << (8 * byte);
    out[e] = size == 4 ? static_cast<std::int32_t>(u) : static_cast<std::int64_t>(u);
  }
  return out;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The key lengths of the case: seqlens_k (problem_error makes paged cases carry one).
std::vector<std::int64_t> key_lengths(const ProblemSpec& p, const SafeTensorsFile& f) {
  const RawTensor* t = f.find("seqlens_k");
  return t ? int_values(*t) : std::vector<std::int64_t>(sz(p.B), p.Nk);
}

// Pages batch row b shares with batch 0 (pages = shared): its leading pages, as many as both use.
std::int64_t shared_pages(const ProblemSpec& p, const std::vector<std::int64_t>& lk, std::int64_t b) {
  if (p.pages != ProblemSpec::Pages::Shared || b == 0) return 0;
  return std::min(ceil_div(lk[0], p.page_size), ceil_div(lk[sz(b)], p.page_size));
}

}  // namespace

std::vector<std::string> key_row_tensors(const ProblemSpec& p, const SafeTensorsFile& f) {
  std::vector<std::string> names;
  for (const char* side : {"k", "v"}) {
    const std::string s = side;
    for (const std::string& n : {s, s + "_block_scale", s + "_scale"})
      if (f.find(n) && (n != s + "_scale" || p.kv_scale == "token")) names.push_back(n);
  }
  return names;
}

void share_prefix(const ProblemSpec& p, SafeTensorsFile& f) {
  if (p.page_size <= 0 || p.pages != ProblemSpec::Pages::Shared) return;
  const std::vector<std::int64_t> lk = key_lengths(p, f);
  for (const std::string& name : key_row_tensors(p, f)) {
    RawTensor* t = f.find(name);
    const std::size_t row = sz(t->shape[3]) * dtype_size(t->dtype);
    for (std::int64_t b = 1; b < p.B; ++b) {
      const std::int64_t keys = std::min(p.Nk, shared_pages(p, lk, b) * p.page_size);
      for (std::int64_t g = 0; g < p.Hkv; ++g)
        std::memcpy(t->data.data() + sz((b * p.Hkv + g) * p.Nk) * row,
                    t->data.data() + sz(g * p.Nk) * row, sz(keys) * row);
    }
  }
}

void page_kv_cache(const ProblemSpec& p, SafeTensorsFile& f, std::uint64_t seed, const std::vector<bool>& read) {
  if (p.page_size <= 0) return;
  Rng rng(seed);
  const std::int64_t P = p.page_size, M = p.Nk / P;  // problem_error: P divides Nk
  const std::vector<std::int64_t> lk = key_lengths(p, f);

  // Page ids in allocation order: (b, m) for each used page, batch 0's shared pages reused,
  // then one spare page that no row uses.
  std::vector<std::int64_t> table(sz(p.B * M), -1);
  struct Owner {
    std::int64_t b, m;
  };
  std::vector<std::vector<Owner>> owners;
  for (std::int64_t b = 0; b < p.B; ++b) {
    const std::int64_t used = ceil_div(lk[sz(b)], P), shared = shared_pages(p, lk, b);
    for (std::int64_t m = 0; m < used; ++m) {
      std::int64_t& id = table[sz(b * M + m)];
      if (m < shared) {
        id = table[sz(m)];
      } else {
        id = static_cast<std::int64_t>(owners.size());
        owners.emplace_back();
      }
      owners[sz(id)].push_back({b, m});
    }
  }
  owners.emplace_back();  // the spare page
  const auto pages = static_cast<std::int64_t>(owners.size());
  std::vector<std::int64_t> place(sz(pages));  // allocation order -> page index in the cache
  std::iota(place.begin(), place.end(), 0);
  if (p.pages != ProblemSpec::Pages::Ordered)
    for (std::size_t a = place.size(); a > 1; --a) std::swap(place[a - 1], place[rng.below(a)]);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t m = 0; m < M; ++m) {
      std::int64_t& id = table[sz(b * M + m)];
      if (id >= 0 && m < ceil_div(lk[sz(b)], P))
        id = place[sz(id)];
      else  // unused entries: anything; -1, 0 and an index past the cache in turn
        id = (b + m) % 3 == 0 ? -1 : (b + m) % 3 == 1 ? 0 : pages + 7;
    }

  // The key each slot holds: that of an owner that uses it (its rows then not poisoned), else
  // the first owner's unused row; the spare page a row of batch 0 (poisoned with `poison`).
  auto clean = [&](std::int64_t b, std::int64_t g, std::int64_t j) {
    return read.empty() || read[sz((b * p.Hkv + g) * p.Nk + j)];
  };
  struct Key {
    std::int64_t b, j;  // b < 0: the poisoned spare page
  };
  std::vector<Key> held(sz(pages * P * p.Hkv));  // by (allocation id, slot, kv head)
  for (std::int64_t id = 0; id < pages; ++id)
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t g = 0; g < p.Hkv; ++g) {
        Key& key = held[sz((id * P + s) * p.Hkv + g)];
        key = {0, p.Nk - 1 - s % p.Nk};
        if (owners[sz(id)].empty() && p.poison) key.b = -1;
        bool chosen = false;
        for (const Owner& o : owners[sz(id)]) {
          const std::int64_t j = o.m * P + s;
          if (!chosen || (j < lk[sz(o.b)] && clean(o.b, g, j))) key = {o.b, j};
          chosen = true;
        }
      }

  for (const std::string& name : key_row_tensors(p, f)) {
    const RawTensor* t = f.find(name);
    const std::int64_t D = t->shape[3];
    const bool token_scale = name == "k_scale" || name == "v_scale";  // [pages, P, Hkv]: no D
    const std::size_t es = dtype_size(t->dtype), row = sz(D) * es;
    Shape shape = p.kv_layout_hnd ? Shape{pages, p.Hkv, P, D} : Shape{pages, P, p.Hkv, D};
    if (token_scale) shape.pop_back();
    RawTensor cache{name == "k" || name == "v" ? name + "_cache" : name, t->dtype, shape,
                    std::vector<unsigned char>(sz(pages * P * p.Hkv) * row)};
    for (std::int64_t id = 0; id < pages; ++id)
      for (std::int64_t s = 0; s < P; ++s)
        for (std::int64_t g = 0; g < p.Hkv; ++g) {
          const std::int64_t slot = p.kv_layout_hnd ? (place[sz(id)] * p.Hkv + g) * P + s
                                                    : (place[sz(id)] * P + s) * p.Hkv + g;
          unsigned char* to = cache.data.data() + sz(slot) * row;
          const Key key = held[sz((id * P + s) * p.Hkv + g)];
          if (key.b < 0)
            poison_row(name, t->dtype, to, D, true);
          else
            std::memcpy(to, t->data.data() + sz((key.b * p.Hkv + g) * p.Nk + key.j) * row, row);
        }
    f.put(std::move(cache));
  }
  f.tensors.erase(std::remove_if(f.tensors.begin(), f.tensors.end(),
                                 [](const RawTensor& t) { return t.name == "k" || t.name == "v"; }),
                  f.tensors.end());
  // Per-head scales [1, Hkv, 1, 1] broadcast to the slots as [Hkv] (NHD) or [Hkv, 1] (HND).
  if (p.kv_scale == "head")
    for (const char* name : {"k_scale", "v_scale"})
      if (RawTensor* t = f.find(name)) t->shape = p.kv_layout_hnd ? Shape{p.Hkv, 1} : Shape{p.Hkv};
  RawTensor bt{"block_table", DType::I32, {p.B, M}, {}};
  for (std::int64_t x : table)
    for (int byte = 0; byte < 4; ++byte)  // little-endian two's complement
      bt.data.push_back(static_cast<unsigned char>(static_cast<std::uint32_t>(x) >> (8 * byte)));
  f.put(std::move(bt));
  f.metadata["attn.kv_layout"] = p.kv_layout_hnd ? "HND" : "NHD";
}

}  // namespace attnoracle::vectors
