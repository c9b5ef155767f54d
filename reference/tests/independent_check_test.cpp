// Independent check of the reference: every golden element of thousands of random problems is
// computed a second way (plain formula in ~600-bit MPFR through Boost.Multiprecision, no
// intervals) and rounded by the tests' own integer rounding (int_round), then compared with the
// reference's tensors bit for bit; the row-level enclosures must contain the same values.
// Inputs and options are re-read from the raw case file; no reference evaluation or rounding
// code is used for the expected values.
//
// ATTNORACLE_TEST_SCALE scales the problem count (default 1: 2400 problems);
// ATTNORACLE_SEED=<seed> replays one problem.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <boost/multiprecision/mpfr.hpp>
#include <gtest/gtest.h>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "int_round.hpp"
#include "random_case.hpp"

namespace attnoracle::testing {
namespace {

namespace bmp = boost::multiprecision;
// 181 decimal digits: at least 600 bits, the working precision of the model.
using Real = bmp::number<bmp::mpfr_float_backend<181>, bmp::et_off>;
static_assert(std::numeric_limits<Real>::digits >= 600);
// A second look, only where a 600-bit value is a midpoint of the output format or within its
// error of one: about 2500 bits, past the reference's own Ziv cap (2048 bits).
using RealHi = bmp::number<bmp::mpfr_float_backend<760>, bmp::et_off>;
static_assert(std::numeric_limits<RealHi>::digits >= 2500);

using Shape = std::vector<std::int64_t>;

// Our values carry rounding errors of a few units of 2^-digits times the magnitudes they come
// from: the argument S_ij - m of exp is off by about 2^(4-digits) (1 + smag), smag = max |T_ij| +
// |bias_ij|, which is then the relative error of exp and of A_ij; sums of <= 64 terms add
// 2^(6-digits) times the sum of the terms' magnitudes (sum_j A_ij |V_jc| for an output). The
// margins eps * (1 + smag) * magnitude, eps = 2^(80-digits) (2^-522 at 600 bits), bound them
// with a factor of 2^60 to spare, yet lie far below any rounding step that matters.
template <class T>
const T& eps() {
  static const T e = ldexp(T(1), 80 - std::numeric_limits<T>::digits);
  return e;
}

template <class T>
std::string show(const T& x) {
  char* s = nullptr;
  mpfr_asprintf(&s, "%.40Re", x.backend().data());
  std::string r(s);
  mpfr_free_str(s);
  return r;
}

std::string hex_bits(std::uint64_t bits, DType t) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "0x%0*llx", format_width(t) / 4,
                static_cast<unsigned long long>(bits));
  return buf;
}

std::string format_value(std::uint64_t bits, DType t) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s (%.17g)", hex_bits(bits, t).c_str(), bits_to_double(bits, t));
  return buf;
}

std::string shape_text(const Shape& shape) {
  std::string s = "[";  // appended: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  for (std::size_t a = 0; a < shape.size(); ++a) {
    if (a) s += ',';
    s += std::to_string(shape[a]);
  }
  return s + "]";
}

std::string index_text(std::int64_t flat, const Shape& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t a = shape.size(); a-- > 0;) {
    idx[a] = flat % shape[a];
    flat /= shape[a];
  }
  std::string s = "[";  // appended: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  for (std::size_t a = 0; a < idx.size(); ++a) {
    if (a) s += ',';
    s += std::to_string(idx[a]);
  }
  return s + "]";
}

// ---- the problem, decoded from the raw file by our own code ----

struct Arr {
  DType dtype = DType::F64;
  Shape shape;
  std::vector<double> v;
  double at(std::int64_t e) const { return v[static_cast<std::size_t>(e)]; }
};

Arr decode(const RawTensor& t) {
  Arr a;
  a.dtype = t.dtype;
  a.shape = t.shape;
  if (t.dtype == DType::BOOL) {
    for (unsigned char b : t.data) a.v.push_back(b ? 1.0 : 0.0);
    return a;
  }
  const auto size = static_cast<std::size_t>(format_width(t.dtype) / 8);
  for (std::size_t e = 0; e * size < t.data.size(); ++e)
    a.v.push_back(bits_to_double(load_bits(t.data.data() + e * size, t.dtype), t.dtype));
  return a;
}

// Element of a tensor broadcast (right-aligned) against [B, H, Nq, Nk].
double bcast_at(const Arr& a, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  const std::int64_t idx[4] = {b, h, i, j};
  const std::size_t r = a.shape.size();
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < r; ++d)
    flat = flat * a.shape[d] + (a.shape[d] == 1 ? 0 : idx[4 - r + d]);
  return a.at(flat);
}

// A number of the metadata: C hex float text is exact as a double; decimal text is read at our
// precision (0.3 is 3/10 to within 2^-600 relative).
template <class T>
T parse_real(const std::string& text) {
  if (text.find_first_of("xX") != std::string::npos) return T(std::strtod(text.c_str(), nullptr));
  return T(text);
}

struct Spec {
  bool mha = false;
  DType in = DType::F32, out = DType::F32;
  std::int64_t B = 0, H = 0, Hkv = 0, Nq = 0, Nk = 0, Dk = 0, Dv = 0, D = 0, Dout = 0;
  Arr q, k, v, x_q, x_kv, w_q, w_k, w_v, w_o;
  std::optional<Arr> mask, bias, query_mask, sinks;
  std::vector<std::int64_t> lq, lk;  // [B]: seqlens_q, seqlens_k, else Nq, Nk
  std::optional<Arr> q_descale, k_descale, v_descale;  // [B, Hkv], FP8 inputs
  std::string scale;    // attn.scale text, empty: 1/sqrt(Dk)
  std::string softcap;  // attn.softcap text, empty: off
  std::string causal = "none";
  bool window = false;
  std::int64_t left = 0, right = 0;
  bool zero_policy = false;
  bool want_weights = false, want_lse = false, want_scores = false;

  std::int64_t width() const { return mha ? Dout : Dv; }
  bool padding(std::int64_t b, std::int64_t i) const {
    return i >= lq.at(static_cast<std::size_t>(b)) || (query_mask && query_mask->at(b * Nq + i) == 0);
  }
  // A deliberate second reading of the positional rules, beside Case's: the check stays
  // independent of the reader it judges.
  bool allowed(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (mask && bcast_at(*mask, b, h, i, j) == 0) return false;
    const auto n = static_cast<std::size_t>(b);
    if (j >= lk.at(n)) return false;
    const std::int64_t aligned = causal == "bottom_right" ? i + (lk.at(n) - lq.at(n)) : i;
    if (causal != "none" && j > aligned) return false;
    if (window && (j < aligned - left || j > aligned + right)) return false;
    if (bias && std::isinf(bcast_at(*bias, b, h, i, j))) return false;
    return true;
  }
  bool row_masked(std::int64_t b, std::int64_t h, std::int64_t i) const {
    for (std::int64_t j = 0; j < Nk; ++j)
      if (allowed(b, h, i, j)) return false;
    return true;
  }
};

Spec read_spec(const SafeTensorsFile& f) {
  Spec s;
  auto meta = [&](const char* key, const std::string& dflt) {
    auto it = f.metadata.find(key);
    return it == f.metadata.end() ? dflt : it->second;
  };
  auto get = [&](const char* name) {
    const RawTensor* t = f.find(name);
    if (!t) throw std::runtime_error(std::string("missing tensor ") + name);
    return decode(*t);
  };
  s.mha = meta("attn.kind", "sdpa") == "mha";
  if (!s.mha) {
    s.q = get("q"), s.k = get("k"), s.v = get("v");
    s.in = s.q.dtype;
    s.B = s.q.shape[0], s.H = s.q.shape[1], s.Nq = s.q.shape[2], s.Dk = s.q.shape[3];
    s.Hkv = s.k.shape[1], s.Nk = s.k.shape[2], s.Dv = s.v.shape[3];
  } else {
    s.x_q = get("x_q"), s.x_kv = get("x_kv");
    s.w_q = get("w_q"), s.w_k = get("w_k"), s.w_v = get("w_v"), s.w_o = get("w_o");
    s.in = s.x_q.dtype;
    s.B = s.x_q.shape[0], s.Nq = s.x_q.shape[1], s.D = s.x_q.shape[2], s.Nk = s.x_kv.shape[1];
    s.H = s.Hkv = s.w_q.shape[0];
    s.Dk = s.w_q.shape[2], s.Dv = s.w_v.shape[2], s.Dout = s.w_o.shape[1];
  }
  if (f.find("mask")) s.mask = get("mask");
  if (f.find("bias")) s.bias = get("bias");
  if (f.find("query_mask")) s.query_mask = get("query_mask");
  // seqlens: I32 or I64 little-endian, [B]
  auto lengths = [&](const char* name, std::int64_t n) {
    std::vector<std::int64_t> l(static_cast<std::size_t>(s.B), n);
    if (const RawTensor* t = f.find(name)) {
      const std::size_t size = t->dtype == DType::I32 ? 4 : 8;
      for (std::size_t e = 0; e < l.size(); ++e) {
        std::uint64_t x = 0;
        for (std::size_t byte = 0; byte < size; ++byte)
          x |= std::uint64_t{t->data.at(e * size + byte)} << (8 * byte);
        l[e] = size == 4 ? static_cast<std::int32_t>(x) : static_cast<std::int64_t>(x);
      }
    }
    return l;
  };
  s.lq = lengths("seqlens_q", s.Nq);
  s.lk = lengths("seqlens_k", s.Nk);
  if (f.find("q_descale")) s.q_descale = get("q_descale");
  if (f.find("k_descale")) s.k_descale = get("k_descale");
  if (f.find("v_descale")) s.v_descale = get("v_descale");
  if (f.find("sinks")) s.sinks = get("sinks");
  const std::string dt = meta("attn.output_dtype", "");
  s.out = dt.empty() ? s.in : *dtype_from_name(dt);
  s.scale = meta("attn.scale", "");
  s.softcap = meta("attn.softcap", "");
  if (!s.softcap.empty() && parse_real<Real>(s.softcap) == 0) s.softcap.clear();
  s.causal = meta("attn.causal", "none");
  const std::string w = meta("attn.window", "none");
  if (w != "none") {
    s.window = true;
    s.left = std::stoll(w.substr(0, w.find(',')));
    s.right = std::stoll(w.substr(w.find(',') + 1));
  }
  s.zero_policy = meta("attn.masked_rows", "error") == "zero";
  const std::string outs = "," + meta("attn.outputs", "out") + ",";
  s.want_weights = outs.find(",weights,") != std::string::npos;
  s.want_lse = outs.find(",lse,") != std::string::npos;
  s.want_scores = outs.find(",scores,") != std::string::npos;
  return s;
}

