// run_adapter against fake implementations: small /bin/sh scripts that follow the adapter
// protocol well or badly (crash, hang, garbage, chatter, lingering children).
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Running, as opposed to gone or a zombie waiting for its parent.
bool process_alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return false;
  const auto p = line.rfind(')');
  if (p == std::string::npos || p + 2 >= line.size()) return false;
  return line[p + 2] != 'Z' && line[p + 2] != 'X';
}

bool gone_soon(pid_t pid) {
  for (int i = 0; i < 100; ++i) {
    if (!process_alive(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The sh helpers every fake adapter starts with: `outputs JOBS` prints each job's output path
// (the last field of the line, keys being sorted; \" and \\ unescaped: enough for these paths).
const char* kPrelude = R"sh(#!/bin/sh
ulimit -c 0
outputs() { sed -e 's/.*"output":"\(.*\)"}$/\1/' -e 's/\\"/"/g' -e 's/\\\\/\\/g' "$1"; }
outputs "$1" > "$1.outs"
)sh";

class AdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "attnoracle-adapter-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    dir_ = root_;
    good_ = root_ / "good.safetensors";
    RawTensor t;
    t.name = "out";
    t.dtype = DType::F32;
    t.shape = {2, 3};
    t.data.resize(24);
    for (std::size_t e = 0; e < 6; ++e)
      encode_float(DType::F32, 0.5 * static_cast<double>(e), t.data.data() + 4 * e);
    expected_.put(t);
    write_file_atomic(good_.string(), serialize_safetensors(expected_));
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // A script in dir_: the prelude, GOOD set to the valid output, then `body`.
  std::string script(const std::string& name, const std::string& body) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << kPrelude << "GOOD=" << quote(good_.string()) << "\n" << body;
    fs::permissions(p, fs::perms::owner_all);
    return quote(p.string());
  }

  std::vector<AdapterJob> jobs(int n) {
    std::vector<AdapterJob> js;
    for (int i = 0; i < n; ++i) {
      const std::string k = std::to_string(i);
      js.push_back({"job " + k, (dir_ / ("in " + k + ".safetensors")).string(),
                    (dir_ / ("out " + k + ".safetensors")).string()});
    }
    return js;
  }

  AdapterRun run(const std::string& command, const std::vector<AdapterJob>& js,
                 double timeout = 0) {
    return run_adapter(command, js, (dir_ / "work").string(), timeout);
  }
  fs::path jobs_file() const { return dir_ / "work" / "jobs.jsonl"; }
  // The copy of the jobs file the script made: one line per job, ids and paths as given (and
  // nothing more when `all`).
  void expect_jobs_file(const std::vector<AdapterJob>& js, bool all) const {
    std::ifstream copy(jobs_file().string() + ".copy");
    std::string line;
    for (const auto& j : js) {
      ASSERT_TRUE(std::getline(copy, line));
      const auto parsed = nlohmann::json::parse(line);
      EXPECT_EQ(parsed.at("id"), j.id);
      if (all) {
        EXPECT_EQ(parsed.at("input"), j.input);
      }
      EXPECT_EQ(parsed.at("output"), j.output);
    }
    if (all) {
      EXPECT_FALSE(std::getline(copy, line));
    }
  }

  void expect_good(const JobResult& r) {
    ASSERT_EQ(r.outcome, Outcome::Output) << r.reason;
    EXPECT_EQ(r.reason, "");
    const RawTensor* out = r.output.find("out");
    ASSERT_NE(out, nullptr);
    EXPECT_EQ(out->shape, (std::vector<std::int64_t>{2, 3}));
    EXPECT_EQ(out->data, expected_.find("out")->data);
  }

  fs::path root_, dir_, good_;
  SafeTensorsFile expected_;
};

const char* kCopyAll = R"sh(while IFS= read -r out; do cp "$GOOD" "$out"; done < "$1.outs"
)sh";

TEST_F(AdapterTest, GoodAdapterOutputsAndJobsFile) {
  const auto js = jobs(3);
  const auto r = run(script("good.sh", std::string("cp \"$1\" \"$1.copy\"\n") + kCopyAll), js);
  EXPECT_EQ(r.exit_status, 0);
  EXPECT_FALSE(r.signaled);
  EXPECT_FALSE(r.timed_out);
  EXPECT_LT(r.seconds, 5);
  ASSERT_EQ(r.results.size(), 3u);
  for (const auto& res : r.results) expect_good(res);

  expect_jobs_file(js, true);
}

