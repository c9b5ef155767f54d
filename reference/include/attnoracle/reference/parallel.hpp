// The one thread pool of the project: a loop over indices split across threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <mpfr.h>

namespace attnoracle {

// Calls body(k) for every k in [0, n) on up to `threads` threads (the caller's included),
// handing out indices in increasing order. When a call throws, no index after it is started,
// and the exception of the smallest failing index is rethrown once every thread has joined,
// so the error reported does not depend on the thread count. Each extra thread frees MPFR's
// caches before it ends.
template <class Body>
void parallel_for(std::size_t n, int threads, Body&& body) {
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> stop_at{n};  // indices at or after it are not started
  std::mutex mu;
  std::size_t err_index = n;
  std::exception_ptr err;
  auto work = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < stop_at.load();) {
      try {
        body(k);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (k < err_index) {
          err_index = k;
          err = std::current_exception();
          stop_at.store(k);
        }
      }
    }
  };
  const std::size_t want = threads < 1 ? 1 : static_cast<std::size_t>(threads);
  const std::size_t count = n < want ? (n == 0 ? 1 : n) : want;
  std::vector<std::thread> pool;
  pool.reserve(count - 1);
  for (std::size_t t = 1; t < count; ++t)
    pool.emplace_back([&] {
      work();
      mpfr_free_cache();
    });
  work();
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace attnoracle
