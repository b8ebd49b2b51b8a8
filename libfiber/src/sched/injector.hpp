// Injector: a scheduler's global run queue. Spawns and wakes from outside the scheduler's
// processors land here, as do local-queue overflows (half a ring at a time).
//
// It holds fiber *pointers* in fixed-size segments rather than linking the fibers themselves:
// moving a batch in or out copies pointers and never touches the control blocks, which with a
// million queued fibers are long out of cache. A mutex guards the segments; an atomic length
// lets the hot path check emptiness without the lock (Tokio's Inject).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>
#include <deque>
#include <mutex>

#include "sched/fiber.hpp"

namespace fiber::detail {

class Injector {
 public:
  // Cheap, racy emptiness hint. Stored under the lock; a processor that sees len > 0 and then
  // takes the lock finds the fibers. Sequentially consistent, for the idle protocol (idle.hpp):
  // a pusher stores the length and then reads the idle counts, a parker updates the counts and
  // then reads the length, and one of the two must see the other - which store-then-load
  // pairs guarantee only when all four are seq_cst. (On x86 the loads cost nothing extra.)
  // The push's store is seq_cst; a pop's store (a shorter length) is a release: no waker
  // depends on seeing it, and any length a parker reads reflects a push ordered before it.
  bool empty() const noexcept { return len_.load(std::memory_order_seq_cst) == 0; }
  std::size_t len() const noexcept { return len_.load(std::memory_order_seq_cst); }

  void push(Fiber* f) noexcept { push_batch(&f, 1); }

  void push_batch(Fiber* const* fibers, std::size_t n) noexcept {
    std::lock_guard lock(mu_);
    for (std::size_t i = 0; i < n;) {
      if (segments_.empty() || segments_.back().end == Segment::kSize) segments_.emplace_back();
      Segment& s = segments_.back();
      const std::size_t k = std::min(n - i, Segment::kSize - s.end);
      std::memcpy(s.items + s.end, fibers + i, k * sizeof(Fiber*));
      s.end += k;
      i += k;
    }
    len_.store(len_.load(std::memory_order_relaxed) + n, std::memory_order_seq_cst);  // see empty()
  }

  Fiber* pop() noexcept {
    Fiber* f = nullptr;
    return pop_batch(&f, 1) ? f : nullptr;
  }

  // Moves up to `max` fibers, oldest first, into out[]; returns how many.
  std::size_t pop_batch(Fiber** out, std::size_t max) noexcept {
    if (empty() || max == 0) return 0;
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    while (n < max && !segments_.empty()) {
      Segment& s = segments_.front();
      const std::size_t k = std::min(max - n, s.end - s.begin);
      std::memcpy(out + n, s.items + s.begin, k * sizeof(Fiber*));
      s.begin += k;
      n += k;
      if (s.begin == s.end) segments_.pop_front();
    }
    len_.store(len_.load(std::memory_order_relaxed) - n, std::memory_order_release);
    return n;
  }

 private:
  struct Segment {
    static constexpr std::size_t kSize = 254;
    std::size_t begin = 0, end = 0;
    Fiber* items[kSize];
  };

  std::mutex mu_;
  std::deque<Segment> segments_;  // GUARDED_BY(mu_)
  std::atomic<std::size_t> len_{0};  // written under mu_
};

}  // namespace fiber::detail
