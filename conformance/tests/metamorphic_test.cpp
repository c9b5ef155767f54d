// Twins are exact transformations (the reference gives related golden values bit for bit), and
// `attnoracle invariants` passes the NumPy example adapter and names the bug of a broken copy.
#include <gtest/gtest.h>

#include "cli_args.hpp"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
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
    if (k % 4 == 3) {  // padded varlen over three sequences (bottom_right for some)
      s.seqlens = std::array<vectors::SeqlensKind, 3>{vectors::SeqlensKind::Varlen, vectors::SeqlensKind::Decode,
                                                      vectors::SeqlensKind::Chunked}[(k / 4) % 3];
      s.B = 3;
    }
    const SafeTensorsFile base = vectors::make_problem(s, 1000 + static_cast<std::uint64_t>(k));
    for (const TwinPair& p : make_twins("p", base, true)) {  // batch row 0 compared alone: at equal indices
      if (p.reference) continue;  // their exact results differ: ReferenceTwinsChangeWhatTheySay
      if (!p.query_of.empty()) continue;  // one query a row: ServingTwins.AreExactTransformations
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


// The reference twins: the reference changes something on the compared rows, and nothing where
// the relation says nothing changes (the rows of other kv groups, of heads other than 0).
TEST(Twins, ReferenceTwinsChangeWhatTheySay) {
  std::map<std::string, int> changed;
  for (int k = 0; k < 8; ++k) {
    vectors::ProblemSpec s;
    s.kind = Kind::Sdpa;
    s.dtype = std::array<DType, 4>{DType::F32, DType::F16, DType::BF16, DType::F64}[k % 4];
    s.B = 1 + k % 2;
    s.Nq = 3 + k % 3;
    s.Nk = 4 + k;
    s.Dk = 2 + k % 3;
    s.Dv = 2;
    s.Hkv = 2 + k % 2;
    s.Hq = s.Hkv * 2;
    s.masked_rows = MaskedRows::Zero;
    s.want_weights = s.want_lse = true;
    s.bias = k % 2 ? vectors::BiasKind::Alibi : vectors::BiasKind::Random;
    s.window = std::make_pair<std::int64_t, std::int64_t>(1, 1);
    if (k % 3 == 0) s.softcap = "5";
    s.query_mask = k % 2 == 0;
    if (k % 2 == 1) s.sinks = "near";
    const SafeTensorsFile base = vectors::make_problem(s, 500 + static_cast<std::uint64_t>(k));
    const Case c = case_from_file("p", base);
    const EvalResult ra = evaluate(c, {});
    const RawTensor& oa = get(ra.golden, "out");
    for (const TwinPair& p : make_twins("p", base)) {
      for (std::int64_t b = 0; b < c.B; ++b)  // padding rows are never compared
        for (std::int64_t i = 0; i < c.Nq; ++i)
          if (!c.query_valid(b, i)) {
            EXPECT_FALSE(p.rows[static_cast<std::size_t>(b * c.Hq * c.Nq + i)]) << p.what;
            EXPECT_FALSE(p.out_rows[static_cast<std::size_t>(b * c.Nq + i)]) << p.what;
          }
      if (!p.reference) continue;
      const EvalResult rb = evaluate(case_from_file("b", p.b), {});
      const RawTensor& ob = get(rb.golden, "out");
      bool any = false;
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            const auto row = static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i);
            bool differs = false;
            for (std::int64_t e = 0; e < c.Dv; ++e)
              differs = differs || bytes_at(oa, row * 2 + static_cast<std::size_t>(e)) !=
                                       bytes_at(ob, row * 2 + static_cast<std::size_t>(e));
            if (p.relation == "kv_head_locality" && c.kv_head(h) != c.Hkv - 1) {
              EXPECT_FALSE(differs) << p.what << " problem " << k << " b " << b << " h " << h << " i " << i;
            }
            if ((p.relation == "bias_sensitivity" || p.relation == "sink_sensitivity") && h != 0) {
              EXPECT_FALSE(differs) << p.what;
            }
            any = any || (differs && p.rows[row]);
          }
      if (any) ++changed[p.relation];
    }
  }
  for (const char* r : {"kv_head_locality", "scale_sensitivity", "softcap_sensitivity", "bias_sensitivity",
                        "window_sensitivity"})
    EXPECT_GE(changed[r], 6) << r;  // of 8 problems: the twins are not vacuous
  EXPECT_EQ(changed["sink_sensitivity"], 4);  // the 4 problems with sinks
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
  for (const char* dp : {"F32 fp32", "F16 fp16", "BF16 bf16", "F64 fp64"}) {
    const std::string d(dp), dtype = d.substr(0, d.find(' ')), profile = d.substr(d.find(' ') + 1);
    const std::string impl = numpy_adapter(dtype == "F64" ? " --dtype float64" : "");
    std::string out;
    EXPECT_EQ(run("invariants --impl " + impl + common() + " --dtypes " + dtype + " --profile " + profile, out), 0)
        << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
  }
  std::string out;
  EXPECT_EQ(run("invariants --impl " + numpy_adapter() + common() + " --dtypes F32,F16", out), 0) << out;
  EXPECT_NE(out.find(" 0 violated, 77 skipped"), std::string::npos) << out;  // the F16 problems' relations
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

