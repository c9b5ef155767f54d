#include "attnoracle/conformance/adapter.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <dirent.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/text.hpp"
#include "attnoracle/reference/error.hpp"

extern char** environ;

namespace attnoracle::conformance {
namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<unsigned char>;

constexpr std::size_t kTailBytes = 4096;
constexpr std::size_t kMaxReasonBytes = 500;
constexpr std::size_t kMaxTextBytes = 64 * 1024;       // read of .error / .unsupported
constexpr auto kKillGrace = std::chrono::seconds(2);   // SIGTERM to SIGKILL
constexpr auto kDrainLimit = std::chrono::milliseconds(500);  // pipe drain after the exit
constexpr auto kTick = std::chrono::milliseconds(20);  // exit polling without a pidfd
constexpr int kReadsPerWakeup = 16;                    // a chatty adapter cannot starve the loop

std::string errno_text(int err) { return std::strerror(err); }

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::optional<std::string> signal_name(int sig) {
  static constexpr std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"}};
  for (const auto& [number, name] : kNames)
    if (number == sig) return std::string(name);
  return std::nullopt;
}

// Length of the valid UTF-8 sequence at b[i], or 0.
template <class Seq>
std::size_t utf8_length(const Seq& b, std::size_t i) {
  const auto c = static_cast<unsigned char>(b[i]);
  if (c < 0x80) return 1;
  std::size_t n;
  std::uint32_t cp, min_cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2, cp = c & 0x1Fu, min_cp = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, cp = c & 0x0Fu, min_cp = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, cp = c & 0x07u, min_cp = 0x10000;
  } else {
    return 0;
  }
  if (i + n > b.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    const auto d = static_cast<unsigned char>(b[i + k]);
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3Fu);
  }
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

// The last kTailBytes of a byte stream.
class Tail {
 public:
  void append(const char* p, std::size_t n) {
    if (n >= kTailBytes) {
      cut_ = cut_ || n > kTailBytes || !buf_.empty();
      buf_.assign(p + (n - kTailBytes), kTailBytes);
      return;
    }
    buf_.append(p, n);
    if (buf_.size() > 2 * kTailBytes) {
      buf_.erase(0, buf_.size() - kTailBytes);
      cut_ = true;
    }
  }
  std::string take() {
    if (buf_.size() > kTailBytes) {
      buf_.erase(0, buf_.size() - kTailBytes);
      cut_ = true;
    }
    // Do not start in the middle of a UTF-8 sequence.
    std::size_t skip = 0;
    while (cut_ && skip < 3 && skip < buf_.size() &&
           (static_cast<unsigned char>(buf_[skip]) & 0xC0) == 0x80)
      ++skip;
    buf_.erase(0, skip);
    return valid_text(buf_);
  }

 private:
  std::string buf_;
  bool cut_ = false;
};

// Reads what is available on a nonblocking pipe; closes it at end of file or on error.
void drain(Fd& pipe, Tail& tail) {
  char buf[1 << 16];
  for (int r = 0; r < kReadsPerWakeup && pipe.get() >= 0; ++r) {
    const ssize_t got = ::read(pipe.get(), buf, sizeof buf);
    if (got > 0) {
      tail.append(buf, static_cast<std::size_t>(got));
    } else if (got < 0 && errno == EINTR) {
      continue;
    } else if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      pipe.reset();  // end of file, or an error we cannot do anything about
    }
  }
}

// A pipe whose ends are CLOEXEC and not 0, 1 or 2 (so that dup2 onto 1 and 2 always copies).
std::pair<int, int> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw InputError("adapter", "", "cannot create a pipe: " + errno_text(errno));
  for (int& fd : fds) {
    if (fd > 2) continue;
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    const int err = errno;
    ::close(fd);
    fd = moved;
    if (moved < 0) throw InputError("adapter", "", "cannot create a pipe: " + errno_text(err));
  }
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  return {fds[0], fds[1]};
}

// Starts /bin/sh -c script as the leader of a new process group, stdin from /dev/null,
// stdout and stderr into out_fd, no other descriptors inherited.
pid_t spawn_shell(const std::string& script, int out_fd) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_fd, 1);
  posix_spawn_file_actions_adddup2(&actions, out_fd, 2);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
#endif
  // Signals the runner may ignore are not passed on; TERM must work for the timeout.
  sigset_t defaults, mask;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGXFSZ, SIGTERM, SIGINT}) sigaddset(&defaults, sig);
  sigemptyset(&mask);
  posix_spawnattr_setflags(&attr, static_cast<short>(POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF |
                                                     POSIX_SPAWN_SETSIGMASK));
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &mask);

  std::string arg0 = "sh", arg1 = "-c", arg2 = script;
  char* argv[] = {arg0.data(), arg1.data(), arg2.data(), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw InputError("/bin/sh", "", "cannot start: " + errno_text(rc));
  return pid;
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);  // CLOEXEC by definition
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

