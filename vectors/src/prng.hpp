// A portable PRNG: xoshiro256** seeded with splitmix64, and distributions that use only
// + - * / on doubles, so that every platform draws the same numbers.
#pragma once

#include <cstdint>

namespace attnoracle::vectors {

std::uint64_t splitmix64(std::uint64_t& state);
// A 64-bit hash of (a, b): two splitmix64 steps, for deriving independent seeds.
std::uint64_t mix64(std::uint64_t a, std::uint64_t b);

class Rng {
 public:
  explicit Rng(std::uint64_t seed);
  std::uint64_t next();                  // xoshiro256**
  double uniform();                      // [0, 1), a multiple of 2^-53
  double uniform(double lo, double hi);  // [lo, hi) up to rounding
  double normal();                       // Irwin-Hall: sum of 12 uniforms - 6, in [-6, 6]
  std::uint64_t below(std::uint64_t n);  // [0, n), unbiased (rejection); n >= 1
  bool chance(double p) { return uniform() < p; }
  double sign() { return (next() >> 63) ? -1.0 : 1.0; }

 private:
  std::uint64_t s_[4];
};

}  // namespace attnoracle::vectors
