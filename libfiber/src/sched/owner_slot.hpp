// OwnerSlot: a one-fiber slot that its owner thread puts to and takes from without a locked
// instruction, and that one other thread (the watchdog's monitor) may still empty while the
// owner is stuck in a fiber. A processor has two: its LIFO slot (the fiber woken last, to run
// next: Processor::schedule_local) and its yield slot (the fiber that yielded last, see
// Processor::schedule_yielded). Putting and taking with atomic exchanges cost about 5 ns each
// on this machine: a quarter of a yield, and a sixth of a channel ping-pong's round trip, whose
// every wake puts a fiber in the LIFO slot and whose every park takes it back out.
//
// The rare steal pays instead of the owner:
//
//   owner, each op:  busy_ = true; compiler barrier; if shared_: busy_ = false, atomic exchange
//                    else plain load and store; busy_ = false (release)
//   thief:           shared_ = true; membarrier (a full barrier on every running thread);
//                    wait until !busy_; exchange; shared_ = false (release)
//
// A store-buffering pattern (busy_ then shared_ on the owner's side, shared_ then busy_ on the
// thief's) whose owner-side fence the membarrier supplies (sched/membarrier.hpp). After it,
// either an owner op began before the barrier, so its busy_ = true is visible and the thief
// waits for the op to end (it never takes the slot mid-op), or it began after and sees
// shared_, so it takes the slow path: atomic exchanges against atomic exchanges. Without
// membarrier the slot is shared from the start and every owner op is an exchange.
//
// Invariants: only the owner thread calls put(), exchange() and take(); one thief at a time
// (the monitor thread) calls steal(); a fiber in the slot is Runnable and owned by the slot, so
// whoever takes it runs (or queues) it, exactly once.
#pragma once

#include <atomic>
#include <thread>

#include "sched/membarrier.hpp"

namespace fiber::detail {

struct Fiber;

class OwnerSlot {
 public:
  OwnerSlot() noexcept : shared_(!membarrier_available()) {}

  // Owner: whether the slot holds a fiber. Exact but for a steal in progress (which only
  // empties it).
  bool occupied_for_owner() const noexcept { return slot_.load(std::memory_order_relaxed) != nullptr; }

  // Owner: puts `f` in the slot, which must be empty (occupied_for_owner() was false).
  void put(Fiber* f) noexcept {
    if (!enter_plain()) [[unlikely]] {
      slot_.exchange(f, std::memory_order_acq_rel);
      return;
    }
    slot_.store(f, std::memory_order_release);  // pairs with the thief's exchange
    leave_plain();
  }

  // Owner: puts `f` in the slot and returns the fiber it held, or nullptr.
  Fiber* exchange(Fiber* f) noexcept {
    if (!enter_plain()) [[unlikely]] return slot_.exchange(f, std::memory_order_acq_rel);
    Fiber* prev = slot_.load(std::memory_order_relaxed);  // ours: only we put fibers here
    slot_.store(f, std::memory_order_release);             // pairs with the thief's exchange
    leave_plain();
    return prev;
  }

  // Owner: takes the fiber in the slot, or nullptr.
  Fiber* take() noexcept {
    if (slot_.load(std::memory_order_relaxed) == nullptr) return nullptr;
    if (!enter_plain()) [[unlikely]] return slot_.exchange(nullptr, std::memory_order_acq_rel);
    Fiber* f = slot_.load(std::memory_order_relaxed);  // ours: only we put fibers here
    slot_.store(nullptr, std::memory_order_relaxed);
    leave_plain();
    return f;
  }

  // Any thread, a snapshot.
  bool occupied() const noexcept { return slot_.load(std::memory_order_acquire) != nullptr; }

  // The thief: takes the fiber in the slot, or nullptr. Blocks only while the owner is inside
  // one put() or take() (a few instructions, unless its thread is preempted there).
  Fiber* steal() noexcept {
    if (slot_.load(std::memory_order_relaxed) == nullptr) return nullptr;  // spare the barrier
    const bool was_shared = shared_.load(std::memory_order_relaxed);
    if (!was_shared) {
      shared_.store(true, std::memory_order_relaxed);
      // Registered but refused (not seen in practice): the owner's plain ops are unfenced, so
      // taking the fiber could race one. Leave it to the owner.
      if (!membarrier_heavy()) {
        shared_.store(false, std::memory_order_relaxed);
        return nullptr;
      }
      while (busy_.load(std::memory_order_acquire)) std::this_thread::yield();
    }
    Fiber* f = slot_.exchange(nullptr, std::memory_order_acq_rel);
    // Release: the owner's next plain op (which loads shared_ with acquire) sees our exchange.
    if (!was_shared) shared_.store(false, std::memory_order_release);
    return f;
  }

 private:
  bool enter_plain() noexcept {
    busy_.store(true, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the thief's membarrier is the fence
    if (!shared_.load(std::memory_order_acquire)) [[likely]] return true;
    busy_.store(false, std::memory_order_release);
    return false;
  }
  void leave_plain() noexcept { busy_.store(false, std::memory_order_release); }

  std::atomic<Fiber*> slot_{nullptr};
  std::atomic<bool> busy_{false};  // owner-written: inside a plain put() or take()
  std::atomic<bool> shared_;       // thief-written: owner ops must be atomic exchanges
};

}  // namespace fiber::detail
