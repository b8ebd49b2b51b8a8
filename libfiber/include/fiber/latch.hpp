// Latch: a single-use countdown that fibers and threads wait on (std::latch's shape).
//
//   fiber::Latch ready(3);
//   for (int i = 0; i < 3; ++i) go [&] { warm_up(); ready.count_down(); };
//   ready.wait();                  // parks a fiber, blocks a thread, until the count is 0
//
// Once the count reaches zero it stays there: every wait returns at once. Compare WaitGroup
// (reusable, counts up and down).
#pragma once

#include <chrono>
#include <cstdint>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API Latch {
 public:
  // Throws UsageError if expected < 0.
  explicit Latch(std::int64_t expected);
  ~Latch();  // a waiter still queued is a fatal error
  Latch(const Latch&) = delete;
  Latch& operator=(const Latch&) = delete;

  // Decrements the count by n; reaching zero wakes every waiter. Throws UsageError if n < 0 or
  // the count would go below zero (then nothing changes).
  void count_down(std::int64_t n = 1);
  // True once the count is zero.
  bool try_wait() const noexcept;
  // Waits until the count is zero. Throws Cancelled.
  void wait() const;
  // Waits at most d / until tp; false if the count is still not zero.
  template <typename Rep, typename Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return wait_until_(detail::deadline_after(d));
  }
  template <typename Clock, typename Duration>
  bool wait_until(const std::chrono::time_point<Clock, Duration>& tp) const {
    return wait_until_(detail::to_deadline(tp));
  }
  // count_down(n) then wait().
  void arrive_and_wait(std::int64_t n = 1);
  // The count now (a snapshot).
  std::int64_t count() const noexcept;

 private:
  bool wait_until_(detail::Deadline d) const;

  mutable detail::SpinLock mu_;
  std::int64_t count_;                 // GUARDED_BY(mu_)
  mutable detail::WaitQueue waiters_;  // GUARDED_BY(mu_)
};

}  // namespace fiber
