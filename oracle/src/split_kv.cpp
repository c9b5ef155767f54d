// The partial-merge invariant: the golden partial states of a split-KV case merge into its
// golden whole result (oracle/INVARIANTS.md).
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {
namespace {

const RawTensor* find(const EvalResult& res, const std::string& name) {
  for (const RawTensor& t : res.golden)
    if (t.name == name) return &t;
  return nullptr;
}

double f64(const RawTensor* t, std::int64_t e) {
  double x;
  std::memcpy(&x, t->data.data() + 8 * static_cast<std::size_t>(e), 8);
  return x;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

// An interval of MPFR numbers at 128 bits, lo rounded down and hi up.
struct Iv {
  mpfr_t lo, hi;
  Iv() { mpfr_inits2(128, lo, hi, static_cast<mpfr_ptr>(nullptr)); }
  ~Iv() { mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr)); }
  Iv(const Iv&) = delete;
  Iv& operator=(const Iv&) = delete;
  // x rounded to F64 within one unit in the last place: [prev(x), next(x)].
  void around(double x) {
    mpfr_set_d(lo, std::nextafter(x, -kInf), MPFR_RNDD);
    mpfr_set_d(hi, std::nextafter(x, kInf), MPFR_RNDU);
  }
  bool meets(const Iv& o) const { return mpfr_lessequal_p(lo, o.hi) && mpfr_lessequal_p(o.lo, hi); }
  std::string show() const {
    char buf[96];
    mpfr_snprintf(buf, sizeof buf, "[%.17Rg, %.17Rg]", lo, hi);
    return buf;
  }
};

}  // namespace

std::vector<Violation> check_partials(const Case& c, const EvalResult& res) {
  std::vector<Violation> out;
  const RawTensor *lp = find(res, "lse_partial.ref"), *op = find(res, "out_partial.ref");
  const RawTensor *oref = find(res, "out.ref"), *lref = find(res, "lse.ref");
  if (!lp) return out;  // without lse_partial no weight of a split is known
  const std::int64_t S = c.splits(), R = c.B * c.Hq * c.Nq, Dv = c.Dv;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        if (!c.query_valid(b, i)) continue;  // padding: never compared
        const std::int64_t row = (b * c.Hq + h) * c.Nq + i;
        auto add = [&](std::int64_t j, std::int64_t col, std::string d) {
          out.push_back(Violation{Invariant::PartialMerge, b, h, i, j, col, std::move(d)});
        };
        // lse_partial is -inf exactly on the splits without an allowed key, where out_partial is 0.
        double m = c.sinks ? c.sink(h) : -kInf;
        for (std::int64_t s = 0; s < S; ++s) {
          bool key = false;
          for (std::int64_t j = s * c.kv_split_size; j < std::min(c.Nk, (s + 1) * c.kv_split_size) && !key; ++j)
            key = detail::allowed(c, b, h, i, j);
          const double l = f64(lp, s * R + row);
          if ((l == -kInf) == key)
            add(-1, -1, "split " + std::to_string(s) + (key ? " has a key" : " has no key") +
                            " but lse_partial.ref is " + std::to_string(l));
          if (!key && op)
            for (std::int64_t d = 0; d < Dv; ++d)
              if (f64(op, (s * R + row) * Dv + d) != 0)
                add(-1, d, "split " + std::to_string(s) + " has no key but out_partial.ref is not 0");
          if (key) m = std::max(m, l);
        }
        if (m == -kInf) continue;  // a fully masked row: the policy's checks
        // E = sum_s exp(lse_s - m) (+ exp(sink - m)): exp is increasing, so the ends of each
        // term come from the ends of lse_s, rounded outwards.
        Iv E, t, lse;
        mpfr_set_zero(E.lo, 1), mpfr_set_zero(E.hi, 1);
        std::vector<std::unique_ptr<Iv>> e(static_cast<std::size_t>(S));
        for (std::int64_t s = 0; s < S; ++s) {
          const double l = f64(lp, s * R + row);
          if (l == -kInf) continue;
          auto& x = e[static_cast<std::size_t>(s)] = std::make_unique<Iv>();
          x->around(l);
          mpfr_sub_d(x->lo, x->lo, m, MPFR_RNDD), mpfr_sub_d(x->hi, x->hi, m, MPFR_RNDU);
          mpfr_exp(x->lo, x->lo, MPFR_RNDD), mpfr_exp(x->hi, x->hi, MPFR_RNDU);
          mpfr_add(E.lo, E.lo, x->lo, MPFR_RNDD), mpfr_add(E.hi, E.hi, x->hi, MPFR_RNDU);
        }
        if (c.sinks) {
          mpfr_set_d(t.lo, c.sink(h), MPFR_RNDD), mpfr_set_d(t.hi, c.sink(h), MPFR_RNDU);
          mpfr_sub_d(t.lo, t.lo, m, MPFR_RNDD), mpfr_sub_d(t.hi, t.hi, m, MPFR_RNDU);
          mpfr_exp(t.lo, t.lo, MPFR_RNDD), mpfr_exp(t.hi, t.hi, MPFR_RNDU);
          mpfr_add(E.lo, E.lo, t.lo, MPFR_RNDD), mpfr_add(E.hi, E.hi, t.hi, MPFR_RNDU);
        }
        if (lref) {
          mpfr_log(lse.lo, E.lo, MPFR_RNDD), mpfr_log(lse.hi, E.hi, MPFR_RNDU);
          mpfr_add_d(lse.lo, lse.lo, m, MPFR_RNDD), mpfr_add_d(lse.hi, lse.hi, m, MPFR_RNDU);
          Iv g;
          g.around(f64(lref, row));
          if (!lse.meets(g)) add(-1, -1, "merged lse " + lse.show() + " misses lse.ref " + g.show());
        }
        if (!op || !oref) continue;
        Iv acc, w, o, p;
        for (std::int64_t d = 0; d < Dv; ++d) {
          mpfr_set_zero(acc.lo, 1), mpfr_set_zero(acc.hi, 1);
          for (std::int64_t s = 0; s < S; ++s) {
            const auto& x = e[static_cast<std::size_t>(s)];
            if (!x) continue;
            mpfr_div(w.lo, x->lo, E.hi, MPFR_RNDD), mpfr_div(w.hi, x->hi, E.lo, MPFR_RNDU);  // w > 0
            o.around(f64(op, (s * R + row) * Dv + d));
            // w * o with w > 0: the ends pair by the sign of each end of o
            mpfr_mul(p.lo, mpfr_sgn(o.lo) >= 0 ? w.lo : w.hi, o.lo, MPFR_RNDD);
            mpfr_mul(p.hi, mpfr_sgn(o.hi) >= 0 ? w.hi : w.lo, o.hi, MPFR_RNDU);
            mpfr_add(acc.lo, acc.lo, p.lo, MPFR_RNDD), mpfr_add(acc.hi, acc.hi, p.hi, MPFR_RNDU);
          }
          Iv g;
          g.around(f64(oref, row * Dv + d));
          if (!acc.meets(g)) add(-1, d, "merged out " + acc.show() + " misses out.ref " + g.show());
        }
      }
  return out;
}

}  // namespace attnoracle::oracle