TEST_F(InvariantsCommand, NewRelationsNameTheirBugs) {
  const std::pair<const char*, const char*> bugs[] = {{"gqa_tiled", "kv_head_locality"},
                                                      {"meta_head_bias_ignored", "bias_sensitivity"},
                                                      {"meta_window_off_by_one", "window_sensitivity"},
                                                      {"meta_softcap_ignored", "softcap_sensitivity"},
                                                      {"no_scaling", "scale_sensitivity"}};
  for (auto [bug, relation] : bugs) {
    std::string out;
    EXPECT_EQ(run("invariants --impl " + numpy_adapter(std::string(" --bug ") + bug) + common(), out), 1)
        << bug << "\n" << out;
    EXPECT_NE(out.find(std::string("  ") + relation + " ("), std::string::npos) << bug << "\n" << out;
  }
  // a tiled GQA mapping in every dtype, each under its profile
  for (const char* dp : {"F16 fp16", "BF16 bf16", "F64 fp64"}) {
    const std::string d(dp), dtype = d.substr(0, d.find(' ')), profile = d.substr(d.find(' ') + 1);
    const std::string impl = numpy_adapter(std::string(dtype == "F64" ? " --dtype float64" : "") + " --bug gqa_tiled");
    std::string out;
    EXPECT_EQ(run("invariants --impl " + impl + common() + " --dtypes " + dtype + " --profile " + profile, out), 1) << out;
    EXPECT_NE(out.find("  kv_head_locality ("), std::string::npos) << out;
  }
}

