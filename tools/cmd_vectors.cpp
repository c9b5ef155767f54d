// attnoracle gen SPEC -o DIR: generates a vector set from a suite spec.
// attnoracle verify DIR: checks a vector set.
#include <cstdio>
#include <memory>
#include <string>

#include "attnoracle/conformance/text.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/vectors/generate.hpp"
#include "attnoracle/vectors/verify.hpp"
#include "cli.hpp"
#include "shard.hpp"

namespace attnoracle::cli {
namespace {

// The options bound straight to the library's, with the command's defaults.
struct GenArgs {
  vectors::GenOptions o = [] {
    vectors::GenOptions d;
    d.jobs = default_threads();
    return d;
  }();
  std::string shard;
  bool quiet = false;
  ProgressFlags progress;
};

int run_gen(const GenArgs& a) {
  vectors::GenOptions o = a.o;
  if (!a.shard.empty()) {
    const Shard s = parse_shard(a.shard);
    o.sharded = true;
    o.shard_k = s.k;
    o.shard_n = s.n;
    if (!a.quiet && !s.source.empty()) std::fprintf(stderr, "gen: shard %d/%d (from %s)\n", s.k, s.n, s.source.c_str());
  }
  require_parent_dir(o.out_dir);

  // On a terminal a progress line; elsewhere (or with --no-progress) one line per case.
  Progress line("gen", !a.quiet && a.progress.wanted());
  vectors::GenCallbacks cb;
  cb.violation = [&line](const std::string& id, const oracle::InvariantViolation& e) {
    line.clear();
    print_violations(id, e);
  };
  if (line.shown())
    cb.progress = [&line](const vectors::CaseEvent& e) { line.update(e.done, e.total); };
  else if (!a.quiet)
    cb.progress = [](const vectors::CaseEvent& e) {
      const char* what = e.what == vectors::CaseEvent::Present  ? " present"
                         : e.what == vectors::CaseEvent::Failed ? " FAILED"
                                                                : "";
      std::fprintf(stderr, "[%zu/%zu] %s  %s%s\n", e.done, e.total, e.spec->id.c_str(),
                   conformance::duration_text(e.seconds).c_str(), what);
      std::fflush(stderr);
    };
  const vectors::GenSummary s = vectors::generate(o, cb);
  line.clear();
  if (!a.quiet || s.failed) {
    std::fprintf(stderr, "%s: %zu cases written, %zu already present, %zu failed",
                 o.out_dir.c_str(), s.written, s.present, s.failed);
    if (s.manifest_written)
      std::fprintf(stderr, "; manifest written (%zu cases)\n", s.suite_cases);
    else if (!o.ids.empty())
      std::fprintf(stderr, "; %zu of the suite's %zu cases asked for (--case), no manifest written\n", s.selected,
                   s.suite_cases);
    else if (o.sharded)
      std::fprintf(stderr,
                   "; shard %d/%d done, %zu of %zu cases still missing; run gen without --shard "
                   "to finish and write the manifest\n",
                   o.shard_k, o.shard_n, s.missing, s.suite_cases);
    else
      std::fprintf(stderr, "; no manifest written\n");
  }
  return s.failed ? 1 : 0;
}

struct VerifyArgs {
  vectors::VerifyOptions o = [] {
    vectors::VerifyOptions d;
    d.jobs = default_threads();
    return d;
  }();
  bool quiet = false;
  ProgressFlags progress;
};

int run_verify(const VerifyArgs& a) {
  const vectors::VerifyOptions& o = a.o;
  Progress line("verify", !a.quiet && a.progress.wanted());
  vectors::VerifyReport r;
  if (line.shown())
    r = vectors::verify(o, [&line](std::size_t done, std::size_t total) { line.update(done, total); });
  else
    r = vectors::verify(o);
  line.clear();
  for (const auto& p : r.problems) std::printf("%s: %s\n", p.where.c_str(), p.reason.c_str());
  std::fflush(stdout);
  if (!a.quiet)
    std::fprintf(stderr, "%s: %zu cases, %zu checked%s, %zu problem%s\n", o.dir.c_str(), r.cases,
                 r.checked, o.recompute ? " and recomputed" : "", r.problems.size(),
                 r.problems.size() == 1 ? "" : "s");
  return r.problems.empty() ? 0 : 1;
}

}  // namespace

Command add_gen(CLI::App& app) {
  auto a = std::make_shared<GenArgs>();
  CLI::App* sub = app.add_subcommand("gen", "generates a vector set from a suite spec");
  sub->add_option("SPEC", a->o.spec_path, "suite spec (JSON)")->required();
  sub->add_option("-o,--output", a->o.out_dir, "output directory (manifest.json, cases/)")->required();
  sub->add_option("--jobs", a->o.jobs, "cases evaluated in parallel")->check(CLI::Range(1, 1024));
  sub->add_option("--shard", a->shard,
                  "k/n: only cases with index % n == k, no manifest (finish with a run without); auto: k and n "
                  "from a Slurm array, a Kubernetes indexed Job or a CI matrix (ATTNORACLE_SHARD_INDEX/COUNT)");
  sub->add_option("--case", a->o.ids, "only these case ids (no manifest written, as with --shard)")->delimiter(',');
  sub->add_option("--threads-per-case", a->o.threads_per_case, "threads of each evaluation")
      ->check(CLI::Range(1, 1024));
  sub->add_option("--max-precision", a->o.max_precision, "Ziv's cap in bits")
      ->check(CLI::Range(64L, 1L << 20));
  sub->add_flag("--model", a->o.model,
                "store the statistical model's magnitudes with the golden tensors of sdpa cases (check reads "
                "them instead of computing them from the inputs)");
  sub->add_flag("-q,--quiet", a->quiet, "no progress on stderr");
  a->progress.add(sub);
  return {sub, [a] { return run_gen(*a); }};
}

Command add_verify(CLI::App& app) {
  auto a = std::make_shared<VerifyArgs>();
  CLI::App* sub = app.add_subcommand("verify", "checks a vector set");
  sub->add_option("DIR", a->o.dir, "vector set directory")->required();
  sub->add_option("--manifest", a->o.manifest,
                  "check the set against this manifest (a committed one) instead of DIR/manifest.json, which must "
                  "equal it where present");
  sub->add_flag("--recompute", a->o.recompute,
                "evaluate every case again and compare the golden tensors bit for bit");
  sub->add_flag("--all", a->o.all, "report every problem, not only the first");
  sub->add_option("--jobs", a->o.jobs, "cases checked in parallel")->check(CLI::Range(1, 1024));
  sub->add_option("--max-precision", a->o.max_precision, "Ziv's cap in bits (as in gen)")
      ->check(CLI::Range(64L, 1L << 20));
  sub->add_flag("-q,--quiet", a->quiet, "no summary and no progress on stderr");
  a->progress.add(sub);
  return {sub, [a] { return run_verify(*a); }};
}

}  // namespace attnoracle::cli
