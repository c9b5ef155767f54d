#include "cli.hpp"

#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>

#include "attnoracle/conformance/text.hpp"
#include "attnoracle/reference/error.hpp"

namespace attnoracle::cli {

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void require_parent_dir(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent))
    throw InputError(path, "", "directory " + parent.string() + " does not exist");
}

void ProgressFlags::add(CLI::App* sub) {
  CLI::Option* yes = sub->add_flag("--progress", on, "show progress on stderr even when it is not a terminal");
  CLI::Option* no = sub->add_flag("--no-progress", off, "no progress line (default where stderr is not a terminal, or CI is set)");
  yes->excludes(no);
}

bool ProgressFlags::wanted() const {
  if (on || off) return on;
  const char* ci = std::getenv("CI");
  return ::isatty(2) != 0 && (ci == nullptr || *ci == '\0');
}

Progress::Progress(std::string what, bool shown)
    : what_(std::move(what)), shown_(shown), start_(Clock::now()), unit_start_(start_), drawn_(start_) {}

Progress::~Progress() { clear(); }

void Progress::update(std::size_t done, std::size_t total, const std::string& unit) {
  if (!shown_) return;
  std::lock_guard<std::mutex> g(m_);
  const Clock::time_point now = Clock::now();
  if (unit != unit_) {
    unit_ = unit;
    unit_start_ = now;
    unit_done0_ = done;
  } else if (any_drawn_ && done < total && now - drawn_ < std::chrono::milliseconds(100)) {
    return;
  }
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double unit_elapsed = std::chrono::duration<double>(now - unit_start_).count();
  std::string line = what_ + ": " + std::to_string(done) + "/" + std::to_string(total) + " " + unit + ", " +
                     conformance::duration_text(elapsed);
  // the rate of this unit so far, carried over what is left of it
  if (done > unit_done0_ && done < total && unit_elapsed > 0)
    line += ", about " + conformance::duration_text(unit_elapsed * static_cast<double>(total - done) / static_cast<double>(done - unit_done0_)) + " left";
  const std::size_t w = line.size();
  if (w < width_) line.append(width_ - w, ' ');  // cover the longer line before
  width_ = w;
  std::fprintf(stderr, "\r%s", line.c_str());
  std::fflush(stderr);
  drawn_ = now;
  any_drawn_ = true;
}

void Progress::erase_locked() {
  if (!any_drawn_) return;
  std::fprintf(stderr, "\r%s\r", std::string(width_, ' ').c_str());
  std::fflush(stderr);
  any_drawn_ = false;
  width_ = 0;
}

void Progress::clear() {
  if (!shown_) return;
  std::lock_guard<std::mutex> g(m_);
  erase_locked();
}

void print_violations(const std::string& file, const oracle::InvariantViolation& e) {
  const auto& v = e.violations();
  std::cerr << "attnoracle: invariant violated: " << file << ": " << v.size() << " violation"
            << (v.size() == 1 ? "" : "s") << "; nothing written\n";
  for (std::size_t k = 0; k < v.size() && k < 20; ++k) std::cerr << "  " << v[k].message() << "\n";
  if (v.size() > 20) std::cerr << "  ... and " << v.size() - 20 << " more\n";
  std::cerr.flush();
}

std::string make_temp_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr)
    throw InputError(tmpl, "", std::string("cannot create a temporary directory: ") + std::strerror(errno));
  return tmpl;
}

TempDirGuard::~TempDirGuard() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace attnoracle::cli
