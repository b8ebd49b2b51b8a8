#include "fiber/waitgroup.hpp"

#include <string>

#include "fiber/error.hpp"

namespace fiber {

void WaitGroup::add(std::int64_t delta) {
  const std::int64_t now = count_.fetch_add(delta, std::memory_order_acq_rel) + delta;
  if (now < 0) {
    count_.fetch_sub(delta, std::memory_order_acq_rel);
    throw UsageError("fiber::WaitGroup::add: the counter would become negative (" + std::to_string(now) + ")");
  }
  if (now != 0 || delta == 0) return;
  // Claim every waiter under the lock; wake them outside it.
  detail::WaitQueue woken;
  {
    std::lock_guard lock(mu_);
    while (detail::Waiter* w = waiters_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
    }
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

void WaitGroup::wait() {
  if (count_.load(std::memory_order_acquire) == 0) return;
  detail::Waiter w;
  {
    std::lock_guard lock(mu_);
    // Re-check under the lock: the add() that reaches zero takes the lock after its decrement.
    if (count_.load(std::memory_order_acquire) == 0) return;
    detail::waiter_prepare(w);
    waiters_.push_back(&w);
  }
  if (detail::waiter_wait(w, detail::ParkReason::WaitGroup) == detail::WakeReason::Cancelled) {
    std::lock_guard lock(mu_);
    waiters_.remove_if_queued(&w);
    throw Cancelled();
  }
}

}  // namespace fiber
