// Inputs of kind merge (CONTRACT section 8): stored partial states o_partial [S,B,H,Nq,Dv] and
// lse_partial [S,B,H,Nq] as a split-KV or cascade kernel leaves them.
#include <cmath>

#include "attnoracle/reference/round.hpp"
#include "attnoracle/vectors/problem.hpp"
#include "numbers.hpp"
#include "prng.hpp"

namespace attnoracle::vectors {
namespace {

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

RawTensor float_tensor(const std::string& name, DType t, std::vector<std::int64_t> shape,
                       const std::vector<double>& values) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(values.size() * dtype_size(t));
  for (std::size_t e = 0; e < values.size(); ++e)
    encode_float(t, values[e], r.data.data() + e * dtype_size(t));
  return r;
}

}  // namespace

SafeTensorsFile make_merge_problem(const ProblemSpec& p, std::uint64_t seed) {
  Rng data_rng(mix64(seed, 1)), lse_rng(mix64(seed, 2)), sinks_rng(mix64(seed, 5));
  const std::int64_t S = p.Nk, rows = p.B * p.Hq * p.Nq;
  SafeTensorsFile f;
  f.metadata["attn.format"] = "1";
  f.metadata["attn.kind"] = "merge";
  f.metadata["attn.masked_rows"] = std::string(masked_rows_name(p.masked_rows));
  f.metadata["attn.output_dtype"] = std::string(dtype_name(p.output_dtype.value_or(p.dtype)));
  f.metadata["attn.outputs"] = p.want_lse ? "out,lse" : "out";
  if (!p.output_dtypes.empty()) f.metadata["attn.output_dtypes"] = p.output_dtypes;
  if (p.lse_partial == "pos_inf") f.metadata["attn.lse_posinf"] = "empty";
  f.metadata["gen.generator"] = p.generator;
  f.metadata["gen.seed"] = std::to_string(seed);

  // lse_s per row: a common level (the row's scale) plus a spread per split; "wide" spreads the
  // splits over 100 (most of them negligible beside the largest, some below exp's underflow).
  std::vector<double> lse(sz(S * rows)), o(sz(S * rows * p.Dv));
  for (std::int64_t r = 0; r < rows; ++r) {
    const double level = lse_rng.uniform(-4.0, 12.0);
    // empty splits: "neg_inf" and "pos_inf" about a quarter, one split of each row kept;
    // "all_neg_inf" a quarter of the rows with every split empty
    const bool row_empty = p.lse_partial == "all_neg_inf" && lse_rng.chance(0.25);
    const auto kept = static_cast<std::int64_t>(lse_rng.below(sz(S)));
    for (std::int64_t s = 0; s < S; ++s) {
      double x = p.lse_partial == "wide" ? level + lse_rng.uniform(-90.0, 10.0)
                                         : level + 2 * lse_rng.normal();
      const bool empty = row_empty || (s != kept && (p.lse_partial == "neg_inf" || p.lse_partial == "pos_inf") &&
                                       lse_rng.chance(0.25));
      if (empty) x = p.lse_partial == "pos_inf" ? INFINITY : -INFINITY;
      lse[sz(s * rows + r)] = std::isfinite(x) ? round_into(x, DType::F32) : x;
      for (std::int64_t e = 0; e < p.Dv; ++e) {
        const double v = round_into(data_rng.normal(), p.dtype);
        // an empty split's O_s is unused: NaN, inf and 0 in turn, as kernels leave it
        o[sz((s * rows + r) * p.Dv + e)] = empty ? (e % 3 == 0 ? NAN : e % 3 == 1 ? INFINITY : 0.0) : v;
      }
    }
  }
  f.put(float_tensor("o_partial", p.dtype, {S, p.B, p.Hq, p.Nq, p.Dv}, o));
  f.put(float_tensor("lse_partial", DType::F32, {S, p.B, p.Hq, p.Nq}, lse));
  if (!p.sinks.empty()) {
    std::vector<double> s(sz(p.Hq));
    for (auto& x : s) {
      double v = 0;
      if (p.sinks == "near") v = 4 + 4 * sinks_rng.uniform();  // among the splits' lse
      else if (p.sinks == "dominant") v = 24 + 4 * sinks_rng.uniform();
      else v = -40 + 4 * sinks_rng.uniform();  // negligible (problem_error: no number for merge)
      x = round_into(v, p.sinks_dtype);
    }
    f.put(float_tensor("sinks", p.sinks_dtype, {p.Hq}, s));
  }
  return f;
}

}  // namespace attnoracle::vectors
