// The record of a vector set's case files whose SHA-256 was taken and found equal to the
// manifest's (CONTRACT section 4, "Verified files"): DIR/.attnoracle-verified, written by `gen`
// and `verify`. A case file whose identity (device, inode, size, modification and status-change
// times) and manifest hash are those recorded is read without hashing it again; any write to the
// file changes its status-change time, which no program can set back.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace attnoracle::vectors {

inline constexpr const char* kVerifiedStamp = ".attnoracle-verified";

struct FileIdentity {
  std::uint64_t dev = 0, ino = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};
FileIdentity identity_of(int fd);

// Whether the stamp of `dir` records `file` (relative to dir) with this hash and identity.
bool stamped(const std::string& dir, const std::string& file, const std::string& sha256, const FileIdentity& id);

// Replaces the stamp of `dir` with these (file, sha256) pairs, each file's identity taken now;
// a file that cannot be looked at is left out, and a directory that cannot be written keeps no
// stamp (every read then hashes).
void record_verified(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace attnoracle::vectors
