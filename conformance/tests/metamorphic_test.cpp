// Twins are exact transformations (the reference gives related golden values bit for bit), and
// `attnoracle invariants` passes the NumPy example adapter and names the bug of a broken copy.
#include <gtest/gtest.h>

#include "cli_args.hpp"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <sys/wait.h>
#include <unistd.h>
#include <string>

#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::conformance {
namespace {

namespace fs = std::filesystem;

const RawTensor& get(const std::vector<RawTensor>& g, const std::string& name) {
  for (const auto& t : g)
    if (t.name == name) return t;
  throw std::runtime_error("no " + name);
}

// The element at flat index k of a tensor, as its bytes.
std::string bytes_at(const RawTensor& t, std::size_t k) {
  const std::size_t es = dtype_size(t.dtype);
  return std::string(reinterpret_cast<const char*>(t.data.data() + k * es), es);
}

TEST(Twins, AreExactTransformations) {
  int pairs = 0;
  for (int k = 0; k < 24; ++k) {
    vectors::ProblemSpec s;
    s.kind = k % 3 == 2 ? Kind::Mha : Kind::Sdpa;
    s.dtype = std::array<DType, 4>{DType::F32, DType::F16, DType::BF16, DType::F64}[k % 4];
    s.causal = std::array<Causal, 3>{Causal::None, Causal::TopLeft, Causal::BottomRight}[(k / 2) % 3];
    s.B = 1 + k % 2;
    s.Nq = 3 + k % 5;
    s.Nk = 2 + (k * 7) % 6;
    s.Dk = 2 + k % 3;
    s.Dv = 1 + k % 4;
    if (s.kind == Kind::Mha) {
      s.Hq = s.Hkv = 2;
      s.D = 3;
      s.Dout = 2;
    } else {
      s.Hkv = 1 + k % 2;
      s.Hq = s.Hkv * 2;
    }
    s.masked_rows = MaskedRows::Zero;
    s.want_weights = s.want_lse = true;
    s.mask = std::array<vectors::MaskKind, 4>{vectors::MaskKind::None, vectors::MaskKind::KeyPadding,
                                              vectors::MaskKind::None,
                                              vectors::MaskKind::KeyPaddingBroadcast}[k % 4];
    if (k % 8 == 7) s.mask = vectors::MaskKind::KeyVector;  // [Nk]
    s.bias = std::array<vectors::BiasKind, 5>{vectors::BiasKind::None, vectors::BiasKind::PerKey,
                                              vectors::BiasKind::Alibi, vectors::BiasKind::None,
                                              vectors::BiasKind::Scalar}[k % 5];
    if (k % 6 == 5) s.window = std::make_pair<std::int64_t, std::int64_t>(1, 2);
    const SafeTensorsFile base = vectors::make_problem(s, 1000 + static_cast<std::uint64_t>(k));
    for (const TwinPair& p : make_twins("p", base)) {
      const Case ca = case_from_file("a", p.a), cb = case_from_file("b", p.b);
      const EvalResult ra = evaluate(ca, {}), rb = evaluate(cb, {});
      const RawTensor &oa = get(ra.golden, "out"), &ob = get(rb.golden, "out");
      const RawTensor &wa = get(ra.golden, "weights"), &wb = get(rb.golden, "weights");
      const bool mha = ca.kind == Kind::Mha;
      const std::int64_t W = mha ? ca.Dout : ca.Dv;
      ++pairs;
      for (std::int64_t b = 0; b < ca.B; ++b)
        for (std::int64_t h = 0; h < ca.Hq; ++h)
          for (std::int64_t i = 0; i < ca.Nq; ++i) {
            const auto row = static_cast<std::size_t>((b * ca.Hq + h) * ca.Nq + i);
            const bool out_cmp = mha ? p.out_rows[static_cast<std::size_t>(b * ca.Nq + i)] : p.rows[row];
            if (out_cmp && (!mha || h == 0))
              for (std::int64_t e = 0; e < W; ++e) {
                const auto at = static_cast<std::size_t>((mha ? b * ca.Nq + i : static_cast<std::int64_t>(row)) * W + e);
                ASSERT_EQ(bytes_at(oa, at), bytes_at(ob, at))
                    << p.what << " problem " << k << " out at " << at;
              }
            if (!p.rows[row]) continue;
            for (std::int64_t j = 0; j < ca.Nk; ++j) {
              const std::int64_t jt = p.perm.empty() ? j : p.perm[static_cast<std::size_t>(j)];
              ASSERT_EQ(bytes_at(wa, row * static_cast<std::size_t>(ca.Nk) + static_cast<std::size_t>(j)),
                        bytes_at(wb, row * static_cast<std::size_t>(cb.Nk) + static_cast<std::size_t>(jt)))
                  << p.what << " problem " << k << " weight " << j;
            }
          }
    }
  }
  EXPECT_GT(pairs, 60);
}

using testing::run;

std::string numpy_adapter(const std::string& extra = "") {
  return "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
         "/conformance/adapters/numpy/attention.py" + extra + "'";
}

class InvariantsCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists("/usr/bin/python3"))
      GTEST_SKIP() << "skipped: /usr/bin/python3 with NumPy (Debian python3-numpy) is not installed";
    dir_ = std::filesystem::temp_directory_path() /
           ("attnoracle-inv-test-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string common() const {
    return " --problems 18 --failures " + (dir_ / "failures").string() + " --work " + (dir_ / "work").string();
  }
  std::filesystem::path dir_;
};

