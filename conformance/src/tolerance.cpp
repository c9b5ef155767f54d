#include "attnoracle/conformance/tolerance.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

// Every sum in this file is rounded as written: no contraction into fused multiply-adds (which
// -march flags or a target attribute would otherwise allow), except where a function says so.
#if defined(__clang__)
#pragma clang fp contract(off)
#define ATTNORACLE_CONTRACT(mode)
#else
#pragma GCC optimize("fp-contract=off")
#define ATTNORACLE_CONTRACT(mode) , optimize("fp-contract=" mode)
#endif

namespace attnoracle::conformance {

double unit_roundoff(DType t) { return std::ldexp(1.0, -float_format(t).precision); }
double min_normal(DType t) { return std::ldexp(1.0, 1 - float_format(t).bias); }
double min_subnormal(DType t) {
  const FloatFormat f = float_format(t);
  return std::ldexp(1.0, 2 - f.bias - f.precision);
}

namespace {

// ---- row_magnitudes ----
//
// For every row and allowed key j it needs dot_j = sum_d q_d k_jd and dabs_j = sum_d |q_d| |k_jd|
// in double, summed in d order (the values the limits have always been derived from), and only
// their maxima. Two ways, with the same results bit for bit:
//  - exact: every (i, j) in double, vectorised across keys (each lane sums in d order, no fused
//    multiply-add: fp-contract is off in this file);
//  - filtered: every (i, j) in float with a rigorous error bound, which leaves as candidates for
//    the maxima only the keys whose interval reaches the largest lower end; those few are then
//    computed exactly as above. Taken when the float computation cannot overflow or underflow
//    (input magnitudes in [2^-50, 2^51)) and there is no softcap (whose tanh would be needed
//    on every key anyway).
typedef double v2d __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int v4i __attribute__((vector_size(16)));
typedef int v8i __attribute__((vector_size(32)));
typedef int v16i __attribute__((vector_size(64)));
typedef unsigned char v4u8 __attribute__((vector_size(4)));
typedef unsigned char v8u8 __attribute__((vector_size(8)));
typedef unsigned char v16u8 __attribute__((vector_size(16)));

constexpr std::int64_t kKeyAlign = 32;  // keys padded to a multiple of every kernel's key block
constexpr std::int64_t kRowBlock = 64;  // query rows per pass over the keys (a multiple of R)

// Products and sums for rows [0, kRowBlock) of q (row-major [kRowBlock][Dk]) against keys
// [j0, j1) of kt (transposed [Dk][ldk]): s[r][j] = sum_d q[r][d] kt[d][j], a[r][j] = sum_d
// qa[r][d] kat[d][j], each summed in d order. j0 and j1 are multiples of the key block.
template <class T, class V, int R, int KV>
inline __attribute__((always_inline)) void dots(const T* q, const T* qa, std::int64_t Dk, const T* kt, const T* kat,
                                                std::int64_t ldk, std::int64_t j0, std::int64_t j1, T* s, T* a) {
  constexpr std::int64_t L = static_cast<std::int64_t>(sizeof(V) / sizeof(T)), JB = L * KV;
  for (std::int64_t jb = j0; jb < j1; jb += JB)
    for (std::int64_t r0 = 0; r0 < kRowBlock; r0 += R) {
      V vs[R][KV], va[R][KV];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < KV; ++v) vs[r][v] = va[r][v] = V{};
      for (std::int64_t d = 0; d < Dk; ++d) {
        V k[KV], ka[KV];
        for (int v = 0; v < KV; ++v) {
          std::memcpy(&k[v], kt + d * ldk + jb + v * L, sizeof(V));
          std::memcpy(&ka[v], kat + d * ldk + jb + v * L, sizeof(V));
        }
        for (int r = 0; r < R; ++r) {
          const T x = q[(r0 + r) * Dk + d], xa = qa[(r0 + r) * Dk + d];
          for (int v = 0; v < KV; ++v) {
            vs[r][v] = vs[r][v] + x * k[v];
            va[r][v] = va[r][v] + xa * ka[v];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < KV; ++v) {
          std::memcpy(s + (r0 + r) * ldk + jb + v * L, &vs[r][v], sizeof(V));
          std::memcpy(a + (r0 + r) * ldk + jb + v * L, &va[r][v], sizeof(V));
        }
    }
}

#define ATTNORACLE_DOTS_ARGS(T) const T *q, const T *qa, std::int64_t Dk, const T *kt, const T *kat, \
                                std::int64_t ldk, std::int64_t j0, std::int64_t j1, T *s, T *a
#define ATTNORACLE_DOTS_PASS q, qa, Dk, kt, kat, ldk, j0, j1, s, a
// Exact (double, no contraction into fused multiply-adds).
__attribute__((target("avx512f") ATTNORACLE_CONTRACT("off"))) void exact_avx512(ATTNORACLE_DOTS_ARGS(double)) {
  dots<double, v8d, 2, 4>(ATTNORACLE_DOTS_PASS);
}
__attribute__((target("avx2") ATTNORACLE_CONTRACT("off"))) void exact_avx2(ATTNORACLE_DOTS_ARGS(double)) {
  dots<double, v4d, 2, 2>(ATTNORACLE_DOTS_PASS);
}
void exact_sse(ATTNORACLE_DOTS_ARGS(double)) { dots<double, v2d, 2, 2>(ATTNORACLE_DOTS_PASS); }
// Filter (float; fused multiply-adds welcome: the error bound holds with or without them).
__attribute__((target("avx512f,fma") ATTNORACLE_CONTRACT("fast"))) void filter_avx512(ATTNORACLE_DOTS_ARGS(float)) {
  dots<float, v16f, 4, 2>(ATTNORACLE_DOTS_PASS);
}
__attribute__((target("avx2,fma") ATTNORACLE_CONTRACT("fast"))) void filter_avx2(ATTNORACLE_DOTS_ARGS(float)) {
  dots<float, v8f, 2, 2>(ATTNORACLE_DOTS_PASS);
}
void filter_sse(ATTNORACLE_DOTS_ARGS(float)) { dots<float, v4f, 2, 2>(ATTNORACLE_DOTS_PASS); }
#undef ATTNORACLE_DOTS_ARGS
#undef ATTNORACLE_DOTS_PASS

using ExactFn = void (*)(const double*, const double*, std::int64_t, const double*, const double*, std::int64_t,
                         std::int64_t, std::int64_t, double*, double*);
using FilterFn = void (*)(const float*, const float*, std::int64_t, const float*, const float*, std::int64_t,
                          std::int64_t, std::int64_t, float*, float*);
ExactFn exact_kernel() {
  if (__builtin_cpu_supports("avx512f")) return exact_avx512;
  if (__builtin_cpu_supports("avx2")) return exact_avx2;
  return exact_sse;
}
FilterFn filter_kernel() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return filter_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return filter_avx2;
  return filter_sse;
}

// A BOOL or float tensor broadcast to [B, Hq, Nq, Nk]: element (b, h, i, j) at
// data[b sb + h sh + i si + j sj] (a stride is 0 along a broadcast dimension).
template <class T>
struct Broadcast {
  const T* data = nullptr;
  std::int64_t sb = 0, sh = 0, si = 0, sj = 0;
  Broadcast(const std::vector<std::int64_t>& shape, const T* p) : data(p) {
    std::int64_t* s[4] = {&sb, &sh, &si, &sj};
    const std::size_t r = shape.size();
    std::int64_t stride = 1;
    for (std::size_t a = r; a-- > 0;) {
      *s[4 - r + a] = shape[a] == 1 ? 0 : stride;
      stride *= shape[a];
    }
  }
  const T* row(std::int64_t b, std::int64_t h, std::int64_t i) const { return data + b * sb + h * sh + i * si; }
};

// The filter's scan of one row over the allowed keys j in [lo, hi] (flags[j] != 0, or all when
// flags is null), on the float products s_j, a_j: with la = max a_j, thr_a = la (1 - 4R) and
// (when scores) ls = max (|s_j| - c8 a_j), writes to cand the keys with a_j >= thr_a or
// (when scores) |s_j| + c8 a_j >= ls, and returns their number; thr_a is returned too.
// A macro rather than a template: the compiler lowers vector comparisons with the instructions
// of the function it meets them in, and a template's are those of the default target (scalar).
#define ATTNORACLE_SCAN_BODY \
  constexpr int L = static_cast<int>(sizeof(V) / sizeof(float));                                     \
  const V ninf = V{} - INFINITY, vc8 = V{} + c8;                                                     \
  V vla = ninf, vls = ninf;                                                                          \
  std::int64_t j = lo;                                                                               \
  for (; j + L <= hi + 1; j += L) {                                                                  \
    V vs, va, l;                                                                                     \
    std::memcpy(&vs, s + j, sizeof vs);                                                              \
    std::memcpy(&va, a + j, sizeof va);                                                              \
    VI bits; /* |s_j| */                                                                             \
    std::memcpy(&bits, &vs, sizeof vs);                                                              \
    bits &= 0x7fffffff;                                                                              \
    std::memcpy(&l, &bits, sizeof l);                                                                \
    l = l - vc8 * va;                                                                                \
    if (flags) {                                                                                     \
      VU8 f8;                                                                                        \
      std::memcpy(&f8, flags + j, sizeof f8);                                                        \
      const VI on = __builtin_convertvector(f8, VI) != 0;                                            \
      va = on ? va : ninf;                                                                           \
      l = on ? l : ninf;                                                                             \
    }                                                                                                \
    vla = va > vla ? va : vla;                                                                       \
    vls = l > vls ? l : vls;                                                                         \
  }                                                                                                  \
  float la = -INFINITY, ls = -INFINITY;                                                              \
  for (int v = 0; v < L; ++v) {                                                                      \
    la = std::max(la, vla[v]);                                                                       \
    ls = std::max(ls, vls[v]);                                                                       \
  }                                                                                                  \
  for (std::int64_t t = j; t <= hi; ++t)                                                             \
    if (!flags || flags[t]) {                                                                        \
      la = std::max(la, a[t]);                                                                       \
      ls = std::max(ls, std::fabs(s[t]) - c8 * a[t]);                                                \
    }                                                                                                \
  const auto thr = static_cast<float>(static_cast<double>(la) * (1 - 4 * R));                        \
  thr_out = thr;                                                                                     \
  if (!scores) return 0;                                                                             \
  const V vthr = V{} + thr, vls_all = V{} + ls;                                                      \
  std::int64_t n = 0;                                                                                \
  for (j = lo; j + L <= hi + 1; j += L) {                                                            \
    V vs, va, as;                                                                                    \
    std::memcpy(&vs, s + j, sizeof vs);                                                              \
    std::memcpy(&va, a + j, sizeof va);                                                              \
    VI bits;                                                                                         \
    std::memcpy(&bits, &vs, sizeof vs);                                                              \
    bits &= 0x7fffffff;                                                                              \
    std::memcpy(&as, &bits, sizeof as);                                                              \
    const VI hit = (va >= vthr) | (as + vc8 * va >= vls_all);                                        \
    std::uint64_t words[sizeof(VI) / 8];                                                             \
    std::memcpy(words, &hit, sizeof hit);                                                            \
    std::uint64_t any = 0;                                                                           \
    for (const std::uint64_t w : words) any |= w;                                                    \
    if (!any) continue;                                                                              \
    for (std::int64_t t = j; t < j + L; ++t)                                                         \
      if ((!flags || flags[t]) && (a[t] >= thr || std::fabs(s[t]) + c8 * a[t] >= ls)) cand[n++] = t; \
  }                                                                                                  \
  for (; j <= hi; ++j)                                                                               \
    if ((!flags || flags[j]) && (a[j] >= thr || std::fabs(s[j]) + c8 * a[j] >= ls)) cand[n++] = j;   \
  return n;                                                                                          \
  /* end of ATTNORACLE_SCAN_BODY */

#define ATTNORACLE_SCAN_ARGS const float *s, const float *a, const unsigned char *flags, std::int64_t lo, \
                             std::int64_t hi, float c8, double R, bool scores, float &thr_out, std::int64_t *cand
__attribute__((target("avx512f,avx512bw"))) std::int64_t scan_avx512(ATTNORACLE_SCAN_ARGS) {
  using V = v16f;
  using VI = v16i;
  using VU8 = v16u8;
  ATTNORACLE_SCAN_BODY
}
__attribute__((target("avx2"))) std::int64_t scan_avx2(ATTNORACLE_SCAN_ARGS) {
  using V = v8f;
  using VI = v8i;
  using VU8 = v8u8;
  ATTNORACLE_SCAN_BODY
}
std::int64_t scan_sse(ATTNORACLE_SCAN_ARGS) {
  using V = v4f;
  using VI = v4i;
  using VU8 = v4u8;
  ATTNORACLE_SCAN_BODY
}
#undef ATTNORACLE_SCAN_ARGS
#undef ATTNORACLE_SCAN_BODY
using ScanFn = std::int64_t (*)(const float*, const float*, const unsigned char*, std::int64_t, std::int64_t, float,
                                double, bool, float&, std::int64_t*);
ScanFn scan_kernel() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return scan_avx512;
  if (__builtin_cpu_supports("avx2")) return scan_avx2;
  return scan_sse;
}

// X W per head, in double, on values (abs = false) or on magnitudes |X| |W| (abs = true); each
// element summed in d order.
std::vector<double> project(const Case& c, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
                            std::int64_t E, bool abs) {
  std::vector<double> p(static_cast<std::size_t>(c.B * c.Hq * N * E));
  std::vector<double> wa(abs ? w.values.size() : 0);
  for (std::size_t k = 0; k < wa.size(); ++k) wa[k] = std::fabs(w.values[k]);
  const double* W = abs ? wa.data() : w.values.data();
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t r = 0; r < c.Hq; ++r)
      for (std::int64_t n = 0; n < N; ++n) {
        double* s = &p[static_cast<std::size_t>(((b * c.Hq + r) * N + n) * E)];
        for (std::int64_t d = 0; d < c.D; ++d) {
          const double xv = x.values[static_cast<std::size_t>((b * N + n) * c.D + d)];
          const double a = abs ? std::fabs(xv) : xv;
          const double* wr = W + (r * c.D + d) * E;
          for (std::int64_t e = 0; e < E; ++e) s[e] += a * wr[e];
        }
      }
  return p;
}

