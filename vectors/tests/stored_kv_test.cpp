// Stored K/V of generated cases (kv_format, kv_scale, kv_scale_binades, v_from_k, o_scale): the
// stored form holds its float twin's keys and values to the format's precision, scales have the
// granularity asked, saturating and subnormal elements appear, paged forms hold the contiguous
// twin's real values, and what cannot be built is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "stored_kv.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::vectors;

ProblemSpec stored(const std::string& format, const std::string& scale = "", std::int64_t binades = 0) {
  ProblemSpec p;
  p.dtype = DType::BF16;
  p.output_dtype = DType::F32;
  p.B = 2, p.Hq = 4, p.Hkv = 2, p.Nq = 3, p.Nk = 24, p.Dk = 64, p.Dv = 32;
  p.kv_format = format, p.kv_scale = scale, p.kv_scale_binades = binades;
  return p;
}

// The float twin: the same spec without the stored form (the data do not depend on it).
ProblemSpec twin_of(ProblemSpec p) {
  p.kv_format.clear(), p.kv_scale.clear(), p.kv_scale_binades = 0;
  return p;
}

double at(const RawTensor& t, std::size_t e) { return decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype)); }

// Each real value of the stored case within `rel` of its twin's, plus `abs` (underflow).
void expect_near_twin(const ProblemSpec& p, double rel, double abs) {
  const Case c = case_from_file("stored", make_problem(p, 5));
  const Case t = case_from_file("twin", make_problem(twin_of(p), 5));
  ASSERT_TRUE(c.kv_form.has_value());
  for (const auto& [s, u] : {std::pair{&c.k, &t.k}, std::pair{&c.v, &t.v}})
    for (std::size_t e = 0; e < s->values.size(); ++e)
      ASSERT_LE(std::fabs(s->values[e] - u->values[e]), rel * std::fabs(u->values[e]) + abs)
          << p.kv_format << " element " << e << ": " << s->values[e] << " vs " << u->values[e];
}

TEST(VectorsStoredKv, ScaledFormsHoldTheTwinToTheirPrecision) {
  // E4M3 3 bits after the point, E5M2 2: half an ulp is 2^-4, 2^-3 of the value; I8's step
  // is the scale, below 2^(ceil(log2 6) - 5) = 1/4 for normal data within 6: half of it.
  for (const char* g : {"tensor", "head", "token"}) {
    expect_near_twin(stored("F8_E4M3", g), 0x1p-4, 0x1p-9 * 0x1p-4);
    expect_near_twin(stored("F8_E5M2", g), 0x1p-3, 0x1p-14);
    expect_near_twin(stored("I8", g), 0, 1.0 / 8);
  }
}

TEST(VectorsStoredKv, ScaleShapesDtypesAndMetadata) {
  const std::pair<const char*, std::vector<std::int64_t>> shapes[] = {
      {"tensor", {}}, {"head", {1, 2, 1, 1}}, {"token", {2, 2, 24, 1}}};
  for (const auto& [g, shape] : shapes) {
    const SafeTensorsFile f = make_problem(stored("I8", g, 3), 1);
    EXPECT_EQ(f.find("k")->dtype, DType::I8);
    EXPECT_EQ(f.find("k_scale")->shape, shape) << g;
    EXPECT_EQ(f.find("v_scale")->dtype, DType::F32);
    EXPECT_EQ(f.metadata.count("attn.kv_block_scale"), 0u);
  }
  const SafeTensorsFile m = make_problem(stored("mxfp8"), 1);
  EXPECT_EQ(m.metadata.at("attn.kv_block_scale"), "mxfp8");
  EXPECT_EQ(m.find("k")->dtype, DType::F8_E4M3);
  EXPECT_EQ(m.find("k_block_scale")->dtype, DType::U8);
  EXPECT_EQ(m.find("k_block_scale")->shape, (std::vector<std::int64_t>{2, 2, 24, 2}));
  EXPECT_EQ(m.find("v_block_scale")->shape, (std::vector<std::int64_t>{2, 2, 24, 1}));
  const SafeTensorsFile n = make_problem(stored("nvfp4"), 1);
  EXPECT_EQ(n.metadata.at("attn.kv_block_scale"), "nvfp4");
  EXPECT_EQ(n.find("k")->dtype, DType::U8);
  EXPECT_EQ(n.find("k")->shape, (std::vector<std::int64_t>{2, 2, 24, 32}));
  EXPECT_EQ(n.find("k_block_scale")->dtype, DType::F8_E4M3);
  EXPECT_EQ(n.find("k_block_scale")->shape, (std::vector<std::int64_t>{2, 2, 24, 4}));
  EXPECT_EQ(n.find("v_global_scale")->shape, (std::vector<std::int64_t>{}));
}

