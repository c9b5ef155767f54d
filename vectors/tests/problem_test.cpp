// The PRNG, the data generators, masks and biases of make_problem: determinism, exactness, and
// the property each generator is there for.
#include "attnoracle/vectors/problem.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <tuple>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "int_tensor.hpp"
#include "numbers.hpp"
#include "prng.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::vectors;

constexpr DType kDtypes[] = {DType::F32, DType::F16, DType::BF16, DType::F64};

ProblemSpec sdpa(std::string generator, DType t, std::int64_t B = 1, std::int64_t Hq = 2,
                 std::int64_t Hkv = 2, std::int64_t Nq = 8, std::int64_t Nk = 16,
                 std::int64_t Dk = 8, std::int64_t Dv = 8) {
  ProblemSpec p;
  p.generator = std::move(generator);
  p.dtype = t;
  p.B = B, p.Hq = Hq, p.Hkv = Hkv, p.Nq = Nq, p.Nk = Nk, p.Dk = Dk, p.Dv = Dv;
  return p;
}

ProblemSpec mha(std::string generator, DType t) {
  ProblemSpec p = sdpa(std::move(generator), t, 2, 2, 2, 6, 8, 4, 4);
  p.kind = Kind::Mha;
  p.D = 8;
  p.Dout = 6;
  return p;
}

Case make_case(const ProblemSpec& p, std::uint64_t seed = 42) {
  return case_from_file("test", make_problem(p, seed));
}

// Scaled scores in double: close enough to judge the sizes a generator aims at.
double score(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  const std::int64_t g = c.kv_head(h);
  double s = 0;
  for (std::int64_t d = 0; d < c.Dk; ++d)
    s += c.q.values[static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * c.Dk + d)] *
         c.k.values[static_cast<std::size_t>(((b * c.Hkv + g) * c.Nk + j) * c.Dk + d)];
  return s / std::sqrt(static_cast<double>(c.Dk));
}

std::vector<double> key_row(const Case& c, std::int64_t g, std::int64_t j) {
  const auto* p = c.k.values.data() + (g * c.Nk + j) * c.Dk;
  return {p, p + c.Dk};
}

