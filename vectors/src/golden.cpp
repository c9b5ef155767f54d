// Checks of stored golden tensors: their layout, and the invariants rounded values keep.
#include <mpfr.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "attnoracle/vectors/model_store.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/vectors/verify.hpp"
#include "numbers.hpp"

namespace attnoracle::vectors {
namespace {

using Shape = std::vector<std::int64_t>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

// A stored tensor decoded to doubles, with the flat indices of its undecided elements.
struct Values {
  std::vector<double> v;
  std::set<std::int64_t> undecided;
  double operator[](std::int64_t i) const { return v[sz(i)]; }
};

Values values(const SafeTensorsFile& f, const std::string& name) {
  Values out;
  const RawTensor* t = f.find(name);
  if (!t) return out;
  const std::size_t n = sz(t->numel()), s = dtype_size(t->dtype);
  out.v.resize(n);
  for (std::size_t e = 0; e < n; ++e) out.v[e] = decode_float(t->dtype, t->data.data() + e * s);
  if (const RawTensor* u = f.find(name + ".undecided"))
    for (std::int64_t e = 0; e < u->numel(); ++e) {
      std::int64_t idx;
      std::memcpy(&idx, u->data.data() + 8 * sz(e), 8);
      out.undecided.insert(idx);
    }
  return out;
}

// y (in format t) is the rounding of an exact value within `ulps` F64 ulps of ref (ref its F64
// rounding: 1; double rounding can move a midpoint): y lies between the roundings of ref's
// neighbours that far (rounding is monotone, and they are at most one step of t apart).
bool consistent(double y, double ref, DType t, int ulps = 1) {
  if (std::isnan(y) || std::isnan(ref)) return false;
  if (t == DType::F64) return y == ref;
  double lo = ref, hi = ref;
  for (int k = 0; k < ulps; ++k) lo = std::nextafter(lo, -INFINITY), hi = std::nextafter(hi, INFINITY);
  return round_double(lo, t) <= y && y <= round_double(hi, t);
}

class Checker {
 public:
  Checker(const Case& c, const SafeTensorsFile& f) : c_(c), f_(f) {}

