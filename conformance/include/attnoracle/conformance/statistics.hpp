// The statistical tier of the verdict (conformance/TOLERANCE.md, "The statistical tier"): each
// element's error divided by its scale under a probabilistic model of the declared arithmetic
// (independent roundings, sqrt(n) u in place of n u), and three tests per tensor on those
// normalised errors: the root mean square, the 99th percentile of their magnitude and their
// signed mean, each failing a correct implementation with probability below kFailureProbability;
// for out of sdpa the bias test besides (BiasSample), with P's roundings independent per value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attnoracle/conformance/profile.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

// What the model needs of the exact weights w_j of each row, computed in double from the inputs
// (sdpa only). kr_j is the bound of weight j's own relative error: its score, the subtraction of
// the maximum, exp, the division and P's rounding, independent roundings added in quadrature.
struct Spread {
  bool exact = false;            // false for mha: the scales are taken on out.bound instead
  // per row [B, Hq, Nq]
  std::vector<double> key_sum;   // sqrt(sum_j (w_j kr_j)^2)
  std::vector<double> key_max;   // max_j kr_j
  std::vector<double> z_part;    // sqrt(sum_k W_k^2), W_k = sum_{j <= k} w_j: Z's summation
  // per element of out
  std::vector<double> key;       // sqrt(sum_j (w_j (v_jc - x_c) kr_j)^2): the weights' errors on out
  std::vector<double> wv;        // sqrt(sum_j (w_j v_jc)^2): the products of P V
  std::vector<double> partial;   // sqrt(sum_k P_k^2), P_k = sum_{j <= k} w_j v_jc: its sums
                                 // (empty where wv holds sqrt(wv^2 + partial^2): stored_spread)
  // The bias test (TOLERANCE.md, "P's roundings: the bias test"): per direction d, the roots of
  // the proxies of sum_k s_dk (P's roundings' part of out_k's error), s_0 = 1, s_1 = sign(x),
  // over the even bins (p_bias[2 d]) and the odd ones (p_bias[2 d + 1])
  double p_bias[4] = {0, 0, 0, 0};
  // P in E4M3 (its subnormals start at 2^-6 of the row maximum's weight), over the keys whose
  // P_j = w_j / max_j w_j is below P's smallest normal, with 1 / l = max_j w_j: per row
  // max_j w_j sqrt(their count) (sub_l) and sqrt(sum_j w_j^2) over every key (w_norm); per element
  // of out max_j w_j sqrt(sum_j v_jc^2) over them (sub_v). Empty for other profiles.
  std::vector<double> sub_l, w_norm, sub_v;
  // Per row, lse's part of the roundings a kernel makes once for many rows (the softmax scale,
  // FP8 descales, a stored k's scale: TOLERANCE.md, "Roundings shared across rows"): the bound
  // of that part of the row's lse error over the row's lse scale (without the output's final
  // rounding and the floors, so at most the scale the gate divides by): a bounded shift of z.
  std::vector<double> lse_shared;
};
Spread weight_spread(const Case& c, const Profile& p);

// The roundings a kernel makes once for many rows (TOLERANCE.md, "Roundings shared across rows"):
// `factor`, the relative bound of those that scale every score; `k`, the unit roundoff of a
// stored k's element x scale (0 without stored K/V).
struct SharedRoundings {
  double factor = 0, k = 0;
};
SharedRoundings shared_roundings(const Case& c, const Profile& p);
// Spread::lse_shared where the spread lacks it (a stored model): from the rows' magnitudes, at
// least weight_spread's.
void bound_lse_shared(const Case& c, const Profile& p, const std::vector<RowMagnitudes>& mags, Spread& sp);

// Per row, for mha (no weights computed): linear bounds of the same contributions, on out.bound.
struct RowScales {
  double key_rel = 0;   // relative error of one weight that is its own
  double sum_rel = 0;   // relative error of Z's summation
  double pv = 0;        // u of the P V accumulation
  double extra = 0;     // the projections' relative error on out.bound
  double score = 0;     // error of a score (lse)
  double log_abs = 0;   // log's own error (lse)
};
RowScales row_scales(const Profile& p, const Case& c, const RowMagnitudes& m);

