// End to end: `attnoracle gen` (determinism across --jobs and --shard, resume, refusals) and
// `attnoracle verify` (each kind of damage to a vector set is caught).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli_run.hpp"

namespace attnoracle::testing {
namespace {

// Small but varied: four generators, sdpa and mha, masks, a refused case, policy zero.
const char* kSpec = R"({"suite": "tiny", "seed": 11, "families": [
  {"name": "gens", "generator": "normal", "cross": {"dtype": ["F32", "F16", "BF16", "F64"]},
   "fixed": {"shape": [1, 2, 1, 4, 6, 4, 3], "causal": "bottom_right",
             "outputs": "out,weights,lse"}},
  {"name": "dominant", "generator": "dominant", "cross": {"dtype": ["F32", "F16"]},
   "fixed": {"shape": [1, 1, 1, 3, 5, 4, 4], "outputs": "out,weights"}},
  {"name": "ties", "generator": "ties", "fixed": {"shape": [1, 2, 2, 3, 8, 4, 4], "bias": "alibi"}},
  {"name": "mha", "generator": "cancel",
   "fixed": {"kind": "mha", "shape": [2, 2, 3, 4, 6, 4, 4, 5], "mask": "key_padding",
             "query_mask": true}},
  {"name": "masked", "generator": "uniform", "cross": {"masked_rows": ["error", "zero"]},
   "fixed": {"shape": [1, 1, 1, 4, 4, 4, 4], "mask": "fully_masked_rows", "outputs": "out,lse"}}
]})";

class VectorsCli : public ::testing::Test {
 protected:
  void SetUp() override { write_text(dir_ / "tiny.json", kSpec); }

  CliResult gen(const std::string& out, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"gen", (dir_ / "tiny.json").string(), "-o",
                                     (dir_ / out).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(args);
  }
  CliResult verify(const std::string& d, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"verify", (dir_ / d).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(args);
  }
  // A fresh copy of a clean generated set, to damage.
  void copy_clean(const std::string& to) {
    if (!fs::exists(dir_ / "clean")) {
      const CliResult r = gen("clean", {"--jobs", "2", "--quiet"});
      ASSERT_EQ(r.status, 0) << r.err;
    }
    fs::copy(dir_ / "clean", dir_ / to, fs::copy_options::recursive);
  }
  // Rewrites the manifest's sha256 of `id` to that of its file now.
  void fix_hash(const std::string& set, const std::string& id) {
    const fs::path m = dir_ / set / "manifest.json";
    std::string text = read_text(m);
    const std::string file = read_text(dir_ / set / "cases" / (id + ".safetensors"));
    const auto at = text.find("\"id\": \"" + id + "\"");
    const auto sha = text.find("\"sha256\": \"", at) + 11;
    text.replace(sha, 64, vectors::sha256_hex(std::string_view(file)));
    write_text(m, text);
  }

  TempDir dir_;
};

TEST_F(VectorsCli, SameBytesWhateverJobsAndShards) {
  const CliResult one = gen("one", {"--jobs", "1"});
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_NE(one.err.find("[1/10] gens-000"), std::string::npos) << one.err;
  ASSERT_EQ(gen("two", {"--jobs", "2", "--quiet"}).status, 0);
  EXPECT_EQ(gen("three", {"--jobs", "3", "--threads-per-case", "2", "--quiet"}).status, 0);

  const CliResult s0 = gen("sharded", {"--shard", "0/2"});
  ASSERT_EQ(s0.status, 0) << s0.err;
  EXPECT_FALSE(fs::exists(dir_ / "sharded" / "manifest.json"));
  EXPECT_NE(s0.err.find("5 of 10 cases still missing"), std::string::npos) << s0.err;
  const CliResult s1 = gen("sharded", {"--shard", "1/2", "--jobs", "2"});
  ASSERT_EQ(s1.status, 0) << s1.err;
  EXPECT_NE(s1.err.find("0 of 10 cases still missing"), std::string::npos) << s1.err;
  const CliResult fin = gen("sharded");
  ASSERT_EQ(fin.status, 0) << fin.err;
  EXPECT_NE(fin.err.find("0 cases written, 10 already present"), std::string::npos) << fin.err;

  const auto a = tree(dir_ / "one");
  EXPECT_EQ(a.size(), 11u);
  for (const char* other : {"two", "three", "sharded"})
    EXPECT_EQ(differences(a, tree(dir_ / other)), std::vector<std::string>{}) << other;
  EXPECT_EQ(verify("one").status, 0);
  const CliResult rc = verify("one", {"--recompute"});
  EXPECT_EQ(rc.status, 0) << rc.out << rc.err;
}

