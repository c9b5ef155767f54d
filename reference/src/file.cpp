#include "attnoracle/reference/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cerrno>
#include <filesystem>
#include <cstring>

#include "attnoracle/reference/error.hpp"

namespace attnoracle {
namespace {

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

}  // namespace

void advise_huge_pages(const void* p, std::size_t n) {
#ifdef MADV_HUGEPAGE
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  // Only large buffers: a buffer of a few huge pages would gain little.
  if (n < 2 * kHuge) return;
  // The whole huge pages inside the buffer (advice on a range it does not own would be wrong).
  const auto start = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t first = (start + kHuge - 1) & ~(kHuge - 1), last = (start + n) & ~(kHuge - 1);
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p, (void)n;
#endif
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

OpenFile::~OpenFile() {
  if (fd >= 0) ::close(fd);
}

OpenFile open_regular_file(const std::string& path, std::uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
  OpenFile f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) throw InputError(path, "", std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    throw InputError(path, "", std::string("cannot read: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw InputError(path, "", "is " + kind_of(st.st_mode) + ", not a regular file");
  f.size = static_cast<std::uint64_t>(st.st_size);
  if (f.size > max_bytes)
    throw InputError(path, "", "is " + std::to_string(f.size) + " bytes, over the limit of " +
                                   std::to_string(max_bytes));
  return f;
}

std::vector<unsigned char> read_regular_file(const std::string& path, std::uint64_t max_bytes) {
  const OpenFile f = open_regular_file(path, max_bytes);
  std::vector<unsigned char> bytes;
  reserve_large(bytes, static_cast<std::size_t>(f.size));
  bytes.resize(static_cast<std::size_t>(f.size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(f.fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw InputError(path, "", std::string("cannot read: ") + std::strerror(errno));
    if (r == 0) break;  // the file shrank while it was read
    done += static_cast<std::size_t>(r);
  }
  bytes.resize(done);
  // A file that grew while it was read is taken as its first `size` bytes, never past the limit.
  return bytes;
}

std::string path_within(const std::string& root, const std::string& relative) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(root) / relative).string();
  std::error_code ec;
  const fs::path base = fs::canonical(root, ec);
  if (ec) throw InputError(root, "", "cannot open: " + ec.message());
  const fs::path real = fs::canonical(path, ec);  // every link resolved; fails on a loop
  if (ec) throw InputError(path, "", "cannot open: " + ec.message());
  const auto [b, r] = std::mismatch(base.begin(), base.end(), real.begin(), real.end());
  if (b != base.end()) throw InputError(path, "", "leads outside " + root + " (to " + real.string() + ")");
  return real.string();
}

std::vector<unsigned char> read_file_within(const std::string& root, const std::string& relative,
                                            std::uint64_t max_bytes) {
  return read_regular_file(path_within(root, relative), max_bytes);
}

}  // namespace attnoracle
