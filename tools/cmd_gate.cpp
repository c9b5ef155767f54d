// attnoracle run DIR --impl 'CMD' and attnoracle check DIR --results RDIR: the conformance gate.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/conformance/gate.hpp"
#include "cli.hpp"
#include "shard.hpp"

namespace attnoracle::cli {
namespace {

namespace fs = std::filesystem;

struct GateArgs {
  std::string dir, impl, plugin, results, profile = "fp32", masked_rows, returns;
  std::vector<std::string> tags, dtypes, ids;
  double timeout = 600;
  bool require_all = false, all = false, keep = false, rehash = false;
  std::string json, junit, html, work, shard;
  int threads = default_threads();
  ProgressFlags progress;
};

conformance::GateOptions options_of(const GateArgs& a) {
  conformance::GateOptions o;
  o.dir = a.dir;
  o.profiles = conformance::declared_profile_set(a.profile, a.masked_rows, a.returns);
  o.tags = a.tags;
  o.ids = a.ids;
  for (const auto& d : a.dtypes) {
    const auto t = dtype_from_name(d);
    if (!t || !is_input_format(*t))
      throw InputError("--dtype", "", "unknown dtype '" + d + "' (F64, F32, F16, BF16, F8_E4M3, F8_E5M2)");
    o.dtypes.push_back(*t);
  }
  if (!a.shard.empty()) {
    const Shard s = parse_shard(a.shard);
    o.shard = s.k;
    o.shards = s.n;
    if (!s.source.empty()) std::fprintf(stderr, "attnoracle: shard %d/%d (from %s)\n", s.k, s.n, s.source.c_str());
  }
  o.timeout = a.timeout;
  o.require_all = a.require_all;
  o.rehash = a.rehash;
  o.threads = a.threads;
  if (!a.json.empty()) require_parent_dir(a.json);
  if (!a.junit.empty()) require_parent_dir(a.junit);
  if (!a.html.empty()) require_parent_dir(a.html);
  o.pictures = !a.json.empty() || !a.html.empty();
  if (!fs::is_directory(a.dir)) throw InputError(a.dir, "", "not a vector set directory");
  return o;
}

// The progress line of the gate: results as they arrive, then comparisons.
void add_progress(conformance::GateOptions& o, Progress& line) {
  if (!line.shown()) return;
  o.progress = [&line](const char* phase, std::size_t done, std::size_t total) {
    line.update(done, total, std::string(phase) == "run" ? "results" : "compared");
  };
}

int finish(const GateArgs& a, const conformance::GateReport& r) {
  std::fputs(conformance::text_report(r, a.all).c_str(), stdout);
  auto put = [](const std::string& path, const std::string& s) {
    write_file_atomic(path, std::vector<unsigned char>(s.begin(), s.end()));
  };
  if (!a.json.empty()) put(a.json, conformance::json_report(r));
  if (!a.junit.empty()) put(a.junit, conformance::junit_report(r));
  if (!a.html.empty()) put(a.html, conformance::html_report(r));
  return conformance::gate_exit_status(r, a.require_all);
}

std::string self_exe() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("attnoracle") : p.string();
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

int run_run(const GateArgs& a) {
  if (a.impl.empty() == a.plugin.empty()) throw InputError("--impl", "", "give exactly one of --impl and --plugin");
  conformance::GateOptions o = options_of(a);
  // A plugin runs in a host process of its own, so that a crash in it is a failed case.
  o.impl = a.impl.empty() ? quote(self_exe()) + " plugin-host " + quote(fs::absolute(a.plugin).string()) : a.impl;
  o.restart_after_crash = !a.plugin.empty();  // the host runs the jobs in order: a crash is on one case
  const bool temp = a.work.empty();
  o.work_dir = temp ? make_temp_dir("attnoracle-run") : a.work;
  // What a leftover process still writes into cannot fail the run: the clean-up is best effort.
  auto clean = [&] {
    std::error_code ec;
    if (temp && !a.keep) fs::remove_all(o.work_dir, ec);
  };
  conformance::GateReport r;
  Progress line("run", a.progress.wanted());
  add_progress(o, line);
  try {
    r = conformance::run_gate(o);
  } catch (...) {
    line.clear();
    clean();
    throw;
  }
  line.clear();
  clean();
  if (temp && a.keep) std::fprintf(stderr, "attnoracle: work directory kept: %s\n", o.work_dir.c_str());
  return finish(a, r);
}

int run_check(const GateArgs& a) {
  conformance::GateOptions o = options_of(a);
  o.results = a.results;
  Progress line("check", a.progress.wanted());
  add_progress(o, line);
  conformance::GateReport r;
  try {
    r = conformance::check_gate(o);
  } catch (...) {
    line.clear();
    throw;
  }
  line.clear();
  return finish(a, r);
}

void common(CLI::App* sub, GateArgs& a) {
  sub->add_option("DIR", a.dir, "vector set (manifest.json, cases/)")->required();
  sub->add_option("--profile", a.profile,
                  "fp64, fp32, fp16, bf16, flash-fp16, flash-bf16, torch-cpu-bf16, a JSON file, a comma-separated "
                  "list of these for several input dtypes, or a family: standard (fp64,fp32,fp16,bf16), flash "
                  "(fp64,fp32,flash-fp16,flash-bf16)");
  sub->add_option("--tag", a.tags, "only cases with one of these tags")->delimiter(',');
  sub->add_option("--dtype", a.dtypes, "only cases with these input dtypes")->delimiter(',');
  sub->add_option("--case", a.ids, "only these case ids")->delimiter(',');
  sub->add_option("--masked-rows", a.masked_rows, "declared treatment of fully masked rows: error, zero, nan, mean");
  sub->add_option("--returns", a.returns, "optional outputs the implementation returns: weights,lse,scores,gradients (default all)");
  sub->add_option("--shard", a.shard,
                  "k/n: only the selected cases whose position in the manifest is k modulo n (merge the shards' "
                  "--json reports with attnoracle merge); auto: k and n from the environment, as for gen");
  sub->add_flag("--require-all", a.require_all, "skipped cases count as failures");
  sub->add_flag("--rehash", a.rehash,
                "take the SHA-256 of every golden file, also of those the set's stamp records verified and unchanged");
  sub->add_flag("--all", a.all, "list passing cases too");
  sub->add_option("--json", a.json, "write the report as JSON");
  sub->add_option("--junit", a.junit, "write the report as JUnit XML");
  sub->add_option("--html", a.html, "write the report as one self-contained HTML page, with pictures of the failing cases");
  a.progress.add(sub);
  sub->add_option("--threads", a.threads, "comparisons in parallel")->check(CLI::Range(1, 1024));
}

struct ReportArgs {
  std::string json, html;
};

int run_report(const ReportArgs& a) {
  require_parent_dir(a.html);
  const std::vector<unsigned char> bytes = read_regular_file(a.json);
  const std::string page =
      conformance::html_report_from_json(a.json, std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  write_file_atomic(a.html, std::vector<unsigned char>(page.begin(), page.end()));
  return 0;
}

struct MergeArgs {
  std::vector<std::string> reports;
  std::string json, junit, html;
  bool all = false;
};

int run_merge(const MergeArgs& a) {
  for (const auto& p : {a.json, a.junit, a.html})
    if (!p.empty()) require_parent_dir(p);
  std::vector<std::string> texts;
  for (const auto& path : a.reports) {
    const std::vector<unsigned char> bytes = read_regular_file(path);
    texts.emplace_back(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  const conformance::MergedReport m = conformance::merge_reports(a.reports, texts);
  // Every output made before any is written: a refusal leaves nothing.
  const std::string html = a.html.empty() ? "" : conformance::html_report_from_json(a.json.empty() ? "merged" : a.json, m.json);
  const std::string junit = a.junit.empty() ? "" : conformance::junit_report(m.report);
  std::fputs(conformance::text_report(m.report, a.all).c_str(), stdout);
  auto put = [](const std::string& path, const std::string& s) {
    write_file_atomic(path, std::vector<unsigned char>(s.begin(), s.end()));
  };
  if (!a.json.empty()) put(a.json, m.json);
  if (!a.junit.empty()) put(a.junit, junit);
  if (!a.html.empty()) put(a.html, html);
  return conformance::gate_exit_status(m.report, m.report.require_all);
}

}  // namespace

Command add_merge(CLI::App& app) {
  auto a = std::make_shared<MergeArgs>();
  CLI::App* sub = app.add_subcommand("merge", "one verdict from the JSON reports of every shard of a run or check (--shard k/n --json)");
  sub->add_option("REPORT", a->reports, "the shards' JSON reports")->required();
  sub->add_flag("--all", a->all, "list passing cases too");
  sub->add_option("--json", a->json, "write the merged report as JSON");
  sub->add_option("--junit", a->junit, "write it as JUnit XML");
  sub->add_option("--html", a->html, "write it as one self-contained HTML page");
  return {sub, [a] { return run_merge(*a); }};
}

Command add_report(CLI::App& app) {
  auto a = std::make_shared<ReportArgs>();
  CLI::App* sub = app.add_subcommand("report", "another format of a saved JSON report (run or check --json)");
  sub->add_option("REPORT", a->json, "the JSON report")->required();
  sub->add_option("--html", a->html, "write it as one self-contained HTML page")->required();
  return {sub, [a] { return run_report(*a); }};
}

Command add_run(CLI::App& app) {
  auto a = std::make_shared<GateArgs>();
  CLI::App* sub = app.add_subcommand("run", "conformance gate: runs an implementation through the adapter protocol");
  common(sub, *a);
  sub->add_option("--impl", a->impl, "the implementation's command");
  sub->add_option("--plugin", a->plugin, "a shared library implementing conformance/include/attnoracle/plugin.h");
  sub->add_option("--timeout", a->timeout, "seconds for the implementation's whole run")->check(CLI::Range(0.0, 1e7));
  sub->add_option("--work", a->work, "directory for inputs and outputs (default: a temporary one)");
  sub->add_flag("--keep", a->keep, "keep the temporary work directory");
  return {sub, [a] { return run_run(*a); }};
}

Command add_check(CLI::App& app) {
  auto a = std::make_shared<GateArgs>();
  CLI::App* sub = app.add_subcommand("check", "the gate on results produced offline (<id>.safetensors in RDIR)");
  common(sub, *a);
  sub->add_option("--results", a->results, "directory of results")->required();
  return {sub, [a] { return run_check(*a); }};
}

}  // namespace attnoracle::cli
