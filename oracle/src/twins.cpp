// Metamorphic relations on the reference: a row unit is evaluated again on twin cases whose
// exact result is known to relate to the original one, and the enclosures must agree.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {

using detail::overlap;
using detail::show;

namespace {

// A case's inputs and options without the file it was read from (twins are built in memory).
Case inputs_of(const Case& c) {
  Case t;
  t.path = c.path;
  t.kind = c.kind;
  t.input_dtype = c.input_dtype;
  t.output_dtype = c.output_dtype;
  t.scale = c.scale;
  t.softcap = c.softcap;
  t.causal = c.causal;
  t.window = c.window;
  t.window_left = c.window_left;
  t.window_right = c.window_right;
  t.masked_rows = c.masked_rows;
  t.want_weights = true;
  t.want_lse = true;
  t.B = c.B, t.Hq = c.Hq, t.Hkv = c.Hkv, t.Nq = c.Nq, t.Nk = c.Nk;
  t.Dk = c.Dk, t.Dv = c.Dv, t.D = c.D, t.Dout = c.Dout;
  t.q = c.q, t.k = c.k, t.v = c.v;
  t.x_q = c.x_q, t.x_kv = c.x_kv, t.w_q = c.w_q, t.w_k = c.w_k, t.w_v = c.w_v, t.w_o = c.w_o;
  t.mask = c.mask;
  t.bias = c.bias;
  t.query_mask = c.query_mask;
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

struct TwinChecker {
  const Case& c;
  std::int64_t b, h, i;  // the unit; h is 0 for mha
  const RowSourceFactory& rows;
  std::vector<Violation>& out;
  RowEnclosures base;

  std::vector<std::int64_t> heads() const {  // heads of the unit
    if (c.kind == Kind::Sdpa) return {h};
    std::vector<std::int64_t> all(static_cast<std::size_t>(c.Hq));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  std::size_t slot(std::int64_t head) const {
    return c.kind == Kind::Sdpa ? 0 : static_cast<std::size_t>(head);
  }

  bool eval(const Case& twin, RowEnclosures& r) {
    try {
      r = rows(twin)->row(b, h, i);
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
      const HeadDetail& a = base.heads.at(s);
      const HeadDetail& z = t.heads.at(s);
      for (std::size_t col = 0; col < a.out.size(); ++col)
        if (!overlap(a.out[col], z.out.at(col))) {
          out.push_back({inv, b, head, i, -1, static_cast<std::int64_t>(col),
                         "output " + show(a.out[col]) + " became " + show(z.out[col]) + " " + what});
          return;  // one report per relation and head is enough
        }
      const auto& wa = base.weights.at(s);
      const auto& wz = t.weights.at(s);
      for (std::size_t j = 0; j < wa.size(); ++j) {
        const std::size_t jt = perm ? static_cast<std::size_t>((*perm)[j]) : j;
        if (!overlap(wa[j], wz.at(jt))) {
          out.push_back({inv, b, head, i, static_cast<std::int64_t>(j), -1,
                         "weight " + show(wa[j]) + " became " + show(wz[jt]) + " " + what});
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
    for (double cst : {1.5, 1.0, 0.5, 0.25, 0x1p-8, 0x1p-16, 0x1p-24}) {
      bool exact = true;
      if (c.bias)
        for (double x : c.bias->values)
          if (std::isfinite(x) && !exact_sum(x, cst)) {
            exact = false;
            break;
          }
      if (c.sinks)
        for (double x : c.sinks->values) exact = exact && exact_sum(x, cst);
      if (!exact) continue;
      Case t = inputs_of(c);
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
      if (detail::positional(c, i, j)) last = j;
    if (last + 1 >= c.Nk) return;  // nothing in the future
    Case t = inputs_of(c);
    if (c.kind == Kind::Sdpa) {
      for (std::int64_t g = 0; g < c.Hkv; ++g) {
        perturb_rows(t.k.values, static_cast<std::size_t>((b * c.Hkv + g) * c.Nk * c.Dk), last + 1, c.Nk, c.Dk);
        perturb_rows(t.v.values, static_cast<std::size_t>((b * c.Hkv + g) * c.Nk * c.Dv), last + 1, c.Nk, c.Dv);
      }
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
    Case t = inputs_of(c);
    auto permute_rows = [&](std::vector<double>& dst, const std::vector<double>& src,
                            std::int64_t blocks, std::int64_t E) {
      for (std::int64_t blk = 0; blk < blocks; ++blk)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          std::copy_n(src.begin() + (blk * c.Nk + j) * E, E,
                      dst.begin() + (blk * c.Nk + perm[static_cast<std::size_t>(j)]) * E);
    };
    if (c.kind == Kind::Sdpa) {
      permute_rows(t.k.values, c.k.values, c.B * c.Hkv, c.Dk);
      permute_rows(t.v.values, c.v.values, c.B * c.Hkv, c.Dv);
    } else {
      permute_rows(t.x_kv.values, c.x_kv.values, c.B, c.D);
    }
    const bool positional_rules = c.causal != Causal::None || c.window;
    if (c.mask || positional_rules) {
      // mask'[b', h', i, perm[j]] = mask[b', h', i, j] and positional(i, j), of shape
      // [mB, mH, Nq, Nk]: the mask's own batch and head extents (1 where it broadcasts).
      const std::vector<std::int64_t> ms = c.mask ? c.mask->shape : std::vector<std::int64_t>{};
      auto extent = [&](std::size_t from_right) {
        return ms.size() > from_right ? ms[ms.size() - 1 - from_right] : std::int64_t{1};
      };
      const std::int64_t mb = extent(3), mh = extent(2);
      BoolTensor m{{mb, mh, c.Nq, c.Nk}, std::vector<unsigned char>(static_cast<std::size_t>(mb * mh * c.Nq * c.Nk), 0)};
      for (std::int64_t bb = 0; bb < mb; ++bb)
        for (std::int64_t hh = 0; hh < mh; ++hh)
          for (std::int64_t qi = 0; qi < c.Nq; ++qi)
            for (std::int64_t j = 0; j < c.Nk; ++j) {
              const bool keep = c.mask_at(bb, hh, qi, j) && detail::positional(c, qi, j);
              m.values[static_cast<std::size_t>(((bb * mh + hh) * c.Nq + qi) * c.Nk + perm[static_cast<std::size_t>(j)])] = keep;
            }
      t.mask = std::move(m);
      t.causal = Causal::None;
      t.window = false;
    }
    if (c.bias && !c.bias->shape.empty() && c.bias->shape.back() == c.Nk) {  // else constant over keys
      const std::int64_t nrows = static_cast<std::int64_t>(c.bias->values.size()) / c.Nk;
      for (std::int64_t rr = 0; rr < nrows; ++rr)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          t.bias->values[static_cast<std::size_t>(rr * c.Nk + perm[static_cast<std::size_t>(j)])] =
              c.bias->values[static_cast<std::size_t>(rr * c.Nk + j)];
    }
    RowEnclosures r;
    if (!eval(t, r)) return;
    agree(Invariant::KeyPermutation, r, heads(), "when keys and values are permuted", &perm);
    if (c.kind == Kind::Mha) mha_out(Invariant::KeyPermutation, r, "when keys are permuted");
  }

  // Changing another head's inputs leaves this unit's heads alone.
  void head_independence() {
    if (c.kind == Kind::Sdpa) {
      if (c.Hq > 1) {  // another query head's queries
        const std::int64_t other = (h + 1) % c.Hq;
        Case t = inputs_of(c);
        perturb_rows(t.q.values, static_cast<std::size_t>((b * c.Hq + other) * c.Nq * c.Dk), 0, c.Nq, c.Dk);
        RowEnclosures r;
        if (eval(t, r))
          agree(Invariant::HeadIndependence, r, {h},
                "when the queries of head " + std::to_string(other) + " change");
      }
      const std::int64_t g = c.kv_head(h);
      if (c.Hkv > 1) {  // another kv head's keys and values
        const std::int64_t og = (g + 1) % c.Hkv;
        Case t = inputs_of(c);
        perturb_rows(t.k.values, static_cast<std::size_t>((b * c.Hkv + og) * c.Nk * c.Dk), 0, c.Nk, c.Dk);
        perturb_rows(t.v.values, static_cast<std::size_t>((b * c.Hkv + og) * c.Nk * c.Dv), 0, c.Nk, c.Dv);
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

std::vector<Violation> check_twins(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                   const RowSourceFactory& rows) {
  std::vector<Violation> out;
  TwinChecker t{c, b, h, i, rows, out, {}};
  {
    Case base = inputs_of(c);
    if (!t.eval(base, t.base)) return out;  // refused: the policy, checked elsewhere
  }
  bool any_valid = false;
  for (bool v : t.base.head_valid) any_valid = any_valid || v;
  if (!any_valid) return out;  // nothing to relate
  t.shift();
  t.causal();
  t.permutation();
  t.head_independence();
  return out;
}

}  // namespace attnoracle::oracle
