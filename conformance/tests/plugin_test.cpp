// The plugin host (`attnoracle plugin-host LIB JOBS`) through the adapter runner: the naive C
// plugin against `attnoracle eval` on hand-made cases, misbehaving plugins (a crash, a wrong ABI
// version, bad tensors, every status), and the libtorch plugin when it is built; gradient cases
// made by `attnoracle gen` and judged by `attnoracle run`.
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/conformance/plugin_host.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {
namespace {

namespace fs = std::filesystem;
using Shape = std::vector<std::int64_t>;

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::int64_t count(const Shape& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

RawTensor floats(const std::string& name, DType t, const Shape& shape,
                 const std::vector<double>& values) {
  RawTensor r{name, t, shape, {}};
  r.data.resize(values.size() * dtype_size(t));
  for (std::size_t e = 0; e < values.size(); ++e)
    encode_float(t, values[e], r.data.data() + e * dtype_size(t));
  return r;
}

RawTensor bools(const std::string& name, const Shape& shape, const std::vector<int>& values) {
  RawTensor r{name, DType::BOOL, shape, {}};
  for (int v : values) r.data.push_back(v ? 1 : 0);
  return r;
}

// Values in [-1, 1] representable in t (F16 and BF16: on a grid of 1/64).
std::vector<double> random_values(std::mt19937& rng, DType t, std::int64_t n) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v;
  for (std::int64_t e = 0; e < n; ++e) {
    const double x = u(rng);
    v.push_back(t == DType::F64   ? x
                : t == DType::F32 ? static_cast<double>(static_cast<float>(x))
                                  : std::round(x * 64) / 64);
  }
  return v;
}

// A hand-made case: sizes, dtype, metadata and the optional tensors.
struct Problem {
  std::string id;
  DType dtype = DType::F32;
  std::int64_t B = 1, Hq = 2, Hkv = 2, Nq = 3, Nk = 4, Dk = 5, Dv = 3;
  std::map<std::string, std::string> meta;
  std::vector<RawTensor> extra;  // mask, bias, query_mask
  bool mha = false;              // kind mha: H = Hq, D = Dk, Dout = Dv + 1
};

SafeTensorsFile make_case(const Problem& p, unsigned seed) {
  std::mt19937 rng(seed);
  SafeTensorsFile f;
  f.metadata = p.meta;
  f.metadata["attn.format"] = "1";
  auto put = [&](const std::string& name, const Shape& s) {
    f.put(floats(name, p.dtype, s, random_values(rng, p.dtype, count(s))));
  };
  if (p.mha) {
    f.metadata["attn.kind"] = "mha";
    put("x_q", {p.B, p.Nq, p.Dk});
    put("x_kv", {p.B, p.Nk, p.Dk});
    put("w_q", {p.Hq, p.Dk, p.Dk});
    put("w_k", {p.Hq, p.Dk, p.Dk});
    put("w_v", {p.Hq, p.Dk, p.Dv});
    put("w_o", {p.Hq * p.Dv, p.Dv + 1});
  } else {
    put("q", {p.B, p.Hq, p.Nq, p.Dk});
    put("k", {p.B, p.Hkv, p.Nk, p.Dk});
    put("v", {p.B, p.Hkv, p.Nk, p.Dv});
  }
  for (const auto& t : p.extra) f.put(t);
  return f;
}

// The hand-made cases the plugins evaluate (expected: an output).
std::vector<Problem> good_problems() {
  const double inf = INFINITY;
  std::vector<Problem> ps;
  Problem p;
  p.id = "basic";
  p.meta = {{"attn.outputs", "out,weights,lse"}};
  ps.push_back(p);

  p = Problem{};
  p.id = "gqa_bottom_right_window";
  p.Hq = 4, p.Hkv = 2, p.Nq = 3, p.Nk = 6;
  p.meta = {
      {"attn.causal", "bottom_right"}, {"attn.window", "2,0"}, {"attn.outputs", "out,weights,lse"}};
  ps.push_back(p);

  p = Problem{};
  p.id = "top_left_softcap_bias_mask";
  p.meta = {{"attn.causal", "top_left"},
            {"attn.softcap", "0.75"},
            {"attn.scale", "0x1.8p-1"},
            {"attn.outputs", "out,weights"}};
  p.extra = {floats("bias", DType::F64, {3, 4}, {0.25, 0, 1, 0, -0.5, 0.125, 0, 0, 0, -inf, 2, 0}),
             bools("mask", {1, 3, 4}, {1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1})};
  ps.push_back(p);

  p = Problem{};
  p.id = "zero_rows_query_mask";
  p.B = 2, p.Nk = 5;
  p.meta = {{"attn.masked_rows", "zero"}, {"attn.outputs", "out,weights,lse"}};
  p.extra = {bools("mask", {3, 5}, {1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1}),
             bools("query_mask", {2, 3}, {1, 1, 0, 1, 1, 1})};
  ps.push_back(p);

  p = Problem{};
  p.id = "padding_row_under_error";
  p.meta = {{"attn.outputs", "out,lse"}};
  p.extra = {bools("mask", {3, 4}, {1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0}),
             bools("query_mask", {1, 3}, {1, 0, 1})};
  ps.push_back(p);

  p = Problem{};
  p.id = "f64_mqa_bias_mask4";
  p.dtype = DType::F64;
  p.B = 2, p.Hq = 3, p.Hkv = 1, p.Nq = 2, p.Nk = 3;
  p.meta = {{"attn.outputs", "out,lse"}};
  p.extra = {floats("bias", DType::F32, {2, 1, 2, 3}, {0.5, -1, 0, 0, 0, -inf, 1, 1, 1, -2, 0, 0}),
             bools("mask", {2, 3, 2, 3}, {1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1,
                                          1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1})};
  ps.push_back(p);

  p = Problem{};
  p.id = "f64_to_f32";
  p.dtype = DType::F64;
  p.meta = {{"attn.output_dtype", "F32"}, {"attn.outputs", "out,weights"}};
  ps.push_back(p);

  p = Problem{};
  p.id = "f32_to_f64";
  p.meta = {{"attn.output_dtype", "F64"}, {"attn.causal", "top_left"}};
  ps.push_back(p);

  p = Problem{};
  p.id = "f32_to_f16";
  p.meta = {{"attn.output_dtype", "F16"}, {"attn.outputs", "out,weights,lse"}};
  ps.push_back(p);

  p = Problem{};
  p.id = "f64_to_bf16";
  p.dtype = DType::F64;
  p.meta = {{"attn.output_dtype", "BF16"}, {"attn.outputs", "out,lse"}};
  ps.push_back(p);

  p = Problem{};  // a dtype per output: BF16 out, F32 lse, F64 weights
  p.id = "bf16_out_f32_lse";
  p.meta = {{"attn.output_dtype", "BF16"},
            {"attn.outputs", "out,weights,lse"},
            {"attn.output_dtypes", "lse:F32,weights:F64"}};
  ps.push_back(p);
  return ps;
}

// Unit roundoff of a result dtype; eps32 and eps64 stand for F32 and F64 (the test's choice).
double unit_roundoff(DType t, double eps32, double eps64) {
  if (t == DType::F16) return std::max(eps32, 0x1p-11);
  if (t == DType::BF16) return std::max(eps32, 0x1p-8);
  return t == DType::F64 ? eps64 : eps32;
}

double element(const RawTensor& t, std::size_t e) {
  return decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype));
}