// The scale of one element's error under the model (TOLERANCE.md): the root of the sum of the
// squared bounds of its independent contributions, over sqrt 3 (a rounding error uniform in
// [-b, b] has variance b^2 / 3), plus the worst-case limit's underflow floors. `row`, `k`: the
// element's row and flat index in `sp`; with sp.exact false, the RowScales bounds on `bound`.
double out_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                 std::size_t row, std::size_t k, double x, double bound, double vsum);
double weight_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                    std::size_t row, double x);
double lse_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, double u_out,
                 std::size_t row, double x);
// weight_scale's terms that depend on the row only, taken once for all its weights: at(x) is
// weight_scale(p, sp, s, L, u_out, row, x), bit for bit.
struct RowWeightScale {
  double rel = 0, floor = 0, p_sub = 0;
  double at(double x) const { return rel * std::fabs(x) / std::sqrt(3.0) + floor + p_sub; }
};
RowWeightScale row_weight_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L,
                                double u_out, std::size_t row);

// The scale of out's error without P's roundings and the final rounding (the bias test's rest,
// whose elements within a row may depend on each other).
double out_rest_scale(const Profile& p, const Spread& sp, const RowScales& s, const RowLimits& L, std::size_t row,
                      std::size_t k, double x, double bound, double vsum);

// The failure probability of each test, for a correct implementation under the model.
inline constexpr double kFailureProbability = 1e-6;
inline constexpr std::int64_t kMinSample = 32;  // fewer normalised errors: no test

// The normalised errors of one tensor: z = (y - x) / scale, the nonzero ones kept, the zeros
// only counted. Each element comes with `share`, the part of its scale^2 that is its own final
// rounding (final_share), independent of every other element's; the rest may depend on the
// other elements of its row. Rows are independent in the model. The elements of a row are added
// one after the other.
struct Sample {
  std::vector<double> z;
  std::int64_t zeros = 0;
  std::int64_t rows = 0;
  double row_mean_sq = 0;  // sum over the closed rows of their mean z^2
  double sum = 0;          // of z
  double own = 0;          // sum of the shares
  double shared = 0;       // sum over the closed rows of (sum over the row of sqrt(1 - share))^2
  // A systematic shift of z bounded per element (dropout's keep scale: TOLERANCE.md, "Dropout"):
  // its largest, its sum, and the sum over the closed rows of their mean shift^2.
  double shift_max = 0, shift_sum = 0, row_mean_shift_sq = 0;
  void add(std::int64_t row, double zi, double share, std::int64_t count = 1, double shift = 0) {
    if (count <= 0) return;
    if (row != last_row_) {
      close();
      ++rows;
      last_row_ = row;
    }
    share = std::clamp(share, 0.0, 1.0);
    const double n = static_cast<double>(count);
    if (shift > 0) {
      shift_max = std::max(shift_max, shift);
      shift_sum += n * shift;
      row_shift_sq_ += n * shift * shift;
    }
    row_n_ += count;
    own += n * share;
    row_rest_ += n * std::sqrt(1 - share);
    if (zi == 0) {
      zeros += count;
      return;
    }
    for (std::int64_t k = 0; k < count; ++k) z.push_back(zi);
    sum += n * zi;
    row_sq_ += n * zi * zi;
  }
  void close() {
    if (row_n_ > 0) row_mean_sq += row_sq_ / static_cast<double>(row_n_);
    if (row_n_ > 0) row_mean_shift_sq += row_shift_sq_ / static_cast<double>(row_n_);
    shared += row_rest_ * row_rest_;
    row_sq_ = row_rest_ = row_shift_sq_ = 0;
    row_n_ = 0;
  }
  std::int64_t size() const { return static_cast<std::int64_t>(z.size()) + zeros; }
  // A bounded shift of z per row, one element a row (lse's shared roundings: Spread::lse_shared),
  // taken for every row at once: its largest, its sum, the sum of its squares.
  void add_row_shifts(const std::vector<double>& shift) {
    for (double r : shift) {
      shift_max = std::max(shift_max, r);
      shift_sum += r;
      row_mean_shift_sq += r * r;
    }
  }

 private:
  std::int64_t last_row_ = -1, row_n_ = 0;
  double row_sq_ = 0, row_rest_ = 0, row_shift_sq_ = 0;
};

