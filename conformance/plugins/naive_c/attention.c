/* Naive scaled dot-product attention in plain C99: the example of AttnOracle's C plugin ABI
 * (conformance/include/attnoracle/plugin.h).
 *
 *     attnoracle run DIR --plugin build/plugins/libattnoracle_naive_c.so --profile fp32
 *
 * Kind sdpa with everything a case can ask for: scale, softcap, bias, a broadcast boolean mask,
 * causal (top_left and bottom_right), window, GQA/MQA, query_mask, sequence lengths (seqlens_q,
 * seqlens_k, I32 or I64, bottom_right aligned per batch), fully masked rows (refused
 * under attn.masked_rows=error, zeros and lse -inf under zero; padding rows never refused), and
 * the optional weights and lse, and the gradients dq, dk, dv and dbias given dout. F32 inputs
 * are computed in float, F64 inputs in double; results are rounded once, to nearest-even, into
 * the output dtype (F64, F32, F16 or BF16). Kind mha and F16 or BF16 inputs are reported as
 * unsupported. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include "attnoracle/plugin.h"

enum { CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT };
enum { OUT_F64, OUT_F32, OUT_F16, OUT_BF16 };
static const char* const kOutNames[] = {"F64", "F32", "F16", "BF16"};
static const unsigned kOutSizes[] = {8, 4, 2, 2};

/* One sdpa problem, read from the case. Strides are in elements, over [B, Hq, Nq, Nk]
 * (0 along a broadcast dimension). */
typedef struct problem {
  int64_t B, Hq, Hkv, Nq, Nk, Dk, Dv;
  int f64;                          /* inputs are F64 (else F32) */
  const void *q, *k, *v;
  double scale, softcap;            /* softcap 0: off */
  int causal;                       /* CAUSAL_* */
  int window;                       /* a window is set */
  int64_t left, right;
  int zero_rows;                    /* attn.masked_rows=zero */
  int want_out, want_weights, want_lse;
  int want_dq, want_dk, want_dv, want_dbias;
  const void* dout;                 /* [B, Hq, Nq, Dv], NULL: no gradient asked */
  int dout_f64;
  int out_dtype;                    /* OUT_* */
  const char* output_dtypes;        /* attn.output_dtypes (name:DTYPE,...), "" when absent */
  const unsigned char* mask;        /* NULL: no mask */
  int64_t mask_stride[4];
  const void* bias;                 /* NULL: no bias */
  int bias_f64;
  int64_t bias_stride[4];
  int32_t bias_ndim;
  const int64_t* bias_shape;
  const unsigned char* query_mask;  /* [B, Nq], NULL: every row is a query */
  const void *seqlens_q, *seqlens_k; /* [B], NULL: Nq and Nk */
  int seqlens_q_i64, seqlens_k_i64;
} problem;

/* Element b of an I32 or I64 tensor [B]. */
static int64_t length_at(const void* data, int i64, int64_t b)
{
  return i64 ? ((const int64_t*)data)[b] : ((const int32_t*)data)[b];
}

/* The valid query and key counts of batch b. */
static int64_t len_q(const struct problem* p, int64_t b)
{
  return p->seqlens_q ? length_at(p->seqlens_q, p->seqlens_q_i64, b) : p->Nq;
}
static int64_t len_k(const struct problem* p, int64_t b)
{
  return p->seqlens_k ? length_at(p->seqlens_k, p->seqlens_k_i64, b) : p->Nk;
}

static int64_t offset4(const int64_t stride[4], int64_t b, int64_t h, int64_t i, int64_t j)
{
  return b * stride[0] + h * stride[1] + i * stride[2] + j * stride[3];
}

static double bias_at(const problem* p, int64_t b, int64_t h, int64_t i, int64_t j)
{
  int64_t at = offset4(p->bias_stride, b, h, i, j);
  return p->bias_f64 ? ((const double*)p->bias)[at] : ((const float*)p->bias)[at];
}

/* allowed(i, j) = j < seqlens_k and mask and causal and window and bias != -inf (CONTRACT
 * section 1). */
