// Once: a three-state word (idle, running, done) and a FIFO of Waiters under a SpinLock (see
// fiber/once.hpp). A finished run - successful or not - wakes every waiter; after a failure
// they race to run it again (enter() lets exactly one of them), the others wait once more.
#include "fiber/once.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "fiber/error.hpp"
#include "sync/owner.hpp"

namespace fiber {

Once::~Once() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Once destroyed while a fiber or thread was waiting on it\n");
    std::abort();
  }
}

bool Once::enter() {
  const std::uint64_t me = detail::caller_owner_id();
  for (;;) {
    detail::Waiter w;
    {
      std::lock_guard guard(mu_);
      const std::uint8_t s = state_.load(std::memory_order_relaxed);
      if (s == kDone) return false;
      if (s == kIdle) {
        state_.store(kRunning, std::memory_order_relaxed);
        runner_ = me;
        return true;
      }
      if (runner_ == me) throw UsageError("fiber::Once::call: called recursively from inside its own function");
      detail::waiter_prepare(w);
      waiters_.push_back(&w);
    }
    if (detail::waiter_wait(w, detail::ParkReason::Once) != detail::WakeReason::Notified) {
      std::lock_guard guard(mu_);
      waiters_.remove_if_queued(&w);
      throw Cancelled();
    }
  }
}

void Once::leave(bool ok) noexcept {
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    state_.store(ok ? kDone : kIdle, std::memory_order_release);
    runner_ = 0;
    while (detail::Waiter* w = waiters_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
    }
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

}  // namespace fiber
