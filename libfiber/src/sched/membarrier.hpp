// Asymmetric fences: membarrier(2) (MEMBARRIER_CMD_PRIVATE_EXPEDITED) puts a full memory barrier
// on every running thread of the process. A protocol that needs a full fence on both sides of a
// store-buffering pattern, but runs one side on a hot path and the other rarely, gives the hot
// side a compiler barrier and the rare side membarrier_heavy(). Users: the watchdog's hazard
// word (monitor.hpp) and the yield slot (owner_slot.hpp).
#pragma once

#include <atomic>

namespace fiber::detail {

// Registers the process for private expedited membarriers, once (thread-safe). False where the
// kernel or a seccomp profile does not offer it; then both sides need real fences.
bool membarrier_available() noexcept;
// The heavy side. False if the kernel refused (then the light sides were not fenced).
bool membarrier_heavy() noexcept;
// The same, for a registered process: that succeeds but for a transient refusal (the kernel's
// cpumask allocation) or a seccomp filter installed since, so a few tries, yielding between.
bool membarrier_heavy_retrying() noexcept;
// A full fence, for sides that cannot rely on membarrier.
void full_fence() noexcept;

// Test hook: while nonzero, BiasedLock's revocations (sync/wait.cpp) take their path for a
// membarrier refused after registration, as after a seccomp filter installed since.
inline std::atomic<int> refuse_revoke_fences{0};

}  // namespace fiber::detail
