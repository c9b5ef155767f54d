// End to end: `attnoracle eval BAD -o OUT` refuses bad case files with exit status 2, exactly one
// line on stderr naming the file and the tensor or key at fault, and no output file.

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli_run.hpp"

namespace attnoracle::testing {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;
using nlohmann::json;

RawTensor floats(const std::string& name, std::vector<std::int64_t> shape,
                 const std::function<double(std::size_t)>& value) {
  RawTensor t;
  t.name = name;
  t.dtype = DType::F32;
  t.shape = std::move(shape);
  const auto n = static_cast<std::size_t>(t.numel());
  t.data.resize(4 * n);
  for (std::size_t e = 0; e < n; ++e) encode_float(DType::F32, value(e), t.data.data() + 4 * e);
  return t;
}

double small(std::size_t e) { return 0.25 * static_cast<double>(e % 7) - 0.5; }

// A valid case: q [1,4,3,4], k [1,2,5,4], v [1,2,5,2] (data laid out k, q, v).
SafeTensorsFile valid_case() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}};
  f.put(floats("q", {1, 4, 3, 4}, small));
  f.put(floats("k", {1, 2, 5, 4}, small));
  f.put(floats("v", {1, 2, 5, 2}, small));
  return f;
}

Bytes bytes_of(const SafeTensorsFile& f) { return serialize_safetensors(f); }

// Rewrites the JSON header of a serialised file, keeping its data area.
Bytes edit_header(const Bytes& file, const std::function<void(json&)>& edit) {
  std::uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | file[static_cast<std::size_t>(b)];
  const auto data_start = file.begin() + 8 + static_cast<long>(n);
  json header = json::parse(file.begin() + 8, data_start);
  edit(header);
  const std::string text = header.dump();
  // One allocation, the header and data copied in: GCC 12 at -O3 reports a false
  // -Warray-bounds on insert after a vector of 8.
  Bytes out(8 + text.size() + static_cast<std::size_t>(file.end() - data_start));
  for (std::size_t b = 0; b < 8; ++b) out[b] = static_cast<unsigned char>(text.size() >> (8 * b));
  std::copy(data_start, file.end(), std::copy(text.begin(), text.end(), out.begin() + 8));
  return out;
}

RawTensor mask_of(std::vector<std::int64_t> shape, std::size_t from = 0, std::size_t to = 0) {
  RawTensor mask{"mask", DType::BOOL, std::move(shape), {}};
  mask.data.assign(static_cast<std::size_t>(mask.numel()), 1);
  for (std::size_t j = from; j < to; ++j) mask.data[j] = 0;
  return mask;
}

class EvalRefusal : public ::testing::Test {
 protected:
  void SetUp() override { fs::create_directory(dir_ / "work"); }

  static CliResult run(const std::vector<std::string>& args) { return run_cli(args); }

  // Runs eval on `bytes` and checks the refusal: status 2, one line naming file and field.
  void expect_refused(const Bytes& bytes, const std::string& field, const std::string& what) {
    const std::string in = dir_ / "work" / "bad.safetensors";
    const std::string out = dir_ / "work" / "out.safetensors";
    write_bytes(in, bytes);
    const CliResult r = run({"eval", in, "-o", out});
    EXPECT_EQ(r.status, 2) << r.err;
    const std::string prefix = "attnoracle: error: " + in + ": " + field + ": ";
    EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << r.err;
    EXPECT_NE(r.err.find(what, prefix.size()), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    EXPECT_FALSE(fs::exists(out));
    for (const auto& e : fs::directory_iterator(dir_ / "work"))
      EXPECT_EQ(e.path().filename().string(), "bad.safetensors") << "left behind: " << e.path();
  }

  TempDir dir_;
};

TEST_F(EvalRefusal, ValidCaseEvaluates) {
  // The baseline the refusals below start from; run into a non-existent directory, see below.
  const std::string in = dir_ / "ok.safetensors";
  const std::string out = dir_ / "ok.out.safetensors";
  write_bytes(in, bytes_of(valid_case()));
  const CliResult r = run({"eval", in, "-o", out});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(out));
}

