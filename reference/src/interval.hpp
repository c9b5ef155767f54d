// Directed-rounding building blocks of the interval kernel. An interval is a pair (lo, hi) of
// mpfr_t with lo rounded down and hi rounded up, so the exact value always lies inside.
#pragma once

#include <mpfr.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace attnoracle::detail {

// A growable array of mpfr_t that reuses its allocations across rows.
class MpfrVec {
 public:
  MpfrVec() = default;
  MpfrVec(const MpfrVec&) = delete;
  MpfrVec& operator=(const MpfrVec&) = delete;
  ~MpfrVec() {
    for (auto& x : v_) mpfr_clear(x.x);
  }
  // Ensures n elements at precision p (values are left unspecified).
  void resize(std::size_t n, mpfr_prec_t p) {
    if (p != prec_) {
      for (auto& x : v_) mpfr_set_prec(x.x, p);
      prec_ = p;
    }
    while (v_.size() < n) {
      v_.emplace_back();
      mpfr_init2(v_.back().x, p);
    }
    n_ = n;
    ptrs_.resize(n);
    for (std::size_t i = 0; i < n; ++i) ptrs_[i] = v_[i].x;
  }
  mpfr_ptr operator[](std::size_t i) { return v_[i].x; }
  mpfr_srcptr operator[](std::size_t i) const { return v_[i].x; }
  std::size_t size() const { return n_; }
  // For mpfr_sum.
  const mpfr_ptr* ptrs() { return ptrs_.data(); }

 private:
  struct Elem {
    mpfr_t x;
  };
  std::vector<Elem> v_;
  std::vector<mpfr_ptr> ptrs_;
  std::size_t n_ = 0;
  mpfr_prec_t prec_ = 0;
};

// out = sum_d a[d sa] b[d sb] over n terms, exactly (out initialised by the caller): each
// product of two doubles is exact in 106 bits, and mpfr_sum is correctly rounded and reports
// exactness, so the precision doubles until the sum is exact; then only the bits in use are kept
// (exact), so that later exact products stay small. Returns out's precision.
inline mpfr_prec_t exact_dot(mpfr_ptr out, const double* a, std::ptrdiff_t sa, const double* b,
                             std::ptrdiff_t sb, std::int64_t n, MpfrVec& prods) {
  prods.resize(static_cast<std::size_t>(n), 106);
  for (std::int64_t d = 0; d < n; ++d) {
    mpfr_set_d(prods[static_cast<std::size_t>(d)], a[d * sa], MPFR_RNDN);
    mpfr_mul_d(prods[static_cast<std::size_t>(d)], prods[static_cast<std::size_t>(d)], b[d * sb], MPFR_RNDN);
  }
  mpfr_prec_t p = 128;
  mpfr_set_prec(out, p);
  while (mpfr_sum(out, prods.ptrs(), static_cast<unsigned long>(n), MPFR_RNDN) != 0) {
    p *= 2;
    mpfr_set_prec(out, p);
  }
  const mpfr_prec_t used = std::max<mpfr_prec_t>(mpfr_min_prec(out), MPFR_PREC_MIN);
  mpfr_prec_round(out, used, MPFR_RNDN);  // exact: the value fits in `used` bits
  return used;
}

// [rlo, rhi] = [alo, ahi] * [blo, bhi], all signs: the extremes are among the four corner
// products, each rounded in its direction.
inline void mul_interval(mpfr_ptr rlo, mpfr_ptr rhi, mpfr_srcptr alo, mpfr_srcptr ahi,
                         mpfr_srcptr blo, mpfr_srcptr bhi, mpfr_ptr tmp) {
  mpfr_srcptr as[2] = {alo, ahi};
  mpfr_srcptr bs[2] = {blo, bhi};
  // rlo/rhi may alias inputs: compute into tmp and a local copy.
  mpfr_t lo, hi;
  mpfr_init2(lo, mpfr_get_prec(rlo));
  mpfr_init2(hi, mpfr_get_prec(rhi));
  mpfr_set_inf(lo, 1);
  mpfr_set_inf(hi, -1);
  for (auto a : as)
    for (auto b : bs) {
      mpfr_mul(tmp, a, b, MPFR_RNDD);
      if (mpfr_less_p(tmp, lo)) mpfr_set(lo, tmp, MPFR_RNDD);
      mpfr_mul(tmp, a, b, MPFR_RNDU);
      if (mpfr_greater_p(tmp, hi)) mpfr_set(hi, tmp, MPFR_RNDU);
    }
  mpfr_set(rlo, lo, MPFR_RNDD);
  mpfr_set(rhi, hi, MPFR_RNDU);
  mpfr_clear(lo);
  mpfr_clear(hi);
}

// [rlo, rhi] = [nlo, nhi] / [zlo, zhi] with 0 < zlo: the sign of the numerator's ends decides
// which end of the denominator bounds each quotient.
inline void div_by_positive(mpfr_ptr rlo, mpfr_ptr rhi, mpfr_srcptr nlo, mpfr_srcptr nhi,
                            mpfr_srcptr zlo, mpfr_srcptr zhi) {
  mpfr_div(rlo, nlo, mpfr_sgn(nlo) >= 0 ? zhi : zlo, MPFR_RNDD);
  mpfr_div(rhi, nhi, mpfr_sgn(nhi) >= 0 ? zlo : zhi, MPFR_RNDU);
}

// Encloses the exact decimal or hexadecimal value of a metadata number.
inline void enclose_text(mpfr_ptr lo, mpfr_ptr hi, const std::string& text) {
  mpfr_strtofr(lo, text.c_str(), nullptr, 0, MPFR_RNDD);
  mpfr_strtofr(hi, text.c_str(), nullptr, 0, MPFR_RNDU);
}

// r = bound of c*tanh(t/c) over c in [cl, ch]: lower (RNDD) or upper (RNDU). The function
// increases with t, and with c for t > 0 (decreases for t < 0), so the extremes over the box of
// t and c lie at its corners; each monotone step rounded the same way keeps the bound.
inline void softcap_bound(mpfr_ptr r, mpfr_srcptr t, mpfr_srcptr cl, mpfr_srcptr ch, mpfr_rnd_t rnd,
                   mpfr_ptr tmp) {
  mpfr_t best;
  mpfr_init2(best, mpfr_get_prec(r));
  for (int k = 0; k < 2; ++k) {
    mpfr_srcptr cap = k == 0 ? cl : ch;
    mpfr_div(tmp, t, cap, rnd);
    mpfr_tanh(tmp, tmp, rnd);
    mpfr_mul(tmp, tmp, cap, rnd);
    if (k == 0 || (rnd == MPFR_RNDD ? mpfr_less_p(tmp, best) : mpfr_greater_p(tmp, best)))
      mpfr_set(best, tmp, rnd);
  }
  mpfr_set(r, best, rnd);
  mpfr_clear(best);
}

}  // namespace attnoracle::detail
