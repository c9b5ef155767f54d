// The fast path's hot loops in SIMD lanes (Highway, dispatched at run time): Dot2 over blocks
// of keys, exp_dd over many arguments, the P V column sums and BallSums' steps. Each lane
// performs exactly the operations of the scalar code (dd.hpp, ball.hpp's dot2, exp_dd.cpp, the
// scalar functions below) in the same order, so every result is
// bit-identical to it on every target; a target without a fused multiply-add runs the scalar
// loops instead. Compiled with -ffp-contract=off. The loops over a kernel's K vectors are
// unrolled (HWY_UNROLL), so that their running sums stay in registers rather than on the stack.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fast/simd.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attnoracle/reference/file.hpp"
#include "fast/ball.hpp"
#include "fast/dd.hpp"
#include "fast/error_bounds.hpp"
#include "fast/exp_dd.hpp"
#include "fast/simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace attnoracle::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_NATIVE_FMA
using D = hn::ScalableTag<double>;
using V = hn::Vec<D>;

struct VDD {
  V hi, lo;
};
// The error-free transformations and double-double operations of dd.hpp, lane by lane.
HWY_INLINE VDD two_sum(V a, V b) {
  const V s = hn::Add(a, b);
  const V bb = hn::Sub(s, a);
  return {s, hn::Add(hn::Sub(a, hn::Sub(s, bb)), hn::Sub(b, bb))};
}
HWY_INLINE VDD fast_two_sum(V a, V b) {
  const V s = hn::Add(a, b);
  return {s, hn::Sub(b, hn::Sub(s, a))};
}
HWY_INLINE VDD two_prod(V a, V b) {
  const V p = hn::Mul(a, b);
  return {p, hn::MulSub(a, b, p)};  // fma(a, b, -p): the same single rounding
}
HWY_INLINE VDD add(VDD x, VDD y) {
  const VDD s = two_sum(x.hi, y.hi);
  const VDD t = two_sum(x.lo, y.lo);
  const VDD v = fast_two_sum(s.hi, hn::Add(s.lo, t.hi));
  return fast_two_sum(v.hi, hn::Add(t.lo, v.lo));
}
HWY_INLINE VDD mul(VDD x, V y) {
  const VDD c = two_prod(x.hi, y);
  return fast_two_sum(c.hi, hn::MulAdd(x.lo, y, c.lo));
}
HWY_INLINE VDD mul(VDD x, VDD y) {
  const VDD c = two_prod(x.hi, y.hi);
  const V tl0 = hn::Mul(x.lo, y.lo);
  const V tl1 = hn::MulAdd(x.hi, y.lo, tl0);
  const V cl2 = hn::MulAdd(x.lo, y.hi, tl1);
  return fast_two_sum(c.hi, hn::Add(c.lo, cl2));
}
#endif

#if HWY_NATIVE_FMA
// Dot2 of q with lanes [l, l + n) of K consecutive blocks from block b: K independent chains
// per lane, so that their latencies overlap.
template <std::size_t K, bool kExact>
HWY_INLINE void dot2_chains(const double* HWY_RESTRICT q, const double* HWY_RESTRICT kt, std::int64_t len,
                            std::int64_t b, std::size_t l, double* HWY_RESTRICT sh, double* HWY_RESTRICT sl,
                            double* HWY_RESTRICT sabs) {
  const D d;
  V h[K], lo[K], a[K];
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) h[v] = lo[v] = a[v] = hn::Zero(d);
  const double* k = kt + b * len * kKeyBlock + l;
  for (std::int64_t e = 0; e < len; ++e) {
    const V qe = hn::Set(d, q[e]);
    HWY_UNROLL(8)
    for (std::size_t v = 0; v < K; ++v) {
      const V kv = hn::LoadU(d, k + (static_cast<std::int64_t>(v) * len + e) * kKeyBlock);
      if constexpr (kExact) {  // p = q k exactly: TwoProd's residual is 0
        const V p = hn::Mul(qe, kv);
        const VDD t = two_sum(h[v], p);
        h[v] = t.hi;
        lo[v] = hn::Add(lo[v], t.lo);  // sl += t.lo
        a[v] = hn::Add(a[v], hn::Abs(p));
      } else {
        const VDD p = two_prod(qe, kv);
        const VDD t = two_sum(h[v], p.hi);
        h[v] = t.hi;
        lo[v] = hn::Add(lo[v], hn::Add(t.lo, p.lo));  // sl += t.lo + p.lo
        a[v] = hn::Add(a[v], hn::Abs(p.hi));
      }
    }
  }
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) {
    const std::size_t o = (static_cast<std::size_t>(b) + v) * kKeyBlock + l;
    hn::StoreU(h[v], d, sh + o);
    hn::StoreU(lo[v], d, sl + o);
    hn::StoreU(a[v], d, sabs + o);
  }
}
#endif

#if HWY_NATIVE_FMA
template <bool kExact>
HWY_INLINE void dot2_all(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                         double* sl, double* sabs) {
  const std::size_t n = hn::Lanes(D());
  std::int64_t b = 0;
  for (; b + 2 <= blocks; b += 2)
    for (std::size_t l = 0; l < kKeyBlock; l += n) dot2_chains<2, kExact>(q, kt, len, b, l, sh, sl, sabs);
  for (; b < blocks; ++b)
    for (std::size_t l = 0; l < kKeyBlock; l += n) dot2_chains<1, kExact>(q, kt, len, b, l, sh, sl, sabs);
}
#endif

void Dot2Blocks(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                double* sl, double* sabs, bool exact_products) {
#if HWY_NATIVE_FMA
  if (kKeyBlock % hn::Lanes(D()) == 0) {
    if (exact_products) dot2_all<true>(q, kt, len, blocks, sh, sl, sabs);
    else dot2_all<false>(q, kt, len, blocks, sh, sl, sabs);
    return;
  }
#endif
  dot2_blocks_scalar(q, kt, len, blocks, sh, sl, sabs, exact_products);
}

