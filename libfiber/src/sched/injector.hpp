// Injector: a scheduler's global run queue. Spawns and wakes from outside the scheduler's
// processors land here, as do local-queue overflows. A mutex-protected intrusive list with an
// atomic length so the empty check on the hot path takes no lock (Tokio's Inject).
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

#include "sched/fiber.hpp"

namespace fiber::detail {

class Injector {
 public:
  // Cheap, racy emptiness hint. Stored under the lock; loaded with acquire so that a processor
  // that sees len > 0 and then takes the lock finds the fibers.
  bool empty() const noexcept { return len_.load(std::memory_order_acquire) == 0; }
  std::size_t len() const noexcept { return len_.load(std::memory_order_acquire); }

  void push(Fiber* f) noexcept {
    f->next = nullptr;
    push_batch(f, f, 1);
  }
  // A batch linked through next, last->next == nullptr.
  void push_batch(Fiber* first, Fiber* last, std::size_t n) noexcept {
    std::lock_guard lock(mu_);
    last->next = nullptr;
    if (tail_) tail_->next = first; else head_ = first;
    tail_ = last;
    len_.store(len_.load(std::memory_order_relaxed) + n, std::memory_order_release);
  }
  Fiber* pop() noexcept {
    if (empty()) return nullptr;
    std::lock_guard lock(mu_);
    return pop_locked();
  }
  // Pops up to `max` fibers; returns the first, links the rest through next (count in *n).
  Fiber* pop_batch(std::size_t max, std::size_t* n) noexcept {
    *n = 0;
    if (empty() || max == 0) return nullptr;
    std::lock_guard lock(mu_);
    Fiber* first = head_;
    Fiber* last = nullptr;
    std::size_t k = 0;
    for (Fiber* f = head_; f && k < max; f = f->next) {
      last = f;
      ++k;
    }
    if (k == 0) return nullptr;
    head_ = last->next;
    if (!head_) tail_ = nullptr;
    last->next = nullptr;
    len_.store(len_.load(std::memory_order_relaxed) - k, std::memory_order_release);
    *n = k;
    return first;
  }

 private:
  Fiber* pop_locked() noexcept {
    Fiber* f = head_;
    if (!f) return nullptr;
    head_ = f->next;
    if (!head_) tail_ = nullptr;
    f->next = nullptr;
    len_.store(len_.load(std::memory_order_relaxed) - 1, std::memory_order_release);
    return f;
  }

  std::mutex mu_;
  Fiber* head_ = nullptr;  // GUARDED_BY(mu_)
  Fiber* tail_ = nullptr;  // GUARDED_BY(mu_)
  std::atomic<std::size_t> len_{0};  // written under mu_
};

}  // namespace fiber::detail
