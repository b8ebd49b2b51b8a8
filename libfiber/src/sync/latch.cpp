// Latch: a count and a FIFO of Waiters under a SpinLock (see fiber/latch.hpp).
#include "fiber/latch.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "fiber/error.hpp"

namespace fiber {

Latch::Latch(std::int64_t expected) : count_(expected) {
  if (expected < 0) throw UsageError("fiber::Latch: negative count " + std::to_string(expected));
}

Latch::~Latch() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Latch destroyed while a fiber or thread was waiting on it\n");
    std::abort();
  }
}

void Latch::count_down(std::int64_t n) {
  if (n < 0) throw UsageError("fiber::Latch::count_down: negative decrement " + std::to_string(n));
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    if (n > count_) {
      throw UsageError("fiber::Latch::count_down: decrement " + std::to_string(n) + " exceeds the count " +
                       std::to_string(count_));
    }
    count_ -= n;
    if (count_ != 0 || n == 0) return;
    while (detail::Waiter* w = waiters_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) woken.push_back(w);
    }
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

bool Latch::try_wait() const noexcept {
  std::lock_guard guard(mu_);
  return count_ == 0;
}

std::int64_t Latch::count() const noexcept {
  std::lock_guard guard(mu_);
  return count_;
}

void Latch::wait() const { wait_until_(detail::kNoDeadline); }

bool Latch::wait_until_(detail::Deadline deadline) const {
  detail::Waiter w;
  {
    std::lock_guard guard(mu_);
    if (count_ == 0) return true;
    if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) return false;
    detail::waiter_prepare(w);
    waiters_.push_back(&w);
  }
  const detail::WakeReason r = deadline == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::Latch)
                                   : detail::waiter_wait_until(w, detail::ParkReason::Latch, deadline);
  if (r == detail::WakeReason::Notified) return true;
  {
    std::lock_guard guard(mu_);
    waiters_.remove_if_queued(&w);
  }
  if (r == detail::WakeReason::Cancelled) throw Cancelled();
  return false;
}

void Latch::arrive_and_wait(std::int64_t n) {
  count_down(n);
  wait();
}

}  // namespace fiber