// ---- the plain-formula evaluation, at the precision of T ----

template <class T>
struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<T> v;
  Mat(std::int64_t r, std::int64_t c) : rows(r), cols(c), v(static_cast<std::size_t>(r * c)) {}
  T& at(std::int64_t r, std::int64_t c) { return v[static_cast<std::size_t>(r * cols + c)]; }
  const T& at(std::int64_t r, std::int64_t c) const {
    return v[static_cast<std::size_t>(r * cols + c)];
  }
};

// rows [offset, offset + rows) of a row-major double array with `cols` columns
template <class T>
Mat<T> mat_of(const Arr& a, std::int64_t offset_rows, std::int64_t rows, std::int64_t cols) {
  Mat<T> m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m.at(r, c) = T(a.at((offset_rows + r) * cols + c));
  return m;
}

// X [rows, D] (batch b of a [B, rows, D] array) times W[h] ([D, cols] of a [H, D, cols] array).
// The sums of products of doubles are exact at our precision for the generated data.
template <class T>
Mat<T> project(const Arr& x, std::int64_t b, std::int64_t rows, std::int64_t D, const Arr& w,
               std::int64_t h, std::int64_t cols) {
  Mat<T> m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      T acc = 0;
      for (std::int64_t d = 0; d < D; ++d)
        acc += T(x.at((b * rows + r) * D + d)) * T(w.at((h * D + d) * cols + c));
      m.at(r, c) = acc;
    }
  return m;
}

// One attention row (b, h, i) of one head.
template <class T>
struct HeadRow {
  bool valid = false;   // some key allowed, or a sink
  std::vector<T> w;     // Nk
  std::vector<T> S;     // Nk: the scores, -inf where not allowed
  std::vector<T> out;   // Dv: N_c / Z
  std::vector<T> bound; // Dv: sum_j A_ij |V_jc|
  T lse;
  double smag = 0;      // max over allowed keys of |T_ij| + |bias_ij|, for the margins
};

template <class T>
HeadRow<T> attend(const Spec& s, const T& scale, const std::optional<T>& cap, std::int64_t b,
                  std::int64_t h, std::int64_t i, const Mat<T>& Q, const Mat<T>& K,
                  const Mat<T>& V) {
  HeadRow<T> r;
  r.w.assign(static_cast<std::size_t>(s.Nk), T(0));
  r.out.assign(static_cast<std::size_t>(V.cols), T(0));
  r.bound.assign(static_cast<std::size_t>(V.cols), T(0));
  r.lse = -std::numeric_limits<T>::infinity();
  r.S.assign(static_cast<std::size_t>(s.Nk), -std::numeric_limits<T>::infinity());
  std::vector<T>& S = r.S;
  std::vector<char> ok(static_cast<std::size_t>(s.Nk), 0);
  T m;
  for (std::int64_t j = 0; j < s.Nk; ++j) {
    if (!s.allowed(b, h, i, j)) continue;
    T dot = 0;
    for (std::int64_t c = 0; c < Q.cols; ++c) dot += Q.at(i, c) * K.at(j, c);
    T t = scale * dot;
    if (cap) t = *cap * tanh(t / *cap);
    const double bias = s.bias ? bcast_at(*s.bias, b, h, i, j) : 0.0;
    const auto uj = static_cast<std::size_t>(j);
    S[uj] = t + T(bias);
    r.smag = std::max(r.smag, abs(t).template convert_to<double>() + std::fabs(bias));
    if (!r.valid || S[uj] > m) m = S[uj];
    r.valid = true;
    ok[uj] = 1;
  }
  // A sink: one more term exp(sink - m) of the denominator, with no value vector.
  std::optional<T> sink;
  if (s.sinks) {
    const double x = s.sinks->at(h);
    sink = T(x);
    r.smag = std::max(r.smag, std::fabs(x));
    if (!r.valid) {  // no allowed key: weights and output 0, lse = the sink
      r.valid = true;
      r.lse = *sink;
      return r;
    }
    if (*sink > m) m = *sink;
  }
  if (!r.valid) return r;
  // exp(S - m): m is the row maximum, so every term is in (0, 1] and one of them is 1.
  T Z = sink ? T(exp(*sink - m)) : T(0);
  std::vector<T> e(static_cast<std::size_t>(s.Nk));
  for (std::size_t j = 0; j < e.size(); ++j)
    if (ok[j]) {
      e[j] = exp(S[j] - m);
      Z += e[j];
    }
  for (std::int64_t c = 0; c < V.cols; ++c) {
    T n = 0, mag = 0;
    for (std::int64_t j = 0; j < s.Nk; ++j) {
      const auto uj = static_cast<std::size_t>(j);
      if (!ok[uj]) continue;
      n += e[uj] * V.at(j, c);
      mag += e[uj] * abs(V.at(j, c));
    }
    // N / Z rather than sum of (e_j / Z) V_jc: exact means of ties stay exact
    r.out[static_cast<std::size_t>(c)] = n / Z;
    r.bound[static_cast<std::size_t>(c)] = mag / Z;
  }
  for (std::size_t j = 0; j < e.size(); ++j)
    if (ok[j]) r.w[j] = e[j] / Z;
  r.lse = m + log(Z);
  return r;
}

// The values of one row unit: (b, h, i) for sdpa, (b, i) with every head for mha.
template <class T>
struct Unit {
  std::vector<HeadRow<T>> heads;  // 1 (sdpa) or H (mha)
  std::vector<T> out, bound;      // Dv or Dout
  double smag = 0;
};

template <class T>
class Model {
 public:
  explicit Model(const Spec& s) : s_(s) {
    scale_ = s.scale.empty() ? T(1) / sqrt(T(s.Dk)) : parse_real<T>(s.scale);
    if (!s.softcap.empty()) cap_ = parse_real<T>(s.softcap);
    if (s.mha) {
      for (std::int64_t b = 0; b < s.B; ++b)
        for (std::int64_t h = 0; h < s.H; ++h) {
          Q_.push_back(project<T>(s.x_q, b, s.Nq, s.D, s.w_q, h, s.Dk));
          K_.push_back(project<T>(s.x_kv, b, s.Nk, s.D, s.w_k, h, s.Dk));
          V_.push_back(project<T>(s.x_kv, b, s.Nk, s.D, s.w_v, h, s.Dv));
        }
    } else {
      // FP8: the real input is the stored one times its descale at [b, kv head].
      auto scaled = [](Mat<T> m, const std::optional<Arr>& d, std::int64_t at) {
        if (d)
          for (auto& x : m.v) x *= T(d->at(at));
        return m;
      };
      for (std::int64_t b = 0; b < s.B; ++b) {
        for (std::int64_t h = 0; h < s.H; ++h)
          Q_.push_back(scaled(mat_of<T>(s.q, (b * s.H + h) * s.Nq, s.Nq, s.Dk), s.q_descale,
                              b * s.Hkv + h / (s.H / s.Hkv)));
        for (std::int64_t g = 0; g < s.Hkv; ++g) {
          K_.push_back(scaled(mat_of<T>(s.k, (b * s.Hkv + g) * s.Nk, s.Nk, s.Dk), s.k_descale,
                              b * s.Hkv + g));
          V_.push_back(scaled(mat_of<T>(s.v, (b * s.Hkv + g) * s.Nk, s.Nk, s.Dv), s.v_descale,
                              b * s.Hkv + g));
        }
      }
    }
  }

