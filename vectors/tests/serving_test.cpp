// The serving suite (vectors/suites/serving.json): its committed manifest lists the spec's cases,
// the committed sample regenerates byte for byte with the manifest's hashes, and the sample's
// paged cases are aimed (pages out of order, slots past a row's length holding NaN).
#include <cmath>

#include "attnoracle/reference/safetensors.hpp"
#include "committed_set.hpp"
#include "int_tensor.hpp"

namespace attnoracle::testing {
namespace {

const fs::path kSource = ATTNORACLE_SOURCE_DIR;
const fs::path kSpec = kSource / "vectors/suites/serving.json";
const fs::path kSet = kSource / "vectors/serving";
const char* kRegenerate = "regenerate with: attnoracle gen vectors/suites/serving.json -o DIR, then copy DIR/manifest.json";

TEST(VectorsServing, ManifestListsTheSpecsCases) { expect_manifest_lists_spec(kSpec, kSet, kRegenerate); }

TEST(VectorsServing, SampleRegeneratesWithTheManifestsHashes) {
  expect_sample_regenerates(kSpec, kSet, 6, 6, kRegenerate);
}

// Every paged case of the sample: its used pages are not in order in some row, and with
// poison some slot of k_cache past a row's length holds NaN; no used table entry is out of range.
TEST(VectorsServing, PagedSampleCasesAreShuffledAndPoisoned) {
  int paged = 0, poisoned = 0;
  for (const auto& e : fs::directory_iterator(kSet / "sample")) {
    const SafeTensorsFile f = read_safetensors(e.path().string());
    const RawTensor* table = f.find("block_table");
    if (!table) continue;
    ++paged;
    const RawTensor& k = *f.find("k_cache");
    const std::vector<std::int64_t> bt = int_tensor_values(*table), lk = int_tensor_values(*f.find("seqlens_k"));
    const std::int64_t B = table->shape[0], M = table->shape[1], pages = k.shape[0];
    const bool hnd = f.metadata.at("attn.kv_layout") == "HND";
    const std::int64_t P = hnd ? k.shape[2] : k.shape[1];
    bool out_of_order = false, nan_past_length = false;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t used = (lk[static_cast<std::size_t>(b)] + P - 1) / P;
      for (std::int64_t m = 0; m < used; ++m) {
        const std::int64_t id = bt[static_cast<std::size_t>(b * M + m)];
        ASSERT_GE(id, 0) << e.path();
        ASSERT_LT(id, pages) << e.path();
        if (m > 0 && id != bt[static_cast<std::size_t>(b * M + m - 1)] + 1) out_of_order = true;
      }
      const std::int64_t last = lk[static_cast<std::size_t>(b)] - 1, s = last % P + 1;
      if (last >= 0 && s < P) {  // the slot after the row's last key, on its last page
        const std::int64_t id = bt[static_cast<std::size_t>(b * M + last / P)];
        const std::int64_t slot = hnd ? id * k.shape[1] * P + s : (id * P + s) * k.shape[2];
        nan_past_length = nan_past_length ||
                          std::isnan(decode_float(k.dtype, k.data.data() + static_cast<std::size_t>(slot * k.shape[3]) * dtype_size(k.dtype)));
      }
    }
    if (M > 2) {
      EXPECT_TRUE(out_of_order) << e.path();
    }
    poisoned += nan_past_length;
  }
  EXPECT_GE(paged, 4);
  EXPECT_GE(poisoned, 1);
}

}  // namespace
}  // namespace attnoracle::testing
