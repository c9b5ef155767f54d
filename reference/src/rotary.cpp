#include "attnoracle/reference/rotary.hpp"

#include <mpfr.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/round.hpp"

namespace attnoracle {
namespace {

constexpr std::pair<RotaryPairing, std::string_view> kPairings[] = {
    {RotaryPairing::Interleaved, "interleaved"}, {RotaryPairing::Half, "half"}};

// Two products of doubles and their sum are exact at this precision: each product spans at most
// 106 bits with exponents in [-2148, 2048], so the sum spans fewer than 4300 bits.
constexpr mpfr_prec_t kExactPrec = 4400;

std::string quote(std::string_view s) { return "\"" + printable(s) + "\""; }

[[noreturn]] void refuse(const std::string& path, const std::string& field, const std::string& what) {
  throw InputError(path, field, what);
}

}  // namespace

std::string_view rotary_pairing_name(RotaryPairing p) { return table_name(kPairings, p); }
std::optional<RotaryPairing> rotary_pairing_from_name(std::string_view s) { return table_from_name(kPairings, s); }

bool has_rotary_inputs(const SafeTensorsFile& file) {
  return file.find(kRotaryCosName) || file.find(kRotarySinName) || file.metadata.count(kRotaryKey) ||
         file.metadata.count(kRotaryRoundKey);
}

std::int64_t rotary_query_position(const Case& c, std::int64_t b, std::int64_t i) {
  return i + (c.key_length(b) - c.query_length(b));
}

void rotate_pair(double x1, double x2, double cos, double sin, DType round, double& y1, double& y2) {
  mpfr_t a, b, cs, sn, r;
  mpfr_inits2(53, a, b, cs, sn, static_cast<mpfr_ptr>(nullptr));
  mpfr_init2(r, kExactPrec);
  mpfr_set_d(a, x1, MPFR_RNDN), mpfr_set_d(b, x2, MPFR_RNDN);
  mpfr_set_d(cs, cos, MPFR_RNDN), mpfr_set_d(sn, sin, MPFR_RNDN);
  mpfr_fmms(r, a, cs, b, sn, MPFR_RNDN);  // exact: x1 cos - x2 sin
  y1 = round_to_format(r, round);
  mpfr_fmma(r, a, sn, b, cs, MPFR_RNDN);  // exact: x1 sin + x2 cos
  y2 = round_to_format(r, round);
  mpfr_clears(a, b, cs, sn, r, static_cast<mpfr_ptr>(nullptr));
}

void apply_rotary(const std::string& path, const SafeTensorsFile& file, Case& c) {
  const auto fail = [&path](const std::string& field, const std::string& what) { refuse(path, field, what); };
  const RawTensor* tc = file.find(kRotaryCosName);
  const RawTensor* ts = file.find(kRotarySinName);
  const auto& md = file.metadata;
  const auto key = md.find(kRotaryKey), rkey = md.find(kRotaryRoundKey);
  const bool has_key = key != md.end(), has_round = rkey != md.end();
  if (!has_rotary_inputs(file)) return;
  const char* first = tc ? kRotaryCosName : ts ? kRotarySinName : has_key ? kRotaryKey : kRotaryRoundKey;
  if (c.kind != Kind::Sdpa) fail(first, "is for attn.kind sdpa only");
  if (tc && !ts) fail(kRotaryCosName, "given, but the case has no rotary_sin tensor");
  if (ts && !tc) fail(kRotarySinName, "given, but the case has no rotary_cos tensor");
  if (!tc) fail(first, "given, but the case has no rotary_cos and rotary_sin tensors (the tables)");
  if (!has_key) fail(kRotaryCosName, "given, but attn.rotary is missing (interleaved or half)");
  const auto pairing = rotary_pairing_from_name(key->second);
  if (!pairing) fail(kRotaryKey, "value " + quote(key->second) + " is not interleaved or half");
  // Without attn.rotary_round the rotated values stay exact: two products of values of at most
  // 24 significant bits each, exact in double (48 bits, exponents far inside its range).
  const bool exact = !has_round;
  if (exact && float_format(c.input_dtype).precision > 24)
    fail(kRotaryKey, "given without attn.rotary_round on " + std::string(dtype_name(c.input_dtype)) +
                         " inputs: an exact rotation is evaluated for F32, F16 and BF16 inputs (name the dtype "
                         "rotated q and k are rounded to)");
  if (exact && c.wants_gradients())
    fail(kRotaryKey, "given without attn.rotary_round: the gradients of an exact rotation are not evaluated "
                     "(name the dtype rotated q and k are rounded to, or ask out, weights, lse and scores only)");
  const auto round = exact ? std::optional<DType>(DType::F64) : dtype_from_name(rkey->second);
  if (!round || !is_float_format(*round))
    fail(kRotaryRoundKey, "value " + quote(rkey->second) + " is not F64, F32, F16 or BF16");
  if (c.paged)
    fail(kRotaryCosName, "given with a paged KV cache, whose keys are stored as kernels keep them (rotated)");
  if (c.kv_form) fail(kRotaryCosName, "given with K/V in a stored form of section 9, which holds keys as stored");
  for (const RawTensor* t : {tc, ts}) {
    if (t->dtype != DType::F32 && t->dtype != c.input_dtype)
      fail(t->name, "dtype " + std::string(dtype_name(t->dtype)) + " is not F32" +
                        (c.input_dtype == DType::F32 ? std::string()
                                                     : " or " + std::string(dtype_name(c.input_dtype)) + " (the input dtype)"));
    if (t->shape.size() != 2)
      fail(t->name, "shape " + shape_string(t->shape) + " is not [Nrot,R/2]");
  }
  if (ts->shape != tc->shape)
    fail(kRotarySinName, "shape " + shape_string(ts->shape) + " is not that of rotary_cos " + shape_string(tc->shape));
  const std::int64_t nrot = tc->shape[0], half = tc->shape[1], R = 2 * half;
  if (half == 0) fail(kRotaryCosName, "shape " + shape_string(tc->shape) + " has R/2 = 0 (no feature to rotate)");
  if (R > c.Dk)
    fail(kRotaryCosName, "shape " + shape_string(tc->shape) + " gives R = " + std::to_string(R) +
                             ", more than Dk = " + std::to_string(c.Dk));
  std::vector<double> cosv(static_cast<std::size_t>(nrot * half)), sinv(cosv.size());
  for (auto [t, out] : {std::pair{tc, &cosv}, std::pair{ts, &sinv}})
    for (std::size_t e = 0; e < out->size(); ++e) {
      const double x = decode_float(t->dtype, t->data.data() + e * dtype_size(t->dtype));
      if (!std::isfinite(x))
        fail(t->name, "element " + std::to_string(e) + " is " +
                          (std::isnan(x) ? "NaN" : x > 0 ? "+infinity" : "-infinity"));
      (*out)[e] = x;
    }
  // The positions used: every compared query's and every key below seqlens_k.
  for (std::int64_t b = 0; b < c.B; ++b) {
    for (std::int64_t i = 0; i < c.Nq; ++i) {
      if (!c.query_valid(b, i)) continue;
      const std::int64_t t = rotary_query_position(c, b, i);
      if (t < 0 || t >= nrot)
        fail(kRotaryCosName, "has Nrot = " + std::to_string(nrot) + " positions, but query " + std::to_string(i) +
                                 " of b=" + std::to_string(b) + " sits at position " + std::to_string(t) +
                                 " (i + seqlens_k - seqlens_q)");
    }
    if (c.key_length(b) > nrot)
      fail(kRotaryCosName, "has Nrot = " + std::to_string(nrot) + " positions, but b=" + std::to_string(b) +
                               " has " + std::to_string(c.key_length(b)) + " keys");
  }
  Rotary rot{*pairing, R, nrot, *round, std::move(cosv), std::move(sinv), {}, {}, exact, {}, {}};
  // Rotates the first R features of each row of x [B, H, N, Dk] at the position of its row.
  const auto rotate = [&](FloatTensor& x, std::vector<double>& mag, std::vector<double>& parts, std::int64_t H,
                          std::int64_t N, bool queries, const char* name) {
    mag.assign(x.values.size(), 0.0);
    if (exact) {  // (x, 0) where nothing rotates
      parts.assign(2 * x.values.size(), 0.0);
      for (std::size_t e = 0; e < x.values.size(); ++e) parts[2 * e] = x.values[e];
    }
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t n = 0; n < N; ++n) {
          const std::int64_t t = queries ? rotary_query_position(c, b, n) : n;
          if (t < 0 || t >= nrot) continue;  // padding or a key past seqlens_k: never used
          const bool used = queries ? c.query_valid(b, n) : n < c.key_length(b);
          double* row = x.values.data() + ((b * H + h) * N + n) * c.Dk;
          for (std::int64_t f = 0; f < half; ++f) {
            const std::int64_t i1 = rot.first(f), i2 = rot.second(f);
            double& x1 = row[i1];
            double& x2 = row[i2];
            const auto at = static_cast<std::size_t>(row - x.values.data());
            const auto p1 = 2 * (at + static_cast<std::size_t>(i1)), p2 = 2 * (at + static_cast<std::size_t>(i2));
            if (!std::isfinite(x1) || !std::isfinite(x2)) {  // left to the unused-position rules
              x1 = x2 = std::numeric_limits<double>::quiet_NaN();
              if (exact) parts[p1] = parts[p2] = x1;
              continue;
            }
            const auto e = static_cast<std::size_t>(t * half + f);
            mag[at + static_cast<std::size_t>(i1)] = std::fabs(x1 * rot.cos[e]) + std::fabs(x2 * rot.sin[e]);
            mag[at + static_cast<std::size_t>(i2)] = std::fabs(x1 * rot.sin[e]) + std::fabs(x2 * rot.cos[e]);
            double y1, y2;
            if (exact) {  // each product exact (see above); the sums rounded to double for q and k
              parts[p1] = x1 * rot.cos[e], parts[p1 + 1] = -(x2 * rot.sin[e]);
              parts[p2] = x1 * rot.sin[e], parts[p2 + 1] = x2 * rot.cos[e];
              x1 = parts[p1] + parts[p1 + 1], x2 = parts[p2] + parts[p2 + 1];
              continue;
            }
            rotate_pair(x1, x2, rot.cos[e], rot.sin[e], *round, y1, y2);
            if (used && (!std::isfinite(y1) || !std::isfinite(y2)))
              fail(kRotaryRoundKey, std::string("rotated ") + name + " element " +
                                        std::to_string(row - x.values.data() + (std::isfinite(y1) ? i2 : i1)) +
                                        " overflows " + rkey->second);
            x1 = y1, x2 = y2;
          }
        }
  };
  rotate(c.q, rot.q_mag, rot.q_parts, c.Hq, c.Nq, true, "q");
  rotate(c.k, rot.k_mag, rot.k_parts, c.Hkv, c.Nk, false, "k");
  c.rotary = std::move(rot);
}

Case exact_rotation_case(const Case& c) {
  Case e = c;
  const Rotary& r = *c.rotary;
  // q' = (a, a, b, b), k' = (a', b', a', b'): q'.k' = (a + b)(a' + b') feature by feature
  const auto expand = [](FloatTensor& x, const std::vector<double>& parts, bool query) {
    std::vector<double> out(2 * parts.size());
    for (std::size_t f = 0; f < parts.size() / 2; ++f) {
      const double a = parts[2 * f], b = parts[2 * f + 1];
      const double v[4] = {a, query ? a : b, query ? b : a, b};
      std::copy(v, v + 4, out.begin() + static_cast<std::ptrdiff_t>(4 * f));
    }
    x.values = std::move(out);
    x.shape.back() *= 4;
  };
  expand(e.q, r.q_parts, true);
  expand(e.k, r.k_parts, false);
  e.scale_features = c.scale_features ? c.scale_features : c.Dk;
  e.Dk = 4 * c.Dk;
  e.rotary.reset();
  return e;
}

}  // namespace attnoracle
