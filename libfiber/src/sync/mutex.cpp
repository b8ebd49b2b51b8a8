// Mutex: a lock word with a fast path, and a wait queue under a SpinLock (see fiber/mutex.hpp).
//
// Uncontended lock and unlock are one CAS each on state_. Contended:
//   - a locker takes mu_, and in one CAS either acquires (the word is free) or publishes
//     kWaiters and enqueues itself, so an unlock either happened before its CAS (it acquires) or
//     sees kWaiters (and takes mu_, which orders it after the enqueue) - no lost wakeup;
//   - normal mode: unlock clears kLocked, then wakes the first waiter unless one is already
//     awake (kWoken). The woken waiter retries; losing to a newcomer, it requeues at the front;
//     after 1 ms of waiting it sets kStarving;
//   - handoff mode (kStarving): unlock keeps kLocked, makes the first waiter the owner and wakes
//     it. kStarving implies kLocked outside mu_, so newcomers always queue behind.
// Threads spin briefly before parking (a futex round trip costs microseconds); fibers do not: a
// holder on the same processor cannot run while we spin, and a fiber park costs a switch.
#include "fiber/mutex.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "fiber/error.hpp"
#include "sync/owner.hpp"

namespace fiber {

namespace detail {
namespace {
thread_local std::uint64_t t_owner_id = 0;
std::atomic<std::uint64_t> g_next_thread_owner{1};
}  // namespace

__attribute__((noinline)) std::uint64_t this_thread_owner_id() noexcept {
  asm volatile("" ::: "memory");
  std::uint64_t id = t_owner_id;
  if (id == 0) {
    id = g_next_thread_owner.fetch_add(1, std::memory_order_relaxed) | kThreadOwnerBit;
    t_owner_id = id;
  }
  return id;
}
}  // namespace detail

namespace {

constexpr std::int64_t kStarveNs = 1'000'000;  // Go's starvationThresholdNs
constexpr std::uintptr_t kRetry = 1;    // Waiter::tag: the lock was released, compete again
constexpr std::uintptr_t kHandoff = 2;  // Waiter::tag: you own the lock now
constexpr int kThreadSpins = 64;

// What a waiter tells the unlocker (through Waiter::payload).
struct WaitInfo {
  std::uint64_t owner;
  std::int64_t since_ns;  // when it first queued
};

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Mutex::~Mutex() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Mutex destroyed while a fiber or thread was waiting for it\n");
    std::abort();
  }
}

void Mutex::lock() {
  const std::uint64_t me = detail::caller_owner_id();
  std::uint32_t s = 0;
  if (state_.compare_exchange_strong(s, kLocked, std::memory_order_acquire, std::memory_order_relaxed)) [[likely]] {
    owner_.store(me, std::memory_order_relaxed);
    return;
  }
  lock_slow(me, detail::kNoDeadline);
}