// Compares a result with the golden `.ref` tensors: |got - ref| <= eps * terms * scale, where
// scale is out.bound for out, 1 for weights, 1 + |ref| for lse; -inf must match exactly.
void expect_close(const std::string& id, const SafeTensorsFile& got, const SafeTensorsFile& golden,
                  double eps, double terms) {
  for (const char* name : {"out", "weights", "lse"}) {
    const RawTensor* expected = golden.find(name);
    if (!expected) continue;
    const RawTensor* ref = golden.find(std::string(name) + ".ref");
    const RawTensor* bound = golden.find("out.bound");
    const RawTensor* t = got.find(name);
    ASSERT_NE(t, nullptr) << id << ": no " << name;
    ASSERT_EQ(t->dtype, expected->dtype) << id << ": " << name;
    ASSERT_EQ(t->shape, expected->shape) << id << ": " << name;
    int reported = 0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(t->numel()); ++e) {
      const double g = element(*t, e), r = element(*ref, e);
      const std::string n = std::string(name);
      const double scale = n == "out" ? element(*bound, e) : n == "weights" ? 1 : 1 + std::abs(r);
      const bool ok = std::isinf(r) ? g == r : std::abs(g - r) <= eps * terms * scale;
      if (!ok && reported++ < 3)
        ADD_FAILURE() << id << ": " << name << "[" << e << "] = " << g << ", expected " << r
                      << " (limit " << eps * terms * scale << ")";
    }
  }
}

class PluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "attnoracle-plugin-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Writes a case file; returns its path.
  std::string write_case(const std::string& id, const SafeTensorsFile& f) {
    const std::string path = (dir_ / (id + ".safetensors")).string();
    write_file_atomic(path, serialize_safetensors(f));
    return path;
  }
  // A case for the misbehaving plugin: a dummy tensor and test.mode.
  std::string mode_case(const std::string& mode, const std::string& suffix = "") {
    SafeTensorsFile f;
    f.metadata = {{"attn.format", "1"}, {"test.mode", mode}};
    f.put(floats("q", DType::F32, {1}, {1.0}));
    return write_case("mode-" + mode + suffix, f);
  }
  // Golden tensors by `attnoracle eval`.
  SafeTensorsFile eval(const std::string& input) {
    const std::string output = input + ".golden";
    const std::string cmd =
        quote(ATTNORACLE_CLI) + " eval -q " + quote(input) + " -o " + quote(output);
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return read_safetensors(output);
  }
  std::vector<AdapterJob> jobs_for(const std::vector<std::string>& inputs) {
    std::vector<AdapterJob> js;
    for (const auto& in : inputs) js.push_back({fs::path(in).stem().string(), in, in + ".result"});
    return js;
  }
  // The command `attnoracle run --plugin` uses (no core file from the crash test).
  AdapterRun host(const std::string& lib, const std::vector<AdapterJob>& js) {
    const std::string cmd = "ulimit -c 0; " + quote(ATTNORACLE_CLI) + " plugin-host " + quote(lib);
    return run_adapter(cmd, js, (dir_ / "work").string(), 300);
  }

  // Runs `lib` on the good problems (those of `dtype` when given) against eval's golden data.
  // With on_golden, the plugin is given the evaluated files (the host drops the golden data).
  void check_against_eval(const std::string& lib, const std::vector<Problem>& problems,
                          double eps32, double eps64, bool on_golden = false) {
    std::vector<std::string> inputs;
    std::vector<SafeTensorsFile> golden;
    for (std::size_t k = 0; k < problems.size(); ++k) {
      inputs.push_back(
          write_case(problems[k].id, make_case(problems[k], 100 + static_cast<unsigned>(k))));
      golden.push_back(eval(inputs.back()));
    }
    if (on_golden)
      for (auto& in : inputs) in += ".golden";
    const auto js = jobs_for(inputs);
    const AdapterRun r = host(lib, js);
    EXPECT_EQ(r.exit_status, 0) << r.stderr_tail;
    ASSERT_EQ(r.results.size(), problems.size());
    for (std::size_t k = 0; k < problems.size(); ++k) {
      const Problem& p = problems[k];
      ASSERT_EQ(r.results[k].outcome, Outcome::Output) << p.id << ": " << r.results[k].reason;
      const double eps = std::max(p.dtype == DType::F64 ? eps64 : eps32,
                                  unit_roundoff(golden[k].find("out")->dtype, eps32, eps64));
      const double terms = static_cast<double>(p.Nk + p.Dk + 8 + (p.mha ? p.Dk + p.Hq * p.Dv : 0));
      expect_close(p.id, r.results[k].output, golden[k], eps, terms);
    }
  }

  // Gradient cases (F32 and F64) by `attnoracle gen` from a spec written here: GQA, softcap, a
  // bias with -inf entries and query padding whose dout is not 0 (dq, dk, dv, dbias); fully
  // masked rows under policy zero (dq, dk, dv). Returns the vector set's directory.
  std::string gradient_suite() {
    const fs::path spec = dir_ / "gradients.json", suite = dir_ / "gradients";
    std::ofstream(spec) << R"({"suite": "plugin_gradients", "seed": 7,
      "description": "gradients through the plugins",
      "families": [
        {"name": "grad_bias", "generator": "normal", "description": "GQA, softcap, bias, padding",
         "cross": {"dtype": ["F32", "F64"]},
         "fixed": {"shape": [2, 4, 2, 6, 9, 8, 8], "bias": "random", "softcap": 5,
                   "query_mask": true, "causal": "bottom_right",
                   "outputs": "out,lse,dq,dk,dv,dbias"}},
        {"name": "grad_zero", "generator": "normal", "description": "fully masked rows",
         "cross": {"dtype": ["F32", "F64"]},
         "fixed": {"shape": [2, 2, 2, 6, 8, 8, 8], "mask": "fully_masked_rows",
                   "masked_rows": "zero", "outputs": "out,dq,dk,dv"}}]})";
    const std::string cmd = quote(ATTNORACLE_CLI) + " gen " + quote(spec.string()) + " -o " +
                            quote(suite.string()) + " > " + quote((dir_ / "gen.log").string()) +
                            " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return suite.string();
  }
  // The gate's JSON report of `lib` on `suite`, under fp32,fp64.
  nlohmann::json gate(const std::string& lib, const std::string& suite) {
    const std::string report = (dir_ / "report.json").string();
    const std::string cmd = "ulimit -c 0; " + quote(ATTNORACLE_CLI) + " run " + quote(suite) +
                            " --plugin " + quote(lib) + " --profile fp32,fp64 --json " +
                            quote(report) + " > " + quote((dir_ / "run.log").string()) + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream in(report);
    return nlohmann::json::parse(in);
  }

  // Every gradient case passes, with dq, dk, dv (and dbias where there is a bias) compared.
  void expect_gradients_pass(const std::string& lib) {
    const nlohmann::json r = gate(lib, gradient_suite());
    EXPECT_EQ(r["verdict"], "pass");
    EXPECT_EQ(r["passed"], 4);
    ASSERT_EQ(r["cases"].size(), 4u);
    for (const auto& c : r["cases"]) {
      const std::string id = c["id"];
      EXPECT_EQ(c["status"], "pass") << id << ": " << c["reason"];
      std::vector<std::string> expected = {"dq", "dk", "dv"};
      if (id.rfind("grad_bias", 0) == 0) expected.push_back("dbias");
      for (const auto& name : expected) {
        bool found = false;
        for (const auto& t : c["tensors"])
          if (t["tensor"] == name) {
            found = true;
            EXPECT_GT(t["compared"], 0) << id << ": " << name;
            EXPECT_EQ(t["over_limit"], 0) << id << ": " << name;
          }
        EXPECT_TRUE(found) << id << ": " << name << " not compared";
      }
    }
  }

  fs::path dir_;
};

