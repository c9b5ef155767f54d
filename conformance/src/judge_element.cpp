// The judgement of one element (its error against its limit, the worst ones, the statistics it
// enters) and of one tensor (the statistics and the statistical tier over its elements).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/round.hpp"
#include "comparer.hpp"

namespace attnoracle::conformance::comparing {

const RawTensor* Comparer::returned(const std::string& name, const std::vector<std::int64_t>& shape) {
  const RawTensor* t = result.find(name);
  if (!t) {
    fail("the result has no tensor '" + name + "'");
    return nullptr;
  }
  const DType want = c.dtype_of(name);
  if (t->dtype != want || t->shape != shape) {
    std::string s;
    // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&.
    for (auto d : t->shape) (s.empty() ? s : s += ',') += std::to_string(d);
    std::string w;
    for (auto d : shape) (w.empty() ? w : w += ',') += std::to_string(d);
    fail(name + " is " + std::string(dtype_name(t->dtype)) + " [" + s + "], expected " +
         std::string(dtype_name(want)) + " [" + w + "]");
    return nullptr;
  }
  return t;
}

void Comparer::element(Acc& acc, const RawTensor& got, const RawTensor& gold, std::size_t k, double x_hi,
                       double x_lo, double bound, double lim, double compute, double scale, std::int64_t row,
                       const std::uint64_t* alt) {
  const DType t = got.dtype;
  if (t != fmt_dtype) format_of(t);
  const std::size_t w = width_of(t);
  const double y = decode_value(t, got.data.data() + k * w);
  std::uint64_t yb = 0;
  std::memcpy(&yb, got.data.data() + k * w, w);
  // The golden element when it is in t; else (a tensor judged in a dtype of its own, against
  // its .ref) t's rounding of the F64 reference, shown in reports only.
  const bool same = gold.dtype == t;
  std::uint64_t gb = 0;
  if (same) gb = bits_of(gold, k);
  else if (std::isfinite(x_hi)) encode_float(t, round_double(x_hi, t), reinterpret_cast<unsigned char*>(&gb));
  // the golden value (or its other candidate) has error 0
  const double d = (same && yb == gb) || (alt && yb == *alt) ? 0 : abs_error(y, x_hi, x_lo, t);
  const double ratio = d == 0 ? 0 : (lim > 0 ? d / lim : INFINITY);
  // ulp_error and bound_error of d, with t's constants looked up once
  const double ulp = d == 0 || std::isinf(d) ? d : d / ulp_of(x_hi, x_lo, fmt_emin, fmt_precision);
  const double be = d == 0 || std::isinf(d) ? d : d / std::max(bound * fmt_u, fmt_min_normal);
  ++acc.t.compared;
  acc.t.worst_ulp = std::max(acc.t.worst_ulp, ulp);
  acc.t.worst_bound_error = std::max(acc.t.worst_bound_error, be);
  if (acc.diagnosis_tensor == -2) acc.diagnosis_tensor = Diagnosis::tensor_index(got.name);
  rep.diagnosis.record(acc.diagnosis_tensor, got.shape, k, x_hi + x_lo, y, ratio);
  if (pictures) pictures->record(got.name, k, ratio);
  if (ratio > 1) {
    ++rep.failed_elements;
    ++acc.t.over_limit;
  }
  if (lim > acc.t.largest_limit) acc.t.largest_limit = lim;
  if (ratio > acc.t.worst_ratio || acc.t.compared == 1) acc.t.worst_ratio = std::max(acc.t.worst_ratio, ratio);
  const bool worst_case = !rep.worst || ratio > rep.worst->limit_ratio;
  const bool worst_tensor = ratio > 0 && (!acc.t.worst || ratio > acc.t.worst->limit_ratio);
  if (worst_case || worst_tensor) {
    const ElementReport er{got.name, unflatten(k, got.shape), t, x_hi + x_lo, gb, y, yb, ulp, be, ratio, d, lim};
    if (worst_case) rep.worst = er;
    if (worst_tensor) acc.t.worst = er;
  }
  // Statistics only where the final rounding dominates: there a correct implementation's
  // errors are its rounding errors, independent and unbiased, within half an ulp plus the
  // small computing error.
  if (compute >= 0 && std::isfinite(d) && std::isfinite(x_hi) && x_hi != 0) {
    statistics(acc, y, x_hi, x_lo, compute);
  }
  if (scale > 0 && std::isfinite(scale) && std::isfinite(d) && std::isfinite(x_hi))
    acc.sample.add(row, d == 0 ? 0 : ((y - x_hi) - x_lo) / scale, final_share(fmt_u, x_hi, scale), 1,
                   shift_of(x_hi, scale));
  else
    ++acc.unsampled;
}

// TOSA-style statistics on the elements where the final rounding dominates (computing error
// at most kComputeShare ulp): rounding to nearest leaves errors of mean 0 and root mean square
// 1/sqrt(12) ulp; truncation leaves a mean near 1/2 ulp toward zero. Allowed: the computing
// share plus three standard deviations of the mean of n uniform errors.
void Comparer::finish(Acc& acc) {
  TensorReport& t = acc.t;
  if (acc.stat_n > 0) {
    const double n = static_cast<double>(acc.stat_n);
    t.mean_bound_error = acc.sum / n;
    t.mean_toward_zero = acc.sum_tz / n;
    t.rms_bound_error = std::sqrt(acc.sum_sq / n);
    if (acc.stat_n >= kMinStatistics) {
      const double mlim = kComputeShare + 3 * std::sqrt(1.0 / 12 / n);
      const double rlim = 0.5 + kComputeShare;
      char buf[200];
      if (std::fabs(t.mean_bound_error) > mlim || std::fabs(t.mean_toward_zero) > mlim) {
        std::snprintf(buf, sizeof buf,
                      "biased rounding: mean error %.3g ulp (%.3g toward zero) over %lld elements, allowed %.3g",
                      t.mean_bound_error, t.mean_toward_zero, static_cast<long long>(acc.stat_n), mlim);
        t.statistics_ok = false;
        t.statistics_note = buf;
      } else if (t.rms_bound_error > rlim) {
        std::snprintf(buf, sizeof buf, "root mean square error %.3g ulp exceeds %.3g", t.rms_bound_error, rlim);
        t.statistics_ok = false;
        t.statistics_note = buf;
      }
      if (!t.statistics_ok) fail(t.tensor + ": " + t.statistics_note);
    }
  }
  if (const RawTensor* r = result.find(t.tensor)) t.dtype = r->dtype;
  t.tier = judge(acc.sample, acc.bias, spread);
  if (t.tier.tested && !t.tier.ok) fail(t.tensor + ": " + t.tier.note);
  rep.tensors.push_back(t);
}

const RawTensor* Comparer::gold(const std::string& name) {
  const RawTensor* t = golden.find(name);
  if (!t) throw InputError(rep.id, name, "golden tensor missing");
  return t;
}
Undecided Comparer::undecided(const std::string& name) {
  Undecided u;
  const RawTensor* idx = golden.find(name + ".undecided");
  const RawTensor* alt = golden.find(name + ".alt");
  if (!idx || !alt) return u;
  for (std::size_t k = 0; k < idx->data.size() / 8; ++k) {
    std::int64_t at;
    std::memcpy(&at, idx->data.data() + 8 * k, 8);
    u.emplace_back(at, bits_of(*alt, k));
  }
  std::stable_sort(u.begin(), u.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Undecided last;  // of equal indices, the last listed
  for (std::size_t k = 0; k < u.size(); ++k)
    if (k + 1 == u.size() || u[k + 1].first != u[k].first) last.push_back(u[k]);
  return last;
}

}  // namespace attnoracle::conformance::comparing
