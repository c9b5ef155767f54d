// Kind merge (CONTRACT section 8) as an sdpa case: the combine of partial states is a softmax
// over the splits with scores lse_s and values O_s.
#include <algorithm>
#include <string>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/merge_case.hpp"

namespace attnoracle {

Case merge_sdpa_case(const Case& m) {
  Case c;
  c.path = m.path;
  c.kind = Kind::Sdpa;
  c.input_dtype = m.input_dtype;  // o_partial's: q = k = 0 and its values are exact in it
  c.output_dtype = m.output_dtype;
  c.output_dtypes = m.output_dtypes;
  c.scale.emplace("1");  // constructed in place: GCC 12 reports a false -Wrestrict on assigning "1" (bug 105329)
  c.masked_rows = m.masked_rows;
  c.want_lse = m.want_lse;
  const std::int64_t S = m.Nk, H = m.Hq, Nq = m.Nq, R = H * Nq, B = m.B, Dv = m.Dv;
  c.B = B, c.Hq = c.Hkv = R, c.Nq = 1, c.Nk = S, c.Dk = 1, c.Dv = Dv;
  auto zeros = [](DType t, std::vector<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return FloatTensor{t, shape, std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  };
  c.q = zeros(m.input_dtype, {B, R, 1, 1});
  c.k = zeros(m.input_dtype, {B, R, S, 1});
  c.v = zeros(m.input_dtype, {B, R, S, Dv});
  c.bias = zeros(m.lse_partial.dtype, {B, R, 1, S});
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t r = 0; r < R; ++r) {  // r = h * Nq + i: the row of lse_partial[s, b]
        const auto src = static_cast<std::size_t>((s * B + b) * R + r);
        const auto dst = static_cast<std::size_t>((b * R + r) * S + s);
        c.bias->values[dst] = m.lse_partial.values[src];  // -inf: the split is not allowed
        std::copy_n(m.o_partial.values.begin() + static_cast<std::ptrdiff_t>(src * Dv), Dv,
                    c.v.values.begin() + static_cast<std::ptrdiff_t>(dst * Dv));
      }
  if (m.sinks) {
    c.sinks = zeros(m.sinks->dtype, {R});
    for (std::int64_t r = 0; r < R; ++r)
      c.sinks->values[static_cast<std::size_t>(r)] = m.sink(r / Nq);
  }
  // The same as a case file (the gate judges a merge as this case).
  auto put = [&](const char* name, const FloatTensor& t) {
    RawTensor r{name, t.dtype, t.shape, std::vector<unsigned char>(t.values.size() * dtype_size(t.dtype))};
    for (std::size_t e = 0; e < t.values.size(); ++e) encode_float(t.dtype, t.values[e], r.data.data() + e * dtype_size(t.dtype));
    c.file.put(std::move(r));
  };
  put("q", c.q), put("k", c.k), put("v", c.v), put("bias", *c.bias);
  if (c.sinks) put("sinks", *c.sinks);
  c.file.metadata = {{"attn.format", "1"}, {"attn.kind", "sdpa"}, {"attn.scale", "1"},
                     {"attn.masked_rows", std::string(masked_rows_name(m.masked_rows))},
                     {"attn.output_dtype", std::string(dtype_name(m.output_dtype))}};
  for (const char* key : {"attn.outputs", "attn.output_dtypes"})
    if (auto it = m.file.metadata.find(key); it != m.file.metadata.end()) c.file.metadata[key] = it->second;
  return c;
}

}  // namespace attnoracle
