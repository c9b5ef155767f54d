// row_magnitudes. For every row and allowed key j it needs dot_j = sum_d q_d k_jd and dabs_j =
// sum_d |q_d| |k_jd| in double, summed in d order (the values the limits have always been
// derived from), and only their maxima. Two ways, with the same results bit for bit:
//  - exact: every (i, j) in double, vectorised across keys (each lane sums in d order, no fused
//    multiply-add);
//  - filtered: every (i, j) in float with a rigorous error bound, which leaves as candidates for
//    the maxima only the keys whose interval reaches the largest lower end; those few are then
//    computed exactly as above. Taken when the float computation cannot overflow or underflow
//    (input magnitudes in [2^-50, 2^51)) and there is no softcap (whose tanh would be needed
//    on every key anyway).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "attnoracle/conformance/tolerance.hpp"
#include "magnitude_kernels.hpp"
#include "no_contraction.hpp"

namespace attnoracle::conformance {

using namespace magnitudes;

namespace {

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

// Rotary: each row's max over its allowed keys of scale * sum_d qm_d km_d (every allowed key,
// the negligible ones too).
void rotary_magnitudes(const Case& c, double scale, std::vector<RowMagnitudes>& out) {
  const Rotary& r = *c.rotary;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const auto row = static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i);
        const double* qm = &r.q_mag[row * static_cast<std::size_t>(c.Dk)];
        for (std::int64_t j = 0; j < c.Nk; ++j) {
          if (!c.allowed(b, h, i, j)) continue;
          const double* km = &r.k_mag[static_cast<std::size_t>(((b * c.Hkv + c.kv_head(h)) * c.Nk + j) * c.Dk)];
          double s = 0;
          for (std::int64_t d = 0; d < c.Dk; ++d) s += qm[d] * km[d];  // 0 past R
          out[row].rotary_abs = std::max(out[row].rotary_abs, s * scale);
        }
      }
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
  if (c.rotary) rotary_magnitudes(c, scale, out);
  return out;
}

}  // namespace attnoracle::conformance
