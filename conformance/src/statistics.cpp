// The statistical tier: the probabilistic error model of the declared arithmetic and the tests on
// the normalised errors (conformance/TOLERANCE.md, "The statistical tier").
#include "attnoracle/conformance/statistics.hpp"

#include "attnoracle/conformance/bin_order.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "attnoracle/reference/file.hpp"

// (no fused multiply-adds: the faster loops below give the scalar loops' results bit for bit)
#include "no_contraction.hpp"

namespace attnoracle::conformance {

namespace {
double sq(double x) { return x * x; }

typedef double v2d __attribute__((vector_size(16)));  // SSE2: in every x86-64's base ABI
typedef double v4d __attribute__((vector_size(32)));  // AVX2, where the processor has it
typedef double v8d __attribute__((vector_size(64)));  // AVX-512, where the processor has it

// For two query rows q0 and q1, dot_j = sum_d q_d k_jd and dabs_j = sum_d |q_d| |k_jd| (= |q_d
// k_jd|, exactly) for the keys j in [j0, j1) (multiples of kKeyBlock), each summed in d order,
// kKeyBlock keys at a time in vector lanes: the same roundings as one key at a time. kt is the
// kv head's keys by blocks of kKeyBlock, each transposed: key jb + l's element d at kt[jb Dk +
// d kKeyBlock + l] (a block's reads are sequential); dot0, dabs0 (q0's) and dot1, dabs1 are
// indexed by j. Two rows share each load of the keys.
constexpr std::int64_t kKeyBlock = 8;
typedef std::uint64_t u2l __attribute__((vector_size(16)));
typedef std::uint64_t u4l __attribute__((vector_size(32)));
typedef std::uint64_t u8l __attribute__((vector_size(64)));
template <class V, class U>
inline __attribute__((always_inline)) void key_dots(const double* q0, const double* q1, const double* kt,
                                                    std::int64_t Dk, std::int64_t j0,
                                                    std::int64_t j1, double* dot0, double* dabs0, double* dot1,
                                                    double* dabs1) {
  constexpr std::int64_t L = static_cast<std::int64_t>(sizeof(V) / sizeof(double)), KV = kKeyBlock / L;
  const U magnitude = U{} + 0x7fff'ffff'ffff'ffffull;  // |x|: the sign bit cleared
  for (std::int64_t jb = j0; jb < j1; jb += kKeyBlock) {
    V s0[KV], a0[KV], s1[KV], a1[KV];
#pragma GCC unroll 4
    for (std::int64_t v = 0; v < KV; ++v) s0[v] = a0[v] = s1[v] = a1[v] = V{};
    const double* block = kt + jb * Dk;
    for (std::int64_t d = 0; d < Dk; ++d) {
      const double x0 = q0[d], xa0 = std::fabs(x0), x1 = q1[d], xa1 = std::fabs(x1);
#pragma GCC unroll 4
      for (std::int64_t v = 0; v < KV; ++v) {
        V k;
        std::memcpy(&k, block + d * kKeyBlock + v * L, sizeof k);
        const V ka = reinterpret_cast<V>(reinterpret_cast<U>(k) & magnitude);
        s0[v] += x0 * k;
        a0[v] += xa0 * ka;
        s1[v] += x1 * k;
        a1[v] += xa1 * ka;
      }
    }
#pragma GCC unroll 4
    for (std::int64_t v = 0; v < KV; ++v) {
      std::memcpy(dot0 + jb + v * L, &s0[v], sizeof(V));
      std::memcpy(dabs0 + jb + v * L, &a0[v], sizeof(V));
      std::memcpy(dot1 + jb + v * L, &s1[v], sizeof(V));
      std::memcpy(dabs1 + jb + v * L, &a1[v], sizeof(V));
    }
  }
}
#define ATTNORACLE_DOTS_ARGS const double *q0, const double *q1, const double *kt, std::int64_t Dk, \
                             std::int64_t j0, std::int64_t j1, double *dot0, double *dabs0, double *dot1, double *dabs1
#define ATTNORACLE_DOTS_PASS q0, q1, kt, Dk, j0, j1, dot0, dabs0, dot1, dabs1
__attribute__((target("avx512f"))) void dots_avx512(ATTNORACLE_DOTS_ARGS) { key_dots<v8d, u8l>(ATTNORACLE_DOTS_PASS); }
__attribute__((target("avx2"))) void dots_avx2(ATTNORACLE_DOTS_ARGS) { key_dots<v4d, u4l>(ATTNORACLE_DOTS_PASS); }
void dots_sse(ATTNORACLE_DOTS_ARGS) { key_dots<v2d, u2l>(ATTNORACLE_DOTS_PASS); }
#undef ATTNORACLE_DOTS_ARGS
#undef ATTNORACLE_DOTS_PASS
using DotsFn = void (*)(const double*, const double*, const double*, std::int64_t, std::int64_t, std::int64_t,
                        double*, double*, double*, double*);
DotsFn dots_kernel() {
  if (__builtin_cpu_supports("avx512f")) return dots_avx512;
  return __builtin_cpu_supports("avx2") ? dots_avx2 : dots_sse;
}

// For the elements of out, over the keys in order: x_c = sum_j w_j v_jc, then key_c = sum_j
// (w_j (v_jc - x_c) kr_j)^2, wv_c = sum_j (w_j v_jc)^2 and partial_c = sum_k P_k^2 (P_k =
// sum_{j <= k} w_j v_jc), not yet square-rooted; key, wv and ps start at 0, x and run are
// scratch [Dv]. C vectors of L elements (V) at a time, their sums in registers over all the
// keys (XC vectors for x: more independent sums), the same operations per element as the
// scalar loop of weight_spread, in every lane. Elements [e0, Dv) from e0 on, XC L (then C L) at a
// time; returns the first element not done.
template <class V, int C, int XC>
inline __attribute__((always_inline)) std::int64_t out_sums(std::int64_t e0, const double* vb,
                                                            const std::int64_t* keys, std::size_t n,
                                                            const double* w, const double* kr, std::int64_t Dv,
                                                            double* key, double* wv, double* ps, double* x,
                                                            double* run) {
  constexpr std::int64_t L = static_cast<std::int64_t>(sizeof(V) / sizeof(double)), E = L * C, XE = L * XC;
  // (memcpy for the unaligned loads and stores: no lambdas, whose vector arguments would
  // cross a function boundary outside the AVX2 target)
  const std::int64_t end = e0 + (Dv - e0) / XE * XE;
  for (std::int64_t e = e0; e < end; e += XE) {
    V xx[XC];
#pragma GCC unroll 4
    for (int c = 0; c < XC; ++c) xx[c] = V{};
    for (std::size_t j = 0; j < n; ++j) {
      const double* v = vb + keys[j] * Dv + e;
#pragma GCC unroll 4
      for (int c = 0; c < XC; ++c) {
        V vv;
        std::memcpy(&vv, v + c * L, sizeof vv);
        xx[c] += w[j] * vv;
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < XC; ++c) std::memcpy(x + e + c * L, &xx[c], sizeof(V));
  }
  for (; e0 + E <= end; e0 += E) {
    V xx[C], k[C], q2[C], r[C], p[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      std::memcpy(&xx[c], x + e0 + c * L, sizeof(V));
      r[c] = V{};
      std::memcpy(&k[c], key + e0 + c * L, sizeof(V));
      std::memcpy(&q2[c], wv + e0 + c * L, sizeof(V));
      std::memcpy(&p[c], ps + e0 + c * L, sizeof(V));
    }
    for (std::size_t j = 0; j < n; ++j) {
      const double* v = vb + keys[j] * Dv + e0;
      const double wj = w[j], kj = kr[j];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        V vv;
        std::memcpy(&vv, v + c * L, sizeof vv);
        const V d = wj * (vv - xx[c]) * kj, q = wj * vv;
        k[c] += d * d;
        q2[c] += q * q;
        r[c] += q;
        p[c] += r[c] * r[c];
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      std::memcpy(key + e0 + c * L, &k[c], sizeof(V));
      std::memcpy(wv + e0 + c * L, &q2[c], sizeof(V));
      std::memcpy(ps + e0 + c * L, &p[c], sizeof(V));
      std::memcpy(run + e0 + c * L, &r[c], sizeof(V));
    }
  }
  return e0;
}
// Four vectors at a time (C for the second pass, whose sums each depend on the previous key's:
// C chains in flight, as many as the registers hold), then one: the elements done (the rest is
// the scalar loop's).
template <class V, int C>
inline __attribute__((always_inline)) std::int64_t all_out_sums(const double* vb, const std::int64_t* keys,
                                                                std::size_t n, const double* w, const double* kr,
                                                                std::int64_t Dv, double* key, double* wv, double* ps,
                                                                double* x, double* run) {
  const std::int64_t e = out_sums<V, C, 4>(0, vb, keys, n, w, kr, Dv, key, wv, ps, x, run);
  return out_sums<V, 1, 1>(e, vb, keys, n, w, kr, Dv, key, wv, ps, x, run);
}

#define ATTNORACLE_SUMS_ARGS const double *vb, const std::int64_t *keys, std::size_t n, const double *w, \
                             const double *kr, std::int64_t Dv, double *key, double *wv, double *ps, double *x, \
                             double *run
#define ATTNORACLE_SUMS_PASS vb, keys, n, w, kr, Dv, key, wv, ps, x, run
__attribute__((target("avx512f"))) std::int64_t sums_avx512(ATTNORACLE_SUMS_ARGS) {
  return all_out_sums<v8d, 4>(ATTNORACLE_SUMS_PASS);
}
__attribute__((target("avx2"))) std::int64_t sums_avx2(ATTNORACLE_SUMS_ARGS) {
  return all_out_sums<v4d, 2>(ATTNORACLE_SUMS_PASS);
}
std::int64_t sums_sse(ATTNORACLE_SUMS_ARGS) { return all_out_sums<v2d, 2>(ATTNORACLE_SUMS_PASS); }
#undef ATTNORACLE_SUMS_ARGS
#undef ATTNORACLE_SUMS_PASS
using SumsFn = std::int64_t (*)(const double*, const std::int64_t*, std::size_t, const double*, const double*,
                                std::int64_t, double*, double*, double*, double*, double*);
SumsFn sums_kernel() {
  if (__builtin_cpu_supports("avx512f")) return sums_avx512;
  return __builtin_cpu_supports("avx2") ? sums_avx2 : sums_sse;
}

// sum_e s_e v_e over e in [0, Dv), as four sums of every fourth element added pairwise at the end
// ((h_0 + h_1) + (h_2 + h_3)), the elements past the last multiple of four into h_0; s null: all
// ones. For four value rows at a time (independent sums in flight), the same operations per row.
double lane_sum(const double* s, const double* v, std::int64_t Dv) {
  double h[4] = {0, 0, 0, 0};
  std::int64_t e = 0;
  for (; e + 4 <= Dv; e += 4)
    for (int l = 0; l < 4; ++l) h[l] += s ? s[e + l] * v[e + l] : v[e + l];
  for (; e < Dv; ++e) h[0] += s ? s[e] * v[e] : v[e];
  return (h[0] + h[1]) + (h[2] + h[3]);
}
// (lanes 0, 1 and 2, 3 of each row in two SSE2 registers: eight sums held in registers)
void lane_sums4(const double* s, const double* const v[4], std::int64_t Dv, double out[4]) {
  v2d lo[4] = {}, hi[4] = {};
  std::int64_t e = 0;
  for (; e + 4 <= Dv; e += 4) {
    v2d s0, s1;
    std::memcpy(&s0, s + e, sizeof s0);
    std::memcpy(&s1, s + e + 2, sizeof s1);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      v2d v0, v1;
      std::memcpy(&v0, v[r] + e, sizeof v0);
      std::memcpy(&v1, v[r] + e + 2, sizeof v1);
      lo[r] += s0 * v0;
      hi[r] += s1 * v1;
    }
  }
  for (int r = 0; r < 4; ++r) {
    double t = lo[r][0];
    for (std::int64_t k = e; k < Dv; ++k) t += s[k] * v[r][k];
    out[r] = (t + lo[r][1]) + (hi[r][0] + hi[r][1]);
  }
}
// A key's bin in the bias test's P part, and its coefficients in both directions.
struct KeyBin {
  std::uint64_t bin;
  double c[2];
};
// `bins` in the order std::sort by bin leaves them, in `out`. Where no two share a bin that order
// is the only one, and an LSD radix sort (8 bits a pass, skipping the digits all share) finds it
// sooner; with a tie (which std::sort orders in its own way) std::sort itself. `ties_likely`:
// std::sort at once.
void sort_bins(const std::vector<KeyBin>& bins, bool ties_likely, std::vector<KeyBin>& out,
               std::vector<KeyBin>& spare) {
  const auto by_bin = [](const KeyBin& lhs, const KeyBin& rhs) { return lhs.bin < rhs.bin; };
  out = bins;
  if (ties_likely || bins.size() < 32) {
    std::sort(out.begin(), out.end(), by_bin);
    return;
  }
  std::uint64_t any = 0, all = ~0ull;
  for (const KeyBin& b : bins) any |= b.bin, all &= b.bin;
  spare.resize(bins.size());
  for (int shift = 0; shift < 64; shift += 8) {
    if ((((any ^ all) >> shift) & 0xff) == 0) continue;  // the same digit everywhere
    std::size_t at[257] = {};
    for (const KeyBin& b : out) ++at[((b.bin >> shift) & 0xff) + 1];
    for (int d = 0; d < 256; ++d) at[d + 1] += at[d];
    for (const KeyBin& b : out) spare[at[(b.bin >> shift) & 0xff]++] = b;
    out.swap(spare);
  }
  for (std::size_t a = 1; a < out.size(); ++a)
    if (out[a].bin == out[a - 1].bin) {
      out = bins;
      std::sort(out.begin(), out.end(), by_bin);
      return;
    }
}
// v as n zeros, in huge pages where it is large (fewer page faults).
void zeros(std::vector<double>& v, std::size_t n) {
  v.reserve(n);
  advise_huge_pages(v.data(), n * sizeof(double));
  v.assign(n, 0.0);
}
// lse's variance proxy times 3 (lse_scale): the weights' sum_j w_j eps_j (key_sum), Z's
// summation, log's own on log Z <= log n, the addition of the maximum, the final rounding; with P
// in E4M3 (w_norm = sqrt(sum_j w_j^2) given) without P's rounding (l sums P unrounded).
double lse_var(const Profile& p, double key_sum, double z_part, double w_norm, double keys, double ax,
               double u_out) {
  const double us = unit_roundoff(p.softmax);
  double var = sq(key_sum) + sq(us * z_part) + sq(p.exp_ulps * us * std::log(keys)) + sq(us * ax) + sq(u_out * ax);
  if (w_norm >= 0) var -= std::min(sq(key_sum), sq(unit_roundoff(p.p) * w_norm));
  return var;
}
}  // namespace

SharedRoundings shared_roundings(const Case& c, const Profile& p) {
  // factors of every score (the softmax scale; FP8 descales' scale q_descale k_descale, two
  // more; a stored K's scale folded into it, one more), each at most u_qk relative on the score;
  // a stored k's element x scale, formed in qk_accum (P in F16 or BF16: in P's dtype, as K is
  // there), at most that dtype's u on each product q_d k_jd
  const double uq = unit_roundoff(p.qk_accum), up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const bool descaled = c.file.find("q_descale") || c.file.find("k_descale");
  SharedRoundings r;
  r.factor = (1 + (descaled ? 2 : 0) + (stored_kv(c) ? 1 : 0)) * uq;
  r.k = stored_kv(c) ? (p.p == DType::F16 || p.p == DType::BF16 ? std::max(uq, up) : uq) : 0;
  return r;
}

void bound_lse_shared(const Case& c, const Profile& p, const std::vector<RowMagnitudes>& mags, Spread& sp) {
  if (!sp.exact || !sp.lse_shared.empty() || sp.key_sum.size() != mags.size()) return;
  const SharedRoundings r = shared_roundings(c, p);
  sp.lse_shared.assign(mags.size(), 0.0);
  for (std::size_t row = 0; row < mags.size(); ++row) {
    // |sum_j w_j t'_j| and sum_j w_j |scale| dabs_j are at most the row's A = max_j |scale| dabs_j;
    // lse's scale without |lse|'s terms, the floors and log's (smaller)
    const double shared = (r.factor + r.k) * mags[row].dot_abs;
    const double var = lse_var(p, sp.key_sum[row], sp.z_part[row], sp.w_norm.empty() ? -1 : sp.w_norm[row], 1, 0, 0);
    sp.lse_shared[row] = shared == 0 ? 0 : (var > 0 ? shared / std::sqrt(var / 3) : INFINITY);
  }
}

std::pair<double, double> binned_parts(std::vector<std::pair<std::uint64_t, double>>& bins) {
  sort_bin_pairs(bins);
  RootSumSquares parity[2];  // over the even and the odd bins
  for (std::size_t a = 0; a < bins.size();) {
    double c = 0;
    std::size_t e = a;
    for (; e < bins.size() && bins[e].first == bins[a].first; ++e) c += bins[e].second;
    parity[bins[a].first & 1].add(c);
    a = e;
  }
  return {parity[0].root(), parity[1].root()};
}

double binned_root(std::vector<std::pair<std::uint64_t, double>>& bins) {
  const auto [even, odd] = binned_parts(bins);
  return even + odd;
}

Spread weight_spread(const Case& c, const Profile& p) {
  Spread s;
  if (c.kind != Kind::Sdpa) return s;
  s.exact = true;
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double ub = p.bias ? unit_roundoff(*p.bias) : 0;  // a bias rounded to its dtype first
  const std::int64_t H = c.Hq, Nk = c.Nk, Dk = c.Dk, Dv = c.Dv;
  const double scale = c.scale ? std::strtod(c.scale->c_str(), nullptr) : 1 / std::sqrt(static_cast<double>(Dk));
  const double cap = c.softcap ? std::strtod(c.softcap->c_str(), nullptr) : 0;
  // stored K/V or FP8 descales: the scale's roundings on k (or on the score), 3 more (row_limits)
  const bool scaled = stored_kv(c) || c.file.find("q_descale") || c.file.find("k_descale");
  const double dot_k = std::sqrt(static_cast<double>(Dk) + (scaled ? 5 : 2)) * uq * std::fabs(scale);
  const SharedRoundings shared_by_rows = shared_roundings(c, p);
  const double shared_factor = shared_by_rows.factor, shared_k = shared_by_rows.k * std::fabs(scale);
  const std::size_t rows = static_cast<std::size_t>(c.B * H * c.Nq);
  s.key_sum.assign(rows, 0.0);
  s.key_max.assign(rows, 0.0);
  s.z_part.assign(rows, 0.0);
  s.lse_shared.assign(rows, 0.0);
  for (std::vector<double>* v : {&s.key, &s.wv, &s.partial}) zeros(*v, rows * static_cast<std::size_t>(Dv));
  const bool p8 = p.p == DType::F8_E4M3;
  if (p8) s.sub_l.assign(rows, 0.0), s.w_norm.assign(rows, 0.0), zeros(s.sub_v, rows * static_cast<std::size_t>(Dv));
  std::vector<std::int64_t> keys;
  std::vector<double> w, t, kr, x(static_cast<std::size_t>(Dv)), run(static_cast<std::size_t>(Dv));
  std::vector<double> dt, da;  // per key: d t_j / d scale times scale (the softcap's slope), |scale| dabs_j
  const bool plain = !c.mask && !c.bias;  // every key in the positional range is allowed
  const SumsFn sums = sums_kernel();
  const DotsFn row_dots = dots_kernel();
  // The current kv head's keys by transposed blocks (as key_dots reads them, zero padded to Nkp
  // keys); two rows' dots by key, rows
  // 2m (index 0) and 2m + 1 (index 1) of a head computed together.
  const std::int64_t Nkp = (Nk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const auto nkp = static_cast<std::size_t>(Nkp);
  std::vector<double> kt(static_cast<std::size_t>(Dk) * nkp, 0.0), dots[2], dabss[2];
  for (int r = 0; r < 2; ++r) dots[r].assign(nkp, 0.0), dabss[r].assign(nkp, 0.0);
  std::int64_t packed = -1;  // the kv head (b * Hkv + g) in kt
  // The bias test's P part: rows of equal weights (a class, by a hash of their bits) round alike,
  // their roots add; the classes are independent. Per class the sums of its rows' roots over the
  // even and the odd bins, for each direction.
  const int p_precision = up > 0 ? float_format(p.p).precision : 0;
  const double p_min_normal = up > 0 ? min_normal(p.p) : 0, p_sub = up > 0 ? min_subnormal(p.p) : 0;
  std::unordered_map<std::uint64_t, std::size_t> classes;
  std::vector<std::array<double, 4>> class_roots;
  std::vector<KeyBin> bins, sorted, spare;
  std::vector<double> sign(static_cast<std::size_t>(Dv));  // of x_c: -1, 0, 1
  // per key of the current kv head: H0_j = sum_c v_jc (the same for every row); per allowed key
  // of the current row: H1_j = sum_c sign(x_c) v_jc
  std::vector<double> h0s(static_cast<std::size_t>(Nk)), h1s;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = c.kv_head(h);
      auto vrow = [&](std::int64_t j) { return &c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * Nk + j) * Dv)]; };
      if (packed != b * c.Hkv + g) {
        packed = b * c.Hkv + g;
        for (std::int64_t j = 0; j < Nk; ++j)
          for (std::int64_t d = 0; d < Dk; ++d) {
            kt[static_cast<std::size_t>(j / kKeyBlock * kKeyBlock * Dk + d * kKeyBlock + j % kKeyBlock)] = c.k.values[static_cast<std::size_t>((packed * Nk + j) * Dk + d)];
          }
        if (up != 0)
          for (std::int64_t j = 0; j < Nk; ++j) h0s[static_cast<std::size_t>(j)] = lane_sum(nullptr, vrow(j), Dv);
      }
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const auto row = static_cast<std::size_t>((b * H + h) * c.Nq + i);
        const double* q = &c.q.values[row * static_cast<std::size_t>(Dk)];
        keys.clear();
        w.clear();
        t.clear();
        kr.clear();
        dt.clear();
        da.clear();
        const Case::KeyRange r = c.key_range(b, i);
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (plain ? c.position_allowed(b, i, j) : c.allowed(b, h, i, j)) keys.push_back(j);
        if (i % 2 == 0) {  // this row's and the next one's dots, over both key ranges
          const std::int64_t i1 = std::min(i + 1, c.Nq - 1);
          const Case::KeyRange r1 = c.key_range(b, i1);
          std::int64_t lo = r.first <= r.last ? r.first : Nk, hi = r.first <= r.last ? r.last : -1;
          if (r1.first <= r1.last) lo = std::min(lo, r1.first), hi = std::max(hi, r1.last);
          if (lo <= hi)
            row_dots(q, q + (i1 - i) * Dk, kt.data(), Dk, lo / kKeyBlock * kKeyBlock, (hi / kKeyBlock + 1) * kKeyBlock,
                     dots[0].data(), dabss[0].data(), dots[1].data(), dabss[1].data());
        }
        const double *dot = dots[i % 2].data(), *dabs = dabss[i % 2].data();
        for (std::size_t a = 0; a < keys.size(); ++a) {
          const auto ka = static_cast<std::size_t>(keys[a]);
          double tj = dot[ka] * scale;
          const double raw = tj;
          if (cap > 0) tj = cap * std::tanh(tj / cap);
          t.push_back(tj);
          dt.push_back(cap > 0 ? (1 - sq(tj / cap)) * raw : raw);
          da.push_back(std::fabs(scale) * dabs[ka]);
          const double bj = plain ? 0.0 : c.bias_at(b, h, i, keys[a]);
          w.push_back(tj + bj);
          // the dot (Dk products and sums), the scale, the softcap; the bias's own rounding
          // (hypot(x, 0) is |x| exactly)
          const double ebias = ub * bj;
          kr.push_back(ebias == 0 ? std::fabs(dot_k * dabs[ka]) : std::hypot(dot_k * dabs[ka], ebias));
        }
        if (keys.empty()) continue;
        const double m = *std::max_element(w.begin(), w.end());
        double z = 0;
        for (std::size_t j = 0; j < w.size(); ++j) {
          // the score's rounding into `softmax` and the bias's addition, the subtraction, exp,
          // the division, P's rounding
          kr[j] = std::sqrt(sq(kr[j]) + sq(us * t[j]) + sq(us * w[j]) + sq(us * (w[j] - m)) + sq(p.exp_ulps * us) +
                            sq(us) + sq(up));
          z += (w[j] = std::exp(w[j] - m));
        }
        double ks = 0, km = 0, zp = 0, wk = 0, wsq = 0, wt = 0, wa = 0;
        for (std::size_t j = 0; j < w.size(); ++j) {
          w[j] /= z;
          ks += sq(w[j] * kr[j]);
          km = std::max(km, kr[j]);
          wk += w[j];
          zp += wk * wk;
          wsq += sq(w[j]);
          wt += w[j] * dt[j];
          wa += w[j] * da[j];
        }
        s.key_sum[row] = std::sqrt(ks);
        s.key_max[row] = km;
        s.z_part[row] = std::sqrt(zp);
        // lse's shared part: d lse = sum_j w_j d t_j, a factor's rounding delta giving d t_j =
        // delta t_j' (t_j' = dt_j), k's giving |d t_j| <= u_qk |scale| dabs_j; over lse's scale
        // without the final rounding, the floors, a sink's term and log's on more keys (smaller)
        const double lse_x = c.sinks ? 0 : std::fabs(m + std::log(z));
        const double var = lse_var(p, s.key_sum[row], s.z_part[row], p8 ? std::sqrt(wsq) : -1,
                                   static_cast<double>(keys.size()), lse_x, 0);
        const double shared = shared_factor * std::fabs(wt) + shared_k * wa;
        s.lse_shared[row] = shared == 0 ? 0 : (var > 0 ? shared / std::sqrt(var / 3) : INFINITY);
        // Vectors of elements at a time, key by key; each element's sums still run over the keys
        // in order, so the results are the scalar loops' bit for bit.
        double* key = &s.key[row * static_cast<std::size_t>(Dv)];
        double* wv = &s.wv[row * static_cast<std::size_t>(Dv)];
        double* ps = &s.partial[row * static_cast<std::size_t>(Dv)];
        const double* vb = &c.v.values[static_cast<std::size_t>((b * c.Hkv + g) * Nk * Dv)];
        const std::int64_t DvE = sums(vb, keys.data(), keys.size(), w.data(), kr.data(), Dv, key, wv, ps, x.data(),
                                      run.data());
        for (std::int64_t e = DvE; e < Dv; ++e) {
          const auto ue = static_cast<std::size_t>(e);
          x[ue] = 0;
          for (std::size_t j = 0; j < keys.size(); ++j) x[ue] += w[j] * vrow(keys[j])[e];
          run[ue] = 0;
          for (std::size_t j = 0; j < keys.size(); ++j) {
            const double ve = vrow(keys[j])[e];
            key[e] += sq(w[j] * (ve - x[ue]) * kr[j]);
            wv[e] += sq(w[j] * ve);
            run[ue] += w[j] * ve;
            ps[e] += sq(run[ue]);
          }
        }
        for (std::int64_t e = 0; e < Dv; ++e) {
          key[e] = std::sqrt(key[e]);
          wv[e] = std::sqrt(wv[e]);
          ps[e] = std::sqrt(ps[e]);
        }
        if (up == 0) continue;
        const double wmax = *std::max_element(w.begin(), w.end());
        if (p8) {  // the keys whose P_j falls below P's smallest normal, and their values
          double* sv = &s.sub_v[row * static_cast<std::size_t>(Dv)];
          double count = 0, w2 = 0;
          for (std::size_t j = 0; j < keys.size(); ++j) {
            w2 += sq(w[j]);
            if (w[j] / wmax >= min_normal(p.p)) continue;
            count += 1;
            for (std::int64_t e = 0; e < Dv; ++e) sv[e] += sq(vrow(keys[j])[e]);
          }
          for (std::int64_t e = 0; e < Dv; ++e) sv[e] = wmax * std::sqrt(sv[e]);
          s.sub_l[row] = wmax * std::sqrt(count);
          s.w_norm[row] = std::sqrt(w2);
        }
        // P's roundings on sum_c s_dc out_c: key j's rounding delta_j (|delta_j| <= up w_j, or half
        // P's subnormal s_p where P_j = w_j / w_max is below P's smallest normal) moves it by
        // delta_j (H_dj - theta X_d), H_dj = sum_c s_dc v_jc, X_d = sum_c s_dc x_c, theta 0 when l
        // sums the unrounded P, 1 when the rounded: the larger of both
        double X[2] = {0, 0};
        for (std::int64_t e = 0; e < Dv; ++e) {
          const double xe = x[static_cast<std::size_t>(e)];
          sign[static_cast<std::size_t>(e)] = xe > 0 ? 1.0 : (xe < 0 ? -1.0 : 0.0);
          X[0] += xe;
          X[1] += std::fabs(xe);
        }
        h1s.resize(keys.size());
        std::size_t a4 = 0;
        for (; a4 + 4 <= keys.size(); a4 += 4) {
          const double* v4[4] = {vrow(keys[a4]), vrow(keys[a4 + 1]), vrow(keys[a4 + 2]), vrow(keys[a4 + 3])};
          lane_sums4(sign.data(), v4, Dv, &h1s[a4]);
        }
        for (; a4 < keys.size(); ++a4) h1s[a4] = lane_sum(sign.data(), vrow(keys[a4]), Dv);
        bins.clear();
        std::uint64_t hash = 14695981039346656037ull;  // FNV-1a of the weights' bits
        for (std::size_t j = 0; j < keys.size(); ++j) {
          std::uint64_t wb;
          std::memcpy(&wb, &w[j], sizeof wb);
          hash = (hash ^ wb) * 1099511628211ull;
          if (w[j] == 0) continue;
          const double H0 = h0s[static_cast<std::size_t>(keys[j])], H1 = h1s[j];
          const double pj = w[j] / wmax, beta = std::max(up * w[j], p_sub / 2);
          // relative bins of at least an ulp of P; below its smallest normal, absolute ones of two
          // subnormal spacings (the top bit set: apart from the others)
          const std::uint64_t bin = pj >= p_min_normal ? BiasSample::value_bin(w[j], p_precision)
                                                       : (1ull << 63) | static_cast<std::uint64_t>(pj / (2 * p_sub));
          bins.push_back({bin, {beta * std::max(std::fabs(H0), std::fabs(H0 - X[0])),
                                beta * std::max(std::fabs(H1), std::fabs(H1 - X[1]))}});
        }
        // the bins in order, each bin's coefficients added, by parity (binned_parts, both directions)
        // (bins narrower than 2^-14 of P's values: ties rare)
        sort_bins(bins, p_precision < 16, sorted, spare);
        RootSumSquares parity[4];  // direction d: even bins at 2 d, odd at 2 d + 1
        for (std::size_t a = 0; a < sorted.size();) {
          double sum[2] = {0, 0};
          std::size_t e = a;
          for (; e < sorted.size() && sorted[e].bin == sorted[a].bin; ++e) sum[0] += sorted[e].c[0], sum[1] += sorted[e].c[1];
          for (int d = 0; d < 2; ++d) parity[2 * d + (sorted[a].bin & 1)].add(sum[d]);
          a = e;
        }
        const auto [at, fresh] = classes.try_emplace(hash, class_roots.size());
        if (fresh) class_roots.push_back({0, 0, 0, 0});
        for (int k = 0; k < 4; ++k) class_roots[at->second][static_cast<std::size_t>(k)] += parity[k].root();
      }
    }
  for (int k = 0; k < 4; ++k) {
    RootSumSquares r;
    for (const auto& roots : class_roots) r.add(roots[static_cast<std::size_t>(k)]);
    s.p_bias[k] = r.root() / std::sqrt(3.0);
  }
  return s;
}