TEST(VectorsStoredKv, BlockFormsHoldTheTwinToTheirPrecision) {
  // mxfp8: OCP's exponent leaves the block's largest up to 2^9 before saturation at 448.
  expect_near_twin(stored("mxfp8"), 0.15, 0x1p-9 * 0x1p-4);
  // nvfp4: E2M1's widest gap (4 to 6) over the block scale, plus E4M3's rounding of that scale
  const Case c = case_from_file("nvfp4", make_problem(stored("nvfp4"), 5));
  const Case t = case_from_file("twin", make_problem(twin_of(stored("nvfp4")), 5));
  for (std::size_t r = 0; r < t.k.values.size() / 16; ++r) {
    double amax = 0;
    for (std::size_t e = 0; e < 16; ++e) amax = std::max(amax, std::fabs(t.k.values[r * 16 + e]));
    for (std::size_t e = 0; e < 16; ++e)
      ASSERT_LE(std::fabs(c.k.values[r * 16 + e] - t.k.values[r * 16 + e]), amax / 5) << r;
  }
}

// Scales moved by up to 12 binades (E5M2, whose range is 31 binades: 28): some elements
// saturate at the largest value, some are subnormal; a scale is not a BF16 value (21
// significant bits); nothing is NaN.
TEST(VectorsStoredKv, WideScalesSaturateAndReachSubnormals) {
  for (const char* format : {"F8_E4M3", "F8_E5M2"}) {
    const SafeTensorsFile f = make_problem(stored(format, "token", std::string(format) == "F8_E4M3" ? 12 : 28), 9);
    const RawTensor& k = *f.find("k");
    const double top = std::string(format) == "F8_E4M3" ? 448 : 57344;
    const double min_normal = std::string(format) == "F8_E4M3" ? 0x1p-6 : 0x1p-14;
    int saturated = 0, subnormal = 0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(k.numel()); ++e) {
      const double x = at(k, e);
      ASSERT_FALSE(std::isnan(x));
      saturated += std::fabs(x) == top;
      subnormal += x != 0 && std::fabs(x) < min_normal;
    }
    EXPECT_GT(saturated, 0) << format;
    EXPECT_GT(subnormal, 0) << format;
    const RawTensor& s = *f.find("k_scale");
    double lo = INFINITY, hi = 0;
    int not_bf16 = 0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(s.numel()); ++e) {
      lo = std::min(lo, at(s, e)), hi = std::max(hi, at(s, e));
      not_bf16 += round_double(at(s, e), DType::BF16) != at(s, e);
    }
    EXPECT_GT(hi / lo, 0x1p16) << format;
    EXPECT_GT(not_bf16, 0);
  }
  const SafeTensorsFile i8 = make_problem(stored("I8", "token", 12), 9);
  int clamped = 0;
  for (std::size_t e = 0; e < i8.find("v")->data.size(); ++e) {
    const auto x = static_cast<std::int8_t>(i8.find("v")->data[e]);
    clamped += x == 127 || x == -128;
  }
  EXPECT_GT(clamped, 0);
  const SafeTensorsFile mx = make_problem(stored("mxfp8", "", 8), 9);
  for (unsigned char b : mx.find("k_block_scale")->data) ASSERT_NE(b, 255);
}

