// Internal: the Waiter operations (fiber/detail/wait.hpp) inline, for the primitives whose every
// operation runs them: a channel ping-pong prepares, claims, waits and wakes once per half round
// trip, and with these inline in channel.cpp (calls, prologues and repeated fiber-or-thread
// tests fewer) pingpong_1t went from 888 to 844 instructions per round trip. wait.cpp defines
// the public functions with them; a thread's side (its parker, the futex) stays out of line
// there, as it ends in a system call anyway.
//
// The contract is wait.hpp's; the protocol is described at the top of wait.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fiber/detail/wait.hpp"
#include "sched/fiber.hpp"
#include "sched/processor.hpp"
#include "sched/runtime.hpp"

namespace fiber::detail {

// wait.cpp: the calling thread's parker (taken from the pool on its first wait); a thread's
// wait until claimed (and, with a deadline in steady_now_ns() time, its timeout); and a
// thread's wake once claimed.
ThreadParker* this_thread_parker();
WakeReason thread_wait(Waiter& w, const int64_t* deadline_ns) noexcept;
void wake_thread_wait(Waiter& w) noexcept;

inline constexpr uint8_t kWaitPending = static_cast<uint8_t>(WakeReason::Pending);

// Claim bias (WakeWord::kBiasBit, sched/claim_gate.hpp). A wait is biased to the processor it
// is made on once the fiber's last kClaimBiasAfter waits were all claimed there (a channel pair,
// a sleep loop, a connection's I/O on its ring); each biased wait claimed from elsewhere anyway
// doubles the streak the next bias takes, and after kMaxClaimRevokes of them the fiber is never
// biased again, so a fiber woken across threads pays at most three membarriers in its life.
inline constexpr uint8_t kClaimBiasAfter = 32;
inline constexpr uint8_t kMaxClaimRevokes = 3;

// Whether `p` (the calling thread's processor, or nullptr) is the one `f` runs on or last ran
// on: for a fiber in a wait, the processor it made the wait on.
[[gnu::always_inline]] inline bool is_wait_processor(const Fiber* f, const Processor* p) noexcept {
  return p != nullptr && f->last_processor.load(std::memory_order_relaxed) == p->index() && f->sched == &p->sched();
}

// wait.cpp: the claim of a biased wait from a thread other than its processor's, behind that
// processor's closed gate (wait_processor_gate, sched/runtime.hpp).
bool claim_biased_elsewhere(Waiter& w, WakeReason reason) noexcept;

// Whether the wait `f` starts now is biased (kClaimBiasAfter), after the last one (`cur`,
// claimed) was not or was claimed elsewhere. Fiber-private state only.
inline bool earn_bias(Fiber* f, uint64_t cur) noexcept {
  if (cur & WakeWord::kLocalBit) {
    f->claim_streak += f->claim_streak != 0xff;
  } else {
    f->claim_streak = 0;
    if ((cur & WakeWord::kBiasBit) && f->claim_revokes < kMaxClaimRevokes) ++f->claim_revokes;
  }
  return f->claim_revokes < kMaxClaimRevokes && f->claim_streak >= (kClaimBiasAfter << f->claim_revokes);
}

// waiter_prepare / waiter_prepare_shielded.
[[gnu::always_inline]] inline void prepare_wait(Waiter& w, bool shielded) noexcept {
  Processor* p = current_processor();
  Fiber* f = p != nullptr ? p->running_fiber() : nullptr;  // current_fiber(), inline
  w.fiber = f;
  w.next = w.prev = nullptr;
  if (f == nullptr) {
    w.parker = this_thread_parker();
    w.state.store(kWaitPending, std::memory_order_relaxed);
    return;
  }
  // Parking first: once the new (gen, Pending) word is published a waker (or a cancel) may claim
  // it and unpark us at once, and unpark requires Parking or Parked. The store (or CAS) below is
  // a release, so whoever reads the new word also sees this one.
  f->state.store(FiberState::Parking, std::memory_order_relaxed);
  // Only this fiber changes the generation. Wakers only claim a Pending wait of the current
  // generation, and the previous wait is no longer Pending (it ended by a claim), so nothing
  // but a cancel's CAS of the cancel bit can write the word now.
  uint64_t cur = f->wake_word.load(std::memory_order_relaxed);
  // What the plain store below rests on: the previous wait ended with a claim. One still Pending
  // could be claimed by a late waker between the load and the store, and that claim's unpark
  // would then wake this wait.
  if ((cur & WakeWord::kReasonMask) == static_cast<uint64_t>(WakeReason::Pending)) [[unlikely]] {
    std::fprintf(stderr, "libfiber: broken invariant: fiber #%llu began a wait while its last one was pending\n",
                 static_cast<unsigned long long>(f->id));
    std::abort();
  }
  uint64_t next;
  if (plain_wait_start()) [[likely]] {
    // A biased wait claimed on its processor keeps the bias; anything else counts towards it
    // (earn_bias).
    constexpr uint64_t kKept = WakeWord::kBiasBit | WakeWord::kLocalBit;
    next = WakeWord::next_wait(cur, shielded, (cur & kKept) == kKept || earn_bias(f, cur));
    // A plain store (release: a waker that reads the new word sees Parking), which may overwrite
    // the bit of a cancel that came since the load: then the cancel's flag is visible here
    // (fiber_cancel_fence is the other half of the fence), and the bit is set again.
    f->wake_word.store(next, std::memory_order_release);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (f->cancel_requested.load(std::memory_order_relaxed) && !(next & WakeWord::kCancelBit)) [[unlikely]] {
      next = f->wake_word.fetch_or(WakeWord::kCancelBit, std::memory_order_acq_rel) | WakeWord::kCancelBit;
    }
  } else {  // never biased: see ClaimGate's invariants
    next = WakeWord::next_wait(cur, shielded);
    while (!f->wake_word.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) next = WakeWord::next_wait(cur, shielded);
  }
  w.gen = WakeWord::unpack(next).gen;
}

// waiter_claim: from (gen, Pending) to (gen, reason) on a fiber's wake word, or from Pending to
// reason | kClaimBusy on a thread's record. One CAS, but for a wait biased to the calling
// thread's processor: a plain load and store behind its ClaimGate (sched/claim_gate.hpp). Every
// other claimer of a biased wait closes that gate first (claim_biased_elsewhere). A claim made
// on the wait's own processor marks the word local, which builds the bias (prepare_wait).
[[gnu::always_inline]] inline bool claim_wait(Waiter& w, WakeReason reason) noexcept {
  if (w.fiber == nullptr) [[unlikely]] {
    uint8_t expected = kWaitPending;
    return w.state.compare_exchange_strong(expected, static_cast<uint8_t>(reason) | Waiter::kClaimBusy,
                                           std::memory_order_acq_rel);
  }
  Fiber* f = w.fiber;
  uint64_t cur = f->wake_word.load(std::memory_order_acquire);
  if (!WakeWord::pending_wait(cur, w.gen)) return false;
  Processor* p = current_processor();
  const bool local = is_wait_processor(f, p);
  if (cur & WakeWord::kBiasBit) {  // this wait's bias (the generation is ours)
    if (!local) [[unlikely]] return claim_biased_elsewhere(w, reason);
    if (p->claim_gate().enter()) [[likely]] {
      // Read again inside, where every write a closer made before reopening is visible:
      // unchanged, it is still this wait's and pending. Changed (claimed, or a cancel bit set
      // behind the gate), the CAS below decides.
      const uint64_t now = f->wake_word.load(std::memory_order_acquire);
      const bool same = now == cur;
      if (same) f->wake_word.store(WakeWord::with_reason(cur, reason) | WakeWord::kLocalBit, std::memory_order_release);
      p->claim_gate().leave();
      if (same) [[likely]] return true;
      cur = now;
    }
  }
  const uint64_t mark = local ? WakeWord::kLocalBit : 0;
  for (;;) {
    if (!WakeWord::pending_wait(cur, w.gen)) return false;
    if (f->wake_word.compare_exchange_weak(cur, WakeWord::with_reason(cur, reason) | mark, std::memory_order_acq_rel)) {
      return true;
    }
  }
}

// waiter_wake.
[[gnu::always_inline]] inline void wake_wait(Waiter& w) noexcept {
  if (w.fiber != nullptr) [[likely]] {
    unpark(w.fiber);
    return;
  }
  wake_thread_wait(w);
}

// The end of a wait that fiber `f` claimed itself, without switching: no waker will unpark it
// (wakers that lost the claim do nothing), so it runs on, and its window has ended.
inline void end_self_claimed_wait(Fiber* f) noexcept {
  f->state.store(FiberState::Running, std::memory_order_release);
  current_processor()->wake_deferred();  // the wakes it deferred in its window
}

// A fiber's wait until claimed (its timer, if any, already added).
[[gnu::always_inline]] inline WakeReason fiber_wait(Waiter& w, ParkReason why) noexcept {
  Fiber* f = w.fiber;
  const WakeWord ww = WakeWord::unpack(f->wake_word.load(std::memory_order_acquire));
  if (ww.cancelled && !ww.shielded && claim_wait(w, WakeReason::Cancelled)) {
    end_self_claimed_wait(f);
    return WakeReason::Cancelled;
  }
  Processor::park_current(why);
  return WakeWord::unpack(f->wake_word.load(std::memory_order_acquire)).reason;
}

// waiter_wait.
[[gnu::always_inline]] inline WakeReason wait_claimed(Waiter& w, ParkReason why) noexcept {
  return w.fiber ? fiber_wait(w, why) : thread_wait(w, nullptr);
}

}  // namespace fiber::detail
