// RWMutex: a reader/writer lock for fibers and threads (Go's sync.RWMutex).
//
//   fiber::RWMutex mu;
//   std::map<std::string, int> table;
//   int get(const std::string& k) {
//     std::shared_lock lock(mu);        // many readers at once
//     return table.at(k);
//   }
//   void put(const std::string& k, int v) {
//     std::lock_guard lock(mu);         // one writer, no readers
//     table[k] = v;
//   }
//
// Meets Lockable/TimedLockable (write side) and SharedLockable/SharedTimedLockable (read side),
// so std::lock_guard, std::unique_lock, std::shared_lock and std::scoped_lock work.
//
// Writers do not starve: once a writer waits, new readers wait too (behind it). Readers do not
// starve either: when a writer unlocks, the readers that queued meanwhile go before the next
// writer. Waiting parks a fiber and blocks a thread.
//
// Ownership: the write lock belongs to the fiber/thread that took it; unlock() by anyone else,
// or when it is not write-locked, throws UsageError, as does unlock_shared() with no read lock
// held, and lock()/lock_shared() by the holder of the write lock (instead of a deadlock).
// Read locks are counted, not owned: taking the write lock while holding a read lock deadlocks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API RWMutex {
 public:
  RWMutex() = default;
  ~RWMutex();  // a waiter still queued is a fatal error
  RWMutex(const RWMutex&) = delete;
  RWMutex& operator=(const RWMutex&) = delete;

  // ---- write side
  // Waits until the caller holds the write lock. Throws UsageError (the caller holds it
  // already), Cancelled.
  void lock();
  // Takes the write lock if it is free now.
  bool try_lock() noexcept;
  // Waits at most d / until tp for the write lock; false on timeout.
  template <typename Rep, typename Period>
  bool try_lock_for(std::chrono::duration<Rep, Period> d) {
    return lock_until_(detail::deadline_after(d));
  }
  template <typename Clock, typename Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return lock_until_(detail::to_deadline(tp));
  }
  // Releases the write lock. Throws UsageError if the caller does not hold it.
  void unlock();

  // ---- read side
  // Waits until the caller holds a read lock (while a writer holds or waits for the lock).
  // Throws UsageError (the caller holds the write lock), Cancelled.
  void lock_shared();
  // Takes a read lock if no writer holds or waits for the lock.
  bool try_lock_shared() noexcept;
  // Waits at most d / until tp for a read lock; false on timeout.
  template <typename Rep, typename Period>
  bool try_lock_shared_for(std::chrono::duration<Rep, Period> d) {
    return lock_shared_until_(detail::deadline_after(d));
  }
  template <typename Clock, typename Duration>
  bool try_lock_shared_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return lock_shared_until_(detail::to_deadline(tp));
  }
  // Releases one read lock. Throws UsageError if no read lock is held.
  void unlock_shared();

 private:
  bool lock_until_(detail::Deadline d);
  bool lock_shared_until_(detail::Deadline d);
  void grant_readers(detail::WaitQueue& woken) noexcept;  // mu_ held
  void dispatch(detail::WaitQueue& woken) noexcept;       // mu_ held

  detail::SpinLock mu_;
  std::uint32_t readers_ = 0;              // GUARDED_BY(mu_): read locks held
  bool writer_ = false;                    // GUARDED_BY(mu_): the write lock is held
  std::atomic<std::uint64_t> writer_id_{0};  // stored under mu_: the write lock's holder
  detail::WaitQueue readq_;                // GUARDED_BY(mu_)
  detail::WaitQueue writeq_;               // GUARDED_BY(mu_)
};

}  // namespace fiber
