// Metamorphic relations on the reference: a row unit is evaluated again on twin cases whose
// exact result is known to relate to the original one, and the enclosures must agree.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/file.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {

using detail::overlap;
using detail::show;

namespace {

// A case's options without its tensors or the file it was read from, asking for weights and
// lse (the twins compare them).
Case options_of(const Case& c) {
  Case t = detail::options_only(c);
  t.want_weights = true;
  t.want_lse = true;
  return t;
}

// A case's inputs and options without the file it was read from (twins are built in memory).
Case inputs_of(const Case& c) {
  Case t = options_of(c);
  t.B = c.B, t.Hq = c.Hq, t.Hkv = c.Hkv, t.Nq = c.Nq, t.Nk = c.Nk;
  t.Dk = c.Dk, t.Dv = c.Dv, t.D = c.D, t.Dout = c.Dout;
  t.q = c.q, t.k = c.k, t.v = c.v;
  t.x_q = c.x_q, t.x_kv = c.x_kv, t.w_q = c.w_q, t.w_k = c.w_k, t.w_v = c.w_v, t.w_o = c.w_o;
  t.mask = c.mask;
  t.bias = c.bias;
  t.query_mask = c.query_mask;
  t.seqlens_q = c.seqlens_q;
  t.seqlens_k = c.seqlens_k;
  t.sinks = c.sinks;
  return t;
}

// A value that differs from x and stays finite.
double perturbed(double x) { return 1.25 - 0.5 * x; }

// Rows n of a [.., N, E] block starting at `base`, replaced by perturbed values.
void perturb_rows(std::vector<double>& v, std::size_t base, std::int64_t from, std::int64_t to,
                  std::int64_t E) {
  for (std::int64_t n = from; n < to; ++n)
    for (std::int64_t e = 0; e < E; ++e) {
      double& x = v[base + static_cast<std::size_t>(n * E + e)];
      x = perturbed(x);
    }
}

// a + b is exact in F64 (Knuth's TwoSum leaves no error).
bool exact_sum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  return (a - (s - bb)) + (b - bb) == 0;
}

