// Mutex: mutual exclusion for fibers and threads (Go's sync.Mutex, plus an owner).
//
//   fiber::Mutex mu;
//   int shared = 0;
//   go [&] {
//     std::lock_guard lock(mu);      // parks this fiber while another fiber or thread holds mu
//     ++shared;
//   };
//   if (mu.try_lock_for(5ms)) { ...; mu.unlock(); }
//
// Meets the standard Lockable and TimedLockable requirements: std::lock_guard, std::unique_lock,
// std::scoped_lock and fiber::CondVar work with it. Waiting parks a fiber and blocks a plain
// thread; any mix works, across processors and schedulers.
//
// Ownership: the fiber (or plain thread) that locked it must unlock it; unlocking a mutex that is
// not locked, or that another fiber/thread holds, throws UsageError. It is not recursive: lock()
// by the owner throws UsageError instead of deadlocking.
//
// Fairness (Go's two modes): normally an unlock wakes the longest waiter, which then competes
// with newly arriving lockers - fast under contention, but it may lose. A waiter that has lost
// for more than 1 ms switches the mutex to handoff mode: each unlock then passes ownership
// directly to the first waiter and newcomers queue up behind. The mode ends when the queue
// empties or a waiter got the lock within 1 ms. So no waiter is bypassed forever.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API Mutex {
 public:
  Mutex() = default;
  ~Mutex();  // a waiter still queued is a fatal error
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  // Waits until the caller owns the mutex. Throws UsageError if the caller already owns it,
  // Cancelled if the waiting fiber is cancelled.
  void lock();
  // Takes the mutex if it is free now (and no waiter is owed a handoff); never waits.
  bool try_lock() noexcept;
  // Waits at most d for the mutex; false on timeout (d <= 0: try_lock). Throws like lock().
  template <typename Rep, typename Period>
  bool try_lock_for(std::chrono::duration<Rep, Period> d) {
    return try_lock_until_(detail::deadline_after(d));
  }
  // Waits until tp at the latest; false on timeout.
  template <typename Clock, typename Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return try_lock_until_(detail::to_deadline(tp));
  }
  // Releases the mutex. Throws UsageError if the caller does not hold it.
  void unlock();
  // Whether someone holds it (a snapshot, for assertions and tests).
  bool is_locked() const noexcept { return (state_.load(std::memory_order_relaxed) & kLocked) != 0; }

 private:
  // state_ bits. kLocked: held. The others change only under mu_:
  // kWaiters: waiters_ may be non-empty (unlock must look). kWoken: an unlock woke a waiter
  // that has not retried yet (later unlocks need not wake another). kStarving: handoff mode.
  static constexpr std::uint32_t kLocked = 1, kWaiters = 2, kWoken = 4, kStarving = 8;

  bool try_lock_until_(detail::Deadline d);
  bool lock_slow(std::uint64_t me, detail::Deadline d);
  void unlock_slow() noexcept;

  // Acquire on the CAS that sets kLocked, release on the store/RMW that clears it (or on the
  // handoff's wake): a critical section happens-before the next one.
  std::atomic<std::uint32_t> state_{0};
  // The holder's id (fiber id, or a thread id with the top bit set); written by the holder after
  // acquiring, or by the unlocker on a handoff. Read by unlock/lock for the ownership checks.
  std::atomic<std::uint64_t> owner_{0};
  detail::SpinLock mu_;
  detail::WaitQueue waiters_;  // GUARDED_BY(mu_); FIFO, a woken loser goes back to the front
};

}  // namespace fiber
