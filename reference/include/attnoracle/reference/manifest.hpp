// The manifest of a vector set (CONTRACT section 4) and SHA-256 of files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace attnoracle::vectors {

inline constexpr std::string_view kManifestFormat = "attnoracle-vectors/1";

struct ManifestCase {
  std::string id;
  std::string file;    // "cases/<id>.safetensors"
  std::string sha256;  // lowercase hex
  std::string expect;  // "ok" or "error"
  std::vector<std::string> tags;
};

struct Manifest {
  std::string format = std::string(kManifestFormat);
  std::string suite;
  std::string generator;  // "attnoracle <version>"
  std::uint64_t seed = 0;
  std::optional<std::string> spec_sha256;
  std::vector<ManifestCase> cases;
};

// Keys in a fixed order (format, suite, generator, seed, spec_sha256, cases; id, file, sha256,
// expect, tags), one case per line: the same manifest gives the same bytes.
std::string manifest_text(const Manifest& m);

// Parses a manifest. Throws InputError(path, "", ...) when it is not JSON; returns the first
// problem with the content (a missing or ill-typed field, a wrong format string, a repeated id)
// in `problem`, as "<JSON path>: <what>".
Manifest parse_manifest(const std::string& path, std::string_view text, std::string& problem);

std::string sha256_hex(const unsigned char* data, std::size_t size);
inline std::string sha256_hex(const std::vector<unsigned char>& b) {
  return sha256_hex(b.data(), b.size());
}
inline std::string sha256_hex(std::string_view s) {
  return sha256_hex(reinterpret_cast<const unsigned char*>(s.data()), s.size());
}

// A case id usable as a file name: letters, digits, _ - . (not first).
bool valid_case_id(std::string_view id);
std::string case_file_name(std::string_view id);  // "cases/<id>.safetensors"

}  // namespace attnoracle::vectors
