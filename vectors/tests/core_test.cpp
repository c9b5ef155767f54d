// The committed vectors/core: regenerating it from vectors/suites/core.json gives the same bytes,
// it verifies, and its README counts what the manifest lists.
#include <cmath>
#include <map>
#include <regex>

#include "attnoracle/reference/case_file.hpp"
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

// out of row (b, h, i) in double, with the mask and bias of batch mb and head mh: a plain
// softmax, accurate to about 1e-13 here, far below the differences the test asks for.
std::vector<double> row_out(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                            std::int64_t mb, std::int64_t mh) {
  const double scale = 1 / std::sqrt(static_cast<double>(c.Dk));
  const std::int64_t g = c.kv_head(h);
  std::vector<double> s(static_cast<std::size_t>(c.Nk), -INFINITY);
  double m = -INFINITY;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    if (!c.position_allowed(b, i, j) || !c.mask_at(mb, mh, i, j)) continue;
    double x = 0;
    for (std::int64_t d = 0; d < c.Dk; ++d)
      x += c.q.values[static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Dk + d)] *
           c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dk + d)];
    s[static_cast<std::size_t>(j)] = x * scale + c.bias_at(mb, mh, i, j);
    m = std::max(m, s[static_cast<std::size_t>(j)]);
  }
  std::vector<double> out(static_cast<std::size_t>(c.Dv), 0.0);
  double sum = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
    sum += w;
    for (std::int64_t d = 0; d < c.Dv; ++d)
      out[static_cast<std::size_t>(d)] +=
          w * c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dv + d)];
  }
  for (double& x : out) x /= sum;
  return out;
}

// Masks and biases differ in every batch and head: an implementation that applies the mask or
// bias of batch 0 (or of head 0) everywhere moves the output of every other batch (head).
TEST(VectorsCore, MasksAndBiasesDifferPerBatchAndHead) {
  const std::string manifest = read_text(kSource / "vectors/core/manifest.json");
  const std::regex id("\\{\"id\": \"((distinct_batch_head|bias_fill)-[0-9]+)\"");
  int cases = 0;
  for (auto it = std::sregex_iterator(manifest.begin(), manifest.end(), id);
       it != std::sregex_iterator(); ++it, ++cases) {
    const std::string name = (*it)[1];
    const Case c = read_case((kSource / "vectors/core/cases" / (name + ".safetensors")).string());
    ASSERT_GT(c.B, 1) << name;
    ASSERT_GT(c.Hq, c.Hkv) << name;
    auto shift = [&](std::int64_t b, std::int64_t h, std::int64_t mb, std::int64_t mh) {
      double d = 0;
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const auto a = row_out(c, b, h, i, b, h), z = row_out(c, b, h, i, mb, mh);
        for (std::size_t e = 0; e < a.size(); ++e) d = std::max(d, std::fabs(a[e] - z[e]));
      }
      return d;
    };
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h) {
        if (b > 0) {
          EXPECT_GT(shift(b, h, 0, h), 0.05) << name << " batch " << b << " head " << h;
        }
        if (h > 0) {
          EXPECT_GT(shift(b, h, b, 0), 0.05) << name << " batch " << b << " head " << h;
        }
      }
    // k and v differ per kv head
    const auto n = static_cast<std::size_t>(c.Nk * c.Dk);
    for (std::int64_t g = 1; g < c.Hkv; ++g)
      EXPECT_FALSE(std::equal(c.k.values.begin(), c.k.values.begin() + n,
                              c.k.values.begin() + static_cast<std::ptrdiff_t>(n * g)))
          << name;
  }
  EXPECT_GE(cases, 4);
}

}  // namespace
}  // namespace attnoracle::testing
