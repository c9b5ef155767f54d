#include "shard.hpp"

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <string>

#include "attnoracle/reference/error.hpp"

namespace attnoracle::cli {
namespace {

struct Source {
  const char* index;
  const char* count;
  const char* min;  // subtracted from the index (Slurm's first task id), or null
  int base;         // what the first shard's index is (GitLab counts from 1)
};

constexpr Source kSources[] = {
    {"ATTNORACLE_SHARD_INDEX", "ATTNORACLE_SHARD_COUNT", nullptr, 0},
    {"SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", 0},
    {"JOB_COMPLETION_INDEX", "ATTNORACLE_SHARD_COUNT", nullptr, 0},
    {"CI_NODE_INDEX", "CI_NODE_TOTAL", nullptr, 1},
    {"CIRCLE_NODE_INDEX", "CIRCLE_NODE_TOTAL", nullptr, 0},
    {"BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT", nullptr, 0},
};

[[noreturn]] void refuse(const std::string& what) { throw InputError("--shard", "", "auto: " + what); }

long integer(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (*value == '\0' || *end != '\0' || errno != 0 || v < 0 || v > 1'000'000)
    refuse(std::string(name) + "=\"" + printable(value) + "\" is not an integer from 0 to 1000000");
  return v;
}

}  // namespace

Shard shard_from_environment(const std::function<const char*(const char*)>& get_or_null) {
  const std::function<const char*(const char*)> get =
      get_or_null ? get_or_null : [](const char* name) -> const char* { return std::getenv(name); };
  for (const Source& s : kSources) {
    const char* index = get(s.index);
    if (!index) continue;
    const char* count = get(s.count);
    if (!count) refuse(std::string(s.index) + " is set but " + s.count + " is not: the number of shards is unknown");
    long k = integer(s.index, index) - s.base;
    if (s.min) {
      if (const char* step = get("SLURM_ARRAY_TASK_STEP"); step && integer("SLURM_ARRAY_TASK_STEP", step) != 1)
        refuse("SLURM_ARRAY_TASK_STEP is not 1: give the array as --array=0-(N-1)");
      if (const char* min = get(s.min)) k -= integer(s.min, min);
    }
    const long n = integer(s.count, count);
    if (n < 1 || k < 0 || k >= n)
      refuse(std::string(s.index) + " and " + s.count + " give shard " + std::to_string(k) + " of " +
             std::to_string(n) + ", not k of n with 0 <= k < n" + (s.base ? " (the index counted from 1)" : ""));
    return {static_cast<int>(k), static_cast<int>(n), std::string(s.index) + ", " + s.count};
  }
  std::string names;
  for (const Source& s : kSources) names += (names.empty() ? "" : ", ") + std::string(s.index);
  refuse("no shard index in the environment (" + names + ")");
}

Shard parse_shard(const std::string& text, const std::function<const char*(const char*)>& get) {
  if (text == "auto") return shard_from_environment(get);
  const auto slash = text.find('/');
  int k = -1, n = 0;
  try {
    if (slash != std::string::npos && slash > 0 && slash + 1 < text.size()) {
      std::size_t used_k = 0, used_n = 0;
      k = std::stoi(text.substr(0, slash), &used_k);
      n = std::stoi(text.substr(slash + 1), &used_n);
      if (used_k != slash || used_n != text.size() - slash - 1) k = -1;
    }
  } catch (const std::exception&) {
    k = -1;
  }
  if (k < 0 || n < 1 || k >= n) throw InputError("--shard", "", "\"" + printable(text) + "\" is not k/n with 0 <= k < n");
  return {k, n, ""};
}

}  // namespace attnoracle::cli