  Unit<T> unit(std::int64_t b, std::int64_t h, std::int64_t i) const {
    Unit<T> u;
    if (!s_.mha) {
      const std::int64_t g = h / (s_.H / s_.Hkv);  // GQA: query head h reads kv head g
      const auto kv = static_cast<std::size_t>(b * s_.Hkv + g);
      u.heads.push_back(attend(s_, scale_, cap_, b, h, i,
                               Q_[static_cast<std::size_t>(b * s_.H + h)], K_[kv], V_[kv]));
      u.out = u.heads[0].out;
      u.bound = u.heads[0].bound;
      u.smag = u.heads[0].smag;
      return u;
    }
    for (std::int64_t r = 0; r < s_.H; ++r) {
      const auto at = static_cast<std::size_t>(b * s_.H + r);
      u.heads.push_back(attend(s_, scale_, cap_, b, r, i, Q_[at], K_[at], V_[at]));
      u.smag = std::max(u.smag, u.heads.back().smag);
    }
    // concat_r(O_r) W_o, and the bound sum_{r,c} bound_r[c] |W_o[r*Dv+c, e]|
    u.out.assign(static_cast<std::size_t>(s_.Dout), T(0));
    u.bound.assign(static_cast<std::size_t>(s_.Dout), T(0));
    for (std::int64_t e = 0; e < s_.Dout; ++e) {
      T acc = 0, mag = 0;
      for (std::int64_t r = 0; r < s_.H; ++r)
        for (std::int64_t c = 0; c < s_.Dv; ++c) {
          const T w(s_.w_o.at((r * s_.Dv + c) * s_.Dout + e));
          const auto uc = static_cast<std::size_t>(c);
          acc += u.heads[static_cast<std::size_t>(r)].out[uc] * w;
          mag += u.heads[static_cast<std::size_t>(r)].bound[uc] * abs(w);
        }
      u.out[static_cast<std::size_t>(e)] = acc;
      u.bound[static_cast<std::size_t>(e)] = mag;
    }
    return u;
  }

 private:
  const Spec& s_;
  T scale_;
  std::optional<T> cap_;
  std::vector<Mat<T>> Q_, K_, V_;
};

// ---- comparison ----

struct Counts {
  std::uint64_t problems = 0, refused = 0, elements = 0, exact_ties = 0, near = 0,
                undecided = 0, second_looks = 0, enclosures = 0, row_calls = 0;
  double seconds_reference = 0, seconds_model = 0;
  void add(const Counts& o) {
    problems += o.problems;
    refused += o.refused;
    elements += o.elements;
    exact_ties += o.exact_ties;
    near += o.near;
    undecided += o.undecided;
    second_looks += o.second_looks;
    enclosures += o.enclosures;
    row_calls += o.row_calls;
    seconds_reference += o.seconds_reference;
    seconds_model += o.seconds_model;
  }
};

struct Outcome {
  std::string context;
  std::vector<std::string> failures;
  std::size_t failure_count = 0;
  Counts counts;
  std::vector<std::string> notes;  // shown when one seed is replayed
  void fail(const std::string& msg) {
    if (failures.size() < 12) failures.push_back(msg);
    ++failure_count;
  }
};

// Our value of one element with its error bound, and the same at ~2500 bits on demand.
struct Value {
  Real x, margin;
  std::function<std::pair<RealHi, RealHi>()> precise;
};

// What the rounding of a value known to within `margin` into dt is, as far as it can be told.
struct Decision {
  enum Kind { Decided, Tie, Near } kind = Decided;
  std::uint64_t bits = 0;            // the nearest (ties to even) of x itself
  std::uint64_t below = 0, above = 0;  // the roundings of x - margin and x + margin
};

template <class T>
Decision decide(const T& x, const T& margin, DType dt) {
  const IntRounded r = round_mpfr(x.backend().data(), dt);
  if (isinf(x) || margin == 0) return {Decision::Decided, r.bits, r.bits, r.bits};  // exact
  // x exactly a midpoint: an exact tie of equal scores (or our rounding at this precision)
  if (r.discarded == Discarded::Half) return {Decision::Tie, r.bits, r.bits, r.bits};
  const T lo = x - margin, hi = x + margin;
  const std::uint64_t below = round_mpfr(lo.backend().data(), dt).bits;
  const std::uint64_t above = round_mpfr(hi.backend().data(), dt).bits;
  const bool same = bits_to_double(below, dt) == bits_to_double(above, dt);
  return {same ? Decision::Decided : Decision::Near, r.bits, below, above};
}

bool is_rounded(const std::string& name) {
  return name == "out" || name == "out.ref" || name == "out.ref_lo" || name == "weights" ||
         name == "weights.ref" || name == "lse" || name == "lse.ref" || name == "scores" ||
         name == "scores.ref";
}

class Checker {
 public:
  Checker(Outcome& o, const Spec& s, const std::vector<RawTensor>& golden) : o_(o) {
    const std::int64_t n = s.width();
    const Shape out_shape = s.mha ? Shape{s.B, s.Nq, n} : Shape{s.B, s.H, s.Nq, n};
    const Shape rows = {s.B, s.H, s.Nq}, w_shape = {s.B, s.H, s.Nq, s.Nk};
    std::map<std::string, std::pair<DType, Shape>> want = {
        {"out", {s.out, out_shape}}, {"out.ref", {DType::F64, out_shape}},
        {"out.bound", {DType::F64, out_shape}}, {"row.valid", {DType::BOOL, rows}}};
    if (s.out == DType::F64) want["out.ref_lo"] = {DType::F64, out_shape};
    if (s.want_weights) {
      want["weights"] = {s.out, w_shape};
      want["weights.ref"] = {DType::F64, w_shape};
    }
    if (s.want_lse) {
      want["lse"] = {s.out, rows};
      want["lse.ref"] = {DType::F64, rows};
    }
    if (s.want_scores) {
      want["scores"] = {s.out, w_shape};
      want["scores.ref"] = {DType::F64, w_shape};
    }
    for (const auto& t : golden) {
      const auto it = want.find(t.name);
      if (it != want.end()) {
        if (t.dtype != it->second.first || t.shape != it->second.second ||
            t.data.size() != numel(t.shape) * dtype_size(t.dtype))
          o_.fail(t.name + ": dtype " + std::string(dtype_name(t.dtype)) + " shape " +
                  shape_text(t.shape) + " (" + std::to_string(t.data.size()) +
                  " bytes), expected " + std::string(dtype_name(it->second.first)) + " " +
                  shape_text(it->second.second));
        else
          g_[t.name].t = &t;
        continue;
      }
      const auto dot = t.name.rfind('.');
      const std::string base = dot == std::string::npos ? "" : t.name.substr(0, dot);
      const std::string suffix = dot == std::string::npos ? "" : t.name.substr(dot);
      if ((suffix == ".undecided" || suffix == ".alt") && is_rounded(base) && want.count(base))
        continue;
      o_.fail("unexpected golden tensor " + t.name);
    }
    for (const auto& [name, spec] : want)
      if (!g_.count(name)) o_.fail("missing golden tensor " + name);
    // undecided lists: ascending flat indices, with the other candidate of each
    for (const auto& t : golden) {
      const auto dot = t.name.rfind(".undecided");
      if (dot == std::string::npos || dot + 10 != t.name.size()) continue;
      const std::string base = t.name.substr(0, dot);
      const RawTensor* alt = nullptr;
      for (const auto& a : golden)
        if (a.name == base + ".alt") alt = &a;
      auto git = g_.find(base);
      if (!alt || git == g_.end() || t.dtype != DType::I64 || t.shape.size() != 1 ||
          alt->dtype != git->second.t->dtype || alt->shape != t.shape) {
        o_.fail(t.name + ": malformed undecided list (needs I64 [n] and " + base +
                ".alt of the same dtype and length)");
        continue;
      }
      const auto size = dtype_size(alt->dtype);
      std::int64_t prev = -1;
      for (std::int64_t e = 0; e < t.shape[0]; ++e) {
        std::int64_t idx;
        std::memcpy(&idx, t.data.data() + e * 8, 8);
        if (idx <= prev || idx >= static_cast<std::int64_t>(numel(git->second.t->shape)))
          o_.fail(t.name + ": index " + std::to_string(idx) + " out of order or range");
        prev = idx;
        git->second.alt[idx] = load_bits(alt->data.data() + e * size, alt->dtype);
        ++listed_undecided_;
      }
    }
    for (const auto& [name, g] : g_)
      if (!g.alt.empty() && !is_rounded(name)) o_.fail(name + " has undecided elements");
  }

  std::uint64_t listed_undecided() const { return listed_undecided_; }

