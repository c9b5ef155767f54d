// Runs an implementation on problems and their twins, and checks the relations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <tuple>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "twins.hpp"

namespace attnoracle::conformance {

namespace {

double finite_abs(double x) { return std::isfinite(x) ? std::fabs(x) : 0; }

// One side's limits, the gate's (tolerance.hpp), from its own case's magnitudes.
struct Side {
  const Case& c;
  const Profile& p;
  std::vector<RowMagnitudes> mags;
  std::vector<RowLimits> rows;  // per row of row_magnitudes
  std::vector<double> bound;    // out.bound from above, per element of out
  double uo;
  Side(const Case& c_, const Profile& p_)
      : c(c_), p(p_), mags(row_magnitudes(c_)), bound(out_bound_above(c_)), uo(unit_roundoff(c_.output_dtype)) {
    for (const auto& m : mags) rows.push_back(row_limits(p, c, m));
  }
  const RowLimits& row(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return rows[static_cast<std::size_t>(c.kind == Kind::Mha ? b * c.Nq + i : (b * c.Hq + h) * c.Nq + i)];
  }
  // The limits take |x|, the exact value; from the result y: when |y - x| <= a + r |x|,
  // |x| <= (|y| + a) / (1 - r).
  static double exact_above(double y, double a, double r) {
    return r < 1 ? (finite_abs(y) + a) / (1 - r) : INFINITY;
  }
  double out(std::int64_t b, std::int64_t h, std::int64_t i, std::size_t at, double y) const {
    const RowLimits& L = row(b, h, i);
    const double bd = bound[at], S = p.safety, vsum = L.keys * bd;  // sum_j |v_jc| <= n max_j |v_jc|
    return out_limit(p, L, uo, bd, vsum, exact_above(y, S * out_compute(L, bd, vsum), S * uo));
  }
  double weight(std::int64_t b, std::int64_t h, std::int64_t i, double y) const {
    const RowLimits& L = row(b, h, i);
    const double S = p.safety;
    return weight_limit(p, L, uo, std::min(1.0, exact_above(y, S * (L.floor + L.p_sub), S * (L.weight_rel + uo))));
  }
  double lse(std::int64_t b, std::int64_t h, std::int64_t i, double y) const {
    const RowLimits& L = row(b, h, i);
    const double S = p.safety;
    return lse_limit(p, L, uo, exact_above(y, S * (L.lse_abs + L.floor), S * uo));
  }
};

struct Tensor {
  std::vector<double> v;
  std::vector<std::int64_t> shape;
  const RawTensor* raw = nullptr;
};

// Reads a result tensor, checking its dtype and shape; an empty optional with `why` otherwise.
bool read_result(const SafeTensorsFile& f, const std::string& name, DType dt,
                 const std::vector<std::int64_t>& shape, Tensor& out, std::string& why) {
  const RawTensor* t = f.find(name);
  if (!t) {
    why = "result has no tensor " + name;
    return false;
  }
  if (t->dtype != dt || t->shape != shape) {
    why = name + " has dtype " + std::string(dtype_name(t->dtype)) + " and the wrong shape or dtype";
    return false;
  }
  out.shape = shape;
  out.raw = t;
  const std::size_t es = dtype_size(dt), n = t->data.size() / es;
  out.v.resize(n);
  for (std::size_t k = 0; k < n; ++k) out.v[k] = decode_float(dt, t->data.data() + k * es);
  return true;
}

// NaN against NaN counts as equal, whatever the payloads.
bool same_bits(const Tensor& a, std::size_t ia, const Tensor& b, std::size_t ib) {
  const std::size_t es = dtype_size(a.raw->dtype);
  return std::memcmp(a.raw->data.data() + ia * es, b.raw->data.data() + ib * es, es) == 0 ||
         (std::isnan(a.v[ia]) && std::isnan(b.v[ib]));
}

// The reference's results of one case file, as doubles (out.ref, weights.ref, lse.ref: the exact
// values rounded to F64); empty vectors for tensors the case does not ask for.
struct Golden {
  std::vector<double> out, weights, lse;
  std::vector<RawTensor> all;  // every golden tensor (the gradients' .ref and .bound among them)
};

Golden reference_of(const SafeTensorsFile& f) {
  const EvalResult r = evaluate(case_from_file("twin", f), {});
  Golden g;
  g.all = r.golden;
  for (const RawTensor& t : r.golden) {
    std::vector<double>* dst = t.name == "out.ref" ? &g.out : t.name == "weights.ref" ? &g.weights
                               : t.name == "lse.ref" ? &g.lse : nullptr;
    if (!dst) continue;
    dst->resize(t.data.size() / 8);
    for (std::size_t k = 0; k < dst->size(); ++k) (*dst)[k] = decode_float(DType::F64, t.data.data() + 8 * k);
  }
  return g;
}

struct Comparison {
  RelationResult& r;
  const Golden* ga = nullptr;  // reference twins: the reference's results of both sides
  const Golden* gb = nullptr;
  double worst_seen = 0;
  bool bitwise = true;
  std::size_t moved = 0, compared = 0;  // elements whose bits differ, of those compared
  std::string first_moved = {};         // the first few of them
  void bits(const char* tensor, const std::string& where, double a, double b, bool bits_equal) {
    ++compared;
    bitwise = bitwise && bits_equal;
    if (bits_equal || ++moved > 3) return;
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s%s%s: %a vs %a", first_moved.empty() ? "" : "; ", tensor, where.c_str(), a, b);
    first_moved += buf;
  }
  // Reference twins: b - a against the reference's xb - xa. Each side is within its limit of its
  // exact value and out.ref within 2^-53 of its own, so |(b - a) - (xb - xa)| <= tol, plus
  // 2^-52 of the magnitudes for out.ref and the subtractions in double.
  void change(const char* tensor, const std::string& where, double a, double b, double tol, bool bits_equal,
              double xa, double xb) {
    if (xa == xb) return element(tensor, where, a, b, tol, bits_equal, " (the reference's is unchanged)");
    bitwise = false;
    double ratio;
    if (!std::isfinite(xa) || !std::isfinite(xb))  // an infinite lse (no key) must be met exactly
      ratio = ((a == xa || (std::isfinite(a) && std::isfinite(xa))) && (b == xb || (std::isfinite(b) && std::isfinite(xb))))
                  ? 0 : INFINITY;
    else if (!std::isfinite(a) || !std::isfinite(b)) ratio = INFINITY;
    else {
      const double slack = 0x1p-51 * (std::fabs(a) + std::fabs(b) + std::fabs(xa) + std::fabs(xb));
      ratio = std::fabs((b - a) - (xb - xa)) / (tol + slack);
    }
    if (ratio > worst_seen) {
      worst_seen = ratio;
      char buf[500];
      std::snprintf(buf, sizeof buf, "%s%s: %.9g (%a) to %.9g (%a), a change of %.3g where the reference's is %.3g, "
                    "tolerance %.3g (%a)%s", tensor, where.c_str(), a, a, b, b, b - a, xb - xa, tol, tol,
                    std::fabs(b - a) <= tol ? ": unchanged where the reference changes" : "");
      r.detail = buf;
    }
  }
  // |a - b| <= tol; equal infinities pass; NaN never does.
  void element(const char* tensor, const std::string& where, double a, double b, double tol,
               bool bits_equal, const char* note = "") {
    bits(tensor, where, a, b, bits_equal);
    double ratio;
    if (a == b || (std::isinf(a) && a == b)) ratio = 0;
    else if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) ratio = INFINITY;
    else ratio = std::fabs(a - b) / tol;
    if (ratio > worst_seen) {
      worst_seen = ratio;
      char buf[400];
      std::snprintf(buf, sizeof buf, "%s%s: %.9g (%a) vs %.9g (%a), tolerance %.3g (%a)%s", tensor, where.c_str(), a,
                    a, b, b, tol, tol, note);
      r.detail = buf;
    }
  }
};

// Byte strings by length, then content. Not std::less: at -O3 GCC 12 reports a false
// -Wstringop-overread in vector<unsigned char>'s operator<=>.
struct BytesLess {
  bool operator()(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) const {
    if (a.size() != b.size()) return a.size() < b.size();
    return a.size() > 0 && std::memcmp(a.data(), b.data(), a.size()) < 0;
  }
};

std::string idx(std::initializer_list<std::int64_t> ix) {
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  // (GCC bug 105329).
  std::string s = "[";
  bool first = true;
  for (auto x : ix) {
    if (!first) s += ',';
    s += std::to_string(x);
    first = false;
  }
  return s + "]";
}

// The gradients the case asks, element by element bit for bit (sides of one shape: reruns);
// dq and dx_q only on the compared rows (padding queries' are free). False with `why` when a
// side's tensor is missing or of another dtype or shape.
bool gradient_bits(const Case& c, const conformance::JobResult& ra, const conformance::JobResult& rb,
                   const TwinPair& p, Comparison& cmp, std::string& why) {
  const std::pair<const char*, bool> grads[] = {
      {"dq", c.want_dq},       {"dk", c.want_dk},       {"dv", c.want_dv},     {"dbias", c.want_dbias},
      {"dsinks", c.want_dsinks}, {"dx_q", c.want_dx_q}, {"dx_kv", c.want_dx_kv}, {"dw_q", c.want_dw_q},
      {"dw_k", c.want_dw_k},   {"dw_v", c.want_dw_v},   {"dw_o", c.want_dw_o}};
  for (const auto& [name, wanted] : grads) {
    if (!wanted) continue;
    const RawTensor* t = ra.output.find(name);
    if (!t) {
      why = std::string("result has no tensor ") + name;
      return false;
    }
    Tensor ga, gb;
    if (!read_result(ra.output, name, t->dtype, t->shape, ga, why) ||
        !read_result(rb.output, name, t->dtype, t->shape, gb, why))
      return false;
    const std::string n = name;
    // rows of [B, Hq, Nq, Dk] (dq) or [B, Nq, D] (dx_q): the query rows compared
    const std::vector<char>* rows = n == "dq" ? &p.rows : n == "dx_q" ? &p.out_rows : nullptr;
    const std::size_t width = t->shape.empty() ? 1 : static_cast<std::size_t>(t->shape.back());
    for (std::size_t e = 0; e < ga.v.size(); ++e) {
      if (rows && !(*rows)[e / width]) continue;
      if (same_bits(ga, e, gb, e)) {
        cmp.bits(name, "", ga.v[e], gb.v[e], true);
        continue;
      }
      std::vector<std::int64_t> ix(t->shape.size());  // the element's index, for the report
      for (std::size_t d = ix.size(), r = e; d-- > 0;) {
        ix[d] = static_cast<std::int64_t>(r % static_cast<std::size_t>(t->shape[d]));
        r /= static_cast<std::size_t>(t->shape[d]);
      }
      std::string where = "[";
      for (std::size_t d = 0; d < ix.size(); ++d) {
        if (d) where += ',';
        where += std::to_string(ix[d]);
      }
      cmp.bits(name, where + "]", ga.v[e], gb.v[e], false);
    }
  }
  return true;
}

// The gradients a pair relates (TwinPair::dq, key_rows, sink_heads, dbias), element by element
// through the pair's mapping: within both sides' gate limits (gradient_limits), or for reference
// twins b - a against the reference's. False with `why` when a side's tensor is missing or of
// another dtype or shape.
template <class QueryOf>
bool twin_gradients(const TwinPair& p, const Case& ca, const Case& cb, const Side& sa, const Side& sb,
                    const conformance::JobResult& ra, const conformance::JobResult& rb, const Golden& xa,
                    const Golden& xb, QueryOf qb, Comparison& cmp, std::string& why) {
  struct Wanted {
    const char* name;
    bool asked;
    std::vector<std::int64_t> shape_a, shape_b;
  };
  const std::vector<std::int64_t> none;
  const Wanted wanted[] = {
      {"dq", p.dq && ca.want_dq && cb.want_dq, ca.q.shape, cb.q.shape},
      {"dk", !p.key_rows.empty() && ca.want_dk && cb.want_dk, ca.k.shape, cb.k.shape},
      {"dv", !p.key_rows.empty() && ca.want_dv && cb.want_dv, ca.v.shape, cb.v.shape},
      {"dsinks", !p.sink_heads.empty() && ca.want_dsinks && cb.want_dsinks, {ca.Hq}, {cb.Hq}},
      {"dbias", p.dbias && ca.want_dbias && cb.want_dbias, ca.bias ? ca.bias->shape : none,
       cb.bias ? cb.bias->shape : none}};
  std::map<std::string, DType> dtypes;
  std::map<std::string, std::pair<Tensor, Tensor>> got;
  for (const Wanted& w : wanted) {
    if (!w.asked) continue;
    const RawTensor* t = ra.output.find(w.name);
    if (!t) {
      why = std::string("result has no tensor ") + w.name;
      return false;
    }
    auto& [ta, tb] = got[w.name];
    if (!read_result(ra.output, w.name, t->dtype, w.shape_a, ta, why) ||
        !read_result(rb.output, w.name, t->dtype, w.shape_b, tb, why))
      return false;
    dtypes[w.name] = t->dtype;
  }
  const auto la = gradient_limits(sa.p, ca, sa.mags, sa.rows, xa.all, dtypes);
  const auto lb = gradient_limits(sb.p, cb, sb.mags, sb.rows, xb.all, dtypes);
  auto one = [&](const std::string& name, std::size_t ia, std::size_t ib, const std::string& where) {
    const auto a = la.find(name), b = lb.find(name);
    if (a == la.end() || b == lb.end()) return;
    const auto& [ta, tb] = got.at(name);
    const double tol = a->second.limit[ia] + b->second.limit[ib];
    if (p.reference)
      cmp.change(name.c_str(), where, ta.v[ia], tb.v[ib], tol, same_bits(ta, ia, tb, ib), a->second.ref[ia],
                 b->second.ref[ib]);
    else
      cmp.element(name.c_str(), where, ta.v[ia], tb.v[ib], tol, same_bits(ta, ia, tb, ib));
  };
  auto jb = [&](std::int64_t j) { return p.perm.empty() ? j : p.perm[static_cast<std::size_t>(j)]; };
  const std::int64_t H = ca.Hq, G = ca.Hkv;
  if (got.count("dq"))
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          if (!p.rows[static_cast<std::size_t>((b * H + h) * ca.Nq + i)]) continue;
          for (std::int64_t e = 0; e < ca.Dk; ++e)
            one("dq", static_cast<std::size_t>(((b * H + h) * ca.Nq + i) * ca.Dk + e),
                static_cast<std::size_t>(((b * H + h) * cb.Nq + qb(i)) * ca.Dk + e), idx({b, h, i, e}));
        }
  for (const auto& [name, D] : {std::pair<std::string, std::int64_t>{"dk", ca.Dk}, {"dv", ca.Dv}}) {
    if (!got.count(name)) continue;
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < ca.Nk; ++j) {
          if (!p.key_rows[static_cast<std::size_t>((b * G + g) * ca.Nk + j)]) continue;
          for (std::int64_t e = 0; e < D; ++e)
            one(name, static_cast<std::size_t>(((b * G + g) * ca.Nk + j) * D + e),
                static_cast<std::size_t>(((b * G + g) * cb.Nk + jb(j)) * D + e), idx({b, g, j, e}));
        }
  }
  if (got.count("dsinks"))
    for (std::int64_t h = 0; h < H; ++h) {
      const auto at = static_cast<std::size_t>(h);
      if (p.sink_heads[at]) one("dsinks", at, at, idx({h}));
    }
  // dbias: the same shape, or one key more in b (a padding key appended); its last extent runs
  // over the keys when it is not 1 (a broadcast one stays)
  if (got.count("dbias")) {
    const auto &sa_ = ca.bias->shape, &sb_ = cb.bias->shape;
    const bool fits = !sa_.empty() && sa_.size() == sb_.size() &&
                      std::equal(sa_.begin(), sa_.end() - 1, sb_.begin()) &&
                      (sb_.back() == sa_.back() || (p.extra_key && sb_.back() == sa_.back() + 1));
    const std::int64_t La = fits ? sa_.back() : 0, Lb = fits ? sb_.back() : 0;
    const bool keys = La == ca.Nk && La > 1;
    for (std::size_t k = 0; fits && k < got.at("dbias").first.v.size(); ++k) {
      const auto outer = static_cast<std::int64_t>(k) / La, j = static_cast<std::int64_t>(k) % La;
      one("dbias", k, static_cast<std::size_t>(outer * Lb + (keys ? jb(j) : j)), idx({outer, j}));
    }
  }
  return true;
}

