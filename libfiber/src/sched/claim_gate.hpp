// ClaimGate: a processor's permission to claim the waits biased to it (WakeWord::kBiasBit) with a
// plain load and store of the fiber's wake word instead of a CAS. A claim is the one locked
// instruction left in each half of a channel ping-pong on one processor, and on this machine its
// CAS was a sixth of the round trip (pingpong_1t 93.5 -> 76 ns, min of 15 runs, with every claim
// made plain, unsafely, for the measurement).
//
// Every thread but the owner closes the gate before it writes a biased wait's word, and the owner
// then claims with a CAS like everyone else until it reopens (sync/waiter_impl.hpp, claim_wait):
//
//   owner, each claim:  busy_ = true; compiler barrier; closed_ == 0? plain load, check, store;
//                       busy_ = false (release) : busy_ = false, CAS
//   other thread:       closed_ += 1; membarrier (a full barrier on every running thread);
//                       wait until !busy_; its atomic read-modify-writes; closed_ -= 1 (release)
//
// The store-buffering pattern of sched/owner_slot.hpp, whose owner-side fence the membarrier
// supplies: either the owner's busy_ = true is visible after it, and the closer waits for that
// claim to end (release/acquire on busy_) and then sees its store, or the owner's later load of
// closed_ sees the closer and it takes the CAS path. The owner's re-load of the word after its
// check sees every write a closer made before reopening (the acquire of closed_).
//
// Invariants: only the owner processor's thread calls enter() and leave(), which bracket a few
// instructions and never a switch; any thread may close() and must open() after; waits are
// biased only where membarrier(2) is available (prepare_wait).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "fiber/detail/wait.hpp"
#include "sched/membarrier.hpp"

namespace fiber::detail {

class ClaimGate {
 public:
  // Owner: true if it may claim plainly now; then leave() right after the store.
  bool enter() noexcept {
    busy_.store(true, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the closer's membarrier is the fence
    if (closed_.load(std::memory_order_acquire) == 0) [[likely]] return true;
    busy_.store(false, std::memory_order_release);
    return false;
  }
  void leave() noexcept { busy_.store(false, std::memory_order_release); }  // pairs with close()

  // Any other thread: from return until open(), the owner claims with CAS. Waits out a plain
  // claim in progress (a few instructions, unless the owner's thread is preempted in it).
  void close() noexcept {
    closes_.fetch_add(1, std::memory_order_relaxed);
    closed_.fetch_add(1, std::memory_order_acq_rel);
    if (!membarrier_heavy_retrying()) [[unlikely]] {
      // Refused: the owner's busy_ = true may still sit in its store buffer, after a load that
      // found the gate open. A store buffer drains in far less than this; then the wait below
      // sees it (the reasoning of fiber_cancel's refused fence).
      full_fence();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    spin_until([this] { return !busy_.load(std::memory_order_acquire); });
  }
  // Release: the owner's next enter() that finds the gate open sees what we wrote.
  void open() noexcept { closed_.fetch_sub(1, std::memory_order_release); }

  // Snapshot, for tests: how often the gate was closed.
  uint64_t closes() const noexcept { return closes_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> busy_{false};      // owner-written: in (or entering) a plain claim
  std::atomic<uint32_t> closed_{0};    // closers inside their section now
  std::atomic<uint64_t> closes_{0};    // for tests and stats
};

}  // namespace fiber::detail