  std::optional<std::string> run() {
    const RawTensor* rv = f_.find("row.valid");
    const Values out = values(f_, "out"), ref = values(f_, "out.ref"),
                 lo = values(f_, "out.ref_lo"), bound = values(f_, "out.bound");
    const Values w = values(f_, "weights"), wr = values(f_, "weights.ref");
    const Values lse = values(f_, "lse"), lser = values(f_, "lse.ref");
    const Values sc = values(f_, "scores"), scr = values(f_, "scores.ref");
    const bool mha = c_.kind == Kind::Mha;
    const std::int64_t width = mha ? c_.Dout : c_.Dv;

    // Element-wise: |out.ref| <= out.bound, out.ref_lo below half an ulp, rounded companions.
    for (std::int64_t e = 0; e < static_cast<std::int64_t>(ref.v.size()); ++e) {
      if (!(std::fabs(ref[e]) <= bound[e]))
        return at("out.ref", e, hexf(ref[e]) + " exceeds out.bound " + hexf(bound[e]));
      if (!lo.v.empty() && !lo.undecided.count(e) && !ref.undecided.count(e) &&
          !(std::fabs(lo[e]) <= std::ldexp(std::fabs(ref[e]), -53) + 0x1p-1074))
        return at("out.ref_lo", e,
                  hexf(lo[e]) + " is more than half an ulp of out.ref " + hexf(ref[e]));
    }

    for (std::int64_t b = 0; b < c_.B; ++b)
      for (std::int64_t i = 0; i < c_.Nq; ++i) {
        bool any_head_valid = false;
        for (std::int64_t h = 0; h < c_.Hq; ++h) {
          const std::int64_t row = (b * c_.Hq + h) * c_.Nq + i;
          std::vector<std::int64_t> keys;
          for (std::int64_t j = 0; j < c_.Nk; ++j)
            if (c_.allowed(b, h, i, j)) keys.push_back(j);
          const bool is_valid = rv->data[sz(row)] != 0;
          // with sinks every row is valid: one without keys still has its sink
          const bool valid = !keys.empty() || c_.sinks;
          any_head_valid = any_head_valid || valid;
          if (is_valid != valid)
            return at("row.valid", row,
                      std::string(is_valid ? "true" : "false") + " but the row has " +
                          std::to_string(keys.size()) + " allowed keys" +
                          (c_.sinks ? " and a sink" : ""));
          if (auto p = weights_row(w, wr, lser, row, h, keys)) return p;
          if (auto p = scores_row(scr, row, keys)) return p;
          if (!lser.v.empty() && c_.sinks && keys.empty()) {
            if (!(lser[row] == c_.sink(h) && lse[row] == round_double(c_.sink(h), c_.dtype_of("lse"))))
              return at("lse.ref", row, hexf(lser[row]) + " on a row with only its sink, not the sink " +
                                            hexf(c_.sink(h)));
          } else if (!lser.v.empty()) {
            if (keys.empty() && !(lser[row] == -INFINITY && lse[row] == -INFINITY))
              return at("lse.ref", row, hexf(lser[row]) + " on a fully masked row, not -inf");
            if (!keys.empty() && !std::isfinite(lser[row]))
              return at("lse.ref", row, hexf(lser[row]) + " on a row with allowed keys");
          }
          if (!mha) {
            const std::int64_t base = row * width;
            if (keys.empty()) {
              for (std::int64_t col = 0; col < width; ++col)
                if (out[base + col] != 0 || ref[base + col] != 0)
                  return at("out", base + col, "not 0 on a fully masked row");
            } else if (auto p = hull(out, ref, b, h, base, keys)) {
              return p;
            }
          }
        }
        if (mha && !any_head_valid) {
          const std::int64_t base = (b * c_.Nq + i) * width;
          for (std::int64_t col = 0; col < width; ++col)
            if (out[base + col] != 0 || ref[base + col] != 0)
              return at("out", base + col, "not 0 on a row where every head is fully masked");
        }
      }
    // Each rounded tensor against its F64 companion, after the checks that say more.
    if (auto p = pairs("out", out, ref, c_.dtype_of("out"), c_.o_scale)) return p;
    if (auto p = pairs("weights", w, wr, c_.dtype_of("weights"))) return p;
    if (auto p = pairs("lse", lse, lser, c_.dtype_of("lse"))) return p;
    if (auto p = pairs("scores", sc, scr, c_.dtype_of("scores"))) return p;
    return std::nullopt;
  }

 private:
  std::optional<std::string> at(const std::string& tensor, std::int64_t e,
                                const std::string& what) const {
    const RawTensor* t = f_.find(tensor);
    std::string idx;
    std::int64_t rest = e;
    Shape pos(t ? t->shape.size() : 0);
    for (std::size_t a = pos.size(); a-- > 0;) {
      pos[a] = rest % t->shape[a];
      rest /= t->shape[a];
    }
    return tensor + shape_string(pos) + ": " + what;
  }

  // An FP8 out is the rounding of O / o_scale: ref / o_scale in F64 is within 2^-52 of it
  // relatively (ref's rounding and the division's), two ulps.
  std::optional<std::string> pairs(const std::string& name, const Values& y, const Values& ref,
                                   DType o, std::optional<double> o_scale = std::nullopt) const {
    for (std::int64_t e = 0; e < static_cast<std::int64_t>(y.v.size()); ++e) {
      if (y.undecided.count(e) || ref.undecided.count(e)) continue;
      if (!consistent(y[e], o_scale ? ref[e] / *o_scale : ref[e], o, o_scale ? 2 : 1))
        return at(name, e, hexf(y[e]) + " is not a rounding of " + name + ".ref " + hexf(ref[e]) +
                               (o_scale ? " / o_scale " + hexf(*o_scale) : ""));
    }
    return std::nullopt;
  }