TEST_F(EvalRefusal, BackwardCoreCasesPassTheGradientTwins) {
  // Causal of both alignments and a window, every kv head's slice given the twins: the oracle
  // passes and the golden file is the committed one, byte for byte.
  for (const char* id : {"bwd_causal-000", "bwd_causal-001", "bwd_window-000", "bwd_bias-000"}) {
    const fs::path in = fs::path(ATTNORACLE_SOURCE_DIR) / "vectors" / "core" / "cases" / (std::string(id) + ".safetensors");
    const std::string out = dir_ / (std::string(id) + ".out.safetensors");
    const CliResult r = run({"eval", in.string(), "-o", out, "--oracle-gradient-slices", "8", "-q"});
    EXPECT_EQ(r.status, 0) << id << ": " << r.err;
    EXPECT_TRUE(read_text(in) == read_text(out)) << id << ": the golden file differs from the committed one";
  }
}

TEST_F(EvalRefusal, SummaryGivesTheWholeTimeAndItsParts) {
  const std::string in = dir_ / "ok.safetensors";
  const std::string out = dir_ / "ok.out.safetensors";
  write_bytes(in, bytes_of(valid_case()));
  const CliResult r = run({"eval", in, "-o", out, "--threads", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::regex line(R"(; ([0-9.]+) s on 1 thread \(reading ([0-9.]+) s, evaluation ([0-9.]+) s, )"
                        R"(oracle ([0-9.]+) s, writing ([0-9.]+) s\)\n$)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, line)) << r.err;
  double parts = 0;
  for (int k = 2; k <= 5; ++k) parts += std::stod(m[k].str());
  // five figures each rounded to 1 ms: the parts' sum exceeds the whole by under 2.5 ms
  EXPECT_LE(parts, std::stod(m[1].str()) + 0.0025) << r.err;
}

TEST_F(EvalRefusal, OutputDirectoryMissing) {
  const std::string in = dir_ / "ok.safetensors";
  const std::string out = dir_ / "missing" / "out.safetensors";
  write_bytes(in, bytes_of(valid_case()));
  const CliResult r = run({"eval", in, "-o", out});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_EQ(r.err.rfind("attnoracle: error: " + out + ": ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
}

TEST_F(EvalRefusal, MissingInput) {
  const std::string in = dir_ / "none.safetensors";
  const CliResult r = run({"eval", in, "-o", dir_ / "out.safetensors"});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_EQ(r.err.rfind("attnoracle: error: " + in + ": cannot open", 0), 0u) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out.safetensors"));
}

TEST_F(EvalRefusal, TruncatedFile) {
  Bytes bytes = bytes_of(valid_case());
  bytes.resize(bytes.size() - 3);
  expect_refused(bytes, "v", "go beyond the data area");
  expect_refused(Bytes(bytes.begin(), bytes.begin() + 5), "header", "too short");
}

TEST_F(EvalRefusal, BadHeaderLength) {
  Bytes bytes = bytes_of(valid_case());
  bytes[0] = 0xff;
  bytes[1] = 0xff;
  expect_refused(bytes, "header", "exceeds the");
  bytes[6] = 0x01;
  expect_refused(bytes, "header", "is over the limit");
}

TEST_F(EvalRefusal, BadJson) {
  Bytes bytes = bytes_of(valid_case());
  bytes[9] = '\n';  // the opening quote of the first key
  expect_refused(bytes, "header", "invalid JSON");
}

TEST_F(EvalRefusal, UnknownDtype) {
  expect_refused(edit_header(bytes_of(valid_case()), [](json& h) { h["q"]["dtype"] = "F128"; }),
                 "q", "unknown dtype \"F128\"");
}

TEST_F(EvalRefusal, ShapeAgainstBytes) {
  expect_refused(edit_header(bytes_of(valid_case()),
                             [](json& h) {
                               h["q"]["shape"] = {1, 4, 3, 5};
                             }),
                 "q", "shape [1,4,3,5] needs 240 bytes but data_offsets cover 192");
}

TEST_F(EvalRefusal, OverlappingOffsets) {
  expect_refused(edit_header(bytes_of(valid_case()),
                             [](json& h) {
                               h["q"]["data_offsets"][0] = 152;  // k covers [0,160)
                               h["q"]["data_offsets"][1] = 344;
                             }),
                 "q", "data_offsets [152,344] overlap those of k [0,160]");
}

TEST_F(EvalRefusal, MissingQ) {
  SafeTensorsFile f = valid_case();
  std::erase_if(f.tensors, [](const RawTensor& t) { return t.name == "q"; });
  expect_refused(bytes_of(f), "q", "missing");
}

TEST_F(EvalRefusal, DkMismatch) {
  SafeTensorsFile f = valid_case();
  f.put(floats("k", {1, 2, 5, 3}, small));
  expect_refused(bytes_of(f), "k", "Dk is 3 but q has Dk 4");
}

TEST_F(EvalRefusal, HqNotMultipleOfHkv) {
  SafeTensorsFile f = valid_case();
  f.put(floats("k", {1, 3, 5, 4}, small));
  f.put(floats("v", {1, 3, 5, 2}, small));
  expect_refused(bytes_of(f), "k", "does not divide Hq 4");
}

TEST_F(EvalRefusal, MaskNotBroadcastable) {
  SafeTensorsFile f = valid_case();
  f.put(mask_of({3, 3, 5}));
  expect_refused(bytes_of(f), "mask", "does not broadcast");
}

// The valid case with q, k, v re-stored as F8_E4M3 (the same values) and an output dtype.
SafeTensorsFile fp8_case() {
  SafeTensorsFile f = valid_case();
  for (auto& t : f.tensors) {
    Bytes b(static_cast<std::size_t>(t.numel()));
    for (std::size_t e = 0; e < b.size(); ++e)
      encode_float(DType::F8_E4M3, decode_float(DType::F32, t.data.data() + 4 * e), b.data() + e);
    t.dtype = DType::F8_E4M3;
    t.data = b;
  }
  f.metadata["attn.output_dtype"] = "F16";
  return f;
}

TEST_F(EvalRefusal, Fp8) {
  const std::string in = dir_ / "fp8.safetensors";
  SafeTensorsFile ok = fp8_case();
  ok.put(floats("k_descale", {1, 2}, [](std::size_t e) { return e ? 0.25 : 3.0; }));
  write_bytes(in, bytes_of(ok));
  EXPECT_EQ(run({"eval", in, "-o", dir_ / "fp8.out.safetensors"}).status, 0);
  SafeTensorsFile f = fp8_case();
  f.metadata.erase("attn.output_dtype");
  expect_refused(bytes_of(f), "attn.output_dtype", "missing (required for F8_E4M3 inputs");
  f = valid_case();
  f.put(floats("q_descale", {1, 2}, small));
  expect_refused(bytes_of(f), "q_descale", "is for FP8 inputs only");
  f = fp8_case();
  f.put(floats("v_descale", {2, 1}, [](std::size_t) { return 1.0; }));
  expect_refused(bytes_of(f), "v_descale", "shape [2,1] is not [B,Hkv] = [1,2]");
  f = fp8_case();
  f.put(floats("v_descale", {1, 2}, [](std::size_t e) { return e ? -1.0 : 1.0; }));
  expect_refused(bytes_of(f), "v_descale", "element 1 is -1; descales must be > 0");
}

TEST_F(EvalRefusal, NaNInput) {
  SafeTensorsFile f = valid_case();
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return e == 13 ? std::nan("") : 1.0; }));
  expect_refused(bytes_of(f), "v", "element 13 is NaN");
}

TEST_F(EvalRefusal, MaskOfRankFive) {
  SafeTensorsFile f = valid_case();
  f.put(mask_of({1, 1, 1, 3, 5}));
  expect_refused(bytes_of(f), "mask", "shape [1,1,1,3,5] has rank 5, expected 0 to 4");
}

TEST_F(EvalRefusal, KeyPaddingMaskOfWrongLength) {
  SafeTensorsFile f = valid_case();
  f.put(mask_of({1, 1, 1, 4}));
  expect_refused(bytes_of(f), "mask", "dimension 3 is 4, must be 1 or Nk = 5");
}

TEST_F(EvalRefusal, NaNInAnAttendedKey) {
  // mask [B,1,1,Nk] leaves key 4 to every query; its v row holds NaN.
  SafeTensorsFile f = valid_case();
  f.put(mask_of({1, 1, 1, 5}, 0, 1));
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return e == 9 ? std::nan("") : 1.0; }));
  expect_refused(bytes_of(f), "v",
                 "element 9 is NaN, in key 4 of b=0, kv head 0, which query 0 of head 0 attends");
}

