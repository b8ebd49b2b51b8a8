// Barrier: arrivals counted under a SpinLock; the completing arrival claims every waiter of the
// phase under the lock and wakes them after it (see fiber/barrier.hpp).
#include "fiber/barrier.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "fiber/error.hpp"

namespace fiber {

namespace {
void wake_all(detail::WaitQueue& woken) noexcept {
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}
}  // namespace

Barrier::Barrier(std::int64_t participants) : expected_(participants) {
  if (participants < 1) throw UsageError("fiber::Barrier: need at least one participant, got " + std::to_string(participants));
}

Barrier::~Barrier() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Barrier destroyed while a fiber or thread was waiting on it\n");
    std::abort();
  }
}

void Barrier::complete_phase(detail::WaitQueue& woken) noexcept {
  ++phase_;
  arrived_ = 0;
  while (detail::Waiter* w = waiters_.pop_front()) {
    if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
  }
}

bool Barrier::arrive_and_wait() {
  detail::Waiter w;
  detail::WaitQueue woken;
  bool completed = false;
  {
    std::lock_guard guard(mu_);
    if (expected_ == 0) throw UsageError("fiber::Barrier::arrive_and_wait: every participant has dropped out");
    completed = ++arrived_ >= expected_;
    if (completed) {
      complete_phase(woken);
    } else {
      detail::waiter_prepare(w);
      waiters_.push_back(&w);
    }
  }
  if (completed) {
    wake_all(woken);
    return true;
  }
  const detail::WakeReason r = detail::waiter_wait(w, detail::ParkReason::Barrier);
  if (r == detail::WakeReason::Notified) return false;
  {
    std::lock_guard guard(mu_);
    // Still queued: the phase has not completed (completion unqueues everyone), so take our
    // arrival back.
    if (waiters_.contains(&w)) {
      waiters_.remove(&w);
      --arrived_;
    }
  }
  throw Cancelled();
}

bool Barrier::arrive_and_drop() {
  detail::WaitQueue woken;
  bool completed = false;
  {
    std::lock_guard guard(mu_);
    if (expected_ == 0) throw UsageError("fiber::Barrier::arrive_and_drop: every participant has dropped out");
    --expected_;
    completed = arrived_ >= expected_;
    if (completed) complete_phase(woken);
  }
  wake_all(woken);
  return completed;
}

std::uint64_t Barrier::phase() const noexcept {
  std::lock_guard guard(mu_);
  return phase_;
}

}  // namespace fiber
