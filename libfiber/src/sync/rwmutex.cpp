// RWMutex: all state under one SpinLock; grants are handed over (see fiber/rwmutex.hpp).
//
// A waiter that is granted the lock is counted as holder by the granter, under mu_, before it
// is woken (readers_ += 1, or writer_ = true), so a Notified wake always means "you hold it".
// dispatch() grants whatever the state allows and runs after every change that can allow more:
//   free (no writer, no reader)   -> the first queued writer;
//   no writer, no writer queued   -> every queued reader.
// A writer's unlock grants the queued readers first (they arrived while it held the lock), so
// alternating phases keep both sides moving. A timed-out or cancelled writer withdraws and calls
// dispatch(): readers queued only because of it must not stay blocked.
#include "fiber/rwmutex.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "fiber/error.hpp"
#include "sync/owner.hpp"

namespace fiber {

namespace {
void wake_all(detail::WaitQueue& woken) noexcept {
  while (detail::Waiter* w = woken.pop_front()) detail::waiter_wake(*w);
}
}  // namespace

RWMutex::~RWMutex() {
  if (!readq_.empty() || !writeq_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::RWMutex destroyed while a fiber or thread was waiting for it\n");
    std::abort();
  }
}

void RWMutex::grant_readers(detail::WaitQueue& woken) noexcept {
  while (detail::Waiter* r = readq_.pop_front()) {
    if (detail::waiter_claim(*r, detail::WakeReason::Notified)) {
      ++readers_;
      woken.push_back(r);
    }
  }
}

void RWMutex::dispatch(detail::WaitQueue& woken) noexcept {
  if (writer_) return;
  if (readers_ == 0) {
    while (detail::Waiter* w = writeq_.pop_front()) {
      if (detail::waiter_claim(*w, detail::WakeReason::Notified)) {
        writer_ = true;
        writer_id_.store(*static_cast<const std::uint64_t*>(w->payload), std::memory_order_relaxed);
        woken.push_back(w);
        return;
      }
    }
  }
  if (writeq_.empty()) grant_readers(woken);
}

void RWMutex::lock() { lock_until_(detail::kNoDeadline); }

bool RWMutex::try_lock() noexcept {
  std::lock_guard guard(mu_);
  if (writer_ || readers_ != 0) return false;
  writer_ = true;
  writer_id_.store(detail::caller_owner_id(), std::memory_order_relaxed);
  return true;
}

bool RWMutex::lock_until_(detail::Deadline deadline) {
  std::uint64_t me = detail::caller_owner_id();
  detail::Waiter w;
  w.payload = &me;
  {
    std::lock_guard guard(mu_);
    if (writer_ && writer_id_.load(std::memory_order_relaxed) == me) {
      throw UsageError("fiber::RWMutex::lock: the caller already holds the write lock (not recursive)");
    }
    if (!writer_ && readers_ == 0) {
      writer_ = true;
      writer_id_.store(me, std::memory_order_relaxed);
      return true;
    }
    if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) return false;
    detail::waiter_prepare(w);
    writeq_.push_back(&w);
  }
  const detail::WakeReason r = deadline == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::RWMutex)
                                   : detail::waiter_wait_until(w, detail::ParkReason::RWMutex, deadline);
  if (r == detail::WakeReason::Notified) return true;  // granted: writer_ and writer_id_ are ours
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    writeq_.remove_if_queued(&w);
    dispatch(woken);
  }
  wake_all(woken);
  if (r == detail::WakeReason::Cancelled) throw Cancelled();
  return false;
}

void RWMutex::unlock() {
  const std::uint64_t me = detail::caller_owner_id();
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    if (!writer_) throw UsageError("fiber::RWMutex::unlock: the write lock is not held");
    if (writer_id_.load(std::memory_order_relaxed) != me) {
      throw UsageError("fiber::RWMutex::unlock: the write lock is held by another fiber or thread, not by the caller");
    }
    writer_ = false;
    writer_id_.store(0, std::memory_order_relaxed);
    grant_readers(woken);
    dispatch(woken);
  }
  wake_all(woken);
}

void RWMutex::lock_shared() { lock_shared_until_(detail::kNoDeadline); }

bool RWMutex::try_lock_shared() noexcept {
  std::lock_guard guard(mu_);
  if (writer_ || !writeq_.empty()) return false;
  ++readers_;
  return true;
}

bool RWMutex::lock_shared_until_(detail::Deadline deadline) {
  detail::Waiter w;
  {
    std::lock_guard guard(mu_);
    if (!writer_ && writeq_.empty()) {
      ++readers_;
      return true;
    }
    if (writer_ && writer_id_.load(std::memory_order_relaxed) == detail::caller_owner_id()) {
      throw UsageError("fiber::RWMutex::lock_shared: the caller holds the write lock (it would deadlock)");
    }
    if (deadline != detail::kNoDeadline && std::chrono::steady_clock::now() >= deadline) return false;
    detail::waiter_prepare(w);
    readq_.push_back(&w);
  }
  const detail::WakeReason r = deadline == detail::kNoDeadline
                                   ? detail::waiter_wait(w, detail::ParkReason::RWMutex)
                                   : detail::waiter_wait_until(w, detail::ParkReason::RWMutex, deadline);
  if (r == detail::WakeReason::Notified) return true;  // granted: counted in readers_
  {
    std::lock_guard guard(mu_);
    readq_.remove_if_queued(&w);
  }
  if (r == detail::WakeReason::Cancelled) throw Cancelled();
  return false;
}

void RWMutex::unlock_shared() {
  detail::WaitQueue woken;
  {
    std::lock_guard guard(mu_);
    if (readers_ == 0) throw UsageError("fiber::RWMutex::unlock_shared: no read lock is held");
    if (--readers_ == 0) dispatch(woken);
  }
  wake_all(woken);
}

}  // namespace fiber
