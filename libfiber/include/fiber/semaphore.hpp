// Semaphore: a counting semaphore for fibers and threads.
//
//   fiber::Semaphore slots(4);            // at most 4 concurrent downloads
//   go [&] {
//     slots.acquire();                    // parks while no permit is available
//     download();
//     slots.release();
//   };
//   if (slots.try_acquire_for(10ms)) { ...; slots.release(); }
//
// FIFO: a released permit goes straight to the longest waiter (no barging), so no waiter is
// bypassed. The count of available permits never exceeds max() (default: no practical bound):
// release() that would exceed it throws UsageError, which catches double releases when max() is
// the initial count. Waiting parks a fiber and blocks a thread; any mix works.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API Semaphore {
 public:
  static constexpr std::int64_t kUnbounded = std::numeric_limits<std::int64_t>::max();

  // `initial` permits available, at most `max` available at any time. Throws UsageError unless
  // 0 <= initial <= max and max >= 1.
  explicit Semaphore(std::int64_t initial = 0, std::int64_t max = kUnbounded);
  ~Semaphore();  // a waiter still queued is a fatal error
  Semaphore(const Semaphore&) = delete;
  Semaphore& operator=(const Semaphore&) = delete;

  // Takes one permit, waiting for one. Throws Cancelled.
  void acquire();
  // Takes one permit if one is available now.
  bool try_acquire() noexcept;
  // Takes one permit, waiting at most d / until tp; false on timeout.
  template <typename Rep, typename Period>
  bool try_acquire_for(std::chrono::duration<Rep, Period> d) {
    return acquire_until_(detail::deadline_after(d));
  }
  template <typename Clock, typename Duration>
  bool try_acquire_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return acquire_until_(detail::to_deadline(tp));
  }
  // Returns n permits (waking up to n waiters). Throws UsageError if n < 0 or the available count
  // would exceed max() (then nothing is released).
  void release(std::int64_t n = 1);
  // Permits available now (a snapshot).
  std::int64_t available() const noexcept;
  std::int64_t max() const noexcept { return max_; }

 private:
  bool acquire_until_(detail::Deadline d);

  const std::int64_t max_;
  mutable detail::SpinLock mu_;
  std::int64_t count_;         // GUARDED_BY(mu_); > 0 only while no live waiter is queued
  detail::WaitQueue waiters_;  // GUARDED_BY(mu_)
};

}  // namespace fiber