TEST(VectorsPrng, SplitMix64MatchesTheReferenceSequence) {
  std::uint64_t s = 0;  // Vigna's splitmix64.c from state 0
  EXPECT_EQ(splitmix64(s), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(splitmix64(s), 0x6e789e6aa1b965f4ULL);
  EXPECT_EQ(splitmix64(s), 0x06c45d188009454fULL);
}

TEST(VectorsPrng, SameSeedSameStreamAndPinnedValues) {
  Rng a(123), b(123), c(124);
  std::vector<std::uint64_t> xa, xb, xc;
  for (int k = 0; k < 100; ++k)
    xa.push_back(a.next()), xb.push_back(b.next()), xc.push_back(c.next());
  EXPECT_EQ(xa, xb);
  EXPECT_NE(xa, xc);
  // Pinned: a change here changes every generated suite.
  Rng r(1);
  EXPECT_EQ(r.next(), 0xb3f2af6d0fc710c5ULL);
  EXPECT_EQ(r.uniform(), 0x1.0a76ab2c8e6c9p-1);
}

TEST(VectorsPrng, DistributionsStayInRange) {
  Rng r(7);
  double sum = 0, sq = 0;
  const int n = 20000;
  for (int k = 0; k < n; ++k) {
    const double u = r.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    const double x = r.normal();
    ASSERT_LE(std::fabs(x), 6.0);
    sum += x;
    sq += x * x;
    ASSERT_LT(r.below(7), 7u);
  }
  EXPECT_NEAR(sum / n, 0.0, 0.05);
  EXPECT_NEAR(sq / n, 1.0, 0.05);
}

TEST(VectorsNumbers, RoundIntoAndUlps) {
  EXPECT_EQ(round_into(1.0 + 0x1p-30, DType::F32), 1.0);
  EXPECT_EQ(round_into(1.0 + 0x1p-11, DType::F16), 1.0);  // tie to even
  EXPECT_EQ(round_into(0x1p-30, DType::F16), 0.0);
  EXPECT_THROW(round_into(1e6, DType::F16), std::invalid_argument);
  EXPECT_EQ(away_ulp(1.0, DType::F16), 1.0 + 0x1p-10);
  EXPECT_EQ(away_ulp(-1.0, DType::BF16), -1.0 - 0x1p-7);
  EXPECT_EQ(away_ulp(0x1p-24, DType::F16), 0x1p-23);  // subnormal spacing
  EXPECT_EQ(limits(DType::F32).min_sub_exp, -149);
  EXPECT_EQ(limits(DType::F16).min_normal_exp, -14);
  EXPECT_EQ(limits(DType::BF16).max_exp, 128);
}

TEST(VectorsMakeProblem, DeterministicAndSeedSensitive) {
  for (const auto& g : generators())
    for (DType t : kDtypes) {
      const ProblemSpec p = sdpa(std::string(g.name), t);
      const auto a = serialize_safetensors(make_problem(p, 5));
      EXPECT_EQ(a, serialize_safetensors(make_problem(p, 5))) << g.name;
      EXPECT_NE(a, serialize_safetensors(make_problem(p, 6))) << g.name;
    }
}

TEST(VectorsMakeProblem, EveryGeneratorGivesValidFiniteCasesInEveryDtype) {
  for (const auto& g : generators())
    for (DType t : kDtypes)
      for (const ProblemSpec& p : {sdpa(std::string(g.name), t), mha(std::string(g.name), t)}) {
        const Case c = make_case(p);  // the reference's reader: finite, shapes, metadata
        EXPECT_EQ(c.input_dtype, t);
        EXPECT_EQ(c.file.metadata.at("gen.generator"), g.name);
        for (const FloatTensor* x :
             {&c.q, &c.k, &c.v, &c.x_q, &c.x_kv, &c.w_q, &c.w_k, &c.w_v, &c.w_o})
          for (double v : x->values) ASSERT_TRUE(std::isfinite(v)) << g.name;
      }
}

// FP8: every generator builds a valid case in both formats; descales are F32 [B, Hkv], distinct
// within each tensor and none 1; the refusals of the FP8 options.
TEST(VectorsMakeProblem, Fp8InputsAndDescales) {
  for (const auto& g : generators())
    for (DType t : {DType::F8_E4M3, DType::F8_E5M2}) {
      ProblemSpec p = sdpa(std::string(g.name), t, 2, 4, 2);
      p.output_dtype = DType::BF16;
      p.descales = true;
      const SafeTensorsFile f = make_problem(p, 7);
      const Case c = case_from_file("test", f);
      EXPECT_EQ(c.input_dtype, t);
      for (const char* name : {"q_descale", "k_descale", "v_descale"}) {
        const RawTensor* d = f.find(name);
        ASSERT_NE(d, nullptr);
        EXPECT_EQ(d->shape, (std::vector<std::int64_t>{2, 2}));
        std::vector<double> v;
        for (std::size_t e = 0; e < 4; ++e) v.push_back(decode_float(DType::F32, d->data.data() + 4 * e));
        std::sort(v.begin(), v.end());
        EXPECT_EQ(std::adjacent_find(v.begin(), v.end()), v.end()) << name;
        EXPECT_EQ(std::count(v.begin(), v.end(), 1.0), 0) << name;
      }
    }
  ProblemSpec p = sdpa("wide_range", DType::F8_E4M3, 2, 4, 2, 8, 32);
  p.output_dtype = DType::F32;
  const Case c = make_case(p);
  double top = 0;
  for (double x : c.v.values) top = std::max(top, std::fabs(x));
  EXPECT_EQ(top, 448.0);  // E4M3's largest value reached (saturated)
  p.output_dtype.reset();
  EXPECT_EQ(problem_error(p), "FP8 dtypes need output_dtype F32, F16 or BF16");
  p.output_dtype = DType::F64;
  EXPECT_EQ(problem_error(p), "FP8 dtypes need output_dtype F32, F16 or BF16");
  ProblemSpec q = sdpa("normal", DType::F32);
  q.descales = true;
  EXPECT_EQ(problem_error(q), "descales need an FP8 dtype");
  ProblemSpec m = mha("normal", DType::F8_E5M2);
  m.output_dtype = DType::F32;
  EXPECT_EQ(problem_error(m), "FP8 dtypes need kind sdpa");
}

TEST(VectorsMakeProblem, IndependentStreams) {
  // The mask's draws do not move the data.
  ProblemSpec a = sdpa("normal", DType::F32), b = a;
  b.mask = MaskKind::Random;
  b.query_mask = true;
  EXPECT_EQ(make_case(a).q.values, make_case(b).q.values);
  EXPECT_EQ(make_case(a).v.values, make_case(b).v.values);
}

TEST(VectorsGenerators, UniformWithinBounds) {
  const Case c = make_case(sdpa("uniform", DType::F32));
  for (double x : c.q.values) {
    EXPECT_GE(x, -1.0);
    EXPECT_LT(x, 1.0);
  }
}

TEST(VectorsGenerators, LargeScoresPassTheExpOverflowThresholds) {
  // exp overflows past 88.7 in F32 and 11.1 in F16; rows are near +offset or -offset.
  for (DType t : kDtypes) {
    ProblemSpec p = sdpa("large_scores", t);
    p.params["offset"] = 100;
    const Case c = make_case(p);
    int positive = 0, negative = 0;
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        const double s = score(c, 0, h, i, 0);
        EXPECT_GT(std::fabs(s), 88.7) << dtype_name(t);
        EXPECT_LT(std::fabs(s), 130.0) << dtype_name(t);
        (s > 0 ? positive : negative)++;
      }
    EXPECT_GT(positive, 0);
    EXPECT_GT(negative, 0);
  }
  ProblemSpec p = sdpa("large_scores", DType::F16);
  p.params["offset"] = 10000;
  const Case c = make_case(p);
  EXPECT_GT(std::fabs(score(c, 0, 0, 0, 0)), 9000.0);
}

TEST(VectorsGenerators, TiesRepeatKeyRowsExactly) {
  for (DType t : kDtypes) {
    const Case c = make_case(sdpa("ties", t));
    std::set<std::vector<double>> rows;
    for (std::int64_t j = 0; j < c.Nk; ++j) rows.insert(key_row(c, 0, j));
    EXPECT_LE(rows.size(), 4u);  // a pool of Nk/4 rows
    ProblemSpec one = sdpa("ties", t);
    one.params["distinct"] = 1;
    const Case d = make_case(one);
    for (std::int64_t j = 1; j < d.Nk; ++j) EXPECT_EQ(key_row(d, 1, j), key_row(d, 1, 0));
  }
}

TEST(VectorsGenerators, NearTiesDifferInOneLastBit) {
  for (DType t : kDtypes) {
    const Case c = make_case(sdpa("near_ties", t));
    const auto base = key_row(c, 0, 0);
    for (std::int64_t j = 1; j < c.Nk; ++j) {
      const auto row = key_row(c, 0, j);
      int differing = 0;
      for (std::size_t d = 0; d < row.size(); ++d)
        if (row[d] != base[d]) {
          ++differing;
          EXPECT_EQ(row[d], away_ulp(base[d] == 0 ? round_into(0.5, t) : base[d], t));
        }
      EXPECT_EQ(differing, 1);
    }
  }
}

TEST(VectorsGenerators, DominantPutsOtherWeightsInTheSubnormalRange) {
  for (DType t : {DType::F32, DType::F16, DType::F64}) {
    const Case c = make_case(sdpa("dominant", t));
    const Limits l = limits(t);
    int subnormal = 0;
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      std::vector<double> s(static_cast<std::size_t>(c.Nk));
      for (std::int64_t j = 0; j < c.Nk; ++j) s[static_cast<std::size_t>(j)] = score(c, 0, 0, i, j);
      const double top = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double x : s) z += std::exp(x - top);
      EXPECT_LE(z, t == DType::F16 ? 1.05 : 1.0 + 1e-9);  // one weight near 1
      for (double x : s) {
        const double w = std::exp(x - top);  // the others, relative to the dominant one
        if (w < std::ldexp(1.0, l.min_normal_exp) && w > std::ldexp(1.0, l.min_sub_exp))
          ++subnormal;
      }
    }
    EXPECT_GT(subnormal, 0) << dtype_name(t);
  }
}

