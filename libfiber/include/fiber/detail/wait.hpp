// Internal: the one parking primitive every blocking operation is built on. Public only because
// templates (Channel<T>, ...) use it; not part of the API. See libfiber/README.md, "Parking".
//
// A Waiter is a wait record on the waiting side's stack. It names who waits: a fiber (which is
// parked) or a plain thread (which blocks). Wakers race to claim it with one CAS; exactly one
// wins and wakes the waiter, the losers do nothing (the single-waker rule). Timeouts,
// cancellation and peers all claim through the same CAS, so each wait ends exactly once.
//
// For a fiber the claim word lives in the fiber's control block and carries a generation that
// changes with every wait, so a late claim on a finished wait fails harmlessly; for a thread it
// lives in the record itself.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <type_traits>

#include "fiber/config.hpp"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace fiber::detail {

struct Fiber;
struct ThreadParker;

enum class WakeReason : uint8_t {
  Pending = 0,    // not yet claimed
  Notified = 1,   // a peer woke it
  Timeout = 2,    // its deadline passed
  Cancelled = 3,  // its fiber was cancelled (or its scheduler stopped)
};

// Why a fiber is parked; a debugger prints it (fiber dump, gdb extension).
enum class ParkReason : uint8_t {
  None = 0,
  Yield,
  Join,
  Sleep,
  BlockOn,
  WaitGroup,
  Channel,
  Select,
  Mutex,
  RWMutex,
  CondVar,
  Semaphore,
  Latch,
  Barrier,
  Once,
  IO,
  Blocking,
};
FIBER_API const char* park_reason_name(ParkReason r) noexcept;

struct Waiter {
  Fiber* fiber = nullptr;          // the waiting fiber, or nullptr for a thread
  ThreadParker* parker = nullptr;  // the waiting thread's parker (fiber == nullptr)
  uint64_t gen = 0;                // fiber: the wait generation this record belongs to
  // thread: WakeReason, claimed with one CAS; kClaimBusy is set between claim and wake.
  std::atomic<uint8_t> state{0};
  static constexpr uint8_t kClaimBusy = 0x80;
  // Intrusive links for WaitQueue; owned by whoever holds the queue's lock.
  Waiter* next = nullptr;
  Waiter* prev = nullptr;
  // Free for the primitive: a value slot, a select case index, ...
  void* payload = nullptr;
  uintptr_t tag = 0;
};

// Binds `w` to the calling fiber (starting a new wait generation) or thread. Must precede making
// `w` visible to wakers.
FIBER_API void waiter_prepare(Waiter& w) noexcept;
// The same for a wait that cancellation does not end: fiber_cancel does not claim it and a
// pending cancel does not cut it short (the cancel bit stays set for the next ordinary wait).
// For waits that must outlast a cancel, such as a completion that still refers to the stack.
// Timeouts and peers claim it as usual. Threads: the same as waiter_prepare.
FIBER_API void waiter_prepare_shielded(Waiter& w) noexcept;
// Parks until `w` is claimed, or its deadline passes (then claims it as Timeout itself).
// Returns the reason it was claimed with. A cancelled fiber returns Cancelled at once.
FIBER_API WakeReason waiter_wait(Waiter& w, ParkReason why) noexcept;
FIBER_API WakeReason waiter_wait_until(Waiter& w, ParkReason why, std::chrono::steady_clock::time_point deadline) noexcept;
// Claiming and waking are two steps so a waker can hand over a value between them:
//   if (waiter_claim(w, Notified)) { *slot_of(w) = value; waiter_wake(w); }
// After a successful claim the waiter cannot resume until waiter_wake(); after waiter_wake()
// the record may be gone and must not be touched.
FIBER_API bool waiter_claim(Waiter& w, WakeReason reason) noexcept;
FIBER_API void waiter_wake(Waiter& w) noexcept;
// claim + wake. False if someone else claimed it first.
inline bool waiter_notify(Waiter& w, WakeReason reason = WakeReason::Notified) noexcept {
  if (!waiter_claim(w, reason)) return false;
  waiter_wake(w);
  return true;
}
// The reason `w` was claimed with, or Pending.
FIBER_API WakeReason waiter_state(const Waiter& w) noexcept;

