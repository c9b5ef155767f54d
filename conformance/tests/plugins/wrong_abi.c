/* A plugin built against a future ABI, for conformance/tests/plugin_test.cpp: the host must
 * refuse to load it. */
#include "attnoracle/plugin.h"

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_abi(void) { return ATTNORACLE_PLUGIN_ABI + 1; }

ATTNORACLE_PLUGIN_EXPORT const char* attnoracle_plugin_name(void) { return "wrong-abi"; }

ATTNORACLE_PLUGIN_EXPORT int attnoracle_plugin_run(const attnoracle_case* c,
                                                   const attnoracle_sink* sink, char* message,
                                                   size_t message_size)
{
  (void)c, (void)sink, (void)message, (void)message_size;
  return ATTNORACLE_OK;
}
