// The kernels suite (vectors/suites/kernels.json): its committed manifest lists the spec's cases,
// the committed sample regenerates byte for byte with the manifest's hashes, the sample's masks
// on the last key block are aimed, and a BF16 kernel of head dims 64 and 128 runs 300 cases.
#include <algorithm>
#include <cmath>
#include <set>

#include "attnoracle/reference/case_file.hpp"
#include "committed_set.hpp"

namespace attnoracle::testing {
namespace {

const fs::path kSource = ATTNORACLE_SOURCE_DIR;
const fs::path kSpec = kSource / "vectors/suites/kernels.json";
const fs::path kSet = kSource / "vectors/kernels";
const char* kRegenerate = "regenerate with: attnoracle gen vectors/suites/kernels.json -o DIR, then copy DIR/manifest.json";

TEST(VectorsKernels, ManifestListsTheSpecsCases) { expect_manifest_lists_spec(kSpec, kSet, kRegenerate); }

TEST(VectorsKernels, SampleRegeneratesWithTheManifestsHashes) {
  expect_sample_regenerates(kSpec, kSet, 10, 10, kRegenerate);
}

// out of row (b, h, i) in double, with the keys of the last 64-key block from `tail` on all
// allowed by the mask when `ignore_tail` (a kernel that skips the mask in its last block).
std::vector<double> row_out(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i, bool ignore_tail) {
  const std::int64_t tail = (c.Nk - 1) / 64 * 64, g = c.kv_head(h);
  const double scale = 1 / std::sqrt(static_cast<double>(c.Dk));
  std::vector<double> s(static_cast<std::size_t>(c.Nk), -INFINITY);
  double mx = -INFINITY;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    if (!c.position_allowed(b, i, j) || !(c.mask_at(b, h, i, j) || (ignore_tail && j >= tail))) continue;
    double x = 0;
    for (std::int64_t e = 0; e < c.Dk; ++e)
      x += c.q.values[static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Dk + e)] *
           c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dk + e)];
    s[static_cast<std::size_t>(j)] = x * scale;
    mx = std::max(mx, x * scale);
  }
  std::vector<double> out(static_cast<std::size_t>(c.Dv), 0.0);
  double sum = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j) {
    const double w = std::exp(s[static_cast<std::size_t>(j)] - mx);
    sum += w;
    for (std::int64_t e = 0; e < c.Dv; ++e)
      out[static_cast<std::size_t>(e)] += w * c.v.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dv + e)];
  }
  for (double& x : out) x /= sum;
  return out;
}

// Every row of the sample's tail_mask cases that sees two keys of the last block moves by more
// than 2^-7 (a BF16 ulp at 1) when the mask of that block is ignored.
TEST(VectorsKernels, TailMasksMoveEveryRowThatSeesTheLastBlock) {
  int cases = 0, half_full = 0;
  for (const auto& e : fs::directory_iterator(kSet / "sample")) {
    if (e.path().filename().string().rfind("tail_mask-", 0) != 0) continue;
    const Case c = read_case(e.path().string());
    ++cases;
    half_full += c.Nk % 128 == 64;
    const std::int64_t tail = (c.Nk - 1) / 64 * 64;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          int seen = 0;
          for (std::int64_t j = tail; j < c.Nk; ++j) seen += c.position_allowed(b, i, j);
          if (seen < 2) continue;
          const auto a = row_out(c, b, h, i, false), z = row_out(c, b, h, i, true);
          double d = 0;
          for (std::size_t k = 0; k < a.size(); ++k) d = std::max(d, std::fabs(a[k] - z[k]));
          EXPECT_GT(d, 0x1p-7) << e.path().filename() << " row " << b << "," << h << "," << i;
        }
  }
  EXPECT_GE(cases, 2);
  EXPECT_GE(half_full, 1);
}

// A BF16 kernel with head dims 64 and 128 alone: `run --dtype BF16 --tag head_dim_64,head_dim_128`.
TEST(VectorsKernels, ABf16KernelOfHeadDims64And128Runs300Cases) {
  int n = 0;
  for (const auto& c : committed_manifest(kSet).cases)
    n += has_tag(c.tags, "bf16") && (has_tag(c.tags, "head_dim_64") || has_tag(c.tags, "head_dim_128"));
  EXPECT_GE(n, 300);
}

}  // namespace
}  // namespace attnoracle::testing