TEST_F(InvariantsCommand, ExampleAdapterPasses) {
  // each dtype under its gate profile; a profile skips the dtypes it does not cover
  for (const char* dp : {"F32 fp32", "F16 fp16", "BF16 bf16"}) {
    const std::string d(dp), dtype = d.substr(0, d.find(' ')), profile = d.substr(d.find(' ') + 1);
    std::string out;
    EXPECT_EQ(run("invariants --impl " + numpy_adapter() + common() + " --dtypes " + dtype + " --profile " + profile, out), 0)
        << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
  }
  std::string out;
  EXPECT_EQ(run("invariants --impl " + numpy_adapter() + common() + " --dtypes F32,F16", out), 0) << out;
  EXPECT_NE(out.find(" 0 violated, 36 skipped"), std::string::npos) << out;  // the F16 problems' relations
}

TEST_F(InvariantsCommand, FailuresGoToAFreshTemporaryDirectory) {
  // no --failures: a new directory under the temporary one, printed; nothing in the current one
  std::string out;
  const fs::path here = fs::current_path();
  fs::current_path(dir_);
  run("invariants --impl " + numpy_adapter(" --bug causal_leak") + " --problems 6 --work " + (dir_ / "work").string(),
      out);
  fs::current_path(here);
  const std::string tag = "the failing cases are in ";
  const auto at = out.find(tag);
  ASSERT_NE(at, std::string::npos) << out;
  const std::string failures = out.substr(at + tag.size(), out.find(';', at) - at - tag.size());
  EXPECT_EQ(std::filesystem::path(failures).parent_path(), std::filesystem::temp_directory_path()) << failures;
  EXPECT_FALSE(std::filesystem::is_empty(failures)) << failures;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "attnoracle-invariants-failures")) << out;
  std::filesystem::remove_all(failures);
}

TEST_F(InvariantsCommand, CausalLeakIsNamed) {
  std::string out;
  EXPECT_EQ(run("invariants --impl " + numpy_adapter(" --bug causal_leak") + common(), out), 1) << out;
  EXPECT_NE(out.find("causal_dependence"), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "failures")) << out;
}

TEST_F(InvariantsCommand, OtherBugsAreNamed) {
  const std::pair<const char*, const char*> bugs[] = {{"mask_ignored", "masked_zero"},
                                                      {"padding_key_leak", "masked_zero"},
                                                      {"shift_one_key", "key_permutation"},
                                                      {"heads_swapped", "head_independence"}};
  for (auto [bug, inv] : bugs) {
    std::string out;
    EXPECT_EQ(run("invariants --impl " + numpy_adapter(std::string(" --bug ") + bug) + common(), out), 1)
        << bug << "\n" << out;
    EXPECT_NE(out.find(inv), std::string::npos) << bug << "\n" << out;
  }
}

TEST_F(InvariantsCommand, CrashingImplementationFails) {
  std::string out;
  EXPECT_EQ(run("invariants --impl false" + common(), out), 1) << out;
  EXPECT_NE(out.find("status 1"), std::string::npos) << out;
}

TEST_F(InvariantsCommand, BadOptionsAreRefused) {
  std::string out;
  EXPECT_EQ(run("invariants --impl true --profile fp7" + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: --profile"), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl true --dtypes F12" + common(), out), 2) << out;
  EXPECT_EQ(run("invariants --impl true --profile " + (dir_ / "none.json").string() + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: " + (dir_ / "none.json").string()), std::string::npos) << out;
}

}  // namespace
}  // namespace attnoracle::conformance
