// Reading input files: one reader for every file the commands read whole.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/reference/limits.hpp"

namespace attnoracle {

// A regular file of at most `max_bytes` bytes, open for reading at its start (closed with the
// object), and its size. Refuses what read_regular_file refuses, with the same messages.
struct OpenFile {
  int fd = -1;
  std::uint64_t size = 0;
  OpenFile() = default;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  OpenFile(OpenFile&& o) noexcept : fd(o.fd), size(o.size) { o.fd = -1; }
  ~OpenFile();
};
OpenFile open_regular_file(const std::string& path, std::uint64_t max_bytes = limits::kFileBytes);

// The bytes of a regular file of at most `max_bytes`. Refuses directories, FIFOs, devices and
// sockets without blocking on them. Throws InputError(path, "", what).
std::vector<unsigned char> read_regular_file(const std::string& path,
                                             std::uint64_t max_bytes = limits::kFileBytes);

// The bytes of `relative` inside the directory `root` (a vector set, a results directory),
// read as read_regular_file does; a path that leaves `root` (through "..", an absolute path or
// a symbolic link resolving outside it) is refused. Throws InputError(root/relative, "", what).
std::vector<unsigned char> read_file_within(const std::string& root, const std::string& relative,
                                            std::uint64_t max_bytes = limits::kFileBytes);
// The real path of `relative` inside `root`, refused as read_file_within refuses it.
std::string path_within(const std::string& root, const std::string& relative);

// Advice that the n bytes at p (a buffer not yet touched, to be filled whole) go on transparent
// huge pages where the system grants them on request: a 2 MiB page takes one page fault where
// 4 KiB pages take 512, and on some virtual machines the faults of filling a large buffer cost
// more than the copy. Only whole huge pages inside the buffer, and only for large buffers.
void advise_huge_pages(const void* p, std::size_t n);
// Reserves n elements in v (empty) with that advice.
template <class T>
void reserve_large(std::vector<T>& v, std::size_t n) {
  v.reserve(n);
  advise_huge_pages(v.data(), n * sizeof(T));
}

// Whether `path` names a regular file (following links); false when it cannot be looked at.
bool is_regular_file(const std::string& path);

}  // namespace attnoracle