RowScales row_scales(const Profile& p, const Case& c, const RowMagnitudes& m) {
  const double uq = unit_roundoff(p.qk_accum), us = unit_roundoff(p.softmax);
  const double upv = unit_roundoff(p.pv_accum);
  const double up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  const double n = static_cast<double>(std::max<std::int64_t>(m.keys, 1));
  RowScales r;
  // A score: Dk + 2 roundings on at most A (the dot, the scale, the softcap), two on at most M
  // (into `softmax`, the bias); mha's projections of q and k first.
  double proj = 0;
  if (c.kind == Kind::Mha) proj = 2 * (std::sqrt(static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection));
  const bool scaled = stored_kv(c) || c.file.find("q_descale") || c.file.find("k_descale");
  r.score = std::sqrt(static_cast<double>(c.Dk) + (scaled ? 5 : 2)) * uq * m.dot_abs + proj * m.dot_abs +
            2 * us * m.score_abs;
  r.score += 3 * rotary_rel(p, c) * m.rotary_abs;  // the rotation's, as in the worst-case limit
  // a bias rounded to its dtype first: one rounding, as in the worst-case limit
  if (p.bias) r.score += unit_roundoff(*p.bias) * m.bias_abs + min_subnormal(*p.bias) / 2;
  r.key_rel = r.score + 2 * us * m.score_abs + p.exp_ulps * us + us + up;
  r.sum_rel = std::sqrt(n) * us;
  // v's scale (stored K/V, v_descale) and an FP8 out's o_scale: one rounding each more on P V
  const int more = (stored_kv(c) || c.file.find("v_descale") ? 1 : 0) + (c.o_scale ? 1 : 0);
  r.pv = std::sqrt(1.0 + more) * upv;
  if (c.kind == Kind::Mha)
    r.extra = std::sqrt(static_cast<double>(c.D) + 1) * uq + unit_roundoff(p.projection) +
              std::sqrt(static_cast<double>(c.Hq * c.Dv) + 1) * upv;
  // dropout: the product of each kept weight (or of the output) by the keep scale, on out.bound
  r.extra += dropout_product_error(p, c);
  r.log_abs = p.exp_ulps * us * (1 + m.score_abs);
  return r;
}

