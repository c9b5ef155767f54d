// The gradients' metamorphic relations: twin evaluations of one batch entry and kv head of a
// case (kind mha: of the whole case, for linearity only), compared with the case's golden
// gradients bit for bit.
//
// The slice: batch b and the G query heads of kv head g, as a case of its own (B = 1, Hkv = 1).
// Batches and kv heads do not interact (each row's softmax reads its own batch and kv head, and
// dk, dv add up only the query heads of their kv head), so the exact gradients of the slice are
// those of the whole case at (b, g), except dbias where the bias is broadcast over batches or
// over the heads of other kv heads (then the case's dbias adds up other slices too).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {

namespace {

// The extent of a right-aligned broadcast shape along dimension d of [B, Hq, Nq, Nk].
std::int64_t extent(const std::vector<std::int64_t>& s, std::size_t d) {
  return d + s.size() >= 4 ? s[d + s.size() - 4] : 1;
}

struct Slice {
  Case t;
  std::int64_t b, g, G;
  std::int64_t eh = 1, eq = 1, ek = 1;  // the bias's extents in the slice, when there is one
  bool dbias_faithful = false;          // the slice's dbias is the case's, element for element
};

// Batch b and kv head g of an sdpa case with dout, as a case of its own asking for the same
// gradients only. Mask and bias keep their extents (1 where the case broadcasts).
Slice slice(const Case& c, std::int64_t b, std::int64_t g) {
  Slice s{Case{}, b, g, c.Hq / c.Hkv};
  Case& t = s.t;
  const std::int64_t G = s.G, h0 = g * G;
  t = detail::options_only(c);
  t.want_dq = c.want_dq, t.want_dk = c.want_dk, t.want_dv = c.want_dv, t.want_dbias = c.want_dbias;
  t.B = 1, t.Hq = G, t.Hkv = 1, t.Nq = c.Nq, t.Nk = c.Nk, t.Dk = c.Dk, t.Dv = c.Dv;
  auto rows = [&](const FloatTensor& x, std::int64_t first, std::int64_t heads, std::int64_t N,
                  std::int64_t E, std::int64_t H) {
    const auto from = x.values.begin() + (b * H + first) * N * E;
    return FloatTensor{x.dtype, {1, heads, N, E}, std::vector<double>(from, from + heads * N * E)};
  };
  t.q = rows(c.q, h0, G, c.Nq, c.Dk, c.Hq);
  t.dout = rows(*c.dout, h0, G, c.Nq, c.Dv, c.Hq);
  t.k = rows(c.k, g, 1, c.Nk, c.Dk, c.Hkv);
  t.v = rows(c.v, g, 1, c.Nk, c.Dv, c.Hkv);
  if (c.mask) {
    const auto& sh = c.mask->shape;
    const std::int64_t mh = extent(sh, 1) == 1 ? 1 : G, mq = extent(sh, 2), mk = extent(sh, 3);
    BoolTensor m{{1, mh, mq, mk}, {}};
    for (std::int64_t k = 0; k < mh; ++k)
      for (std::int64_t i = 0; i < mq; ++i)
        for (std::int64_t j = 0; j < mk; ++j) m.values.push_back(c.mask_at(b, h0 + k, i, j) ? 1 : 0);
    t.mask = std::move(m);
  }
  if (c.dropout) {  // the keep mask of the slice's rows, in full
    BoolTensor m{{1, G, c.Nq, c.Nk}, {}};
    for (std::int64_t k = 0; k < G; ++k)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        for (std::int64_t j = 0; j < c.Nk; ++j) m.values.push_back(c.kept(b, h0 + k, i, j) ? 1 : 0);
    t.dropout = Case::Dropout{c.dropout->p, std::move(m)};
  }
  if (c.bias) {
    const auto& sh = c.bias->shape;
    s.eh = extent(sh, 1) == 1 ? 1 : G, s.eq = extent(sh, 2), s.ek = extent(sh, 3);
    FloatTensor f{c.bias->dtype, {1, s.eh, s.eq, s.ek}, {}};
    for (std::int64_t k = 0; k < s.eh; ++k)
      for (std::int64_t i = 0; i < s.eq; ++i)
        for (std::int64_t j = 0; j < s.ek; ++j) f.values.push_back(c.bias_at(b, h0 + k, i, j));
    t.bias = std::move(f);
    s.dbias_faithful = (extent(sh, 0) != 1 || c.B == 1) && (extent(sh, 1) != 1 || c.Hkv == 1);
  }
  if (c.query_mask) {
    const auto from = c.query_mask->values.begin() + b * c.Nq;
    t.query_mask = BoolTensor{{1, c.Nq}, std::vector<unsigned char>(from, from + c.Nq)};
  }
  if (c.seqlens_q) t.seqlens_q = std::vector<std::int64_t>{(*c.seqlens_q)[static_cast<std::size_t>(b)]};
  if (c.seqlens_k) t.seqlens_k = std::vector<std::int64_t>{(*c.seqlens_k)[static_cast<std::size_t>(b)]};
  if (c.rotary) {  // q and k are rotated already; the tables take dq and dk back (same positions)
    t.rotary = c.rotary;
    t.rotary->q_mag.clear(), t.rotary->k_mag.clear();
  }
  if (c.sinks) {  // the slice's heads' sinks (its dsinks is not compared: the case's sums batches)
    const auto from = c.sinks->values.begin() + h0;
    t.sinks = FloatTensor{c.sinks->dtype, {G}, std::vector<double>(from, from + G)};
  }
  return s;
}

// One golden tensor of an evaluation, decoded, with its undecided elements marked.
struct Golden {
  const RawTensor* t = nullptr;
  std::vector<char> undecided;
  Golden(const EvalResult& r, const std::string& name) {
    for (const RawTensor& x : r.golden)
      if (x.name == name) t = &x;
    if (!t) return;
    undecided.assign(static_cast<std::size_t>(t->numel()), 0);
    for (const RawTensor& x : r.golden)
      if (x.name == name + ".undecided")
        for (std::int64_t k = 0; k < x.numel(); ++k) {
          std::int64_t idx;
          std::memcpy(&idx, x.data.data() + 8 * k, 8);
          undecided[static_cast<std::size_t>(idx)] = 1;
        }
  }
  double at(std::int64_t k) const {
    return decode_float(t->dtype, t->data.data() + static_cast<std::size_t>(k) * dtype_size(t->dtype));
  }
  bool decided(std::int64_t k) const { return !undecided[static_cast<std::size_t>(k)]; }
};

// x with 17 significant digits, then in hex to be replayed exactly.
std::string hex(double x) {
  char buf[80];
  std::snprintf(buf, sizeof buf, "%.17g (%a)", x, x);
  return buf;
}

// The gradients compared, each as G (output dtype) and G.ref (F64).
struct Gradient {
  const char* name;
  bool wanted;
};

// Whether twin element k, of the evaluation with dout doubled, breaks linearity against the
// case's element w (x, y: the two values). Each golden element is the one correct rounding of
// its exact value x, and 2x has x's significand, so round(2x) = 2 round(x) bit for bit; it fails
// only where 2 round(x) overflows, or where |round(x)| is at most the smallest normal (x may then
// be subnormal: round(x) lies on the subnormals' grid of spacing u, and 2x is rounded on a grid
// of spacing u as well, not 2u): those elements, and undecided ones, are skipped.
bool breaks_linearity(const Golden& base, std::int64_t w, const Golden& twin, std::int64_t k, double& x, double& y) {
  const FloatFormat f = float_format(base.t->dtype);
  const double min_normal = std::ldexp(1.0, static_cast<int>(f.emin) + f.precision - 2);
  const double max_finite = std::ldexp(1.0 - std::ldexp(1.0, -f.precision), static_cast<int>(f.emax));
  if (w < 0 || !base.decided(w) || !twin.decided(k)) return false;
  x = base.at(w), y = twin.at(k);
  if (!(std::fabs(x) > min_normal) || !(std::fabs(x) <= max_finite / 2)) return false;
  return y != 2 * x;
}

// Kind mha: the heads share W_o and the weights' gradients add up every batch, so the twin is
// the whole case with dout doubled, and each of its gradients must be twice the case's.
std::vector<Violation> mha_linearity(const Case& c, const EvalResult& res, const TwinEvaluator& evaluate_twin) {
  std::vector<Violation> out;
  Case t = c;
  t.file = SafeTensorsFile{};  // the file's bytes: not read by the evaluation
  FloatTensor twice = *c.dout;
  for (double& x : twice.values) x *= 2;
  t.dout = std::move(twice);
  const EvalResult r1 = evaluate_twin(t);
  const Gradient grads[] = {{"dx_q", c.want_dx_q}, {"dx_kv", c.want_dx_kv}, {"dw_q", c.want_dw_q},
                            {"dw_k", c.want_dw_k},  {"dw_v", c.want_dw_v},   {"dw_o", c.want_dw_o},
                            {"dbias", c.want_dbias}, {"dsinks", c.want_dsinks}};
  for (const Gradient& gr : grads) {
    if (!gr.wanted) continue;
    for (const std::string& name : {std::string(gr.name), std::string(gr.name) + ".ref"}) {
      const Golden base(res, name), twin(r1, name);
      if (!base.t || !twin.t) {
        out.push_back(Violation{Invariant::GradientLinearity, -1, -1, -1, -1, -1, name + ": missing from an evaluation"});
        continue;
      }
      for (std::int64_t k = 0; k < twin.t->numel(); ++k) {
        double x = 0, y = 0;
        if (breaks_linearity(base, k, twin, k, x, y))
          out.push_back(Violation{Invariant::GradientLinearity, -1, -1, k, -1, -1,
                                  name + " (i: its flat index): twice dout gives " + hex(y) + ", not twice " + hex(x)});
      }
    }
  }
  return out;
}

}  // namespace

