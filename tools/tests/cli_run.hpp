// Running the attnoracle binary from end-to-end tests, and small file helpers (on the include
// path of every test target).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

extern char** environ;

namespace attnoracle::testing {

namespace fs = std::filesystem;

struct CliResult {
  int status = -1;  // exit status, or -1 if killed by a signal
  std::string out, err;
};

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(s.data(), static_cast<long>(s.size()));
}

inline void write_bytes(const fs::path& p, const std::vector<unsigned char>& b) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<long>(b.size()));
}

// A temporary directory, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "attnoracle-test-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& s) const { return path_ / s; }

 private:
  fs::path path_;
};

// Runs `attnoracle args...` with stdin closed, capturing stdout and stderr through files.
inline CliResult run_cli(const std::vector<std::string>& args) {
  TempDir io;
  const std::string out_path = io / "stdout", err_path = io / "stderr";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  std::vector<std::string> all = {ATTNORACLE_CLI};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, ATTNORACLE_CLI, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  CliResult r;
  if (spawned != 0) {
    ADD_FAILURE() << "cannot run " << ATTNORACLE_CLI << ": " << std::strerror(spawned);
    return r;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out_path);
  r.err = read_text(err_path);
  return r;
}

// Every regular file under `dir`, by relative path, with its bytes; not a vector set's stamp of
// verified files (.attnoracle-verified: the identities of this copy's files, not its content).
inline std::map<std::string, std::string> tree(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename() != ".attnoracle-verified")
      files[fs::relative(e.path(), dir).string()] = read_text(e.path());
  return files;
}

// Names of the files that differ between two trees (present in one only, or different bytes).
inline std::vector<std::string> differences(const std::map<std::string, std::string>& a,
                                            const std::map<std::string, std::string>& b) {
  std::vector<std::string> d;
  for (const auto& [name, bytes] : a)
    if (!b.count(name) || b.at(name) != bytes) d.push_back(name);
  for (const auto& [name, bytes] : b)
    if (!a.count(name)) d.push_back(name);
  return d;
}

}  // namespace attnoracle::testing
