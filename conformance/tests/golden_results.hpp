// Results made from a case's golden tensors, for tests that plant a change in them and judge
// the result with compare_case.
#pragma once

#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::testing {

// An F32 tensor of `values`.
inline RawTensor f32_tensor(const std::string& name, std::vector<std::int64_t> shape, const std::vector<float>& values) {
  RawTensor r{name, DType::F32, std::move(shape), {}};
  r.data.resize(4 * values.size());
  std::memcpy(r.data.data(), values.data(), r.data.size());
  return r;
}

// The case file f evaluated: its golden file.
inline SafeTensorsFile golden_of(const SafeTensorsFile& f) {
  const Case c = case_from_file("c", f);
  return golden_file(c, evaluate(c, {}));
}

// The golden tensors of `names` that the golden file has, returned as an implementation's result.
inline conformance::JobResult golden_result(const SafeTensorsFile& golden, std::initializer_list<const char*> names) {
  conformance::JobResult r;
  r.outcome = conformance::Outcome::Output;
  for (const char* name : names)
    if (const RawTensor* t = golden.find(name)) r.output.put(*t);
  return r;
}

inline RawTensor& tensor(conformance::JobResult& r, const std::string& name) {
  for (auto& t : r.output.tensors)
    if (t.name == name) return t;
  throw std::runtime_error(name);
}

// Element k of an F32 tensor.
inline float get(const RawTensor& t, std::size_t k) {
  float x;
  std::memcpy(&x, t.data.data() + 4 * k, 4);
  return x;
}
inline void set(RawTensor& t, std::size_t k, double x) {
  const auto f = static_cast<float>(x);
  std::memcpy(t.data.data() + 4 * k, &f, 4);
}

}  // namespace attnoracle::testing
