// The attnoracle command: parses arguments and calls the libraries.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>

#include "attnoracle/case_file.hpp"
#include "attnoracle/error.hpp"
#include "attnoracle/evaluate.hpp"
#include "attnoracle/oracle.hpp"
#include "attnoracle/safetensors.hpp"

namespace {

using namespace attnoracle;

[[noreturn]] void fail(const std::string& line) {
  std::cerr << "attnoracle: error: " << line << std::endl;
  std::exit(2);
}

void require_output_dir(const std::string& out) {
  const std::filesystem::path parent = std::filesystem::path(out).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent))
    throw InputError(out, "", "directory " + parent.string() + " does not exist");
}

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

struct EvalArgs {
  std::string input, output;
  int threads = default_threads();
  long max_precision = 2048;
  std::int64_t twin_units = 16;
  bool quiet = false;
};

// A violated invariant: the report on stderr, exit status 1, nothing written.
[[noreturn]] void violated(const std::string& file, const oracle::InvariantViolation& e) {
  const auto& v = e.violations();
  std::cerr << "attnoracle: invariant violated: " << file << ": " << v.size() << " violation"
            << (v.size() == 1 ? "" : "s") << "; nothing written\n";
  for (std::size_t k = 0; k < v.size() && k < 20; ++k) std::cerr << "  " << v[k].message() << "\n";
  if (v.size() > 20) std::cerr << "  ... and " << v.size() - 20 << " more\n";
  std::cerr.flush();
  std::exit(1);
}

int run_eval(const EvalArgs& a) {
  require_output_dir(a.output);
  const Case c = read_case(a.input);
  EvalOptions opt;
  opt.threads = a.threads;
  opt.max_precision = a.max_precision;
  oracle::CheckOptions check;
  check.twin_units = a.twin_units;
  EvalResult r;
  try {
    r = oracle::certified_evaluate(c, opt, check);
  } catch (const FullyMaskedRow& e) {
    throw InputError(a.input, "mask", e.what());
  } catch (const oracle::InvariantViolation& e) {
    violated(a.input, e);
  }
  write_file_atomic(a.output, serialize_safetensors(golden_file(c, r)));
  if (!a.quiet) {
    std::fprintf(stderr,
                 "%s: %llu golden elements, %llu undecided; %llu rows, %llu needed more "
                 "precision (up to %ld bits); %.3f s on %d thread%s\n",
                 a.output.c_str(), static_cast<unsigned long long>(r.stats.elements),
                 static_cast<unsigned long long>(r.stats.undecided),
                 static_cast<unsigned long long>(r.stats.rows),
                 static_cast<unsigned long long>(r.stats.rows_raised),
                 static_cast<long>(r.stats.max_precision_reached), r.stats.seconds, a.threads,
                 a.threads == 1 ? "" : "s");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnoracle: certified reference and conformance oracle for attention"};
  app.set_version_flag("--version", std::string("attnoracle ") + ATTNORACLE_VERSION);
  app.require_subcommand(1);

  EvalArgs ea;
  CLI::App* eval = app.add_subcommand("eval", "certified evaluation of one case file");
  eval->add_option("CASE", ea.input, "case file (safetensors)")->required();
  eval->add_option("-o,--output", ea.output, "output case file with golden tensors")->required();
  eval->add_option("--threads", ea.threads, "worker threads")->check(CLI::Range(1, 1024));
  eval->add_option("--max-precision", ea.max_precision,
                   "Ziv's cap in bits; past it an element is recorded as undecided")
      ->check(CLI::Range(64L, 1L << 20));
  eval->add_option("--oracle-rows", ea.twin_units,
                   "row units given the oracle's metamorphic checks (every row gets the others)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  eval->add_flag("-q,--quiet", ea.quiet, "no summary on stderr");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fail(std::string("usage: ") + e.what() + " (see attnoracle --help)");
  }

  try {
    if (eval->parsed()) return run_eval(ea);
  } catch (const InputError& e) {
    fail(e.message());
  } catch (const std::bad_alloc&) {
    fail("out of memory");
  }
  return 2;
}
