// A dtype per output (attn.output_dtypes): worked by hand, and the same bytes as evaluating the
// whole case in that dtype.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"
#include "random_case.hpp"

namespace attnoracle::testing {
namespace {

SafeTensorsFile file_of(std::vector<RawTensor> tensors, std::map<std::string, std::string> md) {
  SafeTensorsFile f;
  f.metadata = std::move(md);
  f.metadata["attn.format"] = std::string("1");
  for (auto& t : tensors) f.put(std::move(t));
  return f;
}

const RawTensor& find(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}
const RawTensor* find_or_null(const EvalResult& r, const std::string& name) {
  for (const auto& t : r.golden)
    if (t.name == name) return &t;
  return nullptr;
}
double at(const EvalResult& r, const std::string& name, std::size_t i) {
  const RawTensor& t = find(r, name);
  return decode_float(t.dtype, t.data.data() + i * dtype_size(t.dtype));
}

EvalResult eval(const SafeTensorsFile& f) { return evaluate(case_from_file("test.safetensors", f), EvalOptions{}); }

// Rounding lse.ref (F64) once more into F32 gives the F32 rounding of the exact value unless
// lse.ref is an F32 midpoint (the only place where a double rounding can differ).
bool f32_of_ref_is_safe(double ref) {
  const float f = static_cast<float>(ref);
  const double down = std::nextafter(f, -INFINITY), up = std::nextafter(f, INFINITY);
  return ref != (static_cast<double>(f) + down) / 2 && ref != (static_cast<double>(f) + up) / 2;
}

// BF16 inputs and out (FlashAttention's outputs), lse in F32: scores 1.5 and -0.5 (scale 1),
// lse = 1.5 + log(1 + e^-2).
TEST(OutputDtypes, Bf16OutF32LseByHand) {
  const SafeTensorsFile f = file_of({float_tensor("q", DType::BF16, {1, 1, 1, 1}, {0.5}),
                                     float_tensor("k", DType::BF16, {1, 1, 2, 1}, {3, -1}),
                                     float_tensor("v", DType::BF16, {1, 1, 2, 1}, {1, 0})},
                                    {{"attn.outputs", "out,weights,lse"},
                                     {"attn.scale", "1"},
                                     {"attn.output_dtypes", "lse:F32"}});
  const Case c = case_from_file("test.safetensors", f);
  EXPECT_EQ(c.dtype_of("out"), DType::BF16);
  EXPECT_EQ(c.dtype_of("weights"), DType::BF16);
  EXPECT_EQ(c.dtype_of("lse"), DType::F32);
  const EvalResult r = evaluate(c, EvalOptions{});
  EXPECT_EQ(find(r, "out").dtype, DType::BF16);
  EXPECT_EQ(find(r, "weights").dtype, DType::BF16);
  EXPECT_EQ(find(r, "lse").dtype, DType::F32);
  EXPECT_EQ(find(r, "lse.ref").dtype, DType::F64);
  EXPECT_EQ(find(r, "out.ref").dtype, DType::F64);
  EXPECT_EQ(find(r, "out.bound").dtype, DType::F64);
  const double lse = 1.5 + std::log1p(std::exp(-2.0));  // within an F64 ulp or two
  const double ref = at(r, "lse.ref", 0);
  EXPECT_NEAR(ref, lse, 1e-15);
  ASSERT_TRUE(f32_of_ref_is_safe(ref));
  EXPECT_EQ(at(r, "lse", 0), static_cast<double>(static_cast<float>(ref)));
  EXPECT_NE(at(r, "lse", 0), round_double(ref, DType::BF16));  // F32, not BF16's rounding
  // out = weight of key 0 = 1 / (1 + e^-2) in BF16, as without the key
  EXPECT_EQ(at(r, "out", 0), round_double(at(r, "out.ref", 0), DType::BF16));
  EXPECT_EQ(r.stats.undecided, 0u);
}

// A gradient in its own dtype: dq in F32 of a BF16 case, the others BF16.
TEST(OutputDtypes, GradientInItsOwnDtype) {
  const SafeTensorsFile f = file_of({float_tensor("q", DType::BF16, {1, 1, 1, 1}, {0.5}),
                                     float_tensor("k", DType::BF16, {1, 1, 2, 1}, {3, -1}),
                                     float_tensor("v", DType::BF16, {1, 1, 2, 1}, {1, 0}),
                                     float_tensor("dout", DType::BF16, {1, 1, 1, 1}, {1})},
                                    {{"attn.outputs", "out,dq,dk"}, {"attn.output_dtypes", "dq:F32"}});
  const EvalResult r = eval(f);
  EXPECT_EQ(find(r, "dq").dtype, DType::F32);
  EXPECT_EQ(find(r, "dk").dtype, DType::BF16);
  EXPECT_EQ(at(r, "dq", 0), static_cast<double>(static_cast<float>(at(r, "dq.ref", 0))));
}

// Without the key, nothing changes: an empty override list.
TEST(OutputDtypes, AbsentKeyIsTheOutputDtype) {
  const Case c = case_from_file("test.safetensors",
                                file_of({float_tensor("q", DType::F16, {1, 1, 1, 1}, {0.5}),
                                         float_tensor("k", DType::F16, {1, 1, 1, 1}, {3}),
                                         float_tensor("v", DType::F16, {1, 1, 1, 1}, {1})},
                                        {{"attn.outputs", "out,lse"}}));
  EXPECT_TRUE(c.output_dtypes.empty());
  for (const char* n : {"out", "lse", "weights", "dq"}) EXPECT_EQ(c.dtype_of(n), DType::F16);
}

// The names of attn.outputs, out first.
std::vector<std::string> outputs_of(const SafeTensorsFile& f) {
  std::vector<std::string> names = {"out"};
  const auto it = f.metadata.find("attn.outputs");
  if (it == f.metadata.end()) return names;
  std::string rest = it->second + ",";
  for (std::size_t comma; (comma = rest.find(',')) != std::string::npos; rest.erase(0, comma + 1))
    if (rest.substr(0, comma) != "out") names.push_back(rest.substr(0, comma));
  return names;
}

// Each output given its own dtype holds the bytes (and undecided elements) that the whole case
// evaluated in that dtype gives it; the .ref, .bound and row.valid tensors do not change.
RC_GTEST_PROP(OutputDtypes, SameBytesAsTheWholeCaseInThatDtype, ()) {
  RandomCaseOptions opt;
  opt.large_fraction = 0;
  opt.allow_refusal = false;
  opt.scores_fraction = 0.3;
  const auto seed = *rc::gen::inRange<std::uint64_t>(0, 1u << 30);
  SafeTensorsFile f = random_case(seed, opt);
  const Case plain = case_from_file("test.safetensors", f);
  std::string spec;
  std::map<std::string, DType> own;
  for (const std::string& name : outputs_of(f)) {
    if (!*rc::gen::arbitrary<bool>()) continue;
    const DType t = *rc::gen::element(DType::F64, DType::F32, DType::F16, DType::BF16);
    own[name] = t;
    spec += (spec.empty() ? "" : ",") + name + ":" + std::string(dtype_name(t));
  }
  RC_PRE(!own.empty());
  f.metadata["attn.output_dtypes"] = spec;
  const EvalResult mixed = eval(f);
  const EvalResult base = evaluate(plain, EvalOptions{});
  for (const RawTensor& t : mixed.golden) {
    const std::string name = t.name.substr(0, t.name.find('.'));
    const bool rounded = t.name == name || t.name == name + ".undecided" || t.name == name + ".alt";
    if (!own.count(name) || !rounded) {  // as without the key
      if (t.name == "out.ref_lo") continue;  // present only for F64 out
      const RawTensor* b = find_or_null(base, t.name);
      RC_ASSERT(b != nullptr);
      RC_ASSERT(b->data == t.data);
      continue;
    }
    SafeTensorsFile whole = f;
    whole.metadata.erase("attn.output_dtypes");
    whole.metadata["attn.output_dtype"] = std::string(dtype_name(own[name]));
    const EvalResult w = eval(whole);
    const RawTensor* b = find_or_null(w, t.name);
    RC_ASSERT(b != nullptr);
    RC_ASSERT(b->dtype == t.dtype);
    RC_ASSERT(b->data == t.data);
  }
}

void expect_refused(const std::map<std::string, std::string>& md, const std::string& what) {
  const SafeTensorsFile f = file_of({float_tensor("q", DType::F32, {1, 1, 1, 2}, {1, 2}),
                                     float_tensor("k", DType::F32, {1, 1, 1, 2}, {1, 2}),
                                     float_tensor("v", DType::F32, {1, 1, 1, 2}, {1, 2})},
                                    md);
  try {
    case_from_file("case.safetensors", f);
    ADD_FAILURE() << "accepted: " << what;
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "attn.output_dtypes");
    EXPECT_NE(e.message().find(what), std::string::npos) << e.message();
  }
}

TEST(OutputDtypes, Refusals) {
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse:F32,foo:F32"}},
                 "gives a dtype to \"foo\", which is not an output attn.outputs asks for");
  expect_refused({{"attn.outputs", "out"}, {"attn.output_dtypes", "lse:F32"}},
                 "gives a dtype to \"lse\", which is not an output attn.outputs asks for");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse:F8_E4M3"}},
                 "with DTYPE F64, F32, F16 or BF16 (\"F8_E4M3\"?)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse:f32"}}, "(\"f32\"?)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse:F32,lse:F16"}},
                 "a list without repeats (\"lse\" twice)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse"}},
                 "a comma list of name:DTYPE, e.g. lse:F32 (\"lse\"?)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", ""}}, "(\"\"?)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", "lse:F32,"}}, "(\"\"?)");
  expect_refused({{"attn.outputs", "out,lse"}, {"attn.output_dtypes", " lse:F32"}}, "\" lse\"");
}

