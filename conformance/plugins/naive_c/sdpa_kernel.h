/* The attention kernel, written once for both precisions: attention.c includes this file twice,
 * with REAL defined as float (SDPA sdpa_f32) and as double (SDPA sdpa_f64). <tgmath.h> picks
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
          int padding = (p->query_mask && !p->query_mask[b * p->Nq + i]) || i >= len_q(p, b);
          if (!p->zero_rows && !padding) {
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
