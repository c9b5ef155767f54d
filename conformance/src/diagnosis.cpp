// What a failing case's failing elements have in common. Each detector looks at one pattern and
// says nothing unless every failing element (or row) it considers fits it.
#include "attnoracle/conformance/diagnosis.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "diagnosis_serving.hpp"

namespace attnoracle::conformance {
namespace {

constexpr const char* kTensorNames[3] = {"out", "weights", "lse"};

int tensor_of(const std::string& name) {
  return name == "out" ? 0 : name == "weights" ? 1 : name == "lse" ? 2 : -1;
}

// Heads on the tensor's head axis (1 for mha's out, whose shape is [B, Nq, Dout]).
bool has_head_axis(int t, std::size_t rank) { return t != 0 || rank == 4; }

std::string fmt(const char* f, double x) {
  char buf[48];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}
std::string g4(double x) { return fmt("%.4g", x); }

// "1, 2, 5" (at most `cap` values, then "...").
std::string list(const std::vector<std::int64_t>& v, std::size_t cap = 8) {
  std::string s;
  for (std::size_t k = 0; k < v.size() && k < cap; ++k) s += (k ? ", " : "") + std::to_string(v[k]);
  if (v.size() > cap) s += ", ...";
  return s;
}
std::string plural(std::int64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

int Diagnosis::tensor_index(const std::string& name) { return tensor_of(name); }

void Diagnosis::record(int t, const std::vector<std::int64_t>& shape, std::size_t k, double expected, double actual,
                       double ratio) {
  if (t < 0 || shape.size() < 3) return;
  // [b, h, i, j]: out and weights [B, H, Nq, W], lse [B, H, Nq] (j -1), mha's out [B, Nq, W] (h -1)
  const std::int64_t H = has_head_axis(t, shape.size()) ? shape[1] : 1, Nq = shape.size() == 4 || t == 2 ? shape[2] : shape[1];
  // b * H + h (h taken as 0 where there is no head axis in the shape): one division
  const auto rest = static_cast<std::int64_t>(k);
  const std::int64_t head = shape.size() == 4 ? rest / (shape[2] * shape[3])
                            : t == 2          ? rest / shape[2]
                                              : rest / (shape[1] * shape[2]) * H;
  auto& ht = head_acc[t];
  if (ht.empty()) ht.resize(static_cast<std::size_t>(shape[0] * H));
  Acc& ha = ht[static_cast<std::size_t>(head)];
  ha.worst = std::max(ha.worst, ratio);
  if (!(ratio > 1)) return;
  std::int64_t c[4] = {0, -1, 0, -1};
  if (shape.size() == 4) {
    auto r = rest;
    for (int d = 3; d >= 0; --d) {
      c[d] = r % shape[static_cast<std::size_t>(d)];
      r /= shape[static_cast<std::size_t>(d)];
    }
  } else if (t == 2) {
    c[2] = rest % shape[2];
    c[1] = rest / shape[2] % shape[1];
    c[0] = rest / shape[2] / shape[1];
  } else {
    c[3] = rest % shape[2];
    c[2] = rest / shape[2] % shape[1];
    c[0] = rest / shape[2] / shape[1];
  }
  ++ha.failed;
  Acc& ra = row_acc[t][(c[0] * H + std::max<std::int64_t>(c[1], 0)) * Nq + c[2]];
  ++ra.failed;
  ra.worst = std::max(ra.worst, ratio);
  ++failed_total;
  if (failed.size() < kMaxElements) failed.push_back({t, c[0], c[1], c[2], c[3], expected, actual, ratio});
}

namespace {

// The rules that can mask key j of row (b, h, i), in the order a masked key is attributed to
// them: causal, window, mask, -inf bias. `causal_only` is the case's causal rule without its
// window (the window follows the causal alignment, so it cannot be taken alone).
enum Rule { kSeqlens, kCausal, kWindow, kMask, kBias, kRules };

struct Rules {
  const Case& c;
  Case causal_only;
  bool key_padding = false;  // the mask is the same for every query and head

  explicit Rules(const Case& cc) : c(cc) {
    causal_only.causal = c.causal;
    causal_only.Nq = c.Nq;
    causal_only.Nk = c.Nk;
    causal_only.B = c.B;
    causal_only.seqlens_q = c.seqlens_q;  // the alignment, per batch
    causal_only.seqlens_k = c.seqlens_k;
    // key padding: every query of a (batch, head) masks the same keys (trailing dims [Nq, Nk])
    if (c.mask && c.mask->shape.size() >= 2) {
      const auto& m = c.mask->values;
      const auto per = static_cast<std::size_t>(c.Nq * c.Nk), nk = static_cast<std::size_t>(c.Nk);
      key_padding = per > 0 && m.size() % per == 0;
      for (std::size_t k = 0; k < m.size() && key_padding; ++k) key_padding = (m[k] != 0) == (m[k / per * per + k % nk] != 0);
    }
  }
  // The rule that masks key j, or kRules when it is allowed.
  Rule masking(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (j >= c.key_length(b)) return kSeqlens;
    if (!causal_only.position_allowed(b, i, j)) return kCausal;
    if (!c.position_allowed(b, i, j)) return kWindow;
    if (!c.mask_at(b, h, i, j)) return kMask;
    if (c.bias_at(b, h, i, j) == -INFINITY) return kBias;
    return kRules;
  }
  std::string name(Rule r) const {
    switch (r) {
      case kSeqlens: return "seqlens_k";
      case kCausal: return "causal (" + std::string(causal_name(c.causal)) + ")";
      case kWindow: return "window (" + std::to_string(c.window_left) + ", " + std::to_string(c.window_right) + ")";
      case kMask: return key_padding ? "mask (key padding)" : "mask";
      case kBias: return "-inf bias";
      default: return "?";
    }
  }
  // Does rule r mask some key of row (b, h, i) that the rules before it allow?
  bool masks_some(Rule r, std::int64_t b, std::int64_t h, std::int64_t i) const {
    const std::int64_t lk = c.key_length(b);
    if (r == kSeqlens) return lk < c.Nk;
    const auto co = causal_only.key_range(b, i);
    if (r == kCausal) return c.causal != Causal::None && co.last < lk - 1;
    if (r == kWindow) {
      const auto all = c.key_range(b, i);
      return c.window && (all.first > co.first || all.last < co.last);
    }
    if ((r == kMask && !c.mask) || (r == kBias && !c.bias)) return false;
    const auto kr = c.key_range(b, i);
    for (std::int64_t j = kr.first; j <= kr.last; ++j)
      if (masking(b, h, i, j) == r) return true;
    return false;
  }
};

struct Patterns {
  Patterns(const Case& cc, const Diagnosis& dd, const SafeTensorsFile& g, const SafeTensorsFile& r)
      : c(cc), d(dd), golden(g), result(r), rules(cc), mha(cc.kind == Kind::Mha) {}
  const Case& c;
  const Diagnosis& d;
  const SafeTensorsFile& golden;
  const SafeTensorsFile& result;
  std::vector<Finding> out;
  Rules rules;
  bool mha;
  // rows (b, h, i) of [B, Hq, Nq]: compared (valid, with a key) and failing (any tensor; a
  // failing row of mha's out fails every head of the token)
  std::vector<char> compared, failing;
  std::int64_t n_failing = 0, n_passing = 0;

  std::size_t row(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i);
  }

  void rows() {
    RowFlags f = row_flags(c, d, false);
    compared = std::move(f.compared);
    failing = std::move(f.failing);
    for (std::size_t r = 0; r < failing.size(); ++r) {
      n_failing += failing[r];
      n_passing += compared[r] && !failing[r];
    }
  }
  template <class F>
  void each_row(F&& f) const {
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          if (compared[row(b, h, i)]) f(b, h, i, failing[row(b, h, i)] != 0);
  }
  void add(std::string name, std::string text, std::int64_t elements) {
    out.push_back({std::move(name), std::move(text), elements});
  }

  // Weights at masked positions that are not 0, by the rule that masks them.
  void masked_weights() {
    std::int64_t by[kRules] = {}, n = 0;
    double largest = 0;
    for (const auto& e : d.failed) {
      if (e.tensor != 1 || e.actual == 0) continue;
      const Rule r = rules.masking(e.b, e.h, e.i, e.j);
      if (r == kRules) continue;
      ++by[r];
      ++n;
      largest = std::max(largest, std::fabs(e.actual));
    }
    if (n == 0) return;
    std::string text = plural(n, "masked position", "masked positions") + " got weight (largest " + g4(largest) + "): masked by ";
    std::string sep;
    for (int r = 0; r < kRules; ++r)
      if (by[r] > 0) {
        text += sep + rules.name(static_cast<Rule>(r)) + (n == by[r] ? "" : " (" + std::to_string(by[r]) + ")");
        sep = ", ";
      }
    add("masked_weight", text, n);
    masked_found = true;
  }
  bool masked_found = false;

  // Every failing row has keys that one rule masks, and the rows without such keys pass.
  void rule_rows() {
    if (masked_found || n_failing == 0) return;
    for (int r = 0; r < kRules; ++r) {
      std::int64_t with = 0, fail_with = 0, without = 0;
      bool all = true;
      each_row([&](std::int64_t b, std::int64_t h, std::int64_t i, bool f) {
        const bool m = rules.masks_some(static_cast<Rule>(r), b, h, i);
        with += m;
        without += !m;
        fail_with += m && f;
        all = all && (m || !f);
      });
      // most of the rows with such keys fail, and there are rows without them (all passing)
      if (all && without > 0 && 2 * fail_with >= with) {
        add("masked_rows", "every failing row (" + std::to_string(n_failing) + ") has keys masked by " +
                               rules.name(static_cast<Rule>(r)) + "; the " +
                               plural(without, "row without such keys passes", "rows without such keys pass"),
            d.failed_total);
        return;
      }
    }
  }

  // The failing rows all span more keys than a block (a power of two of at least 16), and rows
  // within a block pass: a blocked kernel going wrong past its first block.
  void blocking() {
    if (n_failing == 0 || n_passing == 0) return;
    std::int64_t fmin = INT64_MAX, fmax = 0, pmin = INT64_MAX, short_pass = 0;
    each_row([&](std::int64_t b, std::int64_t, std::int64_t i, bool f) {
      const std::int64_t span = c.key_range(b, i).last + 1;  // keys 0..last, as a kernel loops over them
      if (f) {
        fmin = std::min(fmin, span);
        fmax = std::max(fmax, span);
      } else {
        pmin = std::min(pmin, span);
      }
    });
    if (fmin <= 16) return;
    std::int64_t block = 16;
    while (2 * block < fmin) block *= 2;  // the largest power of two below fmin
    each_row([&](std::int64_t b, std::int64_t, std::int64_t i, bool f) { short_pass += !f && c.key_range(b, i).last + 1 <= block; });
    if (short_pass == 0) return;
    add("rows_beyond_keys",
        "failures only in rows of more than " + std::to_string(block) + " keys: the " +
            plural(n_failing, "failing row spans", "failing rows span") + " " + std::to_string(fmin) +
            (fmax > fmin ? ".." + std::to_string(fmax) : std::string()) + " keys; the " +
            plural(short_pass, "row", "rows") + " of at most " + std::to_string(block) + " keys " +
            (short_pass == 1 ? "passes" : "pass"),
        d.failed_total);
  }

  // Every failing row has its largest weight (the reference's) past the first block of keys, and
  // rows with it in the first block pass: a blocked kernel that goes wrong when the row's maximum
  // changes after its first block (no rescaling).
  void max_past_block() {
    const RawTensor* w = golden.find("weights.ref");
    if (mha || n_failing == 0 || n_passing == 0 || !w || w->dtype != DType::F64 ||
        w->data.size() != static_cast<std::size_t>(c.B * c.Hq * c.Nq * c.Nk) * 8)
      return;
    std::vector<std::int64_t> at(failing.size(), -1);  // the first key of largest weight
    each_row([&](std::int64_t b, std::int64_t h, std::int64_t i, bool) {
      const std::size_t r = row(b, h, i);
      double best = -1;
      for (std::int64_t j = 0; j < c.Nk; ++j) {
        double x;
        std::memcpy(&x, w->data.data() + 8 * (r * static_cast<std::size_t>(c.Nk) + static_cast<std::size_t>(j)), 8);
        if (x > best) best = x, at[r] = j;
      }
    });
    std::int64_t block = 16;
    while (2 * block < c.Nk) block *= 2;
    for (; block >= 16; block /= 2) {
      std::int64_t past = 0, past_fail = 0, within_pass = 0;
      bool all = true;
      each_row([&](std::int64_t b, std::int64_t h, std::int64_t i, bool f) {
        const bool p = at[row(b, h, i)] >= block;
        past += p;
        past_fail += p && f;
        within_pass += !p && !f;
        all = all && (p || !f);
      });
      // most rows with the maximum past the block fail; some with it within pass
      if (!all || within_pass == 0 || 2 * past_fail < past) continue;
      add("max_past_block",
          "every failing row (" + std::to_string(n_failing) + ") has its largest weight past the first " +
              std::to_string(block) + " keys (" + std::to_string(past_fail) + " of the " + std::to_string(past) +
              " such rows fail); the " + plural(within_pass, "row", "rows") + " with it in keys 0.." +
              std::to_string(block - 1) + (within_pass == 1 ? " passes" : " pass"),
          d.failed_total);
      return;
    }
  }

  // Failures in some batches, some heads or some kv groups only (complete counts per head).
  void heads() {
    std::set<std::int64_t> fb, fh;
    bool head_axis = false;
    for (int t = 0; t < 3; ++t) {
      const auto& hs = d.head_acc[t];
      if (hs.empty()) continue;
      const bool axis = !(t == 0 && mha);
      const std::int64_t H = axis ? c.Hq : 1;
      for (std::size_t k = 0; k < hs.size(); ++k)
        if (hs[k].failed > 0) {
          fb.insert(static_cast<std::int64_t>(k) / H);
          if (axis) fh.insert(static_cast<std::int64_t>(k) % H);
        }
      head_axis = head_axis || axis;
    }
    if (c.B > 1 && !fb.empty() && static_cast<std::int64_t>(fb.size()) < c.B) {
      const std::vector<std::int64_t> v(fb.begin(), fb.end());
      add(v.size() == 1 ? "one_batch" : "some_batches",
          "failures only in batch" + std::string(v.size() == 1 ? " " : "es ") + list(v) + " of " + std::to_string(c.B) +
              "; the other batches pass",
          d.failed_total);
    }
    // a failing mha out has no head: the heads say nothing then
    bool mha_out = mha && !d.row_acc[0].empty();
    if (!head_axis || mha_out || c.Hq < 2 || fh.empty() || static_cast<std::int64_t>(fh.size()) >= c.Hq) return;
    const std::vector<std::int64_t> v(fh.begin(), fh.end());
    std::string text = "failures only in query head" + std::string(v.size() == 1 ? " " : "s ") + list(v) + " of " +
                       std::to_string(c.Hq);
    if (c.Hkv > 1 && c.Hkv < c.Hq) {
      // whole kv groups (h / (Hq / Hkv)), or heads spread over groups
      std::set<std::int64_t> groups;
      for (auto h : v) groups.insert(c.kv_head(h));
      const std::int64_t per = c.Hq / c.Hkv;
      if (static_cast<std::int64_t>(v.size()) == per * static_cast<std::int64_t>(groups.size())) {
        const std::vector<std::int64_t> g(groups.begin(), groups.end());
        add(g.size() == 1 ? "one_kv_group" : "kv_groups",
            "failures only in the query heads of kv head" + std::string(g.size() == 1 ? " " : "s ") + list(g) + " of " +
                std::to_string(c.Hkv) + " (query heads " + list(v) + ")",
            d.failed_total);
        return;
      }
      text += " (kv heads, grouped mapping h / " + std::to_string(per) + ": ";
      for (std::size_t k = 0; k < v.size() && k < 8; ++k)
        text += (k ? ", " : "") + std::to_string(v[k]) + " -> " + std::to_string(c.kv_head(v[k]));
      text += v.size() > 8 ? ", ...)" : ")";
    }
    add(v.size() == 1 ? "one_head" : "some_heads", text + "; the other heads pass", d.failed_total);
  }

  // out of a failing head equals (closely) the reference of another head of the same batch.
  void head_match() {
    const RawTensor* y = result.find("out");
    const RawTensor* x = golden.find("out.ref");
    if (mha || c.Hq < 2 || !y || !x || y->shape != x->shape || y->shape.size() != 4 || x->dtype != DType::F64) return;
    const auto& hs = d.head_acc[0];
    if (hs.empty()) return;
    const std::int64_t Nq = c.Nq, W = y->shape[3];
    auto at = [&](const RawTensor& t, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t e) {
      const auto k = static_cast<std::size_t>(((b * c.Hq + h) * Nq + i) * W + e);
      return decode_float(t.dtype, t.data.data() + k * dtype_size(t.dtype));
    };
    // max |y(b, h) - x(b, g)| / max |x(b, g)| over the valid rows that have a key
    auto distance = [&](std::int64_t b, std::int64_t h, std::int64_t g) {
      double num = 0, den = 0;
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!compared[row(b, h, i)] || !compared[row(b, g, i)]) continue;
        for (std::int64_t e = 0; e < W; ++e) {
          const double xv = at(*x, b, g, i, e), yv = at(*y, b, h, i, e);
          num = std::max(num, std::fabs(yv - xv));
          den = std::max(den, std::fabs(xv));
        }
      }
      return den > 0 ? num / den : INFINITY;
    };
    std::vector<std::string> pairs;
    std::int64_t n = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h) {
        if (hs[static_cast<std::size_t>(b * c.Hq + h)].failed == 0) continue;
        const double own = distance(b, h, h);
        std::int64_t best = -1;
        double bd = INFINITY;
        for (std::int64_t g = 0; g < c.Hq; ++g) {
          if (g == h) continue;
          const double dg = distance(b, h, g);
          if (dg < bd) bd = dg, best = g;
        }
        // close to another head's reference (1%), and ten times closer than to its own
        if (best < 0 || !(bd < 1e-2) || !(bd * 10 < own)) continue;
        ++n;
        if (pairs.size() < 8)
          pairs.push_back("head " + std::to_string(h) + " = reference of head " + std::to_string(best) +
                          (c.B > 1 ? " (batch " + std::to_string(b) + ")" : std::string()));
      }
    if (n == 0) return;
    std::string text = "out of " + plural(n, "failing head matches", "failing heads match") + " the reference of another head: ";
    for (std::size_t k = 0; k < pairs.size(); ++k) text += (k ? ", " : "") + pairs[k];
    if (static_cast<std::size_t>(n) > pairs.size()) text += ", ...";
    add("other_head", text, d.failed_total);
  }

