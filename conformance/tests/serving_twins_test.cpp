// The serving twins (page layout, page order, page size, contiguous form, split size, decode
// against prefill, batch rows) are valid cases whose exact results relate bit for bit, and
// `attnoracle invariants --shapes serving` passes the serving kernels and catches their planted
// paging and split bugs.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "cli_args.hpp"

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/metamorphic.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/vectors/problem.hpp"

namespace attnoracle::conformance {
namespace {

const RawTensor& get(const std::vector<RawTensor>& g, const std::string& name) {
  for (const auto& t : g)
    if (t.name == name) return t;
  throw std::runtime_error("no " + name);
}

std::string bytes_at(const RawTensor& t, std::size_t k) {
  const std::size_t es = dtype_size(t.dtype);
  return std::string(reinterpret_cast<const char*>(t.data.data() + k * es), es);
}

// A serving problem: paged (page size P, 0: contiguous) with the sequence kind, layout and page
// order k gives.
vectors::ProblemSpec serving_spec(int k, std::int64_t P) {
  vectors::ProblemSpec s;
  s.dtype = std::array<DType, 3>{DType::F32, DType::BF16, DType::F16}[k % 3];
  s.B = 2 + k % 3;
  s.Hkv = 1 + k % 2;
  s.Hq = s.Hkv * (1 + k % 3);
  s.Dk = s.Dv = 3 + k % 2;
  s.page_size = P;
  s.Nk = (P > 0 ? P : 1) * (2 + k % 4);
  s.seqlens = std::array<vectors::SeqlensKind, 3>{vectors::SeqlensKind::Decode, vectors::SeqlensKind::Chunked,
                                                  vectors::SeqlensKind::Varlen}[k % 3];
  s.Nq = s.seqlens == vectors::SeqlensKind::Decode ? 1 : std::min<std::int64_t>(2 + k % 5, s.Nk);
  s.causal = std::array<Causal, 3>{Causal::BottomRight, Causal::None, Causal::TopLeft}[(k / 2) % 3];
  s.kv_layout_hnd = k % 2 == 1;
  s.pages = std::array<vectors::ProblemSpec::Pages, 3>{vectors::ProblemSpec::Pages::Shuffled,
                                                       vectors::ProblemSpec::Pages::Shared,
                                                       vectors::ProblemSpec::Pages::Ordered}[(k / 3) % 3];
  if (k % 5 == 4) s.window = std::make_pair<std::int64_t, std::int64_t>(2, 0);
  if (k % 4 == 1) s.sinks = "near";
  if (k % 7 == 3) s.bias = vectors::BiasKind::Alibi;
  if (k % 7 == 5) s.mask = vectors::MaskKind::Random;
  s.poison = k % 2 == 0;
  s.kv_split_size = k % 2 == 0 ? 2 + k % 3 : 0;
  s.want_out_partial = s.want_lse_partial = s.kv_split_size > 0;
  s.masked_rows = MaskedRows::Zero;
  s.want_weights = s.want_lse = true;
  return s;
}

// Every exact twin of a problem: both sides evaluate, and out, weights and lse agree bit for bit
// on the compared rows (mapped through perm and query_of). Counts the twins by relation;
// `some_rows`: each twin compares some row.
void expect_exact_twins(const SafeTensorsFile& base, bool paged, const std::string& label,
                        std::map<std::string, int>& seen, bool some_rows) {
  for (const TwinPair& p : make_twins("p", base, true)) {
    if (p.reference) continue;
    const Case ca = case_from_file("a", p.a), cb = case_from_file("b", p.b);
    // a paged problem's twins stay paged, but those whose key count leaves the page size
    EXPECT_EQ(ca.paged.has_value(), paged && p.what.find("(both contiguous)") == std::string::npos) << p.what;
    const EvalResult ra = evaluate(ca, {}), rb = evaluate(cb, {});
    const RawTensor &oa = get(ra.golden, "out"), &ob = get(rb.golden, "out");
    const RawTensor &wa = get(ra.golden, "weights"), &wb = get(rb.golden, "weights");
    const RawTensor &la = get(ra.golden, "lse"), &lb = get(rb.golden, "lse");
    int rows = 0;
    for (std::int64_t b = 0; b < ca.B; ++b)
      for (std::int64_t h = 0; h < ca.Hq; ++h)
        for (std::int64_t i = 0; i < ca.Nq; ++i) {
          const auto row = static_cast<std::size_t>((b * ca.Hq + h) * ca.Nq + i);
          if (!p.rows[row]) continue;
          ++rows;
          const std::int64_t ib = p.query_of.empty() ? i : 0;
          if (!p.query_of.empty()) {
            ASSERT_EQ(p.query_of[static_cast<std::size_t>(b)], i) << p.what;
          }
          const auto rowb = static_cast<std::size_t>((b * cb.Hq + h) * cb.Nq + ib);
          if (p.lse_shift == 0) {
            ASSERT_EQ(bytes_at(la, row), bytes_at(lb, rowb)) << p.what << " problem " << label << " lse " << row;
          }
          for (std::int64_t e = 0; e < ca.Dv; ++e)
            ASSERT_EQ(bytes_at(oa, row * static_cast<std::size_t>(ca.Dv) + static_cast<std::size_t>(e)),
                      bytes_at(ob, rowb * static_cast<std::size_t>(cb.Dv) + static_cast<std::size_t>(e)))
                << p.what << " problem " << label << " out row " << row;
          for (std::int64_t j = 0; j < ca.Nk; ++j) {
            const std::int64_t jt = p.perm.empty() ? j : p.perm[static_cast<std::size_t>(j)];
            ASSERT_EQ(bytes_at(wa, row * static_cast<std::size_t>(ca.Nk) + static_cast<std::size_t>(j)),
                      bytes_at(wb, rowb * static_cast<std::size_t>(cb.Nk) + static_cast<std::size_t>(jt)))
                << p.what << " problem " << label << " weight " << j;
          }
        }
    if (some_rows) {
      EXPECT_GT(rows, 0) << p.what << " problem " << label << ": nothing compared";
    }
    ++seen[p.relation];
  }
}

TEST(ServingTwins, AreExactTransformations) {
  std::map<std::string, int> seen;
  for (int k = 0; k < 24; ++k) {
    const std::int64_t P = std::array<std::int64_t, 4>{1, 2, 3, 0}[k % 4];
    const vectors::ProblemSpec s = serving_spec(k, P);
    ASSERT_FALSE(vectors::problem_error(s)) << *vectors::problem_error(s);
    expect_exact_twins(vectors::make_problem(s, 700 + static_cast<std::uint64_t>(k)), P > 0, std::to_string(k), seen, true);
  }
  // paged problems: 18 of 24; the page order needs two pages, every one has a spare
  for (const char* r : {"page_layout", "page_order", "page_size", "paged_contiguous"}) EXPECT_EQ(seen[r], 18) << r;
  EXPECT_EQ(seen["split_size"], 12);
  EXPECT_GE(seen["decode_prefill"], 10);  // the problems with Nq > 1 (chunked and varlen)
  EXPECT_EQ(seen["batch_independence"], 24);
  EXPECT_EQ(seen["batch_invariance"], 48);  // B > 1 everywhere: row 0 alone and among others
  EXPECT_GE(seen["key_permutation"], 18);  // the twins of any case apply to paged ones too
  EXPECT_GE(seen["masked_zero"], 18);
  EXPECT_GE(seen["head_independence"], 10);
}

// The rows of a batch tensor [B, ...] as byte strings.
std::vector<std::string> batch_rows_of(const RawTensor& t) {
  std::vector<std::string> rows;
  const std::size_t per = t.data.size() / static_cast<std::size_t>(t.shape[0]);
  for (std::size_t r = 0; r < static_cast<std::size_t>(t.shape[0]); ++r)
    rows.emplace_back(reinterpret_cast<const char*>(t.data.data() + r * per), per);
  return rows;
}

// Batch invariance, worked by hand on a paged problem of three rows: row 0 alone (its table row,
// its lengths, its queries; the caches whole), and row 0 before a copy of it with reversed
// queries and rows 2, 1; only row 0 compared. Asked for only.
TEST(ServingTwins, BatchInvarianceTwins) {
  const vectors::ProblemSpec s = serving_spec(4, 3);  // chunked prefill, B 3
  const SafeTensorsFile base = vectors::make_problem(s, 42);
  const Case c = case_from_file("p", base);
  ASSERT_EQ(c.B, 3);
  for (const TwinPair& p : make_twins("p", base)) EXPECT_NE(p.relation, "batch_invariance");
  std::map<std::string, const TwinPair*> twins;
  const std::vector<TwinPair> all = make_twins("p", base, true);
  for (const TwinPair& p : all)
    if (p.relation == "batch_invariance") twins[p.tag] = &p;
  ASSERT_EQ(twins.size(), 2u);
  const auto q = batch_rows_of(*base.find("q")), table = batch_rows_of(*base.find("block_table")),
             lens = batch_rows_of(*base.find("seqlens_k"));
  const TwinPair& alone = *twins.at("alone");
  EXPECT_TRUE(alone.bitwise);
  EXPECT_EQ(batch_rows_of(*alone.b.find("q")), std::vector<std::string>{q[0]});
  EXPECT_EQ(batch_rows_of(*alone.b.find("block_table")), std::vector<std::string>{table[0]});
  EXPECT_EQ(batch_rows_of(*alone.b.find("seqlens_k")), std::vector<std::string>{lens[0]});
  EXPECT_EQ(alone.b.find("k_cache")->data, base.find("k_cache")->data);
  const TwinPair& regrouped = *twins.at("regrouped");
  EXPECT_EQ(batch_rows_of(*regrouped.b.find("block_table")),
            (std::vector<std::string>{table[0], table[0], table[2], table[1]}));
  EXPECT_EQ(batch_rows_of(*regrouped.b.find("seqlens_k")), (std::vector<std::string>{lens[0], lens[0], lens[2], lens[1]}));
  const auto rq = batch_rows_of(*regrouped.b.find("q"));
  ASSERT_EQ(rq.size(), 4u);
  EXPECT_EQ(rq[0], q[0]);
  EXPECT_EQ(rq[2], q[2]);
  EXPECT_NE(rq[1], q[0]);
  const std::size_t es = dtype_size(c.input_dtype), D = static_cast<std::size_t>(c.Dk);
  for (std::size_t e = 0; e < D; ++e)  // the first query vector, reversed
    EXPECT_EQ(rq[1].substr(e * es, es), q[0].substr((D - 1 - e) * es, es)) << e;
  for (const TwinPair* p : {&alone, &regrouped})
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        EXPECT_EQ(p->out_rows[static_cast<std::size_t>(b * c.Nq + i)] != 0, b == 0 && c.query_valid(b, i)) << p->tag;
}

// The same on random serving problems: page sizes, layouts, page orders, sequence kinds, group
// sizes, splits, causal alignments and windows drawn at random.
RC_GTEST_PROP(ServingTwinsProperty, AreExactOnRandomServingProblems, ()) {
  vectors::ProblemSpec s;
  s.dtype = *rc::gen::element(DType::F32, DType::BF16, DType::F16, DType::F64);
  s.B = *rc::gen::inRange<std::int64_t>(1, 4);
  s.Hkv = *rc::gen::inRange<std::int64_t>(1, 3);
  s.Hq = s.Hkv * *rc::gen::inRange<std::int64_t>(1, 4);
  s.Dk = *rc::gen::inRange<std::int64_t>(1, 5);
  s.Dv = *rc::gen::inRange<std::int64_t>(1, 5);
  s.page_size = *rc::gen::element<std::int64_t>(0, 1, 2, 3, 5);
  s.Nk = std::max<std::int64_t>(s.page_size, 1) * *rc::gen::inRange<std::int64_t>(1, 5);
  s.seqlens = *rc::gen::element(vectors::SeqlensKind::Decode, vectors::SeqlensKind::Chunked,
                                vectors::SeqlensKind::Varlen, vectors::SeqlensKind::Keys);
  s.Nq = *rc::gen::inRange<std::int64_t>(1, 6);
  s.causal = *rc::gen::element(Causal::None, Causal::TopLeft, Causal::BottomRight);
  if (*rc::gen::arbitrary<bool>())
    s.window = std::make_pair(*rc::gen::inRange<std::int64_t>(0, 3), *rc::gen::inRange<std::int64_t>(0, 3));
  s.kv_layout_hnd = *rc::gen::arbitrary<bool>();
  s.pages = *rc::gen::element(vectors::ProblemSpec::Pages::Ordered, vectors::ProblemSpec::Pages::Shuffled,
                              vectors::ProblemSpec::Pages::Shared);
  s.poison = s.dtype != DType::F64 && *rc::gen::arbitrary<bool>();
  s.kv_split_size = *rc::gen::inRange<std::int64_t>(0, 4);
  s.want_out_partial = s.want_lse_partial = s.kv_split_size > 0;
  s.masked_rows = MaskedRows::Zero;
  s.want_weights = s.want_lse = true;
  if (s.page_size == 0 && *rc::gen::arbitrary<bool>()) s.seqlens = vectors::SeqlensKind::None;
  RC_PRE(!vectors::problem_error(s));
  std::map<std::string, int> seen;
  expect_exact_twins(vectors::make_problem(s, *rc::gen::arbitrary<std::uint32_t>()), s.page_size > 0, "random", seen,
                     false);  // the middle query may see every key (causal_dependence: none compared)
  RC_ASSERT(!::testing::Test::HasFailure());
}

// The twins change what they say: the page twins store the keys differently, the batch twin
// changes batch row 0 (its rows of the reference differ) and keeps shared pages of the others, the
// decode twin has one query per batch row.
TEST(ServingTwins, ChangeWhatTheySay) {
  const vectors::ProblemSpec s = [] {
    vectors::ProblemSpec x = serving_spec(4, 3);  // chunked prefill, shared pages, B 3
    x.pages = vectors::ProblemSpec::Pages::Shared;
    return x;
  }();
  const SafeTensorsFile base = vectors::make_problem(s, 42);
  const Case c = case_from_file("p", base);
  ASSERT_TRUE(c.paged);
  std::set<std::string> relations;
  for (const TwinPair& p : make_twins("p", base)) {
    relations.insert(p.relation);
    const Case cb = case_from_file("b", p.b);
    if (p.relation == "page_layout") {
      EXPECT_NE(cb.paged->layout, c.paged->layout);
      EXPECT_NE(p.b.find("k_cache")->shape, p.a.find("k_cache")->shape);
    }
    if (p.relation == "page_order") {
      EXPECT_NE(cb.paged->block_table, c.paged->block_table);
    }
    if (p.relation == "page_size") {
      EXPECT_EQ(cb.paged->page_size, 1);
    }
    if (p.relation == "paged_contiguous") {
      EXPECT_FALSE(cb.paged);
    }
    if (p.relation == "decode_prefill") {
      EXPECT_EQ(cb.Nq, 1);
      EXPECT_EQ(p.query_of.size(), static_cast<std::size_t>(c.B));
    }
    if (p.relation == "batch_independence") {
      // batch row 0 reads new pages; the others the same ones
      const std::int64_t M = c.paged->table_width;
      EXPECT_GE(cb.paged->block_table[0], c.paged->pages);
      for (std::int64_t b = 1; b < c.B; ++b)
        for (std::int64_t m = 0; m * c.paged->page_size < c.key_length(b); ++m)
          EXPECT_EQ(cb.paged->block_table[static_cast<std::size_t>(b * M + m)],
                    c.paged->block_table[static_cast<std::size_t>(b * M + m)]);
      const EvalResult ra = evaluate(c, {}), rb = evaluate(cb, {});
      EXPECT_NE(bytes_at(get(ra.golden, "lse"), 0), bytes_at(get(rb.golden, "lse"), 0));
      EXPECT_NE(bytes_at(get(ra.golden, "out"), 0), bytes_at(get(rb.golden, "out"), 0));
      for (std::int64_t h = 0; h < c.Hq; ++h) EXPECT_FALSE(p.rows[static_cast<std::size_t>(h * c.Nq)]);
    }
  }
  for (const char* r : {"page_layout", "page_order", "page_size", "paged_contiguous", "decode_prefill",
                        "batch_independence"})
    EXPECT_TRUE(relations.count(r)) << r;
}

using testing::run;

std::string serving_kernel(const std::string& options) {
  return "'/usr/bin/python3 " + std::string(ATTNORACLE_SOURCE_DIR) +
         "/conformance/adapters/serving_numpy/attention.py " + options + "'";
}

class ServingInvariants : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists("/usr/bin/python3"))
      GTEST_SKIP() << "skipped: /usr/bin/python3 with NumPy (Debian python3-numpy) is not installed";
    dir_ = std::filesystem::temp_directory_path() /
           ("attnoracle-serving-inv-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string common(int problems) const {
    return " --shapes serving --problems " + std::to_string(problems) + " --failures " + (dir_ / "failures").string() +
           " --work " + (dir_ / "work").string();
  }
  std::filesystem::path dir_;
};