// Magnitudes in [2^-50, 2^51) (or zero), and (below) a bound on the dot products far from
// float's overflow: the float filter's products, sums and c8 a_j are then normal or exact.
// On the upper 32 bits of each value: biased exponent within 50 of 1023, or a zero; `top`
// becomes the largest biased exponent (every magnitude is below 2^(top - 1022)).
bool float_safe(const std::vector<double>& v, std::uint32_t& top) {
  std::uint32_t bad = 0;
  for (const double x : v) {
    std::uint64_t bits;
    std::memcpy(&bits, &x, 8);
    const auto hi = static_cast<std::uint32_t>(bits >> 32) & 0x7fff'ffffu, lo = static_cast<std::uint32_t>(bits);
    const std::uint32_t e = hi >> 20;
    bad |= static_cast<std::uint32_t>((hi | lo) != 0) & static_cast<std::uint32_t>(e - (1023 - 50) > 100);
    top = std::max(top, e);
  }
  return bad == 0;
}

}  // namespace

std::vector<RowMagnitudes> row_magnitudes(const Case& c) {
  const bool mha = c.kind == Kind::Mha;
  const std::int64_t H = c.Hq, Hk = mha ? c.Hq : c.Hkv, Dk = c.Dk, Nq = c.Nq, Nk = c.Nk;
  std::vector<double> Q, K, Qa, Ka;
  if (mha) {
    Q = project(c, c.x_q, c.w_q, Nq, Dk, false);
    K = project(c, c.x_kv, c.w_k, Nk, Dk, false);
    Qa = project(c, c.x_q, c.w_q, Nq, Dk, true);
    Ka = project(c, c.x_kv, c.w_k, Nk, Dk, true);
  }
  const std::vector<double>& q = mha ? Q : c.q.values;
  const std::vector<double>& k = mha ? K : c.k.values;
  const std::vector<double>& qa = mha ? Qa : c.q.values;
  const std::vector<double>& ka = mha ? Ka : c.k.values;
  // sscale gives the scores their sign (attn.scale may be negative), scale the magnitudes.
  const double sscale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double scale = std::fabs(sscale);
  // Keys whose score is far below the row's are negligible: their weights are below e^-kFar
  // computed or exact, so their scores' errors (huge for a bias of -FLT_MAX used as a mask) are
  // left out of M. With K = |s_max| + kFar + 2^-7 (Dk + 2D + 6) A (the score errors of every
  // profile, u <= 2^-8, on both sides), a computed score s_j (1 - 2u) + ... <= s_j / 2 below
  // -4K is more than kFar below the computed maximum; e^-kFar = 2^-2308 times any sum of |v|
  // is below every format's smallest subnormal.
  constexpr double kFar = 1600;
  const double kA = 0x1p-7 * (static_cast<double>(Dk) + 2 * static_cast<double>(mha ? c.D : 0) + 6);
  auto far_below = [&](double smax_abs, double A) { return -4 * (smax_abs + kFar + kA * A); };
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  std::vector<RowMagnitudes> out(static_cast<std::size_t>(mha ? c.B * Nq : c.B * H * Nq));

  // The filter's relative error bound (see above): float products and sums, the conversion of
  // the inputs to float, the double sums, and for mha |Q| <= Qa (1 + gamma_D) / (1 - gamma_D);
  // twice the first-order term, and used doubled again below.
  std::uint32_t eq = 0, ek = 0;  // biased exponents bounding |q| and |k|
  const bool filtered = cap <= 0 && Dk <= 4096 && c.D <= (1 << 20) && float_safe(q, eq) && float_safe(k, ek) &&
                        (!mha || (float_safe(qa, eq) && float_safe(ka, ek))) &&
                        static_cast<double>(Dk) * std::ldexp(1.0, static_cast<int>(eq + ek) - 2044) <= 0x1p100 &&
                        std::isfinite(scale);
  const double R = 2 * (static_cast<double>(Dk) + 8) * 0x1p-24 + (mha ? 8 * (static_cast<double>(c.D) + 2) * 0x1p-53 : 0);
  const auto c8 = static_cast<float>(8 * R);

  const std::int64_t Nkp = (Nk + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
  const auto nkp = static_cast<std::size_t>(Nkp), dk = static_cast<std::size_t>(Dk);
  const std::size_t block = static_cast<std::size_t>(kRowBlock);
  // Keys of the current kv head, transposed [Dk][Nkp] (zero padded), values and magnitudes;
  // query rows of the current block [kRowBlock][Dk]; products [kRowBlock][Nkp].
  std::vector<double> ktd, katd, qd, qad, sd, ad;
  std::vector<float> ktf, katf, qf, qaf, sf, af;
  auto buffers = [&](auto& kt, auto& kat, auto& q_, auto& qa_, auto& s_, auto& a_) {
    kt.assign(dk * nkp, 0);
    kat.assign(dk * nkp, 0);
    q_.assign(block * dk, 0);
    qa_.assign(block * dk, 0);
    s_.assign(block * nkp, 0);
    a_.assign(block * nkp, 0);
  };
  if (filtered) buffers(ktf, katf, qf, qaf, sf, af);
  else buffers(ktd, katd, qd, qad, sd, ad);
  const ExactFn exact = exact_kernel();
  const FilterFn filter = filter_kernel();

  std::optional<Broadcast<unsigned char>> mask;
  std::optional<Broadcast<double>> bias;
  if (c.mask) mask.emplace(c.mask->shape, c.mask->values.data());
  if (c.bias) bias.emplace(c.bias->shape, c.bias->values.data());
  std::vector<unsigned char> allow(static_cast<std::size_t>(Nk));
  std::vector<double> scores(filtered ? 0 : static_cast<std::size_t>(Nk));  // one row's, exact path
  std::vector<std::int64_t> cand(static_cast<std::size_t>(Nk));
  const ScanFn scan_row = scan_kernel();

  // Row (b, h, i)'s exact dot and dabs for key j: the original d-order loop.
  auto exact_pair = [&](std::int64_t b, std::int64_t h, std::int64_t g, std::int64_t i, std::int64_t j, double& dot,
                        double& dabs) {
    dot = 0;
    dabs = 0;
    const double* qi = &q[static_cast<std::size_t>(((b * H + h) * Nq + i) * Dk)];
    const double* qai = &qa[static_cast<std::size_t>(((b * H + h) * Nq + i) * Dk)];
    const double* kj = &k[static_cast<std::size_t>(((b * Hk + g) * Nk + j) * Dk)];
    const double* kaj = &ka[static_cast<std::size_t>(((b * Hk + g) * Nk + j) * Dk)];
    for (std::int64_t d = 0; d < Dk; ++d) {
      dot += qi[d] * kj[d];
      dabs += std::fabs(qai[d]) * std::fabs(kaj[d]);
    }
  };

  std::int64_t packed = -1;  // the kv head (b * Hk + g) in ktd/ktf
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = mha ? h : c.kv_head(h);
      if (packed != b * Hk + g) {
        packed = b * Hk + g;
        for (std::int64_t jb = 0; jb < Nk; jb += 16)  // transposed by blocks of keys
          for (std::int64_t d = 0; d < Dk; ++d)
            for (std::int64_t j = jb; j < std::min(jb + 16, Nk); ++j) {
              const auto from = static_cast<std::size_t>((packed * Nk + j) * Dk + d);
              const auto to = static_cast<std::size_t>(d * Nkp + j);
              if (filtered) {
                ktf[to] = static_cast<float>(k[from]);
                katf[to] = static_cast<float>(std::fabs(ka[from]));
              } else {
                ktd[to] = k[from];
                katd[to] = std::fabs(ka[from]);
              }
            }
      }
      for (std::int64_t i0 = 0; i0 < Nq; i0 += kRowBlock) {
        const std::int64_t rows = std::min(kRowBlock, Nq - i0);
        // The keys any row of the block may attend by position (causal, window).
        std::int64_t jlo = Nk, jhi = -1;
        for (std::int64_t i = i0; i < i0 + rows; ++i) {
          const Case::KeyRange kr = c.key_range(b, i);
          const std::int64_t lo = kr.first, hi = kr.last;
          if (lo <= hi) {
            jlo = std::min(jlo, lo);
            jhi = std::max(jhi, hi);
          }
        }
        const std::int64_t j0 = jlo > jhi ? 0 : jlo / kKeyAlign * kKeyAlign;
        const std::int64_t j1 = jlo > jhi ? 0 : (jhi / kKeyAlign + 1) * kKeyAlign;
        for (std::int64_t r = 0; r < kRowBlock; ++r)
          for (std::int64_t d = 0; d < Dk; ++d) {
            const auto to = static_cast<std::size_t>(r * Dk + d);
            const auto from = static_cast<std::size_t>(((b * H + h) * Nq + i0 + r) * Dk + d);
            const double x = r < rows ? q[from] : 0, xa = r < rows ? std::fabs(qa[from]) : 0;
            if (filtered) {
              qf[to] = static_cast<float>(x);
              qaf[to] = static_cast<float>(xa);
            } else {
              qd[to] = x;
              qad[to] = xa;
            }
          }
        if (j1 > j0) {
          if (filtered) filter(qf.data(), qaf.data(), Dk, ktf.data(), katf.data(), Nkp, j0, j1, sf.data(), af.data());
          else exact(qd.data(), qad.data(), Dk, ktd.data(), katd.data(), Nkp, j0, j1, sd.data(), ad.data());
        }

        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = i0 + r;
          RowMagnitudes& m = out[static_cast<std::size_t>(mha ? b * Nq + i : (b * H + h) * Nq + i)];
          // Allowed keys: j in [lo, hi] by position, and by mask and bias (-inf) when given.
          const Case::KeyRange kr = c.key_range(b, i);
          const std::int64_t lo = kr.first, hi = kr.last;
          if (lo > hi) continue;  // no key: keys stays as it is (max with 0)
          const unsigned char* mrow = mask ? mask->row(b, h, i) : nullptr;
          const double* brow = bias ? bias->row(b, h, i) : nullptr;
          const std::int64_t msj = mask ? mask->sj : 0, bsj = bias ? bias->sj : 0;
          const unsigned char* flags = nullptr;  // allow[j] for j in [lo, hi] when masked
          std::int64_t keys = hi - lo + 1;
          if (mrow || brow) {
            keys = 0;
            for (std::int64_t j = lo; j <= hi; ++j) {
              const bool ok = (!mrow || mrow[j * msj]) && (!brow || brow[j * bsj] != -INFINITY);
              allow[static_cast<std::size_t>(j)] = ok;
              keys += ok;
              if (ok && brow) m.bias_abs = std::max(m.bias_abs, std::fabs(brow[j * bsj]));
            }
            flags = allow.data();
          }
          m.keys = std::max(m.keys, keys);
          auto allowed_key = [&](std::int64_t j) { return !flags || flags[j]; };
          auto bias_of = [&](std::int64_t j) { return brow ? brow[j * bsj] : 0.0; };

          if (!filtered) {
            const double* srow = &sd[static_cast<std::size_t>(r * Nkp)];
            const double* arow = &ad[static_cast<std::size_t>(r * Nkp)];
            double smax = -INFINITY, A = 0, M = 0;
            for (std::int64_t j = lo; j <= hi; ++j) {
              if (!allowed_key(j)) continue;
              double t = srow[j] * sscale;
              if (cap > 0) t = cap * std::tanh(t / cap);
              const double sj = t + bias_of(j);
              scores[static_cast<std::size_t>(j)] = sj;
              smax = std::max(smax, sj);
              M = std::max(M, std::fabs(sj));
              A = std::max(A, arow[j] * scale);
            }
            m.dot_abs = std::max(m.dot_abs, A);
            // only a bias puts keys far below the row's maximum; then M is taken again without them
            const double far = brow && std::isfinite(smax) ? far_below(std::fabs(smax), A) : -INFINITY;
            if (far > -INFINITY) {
              M = 0;
              for (std::int64_t j = lo; j <= hi; ++j)
                if (allowed_key(j) && !(scores[static_cast<std::size_t>(j)] < far))
                  M = std::max(M, std::fabs(scores[static_cast<std::size_t>(j)]));
            }
            m.score_abs = std::max(m.score_abs, M);
            continue;
          }

          // Filtered. With s_j, a_j the float dot and dabs: dabs_j in a_j [1 - R, 1 + R] and
          // |dot_j - s_j| <= R a_j (dot_j, dabs_j: the double values of exact_pair).
          const float* srow = &sf[static_cast<std::size_t>(r * Nkp)];
          const float* arow = &af[static_cast<std::size_t>(r * Nkp)];
          // dabs's maximum is at a key with a_j >= max a (1 - R) / (1 + R) > thr_a. Without a
          // bias, |dot_j| is at most |s_j| + 6R a_j and at least |s_j| - 6R a_j (float rounding
          // included, with c8 = 8R), and the score |fl(dot_j scale)| is monotone in |dot_j|: its
          // maximum is at a key with |s_j| + c8 a_j >= max (|s_i| - c8 a_i).
          float thr_a;
          const std::int64_t n = scan_row(srow, arow, flags, lo, hi, c8, R, !brow, thr_a, cand.data());
          if (!brow) {
            for (std::int64_t t = 0; t < n; ++t) {
              double dot, dabs;
              exact_pair(b, h, g, i, cand[static_cast<std::size_t>(t)], dot, dabs);
              const double st = dot * scale;
              m.dot_abs = std::max(m.dot_abs, dabs * scale);
              m.score_abs = std::max(m.score_abs, std::fabs(st + 0.0));
            }
            continue;
          }
          // With a bias, the score dot_j sscale + bias_j is within `rad` of c_j (the roundings
          // of both computations are in the relative term).
          auto score_interval = [&](std::int64_t j, double& cj, double& rad) {
            const double st = static_cast<double>(srow[j]) * sscale, bj = brow[j * bsj];
            cj = st + bj;
            rad = 4 * R * static_cast<double>(arow[j]) * scale + 0x1p-44 * (std::fabs(st) + std::fabs(bj)) + 0x1p-1000;
          };
          // Bounds of s_max (above and below) and of A, for the negligible keys' threshold.
          double s_hi = -INFINITY, s_lo = -INFINITY, a_hi = 0;
          bool finite = true;
          for (std::int64_t j = lo; j <= hi; ++j) {
            if (!allowed_key(j)) continue;
            double cj, rad;
            score_interval(j, cj, rad);
            finite = finite && std::isfinite(cj) && std::isfinite(rad);
            s_hi = std::max(s_hi, cj + rad);
            s_lo = std::max(s_lo, cj - rad);
            a_hi = std::max(a_hi, static_cast<double>(arow[j]) * scale * (1 + 2 * R));
          }
          const double far = finite ? far_below(std::max(std::fabs(s_hi), std::fabs(s_lo)), a_hi) : -INFINITY;
          double lsb = -INFINITY;
          for (std::int64_t j = lo; j <= hi; ++j) {
            if (!allowed_key(j)) continue;
            double cj, rad;
            score_interval(j, cj, rad);
            if (cj + rad < far) continue;
            lsb = std::max(lsb, std::max(0.0, std::fabs(cj) - rad));
          }
          for (std::int64_t j = lo; j <= hi; ++j) {
            if (!allowed_key(j)) continue;
            double cj, rad;
            score_interval(j, cj, rad);
            const bool negligible = cj + rad < far;
            // not a candidate for A's maximum nor (when negligible, or below lsb) for M's
            if (finite && arow[j] < thr_a && (negligible || std::fabs(cj) + rad < lsb)) continue;
            double dot, dabs;
            exact_pair(b, h, g, i, j, dot, dabs);
            m.dot_abs = std::max(m.dot_abs, dabs * scale);
            if (!negligible) m.score_abs = std::max(m.score_abs, std::fabs(dot * sscale + bias_of(j)));
          }
        }
      }
    }
  return out;
}