constexpr double kEps32 = 0x1p-24, kEps64 = 0x1p-53;

TEST_F(PluginTest, NaiveCMatchesTheReference) {
  check_against_eval(NAIVE_C_PLUGIN, good_problems(), kEps32, kEps64);
}

TEST_F(PluginTest, EvaluatedFilesAreReadAsInputs) {
  check_against_eval(NAIVE_C_PLUGIN, {good_problems()[0]}, kEps32, kEps64, true);
}

TEST_F(PluginTest, NaiveCRefusesAndReportsUnsupported) {
  Problem refused;
  refused.id = "refused";
  refused.extra = {bools("mask", {3, 4}, {1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1})};
  Problem f16;
  f16.id = "f16";
  f16.dtype = DType::F16;
  Problem mha;
  mha.id = "mha";
  mha.mha = true;
  std::vector<std::string> inputs;
  for (const Problem& p : {refused, f16, mha}) inputs.push_back(write_case(p.id, make_case(p, 7)));
  const AdapterRun r = host(NAIVE_C_PLUGIN, jobs_for(inputs));
  ASSERT_EQ(r.results.size(), 3u);
  EXPECT_EQ(r.results[0].outcome, Outcome::Refused);
  EXPECT_NE(r.results[0].reason.find("b=0, h=0, i=1"), std::string::npos) << r.results[0].reason;
  EXPECT_FALSE(fs::exists(inputs[0] + ".result"));
  EXPECT_EQ(r.results[1].outcome, Outcome::Unsupported);
  EXPECT_NE(r.results[1].reason.find("F16"), std::string::npos) << r.results[1].reason;
  EXPECT_EQ(r.results[2].outcome, Outcome::Unsupported);
  EXPECT_NE(r.results[2].reason.find("mha"), std::string::npos) << r.results[2].reason;
}

