// The fast path's hot loops in SIMD lanes, chosen at run time for the processor (simd.cpp);
// every result is bit-identical to the scalar code's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace attnoracle::fast {

// Keys per block of a transposed key matrix: kt[(block * len + e) * kKeyBlock + l] holds
// element e of key block * kKeyBlock + l (0 past the last key).
inline constexpr std::size_t kKeyBlock = 8;

// Blocks of a row of n keys, and the keys k[groups, n, len] (row-major) transposed into them,
// `groups` runs of key_blocks(n) blocks each.
inline std::int64_t key_blocks(std::int64_t n) {
  return (n + static_cast<std::int64_t>(kKeyBlock) - 1) / static_cast<std::int64_t>(kKeyBlock);
}
std::vector<double> transpose_keys(const double* k, std::int64_t groups, std::int64_t n, std::int64_t len);
// Blocks [b0, b1) of one group's keys k[n, len] into kt[(b1 - b0) * len * kKeyBlock], laid out as
// transpose_keys lays them (0 past the last key).
void transpose_key_blocks(const double* k, std::int64_t n, std::int64_t len, std::int64_t b0, std::int64_t b1,
                          double* kt);

// Keys per chunk of the tiled passes over a head's keys and values (fast_rows, the floor): every
// row of a tile runs over one chunk while it is in cache, 128 KB of keys or values at D = 128.
inline constexpr std::int64_t kDotChunkBlocks = 16;  // key blocks of kKeyBlock keys

// Dot2 of q[0, len) with every key of `blocks` consecutive blocks of kt: sh, sl and sabs
// [blocks * kKeyBlock] receive, per key, the running sum, its compensation and sum |q_e k_e|
// rounded, exactly as ball.hpp's dot2 forms them before its final two_sum. With
// exact_products (every q_e k_e exact in F64: see short_significands) TwoProd's residual, then
// 0, is left out: the same values (sl may differ in the sign of a zero).
void dot2_blocks(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                 double* sl, double* sabs, bool exact_products = false);
// The same in plain scalar code (the reference the SIMD lanes are tested against).
void dot2_blocks_scalar(const double* q, const double* kt, std::int64_t len, std::int64_t blocks, double* sh,
                        double* sl, double* sabs, bool exact_products = false);
// Whether every x[i] (0 or normal) has a significand of at most 26 bits: a product of two such
// numbers has at most 52 and is exact in F64 where it does not underflow (the fast path's input
// range rules that out: |x| >= 2^-480). F32, F16 and BF16 values all have.
bool short_significands(const double* x, std::size_t n);
inline constexpr std::uint64_t kLowBits = (std::uint64_t{1} << 27) - 1;  // the bits short ones lack
// The or of x[i]'s bits kLowBits, in scalar code (short_significands' reference).
std::uint64_t low_bits_scalar(const double* x, std::size_t n);
// How many x[i] are neither 0 nor within [kMinInput, kMaxInput] in magnitude (NaN is not).
std::size_t out_of_range(const double* x, std::size_t n);
std::size_t out_of_range_scalar(const double* x, std::size_t n);
// Rows [rows, nd] of v folded into the column ranges: vmin[c] = std::min(vmin[c], v[r][c]),
// vmax the same with std::max, absmin and absmax of |v[r][c]|, row after row.
void value_ranges(std::size_t nd, std::size_t rows, const double* v, double* vmin, double* vmax, double* absmin,
                  double* absmax);
// One pass: out_of_range's count, returned, and short_significands in short_sig (both of them
// are this scan).
std::size_t input_scan(const double* x, std::size_t n, bool& short_sig);
// One pass over rows of values: value_ranges, and out_of_range's count of them, returned (the
// ranges are of use only where it is 0).
std::size_t value_scan(std::size_t nd, std::size_t rows, const double* v, double* vmin, double* vmax, double* absmin,
                       double* absmax);
// The same in scalar code, over columns [from, nd).
void value_ranges_scalar(std::size_t from, std::size_t nd, std::size_t rows, const double* v, double* vmin,
                         double* vmax, double* absmin, double* absmax);

// exp_dd of count double-double arguments (xh[i], xl[i]), each in exp_dd's range.
void exp_dd_many(const double* xh, const double* xl, std::size_t count, double* rh, double* rl);

// One step of ball.hpp's BallSums: x y_c (x |y_c| if absolute) added to columns [0, count) of
// its running sums.
void ball_sum_lanes(std::size_t count, const double* y, bool absolute, double xh, double xl, double xr,
                    double* hi, double* lo, double* errsum, double* radsum, double* ymax);
// The same in scalar code, on columns [from, count).
void ball_sum_lanes_scalar(std::size_t from, std::size_t count, const double* y, bool absolute, double xh,
                           double xl, double xr, double* hi, double* lo, double* errsum, double* radsum,
                           double* ymax);
// n steps of ball_sum_lanes in order, term a adding (xh[a], xl[a], xr[a]) times row y[a] (|y[a]|
// if absolute): each column's sums stay in registers across the terms, the same bits as n calls.
void ball_sum_terms(std::size_t count, std::size_t n, const double* const* y, bool absolute, const double* xh,
                    const double* xl, const double* xr, double* hi, double* lo, double* errsum, double* radsum,
                    double* ymax);