TEST_F(VectorsCli, SomeCasesByIdAndVerifyAgainstAnotherManifest) {
  copy_clean("full");
  // --case: only those cases, the bytes of the full run, no manifest
  const CliResult r = gen("some", {"--case", "ties-000,gens-002", "--jobs", "2"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("2 of the suite's 10 cases asked for (--case), no manifest written"), std::string::npos) << r.err;
  const auto some = tree(dir_ / "some");
  ASSERT_EQ(some.size(), 2u);
  for (const char* id : {"ties-000", "gens-002"})
    EXPECT_EQ(read_text(dir_ / "some/cases" / (std::string(id) + ".safetensors")),
              read_text(dir_ / "full/cases" / (std::string(id) + ".safetensors"))) << id;
  CliResult bad = gen("none", {"--case", "ties-000,ties-9"});
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("attnoracle: error: --case: no case \"ties-9\" in "), std::string::npos) << bad.err;
  // --manifest: a set without its own manifest checked against another; a set whose own
  // manifest differs from it is reported
  const std::string other = (dir_ / "full/manifest.json").string();
  fs::copy(dir_ / "full", dir_ / "bare", fs::copy_options::recursive);
  fs::remove(dir_ / "bare/manifest.json");
  CliResult v = verify("bare", {"--manifest", other});
  EXPECT_EQ(v.status, 0) << v.out << v.err;
  v = verify("some", {"--manifest", other});
  EXPECT_EQ(v.status, 1);
  EXPECT_NE(v.out.find("missing file"), std::string::npos) << v.out;
  copy_clean("edited");
  std::string m = read_text(dir_ / "edited/manifest.json");
  m.replace(m.find("\"seed\": "), 8, "\"seed\":  ");
  write_text(dir_ / "edited/manifest.json", m);
  v = verify("edited", {"--manifest", other});
  EXPECT_EQ(v.status, 1);
  EXPECT_EQ(v.out, "manifest.json: differs from " + other + "\n");
  EXPECT_EQ(verify("bare", {"--manifest", (dir_ / "nothing.json").string()}).status, 2);
}

