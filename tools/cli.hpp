// Shared pieces of the attnoracle command: each subcommand registers itself on the app and
// returns how to run it; main turns InputError into the one-line refusal with status 2.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
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
Command add_report(CLI::App& app);
Command add_merge(CLI::App& app);
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

// --progress and --no-progress of a subcommand.
struct ProgressFlags {
  bool on = false, off = false;
  void add(CLI::App* sub);
  // Forced by a flag; otherwise when stderr is a terminal and CI is not set in the environment.
  bool wanted() const;
};

// One line on stderr, rewritten in place with \r: what, done / total units, the time elapsed and
// an estimate of the time left (from the rate of the current unit). Redrawn at most ten times
// a second and at the last unit; nothing at all unless shown. One update at a time (a lock).
class Progress {
 public:
  Progress(std::string what, bool shown);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  bool shown() const { return shown_; }
  void update(std::size_t done, std::size_t total, const std::string& unit = "cases");
  // Erases the line (the next update draws it again), e.g. before another message.
  void clear();

 private:
  using Clock = std::chrono::steady_clock;
  void erase_locked();
  std::string what_, unit_;
  bool shown_;
  std::mutex m_;
  Clock::time_point start_, unit_start_, drawn_;
  std::size_t unit_done0_ = 0, width_ = 0;  // done at the unit's first update; the line's length
  bool any_drawn_ = false;
};

}  // namespace attnoracle::cli