TEST(VectorsStoredKv, E2M1NearestTiesToEven) {
  EXPECT_EQ(e2m1_nearest(0), 0);
  EXPECT_EQ(e2m1_nearest(0.25), 0);    // tie 0 | 0.5: the even significand
  EXPECT_EQ(e2m1_nearest(0.75), 2);    // tie 0.5 | 1: 1 (m = 0)
  EXPECT_EQ(e2m1_nearest(2.5), 4);     // tie 2 | 3: 2
  EXPECT_EQ(e2m1_nearest(5), 6);       // tie 4 | 6: 4
  EXPECT_EQ(e2m1_nearest(-5.5), 0xF);  // -6
  EXPECT_EQ(e2m1_nearest(100), 7);     // saturates at 6
  EXPECT_EQ(e2m1_nearest(-1.4), 0xB);  // -1.5
}

// The poison markers of a stored case: E4M3 and E5M2 elements and F32 scales that are NaN or
// infinite, E8M0 block scales 255, nvfp4 bytes 0x7F (-6, 6) and I8 per-token scales of F32's largest.
std::size_t poison_markers(const SafeTensorsFile& f) {
  std::size_t n = 0;
  for (const RawTensor& t : f.tensors) {
    if (t.name[0] != 'k' && t.name[0] != 'v') continue;
    const bool e8m0 = t.name.find("block_scale") != std::string::npos && t.dtype == DType::U8;
    for (std::size_t e = 0; e < static_cast<std::size_t>(t.numel()); ++e) {
      if (t.dtype == DType::U8)
        n += e8m0 ? t.data[e] == 0xFF : t.data[e] == 0x7F;
      else if (t.dtype != DType::I8 && t.dtype != DType::I32)
        n += !std::isfinite(at(t, e)) || at(t, e) == std::ldexp(2 - std::ldexp(1.0, -23), 127);
    }
  }
  return n;
}

// poison with stored K/V: the unused key rows of every form, contiguous and paged, hold their
// format's poison (and a paged cache's slots past a row's length their scales' too), the case
// is valid, and the golden out and lse of every row that is not padding are the clean case's.
TEST(VectorsStoredKv, PoisonFillsUnusedRowsAndChangesNoGoldenValue) {
  for (const char* format : {"F8_E4M3", "F8_E5M2", "I8", "mxfp8", "nvfp4"})
    for (const std::int64_t page : {0, 4}) {
      ProblemSpec p = stored(format, format[0] == 'm' || format[0] == 'n' ? "" : "token", 2);
      p.seqlens = SeqlensKind::Varlen, p.causal = Causal::BottomRight, p.want_lse = true;
      p.page_size = page, p.pages = ProblemSpec::Pages::Shuffled;
      const SafeTensorsFile clean_file = make_problem(p, 5);
      const Case clean = case_from_file("clean", clean_file);
      p.poison = true;
      const SafeTensorsFile dirty_file = make_problem(p, 5);
      // nvfp4's saturated bytes may be 0x7F already
      EXPECT_GE(poison_markers(dirty_file), poison_markers(clean_file) + 8) << format << " page " << page;
      const Case dirty = case_from_file("poisoned", dirty_file);
      const EvalResult a = evaluate(clean, {}), b = evaluate(dirty, {});
      for (const char* name : {"out", "lse.ref"}) {
        const auto find = [&](const EvalResult& r) {
          return *std::find_if(r.golden.begin(), r.golden.end(), [&](const RawTensor& g) { return g.name == name; });
        };
        const RawTensor ga = find(a), gb = find(b);
        const auto rows = static_cast<std::size_t>(clean.B * clean.Hq * clean.Nq), per_row = ga.data.size() / rows;
        for (std::size_t r = 0; r < rows; ++r) {
          const auto row = static_cast<std::int64_t>(r);
          if (!clean.query_valid(row / (clean.Hq * clean.Nq), row % clean.Nq)) continue;
          EXPECT_TRUE(std::equal(ga.data.begin() + static_cast<std::ptrdiff_t>(r * per_row),
                                 ga.data.begin() + static_cast<std::ptrdiff_t>((r + 1) * per_row),
                                 gb.data.begin() + static_cast<std::ptrdiff_t>(r * per_row)))
              << name << " row " << r << " " << format << " page " << page;
        }
      }
    }
}