TEST_F(VectorsCli, ResumeRewritesOnlyWhatIsMissingOrStale) {
  copy_clean("resumed");
  const fs::path cases = dir_ / "resumed" / "cases";
  fs::remove(cases / "ties-000.safetensors");
  write_text(cases / "gens-001.safetensors", "not a case file");
  write_text(cases / "mha-000.safetensors.tmp.4242", "half written");  // a stopped run
  fs::remove(dir_ / "resumed" / "manifest.json");
  const CliResult r = gen("resumed", {"--jobs", "2"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("2 cases written, 8 already present"), std::string::npos) << r.err;
  EXPECT_EQ(differences(tree(dir_ / "clean"), tree(dir_ / "resumed")), std::vector<std::string>{});
}

TEST_F(VectorsCli, ManifestFormat) {
  copy_clean("m");
  const std::string text = read_text(dir_ / "m" / "manifest.json");
  EXPECT_EQ(text.rfind("{\"format\": \"attnoracle-vectors/1\", \"suite\": \"tiny\", "
                       "\"generator\": \"attnoracle ",
                       0),
            0u)
      << text;
  EXPECT_NE(text.find("\"seed\": 11,\n \"spec_sha256\": \"" +
                      vectors::sha256_hex(std::string_view(kSpec)) + "\""),
            std::string::npos);
  EXPECT_NE(text.find("{\"id\": \"masked-000\", \"file\": \"cases/masked-000.safetensors\", "
                      "\"sha256\": \""),
            std::string::npos);
  EXPECT_NE(text.find("\"expect\": \"error\", \"tags\": [\"uniform\", \"f32\", \"head_dim_4\", "
                      "\"mask_fully_masked_rows\", \"lse\", \"fully_masked\"]}"),
            std::string::npos)
      << text;
  // the refused case holds inputs only
  const SafeTensorsFile f = read_safetensors(dir_ / "m" / "cases" / "masked-000.safetensors");
  EXPECT_EQ(f.find("out"), nullptr);
  EXPECT_NE(read_safetensors(dir_ / "m" / "cases" / "masked-001.safetensors").find("out"), nullptr);
}

TEST_F(VectorsCli, VerifyCatchesAFlippedBit) {
  copy_clean("flip");
  const fs::path p = dir_ / "flip" / "cases" / "dominant-001.safetensors";
  std::string bytes = read_text(p);
  bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x10);
  write_text(p, bytes);
  const CliResult r = verify("flip");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out.rfind("dominant-001: sha256 ", 0), 0u) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
}

TEST_F(VectorsCli, VerifyCatchesAMissingCase) {
  copy_clean("missing");
  fs::remove(dir_ / "missing" / "cases" / "ties-000.safetensors");
  const CliResult r = verify("missing");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "ties-000: missing file cases/ties-000.safetensors\n");
}

TEST_F(VectorsCli, VerifyCatchesAnEditedManifest) {
  copy_clean("sha");
  const fs::path m = dir_ / "sha" / "manifest.json";
  std::string text = read_text(m);
  const auto at = text.find("\"sha256\": \"", text.find("\"id\": \"gens-002\"")) + 11;
  text[at] = text[at] == '0' ? '1' : '0';
  write_text(m, text);
  CliResult r = verify("sha");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out.rfind("gens-002: sha256 ", 0), 0u) << r.out;

  copy_clean("fmt");
  text = read_text(dir_ / "fmt" / "manifest.json");
  text.replace(text.find("vectors/1"), 9, "vectors/9");
  write_text(dir_ / "fmt" / "manifest.json", text);
  r = verify("fmt");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "manifest.json: format: \"attnoracle-vectors/9\" is not \"attnoracle-vectors/1\"\n");

  write_text(dir_ / "fmt" / "manifest.json", "{\"format\": ");
  r = verify("fmt");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(
      r.err.rfind(
          "attnoracle: error: " + (dir_ / "fmt" / "manifest.json").string() + ": invalid JSON", 0),
      0u)
      << r.err;
  fs::remove(dir_ / "fmt" / "manifest.json");
  r = verify("fmt");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("manifest.json: cannot open"), std::string::npos) << r.err;
}

TEST_F(VectorsCli, VerifyCatchesAnExtraFile) {
  copy_clean("extra");
  fs::copy_file(dir_ / "extra" / "cases" / "ties-000.safetensors",
                dir_ / "extra" / "cases" / "ties-001.safetensors");
  const CliResult r = verify("extra");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "cases/ties-001.safetensors: not listed in the manifest\n");
}