static unsigned char key_allowed(const problem* p, int64_t b, int64_t h, int64_t i, int64_t j)
{
  /* i': the row's position among the keys, for causal and window alike. */
  int64_t ii = i + (p->causal == CAUSAL_BOTTOM_RIGHT ? len_k(p, b) - len_q(p, b) : 0);
  if (j >= len_k(p, b)) return 0;
  if (p->mask && !p->mask[offset4(p->mask_stride, b, h, i, j)]) return 0;
  if (p->causal != CAUSAL_NONE && j > ii) return 0;
  if (p->window && (j < ii - p->left || j > ii + p->right)) return 0;
  if (p->bias && bias_at(p, b, h, i, j) == -INFINITY) return 0;
  return 1;
}

/* Whether row i of batch b is padding (query_mask false, or i >= seqlens_q). */
static int padding_row(const problem* p, int64_t b, int64_t i)
{
  return (p->query_mask && !p->query_mask[b * p->Nq + i]) || i >= len_q(p, b);
}

#define REAL float
#define SDPA sdpa_f32
#define SDPA_BACKWARD sdpa_backward_f32
#include "sdpa_kernel.h"
#undef REAL
#undef SDPA
#undef SDPA_BACKWARD
#define REAL double
#define SDPA sdpa_f64
#define SDPA_BACKWARD sdpa_backward_f64
#include "sdpa_kernel.h"
#undef REAL
#undef SDPA
#undef SDPA_BACKWARD

/* ---- Reading the case ---- */

static const attnoracle_tensor* find_tensor(const attnoracle_case* c, const char* name)
{
  size_t t;
  for (t = 0; t < c->num_tensors; ++t)
    if (strcmp(c->tensors[t].name, name) == 0) return &c->tensors[t];
  return NULL;
}

static const char* find_meta(const attnoracle_case* c, const char* key, const char* fallback)
{
  size_t m;
  for (m = 0; m < c->num_metadata; ++m)
    if (strcmp(c->metadata[m].key, key) == 0) return c->metadata[m].value;
  return fallback;
}

/* A finite number, decimal or C hex float (strtod reads both). */
static int parse_number(const char* text, double* value)
{
  char* end;
  *value = strtod(text, &end);
  return end != text && *end == '\0' && isfinite(*value);
}

/* Strides of t broadcast against [B, Hq, Nq, Nk], numpy style (aligned on the right, each
 * dimension 1 or full). Returns 0 when it does not broadcast. */
static int broadcast(const attnoracle_tensor* t, const int64_t full[4], int64_t stride[4])
{
  int64_t step = 1;
  int a;
  if (t->ndim < 0 || t->ndim > 4) return 0; /* rank 0: one value for all */
  for (a = 3; a >= 0; --a) {
    int64_t n = a >= 4 - t->ndim ? t->shape[a - (4 - t->ndim)] : 1;
    if (n != 1 && n != full[a]) return 0;
    stride[a] = n == 1 ? 0 : step;
    step *= n;
  }
  return 1;
}

static int is_f32_or_f64(const char* dtype)
{
  return !strcmp(dtype, "F32") || !strcmp(dtype, "F64");
}

/* Status and message in one go. */
static int say(int status, char* message, size_t size, const char* what, const char* detail)
{
  snprintf(message, size, "%s%s", what, detail);
  return status;
}

static int unsupported(char* message, size_t size, const char* what, const char* detail)
{
  return say(ATTNORACLE_UNSUPPORTED, message, size, what, detail);
}

static int bad_case(char* message, size_t size, const char* detail)
{
  return say(ATTNORACLE_FAILED, message, size, "bad case: ", detail);
}

