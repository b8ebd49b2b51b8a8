// Semaphore: a count and a FIFO of Waiters under a SpinLock (see fiber/semaphore.hpp). release()
// hands permits to queued waiters directly (claim under the lock, wake after it); only permits
// left over are added to the count. A Notified wake therefore means "you got a permit".
#include "fiber/semaphore.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "fiber/error.hpp"

namespace fiber {

Semaphore::Semaphore(std::int64_t initial, std::int64_t max) : max_(max), count_(initial) {
  if (max < 1 || initial < 0 || initial > max) {
    throw UsageError("fiber::Semaphore: need 0 <= initial <= max and max >= 1 (got initial " + std::to_string(initial) +
                     ", max " + std::to_string(max) + ")");
  }
}

Semaphore::~Semaphore() {
  if (!waiters_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Semaphore destroyed while a fiber or thread was waiting on it\n");
    std::abort();
  }
}

void Semaphore::acquire() { acquire_until_(detail::kNoDeadline); }

bool Semaphore::try_acquire() noexcept {
  std::lock_guard guard(mu_);
  if (count_ == 0) return false;
  --count_;
  return true;
}

bool Semaphore::acquire_until_(detail::Deadline deadline) {
  detail::Waiter w;
  {
    std::lock_guard guard(mu_);
    if (count_ > 0) {
      --count_;
      return true;
    }
    if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) return false;
    detail::waiter_prepare(w);
    waiters_.push_back(&w);
  }
  const detail::WakeReason r = deadline == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::Semaphore)
                                   : detail::waiter_wait_until(w, detail::ParkReason::Semaphore, deadline);
  if (r == detail::WakeReason::Notified) return true;  // a release handed us its permit
  {
    std::lock_guard guard(mu_);
    waiters_.remove_if_queued(&w);
  }
  if (r == detail::WakeReason::Cancelled) throw Cancelled();
  return false;
}

void Semaphore::release(std::int64_t n) {
  if (n < 0) throw UsageError("fiber::Semaphore::release: negative count " + std::to_string(n));
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    if (n > max_ - count_) {
      throw UsageError("fiber::Semaphore::release: releasing " + std::to_string(n) + " with " + std::to_string(count_) +
                       " available would exceed the maximum of " + std::to_string(max_));
    }
    while (n > 0) {
      detail::Waiter* w = waiters_.pop_front();
      if (w == nullptr) break;
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) {
        woken.push_back(w);
        --n;
      }
    }
    count_ += n;
  }
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}

std::int64_t Semaphore::available() const noexcept {
  std::lock_guard guard(mu_);
  return count_;
}

}  // namespace fiber
