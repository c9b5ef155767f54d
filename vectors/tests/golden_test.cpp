// The checks verify makes on stored golden data: clean on reference output, and each one
// catches its own kind of damage.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "attnoracle/vectors/verify.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::vectors;

struct Evaluated {
  Case c;
  SafeTensorsFile f;
};

Evaluated evaluated(ProblemSpec p) {
  Evaluated e;
  e.c = case_from_file("t", make_problem(p, 3));
  e.f = golden_file(e.c, oracle::certified_evaluate(e.c, EvalOptions{}, oracle::CheckOptions{}));
  return e;
}

ProblemSpec spec(DType t, MaskKind mask = MaskKind::FullyMaskedRows) {
  ProblemSpec p;
  p.dtype = t;
  p.B = 2, p.Hq = 2, p.Hkv = 1, p.Nq = 5, p.Nk = 7, p.Dk = 4, p.Dv = 3;
  p.mask = mask;
  p.masked_rows = MaskedRows::Zero;
  p.want_weights = p.want_lse = true;
  return p;
}

void set(SafeTensorsFile& f, const std::string& name, std::size_t e, double v) {
  RawTensor* t = f.find(name);
  encode_float(t->dtype, v, t->data.data() + e * dtype_size(t->dtype));
}
double get(const SafeTensorsFile& f, const std::string& name, std::size_t e) {
  const RawTensor* t = f.find(name);
  return decode_float(t->dtype, t->data.data() + e * dtype_size(t->dtype));
}

std::string problem(const Evaluated& e, const std::function<void(SafeTensorsFile&)>& edit) {
  SafeTensorsFile f = e.f;
  edit(f);
  if (auto p = golden_layout_problem(e.c, f)) return *p;
  if (auto p = golden_invariant_problem(e.c, f)) return *p;
  return "";
}

// A flat index of `name` in an invalid (fully masked) row, or in a valid one.
std::size_t row_where(const SafeTensorsFile& f, bool valid) {
  const RawTensor* rv = f.find("row.valid");
  for (std::size_t r = 0; r < rv->data.size(); ++r)
    if ((rv->data[r] != 0) == valid) return r;
  ADD_FAILURE() << "no such row";
  return 0;
}

TEST(VectorsGoldenChecks, ReferenceOutputIsClean) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F64})
    for (MaskKind m : {MaskKind::FullyMaskedRows, MaskKind::Random}) {
      const Evaluated e = evaluated(spec(t, m));
      EXPECT_EQ(problem(e, [](SafeTensorsFile&) {}), "") << dtype_name(t);
    }
  ProblemSpec p = spec(DType::F32);
  p.kind = Kind::Mha;
  p.Hkv = p.Hq;
  p.D = 6;
  p.Dout = 4;
  EXPECT_EQ(problem(evaluated(p), [](SafeTensorsFile&) {}), "");
}

TEST(VectorsGoldenChecks, EachDamageIsCaught) {
  const Evaluated e = evaluated(spec(DType::F32));
  const std::size_t bad_row = row_where(e.f, false), good_row = row_where(e.f, true);
  const std::size_t Nk = 7, Dv = 3;
  auto expect = [&](const std::function<void(SafeTensorsFile&)>& edit, const std::string& want) {
    const std::string p = problem(e, edit);
    EXPECT_NE(p.find(want), std::string::npos) << "got: " << p << "\nwanted: " << want;
  };
  expect([&](SafeTensorsFile& f) { set(f, "weights.ref", bad_row * Nk, 0.5); },
         "for a key that is not allowed");
  expect(
      [&](SafeTensorsFile& f) {
        set(f, "weights.ref", good_row * Nk, get(f, "weights.ref", good_row * Nk) * 1.5);
        set(f, "weights", good_row * Nk, get(f, "weights", good_row * Nk) * 1.5);
      },
      "allowed weights sum to");
  expect([&](SafeTensorsFile& f) { set(f, "weights.ref", good_row * Nk + 1, -0.25); },
         "not within [0, 1]");
  expect([&](SafeTensorsFile& f) { f.find("row.valid")->data[bad_row] = 1; }, "row.valid[");
  expect([&](SafeTensorsFile& f) { set(f, "lse.ref", bad_row, 0.0); }, "on a fully masked row");
  expect(
      [&](SafeTensorsFile& f) {
        set(f, "out.ref", good_row * Dv, 1e3);
        set(f, "out", good_row * Dv, 1e3);
        set(f, "out.bound", good_row * Dv, 1e4);
      },
      "of the allowed values");
  expect([&](SafeTensorsFile& f) { set(f, "out.bound", good_row * Dv, 0.0); }, "exceeds out.bound");
  expect(
      [&](SafeTensorsFile& f) {
        const double x = get(f, "out", good_row * Dv);
        set(f, "out", good_row * Dv, std::nextafter(static_cast<float>(x), 1e30f));
      },
      "is not a rounding of out.ref");
  expect([&](SafeTensorsFile& f) { set(f, "out", bad_row * Dv, 0.5); }, "out[");
  expect(
      [&](SafeTensorsFile& f) {
        std::erase_if(f.tensors, [](const RawTensor& t) { return t.name == "lse"; });
      },
      "lse: missing");
  expect(
      [&](SafeTensorsFile& f) {
        f.put(RawTensor{"out.ref_lo", DType::F64, {1}, std::vector<unsigned char>(8)});
      },
      "out.ref_lo: present but the case does not call for it");
  // a string moved in: GCC 12 at -O3 reports a false -Wrestrict on assigning "2" (GCC bug 105329)
  expect([&](SafeTensorsFile& f) { f.metadata["attn.undecided"] = std::string("2"); }, "attn.undecided");
  expect([&](SafeTensorsFile& f) { f.find("out")->dtype = DType::F16; }, "out: F16");
}

