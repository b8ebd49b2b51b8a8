#include "fiber/waitgroup.hpp"

#include <string>

#include "fiber/error.hpp"

namespace fiber {

namespace {

// cur + delta, or a UsageError if that is negative or beyond the counter's range.
std::int64_t checked_sum(std::int64_t cur, std::int64_t delta) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(cur, delta, &sum)) {
    throw UsageError("fiber::WaitGroup::add: the counter would overflow (" + std::to_string(cur) + " + " +
                     std::to_string(delta) + ")");
  }
  if (sum < 0) {
    throw UsageError("fiber::WaitGroup::add: the counter would become negative (" + std::to_string(cur) + " + " +
                     std::to_string(delta) + ")");
  }
  return sum;
}

}  // namespace

// The counter reaches zero only under mu_, and a waiter reads zero only under mu_: a waiter that
// sees zero and returns (and may destroy the WaitGroup, as in the header's example) knows the
// add() that got there has released the lock and will not touch the object again. Changes that
// leave the counter above zero stay lock-free.
void WaitGroup::add(std::int64_t delta) {
  std::int64_t cur = count_.load(std::memory_order_relaxed);
  for (;;) {
    const std::int64_t now = checked_sum(cur, delta);
    if (now == 0) break;  // only under the lock, below
    // A CAS loop, not fetch_add-then-undo: a transient negative value would make a concurrent
    // done() fail spuriously.
    if (count_.compare_exchange_weak(cur, now, std::memory_order_acq_rel, std::memory_order_relaxed)) return;
  }
  detail::WaitQueue woken;
  {
    std::lock_guard lock(mu_);
    cur = count_.load(std::memory_order_relaxed);
    std::int64_t now = 0;
    do {
      now = checked_sum(cur, delta);
    } while (!count_.compare_exchange_weak(cur, now, std::memory_order_acq_rel, std::memory_order_relaxed));
    if (now == 0 && delta != 0) {
      // Claim every waiter under the lock; wake them outside it (a claimed waiter cannot return
      // before it is woken, so the object is still alive for that).
      while (detail::Waiter* w = waiters_.pop_front()) {
        if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
      }
    }
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

void WaitGroup::wait() { wait_until_(detail::kNoDeadline); }

bool WaitGroup::wait_until_(detail::Deadline deadline) {
  detail::Waiter w;
  {
    // Zero is read under the lock only (see add()): no unlocked fast path.
    std::lock_guard lock(mu_);
    if (count_.load(std::memory_order_acquire) == 0) return true;
    if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) return false;
    detail::waiter_prepare(w);
    waiters_.push_back(&w);
  }
  const detail::WakeReason r = deadline == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::WaitGroup)
                                   : detail::waiter_wait_until(w, detail::ParkReason::WaitGroup, deadline);
  if (r == detail::WakeReason::Notified) return true;
  {
    std::lock_guard lock(mu_);
    waiters_.remove_if_queued(&w);
  }
  if (r == detail::WakeReason::Cancelled) throw Cancelled();
  return false;
}

}  // namespace fiber