TEST(VectorsGenerators, CancelPairsOppositeValues) {
  const Case c = make_case(sdpa("cancel", DType::F32));
  for (std::int64_t j = 0; j + 1 < c.Nk; j += 2)
    for (std::int64_t d = 0; d < c.Dv; ++d)
      EXPECT_EQ(c.v.values[static_cast<std::size_t>((j + 1) * c.Dv + d)],
                -c.v.values[static_cast<std::size_t>(j * c.Dv + d)]);
}

TEST(VectorsGenerators, WideRangeSpreadsExponents) {
  for (DType t : kDtypes) {
    const Case c = make_case(sdpa("wide_range", t, 1, 2, 2, 8, 64, 8, 16));
    int lo = 100000, hi = -100000;
    for (double x : c.v.values) {
      lo = std::min(lo, std::ilogb(x));
      hi = std::max(hi, std::ilogb(x));
    }
    const Limits l = limits(t);
    EXPECT_GT(hi - lo, (l.max_exp - l.min_normal_exp) * 3 / 4) << dtype_name(t);
    EXPECT_LT(hi, l.max_exp - 1);
  }
}

TEST(VectorsGenerators, SubnormalValues) {
  for (DType t : kDtypes) {
    const Case c = make_case(sdpa("subnormal", t));
    const double min_normal = std::ldexp(1.0, limits(t).min_normal_exp);
    for (double x : c.v.values) {
      EXPECT_NE(x, 0.0);
      EXPECT_LT(std::fabs(x), min_normal) << dtype_name(t);
    }
    int sub = 0;
    for (double x : c.q.values) sub += std::fabs(x) < min_normal;
    EXPECT_GT(sub, 0);
  }
}

std::int64_t allowed_keys(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i) {
  std::int64_t n = 0;
  for (std::int64_t j = 0; j < c.Nk; ++j)
    n += c.position_allowed(b, i, j) && c.mask_at(b, h, i, j) && c.bias_at(b, h, i, j) != -INFINITY;
  return n;
}

TEST(VectorsMasks, KeyPaddingTrailingKeysPerBatch) {
  ProblemSpec p = sdpa("normal", DType::F32, 4, 2, 2, 5, 9);
  p.mask = MaskKind::KeyPadding;
  const Case c = make_case(p);
  EXPECT_EQ(c.mask->shape, (std::vector<std::int64_t>{4, 1, 5, 9}));
  for (std::int64_t b = 0; b < c.B; ++b) {
    bool seen_masked = false;
    for (std::int64_t j = 0; j < c.Nk; ++j) {
      const bool m = c.mask_at(b, 0, 0, j);
      if (!m) seen_masked = true;
      EXPECT_FALSE(seen_masked && m) << "padding is trailing";
      for (std::int64_t i = 1; i < c.Nq; ++i) EXPECT_EQ(c.mask_at(b, 1, i, j), m);
    }
    EXPECT_TRUE(c.mask_at(b, 0, 0, 0));
  }
}

TEST(VectorsMasks, SingleKeyAllowsExactlyOneKeyPerRow) {
  for (Causal causal : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
    ProblemSpec p = sdpa("normal", DType::F32, 2, 2, 1, 6, 9);
    p.mask = MaskKind::SingleKey;
    p.causal = causal;
    const Case c = make_case(p);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) EXPECT_EQ(allowed_keys(c, b, h, i), 1);
  }
}

TEST(VectorsMasks, FullyMaskedRowsAndRefusal) {
  ProblemSpec p = sdpa("normal", DType::F32, 2, 2, 2, 6, 8);
  p.mask = MaskKind::FullyMaskedRows;
  const Case c = make_case(p);
  EXPECT_TRUE(has_fully_masked_row(c));
  EXPECT_TRUE(c.first_refused_row().has_value());
  p.masked_rows = MaskedRows::Zero;
  EXPECT_FALSE(make_case(p).first_refused_row().has_value());
  // Random masks and random biases empty no row by themselves.
  ProblemSpec r = sdpa("normal", DType::F32, 2, 2, 2, 6, 8);
  r.mask = MaskKind::Random;
  r.bias = BiasKind::Random;
  r.causal = Causal::TopLeft;
  for (std::uint64_t seed = 0; seed < 20; ++seed)
    EXPECT_FALSE(has_fully_masked_row(make_case(r, seed)));
}

TEST(VectorsMasks, CausalMaskIsBottomRightAndRankTwo) {
  ProblemSpec p = sdpa("normal", DType::F32, 1, 1, 1, 4, 6);
  p.mask = MaskKind::CausalMask;
  const Case c = make_case(p);
  EXPECT_EQ(c.mask->shape, (std::vector<std::int64_t>{4, 6}));
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 6; ++j) EXPECT_EQ(c.mask_at(0, 0, i, j), j <= i + 2);
}