namespace {
const double kRoot3 = std::sqrt(3.0);
// wv^2 + partial^2; a stored model (stored_model.hpp) keeps their root in wv, partial empty
double pv_terms(const Spread& sp, std::size_t k) {
  return sp.partial.empty() ? sq(sp.wv[k]) : sq(sp.wv[k]) + sq(sp.partial[k]);
}
}

double out_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                 std::size_t row, std::size_t k, double x, double bound, double vsum) {
  const double ax = std::fabs(x), floors = L.floor + L.p_sub * (vsum + L.keys * bound);
  const double us = unit_roundoff(p.softmax);
  if (!sp.exact)  // every term on out.bound, the partial sums at most it, sum w^2 <= 1
    return (s.key_rel * bound + (s.key_rel + s.sum_rel) * ax + s.pv * ((std::sqrt(L.keys) + 1) * bound + ax) +
            s.extra * bound + u_out * ax) / kRoot3 + floors;
  // the weights' own errors, Z's summation, a rescaling's exp, P V's products, partial sums and
  // final division, the final rounding
  // P in E4M3 with l summed from the unrounded P: a rounding delta_j of w_j moves out by
  // delta_j v_jc, not delta_j (v_jc - x_c) as in key[k]: u_p sqrt(sum_j (w_j v_jc)^2) covers it
  const double p8 = p.p == DType::F8_E4M3 ? unit_roundoff(p.p) : 0;
  double var = sq(sp.key[k]) + sq(us * sp.z_part[row] * ax) + sq(p.exp_ulps * us * ax) +
               sq(s.pv) * (pv_terms(sp, k) + sq(ax)) + sq(u_out * ax) + sq(p8 * sp.wv[k]);
  if (sp.sub_l.empty()) return std::sqrt(var) / kRoot3 + floors;
  // P's underflow (step 4b) key by key, independent roundings of at most s_p / 2 each, over l:
  // on the numerator sum_j delta_j v_jc / l, and on l (a relative sum_j delta_j / l, times x)
  var += sq(L.p_sub * (sp.sub_v[k] + sp.sub_l[row] * ax));
  return std::sqrt(var) / kRoot3 + L.floor;
}

