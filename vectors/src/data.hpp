// The data generators: element values of the floating inputs, exactly in the input dtype.
#pragma once

#include <vector>

#include "attnoracle/vectors/problem.hpp"
#include "prng.hpp"

namespace attnoracle::vectors {

struct InputData {
  std::vector<double> q, k, v;                        // sdpa
  std::vector<double> x_q, x_kv, w_q, w_k, w_v, w_o;  // mha
};

// Fills every input tensor of p's kind with generator p.generator's data.
InputData generate_data(const ProblemSpec& p, Rng& rng);

// A generator parameter, or its default.
double param(const ProblemSpec& p, std::string_view name);

}  // namespace attnoracle::vectors