  // The failing elements of tensor t are all the exact values times one factor, or plus one shift.
  void constant(int t) {
    std::vector<const FailedElement*> es;
    double big = 0;
    for (const auto& e : d.failed)
      if (e.tensor == t && std::isfinite(e.actual) && std::isfinite(e.expected)) {
        es.push_back(&e);
        big = std::max(big, std::fabs(e.expected));
      }
    if (es.size() < 4 || !(big > 0)) return;  // fewer elements say little of a constant
    double rmin = INFINITY, rmax = -INFINITY, smin = INFINITY, smax = -INFINITY;
    std::size_t nr = 0;
    for (const auto* e : es) {
      const double s = e->actual - e->expected;
      smin = std::min(smin, s);
      smax = std::max(smax, s);
      if (std::fabs(e->expected) < 1e-3 * big) continue;  // a ratio of nearly 0 says nothing
      const double r = e->actual / e->expected;
      rmin = std::min(rmin, r);
      rmax = std::max(rmax, r);
      ++nr;
    }
    const std::string name = kTensorNames[t];
    const double r = (rmin + rmax) / 2;
    // one factor within 1% over the failing elements, and not 1
    if (nr >= 4 && rmax - rmin <= 1e-2 * std::fabs(r) && std::fabs(r - 1) > 1e-2) {
      std::string why;
      if (std::fabs(r * std::log(2.0) - 1) < 1e-2) why = " = 1 / ln 2: log2 in place of ln";
      else if (std::fabs(r / std::log(2.0) - 1) < 1e-2) why = " = ln 2: ln in place of log2";
      add(name + "_factor",
          name + " is the exact value times a constant " + g4(r) + why + " (" + fmt("%.4g", rmin) + ".." + g4(rmax) +
              " over " + plural(static_cast<std::int64_t>(nr), "failing element", "failing elements") + ")",
          static_cast<std::int64_t>(es.size()));
      return;
    }
    const double s = (smin + smax) / 2;
    // one shift within 1% over the failing elements (or within the output's rounding: 4 u of
    // the largest value, for a shift smaller than the values)
    if (smax - smin <= std::max(1e-2 * std::fabs(s), 4 * unit_roundoff(c.dtype_of("out")) * big) && s != 0) {
      add(name + "_shift",
          name + " is the exact value plus a constant " + fmt("%+.4g", s) + " (" + g4(smin) + ".." + g4(smax) + " over " +
              plural(static_cast<std::int64_t>(es.size()), "failing element", "failing elements") + ")",
          static_cast<std::int64_t>(es.size()));
    }
  }

