// Twins of serving kernels' problems (CONTRACT section 8): the same keys in another page layout,
// page order or page size, or contiguous; another kv split size; one query alone against the full
// case (decode against prefill); another batch row's inputs changed; batch row 0 alone or among
// other rows. All are exact: the keys each row attends and their order are the same on both
// sides, so the exact results are equal.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>

#include "attnoracle/reference/paged.hpp"
#include "twins.hpp"

namespace attnoracle::conformance {
namespace {

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

std::vector<std::int64_t> ints(const RawTensor& t) {
  const std::size_t es = dtype_size(t.dtype), n = t.data.size() / es;
  std::vector<std::int64_t> out(n);
  for (std::size_t e = 0; e < n; ++e) {
    std::uint64_t u = 0;
    for (std::size_t byte = 0; byte < es; ++byte)  // little-endian
      u |= static_cast<std::uint64_t>(t.data[e * es + byte]) << (8 * byte);
    out[e] = es == 4 ? static_cast<std::int32_t>(u) : static_cast<std::int64_t>(u);
  }
  return out;
}

RawTensor i32(const std::string& name, std::vector<std::int64_t> shape, const std::vector<std::int64_t>& values) {
  RawTensor t{name, DType::I32, std::move(shape), {}};
  for (std::int64_t x : values)
    for (int byte = 0; byte < 4; ++byte)  // little-endian two's complement
      t.data.push_back(static_cast<unsigned char>(static_cast<std::uint32_t>(x) >> (8 * byte)));
  return t;
}

void erase(SafeTensorsFile& f, std::initializer_list<const char*> names) {
  std::erase_if(f.tensors, [&](const RawTensor& t) {
    return std::any_of(names.begin(), names.end(), [&](const char* n) { return t.name == n; });
  });
}

// Flips the sign bit of elements [from, to) of t: exact in every binary format.
void flip_signs(RawTensor& t, std::size_t from, std::size_t to) {
  const std::size_t es = dtype_size(t.dtype);
  for (std::size_t e = from; e < to; ++e) t.data[e * es + es - 1] ^= 0x80;
}

std::vector<std::int64_t> key_lengths(const Case& c) {
  std::vector<std::int64_t> lk(sz(c.B));
  for (std::int64_t b = 0; b < c.B; ++b) lk[sz(b)] = c.key_length(b);
  return lk;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The contiguous counterpart of a paged case (CONTRACT section 8): k and v gathered through the
// table (0 past each row's length); seqlens_k stays.
SafeTensorsFile contiguous_form(const Case& c) {
  SafeTensorsFile f = c.file;
  Gathered g = gather_paged(c.path, c.file, *c.paged, key_lengths(c));
  erase(f, {"k_cache", "v_cache", "block_table"});
  f.metadata.erase(std::string(kKvLayoutKey));
  f.put(std::move(g.k));
  f.put(std::move(g.v));
  return f;
}

// A contiguous case (k and v [B, Hkv, Nk, D], Nk a multiple of P) cut into pages of P keys: one
// page per used (row, page) pair, placed in the cache in an order shuffled by `seed`, one spare
// page; unused slots and the spare page NaN, unused table entries -1. Without seqlens_k, every
// row has Nk keys (seqlens_k written so).
SafeTensorsFile paged_form(SafeTensorsFile f, std::int64_t P, KvLayout layout, std::uint64_t seed) {
  const std::vector<std::int64_t> ks = f.find("k")->shape;
  const std::int64_t B = ks[0], Hkv = ks[1], Nk = ks[2], M = Nk / P;
  std::vector<std::int64_t> lk(sz(B), Nk);
  if (const RawTensor* t = f.find("seqlens_k")) lk = ints(*t);
  else f.put(i32("seqlens_k", {B}, lk));
  std::vector<std::int64_t> table(sz(B * M), -1);
  std::int64_t pages = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t m = 0; m < ceil_div(lk[sz(b)], P); ++m) table[sz(b * M + m)] = pages++;
  ++pages;  // the spare page
  std::vector<std::int64_t> place(sz(pages));  // allocation order -> page in the cache
  std::iota(place.begin(), place.end(), 0);
  for (std::size_t a = place.size(); a > 1; --a) {  // Fisher-Yates on an LCG
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    std::swap(place[a - 1], place[(seed >> 33) % a]);
  }
  for (std::int64_t& id : table)
    if (id >= 0) id = place[sz(id)];
  for (const char* name : {"k", "v"}) {
    const RawTensor& t = *f.find(name);
    const std::int64_t D = t.shape[3];
    const std::size_t es = dtype_size(t.dtype), row = sz(D) * es;
    RawTensor cache{std::string(name) + "_cache", t.dtype,
                    layout == KvLayout::HND ? std::vector<std::int64_t>{pages, Hkv, P, D}
                                            : std::vector<std::int64_t>{pages, P, Hkv, D},
                    std::vector<unsigned char>(sz(pages * P * Hkv) * row)};
    for (std::size_t e = 0; e < cache.data.size() / es; ++e) encode_float(t.dtype, NAN, cache.data.data() + e * es);
    PagedKv where;
    where.layout = layout;
    where.page_size = P;
    where.Hkv = Hkv;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < lk[sz(b)]; ++j)
        for (std::int64_t g = 0; g < Hkv; ++g)
          std::memcpy(cache.data.data() + sz(where.cache_index(table[sz(b * M + j / P)], j % P, g, D)) * es,
                      t.data.data() + sz((b * Hkv + g) * Nk + j) * row, row);
    f.put(std::move(cache));
  }
  erase(f, {"k", "v"});
  f.put(i32("block_table", {B, M}, table));
  f.metadata[std::string(kKvLayoutKey)] = std::string(kv_layout_name(layout));
  return f;
}

// Whether a contiguous file cuts into pages of P keys.
bool pageable(const SafeTensorsFile& f, std::int64_t P) {
  const RawTensor* k = f.find("k");
  return k && k->shape.size() == 4 && k->shape[2] % P == 0;
}

// Where an allocation of pages starts over: a fixed seed, so that equal contiguous sides page
// into equal files (one adapter job).
constexpr std::uint64_t kPageSeed = 0x5eed5eedULL;

TwinPair pair(const char* relation, const char* tag, const std::string& what, const SafeTensorsFile& a,
              const Case& c) {
  return TwinPair{relation, tag, what, a, a, {}, 0, false, all_rows(c), all_tokens(c), false, {}};
}

// Page p of a cache [Npages, ...] moved to perm[p].
void permute_pages(RawTensor& t, const std::vector<std::int64_t>& perm) {
  const std::size_t block = t.data.size() / sz(t.shape[0]);
  std::vector<unsigned char> out(t.data.size());
  for (std::size_t p = 0; p < perm.size(); ++p)
    std::memcpy(out.data() + sz(perm[p]) * block, t.data.data() + p * block, block);
  t.data = std::move(out);
}

// The used entries of the table through `map` (page -> page).
RawTensor remap_table(const Case& c, const std::function<std::int64_t(std::int64_t b, std::int64_t page)>& map) {
  const PagedKv& pk = *c.paged;
  std::vector<std::int64_t> table = pk.block_table;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t m = 0; m < ceil_div(c.key_length(b), pk.page_size); ++m) {
      std::int64_t& id = table[sz(b * pk.table_width + m)];
      id = map(b, id);
    }
  return i32("block_table", {c.B, pk.table_width}, table);
}

}  // namespace

