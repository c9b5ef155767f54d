// RapidCheck generators of attention problems (case files held in memory) aimed at attention's
// hard corners, and the test's own reading of a case file (CONTRACT sections 1 and 2), written
// independently of the reference's case reader, for the properties to judge the reference by.
#pragma once

#include <rapidcheck.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::testing {

// How the elements of one floating tensor are drawn. Every element is a finite value of the
// tensor's dtype, generated as a bit pattern.
enum class Values {
  Normal,     // |x| in [1/8, 4), random significand
  Dyadic,     // |x| in [1/8, 4), at most 3 significand bits: exact products, exact ties
  Large,      // |x| in [4, 64): with Dk <= 8, scaled scores reach about 1e4
  Subnormal,  // the dtype's subnormal range (and zeros)
  Mixed,      // each element from any of the above, zeros and the smallest normals
  Adjacent,   // two neighbouring values x and next(x): averages land on rounding midpoints
};

enum class MaskValues { AllTrue, Dense, Sparse, OneHot };  // OneHot: one allowed key per row
enum class BiasValues { Dyadic, Random, Large };           // Dyadic: k/8 with |k| <= 32

// The shape and options of one generated problem; `gen_file` draws the tensors. Properties may
// adjust a drawn spec (force an option) before drawing the tensors.
struct Spec {
  Kind kind = Kind::Sdpa;
  DType input = DType::F32;
  std::optional<DType> output;  // attn.output_dtype, when written
  // sdpa: B, Hq, Hkv, Nq, Nk, Dk, Dv; mha: B, H = Hq = Hkv, Nq, Nk, D, Dk, Dv, Dout
  std::int64_t B = 1, Hq = 1, Hkv = 1, Nq = 1, Nk = 1, Dk = 1, Dv = 1, D = 1, Dout = 1;
  std::string scale;        // attn.scale text; empty: absent (1/sqrt(Dk))
  std::string softcap;      // attn.softcap text; empty: absent
  std::string causal;       // attn.causal text; empty: absent
  std::string window;       // attn.window text ("none" or "L,R"); empty: absent
  std::string masked_rows;  // attn.masked_rows text; empty: absent (error)
  std::string outputs;      // attn.outputs text; empty: absent (out)
  // mask: rank 0 = absent, else 1..4, right-aligned against [B, Hq, Nq, Nk] (NumPy
  // broadcasting); each dimension full or 1
  int mask_rank = 0;
  bool mask_b_full = false, mask_h_full = false, mask_q_full = true, mask_k_full = true;
  MaskValues mask_values = MaskValues::Dense;
  // bias: rank 0 = absent, else 1..4, right-aligned against [B, Hq, Nq, Nk]; full[d] for the
  // dimension d of [B, Hq, Nq, Nk] (a dimension that is not full is 1)
  int bias_rank = 0;
  std::array<bool, 4> bias_full = {false, false, false, false};
  DType bias_dtype = DType::F64;
  BiasValues bias_values = BiasValues::Dyadic;
  int bias_neg_inf_percent = 0;
  // query_mask: absent, or each row padding with the given probability
  bool query_mask = false;
  int padding_percent = 25;
  // values of q, k, v (sdpa) or x_q, x_kv, w_q, w_k, w_v, w_o (mha)
  Values q_values = Values::Normal, k_values = Values::Normal, v_values = Values::Normal;
  Values x_values = Values::Normal, w_values = Values::Normal;
  // keys (sdpa: k rows; mha: x_kv rows) copied from an earlier key with this probability, the
  // copy then differing in the last bit of one element with probability near_tie_percent
  int tie_percent = 0, near_tie_percent = 50;
};

// An integer in [lo, hi), uniform whatever RapidCheck's size; shrinks towards lo.
template <class T>
rc::Gen<T> uniform(T lo, T hi) {
  return rc::gen::resize(100, rc::gen::inRange<T>(lo, hi));
}