// Deadlines of timed waits, on the steady clock. Deadline::max() means "no deadline".
using Deadline = std::chrono::steady_clock::time_point;
inline constexpr Deadline kNoDeadline = Deadline::max();

// How far a timed wait may reach: beyond it, a deadline is none. 100 years, well inside the
// ~292 years either side of its epoch that the steady clock's nanoseconds hold.
inline constexpr std::chrono::hours kFarDeadline{24 * 365 * 100};

// now + d, saturating: d <= 0 (or NaN) gives now (already expired), d beyond kFarDeadline gives
// kNoDeadline. So sleep_for(hours::max()) sleeps for ever rather than overflow. The comparison
// is made in seconds as a double, which no unit overflows (100 years in picoseconds would);
// below about 115 days the sum is exact, beyond that it goes through the double too (a
// microsecond or so off), where converting some units' counts to nanoseconds could overflow.
template <typename Rep, typename Period>
Deadline deadline_after(std::chrono::duration<Rep, Period> d) noexcept {
  using Seconds = std::chrono::duration<double>;
  using Ns = std::chrono::steady_clock::duration;
  const Deadline now = std::chrono::steady_clock::now();
  if (!(d > d.zero())) return now;
  const double secs = Seconds(d).count();
  if (secs >= Seconds(kFarDeadline).count()) return kNoDeadline;
  if (secs < 1e7) return now + std::chrono::ceil<Ns>(d);
  return now + Ns(static_cast<Ns::rep>(secs * 1e9) + 1);
}
// A time point of any clock as a steady-clock deadline (other clocks: by the time left now),
// saturating as deadline_after does. A far time point (max(), min(), a date hundreds of years
// out in seconds or hours) overflows when converted to nanoseconds, and so does any comparison
// that converts to a common unit; so doubles decide first whether it is that far, and only time
// points within kFarDeadline are compared and converted exactly.
template <typename Clock, typename Duration>
Deadline to_deadline(const std::chrono::time_point<Clock, Duration>& tp) noexcept {
  using Seconds = std::chrono::duration<double>;
  constexpr double kFar = Seconds(kFarDeadline).count();
  const double at = Seconds(tp.time_since_epoch()).count();
  if constexpr (std::is_same_v<Clock, std::chrono::steady_clock>) {
    // The steady clock's epoch is about the boot: nothing before it is ahead, and no uptime
    // comes near kFar.
    if (!(at > 0)) return Deadline{};  // expired (and NaN)
    if (at >= kFar) return kNoDeadline;
    return std::chrono::ceil<std::chrono::steady_clock::duration>(tp);
  } else {
    const auto now = Clock::now();
    const double ahead = at - Seconds(now.time_since_epoch()).count();
    if (!(ahead > -kFar)) return std::chrono::steady_clock::now();  // long past (and NaN)
    if (ahead >= kFar) return kNoDeadline;
    // Within kFar of each other: exact from here. (The doubles are ~0.2 us apart at today's
    // dates, so they must not decide whether tp has passed: with an unsigned Rep a tp just
    // past would make tp - now wrap.)
    if (tp <= now) return std::chrono::steady_clock::now();
    return deadline_after(tp - now);
  }
}

// Marks the calling thread's processor (none on a plain thread: no effect) as waiting for
// another thread to finish a few instructions it was preempted in, for the watchdog: such a
// processor is not running its fiber's code, whatever CPU time the yields cost. Not nested.
FIBER_API void spin_wait_begin() noexcept;
FIBER_API void spin_wait_end() noexcept;