  // A correctly rounded element. Where our 600-bit value cannot tell (a midpoint, or within
  // its error of one), the ~2500-bit value decides; an exact midpoint there is a true tie and
  // must be rounded to even; still undecidable (never seen), either neighbour is accepted.
  void rounded(const std::string& name, std::int64_t flat, const Value& v,
               bool plus_zero = false) {
    auto it = g_.find(name);
    if (it == g_.end()) return;
    const RawTensor& t = *it->second.t;
    const DType dt = t.dtype;
    const std::uint64_t bits = load_bits(t.data.data() + flat * dtype_size(dt), dt);
    const double got = bits_to_double(bits, dt);
    ++o_.counts.elements;
    auto report = [&](const std::string& what, std::uint64_t want) {
      o_.fail(name + index_text(flat, t.shape) + " (flat " + std::to_string(flat) +
              "): reference " + format_value(bits, dt) + ", expected " + format_value(want, dt) +
              "; exact ~ " + show(v.x) + " (+- " + show(v.margin) + ")" +
              (what.empty() ? "" : "; " + what));
    };
    auto same = [&](std::uint64_t want) {
      return bits == want || (got == 0 && bits_to_double(want, dt) == 0);  // zeros by value
    };
    const auto alt = it->second.alt.find(flat);
    if (alt != it->second.alt.end()) {
      // undecided: x must lie between the two candidates, at their midpoint to 2^-300
      ++o_.counts.undecided;
      const double other = bits_to_double(alt->second, dt);
      const Real lo(std::min(got, other)), hi(std::max(got, other));
      const Real mid = (lo + hi) / 2;
      if (!(got != other && lo - v.margin <= v.x && v.x <= hi + v.margin &&
            abs(v.x - mid) <= ldexp(abs(mid), -300) + v.margin))
        report("undecided, other candidate " + format_value(alt->second, dt) +
                   ": the value is not at their midpoint",
               round_mpfr(v.x.backend().data(), dt).bits);
      if (o_.notes.size() < 20) {
        const auto [xh, mh] = v.precise();
        const RealHi d = xh - RealHi(mid);
        o_.notes.push_back(name + index_text(flat, t.shape) + " undecided: " +
                           format_value(bits, dt) + " / " + format_value(alt->second, dt) +
                           "; at ~2500 bits our value - midpoint = " + show(d) + " (+- " +
                           show(mh) + ")");
      }
      return;
    }
    Decision d = decide(v.x, v.margin, dt);
    if (plus_zero) {
      if (bits != d.bits) report("a fully masked row's element must be +0", d.bits);
      return;
    }
    if (d.kind != Decision::Decided) {
      ++o_.counts.second_looks;
      const auto [xh, mh] = v.precise();
      d = decide(xh, mh, dt);
    }
    switch (d.kind) {
      case Decision::Decided:
        if (!same(d.bits)) report("", d.bits);
        return;
      case Decision::Tie:
        ++o_.counts.exact_ties;
        if (!same(d.bits))
          report("an exact midpoint (at ~2500 bits): ties to even expected", d.bits);
        return;
      case Decision::Near: {
        ++o_.counts.near;
        const double vb = bits_to_double(d.below, dt), va = bits_to_double(d.above, dt);
        if (!(vb <= got && got <= va))
          report("within our error of a boundary: accepts " + format_value(d.below, dt) +
                     " .. " + format_value(d.above, dt), d.bits);
        return;
      }
    }
  }

  // out.bound: an upper bound of x, within 1e-10 relative.
  void bound(std::int64_t flat, const Real& x, const Real& margin) {
    auto it = g_.find("out.bound");
    if (it == g_.end()) return;
    const RawTensor& t = *it->second.t;
    const double got = bits_to_double(load_bits(t.data.data() + flat * 8, DType::F64), DType::F64);
    ++o_.counts.elements;
    const Real g(got);
    if (x == 0 && got != 0)
      o_.fail("out.bound" + index_text(flat, t.shape) + ": reference " + show(g) + ", exact 0");
    // rounded up: at most 1e-10 relative above, or one unit 2^-1074 below F64's normal range
    if (!(g >= x - margin && g <= x + x * Real(1e-10) + margin + ldexp(Real(1), -1074)))
      o_.fail("out.bound" + index_text(flat, t.shape) + ": reference " + std::to_string(got) +
              " (" + show(g) + "), exact ~ " + show(x) + ": not an upper bound within 1e-10");
  }

  void valid(std::int64_t flat, bool want) {
    auto it = g_.find("row.valid");
    if (it == g_.end()) return;
    const unsigned char got = it->second.t->data[static_cast<std::size_t>(flat)];
    ++o_.counts.elements;
    if (got != (want ? 1 : 0))
      o_.fail("row.valid" + index_text(flat, it->second.t->shape) + ": reference " +
              std::to_string(got) + ", expected " + (want ? "1" : "0"));
  }

  // the golden F64 out.ref element (for out.ref_lo)
  std::optional<double> ref_value(std::int64_t flat) const {
    auto it = g_.find("out.ref");
    if (it == g_.end()) return std::nullopt;
    return bits_to_double(load_bits(it->second.t->data.data() + flat * 8, DType::F64),
                          DType::F64);
  }

 private:
  static std::size_t numel(const Shape& s) {
    std::size_t n = 1;
    for (auto d : s) n *= static_cast<std::size_t>(d);
    return n;
  }
  struct Golden {
    const RawTensor* t = nullptr;
    std::map<std::int64_t, std::uint64_t> alt;
  };
  Outcome& o_;
  std::map<std::string, Golden> g_;
  std::uint64_t listed_undecided_ = 0;
};

// Compares one row unit's golden elements with our values; `hi` gives the unit at ~2500 bits.
void check_unit(Checker& ck, const Spec& s, std::int64_t b, std::int64_t h, std::int64_t i,
                const Unit<Real>& u, const std::function<const Unit<RealHi>&()>& hi) {
  const std::int64_t n = s.width();
  const bool all_masked = std::none_of(u.heads.begin(), u.heads.end(),
                                       [](const HeadRow<Real>& r) { return r.valid; });
  // margins: see eps()
  auto out_margin = [](const auto& unit, std::size_t c) {
    using T = std::decay_t<decltype(unit.out[0])>;
    return T(eps<T>() * (1 + unit.smag) * unit.bound[c]);
  };
  for (std::int64_t c = 0; c < n; ++c) {
    const auto uc = static_cast<std::size_t>(c);
    const std::int64_t flat = (s.mha ? b * s.Nq + i : (b * s.H + h) * s.Nq + i) * n + c;
    const Value out{u.out[uc], out_margin(u, uc), [&hi, uc, out_margin] {
                      const Unit<RealHi>& U = hi();
                      return std::pair{U.out[uc], out_margin(U, uc)};
                    }};
    ck.rounded("out", flat, out, all_masked);
    ck.rounded("out.ref", flat, out, all_masked);
    ck.bound(flat, u.bound[uc], out.margin);
    if (s.out == DType::F64) {
      if (const auto ref = ck.ref_value(flat)) {
        const double r = *ref;
        ck.rounded("out.ref_lo", flat,
                   Value{u.out[uc] - Real(r), out.margin, [&hi, uc, r, out_margin] {
                           const Unit<RealHi>& U = hi();
                           return std::pair{RealHi(U.out[uc] - RealHi(r)), out_margin(U, uc)};
                         }});
      }
    }
  }
  for (std::size_t r = 0; r < u.heads.size(); ++r) {
    const HeadRow<Real>& hr = u.heads[r];
    const std::int64_t head = s.mha ? static_cast<std::int64_t>(r) : h;
    const std::int64_t row = (b * s.H + head) * s.Nq + i;
    ck.valid(row, hr.valid);
    if (s.want_weights)
      for (std::int64_t j = 0; j < s.Nk; ++j) {
        const auto uj = static_cast<std::size_t>(j);
        auto weight = [r, uj](const auto& unit) {
          const auto& x = unit.heads[r].w[uj];
          using T = std::decay_t<decltype(x)>;
          return std::pair{x, T(eps<T>() * (1 + unit.heads[r].smag) * x)};
        };
        const auto [w, wm] = weight(u);
        const Value v{w, wm, [&hi, weight] { return weight(hi()); }};
        ck.rounded("weights", row * s.Nk + j, v);
        ck.rounded("weights.ref", row * s.Nk + j, v);
      }
    if (s.want_lse) {
      auto lse = [r](const auto& unit) {
        const auto& hr2 = unit.heads[r];
        using T = std::decay_t<decltype(hr2.lse)>;
        return std::pair{hr2.lse, hr2.valid ? T(eps<T>() * (1 + hr2.smag + abs(hr2.lse))) : T(0)};
      };
      const auto [x, xm] = lse(u);
      const Value v{x, xm, [&hi, lse] { return lse(hi()); }};
      ck.rounded("lse", row, v);
      ck.rounded("lse.ref", row, v);
    }
    if (s.want_scores)
      for (std::int64_t j = 0; j < s.Nk; ++j) {
        const auto uj = static_cast<std::size_t>(j);
        auto score = [r, uj](const auto& unit) {
          const auto& x = unit.heads[r].S[uj];
          using T = std::decay_t<decltype(x)>;
          return std::pair{x, isinf(x) ? T(0) : T(eps<T>() * (1 + unit.heads[r].smag))};
        };
        const auto [x, xm] = score(u);
        const Value v{x, xm, [&hi, score] { return score(hi()); }};
        ck.rounded("scores", row * s.Nk + j, v);
        ck.rounded("scores.ref", row * s.Nk + j, v);
      }
  }
}

// Our value must lie in the reference's enclosure, widened by our own error bound (the
// enclosure holds the exact value; ours is within `margin` of it).
void check_enclosure(Outcome& o, const std::string& what, const Enclosure& e, const Real& x,
                     const Real& margin) {
  Real lo, hi;
  mpfr_set(lo.backend().data(), e.lo, MPFR_RNDD);
  mpfr_set(hi.backend().data(), e.hi, MPFR_RNDU);
  ++o.counts.enclosures;
  if (!(lo - margin <= x && x <= hi + margin))
    o.fail("enclosure of " + what + " [" + show(lo) + ", " + show(hi) + "] does not contain " +
           show(x) + " (+- " + show(margin) + ")");
}

