// Running the gate over a vector set: select cases, obtain results, compare in parallel.
#include "attnoracle/gate.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "attnoracle/adapter.hpp"
#include "attnoracle/error.hpp"
#include "attnoracle/manifest.hpp"

namespace attnoracle::conformance {
namespace fs = std::filesystem;

namespace {

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, "", "cannot read");
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct Selected {
  vectors::ManifestCase mc;
  std::string path;
};

std::vector<Selected> select(const GateOptions& opt, vectors::Manifest& m) {
  const std::string mpath = (fs::path(opt.dir) / "manifest.json").string();
  const std::vector<unsigned char> text = read_bytes(mpath);
  std::string problem;
  m = vectors::parse_manifest(mpath, std::string_view(reinterpret_cast<const char*>(text.data()), text.size()), problem);
  if (!problem.empty()) throw InputError(mpath, "", problem);
  std::vector<Selected> out;
  for (const auto& c : m.cases) {
    if (!opt.ids.empty() && std::find(opt.ids.begin(), opt.ids.end(), c.id) == opt.ids.end()) continue;
    if (!opt.tags.empty() && std::none_of(opt.tags.begin(), opt.tags.end(), [&](const std::string& t) {
          return std::find(c.tags.begin(), c.tags.end(), t) != c.tags.end();
        }))
      continue;
    out.push_back({c, (fs::path(opt.dir) / c.file).string()});
  }
  return out;
}

// The golden file of a case, checked against the manifest's hash.
SafeTensorsFile golden_of(const Selected& s) {
  const std::vector<unsigned char> bytes = read_bytes(s.path);
  if (vectors::sha256_hex(bytes) != s.mc.sha256)
    throw InputError(s.path, "", "sha256 differs from the manifest: the vector set is altered");
  return parse_safetensors(s.path, bytes);
}

bool dtype_selected(const GateOptions& opt, const SafeTensorsFile& f) {
  if (opt.dtypes.empty()) return true;
  const RawTensor* t = f.find("q");
  if (!t) t = f.find("x_q");
  return t && std::find(opt.dtypes.begin(), opt.dtypes.end(), t->dtype) != opt.dtypes.end();
}

// Compares every case in parallel; results[k] is the implementation's result for cases[k].
void compare_all(const GateOptions& opt, const std::vector<Selected>& cases,
                 const std::vector<JobResult>& results, const std::vector<char>& chosen, GateReport& rep) {
  std::vector<CaseReport> reports(cases.size());
  std::vector<double> bytes(cases.size(), 0);
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next++; k < cases.size(); k = next++) {
      if (!chosen[k]) continue;
      CaseReport& r = reports[k];
      try {
        const SafeTensorsFile golden = golden_of(cases[k]);
        r = compare_case(cases[k].mc.id, golden, cases[k].mc.expect, results[k], opt.profile);
        for (const auto& t : results[k].output.tensors) bytes[k] += static_cast<double>(t.data.size());
      } catch (const InputError& e) {
        r.id = cases[k].mc.id;
        r.status = CaseStatus::Fail;
        r.reason = "bad golden file: " + e.message();
      }
      r.tags = cases[k].mc.tags;
    }
  };
  const int n = std::max(1, opt.threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (std::size_t k = 0; k < cases.size(); ++k) {
    if (!chosen[k]) continue;
    rep.compared_bytes += bytes[k];
    switch (reports[k].status) {
      case CaseStatus::Pass: ++rep.passed; break;
      case CaseStatus::Fail: ++rep.failed; break;
      case CaseStatus::Skip: ++rep.skipped; break;
    }
    rep.cases.push_back(std::move(reports[k]));
  }
}

}  // namespace

GateReport run_gate(const GateOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  GateReport rep;
  vectors::Manifest m;
  const std::vector<Selected> cases = select(opt, m);
  rep.suite = m.suite;
  rep.dir = opt.dir;
  rep.implementation = opt.impl;
  rep.profile = opt.profile.name;
  const fs::path work = opt.work_dir;
  fs::create_directories(work / "inputs");
  fs::create_directories(work / "outputs");
  std::vector<AdapterJob> jobs;
  std::vector<std::size_t> job_of(cases.size(), 0);
  std::vector<char> chosen(cases.size(), 0);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const SafeTensorsFile golden = golden_of(cases[k]);
    if (!dtype_selected(opt, golden)) continue;
    chosen[k] = 1;
    const std::string in = (work / "inputs" / (cases[k].mc.id + ".safetensors")).string();
    write_file_atomic(in, serialize_safetensors(strip_golden(golden)));
    job_of[k] = jobs.size();
    jobs.push_back({cases[k].mc.id, in, (work / "outputs" / (cases[k].mc.id + ".safetensors")).string()});
  }
  AdapterRun run;
  if (!jobs.empty()) run = run_adapter(opt.impl, jobs, (work / "run").string(), opt.timeout);
  if (run.timed_out) rep.adapter_note = "the implementation timed out after " + std::to_string(opt.timeout) + " s";
  else if (run.exit_status != 0) rep.adapter_note = "the implementation exited with status " + std::to_string(run.exit_status);
  if (!rep.adapter_note.empty() && !run.stderr_tail.empty()) rep.adapter_note += "; its last output:\n" + run.stderr_tail;
  std::vector<JobResult> results(cases.size());
  for (std::size_t k = 0; k < cases.size(); ++k)
    if (chosen[k]) results[k] = std::move(run.results[job_of[k]]);
  compare_all(opt, cases, results, chosen, rep);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

GateReport check_gate(const GateOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  GateReport rep;
  vectors::Manifest m;
  const std::vector<Selected> cases = select(opt, m);
  rep.suite = m.suite;
  rep.dir = opt.dir;
  rep.implementation = "results in " + opt.results;
  rep.profile = opt.profile.name;
  if (!fs::is_directory(opt.results)) throw InputError(opt.results, "", "not a directory");
  std::vector<JobResult> results(cases.size());
  std::vector<char> chosen(cases.size(), 0);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    // Only the selected dtypes; reading the golden file again here is cheap next to comparing.
    if (!opt.dtypes.empty() && !dtype_selected(opt, golden_of(cases[k]))) continue;
    chosen[k] = 1;
    const fs::path out = fs::path(opt.results) / (cases[k].mc.id + ".safetensors");
    const bool o = fs::exists(out), e = fs::exists(out.string() + ".error"), u = fs::exists(out.string() + ".unsupported");
    JobResult& r = results[k];
    auto text = [](const std::string& p) {
      std::vector<unsigned char> b = read_bytes(p);
      std::string s(b.begin(), b.end());
      for (char& ch : s)
        if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
      return s.substr(0, 500);
    };
    if (o + e + u > 1) {
      r.outcome = Outcome::Invalid;
      r.reason = "more than one of output, .error and .unsupported";
    } else if (u) {
      r.outcome = Outcome::Unsupported;
      r.reason = text(out.string() + ".unsupported");
    } else if (e) {
      r.outcome = Outcome::Refused;
      r.reason = text(out.string() + ".error");
    } else if (!o) {
      r.outcome = Outcome::Missing;
      r.reason = "no result file " + out.string();
    } else {
      try {
        r.output = read_safetensors(out.string());
        r.outcome = Outcome::Output;
      } catch (const InputError& err) {
        r.outcome = Outcome::Invalid;
        r.reason = err.message();
      }
    }
  }
  compare_all(opt, cases, results, chosen, rep);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

int gate_exit_status(const GateReport& r, bool require_all) {
  return (r.failed > 0 || (require_all && r.skipped > 0)) ? 1 : 0;
}

}  // namespace attnoracle::conformance
