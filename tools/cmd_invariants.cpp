// attnoracle invariants --impl 'CMD': metamorphic checks of an implementation, no golden data.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>


#include <nlohmann/json.hpp>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "cli.hpp"
#include "serving_problems.hpp"

namespace attnoracle::cli {
namespace {

struct InvariantsArgs {
  std::string impl;
  int problems = 12;
  std::uint64_t seed = 1;
  std::vector<std::string> dtypes{"F32"};
  std::vector<std::string> kinds{"sdpa", "mha"};
  int max_len = 12;
  // key counts of the long problems: past 256, and block boundaries of flash kernels
  std::vector<int> long_keys{257, 64, 65, 128, 129, 300};
  int dim = 8;
  // toy; kernel: head dims, group sizes and key counts of shipped kernels; serving: paged KV
  // caches and split-KV (serving_problems.hpp)
  std::string shapes = "toy";
  std::string returns;         // with returns_given: the optional outputs asked and compared
  CLI::Option* returns_option = nullptr;
  std::string profile = "fp32";
  double safety = 0;  // 0: the profile's
  double timeout = 600;
  std::string work, failures, json;  // failures: a fresh temporary directory when empty
  bool keep = false;
  int reruns = 0;                // 0: no relation deterministic
  bool deterministic = false;    // declared: --reruns 3 unless given
  bool batch_invariant = false;  // declared: relation batch_invariance
};

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The sizes of --shapes kernel: head dims (Dk, Dv) kernels accept, query heads per kv head
// (two kv heads), and query and key counts at the block edges of tiled kernels (64, 128, 256,
// 128k + 64), taken in turn.
constexpr std::pair<std::int64_t, std::int64_t> kKernelDims[] = {{64, 64},   {128, 128}, {96, 96},
                                                                 {256, 256}, {192, 128}, {192, 192}};
constexpr std::int64_t kKernelGroups[] = {1, 2, 3, 4, 5, 6, 7, 8, 16};
constexpr std::int64_t kKernelKeys[] = {1, 17, 63, 64, 65, 127, 128, 129, 192, 255, 256, 257, 320};
constexpr std::int64_t kKernelQueries[] = {1, 17, 63, 65, 128};

// Problem k of the run: every option cycles through its values; sizes are drawn from the seed.
vectors::ProblemSpec problem_spec(const InvariantsArgs& a, const conformance::Profile& profile, int k,
                                  std::uint64_t& seed) {
  std::uint64_t s = mix(a.seed * 0x100000001b3ULL + static_cast<std::uint64_t>(k));
  seed = s;
  auto draw = [&](std::int64_t lo, std::int64_t hi) {  // uniform in [lo, hi]
    s = mix(s);
    return lo + static_cast<std::int64_t>(s % static_cast<std::uint64_t>(hi - lo + 1));
  };
  if (a.shapes == "serving")
    return serving_problem(k, *dtype_from_name(a.dtypes[static_cast<std::size_t>(k) % a.dtypes.size()]), profile, draw);
  vectors::ProblemSpec p;
  const std::string& kind = a.kinds[static_cast<std::size_t>(k) % a.kinds.size()];
  p.kind = kind == "mha" ? Kind::Mha : Kind::Sdpa;
  p.dtype = *dtype_from_name(a.dtypes[static_cast<std::size_t>(k / static_cast<int>(a.kinds.size())) % a.dtypes.size()]);
  static const Causal causal[] = {Causal::None, Causal::TopLeft, Causal::BottomRight};
  p.causal = causal[k % 3];
  p.Nq = draw(1, a.max_len);
  p.Nk = draw(1, a.max_len);
  // Problems 1 and 2 of every 4 (one of each kind) take their key counts from --long-keys in
  // turn; bottom-right alignment, so that their causal rows are long too.
  const bool no_long = a.long_keys.size() == 1 && a.long_keys[0] == 0;
  if (!no_long && (k % 4 == 1 || k % 4 == 2)) {
    p.Nk = a.long_keys[static_cast<std::size_t>((k / 4) * 2 + k % 4 - 1) % a.long_keys.size()];
    if (p.causal == Causal::TopLeft) p.causal = Causal::BottomRight;
  }
  p.Dk = draw(1, a.dim);
  p.Dv = draw(1, a.dim);
  p.B = draw(1, 2);
  if (p.kind == Kind::Sdpa) {
    p.Hkv = draw(1, 3);
    p.Hq = p.Hkv * draw(1, 3);
  } else {
    p.Hq = p.Hkv = draw(1, 3);
    p.D = draw(1, a.dim);
    p.Dout = draw(1, a.dim);
  }
  // Kernel sizes for kind sdpa; kind mha keeps the toy ones (the reference certifies its rows
  // through MPFR, as those with softcap, which get a few queries).
  const bool kernel = a.shapes == "kernel" && p.kind == Kind::Sdpa;
  if (kernel) {
    // the n-th problem of kind sdpa takes the n-th group size and head dims
    const auto n = static_cast<std::size_t>(k) / a.kinds.size();
    const auto dims = kKernelDims[n % std::size(kKernelDims)];
    p.Dk = dims.first;
    p.Dv = dims.second;
    p.Nk = kKernelKeys[static_cast<std::size_t>(k) % std::size(kKernelKeys)];
    p.Nq = k % 5 == 4 ? 1 + k % 3 : kKernelQueries[static_cast<std::size_t>(k) % std::size(kKernelQueries)];
    p.B = 1;
    p.Hkv = 2;
    p.Hq = 2 * kKernelGroups[n % std::size(kKernelGroups)];
  }
  p.masked_rows = MaskedRows::Zero;
  // outputs the implementation does not return are not asked for
  p.want_weights = profile.returns_weights;
  p.want_lse = profile.returns_lse;
  static const vectors::MaskKind masks[] = {vectors::MaskKind::None, vectors::MaskKind::KeyPadding,
                                            vectors::MaskKind::Random, vectors::MaskKind::TailBlock};
  p.mask = masks[(k / 3) % (kernel ? 4 : 3)];
  static const vectors::BiasKind biases[] = {vectors::BiasKind::None, vectors::BiasKind::Alibi,
                                             vectors::BiasKind::Random};
  p.bias = biases[(k / 2) % 3];
  if (k % 4 == 3) p.window = kernel ? std::make_pair(draw(0, 130), draw(0, 130)) : std::make_pair(draw(0, 3), draw(0, 3));
  if (k % 5 == 4) p.softcap = "5";
  p.query_mask = k % 6 == 5 || k % 8 == 4;  // mha and sdpa problems
  if (k % 7 == 6) {  // padded varlen, three sequences, each with its own alignment
    static const vectors::SeqlensKind lens[] = {vectors::SeqlensKind::Varlen, vectors::SeqlensKind::Decode,
                                                vectors::SeqlensKind::Chunked};
    p.seqlens = lens[(k / 7) % 3];
    p.B = 3;
  }
  p.generator = "normal";
  return p;
}

// The problem as its reruns ask it: with dout and the gradients of its kind where the profile
// returns gradients and the problem has them (not paged, split or FP8).
vectors::ProblemSpec with_gradients(vectors::ProblemSpec p, const conformance::Profile& profile) {
  if (!profile.returns_gradients || p.page_size > 0 || p.kv_split_size > 0 || is_fp8(p.dtype)) return p;
  if (p.kind == Kind::Mha) {
    p.want_mha.fill(true);
    p.want_mha[1] = !p.self_attention;  // dx_kv
  } else {
    p.want_dq = p.want_dk = p.want_dv = true;
    p.want_dbias = p.bias != vectors::BiasKind::None;
    p.want_dsinks = !p.sinks.empty();
  }
  return vectors::problem_error(p) ? vectors::ProblemSpec{} : p;
}

void write_json(const std::string& path, const InvariantsArgs& a, const conformance::MetamorphicOptions& opt,
                const conformance::MetamorphicReport& r,
                const std::vector<std::pair<std::string, vectors::ProblemSpec>>& specs) {
  nlohmann::ordered_json j;
  j["impl"] = a.impl;
  j["seed"] = a.seed;
  j["problems"] = a.problems;
  j["profile"] = a.profile;
  j["passed"] = r.passed;
  j["violated"] = r.violated;
  j["skipped"] = r.skipped;
  j["bitwise"] = r.bitwise;
  j["reruns"] = opt.reruns;
  j["batch_invariant"] = opt.batch_invariant;
  j["problem_sizes"] = nlohmann::ordered_json::array();
  for (const auto& [id, p] : specs)
    j["problem_sizes"].push_back({{"problem", id}, {"B", p.B}, {"Hq", p.Hq}, {"Hkv", p.Hkv}, {"Nq", p.Nq},
                                  {"Nk", p.Nk}, {"Dk", p.Dk}, {"Dv", p.Dv}, {"page_size", p.page_size},
                                  {"kv_split_size", p.kv_split_size}});
  j["relations"] = nlohmann::ordered_json::array();
  for (const auto& x : r.results) {
    const char* st = x.status == conformance::RelationResult::Status::Pass       ? "pass"
                     : x.status == conformance::RelationResult::Status::Violated ? "violated"
                                                                            : "skipped";
    j["relations"].push_back({{"problem", x.problem},
                              {"invariant", x.relation},
                              {"twin", x.what},
                              {"status", st},
                              {"bitwise", x.bitwise},
                              {"worst_ratio", std::isfinite(x.worst) ? x.worst : -1.0},
                              {"detail", x.detail}});
  }
  std::ostringstream os;
  os << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";  // not UTF-8: U+FFFD
  const std::string s = os.str();
  write_file_atomic(path, std::vector<unsigned char>(s.begin(), s.end()));
}

int run_invariants(const InvariantsArgs& a) {
  namespace fs = std::filesystem;
  for (const auto& d : a.dtypes)
    if (!dtype_from_name(d) || !is_float_format(*dtype_from_name(d)))
      throw InputError("--dtypes", "", "unknown dtype '" + d + "' (F64, F32, F16, BF16)");
  for (const auto& k : a.kinds)
    if (k != "sdpa" && k != "mha") throw InputError("--kinds", "", "unknown kind '" + k + "' (sdpa, mha)");
  if (a.shapes != "toy" && a.shapes != "kernel" && a.shapes != "serving")
    throw InputError("--shapes", "", "unknown shapes '" + a.shapes + "' (toy, kernel, serving)");
  const bool returns_given = a.returns_option && a.returns_option->count() > 0;
  if (returns_given)
    for (std::size_t from = 0; from <= a.returns.size();) {
      const std::size_t comma = std::min(a.returns.find(',', from), a.returns.size());
      const std::string one = a.returns.substr(from, comma - from);
      if (!one.empty() && one != "weights" && one != "lse" && one != "scores" && one != "gradients" && one != "none")
        throw InputError("--returns", "", "unknown output '" + one + "' (weights, lse, scores, gradients; '' or none: out only)");
      from = comma + 1;
    }
  if (a.long_keys.size() > 1)
    for (int n : a.long_keys)
      if (n == 0) throw InputError("--long-keys", "", "0 stands alone (no long problems), not in a list");
  if (!a.json.empty()) require_parent_dir(a.json);
  conformance::MetamorphicOptions opt;
  opt.command = a.impl;
  opt.profile = conformance::load_profile(a.profile);
  if (a.safety > 0) opt.profile.safety = a.safety;
  if (returns_given) conformance::declare_returns(opt.profile, a.returns);
  opt.timeout = a.timeout;
  // what the profile declares, unless the flags ask more (--reruns N sets the count)
  opt.batch_invariant = a.batch_invariant || opt.profile.batch_invariant;
  opt.reruns = a.reruns >= 2 ? a.reruns : opt.profile.deterministic ? 3 : 0;
  opt.failures_dir = a.failures;
  const bool temp_failures = a.failures.empty();
  if (temp_failures) opt.failures_dir = make_temp_dir("attnoracle-invariants-failures");
  // Both temporary directories go on every path out, a thrown error included; the failures
  // directory stays when a relation was violated (its cases are the replay), the work directory
  // with --keep.
  TempDirGuard failures_guard(temp_failures ? opt.failures_dir : "");
  const bool temp_work = a.work.empty();
  opt.work_dir = temp_work ? make_temp_dir("attnoracle-invariants") : a.work;
  TempDirGuard work_guard(temp_work ? opt.work_dir : "");
  if (a.keep) work_guard.release();

  std::vector<std::pair<std::string, SafeTensorsFile>> problems, reruns;
  std::vector<std::pair<std::string, vectors::ProblemSpec>> specs;
  for (int k = 0; k < a.problems; ++k) {
    std::uint64_t seed = 0;
    const vectors::ProblemSpec spec = problem_spec(a, opt.profile, k, seed);
    char id[64];
    std::snprintf(id, sizeof id, "p%03d-%s-%s", k, spec.kind == Kind::Mha ? "mha" : "sdpa",
                  std::string(dtype_name(spec.dtype)).c_str());
    // The gradients where the profile returns them: the twins relate them on the toy problems
    // that are not long (each twin's gradient limits need the reference's backward of both
    // sides), the reruns compare them on every problem.
    const vectors::ProblemSpec grad = with_gradients(spec, opt.profile);
    const bool twin_grads = grad.wants_gradients() && a.shapes == "toy" && spec.Nk <= a.max_len;
    problems.emplace_back(id, vectors::make_problem(twin_grads ? grad : spec, seed));
    specs.emplace_back(id, spec);
    if (opt.reruns < 2) continue;
    reruns.emplace_back(id, !twin_grads && grad.wants_gradients() ? vectors::make_problem(grad, seed)
                                                                   : problems.back().second);
  }
  conformance::MetamorphicReport r = conformance::run_metamorphic(problems, opt);
  if (opt.reruns >= 2) conformance::check_reruns(reruns, opt, r);
  if (r.violated) failures_guard.release();

  for (const auto& x : r.results)
    if (x.status == conformance::RelationResult::Status::Violated)
      std::printf("violated  %s  %s (%s): %s\n", x.problem.c_str(),
                  x.relation.c_str(), x.what.c_str(), x.detail.c_str());
  if (!r.adapter_note.empty()) std::printf("note: %s\n", r.adapter_note.c_str());
  std::printf("%zu relations on %d problems (seed %llu, profile %s%s%s): %zu passed (%zu bit for bit), "
              "%zu violated, %zu skipped\n",
              r.results.size(), a.problems, static_cast<unsigned long long>(a.seed), a.profile.c_str(),
              opt.reruns >= 2 ? (", " + std::to_string(opt.reruns) + " runs each").c_str() : "",
              opt.batch_invariant ? ", batch invariant" : "", r.passed, r.bitwise, r.violated, r.skipped);
  if (r.violated)
    std::printf("replay: the failing cases are in %s; rerun with --seed %llu --problems %d\n",
                opt.failures_dir.c_str(), static_cast<unsigned long long>(a.seed), a.problems);
  if (!a.json.empty()) write_json(a.json, a, opt, r, specs);
  return r.violated ? 1 : 0;
}

}  // namespace

Command add_invariants(CLI::App& app) {
  auto a = std::make_shared<InvariantsArgs>();
  CLI::App* sub = app.add_subcommand("invariants", "metamorphic checks of an implementation, no golden data");
  sub->add_option("--impl", a->impl, "the implementation's command (adapter protocol)")->required();
  sub->add_option("--problems", a->problems, "number of seeded problems")->check(CLI::Range(1, 100000));
  sub->add_option("--seed", a->seed, "seed of the problems");
  sub->add_option("--dtypes", a->dtypes, "input dtypes, cycled (F64, F32, F16, BF16)")->delimiter(',');
  sub->add_option("--kinds", a->kinds, "kinds, cycled (sdpa, mha)")->delimiter(',');
  sub->add_option("--max-len", a->max_len, "largest Nq, and Nk of the problems not long")->check(CLI::Range(1, 4096));
  sub->add_option("--long-keys", a->long_keys,
                  "key counts, taken in turn, of problems 1 and 2 of every 4 (0 alone: none long)")
      ->delimiter(',')
      ->check(CLI::Range(0, 4096));
  sub->add_option("--dim", a->dim, "largest head and model dimension")->check(CLI::Range(1, 1024));
  sub->add_option("--shapes", a->shapes,
                  "toy (sizes drawn up to --max-len and --dim, long key counts from --long-keys), or kernel: sdpa "
                  "problems with head dims 64 to 256 and 192/128, 1 to 8 and 16 query heads per kv head, query and "
                  "key counts at block edges (--max-len, --dim and --long-keys do not apply to them); or serving: "
                  "sdpa problems with paged KV caches (page sizes 16, 1, 64, 48, NHD and HND, shuffled and shared "
                  "pages), decode, chunked and varlen prefill over 2 to 4 batch rows, 1 to 8 query heads per kv head, "
                  "head dims 64 to 256, and a kv split size on every other one (--kinds, --max-len, --dim and "
                  "--long-keys do not apply)");
  a->returns_option = sub->add_option("--returns", a->returns,
                                      "optional outputs the implementation returns, as for run: weights,lse, and gradients "
                                      "(related by the twins of the toy problems up to --max-len keys, compared by "
                                      "the reruns); '' or none: out only (default: all)");
  sub->add_option("--profile", a->profile,
                  "the gate's profile, as for run: fp64, fp32, fp16, bf16, flash-fp16, flash-bf16, or a JSON "
                  "file; its arithmetic gives each side's limit, other input dtypes are skipped");
  sub->add_option("--safety", a->safety, "factor on each side's error bound (default: the profile's)")
      ->check(CLI::Range(1.0, 1e6));
  sub->add_option("--timeout", a->timeout, "seconds for the implementation's whole run")->check(CLI::Range(0.0, 1e6));
  sub->add_option("--work", a->work, "directory for the case files and results (default: a temporary one)");
  sub->add_option("--failures", a->failures,
                  "where failing cases are written for replay (default: a fresh temporary directory, printed)");
  sub->add_option("--json", a->json, "write the report as JSON");
  sub->add_flag("--keep", a->keep, "keep the temporary work directory");
  CLI::Option* reruns = sub->add_option(
      "--reruns", a->reruns,
      "run the implementation N times on every problem (each a run of its own), asking the gradients too where "
      "the profile returns them, and check that no bit changes (relation deterministic)")
      ->check(CLI::Range(2, 100));
  sub->add_flag("--deterministic", a->deterministic,
                "the implementation declares itself deterministic: --reruns 3 unless --reruns is given (as a "
                "profile with \"deterministic\": true)");
  sub->add_flag("--batch-invariant", a->batch_invariant,
                "the implementation declares itself batch invariant: a batch row's results keep their bits alone "
                "and among other rows (relation batch_invariance; as a profile with \"batch_invariant\": true)");
  return {sub, [a, reruns] {
            if (a->deterministic && reruns->count() == 0) a->reruns = 3;
            return run_invariants(*a);
          }};
}

}  // namespace attnoracle::cli