  // The errors of a tensor's failing elements all point one way (weights at masked positions
  // aside: they are reported by rule).
  void one_sign(int t) {
    if (masked_found) return;  // the weight moved to masked keys: every other error follows from it
    std::int64_t up = 0, down = 0;
    for (const auto& e : d.failed) {
      if (e.tensor != t || !std::isfinite(e.actual) || !std::isfinite(e.expected)) continue;
      if (t == 1 && rules.masking(e.b, e.h, e.i, e.j) != kRules) continue;
      up += e.actual > e.expected;
      down += e.actual < e.expected;
    }
    const std::int64_t n = up + down;
    if (n < 8) return;
    const std::int64_t most = std::max(up, down);
    if (static_cast<double>(most) < 0.95 * static_cast<double>(n)) return;
    add(std::string(kTensorNames[t]) + "_one_sign",
        "errors in one direction: " + std::to_string(most) + " of " + std::to_string(n) + " failing " + kTensorNames[t] +
            " elements are " + (up >= down ? "above" : "below") + " the exact values",
        n);
  }

  // The failing rows are exactly the rows of the largest scores.
  void score_magnitude() {
    if (n_failing < 2 || n_passing < 2) return;
    const auto mags = row_magnitudes(c);
    double fmin = INFINITY, fmax = 0, pmax = 0;
    each_row([&](std::int64_t b, std::int64_t h, std::int64_t i, bool f) {
      const auto k = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * c.Hq + h) * c.Nq + i);
      if (k >= mags.size()) return;
      const double s = mags[k].score_abs;
      if (f) {
        fmin = std::min(fmin, s);
        fmax = std::max(fmax, s);
      } else {
        pmax = std::max(pmax, s);
      }
    });
    if (!(fmin > pmax)) return;
    add("large_scores",
        "failures only in the rows of largest scores: the " + plural(n_failing, "failing row has", "failing rows have") +
            " max |S| " + g4(fmin) + (fmax > fmin ? ".." + g4(fmax) : std::string()) + ", the " +
            plural(n_passing, "passing row", "passing rows") + " at most " + g4(pmax),
        d.failed_total);
  }

  // Paged caches and splits (diagnosis_serving.cpp): the page or split the failing rows share.
  void serving() {
    if (mha) return;
    const RowFlags f{compared, failing};
    for (auto& x : paged_findings(c, f, d)) out.push_back(std::move(x));
    if (c.kv_split_size > 0)
      for (auto& x : empty_split_rows(c, f, d.failed_total)) out.push_back(std::move(x));
  }

  void run() {
    rows();
    serving();
    masked_weights();
    rule_rows();
    blocking();
    max_past_block();
    heads();
    head_match();
    constant(2);
    constant(0);
    one_sign(0);
    one_sign(2);
    one_sign(1);
    score_magnitude();
  }
};

}  // namespace

