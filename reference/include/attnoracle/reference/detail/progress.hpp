// The progress of one pass of an evaluation, given to EvalOptions::progress.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::detail {

// Counts the units of a pass as they finish, on any worker; the count goes to the callback
// under a lock, so the calls see 1, 2, ..., total in that order. Nothing when no callback.
class PassProgress {
 public:
  PassProgress(const EvalOptions& opt, std::string unit, std::uint64_t total)
      : f_(opt.progress), unit_(std::move(unit)), total_(total) {}
  void unit_done() {
    if (!f_) return;
    std::lock_guard<std::mutex> g(m_);
    f_(unit_, ++done_, total_);
  }

 private:
  const EvalProgress& f_;
  const std::string unit_;
  const std::uint64_t total_;
  std::uint64_t done_ = 0;
  std::mutex m_;
};

}  // namespace attnoracle::detail