std::vector<TwinPair> paged_twins(const Case& c) {
  const PagedKv& pk = *c.paged;
  const std::int64_t P = pk.page_size;
  const SafeTensorsFile flat = contiguous_form(c);
  std::vector<TwinPair> out;
  const char* layout = pk.layout == KvLayout::HND ? "HND" : "NHD";
  const SafeTensorsFile& inputs = c.file;

  // The caches in the other layout: dimensions 1 and 2 swapped.
  {
    const bool hnd = pk.layout == KvLayout::HND;
    TwinPair p = pair("page_layout", "layout", std::string("the caches written ") + (hnd ? "NHD" : "HND") +
                      " instead of " + layout, inputs, c);
    for (const char* name : {"k_cache", "v_cache"}) {
      RawTensor& t = *p.b.find(name);
      const std::int64_t n1 = t.shape[1], n2 = t.shape[2];
      const std::size_t row = sz(t.shape[3]) * dtype_size(t.dtype);
      std::vector<unsigned char> data(t.data.size());
      for (std::int64_t q = 0; q < t.shape[0]; ++q)
        for (std::int64_t x = 0; x < n1; ++x)
          for (std::int64_t y = 0; y < n2; ++y)
            std::memcpy(data.data() + sz((q * n2 + y) * n1 + x) * row, t.data.data() + sz((q * n1 + x) * n2 + y) * row, row);
      t.data = std::move(data);
      std::swap(t.shape[1], t.shape[2]);
    }
    p.b.metadata[std::string(kKvLayoutKey)] = hnd ? "NHD" : "HND";
    out.push_back(std::move(p));
  }

  // The pages in another order of the cache (reversed, then rotated by one), the table following.
  if (pk.pages > 1) {
    std::vector<std::int64_t> perm(sz(pk.pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::reverse(perm.begin(), perm.end());
    if (pk.pages > 2) std::rotate(perm.begin(), perm.begin() + 1, perm.end());
    TwinPair p = pair("page_order", "pages", "the " + std::to_string(pk.pages) + " pages stored in another order",
                      inputs, c);
    for (const char* name : {"k_cache", "v_cache"}) permute_pages(*p.b.find(name), perm);
    p.b.put(remap_table(c, [&](std::int64_t, std::int64_t id) { return perm[sz(id)]; }));
    out.push_back(std::move(p));
  }

  // Another page size: 1 key a page, or (from 1) the smallest divisor of Nk above 1; each row its
  // own pages, unused slots NaN.
  {
    std::int64_t to = 1;
    if (P == 1)
      for (to = 2; to < c.Nk && c.Nk % to != 0;) ++to;
    if (to != P && c.Nk % to == 0) {
      TwinPair p = pair("page_size", "pagesize",
                        "the keys in pages of " + std::to_string(to) + " instead of " + std::to_string(P), inputs, c);
      p.b = paged_form(flat, to, pk.layout, kPageSeed);
      out.push_back(std::move(p));
    }
  }

  // The contiguous k and v.
  out.push_back(pair("paged_contiguous", "contiguous", "the keys and values contiguous instead of paged", inputs, c));
  out.back().b = flat;

  // The twins of the contiguous form, after those of the problem itself (whose file is then
  // the first written: the base).
  for (TwinPair& p : plain_twins(case_from_file(c.path, flat))) {
    if (pageable(p.a, P) && pageable(p.b, P)) {
      p.a = paged_form(std::move(p.a), P, pk.layout, kPageSeed);
      p.b = paged_form(std::move(p.b), P, pk.layout, kPageSeed);
      p.what += " (both paged, " + std::to_string(P) + " keys a page, " + layout + ")";
    } else {
      p.what += " (both contiguous)";
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<TwinPair> serving_twins(const Case& c) {
  std::vector<TwinPair> out;
  if (c.kind != Kind::Sdpa) return out;
  const SafeTensorsFile& inputs = c.file;

  // Another split size: n / 2 + 1 keys a split (n + 1 where that is n). Partials not compared.
  if (c.kv_split_size > 0) {
    std::int64_t n = c.kv_split_size / 2 + 1;
    if (n == c.kv_split_size) ++n;
    TwinPair p = pair("split_size", "split",
                      "kv split size " + std::to_string(c.kv_split_size) + " changed to " + std::to_string(n), inputs, c);
    p.b.metadata["attn.kv_split_size"] = std::to_string(n);
    out.push_back(std::move(p));
  }

  // Decode against prefill: per batch row, one query alone (Nq = 1) with the keys it may see
  // (bottom-right alignment puts it at position Lk' - 1 = i'), against its row of the case.
  if (c.Nq > 1 && !(c.window && c.causal == Causal::None && c.window_right > 0)) {
    const bool cut = c.causal != Causal::None || c.window;  // keys past i' are not allowed anyway
    std::vector<std::int64_t> query_of(sz(c.B), -1), lk(sz(c.B));
    for (std::int64_t b = 0; b < c.B; ++b) {
      lk[sz(b)] = c.key_length(b);
      std::vector<std::int64_t> valid;
      for (std::int64_t i = 0; i < c.Nq; ++i)
        if (c.query_valid(b, i)) valid.push_back(i);
      for (std::size_t k : {valid.size() / 2, valid.size() - 1}) {
        if (k >= valid.size()) continue;
        const std::int64_t i = valid[k], at = c.aligned_position(b, i);
        // past the keys, position Lk - 1 would differ from i' (a window would move)
        if (cut && c.window && at >= c.key_length(b)) continue;
        query_of[sz(b)] = i;
        if (cut) lk[sz(b)] = std::clamp<std::int64_t>(at + 1, 0, c.key_length(b));
        break;
      }
    }
    if (std::any_of(query_of.begin(), query_of.end(), [](std::int64_t i) { return i >= 0; })) {
      TwinPair p = pair("decode_prefill", "decode", "each batch row's query", inputs, c);
      for (std::int64_t b = 0; b < c.B; ++b)
        p.what += (b ? ", " : " ") + std::to_string(query_of[sz(b)]);
      p.what += " alone (Nq = 1) with the keys it sees";
      p.query_of = query_of;
      std::fill(p.rows.begin(), p.rows.end(), 0);
      std::fill(p.out_rows.begin(), p.out_rows.end(), 0);
      for (std::int64_t b = 0; b < c.B; ++b)
        if (query_of[sz(b)] >= 0) {
          p.out_rows[sz(b * c.Nq + query_of[sz(b)])] = 1;
          for (std::int64_t h = 0; h < c.Hq; ++h) p.rows[sz((b * c.Hq + h) * c.Nq + query_of[sz(b)])] = 1;
        }
      auto src_row = [&](std::int64_t b) { return std::max<std::int64_t>(query_of[sz(b)], 0); };
      const RawTensor& q = *inputs.find("q");
      const std::size_t qrow = sz(c.Dk) * dtype_size(q.dtype);
      RawTensor nq{"q", q.dtype, {c.B, c.Hq, 1, c.Dk}, std::vector<unsigned char>(sz(c.B * c.Hq) * qrow)};
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          std::memcpy(nq.data.data() + sz(b * c.Hq + h) * qrow,
                      q.data.data() + sz((b * c.Hq + h) * c.Nq + src_row(b)) * qrow, qrow);
      p.b.put(std::move(nq));
      if (const RawTensor* d = inputs.find("dout")) {  // the gradients' dout, that query's
        const std::size_t drow = sz(c.Dv) * dtype_size(d->dtype);
        RawTensor nd{"dout", d->dtype, {c.B, c.Hq, 1, c.Dv}, std::vector<unsigned char>(sz(c.B * c.Hq) * drow)};
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t h = 0; h < c.Hq; ++h)
            std::memcpy(nd.data.data() + sz(b * c.Hq + h) * drow,
                        d->data.data() + sz((b * c.Hq + h) * c.Nq + src_row(b)) * drow, drow);
        p.b.put(std::move(nd));
      }
      p.dq = true;  // dk and dv sum over the other queries too
      if (c.mask) {
        RawTensor m{"mask", DType::BOOL, {c.B, c.Hq, 1, c.Nk}, std::vector<unsigned char>(sz(c.B * c.Hq * c.Nk))};
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t h = 0; h < c.Hq; ++h)
            for (std::int64_t j = 0; j < c.Nk; ++j) m.data[sz((b * c.Hq + h) * c.Nk + j)] = c.mask_at(b, h, src_row(b), j);
        p.b.put(std::move(m));
      }
      if (c.bias) {
        const RawTensor& bt = *inputs.find("bias");
        const std::size_t es = dtype_size(bt.dtype);
        RawTensor nb{"bias", bt.dtype, {c.B, c.Hq, 1, c.Nk}, std::vector<unsigned char>(sz(c.B * c.Hq * c.Nk) * es)};
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t h = 0; h < c.Hq; ++h)
            for (std::int64_t j = 0; j < c.Nk; ++j)
              std::memcpy(nb.data.data() + sz((b * c.Hq + h) * c.Nk + j) * es,
                          bt.data.data() + c.bias_index(b, h, src_row(b), j) * es, es);
        p.b.put(std::move(nb));
      }
      erase(p.b, {"query_mask"});
      std::vector<std::int64_t> lq(sz(c.B));
      for (std::int64_t b = 0; b < c.B; ++b) lq[sz(b)] = query_of[sz(b)] >= 0 ? 1 : 0;
      p.b.put(i32("seqlens_q", {c.B}, lq));
      p.b.put(i32("seqlens_k", {c.B}, lk));
      if (cut) p.b.metadata["attn.causal"] = "bottom_right";
      out.push_back(std::move(p));
    }
  }

  // Batch row 0's queries reversed, its keys and values negated (a paged case: its pages copied
  // to new pages of the cache, which its table entries then name, so shared pages stay): the
  // other rows unchanged.
  if (c.B > 1) {
    TwinPair p = pair("batch_independence", "batch", "batch row 0's queries, keys and values changed (its pages copied)", inputs, c);
    RawTensor& q = *p.b.find("q");  // each query vector reversed (negated, it would cancel k's sign)
    const std::size_t qs = dtype_size(q.dtype);
    for (std::int64_t r = 0; r < c.Hq * c.Nq; ++r)
      for (std::int64_t x = 0, y = c.Dk - 1; x < y; ++x, --y)
        std::swap_ranges(q.data.begin() + static_cast<std::ptrdiff_t>(sz(r * c.Dk + x) * qs),
                         q.data.begin() + static_cast<std::ptrdiff_t>(sz(r * c.Dk + x + 1) * qs),
                         q.data.begin() + static_cast<std::ptrdiff_t>(sz(r * c.Dk + y) * qs));
    if (c.paged) {
      const PagedKv& pk = *c.paged;
      const std::int64_t used = ceil_div(c.key_length(0), pk.page_size);
      for (const char* name : {"k_cache", "v_cache"}) {
        RawTensor& t = *p.b.find(name);
        const std::size_t es = dtype_size(t.dtype), block = t.data.size() / sz(t.shape[0]);
        for (std::int64_t m = 0; m < used; ++m) {
          const std::size_t from = sz(pk.block_table[sz(m)]) * block, at = t.data.size();
          t.data.insert(t.data.end(), t.data.begin() + static_cast<std::ptrdiff_t>(from),
                        t.data.begin() + static_cast<std::ptrdiff_t>(from + block));
          flip_signs(t, at / es, t.data.size() / es);
        }
        t.shape[0] += used;
      }
      p.b.put(remap_table(c, [&](std::int64_t b, std::int64_t id) {
        if (b != 0) return id;
        const auto m = std::find(pk.block_table.begin(), pk.block_table.begin() + used, id) - pk.block_table.begin();
        return pk.pages + m;
      }));
    } else {
      for (const char* name : {"k", "v"}) {
        RawTensor& t = *p.b.find(name);
        flip_signs(t, 0, t.data.size() / dtype_size(t.dtype) / sz(c.B));
      }
    }
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) p.rows[sz(h * c.Nq + i)] = 0;
    for (std::int64_t i = 0; i < c.Nq; ++i) p.out_rows[sz(i)] = 0;
    all_gradients(c, p);  // of the other rows (dsinks and a bias's sums run over the batch)
    std::fill_n(p.key_rows.begin(), c.Hkv * c.Nk, 0);
    p.dbias = false;
    p.sink_heads.clear();
    out.push_back(std::move(p));
  }
  return out;
}

namespace {

// Tensors whose first dimension is the batch (mask and bias only at full rank, [B, H, Nq, Nk];
// of extent 1 they broadcast and stay).
bool batch_tensor(const RawTensor& t, std::int64_t B) {
  static const char* const names[] = {"q", "k", "v", "x_q", "x_kv", "query_mask", "seqlens_q", "seqlens_k",
                                      "block_table", "dout", "keep", "q_descale", "k_descale", "v_descale"};
  const bool full = t.name == "mask" || t.name == "bias" ? t.shape.size() == 4 : true;
  return full && !t.shape.empty() && t.shape[0] == B && (t.name == "mask" || t.name == "bias" ||
         std::any_of(std::begin(names), std::end(names), [&](const char* n) { return t.name == n; }));
}

// The case's batch rows `from` (row r of the result is row from[r]), every batch tensor cut so.
SafeTensorsFile batch_rows(const Case& c, const std::vector<std::int64_t>& from) {
  SafeTensorsFile f = c.file;
  for (RawTensor& t : f.tensors) {
    if (!batch_tensor(t, c.B)) continue;
    const std::size_t row = t.data.size() / sz(c.B);
    std::vector<unsigned char> data;
    data.reserve(row * from.size());
    for (std::int64_t b : from)
      data.insert(data.end(), t.data.begin() + static_cast<std::ptrdiff_t>(sz(b) * row),
                  t.data.begin() + static_cast<std::ptrdiff_t>(sz(b + 1) * row));
    t.data = std::move(data);
    t.shape[0] = static_cast<std::int64_t>(from.size());
  }
  return f;
}

}  // namespace

std::vector<TwinPair> batch_twins(const Case& c) {
  std::vector<TwinPair> out;
  auto twin = [&](const char* tag, const std::string& what, const std::vector<std::int64_t>& from) {
    TwinPair p = pair("batch_invariance", tag, what, c.file, c);
    p.b = batch_rows(c, from);
    p.bitwise = true;
    for (std::int64_t b = 1; b < c.B; ++b) {  // row 0 alone is compared
      std::fill_n(p.rows.begin() + static_cast<std::ptrdiff_t>(b * c.Hq * c.Nq), c.Hq * c.Nq, 0);
      std::fill_n(p.out_rows.begin() + static_cast<std::ptrdiff_t>(b * c.Nq), c.Nq, 0);
    }
    if (c.kind == Kind::Sdpa) {  // batch row 0's dq, dk and dv
      all_gradients(c, p);
      std::fill(p.key_rows.begin() + static_cast<std::ptrdiff_t>(c.Hkv * c.Nk), p.key_rows.end(), 0);
      p.dbias = false;
      p.sink_heads.clear();
    }
    return p;
  };
  if (c.B > 1) out.push_back(twin("alone", "batch row 0 alone (batch 1 instead of " + std::to_string(c.B) + ")", {0}));
  // Row 0, a copy of it with every query vector reversed, then the other rows in reverse order.
  std::vector<std::int64_t> from{0, 0};
  for (std::int64_t b = c.B - 1; b > 0; --b) from.push_back(b);
  TwinPair p = twin("regrouped", "batch row 0 among other rows (batch " + std::to_string(c.B + 1) + " instead of " +
                    std::to_string(c.B) + ")", from);
  RawTensor& q = *p.b.find(c.kind == Kind::Mha ? "x_q" : "q");
  const std::size_t es = dtype_size(q.dtype), width = sz(q.shape.back()), per = q.data.size() / sz(q.shape[0]);
  for (std::size_t at = per; at < 2 * per; at += width * es)  // row 1's vectors
    for (std::size_t x = 0, y = width - 1; x < y; ++x, --y)
      std::swap_ranges(q.data.begin() + static_cast<std::ptrdiff_t>(at + x * es),
                       q.data.begin() + static_cast<std::ptrdiff_t>(at + (x + 1) * es),
                       q.data.begin() + static_cast<std::ptrdiff_t>(at + y * es));
  out.push_back(std::move(p));
  return out;
}

}  // namespace attnoracle::conformance
