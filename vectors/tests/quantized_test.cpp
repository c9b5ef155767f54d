// The quantized suite (vectors/suites/quantized.json): its committed manifest lists the spec's
// cases, the committed sample regenerates byte for byte with the manifest's hashes, every family
// and stored form is present, and the sample's cases are aimed (stored K/V with saturated
// elements, a latent case with V a view of K, an FP8 out with amax).
#include <cmath>
#include <set>

#include "attnoracle/reference/safetensors.hpp"
#include "committed_set.hpp"

namespace attnoracle::testing {
namespace {

const fs::path kSource = ATTNORACLE_SOURCE_DIR;
const fs::path kSpec = kSource / "vectors/suites/quantized.json";
const fs::path kSet = kSource / "vectors/quantized";
const char* kRegenerate = "regenerate with: attnoracle gen vectors/suites/quantized.json -o DIR, then copy DIR/manifest.json";

TEST(VectorsQuantized, ManifestListsTheSpecsCases) { expect_manifest_lists_spec(kSpec, kSet, kRegenerate); }

TEST(VectorsQuantized, SampleRegeneratesWithTheManifestsHashes) {
  expect_sample_regenerates(kSpec, kSet, 5, 4, kRegenerate);
}

// Every stored form, scale granularity and FP8 out the suite is for has cases.
TEST(VectorsQuantized, EveryFormIsPresent) {
  const vectors::Manifest m = committed_manifest(kSet);
  std::set<std::string> tags;
  for (const auto& c : m.cases) tags.insert(c.tags.begin(), c.tags.end());
  for (const char* t : {"kv_f8_e4m3", "kv_f8_e5m2", "kv_i8", "kv_mxfp8", "kv_nvfp4", "kv_scale_tensor", "kv_scale_head",
                        "kv_scale_token", "kv_scale_binades", "paged", "v_from_k", "score_jump", "out_f8_e4m3",
                        "out_f8_e5m2", "amax", "lse_f32", "head_dim_576_512", "head_dim_64", "head_dim_256", "poison"})
    EXPECT_TRUE(tags.count(t)) << t;
}

// The sample's stored cases hold what the suite aims at: E4M3 elements saturated at 448 beside
// subnormal ones, V as a view of K, an FP8 out beside its o_scale and amax, and a poisoned I8
// cache (unused slots -128 and 127 with NaN scales).
TEST(VectorsQuantized, SampleCasesAreAimed) {
  int saturated_and_subnormal = 0, latent = 0, fp8_out = 0, poisoned = 0;
  for (const auto& e : fs::directory_iterator(kSet / "sample")) {
    const SafeTensorsFile f = read_safetensors(e.path().string());
    const RawTensor* slot_scale = f.find("k_scale");
    if (f.find("k_cache") && f.find("k_cache")->dtype == DType::I8 && slot_scale && slot_scale->dtype == DType::F32)
      for (std::int64_t s = 0; s < slot_scale->numel(); ++s)
        poisoned += std::isnan(decode_float(DType::F32, slot_scale->data.data() + 4 * s));
    for (const char* name : {"k", "k_cache"}) {
      const RawTensor* k = f.find(name);
      if (!k || k->dtype != DType::F8_E4M3 || f.metadata.count("attn.kv_block_scale")) continue;
      bool top = false, sub = false;
      for (unsigned char b : k->data) {
        top = top || (b & 0x7F) == 0x7E;               // +-448
        sub = sub || ((b & 0x78) == 0 && (b & 7) != 0);  // exponent field 0, significand not
      }
      saturated_and_subnormal += top && sub;
    }
    if (f.metadata.count("attn.v_from_k")) {
      ++latent;
      EXPECT_EQ(f.find("v"), nullptr);
      EXPECT_EQ(f.find("v_cache"), nullptr);
    }
    if (f.metadata.at("attn.output_dtype").rfind("F8_", 0) == 0) {
      ++fp8_out;
      EXPECT_NE(f.find("o_scale"), nullptr) << e.path();
      EXPECT_NE(f.find("amax"), nullptr) << e.path();
    }
  }
  EXPECT_GE(saturated_and_subnormal, 1);
  EXPECT_GE(latent, 1);
  EXPECT_GE(fp8_out, 1);
  EXPECT_GE(poisoned, 1);
}

}  // namespace
}  // namespace attnoracle::testing
