#include "attnoracle/conformance/profile.hpp"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"

namespace attnoracle::conformance {

std::vector<std::string> builtin_profile_names() {
  return {"fp64", "fp32", "fp16", "bf16", "flash-fp16", "flash-bf16", "torch-cpu-bf16", "fp8",
          "flash-fp8", "fp8kv-fp32", "fp8kv-fp16", "fp8kv-bf16"};
}

std::vector<std::string> builtin_family_names() { return {"standard", "flash", "fp8kv"}; }

Profile builtin_profile(const std::string& name, const std::string& what) {
  Profile p;
  p.name = name;
  if (name == "fp64") {
    p.input_dtypes = {DType::F64};
    p.projection = p.qk_accum = p.softmax = p.p = p.pv_accum = DType::F64;
    p.grad_dp = p.grad_ds = p.grad_accum = DType::F64;
  } else if (name == "fp32") {
    p.input_dtypes = {DType::F32};
  } else if (name == "fp16" || name == "flash-fp16") {
    p.input_dtypes = {DType::F16};
    p.projection = DType::F16;
    if (name == "flash-fp16") {
      p.p = p.grad_ds = DType::F16;  // FlashAttention 2 rounds P and dS for the products
      p.lse_dtype = DType::F32;      // and returns its softmax statistics in F32
    }
  } else if (name == "bf16" || name == "flash-bf16") {
    p.input_dtypes = {DType::BF16};
    p.projection = DType::BF16;
    if (name == "flash-bf16") {
      p.p = p.grad_ds = DType::BF16;
      p.lse_dtype = DType::F32;
    }
  } else if (name == "fp8" || name == "flash-fp8") {
    // FP8 inputs (exact), descales applied, Q K^T, softmax and P V in F32; flash-fp8 rounds P
    // to E4M3 for the P V product, as FlashAttention 3's FP8 kernel does.
    p.input_dtypes = {DType::F8_E4M3, DType::F8_E5M2};
    if (name == "flash-fp8") {
      p.p = DType::F8_E4M3;
      p.lse_dtype = DType::F32;
    }
  } else if (name == "fp8kv-fp32" || name == "fp8kv-fp16" || name == "fp8kv-bf16") {
    // An FP8 inference kernel over a float query: K/V element x scale (or the scale on the score
    // and the output) in F32, Q K^T, softmax and P V in F32, P rounded to E4M3 before P V, lse
    // in F32; out in the case's dtype (BF16, or FP8 through o_scale).
    p.input_dtypes = {name == "fp8kv-fp32" ? DType::F32 : name == "fp8kv-fp16" ? DType::F16 : DType::BF16};
    p.projection = p.input_dtypes[0];
    p.p = DType::F8_E4M3;
    p.lse_dtype = DType::F32;
  } else if (name == "torch-cpu-bf16") {
    // BF16 matmuls (an F32 sum rounded to BF16), scale, softcap and bias in BF16, softmax rounding
    // P to BF16, P V a BF16 matmul again.
    p.input_dtypes = {DType::BF16};
    p.projection = p.qk_accum = p.softmax = p.p = p.pv_accum = DType::BF16;
    // autograd of the same ops: dP, the softmax's backward and each gradient matmul in BF16
    p.grad_dp = p.grad_ds = p.grad_accum = DType::BF16;
  } else {
    std::string known;
    for (const auto& n : builtin_profile_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError(what, "", "unknown profile '" + printable(name) + "' (" + known + ", or a JSON file)");
  }
  return p;
}

void declare_returns(Profile& p, std::string_view list) {
  p.returns_weights = list.find("weights") != std::string_view::npos;
  p.returns_lse = list.find("lse") != std::string_view::npos;
  p.returns_scores = list.find("scores") != std::string_view::npos;
  p.returns_gradients = list.find("gradients") != std::string_view::npos;
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

namespace {

// JSON text; `path` names it in errors.
nlohmann::json parse_json(std::string_view text, const std::string& path) {
  if (limits::json_depth(text) > limits::kJsonDepth)
    throw InputError(path, "", "not JSON: nested deeper than " + std::to_string(limits::kJsonDepth) + " levels");
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {  // parse_error; out_of_range for a number past double
    throw InputError(path, "", std::string("not JSON: ") + e.what());
  }
}

nlohmann::json read_json(const std::string& path) {
  const std::vector<unsigned char> bytes = read_regular_file(path, limits::kManifestBytes);
  return parse_json({reinterpret_cast<const char*>(bytes.data()), bytes.size()}, path);
}

// The string field `key` of object `j`, or `absent` when it has none.
std::string text_field(const nlohmann::json& j, const std::string& key, const std::string& absent,
                       const std::string& path) {
  if (!j.contains(key)) return absent;
  if (!j[key].is_string()) throw InputError(path, key, std::string("must be a string, not a JSON ") + j[key].type_name());
  return j[key].get<std::string>();
}

// A profile object; `path` names it in errors (a file, or a file and the member's index).
Profile profile_from_object(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) throw InputError(path, "", "a profile is a JSON object");
  Profile p = builtin_profile(text_field(j, "base", "fp32", path), path + ": base");
  p.name = text_field(j, "name", "custom", path);
  auto dtype = [&](const std::string& key, DType& out) {
    if (!j.contains(key)) return;
    const auto& v = j[key];
    const auto t = v.is_string() ? dtype_from_name(v.get<std::string>()) : std::nullopt;
    // P may be rounded to E4M3 (FP8 kernels); the other stages compute in a float format.
    const bool ok = t && (is_float_format(*t) || (key == "p" && *t == DType::F8_E4M3));
    if (!ok)
      throw InputError(path, key,
                       key == "p" ? "must be one of F64, F32, F16, BF16, F8_E4M3"
                                  : "must be one of F64, F32, F16, BF16");
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
                                  "returns_lse", "returns_scores", "returns_gradients", "bias", "key_block",
                                  "grad_dp", "grad_ds", "grad_accum", "lse_dtype", "partials",
                                  "deterministic", "batch_invariant"};
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) throw InputError(path, printable(key), "unknown profile field");
  }
  if (j.contains("input_dtypes")) {
    if (!j["input_dtypes"].is_array()) throw InputError(path, "input_dtypes", "must be a list of dtype names");
    p.input_dtypes.clear();
    for (const auto& v : j["input_dtypes"]) {
      const auto t = v.is_string() ? dtype_from_name(v.get<std::string>()) : std::nullopt;
      if (!t || !is_input_format(*t))
        throw InputError(path, "input_dtypes", "must be a list of F64, F32, F16, BF16, F8_E4M3, F8_E5M2");
      p.input_dtypes.push_back(*t);
    }
  }
  dtype("projection", p.projection);
  dtype("qk_accum", p.qk_accum);
  dtype("softmax", p.softmax);
  dtype("p", p.p);
  dtype("pv_accum", p.pv_accum);
  dtype("grad_dp", p.grad_dp);
  dtype("grad_ds", p.grad_ds);
  dtype("grad_accum", p.grad_accum);
  if (j.contains("bias")) {
    DType t = DType::F64;
    dtype("bias", t);
    p.bias = t;
  }
  // A dtype that may be absent (JSON null clears it).
  auto optional_dtype = [&](const std::string& key, std::optional<DType>& out) {
    if (!j.contains(key)) return;
    if (j[key].is_null()) {
      out.reset();
      return;
    }
    DType t = DType::F32;
    dtype(key, t);
    out = t;
  };
  optional_dtype("lse_dtype", p.lse_dtype);  // null: lse in the case's dtype
  optional_dtype("partials", p.partials);    // null: no split-KV merge
  number("exp_ulps", p.exp_ulps, 0);
  number("safety", p.safety, 1);
  if (j.contains("key_block")) {
    if (!j["key_block"].is_number_integer() || j["key_block"].get<std::int64_t>() < 0)
      throw InputError(path, "key_block", "must be an integer >= 0 (0: a one-pass softmax)");
    p.key_block = j["key_block"].get<std::int64_t>();
  }
  flag("returns_weights", p.returns_weights);
  flag("returns_lse", p.returns_lse);
  flag("returns_scores", p.returns_scores);
  flag("returns_gradients", p.returns_gradients);
  flag("deterministic", p.deterministic);
  flag("batch_invariant", p.batch_invariant);
  if (j.contains("masked_rows")) {
    const auto m = convention_from_name(j["masked_rows"].is_string() ? j["masked_rows"].get<std::string>() : "");
    if (!m) throw InputError(path, "masked_rows", "must be error, zero, nan or mean");
    p.masked_rows = *m;
  }
  return p;
}

std::vector<DType> covered(const Profile& p) {
  std::vector<DType> out;
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::F8_E5M2})
    if (p.covers(t)) out.push_back(t);
  return out;
}