// The inputs an sdpa row unit (b, h, i) reads, as a case of its own (kind sdpa twins are built
// on it, not on a copy of the whole case): batch b, the query heads `heads` over the kv heads
// `groups` (heads[k] reads groups[k / (heads / groups)]), query row i of each head (the other
// rows 0: they are not read), and row i of the mask and bias, broadcast over the queries. The
// unit is (0, 0, i) of the slice; Nq, Nk and the options stay, so the positional rules too.
// The keys and values are left out (dtype and shape only): kv_blocks copies them.
Case slice_frame(const Case& c, std::int64_t b, std::int64_t i, const std::vector<std::int64_t>& heads,
                 const std::vector<std::int64_t>& groups, TwinBuffers* buffers) {
  Case t = options_of(c);
  const auto nh = static_cast<std::int64_t>(heads.size()), ng = static_cast<std::int64_t>(groups.size());
  t.B = 1, t.Hq = nh, t.Hkv = ng, t.Nq = c.Nq, t.Nk = c.Nk;
  t.Dk = c.Dk, t.Dv = c.Dv;
  const auto nq = static_cast<std::size_t>(nh * c.Nq * c.Dk);
  t.q = FloatTensor{c.q.dtype, {1, nh, c.Nq, c.Dk}, buffers ? buffers->take(nq) : std::vector<double>(nq)};
  std::fill(t.q.values.begin(), t.q.values.end(), 0.0);
  for (std::int64_t k = 0; k < nh; ++k)
    std::copy_n(c.q.values.begin() + ((b * c.Hq + heads[static_cast<std::size_t>(k)]) * c.Nq + i) * c.Dk, c.Dk,
                t.q.values.begin() + (k * c.Nq + i) * c.Dk);
  t.k = FloatTensor{c.k.dtype, {1, ng, c.Nk, c.Dk}, {}};
  t.v = FloatTensor{c.v.dtype, {1, ng, c.Nk, c.Dv}, {}};
  // [1, heads or 1, 1, Nk or 1]: the extents 1 where the original broadcasts.
  auto row_shape = [&](const std::vector<std::int64_t>& s) {
    auto extent = [&](std::size_t from_right) {
      return s.size() > from_right ? s[s.size() - 1 - from_right] : std::int64_t{1};
    };
    return std::vector<std::int64_t>{1, extent(2) == 1 ? 1 : nh, 1, extent(0) == 1 ? 1 : c.Nk};
  };
  if (c.mask) {
    const auto sh = row_shape(c.mask->shape);
    BoolTensor m{sh, {}};
    for (std::int64_t k = 0; k < sh[1]; ++k)
      for (std::int64_t j = 0; j < sh[3]; ++j)
        m.values.push_back(c.mask_at(b, heads[static_cast<std::size_t>(k)], i, j) ? 1 : 0);
    t.mask = std::move(m);
  }
  if (c.bias) {
    const auto sh = row_shape(c.bias->shape);
    FloatTensor f{c.bias->dtype, sh, {}};
    for (std::int64_t k = 0; k < sh[1]; ++k)
      for (std::int64_t j = 0; j < sh[3]; ++j) f.values.push_back(c.bias_at(b, heads[static_cast<std::size_t>(k)], i, j));
    t.bias = std::move(f);
  }
  if (c.query_mask) {
    const auto from = c.query_mask->values.begin() + b * c.Nq;
    t.query_mask = BoolTensor{{1, c.Nq}, std::vector<unsigned char>(from, from + c.Nq)};
  }
  // batch b's lengths, so that the slice's positions and padding are those of the unit
  if (c.seqlens_q) t.seqlens_q = std::vector<std::int64_t>{(*c.seqlens_q)[static_cast<std::size_t>(b)]};
  if (c.seqlens_k) t.seqlens_k = std::vector<std::int64_t>{(*c.seqlens_k)[static_cast<std::size_t>(b)]};
  if (c.sinks) {  // the sinks of the slice's heads, in their order
    FloatTensor s{c.sinks->dtype, {nh}, {}};
    for (std::int64_t hh : heads) s.values.push_back(c.sinks->values[static_cast<std::size_t>(hh)]);
    t.sinks = std::move(s);
  }
  return t;
}

// The blocks [Nk, E] of batch b's kv heads `groups` of x, one after the other, in a buffer with
// room for `room` blocks (a twin that adds a block to it then does not copy the others again).
std::vector<double> kv_blocks(const Case& c, const FloatTensor& x, std::int64_t E, std::int64_t b,
                              const std::vector<std::int64_t>& groups, std::size_t room, TwinBuffers* buffers) {
  const auto n = static_cast<std::size_t>(c.Nk * E);
  const std::size_t want = std::max(room, groups.size()) * n;
  std::vector<double> y = buffers ? buffers->take(want) : std::vector<double>(want);
  y.resize(groups.size() * n);
  for (std::size_t k = 0; k < groups.size(); ++k)
    std::copy_n(x.values.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b * c.Hkv + groups[k]) * n), n,
                y.begin() + static_cast<std::ptrdiff_t>(k * n));
  return y;
}

Case slice(const Case& c, std::int64_t b, std::int64_t i, const std::vector<std::int64_t>& heads,
           const std::vector<std::int64_t>& groups, TwinBuffers* buffers, std::size_t room) {
  Case t = slice_frame(c, b, i, heads, groups, buffers);
  t.k.values = kv_blocks(c, c.k, c.Dk, b, groups, room, buffers);
  t.v.values = kv_blocks(c, c.v, c.Dv, b, groups, room, buffers);
  return t;
}

// x <= y for double-double ends, exactly, where both hi are the F64 numbers nearest hi + lo
// (rounding is monotonic: hi < y.hi gives x <= y; equal hi leave lo to decide); false, which
// sends the comparison to MPFR, where one is not.
bool dd_le(double xh, double xl, double yh, double yl) {
  if (xh + xl != xh || yh + yl != yh) return false;
  return xh < yh || (xh == yh && xl <= yl);
}