// A paged stored case holds, through its table, the real keys and values of its contiguous twin
// (per-slot scales and block scales paged with their keys; shared pages share them).
TEST(VectorsStoredKv, PagedFormsHoldTheContiguousTwin) {
  for (const char* format : {"F8_E4M3", "I8", "mxfp8", "nvfp4"})
    for (const bool hnd : {false, true})
      for (const auto pages : {ProblemSpec::Pages::Shuffled, ProblemSpec::Pages::Shared}) {
        ProblemSpec p = stored(format, format[0] == 'm' || format[0] == 'n' ? "" : "token", 6);
        p.seqlens = SeqlensKind::Decode;
        p.page_size = 4, p.kv_layout_hnd = hnd, p.pages = pages;
        ProblemSpec contiguous = p;
        contiguous.page_size = 0;
        SafeTensorsFile t = make_problem(contiguous, 3);
        if (pages == ProblemSpec::Pages::Shared) share_prefix(p, t);
        const Case c = case_from_file("paged", make_problem(p, 3));
        const Case u = case_from_file("twin", t);
        ASSERT_TRUE(c.paged.has_value());
        const std::vector<std::int64_t> lk = *c.seqlens_k;
        for (std::int64_t b = 0; b < p.B; ++b)
          for (std::int64_t g = 0; g < p.Hkv; ++g)
            for (std::int64_t j = 0; j < lk[static_cast<std::size_t>(b)]; ++j) {
              const auto row = static_cast<std::size_t>((b * p.Hkv + g) * p.Nk + j);
              for (std::size_t e = 0; e < 64; ++e)
                ASSERT_EQ(c.k.values[row * 64 + e], u.k.values[row * 64 + e]) << format << " b " << b << " j " << j;
              for (std::size_t e = 0; e < 32; ++e) ASSERT_EQ(c.v.values[row * 32 + e], u.v.values[row * 32 + e]);
            }
      }
}

TEST(VectorsStoredKv, PagedScaleShapes) {
  ProblemSpec p = stored("F8_E4M3", "token");
  p.seqlens = SeqlensKind::Keys, p.page_size = 8;
  const SafeTensorsFile f = make_problem(p, 2);
  const std::int64_t pages = f.find("k_cache")->shape[0];
  EXPECT_EQ(f.find("k_scale")->shape, (std::vector<std::int64_t>{pages, 8, 2}));
  p.kv_layout_hnd = true;
  EXPECT_EQ(make_problem(p, 2).find("v_scale")->shape, (std::vector<std::int64_t>{pages, 2, 8}));
  p.kv_scale = "head";
  EXPECT_EQ(make_problem(p, 2).find("k_scale")->shape, (std::vector<std::int64_t>{2, 1}));
  p.kv_layout_hnd = false;
  EXPECT_EQ(make_problem(p, 2).find("k_scale")->shape, (std::vector<std::int64_t>{2}));
  p.kv_format = "mxfp8", p.kv_scale.clear();
  EXPECT_EQ(make_problem(p, 2).find("k_block_scale")->shape, (std::vector<std::int64_t>{pages, 8, 2, 2}));
}