namespace {
// max_j (sum = false) or sum_j (sum = true) of |v_jc| over the allowed keys, through |W_o| for mha.
std::vector<double> value_magnitude(const Case& c, bool sum) {
  const std::int64_t H = c.Hq, Nk = c.Nk, Dv = c.Dv;
  auto join = [sum](double& acc, double v) { acc = sum ? acc + v : std::max(acc, v); };
  if (c.kind == Kind::Sdpa) {
    std::vector<double> out(static_cast<std::size_t>(c.B * H * c.Nq * Dv), 0);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          double* o = &out[static_cast<std::size_t>(((b * H + h) * c.Nq + i) * Dv)];
          const Case::KeyRange r = c.key_range(b, i);
          for (std::int64_t j = r.first; j <= r.last; ++j) {
            if (!c.allowed(b, h, i, j)) continue;
            const double* v = &c.v.values[static_cast<std::size_t>(((b * c.Hkv + c.kv_head(h)) * Nk + j) * Dv)];
            for (std::int64_t e = 0; e < Dv; ++e) join(o[e], std::fabs(v[e]));
          }
        }
    return out;
  }
  // |V_r| <= |X| |W_v| element by element; its largest over the keys, through |W_o|.
  const std::vector<double> va = project(c, c.x_kv, c.w_v, Nk, Dv, true);
  std::vector<double> vmax(static_cast<std::size_t>(c.B * H * Dv), 0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t r = 0; r < H; ++r)
      for (std::int64_t j = 0; j < Nk; ++j)
        for (std::int64_t e = 0; e < Dv; ++e) {
          double& m = vmax[static_cast<std::size_t>((b * H + r) * Dv + e)];
          join(m, std::fabs(va[static_cast<std::size_t>(((b * H + r) * Nk + j) * Dv + e)]));
        }
  std::vector<double> out(static_cast<std::size_t>(c.B * c.Nq * c.Dout), 0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t e = 0; e < c.Dout; ++e) {
      double s = 0;
      for (std::int64_t rc = 0; rc < H * Dv; ++rc)
        s += vmax[static_cast<std::size_t>(b * H * Dv + rc)] *
             std::fabs(c.w_o.values[static_cast<std::size_t>(rc * c.Dout + e)]);
      for (std::int64_t i = 0; i < c.Nq; ++i) out[static_cast<std::size_t>((b * c.Nq + i) * c.Dout + e)] = s;
    }
  return out;
}
}  // namespace