rc::Gen<Spec> gen_spec();
void showValue(const Spec& s, std::ostream& os);  // how RapidCheck shows a drawn spec
std::string summary(const Spec& s);                // options and sizes on one line
rc::Gen<SafeTensorsFile> gen_file(const Spec& s);
rc::Gen<SafeTensorsFile> gen_case();  // gen_spec, then gen_file

// One floating tensor of `dtype` and `shape` with elements drawn as `style` says.
rc::Gen<RawTensor> gen_float_tensor(const std::string& name, DType dtype,
                                    std::vector<std::int64_t> shape, Values style);
// The metadata a spec writes (attn.format included).
std::map<std::string, std::string> metadata_of(const Spec& s);

// ---- Exact number helpers, written for the tests (independent of dtype.cpp and round.cpp) ----

std::uint64_t bits_of(DType t, const unsigned char* bytes);   // little-endian element
void store_bits(DType t, std::uint64_t bits, unsigned char* bytes);
double decode(DType t, std::uint64_t bits);                   // exact
std::uint64_t encode(DType t, double x);  // x must be a value of t (throws std::logic_error)
double round_to(DType t, double x);       // nearest-even into t, subnormals kept, overflow to inf
double spacing(DType t, double x);        // distance from |x| to the next larger value of t
std::vector<double> decode_all(const RawTensor& t);  // every element of a float tensor

// ---- Byte-level twins of tensors (any dtype) ----

// dst[.., perm[j], ..] = src[.., j, ..] along `axis`.
RawTensor permute_axis(const RawTensor& src, std::size_t axis, const std::vector<std::int64_t>& perm);
// Indices [from, to) along `axis` of dst replaced by those of src (same shape and dtype).
void splice_axis(RawTensor& dst, const RawTensor& src, std::size_t axis, std::int64_t from,
                 std::int64_t to);
// The tensor twice along axis 0 (dimension 0 doubled).
RawTensor repeat_axis0(const RawTensor& t);

// ---- The test's own reading of a case file ----

struct Reading {
  Kind kind = Kind::Sdpa;
  DType input = DType::F32, output = DType::F32;
  std::int64_t B = 0, Hq = 0, Hkv = 0, Nq = 0, Nk = 0, Dk = 0, Dv = 0, D = 0, Dout = 0;
  Causal causal = Causal::None;
  bool window = false;
  std::int64_t L = 0, R = 0;
  MaskedRows policy = MaskedRows::Error;
  bool want_weights = false, want_lse = false;
  std::vector<double> v;  // sdpa: values [B, Hkv, Nk, Dv]
  std::vector<std::int64_t> mask_shape, bias_shape;
  std::vector<unsigned char> mask;
  std::vector<double> bias;
  std::vector<unsigned char> query_mask;  // [B, Nq], empty when absent

  std::int64_t group(std::int64_t h) const { return h / (Hq / Hkv); }
  bool positional(std::int64_t i, std::int64_t j) const;
  double bias_value(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;  // 0 if absent
  bool allowed(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const;
  bool has_key(std::int64_t b, std::int64_t h, std::int64_t i) const;  // some allowed key
  bool query_valid(std::int64_t b, std::int64_t i) const;
  // The first (b, h, i), in that order, that policy `error` refuses: a non-padding row without
  // an allowed key.
  std::optional<std::array<std::int64_t, 3>> first_refused() const;
  double value(std::int64_t b, std::int64_t g, std::int64_t j, std::int64_t c) const {
    return v[static_cast<std::size_t>(((b * Hkv + g) * Nk + j) * Dv + c)];
  }
};
Reading read(const SafeTensorsFile& f);

// Options and sizes of a case on one line: metadata, then each tensor's dtype and shape.
std::string summary(const SafeTensorsFile& f);
// Options and sizes of a case, then every tensor (dtype, shape, elements as C hex floats).
std::string describe(const SafeTensorsFile& f, std::size_t max_elements = 64);

}  // namespace attnoracle::testing

namespace attnoracle {
// How RapidCheck shows a generated case file and tensor.
void showValue(const SafeTensorsFile& f, std::ostream& os);
void showValue(const RawTensor& t, std::ostream& os);
}  // namespace attnoracle
