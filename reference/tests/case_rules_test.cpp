// Case's rules, worked by hand: the kv head, key ranges, the first refused row, the golden
// tensors, the enum names; and parallel_for.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/parallel.hpp"

namespace attnoracle::testing {

// A case built in memory with the sizes and rules the tests set (no tensors unless given).
Case sized(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t Nq, std::int64_t Nk) {
  Case c;
  c.B = B, c.Hq = Hq, c.Hkv = Hkv, c.Nq = Nq, c.Nk = Nk, c.Dk = 2, c.Dv = 3;
  return c;
}

Case positions(std::int64_t Nq, std::int64_t Nk, Causal causal,
               std::optional<std::pair<std::int64_t, std::int64_t>> window = std::nullopt) {
  Case c = sized(1, 1, 1, Nq, Nk);
  c.causal = causal;
  if (window) std::tie(c.window, c.window_left, c.window_right) =
      std::make_tuple(true, window->first, window->second);
  return c;
}

std::vector<std::int64_t> kv_heads(const Case& c) {
  std::vector<std::int64_t> g;
  for (std::int64_t h = 0; h < c.Hq; ++h) g.push_back(c.kv_head(h));
  return g;
}

std::pair<std::int64_t, std::int64_t> range(const Case& c, std::int64_t i) {
  const Case::KeyRange r = c.key_range(0, i);
  return {r.first, r.last};
}

using Heads = std::vector<std::int64_t>;
using Range = std::pair<std::int64_t, std::int64_t>;

namespace {

TEST(CaseKvHead, GroupsOfEveryRatio) {
  EXPECT_EQ(kv_heads(sized(1, 4, 4, 1, 1)), (Heads{0, 1, 2, 3}));        // ratio 1
  EXPECT_EQ(kv_heads(sized(1, 4, 2, 1, 1)), (Heads{0, 0, 1, 1}));        // ratio 2
  EXPECT_EQ(kv_heads(sized(1, 6, 2, 1, 1)), (Heads{0, 0, 0, 1, 1, 1}));  // ratio 3
  EXPECT_EQ(kv_heads(sized(1, 5, 1, 1, 1)), (Heads{0, 0, 0, 0, 0}));     // MQA: ratio Hq
  Case mha = sized(1, 3, 3, 1, 1);
  mha.kind = Kind::Mha;
  EXPECT_EQ(kv_heads(mha), (Heads{0, 1, 2}));
}

TEST(CaseAlignedPosition, BottomRightShiftsByNkMinusNq) {
  EXPECT_EQ(positions(3, 5, Causal::None).aligned_position(0, 1), 1);
  EXPECT_EQ(positions(3, 5, Causal::TopLeft).aligned_position(0, 1), 1);
  EXPECT_EQ(positions(3, 5, Causal::BottomRight).aligned_position(0, 1), 3);
  EXPECT_EQ(positions(5, 3, Causal::BottomRight).aligned_position(0, 1), -1);
}

TEST(CaseKeyRange, WorkedByHand) {
  EXPECT_EQ(range(positions(3, 5, Causal::None), 2), (Range{0, 4}));
  EXPECT_EQ(range(positions(3, 5, Causal::TopLeft), 1), (Range{0, 1}));
  EXPECT_EQ(range(positions(3, 5, Causal::BottomRight), 0), (Range{0, 2}));
  EXPECT_EQ(range(positions(5, 3, Causal::TopLeft), 4), (Range{0, 2}));  // clipped to Nk - 1
  // bottom_right with more queries than keys: rows 0 and 1 sit before every key
  EXPECT_GT(positions(5, 3, Causal::BottomRight).key_range(0, 1).first,
            positions(5, 3, Causal::BottomRight).key_range(0, 1).last);
  EXPECT_EQ(range(positions(5, 3, Causal::BottomRight), 3), (Range{0, 1}));
  // windows: [a - L, a + R] around the aligned position a, clipped
  EXPECT_EQ(range(positions(3, 5, Causal::None, {{1, 1}}), 0), (Range{0, 1}));
  EXPECT_EQ(range(positions(3, 5, Causal::None, {{1, 1}}), 2), (Range{1, 3}));
  EXPECT_EQ(range(positions(3, 5, Causal::TopLeft, {{0, 5}}), 2), (Range{2, 2}));
  EXPECT_EQ(range(positions(3, 5, Causal::BottomRight, {{1, 0}}), 2), (Range{3, 4}));
  const Case far = positions(5, 3, Causal::None, {{0, 2}});
  EXPECT_GT(far.key_range(0, 3).first, far.key_range(0, 3).last);  // window past the last key
  const std::int64_t huge = 999999999999999999;
  EXPECT_EQ(range(positions(3, 2, Causal::BottomRight, {{huge, 0}}), 2), (Range{0, 1}));
  EXPECT_EQ(range(positions(2, 3, Causal::None, {{huge, huge}}), 0), (Range{0, 2}));
}

// Sequence lengths: batch 0 holds Lq = 2 queries and Lk = 5 keys in a batch padded to Nq = 4,
// Nk = 8; batch 1 is full. bottom_right aligns each batch to its own Lk - Lq (3, then 4), not
// to Nk - Nq = 4 for both.
TEST(CaseSeqlens, BottomRightAlignsPerBatch) {
  Case c = positions(4, 8, Causal::BottomRight);
  c.B = 2;
  c.seqlens_q = std::vector<std::int64_t>{2, 4};
  c.seqlens_k = std::vector<std::int64_t>{5, 8};
  EXPECT_EQ(c.aligned_position(0, 0), 3);
  EXPECT_EQ(c.aligned_position(0, 1), 4);
  EXPECT_EQ(c.aligned_position(1, 0), 4);
  auto keys = [&](std::int64_t b, std::int64_t i) {
    std::string s;
    for (std::int64_t j = 0; j < c.Nk; ++j) s += c.position_allowed(b, i, j) ? '1' : '0';
    return s;
  };
  EXPECT_EQ(keys(0, 0), "11110000");  // Nk - Nq would also allow key 4
  EXPECT_EQ(keys(0, 1), "11111000");  // the last query sees every key of its sequence
  EXPECT_EQ(keys(0, 2), "11111000");  // padding: clipped to Lk, never compared
  EXPECT_EQ(keys(1, 0), "11111000");
  EXPECT_EQ(keys(1, 3), "11111111");
  EXPECT_TRUE(c.query_valid(0, 1));
  EXPECT_FALSE(c.query_valid(0, 2));
  EXPECT_FALSE(c.query_valid(0, 3));
  EXPECT_TRUE(c.query_valid(1, 3));
  EXPECT_EQ(c.key_range(0, 0).last, 3);
  EXPECT_EQ(c.key_range(0, 3).last, 4);
  // a window follows the same alignment: [a - 1, a] around a = i + 3
  c.window = true, c.window_left = 1, c.window_right = 0;
  EXPECT_EQ(keys(0, 1), "00011000");
  EXPECT_EQ(keys(1, 1), "00001100");
  // decode: one query against 5 keys of 8
  c.window = false;
  c.seqlens_q = std::vector<std::int64_t>{1, 4};
  EXPECT_EQ(keys(0, 0), "11111000");
  EXPECT_FALSE(c.query_valid(0, 1));
  // no key at all: Lk = 0
  c.seqlens_k = std::vector<std::int64_t>{0, 8};
  EXPECT_GT(c.key_range(0, 0).first, c.key_range(0, 0).last);
}

// key_range against position_allowed tried on every key: the allowed keys are exactly the
// range, and a non-empty range lies in [0, Nk - 1].
RC_GTEST_PROP(CaseKeyRange, MatchesPositionAllowed, ()) {
  const auto Nq = *rc::gen::inRange<std::int64_t>(1, 13);
  const auto Nk = *rc::gen::inRange<std::int64_t>(1, 13);
  const auto causal =
      *rc::gen::element(Causal::None, Causal::TopLeft, Causal::BottomRight);
  const auto side = rc::gen::oneOf(rc::gen::inRange<std::int64_t>(0, 15),
                                   rc::gen::just<std::int64_t>(999999999999999999));
  std::optional<std::pair<std::int64_t, std::int64_t>> window;
  if (*rc::gen::arbitrary<bool>()) window = {{*side, *side}};
  Case c = positions(Nq, Nk, causal, window);
  if (*rc::gen::arbitrary<bool>()) c.seqlens_q = std::vector{*rc::gen::inRange<std::int64_t>(0, Nq + 1)};
  if (*rc::gen::arbitrary<bool>()) c.seqlens_k = std::vector{*rc::gen::inRange<std::int64_t>(0, Nk + 1)};
  for (std::int64_t i = 0; i < Nq; ++i) {
    const Case::KeyRange r = c.key_range(0, i);
    if (r.first <= r.last) RC_ASSERT(0 <= r.first && r.last <= c.key_length(0) - 1);
    for (std::int64_t j = 0; j < Nk; ++j)
      RC_ASSERT(c.position_allowed(0, i, j) == (r.first <= j && j <= r.last));
  }
}

// B = 2, Hq = 2, Nq = 3, Nk = 2, a full mask with the rows `empty` masked out.
Case masked(const std::vector<RowIndex>& empty) {
  Case c = sized(2, 2, 1, 3, 2);
  c.mask = BoolTensor{{2, 2, 3, 2}, std::vector<unsigned char>(24, 1)};
  for (const RowIndex& r : empty)
    for (std::int64_t j = 0; j < c.Nk; ++j)
      c.mask->values[static_cast<std::size_t>(((r.b * 2 + r.h) * 3 + r.i) * 2 + j)] = 0;
  return c;
}

std::optional<std::tuple<std::int64_t, std::int64_t, std::int64_t>> refused(const Case& c) {
  const auto r = c.first_refused_row();
  if (!r) return std::nullopt;
  return std::make_tuple(r->b, r->h, r->i);
}

using Row = std::tuple<std::int64_t, std::int64_t, std::int64_t>;

TEST(CaseFirstRefusedRow, OrderIsBatchHeadQuery) {
  EXPECT_EQ(refused(masked({})), std::nullopt);
  EXPECT_EQ(refused(masked({{1, 0, 0}, {0, 1, 2}})), (Row{0, 1, 2}));  // b first
  EXPECT_EQ(refused(masked({{0, 1, 0}, {0, 0, 2}})), (Row{0, 0, 2}));  // then h
  EXPECT_EQ(refused(masked({{1, 1, 2}, {1, 1, 1}})), (Row{1, 1, 1}));  // then i
}

TEST(CaseFirstRefusedRow, PaddingAndPolicyZeroAreNotRefused) {
  Case c = masked({{0, 1, 1}, {1, 0, 2}});
  EXPECT_FALSE(c.row_has_key(0, 1, 1));
  EXPECT_TRUE(c.row_has_key(0, 1, 0));
  c.query_mask = BoolTensor{{2, 3}, {1, 0, 1, 1, 1, 1}};  // query 1 of batch 0 is padding
  EXPECT_EQ(refused(c), (Row{1, 0, 2}));
  c.masked_rows = MaskedRows::Zero;
  EXPECT_EQ(refused(c), std::nullopt);
}

TEST(CaseFirstRefusedRow, BiasAndPositionsEmptyRowsToo) {
  Case c = sized(1, 1, 1, 2, 2);
  c.bias = FloatTensor{DType::F32, {2, 2}, {0, 1, -INFINITY, -INFINITY}};
  EXPECT_TRUE(c.allowed(0, 0, 1, 0) == false && c.allowed(0, 0, 0, 1));
  EXPECT_EQ(refused(c), (Row{0, 0, 1}));
  Case p = positions(3, 2, Causal::BottomRight);  // query 0 sits before key 0
  EXPECT_EQ(refused(p), (Row{0, 0, 0}));
}

std::vector<std::string> golden(const Case& c) {
  std::vector<std::string> g;
  for (const GoldenSpec& s : c.golden_tensors()) {
    std::string shape;
    // appended: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
    for (auto d : s.shape) (shape.empty() ? shape : shape += ',') += std::to_string(d);
    g.push_back(s.name + " " + std::string(dtype_name(s.dtype)) + " " + shape);
    EXPECT_TRUE(is_golden_tensor_name(s.name)) << s.name;
    EXPECT_TRUE(is_golden_tensor_name(s.name + ".undecided")) << s.name;
    EXPECT_TRUE(is_golden_tensor_name(s.name + ".alt")) << s.name;
  }
  return g;
}

using Names = std::vector<std::string>;

TEST(CaseGoldenTensors, PerOutputDtypeAndOutputs) {
  Case c = sized(2, 4, 2, 3, 5);  // Dv = 3
  EXPECT_EQ(golden(c), (Names{"out F32 2,4,3,3", "out.ref F64 2,4,3,3", "out.bound F64 2,4,3,3",
                              "row.valid BOOL 2,4,3"}));
  c.output_dtype = DType::F64;  // out.ref_lo only for F64 outputs
  EXPECT_EQ(golden(c), (Names{"out F64 2,4,3,3", "out.ref F64 2,4,3,3", "out.ref_lo F64 2,4,3,3",
                              "out.bound F64 2,4,3,3", "row.valid BOOL 2,4,3"}));
  c.output_dtype = DType::BF16;
  c.want_weights = c.want_lse = true;
  EXPECT_EQ(golden(c),
            (Names{"out BF16 2,4,3,3", "out.ref F64 2,4,3,3", "out.bound F64 2,4,3,3",
                   "row.valid BOOL 2,4,3", "weights BF16 2,4,3,5", "weights.ref F64 2,4,3,5",
                   "lse BF16 2,4,3", "lse.ref F64 2,4,3"}));
  c.output_dtype = DType::F16;
  c.want_weights = false;
  EXPECT_EQ(golden(c), (Names{"out F16 2,4,3,3", "out.ref F64 2,4,3,3", "out.bound F64 2,4,3,3",
                              "row.valid BOOL 2,4,3", "lse F16 2,4,3", "lse.ref F64 2,4,3"}));
  Case m = sized(2, 3, 3, 4, 5);
  m.kind = Kind::Mha;
  m.Dout = 7;
  EXPECT_EQ(m.out_shape(), (std::vector<std::int64_t>{2, 4, 7}));
  EXPECT_EQ(m.row_shape(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(golden(m).front(), "out F32 2,4,7");
}

TEST(CaseNames, RoundTripAndRefuseUnknownNames) {
  for (Kind k : {Kind::Sdpa, Kind::Mha}) EXPECT_EQ(kind_from_name(kind_name(k)), k);
  for (Causal c : {Causal::None, Causal::TopLeft, Causal::BottomRight})
    EXPECT_EQ(causal_from_name(causal_name(c)), c);
  for (MaskedRows m : {MaskedRows::Error, MaskedRows::Zero})
    EXPECT_EQ(masked_rows_from_name(masked_rows_name(m)), m);
  EXPECT_EQ(kind_name(Kind::Mha), "mha");
  EXPECT_EQ(causal_name(Causal::BottomRight), "bottom_right");
  EXPECT_EQ(masked_rows_name(MaskedRows::Zero), "zero");
  for (const char* s : {"", "SDPA", "sdpa ", "gqa"}) EXPECT_EQ(kind_from_name(s), std::nullopt);
  for (const char* s : {"", "top-left", "TopLeft", "causal", "bottom_right "})
    EXPECT_EQ(causal_from_name(s), std::nullopt);
  for (const char* s : {"", "Error", "zeros", "nan"})
    EXPECT_EQ(masked_rows_from_name(s), std::nullopt);
}

// ---- parallel_for ----

struct Failed {
  std::size_t index;
};

TEST(ParallelFor, EveryIndexOnce) {
  for (std::size_t n : {0, 1, 2, 7, 100})
    for (int threads : {0, 1, 2, 3, 8, 200}) {
      std::vector<std::atomic<int>> calls(n);
      parallel_for(n, threads, [&](std::size_t k) { ++calls.at(k); });
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_EQ(calls[k].load(), 1) << "n " << n << " threads " << threads << " index " << k;
    }
}

TEST(ParallelFor, SmallestFailingIndexIsRethrown) {
  // Index 5 fails late, every index after it at once: 5 is reported all the same.
  for (int threads : {1, 2, 3, 4, 8})
    for (int run = 0; run < 5; ++run) {
      try {
        parallel_for(64, threads, [](std::size_t k) {
          if (k == 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          if (k >= 5) throw Failed{k};
        });
        ADD_FAILURE() << "nothing thrown";
      } catch (const Failed& f) {
        EXPECT_EQ(f.index, 5u) << threads << " threads";
      }
    }
}

TEST(ParallelFor, NoIndexStartsAfterAFailure) {
  {  // one thread: exactly the indices up to the failing one
    std::vector<std::size_t> ran;
    EXPECT_THROW(parallel_for(100, 1,
                              [&](std::size_t k) {
                                ran.push_back(k);
                                if (k == 10) throw Failed{k};
                              }),
                 Failed);
    EXPECT_EQ(ran.size(), 11u);
  }
  // Several threads: past the failing index, only those already running when it failed.
  for (int threads : {2, 4}) {
    std::atomic<std::size_t> after{0};
    EXPECT_THROW(parallel_for(1000, threads,
                              [&](std::size_t k) {
                                if (k == 10) throw Failed{k};
                                if (k > 10) ++after;
                                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                              }),
                 Failed);
    EXPECT_LE(after.load(), 2u * static_cast<std::size_t>(threads - 1)) << threads << " threads";
  }
}

}  // namespace
}  // namespace attnoracle::testing
