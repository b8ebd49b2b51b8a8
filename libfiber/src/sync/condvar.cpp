// CondVar: a FIFO of Waiters under a SpinLock (see fiber/condvar.hpp).
//
// The waiter is prepared and queued before the caller's lock is released (enqueue), then parks
// (park); a notifier pops and claims under mu_ and wakes after unlocking it. A waiter whose wait
// ended by timeout or cancel withdraws under mu_; a notifier that popped it first found its
// claim failing and moved on to the next waiter, so no notify_one is swallowed by a timeout.
#include "fiber/condvar.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace fiber {

CondVar::~CondVar() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::CondVar destroyed while a fiber or thread was waiting on it\n");
    std::abort();
  }
}

void CondVar::notify_one() noexcept {
  detail::Waiter* wake = nullptr;
  {
    std::lock_guard guard(mu_);
    while (detail::Waiter* w = waiters_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) {
        wake = w;
        break;
      }
    }
  }
  if (wake) detail::waiter_wake(*wake);
}

void CondVar::notify_all() noexcept {
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    while (detail::Waiter* w = waiters_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
    }
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

void CondVar::enqueue(detail::Waiter& w) noexcept {
  std::lock_guard guard(mu_);
  detail::waiter_prepare(w);
  waiters_.push_back(&w);
}

detail::WakeReason CondVar::park(detail::Waiter& w, detail::Deadline d) noexcept {
  const detail::WakeReason r = d == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::CondVar)
                                   : detail::waiter_wait_until(w, detail::ParkReason::CondVar, d);
  if (r != detail::WakeReason::Notified) {
    std::lock_guard guard(mu_);
    waiters_.remove_if_queued(&w);
  }
  return r;
}

// The caller's unlock() threw after `w` became visible: end the wait without parking for long.
void CondVar::abandon(detail::Waiter& w) noexcept {
  const bool self = detail::waiter_claim(w, detail::WakeReason::Notified);
  if (self) detail::waiter_wake(w);  // we claimed our own wait: nobody else will wake it
  const detail::WakeReason r = detail::waiter_wait(w, detail::ParkReason::CondVar);  // returns at once (or after the claimer's wake)
  {
    std::lock_guard guard(mu_);
    waiters_.remove_if_queued(&w);
  }
  if (!self && r == detail::WakeReason::Notified) notify_one();  // pass a notify we consumed on
}

}  // namespace fiber