// The same in scalar code (ball_sum_lanes_scalar term after term), on columns [from, count).
void ball_sum_terms_scalar(std::size_t from, std::size_t count, std::size_t n, const double* const* y, bool absolute,
                           const double* xh, const double* xl, const double* xr, double* hi, double* lo,
                           double* errsum, double* radsum, double* ymax);

// Keys per block of fast_row's P V column sums: each block is summed from zero, then added to
// the column's total (kBlockSum in error_bounds.hpp is the error bound of one block of 64).
inline constexpr std::size_t kSumBlock = 64;
inline constexpr std::size_t kSumChunk = 2 * kSumBlock;  // weights per chunk of the tiled P V pass

// fast_row's P V column sums: the totals (double-doubles, hi and lo) of the signed sums x y_c
// and of the magnitudes' x |y_c|.
struct PVColumns {
  double *num_hi, *num_lo, *mag_hi, *mag_lo;
};
// For a in [0, n), weight (xh[a], xl[a]) (xh[a] >= 0) times row y + rows[a] stride, added to columns
// [0, cols) of s: per block of kSumBlock weights, each column's sums start from zero and run
// like Dot2 (TwoProd and TwoSum on the high parts, the residuals and xl y in a binary64 chain);
// the block's TwoSum(hi, lo) is then added to the column's total by double-double addition.
void pv_sums(std::size_t cols, std::size_t n, const double* y, const std::int64_t* rows, std::size_t stride,
             const double* xh, const double* xl, const PVColumns& s);
// The same in scalar code, on columns [from, cols).
void pv_sums_scalar(std::size_t from, std::size_t cols, std::size_t n, const double* y, const std::int64_t* rows,
                    std::size_t stride, const double* xh, const double* xl, const PVColumns& s);

// For n balls (midpoint hi, lo and radius, three doubles each, as ball.hpp's Ball): lo[i] and
// hi[i], the F64 numbers round_down_dd(lower(ball)) and round_up_dd(upper(ball)) (fast_row.hpp).
void ball_ends(const double* balls, std::size_t n, double* lo, double* hi);
// The same by those functions, for i in [from, n) (decide.cpp).
void ball_ends_scalar(std::size_t from, std::size_t n, const double* balls, double* lo, double* hi);

// A row's per-key ball steps (fast_row.cpp's row_weights) in SIMD lanes, on n balls kept as
// three arrays (the midpoint's hi and lo, the radius). Each gives the bits of ball.hpp's
// operations; the _scalar versions are those operations, for a in [from, n). An output may be
// the array of an input of the same step (each key is read before it is written).
struct Ball;
struct BallArrays {
  double *hi, *lo, *rad;
};
// dot[a] = dot2_ball(sh[a], sl[a], sabs[a], dot_factor); score[a] = mul(scale, dot[a]), plus
// bias[a] by add(ball, double) where bias[a] != 0 (bias may be null: none). False where a score's
// midpoint or radius is not finite; else *max is the largest score midpoint hi.
bool score_balls(std::size_t n, const double* sh, const double* sl, const double* sabs, const double* bias,
                 double dot_factor, const Ball& scale, BallArrays dot, BallArrays score, double* max);
bool score_balls_scalar(std::size_t from, std::size_t n, const double* sh, const double* sl, const double* sabs,
                        const double* bias, double dot_factor, const Ball& scale, BallArrays dot,
                        BallArrays score, double* max);
// x[a] = add(score[a], -m), and exp_dd's argument (xh, xl): x's midpoint, or 0 below kExpMin.
// False where exp_applies(x[a]) does not hold.
bool exp_args(std::size_t n, BallArrays score, double m, BallArrays x, double* xh, double* xl);
bool exp_args_scalar(std::size_t from, std::size_t n, BallArrays score, double m, BallArrays x, double* xh,
                     double* xl);
// e[a] = exp(x[a]) given (eh[a], el[a]) = exp_dd of its argument: exp_ball, or [0, kTinyExp]
// below kExpMin.
void exp_balls(std::size_t n, BallArrays x, const double* eh, const double* el, BallArrays e);
void exp_balls_scalar(std::size_t from, std::size_t n, BallArrays x, const double* eh, const double* el,
                      BallArrays e);
// sum_a x[a] by ball.hpp's add(Ball, Ball), in kSumParts interleaved partial sums (keys a with
// the same a mod kSumParts, over the first n - n mod kSumParts keys), then those sums in order,
// then the last keys one by one: the same operations on every instruction set. Each step is a
// ball sum, so any grouping encloses the sum.
inline constexpr std::size_t kSumParts = 8;
Ball ball_total(std::size_t n, BallArrays x);
Ball ball_total_scalar(std::size_t n, BallArrays x);
// Their last steps: the kSumParts partial sums `parts` (of the first `whole` keys) in order, then
// keys [whole, n) of x one by one.
Ball ball_total_of_parts(BallArrays parts, std::size_t whole, std::size_t n, BallArrays x);
// out[a] = mul(x[a], y).
void mul_balls(std::size_t n, BallArrays x, const Ball& y, BallArrays out);
void mul_balls_scalar(std::size_t from, std::size_t n, BallArrays x, const Ball& y, BallArrays out);

// The instruction set the dispatch chose (for example "AVX3", "AVX2", "EMU128").
const char* simd_target();

}  // namespace attnoracle::fast
