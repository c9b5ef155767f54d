// The stamp of verified case files (verified_stamp.hpp): one line per file, "sha256 dev ino size
// mtime_ns ctime_ns file".
#include "attnoracle/reference/verified_stamp.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/safetensors.hpp"

namespace attnoracle::vectors {

namespace {
FileIdentity from_stat(const struct stat& st) {
  FileIdentity id;
  id.dev = static_cast<std::uint64_t>(st.st_dev);
  id.ino = static_cast<std::uint64_t>(st.st_ino);
  id.size = static_cast<std::uint64_t>(st.st_size);
  id.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  id.ctime_ns = static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
  return id;
}
}  // namespace

FileIdentity identity_of(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {};
  return from_stat(st);
}

bool stamped(const std::string& dir, const std::string& file, const std::string& sha256, const FileIdentity& id) {
  if (id.size == 0 && id.ino == 0) return false;
  std::vector<unsigned char> bytes;
  try {
    bytes = read_file_within(dir, kVerifiedStamp);  // (a link out of the set is not followed)
  } catch (const InputError&) {
    return false;
  }
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string sha, name;
    FileIdentity rec;
    if (!(ls >> sha >> rec.dev >> rec.ino >> rec.size >> rec.mtime_ns >> rec.ctime_ns >> std::ws)) continue;
    std::getline(ls, name);
    if (name == file) return sha == sha256 && rec == id;
  }
  return false;
}

void record_verified(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& files) {
  std::string text;
  for (const auto& [file, sha] : files) {
    struct stat st {};
    if (::stat((std::filesystem::path(dir) / file).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    const FileIdentity id = from_stat(st);
    text += sha + " " + std::to_string(id.dev) + " " + std::to_string(id.ino) + " " + std::to_string(id.size) + " " +
            std::to_string(id.mtime_ns) + " " + std::to_string(id.ctime_ns) + " " + file + "\n";
  }
  try {
    write_file_atomic((std::filesystem::path(dir) / kVerifiedStamp).string(),
                      std::vector<unsigned char>(text.begin(), text.end()));
  } catch (const InputError&) {
    // a set that cannot be written: no stamp, every read hashes
  }
}

}  // namespace attnoracle::vectors
