// Shared pieces of the attnoracle command: each subcommand registers itself on the app and
// returns how to run it; main turns InputError into the one-line refusal with status 2.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

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
// Prints an oracle report for `file` on stderr ("attnoracle: invariant violated: ...").
void print_violations(const std::string& file, const oracle::InvariantViolation& e);

}  // namespace attnoracle::cli
