// dq and dk through the rotary rotation (CONTRACT section 10): the gradient of the unrotated row
// is R^T applied to that of the rotated row, pair by pair; the rounding of rotated q and k to
// attn.rotary_round passes the gradient unchanged (straight through, as autograd gives it).
#pragma once

#include <mpfr.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "attnoracle/reference/rotary.hpp"
#include "backward_parts.hpp"

namespace attnoracle::detail::backward {

// v, bd: the enclosures of one row's gradient and of its bound, for the rotated row at position
// t (0 <= t < Nrot). Pair (g1, g2) becomes (g1 cos + g2 sin, g2 cos - g1 sin), each product and
// sum rounded outward; the bound (b1, b2) becomes (b1 |cos| + b2 |sin|, b2 |cos| + b1 |sin|),
// which holds |R^T g| since b >= |g|. An exact zero is +0, as a sum of IEEE products gives it.
inline void rotate_back(const Rotary& r, std::int64_t t, std::vector<Enclosure>& v, std::vector<Enclosure>& bd,
                        mpfr_prec_t p) {
  Enclosure a(p), b(p), x1(p), x2(p), bx1(p), bx2(p);
  const auto pair_sum = [&](Enclosure& out, const Enclosure& g, double cg, const Enclosure& h, double ch) {
    mul_d(a.lo, a.hi, g.lo, g.hi, cg);
    mul_d(b.lo, b.hi, h.lo, h.hi, ch);
    mpfr_add(out.lo, a.lo, b.lo, MPFR_RNDD);
    mpfr_add(out.hi, a.hi, b.hi, MPFR_RNDU);
    if (mpfr_zero_p(out.lo)) mpfr_set_zero(out.lo, 1);
    if (mpfr_zero_p(out.hi)) mpfr_set_zero(out.hi, 1);
  };
  const std::int64_t half = r.R / 2;
  for (std::int64_t f = 0; f < half; ++f) {
    const auto e = static_cast<std::size_t>(t * half + f);
    const double cs = r.cos[e], sn = r.sin[e];
    const auto i1 = static_cast<std::size_t>(r.first(f)), i2 = static_cast<std::size_t>(r.second(f));
    pair_sum(x1, v[i1], cs, v[i2], sn);
    pair_sum(x2, v[i2], cs, v[i1], -sn);
    pair_sum(bx1, bd[i1], std::fabs(cs), bd[i2], std::fabs(sn));
    pair_sum(bx2, bd[i2], std::fabs(cs), bd[i1], std::fabs(sn));
    copy_to(v[i1], x1), copy_to(v[i2], x2), copy_to(bd[i1], bx1), copy_to(bd[i2], bx2);
  }
}

}  // namespace attnoracle::detail::backward
