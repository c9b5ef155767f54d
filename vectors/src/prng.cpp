#include "prng.hpp"

namespace attnoracle::vectors {

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::uint64_t mix64(std::uint64_t a, std::uint64_t b) {
  std::uint64_t s = a;
  std::uint64_t h = splitmix64(s);
  s = h ^ b;
  return splitmix64(s);
}

Rng::Rng(std::uint64_t seed) {
  std::uint64_t s = seed;
  for (auto& w : s_) w = splitmix64(s);
}

std::uint64_t Rng::next() {
  auto rotl = [](std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const std::uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

// 53 random bits scaled by 2^-53: exact.
double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }

double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

// Irwin-Hall with 12 terms has variance 1; additions of doubles round the same everywhere.
double Rng::normal() {
  double s = 0;
  for (int k = 0; k < 12; ++k) s += uniform();
  return s - 6.0;
}

std::uint64_t Rng::below(std::uint64_t n) {
  // Reject the top partial block so that every residue is equally likely.
  const std::uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  for (;;) {
    const std::uint64_t x = next();
    if (x < limit) return x % n;
  }
}

}  // namespace attnoracle::vectors