// The root of a sum of squares, scaled as it goes (no overflow, no underflow: LAPACK's dnrm2).
struct RootSumSquares {
  double scale = 0, sum = 0;
  void add(double c) {
    const double a = std::fabs(c);
    if (std::isinf(a)) {  // an overflowed bound: the root is infinite (the test says nothing)
      scale = a;
      sum = 1;
    } else if (a > scale) {
      sum = 1 + sum * (scale / a) * (scale / a);
      scale = a;
    } else if (a > 0) {
      sum += (a / scale) * (a / scale);
    }
  }
  double root() const { return scale * std::sqrt(sum); }
};

// The bias test's sums over out (TOLERANCE.md, "P's roundings: the bias test"): per direction
// d the observed T_d = sum_k s_dk (y_k - x_k); each element's final rounding, max(u_out |x_k|,
// s_out / 2) / sqrt 3 (s_out the output's smallest subnormal) by the bin of |x_k| in the output
// format (values within a bin may round alike); the rest of each row added linearly. Rows are
// added one after the other.
struct BiasSample {
  double t[2] = {0, 0};
  RootSumSquares rest;  // over the closed rows of (sum over the row of rest)
  std::int64_t n = 0;
  std::vector<std::pair<std::uint64_t, double>> finals;  // (bin of |x|, its final rounding's bound / sqrt 3)
  void add(std::int64_t row, double err, double x, double rest_k, double u_out, double sub_out, int precision) {
    if (row != last_row_) {
      close();
      last_row_ = row;
    }
    ++n;
    t[0] += err;
    t[1] += x > 0 ? err : (x < 0 ? -err : 0);
    row_rest_ += rest_k;
    finals.emplace_back(value_bin(x, precision), std::max(u_out * std::fabs(x), sub_out / 2) / std::sqrt(3.0));
  }
  void close() {
    rest.add(row_rest_);
    row_rest_ = 0;
  }
  // Bins of |x| of relative width 2 to 4 u (u = 2^-precision), at least an ulp of the format:
  // the bits of the double |x| above its top precision - 2 bits of significand.
  static std::uint64_t value_bin(double x, int precision) {
    std::uint64_t b;
    const double a = std::fabs(x);
    std::memcpy(&b, &a, sizeof b);
    return b >> (52 - (precision - 2));
  }

 private:
  std::int64_t last_row_ = -1;
  double row_rest_ = 0;
};
// The root of the proxy of a sum of groups of values in bins: the coefficients of a bin add (its
// values may round alike), bins two apart are independent, neighbours may not be: the sums over
// the even bins and over the odd ones each have independent terms, and their roots add.
// Sorts `bins` (bin, coefficient), in place; the two roots (even, odd), and their sum.
std::pair<double, double> binned_parts(std::vector<std::pair<std::uint64_t, double>>& bins);
double binned_root(std::vector<std::pair<std::uint64_t, double>>& bins);

// The share of scale^2 that is the final rounding u_out |x| / sqrt 3.
inline double final_share(double u_out, double x, double scale) {
  const double f = u_out * std::fabs(x) / std::sqrt(3.0) / scale;
  return std::min(1.0, f * f);
}

struct Tier {
  std::int64_t n = 0, rows = 0;
  // observed; rms over the rows of each row's mean z^2 (the plain one for rows of equal size)
  double rms = 0, q99 = 0, mean = 0;
  double rms_limit = 0, q99_limit = 0, mean_limit = 0;
  // the bias test (out of sdpa): T_d over its scale, the larger of the two directions (d = 1:
  // away from zero), and the limit sqrt(2 ln(2 / delta))
  double bias = 0, bias_limit = 0;
  int bias_direction = 0;
  bool bias_tested = false;
  double headroom = 0;  // min over the tests of limit / observed (infinite when every error is 0)
  bool tested = false;  // at least kMinSample elements
  bool ok = true;
  std::string note;     // why it failed
};
// The limits for n elements over `rows` independent rows (TOLERANCE.md):
//   99th percentile of |z| <= sqrt(2 ln(200 / delta))
//   mean over the rows of their mean z^2 <= 2 ln 2 + 4 ln(1 / delta) / rows
//   |mean z| <= sqrt(2 ln(2 / delta)) (sqrt(sum share) + sqrt(sum_rows (sum_row sqrt(1 - share))^2)) / n
// Closes the sample's last row; leaves s.z as the magnitudes |z|, in another order.
Tier judge(Sample& s);
// judge, with the bias test on `b` (P's part from `sp`) when it has kMinSample elements.
Tier judge(Sample& s, BiasSample& b, const Spread& sp);

}  // namespace attnoracle::conformance