#if HWY_NATIVE_FMA
// exp_dd of kInterleave vectors of arguments at xh, xl: each lane runs exp_dd.cpp's steps; the
// vectors' chains are independent, so their latencies overlap.
constexpr std::size_t kInterleave = 4;
template <std::size_t K>
HWY_INLINE void exp_vectors(const double* HWY_RESTRICT xh, const double* HWY_RESTRICT xl, double* HWY_RESTRICT rh,
                            double* HWY_RESTRICT rl) {
  const D d;
  const hn::RebindToSigned<D> di;
  const std::size_t n = hn::Lanes(d);
  const ExpConstants& C = exp_constants();
  VDD p[K], t[K];
  V k[K];
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) {
    const VDD x{hn::LoadU(d, xh + v * n), hn::LoadU(d, xl + v * n)};
    k[v] = hn::Round(hn::Mul(x.hi, hn::Set(d, 1.4426950408889634)));  // nearbyint
    const VDD r = add(x, mul(VDD{hn::Set(d, C.ln2.hi), hn::Set(d, C.ln2.lo)}, hn::Neg(k[v])));
    const V t_scale = hn::Set(d, std::ldexp(1.0, -10));  // scale2(r, -10): exact
    t[v] = VDD{hn::Mul(r.hi, t_scale), hn::Mul(r.lo, t_scale)};
    p[v] = VDD{hn::Set(d, C.inv_fact[9].hi), hn::Set(d, C.inv_fact[9].lo)};
  }
  for (int j = 8; j >= 0; --j) {
    const DD c = C.inv_fact[static_cast<unsigned>(j)];
    const VDD cv{hn::Set(d, c.hi), hn::Set(d, c.lo)};
    HWY_UNROLL(8)
    for (std::size_t v = 0; v < K; ++v) p[v] = add(mul(p[v], t[v]), cv);
  }
  for (int s = 0; s < 10; ++s)
    HWY_UNROLL(8)
    for (std::size_t v = 0; v < K; ++v) p[v] = mul(p[v], p[v]);
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) {
    // 2^k as a double (k in [-895, 12]: normal), so p 2^k is ldexp(p, k) correctly rounded.
    const auto bits = hn::ShiftLeft<52>(hn::Add(hn::ConvertTo(di, k[v]), hn::Set(di, 1023)));
    const V two_k = hn::BitCast(d, bits);
    hn::StoreU(hn::Mul(p[v].hi, two_k), d, rh + v * n);
    hn::StoreU(hn::Mul(p[v].lo, two_k), d, rl + v * n);
  }
}
#endif

void ExpDDMany(const double* xh, const double* xl, std::size_t count, double* rh, double* rl) {
  std::size_t i = 0;
#if HWY_NATIVE_FMA
  const std::size_t n = hn::Lanes(D());
  for (; i + kInterleave * n <= count; i += kInterleave * n) exp_vectors<kInterleave>(xh + i, xl + i, rh + i, rl + i);
  for (; i + n <= count; i += n) exp_vectors<1>(xh + i, xl + i, rh + i, rl + i);
#endif
  for (; i < count; ++i) {
    const DD e = exp_dd(DD{xh[i], xl[i]});
    rh[i] = e.hi;
    rl[i] = e.lo;
  }
}

#if HWY_NATIVE_FMA
// One BallSums step of a column vector (ball_sum_step's operations): x y added to (hi, lo, err).
HWY_INLINE void ball_step(V xh, V xl, V yc, V& hi, V& lo, V& err) {
  const VDD p = two_prod(xh, yc);
  const VDD t = two_sum(hi, p.hi);
  hi = t.hi;
  const V a = hn::Add(t.lo, p.lo), w = hn::MulAdd(xl, yc, a), l = hn::Add(lo, w);
  lo = l;
  err = hn::Add(err, hn::Add(hn::Add(hn::Abs(a), hn::Abs(w)), hn::Abs(l)));
}
#endif