// One ULP in out.ref with the hash fixed: every stored invariant still holds (out is still its
// rounding), so only the re-evaluation sees it.
TEST_F(VectorsCli, OnlyRecomputeCatchesAOneUlpChange) {
  copy_clean("ulp");
  const fs::path p = dir_ / "ulp" / "cases" / "gens-000.safetensors";
  SafeTensorsFile f = read_safetensors(p);
  RawTensor* ref = f.find("out.ref");
  const double x = decode_float(DType::F64, ref->data.data());
  encode_float(DType::F64, std::nextafter(x, INFINITY), ref->data.data());
  const auto bytes = serialize_safetensors(f);
  write_text(p, std::string(bytes.begin(), bytes.end()));
  fix_hash("ulp", "gens-000");
  CliResult r = verify("ulp");
  EXPECT_EQ(r.status, 0) << r.out;
  r = verify("ulp", {"--recompute"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out.rfind("gens-000: out.ref: element 0 differs from the re-evaluation", 0), 0u)
      << r.out;

  // One ULP in `out` itself is no rounding of out.ref: the stored invariants catch it.
  copy_clean("ulp2");
  const fs::path q = dir_ / "ulp2" / "cases" / "gens-000.safetensors";
  SafeTensorsFile g = read_safetensors(q);
  RawTensor* out = g.find("out");
  const double y = decode_float(DType::F32, out->data.data());
  encode_float(DType::F32, std::nextafter(static_cast<float>(y), INFINITY), out->data.data());
  const auto bytes2 = serialize_safetensors(g);
  write_text(q, std::string(bytes2.begin(), bytes2.end()));
  fix_hash("ulp2", "gens-000");
  r = verify("ulp2");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("gens-000: out[0,0,0,0]: "), std::string::npos) << r.out;
}

TEST_F(VectorsCli, VerifyAllReportsEveryProblem) {
  copy_clean("all");
  fs::remove(dir_ / "all" / "cases" / "ties-000.safetensors");
  fs::remove(dir_ / "all" / "cases" / "gens-001.safetensors");
  write_text(dir_ / "all" / "cases" / "stray.txt", "x");
  CliResult r = verify("all");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "cases/stray.txt: not listed in the manifest\n");
  r = verify("all", {"--all", "--jobs", "2"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "cases/stray.txt: not listed in the manifest\n"
            "gens-001: missing file cases/gens-001.safetensors\n"
            "ties-000: missing file cases/ties-000.safetensors\n");
}

// A spec refusal: status 2, one line naming the spec file and the JSON path, nothing written.
void expect_spec_refused(const TempDir& dir, const std::string& spec, const std::string& where,
                         const std::string& what) {
  const fs::path path = dir / "bad.json";
  write_text(path, spec);
  const CliResult r = run_cli({"gen", path.string(), "-o", (dir / "out").string()});
  EXPECT_EQ(r.status, 2);
  const std::string prefix = "attnoracle: error: " + path.string() + ": " + where + ": ";
  EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << r.err;
  EXPECT_NE(r.err.find(what, prefix.size()), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

TEST_F(VectorsCli, SpecRefusals) {
  expect_spec_refused(dir_, "{\"suite\": \"s\", \"seed\": 1, \"families\": [}", "line 1, column 40",
                      "invalid JSON");
  expect_spec_refused(
      dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a", "generator": "gaussian"}]})",
      "families[0].generator", "unknown generator \"gaussian\"");
  expect_spec_refused(dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "normal", "cross": {"dtype": ["F32"], "casual": ["top_left"]}}]})",
                      "families[0].cross.casual", "unknown option");
  expect_spec_refused(dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "normal", "cross": {"dtype": ["F32", "FP16"]}}]})",
                      "families[0].cross.dtype[1]", "\"FP16\" is not one of F64, F32, F16, BF16");
  expect_spec_refused(dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "uniform", "fixed": {"dtype": "F16", "params": {"hi": 1e6}}}]})",
                      "families[0]", "case a-000: generator uniform draws values up to 1e+06, which overflow F16");
  expect_spec_refused(dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "normal", "fixed": {"bias": "fill", "bias_fill": "-1e400"}}]})",
                      "families[0].fixed.bias_fill",
                      "bias_fill \"-1e400\" is not -inf, -max or a negative finite number");
  expect_spec_refused(dir_, R"({"suite": "s", "seed": 1, "families": [{"name": "a",
      "generator": "normal", "fixed": {"kv_format": "fp4"}}]})",
                      "families[0].fixed.kv_format", "\"fp4\" is not one of none, F8_E4M3, F8_E5M2, I8, mxfp8, nvfp4");
}

