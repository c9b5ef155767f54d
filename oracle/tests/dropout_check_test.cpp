// dropout: the oracle ties a dropout case's rows to its twin without dropout, and convex_hull
// bounds a dropout row by its kept values and 0; each catches a deliberately broken twin or row.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::oracle {
namespace {

using Shape = std::vector<std::int64_t>;

RawTensor f32(const std::string& name, Shape shape, const std::function<double(std::size_t)>& value) {
  RawTensor r{name, DType::F32, std::move(shape), {}};
  r.data.resize(4 * static_cast<std::size_t>(r.numel()));
  for (std::size_t e = 0; e < r.data.size() / 4; ++e) encode_float(DType::F32, static_cast<float>(value(e)), r.data.data() + 4 * e);
  return r;
}
double small(std::size_t e) { return 0.25 * static_cast<double>(e % 7) - 0.5; }

// q [1,2,3,4], k [1,1,5,4], v [1,1,5,3]; a full keep mask dropping about one key in three.
Case dropout_case(const std::string& p) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.dropout_p", p}, {"attn.outputs", "out,weights,lse,dq,dk,dv"}};
  f.put(f32("q", {1, 2, 3, 4}, small));
  f.put(f32("k", {1, 1, 5, 4}, [](std::size_t e) { return small(e + 3); }));
  f.put(f32("v", {1, 1, 5, 3}, [](std::size_t e) { return small(2 * e + 1) * 4; }));
  f.put(f32("dout", {1, 2, 3, 3}, [](std::size_t e) { return small(e + 5); }));
  RawTensor keep{"dropout_mask", DType::BOOL, {1, 2, 3, 5}, {}};
  for (std::size_t e = 0; e < 30; ++e) keep.data.push_back(e % 3 != 1);
  f.put(std::move(keep));
  return case_from_file("dropout.safetensors", std::move(f));
}

bool has(const std::vector<Violation>& v, Invariant inv) {
  return std::any_of(v.begin(), v.end(), [&](const Violation& x) { return x.invariant == inv; });
}

TEST(DropoutCheck, CorrectCasePassesEveryCheck) {
  for (const char* p : {"0", "0.1", "0x1.8p-1"}) {
    const Case c = dropout_case(p);
    const Case plain = without_dropout(c);
    ASSERT_FALSE(plain.dropout);
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) EXPECT_TRUE(check_dropout(c, plain, 0, h, i, 128).empty()) << p;
    EXPECT_TRUE(check_case(c, reference_rows()).empty()) << p;
    CheckOptions co;
    co.twin_units = 6;
    const EvalResult r = certified_evaluate(c, EvalOptions{}, co);  // throws on a violation
    EXPECT_FALSE(r.golden.empty());
  }
}

TEST(DropoutCheck, TwinWithOtherKeptValuesOrScoresIsCaught) {
  const Case c = dropout_case("0.25");
  Case v = without_dropout(c);
  v.v.values[6] += 0.5;  // key 2's value, kept in row (0, 0, 0)
  const auto ov = check_dropout(c, v, 0, 0, 0, 128);
  ASSERT_TRUE(has(ov, Invariant::Dropout));
  EXPECT_NE(ov[0].message().find("kept part of A V"), std::string::npos) << ov[0].message();
  Case s = without_dropout(c);
  s.k.values[4] += 0.25;  // key 1's score, and so every weight of the row
  const auto os = check_dropout(c, s, 0, 0, 0, 128);
  ASSERT_TRUE(has(os, Invariant::Dropout));
  EXPECT_TRUE(std::any_of(os.begin(), os.end(), [](const Violation& x) { return x.j >= 0; }));
  // Key 1 is dropped in row (0, 0, 0): its value takes no part there, and in row (0, 0, 1), which keeps
  // it, it does.
  Case d = without_dropout(c);
  d.v.values[3] += 0.5;
  EXPECT_TRUE(check_dropout(c, d, 0, 0, 0, 128).empty());
  EXPECT_TRUE(has(check_dropout(c, d, 0, 0, 1, 128), Invariant::Dropout));
}

TEST(DropoutCheck, OutputOutsideTheKeptValuesIsCaught) {
  const Case c = dropout_case("0.5");
  RowEnclosures r = RowEvaluator(c).row(0, 0, 0, 128);
  EXPECT_TRUE(check_row(c, 0, 0, 0, r).empty());
  // Row (0, 0, 0) keeps keys 0, 2, 3: column 0 of their values and 0 span [-1, 4]; -1.5 lies
  // within the range of every allowed key's value, [-2, 4], but not of the kept ones.
  Enclosure& raw = r.heads[0].raw_out[0];
  mpfr_set_d(raw.lo, -1.5, MPFR_RNDN);
  mpfr_set_d(raw.hi, -1.5, MPFR_RNDN);
  EXPECT_TRUE(has(check_row(c, 0, 0, 0, r), Invariant::ConvexHull));
}

}  // namespace
}  // namespace attnoracle::oracle
