// One case's verdict: every compared element within its limit, and unbiased on average.
#include "attnoracle/conformance/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/conformance/tolerance.hpp"

namespace attnoracle::conformance {

std::string_view status_name(CaseStatus s) {
  switch (s) {
    case CaseStatus::Pass: return "pass";
    case CaseStatus::Fail: return "fail";
    case CaseStatus::Skip: return "skip";
  }
  return "?";
}

namespace {

// The inputs and metadata of a golden file: what case_from_file keeps of it, without copying
// the golden tensors (most of the bytes) only to drop them.
SafeTensorsFile inputs_of(const SafeTensorsFile& golden) {
  SafeTensorsFile f;
  f.metadata = golden.metadata;
  for (const auto& t : golden.tensors)
    if (!is_golden_tensor_name(t.name)) f.tensors.push_back(t);
  return f;
}

// Where the profile returns lse in a dtype of its own and the case asks for lse in another,
// attn.output_dtypes of `md` (the case's metadata) gives lse that dtype; false when nothing changes.
bool declare_output_dtypes(const Case& c, const Profile& p, std::map<std::string, std::string>& md) {
  if (!p.lse_dtype || !c.want_lse || c.dtype_of("lse") == *p.lse_dtype) return false;
  std::string list;
  for (const auto& [name, t] : c.output_dtypes)
    if (name != "lse") list += name + ":" + std::string(dtype_name(t)) + ",";
  md["attn.output_dtypes"] = list + "lse:" + std::string(dtype_name(*p.lse_dtype));
  return true;
}

// The case as the implementation is given it (case_for), read.
Case declared_case(const std::string& id, const SafeTensorsFile& golden, const Profile& p) {
  Case c = case_from_file(id, inputs_of(golden));
  SafeTensorsFile f = c.file;
  if (declare_output_dtypes(c, p, f.metadata)) c = case_from_file(id, std::move(f));
  return c;
}

}  // namespace

SafeTensorsFile strip_golden(const SafeTensorsFile& golden) {
  return case_from_file("golden", inputs_of(golden)).file;  // golden tensors and reference keys dropped
}

SafeTensorsFile case_for(const SafeTensorsFile& golden, const Profile& profile) {
  Case c = case_from_file("golden", inputs_of(golden));
  declare_output_dtypes(c, profile, c.file.metadata);
  return std::move(c.file);
}

namespace {

// dtype_size, inline for the float formats the comparison reads element by element.
std::size_t width_of(DType t) {
  switch (t) {
    case DType::F64: return 8;
    case DType::F32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    default: return dtype_size(t);
  }
}
double finite_value(DType t, const unsigned char* p);
// decode_float, inline for finite F64, F32, F16 and BF16 elements.
double decode_value(DType t, const unsigned char* p) {
  switch (t) {
    case DType::F64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::F32: {
      float x;
      std::memcpy(&x, p, 4);
      return static_cast<double>(x);
    }
    case DType::F16:
    case DType::BF16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const std::uint16_t e = t == DType::F16 ? 0x7c00 : 0x7f80;  // all ones: infinite or NaN
      return (b & e) != e ? finite_value(t, p) : decode_float(t, p);
    }
    default: return decode_float(t, p);
  }
}

std::uint64_t bits_of(const RawTensor& t, std::size_t k) {
  std::uint64_t b = 0;
  const std::size_t w = width_of(t.dtype);
  std::memcpy(&b, t.data.data() + k * w, w);
  return b;
}
double sq(double x) { return x * x; }
double value_of(const RawTensor& t, std::size_t k) { return decode_value(t.dtype, t.data.data() + k * width_of(t.dtype)); }

// A fully masked row that is not padding: the contract refuses it under policy error.
bool has_refusable_row(const Case& c) {
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) return true;
  return false;
}

std::vector<std::int64_t> unflatten(std::size_t k, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = static_cast<std::int64_t>(k) % shape[d];
    k /= static_cast<std::size_t>(shape[d]);
  }
  return idx;
}

// Fast paths of the comparison. An element whose bits equal the golden element's, with it and
// the reference value finite, has error 0 (the first case of Comparer::element): it only counts
// (and, for out, enters the statistics). Blocks of such elements are recognised 16 bytes at a
// time; any other element goes through Comparer::element.
constexpr std::size_t kBlock = 64;

typedef std::uint32_t u32x4 __attribute__((vector_size(16)));
typedef std::uint16_t u16x8 __attribute__((vector_size(16)));

