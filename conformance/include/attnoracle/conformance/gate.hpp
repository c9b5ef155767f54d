// The conformance gate: a vector set, an implementation's results, and a verdict per case.
#pragma once

#include <string>
#include <vector>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/profile.hpp"

namespace attnoracle::conformance {

struct GateOptions {
  std::string dir;                 // the vector set (manifest.json, cases/)
  std::string impl;                // `run`: the implementation's command (adapter protocol)
  std::string results;             // `check`: directory of <id>.safetensors / .error / .unsupported
  Profile profile;
  std::vector<std::string> tags;   // only cases with one of these tags (empty: all)
  std::vector<DType> dtypes;       // only cases with these input dtypes (empty: all)
  std::vector<std::string> ids;    // only these cases (empty: all)
  double timeout = 600;            // seconds for the implementation's whole run
  bool require_all = false;        // skipped cases count as failures
  std::string work_dir;            // `run`: where inputs and outputs go
  int threads = 1;                 // comparisons in parallel
};

struct GateReport {
  std::string suite, dir, implementation, profile;
  std::vector<CaseReport> cases;
  std::size_t passed = 0, failed = 0, skipped = 0;
  std::string adapter_note;        // how the implementation's run ended, when not cleanly
  double seconds = 0;
  double compared_bytes = 0;       // bytes of results compared
};

// Throws InputError for a bad vector set (manifest, a missing or altered case file).
GateReport run_gate(const GateOptions& opt);
GateReport check_gate(const GateOptions& opt);
// 0 pass, 1 any failure (or a skip under require_all)
int gate_exit_status(const GateReport& r, bool require_all);

std::string text_report(const GateReport& r, bool all_cases);
std::string json_report(const GateReport& r);
std::string junit_report(const GateReport& r);

}  // namespace attnoracle::conformance