void check_row_enclosures(Outcome& o, const Spec& s, const RowEvaluator& ev, std::int64_t b,
                          std::int64_t h, std::int64_t i, const Unit<Real>& u, bool expect_throw) {
  for (mpfr_prec_t p : {64, 200}) {
    const std::string at = "row(b=" + std::to_string(b) + ",h=" + std::to_string(h) +
                           ",i=" + std::to_string(i) + ",p=" + std::to_string(p) + ")";
    ++o.counts.row_calls;
    std::optional<RowEnclosures> r;
    try {
      r.emplace(ev.row(b, h, i, p));
    } catch (const FullyMaskedRow& e) {
      if (!expect_throw) o.fail(at + " threw FullyMaskedRow: " + e.what());
      continue;
    } catch (const std::exception& e) {
      o.fail(at + " threw: " + e.what());
      continue;
    }
    if (expect_throw) {
      o.fail(at + " did not refuse a fully masked row under policy error");
      continue;
    }
    const std::size_t heads = u.heads.size();
    if (r->head_valid.size() != heads || r->out.size() != u.out.size() ||
        r->bound.size() != u.out.size()) {
      o.fail(at + ": enclosure vectors have unexpected sizes");
      continue;
    }
    const Real mscale = eps<Real>() * (1 + u.smag);
    for (std::size_t c = 0; c < u.out.size(); ++c) {
      check_enclosure(o, at + " out[" + std::to_string(c) + "]", r->out[c], u.out[c],
                      mscale * u.bound[c]);
      check_enclosure(o, at + " bound[" + std::to_string(c) + "]", r->bound[c], u.bound[c],
                      mscale * u.bound[c]);
    }
    for (std::size_t hh = 0; hh < heads; ++hh) {
      const HeadRow<Real>& hr = u.heads[hh];
      if (r->head_valid[hh] != hr.valid) {
        o.fail(at + ": head " + std::to_string(hh) + " valid " +
               std::to_string(r->head_valid[hh]) + ", expected " + std::to_string(hr.valid));
        continue;
      }
      if (!hr.valid) continue;
      const Real hs = eps<Real>() * (1 + hr.smag);
      // weights may be left out when the case does not ask for them
      const bool has_w = hh < r->weights.size() && !r->weights[hh].empty();
      if (has_w && r->weights[hh].size() != static_cast<std::size_t>(s.Nk))
        o.fail(at + ": weights enclosures have unexpected sizes");
      else if (has_w)
        for (std::size_t j = 0; j < hr.w.size(); ++j)
          check_enclosure(o, at + " weights[" + std::to_string(hh) + "][" + std::to_string(j) + "]",
                          r->weights[hh][j], hr.w[j], hs * hr.w[j]);
      if (hh < r->lse.size())
        check_enclosure(o, at + " lse[" + std::to_string(hh) + "]", r->lse[hh], hr.lse,
                        hs * (1 + abs(hr.lse)));
      if (s.want_scores && hh < r->scores.size())
        for (std::size_t j = 0; j < hr.S.size(); ++j)
          check_enclosure(o, at + " scores[" + std::to_string(hh) + "][" + std::to_string(j) + "]",
                          r->scores[hh][j], hr.S[j], isinf(hr.S[j]) ? Real(0) : hs);
    }
  }
}

int eval_threads(std::uint64_t seed) { return seed % 8 == 0 ? 2 : 1; }

// Generates, evaluates and checks one problem.
// `tamper` may change the reference's result before it is checked (to test the check itself).
Outcome run_problem(const std::string& name, const SafeTensorsFile& file, std::uint64_t seed,
                    std::string context,
                    const std::function<void(EvalResult&)>& tamper = nullptr) {
  Outcome o;
  o.context = std::move(context);
  o.counts.problems = 1;
  Spec s;
  std::optional<Case> c;
  try {
    s = read_spec(file);
    c.emplace(case_from_file(name, file));
  } catch (const InputError& e) {
    o.fail("case refused as bad input: " + e.message());
    return o;
  } catch (const std::exception& e) {
    o.fail(std::string("case could not be read: ") + e.what());
    return o;
  }

  // fully masked rows that must be refused under policy error
  auto refusable = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    return !s.zero_policy && !s.sinks && !s.padding(b, i) && s.row_masked(b, h, i);
  };
  bool expect_refusal = false;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.H; ++h)
      for (std::int64_t i = 0; i < s.Nq; ++i) expect_refusal |= refusable(b, h, i);

  const auto t0 = std::chrono::steady_clock::now();
  std::optional<EvalResult> res;
  try {
    EvalOptions eo;
    eo.threads = eval_threads(seed);
    res.emplace(evaluate(*c, eo));
    if (tamper) tamper(*res);
    if (expect_refusal) o.fail("evaluate did not refuse a case with a fully masked row");
  } catch (const FullyMaskedRow& e) {
    ++o.counts.refused;
    if (!expect_refusal)
      o.fail(std::string("evaluate refused the case: ") + e.what());
    else if (!refusable(e.b, e.h, e.i))
      o.fail("evaluate refused naming (b,h,i)=(" + std::to_string(e.b) + "," +
             std::to_string(e.h) + "," + std::to_string(e.i) + "), not a fully masked row");
  } catch (const std::exception& e) {
    o.fail(std::string("evaluate threw: ") + e.what());
  }
  const auto t1 = std::chrono::steady_clock::now();
  o.counts.seconds_reference += std::chrono::duration<double>(t1 - t0).count();

  const Model<Real> model(s);
  std::optional<Model<RealHi>> model_hi;  // built on first need
  std::optional<Checker> ck;
  if (res) {
    ck.emplace(o, s, res->golden);
    if (ck->listed_undecided() != res->stats.undecided)
      o.fail("stats.undecided " + std::to_string(res->stats.undecided) + " but " +
             std::to_string(ck->listed_undecided()) + " listed in .undecided tensors");
    const SafeTensorsFile gf = golden_file(*c, *res);
    const auto it = gf.metadata.find("attn.undecided");
    if (it == gf.metadata.end() || it->second != std::to_string(ck->listed_undecided()))
      o.fail("metadata attn.undecided is " +
             (it == gf.metadata.end() ? std::string("missing") : it->second));
    for (const auto& t : file.tensors) {
      const RawTensor* back = gf.find(t.name);
      if (!back || back->data != t.data || back->shape != t.shape || back->dtype != t.dtype)
        o.fail("golden_file does not hold input " + t.name + " unchanged");
    }
  }

  // row units, and a sample of them for the row-level enclosures
  std::vector<std::array<std::int64_t, 3>> units;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < (s.mha ? 1 : s.H); ++h)
      for (std::int64_t i = 0; i < s.Nq; ++i) units.push_back({b, h, i});
  std::vector<char> sampled(units.size(), units.size() <= 48 ? 1 : 0);
  if (units.size() > 48) {
    std::uint64_t z = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (int k = 0; k < 24; ++k) {
      z ^= z >> 31;
      z *= 0xBF58476D1CE4E5B9ULL;
      sampled[z % units.size()] = 1;
    }
  }
  std::optional<RowEvaluator> ev;
  try {
    ev.emplace(*c);
  } catch (const std::exception& e) {
    o.fail(std::string("RowEvaluator threw: ") + e.what());
  }
  for (std::size_t k = 0; k < units.size(); ++k) {
    const auto [b, h, i] = units[k];
    if (!res && !(ev && sampled[k])) continue;
    const auto m0 = std::chrono::steady_clock::now();
    const Unit<Real> u = model.unit(b, h, i);
    std::optional<Unit<RealHi>> uh;
    using HiUnit = const Unit<RealHi>&;
    const std::function<HiUnit()> hi = [&, b = b, h = h, i = i]() -> HiUnit {
      if (!model_hi) model_hi.emplace(s);
      if (!uh) uh = model_hi->unit(b, h, i);
      return *uh;
    };
    if (res) check_unit(*ck, s, b, h, i, u, hi);
    o.counts.seconds_model +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - m0).count();
    if (ev && sampled[k]) {
      bool expect_throw = false;
      for (std::int64_t hh = 0; hh < s.H; ++hh)
        if (s.mha || hh == h) expect_throw |= refusable(b, hh, i);
      check_row_enclosures(o, s, *ev, b, h, i, u, expect_throw);
    }
  }
  return o;
}

std::optional<std::uint64_t> env_seed() {
  const char* e = std::getenv("ATTNORACLE_SEED");
  if (!e || !*e) return std::nullopt;
  return std::strtoull(e, nullptr, 0);
}

double env_scale() {
  const char* e = std::getenv("ATTNORACLE_TEST_SCALE");
  if (!e || !*e) return 1.0;
  const double s = std::strtod(e, nullptr);
  return s > 0 ? s : 1.0;
}

// The default generator options, with more of the large problems (up to 64 x 64).
RandomCaseOptions check_options() {
  RandomCaseOptions opt;
  opt.large_fraction = 0.08;
  return opt;
}