// Whether the leader has exited, without reaping it: while it is an unreaped zombie its pid,
// and so the process group id, cannot be reused, and killing the group is safe.
bool leader_exited(pid_t pid) {
  for (;;) {
    siginfo_t info;
    std::memset(&info, 0, sizeof info);
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0)
      return info.si_pid == pid;
    if (errno != EINTR) return true;  // ECHILD: reaped elsewhere (SIGCHLD ignored)
  }
}

int millis_until(Clock::time_point now, Clock::time_point t) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - now).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1'000'000));
}

// This process's children: with it a child subreaper, they include every orphan of an
// implementation's processes (a child started with setsid, a daemon), which a kill of the
// process group cannot reach.
std::vector<pid_t> children() {
  std::vector<pid_t> out;
  const pid_t self = ::getpid();
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/stat");
    std::string line;
    if (!std::getline(f, line)) continue;
    const auto p = line.rfind(')');  // "pid (comm) state ppid ...": comm may hold anything
    if (p == std::string::npos) continue;
    char state = 0;
    long ppid = 0;
    if (std::sscanf(line.c_str() + p + 1, " %c %ld", &state, &ppid) == 2 && ppid == self)
      out.push_back(static_cast<pid_t>(std::atol(e->d_name)));
  }
  ::closedir(d);
  return out;
}

// Kills and reaps what an implementation left behind once its leader is gone; orphans of
// those (their children) are adopted in turn, until none is left or kDrainLimit has passed.
// The gate runs one implementation at a time, so every child left is the implementation's.
void kill_leftovers() {
  const auto end = Clock::now() + kDrainLimit;
  for (std::vector<pid_t> left = children(); !left.empty() && Clock::now() < end; left = children()) {
    for (pid_t c : left) ::kill(c, SIGKILL);
    for (pid_t c : left)
      while (::waitpid(c, nullptr, 0) < 0 && errno == EINTR) {
      }
  }
}

