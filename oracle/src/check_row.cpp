// The invariants that one evaluation of a row shows by itself.
#include <algorithm>
#include <map>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {

using detail::exactly_zero;
using detail::show;

namespace {

struct RowChecker {
  const Case& c;
  std::int64_t b, h, i;  // h: the head being checked
  const RowEnclosures& r;
  std::size_t slot;  // index of the head in r
  std::vector<Violation>& out;

  void add(Invariant inv, std::int64_t j, std::int64_t col, std::string detail) {
    out.push_back(Violation{inv, b, h, i, j, col, std::move(detail)});
  }

  void run() {
    const HeadDetail& hd = r.heads.at(slot);
    const std::vector<Enclosure>& w = r.weights.at(slot);
    const Enclosure& lse = r.lse.at(slot);
    std::vector<std::int64_t> keys;
    for (std::int64_t j = 0; j < c.Nk; ++j)
      if (detail::allowed(c, b, h, i, j)) keys.push_back(j);

    if (keys.empty()) {
      if (c.sinks)
        sink_only(hd, w, lse);
      else
        fully_masked(hd, w, lse);
      return;
    }
    if (!r.head_valid.at(slot))
      add(Invariant::MaskedRowPolicy, -1, -1,
          "the row has " + std::to_string(keys.size()) + " allowed keys but is marked invalid");

    std::vector<char> is_allowed(static_cast<std::size_t>(c.Nk), 0);
    for (auto j : keys) is_allowed[static_cast<std::size_t>(j)] = 1;

    // Weights: masked ones exactly 0, allowed ones in (0, 1], and their sum encloses 1 (with a
    // sink: 1 minus the sink's weight exp(sink - lse), read from the row's own lse).
    mpfr_t lo, hi;
    mpfr_inits2(mpfr_get_prec(w.at(0).lo) + 64, lo, hi, static_cast<mpfr_ptr>(nullptr));
    mpfr_set_zero(lo, 1);
    mpfr_set_zero(hi, 1);
    for (std::int64_t j = 0; j < c.Nk; ++j) {
      const Enclosure& e = w.at(static_cast<std::size_t>(j));
      if (!is_allowed[static_cast<std::size_t>(j)]) {
        if (!exactly_zero(e))
          add(Invariant::MaskedZero, j, -1, "weight of a key that is not allowed is " + show(e));
        continue;
      }
      if (mpfr_sgn(e.hi) <= 0 || mpfr_cmp_ui(e.lo, 1) > 0)
        add(Invariant::WeightRange, j, -1, "weight " + show(e) + " is not within (0, 1]");
      mpfr_add(lo, lo, e.lo, MPFR_RNDD);  // a lower bound of the sum of lower bounds
      mpfr_add(hi, hi, e.hi, MPFR_RNDU);
    }
    std::string with_sink;
    if (c.sinks) {  // exp is increasing: exp(sink - lse.hi) <= the sink's weight <= exp(sink - lse.lo)
      Enclosure ws(mpfr_get_prec(lo));
      mpfr_d_sub(ws.lo, c.sink(h), lse.hi, MPFR_RNDD);
      mpfr_exp(ws.lo, ws.lo, MPFR_RNDD);
      mpfr_d_sub(ws.hi, c.sink(h), lse.lo, MPFR_RNDU);
      mpfr_exp(ws.hi, ws.hi, MPFR_RNDU);
      mpfr_add(lo, lo, ws.lo, MPFR_RNDD);
      mpfr_add(hi, hi, ws.hi, MPFR_RNDU);
      with_sink = " and the sink's weight " + show(ws);
    }
    if (mpfr_cmp_ui(lo, 1) > 0 || mpfr_cmp_ui(hi, 1) < 0) {
      Enclosure s(mpfr_get_prec(lo));
      mpfr_set(s.lo, lo, MPFR_RNDD);
      mpfr_set(s.hi, hi, MPFR_RNDU);
      add(Invariant::RowSum, -1, -1,
          "weights of the " + std::to_string(keys.size()) + " allowed keys" + with_sink +
              " sum to " + show(s));
    }
    mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr));