  // scores.ref: -inf exactly where the key is not allowed, finite elsewhere.
  std::optional<std::string> scores_row(const Values& scr, std::int64_t row,
                                        const std::vector<std::int64_t>& keys) const {
    if (scr.v.empty()) return std::nullopt;
    std::vector<char> allowed(sz(c_.Nk), 0);
    for (auto j : keys) allowed[sz(j)] = 1;
    for (std::int64_t j = 0; j < c_.Nk; ++j) {
      const double x = scr[row * c_.Nk + j];
      if (allowed[sz(j)] ? !std::isfinite(x) : x != -INFINITY)
        return at("scores.ref", row * c_.Nk + j,
                  hexf(x) + (allowed[sz(j)] ? " for an allowed key" : " for a key that is not allowed, not -inf"));
    }
    return std::nullopt;
  }

  std::optional<std::string> weights_row(const Values& w, const Values& wr, const Values& lser,
                                         std::int64_t row, std::int64_t h,
                                         const std::vector<std::int64_t>& keys) const {
    if (wr.v.empty()) return std::nullopt;
    const std::int64_t base = row * c_.Nk;
    std::vector<char> allowed(sz(c_.Nk), 0);
    for (auto j : keys) allowed[sz(j)] = 1;
    long double sum = 0;
    for (std::int64_t j = 0; j < c_.Nk; ++j) {
      const double a = w[base + j], r = wr[base + j];
      if (!allowed[sz(j)]) {
        if (a != 0 || r != 0)
          return at("weights.ref", base + j, hexf(r) + " for a key that is not allowed, not 0");
        continue;
      }
      if (!(a >= 0 && a <= 1 && r >= 0 && r <= 1))
        return at("weights.ref", base + j, hexf(r) + " is not within [0, 1]");
      sum += r;
    }
    // Each stored weight is within 2^-53 of its exact value relatively, and the sum adds
    // rounding errors of at most n 2^-53: n 2^-52 in all.
    long double tol = std::ldexp(static_cast<long double>(keys.size()), -52);
    long double want = 1;
    if (c_.sinks) {
      // 1 minus the sink's weight exp(sink - lse): lse.ref is within 2^-53 |lse| of lse, which
      // moves exp by that much relatively; without lse the sum is only at most 1.
      if (lser.v.empty()) {
        if (sum > 1 + tol)
          return at("weights.ref", base, "the row's allowed weights sum to " +
                                             hexf(static_cast<double>(sum)) + ", above 1");
        return std::nullopt;
      }
      const long double d = static_cast<long double>(c_.sink(h)) - lser[row];
      want = 1 - std::exp(d);
      tol += std::ldexp(std::fabs(static_cast<long double>(lser[row])) + 2, -50);
    }
    if (!keys.empty() && std::fabs(sum - want) > tol)
      return at("weights.ref", base,
                "the row's " + std::to_string(keys.size()) + " allowed weights sum to " +
                    hexf(static_cast<double>(sum)) + ", not " +
                    (c_.sinks ? "1 minus the sink's weight " + hexf(static_cast<double>(want))
                              : std::string("1")));
    return std::nullopt;
  }

