// Planted changes in golden results and what the diagnosis says of them, for the diagnosis tests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "golden_results.hpp"

#include "attnoracle/conformance/compare.hpp"

namespace attnoracle::testing {

// Changes element [b, h, i, j] (4-d) or [b, h, i] (3-d, j = 0) of a result tensor by f(value)
// where where(b, h, i, j) holds.
inline void change(conformance::JobResult& r, const char* name,
                   const std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>& where,
                   const std::function<double(double)>& f) {
  RawTensor& t = tensor(r, name);
  const auto& sh = t.shape;
  const std::int64_t last = sh.size() == 4 ? sh[3] : 1;
  for (std::size_t k = 0; k < t.data.size() / 4; ++k) {
    const auto n = static_cast<std::int64_t>(k);
    const std::int64_t j = n % last, i = n / last % sh[2], h = n / last / sh[2] % sh[1], b = n / last / sh[2] / sh[1];
    if (where(b, h, i, j)) set(t, k, f(get(t, k)));
  }
}

// The result judged against the golden file under profile fp32.
inline conformance::CaseReport compare(const SafeTensorsFile& golden, const conformance::JobResult& r) {
  return conformance::compare_case("c", golden, "ok", r, conformance::builtin_profile("fp32"));
}

// The finding of that name, or null.
inline const conformance::Finding* find(const conformance::CaseReport& rep, const std::string& name) {
  for (const auto& f : rep.diagnosis.findings)
    if (f.name == name) return &f;
  return nullptr;
}

// The reason and every finding, one a line (for failure messages).
inline std::string all(const conformance::CaseReport& rep) {
  std::string s = rep.reason + "\n";
  for (const auto& f : rep.diagnosis.findings) s += f.name + ": " + f.text + "\n";
  return s;
}

}  // namespace attnoracle::testing