TEST_F(EvalRefusal, NaNInAQueryThatIsNotPadding) {
  SafeTensorsFile f = valid_case();
  f.put(floats("q", {1, 4, 3, 4}, [](std::size_t e) { return e == 5 ? INFINITY : 1.0; }));
  expect_refused(bytes_of(f), "q", "element 5 is +infinity, in query 1 of b=0, h=0, which is not padding");
}

TEST_F(EvalRefusal, InfinityInABiasThatIsNotPadding) {
  SafeTensorsFile f = valid_case();
  f.put(floats("bias", {5}, [](std::size_t e) { return e == 2 ? INFINITY : 0.0; }));
  expect_refused(bytes_of(f), "bias", "element 2 is +infinity, on query 0 of b=0, which is not padding");
}

TEST_F(EvalRefusal, NaNInAMaskedKeyEvaluates) {
  // The same NaN in a key the mask [B,1,1,Nk] removes: evaluated, and written back unchanged.
  SafeTensorsFile f = valid_case();
  f.put(mask_of({1, 1, 1, 5}, 4, 5));
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return e == 9 ? std::nan("") : 1.0; }));
  const std::string in = dir_ / "poisoned.safetensors";
  const std::string out = dir_ / "poisoned.out.safetensors";
  write_bytes(in, bytes_of(f));
  const CliResult r = run({"eval", in, "-o", out});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile g = read_safetensors(out);
  const RawTensor* v = g.find("v");
  ASSERT_NE(v, nullptr);
  EXPECT_TRUE(std::isnan(decode_float(DType::F32, v->data.data() + 9 * 4)));
  const RawTensor* o = g.find("out");
  ASSERT_NE(o, nullptr);
  for (std::size_t e = 0; e < static_cast<std::size_t>(o->numel()); ++e)
    EXPECT_EQ(decode_float(o->dtype, o->data.data() + e * 4), 1.0) << e;  // every v entry used is 1
}

