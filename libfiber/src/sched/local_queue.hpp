// LocalQueue: each processor's run queue. A fixed ring, one producer (the owning processor), many
// consumers (the owner popping from the head, and thieves stealing half from the head).
//
// The design follows Tokio's multi-thread queue (seed 002, seed 000 §2):
//
//   head = (steal, real), packed in one 64-bit atomic.
//     real  - the next slot the owner or a thief will claim.
//     steal - the first slot a thief is still copying out; steal == real when no thief is at
//             work. Slots in [steal, real) are reserved by that thief and must not be reused.
//   tail  - the next slot the owner writes. Only the owner stores it.
//
// Length is tail - steal (never more than Capacity), so the owner cannot overwrite slots a thief
// is still copying. Only one thief at a time: a thief that sees steal != real backs off.
//
// Indices are free-running uint32 counters; slots are index & (Capacity - 1).
//
// The single-producer rule is part of the type: LocalQueue is the owner's handle (not copyable,
// owned by the processor) and Stealer is the copyable handle given to everyone else.
#pragma once

#include <atomic>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace fiber::detail {

// The packed head. Wrapped in a value type so the masks are tested in one place.
struct QueueHead {
  uint32_t steal;
  uint32_t real;

  static constexpr QueueHead unpack(uint64_t v) noexcept {
    return {static_cast<uint32_t>(v >> 32), static_cast<uint32_t>(v)};
  }
  constexpr uint64_t pack() const noexcept { return (uint64_t{steal} << 32) | real; }
};
static_assert(QueueHead::unpack(QueueHead{7, 9}.pack()).steal == 7);
static_assert(QueueHead::unpack(QueueHead{7, 9}.pack()).real == 9);
static_assert(QueueHead::unpack(QueueHead{0xffffffffu, 1}.pack()).steal == 0xffffffffu);

// Overflow is any type with `void push_batch(T* const* items, size_t n) noexcept`: a full ring
// hands it half of its slots (oldest first) plus the new item, as an array of pointers, so the
// queued objects themselves are never touched (LocalQueue requires nothing of T). The array is
// only valid during the call. push_batch must not throw: it runs after the head has moved past
// the batch, so an exception would lose those items. push_back_or_overflow static_asserts it.
template <typename Overflow, typename T>
concept NothrowOverflow = requires(Overflow& overflow, T* const* items, std::size_t n) {
  { overflow.push_batch(items, n) } noexcept;
};

template <typename T, uint32_t Capacity = 256>
class LocalQueue {
  static_assert(Capacity >= 2 && (Capacity & (Capacity - 1)) == 0, "capacity must be a power of two");
  static constexpr uint32_t kMask = Capacity - 1;

  struct Inner {
    // Stored by the owner's pop, by thieves (claim and release of a steal) and by the owner's
    // overflow claim, always with a CAS; loaded with acquire so a thief's release CAS (end of
    // steal) happens-before the owner reuses the slots it copied out.
    alignas(64) std::atomic<uint64_t> head{0};
    // Stored only by the owner, with release: publishes the slot written just before it.
    // Loaded with acquire by thieves (synchronises with that store) before they read slots.
    alignas(64) std::atomic<uint32_t> tail{0};
    // Slot contents. Atomic (relaxed) only so that the race checker and the model test see
    // every access; ordering comes from head and tail.
    alignas(64) std::atomic<T*> buffer[Capacity];
    // Used only by the owner's push_overflow, to hand half the ring to the overflow.
    T* overflow_scratch[Capacity / 2 + 1];

    Inner() {
      for (auto& slot : buffer) slot.store(nullptr, std::memory_order_relaxed);
    }
  };

 public:
  class Stealer;

  LocalQueue() : inner_(std::make_unique<Inner>()) {}
  LocalQueue(const LocalQueue&) = delete;
  LocalQueue& operator=(const LocalQueue&) = delete;

  static constexpr uint32_t capacity() noexcept { return Capacity; }

