// Internal: the blocking-offload pool behind fiber::blocking (see fiber/blocking.hpp and
// blocking_pool.cpp). Declared here for the tests.
#pragma once

#include <cstddef>

namespace fiber::detail {

inline constexpr std::size_t kDefaultBlockingThreads = 64;

// The helper-thread limit that $FIBER_BLOCKING_THREADS = `value` asks for: nullptr or "" gives
// kDefaultBlockingThreads; anything but a positive decimal integer throws UsageError naming the
// variable.
std::size_t parse_blocking_threads(const char* value);

// A snapshot of the pool, all zero before its first use (and in a forked child until then).
struct BlockingPoolStats {
  std::size_t threads = 0;      // helper threads alive
  std::size_t idle = 0;         // of those, waiting for a job
  std::size_t queued = 0;       // jobs not yet taken by a thread
  std::size_t max_threads = 0;  // the limit (0: no pool yet)
};
BlockingPoolStats blocking_pool_stats() noexcept;

}  // namespace fiber::detail