    convex(keys, hd);
    equal_scores(keys, hd, w);
  }

  void fully_masked(const HeadDetail& hd, const std::vector<Enclosure>& w, const Enclosure& lse) {
    if (c.masked_rows == MaskedRows::Error && c.query_valid(b, i)) {
      add(Invariant::MaskedRowPolicy, -1, -1,
          "fully masked row under attn.masked_rows=error was evaluated instead of refused");
      return;
    }
    if (r.head_valid.at(slot))
      add(Invariant::MaskedRowPolicy, -1, -1, "fully masked row is marked valid");
    for (std::size_t col = 0; col < hd.out.size(); ++col)
      if (!exactly_zero(hd.out[col]))
        add(Invariant::MaskedRowPolicy, -1, static_cast<std::int64_t>(col),
            "output of a fully masked row is " + show(hd.out[col]) + ", not exactly 0");
    for (std::size_t j = 0; j < w.size(); ++j)
      if (!exactly_zero(w[j]))
        add(Invariant::MaskedRowPolicy, static_cast<std::int64_t>(j), -1,
            "weight in a fully masked row is " + show(w[j]) + ", not exactly 0");
    if (!(mpfr_inf_p(lse.lo) && mpfr_inf_p(lse.hi) && mpfr_sgn(lse.hi) < 0))
      add(Invariant::MaskedRowPolicy, -1, -1, "lse of a fully masked row is " + show(lse));
  }

  // A row with no allowed key but a sink: valid, weights and output exactly 0, lse = the sink.
  void sink_only(const HeadDetail& hd, const std::vector<Enclosure>& w, const Enclosure& lse) {
    if (!r.head_valid.at(slot))
      add(Invariant::MaskedRowPolicy, -1, -1, "a row with only its sink is marked invalid");
    for (std::size_t col = 0; col < hd.out.size(); ++col)
      if (!exactly_zero(hd.out[col]))
        add(Invariant::MaskedRowPolicy, -1, static_cast<std::int64_t>(col),
            "output of a row with only its sink is " + show(hd.out[col]) + ", not exactly 0");
    for (std::size_t j = 0; j < w.size(); ++j)
      if (!exactly_zero(w[j]))
        add(Invariant::MaskedZero, static_cast<std::int64_t>(j), -1,
            "weight in a row with only its sink is " + show(w[j]) + ", not exactly 0");
    if (mpfr_cmp_d(lse.lo, c.sink(h)) != 0 || mpfr_cmp_d(lse.hi, c.sink(h)) != 0)
      add(Invariant::RowSum, -1, -1,
          "lse of a row with only its sink is " + show(lse) + ", not the sink " +
              std::to_string(c.sink(h)));
  }

  // Each coordinate of the output (before any tightening) meets [min, max] of the allowed
  // values (with a sink, of 0 and the allowed values: the weights sum to less than 1); for sdpa the oracle reads the values itself, for mha it takes the exact hull of the
  // projected values from the evaluation.
  // Under dropout the output before its scaling by 1 / (1 - p) is a combination of 0 and the
  // kept keys' values (the kept weights sum to at most 1).
  void convex(const std::vector<std::int64_t>& all_keys, const HeadDetail& hd) {
    std::vector<std::int64_t> keys;
    for (auto j : all_keys)
      if (c.kept(b, h, i, j)) keys.push_back(j);
    for (std::int64_t col = 0; col < c.Dv; ++col) {
      const Enclosure& raw = hd.raw_out.at(static_cast<std::size_t>(col));
      Enclosure hull(64);
      if (c.kind == Kind::Sdpa) {
        const std::int64_t g = c.kv_head(h);
        double mn = INFINITY, mx = -INFINITY;
        for (auto j : keys) {
          const double x = c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dv + col)];
          mn = std::min(mn, x);
          mx = std::max(mx, x);
        }
        if (c.sinks || c.dropout) {
          mn = std::min(mn, 0.0);
          mx = std::max(mx, 0.0);
        }
        mpfr_set_d(hull.lo, mn, MPFR_RNDD);
        mpfr_set_d(hull.hi, mx, MPFR_RNDU);
      } else {
        const Enclosure& e = hd.hull.at(static_cast<std::size_t>(col));
        mpfr_set_prec(hull.lo, mpfr_get_prec(e.lo));
        mpfr_set_prec(hull.hi, mpfr_get_prec(e.hi));
        mpfr_set(hull.lo, e.lo, MPFR_RNDD);
        mpfr_set(hull.hi, e.hi, MPFR_RNDU);
      }
      if (!detail::overlap(raw, hull))
        add(Invariant::ConvexHull, -1, col,
            "output " + show(raw) + " lies outside the allowed values' range " + show(hull));
    }
  }

  // Keys with provably equal scores (identical key vectors, or exactly equal dot products,
  // and equal bias) must have overlapping weights.
  void equal_scores(const std::vector<std::int64_t>& keys, const HeadDetail& hd,
                    const std::vector<Enclosure>& w) {
    std::map<std::vector<double>, std::int64_t> first;  // key vector and bias -> first key
    auto same = [&](std::int64_t j0, std::int64_t j, const char* why) {
      const Enclosure& a = w.at(static_cast<std::size_t>(j0));
      const Enclosure& e = w.at(static_cast<std::size_t>(j));
      if (!detail::overlap(a, e))
        add(Invariant::EqualScores, j, -1,
            std::string("keys ") + std::to_string(j0) + " and " + std::to_string(j) + " (" + why +
                ") have weights " + show(a) + " and " + show(e));
    };
    if (c.kind == Kind::Sdpa) {
      const std::int64_t g = c.kv_head(h);
      for (auto j : keys) {
        const double* k = c.k.values.data() + ((b * c.Hkv + g) * c.Nk + j) * c.Dk;
        std::vector<double> id(k, k + c.Dk);
        id.push_back(c.bias_at(b, h, i, j));
        auto [it, fresh] = first.emplace(std::move(id), j);
        if (!fresh) same(it->second, j, "equal key vectors and bias");
      }
    }
    // exactly known, equal dot products
    std::vector<std::int64_t> exact;
    for (auto j : keys) {
      const Enclosure& d = hd.dots.at(static_cast<std::size_t>(j));
      if (mpfr_equal_p(d.lo, d.hi)) exact.push_back(j);
    }
    std::stable_sort(exact.begin(), exact.end(), [&](std::int64_t x, std::int64_t y) {
      return mpfr_less_p(hd.dots[static_cast<std::size_t>(x)].lo,
                         hd.dots[static_cast<std::size_t>(y)].lo);
    });
    for (std::size_t a = 0, s = 0; a < exact.size(); ++a) {
      const auto ja = static_cast<std::size_t>(exact[a]);
      const auto js = static_cast<std::size_t>(exact[s]);
      if (!mpfr_equal_p(hd.dots[ja].lo, hd.dots[js].lo)) {
        s = a;
        continue;
      }
      if (a != s && c.bias_at(b, h, i, exact[a]) == c.bias_at(b, h, i, exact[s]))
        same(exact[s], exact[a], "equal exact dot products and bias");
    }
  }
};

}  // namespace

std::vector<Violation> check_row(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                 const RowEnclosures& r) {
  std::vector<Violation> out;
  if (c.kind == Kind::Sdpa) {
    RowChecker{c, b, h, i, r, 0, out}.run();
  } else {
    for (std::int64_t hh = 0; hh < c.Hq; ++hh)
      RowChecker{c, b, hh, i, r, static_cast<std::size_t>(hh), out}.run();
  }
  return out;
}

}  // namespace attnoracle::oracle
