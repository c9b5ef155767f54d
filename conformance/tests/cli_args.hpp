// The conformance tests' command lines: `attnoracle ARGS` through the shared runner
// (tools/tests/cli_run.hpp), ARGS split at spaces outside single quotes.
#pragma once

#include <string>
#include <vector>

#include "cli_run.hpp"

namespace attnoracle::testing {

// Runs `attnoracle args`; returns the exit status, with stdout and then stderr in `out`.
inline int run(const std::string& args, std::string& out) {
  std::vector<std::string> argv;
  std::string word;
  bool quoted = false, any = false;
  for (const char ch : args) {
    if (ch == '\'') {
      quoted = !quoted;
      any = true;
    } else if (ch == ' ' && !quoted) {
      if (any) argv.push_back(word);
      word.clear();
      any = false;
    } else {
      word += ch;
      any = true;
    }
  }
  if (any) argv.push_back(word);
  const CliResult r = run_cli(argv);
  out = r.out + r.err;
  return r.status;
}

}  // namespace attnoracle::testing