/* Fills p from the case; on anything it cannot take, returns the status with a message. */
static int read_problem(const attnoracle_case* c, problem* p, char* msg, size_t size)
{
  static const char* known[] = {"attn.format", "attn.kind", "attn.scale", "attn.causal",
                                "attn.window", "attn.softcap", "attn.masked_rows",
                                "attn.output_dtype", "attn.output_dtypes", "attn.outputs"};
  const attnoracle_tensor *q, *k, *v, *mask, *bias, *qmask;
  const char *causal, *window, *rows, *out_dtype, *outputs;
  size_t m, n, t;
  int64_t full[4];

  for (m = 0; m < c->num_metadata; ++m) {
    const char* key = c->metadata[m].key;
    int ok = strncmp(key, "attn.", 5) != 0;
    for (n = 0; n < sizeof known / sizeof known[0]; ++n) ok = ok || !strcmp(key, known[n]);
    if (!ok) return unsupported(msg, size, "metadata key ", key);
  }
  if (strcmp(find_meta(c, "attn.format", ""), "1") != 0)
    return unsupported(msg, size, "attn.format ", find_meta(c, "attn.format", "(none)"));
  if (strcmp(find_meta(c, "attn.kind", "sdpa"), "sdpa") != 0)
    return unsupported(msg, size, "attn.kind ", find_meta(c, "attn.kind", ""));
  for (t = 0; t < c->num_tensors; ++t) {
    const char* name = c->tensors[t].name;
    if (strcmp(name, "q") && strcmp(name, "k") && strcmp(name, "v") && strcmp(name, "mask") &&
        strcmp(name, "bias") && strcmp(name, "query_mask") && strcmp(name, "seqlens_q") &&
        strcmp(name, "seqlens_k") && strcmp(name, "dout"))
      return unsupported(msg, size, "tensor ", name);
  }

  /* q [B, Hq, Nq, Dk], k [B, Hkv, Nk, Dk], v [B, Hkv, Nk, Dv], one dtype. */
  q = find_tensor(c, "q");
  k = find_tensor(c, "k");
  v = find_tensor(c, "v");
  if (!q || !k || !v) return bad_case(msg, size, "q, k or v missing");
  if (!is_f32_or_f64(q->dtype)) return unsupported(msg, size, "input dtype ", q->dtype);
  if (strcmp(k->dtype, q->dtype) || strcmp(v->dtype, q->dtype))
    return bad_case(msg, size, "q, k and v differ in dtype");
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
    return bad_case(msg, size, "q, k and v must have 4 dimensions");
  p->B = q->shape[0], p->Hq = q->shape[1], p->Nq = q->shape[2], p->Dk = q->shape[3];
  p->Hkv = k->shape[1], p->Nk = k->shape[2], p->Dv = v->shape[3];
  if (k->shape[0] != p->B || k->shape[3] != p->Dk || v->shape[0] != p->B ||
      v->shape[1] != p->Hkv || v->shape[2] != p->Nk || p->Hkv < 1 || p->Hq % p->Hkv != 0 ||
      p->Nq < 1 || p->Nk < 1 || p->Dk < 1)
    return bad_case(msg, size, "shapes of q, k and v do not agree");
  p->f64 = !strcmp(q->dtype, "F64");
  p->q = q->data, p->k = k->data, p->v = v->data;
  full[0] = p->B, full[1] = p->Hq, full[2] = p->Nq, full[3] = p->Nk;

  /* Optional tensors. */
  mask = find_tensor(c, "mask");
  if (mask) {
    if (strcmp(mask->dtype, "BOOL") || !broadcast(mask, full, p->mask_stride))
      return bad_case(msg, size, "mask does not broadcast");
    p->mask = (const unsigned char*)mask->data;
  }
  bias = find_tensor(c, "bias");
  if (bias) {
    if (!is_f32_or_f64(bias->dtype)) return unsupported(msg, size, "bias dtype ", bias->dtype);
    if (!broadcast(bias, full, p->bias_stride))
      return bad_case(msg, size, "bias does not broadcast");
    p->bias = bias->data;
    p->bias_f64 = !strcmp(bias->dtype, "F64");
    p->bias_ndim = bias->ndim;
    p->bias_shape = bias->shape;
  }
  qmask = find_tensor(c, "query_mask");
  if (qmask) {
    if (strcmp(qmask->dtype, "BOOL") || qmask->ndim != 2 || qmask->shape[0] != p->B ||
        qmask->shape[1] != p->Nq)
      return bad_case(msg, size, "query_mask is not BOOL [B, Nq]");
    p->query_mask = (const unsigned char*)qmask->data;
  }
  for (t = 0; t < 2; ++t) {
    const attnoracle_tensor* s = find_tensor(c, t ? "seqlens_k" : "seqlens_q");
    int i64;
    if (!s) continue;
    i64 = !strcmp(s->dtype, "I64");
    if ((!i64 && strcmp(s->dtype, "I32")) || s->ndim != 1 || s->shape[0] != p->B)
      return bad_case(msg, size, t ? "seqlens_k is not I32 or I64 [B]" : "seqlens_q is not I32 or I64 [B]");
    if (t) p->seqlens_k = s->data, p->seqlens_k_i64 = i64;
    else p->seqlens_q = s->data, p->seqlens_q_i64 = i64;
  }

  /* Metadata. */
  p->scale = 1 / sqrt((double)p->Dk);
  if (find_meta(c, "attn.scale", NULL) && !parse_number(find_meta(c, "attn.scale", ""), &p->scale))
    return say(ATTNORACLE_FAILED, msg, size, "bad attn.scale ", find_meta(c, "attn.scale", ""));
  if (!parse_number(find_meta(c, "attn.softcap", "0"), &p->softcap) || p->softcap < 0)
    return say(ATTNORACLE_FAILED, msg, size, "bad attn.softcap ", find_meta(c, "attn.softcap", ""));
  causal = find_meta(c, "attn.causal", "none");
  if (!strcmp(causal, "none")) p->causal = CAUSAL_NONE;
  else if (!strcmp(causal, "top_left")) p->causal = CAUSAL_TOP_LEFT;
  else if (!strcmp(causal, "bottom_right")) p->causal = CAUSAL_BOTTOM_RIGHT;
  else return unsupported(msg, size, "attn.causal ", causal);
  window = find_meta(c, "attn.window", "none");
  if (strcmp(window, "none") != 0) {
    long long left, right;
    char tail;
    if (sscanf(window, "%lld,%lld%c", &left, &right, &tail) != 2 || left < 0 || right < 0)
      return say(ATTNORACLE_FAILED, msg, size, "bad attn.window ", window);
    p->window = 1, p->left = left, p->right = right;
  }
  rows = find_meta(c, "attn.masked_rows", "error");
  if (strcmp(rows, "error") && strcmp(rows, "zero"))
    return unsupported(msg, size, "attn.masked_rows ", rows);
  p->zero_rows = !strcmp(rows, "zero");
  out_dtype = find_meta(c, "attn.output_dtype", q->dtype);
  for (p->out_dtype = 0; p->out_dtype < 4; ++p->out_dtype)
    if (!strcmp(out_dtype, kOutNames[p->out_dtype])) break;
  if (p->out_dtype == 4) return unsupported(msg, size, "output dtype ", out_dtype);
  p->output_dtypes = find_meta(c, "attn.output_dtypes", "");
  for (outputs = p->output_dtypes; *outputs;) {  /* each entry's dtype one of kOutNames */
    size_t len = strcspn(outputs, ","), colon = strcspn(outputs, ":");
    int listed = 0;
    for (n = 0; n < 4 && colon < len; ++n)
      listed = listed || (len - colon - 1 == strlen(kOutNames[n]) && !strncmp(outputs + colon + 1, kOutNames[n], len - colon - 1));
    if (!listed) return unsupported(msg, size, "attn.output_dtypes ", p->output_dtypes);
    outputs += len + (outputs[len] == ',');
  }

  /* attn.outputs: a comma list of out, weights, lse and the gradients dq, dk, dv, dbias. */
  outputs = find_meta(c, "attn.outputs", "out");
  while (*outputs) {
    size_t len = strcspn(outputs, ",");
    if (len == 3 && !strncmp(outputs, "out", 3)) p->want_out = 1;
    else if (len == 7 && !strncmp(outputs, "weights", 7)) p->want_weights = 1;
    else if (len == 3 && !strncmp(outputs, "lse", 3)) p->want_lse = 1;
    else if (len == 2 && !strncmp(outputs, "dq", 2)) p->want_dq = 1;
    else if (len == 2 && !strncmp(outputs, "dk", 2)) p->want_dk = 1;
    else if (len == 2 && !strncmp(outputs, "dv", 2)) p->want_dv = 1;
    else if (len == 5 && !strncmp(outputs, "dbias", 5)) p->want_dbias = 1;
    else return unsupported(msg, size, "attn.outputs ", find_meta(c, "attn.outputs", ""));
    outputs += len + (outputs[len] == ',');
  }
  if (p->want_dq || p->want_dk || p->want_dv || p->want_dbias) {
    const attnoracle_tensor* d = find_tensor(c, "dout");
    if (p->want_dbias && !p->bias) return bad_case(msg, size, "dbias asked for, but there is no bias");
    if (!d) return bad_case(msg, size, "gradients asked for, but dout is missing");
    if (!is_f32_or_f64(d->dtype)) return unsupported(msg, size, "dout dtype ", d->dtype);
    if (d->ndim != 4 || d->shape[0] != p->B || d->shape[1] != p->Hq || d->shape[2] != p->Nq ||
        d->shape[3] != p->Dv)
      return bad_case(msg, size, "dout is not shaped as out [B, Hq, Nq, Dv]");
    p->dout = d->data;
    p->dout_f64 = !strcmp(d->dtype, "F64");
  }
  return ATTNORACLE_OK;
}