// The plain C backward (dout of padding rows ignored, softcap's derivative) passes the gate.
TEST_F(PluginTest, NaiveCGradientsPassTheGate) { expect_gradients_pass(NAIVE_C_PLUGIN); }

TEST_F(PluginTest, CrashOnTheSecondCaseFailsTheRestOnly) {
  const auto js = jobs_for({mode_case("ok"), mode_case("segv"), mode_case("ok", "-again")});
  const AdapterRun r = host(MISBEHAVE_PLUGIN, js);
  EXPECT_TRUE(r.signaled || r.exit_status != 0);
  ASSERT_EQ(r.results.size(), 3u);
  ASSERT_EQ(r.results[0].outcome, Outcome::Output) << r.results[0].reason;
  const RawTensor* out = r.results[0].output.find("out");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->shape, (Shape{2, 3}));
  EXPECT_EQ(element(*out, 5), 2.5);
  EXPECT_EQ(r.results[1].outcome, Outcome::Crashed) << r.results[1].reason;
  EXPECT_EQ(r.results[2].outcome, Outcome::Crashed) << r.results[2].reason;
}

// Exit status 2, one line on stderr naming the problem, nothing written.
void expect_refused_load(const AdapterRun& r, const std::string& words) {
  EXPECT_EQ(r.exit_status, 2);
  EXPECT_FALSE(r.signaled);
  EXPECT_EQ(r.stderr_tail.rfind("attnoracle: error: ", 0), 0u) << r.stderr_tail;
  EXPECT_NE(r.stderr_tail.find(words), std::string::npos) << r.stderr_tail;
  ASSERT_FALSE(r.stderr_tail.empty());
  EXPECT_EQ(r.stderr_tail.find('\n'), r.stderr_tail.size() - 1) << r.stderr_tail;
  for (const auto& res : r.results) EXPECT_EQ(res.outcome, Outcome::Crashed);
}

TEST_F(PluginTest, WrongAbiVersionIsRefusedBeforeAnyJob) {
  const auto js = jobs_for({mode_case("ok")});
  const AdapterRun r = host(WRONG_ABI_PLUGIN, js);
  expect_refused_load(r, "ABI version 2, this host speaks version 1");
  for (const char* ext : {"", ".error", ".unsupported"})
    EXPECT_FALSE(fs::exists(js[0].output + ext));
  // The same in-process.
  EXPECT_EQ(plugin_host_main(WRONG_ABI_PLUGIN, (dir_ / "work" / "jobs.jsonl").string()), 2);
  for (const char* ext : {"", ".error", ".unsupported"})
    EXPECT_FALSE(fs::exists(js[0].output + ext));
}