void BallSumLanes(std::size_t count, const double* HWY_RESTRICT y, bool absolute, double xh, double xl, double xr,
                  double* HWY_RESTRICT hi, double* HWY_RESTRICT lo, double* HWY_RESTRICT errsum,
                  double* HWY_RESTRICT radsum, double* HWY_RESTRICT ymax) {
  std::size_t c = 0;
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t n = hn::Lanes(d);
  const V vxh = hn::Set(d, xh), vxl = hn::Set(d, xl), vxr = hn::Set(d, xr);
  for (; c + n <= count; c += n) {
    const V y0 = hn::LoadU(d, y + c), ay = hn::Abs(y0);
    V h = hn::LoadU(d, hi + c), l = hn::LoadU(d, lo + c), e = hn::LoadU(d, errsum + c);
    ball_step(vxh, vxl, absolute ? ay : y0, h, l, e);
    hn::StoreU(h, d, hi + c);
    hn::StoreU(l, d, lo + c);
    hn::StoreU(e, d, errsum + c);
    hn::StoreU(hn::Add(hn::LoadU(d, radsum + c), hn::Mul(vxr, ay)), d, radsum + c);
    hn::StoreU(hn::Max(hn::LoadU(d, ymax + c), ay), d, ymax + c);
  }
#endif
  ball_sum_lanes_scalar(c, count, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
}

#if HWY_NATIVE_FMA
// BallSumTerms on U column vectors from column c at once: U independent chains per term, which
// hides the latency of each column's chain of TwoSums.
template <std::size_t U>
HWY_INLINE void ball_sum_terms_vectors(std::size_t c, std::size_t n, const double* const* HWY_RESTRICT y,
                                       bool absolute, const double* HWY_RESTRICT xh, const double* HWY_RESTRICT xl,
                                       const double* HWY_RESTRICT xr, double* HWY_RESTRICT hi,
                                       double* HWY_RESTRICT lo, double* HWY_RESTRICT errsum,
                                       double* HWY_RESTRICT radsum, double* HWY_RESTRICT ymax) {
  const D d;
  const std::size_t w = hn::Lanes(d);
  V h[U], l[U], e[U], r[U], m[U];
#pragma GCC unroll 4
  for (std::size_t u = 0; u < U; ++u) {
    const std::size_t o = c + u * w;
    h[u] = hn::LoadU(d, hi + o), l[u] = hn::LoadU(d, lo + o), e[u] = hn::LoadU(d, errsum + o);
    r[u] = hn::LoadU(d, radsum + o), m[u] = hn::LoadU(d, ymax + o);
  }
  for (std::size_t a = 0; a < n; ++a) {  // BallSumLanes' step, term after term
    const V vxh = hn::Set(d, xh[a]), vxl = hn::Set(d, xl[a]), vxr = hn::Set(d, xr[a]);
#pragma GCC unroll 4
    for (std::size_t u = 0; u < U; ++u) {
      const V y0 = hn::LoadU(d, y[a] + c + u * w), ay = hn::Abs(y0);
      ball_step(vxh, vxl, absolute ? ay : y0, h[u], l[u], e[u]);
      r[u] = hn::Add(r[u], hn::Mul(vxr, ay));
      m[u] = hn::Max(m[u], ay);
    }
  }
#pragma GCC unroll 4
  for (std::size_t u = 0; u < U; ++u) {
    const std::size_t o = c + u * w;
    hn::StoreU(h[u], d, hi + o), hn::StoreU(l[u], d, lo + o), hn::StoreU(e[u], d, errsum + o);
    hn::StoreU(r[u], d, radsum + o), hn::StoreU(m[u], d, ymax + o);
  }
}
#endif

void BallSumTerms(std::size_t count, std::size_t n, const double* const* HWY_RESTRICT y, bool absolute,
                  const double* HWY_RESTRICT xh, const double* HWY_RESTRICT xl, const double* HWY_RESTRICT xr,
                  double* HWY_RESTRICT hi, double* HWY_RESTRICT lo, double* HWY_RESTRICT errsum,
                  double* HWY_RESTRICT radsum, double* HWY_RESTRICT ymax) {
  std::size_t c = 0;
#if HWY_NATIVE_FMA
  const std::size_t w = hn::Lanes(D());
  for (; c + 4 * w <= count; c += 4 * w)
    ball_sum_terms_vectors<4>(c, n, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
  for (; c + w <= count; c += w)
    ball_sum_terms_vectors<1>(c, n, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
#endif
  ball_sum_terms_scalar(c, count, n, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
}

#if HWY_NATIVE_FMA
// One step of a block's column sums (pv_step's operations): x y added to (hi, lo).
HWY_INLINE void pv_step(V xh, V xl, V yc, V& hi, V& lo) {
  const VDD p = two_prod(xh, yc);
  const VDD t = two_sum(hi, p.hi);
  hi = t.hi;
  lo = hn::Add(lo, hn::MulAdd(xl, yc, hn::Add(t.lo, p.lo)));
}
// pv_step for y >= 0 (and hi >= 0, x >= 0): TwoSum of two nonnegative numbers as Fast2Sum of the
// larger and the smaller, which gives the same two results (both are exact).
HWY_INLINE void pv_step_nonneg(V xh, V xl, V yc, V& hi, V& lo) {
  const VDD p = two_prod(xh, yc);
  const VDD t = fast_two_sum(hn::Max(hi, p.hi), hn::Min(hi, p.hi));
  hi = t.hi;
  lo = hn::Add(lo, hn::MulAdd(xl, yc, hn::Add(t.lo, p.lo)));
}
// A block's sums (hi, lo) added to the totals at th, tl (pv_total's operations).
HWY_INLINE void pv_total(V hi, V lo, double* HWY_RESTRICT th, double* HWY_RESTRICT tl) {
  const D d;
  const VDD t = add(VDD{hn::LoadU(d, th), hn::LoadU(d, tl)}, two_sum(hi, lo));
  hn::StoreU(t.hi, d, th);
  hn::StoreU(t.lo, d, tl);
}
#endif

#if HWY_NATIVE_FMA
// Rows [a0, a1) into K consecutive column vectors from col: the signed and the magnitudes'
// sums of each, from zero, then added to the totals.
template <std::size_t K>
HWY_INLINE void pv_block(std::size_t a0, std::size_t a1, std::size_t col, const double* HWY_RESTRICT y,
                         const std::int64_t* HWY_RESTRICT rows, std::size_t stride, const double* HWY_RESTRICT xh,
                         const double* HWY_RESTRICT xl, const PVColumns& s) {
  const D d;
  const std::size_t L = hn::Lanes(d);
  V nh[K], nl[K], mh[K], ml[K];
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) nh[v] = nl[v] = mh[v] = ml[v] = hn::Zero(d);
  for (std::size_t a = a0; a < a1; ++a) {
    const double* ya = y + static_cast<std::size_t>(rows[a]) * stride + col;
    const V vh = hn::Set(d, xh[a]), vl = hn::Set(d, xl[a]);
    HWY_UNROLL(8)
    for (std::size_t v = 0; v < K; ++v) {
      const V y0 = hn::LoadU(d, ya + v * L);
      pv_step(vh, vl, y0, nh[v], nl[v]);
      pv_step_nonneg(vh, vl, hn::Abs(y0), mh[v], ml[v]);
    }
  }
  HWY_UNROLL(8)
  for (std::size_t v = 0; v < K; ++v) {
    const std::size_t c = col + v * L;
    pv_total(nh[v], nl[v], s.num_hi + c, s.num_lo + c);
    pv_total(mh[v], ml[v], s.mag_hi + c, s.mag_lo + c);
  }
}
#endif

void PVSums(std::size_t cols, std::size_t n, const double* HWY_RESTRICT y, const std::int64_t* HWY_RESTRICT rows,
            std::size_t stride, const double* HWY_RESTRICT xh, const double* HWY_RESTRICT xl, const PVColumns& s) {
  std::size_t c = 0;
#if HWY_NATIVE_FMA
  const std::size_t L = hn::Lanes(D());
  const std::size_t vec_end = cols / L * L;
  for (std::size_t a0 = 0; a0 < n; a0 += kSumBlock) {
    const std::size_t a1 = std::min(n, a0 + kSumBlock);
    std::size_t col = 0;
    for (; col + 2 * L <= vec_end; col += 2 * L) pv_block<2>(a0, a1, col, y, rows, stride, xh, xl, s);  // a cache line of y
    for (; col < vec_end; col += L) pv_block<1>(a0, a1, col, y, rows, stride, xh, xl, s);
  }
  c = vec_end;
#endif
  pv_sums_scalar(c, cols, n, y, rows, stride, xh, xl, s);
}

#if HWY_NATIVE_FMA
// fast_row.hpp's next_up of every lane (x = 0: the smallest subnormal), and -next_up(-x).
HWY_INLINE V next_up_lanes(V x) {
  const D d;
  const hn::RebindToSigned<D> di;
  const auto bits = hn::BitCast(di, x);
  const auto step = hn::IfThenElse(hn::RebindMask(di, hn::Gt(x, hn::Zero(d))), hn::Set(di, 1), hn::Set(di, -1));
  return hn::IfThenElse(hn::Eq(x, hn::Zero(d)), hn::Set(d, std::numeric_limits<double>::denorm_min()),
                        hn::BitCast(d, hn::Add(bits, step)));
}
HWY_INLINE V next_down_lanes(V x) { return hn::Neg(next_up_lanes(hn::Neg(x))); }
#endif

void BallEnds(const double* HWY_RESTRICT balls, std::size_t n, double* HWY_RESTRICT lo, double* HWY_RESTRICT hi) {
  std::size_t i = 0;
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t L = hn::Lanes(d);
  const V zero = hn::Zero(d);
  for (; i + L <= n; i += L) {
    V mh, ml, rad;
    hn::LoadInterleaved3(d, balls + 3 * i, mh, ml, rad);
    // lower() and upper(): mid -/+ s by DWPlusFP, s = radius_up(rad + kEndRel (mag(mid) + rad)).
    const V mag = hn::Mul(hn::Abs(mh), hn::Set(d, 1 + kMagRel));
    const V r = hn::Add(rad, hn::Mul(hn::Set(d, kEndRel), hn::Add(mag, rad)));
    const V sr = hn::Add(hn::Mul(r, hn::Set(d, 1 + kRadiusSlack)), hn::Set(d, kRadiusFloor));
    const VDD a = two_sum(mh, hn::Neg(sr)), b = two_sum(mh, sr);
    const VDD l = fast_two_sum(a.hi, hn::Add(ml, a.lo)), u = fast_two_sum(b.hi, hn::Add(ml, b.lo));
    const auto exact = hn::Eq(rad, zero);
    // round_down_dd and round_up_dd of those ends (of mid itself for an exact ball).
    const VDD ls = two_sum(hn::IfThenElse(exact, mh, l.hi), hn::IfThenElse(exact, ml, l.lo));
    const VDD us = two_sum(hn::IfThenElse(exact, mh, u.hi), hn::IfThenElse(exact, ml, u.lo));
    hn::StoreU(hn::IfThenElse(hn::Lt(ls.lo, zero), next_down_lanes(ls.hi), ls.hi), d, lo + i);
    hn::StoreU(hn::IfThenElse(hn::Gt(us.lo, zero), next_up_lanes(us.hi), us.hi), d, hi + i);
  }
#endif
  ball_ends_scalar(i, n, balls, lo, hi);
}

#if HWY_NATIVE_FMA
// ball.hpp's balls and their operations, lane by lane.
struct VBall {
  VDD mid;
  V rad;
};
HWY_INLINE V radius_up(V r) {
  const D d;
  return hn::Add(hn::Mul(r, hn::Set(d, 1 + kRadiusSlack)), hn::Set(d, kRadiusFloor));
}
HWY_INLINE V mag(VDD x) { return hn::Mul(hn::Abs(x.hi), hn::Set(D(), 1 + kMagRel)); }
HWY_INLINE VBall add(const VBall& a, V y) {
  const VDD s = two_sum(a.mid.hi, y);
  const VDD m = fast_two_sum(s.hi, hn::Add(a.mid.lo, s.lo));
  return {m, radius_up(hn::Add(a.rad, hn::Mul(hn::Set(D(), kAddFP), mag(m))))};
}
HWY_INLINE VBall add(const VBall& a, const VBall& b) {
  const VDD m = add(a.mid, b.mid);
  return {m, radius_up(hn::Add(hn::Add(a.rad, b.rad), hn::Mul(hn::Set(D(), kAddDD), mag(m))))};
}
HWY_INLINE VBall mul(const VBall& a, const VBall& b) {
  const VDD m = mul(a.mid, b.mid);
  const V r = hn::Add(hn::Add(hn::Mul(mag(a.mid), b.rad), hn::Mul(mag(b.mid), a.rad)), hn::Mul(a.rad, b.rad));
  return {m, radius_up(hn::Add(r, hn::Mul(hn::Set(D(), kMulDD), mag(m))))};
}
HWY_INLINE VBall exp_ball(const VBall& a, VDD m) {
  const D d;
  const V e = hn::Mul(mag(m), hn::Set(d, 1 + kExpMid));
  return {m, radius_up(hn::Mul(e, hn::Add(hn::Mul(a.rad, hn::Add(hn::Set(d, 1.0), a.rad)), hn::Set(d, kExpRel))))};
}
HWY_INLINE VBall load(const BallArrays& b, std::size_t a) {
  const D d;
  return {{hn::LoadU(d, b.hi + a), hn::LoadU(d, b.lo + a)}, hn::LoadU(d, b.rad + a)};
}
HWY_INLINE void store(const VBall& x, const BallArrays& b, std::size_t a) {
  const D d;
  hn::StoreU(x.mid.hi, d, b.hi + a);
  hn::StoreU(x.mid.lo, d, b.lo + a);
  hn::StoreU(x.rad, d, b.rad + a);
}
HWY_INLINE VBall splat(const Ball& b) {
  const D d;
  return {{hn::Set(d, b.mid.hi), hn::Set(d, b.mid.lo)}, hn::Set(d, b.rad)};
}
#endif

bool ScoreBalls(std::size_t n, const double* sh, const double* sl, const double* sabs, const double* bias,
                double dot_factor, const Ball& scale, BallArrays dot, BallArrays score, double* max) {
  std::size_t a = 0;
  bool ok = true;
  double top = -INFINITY;
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t L = hn::Lanes(d);
  const VBall sc = splat(scale);
  const V factor = hn::Set(d, dot_factor), zero = hn::Zero(d);
  auto finite = hn::Eq(zero, zero);
  V vtop = hn::Set(d, -INFINITY);
  for (; a + L <= n; a += L) {
    const VBall dt{two_sum(hn::LoadU(d, sh + a), hn::LoadU(d, sl + a)), radius_up(hn::Mul(factor, hn::LoadU(d, sabs + a)))};
    VBall s = mul(sc, dt);
    if (bias) {  // add(s, bias) where the bias is nonzero
      const V y = hn::LoadU(d, bias + a);
      const VBall t = add(s, y);
      const auto nz = hn::Ne(y, zero);
      s = {{hn::IfThenElse(nz, t.mid.hi, s.mid.hi), hn::IfThenElse(nz, t.mid.lo, s.mid.lo)},
           hn::IfThenElse(nz, t.rad, s.rad)};
    }
    store(dt, dot, a);
    store(s, score, a);
    finite = hn::And(finite, hn::And(hn::IsFinite(s.mid.hi), hn::IsFinite(s.rad)));
    vtop = hn::Max(vtop, s.mid.hi);
  }
  ok = hn::AllTrue(d, finite);
  top = hn::GetLane(hn::MaxOfLanes(d, vtop));
#endif
  double tail = -INFINITY;
  ok = score_balls_scalar(a, n, sh, sl, sabs, bias, dot_factor, scale, dot, score, &tail) && ok;
  *max = std::max(top, tail);
  return ok;
}

bool ExpArgs(std::size_t n, BallArrays score, double m, BallArrays x, double* xh, double* xl) {
  std::size_t a = 0;
  bool ok = true;
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t L = hn::Lanes(d);
  const V neg_m = hn::Set(d, -m), max_rad = hn::Set(d, kExpMaxRad), max_arg = hn::Set(d, kExpMax),
          min_arg = hn::Set(d, kExpMin);
  auto applies = hn::Eq(neg_m, neg_m);
  for (; a + L <= n; a += L) {
    const VBall t = add(load(score, a), neg_m);
    store(t, x, a);
    applies = hn::And(applies, hn::And(hn::Le(t.rad, max_rad), hn::Le(t.mid.hi, max_arg)));
    const auto tiny = hn::Lt(t.mid.hi, min_arg);
    hn::StoreU(hn::IfThenZeroElse(tiny, t.mid.hi), d, xh + a);
    hn::StoreU(hn::IfThenZeroElse(tiny, t.mid.lo), d, xl + a);
  }
  ok = hn::AllTrue(d, applies);
#endif
  return exp_args_scalar(a, n, score, m, x, xh, xl) && ok;
}

void ExpBalls(std::size_t n, BallArrays x, const double* eh, const double* el, BallArrays e) {
  std::size_t a = 0;
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t L = hn::Lanes(d);
  const V min_arg = hn::Set(d, kExpMin), tiny_rad = hn::Set(d, kTinyExp);
  for (; a + L <= n; a += L) {
    const VBall t = load(x, a);
    const VBall b = exp_ball(t, VDD{hn::LoadU(d, eh + a), hn::LoadU(d, el + a)});
    const auto tiny = hn::Lt(t.mid.hi, min_arg);  // exp(x) within [0, kTinyExp]
    store(VBall{{hn::IfThenZeroElse(tiny, b.mid.hi), hn::IfThenZeroElse(tiny, b.mid.lo)},
                hn::IfThenElse(tiny, tiny_rad, b.rad)},
          e, a);
  }
#endif
  exp_balls_scalar(a, n, x, eh, el, e);
}

Ball BallTotal(std::size_t n, BallArrays x) {
#if HWY_NATIVE_FMA
  const D d;
  const std::size_t L = hn::Lanes(d);
  constexpr std::size_t kMaxVectors = 4;
  if (kSumParts % L == 0 && kSumParts / L <= kMaxVectors) {
    const std::size_t nv = kSumParts / L, whole = n - n % kSumParts;
    VBall part[kMaxVectors];
    for (std::size_t v = 0; v < nv; ++v) part[v] = {{hn::Zero(d), hn::Zero(d)}, hn::Zero(d)};
    for (std::size_t a = 0; a < whole; a += kSumParts)
      for (std::size_t v = 0; v < nv; ++v) part[v] = add(part[v], load(x, a + v * L));
    double hi[kSumParts], lo[kSumParts], rad[kSumParts];
    for (std::size_t v = 0; v < nv; ++v) store(part[v], BallArrays{hi, lo, rad}, v * L);
    return ball_total_of_parts(BallArrays{hi, lo, rad}, whole, n, x);
  }
#endif
  return ball_total_scalar(n, x);
}

void MulBalls(std::size_t n, BallArrays x, const Ball& y, BallArrays out) {
  std::size_t a = 0;
#if HWY_NATIVE_FMA
  const std::size_t L = hn::Lanes(D());
  const VBall yv = splat(y);
  for (; a + L <= n; a += L) store(mul(load(x, a), yv), out, a);
#endif
  mul_balls_scalar(a, n, x, y, out);
}

// The scans of a case's inputs before the fast path applies. Comparisons, bit operations and
// selections are exact on every target, so these need no fused multiply-add.
// Lanes of |x| that are 0 or within [kMinInput, kMaxInput] (false for NaN).
template <class D, class V>
HWY_INLINE auto InRange(D d, V a) {
  return hn::Or(hn::Eq(a, hn::Zero(d)), hn::And(hn::Ge(a, hn::Set(d, kMinInput)), hn::Le(a, hn::Set(d, kMaxInput))));
}

// How many x[i] are out of range (returned), and the or of their bits kLowBits, in one pass.
std::size_t InputScan(const double* HWY_RESTRICT x, std::size_t n, std::uint64_t* HWY_RESTRICT low) {
  std::size_t i = 0, bad = 0;
  std::uint64_t any = 0;
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> d;
  const hn::RebindToUnsigned<decltype(d)> du;
  const std::size_t L = hn::Lanes(d);
  const auto mask = hn::Set(du, kLowBits);
  auto acc = hn::Zero(du);
  for (; i + L <= n; i += L) {
    const auto x0 = hn::LoadU(d, x + i);
    bad += L - hn::CountTrue(d, InRange(d, hn::Abs(x0)));
    acc = hn::Or(acc, hn::And(hn::BitCast(du, x0), mask));
  }
  any = hn::AllTrue(du, hn::Eq(acc, hn::Zero(du))) ? 0 : 1;
#endif
  *low = any | low_bits_scalar(x + i, n - i);
  return bad + out_of_range_scalar(x + i, n - i);
}

// ValueRanges, and with Count how many of the values are out of range (returned; 0 without).
template <bool Count>
HWY_INLINE std::size_t ranges(std::size_t nd, std::size_t rows, const double* HWY_RESTRICT v,
                              double* HWY_RESTRICT vmin, double* HWY_RESTRICT vmax, double* HWY_RESTRICT absmin,
                              double* HWY_RESTRICT absmax) {
  std::size_t c0 = 0, bad = 0;
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> d;
  const std::size_t L = hn::Lanes(d);
  const std::size_t vec_end = nd / L * L;
  // Row after row, in memory order, the ranges of a row's columns in L1 (a column-major walk
  // reads a long block of rows from memory at a stride): every column sees the rows in order,
  // so std::min's and std::max's choices (signed zeros) are kept.
  for (std::size_t r = 0; r < rows; ++r) {
    const double* row = v + r * nd;
    for (std::size_t c = 0; c < vec_end; c += L) {
      const auto x = hn::LoadU(d, row + c), ax = hn::Abs(x);
      if (Count) bad += L - hn::CountTrue(d, InRange(d, ax));
      const auto mn = hn::LoadU(d, vmin + c), mx = hn::LoadU(d, vmax + c);
      const auto amn = hn::LoadU(d, absmin + c), amx = hn::LoadU(d, absmax + c);
      hn::StoreU(hn::IfThenElse(hn::Lt(x, mn), x, mn), d, vmin + c);
      hn::StoreU(hn::IfThenElse(hn::Lt(mx, x), x, mx), d, vmax + c);
      hn::StoreU(hn::IfThenElse(hn::Lt(ax, amn), ax, amn), d, absmin + c);
      hn::StoreU(hn::IfThenElse(hn::Lt(amx, ax), ax, amx), d, absmax + c);
    }
  }
  c0 = vec_end;
#endif
  value_ranges_scalar(c0, nd, rows, v, vmin, vmax, absmin, absmax);
  if (Count && c0 < nd)
    for (std::size_t r = 0; r < rows; ++r) bad += out_of_range_scalar(v + r * nd + c0, nd - c0);
  return bad;
}

void ValueRanges(std::size_t nd, std::size_t rows, const double* HWY_RESTRICT v, double* HWY_RESTRICT vmin,
                 double* HWY_RESTRICT vmax, double* HWY_RESTRICT absmin, double* HWY_RESTRICT absmax) {
  ranges<false>(nd, rows, v, vmin, vmax, absmin, absmax);
}
std::size_t ValueScan(std::size_t nd, std::size_t rows, const double* HWY_RESTRICT v, double* HWY_RESTRICT vmin,
                      double* HWY_RESTRICT vmax, double* HWY_RESTRICT absmin, double* HWY_RESTRICT absmax) {
  return ranges<true>(nd, rows, v, vmin, vmax, absmin, absmax);
}

const char* TargetHere() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace attnoracle::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnoracle::fast {

HWY_EXPORT(Dot2Blocks);
HWY_EXPORT(ExpDDMany);
HWY_EXPORT(TargetHere);
HWY_EXPORT(BallSumLanes);
HWY_EXPORT(BallSumTerms);
HWY_EXPORT(PVSums);
HWY_EXPORT(BallEnds);
HWY_EXPORT(ScoreBalls);
HWY_EXPORT(ExpArgs);
HWY_EXPORT(ExpBalls);
HWY_EXPORT(MulBalls);
HWY_EXPORT(BallTotal);
HWY_EXPORT(InputScan);
HWY_EXPORT(ValueRanges);
HWY_EXPORT(ValueScan);

void transpose_key_blocks(const double* k, std::int64_t n, std::int64_t len, std::int64_t b0, std::int64_t b1,
                          double* kt) {
  const auto kb = static_cast<std::int64_t>(kKeyBlock);
  for (std::int64_t j = b0 * kb; j < b1 * kb; ++j)
    for (std::int64_t e = 0; e < len; ++e)
      kt[static_cast<std::size_t>(((j / kb - b0) * len + e) * kb + j % kb)] =
          j < n ? k[static_cast<std::size_t>(j * len + e)] : 0.0;
}

std::vector<double> transpose_keys(const double* k, std::int64_t groups, std::int64_t n, std::int64_t len) {
  const std::int64_t blocks = key_blocks(n);
  const auto per_group = static_cast<std::size_t>(blocks * len) * kKeyBlock;
  std::vector<double> kt;
  reserve_large(kt, static_cast<std::size_t>(groups) * per_group);
  kt.resize(static_cast<std::size_t>(groups) * per_group);
  for (std::int64_t g = 0; g < groups; ++g)
    transpose_key_blocks(k + static_cast<std::size_t>(g * n * len), n, len, 0, blocks,
                         kt.data() + static_cast<std::size_t>(g) * per_group);
  return kt;
}

void dot2_blocks_scalar(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                        double* sl, double* sabs, bool exact_products) {
  for (std::int64_t b = 0; b < blocks; ++b)
    for (std::size_t l = 0; l < kKeyBlock; ++l) {
      const double* k = kt + b * len * kKeyBlock + l;
      double h = 0, lo = 0, a = 0;
      for (std::int64_t e = 0; e < len; ++e) {  // ball.hpp's dot2, key l of block b
        if (exact_products) {  // TwoProd's residual is 0
          const double p = q[e] * k[e * kKeyBlock];
          const DD t = fast::two_sum(h, p);
          h = t.hi;
          lo += t.lo;
          a += std::fabs(p);
          continue;
        }
        const DD p = two_prod(q[e], k[e * kKeyBlock]);
        const DD t = fast::two_sum(h, p.hi);
        h = t.hi;
        lo += t.lo + p.lo;
        a += std::fabs(p.hi);
      }
      const std::size_t o = static_cast<std::size_t>(b) * kKeyBlock + l;
      sh[o] = h;
      sl[o] = lo;
      sabs[o] = a;
    }
}

namespace {
// One step of ball.hpp's BallSums on one column: x y added to (hi, lo, err).
inline void ball_sum_step(double xh, double xl, double yc, double& hi, double& lo, double& err) {
  const DD p = two_prod(xh, yc);
  const DD t = fast::two_sum(hi, p.hi);
  hi = t.hi;
  const double a = t.lo + p.lo, w = std::fma(xl, yc, a), l = lo + w;
  lo = l;
  err += (std::fabs(a) + std::fabs(w)) + std::fabs(l);
}
}  // namespace

void ball_sum_lanes_scalar(std::size_t from, std::size_t count, const double* y, bool absolute, double xh,
                           double xl, double xr, double* hi, double* lo, double* errsum, double* radsum,
                           double* ymax) {
  for (std::size_t c = from; c < count; ++c) {  // ball.hpp's BallSums, column c
    const double yc = absolute ? std::fabs(y[c]) : y[c];
    ball_sum_step(xh, xl, yc, hi[c], lo[c], errsum[c]);
    radsum[c] += xr * std::fabs(yc);
    ymax[c] = std::max(ymax[c], std::fabs(yc));
  }
}

void ball_sum_terms_scalar(std::size_t from, std::size_t count, std::size_t n, const double* const* y, bool absolute,
                           const double* xh, const double* xl, const double* xr, double* hi, double* lo,
                           double* errsum, double* radsum, double* ymax) {
  for (std::size_t a = 0; a < n; ++a)
    ball_sum_lanes_scalar(from, count, y[a], absolute, xh[a], xl[a], xr[a], hi, lo, errsum, radsum, ymax);
}

void ball_sum_terms(std::size_t count, std::size_t n, const double* const* y, bool absolute, const double* xh,
                    const double* xl, const double* xr, double* hi, double* lo, double* errsum, double* radsum,
                    double* ymax) {
  HWY_DYNAMIC_DISPATCH(BallSumTerms)(count, n, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
}

namespace {
// One step of a block's column sums: x y added to (hi, lo), like Dot2.
inline void pv_step(double xh, double xl, double yc, double& hi, double& lo) {
  const DD p = two_prod(xh, yc);
  const DD t = fast::two_sum(hi, p.hi);
  hi = t.hi;
  lo += std::fma(xl, yc, t.lo + p.lo);
}
// A block's sums (hi, lo) added to the total (th, tl).
inline void pv_total(double hi, double lo, double& th, double& tl) {
  const DD t = fast::add(DD{th, tl}, two_sum(hi, lo));
  th = t.hi;
  tl = t.lo;
}
}  // namespace

void pv_sums_scalar(std::size_t from, std::size_t cols, std::size_t n, const double* y, const std::int64_t* rows,
                    std::size_t stride, const double* xh, const double* xl, const PVColumns& s) {
  for (std::size_t a0 = 0; a0 < n; a0 += kSumBlock) {
    const std::size_t a1 = std::min(n, a0 + kSumBlock);
    for (std::size_t c = from; c < cols; ++c) {
      double nh = 0, nl = 0, mh = 0, ml = 0;
      for (std::size_t a = a0; a < a1; ++a) {
        const double y0 = y[static_cast<std::size_t>(rows[a]) * stride + c];
        pv_step(xh[a], xl[a], y0, nh, nl);
        pv_step(xh[a], xl[a], std::fabs(y0), mh, ml);
      }
      pv_total(nh, nl, s.num_hi[c], s.num_lo[c]);
      pv_total(mh, ml, s.mag_hi[c], s.mag_lo[c]);
    }
  }
}

void pv_sums(std::size_t cols, std::size_t n, const double* y, const std::int64_t* rows, std::size_t stride,
             const double* xh, const double* xl, const PVColumns& s) {
  HWY_DYNAMIC_DISPATCH(PVSums)(cols, n, y, rows, stride, xh, xl, s);
}

void ball_sum_lanes(std::size_t count, const double* y, bool absolute, double xh, double xl, double xr,
                    double* hi, double* lo, double* errsum, double* radsum, double* ymax) {
  HWY_DYNAMIC_DISPATCH(BallSumLanes)(count, y, absolute, xh, xl, xr, hi, lo, errsum, radsum, ymax);
}

void dot2_blocks(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                 double* sl, double* sabs, bool exact_products) {
  HWY_DYNAMIC_DISPATCH(Dot2Blocks)(q, kt, len, blocks, sh, sl, sabs, exact_products);
}

std::size_t out_of_range_scalar(const double* x, std::size_t n) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double a = std::fabs(x[i]);
    bad += !((a == 0) | ((a >= kMinInput) & (a <= kMaxInput)));
  }
  return bad;
}

std::uint64_t low_bits_scalar(const double* x, std::size_t n) {
  std::uint64_t low = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t bits;
    std::memcpy(&bits, &x[i], 8);
    low |= bits & kLowBits;
  }
  return low;
}

void value_ranges_scalar(std::size_t from, std::size_t nd, std::size_t rows, const double* v, double* vmin,
                         double* vmax, double* absmin, double* absmax) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t ci = from; ci < nd; ++ci) {
      const double x = v[r * nd + ci], ax = std::fabs(x);
      vmin[ci] = std::min(vmin[ci], x);
      vmax[ci] = std::max(vmax[ci], x);
      absmin[ci] = std::min(absmin[ci], ax);
      absmax[ci] = std::max(absmax[ci], ax);
    }
}