/* ---- Results ---- */

/* IEEE binary16 bits of x, rounded to nearest-even (nearbyint in the default rounding mode). */
static uint16_t f16_bits(double x)
{
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double a = fabs(x), sig;
  int e;
  if (isnan(a)) return (uint16_t)(sign | 0x7e00);
  /* From halfway past the largest finite value: infinity. Below 2^-14: subnormal (or 2^-14). */
  if (a >= 65520.0) return (uint16_t)(sign | 0x7c00);
  if (a < 0x1p-14) return (uint16_t)(sign | (uint16_t)nearbyint(a * 0x1p24));
  a = frexp(a, &e); /* x = a * 2^e, 1/2 <= a < 1 */
  sig = nearbyint(a * 2048);
  if (sig == 2048) sig = 1024, ++e;
  return (uint16_t)(sign | (e + 14) << 10 | (uint16_t)(sig - 1024));
}

/* bfloat16 bits of x (the upper half of an F32), rounded to nearest-even. */
static uint16_t bf16_bits(double x)
{
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double a = fabs(x), sig;
  int e;
  if (isnan(a)) return (uint16_t)(sign | 0x7fc0);
  if (a >= 0x1.ffp127) return (uint16_t)(sign | 0x7f80);
  if (a < 0x1p-126) return (uint16_t)(sign | (uint16_t)nearbyint(a * 0x1p133));
  a = frexp(a, &e);
  sig = nearbyint(a * 256);
  if (sig == 256) sig = 128, ++e;
  return (uint16_t)(sign | (e + 126) << 7 | (uint16_t)(sig - 128));
}