TEST(OutputDtypes, OutNeedsNoListing) {
  const Case c = case_from_file("test.safetensors",
                                file_of({float_tensor("q", DType::F32, {1, 1, 1, 1}, {1}),
                                         float_tensor("k", DType::F32, {1, 1, 1, 1}, {1}),
                                         float_tensor("v", DType::F32, {1, 1, 1, 1}, {1})},
                                        {{"attn.outputs", "lse"}, {"attn.output_dtypes", "out:BF16,lse:F64"}}));
  EXPECT_EQ(c.dtype_of("out"), DType::BF16);
  EXPECT_EQ(c.dtype_of("lse"), DType::F64);
}

TEST(OutputDtypes, Fp8InputsRefuseF64) {
  std::map<std::string, std::string> md = {{"attn.output_dtype", "F32"},
                                           {"attn.outputs", "out,lse"},
                                           {"attn.output_dtypes", "lse:F64"}};
  const SafeTensorsFile f = file_of({float_tensor("q", DType::F8_E4M3, {1, 1, 1, 1}, {1}),
                                     float_tensor("k", DType::F8_E4M3, {1, 1, 1, 1}, {1}),
                                     float_tensor("v", DType::F8_E4M3, {1, 1, 1, 1}, {1})},
                                    md);
  try {
    case_from_file("case.safetensors", f);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "attn.output_dtypes");
    EXPECT_NE(e.message().find("gives lse dtype F64, which is not F32, F16 or BF16"), std::string::npos) << e.message();
  }
}

// One input dtype: a float64 q with a float32 k is bad input, naming k.
TEST(OutputDtypes, OneInputDtype) {
  const SafeTensorsFile f = file_of({float_tensor("q", DType::F64, {1, 1, 1, 1}, {1}),
                                     float_tensor("k", DType::F32, {1, 1, 1, 1}, {1}),
                                     float_tensor("v", DType::F64, {1, 1, 1, 1}, {1})},
                                    {});
  try {
    case_from_file("case.safetensors", f);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.message(), "case.safetensors: k: dtype F32 differs from q's F64");
  }
}

}  // namespace
}  // namespace attnoracle::testing