// Runs the command, fills everything of `run` but the results.
void run_process(const std::string& script, double timeout_seconds, AdapterRun& run) {
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);  // orphans of the implementation become ours, to end
  const auto [read_end, write_end] = make_pipe();
  Fd out(read_end);
  Fd child_end(write_end);
  const pid_t pid = spawn_shell(script, child_end.get());
  child_end.reset();
  Fd pidfd(open_pidfd(pid));

  const auto start = Clock::now();
  std::optional<Clock::time_point> deadline, kill_at;
  if (timeout_seconds > 0 && timeout_seconds < 1e9)
    deadline = start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(timeout_seconds));
  bool killed = false;
  Tail tail;

  while (!leader_exited(pid)) {
    const auto now = Clock::now();
    if (deadline && !run.timed_out && now >= *deadline) {
      ::kill(-pid, SIGTERM);
      run.timed_out = true;
      kill_at = now + kKillGrace;
    }
    if (kill_at && !killed && now >= *kill_at) {
      ::kill(-pid, SIGKILL);
      killed = true;
    }
    int wait_ms = -1;
    auto until = [&](Clock::time_point t) {
      const int ms = millis_until(now, t);
      wait_ms = wait_ms < 0 ? ms : std::min(wait_ms, ms);
    };
    if (deadline && !run.timed_out) until(*deadline);
    if (kill_at && !killed) until(*kill_at);
    if (pidfd.get() < 0) until(now + kTick);

    pollfd fds[2];
    nfds_t n = 0;
    if (out.get() >= 0) fds[n++] = {out.get(), POLLIN, 0};
    if (pidfd.get() >= 0) fds[n++] = {pidfd.get(), POLLIN, 0};
    if (n == 0 && wait_ms < 0) wait_ms = millis_until(now, now + kTick);
    ::poll(fds, n, wait_ms);  // EINTR: just go round
    if (out.get() >= 0) drain(out, tail);
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();

  // Whatever it left running in its group goes, then the leader is reaped.
  ::kill(-pid, SIGKILL);
  int status = 0;
  pid_t reaped;
  while ((reaped = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  kill_leftovers();
  run.exit_status = -1;
  if (reaped == pid && WIFEXITED(status)) {
    run.exit_status = WEXITSTATUS(status);
  } else if (reaped == pid && WIFSIGNALED(status)) {
    run.signaled = true;
    run.signal = WTERMSIG(status);
  }

  // The rest of the output. Processes that left the group may hold the pipe open: not for long.
  const auto drain_end = Clock::now() + kDrainLimit;
  while (out.get() >= 0) {
    const auto now = Clock::now();
    if (now >= drain_end) break;
    pollfd fd = {out.get(), POLLIN, 0};
    ::poll(&fd, 1, millis_until(now, drain_end));
    drain(out, tail);
  }
  run.stderr_tail = tail.take();
}

// Text as one line: whitespace and control characters collapse to single spaces, invalid UTF-8
// becomes '?', trimmed, at most kMaxReasonBytes bytes.
std::string one_line(const Bytes& bytes) {
  std::string s;
  bool space = false;
  for (std::size_t i = 0; i < bytes.size();) {
    const unsigned char c = bytes[i];
    const std::size_t len = utf8_length(bytes, i);
    const bool c1 = len == 2 && c == 0xC2 && bytes[i + 1] < 0xA0;  // U+0080..U+009F
    if ((len == 1 && (c <= 0x20 || c == 0x7f)) || c1) {
      i += len;
      space = true;
      continue;
    }
    if (space && !s.empty()) s += ' ';
    space = false;
    if (len == 0) {
      s += '?';
      ++i;
    } else {
      s.append(bytes.begin() + static_cast<std::ptrdiff_t>(i),
               bytes.begin() + static_cast<std::ptrdiff_t>(i + len));
      i += len;
    }
  }
  if (s.size() > kMaxReasonBytes) {
    std::size_t n = kMaxReasonBytes - 3;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
    s.resize(n);
    s += "...";
  }
  return s.empty() ? "(empty)" : s;
}

// Opens a regular file without ever blocking on a FIFO or a device, and says how many bytes
// to read of it: files longer than `limit` are an error, or (cut) read in part. Returns why it
// failed, or nothing.
std::optional<std::string> open_regular(const std::string& path, std::uint64_t limit, bool cut, Fd& fd,
                                        std::uint64_t& want) {
  // O_NOFOLLOW: a result that is a link (to a file outside, say) is never read.
  fd.reset(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW));
  if (fd.get() < 0 && errno == ELOOP)
    return std::string("is a symbolic link, not a regular file (results are read only as files)");
  if (fd.get() < 0) return "cannot open: " + errno_text(errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return "cannot read: " + errno_text(errno);
  if (!S_ISREG(st.st_mode)) return std::string("not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > limit && !cut)
    return "is " + std::to_string(size) + " bytes, more than the runner reads (" +
           std::to_string(limit) + ")";
  want = std::min(size, limit);
  return std::nullopt;
}

// Reads a regular file as open_regular opens it. Returns why it failed, or nothing.
std::optional<std::string> read_regular(const std::string& path, std::uint64_t limit, bool cut,
                                        Bytes& bytes) {
  Fd fd;
  std::uint64_t want = 0;
  if (auto failed = open_regular(path, limit, cut, fd, want)) return failed;
  reserve_for_read(bytes, static_cast<std::size_t>(want));
  bytes.resize(static_cast<std::size_t>(want));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return "cannot read: " + errno_text(errno);
    if (got == 0) break;  // it shrank
    done += static_cast<std::size_t>(got);
  }
  bytes.resize(done);
  return std::nullopt;
}

JobResult make_result(Outcome o, std::string reason) {
  JobResult r;
  r.outcome = o;
  r.reason = std::move(reason);
  return r;
}

JobResult no_output(const AdapterRun& run, double timeout_seconds) {
  if (run.timed_out)
    return make_result(Outcome::TimedOut, "no output: the run timed out after " +
                                              duration_text(timeout_seconds) + " and was killed");
  if (run.signaled) {
    const auto name = signal_name(run.signal);
    return make_result(Outcome::Crashed, "no output: the implementation was killed by " +
                                             name.value_or("signal " + std::to_string(run.signal)));
  }
  if (run.exit_status < 0)
    return make_result(Outcome::Crashed,
                       "no output, and the implementation's exit status is unknown");
  if (run.exit_status != 0) {
    std::string why = "no output: the implementation exited with status " +
                      std::to_string(run.exit_status);
    // A shell reports a child killed by signal n as 128 + n.
    if (const auto name = run.exit_status > 128 ? signal_name(run.exit_status - 128) : std::nullopt)
      why += ", which a shell reports for " + *name;
    return make_result(Outcome::Crashed, why);
  }
  return make_result(Outcome::Missing, "no output, output.error or output.unsupported was written");
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 || (errno != ENOENT && errno != ENOTDIR);
}

// The one file the implementation wrote for a job: 0 output, 1 .error, 2 .unsupported.
JobResult read_written(const std::string& path, int which) {
  Bytes bytes;
  if (which == 0) {
    Fd fd;
    std::uint64_t size = 0;
    if (auto failed = open_regular(path, kMaxOutputBytes, false, fd, size))
      return make_result(Outcome::Invalid, path + ": " + *failed);
    try {  // each tensor read straight into place
      JobResult r = make_result(Outcome::Output, "");
      r.output = read_safetensors(path, fd.get(), size);
      return r;
    } catch (const InputError& e) {
      return make_result(Outcome::Invalid, e.message());
    }
  }
  if (auto failed = read_regular(path, kMaxTextBytes, true, bytes))
    return make_result(Outcome::Invalid, path + ": " + *failed);
  return make_result(which == 1 ? Outcome::Refused : Outcome::Unsupported, one_line(bytes));
}

JobResult collect(const AdapterJob& job, const AdapterRun& run, double timeout_seconds) {
  JobResult r = read_job_result(job.output);
  return r.outcome == Outcome::Missing ? no_output(run, timeout_seconds) : r;
}

void remove_stale(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT && errno != ENOTDIR)
    throw InputError(path, "", "cannot remove a stale output: " + errno_text(errno));
}

}  // namespace

