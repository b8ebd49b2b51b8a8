// A processor's timers: a binary min-heap of entries that live on the waiting fibers' stacks.
//
// Only the owning processor adds entries and fires them (the watchdog's monitor fires them for an
// owner that is stalled); any thread may remove one (a fiber woken by a peer removes its timer
// after it resumes, wherever it resumes). The heap is guarded by a spinlock held for O(log n)
// steps (amortised: an add may grow the vector), never across a switch. Firing claims the
// entry's waiter with WakeReason::Timeout under the lock, so a fiber that resumes for another
// reason and then removes its entry can never race with a firing that still reads it.
//
// A burst of timers (a million sleepers on one processor) grows the heap to 8 MB. A heap that
// drains to empty with room for more than kKeptCapacity entries gives all of it back, freed
// after the lock is released (a free may unmap); a heap within that bound keeps its storage, so
// loads of up to kKeptCapacity timers per processor never reallocate. A larger burst grows it
// again from nothing each time: about log2(burst) reallocations, each copying what the heap
// holds, which costs little beside the burst's own adds.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "fiber/detail/wait.hpp"

namespace fiber::detail {

class TimerQueue;

struct TimerEntry {
  int64_t deadline_ns = 0;  // steady clock
  uint64_t seq = 0;         // FIFO among equal deadlines
  Waiter* waiter = nullptr;
  TimerQueue* queue = nullptr;  // where it was added (the fiber may resume elsewhere)
  std::size_t index = kNotQueued;  // position in the heap, GUARDED_BY(queue->mu_)
  static constexpr std::size_t kNotQueued = std::numeric_limits<std::size_t>::max();
};

int64_t steady_now_ns() noexcept;

class TimerQueue {
 public:
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  // fire_expired() claims at most this many at a time under the lock (its buffer is on the
  // caller's stack, possibly a fiber's), and wakes them before it claims more.
  static constexpr std::size_t kFireBatch = 16;
  // The most storage (in entries; 512 KiB) an empty heap keeps.
  static constexpr std::size_t kKeptCapacity = 65536;

  // Executed only by the owner processor.
  void add(TimerEntry* e);
  // Any thread. No-op if the entry already fired or was removed.
  void remove(TimerEntry* e) noexcept;
  // Earliest deadline, or kNone. Racy read for the owner's wait timeout.
  int64_t next_deadline() const noexcept { return next_.load(std::memory_order_acquire); }
  // The owner, or the monitor for a stalled owner (Monitor::rescue): fires the entries due at
  // `now`, earliest first (FIFO among equal deadlines), all of them or at most `max` entries;
  // returns how many woke a waiter (an entry whose waiter a peer claimed first wakes none).
  std::size_t fire_expired(int64_t now, std::size_t max = std::numeric_limits<std::size_t>::max()) noexcept;
  std::size_t size() const noexcept;
  // Entries the heap has room for without growing (tests: storage is given back).
  std::size_t capacity() const noexcept;

 private:
  bool less(const TimerEntry* a, const TimerEntry* b) const noexcept {
    return a->deadline_ns < b->deadline_ns || (a->deadline_ns == b->deadline_ns && a->seq < b->seq);
  }
  void sift_up(std::size_t i) noexcept;
  void sift_down(std::size_t i) noexcept;
  void erase_at(std::size_t i) noexcept;
  // Under mu_: the heap's storage if it is empty and larger than kKeptCapacity entries (the
  // heap keeps none), else nothing. The caller frees it once the lock is released.
  std::vector<TimerEntry*> take_excess_storage() noexcept {
    if (!heap_.empty() || heap_.capacity() <= kKeptCapacity) return {};
    return std::exchange(heap_, {});
  }
  void publish_next() noexcept {
    next_.store(heap_.empty() ? kNone : heap_[0]->deadline_ns, std::memory_order_release);
  }

  mutable SpinLock mu_;
  std::vector<TimerEntry*> heap_;  // GUARDED_BY(mu_)
  uint64_t seq_ = 0;               // GUARDED_BY(mu_)
  std::atomic<int64_t> next_{kNone};  // heap_[0]'s deadline; stored under mu_
};

}  // namespace fiber::detail