TEST(VectorsMasks, BroadcastMasksAndBiases) {
  // key_padding_broadcast: [B,1,1,Nk], trailing keys off per batch, key 0 always on.
  ProblemSpec p = sdpa("normal", DType::F32, 3, 4, 2, 5, 7);
  p.mask = MaskKind::KeyPaddingBroadcast;
  p.bias = BiasKind::PerKey;
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    const Case c = make_case(p, seed);
    EXPECT_EQ(c.mask->shape, (std::vector<std::int64_t>{3, 1, 1, 7}));
    EXPECT_EQ(c.bias->shape, (std::vector<std::int64_t>{3, 1, 1, 7}));
    for (std::int64_t b = 0; b < 3; ++b) {
      EXPECT_TRUE(c.mask_at(b, 0, 0, 0));
      for (std::int64_t j = 0; j < 7; ++j)  // the same for every head and query
        EXPECT_EQ(c.mask_at(b, 3, 4, j), c.mask_at(b, 0, 0, j));
      for (std::int64_t j = 1; j < 7; ++j)  // off keys are trailing
        if (!c.mask_at(b, 0, 0, j - 1)) {
          EXPECT_FALSE(c.mask_at(b, 0, 0, j));
        }
    }
    EXPECT_FALSE(has_fully_masked_row(c));
  }
  // key_vector [Nk] with a scalar bias []: under causal, one key open to every query.
  ProblemSpec v = sdpa("normal", DType::F16, 2, 2, 2, 4, 6);
  v.mask = MaskKind::KeyVector;
  v.bias = BiasKind::Scalar;
  v.causal = Causal::BottomRight;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    const Case c = make_case(v, seed);
    EXPECT_EQ(c.mask->shape, (std::vector<std::int64_t>{6}));
    EXPECT_TRUE(c.bias->shape.empty());
    EXPECT_FALSE(has_fully_masked_row(c));
  }
}

// tail_block: every key before the last 64-key block open; in that block, per row, one key the
// position rules allow open and one masked at least (where two are allowed), so that a kernel
// skipping the mask in its last key block, or dropping the block, moves the row.
TEST(VectorsMasks, TailBlockMasksPartOfTheLastKeyBlock) {
  for (std::int64_t nk : {5, 64, 65, 129, 192, 320})
    for (Causal causal : {Causal::None, Causal::BottomRight}) {
      ProblemSpec p = sdpa("normal", DType::BF16, 2, 4, 2, 7, nk);
      p.mask = MaskKind::TailBlock;
      p.causal = causal;
      const Case c = make_case(p, static_cast<std::uint64_t>(nk));
      ASSERT_EQ(c.mask->shape, (std::vector<std::int64_t>{2, 4, 7, nk}));
      if (causal == Causal::None || nk >= c.Nq) {  // else causal empties the leading rows
        EXPECT_FALSE(has_fully_masked_row(c)) << nk;
      }
      const std::int64_t tail = (nk - 1) / 64 * 64;
      EXPECT_EQ(tail, nk <= 64 ? 0 : nk <= 128 ? 64 : nk <= 192 ? 128 : 256);
      int distinct_rows = 0;
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            int open = 0, masked = 0, allowed = 0;
            for (std::int64_t j = 0; j < nk; ++j) {
              if (j < tail) {
                EXPECT_TRUE(c.mask_at(b, h, i, j)) << nk << " key " << j;
                continue;
              }
              if (!c.position_allowed(b, i, j)) continue;
              ++allowed;
              (c.mask_at(b, h, i, j) ? open : masked) += 1;
            }
            if (allowed >= 1) {
              EXPECT_GE(open, 1) << nk << " row " << i;
            }
            if (allowed >= 2) {
              EXPECT_GE(masked, 1) << nk << " row " << i;
            }
            bool differs = false;  // from the row of batch 0, head 0
            for (std::int64_t j = tail; j < nk; ++j) differs = differs || c.mask_at(b, h, i, j) != c.mask_at(0, 0, i, j);
            distinct_rows += differs;
          }
      EXPECT_GE(distinct_rows, nk - tail > 4 ? 20 : 0) << nk;  // drawn per batch and head
    }
}

// Refilling the unused positions with NaN and infinities changes no golden value of a row that
// is not padding (the metamorphic relation of poisoned positions), in the reference itself.
TEST(VectorsPoison, UnusedPositionsChangeNothing) {
  std::size_t poisoned_elements = 0;
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (MaskKind m : {MaskKind::KeyPaddingBroadcast, MaskKind::KeyPadding})
      for (Causal causal : {Causal::None, Causal::TopLeft}) {
        ProblemSpec p = sdpa("normal", t, 2, 4, 2, 5, 9);
        p.mask = m;
        p.causal = causal;
        p.query_mask = true;
        p.masked_rows = MaskedRows::Zero;
        p.want_weights = p.want_lse = true;
        const Case clean = make_case(p, 7);
        p.poison = true;
        const SafeTensorsFile dirty_file = make_problem(p, 7);
        for (const char* name : {"q", "k", "v"}) {
          const RawTensor* x = dirty_file.find(name);
          for (std::size_t e = 0; e < static_cast<std::size_t>(x->numel()); ++e)
            poisoned_elements += !std::isfinite(decode_float(t, x->data.data() + e * dtype_size(t)));
        }
        const Case dirty = case_from_file("poisoned", dirty_file);
        const EvalResult a = evaluate(clean, {}), b = evaluate(dirty, {});
        for (const char* name : {"out", "out.ref", "weights", "lse.ref", "row.valid"}) {
          const auto find = [&](const EvalResult& r) {
            return *std::find_if(r.golden.begin(), r.golden.end(),
                                 [&](const RawTensor& g) { return g.name == name; });
          };
          const RawTensor ga = find(a), gb = find(b);
          const std::size_t rows = static_cast<std::size_t>(clean.B * clean.Hq * clean.Nq);
          const std::size_t per_row = ga.data.size() / rows;  // bytes of one (b, h, i) row
          for (std::size_t r = 0; r < rows; ++r) {
            const std::int64_t bb = static_cast<std::int64_t>(r) / (clean.Hq * clean.Nq);
            const std::int64_t i = static_cast<std::int64_t>(r) % clean.Nq;
            if (!clean.query_valid(bb, i)) continue;
            EXPECT_TRUE(std::equal(ga.data.begin() + static_cast<std::ptrdiff_t>(r * per_row),
                                   ga.data.begin() + static_cast<std::ptrdiff_t>((r + 1) * per_row),
                                   gb.data.begin() + static_cast<std::ptrdiff_t>(r * per_row)))
                << name << " row " << r << " " << dtype_name(t) << " " << mask_kind_name(m);
          }
        }
      }
  EXPECT_GT(poisoned_elements, 500u);
}

