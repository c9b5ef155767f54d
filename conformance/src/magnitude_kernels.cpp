// The kernels of magnitude_kernels.hpp, one per instruction set.
#include "magnitude_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "no_contraction.hpp"

namespace attnoracle::conformance::magnitudes {

namespace {

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

// The products (ExactFn, FilterFn): R rows by KV vectors of keys at a time.
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

}  // namespace

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

namespace {

// The scan (ScanFn). A macro rather than a template: the compiler lowers vector comparisons with the instructions
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
}  // namespace

ScanFn scan_kernel() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return scan_avx512;
  if (__builtin_cpu_supports("avx2")) return scan_avx2;
  return scan_sse;
}

}  // namespace attnoracle::conformance::magnitudes