// Adds `p` to the set, refusing a second member for an input dtype.
void add_member(ProfileSet& set, Profile p, const std::string& what) {
  for (DType t : covered(p))
    if (const Profile* other = set.for_dtype(t))
      throw InputError(what, "", "profiles " + printable(other->name) + " and " + printable(p.name) + " both cover " +
                                     std::string(dtype_name(t)) + " inputs: give one profile per input dtype");
  set.members.push_back(std::move(p));
}

bool is_json_path(const std::string& s) { return s.size() > 5 && s.compare(s.size() - 5, 5, ".json") == 0; }

}  // namespace

Profile profile_from_json(const std::string& path) {
  const nlohmann::json j = read_json(path);
  if (j.is_object() && j.contains("profiles"))
    throw InputError(path, "profiles", "a profile family: give it to run or check, one profile here");
  return profile_from_object(j, path);
}

Profile profile_from_json_text(std::string_view text, const std::string& what) {
  if (text.size() > limits::kManifestBytes) throw InputError(what, "", "not JSON: longer than the limit of a JSON file");
  return profile_from_object(parse_json(text, what), what);
}

bool Profile::covers(DType t) const {
  return input_dtypes.empty() || std::find(input_dtypes.begin(), input_dtypes.end(), t) != input_dtypes.end();
}