std::vector<double> out_bound_above(const Case& c) { return value_magnitude(c, false); }
std::vector<double> out_value_sum(const Case& c) { return value_magnitude(c, true); }

RowLimits row_limits(const Profile& p, const Case& c, const RowMagnitudes& row) {
  // A sink is one more term exp(sink - m) of Z, with no value vector: n + 1 terms, and m the
  // maximum over the scores and the sink, so max |S| covers |sink| too. The kernel keeps the
  // sink in its dtype or rounds it once into the softmax dtype (u_s |sink|, within the 2 u_s
  // max|S| of (1)); every step below then holds with these n and max |S|.
  RowMagnitudes m = row;
  if (c.sinks) {
    m.keys += 1;
    for (double s : c.sinks->values) m.score_abs = std::max(m.score_abs, std::fabs(s));
  }
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double upv = unit_roundoff(p.pv_accum);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double n = static_cast<double>(std::max<std::int64_t>(m.keys, 1));
  const DType out = c.dtype_of("out");
  RowLimits r;
  // (1) a score: Dk products and sums (gamma_Dk), the scale and softcap (2 more roundings) on
  // the dot's magnitude A, then rounding into the softmax dtype and the bias addition.
  double proj = 0;
  if (c.kind == Kind::Mha)  // q and k each carry (D + 1) u_qk + u_proj relative error first
    proj = 2 * ((static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection));
  r.score = (static_cast<double>(c.Dk) + 2) * uq * m.dot_abs + proj * m.dot_abs + 2 * us * m.score_abs;
  // a bias rounded to its dtype first: |fl(b) - b| <= u_b |b| where fl(b) is normal, and at most
  // half the smallest spacing below (so the sum of both bounds it everywhere).
  if (p.bias) r.score += unit_roundoff(*p.bias) * m.bias_abs + min_subnormal(*p.bias) / 2;
  // FP8 descales applied in the qk dtype: q and k each rounded once after scaling (a product off
  // by (1 + u)^2 - 1 <= 3u), or dq dk formed and multiplied into the score (two roundings, 2u):
  // 3u on the dot's magnitude covers both. v's descale: one rounding of each v (or of the
  // output), u_pv on the bound, added in (4).
  const bool descaled = c.file.find("q_descale") || c.file.find("k_descale");
  if (descaled) r.score += 3 * uq * m.dot_abs;
  // (2) exp(S_j - m): both S_j and the row maximum m are off by `score`, the subtraction rounds
  // (us |S_j - m| <= 2 us max|S|), exp adds exp_ulps: a relative error of e_j of
  double e_rel = 2 * r.score + 2 * us * m.score_abs + p.exp_ulps * us;
  // (2b) an online softmax over nb key blocks rescales the earlier blocks' partial sums by
  // alpha = exp(m_old - m_new) up to nb - 1 times: an error of alpha scales those blocks' weights
  // like one of exp (exp_ulps each), and the arguments' roundings add up to u_sm sum |dm| <= 2 u_sm M.
  const double nb = p.key_block > 0 ? std::ceil(n / static_cast<double>(p.key_block)) : 1;
  if (nb > 1) e_rel += (nb - 1) * p.exp_ulps * us + 2 * us * m.score_abs;
  // (3) a weight e_j / Z: Z carries e_rel plus the sum's gamma_n; the division rounds; P is
  // rounded to its dtype.
  // A term's sum sees at most n + nb - 1 roundings: those of its block, then a product by alpha
  // and an addition per later block (gamma_{n+nb-1} <= (n + nb) u; n + 1 for one pass).
  r.weight_rel = 2 * e_rel + (n + nb) * us + up;
  // (4) the output: P V over n terms (gamma_n of the accumulation) on sum_j A_j |v_j| = bound;
  // mha adds the projection of V and the output projection over H Dv terms.
  r.out_coef = r.weight_rel + (n + nb) * upv;
  if (c.file.find("v_descale")) r.out_coef += 2 * upv;  // one rounding of v or of the output
  if (c.kind == Kind::Mha)
    r.out_coef += (static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection) +
                  (static_cast<double>(c.Hq * c.Dv) + 1) * upv;
  // (5) lse = m + log Z: the score error, Z's relative error, log's own.
  r.lse_abs = r.score + e_rel + (n + nb) * us + p.exp_ulps * us * (1 + m.score_abs);
  // underflow: the output format's subnormal spacing, and flushed tiny weights in P V.
  r.floor = 2 * min_subnormal(out) + n * min_normal(p.pv_accum);
  // (4b) P's underflow (Higham (2.8)): a weight rounded to p below its smallest normal m_p is
  // off by up to s_p / 2 absolutely. Every computed score is in [-M - score, M + score] and so
  // is any maximum of them (running or final), so s_j - m' >= -(2M + 2 score); the weights
  // rounded are exp(s_j - m') or those over Z <= n, so none is below exp(-reach) (the 1 covers
  // the subtraction's and exp's roundings): when that is at least m_p, or the row has one key
  // (its weight is 1), no weight underflows and the term is 0.
  r.keys = n;
  const double reach = 2 * m.score_abs + 2 * r.score + 1 + std::log(n);
  r.p_sub = n > 1 && !(reach < -std::log(min_normal(p.p))) ? min_subnormal(p.p) / 2 : 0;
  // lse when l sums the rounded weights: l >= 1 (the maximum's weight is exp(0) = 1, exact in
  // every format), so n absolute errors of s_p / 2 are a relative n s_p / 2 of l, in log l.
  r.lse_abs += n * r.p_sub;
  return r;
}

