/* A plugin that misbehaves on purpose, for conformance/tests/plugin_test.cpp: the case's
 * metadata key `test.mode` says how. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "attnoracle/plugin.h"

static const float kOut[6] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 2.5f};
static const int64_t kShape[2] = {2, 3};

static const char* mode_of(const attnoracle_case* c)
{
  size_t m;
  for (m = 0; m < c->num_metadata; ++m)
    if (!strcmp(c->metadata[m].key, "test.mode")) return c->metadata[m].value;
  return "ok";
}

/* Emits `out`, F32 [2, 3], with the given dtype, byte size and shape. */
static int emit_out(const attnoracle_sink* sink, const char* dtype, uint64_t nbytes,
                    const int64_t* shape)
{
  attnoracle_tensor t;
  t.name = "out";
  t.dtype = dtype;
  t.ndim = 2;
  t.shape = shape;
  t.data = kOut;
  t.nbytes = nbytes;
  return sink->emit(sink->ctx, &t);
}

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_abi(void) { return ATTNORACLE_PLUGIN_ABI; }

ATTNORACLE_PLUGIN_EXPORT const char* attnoracle_plugin_name(void) { return "misbehave"; }

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size)
{
  static const int64_t negative[2] = {2, -3};
  const char* mode = mode_of(c);
  if (!strcmp(mode, "ok")) {
    return emit_out(sink, "F32", sizeof kOut, kShape) ? ATTNORACLE_FAILED : ATTNORACLE_OK;
  } else if (!strcmp(mode, "segv")) {
    int* volatile nowhere = NULL;
    *nowhere = 1;
    raise(SIGSEGV); /* should the store not fault */
  } else if (!strcmp(mode, "bad_size")) {
    emit_out(sink, "F32", 20, kShape);
  } else if (!strcmp(mode, "bad_dtype")) {
    emit_out(sink, "F33", sizeof kOut, kShape);
  } else if (!strcmp(mode, "negative_dim")) {
    emit_out(sink, "F32", sizeof kOut, negative);
  } else if (!strcmp(mode, "twice")) {
    emit_out(sink, "F32", sizeof kOut, kShape);
    emit_out(sink, "F32", sizeof kOut, kShape);
  } else if (!strcmp(mode, "unsupported")) {
    snprintf(message, message_size, "feature X is not supported");
    return ATTNORACLE_UNSUPPORTED;
  } else if (!strcmp(mode, "refused")) {
    emit_out(sink, "F32", sizeof kOut, kShape); /* dropped: the case is refused */
    snprintf(message, message_size, "fully masked row: b=0, h=0, i=1");
    return ATTNORACLE_REFUSED;
  } else if (!strcmp(mode, "failed")) {
    snprintf(message, message_size, "out of luck");
    return ATTNORACLE_FAILED;
  } else if (!strcmp(mode, "status_99")) {
    return 99;
  }
  return ATTNORACLE_OK;
}
