// `gen`: a suite spec to a vector set (case files and manifest), in parallel, resumable and
// shardable, with byte-identical output whatever the split.
#pragma once

#include <mpfr.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/vectors/suite.hpp"

namespace attnoracle::vectors {

struct GenOptions {
  std::string spec_path;
  std::string out_dir;
  int jobs = 1;              // cases in parallel
  int threads_per_case = 1;  // threads of one evaluation
  bool sharded = false;      // only cases with index % shard_n == shard_k; no manifest
  int shard_k = 0, shard_n = 1;
  std::vector<std::string> ids;  // when not empty, only these cases (after the shard's); no manifest
  mpfr_prec_t max_precision = 2048;
  bool model = false;  // the model's magnitudes with the golden tensors (model.rows, model.out, model.p_bias)
};

struct CaseEvent {
  enum What { Written, Present, Failed } what;
  std::size_t done, total;  // among the cases of this run
  const CaseSpec* spec;
  double seconds;
};

struct GenCallbacks {
  std::function<void(const CaseEvent&)> progress;  // called under a lock
  std::function<void(const std::string& id, const oracle::InvariantViolation&)> violation;
};

struct GenSummary {
  std::size_t suite_cases = 0;  // in the whole suite
  std::size_t selected = 0;     // in this run (this shard)
  std::size_t written = 0, present = 0, failed = 0;
  std::size_t missing = 0;  // suite cases without a file after this run
  bool manifest_written = false;
};

// Throws InputError for a bad spec (file, JSON path, what), an output directory that cannot be
// made, or a case that cannot be built. Invariant violations are reported to `cb.violation`,
// counted in `failed`, and leave that case unwritten and the manifest unwritten.
GenSummary generate(const GenOptions& opt, const GenCallbacks& cb = {});

// The value of "generator" in manifests and of attn.reference in case files.
std::string generator_name();

}  // namespace attnoracle::vectors