std::size_t input_scan(const double* x, std::size_t n, bool& short_sig) {
  std::uint64_t low = 0;
  const std::size_t bad = HWY_DYNAMIC_DISPATCH(InputScan)(x, n, &low);
  short_sig = low == 0;
  return bad;
}

std::size_t out_of_range(const double* x, std::size_t n) {
  bool short_sig = false;
  return input_scan(x, n, short_sig);
}

bool short_significands(const double* x, std::size_t n) {
  bool short_sig = false;
  input_scan(x, n, short_sig);
  return short_sig;
}

void value_ranges(std::size_t nd, std::size_t rows, const double* v, double* vmin, double* vmax, double* absmin,
                  double* absmax) {
  HWY_DYNAMIC_DISPATCH(ValueRanges)(nd, rows, v, vmin, vmax, absmin, absmax);
}

std::size_t value_scan(std::size_t nd, std::size_t rows, const double* v, double* vmin, double* vmax, double* absmin,
                       double* absmax) {
  return HWY_DYNAMIC_DISPATCH(ValueScan)(nd, rows, v, vmin, vmax, absmin, absmax);
}

void exp_dd_many(const double* xh, const double* xl, std::size_t count, double* rh, double* rl) {
  HWY_DYNAMIC_DISPATCH(ExpDDMany)(xh, xl, count, rh, rl);
}