// Stored K/V, V as a view of K and FP8 outputs through gen, then verify with --recompute: each
// case re-evaluated equals its golden tensors bit for bit.
TEST_F(VectorsCli, StoredKvCasesGenerateAndRecompute) {
  write_text(dir_ / "q.json", R"({"suite": "q", "seed": 2, "families": [
  {"name": "scaled", "generator": "normal", "cross": {"kv_format": ["F8_E4M3", "I8"], "kv_scale": ["head", "token"]},
   "fixed": {"dtype": "BF16", "shape": [2, 4, 2, 3, 32, 32, 32], "seqlens": "decode", "page_size": 8,
             "pages": "shared", "kv_scale_binades": 6, "outputs": "out,lse"}},
  {"name": "block", "generator": "normal", "cross": {"kv_format": ["mxfp8", "nvfp4"]},
   "fixed": {"shape": [1, 4, 1, 2, 16, 64, 32], "v_from_k": true, "kv_scale_binades": 3,
             "output_dtype": "F8_E4M3", "o_scale": "0x1p-6", "outputs": "out,amax"}}
]})");
  const CliResult g = run_cli({"gen", (dir_ / "q.json").string(), "-o", (dir_ / "q").string(), "--jobs", "2", "--quiet"});
  ASSERT_EQ(g.status, 0) << g.err;
  const CliResult v = verify("q", {"--recompute", "--jobs", "2"});
  EXPECT_EQ(v.status, 0) << v.out;
  EXPECT_NE(v.err.find("6 cases, 6 checked and recomputed, 0 problems"), std::string::npos) << v.err;
  const SafeTensorsFile f = read_safetensors(dir_ / "q/cases/block-001.safetensors");
  EXPECT_EQ(f.metadata.at("attn.kv_block_scale"), "nvfp4");
  EXPECT_EQ(f.find("v"), nullptr);
  EXPECT_EQ(f.find("amax")->dtype, DType::F32);
}

TEST_F(VectorsCli, UsageErrors) {
  CliResult r = gen("x", {"--shard", "2/2"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "attnoracle: error: --shard: \"2/2\" is not k/n with 0 <= k < n\n");
  r = run_cli({"gen", (dir_ / "none.json").string(), "-o", (dir_ / "x").string()});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err.rfind("attnoracle: error: " + (dir_ / "none.json").string() + ": cannot open", 0),
            0u)
      << r.err;
  r = run_cli({"gen", (dir_ / "tiny.json").string(), "-o", (dir_ / "no" / "such").string()});
  EXPECT_EQ(r.status, 2);
}

