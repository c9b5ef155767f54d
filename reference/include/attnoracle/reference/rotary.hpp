// Rotary embedding from given tables (CONTRACT section 10): the first R features of q and k
// rotated by position before the scores, each rotated value rounded once to attn.rotary_round,
// or kept exact without it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle {

struct Case;

// Metadata keys and tensor names.
inline constexpr const char* kRotaryKey = "attn.rotary";
inline constexpr const char* kRotaryRoundKey = "attn.rotary_round";
inline constexpr const char* kRotaryCosName = "rotary_cos";
inline constexpr const char* kRotarySinName = "rotary_sin";

// interleaved: pairs (2f, 2f + 1) (GPT-J); half: pairs (f, f + R/2) (NeoX).
enum class RotaryPairing { Interleaved, Half };
std::string_view rotary_pairing_name(RotaryPairing p);
std::optional<RotaryPairing> rotary_pairing_from_name(std::string_view s);

struct Rotary {
  RotaryPairing pairing = RotaryPairing::Interleaved;
  std::int64_t R = 0;    // rotated features, even, at most Dk
  std::int64_t Nrot = 0; // positions the tables hold
  DType round = DType::F32;  // when not exact
  std::vector<double> cos, sin;  // the tables, [Nrot, R/2] row-major
  // Per element of q and of k: |x1 cos| + |x2 sin| for the first of a rotated pair, |x1 sin| +
  // |x2 cos| for the second, from the values as given (0 past R and at unused positions): the
  // magnitude a kernel's own rotation rounds on.
  std::vector<double> q_mag, k_mag;
  // Without attn.rotary_round: the rotated values exact. Each is x1 c - x2 s or x1 s + x2 c, two
  // products of values of at most 24 significant bits, each exact in a double: q_parts and
  // k_parts hold per element of q and k the two doubles whose sum it is ([..., Dk, 2]; the value
  // and 0 where nothing rotates), q and k of the case the sums rounded to double.
  bool exact = false;
  std::vector<double> q_parts, k_parts;
  // Features (i1, i2) of pair f: (2f, 2f + 1) interleaved, (f, f + R/2) half.
  std::int64_t first(std::int64_t f) const { return pairing == RotaryPairing::Interleaved ? 2 * f : f; }
  std::int64_t second(std::int64_t f) const { return pairing == RotaryPairing::Interleaved ? 2 * f + 1 : f + R / 2; }
};

// Whether the file names any of the rotary inputs (tables or keys).
bool has_rotary_inputs(const SafeTensorsFile& file);

// The position of query i of batch b: i + (Lk - Lq) (section 1's i', whatever the causal mode).
std::int64_t rotary_query_position(const Case& c, std::int64_t b, std::int64_t i);

// (x1 cos - x2 sin, x1 sin + x2 cos), each decided exactly and rounded once to `round`.
void rotate_pair(double x1, double x2, double cos, double sin, DType round, double& y1, double& y2);

// The case of an exact rotation whose forward results are c's: q and k of Dk' = 4 Dk features,
// (a, a, b, b) and (a', b', a', b') per feature (a + b, a' + b' the exact rotated values), so that
// each score's dot product is q.k exactly; the scale stays c's (scale_features = c.Dk), and the
// rotation is gone.
Case exact_rotation_case(const Case& c);

// Reads the tables and keys of `file` into c.rotary and rotates c.q and c.k in place (c of kind
// sdpa, its sizes, lengths and inputs read). Positions outside the tables, which only padding
// rows and keys past seqlens_k reach, are left as given; a pair with a non-finite element
// becomes NaN, NaN. Throws InputError(path, <tensor or key>, <what>).
void apply_rotary(const std::string& path, const SafeTensorsFile& file, Case& c);

}  // namespace attnoracle
