// libFuzzer: the safetensors reader and the case validator on arbitrary bytes. Bad input must
// end in InputError (one line), never in a crash, a hang, or another exception.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<unsigned char> bytes(data, data + size);
  try {
    attnoracle::SafeTensorsFile f = attnoracle::parse_safetensors("fuzz.safetensors", bytes);
    const attnoracle::Case c = attnoracle::case_from_file("fuzz.safetensors", std::move(f));
    (void)c.first_refused_row();  // the case's rules on whatever shapes were accepted
    (void)c.golden_tensors();
  } catch (const attnoracle::InputError& e) {
    if (e.message().find('\n') != std::string::npos) __builtin_trap();  // one line only
  }
  return 0;
}