// `golden` gives the reference's results of both sides, for reference twins and the twins
// whose gradients are compared; called only once both sides have results.
void compare_pair(const TwinPair& p, const conformance::JobResult& ra, const conformance::JobResult& rb,
                  const MetamorphicOptions& opt, RelationResult& res,
                  const std::function<std::pair<const Golden*, const Golden*>()>& golden) {
  using conformance::Outcome;
  using St = RelationResult::Status;
  if (ra.outcome == Outcome::Unsupported || rb.outcome == Outcome::Unsupported) {
    res.status = St::Skipped;
    res.detail = "unsupported: " + (ra.outcome == Outcome::Unsupported ? ra.reason : rb.reason);
    return;
  }
  if (ra.outcome == Outcome::Refused && rb.outcome == Outcome::Refused) {
    res.status = St::Pass;
    res.detail = "both refused";
    return;
  }
  if (ra.outcome != Outcome::Output || rb.outcome != Outcome::Output) {
    res.status = St::Violated;
    auto say = [](const conformance::JobResult& j) {
      return std::string(conformance::outcome_name(j.outcome)) + (j.reason.empty() ? "" : " (" + j.reason + ")");
    };
    res.detail = "problem: " + say(ra) + "; twin: " + say(rb);
    return;
  }
  const Case ca = case_from_file("a", p.a), cb = case_from_file("b", p.b);
  const Side sa(ca, opt.profile), sb(cb, opt.profile);
  const DType odt = ca.output_dtype;
  const bool mha = ca.kind == Kind::Mha;
  const std::int64_t H = ca.Hq, W = mha ? ca.Dout : ca.Dv, Nqb = cb.Nq;
  // the row of b that row i of a compares with (decode twins hold one query a batch row)
  auto qb = [&](std::int64_t i) { return p.query_of.empty() ? i : std::int64_t{0}; };
  Comparison cmp{res};
  // gradients related: each side's limits from the reference's results of that side
  const bool grads = opt.profile.returns_gradients && ca.kind == Kind::Sdpa && ca.wants_gradients() &&
                     cb.wants_gradients() && (p.dq || !p.key_rows.empty() || !p.sink_heads.empty() || p.dbias);
  const Golden *ga = nullptr, *gb = nullptr;
  if (p.reference || grads) {
    try {
      std::tie(ga, gb) = golden();
    } catch (const std::exception& e) {
      if (p.reference) {
        res.status = St::Skipped;
        res.detail = std::string("the reference does not evaluate the pair: ") + e.what();
        return;
      }
      ga = gb = nullptr;  // an exact twin: out, weights and lse are still related
    }
  }
  if (p.reference) cmp.ga = ga, cmp.gb = gb;
  // each side within its own limit of its exact value
  auto compare = [&](const char* tensor, const std::string& where, double a, double b, double tol, bool bits,
                     const std::vector<double> Golden::*t, std::size_t ia, std::size_t ib) {
    if (cmp.ga) cmp.change(tensor, where, a, b, tol, bits, (cmp.ga->*t)[ia], (cmp.gb->*t)[ib]);
    else cmp.element(tensor, where, a, b, tol, bits);
  };
  std::string why;
  Tensor oa, ob;
  auto unreadable = [&] {
    res.status = St::Violated;
    res.detail = why;
  };
  if (!read_result(ra.output, "out", odt, ca.out_shape(), oa, why) ||
      !read_result(rb.output, "out", odt, cb.out_shape(), ob, why))
    return unreadable();
  for (std::int64_t b = 0; b < ca.B; ++b)
    for (std::int64_t i = 0; i < ca.Nq; ++i)
      for (std::int64_t h = 0; h < (mha ? 1 : H); ++h) {
        if (mha ? !p.out_rows[static_cast<std::size_t>(b * ca.Nq + i)] : !p.rows[static_cast<std::size_t>((b * H + h) * ca.Nq + i)])
          continue;
        for (std::int64_t e = 0; e < W; ++e) {
          const auto at = static_cast<std::size_t>((mha ? (b * ca.Nq + i) : ((b * H + h) * ca.Nq + i)) * W + e);
          const auto atb = static_cast<std::size_t>((mha ? (b * Nqb + qb(i)) : ((b * H + h) * Nqb + qb(i))) * W + e);
          const double tol = sa.out(b, h, i, at, oa.v[at]) + sb.out(b, h, qb(i), atb, ob.v[atb]);
          compare("out", mha ? idx({b, i, e}) : idx({b, h, i, e}), oa.v[at], ob.v[atb], tol,
                  same_bits(oa, at, ob, atb), &Golden::out, at, atb);
        }
      }
  if (ca.want_weights && opt.profile.returns_weights) {
    Tensor wa, wb;
    const std::int64_t Nkb = cb.Nk;
    if (!read_result(ra.output, "weights", odt, {ca.B, H, ca.Nq, ca.Nk}, wa, why) ||
        !read_result(rb.output, "weights", odt, {cb.B, H, Nqb, Nkb}, wb, why))
      return unreadable();
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          if (!p.rows[static_cast<std::size_t>((b * H + h) * ca.Nq + i)]) continue;
          for (std::int64_t j = 0; j < ca.Nk; ++j) {
            const std::int64_t jt = p.perm.empty() ? j : p.perm[static_cast<std::size_t>(j)];
            const auto ia = static_cast<std::size_t>(((b * H + h) * ca.Nq + i) * ca.Nk + j);
            const auto ib = static_cast<std::size_t>(((b * H + h) * Nqb + qb(i)) * Nkb + jt);
            const double tol = sa.weight(b, h, i, wa.v[ia]) + sb.weight(b, h, qb(i), wb.v[ib]);
            compare("weights", idx({b, h, i, j}), wa.v[ia], wb.v[ib], tol, same_bits(wa, ia, wb, ib), &Golden::weights,
                    ia, ib);
          }
          if (p.extra_key) {  // a masked key's weight is exactly 0 in any sane implementation
            const double w = wb.v[static_cast<std::size_t>(((b * H + h) * Nqb + qb(i)) * Nkb + ca.Nk)];
            if (w != 0) {
              cmp.worst_seen = INFINITY;
              char buf[200];
              std::snprintf(buf, sizeof buf, "weights%s of the masked padding key is %.9g (%a), not 0",
                            idx({b, h, i, ca.Nk}).c_str(), w, w);
              res.detail = buf;
            }
          }
        }
  }
  if (ca.want_lse && opt.profile.returns_lse) {
    Tensor la, lb;
    if (!read_result(ra.output, "lse", odt, {ca.B, H, ca.Nq}, la, why) ||
        !read_result(rb.output, "lse", odt, {cb.B, H, Nqb}, lb, why))
      return unreadable();
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          const auto at = static_cast<std::size_t>((b * H + h) * ca.Nq + i);
          if (!p.rows[at]) continue;
          const auto atb = static_cast<std::size_t>((b * H + h) * Nqb + qb(i));
          const double a = la.v[at] + p.lse_shift, b2 = lb.v[atb];
          // lse_b = lse_a + shift exactly; the addition in double rounds once (2^-53 |a|)
          const double tol = sa.lse(b, h, i, la.v[at]) + sb.lse(b, h, qb(i), b2) + 0x1p-53 * finite_abs(a);
          compare("lse", idx({b, h, i}), a, b2, tol, p.lse_shift == 0 && same_bits(la, at, lb, atb), &Golden::lse,
                  at, atb);
        }
  }
  const bool same_shapes = ca.B == cb.B && ca.Nq == cb.Nq && ca.Nk == cb.Nk;  // reruns
  if (p.bitwise && same_shapes && opt.profile.returns_gradients && ca.wants_gradients() &&
      !gradient_bits(ca, ra, rb, p, cmp, why))
    return unreadable();
  if (grads && ga && !twin_gradients(p, ca, cb, sa, sb, ra, rb, *ga, *gb, qb, cmp, why)) return unreadable();
  res.worst = cmp.worst_seen;
  res.bitwise = cmp.bitwise;
  res.status = cmp.worst_seen <= 1 ? St::Pass : St::Violated;
  if (res.status == St::Pass) res.detail.clear();
  if (p.bitwise) {  // the bits alone decide: both sides of one exact value, limits aside
    res.status = cmp.moved > 0 ? St::Violated : St::Pass;
    res.detail = cmp.moved == 0 ? "" : std::to_string(cmp.moved) + " of " + std::to_string(cmp.compared) +
                                           " elements changed bits: " + cmp.first_moved + (cmp.moved > 3 ? "; ..." : "");
  }
}