std::vector<Violation> check_gradient_twins(const Case& c, const EvalResult& res, std::int64_t b,
                                            std::int64_t g, const TwinEvaluator& evaluate_twin) {
  std::vector<Violation> out;
  if (!c.wants_gradients() || !c.dout) return out;
  for (double x : c.dout->values)
    if (std::fabs(x) > DBL_MAX / 2) return out;  // 2 dout would not be a double: no twin
  if (c.kind == Kind::Mha) return b == 0 && g == 0 ? mha_linearity(c, res, evaluate_twin) : out;
  const Slice s = slice(c, b, g);
  const Case& t = s.t;
  const std::int64_t G = s.G;
  const Gradient grads[] = {{"dq", c.want_dq}, {"dk", c.want_dk}, {"dv", c.want_dv}, {"dbias", c.want_dbias}};

  // Where the slice's element k of gradient `name` lies in the case's, -1 where it is not the
  // case's exact value (dbias of a bias broadcast beyond the slice).
  auto whole_index = [&](const std::string& name, std::int64_t k) -> std::int64_t {
    if (name == "dq") return (b * c.Hq + g * G) * c.Nq * c.Dk + k;
    if (name == "dk") return (b * c.Hkv + g) * c.Nk * c.Dk + k;
    if (name == "dv") return (b * c.Hkv + g) * c.Nk * c.Dv + k;
    if (!s.dbias_faithful) return -1;
    const std::int64_t hk = k / (s.eq * s.ek), iq = k / s.ek % s.eq, jk = k % s.ek;
    return static_cast<std::int64_t>(c.bias_index(b, g * G + hk, iq, jk));
  };
  // The violation's position in the case: (b, h, i, c) for dq, (b, kv head, j, c) for dk, dv;
  // for dbias the flat index `flat` as i (the case's, or the slice's where it says so).
  auto at = [&](const std::string& name, std::int64_t k, Invariant inv, std::string what,
                std::int64_t flat = -1) {
    Violation v{inv, b, -1, -1, -1, -1, std::move(what)};
    if (name == "dq") {
      v.h = g * G + k / (c.Nq * c.Dk), v.i = k / c.Dk % c.Nq, v.c = k % c.Dk;
    } else if (name == "dk" || name == "dv") {
      const std::int64_t E = name == "dk" ? c.Dk : c.Dv;
      v.h = g, v.j = k / E, v.c = k % E;
    } else {
      v.b = -1, v.i = flat;
    }
    return v;
  };

  // Linearity: the twin with dout doubled (breaks_linearity).
  // Golden values rather than enclosures: the relation is then one of the exact values, not of
  // how the reference reached them (its working precisions need not scale with dout).
  Slice twice = s;
  for (double& x : twice.t.dout->values) x *= 2;
  const EvalResult r1 = evaluate_twin(twice.t);
  for (const Gradient& gr : grads) {
    if (!gr.wanted) continue;
    for (const std::string& name : {std::string(gr.name), std::string(gr.name) + ".ref"}) {
      const Golden base(res, name), twin(r1, name);
      if (!base.t || !twin.t) {
        out.push_back(at(gr.name, 0, Invariant::GradientLinearity, name + ": missing from an evaluation"));
        continue;
      }
      for (std::int64_t k = 0; k < twin.t->numel(); ++k) {
        const std::int64_t w = whole_index(gr.name, k);
        double x = 0, y = 0;
        if (breaks_linearity(base, w, twin, k, x, y))
          out.push_back(at(gr.name, k, Invariant::GradientLinearity,
                           name + (std::string(gr.name) == "dbias" ? " (i: its flat index)" : "") +
                               ": twice dout gives " + hex(y) + ", not twice " + hex(x),
                           w));
      }
    }
  }

  // Dependence: a key j that some compared query of the slice sees and some row does not; the
  // rows (h, i) that do not see it get other q and dout rows (negated, 1 for 0: values of every
  // dtype). Exactly unchanged, as the exact values are: dq of the other rows (a row's gradient
  // reads its own q and dout only), dk and dv of every key that no changed row sees (j among
  // them), and dbias where no changed row sees the key.
  const std::int64_t rows = G * c.Nq;
  auto sees = [&](std::int64_t h, std::int64_t i, std::int64_t j) {
    return t.query_valid(0, i) && detail::allowed(t, 0, h, i, j);
  };
  std::int64_t key = -1, best = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    std::int64_t n = 0;
    for (std::int64_t h = 0; h < G; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) n += sees(h, i, j);
    if (std::min(n, rows - n) > best) key = j, best = std::min(n, rows - n);
  }
  if (key < 0) return out;
  Slice changed = twice;
  std::vector<char> moved(static_cast<std::size_t>(rows), 0);
  std::vector<char> key_moved(static_cast<std::size_t>(c.Nk), 0);
  for (std::int64_t h = 0; h < G; ++h)
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      if (sees(h, i, key)) continue;
      moved[static_cast<std::size_t>(h * c.Nq + i)] = 1;
      auto other = [](std::vector<double>& v, std::int64_t from, std::int64_t n) {
        for (std::int64_t e = from; e < from + n; ++e) {
          double& x = v[static_cast<std::size_t>(e)];
          x = x != 0 ? -x : 1.0;
        }
      };
      other(changed.t.q.values, (h * c.Nq + i) * c.Dk, c.Dk);
      other(changed.t.dout->values, (h * c.Nq + i) * c.Dv, c.Dv);
      for (std::int64_t j = 0; j < c.Nk; ++j)
        if (sees(h, i, j)) key_moved[static_cast<std::size_t>(j)] = 1;
    }
  std::vector<char> bias_moved;
  if (t.bias) {
    bias_moved.assign(t.bias->values.size(), 0);
    for (std::int64_t h = 0; h < G; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        for (std::int64_t j = 0; j < c.Nk; ++j)
          if (moved[static_cast<std::size_t>(h * c.Nq + i)] && sees(h, i, j)) bias_moved[t.bias_index(0, h, i, j)] = 1;
  }
  const EvalResult r2 = evaluate_twin(changed.t);
  for (const Gradient& gr : grads) {
    if (!gr.wanted) continue;
    const std::string n = gr.name;
    for (const std::string& name : {n, n + ".ref"}) {
      const Golden before(r1, name), after(r2, name);
      if (!before.t || !after.t) continue;  // reported above
      for (std::int64_t k = 0; k < after.t->numel(); ++k) {
        const bool kept = n == "dq"   ? !moved[static_cast<std::size_t>(k / c.Dk)]
                          : n == "dk" ? !key_moved[static_cast<std::size_t>(k / c.Dk)]
                          : n == "dv" ? !key_moved[static_cast<std::size_t>(k / c.Dv)]
                                      : !bias_moved[static_cast<std::size_t>(k)];
        if (!kept || !before.decided(k) || !after.decided(k)) continue;
        const double x = before.at(k), y = after.at(k);
        if (x != y)  // +0 and -0 are one golden value
          out.push_back(at(n, k, Invariant::GradientCausalDependence,
                           name + (n == "dbias" ? " (i: flat index in [1, " + std::to_string(s.eh) + ", " +
                                                      std::to_string(s.eq) + ", " + std::to_string(s.ek) +
                                                      "], the bias of batch " + std::to_string(b) +
                                                      " and kv head " + std::to_string(g) + ")"
                                                : std::string()) +
                               ": changing the queries that cannot see key " + std::to_string(key) +
                               " moves it from " + hex(x) + " to " + hex(y),
                           k));
      }
    }
  }
  return out;
}

}  // namespace attnoracle::oracle
