// Who is calling, for ownership checks (Mutex, RWMutex, Once): a fiber's id, or for a plain
// thread a process-unique id with the top bit set (fiber ids never have it). Never 0.
#pragma once

#include <cstdint>

#include "sched/fiber.hpp"

namespace fiber::detail {

inline constexpr std::uint64_t kThreadOwnerBit = std::uint64_t{1} << 63;

// The calling plain thread's id (src/sync/mutex.cpp). Not inlined: it reads a thread_local.
std::uint64_t this_thread_owner_id() noexcept;

inline std::uint64_t caller_owner_id() noexcept {
  if (const Fiber* f = current_fiber()) return f->id;
  return this_thread_owner_id();
}

}  // namespace fiber::detail
