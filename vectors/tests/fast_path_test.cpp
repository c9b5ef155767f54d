// The fast path tested the way Arb tests its fast kernels against precise ones: on random and
// adversarial problems, every MPFR enclosure (256 bits, so nearly exact) lies inside the fast
// ball, and the golden bytes are the same with the fast path on and off. Its exp and its
// rounding are checked against MPFR directly.
#include <gtest/gtest.h>

#include <mpfr.h>

#include <cstdint>
#include <cstring>
#include <random>

#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "attnoracle/reference/round.hpp"
#include "fast/decide.hpp"
#include "fast/error_bounds.hpp"
#include "fast/exp_dd.hpp"
#include "fast/fast_row.hpp"

namespace attnoracle::testing {
namespace {

double scale_env() {
  const char* s = std::getenv("ATTNORACLE_TEST_SCALE");
  return s ? std::max(0.01, std::atof(s)) : 1.0;
}

// x as an MPFR number (exact at 256 bits: a double-double spans at most ~2100 bits, but the
// normalised ones made here are within 120).
void set_dd(mpfr_ptr r, fast::DD x) {
  mpfr_set_d(r, x.hi, MPFR_RNDN);
  mpfr_add_d(r, r, x.lo, MPFR_RNDN);
}

TEST(FastPath, ExpIsWithinItsBound) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> U(fast::kExpMin, 8);
  mpfr_t x, e, y, d;
  mpfr_inits2(512, x, e, y, d, static_cast<mpfr_ptr>(nullptr));
  double worst = 0;
  const int n = static_cast<int>(20000 * scale_env());
  for (int k = 0; k < n; ++k) {
    fast::DD a = fast::two_sum(U(rng), 0);
    a.lo = std::ldexp(U(rng) / 16, std::ilogb(a.hi == 0 ? 1 : a.hi) - 53);  // a genuine low part
    a = fast::two_sum(a.hi, a.lo);
    if (k < 200) a = fast::two_sum(std::ldexp(static_cast<double>(k - 100), -3), 0);  // small and exact
    set_dd(x, a);
    mpfr_exp(e, x, MPFR_RNDN);
    set_dd(y, fast::exp_dd(a));
    mpfr_sub(d, y, e, MPFR_RNDN);
    mpfr_div(d, d, e, MPFR_RNDN);
    worst = std::max(worst, std::fabs(mpfr_get_d(d, MPFR_RNDN)));
  }
  mpfr_clears(x, e, y, d, static_cast<mpfr_ptr>(nullptr));
  EXPECT_LE(worst, fast::kExpRel / 16) << "worst relative error " << worst;
  RecordProperty("worst_exp_error_log2", std::to_string(std::log2(worst)));
}

TEST(FastPath, RoundingOfDoubleDoublesMatchesMpfr) {
  std::mt19937_64 rng(11);
  mpfr_t x;
  mpfr_init2(x, 256);
  const int n = static_cast<int>(200000 * scale_env());
  for (int k = 0; k < n; ++k) {
    const DType t = std::array<DType, 4>{DType::F64, DType::F32, DType::F16, DType::BF16}[k % 4];
    const FloatFormat f = float_format(t);
    // values near a midpoint of the format, at every scale including subnormal and overflow
    const int e = static_cast<int>(rng() % static_cast<std::uint64_t>(f.emax - f.emin + 8)) + static_cast<int>(f.emin) - 4;
    const double base = std::ldexp(static_cast<double>((rng() >> 11) | 1), e - 53);
    const double mid = round_dd(fast::DD{base, 0}, t);  // some format value near base
    const double q = std::ldexp(1.0, std::max(std::ilogb(mid == 0 ? base : mid), 1 - f.bias) - f.precision + 1);
    fast::DD v = fast::two_sum(mid + q / 2, 0);  // a midpoint, exact or nearly
    const int wiggle = static_cast<int>(rng() % 3) - 1;
    v = fast::two_sum(v.hi, wiggle * std::ldexp(std::fabs(v.hi), -60));
    if (!std::isfinite(v.hi)) continue;
    set_dd(x, v);
    EXPECT_EQ(fast::round_dd(v, t), round_to_format(x, t))
        << std::hexfloat << v.hi << " + " << v.lo << " in " << dtype_name(t);
  }
  mpfr_clear(x);
}

// The inclusion: every MPFR enclosure at 256 bits inside the fast one.
void expect_inside(const Enclosure& precise, mpfr_srcptr lo, mpfr_srcptr hi, const char* what,
                   int problem) {
  EXPECT_TRUE(mpfr_lessequal_p(lo, precise.lo) && mpfr_lessequal_p(precise.hi, hi))
      << what << " of problem " << problem << ": fast [" << mpfr_get_d(lo, MPFR_RNDN) << ", "
      << mpfr_get_d(hi, MPFR_RNDN) << "] does not contain the precise enclosure";
}
// Within the double-double ends [l, u] (exact at 256 bits).
void expect_inside(const Enclosure& precise, fast::DD l, fast::DD u, const char* what, int problem) {
  mpfr_t lo, hi;
  mpfr_inits2(256, lo, hi, static_cast<mpfr_ptr>(nullptr));
  mpfr_set_d(lo, l.hi, MPFR_RNDN);
  mpfr_add_d(lo, lo, l.lo, MPFR_RNDN);
  mpfr_set_d(hi, u.hi, MPFR_RNDN);
  mpfr_add_d(hi, hi, u.lo, MPFR_RNDN);
  expect_inside(precise, lo, hi, what, problem);
  mpfr_clears(lo, hi, static_cast<mpfr_ptr>(nullptr));
}
void expect_inside(const Enclosure& precise, const fast::Ball& ball, const char* what, int problem) {
  expect_inside(precise, fast::lower(ball), fast::upper(ball), what, problem);
}

TEST(FastPath, EnclosesThePreciseValuesAndGivesTheSameBytes) {
  const auto& gens = vectors::generators();
  int problems = 0, rows_fast = 0, rows_total = 0;
  const int rounds = std::max(1, static_cast<int>(10 * scale_env()));
  for (int round = 0; round < rounds; ++round)
    for (std::size_t gi = 0; gi < gens.size(); ++gi)
      for (int k = 0; k < 8; ++k) {
        vectors::ProblemSpec s;
        s.generator = std::string(gens[gi].name);
        s.dtype = std::array<DType, 4>{DType::F32, DType::F16, DType::BF16, DType::F64}[k % 4];
        s.output_dtype = std::array<DType, 4>{DType::F32, DType::F16, DType::BF16, DType::F64}[(k + round) % 4];
        s.B = 1 + k % 2;
        s.Hkv = 1 + (k / 2) % 2;
        s.Hq = s.Hkv * (1 + k % 3);
        s.Nq = 1 + (k * 5 + round) % 9;
        s.Nk = 1 + (k * 7 + 3 * round) % 13;
        s.Dk = 1 + (k * 3) % 8;
        s.Dv = 1 + (k + round) % 6;
        s.causal = std::array<Causal, 3>{Causal::None, Causal::TopLeft, Causal::BottomRight}[(k + round) % 3];
        s.masked_rows = MaskedRows::Zero;
        s.want_weights = s.want_lse = true;
        s.mask = k % 4 == 3 ? vectors::MaskKind::KeyPadding : vectors::MaskKind::None;
        s.bias = k % 5 == 1 ? vectors::BiasKind::Alibi : (k % 5 == 2 ? vectors::BiasKind::Random : vectors::BiasKind::None);
        if (s.generator == "long_rows") s.Nk = 600;
        if (vectors::problem_error(s)) continue;
        SafeTensorsFile f;
        try {
          f = vectors::make_problem(s, 5000 + 97 * gi + 13 * static_cast<std::uint64_t>(k) + 100000 * static_cast<std::uint64_t>(round));
        } catch (const std::invalid_argument&) {
          continue;
        }
        const Case c = case_from_file("p", f);
        ++problems;
        const fast::Setup setup = fast::prepare(c);
        const fast::Setup rowwise = fast::prepare(c, false);  // each row transposes its own keys
        if (setup.applies) {
          const RowEvaluator ev(c);
          for (std::int64_t b = 0; b < c.B; ++b)
            for (std::int64_t h = 0; h < c.Hq; ++h) {
              // the head's rows as one tile and as tiles from row 1, with and without the
              // transposed keys: each row as fast_row evaluates it alone
              const std::vector<fast::FastRow> tile = fast::fast_rows(c, setup, b, h, 0, c.Nq);
              const std::vector<fast::FastRow> tile_w = fast::fast_rows(c, rowwise, b, h, 1, c.Nq - 1);
              ASSERT_EQ(tile.size(), static_cast<std::size_t>(c.Nq));
              for (std::int64_t i = 0; i < c.Nq; ++i) {
                ++rows_total;
                const fast::FastRow fr = fast::fast_row(c, setup, b, h, i);
                const fast::FastRow fw = fast::fast_row(c, rowwise, b, h, i);
                std::vector<const fast::FastRow*> others{&fw, &tile[static_cast<std::size_t>(i)]};
                if (i > 0) others.push_back(&tile_w[static_cast<std::size_t>(i - 1)]);
                // the same balls, bit for bit
                auto same = [](const fast::Ball& x, const fast::Ball& y) {
                  return std::memcmp(&x.mid.hi, &y.mid.hi, 8) == 0 && std::memcmp(&x.mid.lo, &y.mid.lo, 8) == 0 &&
                         std::memcmp(&x.rad, &y.rad, 8) == 0;
                };
                for (const fast::FastRow* o : others) {
                  ASSERT_EQ(fr.ok, o->ok) << "row " << i << ", problem " << problems;
                  if (!fr.ok) continue;
                  ASSERT_TRUE(same(fr.z, o->z)) << "Z, row " << i << ", problem " << problems;
                  for (std::size_t j = 0; j < fr.dots.size(); ++j)
                    ASSERT_TRUE(same(fr.dots[j], o->dots[j]) && same(fr.scores[j], o->scores[j]) &&
                                same(fr.weights[j], o->weights[j]))
                        << "key " << j << ", row " << i << ", problem " << problems;
                  for (std::size_t e = 0; e < fr.out.size(); ++e)
                    ASSERT_TRUE(same(fr.out[e], o->out[e]) && same(fr.bound[e], o->bound[e]))
                        << "out " << e << ", row " << i << ", problem " << problems;
                }
                if (!fr.ok) continue;
                ++rows_fast;
                const RowEnclosures pr = ev.row(b, h, i, 256);
                const HeadDetail& d = pr.heads[0];
                for (std::int64_t j = 0; j < c.Nk; ++j)
                  if (fr.allowed[static_cast<std::size_t>(j)]) {
                    expect_inside(d.dots[static_cast<std::size_t>(j)], fr.dots[static_cast<std::size_t>(j)], "dot", problems);
                    expect_inside(pr.weights[0][static_cast<std::size_t>(j)], fr.weights[static_cast<std::size_t>(j)], "weight", problems);
                  }
                for (std::int64_t e = 0; e < c.Dv; ++e) {
                  const auto ei = static_cast<std::size_t>(e);
                  expect_inside(d.raw_out[ei], fr.out[ei], "out", problems);
                  // out.bound as the fast path rounds it: the ball within the |v| range
                  fast::DD lo, hi;
                  fast::ends(fr.bound[ei], lo, hi, fr.absmin[ei], fr.absmax[ei]);
                  expect_inside(pr.bound[ei], lo, hi, "out.bound", problems);
                }
                const Enclosure lse = fast::lse_enclosure(fr);
                expect_inside(pr.lse[0], lse.lo, lse.hi, "lse", problems);
              }
            }
        }
        EvalOptions on, off;
        off.fast_path = false;
        const EvalResult a = evaluate(c, on), z = evaluate(c, off);
        for (const RawTensor& t : a.golden) {
          const RawTensor* u = nullptr;
          for (const RawTensor& x : z.golden)
            if (x.name == t.name) u = &x;
          ASSERT_TRUE(u) << t.name << " only with the fast path, problem " << problems;
          if (u->data == t.data) continue;
          std::size_t at = 0;
          const std::size_t es = dtype_size(t.dtype);
          while (at * es < t.data.size() && std::memcmp(t.data.data() + at * es, u->data.data() + at * es, es) == 0) ++at;
          FAIL() << "problem " << problems << " (" << s.generator << ", " << dtype_name(s.dtype) << " -> "
                 << dtype_name(*s.output_dtype) << "): " << t.name << "[" << at << "] fast "
                 << (at * es < t.data.size() && t.dtype != DType::BOOL && t.dtype != DType::I64 ? decode_float(t.dtype, t.data.data() + at * es) : -1.0)
                 << " vs MPFR "
                 << (at * es < u->data.size() && u->dtype != DType::BOOL && u->dtype != DType::I64 ? decode_float(u->dtype, u->data.data() + at * es) : -1.0);
        }
        ASSERT_EQ(a.golden.size(), z.golden.size()) << "problem " << problems;
      }
  EXPECT_GT(problems, 50);
  EXPECT_GT(rows_fast, rows_total / 2);
  RecordProperty("rows_fast", rows_fast);
  RecordProperty("rows_total", rows_total);
}

}  // namespace
}  // namespace attnoracle::testing
