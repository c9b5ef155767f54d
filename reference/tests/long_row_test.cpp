// Long rows with one column (Dk = Dv = 1): the fast path's P V and bound sums over thousands
// of keys. Their balls must hold the precise values (MPFR at 256 bits), and rows whose sum
// cancels far below the sum of magnitudes must still be decided by the fast path.
#include <gtest/gtest.h>
#include <mpfr.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"
#include "fast/decide.hpp"
#include "fast/fast_row.hpp"

namespace attnoracle::testing {
namespace {

// Normal numbers rounded to F32 (xorshift and Box-Muller: the same on every platform).
class Normals {
 public:
  explicit Normals(std::uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double next() {
    const double u1 = (static_cast<double>(bits() >> 11) + 1) * 0x1p-53, u2 = static_cast<double>(bits() >> 11) * 0x1p-53;
    return static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  std::uint64_t bits() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  std::uint64_t s_;
};

enum class Values { Normal, Positive, CancellingPairs, NearlyCancellingPairs };

// B = Hq = Hkv = 1, Dk = Dv = 1, F32 inputs and output. CancellingPairs: keys in equal pairs
// with opposite values, one of them moved by one F32 ulp, so that sum e_j v_j is about 2^-24
// of sum e_j |v_j| / Nk; NearlyCancellingPairs: every pair's values differ by 2^-20 relative
// (either way), so that sum e_j v_j is about 2^-20 sqrt(2 / Nk) of sum e_j |v_j|.
Case long_row_case(std::int64_t nq, std::int64_t nk, Values kind, std::uint64_t seed, const std::string& outputs) {
  Normals g(seed);
  std::vector<double> q(static_cast<std::size_t>(nq)), k(static_cast<std::size_t>(nk)), v(k.size());
  for (double& x : q) x = g.next();
  for (std::size_t j = 0; j < k.size(); ++j) {
    const bool pairs = kind == Values::CancellingPairs || kind == Values::NearlyCancellingPairs;
    const bool second = pairs && j % 2 == 1;
    k[j] = second ? k[j - 1] : g.next();
    v[j] = second ? -v[j - 1] : g.next();
    if (second && kind == Values::NearlyCancellingPairs)
      v[j] = static_cast<float>(v[j] * (1 + (g.next() < 0 ? -0x1p-20 : 0x1p-20)));
    if (kind == Values::Positive) v[j] = std::fabs(v[j]);
  }
  if (kind == Values::CancellingPairs) v[1] = std::nextafter(static_cast<float>(v[1]), 0.0f);
  auto tensor = [](const std::string& name, std::int64_t n, const std::vector<double>& x) {
    RawTensor r{name, DType::F32, {1, 1, n, 1}, {}};
    r.data.resize(x.size() * 4);
    for (std::size_t i = 0; i < x.size(); ++i) encode_float(DType::F32, x[i], r.data.data() + i * 4);
    return r;
  };
  SafeTensorsFile f;
  f.metadata = {{"attn.kind", "sdpa"}, {"attn.causal", "none"}, {"attn.window", "none"},
                {"attn.softcap", "0"}, {"attn.output_dtype", "F32"}, {"attn.outputs", outputs},
                {"attn.masked_rows", "error"}};
  f.metadata["attn.format"] = std::string("1");
  f.put(tensor("q", nq, q));
  f.put(tensor("k", nk, k));
  f.put(tensor("v", nk, v));
  return case_from_file("long_row.safetensors", f);
}

// lo <= precise.lo and precise.hi <= hi, the double-double ends exact at 256 bits.
bool inside(const Enclosure& precise, fast::DD l, fast::DD u) {
  mpfr_t lo, hi;
  mpfr_inits2(256, lo, hi, static_cast<mpfr_ptr>(nullptr));
  mpfr_set_d(lo, l.hi, MPFR_RNDN);
  mpfr_add_d(lo, lo, l.lo, MPFR_RNDN);
  mpfr_set_d(hi, u.hi, MPFR_RNDN);
  mpfr_add_d(hi, hi, u.lo, MPFR_RNDN);
  const bool ok = mpfr_lessequal_p(lo, precise.lo) && mpfr_lessequal_p(precise.hi, hi);
  mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr));
  return ok;
}

TEST(LongRow, BallsHoldThePreciseValues) {
  for (std::int64_t nk : {2048, 16384})
    for (Values kind : {Values::Normal, Values::Positive, Values::CancellingPairs, Values::NearlyCancellingPairs}) {
      const Case c = long_row_case(3, nk, kind, static_cast<std::uint64_t>(nk) + static_cast<std::uint64_t>(kind), "out,lse");
      const fast::Setup s = fast::prepare(c);
      ASSERT_TRUE(s.applies) << s.why_not;
      const RowEvaluator ev(c);
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const fast::FastRow fr = fast::fast_row(c, s, 0, 0, i);
        ASSERT_TRUE(fr.ok) << "Nk " << nk << ", row " << i;
        const RowEnclosures pr = ev.row(0, 0, i, 256);
        EXPECT_TRUE(inside(pr.heads[0].raw_out[0], fast::lower(fr.out[0]), fast::upper(fr.out[0])))
            << "out, Nk " << nk << ", values " << static_cast<int>(kind) << ", row " << i;
        fast::DD lo, hi;
        fast::ends(fr.bound[0], lo, hi, fr.absmin[0], fr.absmax[0]);
        EXPECT_TRUE(inside(pr.bound[0], lo, hi)) << "out.bound, Nk " << nk << ", row " << i;
        const Enclosure lse = fast::lse_enclosure(fr);
        EXPECT_TRUE(mpfr_lessequal_p(lse.lo, pr.lse[0].lo) && mpfr_lessequal_p(pr.lse[0].hi, lse.hi))
            << "lse, Nk " << nk << ", row " << i;
      }
    }
}

// Such rows fell back to MPFR when the P V radius was the a-priori 3 n^2 u^2 sum |e v|: 2^-72.4
// of that sum at 16384 keys, above F64's half ulp of out (out is about 2^-27 of it here).
TEST(LongRow, CancellingRowsStayOnTheFastPathWithTheSameBytes) {
  const Case c = long_row_case(8, 16384, Values::NearlyCancellingPairs, 7, "out,lse");
  EvalOptions on, off;
  on.threads = off.threads = 2;
  off.fast_path = false;
  const EvalResult a = evaluate(c, on), z = evaluate(c, off);
  EXPECT_EQ(a.stats.rows_fast, 8u);
  EXPECT_EQ(a.stats.rows_fallback, 0u);
  EXPECT_EQ(a.stats.undecided, 0u);
  ASSERT_EQ(a.golden.size(), z.golden.size());
  for (std::size_t t = 0; t < a.golden.size(); ++t) {
    EXPECT_EQ(a.golden[t].name, z.golden[t].name);
    EXPECT_EQ(a.golden[t].data, z.golden[t].data) << a.golden[t].name;
  }
}

}  // namespace
}  // namespace attnoracle::testing