/* The dtype of output `name` (OUT_*): its entry in attn.output_dtypes, else the output dtype. */
static int dtype_of(const problem* p, const char* name)
{
  const char* s = p->output_dtypes;
  size_t n = strlen(name);
  int d;
  while (*s) {
    size_t len = strcspn(s, ",");
    if (len > n && s[n] == ':' && !strncmp(s, name, n))
      for (d = 0; d < 4; ++d)
        if (len - n - 1 == strlen(kOutNames[d]) && !strncmp(s + n + 1, kOutNames[d], len - n - 1)) return d;
    s += len + (s[len] == ',');
  }
  return p->out_dtype;
}

/* Emits `count` values of the compute type, rounded to the output's dtype. */
static int emit(const attnoracle_sink* sink, const problem* p, const char* name, const void* values,
                int64_t count, int32_t ndim, const int64_t* shape)
{
  attnoracle_tensor t;
  void* converted = NULL;
  int64_t e;
  int rejected;
  const int dtype = dtype_of(p, name);
  if (dtype != (p->f64 ? OUT_F64 : OUT_F32)) {
    converted = malloc((size_t)count * kOutSizes[dtype] + 1);
    if (!converted) return -1;
    for (e = 0; e < count; ++e) {
      double x = p->f64 ? ((const double*)values)[e] : ((const float*)values)[e];
      switch (dtype) {
        case OUT_F64: ((double*)converted)[e] = x; break;
        case OUT_F32: ((float*)converted)[e] = (float)x; break;
        case OUT_F16: ((uint16_t*)converted)[e] = f16_bits(x); break;
        default: ((uint16_t*)converted)[e] = bf16_bits(x); break;
      }
    }
    values = converted;
  }
  t.name = name;
  t.dtype = kOutNames[dtype];
  t.ndim = ndim;
  t.shape = shape;
  t.data = values;
  t.nbytes = (uint64_t)count * kOutSizes[dtype];
  rejected = sink->emit(sink->ctx, &t);
  free(converted);
  return rejected;
}

/* ---- The three entry points ---- */

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_abi(void) { return ATTNORACLE_PLUGIN_ABI; }

ATTNORACLE_PLUGIN_EXPORT const char* attnoracle_plugin_name(void) { return "naive-c 1.0"; }

