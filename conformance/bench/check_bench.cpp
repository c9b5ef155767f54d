// Throughput of `check`: bytes of an implementation's result compared per second, on a large
// synthetic case (B = 1, H = 8, Nq = Nk = 1024, Dk = Dv = 64, weights and lse requested), in F32
// and in F16. The golden tensors come from a plain double computation of attention on random
// inputs (a throughput benchmark needs consistent tensors, not certified ones); the result is
// the golden values with one element in 61 moved by one ulp and some undecided elements given
// their other candidate, so that every path of the comparison runs and the verdict is a pass.
//
//   compare_case  the per-case comparison on tensors in memory
//   check_gate    the whole `attnoracle check` on a one-case vector set written to a temporary
//                 directory: manifest, reading and hashing the golden file, reading the result
//   row_magnitudes  the part of compare_case that is O(Nq Nk Dk) (time only)
//
// With --write-set (main, below) it writes a larger one-case set instead, for timing the process.
//
// Times are CPU times (the rates too): the machine may be shared. tools/bench_check.sh builds in
// Release and prints the medians in MB/s.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/conformance/stored_model.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/verified_stamp.hpp"
#include "attnoracle/conformance/tolerance.hpp"

namespace {

using namespace attnoracle;
using namespace attnoracle::conformance;
namespace fs = std::filesystem;

// The benchmarks' case, and the larger one --write-set writes for timing the whole process.
struct Shape {
  std::int64_t B, H, N, D;
};
constexpr Shape kBench{1, 8, 1024, 64}, kProcess{2, 4, 1024, 128};

// x rounded to nearest-even in F16 or F32 (x finite, in range), as a double.
double round_to(DType t, double x) {
  if (t == DType::F32) return static_cast<double>(static_cast<float>(x));
  if (t == DType::F64) return x;
  const double a = std::fabs(x);
  const int e = a < 0x1p-14 ? -14 : std::ilogb(a);  // F16: 11 bits, subnormals below 2^-14
  const double quantum = std::ldexp(1.0, e - 10);
  return std::nearbyint(x / quantum) * quantum;  // exact scaling, round half to even
}

std::uint64_t bits_at(const RawTensor& t, std::size_t k) {
  std::uint64_t b = 0;
  std::memcpy(&b, t.data.data() + k * dtype_size(t.dtype), dtype_size(t.dtype));
  return b;
}
// The bits without the sign (F32 or F16).
std::uint64_t magnitude(DType t, std::uint64_t b) { return b & (t == DType::F32 ? 0x7fff'ffffu : 0x7fffu); }
void set_bits(RawTensor& t, std::size_t k, std::uint64_t b) {
  std::memcpy(t.data.data() + k * dtype_size(t.dtype), &b, dtype_size(t.dtype));
}

RawTensor tensor(const std::string& name, DType t, std::vector<std::int64_t> shape) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(static_cast<std::size_t>(r.numel()) * dtype_size(t));
  return r;
}

// A golden tensor (dtype t) and its F64 reference from exact-enough double values.
void put_golden(SafeTensorsFile& f, const std::string& name, DType t, const std::vector<std::int64_t>& shape,
                const std::vector<double>& ref) {
  RawTensor g = tensor(name, t, shape), r = tensor(name + ".ref", DType::F64, shape);
  for (std::size_t k = 0; k < ref.size(); ++k) {
    encode_float(t, round_to(t, ref[k]), g.data.data() + k * dtype_size(t));
    std::memcpy(r.data.data() + 8 * k, &ref[k], 8);
  }
  f.put(std::move(g));
  f.put(std::move(r));
}

struct Synthetic {
  std::string id;
  DType dtype;
  SafeTensorsFile golden;
  JobResult result;
  double result_bytes = 0;
};

Synthetic make_case(DType dt, const Shape& shape = kBench, bool model = true) {
  const std::int64_t kB = shape.B, kH = shape.H, kN = shape.N, kD = shape.D;
  Synthetic s;
  s.id = std::string("large_") + std::string(dtype_name(dt));
  s.dtype = dt;
  SafeTensorsFile& f = s.golden;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,weights,lse"}};
  std::mt19937_64 rng(20240611);
  // Multiples of 2^-10 in [-2, 2]: exact in every input dtype.
  std::uniform_int_distribution<int> digit(-2048, 2048);
  auto random_input = [&](const char* name, std::vector<double>& v) {
    RawTensor t = tensor(name, dt, {kB, kH, kN, kD});
    v.resize(static_cast<std::size_t>(t.numel()));
    for (std::size_t k = 0; k < v.size(); ++k) {
      v[k] = std::ldexp(digit(rng), -10);
      encode_float(dt, v[k], t.data.data() + k * dtype_size(dt));
    }
    f.put(std::move(t));
  };
  std::vector<double> q, k, v;
  random_input("q", q);
  random_input("k", k);
  random_input("v", v);

  // Attention in double.
  const double scale = 1 / std::sqrt(static_cast<double>(kD));
  const auto rows = static_cast<std::size_t>(kB * kH * kN), N = static_cast<std::size_t>(kN),
             D = static_cast<std::size_t>(kD);
  std::vector<double> out(rows * D), bound(rows * D), weights(rows * N), lse(rows), srow(N);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t head = r / N;  // Hq = Hkv
    const double* qi = &q[r * D];
    double m = -INFINITY;
    for (std::size_t j = 0; j < N; ++j) {
      const double* kj = &k[(head * N + j) * D];
      double dot = 0;
      for (std::size_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
      srow[j] = dot * scale;
      m = std::max(m, srow[j]);
    }
    double z = 0;
    for (std::size_t j = 0; j < N; ++j) z += (srow[j] = std::exp(srow[j] - m));
    for (std::size_t j = 0; j < N; ++j) {
      const double w = weights[r * N + j] = srow[j] / z;
      const double* vj = &v[(head * N + j) * D];
      for (std::size_t c = 0; c < D; ++c) {
        out[r * D + c] += w * vj[c];
        bound[r * D + c] += w * std::fabs(vj[c]);
      }
    }
    lse[r] = m + std::log(z);
  }
  for (double& b : bound) b *= 1 + 0x1p-40;  // an upper bound, as the reference's is

  put_golden(f, "out", dt, {kB, kH, kN, kD}, out);
  put_golden(f, "weights", dt, {kB, kH, kN, kN}, weights);
  put_golden(f, "lse", dt, {kB, kH, kN}, lse);
  RawTensor b = tensor("out.bound", DType::F64, {kB, kH, kN, kD});
  std::memcpy(b.data.data(), bound.data(), b.data.size());
  f.put(std::move(b));
  RawTensor valid = tensor("row.valid", DType::BOOL, {kB, kH, kN});
  std::fill(valid.data.begin(), valid.data.end(), 1);
  f.put(std::move(valid));

  // Some undecided elements of out and weights: the golden tensor holds one candidate, .alt
  // the neighbour on the side of the reference value.
  for (const char* name : {"out", "weights"}) {
    const RawTensor& g = *f.find(name);
    const RawTensor& ref = *f.find(std::string(name) + ".ref");
    const auto n = static_cast<std::size_t>(g.numel());
    RawTensor idx = tensor(std::string(name) + ".undecided", DType::I64, {0});
    RawTensor alt = tensor(std::string(name) + ".alt", dt, {0});
    for (std::size_t e = 5; e < n; e += 1009) {
      double x;
      std::memcpy(&x, ref.data.data() + 8 * e, 8);
      const double gv = decode_float(dt, g.data.data() + e * dtype_size(dt));
      const std::uint64_t gb = bits_at(g, e);
      const std::uint64_t ab = (x > gv) == (gv > 0) || magnitude(dt, gb) == 0 ? gb + 1 : gb - 1;
      const auto at = static_cast<std::int64_t>(e);
      idx.data.resize(idx.data.size() + 8);
      std::memcpy(idx.data.data() + idx.data.size() - 8, &at, 8);
      alt.data.resize(alt.data.size() + dtype_size(dt));
      std::memcpy(alt.data.data() + alt.data.size() - dtype_size(dt), &ab, dtype_size(dt));
    }
    idx.shape = {static_cast<std::int64_t>(idx.data.size() / 8)};
    alt.shape = idx.shape;
    f.put(std::move(idx));
    f.put(std::move(alt));
  }

  // The result: the golden values, one element in 61 moved by one ulp (away from or toward
  // zero, alternately), every other undecided element given its other candidate.
  s.result.outcome = Outcome::Output;
  for (const char* name : {"out", "weights", "lse"}) {
    RawTensor y = *f.find(name);
    const auto n = static_cast<std::size_t>(y.numel());
    for (std::size_t e = 0; e < n; ++e) {
      const std::uint64_t h = (e * 0x9e3779b97f4a7c15ull) >> 40;
      if (h % 61 != 0) continue;
      const std::uint64_t yb = bits_at(y, e);
      set_bits(y, e, (h & 64) && magnitude(dt, yb) != 0 ? yb - 1 : yb + 1);
    }
    if (const RawTensor* idx = f.find(std::string(name) + ".undecided")) {
      const RawTensor& alt = *f.find(std::string(name) + ".alt");
      for (std::size_t u = 0; u < static_cast<std::size_t>(idx->numel()); u += 2) {
        std::int64_t at;
        std::memcpy(&at, idx->data.data() + 8 * u, 8);
        set_bits(y, static_cast<std::size_t>(at), bits_at(alt, u));
      }
    }
    s.result_bytes += static_cast<double>(y.data.size());
    s.result.output.put(std::move(y));
  }
  // the model's magnitudes stored with the golden tensors, as `gen --model` stores them
  if (model) put_model(case_from_file(s.id, f), f);
  return s;
}

const Synthetic& synthetic(DType dt) {
  static std::map<DType, std::unique_ptr<Synthetic>> cache;
  auto& p = cache[dt];
  if (!p) p = std::make_unique<Synthetic>(make_case(dt));
  return *p;
}

Profile profile_for(DType dt) { return builtin_profile(dt == DType::F16 ? "fp16" : "fp32"); }

DType dtype_arg(const benchmark::State& state) { return state.range(0) == 16 ? DType::F16 : DType::F32; }

void BM_CompareCase(benchmark::State& state) {
  const Synthetic& s = synthetic(dtype_arg(state));
  const Profile profile = profile_for(s.dtype);
  for (auto _ : state) {
    CaseReport rep = compare_case(s.id, s.golden, "ok", s.result, profile);
    if (rep.status != CaseStatus::Pass) {
      state.SkipWithError(("the synthetic case does not pass: " + rep.reason).c_str());
      break;
    }
    benchmark::DoNotOptimize(rep);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * s.result_bytes));
  state.SetLabel(s.id);
}

// A one-case vector set (DIR/set) and its results directory (DIR/results).
void write_set(const Synthetic& s, const fs::path& root) {
  fs::create_directories(root / "set" / "cases");
  fs::create_directories(root / "results");
  const std::vector<unsigned char> bytes = serialize_safetensors(s.golden);
  write_file_atomic((root / "set" / vectors::case_file_name(s.id)).string(), bytes);
  vectors::Manifest m;
  m.suite = "bench";
  m.generator = "check_bench";
  m.cases.push_back({s.id, vectors::case_file_name(s.id), vectors::sha256_hex(bytes), "ok", {"bench"}});
  std::ofstream(root / "set" / "manifest.json") << vectors::manifest_text(m);
  // the file just hashed, recorded as verified as gen records it (with the stored model only:
  // the set without stands for the check as it was, hashing its golden file)
  if (s.golden.find("model.rows")) vectors::record_verified((root / "set").string(), {{m.cases[0].file, m.cases[0].sha256}});
  write_file_atomic((root / "results" / (s.id + ".safetensors")).string(), serialize_safetensors(s.result.output));
}

// write_set's set in a temporary directory, removed at exit.
struct TempSet {
  fs::path root;
  GateOptions opt;
  double result_bytes = 0;
  explicit TempSet(const Synthetic& s) {
    root = fs::temp_directory_path() /
           ("attnoracle-check-bench-" + std::to_string(::getpid()) + "-" + std::string(dtype_name(s.dtype)));
    write_set(s, root);
    opt.dir = (root / "set").string();
    opt.results = (root / "results").string();
    opt.profiles = {profile_for(s.dtype).name, {profile_for(s.dtype)}};
    opt.threads = 1;
    result_bytes = s.result_bytes;
  }
  ~TempSet() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  TempSet(const TempSet&) = delete;
  TempSet& operator=(const TempSet&) = delete;
};

void BM_CheckGate(benchmark::State& state) {
  static std::map<DType, std::unique_ptr<TempSet>> sets;
  const DType dt = dtype_arg(state);
  auto& set = sets[dt];
  if (!set) set = std::make_unique<TempSet>(synthetic(dt));
  double bytes = 0;
  for (auto _ : state) {
    const GateReport rep = check_gate(set->opt);
    if (rep.passed != 1 || rep.failed != 0) {
      state.SkipWithError(("the synthetic set does not pass: " +
                           (rep.cases.empty() ? std::string("no case") : rep.cases[0].reason)).c_str());
      break;
    }
    bytes += rep.compared_bytes;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.SetLabel(synthetic(dt).id);
}

void BM_RowMagnitudes(benchmark::State& state) {
  const Synthetic& s = synthetic(dtype_arg(state));
  const Case c = case_from_file(s.id, s.golden);
  for (auto _ : state) benchmark::DoNotOptimize(row_magnitudes(c));
  state.SetLabel(s.id);
}

// Argument: 32 (F32 inputs and outputs, profile fp32) or 16 (F16, profile fp16).
BENCHMARK(BM_CompareCase)->Arg(32)->Arg(16)->Unit(benchmark::kMillisecond);
// (the comparison runs in the gate's worker thread: the process's CPU time)
BENCHMARK(BM_CheckGate)->Arg(32)->Arg(16)->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RowMagnitudes)->Arg(32)->Arg(16)->Unit(benchmark::kMillisecond);

}  // namespace

// --write-set DIR [32|16] [plain]: writes the one-case set of B = 2, H = 4, Nq = Nk = 1024, D =
// 128 (F32, or F16 with 16) to DIR/set and its result to DIR/results, for timing `attnoracle check`
// as a whole process (tools/bench_check.sh); with `plain`, without the stored model (check
// computes it from the inputs) and without the record of the verified file (check hashes it).
// No benchmark runs.
int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--write-set") {
    const DType dt = argc >= 4 && std::string(argv[3]) == "16" ? DType::F16 : DType::F32;
    write_set(make_case(dt, kProcess, !(argc >= 5 && std::string(argv[4]) == "plain")), argv[2]);
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