// Counts a result, and copies the case files of a violated relation to opt.failures_dir
// (`fb` empty: one file).
void tally(RelationResult r, const std::string& fa, const std::string& fb, const MetamorphicOptions& opt,
           MetamorphicReport& rep) {
  namespace fs = std::filesystem;
  if (r.status == RelationResult::Status::Violated && !opt.failures_dir.empty() && !fa.empty()) {
    fs::create_directories(opt.failures_dir);
    const fs::path a = fs::path(opt.failures_dir) / fs::path(fa).filename();
    fs::copy_file(fa, a, fs::copy_options::overwrite_existing);
    r.detail += "; case" + std::string(fb.empty() ? ": " : "s: ") + a.string();
    if (!fb.empty()) {
      const fs::path b = fs::path(opt.failures_dir) / fs::path(fb).filename();
      fs::copy_file(fb, b, fs::copy_options::overwrite_existing);
      r.detail += " and " + b.string();
    }
  }
  switch (r.status) {
    case RelationResult::Status::Pass: ++rep.passed; break;
    case RelationResult::Status::Violated: ++rep.violated; break;
    case RelationResult::Status::Skipped: ++rep.skipped; break;
  }
  if (r.status == RelationResult::Status::Pass && r.bitwise) ++rep.bitwise;
  rep.results.push_back(std::move(r));
}

}  // namespace

