// libFuzzer: the manifest reader on arbitrary text: a result, a problem, or InputError.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/manifest.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string problem;
  try {
    const attnoracle::vectors::Manifest m = attnoracle::vectors::parse_manifest("manifest.json", text, problem);
    if (problem.empty()) (void)attnoracle::vectors::manifest_text(m);
  } catch (const attnoracle::InputError&) {
  }
  return 0;
}
