// Running the gate over a vector set: select cases, obtain results, compare in parallel.
#include "attnoracle/conformance/gate.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/conformance/text.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "attnoracle/reference/parallel.hpp"

namespace attnoracle::conformance {
namespace fs = std::filesystem;

namespace {

struct Selected {
  vectors::ManifestCase mc;
  std::string path;  // the case file
  std::string dir;   // the set it belongs to: nothing is read outside it
  std::size_t position = 0;  // in the manifest's list of cases
  bool rehash = false;       // hashed even where the set's stamp records it verified
};

// At most kListed values, then how many more: "a, b, c and 12 more".
std::string brief_list(const std::vector<std::string>& values) {
  constexpr std::size_t kListed = 12;
  std::string s;
  for (std::size_t k = 0; k < values.size() && k < kListed; ++k) s += (k ? ", " : "") + values[k];
  if (values.size() > kListed) s += " and " + std::to_string(values.size() - kListed) + " more";
  return s.empty() ? "none" : s;
}

// A selector that leaves no case: bad usage, naming the selector and what the set holds.
[[noreturn]] void no_match(const GateOptions& opt, const std::string& selector, const std::string& what,
                           std::vector<std::string> present, bool among_selected) {
  std::sort(present.begin(), present.end());
  present.erase(std::unique(present.begin(), present.end()), present.end());
  throw InputError(opt.dir, selector,
                   "no case matches (" + what + (among_selected ? " among the cases the other selectors leave: " : " in this set: ") +
                       brief_list(present) + ")");
}

std::vector<Selected> select(const GateOptions& opt, vectors::Manifest& m, std::size_t& selected) {
  const std::string mpath = (fs::path(opt.dir) / "manifest.json").string();
  const std::vector<unsigned char> text = read_file_within(opt.dir, "manifest.json", limits::kManifestBytes);
  std::string problem;
  m = vectors::parse_manifest(mpath, std::string_view(reinterpret_cast<const char*>(text.data()), text.size()), problem);
  if (!problem.empty()) throw InputError(mpath, "", problem);
  // cases/ a link that leaves the set: refused as a whole, before any case is read.
  if (fs::exists(fs::symlink_status(fs::path(opt.dir) / "cases"))) path_within(opt.dir, "cases");
  std::vector<Selected> out;
  for (std::size_t position = 0; position < m.cases.size(); ++position) {
    const auto& c = m.cases[position];
    if (!opt.ids.empty() && std::find(opt.ids.begin(), opt.ids.end(), c.id) == opt.ids.end()) continue;
    if (!opt.tags.empty() && std::none_of(opt.tags.begin(), opt.tags.end(), [&](const std::string& t) {
          return std::find(c.tags.begin(), c.tags.end(), t) != c.tags.end();
        }))
      continue;
    out.push_back({c, (fs::path(opt.dir) / c.file).string(), opt.dir, position, opt.rehash});
  }
  if (out.empty() && (!opt.ids.empty() || !opt.tags.empty())) {
    std::vector<std::string> ids, tags;
    bool id_matches = opt.ids.empty();
    for (const auto& c : m.cases) {
      ids.push_back(c.id);
      if (std::find(opt.ids.begin(), opt.ids.end(), c.id) != opt.ids.end()) {
        id_matches = true;
        tags.insert(tags.end(), c.tags.begin(), c.tags.end());
      }
    }
    if (!id_matches) no_match(opt, "--case", "ids", ids, false);
    if (opt.ids.empty())
      for (const auto& c : m.cases) tags.insert(tags.end(), c.tags.begin(), c.tags.end());
    no_match(opt, "--tag", "tags", tags, !opt.ids.empty());
  }
  selected = out.size();
  if (opt.shards > 0) {
    const auto k = static_cast<std::size_t>(opt.shard), n = static_cast<std::size_t>(opt.shards);
    std::erase_if(out, [&](const Selected& s) { return s.position % n != k; });
  }
  return out;
}

// What --dtype sees of a case: the dtype of q (or x_q), or "" when there is none.
std::string input_dtype_name(const SafeTensorsFile& f) {
  const RawTensor* t = f.find("q");
  if (!t) t = f.find("x_q");
  return t ? std::string(dtype_name(t->dtype)) : std::string();
}

// The golden file of a case, checked against the manifest's hash.
SafeTensorsFile golden_of(const Selected& s) {
  return vectors::read_set_case(s.dir, s.mc.file, s.mc.sha256, s.rehash);
}

// The tensor holding the case's input dtype: q, x_q (kind mha) or o_partial (kind merge).
const RawTensor* input_tensor(const SafeTensorsFile& f) {
  for (const char* name : {"q", "x_q", "o_partial"})
    if (const RawTensor* t = f.find(name)) return t;
  return nullptr;
}

bool dtype_selected(const GateOptions& opt, const SafeTensorsFile& f) {
  if (opt.dtypes.empty()) return true;
  const RawTensor* t = input_tensor(f);
  return t && std::find(opt.dtypes.begin(), opt.dtypes.end(), t->dtype) != opt.dtypes.end();
}

// The profile that judges a case: the member for its input dtype, null when none covers it (a
// file without an input is judged by the first, which reports what is wrong with it).
const Profile* profile_for(const GateOptions& opt, const SafeTensorsFile& f) {
  const RawTensor* t = input_tensor(f);
  return t ? opt.profiles.for_dtype(t->dtype) : &opt.profiles.members.front();
}

CaseReport uncovered(const GateOptions& opt, const std::string& id, const SafeTensorsFile& f) {
  CaseReport r;
  r.id = id;
  r.dtype = input_tensor(f)->dtype;
  r.status = CaseStatus::Skip;
  r.reason = "profile " + opt.profiles.name + " does not cover " + std::string(dtype_name(r.dtype)) + " inputs";
  return r;
}

// Golden files parsed while selecting cases, handed to the comparison so that it need not read
// and hash them again; kept up to a total size, beyond which they are read again.
struct KeptGoldens {
  static constexpr std::size_t kBudget = std::size_t{256} << 20;
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::size_t bytes = 0;
  explicit KeptGoldens(std::size_t n) : files(n) {}
  void keep(std::size_t k, SafeTensorsFile&& f) {
    std::size_t size = 0;
    for (const auto& t : f.tensors) size += t.data.size();
    if (bytes + size > kBudget) return;
    bytes += size;
    files[k] = std::make_unique<SafeTensorsFile>(std::move(f));
  }
};

// Compares every case in parallel; result_of(k) is the implementation's result for cases[k]
// (called once, in the worker that compares the case).
void compare_all(const GateOptions& opt, const std::vector<Selected>& cases,
                 const std::function<JobResult(std::size_t)>& result_of, const std::vector<char>& chosen,
                 KeptGoldens& kept, GateReport& rep) {
  std::vector<CaseReport> reports(cases.size());
  std::vector<double> bytes(cases.size(), 0);
  const auto total = static_cast<std::size_t>(std::count(chosen.begin(), chosen.end(), 1));
  std::size_t done = 0;
  std::mutex progress_lock;
  // A throw of result_of stops the loop; the smallest case's is rethrown, as when the results
  // were read first.
  parallel_for(cases.size(), std::max(1, opt.threads), [&](std::size_t k) {
    if (!chosen[k]) return;
    CaseReport& r = reports[k];
    auto bad_golden = [&](const InputError& e) {
      r.id = cases[k].mc.id;
      r.status = CaseStatus::Fail;
      r.reason = "bad golden file: " + e.message();
    };
    std::unique_ptr<SafeTensorsFile> golden = std::move(kept.files[k]);
    try {
      if (!golden) golden = std::make_unique<SafeTensorsFile>(golden_of(cases[k]));
    } catch (const InputError& e) {
      golden.reset();
      bad_golden(e);
    }
    if (golden) {
      if (const Profile* profile = profile_for(opt, *golden); !profile) {
        r = uncovered(opt, cases[k].mc.id, *golden);
      } else {
        JobResult result = result_of(k);
        try {
          r = compare_case(cases[k].mc.id, *golden, cases[k].mc.expect, result, *profile, opt.pictures);
          r.profile = profile->name;
          for (const auto& t : result.output.tensors) bytes[k] += static_cast<double>(t.data.size());
        } catch (const InputError& e) {
          bad_golden(e);
        }
      }
    }
    r.tags = cases[k].mc.tags;
    r.position = cases[k].position;
    if (opt.progress) {
      std::lock_guard<std::mutex> g(progress_lock);
      opt.progress("compare", ++done, total);
    }
  });
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

// The selected cases, and the report's heading.
std::vector<Selected> start(const GateOptions& opt, const std::string& implementation, GateReport& rep) {
  vectors::Manifest m;
  std::vector<Selected> cases = select(opt, m, rep.selected);
  rep.shard = opt.shard;
  rep.shards = opt.shards;
  rep.suite = m.suite;
  rep.dir = opt.dir;
  rep.implementation = implementation;
  rep.profile = opt.profiles.name;
  rep.require_all = opt.require_all;
  return cases;
}

// Runs the implementation on the jobs. With restart_after_crash, a run that dies of a signal
// fails the first job left without a file, the one the host was on, as crashed on that case, and
// the host is started again on the jobs after it, within what is left of the timeout.
AdapterRun run_jobs(const GateOptions& opt, const std::vector<AdapterJob>& jobs, const fs::path& work,
                    std::vector<std::string>& notes) {
  const auto t0 = std::chrono::steady_clock::now();
  AdapterRun run = run_adapter(opt.impl, jobs, (work / "run").string(), opt.timeout);
  if (!opt.restart_after_crash) return run;
  AdapterRun last = run;
  std::size_t begin = 0;  // jobs[begin..] are those of `last`
  while (!last.timed_out) {
    // the signal, whether the host died of it or the shell reported it as 128 + n
    const int sig = last.signaled ? last.signal : last.exit_status > 128 && last.exit_status < 160 ? last.exit_status - 128 : 0;
    if (sig == 0) break;
    std::size_t at = begin;
    while (at < jobs.size() && run.results[at].outcome != Outcome::Crashed) ++at;
    if (at == jobs.size()) break;
    run.results[at].reason = "signal " + std::to_string(sig) + " on case " + jobs[at].id +
                             (at + 1 < jobs.size() ? "; the plugin host was started again on the cases after it" : "");
    notes.push_back("the plugin host died of signal " + std::to_string(sig) + " on case " + jobs[at].id);
    begin = at + 1;
    if (begin == jobs.size()) break;
    double left = 0;
    if (opt.timeout > 0) {
      left = opt.timeout - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (left <= 0) {
        for (std::size_t k = begin; k < jobs.size(); ++k)
          run.results[k] = {Outcome::TimedOut, "no output: the run timed out after " + duration_text(opt.timeout), {}};
        run.timed_out = true;
        break;
      }
    }
    const std::vector<AdapterJob> rest(jobs.begin() + static_cast<std::ptrdiff_t>(begin), jobs.end());
    last = run_adapter(opt.impl, rest, (work / "run").string(), left);
    for (std::size_t k = 0; k < rest.size(); ++k) run.results[begin + k] = std::move(last.results[k]);
    run.timed_out = last.timed_out;
    run.exit_status = last.exit_status;
    run.signaled = last.signaled;
    run.signal = last.signal;
    run.stderr_tail = last.stderr_tail;
  }
  return run;
}

// While the implementation runs: the results written so far, counted every quarter of a second
// and given to opt.progress; stopped when destroyed.
class ResultPoller {
 public:
  ResultPoller(const GateOptions& opt, const std::vector<AdapterJob>& jobs) : thread_([this, &opt, &jobs] {
      std::unique_lock<std::mutex> lock(m_);
      while (!over_) {
        std::size_t n = 0;
        std::error_code ec;
        for (const auto& j : jobs)
          if (fs::exists(j.output, ec) || fs::exists(j.output + ".error", ec) || fs::exists(j.output + ".unsupported", ec)) ++n;
        opt.progress("run", n, jobs.size());
        cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return over_; });
      }
    }) {}
  ResultPoller(const ResultPoller&) = delete;
  ResultPoller& operator=(const ResultPoller&) = delete;
  ~ResultPoller() {
    {
      std::lock_guard<std::mutex> g(m_);
      over_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool over_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace

GateReport run_gate(const GateOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  GateReport rep;
  const std::vector<Selected> cases = start(opt, opt.impl, rep);
  const fs::path work = opt.work_dir;
  std::vector<char> chosen(cases.size(), 0), uncovered_case(cases.size(), 0);
  KeptGoldens kept(cases.size());
  // The cases of the selected dtypes, before anything is written.
  std::vector<std::string> seen;
  std::size_t count = 0;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    SafeTensorsFile golden = golden_of(cases[k]);
    if (!dtype_selected(opt, golden)) {
      seen.push_back(input_dtype_name(golden));
      continue;
    }
    chosen[k] = 1;
    ++count;
    if (!profile_for(opt, golden)) {
      uncovered_case[k] = 1;  // skipped: the implementation never sees it
      continue;
    }
    kept.keep(k, std::move(golden));
  }
  // A shard may hold no case of the dtypes (the others may): only a whole selection is refused.
  if (count == 0 && !cases.empty() && !opt.dtypes.empty() && opt.shards == 0)
    no_match(opt, "--dtype", "input dtypes", seen, !opt.tags.empty() || !opt.ids.empty());
  fs::create_directories(work / "inputs");
  fs::create_directories(work / "outputs");
  std::vector<AdapterJob> jobs;
  std::vector<std::size_t> job_of(cases.size(), 0);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    if (!chosen[k] || uncovered_case[k]) continue;
    const std::string in = (work / "inputs" / (cases[k].mc.id + ".safetensors")).string();
    if (kept.files[k]) {
      write_file_atomic(in, serialize_safetensors(case_for(*kept.files[k], *profile_for(opt, *kept.files[k]))));
    } else {
      const SafeTensorsFile golden = golden_of(cases[k]);
      write_file_atomic(in, serialize_safetensors(case_for(golden, *profile_for(opt, golden))));
    }
    job_of[k] = jobs.size();
    jobs.push_back({cases[k].mc.id, in, (work / "outputs" / (cases[k].mc.id + ".safetensors")).string()});
  }
  AdapterRun run;
  std::vector<std::string> notes;
  if (!jobs.empty()) {
    std::optional<ResultPoller> poller;
    if (opt.progress) poller.emplace(opt, jobs);
    run = run_jobs(opt, jobs, work, notes);
  }
  for (const auto& n : notes) rep.adapter_note += (rep.adapter_note.empty() ? "" : "; ") + n;
  std::string end;
  if (run.timed_out) end = "the implementation timed out after " + duration_text(opt.timeout);
  else if (run.signaled) end = "the implementation was killed by signal " + std::to_string(run.signal);
  else if (run.exit_status != 0) end = "the implementation exited with status " + std::to_string(run.exit_status);
  if (!end.empty()) rep.adapter_note += (rep.adapter_note.empty() ? "" : "; ") + end;
  if (!end.empty() && !run.stderr_tail.empty()) rep.adapter_note += "; its last output:\n" + run.stderr_tail;
  compare_all(opt, cases, [&](std::size_t k) { return std::move(run.results[job_of[k]]); }, chosen, kept, rep);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

GateReport check_gate(const GateOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  GateReport rep;
  const std::vector<Selected> cases = start(opt, "results in " + opt.results, rep);
  if (!fs::is_directory(opt.results)) throw InputError(opt.results, "", "not a directory");
  std::vector<char> chosen(cases.size(), 0);
  KeptGoldens kept(cases.size());
  std::vector<std::string> seen;
  std::size_t count = 0;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    // Only the selected dtypes (the golden files read here are not read again below).
    if (!opt.dtypes.empty()) {
      SafeTensorsFile golden = golden_of(cases[k]);
      if (!dtype_selected(opt, golden)) {
        seen.push_back(input_dtype_name(golden));
        continue;
      }
      kept.keep(k, std::move(golden));
    }
    chosen[k] = 1;
    ++count;
  }
  if (count == 0 && !cases.empty() && !opt.dtypes.empty() && opt.shards == 0)
    no_match(opt, "--dtype", "input dtypes", seen, !opt.tags.empty() || !opt.ids.empty());
  // Each result is read by the worker that compares it.
  auto result_of = [&](std::size_t k) {
    const std::string out = (fs::path(opt.results) / (cases[k].mc.id + ".safetensors")).string();
    JobResult r = read_job_result(out);
    if (r.outcome == Outcome::Missing) r.reason = "no result file " + out + ", .error or .unsupported";
    return r;
  };
  compare_all(opt, cases, result_of, chosen, kept, rep);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

int gate_exit_status(const GateReport& r, bool require_all) {
  return (r.failed > 0 || (require_all && r.skipped > 0)) ? 1 : 0;
}

}  // namespace attnoracle::conformance