MetamorphicReport run_metamorphic(const std::vector<std::pair<std::string, SafeTensorsFile>>& problems,
                                  const MetamorphicOptions& opt) {
  namespace fs = std::filesystem;
  MetamorphicReport rep;
  std::vector<conformance::AdapterJob> jobs;
  struct Pending {
    std::string problem;
    TwinPair pair;
    std::size_t ja, jb;
    std::string fa, fb;
    std::string skip;  // why the pair is not run
  };
  std::vector<Pending> pend;
  fs::create_directories(opt.work_dir);
  for (const auto& problem : problems) {
    // named references, not a structured binding: clang 14 cannot capture one in a lambda
    const std::string& id = problem.first;
    const SafeTensorsFile& file = problem.second;
    std::map<std::vector<unsigned char>, std::size_t, BytesLess> written;  // same bytes, same job
    std::map<std::string, int> tags;  // a tag used again with other bytes gets `other`, then a number
    auto job_for = [&](const SafeTensorsFile& f, std::string tag, const std::string& other, std::string& path) {
      std::vector<unsigned char> bytes = serialize_safetensors(f);
      if (auto it = written.find(bytes); it != written.end()) {
        path = jobs[it->second].input;
        return it->second;
      }
      if (tags.count(tag) && !other.empty()) tag = other;
      if (const int n = tags[tag]++; n > 0) tag += "-" + std::to_string(n);
      path = (fs::path(opt.work_dir) / (id + "." + tag + ".safetensors")).string();
      write_file_atomic(path, bytes);
      jobs.push_back({id + "." + tag, path, (fs::path(opt.work_dir) / (id + "." + tag + ".out.safetensors")).string()});
      written.emplace(std::move(bytes), jobs.size() - 1);
      return jobs.size() - 1;
    };
    const DType in = case_from_file(id, file).input_dtype;
    const bool skip = !opt.profile.covers(in);
    for (TwinPair& p : make_twins(id, file, opt.batch_invariant)) {
      Pending q{id, std::move(p), 0, 0, {}, {}, {}};
      if (skip) {  // as the gate skips a case
        q.skip = "profile " + opt.profile.name + " does not cover " + std::string(dtype_name(in)) + " inputs";
        pend.push_back(std::move(q));
        continue;
      }
      q.ja = job_for(q.pair.a, "base", "base-" + q.pair.tag, q.fa);  // a twin's own base: "base-head", ...
      q.jb = job_for(q.pair.b, q.pair.tag, "", q.fb);
      pend.push_back(std::move(q));
    }
  }
  conformance::AdapterRun run;
  if (!jobs.empty()) run = conformance::run_adapter(opt.command, jobs, (fs::path(opt.work_dir) / "run").string(), opt.timeout);
  if (run.timed_out || run.signaled || run.exit_status != 0) {
    rep.adapter_note = run.timed_out ? "the implementation timed out"
                                     : "the implementation exited with status " + std::to_string(run.exit_status);
    if (!run.stderr_tail.empty()) rep.adapter_note += "; its last output: " + run.stderr_tail;
  }
  std::map<std::size_t, Golden> evaluated;  // by job: the reference's results, evaluated once
  auto golden_of = [&](std::size_t job, const SafeTensorsFile& f) -> const Golden* {
    auto it = evaluated.find(job);
    if (it == evaluated.end()) it = evaluated.emplace(job, reference_of(f)).first;
    return &it->second;
  };
  for (Pending& q : pend) {
    RelationResult r;
    r.problem = q.problem;
    r.relation = q.pair.relation;
    r.what = q.pair.what;
    if (!q.skip.empty()) {
      r.status = RelationResult::Status::Skipped;
      r.detail = q.skip;
    } else {
      compare_pair(q.pair, run.results[q.ja], run.results[q.jb], opt, r, [&] {
        return std::make_pair(golden_of(q.ja, q.pair.a), golden_of(q.jb, q.pair.b));
      });
    }
    tally(std::move(r), q.fa, q.fb, opt, rep);
  }
  return rep;
}

