/* AttnOracle plugin ABI, version 1: an attention implementation in a shared library, run
 * in-process by `attnoracle run DIR --plugin LIB` (C99 and C++, no dependencies).
 *
 * The runner starts `attnoracle plugin-host LIB JOBS` (a process of its own, so that a crash in
 * the plugin fails the case instead of the runner). The host dlopens LIB, checks
 * attnoracle_plugin_abi() == ATTNORACLE_PLUGIN_ABI (else: one line on stderr, exit status 2,
 * nothing written), then for every job reads the case file and calls attnoracle_plugin_run()
 * once, from one thread, one case after the other. What the tensors and metadata mean is in
 * docs/CONTRACT.md (sections 1 and 2) and vectors/FORMAT.md.
 *
 * Ownership: everything the host passes (the case, its tensors, strings, shapes and data) is
 * read-only and valid only during the call; copy what you keep. Everything the plugin passes to
 * the sink is copied by the host before emit() returns; the plugin keeps ownership and may free
 * or reuse it right after. The plugin never frees what the host owns, and the host never frees
 * what the plugin owns. */
#ifndef ATTNORACLE_PLUGIN_H
#define ATTNORACLE_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#define ATTNORACLE_PLUGIN_ABI 1

/* Marks the three entry points as exported, also under -fvisibility=hidden. */
#if defined(_WIN32)
#define ATTNORACLE_PLUGIN_EXPORT __declspec(dllexport)
#elif defined(__GNUC__)
#define ATTNORACLE_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define ATTNORACLE_PLUGIN_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* One tensor, in the case (host to plugin) or in the result (plugin to host). */
typedef struct attnoracle_tensor {
  const char* name;      /* NUL-terminated: "q", "k", "v", "mask", "dout", ...; "out", "weights",
                            "lse", "dq", ... */
  const char* dtype;     /* safetensors dtype name: "F64", "F32", "F16", "BF16", "BOOL", ... */
  int32_t ndim;          /* number of dimensions, 0 to 16 (0: a scalar of one element) */
  const int64_t* shape;  /* ndim sizes, each >= 0; may be NULL when ndim == 0 */
  const void* data;      /* row-major little-endian elements (BF16: upper half of an F32;
                            BOOL: one byte, 0 or 1); may be NULL when nbytes == 0; the host's
                            are aligned to 16 bytes, the plugin's need no alignment */
  uint64_t nbytes;       /* byte size: product of shape times the dtype's element size */
} attnoracle_tensor;

/* One `__metadata__` entry: "attn.causal" -> "top_left", say. Keys are unique. */
typedef struct attnoracle_kv {
  const char* key;    /* NUL-terminated */
  const char* value;  /* NUL-terminated */
} attnoracle_kv;

/* One case: the input tensors and metadata of a case file (golden tensors, attn.reference and
 * attn.undecided, which an evaluated file holds, are left out). */
typedef struct attnoracle_case {
  const char* id;                   /* the job's id, for messages */
  const attnoracle_tensor* tensors; /* num_tensors tensors, sorted by name */
  size_t num_tensors;
  const attnoracle_kv* metadata;    /* num_metadata entries, sorted by key */
  size_t num_metadata;
} attnoracle_case;

/* Where results go. The plugin calls emit(ctx, &t) once per output tensor attn.outputs names
 * ("out", "weights", "lse", "scores", and the gradients "dq", "dk", "dv", "dbias", shaped as q,
 * k, v and bias: docs/CONTRACT.md section 7), each in its dtype: its entry in the metadata key
 * attn.output_dtypes ("lse:F32", say) when it has one, else attn.output_dtype (else the input
 * dtype). A plugin that does not read attn.output_dtypes returns ATTNORACLE_UNSUPPORTED naming
 * it when a case holds it, as for any metadata key it does not know (ABI 1 unchanged).
 * emit returns 0 when the tensor is taken, nonzero when it is rejected (unknown dtype, nbytes
 * not matching the shape, NULL name or data, a name given twice): the case then fails with a
 * message naming the problem, whatever the plugin returns. Tensors emitted are written only
 * when the plugin returns ATTNORACLE_OK; otherwise they are dropped. */
typedef struct attnoracle_sink {
  void* ctx;  /* the host's; pass it back unchanged */
  int (*emit)(void* ctx, const attnoracle_tensor* tensor);
} attnoracle_sink;

/* What attnoracle_plugin_run returns. */
typedef enum attnoracle_status {
  ATTNORACLE_OK = 0,          /* results emitted; written as the job's output file */
  ATTNORACLE_REFUSED = 1,     /* the case is refused (a fully masked row under attn.masked_rows
                                 = error, say): the message goes to `<output>.error` */
  ATTNORACLE_UNSUPPORTED = 2, /* a feature or dtype the plugin does not do: the message names it
                                 and goes to `<output>.unsupported` (the case is skipped) */
  ATTNORACLE_FAILED = 3       /* anything else that went wrong: the message goes to
                                 `<output>.error` (the case fails) */
} attnoracle_status;

/* The three entry points a plugin exports (C linkage). */

/* Returns ATTNORACLE_PLUGIN_ABI as the plugin was compiled. */
ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_abi(void);

/* A NUL-terminated name for reports ("naive-c 1.0"), static storage. */
ATTNORACLE_PLUGIN_EXPORT const char* attnoracle_plugin_name(void);

/* Evaluates one case. `message` is a host buffer of `message_size` bytes (at least 256), set to
 * "" before the call: write a NUL-terminated UTF-8 line there for REFUSED, UNSUPPORTED and
 * FAILED (longer text is cut at message_size - 1 bytes). Returns an attnoracle_status value.
 * It must not throw (C++: catch everything and return ATTNORACLE_FAILED). */
ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size);

/* The entry points' types, for hosts that look them up with dlsym. */
typedef int (*attnoracle_plugin_abi_fn)(void);
typedef const char* (*attnoracle_plugin_name_fn)(void);
typedef int (*attnoracle_plugin_run_fn)(const attnoracle_case*, const attnoracle_sink*, char*,
                                        size_t);

#ifdef __cplusplus
}
#endif

#endif /* ATTNORACLE_PLUGIN_H */
