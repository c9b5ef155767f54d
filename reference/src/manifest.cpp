// Manifest text and parsing; SHA-256 from nettle.
#include "attnoracle/reference/manifest.hpp"

#include <nettle/sha2.h>

#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "attnoracle/reference/verified_stamp.hpp"

namespace attnoracle::vectors {

using nlohmann::json;

namespace {
std::string hex_of(sha256_ctx& ctx) {
  unsigned char digest[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx, SHA256_DIGEST_SIZE, digest);
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : digest) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}
}  // namespace

std::string sha256_hex(const unsigned char* data, std::size_t size) {
  sha256_ctx ctx;
  sha256_init(&ctx);
  sha256_update(&ctx, size, data);
  return hex_of(ctx);
}

SafeTensorsFile read_set_case(const std::string& dir, const std::string& file, const std::string& sha256,
                              bool rehash) {
  const std::string path = (std::filesystem::path(dir) / file).string();
  // Hashed as it is read, each tensor straight into place: one pass, no copy of the whole file.
  try {
    const OpenFile f = open_regular_file(path_within(dir, file));
    if (!rehash && stamped(dir, file, sha256, identity_of(f.fd))) return read_safetensors(path, f.fd, f.size);
    sha256_ctx ctx;
    sha256_init(&ctx);
    SafeTensorsFile out = read_safetensors(path, f.fd, f.size, [&](const unsigned char* p, std::size_t n) {
      sha256_update(&ctx, n, p);
    });
    if (hex_of(ctx) == sha256) return out;
  } catch (const InputError&) {
    // below: whether the file is the one the manifest names decides first what is said of it
  }
  const std::vector<unsigned char> bytes = read_file_within(dir, file);
  if (sha256_hex(bytes) != sha256)
    throw InputError(path, "", "sha256 differs from the manifest: the vector set is altered");
  return parse_safetensors(path, bytes);
}

bool valid_case_id(std::string_view id) {
  if (id.empty() || id.size() > 200 || id[0] == '.') return false;
  for (unsigned char ch : id)
    if (!std::isalnum(ch) && ch != '_' && ch != '-' && ch != '.') return false;
  return true;
}

std::string case_file_name(std::string_view id) {
  return "cases/" + std::string(id) + ".safetensors";
}

std::string manifest_text(const Manifest& m) {
  auto q = [](const std::string& s) { return json(s).dump(); };
  std::string t = "{\"format\": " + q(m.format) + ", \"suite\": " + q(m.suite) +
                  ", \"generator\": " + q(m.generator) + ", \"seed\": " + std::to_string(m.seed);
  if (m.spec_sha256) t += ",\n \"spec_sha256\": " + q(*m.spec_sha256);
  t += ",\n \"cases\": [";
  for (std::size_t k = 0; k < m.cases.size(); ++k) {
    const ManifestCase& c = m.cases[k];
    t += k ? ",\n  " : "\n  ";
    t += "{\"id\": " + q(c.id) + ", \"file\": " + q(c.file) + ", \"sha256\": " + q(c.sha256) +
         ", \"expect\": " + q(c.expect) + ", \"tags\": [";
    for (std::size_t a = 0; a < c.tags.size(); ++a) t += (a ? ", " : "") + q(c.tags[a]);
    t += "]}";
  }
  t += m.cases.empty() ? "]}\n" : "\n ]}\n";
  return t;
}

Manifest parse_manifest(const std::string& path, std::string_view text, std::string& problem) {
  if (text.size() > limits::kManifestBytes)
    throw InputError(path, "", "is " + std::to_string(text.size()) + " bytes, over the limit of " +
                                   std::to_string(limits::kManifestBytes));
  if (limits::json_depth(text) > limits::kJsonDepth)
    throw InputError(path, "", "invalid JSON: nested deeper than " +
                                   std::to_string(limits::kJsonDepth) + " levels");
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {  // parse_error; out_of_range for a number past double
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what.erase(0, pos + 2);
    throw InputError(path, "", "invalid JSON: " + printable(what, 200));
  }
  Manifest m;
  problem.clear();
  auto bad = [&](const std::string& where, const std::string& what) {
    if (problem.empty()) problem = where + ": " + what;
    return m;
  };
  if (!j.is_object()) return bad("$", "not a JSON object");
  auto str = [&](const json& o, const char* key, std::string& out) {
    if (!o.contains(key) || !o[key].is_string()) return false;
    out = o[key].get<std::string>();
    return true;
  };
  for (const auto& [k, v] : j.items())
    if (k != "format" && k != "suite" && k != "generator" && k != "seed" && k != "spec_sha256" &&
        k != "cases")
      return bad(printable(k), "unknown key");
  if (!str(j, "format", m.format)) return bad("format", "missing or not a string");
  if (m.format != kManifestFormat)
    return bad("format", "\"" + printable(m.format) + "\" is not \"" + std::string(kManifestFormat) + "\"");
  if (!str(j, "suite", m.suite)) return bad("suite", "missing or not a string");
  if (!str(j, "generator", m.generator)) return bad("generator", "missing or not a string");
  if (!j.contains("seed") || !j["seed"].is_number_unsigned())
    return bad("seed", "missing or not a non-negative integer");
  m.seed = j["seed"].get<std::uint64_t>();
  if (j.contains("spec_sha256")) {
    std::string s;
    if (!str(j, "spec_sha256", s)) return bad("spec_sha256", "not a string");
    m.spec_sha256 = s;
  }
  if (!j.contains("cases") || !j["cases"].is_array())
    return bad("cases", "missing or not an array");
  std::set<std::string> ids;
  const json& cases = j["cases"];
  if (cases.size() > limits::kCases)
    return bad("cases", std::to_string(cases.size()) + " cases, over the limit of " +
                            std::to_string(limits::kCases));
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::string where = "cases[" + std::to_string(k) + "]";
    const json& c = cases[k];
    if (!c.is_object()) return bad(where, "not an object");
    for (const auto& [key, v] : c.items())
      if (key != "id" && key != "file" && key != "sha256" && key != "expect" && key != "tags")
        return bad(where + "." + printable(key), "unknown key");
    ManifestCase mc;
    if (!str(c, "id", mc.id) || !valid_case_id(mc.id))
      return bad(where + ".id", "missing or not a name of letters, digits, _ - .");
    if (!ids.insert(mc.id).second) return bad(where + ".id", "\"" + mc.id + "\" appears twice");
    if (!str(c, "file", mc.file) || mc.file != case_file_name(mc.id))
      return bad(where + ".file", "missing or not \"" + case_file_name(mc.id) + "\"");
    bool hex = str(c, "sha256", mc.sha256) && mc.sha256.size() == 64;
    for (char ch : mc.sha256) hex = hex && ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'));
    if (!hex) return bad(where + ".sha256", "missing or not 64 lowercase hex digits");
    if (!str(c, "expect", mc.expect) || (mc.expect != "ok" && mc.expect != "error"))
      return bad(where + ".expect", "missing or not \"ok\" or \"error\"");
    if (!c.contains("tags") || !c["tags"].is_array())
      return bad(where + ".tags", "missing or not an array");
    for (const auto& t : c["tags"]) {
      if (!t.is_string()) return bad(where + ".tags", "holds a value that is not a string");
      mc.tags.push_back(t.get<std::string>());
    }
    m.cases.push_back(std::move(mc));
  }
  return m;
}

}  // namespace attnoracle::vectors
