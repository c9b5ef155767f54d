// The row types of the evaluator: enclosures of one row unit, the kernel that computes them,
// and the fast path's F64 intervals. Not public API: the oracle and the tests read them.
#pragma once

#include <cstdint>
#include <vector>

#include <mpfr.h>

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle {

// One sdpa row as the fast path encloses it, in F64 intervals rounded outward: what the
// oracle's row checks read.
struct RowIntervals {
  std::vector<char> allowed;           // [Nk]
  std::vector<double> w_lo, w_hi;      // [Nk] weights (exactly 0 where not allowed)
  std::vector<double> out_lo, out_hi;  // [Dv] before the intersection with the values' range
  double lse_lo = 0, lse_hi = 0;
};

// An enclosure [lo, hi] of one exact real value.
struct Enclosure {
  mpfr_t lo, hi;
  explicit Enclosure(mpfr_prec_t p);
  Enclosure(const Enclosure&) = delete;
  Enclosure& operator=(const Enclosure&) = delete;
  Enclosure(Enclosure&& o) noexcept;
  Enclosure& operator=(Enclosure&& o) noexcept {
    mpfr_swap(lo, o.lo);
    mpfr_swap(hi, o.hi);
    return *this;
  }
  ~Enclosure();
  bool contains(const mpfr_t x) const { return mpfr_lessequal_p(lo, x) && mpfr_lessequal_p(x, hi); }
};

// An enclosure's two ends as double-doubles, each end the value hi + lo: what the fast path's
// rows give the twins for out and weights (RowParts::Compared), where MPFR enclosures would
// cost more than the row itself.
struct DDEnclosure {
  double lo_hi = 0, lo_lo = 0, hi_hi = 0, hi_lo = 0;
};
// The enclosure of those ends at 128 bits, the lower end rounded down and the upper one up: the
// enclosure the fast path gives for the same ball (RowParts::All).
Enclosure enclosure_of(const DDEnclosure& e);

// What one head's row is made of, for the oracle.
struct HeadDetail {
  std::vector<char> allowed;       // [Nk]: key j may be attended
  std::vector<Enclosure> dots;     // [Nk]: q_i . k_j (a point when exact); 0 where not allowed
  std::vector<Enclosure> raw_out;  // [Dv]: N_c / Z before the intersection with the hull
  std::vector<Enclosure> hull;     // [Dv]: [min, max] of v_jc over the allowed keys
  std::vector<Enclosure> out;      // [Dv]: the head's output O (the row's out for sdpa)
};

// Enclosures of one row unit at one working precision. A unit is (b, h, i) for kind sdpa and
// (b, i) for kind mha (all heads, as the output mixes them; h is then ignored).
struct RowEnclosures {
  bool valid = true;                  // false: fully masked (policy zero, or a padding row)
  std::vector<Enclosure> out;         // Dv (sdpa) or Dout (mha)
  std::vector<Enclosure> bound;       // the magnitude bound of each output element
  // per head for mha (H rows), one for sdpa: each Nk long (0 where not allowed), one lse per head
  std::vector<std::vector<Enclosure>> weights;
  std::vector<Enclosure> lse;
  std::vector<std::vector<Enclosure>> scores;  // per head like weights: S, -inf where not allowed
  std::vector<bool> head_valid;       // per head (mha) or one (sdpa)
  std::vector<HeadDetail> heads;      // per head (mha) or one (sdpa)
  // A fast row of RowParts::Compared: the heads' out and the weights as their ends instead (one
  // vector per head, as weights), the enclosures of heads[].out, out and weights left empty.
  std::vector<std::vector<DDEnclosure>> out_ends, weight_ends;
};

class RowEvaluator {
 public:
  explicit RowEvaluator(const Case& c);  // precomputes exact projections for mha
  ~RowEvaluator();
  RowEvaluator(const RowEvaluator&) = delete;
  RowEvaluator& operator=(const RowEvaluator&) = delete;
  // Throws FullyMaskedRow under policy error (unless the row is padding).
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) const;

 private:
  struct Impl;
  Impl* impl_;
};

// The evaluator's tiers for a row evaluated again (the oracle's twins): the double-double fast
// path where it applies and its balls decide every rounding of the row's out, weights and lse
// (the test by which eval commits a fast row, with weights and lse always included), else
// RowEvaluator at precision p. The fast path's enclosures are its balls, which hold the exact
// values as the MPFR ones do.
// What a row of the fast path is given as: every part (the oracle's row checks read them all),
// or only the parts the twins compare (lse, the heads' allowed keys and validity, and the ends
// of out and the weights in out_ends and weight_ends), which spares the enclosures of the dots,
// scores, raw outputs, hulls and bounds, and builds none for out and the weights.
// Rows from MPFR always have every part.
enum class RowParts { All, Compared };

class TieredRowEvaluator {
 public:
  explicit TieredRowEvaluator(const Case& c, RowParts parts = RowParts::All);
  ~TieredRowEvaluator();
  TieredRowEvaluator(const TieredRowEvaluator&) = delete;
  TieredRowEvaluator& operator=(const TieredRowEvaluator&) = delete;
  // Safe to call from several threads at once.
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i, mpfr_prec_t p) const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace attnoracle