void ball_ends(const double* balls, std::size_t n, double* lo, double* hi) {
  HWY_DYNAMIC_DISPATCH(BallEnds)(balls, n, lo, hi);
}

bool score_balls(std::size_t n, const double* sh, const double* sl, const double* sabs, const double* bias,
                 double dot_factor, const Ball& scale, BallArrays dot, BallArrays score, double* max) {
  return HWY_DYNAMIC_DISPATCH(ScoreBalls)(n, sh, sl, sabs, bias, dot_factor, scale, dot, score, max);
}
bool exp_args(std::size_t n, BallArrays score, double m, BallArrays x, double* xh, double* xl) {
  return HWY_DYNAMIC_DISPATCH(ExpArgs)(n, score, m, x, xh, xl);
}
void exp_balls(std::size_t n, BallArrays x, const double* eh, const double* el, BallArrays e) {
  HWY_DYNAMIC_DISPATCH(ExpBalls)(n, x, eh, el, e);
}
void mul_balls(std::size_t n, BallArrays x, const Ball& y, BallArrays out) {
  HWY_DYNAMIC_DISPATCH(MulBalls)(n, x, y, out);
}
Ball ball_total(std::size_t n, BallArrays x) { return HWY_DYNAMIC_DISPATCH(BallTotal)(n, x); }

