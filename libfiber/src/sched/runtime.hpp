// Fiber lifecycle helpers shared by the processor loop and the public entry points.
#pragma once

#include <atomic>
#include <cstdint>

#include "sched/fiber.hpp"

namespace fiber::detail {

class ClaimGate;

// A block of n process-unique fiber ids (never 0).
uint64_t allocate_fiber_ids(uint64_t n) noexcept;
// Runs the fiber's task on its own stack; an escaping exception is stored in task->error.
void run_task(Fiber* self) noexcept;
// Destroys the FiberLocal values of `self` (which has a table), on its own stack, after its
// task: before complete_fiber for a joinable fiber, inside it (after the unhandled-exception
// handler) for a detached one (fiber_local.cpp).
void fls_fiber_exit(Fiber* self) noexcept;
// The fiber is done (ran, or could not get a stack): wake its joiner, leave its group and the
// registry, report an unobserved exception of a detached fiber. On the processor that ran it.
void complete_fiber(Fiber* f) noexcept;
void drop_fiber_ref(Fiber* f) noexcept;
// Lists the running fiber `f` (the caller itself) in its scheduler's registry, where stop()
// finds the fibers to cancel. A fiber is listed at its first cancellation point or switch away
// (ensure_listed), not when it starts: one that runs to its end without either - a spawn
// benchmark's, a skynet leaf's - never takes the shard lock (spawn: 64 -> 58 ns per fiber).
// Listed once stop() has begun, it cancels itself, as stop() would have.
void list_self(const Fiber* running) noexcept;
inline void ensure_listed(const Fiber* f) noexcept {
  if (f->reg_shard == Fiber::kUnlisted) [[unlikely]] list_self(f);
}
// Throws fiber::Cancelled if `f` was cancelled (and is not already unwinding); lists `f` first,
// being a cancellation point, so `f` must be the caller. The bit test is inline: yield calls
// this on every switch.
void throw_cancelled_unless_unwinding();
inline void throw_if_cancelled(const Fiber* f) {
  ensure_listed(f);
  if (WakeWord::unpack(f->wake_word.load(std::memory_order_acquire)).cancelled) [[unlikely]] {
    throw_cancelled_unless_unwinding();
  }
}
// Writes one line naming the fiber, its stack and `how` it overflowed, then aborts. Async-signal-
// safe (the guard-page fault handler calls it on the alternate signal stack).
[[noreturn]] void report_stack_overflow(const Fiber* f, const char* how) noexcept;
// How a fiber's wait starts and a cancel reaches it. True (membarrier(2) registered):
// waiter_prepare publishes the new wait with a plain store of wake_word, and a cancel pays for
// the store-buffering fence on both sides with one membarrier (fiber_cancel). False:
// waiter_prepare uses a CAS, which a concurrent cancel's CAS of the bit cannot be lost to. Decided
// (decide_wait_start) before the first scheduler starts its processors, so before any fiber
// exists, and never changed after: every fiber's waits and cancels agree.
inline std::atomic<bool> g_plain_wait_start{false};
void decide_wait_start() noexcept;
inline bool plain_wait_start() noexcept { return g_plain_wait_start.load(std::memory_order_relaxed); }
// wait.cpp: the ClaimGate of the processor `f` runs on, or made its pending wait on (of its own
// scheduler: a fiber runs only on those).
ClaimGate& wait_processor_gate(const Fiber* f) noexcept;
// fiber_cancel (fiber/detail/task.hpp) in its three steps, for callers that need not fence for
// every fiber: stop() marks a batch, fences once, then claims; a fiber that has never run (and
// is about to, on this thread) cannot be starting a wait, so needs no fence at all.
void fiber_cancel_mark(Fiber* f) noexcept;
bool fiber_cancel_fence() noexcept;  // false: membarrier refused; claim again later (stop: next round)
void fiber_cancel_claim(Fiber* f) noexcept;
// fiber_cancel_claim without the wake: true if it claimed the fiber's wait, which the caller
// must then unpark. For callers that hold a lock a window may take: unpark may wait for a
// parking fiber to finish its switch (stop(): a registry shard's, which a fiber takes when it
// lists itself at its first park).
[[nodiscard]] bool fiber_cancel_try_claim(Fiber* f) noexcept;
// Ends a prepared wait that will not be waited for. A cancel or close may have claimed it
// meanwhile; then this returns once their unpark has landed.
void waiter_abandon(Waiter& w) noexcept;

}  // namespace fiber::detail