bool Mutex::try_lock() noexcept {
  std::uint32_t s = state_.load(std::memory_order_relaxed);
  while (!(s & (kLocked | kStarving))) {
    if (state_.compare_exchange_weak(s, s | kLocked, std::memory_order_acquire, std::memory_order_relaxed)) {
      owner_.store(detail::caller_owner_id(), std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

bool Mutex::try_lock_until_(detail::Deadline d) {
  if (try_lock()) return true;
  return lock_slow(detail::caller_owner_id(), d);
}

void Mutex::unlock() {
  const std::uint64_t me = detail::caller_owner_id();
  if (!(state_.load(std::memory_order_relaxed) & kLocked)) {
    throw UsageError("fiber::Mutex::unlock: the mutex is not locked");
  }
  if (owner_.load(std::memory_order_relaxed) != me) {
    throw UsageError("fiber::Mutex::unlock: the mutex is held by another fiber or thread, not by the caller");
  }
  owner_.store(0, std::memory_order_relaxed);
  std::uint32_t s = kLocked;
  if (state_.compare_exchange_strong(s, 0, std::memory_order_release, std::memory_order_relaxed)) [[likely]] return;
  unlock_slow();
}

bool Mutex::lock_slow(std::uint64_t me, detail::Deadline deadline) {
  using detail::WakeReason;
  if (owner_.load(std::memory_order_relaxed) == me) {
    throw UsageError("fiber::Mutex::lock: the caller already holds this mutex (fiber::Mutex is not recursive)");
  }
  if (detail::current_fiber() == nullptr) {
    for (int i = 0; i < kThreadSpins; ++i) {
      std::uint32_t s = state_.load(std::memory_order_relaxed);
      if (!(s & (kLocked | kStarving)) &&
          state_.compare_exchange_weak(s, s | kLocked, std::memory_order_acquire, std::memory_order_relaxed)) {
        owner_.store(me, std::memory_order_relaxed);
        return true;
      }
      __builtin_ia32_pause();
    }
  }
  WaitInfo info{me, 0};
  bool woken = false;     // we hold the kWoken token (an unlock woke us)
  bool starving = false;  // we have waited more than kStarveNs and lost a retry
  for (;;) {
    detail::Waiter w;
    w.payload = &info;
    {
      std::lock_guard guard(mu_);
      std::uint32_t s = state_.load(std::memory_order_relaxed);
      for (;;) {
        if (!(s & (kLocked | kStarving))) {
          const std::uint32_t next = (s | kLocked) & ~(woken ? kWoken : 0u);
          if (state_.compare_exchange_weak(s, next, std::memory_order_acquire, std::memory_order_relaxed)) {
            owner_.store(me, std::memory_order_relaxed);
            return true;
          }
          continue;
        }
        if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) {
          if (woken) state_.fetch_and(~kWoken, std::memory_order_relaxed);
          return false;
        }
        std::uint32_t next = s | kWaiters;
        if (woken) next &= ~kWoken;
        if (starving) next |= kStarving;  // s has kLocked here, so kStarving implies kLocked
        if (state_.compare_exchange_weak(s, next, std::memory_order_relaxed)) break;
      }
      if (info.since_ns == 0) info.since_ns = now_ns();
      detail::waiter_prepare(w);
      if (woken) waiters_.push_front(&w); else waiters_.push_back(&w);
    }
    const WakeReason r = deadline == detail::kNoDeadline
                             ? detail::waiter_wait(w, detail::ParkReason::Mutex)
                             : detail::waiter_wait_until(w, detail::ParkReason::Mutex, deadline);
    if (r == WakeReason::Notified) {
      if (w.tag == kHandoff) return true;  // the unlocker made us the owner
      woken = true;
      starving = starving || now_ns() - info.since_ns > kStarveNs;
      continue;
    }
    {
      std::lock_guard guard(mu_);
      waiters_.remove_if_queued(&w);
      if (waiters_.empty()) state_.fetch_and(~(kWaiters | kStarving), std::memory_order_relaxed);
    }
    if (r == WakeReason::Cancelled) throw Cancelled();
    return false;
  }
}

void Mutex::unlock_slow() noexcept {
  detail::Waiter* wake = nullptr;
  {
    std::lock_guard guard(mu_);
    if (state_.load(std::memory_order_relaxed) & kStarving) {
      while (detail::Waiter* w = waiters_.pop_front()) {
        if (detail::waiter_claim(*w, detail::WakeReason::Notified)) {
          wake = w;
          break;
        }
      }
      if (wake != nullptr) {
        // Hand over: kLocked stays set; the critical sections are ordered by claim and wake.
        const WaitInfo* info = static_cast<const WaitInfo*>(wake->payload);
        owner_.store(info->owner, std::memory_order_relaxed);
        wake->tag = kHandoff;
        if (waiters_.empty()) {
          state_.fetch_and(~(kWaiters | kStarving), std::memory_order_relaxed);
        } else if (now_ns() - info->since_ns < kStarveNs) {
          state_.fetch_and(~kStarving, std::memory_order_relaxed);
        }
      } else {
        state_.fetch_and(~(kLocked | kWaiters | kStarving), std::memory_order_release);
      }
    } else {
      const std::uint32_t s = state_.fetch_and(~kLocked, std::memory_order_release);
      if ((s & kWaiters) && !(s & kWoken)) {
        while (detail::Waiter* w = waiters_.pop_front()) {
          if (detail::waiter_claim(*w, detail::WakeReason::Notified)) {
            wake = w;
            wake->tag = kRetry;
            state_.fetch_or(kWoken, std::memory_order_relaxed);
            break;
          }
        }
        if (waiters_.empty()) state_.fetch_and(~kWaiters, std::memory_order_relaxed);
      }
    }
  }
  if (wake != nullptr) detail::waiter_wake(*wake);
}

}  // namespace fiber