void check_reruns(const std::vector<std::pair<std::string, SafeTensorsFile>>& problems,
                  const MetamorphicOptions& opt, MetamorphicReport& rep) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(opt.work_dir) / "reruns";
  fs::create_directories(dir);
  std::vector<std::string> inputs;
  std::vector<std::size_t> run_of;  // problem -> its job, or npos when its dtype is skipped
  for (const auto& [id, file] : problems) {
    if (!opt.profile.covers(case_from_file(id, file).input_dtype)) {
      run_of.push_back(std::string::npos);
      continue;
    }
    run_of.push_back(inputs.size());
    inputs.push_back((dir / (id + ".safetensors")).string());
    write_file_atomic(inputs.back(), serialize_safetensors(file));
  }
  // Each run a call of its own, its outputs apart: nothing of one run is seen by the next.
  std::vector<conformance::AdapterRun> runs(static_cast<std::size_t>(std::max(opt.reruns, 2)));
  for (std::size_t n = 0; n < runs.size() && !inputs.empty(); ++n) {
    std::vector<conformance::AdapterJob> jobs;
    for (const std::string& in : inputs) {
      const std::string stem = fs::path(in).stem().string();
      jobs.push_back({stem + ".run" + std::to_string(n + 1), in,
                      (dir / (stem + ".run" + std::to_string(n + 1) + ".out.safetensors")).string()});
    }
    runs[n] = conformance::run_adapter(opt.command, jobs, (dir / ("run" + std::to_string(n + 1))).string(), opt.timeout);
    const auto& run = runs[n];
    if ((run.timed_out || run.signaled || run.exit_status != 0) && rep.adapter_note.empty()) {
      rep.adapter_note = "rerun " + std::to_string(n + 1) + ": " +
                         (run.timed_out ? std::string("the implementation timed out")
                                        : "the implementation exited with status " + std::to_string(run.exit_status));
      if (!run.stderr_tail.empty()) rep.adapter_note += "; its last output: " + run.stderr_tail;
    }
  }
  for (std::size_t k = 0; k < problems.size(); ++k) {
    const auto& [id, file] = problems[k];
    const Case c = case_from_file(id, file);
    RelationResult r;
    r.problem = id;
    r.relation = "deterministic";
    r.what = std::to_string(runs.size()) + " runs of the problem";
    if (run_of[k] == std::string::npos) {
      r.status = RelationResult::Status::Skipped;
      r.detail = "profile " + opt.profile.name + " does not cover " + std::string(dtype_name(c.input_dtype)) + " inputs";
      tally(std::move(r), "", "", opt, rep);
      continue;
    }
    TwinPair p{r.relation, "rerun", r.what, file, file, {}, 0, false, all_rows(c), all_tokens(c), false, {}, true};
    const std::size_t j = run_of[k];
    for (std::size_t n = 1; n < runs.size(); ++n) {  // every run against the first
      RelationResult one = r;
      compare_pair(p, runs[0].results[j], runs[n].results[j], opt, one, [] {
        return std::make_pair<const Golden*, const Golden*>(nullptr, nullptr);
      });
      if (n == 1 || one.status != RelationResult::Status::Pass) {
        if (one.status == RelationResult::Status::Violated) one.detail = "run " + std::to_string(n + 1) + " against run 1: " + one.detail;
        r = std::move(one);
      }
      if (r.status != RelationResult::Status::Pass) break;
    }
    const std::string replay = inputs[j];
    tally(std::move(r), replay, "", opt, rep);
  }
}

}  // namespace attnoracle::conformance
