// Rows per second of the reference's row kernels, one thread:
//
//   BM_row       RowEvaluator::row(b, h, i, p): the interval enclosures of one row of attention
//                over MPFR at working precision p (what `attnoracle eval` runs for every row the
//                fast path does not decide, before Ziv's rounding test), p = 128 bits;
//   BM_fast_row  fast::fast_row(c, setup, b, h, i): the fast certified path, the same row in
//                double-double ball arithmetic (reference/src/fast; built when that header is
//                there). Only the balls: deciding the roundings is not included.
//
// Cases: kind sdpa, B = H = 1, Nk = 256, 1024, 4096 keys, Dk = Dv = 64, F32 inputs drawn from the
// standard normal distribution (fixed seed), F32 outputs, `out` only, default scale; 16 query
// rows, evaluated in turn.
//
//   BUILD/bench/attnoracle_row_bench [--benchmark_filter=...] [--benchmark_repetitions=5]
//
// Counters: rows/s; MAC/s = rows/s x Nk x (Dk + Dv), the multiply-adds of Q K^T and P V per
// second (NumPy's float64 BLAS does some 10^9 to 10^10 of them per second per core).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>  // evaluate.hpp uses std::runtime_error without including it
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/safetensors.hpp"

// The fast path's header is private to the reference (its directory is added by
// bench/CMakeLists.txt). Only prepare() and fast_row() are called, both compiled in the library
// with its own options (-mfma, no contraction); none of the inline arithmetic of its headers is
// used here, so no copy of it is compiled with this file's options.
#if __has_include("fast/fast_row.hpp")
#include "fast/fast_row.hpp"
#define ATTNORACLE_HAVE_FAST_ROW 1
#endif

namespace {

using namespace attnoracle;

constexpr std::int64_t kRows = 16;  // query rows in the case (Nq)
constexpr std::int64_t kD = 64;

RawTensor normal_f32(const std::string& name, std::int64_t n, std::int64_t d, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  RawTensor t;
  t.name = name;
  t.dtype = DType::F32;
  t.shape = {1, 1, n, d};
  t.data.resize(static_cast<std::size_t>(n * d) * sizeof(float));
  for (std::size_t k = 0; k < static_cast<std::size_t>(n * d); ++k) {
    const float x = dist(rng);
    std::memcpy(t.data.data() + k * sizeof(float), &x, sizeof(float));  // little-endian host
  }
  return t;
}

// One case per Nk, built once and kept for the whole run.
const Case& case_for(std::int64_t nk) {
  static std::map<std::int64_t, std::unique_ptr<Case>> cases;
  auto& slot = cases[nk];
  if (!slot) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(nk) * 7919u + 1u);
    SafeTensorsFile f;
    f.metadata = {{"attn.format", "1"}, {"attn.kind", "sdpa"}, {"attn.output_dtype", "F32"},
                  {"attn.outputs", "out"}};
    f.put(normal_f32("q", kRows, kD, rng));
    f.put(normal_f32("k", nk, kD, rng));
    f.put(normal_f32("v", nk, kD, rng));
    slot = std::make_unique<Case>(case_from_file("row_bench(Nk=" + std::to_string(nk) + ")", std::move(f)));
  }
  return *slot;
}

void set_counters(benchmark::State& state, std::int64_t nk) {
  const auto rows = static_cast<double>(state.iterations());
  state.counters["rows/s"] = benchmark::Counter(rows, benchmark::Counter::kIsRate);
  state.counters["MAC/s"] = benchmark::Counter(rows * static_cast<double>(nk * 2 * kD), benchmark::Counter::kIsRate);
}

void BM_row(benchmark::State& state) {
  const std::int64_t nk = state.range(0);
  const auto p = static_cast<mpfr_prec_t>(state.range(1));
  const Case& c = case_for(nk);
  const RowEvaluator ev(c);
  std::int64_t i = 0;
  for (auto _ : state) {
    RowEnclosures r = ev.row(0, 0, i, p);
    benchmark::DoNotOptimize(r.out.data());
    i = (i + 1) % kRows;
  }
  set_counters(state, nk);
  state.SetLabel("MPFR, D=" + std::to_string(kD) + " p=" + std::to_string(p));
}

BENCHMARK(BM_row)
    ->ArgNames({"Nk", "p"})
    ->Args({256, 128})
    ->Args({1024, 128})
    ->Args({4096, 128})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

#ifdef ATTNORACLE_HAVE_FAST_ROW
void BM_fast_row(benchmark::State& state) {
  const std::int64_t nk = state.range(0);
  const Case& c = case_for(nk);
  const fast::Setup setup = fast::prepare(c);
  if (!setup.applies) {
    state.SkipWithError(("the fast path does not apply: " + setup.why_not).c_str());
    return;
  }
  std::int64_t i = 0, gave_up = 0;
  for (auto _ : state) {
    fast::FastRow r = fast::fast_row(c, setup, 0, 0, i);
    benchmark::DoNotOptimize(r.out.data());
    gave_up += r.ok ? 0 : 1;
    i = (i + 1) % kRows;
  }
  set_counters(state, nk);
  state.counters["not_ok"] = static_cast<double>(gave_up);  // rows the path gave up on
  state.SetLabel("double-double balls, D=" + std::to_string(kD));
}

BENCHMARK(BM_fast_row)->ArgName("Nk")->Arg(256)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();
#endif

}  // namespace

BENCHMARK_MAIN();
