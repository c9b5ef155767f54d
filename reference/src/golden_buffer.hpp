// A golden tensor being filled by the workers, and its .undecided and .alt companions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::detail {

// One golden tensor being filled: its bytes, and the elements that could not be decided.
struct GoldenBuffer {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;
  std::mutex mu;
  std::vector<std::pair<std::int64_t, double>> undecided;  // flat index, other candidate

  explicit GoldenBuffer(const GoldenSpec& g) : name(g.name), dtype(g.dtype), shape(g.shape) {
    std::int64_t count = 1;
    for (auto d : shape) count *= d;
    bytes.assign(static_cast<std::size_t>(count) * dtype_size(dtype), 0);
  }
  void set(std::int64_t idx, double v) {
    encode_float(dtype, v, bytes.data() + static_cast<std::size_t>(idx) * dtype_size(dtype));
  }
  void set_all(std::int64_t base, const std::vector<double>& v) {
    for (std::size_t k = 0; k < v.size(); ++k) set(base + static_cast<std::int64_t>(k), v[k]);
  }
  RawTensor take() { return RawTensor{name, dtype, shape, std::move(bytes)}; }
};

// The result of one rounded element, before it is committed.
struct Pending {
  GoldenBuffer* buf;
  std::int64_t idx;
  RoundedEnclosure r;
};

// A filled tensor appended to `out`, after its .undecided and .alt companions (if any).
inline void append_golden(GoldenBuffer& g, std::vector<RawTensor>& out) {
  std::vector<std::pair<std::int64_t, double>> und = std::move(g.undecided);
  std::sort(und.begin(), und.end());
  if (!und.empty()) {
    RawTensor idx{g.name + ".undecided", DType::I64, {static_cast<std::int64_t>(und.size())}, {}};
    RawTensor alt{g.name + ".alt", g.dtype, {static_cast<std::int64_t>(und.size())}, {}};
    idx.data.resize(und.size() * 8);
    alt.data.resize(und.size() * dtype_size(g.dtype));
    for (std::size_t k = 0; k < und.size(); ++k) {
      std::memcpy(idx.data.data() + 8 * k, &und[k].first, 8);
      encode_float(g.dtype, und[k].second, alt.data.data() + k * dtype_size(g.dtype));
    }
    out.push_back(std::move(idx));
    out.push_back(std::move(alt));
  }
  out.push_back(g.take());
}

}  // namespace attnoracle::detail
