/* A plugin that misbehaves on purpose, for conformance/tests/plugin_test.cpp: the case's
 * metadata key `test.mode` says how.
 *
 * For conformance/tests/gate_test.cpp, a crash on one case of a vector set: with the environment
 * variable ATTNORACLE_TEST_DELEGATE naming a plugin library, every case is handed to that plugin,
 * except the case whose id is ATTNORACLE_TEST_CRASH_ON, on which this one dies of SIGSEGV (of
 * abort() when ATTNORACLE_TEST_CRASH_HOW is "abort"). */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
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

static void crash(void)
{
  int* volatile nowhere = NULL;
  *nowhere = 1;
  raise(SIGSEGV); /* should the store not fault */
}

/* The delegate's run function, or NULL when ATTNORACLE_TEST_DELEGATE is not set. */
static attnoracle_plugin_run_fn delegate(void)
{
  static attnoracle_plugin_run_fn run = NULL;
  static int loaded = 0;
  if (!loaded) {
    const char* lib = getenv("ATTNORACLE_TEST_DELEGATE");
    void* handle = lib && *lib ? dlopen(lib, RTLD_NOW | RTLD_LOCAL) : NULL;
    void* symbol = handle ? dlsym(handle, "attnoracle_plugin_run") : NULL;
    /* POSIX: a data pointer from dlsym converts to a function pointer. */
    if (symbol) memcpy(&run, &symbol, sizeof run);
    loaded = 1;
  }
  return run;
}

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size)
{
  static const int64_t negative[2] = {2, -3};
  const char* mode = mode_of(c);
  const attnoracle_plugin_run_fn other = delegate();
  if (other) {
    const char* crash_on = getenv("ATTNORACLE_TEST_CRASH_ON");
    const char* how = getenv("ATTNORACLE_TEST_CRASH_HOW");
    if (crash_on && c->id && !strcmp(crash_on, c->id)) {
      if (how && !strcmp(how, "abort")) abort();
      crash();
    }
    return other(c, sink, message, message_size);
  }
  if (!strcmp(mode, "ok")) {
    return emit_out(sink, "F32", sizeof kOut, kShape) ? ATTNORACLE_FAILED : ATTNORACLE_OK;
  } else if (!strcmp(mode, "segv")) {
    crash();
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