TEST_F(AdapterTest, RefusedAndUnsupportedText) {
  const auto r = run(script("refuse.sh", R"sh(n=0
while IFS= read -r out; do
  case $n in
    0) printf '  fully masked row\n\tat b=0, h=1\r\n\n' > "$out.error" ;;
    1) printf 'dtype F8_E4M3' > "$out.unsupported" ;;
    2) head -c 100000 /dev/zero | tr '\0' x > "$out.error" ;;
    3) : > "$out.error" ;;
    4) printf 'bad \377\376 bytes \303\251' > "$out.error" ;;
    5) printf 'red\033[31m\302\233x' > "$out.unsupported" ;;
  esac
  n=$((n+1))
done < "$1.outs"
)sh"),
                     jobs(6));
  ASSERT_EQ(r.results.size(), 6u);
  EXPECT_EQ(r.results[0].outcome, Outcome::Refused);
  EXPECT_EQ(r.results[0].reason, "fully masked row at b=0, h=1");
  EXPECT_EQ(r.results[1].outcome, Outcome::Unsupported);
  EXPECT_EQ(r.results[1].reason, "dtype F8_E4M3");
  EXPECT_EQ(r.results[2].outcome, Outcome::Refused);
  EXPECT_EQ(r.results[2].reason.size(), 500u);
  EXPECT_EQ(r.results[2].reason.substr(497), "...");
  EXPECT_EQ(r.results[3].reason, "(empty)");
  EXPECT_EQ(r.results[4].reason, "bad ?? bytes \xc3\xa9");
  EXPECT_EQ(r.results[5].reason, "red [31m x");  // ESC and C1 controls are not passed on
}

TEST_F(AdapterTest, NothingWrittenIsMissing) {
  const auto r = run(script("lazy.sh", "exit 0\n"), jobs(2));
  ASSERT_EQ(r.results.size(), 2u);
  for (const auto& res : r.results) {
    EXPECT_EQ(res.outcome, Outcome::Missing);
    EXPECT_NE(res.reason.find("no output"), std::string::npos);
  }
}

TEST_F(AdapterTest, CrashAfterFirstJob) {
  const auto r = run(script("crash.sh", R"sh(first=1
while IFS= read -r out; do
  if [ $first = 1 ]; then cp "$GOOD" "$out"; first=0; else kill -SEGV $$; fi
done < "$1.outs"
)sh"),
                     jobs(3));
  // dash does not exec the command, so the shell reports 139; an exec'ing shell, the signal.
  EXPECT_TRUE(r.signaled ? r.signal == SIGSEGV : r.exit_status == 128 + SIGSEGV);
  ASSERT_EQ(r.results.size(), 3u);
  expect_good(r.results[0]);
  for (int i : {1, 2}) {
    EXPECT_EQ(r.results[i].outcome, Outcome::Crashed);
    EXPECT_NE(r.results[i].reason.find("SIGSEGV"), std::string::npos) << r.results[i].reason;
  }
}

TEST_F(AdapterTest, HangIsKilledAtTheTimeout) {
  const auto start = Clock::now();
  const auto r = run(script("hang.sh", R"sh(read -r out < "$1.outs"; cp "$GOOD" "$out"
sleep 100 & echo $! > "$1.child"
sleep 100
)sh"),
                     jobs(2), 1.0);
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(took, 5);
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_TRUE(r.timed_out);
  ASSERT_EQ(r.results.size(), 2u);
  expect_good(r.results[0]);
  EXPECT_EQ(r.results[1].outcome, Outcome::TimedOut);
  EXPECT_NE(r.results[1].reason.find("timed out after 1 s"), std::string::npos);
  const pid_t child = std::stoi(slurp(jobs_file().string() + ".child"));
  EXPECT_TRUE(gone_soon(child));
}

TEST_F(AdapterTest, IgnoredTermGetsKill) {
  // The leader itself ignores TERM (and passes that on), so only KILL ends it.
  const auto r = run("trap '' TERM; " + script("stubborn.sh", "sleep 100\n"), jobs(1), 0.3);
  EXPECT_TRUE(r.timed_out);
  EXPECT_TRUE(r.signaled);
  EXPECT_EQ(r.signal, SIGKILL);
  EXPECT_GE(r.seconds, 2.2);
  EXPECT_LT(r.seconds, 6);
  EXPECT_EQ(r.results.at(0).outcome, Outcome::TimedOut);
}

TEST_F(AdapterTest, GarbageOutputsAreInvalid) {
  const auto r = run(script("garbage.sh", R"sh(n=0
while IFS= read -r out; do
  case $n in
    0) printf 'not a safetensors file' > "$out" ;;
    1) head -c 20000000 /dev/urandom > "$out" ;;
    2) mkfifo "$out" ;;
    3) mkdir "$out" ;;
    4) : > "$out" ;;
  esac
  n=$((n+1))