std::vector<std::int64_t> lengths_of(const SafeTensorsFile& f, const char* name) {
  const RawTensor* t = f.find(name);
  std::vector<std::int64_t> l;
  if (!t) return l;
  for (std::size_t e = 0; e < static_cast<std::size_t>(t->numel()); ++e) {
    std::int64_t x = 0;
    if (t->dtype == DType::I32) {
      std::int32_t y;
      std::memcpy(&y, t->data.data() + 4 * e, 4);
      x = y;
    } else {
      std::memcpy(&x, t->data.data() + 8 * e, 8);
    }
    l.push_back(x);
  }
  return l;
}

TEST(VectorsSeqlens, EachKindOfLengths) {
  for (SeqlensKind kind : {SeqlensKind::Varlen, SeqlensKind::Decode, SeqlensKind::Chunked, SeqlensKind::Keys}) {
    ProblemSpec p = sdpa("normal", DType::F32, 5, 2, 2, 6, 24);
    p.seqlens = kind;
    p.causal = Causal::BottomRight;
    p.seqlens_dtype = kind == SeqlensKind::Keys ? DType::I64 : DType::I32;
    const SafeTensorsFile f = make_problem(p, 3);
    const Case c = case_from_file("varlen", f);  // valid: lengths within [0, N]
    const auto lq = lengths_of(f, "seqlens_q"), lk = lengths_of(f, "seqlens_k");
    ASSERT_EQ(lk.size(), 5u) << seqlens_kind_name(kind);
    EXPECT_EQ(f.find("seqlens_k")->dtype, p.seqlens_dtype);
    EXPECT_EQ(lk[0], 24);  // one full sequence
    EXPECT_EQ(lk[1], 2);   // one with few keys
    EXPECT_EQ(std::set<std::int64_t>(lk.begin(), lk.end()).size(), 5u) << "distinct key counts";
    if (kind == SeqlensKind::Keys) {
      EXPECT_EQ(f.find("seqlens_q"), nullptr);
      continue;
    }
    ASSERT_EQ(lq.size(), 5u);
    for (std::size_t b = 0; b < 5; ++b) {
      EXPECT_GE(lq[b], 1);
      EXPECT_LE(lq[b], std::min<std::int64_t>(6, lk[b])) << seqlens_kind_name(kind) << " b=" << b;
      if (kind == SeqlensKind::Decode) {
        EXPECT_EQ(lq[b], 1);
      }
    }
    if (kind != SeqlensKind::Decode) {
      EXPECT_EQ(lq[0], 6);
    }
    EXPECT_EQ(c.first_refused_row(), std::nullopt);  // bottom_right: Lq <= Lk leaves no row empty
    // the last valid query of each sequence sees exactly its sequence's keys
    for (std::int64_t b = 0; b < 5; ++b)
      EXPECT_EQ(c.key_range(b, lq[static_cast<std::size_t>(b)] - 1).last, lk[static_cast<std::size_t>(b)] - 1);
  }
  ProblemSpec bad = sdpa("normal", DType::F32, 2, 1, 1, 2, 2);
  bad.seqlens = SeqlensKind::Varlen;
  bad.seqlens_dtype = DType::F32;
  EXPECT_EQ(problem_error(bad), "seqlens_dtype must be I32 or I64");
}

TEST(VectorsSeqlens, PoisonFillsKeysPastSeqlensK) {
  ProblemSpec p = sdpa("normal", DType::F16, 3, 2, 1, 4, 10);
  p.seqlens = SeqlensKind::Varlen;
  p.causal = Causal::BottomRight;
  p.poison = true;
  const SafeTensorsFile f = make_problem(p, 5);
  const auto lk = lengths_of(f, "seqlens_k");
  const RawTensor* v = f.find("v");
  for (std::int64_t b = 0; b < 3; ++b)
    for (std::int64_t j = 0; j < 10; ++j) {
      const double x = decode_float(DType::F16, v->data.data() + static_cast<std::size_t>((b * 10 + j) * 8) * 2);
      EXPECT_EQ(std::isfinite(x), j < lk[static_cast<std::size_t>(b)]) << "b=" << b << " j=" << j;
    }
  EXPECT_NO_THROW(evaluate(case_from_file("poisoned", f), {}));
}

TEST(VectorsPoison, NeedsKindSdpa) {
  ProblemSpec p;
  p.kind = Kind::Mha;
  p.Hq = p.Hkv = 2;
  p.D = p.Dout = 2;
  p.poison = true;
  EXPECT_EQ(problem_error(p), "poison needs kind sdpa (kind mha inputs are all finite)");
}

TEST(VectorsMasks, QueryMaskKeepsAValidRowPerBatchAndPadsBatchZero) {
  ProblemSpec p = sdpa("normal", DType::F32, 3, 1, 1, 5, 5);
  p.query_mask = true;
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    const Case c = make_case(p, seed);
    EXPECT_FALSE(c.query_valid(0, 4));
    for (std::int64_t b = 0; b < 3; ++b) EXPECT_TRUE(c.query_valid(b, 0));
  }
}

TEST(VectorsBias, AlibiSlopesAndExactValues) {
  ProblemSpec p = sdpa("normal", DType::F32, 1, 8, 8, 4, 6);
  p.bias = BiasKind::Alibi;
  p.causal = Causal::BottomRight;
  const Case c = make_case(p);
  EXPECT_EQ(c.bias->shape, (std::vector<std::int64_t>{1, 8, 4, 6}));
  EXPECT_EQ(c.bias->dtype, DType::F32);
  for (std::int64_t h = 0; h < 8; ++h)
    for (std::int64_t i = 0; i < 4; ++i)
      for (std::int64_t j = 0; j < 6; ++j) {
        // H = 8: slopes 2^-(h+1), exact
        const double want =
            -std::ldexp(1.0, -static_cast<int>(h + 1)) * static_cast<double>(std::abs(i + 2 - j));
        EXPECT_EQ(c.bias_at(0, h, i, j), want);
      }
  ProblemSpec q = sdpa("normal", DType::F16, 1, 3, 3, 4, 6);
  q.bias = BiasKind::Alibi;
  const Case d = make_case(q);
  for (std::int64_t h = 0; h < 3; ++h) {
    const double slope = std::exp2(-8.0 * static_cast<double>(h + 1) / 3.0);
    EXPECT_NEAR(d.bias_at(0, h, 0, 5), -5 * slope, 5 * slope * 0x1p-23);
  }
}