// Element k of out or of the weights of one head of a row: the ends a fast row gives for the
// twins, else the enclosure.
struct Elements {
  const std::vector<Enclosure>* enc = nullptr;
  const std::vector<DDEnclosure>* ends = nullptr;
  Elements(const RowEnclosures& r, std::size_t slot, bool weights) {
    const auto& e = weights ? r.weight_ends : r.out_ends;
    if (slot < e.size()) ends = &e[slot];
    else enc = weights ? &r.weights.at(slot) : &r.heads.at(slot).out;
  }
  std::size_t size() const { return ends ? ends->size() : enc->size(); }
  // The enclosure of element k (made in `hold` from the ends).
  const Enclosure& at(std::size_t k, std::optional<Enclosure>& hold) const {
    if (!ends) return enc->at(k);
    hold.emplace(enclosure_of(ends->at(k)));
    return *hold;
  }
};

// Whether element j of a and element k of b overlap: on their ends where both have ends and
// those overlap (then so do the enclosures made of them, which are wider), else on the
// enclosures, as ever.
bool elements_overlap(const Elements& a, std::size_t j, const Elements& b, std::size_t k) {
  if (a.ends && b.ends) {
    const DDEnclosure &x = a.ends->at(j), &y = b.ends->at(k);
    if (dd_le(x.lo_hi, x.lo_lo, y.hi_hi, y.hi_lo) && dd_le(y.lo_hi, y.lo_lo, x.hi_hi, x.hi_lo)) return true;
  }
  std::optional<Enclosure> hx, hy;
  return overlap(a.at(j, hx), b.at(k, hy));
}

// Gives a twin's queries, keys and values back to `buffers` when the twin goes out of scope.
struct Recycled {
  Case& t;
  TwinBuffers* buffers;
  ~Recycled() {
    if (!buffers) return;
    for (FloatTensor* x : {&t.q, &t.k, &t.v}) buffers->give(std::move(x->values));
  }
};

// The keys and values of `from` (the unit's slice: one kv head) lent to the twin `to` for its
// life, given back cut to that one kv head's block.
struct Borrowed {
  Case& to;
  Case& from;
  Borrowed(Case& t, Case& f) : to(t), from(f) {
    to.k.values = std::move(from.k.values);
    to.v.values = std::move(from.v.values);
  }
  ~Borrowed() {
    from.k.values = std::move(to.k.values);
    from.v.values = std::move(to.v.values);
    from.k.values.resize(static_cast<std::size_t>(from.Nk * from.Dk));
    from.v.values.resize(static_cast<std::size_t>(from.Nk * from.Dv));
  }
};

// Appends kv head g of batch b of x ([Nk, E] rows), perturbed, to y.
void append_perturbed(std::vector<double>& y, const Case& c, const FloatTensor& x, std::int64_t E, std::int64_t b,
                      std::int64_t g) {
  const auto n = static_cast<std::size_t>(c.Nk * E);
  const double* from = x.values.data() + static_cast<std::size_t>(b * c.Hkv + g) * n;
  const std::size_t at = y.size();
  y.resize(at + n);
  for (std::size_t k = 0; k < n; ++k) y[at + k] = perturbed(from[k]);
}

struct TwinChecker {
  const Case& c;
  std::int64_t b, h, i;  // the unit; h is 0 for mha
  const RowSourceFactory& rows;
  std::vector<Violation>& out;
  RowEnclosures base;
  TwinBuffers* buffers;
  // sdpa: the unit's slice (its query head over its kv head), which the twins share in turn:
  // shift and head independence leave its keys and values as they are, causal dependence
  // then changes some in place, and the key permutation rewrites them all.
  Case unit_slice{};

