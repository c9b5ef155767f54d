// libFuzzer: the suite spec reader (what `attnoracle gen SPEC` parses and expands) on arbitrary
// text: a suite, or InputError (one line), never a crash, a hang, or another exception.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/vectors/suite.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const attnoracle::vectors::Suite s = attnoracle::vectors::parse_suite("suite.json", text);
    for (const auto& c : s.cases) (void)attnoracle::vectors::option_tags(c.problem);
  } catch (const attnoracle::InputError& e) {
    if (e.message().find('\n') != std::string::npos) __builtin_trap();  // one line only
  }
  return 0;
}
