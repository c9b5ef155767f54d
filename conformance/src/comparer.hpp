// The comparison of one case's result with its golden tensors, element by element: the state
// it keeps (the rows' limits and scales, the statistics of each tensor) and its parts, one file
// each: the judgement of one element and of one tensor (judge_element.cpp), the forward outputs
// (compare_forward.cpp), the gradients (compare_gradients.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/conformance/pictures.hpp"
#include "attnoracle/conformance/statistics.hpp"
#include "attnoracle/conformance/tolerance.hpp"
#include "element_scan.hpp"

namespace attnoracle::conformance::comparing {

constexpr double kComputeShare = 0.125;  // ulp of the output
constexpr std::int64_t kMinStatistics = 32;

struct Comparer {
  const Case& c;
  const SafeTensorsFile& golden;
  const SafeTensorsFile& result;
  const Profile& profile;
  CaseReport& rep;
  std::vector<RowLimits> limits;  // per row of row_magnitudes
  int emin = 0, precision = 0;    // of the output format: 1 - bias, p
  std::vector<RowScales> scales;  // the statistical tier's, per row of row_magnitudes
  Spread spread;
  std::vector<RowMagnitudes> mags;      // per row, as row_magnitudes
  PictureCollector* pictures = nullptr;  // when the report draws pictures
  // The relative systematic error the statistical tier allows the tensor being compared: dropout's
  // keep scale (dropout_scale_error) on out and the gradients, 0 elsewhere. It enters as a shift
  // of each z of at most sys_rel |x| / scale (Sample::add).
  double sys_rel = 0;
  double shift_of(double x, double scale) const { return sys_rel > 0 ? sys_rel * std::fabs(x) / scale : 0; }

  // Checks dtype and shape of a returned tensor; records the failure.
  const RawTensor* returned(const std::string& name, const std::vector<std::int64_t>& shape);
  void fail(const std::string& why) {
    rep.status = CaseStatus::Fail;
    if (rep.reason.empty()) rep.reason = why;
  }

  // The statistical tier's scale of element k of out, in row `row` (of row_magnitudes).
  double out_scale_at(std::size_t row, std::size_t k, double x, double bound, double vsum) const {
    return out_scale(profile, spread, scales[row], limits[row], unit_roundoff(c.dtype_of("out")), row, k, x, bound, vsum);
  }
  // A row's limits for a tensor of dtype t: the floor in t's subnormal spacing, not out's.
  RowLimits limits_in(std::size_t row, DType t) const {
    RowLimits L = limits[row];
    L.floor += 2 * (min_subnormal(t) - min_subnormal(c.dtype_of("out")));
    return L;
  }

  // Per-tensor accumulation.
  struct Acc {
    TensorReport t;
    double sum = 0, sum_tz = 0, sum_sq = 0;
    std::int64_t stat_n = 0;
    Sample sample;              // the statistical tier's normalised errors
    BiasSample bias;            // its bias test's sums (out of sdpa)
    std::int64_t unsampled = 0;  // compared elements outside the sample
    int diagnosis_tensor = -2;   // Diagnosis::tensor_index of the tensor, once known
  };

  // Element k of out (row `row`), y against x_hi + x_lo, into the bias test.
  void bias_add(Acc& acc, std::size_t row, std::size_t k, double y, double x_hi, double x_lo, double bound,
                double vsum) const {
    acc.bias.add(static_cast<std::int64_t>(row), (y - x_hi) - x_lo, x_hi,
                 out_rest_scale(profile, spread, scales[row], limits[row], row, k, x_hi, bound, vsum),
                 unit_roundoff(c.dtype_of("out")), min_subnormal(c.dtype_of("out")), precision);
  }

  // The constants of element()'s dtype (that of the returned tensors), looked up when it changes.
  DType fmt_dtype = DType::BOOL;
  int fmt_emin = 0, fmt_precision = 0;
  double fmt_u = 0, fmt_min_normal = 0;
  void format_of(DType t) {
    const FloatFormat f = float_format(t);
    fmt_dtype = t;
    fmt_emin = 1 - f.bias;
    fmt_precision = f.precision;
    fmt_u = unit_roundoff(t);
    fmt_min_normal = min_normal(t);
  }

  // One element: y against x = x_hi + x_lo, with limit `lim` (after the safety factor) and the
  // bound used by the bound error. `alt`: an undecided element's other candidate (bits).
  // `compute`: the part of the (unscaled) limit that is not the final rounding; negative when
  // the element takes no part in the statistics. `scale`: the element's scale under the
  // statistical tier's model, in `row`; negative when it takes no part in the tier.
  void element(Acc& acc, const RawTensor& got, const RawTensor& gold, std::size_t k, double x_hi, double x_lo,
               double bound, double lim, double compute, double scale, std::int64_t row,
               const std::uint64_t* alt = nullptr);

  // The statistics of an element that takes part (compute >= 0, d finite, x_hi finite, nonzero).
  void statistics(Acc& acc, double y, double x_hi, double x_lo, double compute) {
    const double ulp_x = ulp_of(x_hi, x_lo, emin, precision);
    if (compute <= kComputeShare * ulp_x) {
      const double e = ((y - x_hi) - x_lo) / ulp_x;
      acc.sum += e;
      acc.sum_tz += x_hi > 0 ? -e : e;  // positive when the error points toward zero
      acc.sum_sq += e * e;
      ++acc.stat_n;
    }
  }

  // TOSA-style statistics on the elements where the final rounding dominates (computing error
  // at most kComputeShare ulp): rounding to nearest leaves errors of mean 0 and root mean square
  // 1/sqrt(12) ulp; truncation leaves a mean near 1/2 ulp toward zero. Allowed: the computing
  // share plus three standard deviations of the mean of n uniform errors.
  // Then the statistical tier; the tensor's report joins the case's.
  void finish(Acc& acc);

  // A golden tensor (refused as bad input when missing), and the undecided elements of one.
  const RawTensor* gold(const std::string& name);
  Undecided undecided(const std::string& name);

  // dq, dk, dv, dbias, dsinks (TOLERANCE.md, "Gradients"): per element, and the statistical
  // tier per tensor.
  void gradients();
  // Kind mha's dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, dbias, dsinks (TOLERANCE.md, "Gradients of
  // kind mha"): per element, and the statistical tier per tensor.
  void mha_gradients();

  // The whole case: out, weights, lse, scores, then the gradients; the case's reason last.
  void run();
};

// The case as the implementation is given it (case_for), read.
Case declared_case(const std::string& id, const SafeTensorsFile& golden, const Profile& p);

}  // namespace attnoracle::conformance::comparing