  std::vector<std::int64_t> heads() const {  // heads of the unit
    if (c.kind == Kind::Sdpa) return {h};
    std::vector<std::int64_t> all(static_cast<std::size_t>(c.Hq));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  std::size_t slot(std::int64_t head) const {
    return c.kind == Kind::Sdpa ? 0 : static_cast<std::size_t>(head);
  }

  bool sdpa() const { return c.kind == Kind::Sdpa; }
  // The case a twin changes: the unit's slice (sdpa), else a copy of the case held in `own`
  // (mha, whose rows read every head).
  Case& twin_case(std::optional<Case>& own) {
    if (sdpa()) return unit_slice;
    own.emplace(inputs_of(c));
    return *own;
  }

  bool eval(const Case& twin, RowEnclosures& r) {
    try {
      r = sdpa() ? rows(twin)->row(0, 0, i) : rows(twin)->row(b, h, i);
      return true;
    } catch (const FullyMaskedRow&) {
      return false;
    }
  }

  // The twin's row must agree with the base row on the heads in `which`: outputs, weights
  // (key j of the base is key perm[j] of the twin) and lse (shifted by `shift`).
  void agree(Invariant inv, const RowEnclosures& t, const std::vector<std::int64_t>& which,
             const std::string& what, const std::vector<std::int64_t>* perm = nullptr,
             double shift = 0) {
    for (auto head : which) {
      const std::size_t s = slot(head);
      std::optional<Enclosure> ha, hz;
      const Elements oa(base, s, false), oz(t, s, false);
      for (std::size_t col = 0; col < oa.size(); ++col)
        if (!elements_overlap(oa, col, oz, col)) {
          out.push_back({inv, b, head, i, -1, static_cast<std::int64_t>(col),
                         "output " + show(oa.at(col, ha)) + " became " + show(oz.at(col, hz)) + " " + what});
          return;  // one report per relation and head is enough
        }
      const Elements wa(base, s, true), wz(t, s, true);
      for (std::size_t j = 0; j < wa.size(); ++j) {
        const std::size_t jt = perm ? static_cast<std::size_t>((*perm)[j]) : j;
        if (!elements_overlap(wa, j, wz, jt)) {
          out.push_back({inv, b, head, i, static_cast<std::int64_t>(j), -1,
                         "weight " + show(wa.at(j, ha)) + " became " + show(wz.at(jt, hz)) + " " + what});
          return;
        }
      }
      Enclosure l(mpfr_get_prec(base.lse.at(s).lo) + 64);
      mpfr_add_d(l.lo, base.lse[s].lo, shift, MPFR_RNDD);
      mpfr_add_d(l.hi, base.lse[s].hi, shift, MPFR_RNDU);
      if (!overlap(l, t.lse.at(s))) {
        out.push_back({inv, b, head, i, -1, -1,
                       "lse " + show(base.lse[s]) + " became " + show(t.lse[s]) + " " + what});
        return;
      }
    }
  }

  // A constant added to every score through the bias, and to every sink (the sink is one more
  // logit of the softmax: the relation holds only when it moves with the scores).
  void shift() {
    std::optional<Case> own;
    Case& t = twin_case(own);
    // the slice's bias and sinks, put back for the next twins
    struct Restore {
      Case& t;
      const std::optional<FloatTensor> bias, sinks;
      ~Restore() {
        t.bias = bias;
        t.sinks = sinks;
      }
    } const restore{t, t.bias, t.sinks};
    for (double cst : {1.5, 1.0, 0.5, 0.25, 0x1p-8, 0x1p-16, 0x1p-24}) {
      bool exact = true;
      if (t.bias)  // every bias value the twin reads
        for (double x : t.bias->values)
          if (std::isfinite(x) && !exact_sum(x, cst)) {
            exact = false;
            break;
          }
      if (t.sinks)  // the sinks of the twin's heads
        for (double x : t.sinks->values) exact = exact && exact_sum(x, cst);
      if (!exact) continue;
      if (t.sinks) {
        t.sinks->dtype = DType::F64;
        for (double& x : t.sinks->values) x += cst;  // exact, checked above
      }
      if (t.bias) {
        t.bias->dtype = DType::F64;
        for (double& x : t.bias->values) x += cst;  // exact, checked above; -inf stays -inf
      } else {
        t.bias = FloatTensor{DType::F64, {1}, {cst}};
      }
      RowEnclosures r;
      if (!eval(t, r)) return;
      char what[96];
      std::snprintf(what, sizeof what, "when %.17g (%a) is added to every score", cst, cst);
      agree(Invariant::ShiftInvariance, r, heads(), what, nullptr, cst);
      return;
    }
  }

  // Under causal, keys after the last one the query may see are changed (keys and values, or
  // the inputs they are projected from).
  void causal() {
    if (c.causal == Causal::None) return;
    std::int64_t last = -1;
    for (std::int64_t j = 0; j < c.Nk; ++j)
      if (detail::positional(c, b, i, j)) last = j;
    if (last + 1 >= c.Nk) return;  // nothing in the future
    // the slice's future keys change in place (permutation() rewrites them)
    std::optional<Case> own;
    Case& t = twin_case(own);
    if (sdpa()) {
      perturb_rows(t.k.values, 0, last + 1, c.Nk, c.Dk);
      perturb_rows(t.v.values, 0, last + 1, c.Nk, c.Dv);
    } else {
      perturb_rows(t.x_kv.values, static_cast<std::size_t>(b * c.Nk * c.D), last + 1, c.Nk, c.D);
    }
    RowEnclosures r;
    if (!eval(t, r)) return;
    agree(Invariant::CausalDependence, r, heads(),
          "when keys " + std::to_string(last + 1) + ".." + std::to_string(c.Nk - 1) +
              " after the last visible key " + std::to_string(last) + " change");
    if (c.kind == Kind::Mha) mha_out(Invariant::CausalDependence, r, "when future keys change");
  }

  // For mha the mixed output must agree too when every head agrees.
  void mha_out(Invariant inv, const RowEnclosures& r, const std::string& what) {
    for (std::size_t e = 0; e < base.out.size(); ++e)
      if (!overlap(base.out[e], r.out.at(e))) {
        out.push_back({inv, b, 0, i, -1, static_cast<std::int64_t>(e),
                       "output " + show(base.out[e]) + " became " + show(r.out[e]) + " " + what});
        return;
      }
  }

  // Keys and values permuted together, with the mask's and bias's columns; positional rules
  // are first written into the mask, as they do not follow the keys.
  void permutation() {
    if (c.Nk < 2) return;
    std::vector<std::int64_t> perm(static_cast<std::size_t>(c.Nk));  // key j goes to perm[j]
    std::iota(perm.begin(), perm.end(), 0);
    std::reverse(perm.begin(), perm.end());
    if (c.Nk > 2) std::rotate(perm.begin(), perm.begin() + 1, perm.end());
    // the last twin of the slice: its keys, values and mask are rewritten
    std::optional<Case> own;
    Case& t = twin_case(own);
    if (sdpa()) {
      permute_sdpa(t, perm);
    } else {
      permute_mha(t, perm);
    }
    RowEnclosures r;
    if (!eval(t, r)) return;
    agree(Invariant::KeyPermutation, r, heads(), "when keys and values are permuted", &perm);
    if (c.kind == Kind::Mha) mha_out(Invariant::KeyPermutation, r, "when keys are permuted");
  }

  // On the unit's slice: its keys, values, mask row and bias row. The slice's keys and values
  // are the case's block of kv head kv_head(h), read from there.
  void permute_sdpa(Case& t, const std::vector<std::int64_t>& perm) const {
    const std::int64_t g = c.kv_head(h);
    auto permute_rows = [&](std::vector<double>& dst, const std::vector<double>& from, std::int64_t E) {
      const double* block = from.data() + (b * c.Hkv + g) * c.Nk * E;
      for (std::int64_t j = 0; j < c.Nk; ++j)
        std::copy_n(block + j * E, E, dst.begin() + perm[static_cast<std::size_t>(j)] * E);
    };
    permute_rows(t.k.values, c.k.values, c.Dk);
    permute_rows(t.v.values, c.v.values, c.Dv);
    if (c.mask || c.causal != Causal::None || c.window || c.seqlens_k) {
      // mask'[perm[j]] = mask[i, j] and positional(b, i, j), over the keys of row i
      BoolTensor m{{1, 1, 1, c.Nk}, std::vector<unsigned char>(static_cast<std::size_t>(c.Nk), 0)};
      for (std::int64_t j = 0; j < c.Nk; ++j)
        m.values[static_cast<std::size_t>(perm[static_cast<std::size_t>(j)])] =
            t.mask_at(0, 0, i, j) && detail::positional(c, b, i, j);
      t.mask = std::move(m);
      t.causal = Causal::None;
      t.window = false;
      t.seqlens_k.reset();  // now in the mask
    }
    if (t.bias && t.bias->shape.back() == c.Nk) {  // else constant over keys
      const std::vector<double> row = t.bias->values;  // the slice's bias row before the permutation
      for (std::int64_t j = 0; j < c.Nk; ++j)
        t.bias->values[static_cast<std::size_t>(perm[static_cast<std::size_t>(j)])] =
            row[static_cast<std::size_t>(j)];
    }
  }

  // On a copy of the whole case: the projected inputs' rows, the mask and bias columns.
  void permute_mha(Case& t, const std::vector<std::int64_t>& perm) const {
    for (std::int64_t blk = 0; blk < c.B; ++blk)
      for (std::int64_t j = 0; j < c.Nk; ++j)
        std::copy_n(c.x_kv.values.begin() + (blk * c.Nk + j) * c.D, c.D,
                    t.x_kv.values.begin() + (blk * c.Nk + perm[static_cast<std::size_t>(j)]) * c.D);
    const bool positional_rules = c.causal != Causal::None || c.window || c.seqlens_k;
    if (c.mask || positional_rules) {
      // mask'[b', h', i, perm[j]] = mask[b', h', i, j] and positional(i, j), of shape
      // [mB, mH, Nq, Nk]: the mask's own batch and head extents (1 where it broadcasts).
      const std::vector<std::int64_t> ms = c.mask ? c.mask->shape : std::vector<std::int64_t>{};
      auto extent = [&](std::size_t from_right) {
        return ms.size() > from_right ? ms[ms.size() - 1 - from_right] : std::int64_t{1};
      };
      // with sequence lengths the positions differ per batch
      const std::int64_t mb = c.seqlens_q || c.seqlens_k ? c.B : extent(3), mh = extent(2);
      BoolTensor m{{mb, mh, c.Nq, c.Nk}, std::vector<unsigned char>(static_cast<std::size_t>(mb * mh * c.Nq * c.Nk), 0)};
      for (std::int64_t bb = 0; bb < mb; ++bb)
        for (std::int64_t hh = 0; hh < mh; ++hh)
          for (std::int64_t qi = 0; qi < c.Nq; ++qi)
            for (std::int64_t j = 0; j < c.Nk; ++j) {
              const bool keep = c.mask_at(bb, hh, qi, j) && detail::positional(c, bb, qi, j);
              m.values[static_cast<std::size_t>(((bb * mh + hh) * c.Nq + qi) * c.Nk + perm[static_cast<std::size_t>(j)])] = keep;
            }
      t.mask = std::move(m);
      t.causal = Causal::None;
      t.window = false;
      t.seqlens_k.reset();  // now in the mask
    }
    if (c.bias && !c.bias->shape.empty() && c.bias->shape.back() == c.Nk) {  // else constant over keys
      const std::int64_t nrows = static_cast<std::int64_t>(c.bias->values.size()) / c.Nk;
      for (std::int64_t rr = 0; rr < nrows; ++rr)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          t.bias->values[static_cast<std::size_t>(rr * c.Nk + perm[static_cast<std::size_t>(j)])] =
              c.bias->values[static_cast<std::size_t>(rr * c.Nk + j)];
    }
  }

  // Changing another head's inputs leaves this unit's heads alone.
  void head_independence() {
    if (sdpa()) {
      const std::int64_t g = c.kv_head(h), per = c.Hq / c.Hkv;
      if (c.Hq > 1) {  // another query head's queries: one of the same kv head where there is one
        const std::int64_t other = per > 1 ? g * per + (h - g * per + 1) % per : (h + 1) % c.Hq;
        // both heads over kv head g (which keys the other head reads does not matter to head h)
        Case t = slice_frame(c, b, i, {h, other}, {g}, buffers);
        const Recycled done{t, buffers};
        const Borrowed kv{t, unit_slice};
        perturb_rows(t.q.values, static_cast<std::size_t>(c.Nq * c.Dk), i, i + 1, c.Dk);
        RowEnclosures r;
        if (eval(t, r))
          agree(Invariant::HeadIndependence, r, {h},
                "when the queries of head " + std::to_string(other) + " change");
      }
      if (c.Hkv > 1) {  // another kv head's keys and values
        const std::int64_t og = (g + 1) % c.Hkv;
        Case t = slice_frame(c, b, i, {h, og * per}, {g, og}, buffers);
        const Recycled done{t, buffers};
        const Borrowed kv{t, unit_slice};  // kv head g's block, then og's, perturbed
        append_perturbed(t.k.values, c, c.k, c.Dk, b, og);
        append_perturbed(t.v.values, c, c.v, c.Dv, b, og);
        RowEnclosures r;
        if (eval(t, r))
          agree(Invariant::HeadIndependence, r, {h},
                "when the keys and values of kv head " + std::to_string(og) + " change");
      }
      return;
    }
    if (c.Hq < 2) return;
    const std::int64_t r0 = i % c.Hq;  // the head whose projections change
    Case t = inputs_of(c);
    for (auto* w : {&t.w_q, &t.w_k, &t.w_v}) {
      const std::int64_t per = static_cast<std::int64_t>(w->values.size()) / c.Hq;
      perturb_rows(w->values, static_cast<std::size_t>(r0 * per), 0, 1, per);
    }
    RowEnclosures r;
    if (!eval(t, r)) return;
    std::vector<std::int64_t> others;
    for (std::int64_t hh = 0; hh < c.Hq; ++hh)
      if (hh != r0) others.push_back(hh);
    agree(Invariant::HeadIndependence, r, others,
          "when the projections of head " + std::to_string(r0) + " change");
  }
};

}  // namespace