Outcome run_seed(std::uint64_t seed, const RandomCaseOptions& opt = check_options()) {
  RandomCaseInfo info;
  const SafeTensorsFile file = random_case(seed, opt, &info);
  std::string context = info.summary + "\n    case: " + describe_case(file) +
                        "\n    replay: ATTNORACLE_SEED=" + std::to_string(seed);
  return run_problem("random-" + std::to_string(seed), file, seed, std::move(context));
}

void report(const Outcome& o) {
  if (o.failure_count == 0) return;
  std::string msg = o.context;
  for (const auto& f : o.failures) msg += "\n  " + f;
  if (o.failure_count > o.failures.size())
    msg += "\n  ... and " + std::to_string(o.failure_count - o.failures.size()) + " more";
  ADD_FAILURE() << msg;
}

std::string summary(const Counts& c, double seconds) {
  std::ostringstream s;
  s << c.problems << " problems (" << c.refused << " refused), " << c.elements
    << " golden elements checked (" << c.exact_ties << " exact ties, " << c.near
    << " left undecidable by us, " << c.undecided << " undecided by the reference; "
    << c.second_looks << " second looks at ~2500 bits), " << c.enclosures
    << " enclosures in " << c.row_calls << " row calls; " << seconds << " s wall (reference "
    << c.seconds_reference << " s, model " << c.seconds_model << " s)";
  return s.str();
}

constexpr std::uint64_t kFirstSeed = 1;

TEST(IndependentCheck, RandomProblems) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::uint64_t> seeds;
  if (auto one = env_seed()) {
    seeds.push_back(*one);
  } else {
    const auto n = static_cast<std::uint64_t>(std::max(1.0, std::round(2400 * env_scale())));
    for (std::uint64_t k = 0; k < n; ++k) seeds.push_back(kFirstSeed + k);
  }
  std::vector<Outcome> outcomes(seeds.size());
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < seeds.size();) outcomes[k] = run_seed(seeds[k]);
  };
  const unsigned workers = std::max(1u, std::min(2u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  Counts total;
  std::string undecided_seeds;
  for (std::size_t k = 0; k < seeds.size(); ++k) {
    total.add(outcomes[k].counts);
    report(outcomes[k]);
    if (outcomes[k].counts.undecided) undecided_seeds += " " + std::to_string(seeds[k]);
  }
  if (seeds.size() == 1) {
    std::cout << outcomes[0].context << "\n";
    for (const auto& n : outcomes[0].notes) std::cout << "  " << n << "\n";
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "independent check: " << summary(total, secs) << std::endl;
  if (!undecided_seeds.empty())
    std::cout << "seeds with elements the reference left undecided:" << undecided_seeds << "\n";
  EXPECT_GE(total.elements, seeds.size());
}

// Whether a mask or bias of this shape broadcasts over the queries or the keys (shapes a
// reader that wants [..., Nq, Nk] would refuse).
bool broadcasts_within_head(const Arr& a, std::int64_t Nq, std::int64_t Nk) {
  const std::size_t r = a.shape.size();
  return r < 2 || (a.shape[r - 2] == 1 && Nq > 1) || (a.shape[r - 1] == 1 && Nk > 1);
}

// Masks and biases of every broadcast shape, key padding masks [B,1,1,Nk] and rank 0 among
// them: at least 500 problems (ATTNORACLE_TEST_SCALE scales it) whose mask or bias broadcasts
// over the queries or the keys, each golden element checked against our own evaluation.
TEST(IndependentCheck, BroadcastMasksAndBiases) {
  const auto start = std::chrono::steady_clock::now();
  RandomCaseOptions opt = check_options();
  opt.mask_fraction = 1;
  opt.bias_fraction = 0.5;
  opt.key_padding_mask_fraction = 0.3;
  opt.large_fraction = 0.02;
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(500 * env_scale())));
  std::vector<std::uint64_t> seeds;
  std::map<std::string, int> seen;
  for (std::uint64_t seed = 1'000'001; seeds.size() < want; ++seed) {
    const Spec s = read_spec(random_case(seed, opt));
    const bool m = s.mask && broadcasts_within_head(*s.mask, s.Nq, s.Nk);
    const bool b = s.bias && broadcasts_within_head(*s.bias, s.Nq, s.Nk);
    if (!m && !b) continue;
    seeds.push_back(seed);
    if (m) ++seen["mask rank " + std::to_string(s.mask->shape.size())];
    if (s.mask && s.mask->shape == std::vector<std::int64_t>{s.B, 1, 1, s.Nk}) ++seen["key padding"];
    if (b) ++seen["bias rank " + std::to_string(s.bias->shape.size())];
    if (s.mha) ++seen["mha"];
  }
  std::vector<Outcome> outcomes(seeds.size());
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < seeds.size();) outcomes[k] = run_seed(seeds[k], opt);
  };
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < std::max(1u, std::min(2u, std::thread::hardware_concurrency())); ++w)
    pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  Counts total;
  for (const auto& o : outcomes) {
    total.add(o.counts);
    report(o);
  }
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "broadcast masks and biases: " << all << "\nindependent check: "
            << summary(total, secs) << std::endl;
  EXPECT_EQ(total.problems, want);
  EXPECT_GE(total.elements, want - total.refused);
  if (env_scale() >= 1) {
    for (const char* k : {"mask rank 0", "mask rank 1", "mask rank 2", "mask rank 3",
                          "mask rank 4", "key padding", "bias rank 0", "mha"})
      EXPECT_GT(seen[k], 0) << k;
  }
}

// Runs `seeds` on two threads (each its own problem), totals and reports them.
Counts run_seeds(const std::vector<std::uint64_t>& seeds, const std::function<Outcome(std::uint64_t)>& one) {
  std::vector<Outcome> outcomes(seeds.size());
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < seeds.size();) outcomes[k] = one(seeds[k]);
  };
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < std::max(1u, std::min(2u, std::thread::hardware_concurrency())); ++w)
    pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  Counts total;
  for (const auto& o : outcomes) {
    total.add(o.counts);
    report(o);
  }
  return total;
}

// Options drawing sequence lengths in every problem, over up to 3 batches.
RandomCaseOptions seqlens_options() {
  RandomCaseOptions opt = check_options();
  opt.seqlens_fraction = 1;
  opt.max_batch = 3;
  opt.large_fraction = 0.02;
  return opt;
}

// Sequence lengths (padded varlen): at least 500 problems (ATTNORACLE_TEST_SCALE scales it)
// with seqlens_q or seqlens_k, causal aligned per batch, each golden element checked against
// our own evaluation.
TEST(IndependentCheck, SequenceLengths) {
  const auto start = std::chrono::steady_clock::now();
  const RandomCaseOptions opt = seqlens_options();
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(500 * env_scale())));
  std::vector<std::uint64_t> seeds;
  std::map<std::string, int> seen;
  for (std::uint64_t seed = 2'000'001; seeds.size() < want; ++seed) {
    RandomCaseInfo info;
    const SafeTensorsFile f = random_case(seed, opt, &info);
    if (!info.seqlens) continue;
    seeds.push_back(seed);
    const Spec s = read_spec(f);
    if (f.find("seqlens_q")) ++seen[std::string("seqlens_q ") + std::string(dtype_name(f.find("seqlens_q")->dtype))];
    if (f.find("seqlens_k")) ++seen["seqlens_k"];
    for (std::int64_t b = 0; b < s.B; ++b) {
      const auto n = static_cast<std::size_t>(b);
      if (s.lq[n] == 1 && s.Nq > 1) ++seen["decode"];
      if (s.lk[n] < s.Nk && s.lq[n] < s.Nq && s.causal == "bottom_right") ++seen["bottom_right padded"];
      if (s.lk[n] == 0) ++seen["no key"];
    }
    if (s.window) ++seen["window"];
    if (s.mha) ++seen["mha"];
  }
  const Counts total = run_seeds(seeds, [&](std::uint64_t seed) { return run_seed(seed, opt); });
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "sequence lengths: " << all << "\nindependent check: " << summary(total, secs) << std::endl;
  EXPECT_EQ(total.problems, want);
  EXPECT_GE(total.elements, want - total.refused);
  if (env_scale() >= 1) {
    for (const char* k : {"seqlens_q I32", "seqlens_q I64", "seqlens_k", "decode", "bottom_right padded",
                          "no key", "window", "mha"})
      EXPECT_GT(seen[k], 0) << k;
  }
}