namespace {
Ball get(const BallArrays& b, std::size_t a) { return {DD{b.hi[a], b.lo[a]}, b.rad[a]}; }
void put(const BallArrays& b, std::size_t a, const Ball& x) {
  b.hi[a] = x.mid.hi;
  b.lo[a] = x.mid.lo;
  b.rad[a] = x.rad;
}
}  // namespace

bool score_balls_scalar(std::size_t from, std::size_t n, const double* sh, const double* sl, const double* sabs,
                        const double* bias, double dot_factor, const Ball& scale, BallArrays dot,
                        BallArrays score, double* max) {
  bool ok = true;
  double top = -INFINITY;
  for (std::size_t a = from; a < n; ++a) {
    const Ball dt = dot2_ball(sh[a], sl[a], sabs[a], dot_factor);
    Ball s = mul(scale, dt);
    if (bias && bias[a] != 0) s = add(s, bias[a]);
    put(dot, a, dt);
    put(score, a, s);
    ok = ok && std::isfinite(s.mid.hi) && std::isfinite(s.rad);
    top = std::max(top, s.mid.hi);
  }
  *max = top;
  return ok;
}

bool exp_args_scalar(std::size_t from, std::size_t n, BallArrays score, double m, BallArrays x, double* xh,
                     double* xl) {
  bool ok = true;
  for (std::size_t a = from; a < n; ++a) {
    const Ball t = add(get(score, a), -m);
    put(x, a, t);
    ok = ok && exp_applies(t);
    const bool tiny = t.mid.hi < kExpMin;
    xh[a] = tiny ? 0 : t.mid.hi;
    xl[a] = tiny ? 0 : t.mid.lo;
  }
  return ok;
}