std::vector<double> TwinBuffers::take(std::size_t n) {
  std::vector<double> v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // the smallest buffer that holds n, else the largest (it grows)
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (best == free_.end()) {
        best = it;
      } else if (best->capacity() >= n) {
        if (it->capacity() >= n && it->capacity() < best->capacity()) best = it;
      } else if (it->capacity() > best->capacity()) {
        best = it;
      }
    }
    if (best != free_.end()) {
      if (best->capacity() >= n) v = std::move(*best);  // else it goes: its contents do not matter
      free_.erase(best);
    }
  }
  if (v.capacity() < n) {
    v = std::vector<double>();
    reserve_large(v, n);
  }
  v.resize(n);
  return v;
}

void TwinBuffers::give(std::vector<double>&& v) {
  if (v.capacity() == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(v));
}

std::vector<Violation> check_twins(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                   const RowSourceFactory& rows, TwinBuffers* buffers) {
  RowEnclosures base;
  try {
    base = rows(c)->row(b, h, i);
  } catch (const FullyMaskedRow&) {
    return {};  // refused: the policy, checked elsewhere
  }
  return check_twins(c, b, h, i, rows, std::move(base), buffers);
}

std::vector<Violation> check_twins(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                   const RowSourceFactory& rows, RowEnclosures base,
                                   TwinBuffers* buffers) {
  std::vector<Violation> out;
  TwinChecker t{c, b, h, i, rows, out, std::move(base), buffers};
  bool any_valid = false;
  for (bool v : t.base.head_valid) any_valid = any_valid || v;
  if (!any_valid) return out;  // nothing to relate
  if (t.sdpa())  // room for a second kv head's block, which head_independence() adds
    t.unit_slice = slice(c, b, i, {h}, {c.kv_head(h)}, buffers, c.Hkv > 1 ? 2 : 1);
  const Recycled done{t.unit_slice, buffers};
  // In this order: the twins that keep the slice's keys and values, then those that change them.
  t.shift();
  t.head_independence();
  t.causal();
  t.permutation();
  return out;
}

}  // namespace attnoracle::oracle
