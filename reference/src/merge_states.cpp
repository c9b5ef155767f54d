// Kind merge (CONTRACT section 8) as an sdpa case: the combine of partial states is a softmax
// over the splits with scores lse_s and values O_s, so the certified evaluator decides it.
#include <cmath>
#include <string>

#include "attnoracle/reference/split_kv.hpp"

namespace attnoracle {

EvalResult merge_result(const Case& m, EvalResult inner) {
  for (RawTensor& t : inner.golden) {
    if (t.name == "out" || t.name == "out.ref" || t.name == "out.ref_lo" || t.name == "out.bound")
      t.shape = m.out_shape();
    else if (t.name == "lse" || t.name == "lse.ref" || t.name == "row.valid")
      t.shape = m.row_shape();
  }
  return inner;
}

FullyMaskedRow merge_row(const Case& m, const FullyMaskedRow& inner) {
  return FullyMaskedRow(inner.b, inner.h / m.Nq, inner.h % m.Nq);
}

EvalResult evaluate_merge(const Case& m, const EvalOptions& opt) {
  const Case c = merge_sdpa_case(m);
  try {
    return merge_result(m, evaluate(c, opt));
  } catch (const FullyMaskedRow& e) {
    throw merge_row(m, e);
  }
}

}  // namespace attnoracle