TEST(VectorsBias, RandomHasMinusInfinityAndFiniteEntries) {
  ProblemSpec p = sdpa("normal", DType::F32, 2, 2, 2, 8, 16);
  p.bias = BiasKind::Random;
  const Case c = make_case(p);
  int inf = 0, finite = 0;
  for (double x : c.bias->values) (x == -INFINITY ? inf : finite)++;
  EXPECT_GT(inf, 0);
  EXPECT_GT(finite, inf);
}

TEST(VectorsBias, FillWritesAMaskAsABias) {
  const std::pair<std::string, double> fills[] = {
      {"", -INFINITY}, {"-inf", -INFINITY}, {"-1e4", -1e4}, {"-max", -0x1.fffffep127}};
  for (const auto& [text, value] : fills) {
    ProblemSpec p = sdpa("normal", DType::F32, 3, 4, 2, 6, 20);
    p.bias = BiasKind::Fill;
    p.bias_fill = text;
    p.mask = MaskKind::Random;
    p.window = std::make_pair(std::int64_t{3}, std::int64_t{2});
    const Case c = make_case(p);
    ASSERT_TRUE(c.bias);
    EXPECT_EQ(c.bias->shape, (std::vector<std::int64_t>{3, 4, 6, 20}));
    int filled = 0;
    for (double x : c.bias->values) {
      ASSERT_TRUE(x == 0 || x == value) << text << " " << x;
      filled += x == value;
    }
    // about a quarter of 3*4*6*20 = 1440 entries
    EXPECT_GT(filled, 250) << text;
    EXPECT_LT(filled, 470) << text;
    // every row keeps a key that mask and window allow with bias 0
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          bool open = false;
          for (std::int64_t j = 0; j < c.Nk; ++j)
            open = open || (c.position_allowed(b, i, j) && c.mask_at(b, h, i, j) &&
                            c.bias_at(b, h, i, j) == 0);
          EXPECT_TRUE(open) << text << " row " << b << "," << h << "," << i;
        }
  }
}

TEST(VectorsBias, FillValueIsRoundedIntoTheBiasDtype) {
  ProblemSpec p = sdpa("normal", DType::BF16);
  p.bias = BiasKind::Fill;
  p.bias_dtype = DType::BF16;
  p.bias_fill = "-1e4";
  EXPECT_EQ(bias_fill_value(p).value, -9984.0);
  p.bias_fill = "-max";
  EXPECT_EQ(bias_fill_value(p).value, -0x1.fep127);
  p.dtype = p.bias_dtype = DType::F16;
  EXPECT_EQ(bias_fill_value(p).value, -65504.0);
  p.bias_fill = "-1e4";
  EXPECT_EQ(bias_fill_value(p).value, -1e4);
  p.bias_dtype = DType::F64;
  p.bias_fill = "-max";
  EXPECT_EQ(bias_fill_value(p).value, -0x1.fffffffffffffp1023);
}

TEST(VectorsProblemError, RefusesWhatCannotBeBuilt) {
  ProblemSpec p = sdpa("normal", DType::F32, 1, 4, 3);
  EXPECT_NE(problem_error(p), std::nullopt);
  p = sdpa("nosuch", DType::F32);
  EXPECT_NE(problem_error(p), std::nullopt);
  p = sdpa("normal", DType::F32);
  p.params["offset"] = 1;
  EXPECT_NE(problem_error(p), std::nullopt);
  p = sdpa("normal", DType::F32);
  p.softcap = "-1";
  EXPECT_NE(problem_error(p), std::nullopt);
  p = sdpa("uniform", DType::F16);
  p.params["hi"] = 1e6;
  EXPECT_NE(problem_error(p), std::nullopt);  // would overflow F16
  EXPECT_THROW(make_problem(p, 1), std::invalid_argument);
  p = sdpa("large_scores", DType::F16);
  p.params["offset"] = 1e10;
  EXPECT_NE(problem_error(p), std::nullopt);
  p.params["offset"] = 1e4;
  EXPECT_EQ(problem_error(p), std::nullopt);
  p = sdpa("normal", DType::F16);
  p.bias = BiasKind::Random;
  p.bias_fill = "-1e4";
  EXPECT_EQ(problem_error(p), "bias_fill needs bias fill");
  p.bias = BiasKind::Fill;
  EXPECT_EQ(problem_error(p), std::nullopt);
  p.bias_fill = "1";
  EXPECT_EQ(problem_error(p), "bias_fill \"1\" is not -inf, -max or a negative finite number");
  p.bias_fill = "minus";
  EXPECT_NE(problem_error(p), std::nullopt);
  p.bias_fill = "-1e5";
  p.bias_dtype = DType::F16;
  EXPECT_EQ(problem_error(p), "bias_fill -1e5 overflows bias_dtype F16");
  p.bias_dtype = DType::F32;
  EXPECT_EQ(problem_error(p), std::nullopt);
}

