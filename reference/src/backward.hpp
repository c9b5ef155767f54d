// Certified gradients of kind sdpa (CONTRACT section 7): dq, dk, dv, dbias and dsinks from dout.
#pragma once

#include <cstdint>
#include <string>

#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle {

namespace detail {
struct GoldenBuffer;
}

// Whether `name` is a gradient golden tensor (dq, dq.ref, dq.bound, dk, ...).
bool is_gradient_golden(const std::string& name);

// Evaluates the gradients the case asks for and appends their golden tensors (each with its
// .undecided and .alt companions when needed) to res.golden, counting them in res.stats.
void evaluate_gradients(const Case& c, const EvalOptions& opt, EvalResult& res);
// The same for kind mha (backward_mha.cpp).
void evaluate_mha_gradients(const Case& c, const EvalOptions& opt, EvalResult& res);

// The tensors dsinks, dsinks.ref and dsinks.bound being filled.
struct SinkGradientBuffers {
  detail::GoldenBuffer *value, *ref, *bound;
};
struct SinkGradientStats {
  std::uint64_t elements = 0, undecided = 0;
  mpfr_prec_t reached = 0;  // the largest working precision used
};
// dsinks (backward_sinks.cpp): one Ziv loop per head from precision p0 up to cap, the rows'
// lse and out taken from `ev` at each precision.
SinkGradientStats evaluate_dsinks(const Case& c, const EvalOptions& opt, const RowEvaluator& ev,
                                  const SinkGradientBuffers& out, mpfr_prec_t p0, mpfr_prec_t cap);

}  // namespace attnoracle