double out_rest_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, std::size_t row,
                      std::size_t k, double x, double bound, double vsum) {
  (void)bound, (void)vsum;  // P's underflow term (step 4b) is P's part of the bias test
  if (!sp.exact) return 0;
  const double ax = std::fabs(x);
  const double us = unit_roundoff(p.softmax), up = p.p == DType::F64 ? 0 : unit_roundoff(p.p);
  // kr_j^2 = r_j^2 + up^2, r_j what is not P's rounding: r_j^2 / kr_j^2 <= 1 - up^2 / max_j kr_j^2
  const double km = sp.key_max[row], keep = km > 0 ? std::sqrt(std::max(0.0, 1 - sq(up / km))) : 0;
  const double var = sq(sp.key[k] * keep) + sq(us * sp.z_part[row] * ax) + sq(p.exp_ulps * us * ax) +
                     sq(s.pv) * (pv_terms(sp, k) + sq(ax));
  return std::sqrt(var) / kRoot3 + L.floor;
}

RowWeightScale row_weight_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L,
                                double u_out, std::size_t row) {
  RowWeightScale r;
  r.floor = L.floor;
  r.p_sub = L.p_sub;
  if (!sp.exact) {
    r.rel = s.key_rel * 2 + s.sum_rel + u_out;
    return r;
  }
  // d w_i = w_i (eps_i - sum_j w_j eps_j): its own error, Z's, the final rounding
  const double us = unit_roundoff(p.softmax);
  r.rel = std::sqrt(sq(sp.key_max[row]) + sq(sp.key_sum[row]) + sq(us * sp.z_part[row]) + sq(u_out));
  return r;
}