void exp_balls_scalar(std::size_t from, std::size_t n, BallArrays x, const double* eh, const double* el,
                      BallArrays e) {
  for (std::size_t a = from; a < n; ++a) {
    const Ball t = get(x, a);
    put(e, a, t.mid.hi < kExpMin ? exp(t) : exp_ball(t, DD{eh[a], el[a]}));
  }
}

Ball ball_total_of_parts(BallArrays parts, std::size_t whole, std::size_t n, BallArrays x) {
  Ball total{};
  if (whole > 0)
    for (std::size_t l = 0; l < kSumParts; ++l) total = add(total, get(parts, l));
  for (std::size_t a = whole; a < n; ++a) total = add(total, get(x, a));
  return total;
}

Ball ball_total_scalar(std::size_t n, BallArrays x) {
  const std::size_t whole = n - n % kSumParts;
  double hi[kSumParts] = {}, lo[kSumParts] = {}, rad[kSumParts] = {};
  const BallArrays parts{hi, lo, rad};
  for (std::size_t a = 0; a < whole; ++a) put(parts, a % kSumParts, add(get(parts, a % kSumParts), get(x, a)));
  return ball_total_of_parts(parts, whole, n, x);
}

void mul_balls_scalar(std::size_t from, std::size_t n, BallArrays x, const Ball& y, BallArrays out) {
  for (std::size_t a = from; a < n; ++a) put(out, a, mul(get(x, a), y));
}

const char* simd_target() { return HWY_DYNAMIC_DISPATCH(TargetHere)(); }

}  // namespace attnoracle::fast
#endif
