// WaitGroup: waits for a collection of tasks to finish (Go's sync.WaitGroup).
//
//   fiber::WaitGroup wg;
//   for (int i = 0; i < n; ++i) {
//     wg.add(1);
//     go [&wg] { work(); wg.done(); };
//   }
//   wg.wait();  // parks a fiber, blocks a thread
//
// Usable from fibers and plain threads, on any scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

// A WaitGroup has a cache line to itself (its first member is alignas(64)): every fiber that
// finishes writes its counter, on any processor, and it usually lives on the stack of the fiber
// that waits. Sharing a line with that fiber's other locals, each done() took the line from a
// spawning loop still writing beside it.
class FIBER_API WaitGroup {
 public:
  WaitGroup() = default;
  WaitGroup(const WaitGroup&) = delete;
  WaitGroup& operator=(const WaitGroup&) = delete;

  // Adds delta (may be negative) to the counter; reaching zero wakes every waiter.
  // Throws UsageError if the counter would go negative or past INT64_MAX.
  void add(std::int64_t delta = 1);
  // add(-1).
  void done() { add(-1); }
  // Returns when the counter is zero. Throws Cancelled if the waiting fiber is cancelled.
  void wait();
  // Waits at most d / until tp for the counter to reach zero; false on timeout (d <= 0: only
  // checks). Throws Cancelled.
  template <typename Rep, typename Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    return wait_until_(detail::deadline_after(d));
  }
  template <typename Clock, typename Duration>
  bool wait_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return wait_until_(detail::to_deadline(tp));
  }
  // The current counter (a snapshot).
  std::int64_t count() const noexcept { return count_.load(std::memory_order_acquire); }

 private:
  bool wait_until_(detail::Deadline d);

  alignas(64) std::atomic<std::int64_t> count_{0};  // the reaching-zero decrement is acq_rel
  detail::SpinLock mu_;
  detail::WaitQueue waiters_;           // GUARDED_BY(mu_)
};

}  // namespace fiber
