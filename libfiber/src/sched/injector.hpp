// Injector: a scheduler's global run queue. Spawns and wakes from outside the scheduler's
// processors land here, as do local-queue overflows (half a ring at a time).
//
// It holds fiber *pointers* in fixed-size segments rather than linking the fibers themselves:
// moving a batch in or out copies pointers and never touches the control blocks, which with a
// million queued fibers are long out of cache. A spinlock guards the segments; an atomic length
// lets the hot path check emptiness without the lock (Tokio's Inject). Under the lock there is
// only copying, and now and then a segment from malloc; a used-up segment is freed after it. A
// mutex made a processor popping here while a spawner pushed (half a ring every 128 fibers) go to
// sleep in the kernel: about 750 times per million fibers at 2 processors, ~17 us each on this
// machine, while the fibers it should have been running piled up (tools/bench spawn, medians
// of five interleaved runs: 66.9 -> 59.9 ns per fiber).
//
// Pushes cannot fail (they are noexcept: a wake has nowhere to report an error). When no segment
// can be had (out of memory), fibers are linked through Fiber::next (a spawn record through its
// own link: queue_link) on a spill list instead, Tokio's way, which needs no memory. Order stays
// FIFO: while the spill list is not empty every push goes there, and pops drain the segments
// first, so the segments only ever hold fibers older than the spill list's.
//
// Segments are 64 KiB. A spawner that never yields (a million `go`s in a loop) sends half its
// ring here at a time, and with 2 KiB segments it took a segment from malloc every 253 fibers,
// under the lock the other processors pop with, the arena growing by an mprotect(2) about every
// second one. With 64 KiB, tools/bench's spawn went from 75 to 69 ns per fiber and spawn_1t from
// 153 to 146 (medians of five interleaved runs, this 2-core VM). An idle scheduler keeps at most
// one spare segment, whose pages are touched only as far as it was ever filled.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>  // std::lock_guard
#include <new>
#include <utility>

#include "sched/fiber.hpp"

namespace fiber::detail {

class Injector {
 public:
  Injector() = default;
  Injector(const Injector&) = delete;
  Injector& operator=(const Injector&) = delete;
  ~Injector() {
    for (Segment* s : {head_, spare_}) {
      while (s != nullptr) delete std::exchange(s, s->next);
    }
  }

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
    std::size_t i = spill_head_ == nullptr ? push_segments(fibers, n) : 0;
    for (; i < n; ++i) {
      Fiber* f = fibers[i];
      queue_link(f) = nullptr;  // a fiber's or a spawn record's (fiber.hpp)
      if (spill_tail_ != nullptr) queue_link(spill_tail_) = f; else spill_head_ = f;
      spill_tail_ = f;
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
    std::size_t n = 0;
    Segment* used_up = nullptr;  // freed once the lock is released
    {
      std::lock_guard lock(mu_);
      while (n < max && head_ != nullptr) {
        Segment& s = *head_;
        const std::size_t k = std::min(max - n, s.end - s.begin);
        std::memcpy(out + n, s.items + s.begin, k * sizeof(Fiber*));
        s.begin += k;
        n += k;
        if (s.begin == s.end) used_up = retire_head(used_up);
      }
      for (; n < max && spill_head_ != nullptr; ++n) {
        Fiber* f = spill_head_;
        spill_head_ = queue_link(f);
        queue_link(f) = nullptr;
        out[n] = f;
      }
      if (spill_head_ == nullptr) spill_tail_ = nullptr;
      len_.store(len_.load(std::memory_order_relaxed) - n, std::memory_order_release);
    }
    while (used_up != nullptr) delete std::exchange(used_up, used_up->next);
    return n;
  }

  // Tests: while positive, each segment the injector would allocate is refused, as when memory
  // has run out (and the count goes down by one). Internal: reachable from tests because they
  // link the static library (fiber_internal); the shared library does not export it.
  static inline std::atomic<int> refuse_segments{0};

  // Fibers a segment holds: with its header (a pointer and two counts), 64 KiB.
  static constexpr std::size_t kSegmentEntries =
      (64 * 1024 - sizeof(void*) - 2 * sizeof(std::size_t)) / sizeof(Fiber*);

 private:
  struct Segment {
    static constexpr std::size_t kSize = kSegmentEntries;
    Segment* next = nullptr;
    std::size_t begin = 0, end = 0;
    Fiber* items[kSize];
  };
  static_assert(sizeof(Segment) == 64 * 1024);

  // Appends to the segments as many of fibers[0, n) as it has room for, taking new segments as
  // needed; returns how many (fewer than n only when no segment can be had). Under mu_.
  std::size_t push_segments(Fiber* const* fibers, std::size_t n) noexcept {
    std::size_t i = 0;
    while (i < n) {
      if (tail_ == nullptr || tail_->end == Segment::kSize) {
        Segment* s = take_segment();
        if (s == nullptr) break;
        if (tail_ != nullptr) tail_->next = s; else head_ = s;
        tail_ = s;
      }
      const std::size_t k = std::min(n - i, Segment::kSize - tail_->end);
      std::memcpy(tail_->items + tail_->end, fibers + i, k * sizeof(Fiber*));
      tail_->end += k;
      i += k;
    }
    return i;
  }

  // An empty segment: the spare one, or a new one; nullptr when memory has run out. Under mu_.
  Segment* take_segment() noexcept {
    if (Segment* s = std::exchange(spare_, nullptr)) return s;
    int refuse = refuse_segments.load(std::memory_order_relaxed);
    while (refuse > 0 && !refuse_segments.compare_exchange_weak(refuse, refuse - 1, std::memory_order_relaxed)) {
    }
    if (refuse > 0) [[unlikely]] return nullptr;
    return new (std::nothrow) Segment;
  }

  // The head segment is used up: kept as the spare when there is none, else linked onto
  // `to_free` (a burst's segments do not stay allocated); returns that list. Under mu_.
  Segment* retire_head(Segment* to_free) noexcept {
    Segment* s = head_;
    head_ = s->next;
    if (head_ == nullptr) tail_ = nullptr;
    s->begin = s->end = 0;
    if (spare_ == nullptr) {
      s->next = nullptr;
      spare_ = s;
      return to_free;
    }
    s->next = to_free;
    return s;
  }

  SpinLock mu_;
  Segment* head_ = nullptr;   // GUARDED_BY(mu_): oldest segment, popped from
  Segment* tail_ = nullptr;   // GUARDED_BY(mu_): newest, pushed to
  Segment* spare_ = nullptr;  // GUARDED_BY(mu_): one empty segment kept for the next push
  // GUARDED_BY(mu_): fibers pushed when no segment could be had, linked through Fiber::next
  // (free while a fiber is here: it is in no inbox or pinned queue), oldest first.
  Fiber* spill_head_ = nullptr;
  Fiber* spill_tail_ = nullptr;
  std::atomic<std::size_t> len_{0};  // written under mu_
};

}  // namespace fiber::detail
