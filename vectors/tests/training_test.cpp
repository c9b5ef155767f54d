// The training suite (vectors/suites/training.json): its committed manifest lists the spec's
// cases, the committed sample regenerates byte for byte with the manifest's hashes, and the
// sample's rotary tables are those the spec names (cos and sin of t 10000^(-2f/R)) up to
// positions past 4000, and its dropout cases hold a keep mask over every (b, h, i, j) kept at a
// rate near 1 - p.
#include <cmath>
#include <cstdlib>

#include "attnoracle/reference/safetensors.hpp"
#include "committed_set.hpp"

namespace attnoracle::testing {
namespace {

const fs::path kSource = ATTNORACLE_SOURCE_DIR;
const fs::path kSpec = kSource / "vectors/suites/training.json";
const fs::path kSet = kSource / "vectors/training";
const char* kRegenerate = "regenerate with: attnoracle gen vectors/suites/training.json -o DIR, then copy DIR/manifest.json";

TEST(VectorsTraining, ManifestListsTheSpecsCases) { expect_manifest_lists_spec(kSpec, kSet, kRegenerate); }

TEST(VectorsTraining, SampleRegeneratesWithTheManifestsHashes) {
  expect_sample_regenerates(kSpec, kSet, 8, 8, kRegenerate);
}

// Each sample case's tables against std::cos and std::sin (within 2^-22 relative to 1: an F32
// rounding and the double's own error at angles up to 4096), and the longest position reached.
TEST(VectorsTraining, SampleTablesAreTheSpecsAngles) {
  std::int64_t longest = 0;
  for (const auto& e : fs::directory_iterator(kSet / "sample")) {
    const SafeTensorsFile f = read_safetensors(e.path().string());
    const RawTensor* c = f.find("rotary_cos");
    const RawTensor* s = f.find("rotary_sin");
    if (!c && !s) continue;  // a dropout case
    ASSERT_TRUE(c && s) << e.path();
    const std::int64_t nrot = c->shape[0], half = c->shape[1];
    longest = std::max(longest, nrot - 1);
    for (std::int64_t t = 0; t < nrot; t += std::max<std::int64_t>(1, nrot / 64))
      for (std::int64_t fq = 0; fq < half; ++fq) {
        const double a = static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(fq) / static_cast<double>(2 * half));
        const auto at = static_cast<std::size_t>(t * half + fq) * 4;
        EXPECT_NEAR(decode_float(DType::F32, c->data.data() + at), std::cos(a), 0x1p-22) << e.path() << " t=" << t;
        EXPECT_NEAR(decode_float(DType::F32, s->data.data() + at), std::sin(a), 0x1p-22) << e.path() << " t=" << t;
      }
  }
  EXPECT_GE(longest, 4000);
}

// Each dropout case of the sample: a full BOOL mask, kept within 5 standard deviations of 1 - p.
TEST(VectorsTraining, SampleDropoutMasksKeepNearOneMinusP) {
  int dropout = 0;
  for (const auto& e : fs::directory_iterator(kSet / "sample")) {
    const SafeTensorsFile f = read_safetensors(e.path().string());
    const RawTensor* keep = f.find("dropout_mask");
    if (!keep) continue;
    ++dropout;
    const RawTensor& q = *f.find("q");
    const RawTensor& k = *f.find("k");
    ASSERT_EQ(keep->dtype, DType::BOOL) << e.path();
    EXPECT_EQ(keep->shape, (std::vector<std::int64_t>{q.shape[0], q.shape[1], q.shape[2], k.shape[2]})) << e.path();
    const double p = std::strtod(f.metadata.at("attn.dropout_p").c_str(), nullptr);
    double kept = 0;
    for (auto x : keep->data) kept += x;
    const double n = static_cast<double>(keep->data.size());
    EXPECT_NEAR(kept / n, 1 - p, 5 * std::sqrt(p * (1 - p) / n)) << e.path();
  }
  EXPECT_GE(dropout, 4);
}

}  // namespace
}  // namespace attnoracle::testing
