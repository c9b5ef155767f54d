// The oracle applied to any implementation: each problem is run beside transformed twins whose
// results must relate (CONTRACT section 5 protocol, all in one adapter call), no golden data
// needed. A relation between two results a and b holds when |a - b| <= limit_a + limit_b, each
// the gate's limit (tolerance.hpp, conformance/TOLERANCE.md) under the same profile, from its
// own case's magnitudes; bitwise agreement is reported as information. Twins whose exact results
// differ (a parameter or one kv head changed) relate through the reference: b - a must be the
// reference's b - a within the same limits. Padding rows (query_mask false) are never compared.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::conformance {

// One relation instance: two case files (inputs only) whose results must agree.
struct TwinPair {
  std::string relation;  // an oracle invariant's name, or a relation of its own (kv_head_locality, ...)
  std::string tag;   // file-name friendly: "permuted", "shifted", "future", "padding", "poisoned", "head", ...
  std::string what;  // what the twin changes, for reports
  SafeTensorsFile a, b;
  std::vector<std::int64_t> perm;  // key j of a is key perm[j] of b (identity when empty)
  double lse_shift = 0;            // lse of b = lse of a + lse_shift
  bool extra_key = false;          // b has one more key, masked out: its weight must be exactly 0
  std::vector<char> rows;      // [B, H, Nq]: rows compared (out of sdpa, weights, lse)
  std::vector<char> out_rows;  // [B, Nq]: tokens whose out is compared (mha)
  bool reference = false;      // b - a must equal the reference's b - a (within the limits)
  // When not empty, b has one query per batch row: its query 0 of row r is query query_of[r]
  // of a (-1: that row of b is padding, nothing compared); `rows` and `out_rows` name a's rows.
  std::vector<std::int64_t> query_of;
  // Every compared element must keep its bits (NaN against NaN counts as equal, whatever the
  // payload), the gradients included; the limits still apply.
  bool bitwise = false;
  // Gradients, kind sdpa (where the problem asks them and the profile returns them), related as
  // out is (within both limits, or through the reference): dq on `rows` when `dq`; dk and dv on
  // the keys `key_rows` ([B, Hkv, Nk] of a; key j of a is key perm[j] of b); dsinks on the heads
  // `sink_heads` ([Hq]); dbias when `dbias` (along the keys as they are). Empty: not compared.
  bool dq = false;
  std::vector<char> key_rows = {}, sink_heads = {};
  bool dbias = false;
};

// The twins of one problem. Permuted keys, a constant added to every score through the bias,
// future keys changed (causal), a masked padding key appended (for sdpa also with NaN keys and
// values), every unused position refilled with NaN (sdpa), and one head changed; then, related through the reference: one kv head's keys and
// values changed, the scale doubled, the softcap changed, head 0's bias changed, the window
// widened by one key on each side. A paged case gets the twins of its contiguous form (paged
// again where both sides keep whole pages), and the same keys in the other layout, another page
// order, another page size and contiguous. Every case of kind sdpa gets the serving twins:
// another kv split size, one query alone with its keys (decode against prefill), and batch
// row 0's inputs changed (the other rows unchanged). With `batch_invariance`, also the bitwise
// twins of relation batch_invariance: batch row 0 alone (batch 1), and batch row 0 among other
// rows (a copy of it with its queries reversed, then the other rows in reverse order: B + 1).
std::vector<TwinPair> make_twins(const std::string& path, const SafeTensorsFile& base,
                                 bool batch_invariance = false);

struct RelationResult {
  std::string problem;
  std::string relation;
  std::string what;
  enum class Status { Pass, Violated, Skipped } status = Status::Pass;
  bool bitwise = false;     // every compared element had identical bits
  double worst = 0;         // largest |a - b| / tolerance over compared elements
  std::string detail;       // where and by how much, or why skipped
};

struct MetamorphicOptions {
  std::string command;       // the implementation (adapter protocol)
  std::string work_dir;      // case files, jobs and outputs go here
  std::string failures_dir;  // failing pairs are copied here for replay
  double timeout = 600;      // seconds for the whole adapter run
  Profile profile;           // the gate's: problems of other input dtypes are skipped
  bool batch_invariant = false;  // declared: relation batch_invariance, bit for bit
  int reruns = 0;                // check_reruns: runs of each problem (2 or more)
};

struct MetamorphicReport {
  std::vector<RelationResult> results;
  std::size_t passed = 0, violated = 0, skipped = 0, bitwise = 0;
  std::string adapter_note;  // exit status, timeout, stderr tail when something went wrong
};

// Writes every problem and its twins, runs the implementation once on all of them, and checks
// the relations. `problems` are (id, case file holding inputs and metadata).
MetamorphicReport run_metamorphic(const std::vector<std::pair<std::string, SafeTensorsFile>>& problems,
                                  const MetamorphicOptions& opt);

// Relation deterministic: runs the implementation opt.reruns times (each a run of its own on
// every problem) and adds to `rep`, per problem, whether every run gave the bits of the first:
// out, weights, lse and the gradients the problem asks (NaN equals NaN; padding rows and the dq
// of padding queries, which the contract leaves free, are not compared).
void check_reruns(const std::vector<std::pair<std::string, SafeTensorsFile>>& problems,
                  const MetamorphicOptions& opt, MetamorphicReport& rep);

}  // namespace attnoracle::conformance