// Poisoned unused positions: at least 500 problems (ATTNORACLE_TEST_SCALE scales it) whose
// padding queries' q rows and unused keys' k and v rows hold NaN and infinities. The same case
// with zeros there passes the independent check, and the golden tensors of both agree byte for
// byte on every compared row (padding rows are not compared; the reader may zero them).
TEST(IndependentCheck, PoisonedPositions) {
  const auto start = std::chrono::steady_clock::now();
  RandomCaseOptions opt = seqlens_options();
  opt.seqlens_fraction = 0.6;
  opt.query_mask_fraction = 0.4;
  opt.mask_fraction = 0.5;
  opt.poison_fraction = 1;
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(500 * env_scale())));
  std::vector<std::uint64_t> seeds;
  std::size_t poisoned = 0;
  for (std::uint64_t seed = 3'000'001; seeds.size() < want; ++seed) {
    RandomCaseInfo info;
    random_case(seed, opt, &info);
    if (info.poisoned == 0) continue;
    seeds.push_back(seed);
    poisoned += info.poisoned;
  }
  std::atomic<std::size_t> compared_rows{0};
  auto one = [&](std::uint64_t seed) {
    RandomCaseInfo info;
    const SafeTensorsFile bad = random_case(seed, opt, &info);
    const std::string context = info.summary + "\n    case: " + describe_case(bad) +
                                "\n    replay: ATTNORACLE_SEED=" + std::to_string(seed);
    Outcome o = run_problem("clean-" + std::to_string(seed), *info.clean, seed, context);
    try {
      const Case cb = case_from_file("poisoned", bad), cc = case_from_file("clean", *info.clean);
      std::optional<EvalResult> rb, rc;
      try {
        rc.emplace(evaluate(cc, EvalOptions{}));
      } catch (const FullyMaskedRow&) {
      }
      try {
        rb.emplace(evaluate(cb, EvalOptions{}));
      } catch (const FullyMaskedRow&) {
      }
      if (rb.has_value() != rc.has_value()) {
        o.fail("one of the poisoned and clean cases was refused, not the other");
        return o;
      }
      if (!rb) return o;
      for (const RawTensor& t : rc->golden) {
        if (t.shape.size() < 3 || t.shape[0] != cc.B || t.shape[1] != cc.Hq || t.shape[2] != cc.Nq) continue;
        const RawTensor* u = nullptr;
        for (const RawTensor& x : rb->golden)
          if (x.name == t.name) u = &x;
        if (!u || u->data.size() != t.data.size()) {
          o.fail(t.name + ": missing or resized in the poisoned case");
          continue;
        }
        const std::size_t per = t.data.size() / static_cast<std::size_t>(cc.B * cc.Hq * cc.Nq);
        for (std::int64_t b = 0; b < cc.B; ++b)
          for (std::int64_t h = 0; h < cc.Hq; ++h)
            for (std::int64_t i = 0; i < cc.Nq; ++i) {
              if (!cc.query_valid(b, i)) continue;
              ++compared_rows;
              const std::size_t at = static_cast<std::size_t>((b * cc.Hq + h) * cc.Nq + i) * per;
              if (!std::equal(t.data.begin() + at, t.data.begin() + at + per, u->data.begin() + at))
                o.fail(t.name + ": row " + std::to_string(b) + "," + std::to_string(h) + "," +
                       std::to_string(i) + " differs between the poisoned and the clean case");
            }
      }
    } catch (const std::exception& e) {
      o.fail(std::string("the poisoned case: ") + e.what());
    }
    return o;
  };
  const Counts total = run_seeds(seeds, one);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "poisoned positions: " << poisoned << " non-finite elements in " << seeds.size()
            << " problems, " << compared_rows << " rows compared byte for byte\nindependent check: "
            << summary(total, secs) << std::endl;
  EXPECT_EQ(total.problems, want);
  EXPECT_GT(compared_rows.load(), want);
}

// FP8 inputs, both formats, with distinct non-unit descales per (batch, kv head) on most
// problems: at least 500 problems (ATTNORACLE_TEST_SCALE scales it), each golden element checked
// against our own evaluation, which applies the descales itself.
TEST(IndependentCheck, Fp8InputsWithDescales) {
  const auto start = std::chrono::steady_clock::now();
  RandomCaseOptions opt = check_options();
  opt.input_dtypes = {DType::F8_E4M3, DType::F8_E5M2};
  opt.mha_fraction = 0;
  opt.large_fraction = 0.03;
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(500 * env_scale())));
  std::vector<std::uint64_t> seeds;
  std::map<std::string, int> seen;
  for (std::uint64_t seed = 2'000'001; seeds.size() < want; ++seed) {
    const Spec s = read_spec(random_case(seed, opt));
    seeds.push_back(seed);
    ++seen[std::string(dtype_name(s.in)) + "->" + std::string(dtype_name(s.out))];
    for (const auto* d : {&s.q_descale, &s.k_descale, &s.v_descale})
      if (*d && s.B * s.Hkv > 1) {
        std::vector<double> v = (*d)->v;
        std::sort(v.begin(), v.end());
        if (std::adjacent_find(v.begin(), v.end()) == v.end() &&
            std::find(v.begin(), v.end(), 1.0) == v.end())
          ++seen["distinct non-unit descales"];
      }
    if (s.Hkv > 1 && s.H > s.Hkv) ++seen["gqa"];
  }
  const Counts total = run_seeds(seeds, [&](std::uint64_t seed) { return run_seed(seed, opt); });
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "fp8: " << all << "\nindependent check: " << summary(total, secs) << std::endl;
  EXPECT_EQ(total.problems, want);
  EXPECT_GE(total.elements, want - total.refused);
  if (env_scale() >= 1) {
    for (const char* k : {"F8_E4M3->F32", "F8_E4M3->F16", "F8_E4M3->BF16", "F8_E5M2->F32",
                          "F8_E5M2->F16", "F8_E5M2->BF16", "distinct non-unit descales", "gqa"})
      EXPECT_GT(seen[k], 0) << k;
  }
}

// Sinks (one logit per query head in the denominator) and the scores output: at least 500
// problems with sinks (ATTNORACLE_TEST_SCALE scales it), every dtype, GQA and mha among them,
// rows with no allowed key but a sink, half of them asking for scores.
TEST(IndependentCheck, SinksAndScores) {
  const auto start = std::chrono::steady_clock::now();
  RandomCaseOptions opt = check_options();
  opt.sinks_fraction = 1;
  opt.scores_fraction = 0.5;
  opt.large_fraction = 0.02;
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(500 * env_scale())));
  std::vector<std::uint64_t> seeds;
  std::map<std::string, int> seen;
  for (std::uint64_t seed = 2'000'001; seeds.size() < want; ++seed) {
    RandomCaseInfo info;
    const Spec s = read_spec(random_case(seed, opt, &info));
    seeds.push_back(seed);
    ++seen["in " + std::string(dtype_name(s.in))];
    ++seen["sinks " + std::string(dtype_name(s.sinks->dtype))];
    if (s.want_scores) ++seen["scores"];
    if (s.mha) ++seen["mha"];
    if (!s.mha && s.H > s.Hkv) ++seen["gqa"];
    if (info.fully_masked_row) ++seen["row with only its sink"];
    if (info.fully_masked_row && !s.zero_policy) ++seen["only its sink, policy error"];
  }
  const Counts total = run_seeds(seeds, [&](std::uint64_t seed) { return run_seed(seed, opt); });
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "sinks and scores: " << all << "\nindependent check: " << summary(total, secs)
            << std::endl;
  EXPECT_EQ(total.problems, want);
  EXPECT_EQ(total.refused, 0u);  // with sinks no row is fully masked
  EXPECT_GE(total.elements, want);
  if (env_scale() >= 1) {
    for (const char* k : {"in F64", "in F32", "in F16", "in BF16", "sinks F64", "sinks F32",
                          "scores", "mha", "gqa", "row with only its sink",
                          "only its sink, policy error"})
      EXPECT_GT(seen[k], 0) << k;
  }
}

// The features together: sinks and scores over padded varlen batches, and FP8 inputs with
// descales over them, at least 300 problems each (ATTNORACLE_TEST_SCALE scales it), each golden
// element checked against our own evaluation.
TEST(IndependentCheck, SinksAndFp8WithSequenceLengths) {
  const auto start = std::chrono::steady_clock::now();
  RandomCaseOptions with_sinks = seqlens_options();
  with_sinks.sinks_fraction = 1;
  with_sinks.scores_fraction = 0.5;
  RandomCaseOptions with_fp8 = seqlens_options();
  with_fp8.input_dtypes = {DType::F8_E4M3, DType::F8_E5M2};
  with_fp8.mha_fraction = 0;
  const auto want = static_cast<std::size_t>(std::max(1.0, std::round(300 * env_scale())));
  std::map<std::string, int> seen;
  Counts total;
  for (const RandomCaseOptions* opt : {&with_sinks, &with_fp8}) {
    std::vector<std::uint64_t> seeds;
    for (std::uint64_t seed = 4'000'001; seeds.size() < want; ++seed) {
      RandomCaseInfo info;
      const SafeTensorsFile f = random_case(seed, *opt, &info);
      if (!info.seqlens) continue;
      seeds.push_back(seed);
      const Spec s = read_spec(f);
      if (s.sinks) ++seen["sinks"];
      if (s.want_scores) ++seen["scores"];
      if (s.q_descale || s.k_descale || s.v_descale) ++seen["descales"];
      for (std::int64_t b = 0; b < s.B; ++b)
        if (s.lk[static_cast<std::size_t>(b)] == 0 && s.sinks) ++seen["sink only (seqlens_k 0)"];
      if (s.causal == "bottom_right") ++seen["bottom_right"];
    }
    const Counts c = run_seeds(seeds, [&](std::uint64_t seed) { return run_seed(seed, *opt); });
    total.add(c);
    EXPECT_EQ(c.problems, want);
  }
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "features together: " << all << "\nindependent check: " << summary(total, secs) << std::endl;
  EXPECT_GE(total.elements, 2 * want - total.refused);
  if (env_scale() >= 1) {
    for (const char* k : {"sinks", "scores", "descales", "sink only (seqlens_k 0)", "bottom_right"})
      EXPECT_GT(seen[k], 0) << k;
  }
}