TEST_F(PluginTest, MissingLibraryAndNonPluginAreRefused) {
  const auto js = jobs_for({mode_case("ok")});
  expect_refused_load(host((dir_ / "nowhere.so").string(), js), "cannot load the plugin");
  expect_refused_load(host("libm.so.6", js), "attnoracle_plugin_abi: not exported");
}

TEST_F(PluginTest, BadOutputsAndStatusesBecomeErrorFiles) {
  struct Expect {
    std::string mode;
    Outcome outcome;
    std::string words;
  };
  const std::vector<Expect> expected = {
      {"bad_size", Outcome::Refused, "tensor 'out': 20 bytes, but F32 [2, 3] needs 24"},
      {"bad_dtype", Outcome::Refused, "unknown dtype 'F33'"},
      {"negative_dim", Outcome::Refused, "negative size in shape [2, -3]"},
      {"twice", Outcome::Refused, "emitted twice"},
      {"status_99", Outcome::Refused, "unknown status 99"},
      {"failed", Outcome::Refused, "misbehave failed: out of luck"},
      {"refused", Outcome::Refused, "fully masked row: b=0, h=0, i=1"},
      {"unsupported", Outcome::Unsupported, "feature X is not supported"},
      {"ok", Outcome::Output, ""},
  };
  std::vector<std::string> inputs;
  for (const auto& e : expected) inputs.push_back(mode_case(e.mode));
  inputs.push_back(write_case("garbage", {}));
  std::ofstream(inputs.back(), std::ios::trunc) << "not a safetensors file";
  const AdapterRun r = host(MISBEHAVE_PLUGIN, jobs_for(inputs));
  EXPECT_EQ(r.exit_status, 0) << r.stderr_tail;
  ASSERT_EQ(r.results.size(), expected.size() + 1);
  for (std::size_t k = 0; k < expected.size(); ++k) {
    EXPECT_EQ(r.results[k].outcome, expected[k].outcome)
        << expected[k].mode << ": " << r.results[k].reason;
    EXPECT_NE(r.results[k].reason.find(expected[k].words), std::string::npos)
        << expected[k].mode << ": " << r.results[k].reason;
  }
  EXPECT_EQ(r.results.back().outcome, Outcome::Refused);
  EXPECT_NE(r.results.back().reason.find("cannot read the case"), std::string::npos)
      << r.results.back().reason;
}

TEST_F(PluginTest, LibtorchMatchesTheReference) {
#ifndef TORCH_PLUGIN
  GTEST_SKIP() << "libtorch not built";
#else
  std::vector<Problem> problems = good_problems();
  Problem mha;
  mha.id = "mha";
  mha.mha = true;
  mha.Hkv = mha.Hq;
  problems.push_back(mha);
  check_against_eval(TORCH_PLUGIN, problems, kEps32, kEps64);

  // BF16 is computed in BF16 (checked loosely here); F16 has no CPU kernels in libtorch 1.13.
  Problem bf16;
  bf16.id = "bf16";
  bf16.dtype = DType::BF16;
  check_against_eval(TORCH_PLUGIN, {bf16}, 0x1p-8, kEps64);
  Problem f16;
  f16.id = "f16";
  f16.dtype = DType::F16;
  const AdapterRun r = host(TORCH_PLUGIN, jobs_for({write_case("f16", make_case(f16, 3))}));
  ASSERT_EQ(r.results.size(), 1u);
  EXPECT_EQ(r.results[0].outcome, Outcome::Unsupported) << r.results[0].reason;
  EXPECT_NE(r.results[0].reason.find("Half"), std::string::npos) << r.results[0].reason;
#endif
}