RowFlags row_flags(const Case& c, const Diagnosis& d, bool keyless) {
  const bool mha = c.kind == Kind::Mha;
  const std::size_t n = static_cast<std::size_t>(c.B * c.Hq * c.Nq);
  RowFlags f{std::vector<char>(n), std::vector<char>(n)};
  auto row = [&](std::int64_t b, std::int64_t h, std::int64_t i) { return static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i); };
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        f.compared[row(b, h, i)] = c.query_valid(b, i) && (keyless || c.row_has_key(b, h, i));
  for (int t = 0; t < 3; ++t)
    for (const auto& [key, acc] : d.row_acc[t]) {
      if (t == 0 && mha) {  // key b * Nq + i
        for (std::int64_t h = 0; h < c.Hq; ++h) f.failing[row(key / c.Nq, h, key % c.Nq)] = 1;
      } else if (static_cast<std::size_t>(key) < n) {
        f.failing[static_cast<std::size_t>(key)] = 1;
      }
    }
  for (std::size_t r = 0; r < n; ++r)
    if (!f.compared[r]) f.failing[r] = 0;  // fully masked or padding rows say nothing here
  return f;
}

std::vector<Finding> find_patterns(const Case& c, const Diagnosis& d, const SafeTensorsFile& golden,
                                   const SafeTensorsFile& result) {
  if (d.failed_total == 0) return {};
  Patterns p(c, d, golden, result);
  p.run();
  return std::move(p.out);
}

