// The host of in-process implementations (plugin.h): `attnoracle plugin-host LIB JOBS`, which
// `attnoracle run DIR --plugin LIB` runs through the adapter protocol (CONTRACT section 5).
#pragma once

#include <string>

namespace attnoracle::conformance {

// Loads `lib` (dlopen, RTLD_NOW | RTLD_LOCAL), checks that it exports the three entry points and
// speaks ATTNORACLE_PLUGIN_ABI, then works through the jobs file: for each job it reads the case
// file, calls the plugin once and writes exactly one of `output` (the tensors emitted),
// `output.error` (refused, failed, unreadable case, or a bad tensor emitted: the text says which)
// and `output.unsupported`. Returns 0 once the list is done. Returns 2 after one line on stderr
// ("attnoracle: error: ...") and without writing anything when the library cannot be loaded, is
// not a plugin, speaks another ABI version, or the jobs file cannot be read. A crash in the
// plugin takes the process down: run_adapter reports the jobs left without output as crashed;
// the gate (GateOptions::restart_after_crash, set for `run --plugin`) fails the first of them, the
// job the host was on, and starts the host again on the jobs after it.
int plugin_host_main(const std::string& lib, const std::string& jobs_path);

}  // namespace attnoracle::conformance
