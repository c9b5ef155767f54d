// The manifest of a vector set (CONTRACT section 4) and SHA-256 of files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attnoracle/reference/safetensors.hpp"

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

// The case file `file` of the vector set in `dir`, read only inside it (as read_file_within) and
// hashed as it is read. Throws InputError(dir/file, "", ...): "sha256 differs from the manifest:
// the vector set is altered" when its SHA-256 is not `sha256` (said before any other problem of
// such a file), else what reading and parsing it refuse. A file the set's stamp records as
// verified with this hash, unchanged since (verified_stamp.hpp), is read without hashing, unless
// `rehash`.
SafeTensorsFile read_set_case(const std::string& dir, const std::string& file, const std::string& sha256,
                              bool rehash = false);

// A case id usable as a file name: letters, digits, _ - . (not first).
bool valid_case_id(std::string_view id);
std::string case_file_name(std::string_view id);  // "cases/<id>.safetensors"

}  // namespace attnoracle::vectors