// gen --model: the model's magnitudes with the golden tensors of the sdpa cases (none for mha),
// verified, recomputed by --recompute, which catches one changed bit of them; a gen without
// --model into the same directory writes the files again without them.
TEST_F(VectorsCli, StoredModelIsVerifiedAndRecomputed) {
  CliResult r = gen("model", {"--model", "--jobs", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile f = read_safetensors(dir_ / "model" / "cases" / "gens-000.safetensors");
  for (const char* name : {"model.rows", "model.out", "model.p_bias"}) EXPECT_NE(f.find(name), nullptr) << name;
  EXPECT_EQ(read_safetensors(dir_ / "model" / "cases" / "mha-000.safetensors").find("model.rows"), nullptr);
  r = verify("model", {"--recompute"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;

  fs::copy(dir_ / "model", dir_ / "bit", fs::copy_options::recursive);
  const fs::path p = dir_ / "bit" / "cases" / "gens-000.safetensors";
  SafeTensorsFile g = read_safetensors(p);
  g.find("model.out")->data[0] ^= 1;
  const auto bytes = serialize_safetensors(g);
  write_text(p, std::string(bytes.begin(), bytes.end()));
  fix_hash("bit", "gens-000");
  r = verify("bit", {"--recompute"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out.rfind("gens-000: model.out: element 0 differs from the re-evaluation", 0), 0u) << r.out;

  // a stored model of the wrong shape: refused by the layout check, naming the tensor
  SafeTensorsFile h = read_safetensors(p);
  RawTensor* rows = h.find("model.rows");
  rows->shape.back() = 6;
  rows->shape.insert(rows->shape.end() - 1, 2);
  const auto bytes2 = serialize_safetensors(h);
  write_text(p, std::string(bytes2.begin(), bytes2.end()));
  fix_hash("bit", "gens-000");
  r = verify("bit");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "gens-000: model.rows: must be F64 of the shape the case gives it\n");

  r = gen("model", {"--jobs", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_safetensors(dir_ / "model" / "cases" / "gens-000.safetensors").find("model.rows"), nullptr);
  EXPECT_EQ(verify("model").status, 0);
}

TEST_F(VectorsCli, SecondGenIntoTheSameDirectoryIsRefusedWhileTheFirstRuns) {
  // A run in progress holds the directory (as gen does, with flock): an unsharded run, which
  // would remove the first run's temporary files and manifest, is refused and changes nothing.
  fs::create_directories(dir_ / "busy" / "cases");
  write_text(dir_ / "busy" / "cases" / "a-000.safetensors.tmp.AbCdEf", "in progress");
  const int fd = ::open((dir_ / "busy").c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_SH), 0);
  CliResult r = gen("busy");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "attnoracle: error: " + (dir_ / "busy").string() +
                       ": another attnoracle gen is writing into it\n");
  EXPECT_TRUE(fs::exists(dir_ / "busy" / "cases" / "a-000.safetensors.tmp.AbCdEf"));
  // Shards share the directory with each other.
  r = gen("busy", {"--shard", "0/2", "--quiet"});
  EXPECT_EQ(r.status, 0) << r.err;
  ::close(fd);
  r = gen("busy", {"--quiet"});  // alone again: it cleans up and completes the set
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "busy" / "cases" / "a-000.safetensors.tmp.AbCdEf"));
  EXPECT_TRUE(fs::exists(dir_ / "busy" / "manifest.json"));
}

TEST_F(VectorsCli, VerifyReadsNothingOutsideTheSet) {
  copy_clean("linked");
  const fs::path set = dir_ / "linked", outside = dir_ / "outside.json";
  fs::copy_file(set / "manifest.json", outside);
  // The manifest a link to a file outside: refused, exit 2, the outside file not read.
  fs::remove(set / "manifest.json");
  fs::create_symlink(outside, set / "manifest.json");
  CliResult r = verify("linked");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("manifest.json: leads outside"), std::string::npos) << r.err;
  // A manifest that is a directory, or a FIFO: refused at once.
  fs::remove(set / "manifest.json");
  fs::create_directory(set / "manifest.json");
  r = verify("linked");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("is a directory, not a regular file"), std::string::npos) << r.err;
  fs::remove(set / "manifest.json");
  ASSERT_EQ(::mkfifo((set / "manifest.json").c_str(), 0600), 0);
  r = verify("linked");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("is a FIFO, not a regular file"), std::string::npos) << r.err;
  fs::remove(set / "manifest.json");
  fs::copy_file(outside, set / "manifest.json");
  // A case file linked outside the set, and one that is a link loop: problems of the set.
  const fs::path a = set / "cases" / "ties-000.safetensors";
  fs::rename(a, dir_ / "ties-000.safetensors");
  fs::create_symlink(dir_ / "ties-000.safetensors", a);
  r = verify("linked", {"--all"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("leads outside"), std::string::npos) << r.out;
  fs::remove(a);
  fs::create_symlink(a, a);
  r = verify("linked", {"--all"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("ties-000: cases/ties-000.safetensors: cannot open"), std::string::npos) << r.out;
}

TEST_F(VectorsCli, OutputPathThroughAFileIsBadInput) {
  // -o under a regular file: one line, exit 2 (not an uncaught filesystem error).
  write_text(dir_ / "file", "x");
  const CliResult r = gen("file/sub");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err.rfind("attnoracle: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
}  // namespace attnoracle::testing
