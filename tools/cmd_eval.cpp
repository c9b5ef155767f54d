// attnoracle eval CASE -o OUT: certified evaluation of one case file.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli.hpp"

namespace attnoracle::cli {
namespace {

struct EvalArgs {
  std::string input, output;
  int threads = default_threads();
  long max_precision = 2048;
  std::int64_t twin_units = 16;
  std::int64_t gradient_slices = 1;
  bool quiet = false;
  bool no_fast_path = false;
  ProgressFlags progress;
};

// The big float inputs whose F64 values encode back to exactly their file bytes: those bytes
// are dropped while the case is evaluated and written again from the values for the output
// file, so that memory holds one copy of the inputs, not two.
std::vector<RawTensor*> drop_float_bytes(Case& c) {
  std::vector<RawTensor*> dropped;
  const std::pair<const char*, const FloatTensor*> inputs[] = {
      {"q", &c.q}, {"k", &c.k}, {"v", &c.v}, {"x_q", &c.x_q}, {"x_kv", &c.x_kv}};
  for (const auto& [name, f] : inputs) {
    if (c.kv_form && std::string_view(name) == "k") continue;  // stored_kv reads k from the file
    RawTensor* t = c.file.find(name);
    if (!t || t->dtype != f->dtype || t->data.empty()) continue;
    const std::size_t w = dtype_size(t->dtype);
    if (t->data.size() != f->values.size() * w) continue;
    unsigned char buf[4096];  // encoded by chunks, each compared at once
    const std::size_t per = sizeof buf / w;
    bool exact = true;
    try {
      for (std::size_t k = 0; k < f->values.size() && exact; k += per) {
        const std::size_t n = std::min(per, f->values.size() - k);
        for (std::size_t e = 0; e < n; ++e) encode_float(t->dtype, f->values[k + e], buf + e * w);
        exact = std::memcmp(buf, t->data.data() + k * w, n * w) == 0;
      }
    } catch (const std::exception&) {
      exact = false;  // a value the dtype cannot hold (descaled F8 inputs)
    }
    if (!exact) continue;  // a NaN's payload, a descaled input: the bytes stay
    std::vector<unsigned char>().swap(t->data);
    dropped.push_back(t);
  }
  return dropped;
}

void restore_float_bytes(const Case& c, const std::vector<RawTensor*>& dropped) {
  for (RawTensor* t : dropped) {
    const FloatTensor& f = t->name == "q" ? c.q : t->name == "k" ? c.k : t->name == "v" ? c.v
                           : t->name == "x_q" ? c.x_q : c.x_kv;
    const std::size_t w = dtype_size(t->dtype);
    t->data.resize(f.values.size() * w);
    for (std::size_t k = 0; k < f.values.size(); ++k) encode_float(t->dtype, f.values[k], t->data.data() + k * w);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int run_eval(const EvalArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  require_parent_dir(a.output);
  Case c = read_case(a.input);
  const std::vector<RawTensor*> dropped = drop_float_bytes(c);
  const double reading = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  EvalOptions opt;
  opt.threads = a.threads;
  opt.max_precision = a.max_precision;
  opt.fast_path = !a.no_fast_path;
  oracle::CheckOptions check;
  check.twin_units = a.twin_units;
  check.gradient_twin_slices = a.gradient_slices;
  // On a terminal a line: the units of each pass done (forward rows, the gradients' passes,
  // the oracle's twins); erased before anything else is printed.
  Progress line("eval", !a.quiet && a.progress.wanted());
  if (line.shown())
    opt.progress = [&line](const std::string& unit, std::uint64_t done, std::uint64_t total) {
      line.update(static_cast<std::size_t>(done), static_cast<std::size_t>(total), unit);
    };
  EvalResult r;
  try {
    r = oracle::certified_evaluate(c, opt, check);
  } catch (const FullyMaskedRow& e) {
    throw InputError(a.input, c.kind == Kind::Merge ? "lse_partial" : "mask", e.what());
  } catch (const oracle::InvariantViolation& e) {
    line.clear();
    print_violations(a.input, e);
    return 1;
  }
  line.clear();
  const double certified = seconds_since(t1);  // the evaluation, then the oracle's twins
  const auto t2 = std::chrono::steady_clock::now();
  restore_float_bytes(c, dropped);
  write_golden_file(a.output, c, r);
  const double writing = seconds_since(t2), whole = seconds_since(t0);
  if (!a.quiet) {
    const EvalStats& st = r.stats;
    std::string fast = st.fast_path_note.empty()
                           ? std::to_string(st.rows_fast) + " by the fast path, " +
                                 std::to_string(st.rows - st.rows_fast) + " by MPFR (" +
                                 std::to_string(st.rows_fallback) + " fell back)"
                           : "all by MPFR (fast path: " + st.fast_path_note + ")";
    if (c.wants_gradients())
      fast += "; gradient units " + std::to_string(st.grad_units_fast) + " by the fast path (" +
              std::to_string(st.grad_units_fallback) + " fell back to MPFR)";
    std::fprintf(stderr,
                 "%s: %llu golden elements, %llu undecided; %llu rows, %s, %llu needed more "
                 "precision (up to %ld bits); %.3f s on %d thread%s (reading %.3f s, evaluation "
                 "%.3f s, oracle %.3f s, writing %.3f s)\n",
                 a.output.c_str(), static_cast<unsigned long long>(st.elements),
                 static_cast<unsigned long long>(st.undecided), static_cast<unsigned long long>(st.rows),
                 fast.c_str(), static_cast<unsigned long long>(st.rows_raised),
                 static_cast<long>(st.max_precision_reached), whole, a.threads,
                 a.threads == 1 ? "" : "s", reading, st.seconds, certified - st.seconds, writing);
  }
  return 0;
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* sub = app.add_subcommand("eval", "certified evaluation of one case file");
  sub->add_option("CASE", a->input, "case file (safetensors)")->required();
  sub->add_option("-o,--output", a->output, "output case file with golden tensors")->required();
  sub->add_option("--threads", a->threads, "worker threads")->check(CLI::Range(1, 1024));
  sub->add_option("--max-precision", a->max_precision,
                  "Ziv's cap in bits; past it an element is recorded as undecided")
      ->check(CLI::Range(64L, 1L << 20));
  sub->add_option("--oracle-rows", a->twin_units,
                  "row units given the oracle's metamorphic checks (every row gets the others)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  sub->add_option("--oracle-gradient-slices", a->gradient_slices,
                  "(batch, kv head) slices given the oracle's gradient twins, each up to two "
                  "backward evaluations of the slice")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  sub->add_flag("--no-fast-path", a->no_fast_path, "evaluate every row with MPFR (same bytes, slower)");
  sub->add_flag("-q,--quiet", a->quiet, "no summary and no progress on stderr");
  a->progress.add(sub);
  return {sub, [a] { return run_eval(*a); }};
}

}  // namespace attnoracle::cli
