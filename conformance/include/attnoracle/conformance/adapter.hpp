// Running an implementation through the adapter protocol (CONTRACT section 5): the runner writes
// a jobs file, starts the implementation once on it, and collects what it wrote for each job.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {

struct AdapterJob {
  std::string id;
  std::string input;   // case file path
  std::string output;  // result path; the implementation may write output, .error or .unsupported
};

enum class Outcome {
  Output,       // `output` was written and is a valid safetensors file
  Refused,      // `output.error` was written
  Unsupported,  // `output.unsupported` was written
  Missing,      // nothing was written and the implementation exited 0
  Crashed,      // nothing was written and the implementation died or exited nonzero
  TimedOut,     // nothing was written and the run timed out
  Invalid,      // more than one of the three was written, or `output` is not readable safetensors
};

struct JobResult {
  Outcome outcome = Outcome::Missing;
  // Refused, Unsupported: the text written (one line, trimmed, at most 500 bytes);
  // otherwise why the job failed; empty for Output.
  std::string reason;
  SafeTensorsFile output;  // the parsed output when outcome == Output
};

struct AdapterRun {
  std::vector<JobResult> results;  // one per job, in order
  int exit_status = 0;             // exit status, or -1 when killed by a signal
  bool signaled = false;
  int signal = 0;                  // the signal that killed it, when signaled
  bool timed_out = false;          // the runner hit the timeout and killed the process group
  double seconds = 0;              // wall-clock time from start to exit
  std::string stderr_tail;         // the last 4 KiB written on stdout and stderr (merged, as valid_text)
};

// Writes `<work_dir>/jobs.jsonl`, runs `/bin/sh -c "<command> '<jobs.jsonl>'"` in its own process
// group (stdin /dev/null; stdout and stderr drained into `stderr_tail`), waits at most
// `timeout_seconds` (0: no limit; on timeout the group gets SIGTERM, then SIGKILL 2 s later),
// kills whatever the implementation left running in its group, and collects every job.
// Stale outputs of the jobs are removed before the start. Never throws for anything the
// implementation does; throws InputError for the runner's own problems (work_dir cannot be
// created or written, a stale output cannot be removed, /bin/sh cannot be started).
AdapterRun run_adapter(const std::string& command, const std::vector<AdapterJob>& jobs,
                       const std::string& work_dir, double timeout_seconds);

// What was written for one job at `output` (the file itself, output.error, output.unsupported),
// the one reader of `run` and `check`: Output (at most kMaxOutputBytes, valid safetensors),
// Refused or Unsupported (the text, one line), Invalid (more than one written, unreadable, too
// large, not safetensors), or Missing when none was written. Never throws.
JobResult read_job_result(const std::string& output);

// From 32 MiB: reserves `size` bytes of untouched memory in `bytes` (empty), in huge pages where
// the system grants them: the 4 KiB page faults of a fresh buffer of hundreds of MB cost as much
// as reading it.
void reserve_for_read(std::vector<unsigned char>& bytes, std::size_t size);

// Text of an implementation as it may reach a report (JSON, JUnit, HTML, a terminal): valid UTF-8
// kept; carriage returns dropped; each byte of an invalid sequence, NUL and every other control
// character but newline and tab become U+FFFD.
std::string valid_text(std::string_view bytes);

// "output", "refused", "unsupported", "missing", "crashed", "timed_out", "invalid".
std::string_view outcome_name(Outcome o);

// Largest `output` file the runner reads (larger ones are Invalid).
inline constexpr unsigned long long kMaxOutputBytes = 1ULL << 30;

}  // namespace attnoracle::conformance
