// Certified gradients of kind sdpa (CONTRACT section 7): dq, dk, dv and dbias from dout.
#pragma once

#include <string>

#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle {

// Whether `name` is a gradient golden tensor (dq, dq.ref, dq.bound, dk, ...).
bool is_gradient_golden(const std::string& name);

// Evaluates the gradients the case asks for and appends their golden tensors (each with its
// .undecided and .alt companions when needed) to res.golden, counting them in res.stats.
void evaluate_gradients(const Case& c, const EvalOptions& opt, EvalResult& res);

}  // namespace attnoracle