// Are elements [k, k + kBlock) of y and g (dtype t) equal and finite, and those of ref (F64)
// finite? (Exponent fields all ones: infinite or NaN. For 8-byte elements the exponent is in
// the odd 32-bit word.)
bool block_trivial(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k) {
  const std::size_t w = dtype_size(t), bytes = kBlock * w;
  y += k * w;
  g += k * w;
  ref += k * 8;
  const u32x4 odd = {0, ~0u, 0, ~0u}, e64 = {0, 0x7ff0'0000u, 0, 0x7ff0'0000u};
  u32x4 bad = {0, 0, 0, 0};
  if (w == 2) {
    const std::uint16_t m = t == DType::F16 ? 0x7c00 : 0x7f80;
    const u16x8 e = {m, m, m, m, m, m, m, m};
    for (std::size_t off = 0; off < bytes; off += 16) {
      u16x8 a, b;
      std::memcpy(&a, y + off, 16);
      std::memcpy(&b, g + off, 16);
      const u16x8 r = (a ^ b) | reinterpret_cast<u16x8>((a & e) == e);
      u32x4 r32;
      std::memcpy(&r32, &r, 16);
      bad |= r32;
    }
  } else {
    const u32x4 e = w == 4 ? u32x4{0x7f80'0000u, 0x7f80'0000u, 0x7f80'0000u, 0x7f80'0000u} : e64;
    const u32x4 lanes = w == 4 ? u32x4{~0u, ~0u, ~0u, ~0u} : odd;
    for (std::size_t off = 0; off < bytes; off += 16) {
      u32x4 a, b;
      std::memcpy(&a, y + off, 16);
      std::memcpy(&b, g + off, 16);
      bad |= (a ^ b) | (reinterpret_cast<u32x4>((a & e) == e) & lanes);
    }
  }
  for (std::size_t off = 0; off < kBlock * 8; off += 16) {
    u32x4 r;
    std::memcpy(&r, ref + off, 16);
    bad |= reinterpret_cast<u32x4>((r & e64) == e64) & odd;
  }
  std::uint64_t words[2];
  std::memcpy(words, &bad, 16);
  return (words[0] | words[1]) == 0;
}