void reserve_for_read(std::vector<unsigned char>& bytes, std::size_t size) {
  if (size < (std::size_t{32} << 20)) return;
  bytes.reserve(size);
  const auto begin = reinterpret_cast<std::uintptr_t>(bytes.data());
  const std::uintptr_t page = 4096, lo = (begin + page - 1) / page * page, hi = (begin + size) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
}

std::string valid_text(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    const std::size_t len = utf8_length(bytes, i);
    if (c == '\r') {  // a progress line's returns: the lines run on
      ++i;
      continue;
    }
    const bool control = len == 1 && (c < 0x20 || c == 0x7f) && c != '\n' && c != '\t';
    const bool c1 = len == 2 && c == 0xC2 && static_cast<unsigned char>(bytes[i + 1]) < 0xA0;  // U+0080..U+009F
    if (len == 0 || control || c1) {
      s += "\xEF\xBF\xBD";
      i += len == 0 ? 1 : len;
    } else {
      s.append(bytes.substr(i, len));
      i += len;
    }
  }
  return s;
}

JobResult read_job_result(const std::string& output) {
  static constexpr const char* kNames[3] = {"output", "output.error", "output.unsupported"};
  const std::string paths[3] = {output, output + ".error", output + ".unsupported"};
  std::vector<std::string> present;
  int which = -1;
  for (int i = 0; i < 3; ++i) {
    if (!exists(paths[i])) continue;
    present.push_back(kNames[i]);
    which = i;
  }
  if (present.size() == 2)
    return make_result(Outcome::Invalid, "wrote both " + present[0] + " and " + present[1] +
                                             " (exactly one is allowed)");
  if (present.size() == 3)
    return make_result(Outcome::Invalid, "wrote output, output.error and output.unsupported "
                                         "(exactly one is allowed)");
  if (present.empty()) return make_result(Outcome::Missing, "no output, output.error or output.unsupported was written");
  try {
    return read_written(paths[which], which);
  } catch (const std::exception& e) {  // std::bad_alloc, say
    return make_result(Outcome::Invalid, paths[which] + ": " + e.what());
  }
}

std::string_view outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Output: return "output";
    case Outcome::Refused: return "refused";
    case Outcome::Unsupported: return "unsupported";
    case Outcome::Missing: return "missing";
    case Outcome::Crashed: return "crashed";
    case Outcome::TimedOut: return "timed_out";
    case Outcome::Invalid: return "invalid";
  }
  return "unknown";
}

AdapterRun run_adapter(const std::string& command, const std::vector<AdapterJob>& jobs,
                       const std::string& work_dir, double timeout_seconds) {
  std::error_code ec;
  std::filesystem::create_directories(work_dir, ec);
  if (ec) throw InputError(work_dir, "", "cannot create the work directory: " + ec.message());
  const std::string jobs_path = (std::filesystem::path(work_dir) / "jobs.jsonl").string();

  std::string text;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const auto& job = jobs[i];
    const nlohmann::json line = {{"id", job.id}, {"input", job.input}, {"output", job.output}};
    try {
      text += line.dump() + "\n";
    } catch (const nlohmann::json::exception&) {
      throw InputError(jobs_path, "job " + std::to_string(i + 1), "id or path is not valid UTF-8");
    }
  }
  write_file_atomic(jobs_path, Bytes(text.begin(), text.end()));
  for (const auto& job : jobs)
    for (const char* suffix : {"", ".error", ".unsupported"}) remove_stale(job.output + suffix);

  AdapterRun run;
  run_process(command + " " + shell_quote(jobs_path), timeout_seconds, run);
  run.results.reserve(jobs.size());
  for (const auto& job : jobs) run.results.push_back(collect(job, run, timeout_seconds));
  return run;
}

}  // namespace attnoracle::conformance