TEST_F(EvalRefusal, InputsAreCopiedIntoTheOutputByteForByte) {
  // A NaN with its own payload in a masked key, far into v: the inputs are checked to encode
  // back to their bytes by chunks, and one that does not (the payload) keeps its bytes.
  const std::int64_t nk = 600;
  SafeTensorsFile f = valid_case();
  f.put(floats("k", {1, 2, nk, 4}, small));
  f.put(floats("v", {1, 2, nk, 2}, small));
  f.put(mask_of({1, 1, 1, nk}, 400, 401));
  const std::size_t poisoned = (1 * nk + 400) * 2;  // kv head 1, key 400, column 0
  const std::uint32_t payload = 0x7fc12345;
  std::memcpy(f.find("v")->data.data() + 4 * poisoned, &payload, 4);
  const std::string in = dir_ / "payload.safetensors";
  const std::string out = dir_ / "payload.out.safetensors";
  write_bytes(in, bytes_of(f));
  const CliResult r = run({"eval", in, "-o", out, "-q"});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile g = read_safetensors(out);
  for (const char* name : {"q", "k", "v", "mask"}) {
    const RawTensor* t = g.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_TRUE(t->data == f.find(name)->data) << name << " differs from the input's bytes";
  }
}

RawTensor lengths(const std::string& name, DType t, const std::vector<std::int64_t>& v) {
  RawTensor r{name, t, {static_cast<std::int64_t>(v.size())}, {}};
  for (std::int64_t x : v)
    for (std::size_t b = 0; b < dtype_size(t); ++b)
      r.data.push_back(static_cast<unsigned char>(static_cast<std::uint64_t>(x) >> (8 * b)));
  return r;
}

