#include "cli.hpp"

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>

#include "attnoracle/reference/error.hpp"

namespace attnoracle::cli {

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void require_parent_dir(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent))
    throw InputError(path, "", "directory " + parent.string() + " does not exist");
}

void print_violations(const std::string& file, const oracle::InvariantViolation& e) {
  const auto& v = e.violations();
  std::cerr << "attnoracle: invariant violated: " << file << ": " << v.size() << " violation"
            << (v.size() == 1 ? "" : "s") << "; nothing written\n";
  for (std::size_t k = 0; k < v.size() && k < 20; ++k) std::cerr << "  " << v[k].message() << "\n";
  if (v.size() > 20) std::cerr << "  ... and " << v.size() - 20 << " more\n";
  std::cerr.flush();
}

std::string make_temp_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr)
    throw InputError(tmpl, "", std::string("cannot create a temporary directory: ") + std::strerror(errno));
  return tmpl;
}

TempDirGuard::~TempDirGuard() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace attnoracle::cli