// Elements [k0, k0 + n) one by one: the trivially equal ones are counted, slow(k) is called for
// the others, in order.
template <class U, class F>
void scan_elements(const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k0,
                   std::size_t n, U expmask, std::int64_t& counted, F&& slow) {
  for (std::size_t k = k0; k < k0 + n; ++k) {
    U a, b;
    std::uint64_t r;
    std::memcpy(&a, y + k * sizeof(U), sizeof(U));
    std::memcpy(&b, g + k * sizeof(U), sizeof(U));
    std::memcpy(&r, ref + 8 * k, 8);
    if (a == b && (a & expmask) != expmask && (r & 0x7ff0'0000'0000'0000ull) != 0x7ff0'0000'0000'0000ull) ++counted;
    else slow(k);
  }
}
template <class F>
void scan_elements(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k0,
                   std::size_t n, std::int64_t& counted, F&& slow) {
  switch (t) {
    case DType::F64: return scan_elements<std::uint64_t>(y, g, ref, k0, n, 0x7ff0'0000'0000'0000ull, counted, slow);
    case DType::F32: return scan_elements<std::uint32_t>(y, g, ref, k0, n, 0x7f80'0000u, counted, slow);
    case DType::F16: return scan_elements<std::uint16_t>(y, g, ref, k0, n, 0x7c00, counted, slow);
    case DType::BF16: return scan_elements<std::uint16_t>(y, g, ref, k0, n, 0x7f80, counted, slow);
    default:
      for (std::size_t k = k0; k < k0 + n; ++k) slow(k);
  }
}

// One element: trivially equal (as in scan_elements)?
bool trivial_at(DType t, const unsigned char* y, const unsigned char* g, const unsigned char* ref, std::size_t k) {
  std::int64_t n = 0;
  scan_elements(t, y, g, ref, k, 1, n, [](std::size_t) {});
  return n == 1;
}

// The value of a finite element of a float format (exact, as decode_float).
double finite_value(DType t, const unsigned char* p) {
  switch (t) {
    case DType::F32: {
      float x;
      std::memcpy(&x, p, 4);
      return static_cast<double>(x);
    }
    case DType::BF16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const std::uint32_t w = static_cast<std::uint32_t>(b) << 16;
      float x;
      std::memcpy(&x, &w, 4);
      return static_cast<double>(x);
    }
    case DType::F16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      const int e = (b >> 10) & 31, m = b & 1023;  // finite: e < 31
      const double mag = e == 0 ? static_cast<double>(m) * 0x1p-24 : static_cast<double>(1024 + m) * exp2i(e - 25);
      return (b & 0x8000) ? -mag : mag;
    }
    default: return decode_float(t, p);
  }
}

// The undecided elements of a golden tensor: (flat index, other candidate's bits), sorted by
// index; for a repeated index the last one listed counts (as a map assignment would).
using Undecided = std::vector<std::pair<std::int64_t, std::uint64_t>>;
// Looks indices up in order: galloping forward from the last one, from the start when k goes back.
struct AltCursor {
  const Undecided& u;
  std::size_t pos = 0;
  const std::uint64_t* find(std::size_t k) {
    if (u.empty()) return nullptr;
    const auto key = static_cast<std::int64_t>(k);
    if (pos > 0 && u[pos - 1].first >= key) pos = 0;
    std::size_t hi = pos, step = 1;
    while (hi < u.size() && u[hi].first < key) {
      pos = hi + 1;
      hi += step;
      step *= 2;
    }
    const auto end = u.begin() + static_cast<std::ptrdiff_t>(std::min(hi, u.size()));
    const auto it = std::lower_bound(u.begin() + static_cast<std::ptrdiff_t>(pos), end, key,
                                     [](const auto& e, std::int64_t v) { return e.first < v; });
    pos = static_cast<std::size_t>(it - u.begin());
    return pos < u.size() && it->first == key ? &it->second : nullptr;
  }
};

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

  // Checks dtype and shape of a returned tensor; records the failure.
  const RawTensor* returned(const std::string& name, const std::vector<std::int64_t>& shape) {
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
               const std::uint64_t* alt = nullptr) {
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
      acc.sample.add(row, d == 0 ? 0 : ((y - x_hi) - x_lo) / scale, final_share(fmt_u, x_hi, scale));
    else
      ++acc.unsampled;
  }

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
  void finish(Acc& acc) {
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

  const RawTensor* gold(const std::string& name) {
    const RawTensor* t = golden.find(name);
    if (!t) throw InputError(rep.id, name, "golden tensor missing");
    return t;
  }
  Undecided undecided(const std::string& name) {
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

  // dq, dk, dv, dbias, dsinks (TOLERANCE.md, "Gradients"): per element, and the statistical
  // tier per tensor.
  void gradients() {
    if (!profile.returns_gradients) {
      rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("gradients not returned (declared)");
      return;
    }
    const MaskedRowConvention conv = profile.masked_rows;
    if (conv == MaskedRowConvention::Nan || conv == MaskedRowConvention::Mean)
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < c.Hq; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i)
            if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) {
              rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("gradients not compared: fully masked rows under masked_rows=") +
                            std::string(convention_name(conv));
              return;
            }
    if (c.kind == Kind::Mha) {
      mha_gradients();
      return;
    }
    const RawTensor *oref = gold("out.ref"), *obound = gold("out.bound");
    std::vector<double> xr(oref->data.size() / 8), br(obound->data.size() / 8);
    for (std::size_t k = 0; k < xr.size(); ++k) xr[k] = value_of(*oref, k);
    for (std::size_t k = 0; k < br.size(); ++k) br[k] = value_of(*obound, k);
    bool underflows = false;
    for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
    const std::vector<double> vsum = underflows ? out_value_sum(c) : std::vector<double>{};
    // out's statistical bound per element (D_i = dout . out from the implementation's own out)
    std::vector<double> os(xr.size());
    for (std::size_t k = 0; k < os.size(); ++k) {
      const std::size_t row = k / static_cast<std::size_t>(c.Dv);
      os[k] = std::sqrt(3.0) * out_scale_at(row, k, xr[k], br[k], vsum.empty() ? 0 : vsum[k]);
    }
    const GradientErrors ge = gradient_errors(profile, c, mags, limits, xr, br, vsum, os);
    const double ug = unit_roundoff(profile.grad_accum);
    const double group = static_cast<double>(c.Hq / c.Hkv);
    // dq of padding rows is not compared (as their out); their contributions to dk, dv and
    // dbias are, through those tensors.
    auto skip = [&](const std::string& name, std::size_t k) {
      if (name != "dq") return false;
      const auto row = static_cast<std::int64_t>(k) / c.Dk;
      return !c.query_valid(row / (c.Hq * c.Nq), row % c.Nq);
    };
    // The statistical tier's groups: elements of different groups depend on disjoint rows.
    auto judge = [&](const std::string& name, bool wanted, const std::vector<std::int64_t>& shape,
                     const std::vector<double>& err, const GradientSpread& sp, std::size_t group_size,
                     auto terms_of, double partials) {
      if (!wanted) return;
      const RawTensor* got = returned(name, shape);
      if (!got) return;
      // in the gradient's own dtype: its rounding, its floor, and GQA's `partials` roundings
      const double uo = unit_roundoff(got->dtype), floor = 2 * min_subnormal(got->dtype);
      const double extra = partials * uo;
      const RawTensor *gg = gold(name), *gref = gold(name + ".ref"), *gb = gold(name + ".bound");
      const Undecided u = undecided(name);
      AltCursor u_at{u};
      Acc a;
      a.t.tensor = name;
      for (std::size_t k = 0; k < err.size(); ++k) {
        if (skip(name, k)) continue;
        const double x = value_of(*gref, k), bd = value_of(*gb, k), n = terms_of(k);
        // FTZ in the accumulation: n terms each flushed below grad_accum's smallest normal
        const double fl = floor + n * min_normal(profile.grad_accum);
        const double lim = gradient_limit(profile, err[k], n, extra, bd, uo, fl, x);
        // the random parts, the accumulation's n + 2 roundings on at most bd each (any order),
        // GQA's partial sums (extra = group u_out: group roundings of u_out bd), the final one
        const double var = sq(sp.random[k]) + (n + 2) * sq(ug * bd) + extra * uo * sq(bd) + sq(uo * x);
        const double scale = std::sqrt(var / 3) + sp.floor[k] + fl;
        element(a, *got, *gg, k, x, 0, bd, lim, -1, scale, static_cast<std::int64_t>(k / group_size), u_at.find(k));
      }
      finish(a);
    };
    // dq sums over the row's keys; dk and dv over the group's query heads and rows (GQA partial
    // sums per query head may be rounded to the output dtype first: group u_out more); dbias over
    // the entries its element was broadcast to.
    judge("dq", c.want_dq, c.q.shape, ge.dq, ge.dq_spread, static_cast<std::size_t>(c.Dk), [&](std::size_t k) {
      return limits[k / static_cast<std::size_t>(c.Dk)].keys; }, 0.0);
    const double rows = group * static_cast<double>(c.Nq);
    const double gqa = group > 1 ? group : 0;
    const auto head = static_cast<std::size_t>(c.Nk);
    judge("dk", c.want_dk, c.k.shape, ge.dk, ge.dk_spread, head * static_cast<std::size_t>(c.Dk),
          [&](std::size_t) { return rows; }, gqa);
    judge("dv", c.want_dv, c.v.shape, ge.dv, ge.dv_spread, head * static_cast<std::size_t>(c.Dv),
          [&](std::size_t) { return rows; }, gqa);
    if (c.bias) {
      const double per = static_cast<double>(c.B * c.Hq * c.Nq * c.Nk) / static_cast<double>(c.bias->values.size());
      // (the last extent is the keys'; the ones before it, where not broadcast, the rows')
      const std::size_t last = c.bias->shape.empty() ? ge.dbias.size() : static_cast<std::size_t>(c.bias->shape.back());
      judge("dbias", c.want_dbias, c.bias->shape, ge.dbias, ge.dbias_spread, std::max<std::size_t>(last, 1),
            [&](std::size_t) { return per; }, 0.0);
    }
    // dsinks[h] sums one term per row of the head over the batch.
    if (c.sinks)
      judge("dsinks", c.want_dsinks, {c.Hq}, ge.dsinks, ge.dsinks_spread, 1,
            [&](std::size_t) { return static_cast<double>(c.B * c.Nq); }, 0.0);
  }

  // Kind mha's dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o, dbias, dsinks (TOLERANCE.md, "Gradients of
  // kind mha"): per element, and the statistical tier per tensor.
  void mha_gradients() {
    const MhaGradientErrors ge = mha_gradient_errors(profile, c, limits);
    const bool self = c.self_attention;
    const double ug = unit_roundoff(profile.grad_accum);
    // each head's gradients, rounded to `projection` before the chain rule: u_proj on G.bound
    const double up = unit_roundoff(profile.projection);
    const double H = static_cast<double>(c.Hq), Dk = static_cast<double>(c.Dk), Dv = static_cast<double>(c.Dv);
    auto judge = [&](const std::string& name, bool wanted, const std::vector<std::int64_t>& shape, const std::vector<double>& err,
                     const GradientSpread& sp, std::size_t group_size, double n, double extra, auto skip) {
      if (!wanted || err.empty()) return;
      const RawTensor* got = returned(name, shape);
      if (!got) return;
      const double uo = unit_roundoff(got->dtype), floor = 2 * min_subnormal(got->dtype);  // the gradient's own
      const RawTensor *gg = gold(name), *gref = gold(name + ".ref"), *gb = gold(name + ".bound");
      const Undecided u = undecided(name);
      AltCursor u_at{u};
      Acc a;
      a.t.tensor = name;
      const double fl = floor + n * min_normal(profile.grad_accum);
      for (std::size_t k = 0; k < err.size(); ++k) {
        if (skip(k)) continue;
        const double x = value_of(*gref, k), bd = value_of(*gb, k);
        const double lim = gradient_limit(profile, err[k], n, extra, bd, uo, fl, x);
        const double var = sq(sp.random[k]) + (n + 2) * sq(ug * bd) + sq(extra * bd) + sq(uo * x);
        const double scale = std::sqrt(var / 3) + sp.floor[k] + fl;
        element(a, *got, *gg, k, x, 0, bd, lim, -1, scale, static_cast<std::int64_t>(k / group_size), u_at.find(k));
      }
      finish(a);
    };
    const auto none = [](std::size_t) { return false; };
    const auto D = static_cast<std::size_t>(c.D);
    // dx_q of padding rows is 0 (not compared, as dq's) unless x is the keys too.
    const auto padding = [&](std::size_t k) {
      const auto row = static_cast<std::int64_t>(k / D);
      return !self && !c.query_valid(row / c.Nq, row % c.Nq);
    };
    // terms: the chain rule's products (H Dk, and H (Dk + Dv) for the keys), or the tokens; the
    // tier's groups: a token of dx_q (a batch in self-attention, whose keys mix the rows), a
    // batch of dx_kv, the whole of dw_*.
    judge("dx_q", c.want_dx_q, c.x_q.shape, ge.dx_q, ge.dx_q_spread, self ? D * static_cast<std::size_t>(c.Nq) : D,
          H * (self ? 2 * Dk + Dv : Dk), up, padding);
    judge("dx_kv", c.want_dx_kv, c.x_kv.shape, ge.dx_kv, ge.dx_kv_spread, D * static_cast<std::size_t>(c.Nk), H * (Dk + Dv), up, none);
    const double tq = static_cast<double>(c.B * c.Nq), tk = static_cast<double>(c.B * c.Nk);
    judge("dw_q", c.want_dw_q, c.w_q.shape, ge.dw_q, ge.dw_q_spread, ge.dw_q.size(), tq, up, none);
    judge("dw_k", c.want_dw_k, c.w_k.shape, ge.dw_k, ge.dw_k_spread, ge.dw_k.size(), tk, up, none);
    judge("dw_v", c.want_dw_v, c.w_v.shape, ge.dw_v, ge.dw_v_spread, ge.dw_v.size(), tk, up, none);
    judge("dw_o", c.want_dw_o, c.w_o.shape, ge.dw_o, ge.dw_o_spread, ge.dw_o.size(), tq, 0.0, none);
    if (c.bias) {
      const double per = static_cast<double>(c.B * c.Hq * c.Nq * c.Nk) / static_cast<double>(c.bias->values.size());
      const std::size_t last = c.bias->shape.empty() ? ge.dbias.size() : static_cast<std::size_t>(c.bias->shape.back());
      judge("dbias", c.want_dbias, c.bias->shape, ge.dbias, ge.dbias_spread, std::max<std::size_t>(last, 1), per, 0.0, none);
    }
    if (c.sinks) judge("dsinks", c.want_dsinks, {c.Hq}, ge.dsinks, ge.dsinks_spread, 1, tq, 0.0, none);
  }

  void run() {
    const bool mha = c.kind == Kind::Mha;
    const std::int64_t H = c.Hq, W = mha ? c.Dout : c.Dv;
    mags = row_magnitudes(c);
    limits.reserve(mags.size());
    for (const auto& m : mags) limits.push_back(row_limits(profile, c, m));
    scales.reserve(mags.size());
    for (const auto& m : mags) scales.push_back(row_scales(profile, c, m));
    spread = weight_spread(c, profile);
    // P's underflow term needs sum_j |v_jc| per element, only where some row may underflow.
    bool underflows = false;
    for (const auto& L : limits) underflows = underflows || L.p_sub > 0;
    const std::vector<double> vsum = underflows ? out_value_sum(c) : std::vector<double>{};
    auto vsum_at = [&](std::size_t k) { return underflows ? vsum[k] : 0.0; };
    const FloatFormat fmt = float_format(c.dtype_of("out"));
    emin = 1 - fmt.bias;
    precision = fmt.precision;
    const RawTensor* valid = gold("row.valid");
    auto head_valid = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
      return valid->data[static_cast<std::size_t>((b * H + h) * c.Nq + i)] != 0;
    };
    const double uo = unit_roundoff(c.dtype_of("out")), S = profile.safety;
    const MaskedRowConvention conv = profile.masked_rows;

    // out
    const std::vector<std::int64_t> oshape = mha ? std::vector<std::int64_t>{c.B, c.Nq, W}
                                                 : std::vector<std::int64_t>{c.B, H, c.Nq, W};
    const RawTensor* out = returned("out", oshape);
    if (!out) return;
    const RawTensor *g = gold("out"), *ref = gold("out.ref"), *bound = gold("out.bound");
    const RawTensor* lo = golden.find("out.ref_lo");
    const Undecided und = undecided("out");
    AltCursor und_at{und};
    // Flat F64 views (the shapes are the golden file's; out's was checked above).
    const auto f64 = [&](const RawTensor* t) -> const unsigned char* {
      return t && t->dtype == DType::F64 && t->data.size() == out->data.size() / dtype_size(out->dtype) * 8
                 ? t->data.data()
                 : nullptr;
    };
    const unsigned char *xr = f64(ref), *xlr = f64(lo), *br = f64(bound);
    const bool fast = xr && br && (!lo || xlr) && g->dtype == out->dtype && g->data.size() == out->data.size();
    const std::size_t w = dtype_size(out->dtype);
    Acc acc;
    acc.t.tensor = "out";
    acc.sample.z.reserve(out->data.size() / w);  // as for weights below
    advise_huge_pages(acc.sample.z.data(), acc.sample.z.capacity() * sizeof(double));
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        if (!c.query_valid(b, i)) continue;  // padding rows are not compared
        for (std::int64_t h = 0; h < (mha ? 1 : H); ++h) {
          bool masked = false;  // some head of the row (token) is fully masked
          for (std::int64_t hh = (mha ? 0 : h); hh < (mha ? H : h + 1); ++hh) masked = masked || !head_valid(b, hh, i);
          const std::size_t row = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
          const RowLimits& L = limits[row];
          for (std::int64_t e = 0; e < W; ++e) {
            const auto k = static_cast<std::size_t>(static_cast<std::int64_t>(row) * W + e);
            if (fast && !masked && rep.worst && trivial_at(out->dtype, out->data.data(), g->data.data(), xr, k)) {
              // bits equal to the golden element, both it and the reference finite: error 0;
              // the statistics as in element()
              ++acc.t.compared;
              double x, bd, xl = 0;
              std::memcpy(&x, xr + 8 * k, 8);
              std::memcpy(&bd, br + 8 * k, 8);
              acc.t.largest_limit = std::max(acc.t.largest_limit, out_limit(profile, L, uo, bd, vsum_at(k), x));
              const double sc = out_scale_at(row, k, x, bd, vsum_at(k));
              acc.sample.add(static_cast<std::int64_t>(row), 0, final_share(uo, x, sc));
              if (x != 0) {
                if (xlr) std::memcpy(&xl, xlr + 8 * k, 8);
                const double compute = out_compute(L, bd, vsum_at(k));
                const double y = finite_value(out->dtype, out->data.data() + k * w);
                if (compute >= 0) statistics(acc, y, x, xl, compute);
                if (spread.exact) bias_add(acc, row, k, y, x, xl, bd, vsum_at(k));
              }
              continue;
            }
            const double y = value_of(*out, k);
            if (masked && conv == MaskedRowConvention::Error) {
              fail("returned an output for a fully masked row, where it declares refusal");
              return;
            }
            if (masked && conv == MaskedRowConvention::Nan) {
              if (!std::isnan(y)) fail("a fully masked row gives " + std::to_string(y) + ", not NaN as declared");
              continue;
            }
            if (masked && conv == MaskedRowConvention::Mean) {
              if (mha) continue;  // the mean of one head's values, mixed by W_o: not compared
              const std::int64_t gk = c.kv_head(h);
              double s = 0, sa = 0;
              for (std::int64_t j = 0; j < c.Nk; ++j) {
                const double v = c.v.values[static_cast<std::size_t>(((b * c.Hkv + gk) * c.Nk + j) * c.Dv + e)];
                s += v;
                sa += std::fabs(v);
              }
              const double n = static_cast<double>(c.Nk);
              const double lim = S * ((L.out_coef + (n + 2) * unit_roundoff(profile.pv_accum)) * sa / n + uo * std::fabs(s / n) + L.floor);
              element(acc, *out, *g, k, s / n, 0, sa / n, lim, -1, -1, 0);
              continue;
            }
            const double x = value_of(*ref, k), xl = lo ? value_of(*lo, k) : 0, bd = value_of(*bound, k);
            const double lim = out_limit(profile, L, uo, bd, vsum_at(k), x);
            element(acc, *out, *g, k, x, xl, bd, lim, masked ? -1 : out_compute(L, bd, vsum_at(k)),
                    masked ? -1 : out_scale_at(row, k, x, bd, vsum_at(k)), static_cast<std::int64_t>(row), und_at.find(k));
            if (spread.exact && !masked && std::isfinite(y) && std::isfinite(x) && std::isfinite(xl))
              bias_add(acc, row, k, y, x, xl, bd, vsum_at(k));
          }
        }
      }
    finish(acc);

    // weights and lse, per head row
    auto per_row = [&](const std::string& name, bool wanted, bool returns, bool weights) {
      if (!wanted) return;
      if (!returns) {
        rep.reason += (rep.reason.empty() ? "" : "; ") + name + " not returned (declared)";
        return;
      }
      const std::vector<std::int64_t> shape = weights ? std::vector<std::int64_t>{c.B, H, c.Nq, c.Nk}
                                                      : std::vector<std::int64_t>{c.B, H, c.Nq};
      const RawTensor* got = returned(name, shape);
      if (!got) return;
      const RawTensor *gg = gold(name), *gref = gold(name + ".ref");
      // Judged in its own dtype (that of the case given to the implementation): against the
      // golden tensor when that is in the same dtype, else against the .ref alone.
      const DType t = got->dtype;
      const double u_t = unit_roundoff(t);
      const Undecided u = gg->dtype == t ? undecided(name) : Undecided{};
      AltCursor u_at{u};
      const std::size_t n_el = got->data.size() / dtype_size(got->dtype);
      const bool blocks = gg->dtype == got->dtype && gg->data.size() == got->data.size() &&
                          gref->dtype == DType::F64 && gref->data.size() == n_el * 8;
      Acc a;
      a.t.tensor = name;
      a.sample.z.reserve(n_el);  // at most one normalised error per element, without regrowing
      advise_huge_pages(a.sample.z.data(), a.sample.z.capacity() * sizeof(double));
      const std::int64_t per = weights ? c.Nk : 1;
      std::vector<char> slowed;  // per element of a block: compared by element()
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t i = 0; i < c.Nq; ++i) {
            if (!c.query_valid(b, i)) continue;
            const bool masked = !head_valid(b, h, i);
            const auto lrow = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
            const auto hrow = static_cast<std::size_t>((b * H + h) * c.Nq + i);
            const RowLimits L = limits_in(lrow, t);
            const auto row0 = static_cast<std::size_t>(((b * H + h) * c.Nq + i) * per);
            const RowWeightScale ws = weights ? row_weight_scale(profile, spread, scales[lrow], L, u_t, hrow)
                                              : RowWeightScale{};
            auto slow = [&](std::size_t k) {  // one element, as it has always been compared
              const double y = value_of(*got, k);
              if (masked && conv == MaskedRowConvention::Nan) {  // lse: NaN, or -inf as log 0
                if (!std::isnan(y) && (weights || y != -INFINITY))
                  fail("a fully masked row's " + name + " is " + std::to_string(y) + ", not NaN" +
                       (weights ? "" : " or -inf") + " as declared");
                return;
              }
              if (masked && conv == MaskedRowConvention::Mean) return;   // 1/Nk or log Nk + S: not compared
              if (masked && conv == MaskedRowConvention::Error) return;  // reported on out
              const double x = value_of(*gref, k);
              const double lim = weights ? weight_limit(profile, L, u_t, x) : lse_limit(profile, L, u_t, x);
              const RowScales& R = scales[lrow];
              const double sc = weights ? ws.at(x) : lse_scale(profile, spread, R, L, u_t, hrow, x);
              element(a, *got, *gg, k, x, 0, weights ? 1.0 : std::max(1.0, std::fabs(x)), lim, -1, sc,
                      static_cast<std::int64_t>(hrow), u_at.find(k));
            };
            for (std::int64_t j = 0; j < per;) {
              const auto k = row0 + static_cast<std::size_t>(j);
              if (!blocks || masked || !rep.worst) {
                slow(k);
                ++j;
                continue;
              }
              // Elements equal to the golden ones (finite, reference finite) have error 0 and
              // only count: by blocks, and one by one in a block with another element.
              const auto n = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(kBlock), per - j));
              const unsigned char *yd = got->data.data(), *gd = gg->data.data(), *rd = gref->data.data();
              slowed.assign(n, 0);
              if (n == kBlock && block_trivial(got->dtype, yd, gd, rd, k)) a.t.compared += static_cast<std::int64_t>(n);
              else
                scan_elements(got->dtype, yd, gd, rd, k, n, a.t.compared, [&](std::size_t kk) {
                  slowed[kk - k] = 1;
                  slow(kk);
                });
              // the largest limit, over the elements counted without their limit too; those
              // (error 0) join the statistical tier's sample
              const RowScales& R = scales[lrow];
              for (std::size_t e = k; e < k + n; ++e) {
                double x;
                std::memcpy(&x, rd + 8 * e, 8);
                a.t.largest_limit = std::max(a.t.largest_limit, weights ? weight_limit(profile, L, u_t, x) : lse_limit(profile, L, u_t, x));
                if (slowed[e - k]) continue;
                const double sc = weights ? ws.at(x) : lse_scale(profile, spread, R, L, u_t, hrow, x);
                a.sample.add(static_cast<std::int64_t>(hrow), 0, final_share(u_t, x, sc));
              }
              j += static_cast<std::int64_t>(n);
            }
          }
      finish(a);
    };
    per_row("weights", c.want_weights, profile.returns_weights, true);
    per_row("lse", c.want_lse, profile.returns_lse, false);

    // scores, per element: step 1's error (TOLERANCE.md), -inf exactly where not allowed
    if (c.want_scores && !profile.returns_scores)
      rep.reason += (rep.reason.empty() ? "" : "; ") + std::string("scores not returned (declared)");
    if (c.want_scores && profile.returns_scores)
      if (const RawTensor* got = returned("scores", {c.B, H, c.Nq, c.Nk})) {
        const RawTensor *gg = gold("scores"), *gref = gold("scores.ref");
        const double u_t = unit_roundoff(got->dtype);
        const Undecided u = gg->dtype == got->dtype ? undecided("scores") : Undecided{};
        AltCursor u_at{u};
        Acc a;
        a.t.tensor = "scores";
        for (std::int64_t b = 0; b < c.B; ++b)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t i = 0; i < c.Nq; ++i) {
              if (!c.query_valid(b, i)) continue;
              const auto lrow = static_cast<std::size_t>(mha ? b * c.Nq + i : (b * H + h) * c.Nq + i);
              const auto hrow = static_cast<std::int64_t>((b * H + h) * c.Nq + i);
              for (std::int64_t j = 0; j < c.Nk; ++j) {
                const auto k = static_cast<std::size_t>(hrow * c.Nk + j);
                const double x = value_of(*gref, k);
                element(a, *got, *gg, k, x, 0, std::max(1.0, std::fabs(x)),
                        score_limit(profile, limits_in(lrow, got->dtype), u_t, x), -1, -1, hrow, u_at.find(k));
              }
            }
        finish(a);
      }

    if (c.wants_gradients()) gradients();

    if (rep.failed_elements > 0 && rep.worst) {
      char buf[200];
      const ElementReport& we = *rep.worst;
      if (exact_is_normal(we) || !std::isfinite(we.error))
        std::snprintf(buf, sizeof buf, "%lld element%s beyond the limit; worst %.3g times the limit",
                      static_cast<long long>(rep.failed_elements), rep.failed_elements == 1 ? "" : "s", we.limit_ratio);
      else
        std::snprintf(buf, sizeof buf, "%lld element%s beyond the limit; worst: error %.3g where the exact value is %.3g (limit %.3g)",
                      static_cast<long long>(rep.failed_elements), rep.failed_elements == 1 ? "" : "s", we.error, we.expected,
                      we.limit);
      // the elements beyond their limits say more than the statistics that follow from them
      const std::string earlier = rep.reason;
      rep.reason.clear();
      fail(buf);
      if (!earlier.empty() && earlier != rep.reason) rep.reason += "; " + earlier;
    }
  }
};

}  // namespace

