// gen --shard auto: the shard from each engine's variables, every refusal, and a set generated
// as a Slurm-style array of three shards byte-identical to one generated at once.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <string>

#include "attnoracle/reference/error.hpp"
#include "cli_run.hpp"
#include "shard.hpp"

namespace attnoracle::testing {
namespace {

using Env = std::map<std::string, std::string>;

cli::Shard shard(const Env& env) {
  return cli::shard_from_environment([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string refusal(const Env& env) {
  try {
    shard(env);
  } catch (const InputError& e) {
    return e.message();
  }
  return "";
}

TEST(ShardAuto, EachEngine) {
  auto expect = [](const Env& env, int k, int n) {
    const cli::Shard s = shard(env);
    EXPECT_EQ(s.k, k) << s.source;
    EXPECT_EQ(s.n, n) << s.source;
  };
  expect({{"ATTNORACLE_SHARD_INDEX", "2"}, {"ATTNORACLE_SHARD_COUNT", "5"}}, 2, 5);
  expect({{"SLURM_ARRAY_TASK_ID", "3"}, {"SLURM_ARRAY_TASK_COUNT", "4"}, {"SLURM_ARRAY_TASK_MIN", "0"}}, 3, 4);
  expect({{"SLURM_ARRAY_TASK_ID", "7"}, {"SLURM_ARRAY_TASK_COUNT", "4"}, {"SLURM_ARRAY_TASK_MIN", "5"},
          {"SLURM_ARRAY_TASK_STEP", "1"}},
         2, 4);  // --array=5-8
  expect({{"JOB_COMPLETION_INDEX", "0"}, {"ATTNORACLE_SHARD_COUNT", "3"}}, 0, 3);
  expect({{"CI_NODE_INDEX", "1"}, {"CI_NODE_TOTAL", "2"}}, 0, 2);  // GitLab counts from 1
  expect({{"CIRCLE_NODE_INDEX", "1"}, {"CIRCLE_NODE_TOTAL", "2"}}, 1, 2);
  expect({{"BUILDKITE_PARALLEL_JOB", "4"}, {"BUILDKITE_PARALLEL_JOB_COUNT", "5"}}, 4, 5);
  // the project's own variables come first
  expect({{"ATTNORACLE_SHARD_INDEX", "1"}, {"ATTNORACLE_SHARD_COUNT", "2"}, {"SLURM_ARRAY_TASK_ID", "0"},
          {"SLURM_ARRAY_TASK_COUNT", "9"}},
         1, 2);
  EXPECT_EQ(shard({{"CI_NODE_INDEX", "2"}, {"CI_NODE_TOTAL", "2"}}).source, "CI_NODE_INDEX, CI_NODE_TOTAL");
}

// --shard's value, as gen, run and check read it: k/n, or auto from the environment.
TEST(ShardValue, KOfNOrAuto) {
  const cli::Shard s = cli::parse_shard("3/8");
  EXPECT_EQ(s.k, 3);
  EXPECT_EQ(s.n, 8);
  EXPECT_EQ(s.source, "");
  const Env env = {{"CIRCLE_NODE_INDEX", "1"}, {"CIRCLE_NODE_TOTAL", "2"}};
  const cli::Shard a = cli::parse_shard("auto", [&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  EXPECT_EQ(a.k, 1);
  EXPECT_EQ(a.n, 2);
  EXPECT_EQ(a.source, "CIRCLE_NODE_INDEX, CIRCLE_NODE_TOTAL");
  for (const char* bad : {"", "1", "2/2", "-1/2", "1/0", "a/2", "1/2x", "/2", "1/", "1/99999999999", "0/2/3"}) {
    try {
      cli::parse_shard(bad);
      ADD_FAILURE() << bad;
    } catch (const InputError& e) {
      EXPECT_EQ(e.message(), "--shard: \"" + std::string(bad) + "\" is not k/n with 0 <= k < n");
    }
  }
}

TEST(ShardAuto, Refusals) {
  EXPECT_EQ(refusal({}).rfind("--shard: auto: no shard index in the environment (ATTNORACLE_SHARD_INDEX, "
                              "SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX, CI_NODE_INDEX",
                              0),
            0u)
      << refusal({});
  EXPECT_EQ(refusal({{"JOB_COMPLETION_INDEX", "1"}}),
            "--shard: auto: JOB_COMPLETION_INDEX is set but ATTNORACLE_SHARD_COUNT is not: the number of shards is "
            "unknown");
  EXPECT_EQ(refusal({{"ATTNORACLE_SHARD_INDEX", "x1"}, {"ATTNORACLE_SHARD_COUNT", "2"}}),
            "--shard: auto: ATTNORACLE_SHARD_INDEX=\"x1\" is not an integer from 0 to 1000000");
  EXPECT_EQ(refusal({{"ATTNORACLE_SHARD_INDEX", "-1"}, {"ATTNORACLE_SHARD_COUNT", "2"}}),
            "--shard: auto: ATTNORACLE_SHARD_INDEX=\"-1\" is not an integer from 0 to 1000000");
  EXPECT_EQ(refusal({{"ATTNORACLE_SHARD_INDEX", "2"}, {"ATTNORACLE_SHARD_COUNT", "2"}}),
            "--shard: auto: ATTNORACLE_SHARD_INDEX and ATTNORACLE_SHARD_COUNT give shard 2 of 2, not k of n with "
            "0 <= k < n");
  EXPECT_EQ(refusal({{"CI_NODE_INDEX", "0"}, {"CI_NODE_TOTAL", "2"}}),
            "--shard: auto: CI_NODE_INDEX and CI_NODE_TOTAL give shard -1 of 2, not k of n with 0 <= k < n (the "
            "index counted from 1)");
  EXPECT_EQ(refusal({{"SLURM_ARRAY_TASK_ID", "2"}, {"SLURM_ARRAY_TASK_COUNT", "2"}, {"SLURM_ARRAY_TASK_STEP", "2"}}),
            "--shard: auto: SLURM_ARRAY_TASK_STEP is not 1: give the array as --array=0-(N-1)");
  EXPECT_EQ(refusal({{"ATTNORACLE_SHARD_INDEX", "0"}, {"ATTNORACLE_SHARD_COUNT", "0"}}),
            "--shard: auto: ATTNORACLE_SHARD_INDEX and ATTNORACLE_SHARD_COUNT give shard 0 of 0, not k of n with "
            "0 <= k < n");
}

const char* kSpec = R"({"suite": "tiny", "seed": 5, "families": [
  {"name": "gens", "generator": "normal", "cross": {"dtype": ["F32", "F16", "BF16", "F64"]},
   "fixed": {"shape": [1, 2, 1, 4, 6, 4, 3], "causal": "bottom_right", "outputs": "out,weights,lse"}},
  {"name": "ties", "generator": "ties", "fixed": {"shape": [1, 2, 2, 3, 8, 4, 4], "bias": "alibi"}}
]})";

// As an array job would run it: each task with its own SLURM_ARRAY_TASK_ID, then a last run
// without --shard that writes the manifest.
TEST(ShardAuto, ArrayOfShardsEqualsOneRun) {
  TempDir dir;
  write_text(dir.path() / "tiny.json", kSpec);
  const std::string spec = (dir.path() / "tiny.json").string();
  ASSERT_EQ(run_cli({"gen", spec, "-o", (dir.path() / "one").string(), "--quiet"}).status, 0);
  ::setenv("SLURM_ARRAY_TASK_COUNT", "3", 1);
  ::setenv("SLURM_ARRAY_TASK_MIN", "0", 1);
  for (const char* k : {"0", "1", "2"}) {
    ::setenv("SLURM_ARRAY_TASK_ID", k, 1);
    const CliResult r = run_cli({"gen", spec, "-o", (dir.path() / "array").string(), "--shard", "auto"});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.err.find(std::string("gen: shard ") + k + "/3 (from SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT)"),
              std::string::npos)
        << r.err;
  }
  for (const char* v : {"SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"}) ::unsetenv(v);
  EXPECT_FALSE(fs::exists(dir.path() / "array" / "manifest.json"));
  const CliResult fin = run_cli({"gen", spec, "-o", (dir.path() / "array").string()});
  ASSERT_EQ(fin.status, 0) << fin.err;
  EXPECT_NE(fin.err.find("0 cases written, 5 already present"), std::string::npos) << fin.err;
  EXPECT_EQ(differences(tree(dir.path() / "one"), tree(dir.path() / "array")), std::vector<std::string>{});
  // no variable set: one line, status 2, nothing written
  const CliResult none = run_cli({"gen", spec, "-o", (dir.path() / "none").string(), "--shard", "auto"});
  EXPECT_EQ(none.status, 2);
  EXPECT_EQ(none.err.rfind("attnoracle: error: --shard: auto: no shard index in the environment", 0), 0u) << none.err;
  EXPECT_FALSE(fs::exists(dir.path() / "none"));
}

}  // namespace
}  // namespace attnoracle::testing