TEST_F(EvalRefusal, SeqlensOutOfRange) {
  SafeTensorsFile f = valid_case();
  f.put(lengths("seqlens_k", DType::I32, {6}));
  expect_refused(bytes_of(f), "seqlens_k", "element 0 is 6, more than Nk = 5");
  f = valid_case();
  f.put(lengths("seqlens_q", DType::I64, {-1}));
  expect_refused(bytes_of(f), "seqlens_q", "element 0 is -1; sequence lengths must be at least 0");
}

TEST_F(EvalRefusal, SeqlensOfWrongShapeOrDtype) {
  SafeTensorsFile f = valid_case();
  f.put(lengths("seqlens_q", DType::I32, {1, 1}));
  expect_refused(bytes_of(f), "seqlens_q", "shape [2] is not [B] = [1]");
  f = valid_case();
  f.put(floats("seqlens_k", {1}, [](std::size_t) { return 3.0; }));
  expect_refused(bytes_of(f), "seqlens_k", "dtype F32 is not I32 or I64");
}

TEST_F(EvalRefusal, NaNInAKeyBeforeSeqlensK) {
  // seqlens_k = 4: key 3 is used, its v row holding NaN is refused; key 4 may hold it.
  SafeTensorsFile f = valid_case();
  f.put(lengths("seqlens_k", DType::I32, {4}));
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return e == 7 ? std::nan("") : 1.0; }));
  expect_refused(bytes_of(f), "v",
                 "element 7 is NaN, in key 3 of b=0, kv head 0, which query 0 of head 0 attends");
  f.put(floats("v", {1, 2, 5, 2}, [](std::size_t e) { return e == 9 ? std::nan("") : 1.0; }));
  const std::string in = dir_ / "varlen.safetensors", out = dir_ / "varlen.out.safetensors";
  write_bytes(in, bytes_of(f));
  const CliResult r = run({"eval", in, "-o", out});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(out));
}

TEST_F(EvalRefusal, BadCausalValue) {
  SafeTensorsFile f = valid_case();
  f.metadata["attn.causal"] = "lower";
  expect_refused(bytes_of(f), "attn.causal", "\"lower\"");
}

TEST_F(EvalRefusal, UnknownAttnKey) {
  SafeTensorsFile f = valid_case();
  f.metadata["attn.casual"] = "top_left";
  expect_refused(bytes_of(f), "attn.casual", "unknown key");
}

TEST_F(EvalRefusal, FullyMaskedRow) {
  SafeTensorsFile f = valid_case();
  f.put(mask_of({3, 5}, 5, 10));  // row 1 masked
  expect_refused(bytes_of(f), "mask", "");
}

TEST_F(EvalRefusal, BadSinks) {
  SafeTensorsFile f = valid_case();
  f.put(floats("sinks", {4}, [](std::size_t e) { return e == 2 ? NAN : 0.5; }));
  expect_refused(bytes_of(f), "sinks", "element 2 is NaN");
  f.put(floats("sinks", {2}, small));
  expect_refused(bytes_of(f), "sinks", "shape [2] is not [Hq] = [4]");
  f.put(RawTensor{"sinks", DType::BOOL, {4}, Bytes(4, 1)});
  expect_refused(bytes_of(f), "sinks", "dtype BOOL is not F64, F32 or F32 (the input dtype)");
}

