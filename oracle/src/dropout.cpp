// Dropout (CONTRACT section 10): a row of a dropout case against the same row of the case
// without dropout, evaluated again.
#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/dropout.hpp"
#include "detail.hpp"

namespace attnoracle::oracle {

using detail::overlap;
using detail::show;

Case without_dropout(const Case& c) {
  Case t = c;
  t.dropout.reset();
  t.file = {};
  return t;
}

std::vector<Violation> check_dropout(const Case& c, const Case& plain, std::int64_t b, std::int64_t h,
                                     std::int64_t i, mpfr_prec_t p) {
  std::vector<Violation> v;
  const auto add = [&](std::int64_t j, std::int64_t col, std::string what) {
    v.push_back(Violation{Invariant::Dropout, b, h, i, j, col, std::move(what)});
  };
  RowEnclosures d, a;
  try {
    d = RowEvaluator(c).row(b, h, i, p);
    a = RowEvaluator(plain).row(b, h, i, p);
  } catch (const FullyMaskedRow&) {
    return v;  // refused: the policy, checked elsewhere
  }
  if (!overlap(d.lse.at(0), a.lse.at(0)))
    add(-1, -1, "lse " + show(d.lse[0]) + " differs from " + show(a.lse[0]) + " without dropout");
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    const auto jj = static_cast<std::size_t>(j);
    if (!overlap(d.weights.at(0).at(jj), a.weights.at(0).at(jj)))
      add(j, -1, "weight " + show(d.weights[0][jj]) + " differs from " + show(a.weights[0][jj]) + " without dropout");
  }
  // O_c = 1 / (1 - p) sum_j keep_j A_j v_jc with A and v the twin's: each product
  // and the sum rounded outward, so the interval holds the exact value.
  const mpfr_prec_t q = p + 64;
  Enclosure s(q), t(q), sum(q);
  enclose_keep_scale(s.lo, s.hi, c.dropout->p);
  const std::int64_t g = c.kv_head(h);
  for (std::int64_t col = 0; col < c.Dv; ++col) {
    mpfr_set_zero(sum.lo, 1);
    mpfr_set_zero(sum.hi, 1);
    for (std::int64_t j = 0; j < c.Nk; ++j) {
      if (!c.kept(b, h, i, j)) continue;
      const Enclosure& w = a.weights[0][static_cast<std::size_t>(j)];
      const double x = plain.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dv + col)];
      mpfr_mul_d(t.lo, x >= 0 ? w.lo : w.hi, x, MPFR_RNDD);
      mpfr_mul_d(t.hi, x >= 0 ? w.hi : w.lo, x, MPFR_RNDU);
      mpfr_add(sum.lo, sum.lo, t.lo, MPFR_RNDD);
      mpfr_add(sum.hi, sum.hi, t.hi, MPFR_RNDU);
    }
    mpfr_mul(t.lo, sum.lo, mpfr_sgn(sum.lo) >= 0 ? s.lo : s.hi, MPFR_RNDD);
    mpfr_mul(t.hi, sum.hi, mpfr_sgn(sum.hi) >= 0 ? s.hi : s.lo, MPFR_RNDU);
    const Enclosure& o = d.out.at(static_cast<std::size_t>(col));
    if (!overlap(o, t))
      add(-1, col, "output " + show(o) + " is not 1 / (1 - p) times the kept part of A V " + show(t));
  }
  return v;
}

}  // namespace attnoracle::oracle