double weight_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                    std::size_t row, double x) {
  return row_weight_scale(p, sp, s, L, u_out, row).at(x);
}

double lse_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                 std::size_t row, double x) {
  const double ax = std::fabs(x), floors = L.floor + L.keys * L.p_sub;
  if (!sp.exact) return (s.score + s.key_rel + s.sum_rel + s.log_abs + u_out * ax) / kRoot3 + floors;
  // lse = log sum exp(s_j) (lse_var). P in E4M3: l sums P before its rounding (FlashAttention
  // 3), so neither P's rounding (u_p sqrt(sum_j w_j^2) of key_sum) nor its underflow reaches lse
  const double var = lse_var(p, sp.key_sum[row], sp.z_part[row], sp.w_norm.empty() ? -1 : sp.w_norm[row], L.keys,
                             ax, u_out);
  return std::sqrt(var) / kRoot3 + (sp.w_norm.empty() ? floors : L.floor);
}

Tier judge(Sample& s) {
  Tier t;
  s.close();
  t.n = s.size();
  t.rows = s.rows;
  const double delta = kFailureProbability;
  t.q99_limit = std::sqrt(2 * std::log(200 / delta));
  const double R = static_cast<double>(std::max<std::int64_t>(s.rows, 1));
  t.rms_limit = std::sqrt(2 * std::log(2.0) + 4 * std::log(1 / delta) / R);
  // the mean is the sum of the final roundings' parts (independent: proxy sum share / n^2) and
  // of the rest (rows independent, within a row any dependence): the roots of the proxies add
  t.mean_limit = std::sqrt(2 * std::log(2 / delta)) * (std::sqrt(s.own) + std::sqrt(s.shared)) /
                 static_cast<double>(std::max<std::int64_t>(t.n, 1));
  // a systematic shift s_k of every z_k (dropout's keep scale): |z| <= |z0| + max s, the rms of
  // the rows' means by Minkowski's inequality, the mean by the mean shift
  t.q99_limit += s.shift_max;
  t.rms_limit += std::sqrt(s.row_mean_shift_sq / R);
  t.mean_limit += s.shift_sum / static_cast<double>(std::max<std::int64_t>(t.n, 1));
  t.headroom = std::numeric_limits<double>::infinity();
  if (t.n < kMinSample) return t;
  t.tested = true;
  const double n = static_cast<double>(t.n);
  t.mean = s.sum / n;
  t.rms = std::sqrt(s.row_mean_sq / R);
  // the 99th percentile of |z|: the ceil(0.99 n)-th smallest, the zeros first
  const auto rank = static_cast<std::int64_t>(std::ceil(0.99 * n));
  if (rank > s.zeros) {
    // in place (no copy of a sample as large as the tensor): z becomes |z|, reordered
    std::vector<double>& a = s.z;
    for (double& z : a) z = std::fabs(z);
    const auto at = a.begin() + (rank - s.zeros - 1);
    std::nth_element(a.begin(), at, a.end());
    t.q99 = *at;
  }
  auto room = [](double limit, double seen) {
    return seen > 0 ? limit / seen : std::numeric_limits<double>::infinity();
  };
  t.headroom = std::min({room(t.q99_limit, t.q99), room(t.rms_limit, t.rms), room(t.mean_limit, std::fabs(t.mean))});
  char buf[200];
  if (!(std::fabs(t.mean) <= t.mean_limit)) {
    std::snprintf(buf, sizeof buf, "biased: mean normalised error %.3g over %lld elements, allowed %.3g", t.mean,
                  static_cast<long long>(t.n), t.mean_limit);
    t.note = buf;
  } else if (!(t.q99 <= t.q99_limit)) {
    std::snprintf(buf, sizeof buf, "99th percentile of the normalised error %.3g exceeds %.3g", t.q99, t.q99_limit);
    t.note = buf;
  } else if (!(t.rms <= t.rms_limit)) {
    std::snprintf(buf, sizeof buf, "root mean square normalised error %.3g exceeds %.3g over %lld rows", t.rms,
                  t.rms_limit, static_cast<long long>(t.rows));
    t.note = buf;
  }
  t.ok = t.note.empty();
  return t;
}