// A case with sinks and the scores output, end to end: eval writes scores and scores.ref, the
// oracle checks every row (a row with no allowed key but its sink is evaluated, not refused).
TEST_F(EvalRefusal, SinksAndScoresEvaluate) {
  SafeTensorsFile f = valid_case();
  f.metadata["attn.outputs"] = "out,weights,lse,scores";
  f.put(floats("sinks", {4}, [](std::size_t e) { return 0.5 * static_cast<double>(e) - 1; }));
  f.put(mask_of({3, 5}, 0, 5));  // query 0 attends no key
  const std::string in = dir_ / "sinks.safetensors";
  const std::string out = dir_ / "sinks.out.safetensors";
  write_bytes(in, bytes_of(f));
  const CliResult r = run({"eval", in, "-o", out});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile g = read_safetensors(out);
  const RawTensor* s = g.find("scores");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, (std::vector<std::int64_t>{1, 4, 3, 5}));
  EXPECT_EQ(decode_float(DType::F32, s->data.data()), -INFINITY);  // query 0, key 0: masked
  EXPECT_TRUE(std::isfinite(decode_float(DType::F32, s->data.data() + 4 * 5)));
  ASSERT_NE(g.find("scores.ref"), nullptr);
  const RawTensor* lse = g.find("lse.ref");
  ASSERT_NE(lse, nullptr);
  EXPECT_EQ(decode_float(DType::F64, lse->data.data() + 8 * 3), 0.5 - 1);  // head 1, query 0
  EXPECT_EQ(g.find("row.valid")->data, Bytes(12, 1));
}

// Gradients: a case asking for dq, dk, dv, dbias is evaluated and written with them.
TEST_F(EvalRefusal, GradientsEvaluate) {
  SafeTensorsFile f = valid_case();
  f.put(floats("dout", {1, 4, 3, 2}, small));
  f.put(floats("bias", {5}, small));
  f.metadata["attn.outputs"] = "out,dq,dk,dv,dbias";
  const std::string in = dir_ / "grad.safetensors";
  const std::string out = dir_ / "grad.out.safetensors";
  write_bytes(in, bytes_of(f));
  const CliResult r = run({"eval", in, "-o", out});
  ASSERT_EQ(r.status, 0) << r.err;
  const SafeTensorsFile g = read_safetensors(out);
  for (const char* name : {"dq", "dk", "dv", "dbias"})
    for (const std::string suffix : {"", ".ref", ".bound"}) {
      const RawTensor* t = g.find(name + suffix);
      ASSERT_NE(t, nullptr) << name << suffix;
      EXPECT_EQ(t->shape, f.find(name + 1)->shape) << name << suffix;  // q, k, v, bias
    }
  // Evaluated again from its own output: the same bytes.
  const std::string again = dir_ / "grad.again.safetensors";
  ASSERT_EQ(run({"eval", out, "-o", again}).status, 0);
  EXPECT_EQ(read_text(out), read_text(again));
}

TEST_F(EvalRefusal, GradientWithoutDout) {
  SafeTensorsFile f = valid_case();
  f.metadata["attn.outputs"] = "out,dk";
  expect_refused(bytes_of(f), "dout", "required when attn.outputs asks for a gradient: dk");
}

TEST_F(EvalRefusal, DoutOfTheWrongShape) {
  SafeTensorsFile f = valid_case();
  f.put(floats("dout", {1, 4, 3, 4}, small));
  f.metadata["attn.outputs"] = "dq";
  expect_refused(bytes_of(f), "dout", "is not the shape of out [B,Hq,Nq,Dv] = [1,4,3,2]");
}

TEST_F(EvalRefusal, NaNInDout) {
  SafeTensorsFile f = valid_case();
  f.put(floats("dout", {1, 4, 3, 2}, [](std::size_t e) { return e == 5 ? std::nan("") : 1.0; }));
  f.metadata["attn.outputs"] = "dv";
  expect_refused(bytes_of(f), "dout", "element 5 is NaN, in query 2 of b=0, h=0, which is not padding");
}