// ---- hand-made cases ----

Outcome run_hand_case(const std::string& name, const SafeTensorsFile& f) {
  Outcome o = run_problem(name, f, 0, name + ": " + describe_case(f));
  report(o);
  return o;
}

// Two keys with equal scores, values adjacent in F16: the output is exactly the midpoint
// between them, which the reference decides (ties to even), and so must we.
TEST(IndependentCheck, MidpointOfEqualScoresIsDecided) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.outputs", "out,weights,lse"}};
  const double a = 1.0, b = 1.0 + std::ldexp(1.0, -10);  // adjacent F16 values
  f.put(float_tensor("q", DType::F16, {1, 1, 2, 2}, {0.5, -0.25, 0, 0}));
  f.put(float_tensor("k", DType::F16, {1, 1, 2, 2}, {1, 2, 1, 2}));
  f.put(float_tensor("v", DType::F16, {1, 1, 2, 3}, {a, b, -b, b, a, std::ldexp(1.0, -24)}));
  const Outcome o = run_hand_case("midpoint", f);
  EXPECT_GE(o.counts.exact_ties, 4u);  // out[0,0,0,0:2] and out.ref (F64 decides them too)
  // (a+b)/2 in F16 is the midpoint: ties to even give a (0x3C00), b is odd (0x3C01)
  const Case c = case_from_file("midpoint", f);
  const EvalResult r = evaluate(c, EvalOptions{});
  EXPECT_EQ(r.stats.undecided, 0u);
}

// A fully masked row under policy zero next to a padding row under policy error.
TEST(IndependentCheck, MaskedRowsAndPadding) {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"attn.masked_rows", "zero"},
                {"attn.causal", "bottom_right"}, {"attn.outputs", "lse,out,weights"}};
  f.put(float_tensor("q", DType::F32, {1, 1, 3, 2}, {1, 2, 3, 4, 5, 6}));
  f.put(float_tensor("k", DType::F32, {1, 1, 2, 2}, {0.5, 0.25, -1, 2}));
  f.put(float_tensor("v", DType::F32, {1, 1, 2, 1}, {3, -7}));
  EXPECT_GT(run_hand_case("masked-zero", f).counts.elements, 0u);
  f.metadata["attn.masked_rows"] = "error";
  RawTensor qm;
  qm.name = "query_mask";
  qm.dtype = DType::BOOL;
  qm.shape = {1, 3};
  qm.data = {0, 1, 1};
  f.put(qm);
  EXPECT_GT(run_hand_case("masked-padding", f).counts.elements, 0u);
  qm.data = {1, 1, 0};
  f.put(qm);
  EXPECT_EQ(run_hand_case("masked-refused", f).counts.refused, 1u);
}

// The check catches a one-ulp change of any rounded golden element, a wrong row.valid, and a
// bound off by 1e-9.
TEST(IndependentCheck, CatchesCorruptedResults) {
  RandomCaseOptions opt;
  opt.allow_masked_rows = false;
  opt.weights_fraction = opt.lse_fraction = 1;
  opt.families = {DataFamily::Uniform, DataFamily::Normal};
  int caught = 0, tried = 0;
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const SafeTensorsFile f = random_case(seed, opt);
    for (const char* name : {"out", "out.ref", "weights", "weights.ref", "lse", "lse.ref",
                             "row.valid", "out.bound"}) {
      std::int64_t where = -1;
      auto tamper = [&](EvalResult& r) {
        for (auto& t : r.golden) {
          if (t.name != name) continue;
          where = static_cast<std::int64_t>(seed % static_cast<std::uint64_t>(t.numel()));
          unsigned char* p = t.data.data() + where * static_cast<std::int64_t>(dtype_size(t.dtype));
          if (t.dtype == DType::BOOL) {
            *p ^= 1;
          } else if (t.name == "out.bound") {
            double x;
            std::memcpy(&x, p, 8);
            x = x * (1 + 1e-9) + 1e-300;
            std::memcpy(p, &x, 8);
          } else {
            store_bits(load_bits(p, t.dtype) ^ 1, t.dtype, p);  // one ulp
          }
        }
      };
      const Outcome o = run_problem("tampered", f, seed, "", tamper);
      if (where < 0) continue;
      ++tried;
      if (o.failure_count > 0) ++caught;
      else ADD_FAILURE() << "seed " << seed << ": a change of " << name << "[" << where
                         << "] went unnoticed";
    }
  }
  EXPECT_GT(tried, 100);
  EXPECT_EQ(caught, tried);
}

// ---- the generator ----

TEST(RandomCase, SameSeedSameFile) {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    const auto a = serialize_safetensors(random_case(seed, RandomCaseOptions{}));
    const auto b = serialize_safetensors(random_case(seed, RandomCaseOptions{}));
    ASSERT_EQ(a, b) << "seed " << seed;
  }
}

// The default options reach every feature the independent check is meant to cover.
TEST(RandomCase, CoversTheFeatures) {
  std::map<std::string, int> seen;
  const auto n = static_cast<std::uint64_t>(std::max(1.0, std::round(2400 * env_scale())));
  for (std::uint64_t seed = kFirstSeed; seed < kFirstSeed + n; ++seed) {
    RandomCaseInfo info;
    const SafeTensorsFile f = random_case(seed, check_options(), &info);
    const Spec s = read_spec(f);
    ++seen["family " + std::string(family_name(info.family))];
    ++seen[std::string(s.mha ? "mha" : "sdpa") + " in " + std::string(dtype_name(s.in))];
    ++seen["out " + std::string(dtype_name(s.out))];
    if (s.in != s.out) ++seen["output dtype differs"];
    if (!s.mha && s.Hkv > 1 && s.H > s.Hkv) ++seen["gqa"];
    if (!s.mha && s.Hkv == 1 && s.H > 1) ++seen["mqa"];
    if (s.Nq > s.Nk) ++seen["Nq > Nk"];
    if (s.Nq < s.Nk) ++seen["Nq < Nk"];
    if (s.Nq == 1 && s.Nk == 1) ++seen["1x1"];
    if (s.Nq >= 40 && s.Nk >= 40) ++seen["large"];
    if (s.mask) ++seen["mask rank " + std::to_string(s.mask->shape.size())];
    if (s.mask && broadcasts_within_head(*s.mask, s.Nq, s.Nk)) ++seen["mask broadcast"];
    if (s.bias && s.bias->shape.empty()) ++seen["bias rank 0"];
    if (s.bias) {
      ++seen["bias " + std::string(dtype_name(s.bias->dtype))];
      if (std::any_of(s.bias->v.begin(), s.bias->v.end(), [](double x) { return std::isinf(x); }))
        ++seen["bias -inf"];
      if (s.bias->shape.size() < 4 || std::count(s.bias->shape.begin(), s.bias->shape.end(), 1))
        ++seen["bias broadcast"];
    }
    ++seen["causal " + s.causal];
    if (s.window) ++seen["window"];
    if (s.query_mask) ++seen["query_mask"];
    if (!s.softcap.empty()) ++seen["softcap"];
    const auto scale = f.metadata.find("attn.scale");
    if (scale != f.metadata.end())
      ++seen[scale->second.find('x') != std::string::npos ? "scale hex" : "scale decimal"];
    if (s.want_weights) ++seen["weights"];
    if (s.want_lse) ++seen["lse"];
    if (info.fully_masked_row && s.zero_policy) ++seen["fully masked, zero"];
    if (info.expect_refusal) ++seen["refusal"];
    if (info.padding_masked_row && !s.zero_policy) ++seen["masked padding, error"];
    if (!info.fully_masked_row && !s.zero_policy) ++seen["policy error, no masked row"];
  }
  std::string all;
  for (const auto& [k, v] : seen) all += k + "=" + std::to_string(v) + " ";
  std::cout << all << "\n";
  for (const char* want :
       {"family uniform", "family normal", "family large_scores", "family ties",
        "family subnormal", "family wide_range", "family cancel", "sdpa in F64", "sdpa in F32",
        "sdpa in F16", "sdpa in BF16", "mha in F64", "mha in F32", "mha in F16", "mha in BF16",
        "out F64", "out F32", "out F16", "out BF16", "output dtype differs", "gqa", "mqa",
        "Nq > Nk", "Nq < Nk", "1x1", "large", "mask rank 2", "mask rank 3", "mask rank 4",
        "mask broadcast", "bias rank 0", "bias F32", "bias F64", "bias F16", "bias BF16", "bias -inf", "bias broadcast",
        "causal top_left", "causal bottom_right", "window", "query_mask", "softcap",
        "scale hex", "scale decimal", "weights", "lse", "fully masked, zero", "refusal",
        "masked padding, error", "policy error, no masked row"})
    if (env_scale() >= 1) {
      EXPECT_GT(seen[want], 0) << want;
    }
}

}  // namespace
}  // namespace attnoracle::testing