Tier judge(Sample& s, BiasSample& b, const Spread& sp) {
  Tier t = judge(s);
  b.close();
  if (!t.tested || !sp.exact || b.n < kMinSample) return t;
  // P's roundings and the final roundings are independent: over the even bins of both their
  // proxies add, over the odd ones likewise; the roots of those two and of the rest's add (Hoelder)
  const auto [f_even, f_odd] = binned_parts(b.finals);
  const double rest = b.rest.root();
  for (int d = 0; d < 2; ++d) {
    const double scale = std::hypot(sp.p_bias[2 * d], f_even) + std::hypot(sp.p_bias[2 * d + 1], f_odd) + rest;
    const double z = scale > 0 ? b.t[d] / scale : (b.t[d] == 0 ? 0 : std::numeric_limits<double>::infinity());
    if (d == 0 || !(std::fabs(z) <= std::fabs(t.bias))) t.bias = z, t.bias_direction = d;
  }
  t.bias_tested = true;
  t.bias_limit = std::sqrt(2 * std::log(2 / kFailureProbability));
  if (std::fabs(t.bias) > 0) t.headroom = std::min(t.headroom, t.bias_limit / std::fabs(t.bias));
  if (!(std::fabs(t.bias) <= t.bias_limit) && t.ok) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "biased %s: %s %.3g times its scale over %lld elements, allowed %.3g",
                  t.bias_direction == 0 ? (t.bias > 0 ? "up" : "down") : (t.bias > 0 ? "away from zero" : "toward zero"),
                  t.bias_direction == 0 ? "sum of the errors" : "sum of the errors away from zero", t.bias,
                  static_cast<long long>(b.n), t.bias_limit);
    t.note = buf;
    t.ok = false;
  }
  return t;
}

}  // namespace attnoracle::conformance
