// --shard k/n and --shard auto (gen, run, check): the shard index and count, given or taken from
// the environment of an array or parallel job.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace attnoracle::cli {

struct Shard {
  int k = 0, n = 1;    // this shard, of n: the cases whose index is k modulo n
  std::string source;  // the variables it came from, for messages
};

// The first of these that is set (index variable first, then its count):
//   ATTNORACLE_SHARD_INDEX, ATTNORACLE_SHARD_COUNT       (0-based; any CI matrix)
//   SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT   (a Slurm array, step 1)
//   JOB_COMPLETION_INDEX, ATTNORACLE_SHARD_COUNT         (a Kubernetes indexed Job)
//   CI_NODE_INDEX - 1, CI_NODE_TOTAL                     (GitLab CI `parallel`)
//   CIRCLE_NODE_INDEX, CIRCLE_NODE_TOTAL                 (CircleCI parallelism)
//   BUILDKITE_PARALLEL_JOB, BUILDKITE_PARALLEL_JOB_COUNT (Buildkite parallelism)
// Throws InputError("--shard", ...) naming the variable when none is set, a value is not an
// integer, the count is missing, or the index is out of range. `get` reads a variable (null:
// unset); getenv by default.
Shard shard_from_environment(const std::function<const char*(const char*)>& get = nullptr);

// The value of --shard: "k/n" with 0 <= k < n (source empty), or "auto" (shard_from_environment).
// Throws InputError("--shard", ...) otherwise.
Shard parse_shard(const std::string& text, const std::function<const char*(const char*)>& get = nullptr);

}  // namespace attnoracle::cli