// Sinks of each kind, in their dtype and range; a row with no key but a sink is not refused.
TEST(VectorsSinks, KindsDtypesAndRefusals) {
  ProblemSpec p = sdpa("normal", DType::BF16, 1, 4, 2, 5, 9);
  EXPECT_FALSE(make_case(p).sinks);
  for (auto [kind, lo, hi] : {std::tuple{"near", -2.0, 2.0}, {"dominant", 12.0, 16.0},
                              {"negligible", -40.0, -36.0}, {"0.75", 0.75, 0.75}}) {
    p.sinks = kind;
    for (DType t : {DType::F64, DType::F32, DType::BF16}) {
      p.sinks_dtype = t;
      const Case c = make_case(p);
      ASSERT_TRUE(c.sinks) << kind;
      EXPECT_EQ(c.sinks->dtype, t);
      EXPECT_EQ(c.sinks->shape, (std::vector<std::int64_t>{4}));
      for (double x : c.sinks->values) {
        EXPECT_GE(x, lo) << kind;
        EXPECT_LE(x, hi) << kind;
      }
    }
  }
  p.sinks_dtype = DType::F16;
  EXPECT_EQ(problem_error(p).value_or(""), "sinks_dtype must be F64, F32 or the input dtype (F64 or F32 for FP8 inputs)");
  p.sinks_dtype = DType::F32;
  p.sinks = "big";
  EXPECT_EQ(problem_error(p).value_or(""),
            "sinks \"big\" is not near, dominant, negligible or a finite number");
  ProblemSpec m = sdpa("normal", DType::F32, 2, 2, 2, 6, 8);
  m.mask = MaskKind::FullyMaskedRows;
  m.sinks = "near";
  const Case c = make_case(m);
  EXPECT_FALSE(has_fully_masked_row(c));
  EXPECT_FALSE(c.first_refused_row().has_value());
}

// Dropout: a keep mask [B, Hq, Nq, Nk] from its own stream (the other inputs unchanged), kept at
// a rate near 1 - p, attn.dropout_p as written; and the refusals.
TEST(VectorsDropout, KeepMaskAndRefusals) {
  ProblemSpec p = sdpa("normal", DType::BF16, 1, 4, 2, 64, 64);
  const Case plain = make_case(p);
  EXPECT_FALSE(plain.dropout);
  p.dropout = "0.3";
  const Case c = make_case(p);
  ASSERT_TRUE(c.dropout);
  EXPECT_EQ(c.dropout->p, "0.3");
  EXPECT_EQ(c.dropout->keep.shape, (std::vector<std::int64_t>{1, 4, 64, 64}));
  EXPECT_EQ(c.q.values, plain.q.values);
  EXPECT_EQ(c.v.values, plain.v.values);
  double kept = 0;
  for (auto x : c.dropout->keep.values) kept += x;
  EXPECT_NEAR(kept / 16384, 0.7, 0.02);  // 3.5 standard deviations: sqrt(0.21 / 16384) = 0.0036
  p.dropout = "1";
  EXPECT_EQ(problem_error(p).value_or(""), "dropout \"1\" is not a number in [0, 1)");
  p.dropout = "0.5";
  p.kv_split_size = 16;
  p.want_out_partial = true;
  EXPECT_EQ(problem_error(p).value_or(""), "dropout has no partial states (out_partial, lse_partial)");
  ProblemSpec m = p;
  m.kind = Kind::Mha;
  EXPECT_EQ(problem_error(m).value_or(""), "dropout needs kind sdpa");
}

// dsinks: asked with sinks it is in attn.outputs (with dout); without sinks the spec is refused.
TEST(VectorsSinks, Dsinks) {
  ProblemSpec p = sdpa("normal", DType::F32, 1, 4, 2, 5, 9);
  p.want_dq = p.want_dsinks = true;
  EXPECT_EQ(problem_error(p).value_or(""), "dsinks needs sinks");
  p.sinks = "near";
  ASSERT_EQ(problem_error(p), std::nullopt);
  const Case c = make_case(p);
  EXPECT_TRUE(c.want_dsinks && c.want_dq && c.dout);
  EXPECT_EQ(c.golden_tensors().back().name, "dsinks.bound");
  EXPECT_EQ(c.golden_tensors().back().shape, (std::vector<std::int64_t>{4}));
}

// Kind mha's gradients: dout in out's shape [B, Nq, Dout]; sdpa's names refused for mha and
// the reverse; self-attention has no dx_kv.
TEST(VectorsMhaGradients, DoutAndRefusals) {
  ProblemSpec p = mha("normal", DType::F32);
  p.want_mha = {true, true, true, true, true, true};
  ASSERT_EQ(problem_error(p), std::nullopt);
  const Case c = make_case(p);
  ASSERT_TRUE(c.dout);
  EXPECT_EQ(c.dout->shape, (std::vector<std::int64_t>{p.B, p.Nq, p.Dout}));
  EXPECT_TRUE(c.want_dx_q && c.want_dx_kv && c.want_dw_o);
  EXPECT_EQ(c.golden_tensors().back().name, "dw_o.bound");
  p.want_dq = true;
  EXPECT_EQ(problem_error(p).value_or(""), "dq, dk and dv are gradients of kind sdpa (kind mha: dx_q ... dw_o)");
  ProblemSpec s = sdpa("normal", DType::F32);
  s.want_mha[5] = true;
  EXPECT_EQ(problem_error(s).value_or(""), "dx_q, dx_kv, dw_q, dw_k, dw_v and dw_o are gradients of kind mha");
  ProblemSpec self = mha("normal", DType::F32);
  self.Nk = self.Nq;
  self.self_attention = true;
  self.want_mha[1] = true;
  EXPECT_EQ(problem_error(self).value_or(""), "self attention has no dx_kv (dx_q is the whole gradient of x)");
}

}  // namespace
}  // namespace attnoracle::testing