/* Values of an F32 or F64 tensor in the compute type (a new buffer), or NULL. */
static void* to_real(const problem* p, const void* data, int f64, int64_t count)
{
  void* r = malloc((size_t)count * (p->f64 ? sizeof(double) : sizeof(float)) + 1);
  int64_t e;
  if (!r) return NULL;
  for (e = 0; e < count; ++e) {
    double x = f64 ? ((const double*)data)[e] : ((const float*)data)[e];
    if (p->f64) ((double*)r)[e] = x;
    else ((float*)r)[e] = (float)x;
  }
  return r;
}

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size)
{
  problem p;
  int status, ok = 1, grads, e;
  size_t real = 0;
  int64_t rows, kv, nbias = 1, out_shape[4], weights_shape[4], q_shape[4], k_shape[4], v_shape[4];
  void *out = NULL, *weights = NULL, *lse = NULL;
  void *dout = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *dbias = NULL;
  unsigned char* allowed = NULL;

  memset(&p, 0, sizeof p);
  status = read_problem(c, &p, message, message_size);
  if (status != ATTNORACLE_OK) return status;

  /* Buffers in the compute type; weights are one row of scratch unless asked for (or needed by
   * the gradients, as out is). */
  grads = p.dout != NULL;
  real = p.f64 ? sizeof(double) : sizeof(float);
  rows = p.B * p.Hq * p.Nq;
  kv = p.B * p.Hkv * p.Nk;
  for (e = 0; p.bias && e < p.bias_ndim; ++e) nbias *= p.bias_shape[e];
  if (p.want_out || grads) out = malloc((size_t)(rows * p.Dv) * real);
  weights = malloc((size_t)((p.want_weights || grads ? rows : 1) * p.Nk) * real);
  if (p.want_lse) lse = malloc((size_t)rows * real);
  allowed = malloc((size_t)p.Nk);
  if (grads) {
    dout = to_real(&p, p.dout, p.dout_f64, rows * p.Dv);
    dq = calloc((size_t)(rows * p.Dk) + 1, real);
    dk = calloc((size_t)(kv * p.Dk) + 1, real);
    dv = calloc((size_t)(kv * p.Dv) + 1, real);
    if (p.want_dbias) dbias = calloc((size_t)nbias, real);
  }
  if (((p.want_out || grads) && !out) || !weights || (p.want_lse && !lse) || !allowed ||
      (grads && (!dout || !dq || !dk || !dv || (p.want_dbias && !dbias)))) {
    status = say(ATTNORACLE_FAILED, message, message_size, "out of memory", "");
    goto done;
  }

  if (p.f64)
    ok = sdpa_f64(&p, out, weights, p.want_weights || grads, lse, allowed, message, message_size);
  else
    ok = sdpa_f32(&p, out, weights, p.want_weights || grads, lse, allowed, message, message_size);
  if (!ok) {
    status = ATTNORACLE_REFUSED;
    goto done;
  }
  if (grads && p.f64)
    sdpa_backward_f64(&p, weights, out, dout, dq, dk, dv, dbias);
  else if (grads)
    sdpa_backward_f32(&p, weights, out, dout, dq, dk, dv, dbias);

  out_shape[0] = weights_shape[0] = q_shape[0] = k_shape[0] = v_shape[0] = p.B;
  out_shape[1] = weights_shape[1] = q_shape[1] = p.Hq;
  k_shape[1] = v_shape[1] = p.Hkv;
  out_shape[2] = weights_shape[2] = q_shape[2] = p.Nq;
  k_shape[2] = v_shape[2] = p.Nk;
  out_shape[3] = v_shape[3] = p.Dv;
  q_shape[3] = k_shape[3] = p.Dk;
  weights_shape[3] = p.Nk;
  if ((p.want_out && emit(sink, &p, "out", out, rows * p.Dv, 4, out_shape)) ||
      (p.want_weights && emit(sink, &p, "weights", weights, rows * p.Nk, 4, weights_shape)) ||
      (p.want_lse && emit(sink, &p, "lse", lse, rows, 3, out_shape)) ||
      (p.want_dq && emit(sink, &p, "dq", dq, rows * p.Dk, 4, q_shape)) ||
      (p.want_dk && emit(sink, &p, "dk", dk, kv * p.Dk, 4, k_shape)) ||
      (p.want_dv && emit(sink, &p, "dv", dv, kv * p.Dv, 4, v_shape)) ||
      (p.want_dbias && emit(sink, &p, "dbias", dbias, nbias, p.bias_ndim, p.bias_shape)))
    status = say(ATTNORACLE_FAILED, message, message_size, "a result was not taken", "");

done:
  free(out);
  free(weights);
  free(lse);
  free(allowed);
  free(dout);
  free(dq);
  free(dk);
  free(dv);
  free(dbias);
  return status;
}
