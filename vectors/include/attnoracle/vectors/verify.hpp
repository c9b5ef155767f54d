// Checking a vector set: manifest, files and hashes, case validity, the invariants that stored
// golden data keeps after rounding, and (optionally) bitwise re-evaluation.
#pragma once

#include <mpfr.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::vectors {

// The golden tensors a case calls for are all present with their dtypes and shapes, no others
// are, undecided lists are well formed and counted in attn.undecided. `f` is the whole file.
std::optional<std::string> golden_layout_problem(const Case& c, const SafeTensorsFile& f);

// Invariants of the stored (rounded) golden data: masked weights exactly 0, weights in [0, 1],
// rows of weights.ref summing to 1 within n 2^-52, out within the rounded range of the allowed
// values (sdpa) and within out.bound, row.valid as the mask says, zero outputs and -inf lse on
// fully masked rows, each rounded tensor consistent with its F64 companion. Assumes the layout
// is right (golden_layout_problem).
std::optional<std::string> golden_invariant_problem(const Case& c, const SafeTensorsFile& f);

struct VerifyOptions {
  std::string dir;
  std::string manifest;    // another manifest to check the set against (DIR's own, when present, must equal it)
  bool recompute = false;  // evaluate every case again and compare golden tensors bitwise
  bool all = false;        // report every problem, not only the first
  int jobs = 1;
  mpfr_prec_t max_precision = 2048;  // must be the one the set was generated with
};

struct VerifyProblem {
  std::string where;  // a case id, "manifest.json", or "cases/<file>"
  std::string reason;
};

struct VerifyReport {
  std::size_t cases = 0;                // listed in the manifest
  std::size_t checked = 0;              // cases checked completely
  std::vector<VerifyProblem> problems;  // in manifest order
};

// Throws InputError(<dir>/manifest.json, ...) when the manifest cannot be read or is not JSON.
VerifyReport verify(const VerifyOptions& opt,
                    const std::function<void(std::size_t done, std::size_t total)>& progress = {});

}  // namespace attnoracle::vectors
