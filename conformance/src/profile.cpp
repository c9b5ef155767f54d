#include "attnoracle/conformance/profile.hpp"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"

namespace attnoracle::conformance {

std::vector<std::string> builtin_profile_names() {
  return {"fp64", "fp32", "fp16", "bf16", "flash-fp16", "flash-bf16"};
}

Profile builtin_profile(const std::string& name, const std::string& what) {
  Profile p;
  p.name = name;
  if (name == "fp64") {
    p.input_dtypes = {DType::F64};
    p.projection = p.qk_accum = p.softmax = p.p = p.pv_accum = DType::F64;
  } else if (name == "fp32") {
    p.input_dtypes = {DType::F32};
  } else if (name == "fp16" || name == "flash-fp16") {
    p.input_dtypes = {DType::F16};
    p.projection = DType::F16;
    if (name == "flash-fp16") p.p = DType::F16;
  } else if (name == "bf16" || name == "flash-bf16") {
    p.input_dtypes = {DType::BF16};
    p.projection = DType::BF16;
    if (name == "flash-bf16") p.p = DType::BF16;
  } else {
    std::string known;
    for (const auto& n : builtin_profile_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError(what, "", "unknown profile '" + name + "' (" + known + ", or a JSON file)");
  }
  return p;
}

std::string_view convention_name(MaskedRowConvention c) {
  switch (c) {
    case MaskedRowConvention::Error: return "error";
    case MaskedRowConvention::Zero: return "zero";
    case MaskedRowConvention::Nan: return "nan";
    case MaskedRowConvention::Mean: return "mean";
  }
  return "?";
}

std::optional<MaskedRowConvention> convention_from_name(std::string_view s) {
  for (MaskedRowConvention c : {MaskedRowConvention::Error, MaskedRowConvention::Zero, MaskedRowConvention::Nan,
                                MaskedRowConvention::Mean})
    if (convention_name(c) == s) return c;
  return std::nullopt;
}

Profile load_profile(const std::string& name_or_path, const std::string& what) {
  const std::string& s = name_or_path;
  return s.size() > 5 && s.compare(s.size() - 5, 5, ".json") == 0 ? profile_from_json(s) : builtin_profile(s, what);
}

Profile profile_from_json(const std::string& path) {
  const std::vector<unsigned char> bytes = read_regular_file(path, limits::kManifestBytes);
  if (limits::json_depth({reinterpret_cast<const char*>(bytes.data()), bytes.size()}) > limits::kJsonDepth)
    throw InputError(path, "", "not JSON: nested deeper than " + std::to_string(limits::kJsonDepth) + " levels");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {  // parse_error; out_of_range for a number past double
    throw InputError(path, "", std::string("not JSON: ") + e.what());
  }
  if (!j.is_object()) throw InputError(path, "", "a profile is a JSON object");
  Profile p = builtin_profile(j.value("base", std::string("fp32")), path + ": base");
  p.name = j.value("name", std::string("custom"));
  auto dtype = [&](const std::string& key, DType& out) {
    if (!j.contains(key)) return;
    const auto& v = j[key];
    const auto t = v.is_string() ? dtype_from_name(v.get<std::string>()) : std::nullopt;
    if (!t || !is_float_format(*t)) throw InputError(path, key, "must be one of F64, F32, F16, BF16");
    out = *t;
  };
  auto number = [&](const std::string& key, double& out, double lo) {
    if (!j.contains(key)) return;
    if (!j[key].is_number() || j[key].get<double>() < lo)
      throw InputError(path, key, "must be a number >= " + std::to_string(lo));
    out = j[key].get<double>();
  };
  auto flag = [&](const std::string& key, bool& out) {
    if (!j.contains(key)) return;
    if (!j[key].is_boolean()) throw InputError(path, key, "must be true or false");
    out = j[key].get<bool>();
  };
  for (const auto& [key, v] : j.items()) {
    static const char* known[] = {"name", "base", "input_dtypes", "projection", "qk_accum", "softmax", "p",
                                  "pv_accum", "exp_ulps", "safety", "masked_rows", "returns_weights",
                                  "returns_lse"};
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) throw InputError(path, key, "unknown profile field");
  }
  if (j.contains("input_dtypes")) {
    if (!j["input_dtypes"].is_array()) throw InputError(path, "input_dtypes", "must be a list of dtype names");
    p.input_dtypes.clear();
    for (const auto& v : j["input_dtypes"]) {
      const auto t = v.is_string() ? dtype_from_name(v.get<std::string>()) : std::nullopt;
      if (!t || !is_float_format(*t)) throw InputError(path, "input_dtypes", "must be a list of F64, F32, F16, BF16");
      p.input_dtypes.push_back(*t);
    }
  }
  dtype("projection", p.projection);
  dtype("qk_accum", p.qk_accum);
  dtype("softmax", p.softmax);
  dtype("p", p.p);
  dtype("pv_accum", p.pv_accum);
  number("exp_ulps", p.exp_ulps, 0);
  number("safety", p.safety, 1);
  flag("returns_weights", p.returns_weights);
  flag("returns_lse", p.returns_lse);
  if (j.contains("masked_rows")) {
    const auto m = convention_from_name(j["masked_rows"].is_string() ? j["masked_rows"].get<std::string>() : "");
    if (!m) throw InputError(path, "masked_rows", "must be error, zero, nan or mean");
    p.masked_rows = *m;
  }
  return p;
}

}  // namespace attnoracle::conformance
