// The progress of one pass of an evaluation, given to EvalOptions::progress.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "attnoracle/reference/evaluate.hpp"

namespace attnoracle::detail {

// Counts the units of a pass as they finish, on any worker; the count goes to the callback
// under a lock, so the calls see 1, 2, ..., total in that order. While the pass runs, a timer
// also repeats the current count once a second, so that a line showing the elapsed time moves
// during one long unit. Nothing (and no timer) when no callback.
class PassProgress {
 public:
  PassProgress(const EvalOptions& opt, std::string unit, std::uint64_t total)
      : f_(opt.progress), unit_(std::move(unit)), total_(total) {
    if (f_ && total_ > 0) timer_ = std::thread([this] { tick(); });
  }
  ~PassProgress() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (timer_.joinable()) timer_.join();
  }
  PassProgress(const PassProgress&) = delete;
  PassProgress& operator=(const PassProgress&) = delete;

  void unit_done() {
    if (!f_) return;
    std::lock_guard<std::mutex> g(m_);
    f_(unit_, ++done_, total_);
  }

 private:
  // Once a second until the last unit is done or the pass ends; the count is not changed.
  void tick() {
    std::unique_lock<std::mutex> g(m_);
    while (!cv_.wait_for(g, std::chrono::seconds(1), [this] { return stop_ || done_ == total_; }))
      f_(unit_, done_, total_);
  }

  const EvalProgress& f_;
  const std::string unit_;
  const std::uint64_t total_;
  std::uint64_t done_ = 0;
  bool stop_ = false;
  std::mutex m_;
  std::condition_variable cv_;
  std::thread timer_;
};

}  // namespace attnoracle::detail
