#include "amax.hpp"

#include <algorithm>
#include <set>

namespace attnoracle::detail {

AmaxResult decide_amax(const std::vector<double>& lo, const std::vector<double>& hi, std::int64_t width,
                       const std::function<std::vector<Enclosure>(std::int64_t row, mpfr_prec_t p)>& out_at,
                       mpfr_prec_t p0, mpfr_prec_t cap) {
  AmaxResult res;
  // The exact max lies in [max lo, max hi]: it is some |O_e| <= hi_e, and each |O_e| >= lo_e.
  double mlo = 0, mhi = 0;
  for (std::size_t e = 0; e < lo.size(); ++e) mlo = std::max(mlo, lo[e]), mhi = std::max(mhi, hi[e]);
  const double a = round_double(mlo, DType::F32), z = round_double(mhi, DType::F32);
  res.r = {a == z, a, z};
  if (a == z) return res;
  // Only elements with hi_e >= max lo can be the max: their rows, evaluated again.
  std::set<std::int64_t> rows;
  for (std::size_t e = 0; e < hi.size(); ++e)
    if (hi[e] >= mlo) rows.insert(static_cast<std::int64_t>(e) / width);
  for (mpfr_prec_t p = std::min(2 * p0, cap);; p = std::min(2 * p, cap)) {
    Enclosure m(p + 8);
    mpfr_set_d(m.lo, mlo, MPFR_RNDD);
    mpfr_set_zero(m.hi, 1);
    mpfr_t x;
    mpfr_init2(x, p + 8);
    for (std::int64_t r : rows)
      for (const Enclosure& o : out_at(r, p)) {
        // |O| in [max(lo, -hi, 0), max(-lo, hi)]
        mpfr_neg(x, o.hi, MPFR_RNDD);
        if (mpfr_sgn(o.lo) >= 0) mpfr_max(x, x, o.lo, MPFR_RNDD);
        if (mpfr_cmp(x, m.lo) > 0) mpfr_set(m.lo, x, MPFR_RNDD);
        mpfr_neg(x, o.lo, MPFR_RNDU);
        mpfr_max(x, x, o.hi, MPFR_RNDU);
        if (mpfr_cmp(x, m.hi) > 0) mpfr_set(m.hi, x, MPFR_RNDU);
      }
    mpfr_clear(x);
    res.precision = p;
    res.r = round_enclosure(m.lo, m.hi, DType::F32);
    if (res.r.decided || p >= cap) return res;
  }
}

}  // namespace attnoracle::detail
