// Checks shared by the tests of the suites distributed as a committed manifest and sample
// (vectors/kernels, vectors/serving, vectors/training): the manifest lists the spec's cases with their tags, and
// the sample regenerates byte for byte with the manifest's hashes.
#pragma once

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/vectors/generate.hpp"
#include "attnoracle/vectors/suite.hpp"
#include "cli_run.hpp"

namespace attnoracle::testing {

inline vectors::Manifest committed_manifest(const fs::path& set) {
  std::string problem;
  const vectors::Manifest m =
      vectors::parse_manifest("manifest.json", read_text(set / "manifest.json"), problem);
  EXPECT_EQ(problem, "");
  return m;
}

inline bool has_tag(const std::vector<std::string>& tags, const std::string& tag) {
  return std::find(tags.begin(), tags.end(), tag) != tags.end();
}

inline void expect_manifest_lists_spec(const fs::path& spec_path, const fs::path& set,
                                       const std::string& regenerate) {
  const vectors::Manifest m = committed_manifest(set);
  const std::string spec = read_text(spec_path);
  EXPECT_EQ(m.spec_sha256.value_or(""), vectors::sha256_hex(std::string_view(spec))) << regenerate;
  EXPECT_EQ(m.generator, vectors::generator_name()) << regenerate;
  const vectors::Suite s = vectors::parse_suite(spec_path.string(), spec);
  ASSERT_EQ(m.cases.size(), s.cases.size()) << regenerate;
  for (std::size_t k = 0; k < s.cases.size(); ++k) {
    EXPECT_EQ(m.cases[k].id, s.cases[k].id);
    std::vector<std::string> tags = m.cases[k].tags;
    if (!tags.empty() && tags.back() == "fully_masked" && !has_tag(s.cases[k].tags, "fully_masked"))
      tags.pop_back();
    EXPECT_EQ(tags, s.cases[k].tags) << m.cases[k].id;
  }
}

inline void expect_sample_regenerates(const fs::path& spec_path, const fs::path& set,
                                      std::size_t min_files, std::size_t min_families,
                                      const std::string& regenerate) {
  const vectors::Manifest m = committed_manifest(set);
  std::map<std::string, std::string> hash;
  for (const auto& c : m.cases) hash[c.id] = c.sha256;
  const auto sample = tree(set / "sample");
  ASSERT_GE(sample.size(), min_files);
  std::string ids;
  std::set<std::string> families;
  for (const auto& [name, bytes] : sample) {
    ASSERT_EQ(fs::path(name).extension(), ".safetensors") << name;
    const std::string id = fs::path(name).stem().string();
    ASSERT_TRUE(hash.count(id)) << id << " is not in the manifest";
    EXPECT_EQ(vectors::sha256_hex(std::string_view(bytes)), hash[id]) << id;
    ids += (ids.empty() ? "" : ",") + id;
    families.insert(id.substr(0, id.rfind('-')));
  }
  EXPECT_GE(families.size(), min_families);
  TempDir d;
  const CliResult r = run_cli({"gen", spec_path.string(), "-o", (d / "s").string(), "--case", ids,
                               "--jobs", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(differences(tree(d / "s/cases"), sample), std::vector<std::string>{}) << regenerate;
}

}  // namespace attnoracle::testing