TEST_F(ServingInvariants, CorrectKernelsPass) {
  std::string out;
  const std::string json = (dir_ / "report.json").string();
  for (const char* kernel : {"--structure splitkv --split 64 --chunk 16", "--structure pagewise --arith fp32"}) {
    EXPECT_EQ(run("invariants --impl " + serving_kernel(kernel) + common(6) + " --json " + json, out), 0)
        << kernel << "\n" << out;
    EXPECT_NE(out.find(" 0 violated, 0 skipped"), std::string::npos) << out;
    std::ifstream in(json);
    const nlohmann::json report = nlohmann::json::parse(in);
    std::map<std::string, int> passed;
    for (const auto& r : report["relations"])
      if (r["status"] == "pass") ++passed[r["invariant"].get<std::string>()];
    // every serving relation met, on every paged problem (all 6), beside the others
    for (const char* r : {"page_layout", "page_order", "page_size", "paged_contiguous", "batch_independence"})
      EXPECT_EQ(passed[r], 6) << r;
    EXPECT_EQ(passed["split_size"], 3);  // problems 0, 2, 4
    EXPECT_GE(passed["decode_prefill"], 3);
    EXPECT_GE(passed["key_permutation"], 6);
  }
}

// Each bug meets the relation written for it (and others).
TEST_F(ServingInvariants, PlantedBugsAreCaught) {
  std::string out;
  for (const auto& [bug, relation] : std::vector<std::pair<std::string, std::string>>{
           {"table_batch0", "batch_independence"},
           {"page_boundary_off_by_one", "page_size"},
           {"last_page_wrong", "page_size"},
           {"split_off_by_one", "split_size"}}) {
    EXPECT_EQ(run("invariants --impl " + serving_kernel("--structure splitkv --split 64 --chunk 16 --bug " + bug) +
                      common(6),
                  out),
              1)
        << bug << "\n"
        << out;
    EXPECT_NE(out.find(" " + relation + " ("), std::string::npos) << bug << "\n" << out;
  }
}

}  // namespace
}  // namespace attnoracle::conformance
