// The fast certified path of the gradients: dq row by row and dk, dv key by key in
// double-double ball arithmetic, committed where the balls decide every rounding (values,
// their .ref and their bound); what they do not decide goes to the MPFR path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::fast {

// One gradient's elements of a unit, decided: [n] values, their .ref and bounds.
struct DecidedGrad {
  std::vector<double> value, ref, bound;
};

class FastBackward {
 public:
  // Applies like the forward's fast path (kind sdpa, no softcap, inputs and dout in range)
  // and to cases without sinks.
  FastBackward(const Case& c, const EvalOptions& opt);
  ~FastBackward();
  FastBackward(const FastBackward&) = delete;
  FastBackward& operator=(const FastBackward&) = delete;

  bool applies() const;
  const std::string& why_not() const;

  // The row pass on a row that takes part (not padding, some key allowed): keeps the row's
  // statistics for the key pass, and decides dq_i when the case asks for it. False: dq_i is
  // not decided (the MPFR path does it).
  bool row(std::int64_t b, std::int64_t h, std::int64_t i, DecidedGrad& dq) const;
  // Whether row (b, h, i) has its statistics for the other passes (from row(), or else given
  // by set_row_stat from the MPFR path's enclosures).
  bool has_row_stat(std::int64_t b, std::int64_t h, std::int64_t i) const;
  void set_row_stat(std::int64_t b, std::int64_t h, std::int64_t i, const Enclosure& lse, const Enclosure& d,
                    const Enclosure& dabs);
  // Row (b, h, i)'s statistics as MPFR enclosures (each end rounded outward to the enclosures'
  // precision) when it has them: lse, D = dout . O and sum_c |dout_c O_c|.
  bool row_stat(std::int64_t b, std::int64_t h, std::int64_t i, Enclosure& lse, Enclosure& d, Enclosure& dabs) const;
  // Whether the dP_ij = dout_i . v_j of row (b, h, i) are proven not all equal over its allowed
  // keys (two disjoint balls), so that its dS is not 0 by that structure.
  bool dp_differ(std::int64_t b, std::int64_t h, std::int64_t i) const;
  // The key pass: dk_j and dv_j (those the case asks for) over the rows of kv head g that see
  // key j, after the row pass. False: the unit goes to the MPFR path.
  bool key(std::int64_t b, std::int64_t g, std::int64_t j, DecidedGrad& dk, DecidedGrad& dv) const;
  // The bias pass: unit (b', h', j') of the bias's extents [Eb, Eh, Ei, Ej] over
  // [B, Hq, Nq, Nk], its Ei elements of dbias, after the row pass. False: MPFR.
  bool bias(std::int64_t bb, std::int64_t hb, std::int64_t jb, DecidedGrad& db) const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace attnoracle::fast