TEST_F(InvariantsCommand, PaddingRowsAreFree) {
  // A correct kernel that writes padding rows (query_mask false) as zeros, or as NaN: the
  // contract leaves them free, so every relation holds. The wrapper counts the rows it overwrote.
  const fs::path wrapper = dir_ / "padding_rows.py", count = dir_ / "padded";
  {
    std::FILE* f = std::fopen(wrapper.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fprintf(f, "%s", (R"(import os, sys
sys.path.insert(0, ")" + std::string(ATTNORACLE_SOURCE_DIR) + R"(/conformance/adapters/numpy")
import numpy as np
import attention
FILL = float(sys.argv.pop(1))
correct = attention.run_case
def run_case(path, compute, bug=None):
    result, dtypes = correct(path, compute, bug)
    qm = attention.safetensors_np.read(path)[0].get("query_mask")
    if qm is not None:
        pad = ~qm.astype(bool)
        for name in result:  # what the contract leaves free: dq too, not dk, dv, dbias, dsinks
            if name not in ("out", "weights", "lse", "dq"):
                continue
            a = np.array(result[name])
            (a if name == "out" and a.ndim == 3 else np.swapaxes(a, 1, 2))[pad] = FILL
            result[name] = a
        with open(os.environ["PADDED"], "a") as f:
            f.write(f"{int(pad.sum())}\n")
    return result, dtypes
attention.run_case = run_case
sys.exit(attention.main())
)").c_str());
    std::fclose(f);
  }
  for (const char* fill : {"0", "nan"}) {
    fs::remove(count);
    std::string out;
    EXPECT_EQ(run("invariants --impl 'env PADDED=" + count.string() + " /usr/bin/python3 " + wrapper.string() + " " +
                      fill + "'" + common(),
                  out),
              0)
        << fill << "\n" << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
    std::FILE* f = std::fopen(count.c_str(), "r");
    ASSERT_NE(f, nullptr) << "no problem had padding rows";
    long total = 0, n = 0;
    while (std::fscanf(f, "%ld", &n) == 1) total += n;
    std::fclose(f);
    EXPECT_GT(total, 0) << fill;
  }
}

TEST_F(InvariantsCommand, LongRowsCatchAMissingRescale) {
  // A flash kernel that does not rescale the earlier blocks is right on rows of one block: it
  // passes with short problems only, and is caught with the default long ones.
  const std::string flash = "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
                            "/conformance/adapters/flash_numpy/attention.py --block 64";
  std::string out;
  const std::string json = (dir_ / "report.json").string();
  EXPECT_EQ(run("invariants --impl " + flash + "'" + common() + " --json " + json, out), 0) << out;
  EXPECT_EQ(run("invariants --impl " + flash + " --bug no_rescale'" + common() + " --long-keys 0", out), 0) << out;
  EXPECT_EQ(run("invariants --impl " + flash + " --bug no_rescale'" + common(), out), 1) << out;
  // the default problems: rows past 256 keys and at the block boundaries
  std::FILE* f = std::fopen(json.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text;
  for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
  std::fclose(f);
  for (const char* nk : {"\"Nk\": 257", "\"Nk\": 300", "\"Nk\": 64,", "\"Nk\": 65,", "\"Nk\": 128,", "\"Nk\": 129,"})
    EXPECT_NE(text.find(nk), std::string::npos) << nk << "\n" << text.substr(0, 2000);
}

// A Python wrapper around the NumPy adapter: `body` runs after `import attention`, then main().
void write_wrapper(const fs::path& path, const std::string& body) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fprintf(f, "%s", ("import sys\nsys.path.insert(0, \"" + std::string(ATTNORACLE_SOURCE_DIR) +
                         "/conformance/adapters/numpy\")\nimport attention\n" + body +
                         "sys.exit(attention.main())\n").c_str());
  std::fclose(f);
}

TEST_F(InvariantsCommand, AKernelReturningOnlyOutPassesWithReturns) {
  // A correct kernel that returns out alone, and stops on a case asking for more.
  const fs::path wrapper = dir_ / "out_only.py";
  write_wrapper(wrapper, R"(correct = attention.run_case
def run_case(path, compute, bug=None):
    asked = attention.safetensors_np.read(path)[1].get("attn.outputs")
    if asked != "out":
        raise SystemExit("asked for " + asked)
    result, dtypes = correct(path, compute, bug)
    return {"out": result["out"]}, dtypes
attention.run_case = run_case
)");
  const std::string impl = "'/usr/bin/python3 " + wrapper.string() + "'";
  const std::string few = " --problems 6 --work " + (dir_ / "work").string();
  std::string out;
  EXPECT_EQ(run("invariants --impl " + impl + few, out), 1) << out;  // asked for weights and lse
  for (const char* returns : {"''", "none"}) {
    EXPECT_EQ(run("invariants --impl " + impl + few + " --returns " + returns, out), 0) << returns << "\n" << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
  }
  // lse alone: the wrapper stops on the first case asking for it
  EXPECT_EQ(run("invariants --impl " + impl + few + " --returns lse", out), 1) << out;
  EXPECT_EQ(run("invariants --impl true --returns weights,dq" + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: --returns: unknown output 'dq'"), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl true --shapes large" + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: --shapes"), std::string::npos) << out;
}

TEST_F(InvariantsCommand, KernelShapesCatchAMappingWrongForOneGroupSize) {
  // A kernel whose kv head mapping is interleaved (h % Hkv) only when Hq / Hkv = 7: the toy
  // problems (1 to 3 query heads per kv head) miss it, the kernel shapes catch it.
  const fs::path wrapper = dir_ / "group7.py";
  write_wrapper(wrapper, R"(correct = attention.attention
def attention7(q, k, v, meta, bug, **kw):
    return correct(q, k, v, meta, "transposed_gqa" if q.shape[1] == 7 * k.shape[1] else bug, **kw)
attention.attention = attention7
)");
  const std::string impl = "'/usr/bin/python3 " + wrapper.string() + "'";
  const std::string json = (dir_ / "report.json").string();
  std::string out;
  EXPECT_EQ(run("invariants --impl " + impl + common() + " --kinds sdpa", out), 0) << out;
  EXPECT_EQ(run("invariants --impl " + numpy_adapter() + common() + " --shapes kernel --json " + json, out), 0) << out;
  EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
  std::FILE* f = std::fopen(json.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text;
  for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
  std::fclose(f);
  // 18 problems, 9 of kind sdpa: every group size over two kv heads, kernel head dims
  for (int g : {1, 2, 3, 4, 5, 6, 7, 8, 16})
    EXPECT_NE(text.find("\"Hq\": " + std::to_string(2 * g) + ",\n      \"Hkv\": 2"), std::string::npos) << g;
  for (const char* d : {"\"Dk\": 64", "\"Dk\": 96", "\"Dk\": 128", "\"Dk\": 192", "\"Dk\": 256", "\"Dv\": 128"})
    EXPECT_NE(text.find(d), std::string::npos) << d;
  EXPECT_EQ(run("invariants --impl " + impl + " --problems 9 --kinds sdpa --work " + (dir_ / "work").string() +
                    " --failures " + (dir_ / "failures").string() + " --shapes kernel", out), 1) << out;
  EXPECT_NE(out.find("  kv_head_locality ("), std::string::npos) << out;
}

std::string flash_adapter(const std::string& extra = "") {
  return "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) + "/conformance/adapters/flash_numpy/attention.py" +
         extra + "'";
}

// The number of times `what` occurs in `text`.
std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_F(InvariantsCommand, CorrectKernelsAreDeterministicAndBatchInvariant) {
  // Three runs of every problem, gradients included, and every row alone and among others: no
  // bit moves in the NumPy kernels (the flash one in blocks of 16 keys: several on most rows).
  for (const std::string& impl : {numpy_adapter(), flash_adapter(" --block 16")}) {
    const std::string json = (dir_ / "report.json").string();
    std::string out;
    EXPECT_EQ(run("invariants --impl " + impl + common() + " --reruns 3 --batch-invariant --json " + json, out), 0)
        << impl << "\n" << out;
    EXPECT_NE(out.find(", 3 runs each, batch invariant): "), std::string::npos) << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
    std::FILE* f = std::fopen(json.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string text;
    for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
    std::fclose(f);
    EXPECT_EQ(count(text, "\"invariant\": \"deterministic\""), 18u) << text.substr(0, 1000);
    EXPECT_GE(count(text, "\"invariant\": \"batch_invariance\""), 18u);  // row 0 among others; alone where B > 1
    EXPECT_NE(text.find("\"reruns\": 3"), std::string::npos);
  }
}

// A bug no single run shows: `impl` passes without `flag`, and with it violates `relation` alone,
// naming elements of `tensor` that changed bits and both values in hex.
void expect_caught_only_with(const std::string& impl, const std::string& common, const std::string& flag,
                             const std::string& relation, const std::string& tensor) {
  std::string out;
  EXPECT_EQ(run("invariants --impl " + impl + common, out), 0) << out;
  EXPECT_EQ(run("invariants --impl " + impl + common + " " + flag, out), 1) << out;
  EXPECT_NE(out.find("elements changed bits: " + tensor + "["), std::string::npos) << out;
  EXPECT_NE(out.find(" vs 0x"), std::string::npos) << out;
  EXPECT_GT(count(out, "violated  "), 0u) << out;
  EXPECT_EQ(count(out, "violated  "), count(out, "  " + relation + " (")) << out;
}

TEST_F(InvariantsCommand, RerunsCatchANondeterministicBackward) {
  // dq summed over the key blocks in an order drawn per run: the reruns, which ask the
  // gradients, see it; with the forward outputs alone (--returns without gradients) nothing moves.
  const std::string impl = flash_adapter(" --block 16 --bug dq_block_order_random");
  expect_caught_only_with(impl, common(), "--reruns 3", "deterministic", "dq");
  std::string out;
  EXPECT_EQ(run("invariants --impl " + impl + common() + " --returns weights,lse --deterministic", out), 0) << out;
  EXPECT_NE(out.find(", 3 runs each): "), std::string::npos) << out;
}

TEST_F(InvariantsCommand, BatchInvarianceCatchesABlockSizeFromTheBatch) {
  // Keys per block from the batch size: every result is within its limits (batch_independence
  // holds), but a row's bits change with the batch once it is declared batch invariant.
  expect_caught_only_with(flash_adapter(" --bug block_from_batch"), common(), "--batch-invariant", "batch_invariance",
                          "out");
}

TEST_F(InvariantsCommand, DeclaredInTheProfile) {
  // A profile declaring determinism and batch invariance: the reruns (3 runs) and relation
  // batch_invariance without the flags, which catch a backward summing its key blocks in an order
  // drawn per run; --reruns still sets the count.
  const std::string profile = (dir_ / "declared.json").string();
  auto write_text = [](const std::string& path, const char* text) { std::ofstream(path) << text; };
  write_text(profile, R"({"name": "declared", "base": "fp32", "deterministic": true, "batch_invariant": true})");
  const std::string impl = flash_adapter(" --block 16 --bug dq_block_order_random");
  std::string out;
  EXPECT_EQ(run("invariants --impl " + impl + common() + " --profile " + profile, out), 1) << out;
  EXPECT_NE(out.find(", 3 runs each, batch invariant): "), std::string::npos) << out;
  EXPECT_NE(out.find("  deterministic ("), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl " + flash_adapter(" --block 16") + common() + " --profile " + profile +
                    " --reruns 2", out), 0) << out;
  EXPECT_NE(out.find(", 2 runs each, batch invariant): "), std::string::npos) << out;
  EXPECT_NE(out.find(" 0 violated"), std::string::npos) << out;
  write_text(profile, R"({"name": "declared", "deterministic": "yes"})");
  EXPECT_EQ(run("invariants --impl true" + common() + " --profile " + profile, out), 2) << out;
  EXPECT_NE(out.find("declared.json: deterministic: must be true or false"), std::string::npos) << out;
}

TEST_F(InvariantsCommand, TwinsRelateTheGradients) {
  // Backward bugs no forward output shows: dk and dv summed over the wrong query heads (a dk
  // from the wrong kv head), and the last partial key block skipped. The twins that ask the
  // gradients catch them; with --returns without gradients nothing is compared, nothing fails.
  std::string out;
  const std::string tiled = numpy_adapter(" --bug bwd_gqa_sum_tiled");
  EXPECT_EQ(run("invariants --impl " + tiled + common(), out), 1) << out;
  EXPECT_NE(out.find("): dk["), std::string::npos) << out;
  EXPECT_NE(out.find("  scale_sensitivity ("), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl " + tiled + common() + " --returns weights,lse", out), 0) << out;
  // an exact twin (the keys permuted: other keys land in the skipped block of 4) sees it in dv
  const std::string tail = flash_adapter(" --block 4 --bug bwd_tail_block_skipped");
  EXPECT_EQ(run("invariants --impl " + tail + common(), out), 1) << out;
  EXPECT_NE(out.find("  key_permutation (keys and values permuted): dv["), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl " + tail + common() + " --returns weights,lse", out), 0) << out;
}

TEST_F(InvariantsCommand, NaNPayloadsAreNotDifferences) {
  // A kernel writing out[..., 0] as a NaN of a payload drawn per run: the reruns see no change
  // (NaN equals NaN); the last bit of it flipped at random instead is a change.
  const fs::path wrapper = dir_ / "noisy.py";
  write_wrapper(wrapper, R"(import os
import numpy as np
MODE = sys.argv.pop(1)
correct = attention.run_case
def run_case(path, compute, bug=None):
    result, dtypes = correct(path, compute, bug)
    bits = np.array(result["out"], np.float32).view(np.uint32)
    noise = np.frombuffer(os.urandom(4 * bits[..., 0].size), np.uint32).reshape(bits[..., 0].shape)
    bits[..., 0] = 0x7FC00000 | (noise & 0x3FFFFF) if MODE == "nan" else bits[..., 0] ^ (noise & 1)
    result["out"] = bits.view(np.float32)
    return result, dtypes
attention.run_case = run_case
)");
  std::string out;
  for (const char* mode : {"nan", "bit"}) {
    const std::string impl = "'/usr/bin/python3 " + wrapper.string() + " " + mode + "'";
    EXPECT_EQ(run("invariants --impl " + impl + common() + " --reruns 2", out), 1) << out;  // NaN fails the limits
    EXPECT_EQ(out.find("  deterministic (") == std::string::npos, std::string(mode) == "nan") << mode << "\n" << out;
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
  EXPECT_EQ(run("invariants --impl true --long-keys 0,64" + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: --long-keys"), std::string::npos) << out;
  EXPECT_EQ(run("invariants --impl true --profile " + (dir_ / "none.json").string() + common(), out), 2) << out;
  EXPECT_NE(out.find("attnoracle: error: " + (dir_ / "none.json").string()), std::string::npos) << out;
  for (const char* n : {"1", "0", "101", "two"}) {
    EXPECT_EQ(run("invariants --impl true --reruns " + std::string(n) + common(), out), 2) << out;
    EXPECT_NE(out.find("--reruns"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace attnoracle::conformance