done < "$1.outs"
)sh"),
                     jobs(5));
  ASSERT_EQ(r.results.size(), 5u);
  for (const auto& res : r.results) {
    EXPECT_EQ(res.outcome, Outcome::Invalid) << res.reason;
    EXPECT_FALSE(res.reason.empty());
    EXPECT_EQ(res.reason.find('\n'), std::string::npos);
  }
  EXPECT_NE(r.results[2].reason.find("not a regular file"), std::string::npos);
  EXPECT_NE(r.results[3].reason.find("not a regular file"), std::string::npos);
}

TEST_F(AdapterTest, MoreThanOneFileIsInvalid) {
  const auto r = run(script("both.sh", R"sh(n=0
while IFS= read -r out; do
  cp "$GOOD" "$out"; echo no > "$out.error"
  if [ $n = 1 ]; then echo no > "$out.unsupported"; fi
  n=$((n+1))
done < "$1.outs"
)sh"),
                     jobs(2));
  ASSERT_EQ(r.results.size(), 2u);
  EXPECT_EQ(r.results[0].outcome, Outcome::Invalid);
  EXPECT_EQ(r.results[0].reason, "wrote both output and output.error (exactly one is allowed)");
  EXPECT_EQ(r.results[1].outcome, Outcome::Invalid);
  EXPECT_NE(r.results[1].reason.find("output.unsupported"), std::string::npos);
}

TEST_F(AdapterTest, NonzeroExitKeepsOutputs) {
  const auto r = run(script("exit3.sh", std::string(kCopyAll) + "exit 3\n"), jobs(2));
  EXPECT_EQ(r.exit_status, 3);
  EXPECT_FALSE(r.signaled);
  for (const auto& res : r.results) expect_good(res);
}