TEST_F(EvalRefusal, DbiasWithoutBias) {
  SafeTensorsFile f = valid_case();
  f.put(floats("dout", {1, 4, 3, 2}, small));
  f.metadata["attn.outputs"] = "dbias";
  expect_refused(bytes_of(f), "attn.outputs", "dbias is asked but the case has no bias tensor");
}

// Split-KV partial states and kind merge (CONTRACT section 8).
TEST_F(EvalRefusal, SplitKv) {
  SafeTensorsFile f = valid_case();
  f.metadata["attn.outputs"] = "out,out_partial";
  expect_refused(bytes_of(f), "attn.outputs", "asks for out_partial but attn.kv_split_size is missing");
  f.metadata["attn.kv_split_size"] = "0";
  expect_refused(bytes_of(f), "attn.kv_split_size", "value \"0\" is not an integer >= 1");
  f.metadata["attn.kv_split_size"] = "2.5";
  expect_refused(bytes_of(f), "attn.kv_split_size", "value \"2.5\" is not an integer >= 1");
  f.metadata["attn.kv_split_size"] = "2";
  f.put(floats("dout", {1, 4, 3, 2}, small));
  f.metadata["attn.outputs"] = "lse_partial,dq";
  expect_refused(bytes_of(f), "attn.outputs", "partial states have no gradients");
}

SafeTensorsFile merge_case() {  // S=2, B=1, H=2, Nq=1, Dv=2
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.kind", "merge"}};
  f.put(floats("o_partial", {2, 1, 2, 1, 2}, small));
  f.put(floats("lse_partial", {2, 1, 2, 1}, small));
  return f;
}

TEST_F(EvalRefusal, Merge) {
  SafeTensorsFile f = merge_case();
  f.put(floats("lse_partial", {2, 1, 2, 1}, [](std::size_t e) { return e == 3 ? INFINITY : 0.5; }));
  expect_refused(bytes_of(f), "lse_partial", "element 3 is +infinity (only -infinity is allowed");
  f.put(floats("lse_partial", {2, 1, 2, 1}, [](std::size_t e) { return e == 1 ? std::nan("") : 0.5; }));
  f.metadata["attn.lse_posinf"] = "empty";
  expect_refused(bytes_of(f), "lse_partial", "element 1 is NaN");
  f = merge_case();
  f.put(floats("o_partial", {2, 1, 2, 1, 2}, [](std::size_t e) { return e == 6 ? std::nan("") : 1.0; }));
  expect_refused(bytes_of(f), "o_partial", "element 6 is NaN, in a split whose lse_partial (element 3) is not -infinity");
  f = merge_case();  // row h=1 of b=0, i=0: every split -inf, policy error
  f.put(floats("lse_partial", {2, 1, 2, 1}, [](std::size_t e) { return e % 2 ? -INFINITY : 0.5; }));
  expect_refused(bytes_of(f), "lse_partial", "fully masked row at b=0, h=1, i=0");
  f = merge_case();
  f.put(floats("q", {1, 1, 1, 1}, small));
  expect_refused(bytes_of(f), "q", "unknown tensor (expected o_partial, lse_partial, and optionally sinks");
  f = merge_case();
  f.metadata["attn.causal"] = "top_left";
  expect_refused(bytes_of(f), "attn.causal", "is not an option of attn.kind merge");
  f = merge_case();
  f.metadata["attn.outputs"] = "out,weights";
  expect_refused(bytes_of(f), "attn.outputs", "asks for weights, which kind merge does not have");
  f = merge_case();
  f.put(floats("lse_partial", {2, 1, 2, 2}, small));
  expect_refused(bytes_of(f), "lse_partial", "is not [S,B,H,Nq] (from o_partial) = [2,1,2,1]");
}

}  // namespace
}  // namespace attnoracle::testing