// Waits until done() for something another thread finishes in a few instructions: spins
// briefly; past that the thread was probably preempted (more threads than cores), so gives it
// the CPU rather than burn our time slice, and tells the watchdog so (spin_wait_begin).
template <typename Done>
void spin_until(Done done) noexcept {
  for (int spins = 0; spins < 128; ++spins) {
    if (done()) return;
    __builtin_ia32_pause();
  }
  if (done()) return;
  spin_wait_begin();
  do {
    sched_yield();
  } while (!done());
  spin_wait_end();
}

// A tiny spinlock for wait-queue state: held for a few instructions, never across a switch.
class SpinLock {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      spin_until([this] { return !locked_.load(std::memory_order_relaxed); });
    }
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// A SpinLock that the one thread which takes it again and again takes with plain loads and
// stores, no locked instruction: a channel's lock is taken four times per round trip of a
// ping-pong on one processor, and its exchanges were 8% of that round trip (70.6 ns to 64.9).
//
// It starts as a SpinLock (every lock an exchange on locked_). A thread that takes it
// kBiasAfter times in a row (no other thread between) makes it biased to itself: owner_ names
// that thread, which from then on enters by announcing itself in busy_. The first other thread
// to take it (after the exchange on locked_, which the owner no longer takes) revokes the bias
// for good, so a lock costs a revocation at most once in its life:
//
//   owner, each lock:  busy_ = true; compiler barrier; owner_ still us? enter : busy_ = false,
//                      take locked_; unlock: busy_ = false (release)
//   revoker, once:     (holding locked_) owner_ = kRevoked; membarrier (a full barrier on every
//                      running thread); wait until !busy_
//
// The store-buffering pattern of sched/owner_slot.hpp, with the owner-side fence supplied by
// the membarrier: either the owner's busy_ = true is visible after it, so the revoker waits
// for that critical section to end (release/acquire on busy_), or the owner's later load sees
// kRevoked and it takes locked_ like everyone else. Without membarrier(2) nothing is biased.
// Every cross-thread order above is carried by the atomics owner_, busy_ and locked_, with the
// memory orders stated where they are used. A thread is told apart by its thread pointer
// (%fs:0, glibc's TCB), which is no shared data and synchronises nothing: it only has to be
// this thread's, read afresh on every lock (invariant 3: a fiber may have moved threads since
// its last call). The asm's memory clobber makes it a compiler barrier, so the compiler neither
// reuses the value nor moves the read across the call in which the fiber switched (5
// instructions per pingpong_1t round trip).
//
// Invariants: owner_ goes kUnbiased -> a thread (by that thread, holding locked_) -> kRevoked
// (by another, holding locked_), never back; no thread token equals either sentinel; no two
// critical sections overlap (the revoker holds locked_ while it waits out the owner's last);
// held_plain_ is true exactly while the owner is in a plain section. The same contract as
// SpinLock: held for a few instructions, never across a switch.
class BiasedLock {
 public:
  void lock() noexcept {
    const uintptr_t me = thread_token();
    if (owner_.load(std::memory_order_relaxed) == me) [[likely]] {
      busy_.store(true, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the revoker's membarrier is the fence
      if (owner_.load(std::memory_order_relaxed) == me) [[likely]] {
        held_plain_ = true;
        tsan_acquire();
        return;
      }
      busy_.store(false, std::memory_order_release);
    }
    lock_slow(me);
  }
  void unlock() noexcept {
    if (held_plain_) [[likely]] {
      held_plain_ = false;
      tsan_release();
      busy_.store(false, std::memory_order_release);  // pairs with the revoker's wait
      return;
    }
    locked_.unlock();
  }
  // Different on each live thread, and never kUnbiased or kRevoked; 0 on every thread off
  // x86-64 (then nothing is biased: lock_slow() never makes 0 the owner).
  static uintptr_t thread_token() noexcept {
    uintptr_t t = 0;
#if defined(__x86_64__)
    asm volatile("mov %%fs:0, %0" : "=r"(t) : : "memory");
#endif
    return t;
  }
  static constexpr uint32_t kBiasAfter = 64;
  // Snapshots, for tests and debugging: biased to some thread now; revoked (for good).
  bool biased() const noexcept {
    const uintptr_t o = owner_.load(std::memory_order_acquire);
    return o != kUnbiased && o != kRevoked;
  }
  bool revoked() const noexcept { return owner_.load(std::memory_order_acquire) == kRevoked; }

 private:
  // owner_'s sentinels: thread pointers are aligned, so neither is one.
  static constexpr uintptr_t kRevoked = 1;
  static constexpr uintptr_t kUnbiased = 2;
  FIBER_API void lock_slow(uintptr_t me) noexcept;
  // For TSan, the owner's plain sections are a mutex's: a thread that reuses a dead owner's
  // thread pointer (glibc's stack cache) inherits the bias, ordered after the owner's last
  // section by glibc's stack-cache lock, which TSan does not see. The revoker's side needs no
  // annotation: its acquire of busy_ is a real one, which TSan checks.
#if defined(__SANITIZE_THREAD__)
  void tsan_acquire() noexcept { __tsan_acquire(&busy_); }
  void tsan_release() noexcept { __tsan_release(&busy_); }
#else
  void tsan_acquire() noexcept {}
  void tsan_release() noexcept {}
#endif

  std::atomic<uintptr_t> owner_{kUnbiased};  // see the invariants
  SpinLock locked_;                  // what everyone but the owner takes
  std::atomic<bool> busy_{false};    // owner-written: in (or entering) a plain section
  bool held_plain_ = false;          // GUARDED_BY(this): the holder entered without locked_
  uint32_t streak_ = 0;              // GUARDED_BY(locked_): locks in a row by last_
  uintptr_t last_ = 0;               // GUARDED_BY(locked_)
};

// An intrusive FIFO of Waiters. Not thread-safe itself: the owning primitive's lock guards it.
class WaitQueue {
 public:
  bool empty() const noexcept { return head_ == nullptr; }
  Waiter* front() const noexcept { return head_; }
  void push_back(Waiter* w) noexcept {
    w->next = nullptr;
    w->prev = tail_;
    if (tail_) tail_->next = w; else head_ = w;
    tail_ = w;
  }
  // For a waiter that keeps its place (a woken mutex waiter that lost the race goes back first).
  void push_front(Waiter* w) noexcept {
    w->prev = nullptr;
    w->next = head_;
    if (head_) head_->prev = w; else tail_ = w;
    head_ = w;
  }
  void remove(Waiter* w) noexcept {
    if (w->prev) w->prev->next = w->next; else head_ = w->next;
    if (w->next) w->next->prev = w->prev; else tail_ = w->prev;
    w->next = w->prev = nullptr;
  }
  // True while `w` is linked in this queue (a popped waiter has no prev and is not the head).
  bool contains(const Waiter* w) const noexcept { return w->prev != nullptr || head_ == w; }
  // For a waiter whose wait ended by timeout or cancel: unlink it if no waker popped it yet.
  void remove_if_queued(Waiter* w) noexcept {
    if (contains(w)) remove(w);
  }
  Waiter* pop_front() noexcept {
    Waiter* w = head_;
    if (w) remove(w);
    return w;
  }
  // Wakes and removes the first waiter that can still be claimed; skips (and removes) stale
  // ones whose wait already ended (timed out, cancelled). False if none was woken.
  bool notify_one(WakeReason reason = WakeReason::Notified) noexcept {
    while (Waiter* w = pop_front()) {
      if (waiter_notify(*w, reason)) return true;
    }
    return false;
  }
  std::size_t notify_all(WakeReason reason = WakeReason::Notified) noexcept {
    std::size_t n = 0;
    while (Waiter* w = pop_front()) n += waiter_notify(*w, reason) ? 1 : 0;
    return n;
  }

 private:
  Waiter* head_ = nullptr;
  Waiter* tail_ = nullptr;
};

}  // namespace fiber::detail