TEST_F(AdapterTest, ChattyAdapterKeepsOnlyTheTail) {
  const auto r = run(script("chatty.sh", std::string(R"sh(
head -c 10000000 /dev/zero | tr '\0' x >&2
head -c 3000000 /dev/zero | tr '\0' y
printf 'THE END' >&2
)sh") + kCopyAll),
                     jobs(1));
  EXPECT_LE(r.stderr_tail.size(), 4096u);
  EXPECT_GE(r.stderr_tail.size(), 4000u);
  EXPECT_TRUE(r.stderr_tail.ends_with("THE END")) << r.stderr_tail.substr(4000);
  expect_good(r.results.at(0));
  EXPECT_LT(r.seconds, 5);
}

// What the implementation writes on its streams is kept as valid UTF-8 without control characters
// (it reaches JSON, JUnit, HTML and the terminal): invalid bytes, NUL and escapes become U+FFFD.
TEST_F(AdapterTest, OutputThatIsNotUtf8IsMadeValid) {
  const auto r = run(script("bytes.sh", std::string("printf 'a\\377\\000\\033[2Jb\\r\\n\\303\\274\\t\\342\\202' >&2\n") + kCopyAll),
                     jobs(1));
  EXPECT_EQ(r.stderr_tail, "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD[2Jb\n\xC3\xBC\t\xEF\xBF\xBD\xEF\xBF\xBD");
  expect_good(r.results.at(0));
}

TEST(ValidText, KeepsUtf8AndReplacesTheRest) {
  EXPECT_EQ(valid_text(""), "");
  EXPECT_EQ(valid_text("plain\ttext\n"), "plain\ttext\n");
  EXPECT_EQ(valid_text("\xC3\xBC \xE2\x82\xAC \xF0\x9F\x98\x80"), "\xC3\xBC \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(valid_text(std::string("a\0b", 3)), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(valid_text("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");          // overlong NUL
  EXPECT_EQ(valid_text("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  EXPECT_EQ(valid_text("\xC2\x9B"), "\xEF\xBF\xBD");                       // C1 control (CSI)
  EXPECT_EQ(valid_text("x\r\ny\x7f"), "x\ny\xEF\xBF\xBD");
}

TEST_F(AdapterTest, SpacesAndQuotesInIdsAndPaths) {
  dir_ = root_ / "dir with spaces 'single' \"double\" $HOME `tick` \\n";
  fs::create_directories(dir_);
  auto js = jobs(2);
  js[0].id = "id \"quoted\" 'single' \xc3\xbc\\";
  js[1].id = "";
  const auto r = run(script("good 'quoted' \"script\".sh",
                            std::string("cp \"$1\" \"$1.copy\"\n") + kCopyAll),
                     js);
  ASSERT_EQ(r.results.size(), 2u);
  for (const auto& res : r.results) expect_good(res);
  expect_jobs_file(js, false);
}

TEST_F(AdapterTest, LingeringChildDoesNotHoldTheRun) {
  const auto start = Clock::now();
  const auto r = run(script("linger.sh", std::string(R"sh(sleep 100 & echo $! > "$1.child"
)sh") + kCopyAll + "exit 0\n"),
                     jobs(2));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_status, 0);
  for (const auto& res : r.results) expect_good(res);
  EXPECT_TRUE(gone_soon(std::stoi(slurp(jobs_file().string() + ".child"))));
}

// A child that leaves the process group (setsid) and a daemon (double fork, setsid) are ended
// with the run as well.
TEST_F(AdapterTest, SetsidChildAndDaemonAreEnded) {
  const auto start = Clock::now();
  const auto r = run(script("escape.sh", std::string(R"sh(setsid sleep 100 & echo $! > "$1.child"
(setsid sh -c 'echo $$ > "$0.daemon"; exec sleep 100' "$1" &) 
while [ ! -s "$1.daemon" ]; do sleep 0.01; done
)sh") + kCopyAll + "exit 0\n"),
                     jobs(1));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5);
  EXPECT_EQ(r.exit_status, 0);
  expect_good(r.results[0]);
  EXPECT_TRUE(gone_soon(std::stoi(slurp(jobs_file().string() + ".child"))));
  EXPECT_TRUE(gone_soon(std::stoi(slurp(jobs_file().string() + ".daemon"))));
}

TEST_F(AdapterTest, ClosedStdoutAndDeletedJobsFile) {
  const auto r = run(script("rude.sh", std::string("rm -f \"$1\"\nexec >&- 2>&-\n") + kCopyAll),
                     jobs(2));
  EXPECT_EQ(r.exit_status, 0);
  for (const auto& res : r.results) expect_good(res);
  EXPECT_EQ(r.stderr_tail, "");
}

TEST_F(AdapterTest, StaleOutputsAreRemovedFirst) {
  const auto js = jobs(2);
  std::ofstream(js[0].output + ".error") << "old refusal";
  std::ofstream(js[1].output) << "old garbage";
  const auto r = run(script("lazy.sh", "exit 0\n"), js);
  for (const auto& res : r.results) EXPECT_EQ(res.outcome, Outcome::Missing);
  const auto r2 = run(script("good.sh", kCopyAll), js);
  for (const auto& res : r2.results) expect_good(res);
}

TEST_F(AdapterTest, CommandNotFound) {
  const auto r = run(quote((dir_ / "no such adapter").string()), jobs(1));
  EXPECT_EQ(r.exit_status, 127);
  EXPECT_EQ(r.results.at(0).outcome, Outcome::Crashed);
  EXPECT_NE(r.results.at(0).reason.find("status 127"), std::string::npos);
  EXPECT_NE(r.stderr_tail.find("not found"), std::string::npos) << r.stderr_tail;
}

TEST_F(AdapterTest, UnwritableWorkDirThrows) {
  EXPECT_THROW(run_adapter("true", jobs(1), "/dev/null/work", 0), InputError);
  EXPECT_THROW(run_adapter("true", jobs(1), good_.string(), 0), InputError);
}

TEST_F(AdapterTest, ResultsThatAreLinksAreNotFollowed) {
  // An .error or an output linked to a file outside: invalid, and the outside text never shown.
  const fs::path secret = root_ / "secret.txt", out = root_ / "job.safetensors";
  std::ofstream(secret) << "do not print me";
  fs::create_symlink(secret, out.string() + ".error");
  JobResult r = read_job_result(out.string());
  EXPECT_EQ(r.outcome, Outcome::Invalid);
  EXPECT_NE(r.reason.find("is a symbolic link"), std::string::npos) << r.reason;
  EXPECT_EQ(r.reason.find("do not print me"), std::string::npos) << r.reason;
  fs::remove(out.string() + ".error");
  fs::create_symlink(good_, out);
  r = read_job_result(out.string());
  EXPECT_EQ(r.outcome, Outcome::Invalid);
  EXPECT_NE(r.reason.find("is a symbolic link"), std::string::npos) << r.reason;
}

TEST(Outcome, Names) {
  EXPECT_EQ(outcome_name(Outcome::Output), "output");
  EXPECT_EQ(outcome_name(Outcome::Refused), "refused");
  EXPECT_EQ(outcome_name(Outcome::Unsupported), "unsupported");
  EXPECT_EQ(outcome_name(Outcome::Missing), "missing");
  EXPECT_EQ(outcome_name(Outcome::Crashed), "crashed");
  EXPECT_EQ(outcome_name(Outcome::TimedOut), "timed_out");
  EXPECT_EQ(outcome_name(Outcome::Invalid), "invalid");
}

}  // namespace
}  // namespace attnoracle::conformance