void diagnose(const Case& c, const SafeTensorsFile& golden, const SafeTensorsFile& result, CaseReport& rep) {
  Diagnosis& d = rep.diagnosis;
  // every (b, h) of every compared tensor, those that record never saw with 0
  for (const auto& tr : rep.tensors) {
    const int t = tensor_of(tr.tensor);
    if (t < 0) continue;
    const bool axis = !(t == 0 && c.kind == Kind::Mha);
    const std::int64_t H = axis ? c.Hq : 1;
    auto& hs = d.head_acc[t];
    if (hs.empty()) hs.resize(static_cast<std::size_t>(c.B * H));
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const auto& a = hs[static_cast<std::size_t>(b * H + h)];
        d.heads.push_back({tr.tensor, b, axis ? h : -1, a.failed, a.worst});
      }
  }
  for (int t = 0; t < 3; ++t) {
    std::vector<std::pair<std::int64_t, Diagnosis::Acc>> rs(d.row_acc[t].begin(), d.row_acc[t].end());
    std::sort(rs.begin(), rs.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    const bool axis = !(t == 0 && c.kind == Kind::Mha);
    const std::int64_t H = axis ? c.Hq : 1;
    d.failing_rows += static_cast<std::int64_t>(rs.size());
    for (const auto& [key, a] : rs) {
      if (d.rows.size() >= Diagnosis::kMaxRows) break;
      d.rows.push_back({kTensorNames[t], key / c.Nq / H, axis ? key / c.Nq % H : -1, key % c.Nq, a.failed, a.worst});
    }
  }
  if (rep.status == CaseStatus::Fail) d.findings = find_patterns(c, d, golden, result);
}

}  // namespace attnoracle::conformance
