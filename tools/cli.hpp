// Shared pieces of the attnoracle command: each subcommand registers itself on the app and
// returns how to run it; main turns InputError into the one-line refusal with status 2.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <utility>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // the exit status; may throw InputError
};

Command add_eval(CLI::App& app);
Command add_gen(CLI::App& app);
Command add_verify(CLI::App& app);
Command add_invariants(CLI::App& app);
Command add_run(CLI::App& app);
Command add_check(CLI::App& app);
Command add_plugin_host(CLI::App& app);

int default_threads();
// Refuses (InputError) when the directory that would hold `path` does not exist.
void require_parent_dir(const std::string& path);
// A fresh directory PREFIX-XXXXXX in the temporary directory, made with mkdtemp (a name no one
// can plant beforehand); InputError when it cannot be made.
std::string make_temp_dir(const std::string& prefix);
// Removes a temporary directory when it goes out of scope, on every path out (an exception
// included), unless release() was called. Best effort: what a leftover process still writes
// into cannot fail the command.
class TempDirGuard {
 public:
  explicit TempDirGuard(std::string path) : path_(std::move(path)) {}
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  ~TempDirGuard();
  void release() { path_.clear(); }

 private:
  std::string path_;
};
// Prints an oracle report for `file` on stderr ("attnoracle: invariant violated: ...").
void print_violations(const std::string& file, const oracle::InvariantViolation& e);

}  // namespace attnoracle::cli
