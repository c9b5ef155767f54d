// The committed vectors/core: regenerating it from vectors/suites/core.json gives the same bytes,
// it verifies, and its README counts what the manifest lists.
#include <map>
#include <regex>

#include "cli_run.hpp"

namespace attnoracle::testing {
namespace {

const fs::path kSource = ATTNORACLE_SOURCE_DIR;

TEST(VectorsCore, RegeneratesByteForByte) {
  TempDir d;
  const CliResult r = run_cli({"gen", (kSource / "vectors/suites/core.json").string(), "-o",
                               (d / "core").string(), "--jobs", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto committed = tree(kSource / "vectors/core");
  committed.erase("README.md");
  EXPECT_EQ(differences(tree(d / "core"), committed), std::vector<std::string>{})
      << "regenerate with: attnoracle gen vectors/suites/core.json -o vectors/core";
}

TEST(VectorsCore, CommittedSetVerifies) {
  const CliResult r = run_cli({"verify", (kSource / "vectors/core").string(), "--jobs", "2"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

TEST(VectorsCore, ReadmeCountsEveryFamily) {
  const std::string manifest = read_text(kSource / "vectors/core/manifest.json");
  const std::string readme = read_text(kSource / "vectors/core/README.md");
  std::map<std::string, int> families;
  const std::regex id("\\{\"id\": \"([A-Za-z0-9_.]+)-[0-9]+\"");
  int total = 0;
  for (auto it = std::sregex_iterator(manifest.begin(), manifest.end(), id);
       it != std::sregex_iterator(); ++it, ++total)
    ++families[(*it)[1]];
  ASSERT_GT(total, 0);
  for (const auto& [name, n] : families)
    EXPECT_NE(readme.find("| `" + name + "` | " + std::to_string(n) + " |"), std::string::npos)
        << name << " " << n;
  EXPECT_NE(readme.find(std::to_string(total) + " cases"), std::string::npos) << total;
}

}  // namespace
}  // namespace attnoracle::testing
