// The interval pieces the backward evaluations share (backward.cpp for kind sdpa,
// backward_mha.cpp for kind mha): directed-rounding products, sums of enclosed terms, the scale
// and softcap, and the softcap's derivative.
#pragma once

#include <mpfr.h>

#include <cstddef>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dropout.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "interval.hpp"

namespace attnoracle::detail::backward {

inline void set_zero(Enclosure& e) {
  mpfr_set_zero(e.lo, 1);
  mpfr_set_zero(e.hi, 1);
}
inline void copy_to(Enclosure& r, const Enclosure& x) {
  mpfr_set(r.lo, x.lo, MPFR_RNDD);
  mpfr_set(r.hi, x.hi, MPFR_RNDU);
}
// [lo, hi] = x * d for a double d: the sign of d picks the ends.
inline void mul_d(mpfr_ptr lo, mpfr_ptr hi, mpfr_srcptr xlo, mpfr_srcptr xhi, double d) {
  mpfr_mul_d(lo, d >= 0 ? xlo : xhi, d, MPFR_RNDD);
  mpfr_mul_d(hi, d >= 0 ? xhi : xlo, d, MPFR_RNDU);
}
// r = a * x with a >= 0 (r distinct from a and x): the sign of x's ends picks a's ends.
inline void mul_nonneg(Enclosure& r, const Enclosure& a, const Enclosure& x) {
  mpfr_mul(r.lo, mpfr_sgn(x.lo) >= 0 ? a.lo : a.hi, x.lo, MPFR_RNDD);
  mpfr_mul(r.hi, mpfr_sgn(x.hi) >= 0 ? a.hi : a.lo, x.hi, MPFR_RNDU);
}
// r = |x| (r distinct from x).
inline void abs_of(Enclosure& r, const Enclosure& x) {
  if (mpfr_sgn(x.lo) >= 0) {
    copy_to(r, x);
  } else if (mpfr_sgn(x.hi) <= 0) {
    mpfr_neg(r.lo, x.hi, MPFR_RNDD);
    mpfr_neg(r.hi, x.lo, MPFR_RNDU);
  } else {
    mpfr_set_zero(r.lo, 1);
    mpfr_neg(r.hi, x.lo, MPFR_RNDU);
    if (mpfr_greater_p(x.hi, r.hi)) mpfr_set(r.hi, x.hi, MPFR_RNDU);
  }
}

// Sums of enclosed terms: the lower ends summed down, the upper ends up.
struct Terms {
  MpfrVec lo, hi;
  std::size_t n = 0;
  void reset(std::size_t count, mpfr_prec_t p) {
    lo.resize(count, p);
    hi.resize(count, p);
    n = 0;
  }
  void sum(Enclosure& r) {
    if (n == 0) return set_zero(r);
    mpfr_sum(r.lo, lo.ptrs(), n, MPFR_RNDD);
    mpfr_sum(r.hi, hi.ptrs(), n, MPFR_RNDU);
  }
};

// The scale, the softcap and the keep scale 1 / (1 - p) of dropout at one precision.
struct Consts {
  Enclosure scale, abs_scale, cap, keep;
  bool softcap, dropout;
  Rational keep_exact;  // 1 / (1 - p) exactly, where keep_is_exact
  bool keep_is_exact = false;
  Consts(const Case& c, mpfr_prec_t p)
      : scale(p), abs_scale(p), cap(p), keep(p), softcap(c.softcap.has_value()), dropout(c.dropout.has_value()) {
    if (dropout) {
      enclose_keep_scale(keep.lo, keep.hi, c.dropout->p);
      keep_is_exact = exact_keep_scale(keep_exact.q, c.dropout->p);
    }
    if (c.scale) {
      detail::enclose_text(scale.lo, scale.hi, *c.scale);
    } else {  // 1/sqrt(Dk), correctly rounded each way
      mpfr_set_si(cap.lo, c.Dk, MPFR_RNDN);
      mpfr_rec_sqrt(scale.lo, cap.lo, MPFR_RNDD);
      mpfr_rec_sqrt(scale.hi, cap.lo, MPFR_RNDU);
    }
    abs_of(abs_scale, scale);
    if (softcap) detail::enclose_text(cap.lo, cap.hi, *c.softcap);
  }
};

// sech^2(T/c) = 1 - tanh^2(T/c), the softcap's derivative: sech decreases with |T/c|, so the
// largest |T| over the smallest c gives the lower end and the smallest |T| over the largest c
// the upper end.
inline void softcap_slope(Enclosure& r, const Enclosure& T, const Consts& k, mpfr_ptr tmp) {
  mpfr_abs(tmp, T.lo, MPFR_RNDN);
  if (mpfr_cmpabs(T.hi, tmp) > 0) mpfr_abs(tmp, T.hi, MPFR_RNDN);
  mpfr_div(tmp, tmp, k.cap.lo, MPFR_RNDU);
  mpfr_sech(r.lo, tmp, MPFR_RNDD);
  mpfr_sqr(r.lo, r.lo, MPFR_RNDD);
  if (mpfr_sgn(T.lo) <= 0 && mpfr_sgn(T.hi) >= 0) {
    mpfr_set_ui(tmp, 0, MPFR_RNDN);
  } else {
    mpfr_abs(tmp, T.lo, MPFR_RNDN);
    if (mpfr_cmpabs(T.hi, tmp) < 0) mpfr_abs(tmp, T.hi, MPFR_RNDN);
    mpfr_div(tmp, tmp, k.cap.hi, MPFR_RNDD);
  }
  mpfr_sech(r.hi, tmp, MPFR_RNDU);
  mpfr_sqr(r.hi, r.hi, MPFR_RNDU);
  if (mpfr_cmp_ui(r.hi, 1) > 0) mpfr_set_ui(r.hi, 1, MPFR_RNDN);
}

// Dropout: dP_ij (or its magnitude) times keep_ij / (1 - p), in place (tmp distinct from x).
inline void keep_scaled(Enclosure& x, bool kept, const Consts& k, Enclosure& tmp) {
  if (!k.dropout) return;
  if (!kept) return set_zero(x);
  if (k.keep_is_exact) return mul_keep_scale(x.lo, x.hi, x.lo, x.hi, k.keep_exact.q);  // increasing in x
  mul_nonneg(tmp, k.keep, x);
  copy_to(x, tmp);
}

// What the key and bias passes read of a row: lse_i, D_i and sum_c |dout_ic O_ic|, and
// whether its dS is exactly 0.
struct RowStat {
  bool valid = false;    // a row that takes part: not padding, not fully masked
  bool zero_ds = false;  // dP_ij the same exact number for every allowed j: dS_i = 0 exactly
  Enclosure lse{MPFR_PREC_MIN}, d{MPFR_PREC_MIN}, dabs{MPFR_PREC_MIN};
};

// One entry (i, j) of the backward: P, dS, dT and A = P (sum_c |dout_ic v_jc| + sum_c
// |dout_ic O_ic|), the magnitude of the terms dS is made of (times the softcap's slope in At,
// the magnitude of dT).
struct Entry {
  Enclosure P, dP, dPabs, x, dS, slope, dT, A, At, tmp;
  explicit Entry(mpfr_prec_t p)
      : P(p), dP(p), dPabs(p), x(p), dS(p), slope(p), dT(p), A(p), At(p), tmp(p) {}
};

// dS, dT and their magnitudes from P, dP and the row's statistics.
inline void backward_entry(Entry& e, const RowStat& st, const Enclosure* T, const Consts& k) {
  if (st.zero_ds) {
    set_zero(e.dS);
  } else {
    mpfr_sub(e.x.lo, e.dP.lo, st.d.hi, MPFR_RNDD);
    mpfr_sub(e.x.hi, e.dP.hi, st.d.lo, MPFR_RNDU);
    mul_nonneg(e.dS, e.P, e.x);
  }
  mpfr_add(e.x.lo, e.dPabs.lo, st.dabs.lo, MPFR_RNDD);
  mpfr_add(e.x.hi, e.dPabs.hi, st.dabs.hi, MPFR_RNDU);
  mul_nonneg(e.A, e.P, e.x);
  if (k.softcap && T) {
    softcap_slope(e.slope, *T, k, e.tmp.lo);
    mul_nonneg(e.dT, e.slope, e.dS);
    mul_nonneg(e.At, e.slope, e.A);
  } else {
    copy_to(e.dT, e.dS);
    copy_to(e.At, e.A);
  }
}


// From T holding q_i . k_j: T = scale q_i . k_j, S_ij = softcap(T) + bias (in e.x), and
// P_ij = exp(S_ij - lse_i), at most 1 (a weight).
inline void weight_from_dot(Entry& e, Enclosure& T, const RowStat& st, const Consts& k, double bias) {
  detail::mul_interval(T.lo, T.hi, T.lo, T.hi, k.scale.lo, k.scale.hi, e.tmp.lo);
  Enclosure& S = e.x;
  if (k.softcap) {
    detail::softcap_bound(S.lo, T.lo, k.cap.lo, k.cap.hi, MPFR_RNDD, e.tmp.lo);
    detail::softcap_bound(S.hi, T.hi, k.cap.lo, k.cap.hi, MPFR_RNDU, e.tmp.lo);
  } else {
    copy_to(S, T);
  }
  mpfr_add_d(S.lo, S.lo, bias, MPFR_RNDD);
  mpfr_add_d(S.hi, S.hi, bias, MPFR_RNDU);
  mpfr_sub(e.tmp.lo, S.lo, st.lse.hi, MPFR_RNDD);
  mpfr_exp(e.P.lo, e.tmp.lo, MPFR_RNDD);
  mpfr_sub(e.tmp.hi, S.hi, st.lse.lo, MPFR_RNDU);
  mpfr_exp(e.P.hi, e.tmp.hi, MPFR_RNDU);
  if (mpfr_cmp_ui(e.P.hi, 1) > 0) mpfr_set_ui(e.P.hi, 1, MPFR_RNDN);
}

}  // namespace attnoracle::detail::backward
