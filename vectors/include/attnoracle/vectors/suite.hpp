// Suite specs (vectors/SUITES.md): named families of cases, each a cross product of option
// lists, expanded in a fixed order into cases with ids and seeds.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::vectors {

struct CaseSpec {
  std::string id;  // "<family>-<index in family, 3 digits at least>"
  std::string family;
  std::uint64_t seed = 0;
  ProblemSpec problem;
  std::vector<std::string> tags;  // the family's tags, then tags derived from the options
};

struct Suite {
  std::string name;
  std::uint64_t seed = 0;
  std::vector<CaseSpec> cases;  // in expansion order
};

// Parses and expands a spec. Throws InputError(path, <JSON path>, <what>) on any problem:
// invalid JSON, unknown or duplicate key, a value of the wrong type or out of range, an
// unknown generator or parameter, an option combination that cannot be built.
Suite parse_suite(const std::string& path, std::string_view text);
Suite read_suite(const std::string& path);  // also InputError when the file cannot be read

// The seed of case `index` of `family`: a hash of the three, so that adding or removing a
// family leaves the other families' cases unchanged.
std::uint64_t case_seed(std::uint64_t suite_seed, std::string_view family, std::uint64_t index);

// Tags derived from a case's options (dtype, kind, causal, mask, ...), in a fixed order.
std::vector<std::string> option_tags(const ProblemSpec& p);

}  // namespace attnoracle::vectors
