// libFuzzer: the profile reader (what `--profile FILE.json` loads: one profile, or a family of
// them for run and check) on arbitrary bytes: a profile set, or InputError (one line), never a
// crash, a hang, or another exception. The reader takes a path, so each input is written to a
// file of a private directory first.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/reference/error.hpp"

namespace {

const std::string& input_path() {
  static const std::string path = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/attnoracle_fuzz_profile.XXXXXX";
    if (!mkdtemp(dir.data())) __builtin_trap();
    return dir + "/profile.json";
  }();
  static const bool cleanup = std::atexit([] {
    std::remove(path.c_str());
    std::remove(path.substr(0, path.rfind('/')).c_str());
  }) == 0;
  (void)cleanup;
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = input_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) __builtin_trap();
  try {
    const attnoracle::conformance::ProfileSet set = attnoracle::conformance::load_profile_set(path);
    for (const auto& p : set.members) (void)p.covers(attnoracle::DType::F16);
    (void)attnoracle::conformance::profile_from_json(path);
  } catch (const attnoracle::InputError& e) {
    if (e.message().find('\n') != std::string::npos) __builtin_trap();  // one line only
  }
  return 0;
}
