// End-to-end tests of `attnoracle eval` on hand-built cases: edits of a case file, and a fixture
// that evaluates a case or expects it refused as the contract says (one line naming the file and
// the field, exit status 2, no output written).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli_run.hpp"

namespace attnoracle::testing {

inline SafeTensorsFile with(SafeTensorsFile f, const RawTensor& t) {
  f.put(t);
  return f;
}
inline SafeTensorsFile without(SafeTensorsFile f, const std::string& name) {
  std::erase_if(f.tensors, [&](const RawTensor& t) { return t.name == name; });
  return f;
}
inline SafeTensorsFile with_meta(SafeTensorsFile f, const std::string& key, const std::string& value) {
  f.metadata[key] = value;
  return f;
}
inline SafeTensorsFile without_meta(SafeTensorsFile f, const std::string& key) {
  f.metadata.erase(key);
  return f;
}

// A tensor of the values v (each rounded to nearest in t).
inline RawTensor floats(const std::string& name, std::vector<std::int64_t> shape, const std::vector<double>& v,
                        DType t = DType::F32) {
  RawTensor r{name, t, std::move(shape), {}};
  r.data.resize(dtype_size(t) * v.size());
  for (std::size_t e = 0; e < v.size(); ++e) encode_float(t, v[e], r.data.data() + dtype_size(t) * e);
  return r;
}

// The elements of tensor `name` of f as doubles.
inline std::vector<double> values(const SafeTensorsFile& f, const std::string& name) {
  const RawTensor& t = *f.find(name);
  std::vector<double> v;
  for (std::size_t e = 0; e < static_cast<std::size_t>(t.numel()); ++e)
    v.push_back(decode_float(t.dtype, t.data.data() + e * dtype_size(t.dtype)));
  return v;
}

class EvalCli : public ::testing::Test {
 protected:
  void SetUp() override { std::filesystem::create_directory(dir_ / "work"); }

  void expect_refused(const SafeTensorsFile& f, const std::string& field, const std::string& what) {
    const std::string in = dir_ / "work" / "bad.safetensors";
    const std::string out = dir_ / "work" / "out.safetensors";
    write_bytes(in, serialize_safetensors(f));
    const CliResult r = run_cli({"eval", in, "-o", out});
    EXPECT_EQ(r.status, 2) << r.err;
    const std::string prefix = "attnoracle: error: " + in + ": " + field + ": ";
    EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << r.err;
    EXPECT_NE(r.err.find(what, prefix.size()), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    EXPECT_FALSE(std::filesystem::exists(out));
  }

  // The golden file of `f` evaluated under `eval -q` and `extra` arguments.
  SafeTensorsFile evaluated(const SafeTensorsFile& f, const std::string& name,
                            const std::vector<std::string>& extra = {}) {
    const std::string in = dir_ / (name + ".safetensors"), out = dir_ / (name + ".out.safetensors");
    write_bytes(in, serialize_safetensors(f));
    std::vector<std::string> args{"eval", in, "-o", out, "-q"};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.status, 0) << name << ": " << r.err;
    return read_safetensors(out);
  }

  TempDir dir_;
};

}  // namespace attnoracle::testing