bool exact_is_normal(const ElementReport& w) { return std::isfinite(w.expected) && std::fabs(w.expected) >= min_normal(w.dtype); }

CaseReport compare_plain_case(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                              const JobResult& result, const Profile& profile, bool pictures) {
  CaseReport rep;
  rep.id = id;
  const Case c = declared_case(id, golden, profile);
  rep.dtype = c.input_dtype;
  if (!profile.covers(c.input_dtype)) {
    rep.status = CaseStatus::Skip;
    rep.reason = "profile " + profile.name + " does not cover " + std::string(dtype_name(c.input_dtype)) + " inputs";
    return rep;
  }
  const bool refusable = has_refusable_row(c);
  switch (result.outcome) {
    case Outcome::Unsupported:
      rep.status = CaseStatus::Skip;
      rep.reason = "unsupported: " + result.reason;
      return rep;
    case Outcome::Refused:
      if (expect == "error" || (refusable && profile.masked_rows == MaskedRowConvention::Error)) {
        rep.reason = "refused as required: " + result.reason;
        return rep;
      }
      rep.status = CaseStatus::Fail;
      rep.reason = "refused a case it must evaluate: " + result.reason;
      return rep;
    case Outcome::Output:
      break;
    default:
      rep.status = CaseStatus::Fail;
      rep.reason = std::string(outcome_name(result.outcome)) + (result.reason.empty() ? "" : ": " + result.reason);
      return rep;
  }
  if (expect == "error") {
    if (profile.masked_rows == MaskedRowConvention::Error) {
      rep.status = CaseStatus::Fail;
      rep.reason = "evaluated a case with a fully masked row, which must be refused";
      return rep;
    }
    // No golden values: only the declared treatment of the fully masked rows can be checked.
    const RawTensor* out = result.output.find("out");
    const bool mha = c.kind == Kind::Mha;
    if (!out || out->dtype != c.dtype_of("out")) {
      rep.status = CaseStatus::Fail;
      rep.reason = "the result has no out of dtype " + std::string(dtype_name(c.dtype_of("out")));
      return rep;
    }
    const std::int64_t W = mha ? c.Dout : c.Dv;
    std::int64_t checked = 0;
    for (std::int64_t b = 0; b < c.B && !mha; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          if (!c.query_valid(b, i) || c.row_has_key(b, h, i)) continue;
          for (std::int64_t e = 0; e < W; ++e) {
            const auto k = static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * W + e);
            if (k >= out->data.size() / dtype_size(out->dtype)) break;
            const double y = value_of(*out, k);
            const bool ok = profile.masked_rows == MaskedRowConvention::Zero ? y == 0
                            : profile.masked_rows == MaskedRowConvention::Nan ? std::isnan(y)
                                                                               : std::isfinite(y);
            ++checked;
            if (!ok) {
              rep.status = CaseStatus::Fail;
              rep.reason = "a fully masked row gives " + std::to_string(y) + ", not what masked_rows=" +
                           std::string(convention_name(profile.masked_rows)) + " declares";
              return rep;
            }
          }
        }
    rep.reason = "no golden values (policy error): " + std::to_string(checked) +
                 " elements of fully masked rows checked against the declared convention";
    return rep;
  }
  Comparer cmp{c, golden, result.output, profile, rep, {}, 0, 0, {}, {}, {}, nullptr};
  std::optional<PictureCollector> collector;
  if (pictures) {
    collector.emplace(c);
    cmp.pictures = &*collector;
  }
  cmp.run();
  diagnose(c, golden, result.output, rep);
  if (collector && rep.status == CaseStatus::Fail) {
    std::int64_t compared[3] = {-1, -1, -1};
    for (const auto& t : rep.tensors)
      compared[t.tensor == "out" ? 0 : t.tensor == "weights" ? 1 : 2] = t.compared;
    rep.pictures = collector->finish(cmp.mags, compared);
  }
  return rep;
}

}  // namespace attnoracle::conformance
