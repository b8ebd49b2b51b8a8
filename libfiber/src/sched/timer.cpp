#include "sched/timer.hpp"

#include <time.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "sched/fiber.hpp"  // current_processor()

namespace fiber::detail {

int64_t steady_now_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void TimerQueue::add(TimerEntry* e) {
  std::lock_guard lock(mu_);
  e->queue = this;
  e->seq = seq_++;
  e->index = heap_.size();
  heap_.push_back(e);
  sift_up(e->index);
  publish_next();
}

void TimerQueue::remove(TimerEntry* e) noexcept {
  std::vector<TimerEntry*> excess;  // destroyed after the lock is released
  std::lock_guard lock(mu_);
  if (e->index == TimerEntry::kNotQueued) return;
  erase_at(e->index);
  publish_next();
  excess = take_excess_storage();
}

std::size_t TimerQueue::fire_expired(int64_t now, std::size_t max) noexcept {
  std::size_t woken = 0;
  std::size_t taken = 0;  // entries removed, woken or not (their waiter claimed elsewhere first)
  // Woken in deadline order. On the processor's thread each wake takes the LIFO slot and pushes
  // the fiber there before it to the back of the run queue, so the earliest is woken last, to
  // hold the slot and run first, with the others queued behind it in order. The monitor, which
  // fires a blocked processor's timers from its own thread, wakes into the global queue, FIFO:
  // there they go in the order they come.
  const bool hold_earliest = current_processor() != nullptr;
  Waiter* earliest = nullptr;
  bool more = next_deadline() <= now;
  while (more && taken < max) {
    // Claim under the lock, wake outside it: a claimed waiter cannot resume until woken, so its
    // record stays valid; an unclaimed (lost) one is never touched after the lock is released.
    // In batches of at most kFireBatch entries, so that the buffer stays small (this runs on
    // fiber stacks too) and remote removers wait behind at most one batch.
    Waiter* claimed[kFireBatch];
    std::size_t n = 0;
    std::vector<TimerEntry*> excess;  // destroyed after the lock is released
    {
      std::lock_guard lock(mu_);
      const std::size_t room = std::min(std::size(claimed), max - taken);
      std::size_t batch = 0;
      while (!heap_.empty() && heap_[0]->deadline_ns <= now && batch < room) {
        TimerEntry* e = heap_[0];
        erase_at(0);
        ++batch;
        if (waiter_claim(*e->waiter, WakeReason::Timeout)) claimed[n++] = e->waiter;
      }
      taken += batch;
      more = batch == room && !heap_.empty() && heap_[0]->deadline_ns <= now;
      publish_next();
      excess = take_excess_storage();
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (hold_earliest && earliest == nullptr) {
        earliest = claimed[i];  // claimed, so its record stays valid until woken
      } else {
        waiter_wake(*claimed[i]);
      }
    }
    woken += n;
  }
  if (earliest != nullptr) waiter_wake(*earliest);
  return woken;
}

std::size_t TimerQueue::size() const noexcept {
  std::lock_guard lock(mu_);
  return heap_.size();
}

std::size_t TimerQueue::capacity() const noexcept {
  std::lock_guard lock(mu_);
  return heap_.capacity();
}

void TimerQueue::sift_up(std::size_t i) noexcept {
  while (i > 0) {
    const std::size_t parent = (i - 1) / 2;
    if (!less(heap_[i], heap_[parent])) break;
    std::swap(heap_[i], heap_[parent]);
    heap_[i]->index = i;
    heap_[parent]->index = parent;
    i = parent;
  }
}

void TimerQueue::sift_down(std::size_t i) noexcept {
  const std::size_t n = heap_.size();
  for (;;) {
    std::size_t best = i;
    const std::size_t l = 2 * i + 1, r = l + 1;
    if (l < n && less(heap_[l], heap_[best])) best = l;
    if (r < n && less(heap_[r], heap_[best])) best = r;
    if (best == i) break;
    std::swap(heap_[i], heap_[best]);
    heap_[i]->index = i;
    heap_[best]->index = best;
    i = best;
  }
}

void TimerQueue::erase_at(std::size_t i) noexcept {
  TimerEntry* gone = heap_[i];
  gone->index = TimerEntry::kNotQueued;
  TimerEntry* last = heap_.back();
  heap_.pop_back();
  if (i == heap_.size()) return;
  heap_[i] = last;
  last->index = i;
  sift_up(i);
  sift_down(last->index);
}

}  // namespace fiber::detail