TEST(VectorsStoredKv, VFromKAndFp8Out) {
  ProblemSpec p = stored("F8_E4M3", "token");
  p.v_from_k = true;
  const SafeTensorsFile f = make_problem(p, 4);
  EXPECT_EQ(f.find("v"), nullptr);
  EXPECT_EQ(f.find("v_scale"), nullptr);
  EXPECT_EQ(f.metadata.at("attn.v_from_k"), "32");
  const Case c = case_from_file("latent", f);
  for (std::size_t r = 0; r < static_cast<std::size_t>(p.B * p.Hkv * p.Nk); ++r)
    for (std::size_t e = 0; e < 32; ++e) ASSERT_EQ(c.v.values[r * 32 + e], c.k.values[r * 64 + e]);
  p.output_dtype = DType::F8_E4M3, p.o_scale = "0.1", p.want_amax = true;
  const SafeTensorsFile o = make_problem(p, 4);
  EXPECT_EQ(at(*o.find("o_scale"), 0), static_cast<double>(0.1f));  // rounded to nearest into F32
  EXPECT_EQ(o.metadata.at("attn.outputs"), "out,amax");
  EXPECT_EQ(o.metadata.at("attn.output_dtype"), "F8_E4M3");
  EXPECT_TRUE(case_from_file("fp8 out", o).want_amax);
}

TEST(VectorsStoredKv, RefusesWhatCannotBeBuilt) {
  auto error = [](const ProblemSpec& p) { return problem_error(p).value_or(""); };
  ProblemSpec p = stored("mxfp8");
  p.Dv = 48;
  EXPECT_EQ(error(p), "kv_format mxfp8 needs Dk and Dv multiples of 32");
  p.v_from_k = true;  // v is a view: only Dk counts
  EXPECT_EQ(error(p), "");
  p.Dv = 65;
  EXPECT_EQ(error(p), "v_from_k needs Dv <= Dk");
  p = stored("nvfp4");
  p.Dk = 40;
  EXPECT_EQ(error(p), "kv_format nvfp4 needs Dk and Dv multiples of 16");
  p = stored("mxfp8", "head");
  EXPECT_EQ(error(p), "kv_scale needs kv_format F8_E4M3, F8_E5M2 or I8");
  p = stored("", "", 3);
  EXPECT_EQ(error(p), "kv_scale_binades needs a kv_format");
  p = stored("I8");
  p.dtype = DType::F8_E4M3;
  EXPECT_EQ(error(p), "kv_format needs a float dtype (q's: F64, F32, F16 or BF16)");
  p = stored("F8_E5M2");
  p.generator = "subnormal";
  EXPECT_EQ(error(p), "kv_format is not built for generator subnormal (its scales would leave F32's normal range)");
  p = stored("I8");
  p.want_dq = true;
  EXPECT_EQ(error(p), "stored K/V and v_from_k have no gradients");
  p = stored("I8");
  p.kind = Kind::Mha, p.Hq = p.Hkv = 2, p.D = 4, p.Dout = 4;
  EXPECT_EQ(error(p), "kv_format and v_from_k need kind sdpa");
  p = stored("");
  p.output_dtype = DType::F8_E4M3;
  EXPECT_EQ(error(p), "o_scale goes with an FP8 output_dtype (F8_E4M3, F8_E5M2), and only there");
  p.o_scale = "-1";
  EXPECT_EQ(error(p), "o_scale \"-1\" is not a number > 0 that F32 holds (rounded to nearest)");
  p.o_scale = "1e-50";
  EXPECT_EQ(error(p), "o_scale \"1e-50\" is not a number > 0 that F32 holds (rounded to nearest)");
  p.o_scale = "1e39";
  EXPECT_EQ(error(p), "o_scale \"1e39\" is not a number > 0 that F32 holds (rounded to nearest)");
  p.o_scale = "0x1p-10";
  EXPECT_EQ(error(p), "");
  p.output_dtype = DType::F32;
  EXPECT_EQ(error(p), "o_scale goes with an FP8 output_dtype (F8_E4M3, F8_E5M2), and only there");
  p.o_scale.clear(), p.want_amax = true;
  EXPECT_EQ(error(p), "amax needs an FP8 output_dtype (F8_E4M3 or F8_E5M2)");
}

}  // namespace
}  // namespace attnoracle::testing
