// Fiber lifecycle helpers shared by the processor loop and the public entry points.
#pragma once

#include <cstdint>

#include "sched/fiber.hpp"

namespace fiber::detail {

// A block of n process-unique fiber ids (never 0).
uint64_t allocate_fiber_ids(uint64_t n) noexcept;
// Runs the fiber's task on its own stack; an escaping exception is stored in task->error.
void run_task(Fiber* self) noexcept;
// The fiber is done (ran, or could not get a stack): wake its joiner, leave its group and the
// registry, report an unobserved exception of a detached fiber. On the processor that ran it.
void complete_fiber(Fiber* f) noexcept;
void drop_fiber_ref(Fiber* f) noexcept;
// Throws fiber::Cancelled if `f` was cancelled (and is not already unwinding). The bit test is
// inline: yield calls this on every switch.
void throw_cancelled_unless_unwinding();
inline void throw_if_cancelled(const Fiber* f) {
  if (WakeWord::unpack(f->wake_word.load(std::memory_order_acquire)).cancelled) [[unlikely]] {
    throw_cancelled_unless_unwinding();
  }
}
// Writes one line naming the fiber, its stack and `how` it overflowed, then aborts. Async-signal-
// safe (the guard-page fault handler calls it on the alternate signal stack).
[[noreturn]] void report_stack_overflow(const Fiber* f, const char* how) noexcept;
// Ends a prepared wait that will not be waited for. A cancel or close may have claimed it
// meanwhile; then this returns once their unpark has landed.
void waiter_abandon(Waiter& w) noexcept;

}  // namespace fiber::detail