// With sinks: clean on reference output (rows with only their sink among them), and the sum of
// weights, the lse of a sink-only row and masked scores are checked.
TEST(VectorsGoldenChecks, Sinks) {
  ProblemSpec p = spec(DType::F32);
  p.sinks = "near";
  p.masked_rows = MaskedRows::Error;
  p.want_scores = true;
  const Evaluated e = evaluated(p);
  EXPECT_EQ(problem(e, [](SafeTensorsFile&) {}), "");
  // the row masked by fully_masked_rows: valid, with only its sink
  std::size_t sink_row = 0;
  const RawTensor* rv = e.f.find("row.valid");
  for (std::size_t r = 0; r < rv->data.size(); ++r)
    if (get(e.f, "lse.ref", r) == e.c.sink(static_cast<std::int64_t>(r / 5 % 2))) sink_row = r;
  const std::size_t Nk = 7;
  EXPECT_NE(problem(e, [&](SafeTensorsFile& f) { set(f, "lse.ref", sink_row, 0.125); }).find(
                "on a row with only its sink"),
            std::string::npos);
  std::size_t row = 0;  // a row with keys
  while (get(e.f, "lse.ref", row) == e.c.sink(static_cast<std::int64_t>(row / 5 % 2))) ++row;
  std::size_t j = 0;  // the row's largest weight
  for (std::size_t k = 1; k < Nk; ++k)
    if (get(e.f, "weights.ref", row * Nk + k) > get(e.f, "weights.ref", row * Nk + j)) j = k;
  EXPECT_NE(problem(e, [&](SafeTensorsFile& f) {
              set(f, "weights.ref", row * Nk + j, get(f, "weights.ref", row * Nk + j) * 1.25);
              set(f, "weights", row * Nk + j, get(f, "weights", row * Nk + j) * 1.25);
            }).find("1 minus the sink's weight"),
            std::string::npos);
  EXPECT_NE(problem(e, [&](SafeTensorsFile& f) { set(f, "scores.ref", sink_row * Nk, 1.0); })
                .find("for a key that is not allowed, not -inf"),
            std::string::npos);
}

// An FP8 out is O / o_scale rounded: clean as evaluated (with saturated elements), and an
// element moved by one E4M3 step, or left undivided, is caught.
TEST(VectorsGolden, Fp8OutIsTheRoundingOfOOverOScale) {
  ProblemSpec p = spec(DType::F32, MaskKind::None);
  p.want_weights = false;
  p.output_dtype = DType::F8_E4M3;
  p.o_scale = "0x1p-11";  // |O| up to about 1: past 448 after the division, saturated
  const Evaluated e = evaluated(p);
  EXPECT_EQ(problem(e, [](SafeTensorsFile&) {}), "");
  int saturated = 0;
  for (std::size_t k = 0; k < 30; ++k) saturated += std::fabs(get(e.f, "out", k)) == 448;
  EXPECT_GT(saturated, 0);
  std::size_t k = 0;  // an element below saturation, one step up is still in range
  while (std::fabs(get(e.f, "out", k)) >= 224) ++k;
  int exp = 0;
  const double x = get(e.f, "out", k);
  std::frexp(x, &exp);  // |x| = m 2^exp, 1/2 <= m < 1: E4M3's step there is 2^(exp - 4), 2^-9 at least
  const double up = x + std::ldexp(1.0, std::max(exp - 4, -9));
  EXPECT_NE(problem(e, [&](SafeTensorsFile& f) { set(f, "out", k, up); }).find("is not a rounding of out.ref"),
            std::string::npos);
  EXPECT_NE(problem(e, [&](SafeTensorsFile& f) { set(f, "out", k, round_double(get(f, "out.ref", k), DType::F8_E4M3)); }),
            "");
}

}  // namespace
}  // namespace attnoracle::testing
