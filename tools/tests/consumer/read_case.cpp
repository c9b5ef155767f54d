// Reads a case file through the installed format library and prints what it holds.
#include <cstdio>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/version.hpp"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  try {
    const attnoracle::Case c = attnoracle::read_case(argv[1]);
    std::printf("%s: %s B=%lld Hq=%lld Nq=%lld Nk=%lld\n", attnoracle::kNameAndVersion,
                std::string(attnoracle::kind_name(c.kind)).c_str(), static_cast<long long>(c.B),
                static_cast<long long>(c.Hq), static_cast<long long>(c.Nq), static_cast<long long>(c.Nk));
  } catch (const attnoracle::InputError& e) {
    std::fprintf(stderr, "%s\n", e.message().c_str());
    return 2;
  }
  return 0;
}
