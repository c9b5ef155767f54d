// The gate end to end: `attnoracle run` and `check` on a small vector set, against a correct
// implementation and against every way an implementation can misbehave. Each misbehaviour is a
// failed case with its reason; the runner itself always finishes and writes its reports.
#include <sys/stat.h>
#include <gtest/gtest.h>

#include "cli_args.hpp"

#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/verified_stamp.hpp"

namespace attnoracle {
namespace {

namespace fs = std::filesystem;

using testing::run;
using testing::write_text;

class Gate : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("attnoracle-gate-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "set" / "cases");
    vectors::Manifest m;
    m.suite = "tiny";
    m.generator = "test";
    for (int k = 0; k < 3; ++k) {
      SafeTensorsFile f;
      f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,weights"}};
      if (k == 2) f.metadata["attn.causal"] = "bottom_right";
      const std::int64_t Nq = 3 + k, Nk = 4 + k, D = 4;
      auto put = [&](const char* name, std::vector<std::int64_t> shape, float seed) {
        RawTensor t{name, DType::F32, shape, {}};
        const std::int64_t n = shape[2] * shape[3];
        t.data.resize(static_cast<std::size_t>(n) * 4);
        for (std::int64_t e = 0; e < n; ++e) {
          const float v = std::sin(seed * static_cast<float>(e + 1));
          std::memcpy(t.data.data() + 4 * e, &v, 4);
        }
        f.put(std::move(t));
      };
      put("q", {1, 1, Nq, D}, 1.7f);
      put("k", {1, 1, Nk, D}, 0.9f);
      put("v", {1, 1, Nk, D}, 2.3f);
      const Case c = case_from_file("c", f);
      const std::vector<unsigned char> bytes = serialize_safetensors(golden_file(c, evaluate(c, {})));
      const std::string id = "case" + std::to_string(k);
      write_file_atomic((dir_ / "set" / "cases" / (id + ".safetensors")).string(), bytes);
      m.cases.push_back({id, "cases/" + id + ".safetensors", vectors::sha256_hex(bytes), "ok", {k == 2 ? "causal" : "plain"}});
    }
    write_text(dir_ / "set" / "manifest.json", vectors::manifest_text(m));
    // Misbehaving implementations, as small Python scripts.
    const std::string head =
        "import json, sys\nsys.path.insert(0, '" + std::string(ATTNORACLE_SOURCE_DIR) +
        "/conformance/adapters/numpy')\nimport safetensors_np as st\nimport numpy as np\n"
        "jobs = [json.loads(l) for l in open(sys.argv[-1])]\n";
    write_text(dir_ / "garbage.py", head + "for j in jobs: open(j['output'], 'w').write('garbage')\n");
    write_text(dir_ / "wrong_dtype.py", head +
        "for j in jobs:\n  t, m = st.load(j['input'])\n  st.save(j['output'], {'out': np.zeros((1,1,t['q'].shape[2],4), np.float64)}, {})\n");
    write_text(dir_ / "wrong_shape.py", head +
        "for j in jobs:\n  st.save(j['output'], {'out': np.zeros((1,1,1,4), np.float32)}, {})\n");
    write_text(dir_ / "zeros.py", head +
        "for j in jobs:\n  t, m = st.load(j['input'])\n  st.save(j['output'], {'out': np.zeros((1,1,t['q'].shape[2],4), np.float32), 'weights': np.zeros((1,1,t['q'].shape[2],t['k'].shape[2]), np.float32)}, {})\n");
    write_text(dir_ / "nan.py", head +
        "for j in jobs:\n  t, m = st.load(j['input'])\n  st.save(j['output'], {'out': np.full((1,1,t['q'].shape[2],4), np.nan, np.float32), 'weights': np.zeros((1,1,t['q'].shape[2],t['k'].shape[2]), np.float32)}, {})\n");
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // Runs the gate; returns the exit status and the JSON report.
  int gate(const std::string& impl, nlohmann::json& report, const std::string& extra = "") {
    const fs::path json = dir_ / "report.json", xml = dir_ / "report.xml";
    fs::remove(json);
    fs::remove(xml);
    const std::string how = impl.rfind("--plugin ", 0) == 0 ? impl : "--impl " + impl;
    const int st = run("run " + (dir_ / "set").string() + " " + how + " --json " + json.string() +
                           " --junit " + xml.string() + " --all " + extra, out_);
    EXPECT_TRUE(fs::exists(json)) << out_;
    EXPECT_TRUE(fs::exists(xml)) << out_;
    if (fs::exists(json)) report = nlohmann::json::parse(std::ifstream(json));
    return st;
  }
  std::string py(const char* script) { return "'/usr/bin/python3 " + (dir_ / script).string() + "'"; }
  void expect_all_failed(const nlohmann::json& r, const std::string& word) {
    ASSERT_EQ(r["cases"].size(), 3u) << out_;
    for (const auto& c : r["cases"]) {
      EXPECT_EQ(c["status"], "fail") << c.dump();
      EXPECT_NE(c["reason"].get<std::string>().find(word), std::string::npos) << c.dump();
    }
  }
  static fs::path dir_;
  std::string out_;
};
fs::path Gate::dir_;

TEST_F(Gate, CorrectImplementationPasses) {
  nlohmann::json r;
  EXPECT_EQ(gate("'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                     "/conformance/adapters/numpy/attention.py'", r), 0) << out_;
  EXPECT_EQ(r["passed"], 3) << out_;
  EXPECT_NE(out_.find("3 passed, 0 failed, 0 skipped"), std::string::npos) << out_;
  // the report's schema (docs/CONTRACT.md, "The JSON report")
  EXPECT_EQ(r["schema"], "attnoracle-report/1");
  EXPECT_EQ(r["verdict"], "pass");
  EXPECT_EQ(r["require_all"], false);
  EXPECT_EQ(r["skipped_cases"].size(), 0u);
  for (const auto& c : r["cases"]) {
    ASSERT_EQ(c["tensors"].size(), 2u) << c.dump();  // out, weights
    for (const auto& t : c["tensors"]) {
      EXPECT_GT(t["largest_limit"].get<double>(), 0) << t.dump();
      EXPECT_EQ(t["over_limit"], 0) << t.dump();
      ASSERT_TRUE(t.contains("worst")) << t.dump();
      if (t["worst"].is_null()) continue;  // every element equal to its golden value
      EXPECT_EQ(t["worst"]["tensor"], t["tensor"]);
      EXPECT_LE(t["worst"]["limit_ratio"].get<double>(), 1) << t.dump();
      EXPECT_LE(t["worst"]["limit"].get<double>(), t["largest_limit"].get<double>()) << t.dump();
    }
  }
}

TEST_F(Gate, JsonReportSummarisesEachTensorsLimits) {
  nlohmann::json r;
  EXPECT_EQ(gate(py("zeros.py"), r), 1) << out_;
  EXPECT_EQ(r["verdict"], "fail");
  ASSERT_EQ(r["cases"].size(), 3u) << out_;
  for (const auto& c : r["cases"]) {
    EXPECT_EQ(c["status"], "fail") << c.dump();
    std::int64_t over = 0;
    double worst_ratio = 0;
    for (const auto& t : c["tensors"]) {
      over += t["over_limit"].get<std::int64_t>();
      ASSERT_TRUE(t["worst"].is_object()) << t.dump();
      const auto& w = t["worst"];
      EXPECT_EQ(w["tensor"], t["tensor"]);
      EXPECT_EQ(w["index"].size(), 4u) << w.dump();
      EXPECT_EQ(w["actual"], 0.0) << w.dump();
      // all zeros: the error is the exact value's magnitude, the ratio the error over the limit
      EXPECT_EQ(w["error"].get<double>(), std::abs(w["expected"].get<double>())) << w.dump();
      EXPECT_GT(w["limit"].get<double>(), 0) << w.dump();
      EXPECT_LE(w["limit"].get<double>(), t["largest_limit"].get<double>()) << t.dump();
      EXPECT_NEAR(w["limit_ratio"].get<double>(), w["error"].get<double>() / w["limit"].get<double>(),
                  1e-9 * w["limit_ratio"].get<double>()) << w.dump();
      EXPECT_EQ(w["limit_ratio"], t["worst_limit_ratio"]) << t.dump();
      EXPECT_GT(t["over_limit"].get<std::int64_t>(), 0) << t.dump();
      EXPECT_LE(t["over_limit"].get<std::int64_t>(), t["compared"].get<std::int64_t>()) << t.dump();
      worst_ratio = std::max(worst_ratio, w["limit_ratio"].get<double>());
    }
    EXPECT_EQ(over, c["failed_elements"].get<std::int64_t>()) << c.dump();
    EXPECT_EQ(c["worst"]["limit_ratio"].get<double>(), worst_ratio) << c.dump();
  }
}

TEST_F(Gate, CrashIsAFailedCase) {
  nlohmann::json r;
  EXPECT_EQ(gate("'kill -SEGV $$ #'", r), 1) << out_;
  expect_all_failed(r, "crashed");
}

TEST_F(Gate, HangIsATimeout) {
  nlohmann::json r;
  EXPECT_EQ(gate("'sleep 60 #'", r, "--timeout 1"), 1) << out_;
  expect_all_failed(r, "timed_out");
}

TEST_F(Gate, MissingOutputFails) {
  nlohmann::json r;
  EXPECT_EQ(gate("true", r), 1) << out_;
  expect_all_failed(r, "missing");
}

TEST_F(Gate, GarbageOutputFails) {
  nlohmann::json r;
  EXPECT_EQ(gate(py("garbage.py"), r), 1) << out_;
  expect_all_failed(r, "invalid");
}

TEST_F(Gate, WrongDtypeAndShapeFail) {
  nlohmann::json r;
  EXPECT_EQ(gate(py("wrong_dtype.py"), r), 1) << out_;
  expect_all_failed(r, "expected F32");
  EXPECT_EQ(gate(py("wrong_shape.py"), r), 1) << out_;
  expect_all_failed(r, "expected F32");
}

TEST_F(Gate, NanFails) {
  nlohmann::json r;
  EXPECT_EQ(gate(py("nan.py"), r), 1) << out_;
  expect_all_failed(r, "beyond the limit");
}

TEST_F(Gate, SelectionAndRequireAll) {
  nlohmann::json r;
  const std::string good = "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/numpy/attention.py'";
  EXPECT_EQ(gate(good, r, "--tag causal"), 0) << out_;
  EXPECT_EQ(r["cases"].size(), 1u);
  EXPECT_EQ(gate(good, r, "--profile fp16"), 0) << out_;  // F32 cases: all skipped
  EXPECT_EQ(r["skipped"], 3);
  EXPECT_EQ(gate(good, r, "--profile fp16 --require-all"), 1) << out_;
  // JUnit too: each skip a failure with its reason
  std::ifstream xml(dir_ / "report.xml");
  const std::string junit((std::istreambuf_iterator<char>(xml)), std::istreambuf_iterator<char>());
  EXPECT_NE(junit.find("tests=\"3\" failures=\"3\" skipped=\"0\""), std::string::npos) << junit;
  EXPECT_NE(junit.find("skipped, a failure under --require-all: profile fp16 does not cover F32 inputs"), std::string::npos)
      << junit;
}

TEST_F(Gate, RequireAllListsEachSkippedCase) {
  nlohmann::json r;
  const std::string good = "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/numpy/attention.py'";
  // without --all: under --require-all every skip is listed with its reason, not summarised
  const fs::path json = dir_ / "require-all.json";
  std::string out;
  EXPECT_EQ(run("run " + (dir_ / "set").string() + " --impl " + good + " --profile fp16 --require-all --json " +
                    json.string(), out), 1) << out;
  // the same reason: one entry naming every case
  EXPECT_NE(out.find("SKIP  3 cases: profile fp16 does not cover F32 inputs\n      case0, case1, case2\n"
                     "      failures under --require-all\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("skipped 3:"), std::string::npos) << out;
  EXPECT_NE(out.find("3 skipped (failures under --require-all)"), std::string::npos) << out;
  r = nlohmann::json::parse(std::ifstream(json));
  EXPECT_EQ(r["verdict"], "fail");
  EXPECT_EQ(r["require_all"], true);
  ASSERT_EQ(r["skipped_cases"].size(), 3u) << r.dump();
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(r["skipped_cases"][k]["id"], "case" + std::to_string(k));
    EXPECT_EQ(r["skipped_cases"][k]["reason"], "profile fp16 does not cover F32 inputs");
  }
  // without --require-all the skips are summarised, and the gate passes
  EXPECT_EQ(run("run " + (dir_ / "set").string() + " --impl " + good + " --profile fp16 --json " + json.string(), out), 0)
      << out;
  EXPECT_NE(out.find("skipped 3: profile fp16 does not cover F32 inputs"), std::string::npos) << out;
  r = nlohmann::json::parse(std::ifstream(json));
  EXPECT_EQ(r["verdict"], "pass");
  EXPECT_EQ(r["skipped_cases"].size(), 3u);
  // an unsupported case under --require-all, in check: listed, and the gate fails
  const fs::path res = dir_ / "results-unsupported";
  fs::create_directories(res);
  write_text(res / "case0.safetensors.unsupported", "no causal");
  EXPECT_EQ(run("check " + (dir_ / "set").string() + " --results " + res.string() + " --case case0 --require-all", out), 1)
      << out;
  EXPECT_NE(out.find("unsupported: no causal\n      a failure under --require-all"), std::string::npos) << out;
}

TEST_F(Gate, SelectionMatchingNoCaseIsBadUsage) {
  const std::string set = (dir_ / "set").string();
  const fs::path json = dir_ / "no-match.json";
  const fs::path res = dir_ / "results-empty";
  fs::create_directories(res);
  struct Expect {
    std::string selection, line;
  };
  const std::vector<Expect> expected = {
      {"--tag causl", set + ": --tag: no case matches (tags in this set: causal, plain)"},
      {"--dtype F16,BF16", set + ": --dtype: no case matches (input dtypes in this set: F32)"},
      {"--case case9", set + ": --case: no case matches (ids in this set: case0, case1, case2)"},
      {"--case case2 --tag plain",
       set + ": --tag: no case matches (tags among the cases the other selectors leave: causal)"},
      {"--tag causal --dtype F64",
       set + ": --dtype: no case matches (input dtypes among the cases the other selectors leave: F32)"},
  };
  for (const auto& e : expected)
    for (const std::string& cmd : {"run " + set + " --impl true", "check " + set + " --results " + res.string()})
      for (const std::string& more : {std::string(), std::string(" --require-all")}) {
        fs::remove(json);
        std::string out;
        EXPECT_EQ(run(cmd + " " + e.selection + more + " --json " + json.string(), out), 2) << cmd << e.selection << out;
        EXPECT_EQ(out, "attnoracle: error: " + e.line + "\n") << cmd << " " << e.selection;
        EXPECT_FALSE(fs::exists(json)) << cmd << " " << e.selection;
      }
}

TEST_F(Gate, TheImplementationRunsOnTheSelectedCasesOnly) {
  // a fake adapter that records its jobs file and the inputs it was given, and writes nothing
  const fs::path work = dir_ / "work-selected", seen = dir_ / "seen-jobs.jsonl";
  write_text(dir_ / "record.sh", "cp \"$1\" '" + seen.string() + "'\n");
  struct Expect {
    std::string selection;
    std::vector<std::string> ids;
  };
  const std::vector<Expect> expected = {
      {"--tag causal", {"case2"}},
      {"--tag plain", {"case0", "case1"}},
      {"--case case1,case2", {"case1", "case2"}},
      {"--tag plain,causal --case case0,case2", {"case0", "case2"}},
      {"--dtype F32 --case case1", {"case1"}},
      {"", {"case0", "case1", "case2"}},
  };
  for (const auto& e : expected) {
    fs::remove_all(work);
    fs::remove(seen);
    std::string out;
    EXPECT_EQ(run("run " + (dir_ / "set").string() + " --impl '/bin/sh " + (dir_ / "record.sh").string() + "' --work " +
                      work.string() + " " + e.selection, out), 1) << out;  // no output: missing
    std::vector<std::string> ids;
    std::ifstream jobs(seen);
    for (std::string line; std::getline(jobs, line);) {
      const auto j = nlohmann::json::parse(line);
      ids.push_back(j["id"]);
      EXPECT_EQ(j["input"], (work / "inputs" / (ids.back() + ".safetensors")).string());
    }
    EXPECT_EQ(ids, e.ids) << e.selection;
    std::vector<std::string> inputs;
    for (const auto& f : fs::directory_iterator(work / "inputs")) inputs.push_back(f.path().stem().string());
    std::sort(inputs.begin(), inputs.end());
    EXPECT_EQ(inputs, e.ids) << e.selection;
  }
}

TEST_F(Gate, PluginCrashingOnOneCaseFailsThatCaseOnly) {
  // misbehave hands every case to the naive C plugin but dies on one; the host is started again
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  ::setenv("ATTNORACLE_TEST_DELEGATE", NAIVE_C_PLUGIN, 1);
  for (const auto& [crash_on, how, sig] : std::vector<std::tuple<std::string, std::string, int>>{
           {"case1", "segv", 11}, {"case0", "abort", 6}, {"case2", "segv", 11}}) {
    ::setenv("ATTNORACLE_TEST_CRASH_ON", crash_on.c_str(), 1);
    ::setenv("ATTNORACLE_TEST_CRASH_HOW", how.c_str(), 1);
    nlohmann::json r;
    EXPECT_EQ(gate("--plugin " + std::string(MISBEHAVE_PLUGIN), r), 1) << out_;
    ASSERT_EQ(r["cases"].size(), 3u) << out_;
    for (const auto& c : r["cases"]) {
      if (c["id"] == crash_on) {
        EXPECT_EQ(c["status"], "fail") << c.dump();
        EXPECT_EQ(c["reason"].get<std::string>().rfind("crashed: signal " + std::to_string(sig) + " on case " + crash_on, 0),
                  0u) << c.dump();
      } else {
        EXPECT_EQ(c["status"], "pass") << c.dump() << out_;
      }
    }
    EXPECT_EQ(r["passed"], 2) << out_;
    EXPECT_EQ(r["failed"], 1) << out_;
  }
  ::unsetenv("ATTNORACLE_TEST_DELEGATE");
  ::unsetenv("ATTNORACLE_TEST_CRASH_ON");
  ::unsetenv("ATTNORACLE_TEST_CRASH_HOW");
}

TEST_F(Gate, CheckOfflineResults) {
  // results produced by running the adapter on the case files themselves
  const fs::path res = dir_ / "results";
  fs::create_directories(res);
  std::string jobs;
  for (int k = 0; k < 3; ++k) {
    const std::string id = "case" + std::to_string(k);
    jobs += nlohmann::json{{"id", id}, {"input", (dir_ / "set" / "cases" / (id + ".safetensors")).string()},
                           {"output", (res / (id + ".safetensors")).string()}}.dump() + "\n";
  }
  write_text(dir_ / "jobs.jsonl", jobs);
  std::string out;
  ASSERT_EQ(std::system(("/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                         "/conformance/adapters/numpy/attention.py " + (dir_ / "jobs.jsonl").string()).c_str()), 0);
  EXPECT_EQ(run("check " + (dir_ / "set").string() + " --results " + res.string(), out), 0) << out;
  fs::remove(res / "case1.safetensors");
  EXPECT_EQ(run("check " + (dir_ / "set").string() + " --results " + res.string(), out), 1) << out;
  EXPECT_NE(out.find("missing"), std::string::npos) << out;
}

TEST_F(Gate, CheckReadsResultsAsRunDoes) {
  // check and run classify one job's files with the same reader, and the same messages
  const fs::path res = dir_ / "results-states";
  fs::create_directories(res);
  write_text(res / "case0.safetensors.error", "refused\tfor a reason\n");
  write_text(res / "case0.safetensors.unsupported", "no");
  write_text(res / "case1.safetensors", "garbage");
  write_text(res / "case2.safetensors.unsupported", "  softcap\n");
  const fs::path json = dir_ / "states.json";
  std::string out;
  EXPECT_EQ(run("check " + (dir_ / "set").string() + " --results " + res.string() + " --json " + json.string(), out), 1)
      << out;
  const nlohmann::json r = nlohmann::json::parse(std::ifstream(json));
  ASSERT_EQ(r["cases"].size(), 3u) << out;
  EXPECT_NE(r["cases"][0]["reason"].get<std::string>().find(
                "wrote both output.error and output.unsupported (exactly one is allowed)"),
            std::string::npos) << r.dump();
  EXPECT_NE(r["cases"][1]["reason"].get<std::string>().find("invalid"), std::string::npos) << r.dump();
  EXPECT_EQ(r["cases"][2]["status"], "skip") << r.dump();
  EXPECT_NE(r["cases"][2]["reason"].get<std::string>().find("unsupported: softcap"), std::string::npos) << r.dump();
  // the same files written by an implementation under run
  write_text(dir_ / "states.sh",
             "while read -r l; do o=$(echo \"$l\" | sed 's/.*\"output\": *\"\\([^\"]*\\)\".*/\\1/');"
             " case \"$o\" in *case0*) printf 'refused' > \"$o.error\"; printf no > \"$o.unsupported\";;"
             " *case1*) printf garbage > \"$o\";; *) printf '  softcap\\n' > \"$o.unsupported\";; esac; done < \"$1\"\n");
  nlohmann::json g;
  EXPECT_EQ(gate("'/bin/sh " + (dir_ / "states.sh").string() + "'", g), 1) << out_;
  ASSERT_EQ(g["cases"].size(), 3u) << out_;
  auto text = [](const nlohmann::json& c) {  // the reason, without the directory of the file
    const std::string s = c["reason"].get<std::string>();
    const auto at = s.find("case1.safetensors");
    return at == std::string::npos ? s : s.substr(at);
  };
  for (int k = 0; k < 3; ++k) EXPECT_EQ(text(g["cases"][k]), text(r["cases"][k])) << g.dump() << r.dump();
}

TEST_F(Gate, BadUsageAndAlteredSetsAreRefused) {
  std::string out;
  EXPECT_EQ(run("run " + (dir_ / "nowhere").string() + " --impl true", out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error:"), std::string::npos) << out;
  EXPECT_EQ(run("run " + (dir_ / "set").string() + " --impl true --profile fp7", out), 2) << out;
  // an altered case file: its hash no longer matches the manifest
  const fs::path copy = dir_ / "altered";
  fs::copy(dir_ / "set", copy, fs::copy_options::recursive);
  {
    std::fstream f(copy / "cases" / "case0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_EQ(run("run " + copy.string() + " --impl true", out), 2) << out;
  EXPECT_NE(out.find("sha256"), std::string::npos) << out;
  // altered where the reader would refuse it too (its JSON header, its length): the hash is
  // what is said first, not the first problem reading finds
  const fs::path cf = copy / "cases" / "case0.safetensors";
  fs::copy_file(dir_ / "set" / "cases" / "case0.safetensors", cf, fs::copy_options::overwrite_existing);
  {
    std::fstream f(cf, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('[');
  }
  EXPECT_EQ(run("run " + copy.string() + " --impl true", out), 2) << out;
  EXPECT_NE(out.find("case0.safetensors: sha256 differs from the manifest"), std::string::npos) << out;
  fs::resize_file(cf, fs::file_size(cf) - 3);
  EXPECT_EQ(run("run " + copy.string() + " --impl true", out), 2) << out;
  EXPECT_NE(out.find("case0.safetensors: sha256 differs from the manifest"), std::string::npos) << out;
}

// The set's stamp of verified files (verify writes it): a file changed since is hashed and
// refused, its modification time set back or not; a stamp recording the changed file's identity
// is trusted (no hash taken, nothing refused), and --rehash takes the hash anyway.
TEST_F(Gate, VerifiedStampSkipsTheHashOfUnchangedFilesOnly) {
  const fs::path set = dir_ / "stamped";
  fs::remove_all(set);
  fs::copy(dir_ / "set", set, fs::copy_options::recursive);
  std::string out;
  ASSERT_EQ(run("verify " + set.string(), out), 0) << out;
  ASSERT_TRUE(fs::exists(set / vectors::kVerifiedStamp));
  EXPECT_NE(run("run " + set.string() + " --impl true", out), 2) << out;
  const fs::path cf = set / "cases" / "case0.safetensors";
  const auto when = fs::last_write_time(cf);
  {
    std::fstream f(cf, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  fs::last_write_time(cf, when);
  EXPECT_EQ(run("run " + set.string() + " --impl true", out), 2) << out;
  EXPECT_NE(out.find("case0.safetensors: sha256 differs from the manifest"), std::string::npos) << out;
  const fs::path res = dir_ / "golden_results";  // the untouched golden files as results
  fs::remove_all(res);
  fs::copy(dir_ / "set" / "cases", res, fs::copy_options::recursive);
  EXPECT_EQ(run("check " + set.string() + " --results " + res.string(), out), 1) << out;  // a failed case
  EXPECT_NE(out.find("bad golden file: " + cf.string() + ": sha256 differs from the manifest"), std::string::npos)
      << out;
  EXPECT_NE(out.find("2 passed, 1 failed"), std::string::npos) << out;

  const nlohmann::json m = nlohmann::json::parse(std::ifstream(set / "manifest.json"));
  vectors::record_verified(set.string(), {{"cases/case0.safetensors", m["cases"][0]["sha256"].get<std::string>()}});
  EXPECT_NE(run("run " + set.string() + " --impl true", out), 2) << out;
  EXPECT_EQ(out.find("sha256"), std::string::npos) << out;
  EXPECT_EQ(run("run " + set.string() + " --impl true --rehash", out), 2) << out;
  EXPECT_NE(out.find("case0.safetensors: sha256 differs from the manifest"), std::string::npos) << out;
  EXPECT_EQ(run("check " + set.string() + " --results " + res.string(), out), 0) << out;
  EXPECT_EQ(run("check " + set.string() + " --results " + res.string() + " --rehash", out), 1) << out;
  EXPECT_NE(out.find("sha256 differs from the manifest"), std::string::npos) << out;
}

TEST_F(Gate, NothingIsReadOutsideTheSet) {
  // A copy of the set whose manifest, then one case file, is a link to a file outside it.
  const fs::path set = dir_ / "linked", outside = dir_ / "outside";
  fs::remove_all(set);
  fs::remove_all(outside);
  fs::copy(dir_ / "set", set, fs::copy_options::recursive);
  fs::create_directories(outside);
  const std::string impl = " --impl '/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                           "/conformance/adapters/numpy/attention.py'";
  fs::rename(set / "manifest.json", outside / "manifest.json");
  fs::create_symlink(outside / "manifest.json", set / "manifest.json");
  EXPECT_EQ(run("run " + set.string() + impl, out_), 2) << out_;
  EXPECT_NE(out_.find("manifest.json: leads outside"), std::string::npos) << out_;
  fs::remove(set / "manifest.json");
  fs::copy_file(outside / "manifest.json", set / "manifest.json");
  fs::rename(set / "cases" / "case1.safetensors", outside / "case1.safetensors");
  fs::create_symlink(outside / "case1.safetensors", set / "cases" / "case1.safetensors");
  EXPECT_EQ(run("run " + set.string() + impl, out_), 2) << out_;
  EXPECT_NE(out_.find("case1.safetensors: leads outside"), std::string::npos) << out_;
  fs::remove(set / "cases" / "case1.safetensors");
  ASSERT_EQ(::mkfifo((set / "cases" / "case1.safetensors").c_str(), 0600), 0);
  EXPECT_EQ(run("run " + set.string() + impl, out_), 2) << out_;
  EXPECT_NE(out_.find("is a FIFO, not a regular file"), std::string::npos) << out_;
}

// Whether text is valid UTF-8 (nlohmann parses only that).
bool valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();  // strict: throws on a byte that is not UTF-8
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// What an implementation writes reaches the reports as valid UTF-8 without control characters,
// whatever bytes it wrote: on stderr before exiting 1, in .error and .unsupported files (NUL
// bytes, invalid sequences, one of 1 MiB).
TEST_F(Gate, ImplementationTextThatIsNotUtf8) {
  write_text(dir_ / "bytes.py",
             "import json, os, sys\n"
             "jobs = [json.loads(l) for l in open(sys.argv[-1])]\n"
             "open(jobs[0]['output'] + '.error', 'wb').write(b'bad \\xff\\xfe\\x00 \\x1b[31mred\\xc3')\n"
             "open(jobs[1]['output'] + '.unsupported', 'wb').write(b'\\x80' * (1 << 20))\n"
             "os.write(2, b'\\xff\\xfe\\x00\\x1b[2J not UTF-8 \\xe2\\x82\\n' * 3)\n"
             "sys.exit(1)\n");
  nlohmann::json r;
  EXPECT_EQ(gate(py("bytes.py"), r), 1) << out_;
  ASSERT_EQ(r["cases"].size(), 3u) << out_;
  EXPECT_EQ(r["cases"][0]["status"], "fail");
  const std::string reason = r["cases"][0]["reason"];
  EXPECT_NE(reason.find("bad ?? [31mred?"), std::string::npos) << reason;
  EXPECT_EQ(r["cases"][1]["status"], "skip");
  EXPECT_LE(r["cases"][1]["reason"].get<std::string>().size(), 600u);
  EXPECT_NE(r["cases"][2]["reason"].get<std::string>().find("exited with status 1"), std::string::npos) << r.dump();
  const std::string note = r["note"];
  EXPECT_NE(note.find("\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD[2J not UTF-8 \xEF\xBF\xBD\xEF\xBF\xBD\n"), std::string::npos) << note;
  for (const std::string& text : {out_, testing::read_text(dir_ / "report.xml"), r.dump()}) {
    EXPECT_TRUE(valid_utf8(text)) << text;
    EXPECT_EQ(text.find('\x1b'), std::string::npos);
    EXPECT_EQ(text.find('\0'), std::string::npos);
  }
}

// check reads a result only as a regular file in the results directory: a link (to a file
// outside, to a device, to nowhere), a FIFO or a directory fails its case, without blocking.
TEST_F(Gate, CheckReadsOnlyRegularFiles) {
  const fs::path res = dir_ / "results-hostile", json = dir_ / "hostile.json";
  fs::create_directories(res);
  fs::copy_file(dir_ / "set" / "cases" / "case0.safetensors", dir_ / "outside.safetensors",
                fs::copy_options::overwrite_existing);
  struct Plant {
    std::function<void(const fs::path&)> make;
    std::string reason;
  };
  const std::vector<Plant> plants = {
      {[](const fs::path& p) { fs::create_symlink("/etc/passwd", p); }, "is a symbolic link"},
      {[](const fs::path& p) { fs::create_symlink("/dev/zero", p); }, "is a symbolic link"},
      {[&](const fs::path& p) { fs::create_symlink(dir_ / "outside.safetensors", p); }, "is a symbolic link"},
      {[](const fs::path& p) { fs::create_symlink("/nowhere/at/all", p); }, "is a symbolic link"},
      {[](const fs::path& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0); }, "not a regular file"},
      {[](const fs::path& p) { fs::create_directory(p); }, "not a regular file"},
      {[](const fs::path& p) { write_text(p, ""); }, "too short for the 8-byte header length"},
      {[](const fs::path& p) { write_text(p, "name,value\nq,1\n"); }, "not a safetensors file"},
  };
  for (const auto& plant : plants)
    for (const char* suffix : {"", ".error"}) {
      fs::remove_all(res);
      fs::create_directories(res);
      plant.make(res / (std::string("case1.safetensors") + suffix));
      std::string out;
      EXPECT_EQ(run("check " + (dir_ / "set").string() + " --results " + res.string() + " --case case1 --json " + json.string(),
                    out), 1) << out;
      const nlohmann::json r = nlohmann::json::parse(std::ifstream(json));
      ASSERT_EQ(r["cases"].size(), 1u) << out;
      EXPECT_EQ(r["cases"][0]["status"], "fail") << r.dump();
      const std::string reason = r["cases"][0]["reason"];
      if (*suffix && plant.reason.find("header") != std::string::npos) continue;  // text: read as text
      if (*suffix && plant.reason.find("safetensors") != std::string::npos) continue;
      EXPECT_NE(reason.find(plant.reason), std::string::npos) << suffix << ": " << reason;
    }
}

// A set whose cases/ directory is a link to a directory outside it: refused, naming the file.
TEST_F(Gate, CasesDirectoryLinkedOutsideIsRefused) {
  const fs::path set = dir_ / "linked-cases", outside = dir_ / "outside-cases";
  fs::remove_all(set);
  fs::remove_all(outside);
  fs::create_directories(set);
  fs::copy(dir_ / "set" / "cases", outside, fs::copy_options::recursive);
  fs::copy_file(dir_ / "set" / "manifest.json", set / "manifest.json");
  fs::create_directory_symlink(outside, set / "cases");
  for (const std::string& cmd : {"run " + set.string() + " --impl true", "check " + set.string() + " --results " + dir_.string(),
                                 "verify " + set.string()}) {
    std::string out;
    EXPECT_EQ(run(cmd, out), 2) << out;
    EXPECT_EQ(out, "attnoracle: error: " + (set / "cases").string() + ": leads outside " + set.string() + " (to " +
                       fs::canonical(outside).string() + ")\n") << cmd;
  }
}

// Neighbours of the adapter protocol: an implementation that writes results for ids it was not
// given, writes a result then deletes it, or never exits; a work directory with spaces.
TEST_F(Gate, ImplementationsThatMisbehaveOtherwise) {
  write_text(dir_ / "others.py",
             "import json, os, sys\n"
             "jobs = [json.loads(l) for l in open(sys.argv[-1])]\n"
             "d = os.path.dirname(jobs[0]['output'])\n"
             "open(os.path.join(d, 'case9.safetensors'), 'w').write('x')\n"
             "open(jobs[0]['output'], 'w').write('x'); os.remove(jobs[0]['output'])\n");
  nlohmann::json r;
  EXPECT_EQ(gate(py("others.py"), r), 1) << out_;
  expect_all_failed(r, "missing");
  const fs::path work = dir_ / "a work dir";
  fs::remove_all(work);
  std::string out;
  EXPECT_EQ(run("run " + (dir_ / "set").string() + " --impl '/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                    "/conformance/adapters/numpy/attention.py' --work '" + work.string() + "'", out), 0) << out;
  EXPECT_EQ(gate("'sleep 100 & sleep 100; #'", r, "--timeout 0.5"), 1) << out_;
  expect_all_failed(r, "timed_out");
}

// The NumPy adapter, then the results of the ids that end with SUFFIX replaced by a refusal (not
// UTF-8): `mixed() + " SUFFIX"`.
std::string mixed() {
  const std::string script =
      (fs::temp_directory_path() / ("attnoracle-gate-test-" + std::to_string(::getpid())) / "mixed.sh").string();
  testing::write_text(script, "/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                                  "/conformance/adapters/numpy/attention.py \"$2\" || exit\n"
                                  "for o in $(sed -n \"s/.*\\\"output\\\": *\\\"\\([^\\\"]*\\/[^\\/\\\"]*$1\\.safetensors\\)\\\".*/\\1/p\" \"$2\"); do\n"
                                  "  rm \"$o\"; printf 'no \\377' > \"$o.error\"; done\n");
  return "/bin/sh " + script;
}

// run --shard k/n: the cases whose position in the manifest is k modulo n; merge gives the
// verdict, the text, JUnit and JSON of the run over all of them.
TEST_F(Gate, ShardsMergeIntoOneRun) {
  const std::string set = (dir_ / "set").string();
  const std::string impl = " --impl '" + mixed() + " case1'";
  std::string one, out;
  const fs::path j1 = dir_ / "one.json", x1 = dir_ / "one.xml";
  EXPECT_EQ(run("run " + set + impl + " --all --json " + j1.string() + " --junit " + x1.string(), one), 1) << one;
  std::string reports;
  for (int k = 0; k < 4; ++k) {  // shard 3 holds no case
    const std::string json = (dir_ / ("shard" + std::to_string(k) + ".json")).string();
    EXPECT_EQ(run("run " + set + impl + " --shard " + std::to_string(k) + "/4 --json " + json, out), k == 1 ? 1 : 0) << out;
    EXPECT_NE(out.find("shard " + std::to_string(k) + "/4: " + (k < 3 ? "1" : "0") + " of the 3 cases selected"),
              std::string::npos) << out;
    const nlohmann::json r = nlohmann::json::parse(std::ifstream(json));
    EXPECT_EQ(r["shard"], (nlohmann::json{{"index", k}, {"count", 4}, {"selected", 3}}));
    reports = json + " " + reports;  // in any order
  }
  const fs::path jm = dir_ / "merged.json", xm = dir_ / "merged.xml", hm = dir_ / "merged.html", hr = dir_ / "report.html";
  std::string merged;
  EXPECT_EQ(run("merge " + reports + "--all --json " + jm.string() + " --junit " + xm.string() + " --html " + hm.string(),
                merged), 1) << merged;
  auto without_time = [](std::string s, const std::string& from, char to) {
    for (auto at = s.find(from); at != std::string::npos; at = s.find(from, at + 1)) s.erase(at, s.find(to, at + from.size()) - at);
    return s;
  };
  EXPECT_EQ(without_time(merged, " cases in ", ':'), without_time(one, " cases in ", ':'));
  EXPECT_EQ(without_time(testing::read_text(xm), "time=\"", '"'), without_time(testing::read_text(x1), "time=\"", '"'));
  nlohmann::json a = nlohmann::json::parse(std::ifstream(j1)), b = nlohmann::json::parse(std::ifstream(jm));
  EXPECT_GE(b["seconds"].get<double>(), 0);
  a.erase("seconds");
  b.erase("seconds");
  EXPECT_EQ(a, b);
  EXPECT_EQ(b["verdict"], "fail");
  EXPECT_EQ(b["failed"], 1);
  EXPECT_EQ(run("report " + jm.string() + " --html " + hr.string(), out), 0) << out;
  EXPECT_EQ(testing::read_text(hm), testing::read_text(hr));
}

// The same on a part of vectors/core, several dtypes and profiles, a dtype selection (a shard may
// hold none of it) and failures.
TEST_F(Gate, ShardsOfTheCoreSetMergeIntoOneRun) {
  const std::string set = std::string(ATTNORACLE_SOURCE_DIR) + "/vectors/core";
  const std::string args = " --impl '" + mixed() + " 1' --tag softcap --dtype F32,F16,BF16 --profile standard --all";
  std::string one, out, merged, reports;
  const fs::path j1 = dir_ / "core.json", x1 = dir_ / "core.xml", jm = dir_ / "core-merged.json", xm = dir_ / "core-merged.xml";
  const int status = run("run " + set + args + " --json " + j1.string() + " --junit " + x1.string(), one);
  EXPECT_EQ(status, 1) << one;
  for (int k = 0; k < 4; ++k) {
    const std::string json = (dir_ / ("core" + std::to_string(k) + ".json")).string();
    EXPECT_LE(run("run " + set + args + " --shard " + std::to_string(k) + "/4 --json " + json, out), 1) << out;
    reports += json + " ";
  }
  EXPECT_EQ(run("merge " + reports + "--all --json " + jm.string() + " --junit " + xm.string(), merged), status) << merged;
  nlohmann::json a = nlohmann::json::parse(std::ifstream(j1)), b = nlohmann::json::parse(std::ifstream(jm));
  ASSERT_GT(a["cases"].size(), 10u);
  EXPECT_GT(a["failed"].get<int>(), 0);
  EXPECT_GT(a["passed"].get<int>(), 0);
  ASSERT_EQ(a["cases"].size(), b["cases"].size());
  for (std::size_t k = 0; k < a["cases"].size(); ++k) {  // case for case
    EXPECT_EQ(a["cases"][k]["id"], b["cases"][k]["id"]);
    EXPECT_EQ(a["cases"][k]["status"], b["cases"][k]["status"]) << a["cases"][k]["id"];
  }
  a.erase("seconds");
  b.erase("seconds");
  EXPECT_EQ(a, b);
  const std::size_t cut = one.rfind(" cases in "), cut_m = merged.rfind(" cases in ");
  EXPECT_EQ(merged.substr(0, cut_m), one.substr(0, cut));
  EXPECT_EQ(merged.substr(merged.find(':', cut_m)), one.substr(one.find(':', cut)));
}

// check --shard, merged: the verdict of one check.
TEST_F(Gate, CheckShardsMergeIntoOneCheck) {
  const fs::path res = dir_ / "results-shards";
  fs::create_directories(res);
  write_text(res / "case0.safetensors.unsupported", "no \xff");
  write_text(res / "case1.safetensors.error", "refused");
  write_text(res / "case2.safetensors", "garbage");
  const std::string cmd = "check " + (dir_ / "set").string() + " --results " + res.string() + " --all";
  std::string one, out, merged;
  const fs::path j1 = dir_ / "check.json", jm = dir_ / "check-merged.json";
  EXPECT_EQ(run(cmd + " --json " + j1.string(), one), 1) << one;
  std::string reports;
  for (int k = 0; k < 2; ++k) {
    const std::string json = (dir_ / ("check" + std::to_string(k) + ".json")).string();
    EXPECT_EQ(run(cmd + " --shard " + std::to_string(k) + "/2 --json " + json, out), 1) << out;
    reports += json + " ";
  }
  EXPECT_EQ(run("merge " + reports + "--all --json " + jm.string(), merged), 1) << merged;
  nlohmann::json a = nlohmann::json::parse(std::ifstream(j1)), b = nlohmann::json::parse(std::ifstream(jm));
  a.erase("seconds");
  b.erase("seconds");
  EXPECT_EQ(a, b);
  EXPECT_EQ(b["skipped"], 1);
  EXPECT_EQ(b["failed"], 2);
  EXPECT_EQ(merged.substr(0, merged.rfind(" cases in ")), one.substr(0, one.rfind(" cases in ")));
}

// merge refuses what is not every shard of one run, in one line, writing nothing.
TEST_F(Gate, MergeRefusesWhatIsNotOneRunsShards) {
  const std::string set = (dir_ / "set").string();
  const std::string good = " --impl '/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/numpy/attention.py'";
  auto shard = [&](const std::string& name, const std::string& args) {
    const std::string json = (dir_ / (name + ".json")).string();
    std::string out;
    EXPECT_EQ(run("run " + set + good + " --json " + json + " " + args, out), 0) << out;
    return json;
  };
  const std::string s0 = shard("m0", "--shard 0/2"), s1 = shard("m1", "--shard 1/2"), whole = shard("mw", "");
  const std::string fp64 = shard("m1-fp64", "--shard 1/2 --profile fp64"), of3 = shard("m1-of3", "--shard 1/3");
  const std::string tagged = shard("m1-tag", "--shard 1/2 --tag plain");
  const fs::path out_json = dir_ / "refused.json";
  struct Expect {
    std::string args, line;
  };
  const std::vector<Expect> expected = {
      {s0 + " " + s1, ""},
      {s0, s0 + ": shard: shard 1 of 2 is missing: give every shard's report"},
      {s0 + " " + s0, s0 + ": shard: shard 0/2 is also " + s0},
      {s0 + " " + whole, whole + ": shard: missing: not the report of one shard (run or check with --shard and --json)"},
      {s0 + " " + fp64, fp64 + ": profile: \"fp64\" differs from \"fp32\" in " + s0},
      {s0 + " " + of3, of3 + ": shard.count: 3 shards, " + s0 + " has 2: not shards of one run"},
      {s0 + " " + tagged, tagged + ": shard.selected: 2 cases selected, " + s0 + " has 3: other selectors"},
      {s0 + " " + (dir_ / "garbage.py").string(), (dir_ / "garbage.py").string() + ": not JSON (a report written by run or check with --json)"},
  };
  for (const auto& e : expected) {
    fs::remove(out_json);
    std::string out;
    const int st = run("merge " + e.args + " --json " + out_json.string(), out);
    if (e.line.empty()) {
      EXPECT_EQ(st, 0) << out;
      EXPECT_TRUE(fs::exists(out_json));
      continue;
    }
    EXPECT_EQ(st, 2) << out;
    EXPECT_EQ(out, "attnoracle: error: " + e.line + "\n") << e.args;
    EXPECT_FALSE(fs::exists(out_json)) << e.args;
  }
  // a case in two shards' reports
  nlohmann::json r = nlohmann::json::parse(std::ifstream(s1));
  r["cases"].push_back(nlohmann::json::parse(std::ifstream(s0))["cases"][0]);
  write_text(dir_ / "m1-overlap.json", r.dump());
  std::string out;
  EXPECT_EQ(run("merge " + s0 + " " + (dir_ / "m1-overlap.json").string(), out), 2) << out;
  EXPECT_EQ(out, "attnoracle: error: " + (dir_ / "m1-overlap.json").string() + ": cases: case case0 is also in " + s0 + "\n");
  // --shard values
  EXPECT_EQ(run("check " + set + " --results " + dir_.string() + " --shard 2/2", out), 2) << out;
  EXPECT_EQ(out, "attnoracle: error: --shard: \"2/2\" is not k/n with 0 <= k < n\n");
  ::setenv("ATTNORACLE_SHARD_INDEX", "1", 1);
  ::setenv("ATTNORACLE_SHARD_COUNT", "2", 1);
  const std::string json = (dir_ / "auto.json").string();
  EXPECT_EQ(run("run " + set + good + " --shard auto --json " + json, out), 0) << out;
  ::unsetenv("ATTNORACLE_SHARD_INDEX");
  ::unsetenv("ATTNORACLE_SHARD_COUNT");
  EXPECT_NE(out.find("attnoracle: shard 1/2 (from ATTNORACLE_SHARD_INDEX, ATTNORACLE_SHARD_COUNT)"), std::string::npos) << out;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(json))["cases"].size(), 1u);
}

// run's work directory is made by mkdtemp (a name no one can plant a link at beforehand), and is
// kept and named with --keep.
TEST_F(Gate, WorkDirectoryIsFresh) {
  const std::string good = "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/numpy/attention.py'";
  std::string out;
  ASSERT_EQ(run("run " + (dir_ / "set").string() + " --impl " + good + " --keep", out), 0) << out;
  const std::string key = "work directory kept: ";
  const auto at = out.find(key);
  ASSERT_NE(at, std::string::npos) << out;
  const fs::path work = out.substr(at + key.size(), out.find('\n', at) - at - key.size());
  EXPECT_EQ(work.parent_path(), fs::temp_directory_path());
  const std::string name = work.filename().string();
  ASSERT_EQ(name.rfind("attnoracle-run-", 0), 0u) << name;
  EXPECT_NE(name, "attnoracle-run-" + std::to_string(::getpid()));
  struct stat st {};
  ASSERT_EQ(::lstat(work.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);  // mkdtemp's
  EXPECT_TRUE(fs::exists(work / "inputs"));
  fs::remove_all(work);
}

}  // namespace
}  // namespace attnoracle
