// CondVar: a condition variable for fibers and threads (std::condition_variable_any's shape).
//
//   fiber::Mutex mu;
//   fiber::CondVar cv;
//   std::deque<Job> jobs;
//   // consumer
//   std::unique_lock lock(mu);
//   cv.wait(lock, [&] { return !jobs.empty(); });      // parks a fiber, blocks a thread
//   Job j = std::move(jobs.front()); jobs.pop_front();
//   // producer
//   { std::lock_guard g(mu); jobs.push_back(job); }
//   cv.notify_one();
//
// Works with any lock that records whether it is held and whose unlock() neither blocks nor
// takes a lock that some thread may hold while it notifies a CondVar or cancels a fiber:
// unlock() runs while the waiting fiber is still parking, and a notifier on another thread
// waits for that. So std::unique_lock<fiber::Mutex> (the usual one),
// std::unique_lock<fiber::RWMutex>, even std::unique_lock<std::mutex>. Not a bare fiber::Mutex:
// a cancelled fiber's re-lock can throw and leave it unlocked (see below), and a
// std::lock_guard around it would then unlock it again while unwinding, a UsageError in a
// destructor, which terminates. A waiter is queued before the
// lock is released, so a notify issued after the waiter released the lock always reaches it.
//
// Timeouts: a negative duration or a past deadline returns timeout (or the predicate's value)
// at once, without releasing the lock. Cancellation: a cancelled waiting fiber leaves the queue,
// re-takes the lock (if that lock's lock() itself throws Cancelled, as fiber::Mutex's does when
// it has to wait, the lock is not held, which std::unique_lock records) and throws
// fiber::Cancelled. A notify that reached a waiter whose re-lock then throws is passed on to the
// next waiter (one notify_one), never lost. That is the one spurious wakeup: the notify may have
// been a notify_all that the next waiter, queued after it, was not meant to get. Use the
// predicate forms.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <utility>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"
#include "fiber/error.hpp"

namespace fiber {

class FIBER_API CondVar {
 public:
  CondVar() = default;
  ~CondVar();  // a waiter still queued is a fatal error
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Wakes the longest-waiting waiter, if any.
  void notify_one() noexcept;
  // Wakes every current waiter.
  void notify_all() noexcept;

  // Releases lk, waits for a notify, re-takes lk. Throws UsageError if lk is not held,
  // Cancelled.
  template <typename Lock>
  void wait(Lock& lk) {
    wait_impl(lk, detail::kNoDeadline);
  }
  // Waits until pred() holds (checked with lk held).
  template <typename Lock, typename Pred>
  void wait(Lock& lk, Pred pred) {
    while (!pred()) wait(lk);
  }
  // Waits for a notify at most d / until tp: cv_status::timeout if the time ran out.
  template <typename Lock, typename Rep, typename Period>
  std::cv_status wait_for(Lock& lk, std::chrono::duration<Rep, Period> d) {
    return wait_impl(lk, detail::deadline_after(d));
  }
  template <typename Lock, typename Clock, typename Duration>
  std::cv_status wait_until(Lock& lk, const std::chrono::time_point<Clock, Duration>& tp) {
    return wait_impl(lk, detail::to_deadline(tp));
  }
  // Waits until pred() holds, at most d / until tp; returns pred() (false: timed out).
  template <typename Lock, typename Rep, typename Period, typename Pred>
  bool wait_for(Lock& lk, std::chrono::duration<Rep, Period> d, Pred pred) {
    return wait_pred(lk, detail::deadline_after(d), std::move(pred));
  }
  template <typename Lock, typename Clock, typename Duration, typename Pred>
  bool wait_until(Lock& lk, const std::chrono::time_point<Clock, Duration>& tp, Pred pred) {
    return wait_pred(lk, detail::to_deadline(tp), std::move(pred));
  }

 private:
  template <typename Lock, typename Pred>
  bool wait_pred(Lock& lk, detail::Deadline d, Pred pred) {
    while (!pred()) {
      if (wait_impl(lk, d) == std::cv_status::timeout) return pred();
    }
    return true;
  }

  template <typename Lock>
  std::cv_status wait_impl(Lock& lk, detail::Deadline d) {
    if constexpr (requires { lk.owns_lock(); }) {
      if (!lk.owns_lock()) throw UsageError("fiber::CondVar::wait: the lock is not held");
    }
    if (d != detail::kNoDeadline && d <= std::chrono::steady_clock::now()) return std::cv_status::timeout;
    detail::Waiter w;
    enqueue(w);  // from here on a notify reaches us
    try {
      lk.unlock();
    } catch (...) {
      abandon(w);
      throw;
    }
    const detail::WakeReason r = park(w, d);  // withdrawn unless notified
    try {
      lk.lock();
    } catch (...) {
      // Cancelled while re-taking the lock after a notify: that notify_one was meant for a
      // waiter that will now not look at the condition, so hand it to the next one.
      if (r == detail::WakeReason::Notified) notify_one();
      throw;
    }
    if (r == detail::WakeReason::Cancelled) throw Cancelled();
    return r == detail::WakeReason::Timeout ? std::cv_status::timeout : std::cv_status::no_timeout;
  }

  void enqueue(detail::Waiter& w) noexcept;
  detail::WakeReason park(detail::Waiter& w, detail::Deadline d) noexcept;
  void abandon(detail::Waiter& w) noexcept;

  detail::SpinLock mu_;
  detail::WaitQueue waiters_;  // GUARDED_BY(mu_)
};

}  // namespace fiber