  // Each output coordinate lies within [min, max] of the allowed values, rounded.
  std::optional<std::string> hull(const Values& out, const Values& ref, std::int64_t b,
                                  std::int64_t h, std::int64_t base,
                                  const std::vector<std::int64_t>& keys) const {
    const std::int64_t g = c_.kv_head(h);
    for (std::int64_t col = 0; col < c_.Dv; ++col) {
      double mn = INFINITY, mx = -INFINITY;
      for (auto j : keys) {
        const double x = c_.v.values[sz(((b * c_.Hkv + g) * c_.Nk + j) * c_.Dv + col)];
        mn = std::min(mn, x);
        mx = std::max(mx, x);
      }
      if (c_.sinks) {  // the weights sum to less than 1: a combination of 0 and the values
        mn = std::min(mn, 0.0);
        mx = std::max(mx, 0.0);
      }
      const double r = ref[base + col], y = out[base + col];
      if (!(mn <= r && r <= mx))
        return at("out.ref", base + col,
                  hexf(r) + " outside [" + hexf(mn) + ", " + hexf(mx) + "] of the allowed values");
      // an FP8 out is O / o_scale: the quotients' F64 neighbours keep the rounding's bounds
      const DType o = c_.dtype_of("out");
      const double lo = c_.o_scale ? std::nextafter(mn / *c_.o_scale, -INFINITY) : mn;
      const double hi = c_.o_scale ? std::nextafter(mx / *c_.o_scale, INFINITY) : mx;
      if (!(round_double(lo, o) <= y && y <= round_double(hi, o)))
        return at("out", base + col,
                  hexf(y) + " outside [" + hexf(mn) + ", " + hexf(mx) + "] of the allowed values");
    }
    return std::nullopt;
  }

  const Case& c_;
  const SafeTensorsFile& f_;
};

}  // namespace

std::optional<std::string> golden_layout_problem(const Case& c, const SafeTensorsFile& f) {
  const std::vector<GoldenSpec> want = c.golden_tensors();
  std::uint64_t undecided = 0;
  for (const GoldenSpec& e : want) {
    const RawTensor* t = f.find(e.name);
    if (!t) return e.name + ": missing";
    if (t->dtype != e.dtype || t->shape != e.shape)
      return e.name + ": " + std::string(dtype_name(t->dtype)) + " " + shape_string(t->shape) +
             ", expected " + std::string(dtype_name(e.dtype)) + " " + shape_string(e.shape);
    const RawTensor* idx = f.find(e.name + ".undecided");
    const RawTensor* alt = f.find(e.name + ".alt");
    if (!idx && !alt) continue;
    if (!idx || !alt) return e.name + ": .undecided and .alt must come together";
    if (idx->dtype != DType::I64 || idx->shape.size() != 1 || idx->shape[0] < 1)
      return e.name + ".undecided: not I64 [n] with n >= 1";
    if (alt->dtype != e.dtype || alt->shape != idx->shape)
      return e.name + ".alt: not " + std::string(dtype_name(e.dtype)) + " " +
             shape_string(idx->shape);
    std::int64_t prev = -1;
    for (std::int64_t k = 0; k < idx->shape[0]; ++k) {
      std::int64_t v;
      std::memcpy(&v, idx->data.data() + 8 * sz(k), 8);
      if (v <= prev || v >= t->numel())
        return e.name + ".undecided: indices not ascending within [0, " +
               std::to_string(t->numel()) + ")";
      prev = v;
    }
    undecided += static_cast<std::uint64_t>(idx->shape[0]);
  }
  for (const RawTensor& t : f.tensors) {
    if (!is_golden_tensor_name(t.name)) continue;
    std::string base = t.name;
    for (const char* suffix : {".undecided", ".alt"})
      if (base.size() > std::strlen(suffix) &&
          base.compare(base.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
        base.resize(base.size() - std::strlen(suffix));
    bool wanted = base.rfind("model.", 0) == 0;  // the model's magnitudes: checked below
    for (const GoldenSpec& e : want) wanted = wanted || e.name == base;
    if (!wanted) return t.name + ": present but the case does not call for it";
  }
  try {
    if (model_store().check) model_store().check(c, f);
  } catch (const InputError& e) {
    return e.field() + ": " + e.what();
  }
  const auto ref = f.metadata.find("attn.reference");
  if (ref == f.metadata.end()) return "attn.reference: missing";
  const auto und = f.metadata.find("attn.undecided");
  if (und == f.metadata.end() || und->second != std::to_string(undecided))
    return "attn.undecided: not " + std::to_string(undecided) +
           ", the number of undecided elements";
  return std::nullopt;
}

std::optional<std::string> golden_invariant_problem(const Case& c, const SafeTensorsFile& f) {
  return Checker(c, f).run();
}

}  // namespace attnoracle::vectors