namespace attnoracle::testing {
namespace {

using namespace attnoracle::vectors;

// A paged case holds, at every key a row uses, the bytes of k and v of its contiguous twin (the
// same spec and seed without page_size), through its block table, in both layouts; unused table
// entries hold -1, 0 or an index past the cache; with poison a slot past a row's length is NaN
// (unshared pages).
TEST(VectorsPaging, PagedCaseHoldsTheContiguousTwinsKeys) {
  for (const bool hnd : {false, true})
    for (const auto pages : {ProblemSpec::Pages::Ordered, ProblemSpec::Pages::Shuffled, ProblemSpec::Pages::Shared})
      for (const std::int64_t P : {1, 3, 4, 12}) {
        ProblemSpec p;
        p.dtype = DType::BF16;
        p.B = 4, p.Hq = 4, p.Hkv = 2, p.Nq = 3, p.Nk = 24, p.Dk = 8, p.Dv = 4;
        p.seqlens = SeqlensKind::Chunked;
        p.page_size = P, p.kv_layout_hnd = hnd, p.pages = pages, p.poison = true;
        const SafeTensorsFile f = make_problem(p, 11);
        ProblemSpec twin = p;
        twin.page_size = 0;
        SafeTensorsFile t = make_problem(twin, 11);
        if (pages == ProblemSpec::Pages::Shared) share_prefix(p, t);  // the twin's keys shared too
        ASSERT_EQ(f.find("k"), nullptr);
        const RawTensor& kc = *f.find("k_cache");
        const RawTensor& vc = *f.find("v_cache");
        const std::vector<std::int64_t> bt = int_tensor_values(*f.find("block_table"));
        const std::vector<std::int64_t> lk = int_tensor_values(*f.find("seqlens_k"));
        const std::int64_t M = p.Nk / P, pages_n = kc.shape[0];
        EXPECT_EQ(f.metadata.at("attn.kv_layout"), hnd ? "HND" : "NHD");
        EXPECT_EQ(kc.shape, (hnd ? std::vector<std::int64_t>{pages_n, 2, P, 8} : std::vector<std::int64_t>{pages_n, P, 2, 8}));
        const Case c = case_from_file("twin", t);
        bool nan_seen = false;
        for (std::int64_t b = 0; b < p.B; ++b)
          for (std::int64_t m = 0; m < M; ++m) {
            const std::int64_t id = bt[static_cast<std::size_t>(b * M + m)];
            if (m * P >= lk[static_cast<std::size_t>(b)]) {
              EXPECT_TRUE(id == -1 || id == 0 || id >= pages_n) << id;
              continue;
            }
            ASSERT_GE(id, 0);
            ASSERT_LT(id, pages_n);
            for (std::int64_t s = 0; s < P; ++s)
              for (std::int64_t g = 0; g < p.Hkv; ++g) {
                const std::int64_t j = m * P + s;
                const std::int64_t slot = hnd ? (id * p.Hkv + g) * P + s : (id * P + s) * p.Hkv + g;
                for (std::int64_t e = 0; e < p.Dk; ++e) {
                  const double x = decode_float(kc.dtype, kc.data.data() + static_cast<std::size_t>(slot * p.Dk + e) * 2);
                  const double y = c.k.values[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dk + e)];
                  if (j < lk[static_cast<std::size_t>(b)] && std::isfinite(y)) {
                    EXPECT_EQ(x, y) << "b " << b << " j " << j << " P " << P;
                  }
                  nan_seen = nan_seen || (j >= lk[static_cast<std::size_t>(b)] && std::isnan(x));
                }
                for (std::int64_t e = 0; e < p.Dv; ++e) {
                  const double x = decode_float(vc.dtype, vc.data.data() + static_cast<std::size_t>(slot * p.Dv + e) * 2);
                  const double y = c.v.values[static_cast<std::size_t>(((b * p.Hkv + g) * p.Nk + j) * p.Dv + e)];
                  if (j < lk[static_cast<std::size_t>(b)] && std::isfinite(y)) {
                    EXPECT_EQ(x, y);
                  }
                }
              }
          }
        if (P > 1 && pages != ProblemSpec::Pages::Shared) {  // shared pages hold batch 0's keys there
          EXPECT_TRUE(nan_seen) << "P " << P;
        }
      }
}

TEST(VectorsPaging, RefusesWhatItCannotPage) {
  ProblemSpec p;
  p.B = 2, p.Nk = 10, p.page_size = 4;
  EXPECT_EQ(problem_error(p).value_or(""), "page_size needs seqlens (a paged cache has seqlens_k)");
  p.seqlens = SeqlensKind::Keys;
  EXPECT_EQ(problem_error(p).value_or(""), "page_size must divide Nk (Nk = pages per row x page size)");
  p.Nk = 12;
  EXPECT_EQ(problem_error(p), std::nullopt);
  p.want_dq = true;
  EXPECT_EQ(problem_error(p).value_or(""), "paged cases have no gradients");
  p.want_dq = false;
  p.want_lse_partial = true;
  EXPECT_EQ(problem_error(p).value_or(""), "out_partial and lse_partial need kv_split_size");
  p.kv_split_size = 5;
  EXPECT_EQ(problem_error(p), std::nullopt);
  p.bias = BiasKind::RowOffset;
  p.bias_dtype = DType::F16;
  p.dtype = DType::F16;
  EXPECT_EQ(problem_error(p).value_or(""), "bias row_offset needs bias_dtype F64 or F32 (its offsets reach -2e31)");
}

// Every row offset is 0 or far below -5e4.
TEST(VectorsPaging, RowOffsetsLieFarBelowFiniteSentinels) {
  ProblemSpec p;
  p.B = 2, p.Hq = 2, p.Hkv = 1, p.Nq = 30, p.Nk = 8, p.Dk = 4, p.Dv = 4;
  p.bias = BiasKind::RowOffset;
  const SafeTensorsFile f = make_problem(p, 3);
  const RawTensor& bias = *f.find("bias");
  EXPECT_EQ(bias.shape, (std::vector<std::int64_t>{2, 2, 30, 1}));
  int zero = 0, far = 0, farther = 0;
  for (std::int64_t e = 0; e < bias.numel(); ++e) {
    const double x = decode_float(bias.dtype, bias.data.data() + static_cast<std::size_t>(e) * 4);
    zero += x == 0;
    far += x <= -1e5 && x > -2.1e5;
    farther += x <= -1e31;
  }
  EXPECT_EQ(zero + far + farther, 120);
  EXPECT_GT(zero, 10);
  EXPECT_GT(far, 10);
  EXPECT_GT(farther, 10);
}

}  // namespace
}  // namespace attnoracle::testing
