// The conformance gate: a vector set, an implementation's results, and a verdict per case.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/profile.hpp"

namespace attnoracle::conformance {

struct GateOptions {
  std::string dir;                 // the vector set (manifest.json, cases/)
  std::string impl;                // `run`: the implementation's command (adapter protocol)
  std::string results;             // `check`: directory of <id>.safetensors / .error / .unsupported
  ProfileSet profiles;             // each case is judged by the member for its input dtype
  std::vector<std::string> tags;   // only cases with one of these tags (empty: all)
  std::vector<DType> dtypes;       // only cases with these input dtypes (empty: all)
  std::vector<std::string> ids;    // only these cases (empty: all)
  // shards > 0: only the selected cases whose position in the manifest is `shard` modulo
  // `shards` (a shard may hold none)
  int shard = 0, shards = 0;
  double timeout = 600;            // seconds for the implementation's whole run
  bool require_all = false;        // skipped cases count as failures
  bool rehash = false;             // hash every golden file, also those the set's stamp records verified
  std::string work_dir;            // `run`: where inputs and outputs go
  int threads = 1;                 // comparisons in parallel
  // `run`: the implementation is the plugin host, which runs the jobs in order; when it dies of
  // a signal, the job it was on fails as crashed and the host is started again on the jobs left.
  bool restart_after_crash = false;
  bool pictures = false;           // failing cases carry the data of the HTML report's pictures
  // Called as results arrive ("run": the implementation's output files, polled) and as cases are
  // compared ("compare"), from any thread, one call at a time.
  std::function<void(const char* phase, std::size_t done, std::size_t total)> progress;
};

struct GateReport {
  std::string suite, dir, implementation, profile;
  std::vector<CaseReport> cases;
  std::size_t passed = 0, failed = 0, skipped = 0;
  bool require_all = false;        // skipped cases count as failures
  std::string adapter_note;        // how the implementation's run ended, when not cleanly
  double seconds = 0;
  double compared_bytes = 0;       // bytes of results compared
  int shard = 0, shards = 0;       // shards > 0: the report of one shard (GateOptions)
  std::size_t selected = 0;        // of a shard: the cases the selectors leave in all shards together
};

// Throws InputError for a bad vector set (manifest, a missing or altered case file), and for a
// selection (--tag, --dtype, --case) that matches no case: InputError(dir, "--tag", "no case
// matches (tags in this set: ...)"), before anything is written or run.
GateReport run_gate(const GateOptions& opt);
GateReport check_gate(const GateOptions& opt);
// The JSON reports of the shards of one run or check (`texts`, their files named by `paths`), all
// n shards of it, merged into the report of one run over them all: its cases in the manifest's
// order, the counts added, the seconds added, the notes joined. `json` is the merged JSON report
// (each case's object as its shard wrote it); `report` holds what the text and JUnit reports
// show. Throws InputError(path, field, what) for a file that is not such a report, reports of
// different suites, profiles, implementations, --require-all or selections, a shard given twice,
// a case in two shards, and shards missing.
struct MergedReport {
  GateReport report;
  std::string json;
};
MergedReport merge_reports(const std::vector<std::string>& paths, const std::vector<std::string>& texts);

// 0 pass, 1 any failure (or a skip under require_all)
int gate_exit_status(const GateReport& r, bool require_all);

std::string text_report(const GateReport& r, bool all_cases);
std::string json_report(const GateReport& r);
std::string junit_report(const GateReport& r);
// One self-contained HTML page (inline style and script, no network) drawing the JSON report:
// the cases with filters and sorting, per failing case its findings and pictures.
std::string html_report(const GateReport& r);
// The same page from a saved JSON report (its text; `path` names it in errors): throws
// InputError(path, field, what) for the first field the page reads that is missing or wrong.
std::string html_report_from_json(const std::string& path, const std::string& text);

}  // namespace attnoracle::conformance
