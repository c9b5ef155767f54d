// The values of an I32 or I64 tensor (little-endian two's complement), for the tests.
#pragma once

#include <cstdint>
#include <vector>

#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::testing {

inline std::vector<std::int64_t> int_tensor_values(const RawTensor& t) {
  std::vector<std::int64_t> out;
  const std::size_t size = dtype_size(t.dtype);
  for (std::size_t e = 0; e * size < t.data.size(); ++e) {
    std::uint64_t u = 0;
    for (std::size_t byte = 0; byte < size; ++byte) u |= std::uint64_t{t.data[e * size + byte]} << (8 * byte);
    out.push_back(size == 4 ? static_cast<std::int32_t>(u) : static_cast<std::int64_t>(u));
  }
  return out;
}

}  // namespace attnoracle::testing