  // Number of fibers queued (owner's view; exact for the owner, a hint for others).
  // Executed only by the owner.
  uint32_t len() const noexcept {
    const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_acquire));
    return inner_->tail.load(std::memory_order_relaxed) - h.real;
  }
  bool has_tasks() const noexcept { return len() != 0; }
  // Free slots the owner may fill without overflowing (counts slots a thief still holds).
  uint32_t remaining_slots() const noexcept {
    const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_acquire));
    return Capacity - (inner_->tail.load(std::memory_order_relaxed) - h.steal);
  }

  // Push at the tail. When the ring is full, half of it plus `task` moves to `overflow` in one
  // batch. Executed only by the owner.
  template <typename Overflow>
  void push_back_or_overflow(T* task, Overflow& overflow) noexcept {
    static_assert(NothrowOverflow<Overflow, T>,
                  "Overflow needs push_batch(T* const*, size_t) noexcept: it runs after the head moved");
    for (;;) {
      const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_acquire));
      const uint32_t tail = inner_->tail.load(std::memory_order_relaxed);  // we are its only writer
      if (tail - h.steal < Capacity) [[likely]] {
        inner_->buffer[tail & kMask].store(task, std::memory_order_relaxed);
        // Synchronises with the acquire load of tail in steal_into2 and in pop.
        inner_->tail.store(tail + 1, std::memory_order_release);
        return;
      }
      if (h.steal != h.real) {
        // Full, and a thief is copying out: it will free room soon; don't wait for it.
        overflow.push_batch(&task, 1);
        return;
      }
      if (push_overflow(task, h.real, tail, overflow)) return;
      // A thief took some of the ring between our load and the CAS: room again, retry.
    }
  }

  // Push the n items of `items` (in order) at the tail; the batch must fit: remaining_slots() >= n.
  // Executed only by the owner.
  void push_back_batch(T* const* items, uint32_t n) noexcept {
    const uint32_t tail = inner_->tail.load(std::memory_order_relaxed);
    for (uint32_t i = 0; i < n; ++i) {
      inner_->buffer[(tail + i) & kMask].store(items[i], std::memory_order_relaxed);
    }
    inner_->tail.store(tail + n, std::memory_order_release);  // as in push_back_or_overflow
  }

  // What pop() would return next, or nullptr: a hint (a thief may take it first), for
  // prefetching. Executed only by the owner.
  T* peek() const noexcept {
    const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_relaxed));
    if (inner_->tail.load(std::memory_order_relaxed) == h.real) return nullptr;
    return inner_->buffer[h.real & kMask].load(std::memory_order_relaxed);
  }

  // Pop from the head. Executed only by the owner.
  T* pop() noexcept {
    uint64_t packed = inner_->head.load(std::memory_order_acquire);
    uint32_t idx;
    for (;;) {
      const QueueHead h = QueueHead::unpack(packed);
      const uint32_t tail = inner_->tail.load(std::memory_order_relaxed);
      if (h.real == tail) return nullptr;
      const uint32_t next_real = h.real + 1;
      // With no thief at work, steal follows real; otherwise only real moves.
      const QueueHead next = h.steal == h.real ? QueueHead{next_real, next_real} : QueueHead{h.steal, next_real};
      // Competes with thieves' claim CAS in steal_into2.
      if (inner_->head.compare_exchange_weak(packed, next.pack(), std::memory_order_acq_rel,
                                             std::memory_order_acquire)) {
        idx = h.real;
        break;
      }
    }
    return inner_->buffer[idx & kMask].load(std::memory_order_relaxed);
  }

  Stealer stealer() const noexcept { return Stealer(inner_.get()); }

  // The copyable handle for thieves. Valid while the owning LocalQueue lives.
  class Stealer {
   public:
    Stealer() = default;

    bool is_empty() const noexcept {
      const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_acquire));
      return inner_->tail.load(std::memory_order_acquire) == h.real;
    }
    uint32_t len() const noexcept {
      const QueueHead h = QueueHead::unpack(inner_->head.load(std::memory_order_acquire));
      return inner_->tail.load(std::memory_order_acquire) - h.real;
    }

    // Steal half of this queue into `dst` (owned by the caller, who must be dst's owner).
    // Returns one of the stolen fibers to run now (the rest are in dst), or nullptr.
    // Any thread may call it on a queue it does not own.
    T* steal_into(LocalQueue& dst) const noexcept {
      Inner& d = *dst.inner_;
      const uint32_t dst_tail = d.tail.load(std::memory_order_relaxed);  // dst's owner is us
      const QueueHead dh = QueueHead::unpack(d.head.load(std::memory_order_acquire));
      // Don't steal into a queue that could not take half of a full one.
      if (dst_tail - dh.steal > Capacity / 2) return nullptr;

      uint32_t n = steal_into2(d, dst_tail);
      if (n == 0) return nullptr;
      // Keep the last one to run; publish the others.
      --n;
      T* ret = d.buffer[(dst_tail + n) & kMask].load(std::memory_order_relaxed);
      if (n != 0) d.tail.store(dst_tail + n, std::memory_order_release);  // as in push_back
      return ret;
    }

   private:
    friend class LocalQueue;
    explicit Stealer(Inner* inner) noexcept : inner_(inner) {}

    uint32_t steal_into2(Inner& d, uint32_t dst_tail) const noexcept {
      Inner& s = *inner_;
      uint64_t prev = s.head.load(std::memory_order_acquire);
      QueueHead claimed;
      uint32_t n;
      for (;;) {
        const QueueHead h = QueueHead::unpack(prev);
        // Synchronises with the owner's release store of tail: slots below it are written.
        const uint32_t src_tail = s.tail.load(std::memory_order_acquire);
        if (h.steal != h.real) return 0;  // another thief is at work
        n = src_tail - h.real;
        n -= n / 2;  // half, rounded up
        if (n == 0) return 0;
        claimed = QueueHead{h.steal, h.real + n};
        // Reserve [steal, real + n): owner pops and other thieves now start past it, and the
        // owner will not overwrite it while steal lags behind.
        if (s.head.compare_exchange_weak(prev, claimed.pack(), std::memory_order_acq_rel,
                                         std::memory_order_acquire)) {
          break;
        }
      }
      for (uint32_t i = 0; i < n; ++i) {
        T* t = s.buffer[(claimed.steal + i) & kMask].load(std::memory_order_relaxed);
        d.buffer[(dst_tail + i) & kMask].store(t, std::memory_order_relaxed);
      }
      // Release the reservation: steal catches up with real (which the owner may have moved).
      // The release half synchronises with the owner's acquire load of head in push.
      prev = claimed.pack();
      for (;;) {
        const QueueHead h = QueueHead::unpack(prev);
        const QueueHead done{h.real, h.real};
        if (s.head.compare_exchange_weak(prev, done.pack(), std::memory_order_acq_rel,
                                         std::memory_order_acquire)) {
          return n;
        }
        assert(QueueHead::unpack(prev).steal != QueueHead::unpack(prev).real);
      }
    }

    Inner* inner_ = nullptr;
  };

 private:
  template <typename Overflow>
  [[gnu::noinline]] bool push_overflow(T* task, uint32_t head, [[maybe_unused]] uint32_t tail, Overflow& overflow) noexcept {
    constexpr uint32_t n = Capacity / 2;
    assert(tail - head == Capacity && "push_overflow: queue is not full");
    const uint64_t prev = QueueHead{head, head}.pack();
    const uint64_t next = QueueHead{head + n, head + n}.pack();
    uint64_t expected = prev;
    // Claim the first half as if popping it. Fails if a thief got there first.
    if (!inner_->head.compare_exchange_strong(expected, next, std::memory_order_release,
                                              std::memory_order_relaxed)) {
      return false;
    }
    // Owner-only scratch space, not a local array: this runs on fiber stacks, which may be
    // compact (2 KiB, no guard page).
    T** batch = inner_->overflow_scratch;
    for (uint32_t i = 0; i < n; ++i) batch[i] = inner_->buffer[(head + i) & kMask].load(std::memory_order_relaxed);
    batch[n] = task;
    overflow.push_batch(batch, n + 1);  // noexcept (checked in push_back_or_overflow)
    return true;
  }

  std::unique_ptr<Inner> inner_;
};

}  // namespace fiber::detail