double ulp_of(double x_hi, double x_lo, DType t) {
  const FloatFormat f = float_format(t);
  return ulp_of(x_hi, x_lo, 1 - f.bias, f.precision);
}

double abs_error(double y, double x_hi, double x_lo, DType t) {
  if (std::isnan(x_hi)) return std::isnan(y) ? 0 : INFINITY;
  if (std::isnan(y)) return INFINITY;
  if (std::isinf(x_hi)) return y == x_hi ? 0 : INFINITY;
  if (std::isinf(y)) {
    // Round to nearest overflows from halfway between the largest finite value and 2^(emax + 1).
    const FloatFormat f = float_format(t);
    const double big = std::ldexp(2 - std::ldexp(1.0, 1 - f.precision), f.bias);  // largest finite
    const double half = std::ldexp(1.0, f.bias - f.precision);                      // half its ulp
    const double ax = std::fabs(x_hi), axl = std::signbit(x_hi) ? -x_lo : x_lo;
    // ax - big is exact (Sterbenz: big <= ax <= 2 big)
    const bool overflows = ax > big ? (ax - big) + axl >= half : ax == big && axl >= half;
    return overflows && std::signbit(y) == std::signbit(x_hi) ? 0 : INFINITY;
  }
  return std::fabs((y - x_hi) - x_lo);
}

double ulp_error(double y, double x_hi, double x_lo, DType t) {
  const double d = abs_error(y, x_hi, x_lo, t);
  return d == 0 || std::isinf(d) ? d : d / ulp_of(x_hi, x_lo, t);
}

double bound_error(double y, double x_hi, double x_lo, double bound, DType t) {
  const double d = abs_error(y, x_hi, x_lo, t);
  return d == 0 || std::isinf(d) ? d : d / std::max(bound * unit_roundoff(t), min_normal(t));
}

}  // namespace attnoracle::conformance