const Profile* ProfileSet::for_dtype(DType t) const {
  for (const Profile& p : members)
    if (p.covers(t)) return &p;
  return nullptr;
}

std::vector<DType> ProfileSet::dtypes() const {
  std::vector<DType> out;
  for (const Profile& p : members)
    for (DType t : covered(p)) out.push_back(t);
  return out;
}

ProfileSet declared_profile_set(const std::string& spec, const std::string& masked_rows, const std::string& returns,
                                const std::string& what, const std::string& masked_what) {
  ProfileSet set = load_profile_set(spec, what);
  std::optional<MaskedRowConvention> rows;
  if (!masked_rows.empty()) {
    rows = convention_from_name(masked_rows);
    if (!rows) throw InputError(masked_what, "", "must be error, zero, nan or mean");
  }
  for (Profile& p : set.members) {
    if (rows) p.masked_rows = *rows;
    if (!returns.empty()) declare_returns(p, returns);
  }
  return set;
}

ProfileSet load_profile_set(const std::string& spec, const std::string& what) {
  ProfileSet set;
  set.name = spec;
  if (spec == "fp8kv") {  // an FP8 kernel family: float queries over stored K/V, and FP8 inputs
    for (const char* n : {"fp8kv-fp32", "fp8kv-fp16", "fp8kv-bf16", "flash-fp8"})
      add_member(set, builtin_profile(n, what), what);
    return set;
  }
  if (spec == "standard" || spec == "flash") {
    const bool flash = spec == "flash";
    for (const char* n : {"fp64", "fp32", flash ? "flash-fp16" : "fp16", flash ? "flash-bf16" : "bf16"})
      add_member(set, builtin_profile(n, what), what);
    if (flash) add_member(set, builtin_profile("flash-fp8", what), what);
    return set;
  }
  if (is_json_path(spec) && spec.find(',') == std::string::npos) {
    const nlohmann::json j = read_json(spec);
    if (!(j.is_object() && j.contains("profiles"))) {
      Profile p = profile_from_object(j, spec);
      set.name = p.name;
      set.members.push_back(std::move(p));
      return set;
    }
    for (const auto& [key, v] : j.items())
      if (key != "name" && key != "profiles") throw InputError(spec, printable(key), "unknown field of a profile family");
    if (!j["profiles"].is_array() || j["profiles"].empty())
      throw InputError(spec, "profiles", "must be a non-empty list of profile names, files or objects");
    set.name = text_field(j, "name", "custom", spec);
    const std::filesystem::path base = std::filesystem::path(spec).parent_path();
    std::size_t k = 0;
    for (const auto& m : j["profiles"]) {
      const std::string at = spec + ": profiles[" + std::to_string(k++) + "]";
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        if (s.empty() || printable(s, s.size()) != s)
          throw InputError(at, "", "\"" + printable(s) + "\" is not a profile name or a file name");
        add_member(set, is_json_path(s) ? profile_from_json((base / s).string()) : builtin_profile(s, at), spec);
      } else if (m.is_object()) {
        add_member(set, profile_from_object(m, at), spec);
      } else {
        throw InputError(spec, "profiles", "each member is a profile name, a file or a profile object");
      }
    }
    return set;
  }
  std::size_t from = 0;
  while (from <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', from), spec.size());
    const std::string one = spec.substr(from, comma - from);
    if (one.empty()) throw InputError(what, "", "an empty profile name in '" + spec + "'");
    add_member(set, load_profile(one, what), what);
    from = comma + 1;
  }
  return set;
}

}  // namespace attnoracle::conformance
