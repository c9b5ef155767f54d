/* The attention kernel, written once for both precisions: attention.c includes this file twice,
 * with REAL defined as float (SDPA sdpa_f32, SDPA_BACKWARD sdpa_backward_f32) and as double
 * (sdpa_f64, sdpa_backward_f64). <tgmath.h> picks
 * expf/tanhf/logf for float and exp/tanh/log for double, so all arithmetic is done in REAL.
 *
 * For every (b, h, i): scores of the allowed keys, their maximum, exp(s - max), the sum, the
 * weights, then the output row. Returns 1, or 0 after writing a refusal into `message` (a fully
 * masked row under attn.masked_rows=error). `weights` holds Nk scratch values per row at least;
 * `out` and `lse` may be NULL when not asked for. */
static int SDPA(const problem* p, REAL* out, REAL* weights, int weights_full, REAL* lse,
                unsigned char* allowed, char* message, size_t message_size)
{
  const REAL* q = (const REAL*)p->q;
  const REAL* k = (const REAL*)p->k;
  const REAL* v = (const REAL*)p->v;
  const REAL scale = (REAL)p->scale, cap = (REAL)p->softcap;
  const int64_t group = p->Hq / p->Hkv; /* query heads per kv head */
  int64_t b, h, i, j, d;

  for (b = 0; b < p->B; ++b) {
    for (h = 0; h < p->Hq; ++h) {
      const int64_t g = h / group;
      const REAL* kh = k + (b * p->Hkv + g) * p->Nk * p->Dk;
      const REAL* vh = v + (b * p->Hkv + g) * p->Nk * p->Dv;
      for (i = 0; i < p->Nq; ++i) {
        const int64_t row = (b * p->Hq + h) * p->Nq + i;
        const REAL* qi = q + row * p->Dk;
        REAL* w = weights + (weights_full ? row * p->Nk : 0);
        REAL m = -INFINITY, z = 0;
        int any = 0;

        /* Scores: scale * q.k, softcap, bias; only where the key is allowed. */
        for (j = 0; j < p->Nk; ++j) {
          REAL s = 0;
          allowed[j] = key_allowed(p, b, h, i, j);
          w[j] = 0;
          if (!allowed[j]) continue;
          for (d = 0; d < p->Dk; ++d) s += qi[d] * kh[j * p->Dk + d];
          s = scale * s;
          if (cap != 0) s = cap * tanh(s / cap);
          if (p->bias) s += (REAL)bias_at(p, b, h, i, j);
          w[j] = s;
          if (!any || s > m) m = s;
          any = 1;
        }

        if (!any) { /* a fully masked row */
          if (!p->zero_rows && !padding_row(p, b, i)) {
            snprintf(message, message_size,
                     "fully masked row: b=%lld, h=%lld, i=%lld has no allowed key "
                     "(attn.masked_rows=error)", (long long)b, (long long)h, (long long)i);
            return 0;
          }
          if (out) for (d = 0; d < p->Dv; ++d) out[row * p->Dv + d] = 0;
          if (lse) lse[row] = -INFINITY;
          continue;
        }

        /* Softmax over the allowed keys, the maximum subtracted first. */
        for (j = 0; j < p->Nk; ++j) {
          if (!allowed[j]) continue;
          w[j] = exp(w[j] - m);
          z += w[j];
        }
        for (j = 0; j < p->Nk; ++j) w[j] /= z; /* not allowed: 0 / z = 0 */
        if (lse) lse[row] = m + log(z);

        /* Output row: sum over keys of weight times value. */
        if (out) {
          REAL* o = out + row * p->Dv;
          for (d = 0; d < p->Dv; ++d) o[d] = 0;
          for (j = 0; j < p->Nk; ++j) {
            if (!allowed[j]) continue;
            for (d = 0; d < p->Dv; ++d) o[d] += w[j] * vh[j * p->Dv + d];
          }
        }
      }
    }
  }
  return 1;
}

/* Gradients (docs/CONTRACT.md section 7) from the forward's weights P (every row) and out O.
 * For each row i that is not padding (padding rows contribute nothing, whatever their dout):
 * D = dout_i . O_i, and for each key j with P_j != 0, dP_j = dout_i . v_j,
 * dS_j = P_j (dP_j - D), dT_j = dS_j (1 - tanh^2(T_j / c)) under a softcap (T_j = scale q_i . k_j);
 * dq_i += scale dT_j k_j, dk_j += scale dT_j q_i, dv_j += P_j dout_i, dbias += dS_j at the bias
 * element the score read. Keys with P_j = 0 (not allowed, or a fully masked row) add exactly 0.
 * dq, dk, dv and dbias (NULL: not asked) start at 0; dout is in REAL. */
static void SDPA_BACKWARD(const problem* p, const REAL* weights, const REAL* out, const REAL* dout,
                          REAL* dq, REAL* dk, REAL* dv, REAL* dbias)
{
  const REAL* q = (const REAL*)p->q;
  const REAL* k = (const REAL*)p->k;
  const REAL* v = (const REAL*)p->v;
  const REAL scale = (REAL)p->scale, cap = (REAL)p->softcap;
  const int64_t group = p->Hq / p->Hkv;
  int64_t b, h, i, j, d;

  for (b = 0; b < p->B; ++b) {
    for (h = 0; h < p->Hq; ++h) {
      const int64_t kv = (b * p->Hkv + h / group) * p->Nk;
      const REAL* kh = k + kv * p->Dk;
      const REAL* vh = v + kv * p->Dv;
      REAL* dkh = dk + kv * p->Dk;
      REAL* dvh = dv + kv * p->Dv;
      for (i = 0; i < p->Nq; ++i) {
        const int64_t row = (b * p->Hq + h) * p->Nq + i;
        const REAL *w = weights + row * p->Nk, *o = out + row * p->Dv;
        const REAL *di = dout + row * p->Dv, *qi = q + row * p->Dk;
        REAL* dqi = dq + row * p->Dk;
        REAL D = 0;
        if (padding_row(p, b, i)) continue;
        for (d = 0; d < p->Dv; ++d) D += di[d] * o[d];
        for (j = 0; j < p->Nk; ++j) {
          REAL dp = 0, ds;
          if (w[j] == 0) continue;
          for (d = 0; d < p->Dv; ++d) dp += di[d] * vh[j * p->Dv + d];
          ds = w[j] * (dp - D);
          if (dbias) dbias[offset4(p->bias_stride, b, h, i, j)] += ds;
          if (cap != 0) {
            REAL t = 0;
            for (d = 0; d < p->Dk; ++d) t += qi[d] * kh[j * p->Dk + d];
            t = tanh(scale * t / cap);
            ds *= 1 - t * t;
          }
          for (d = 0; d < p->Dk; ++d) {
            dqi[d] += scale * ds * kh[j * p->Dk + d];
            dkh[j * p->Dk + d] += scale * ds * qi[d];
          }
          for (d = 0; d < p->Dv; ++d) dvh[j * p->Dv + d] += w[j] * di[d];
        }
      }
    }
  }
}