// Autograd's dq, dk, dv and dbias pass the gate, each compared element by element; kind mha's
// gradients satisfy the identities of a multilinear map.
TEST_F(PluginTest, LibtorchGradientsPassTheGate) {
#ifndef TORCH_PLUGIN
  GTEST_SKIP() << "libtorch not built";
#else
  expect_gradients_pass(TORCH_PLUGIN);
  // Kind mha's gradients by autograd, in F64, against identities of L = sum(dout * out): out is
  // linear in w_o and in w_v, and homogeneous of degree 1 in each of (x_q, w_q) and (x_kv, w_k),
  // (x_kv, w_v) taken together, so <dw_o, w_o> = <dw_v, w_v> = L, <dx_q, x_q> = <dw_q, w_q> and
  // <dx_kv, x_kv> = <dw_k, w_k> + <dw_v, w_v>; in self-attention dx_q holds both sums.
  for (const bool self : {false, true}) {
    Problem mha;
    mha.id = self ? "mha_self_gradients" : "mha_gradients";
    mha.mha = true;
    mha.dtype = DType::F64;
    mha.Hkv = mha.Hq;
    mha.B = 2;
    if (self) mha.Nk = mha.Nq;
    mha.meta = {{"attn.outputs", self ? "out,dx_q,dw_q,dw_k,dw_v,dw_o" : "out,dx_q,dx_kv,dw_q,dw_k,dw_v,dw_o"}};
    std::mt19937 rng(9);
    const Shape dshape{mha.B, mha.Nq, mha.Dv + 1};
    mha.extra.push_back(floats("dout", DType::F64, dshape, random_values(rng, DType::F64, count(dshape))));
    SafeTensorsFile f = make_case(mha, 5);
    if (self) {
      RawTensor x = *f.find("x_q");
      x.name = "x_kv";
      f.put(x);
    }
    const AdapterRun r = host(TORCH_PLUGIN, jobs_for({write_case(mha.id, f)}));
    ASSERT_EQ(r.results.size(), 1u);
    ASSERT_EQ(r.results[0].outcome, Outcome::Output) << r.results[0].reason;
    const SafeTensorsFile& o = r.results[0].output;
    EXPECT_EQ(o.find("dx_kv") != nullptr, !self);
    auto dot = [&](const RawTensor& a, const RawTensor& b) {
      EXPECT_EQ(a.shape, b.shape) << a.name << " " << b.name;
      double s = 0;
      for (std::int64_t e = 0; e < count(a.shape); ++e) s += element(a, e) * element(b, e);
      return s;
    };
    auto got = [&](const char* name) -> const RawTensor& {
      const RawTensor* t = o.find(name);
      EXPECT_NE(t, nullptr) << name;
      return t ? *t : *o.find("out");
    };
    const double L = dot(*f.find("dout"), got("out"));
    const double wq = dot(got("dw_q"), *f.find("w_q")), wk = dot(got("dw_k"), *f.find("w_k"));
    const double wv = dot(got("dw_v"), *f.find("w_v"));
    const double tol = 1e-12 * (1 + std::fabs(L) + std::fabs(wq) + std::fabs(wk) + std::fabs(wv));
    EXPECT_NEAR(dot(got("dw_o"), *f.find("w_o")), L, tol) << mha.id;
    EXPECT_NEAR(wv, L, tol) << mha.id;
    if (self) {
      EXPECT_NEAR(dot(got("dx_q"), *f.find("x_q")), wq + wk + wv, tol) << mha.id;
    } else {
      EXPECT_NEAR(dot(got("dx_q"), *f.find("x_q")), wq, tol) << mha.id;
      EXPECT_NEAR(dot(got("dx_kv"), *f.find("x_kv")), wk + wv, tol) << mha.id;
    }
  }
  // sdpa's names asked of kind mha are refused, naming the kind.
  Problem bad;
  bad.id = "mha_dq";
  bad.mha = true;
  bad.meta = {{"attn.outputs", "out,dq"}};
  const AdapterRun r = host(TORCH_PLUGIN, jobs_for({write_case(bad.id, make_case(bad, 5))}));
  ASSERT_EQ(r.results.size(), 1u);
  EXPECT_EQ(r.results[0].outcome, Outcome::Refused) << r.results[0].reason;
  EXPECT_NE(r.results[0].reason.find("dq is not a gradient of kind mha"), std::string::npos)
      << r.results[0].reason;
#endif
}

}  // namespace
}  // namespace attnoracle::conformance
