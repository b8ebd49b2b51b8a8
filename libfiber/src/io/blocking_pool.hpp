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

// Queues run(arg) on the pool, from any thread, and returns at once: a job nobody waits for, so
// `arg` must own what run() needs (run() frees it). Throws UsageError for an invalid
// $FIBER_BLOCKING_THREADS, ResourceError if no helper thread exists and none can be started
// (run() then never runs). For waits that must end before the job does (net::resolve's deadline).
void blocking_detach(void (*run)(void*) noexcept, void* arg);

}  // namespace fiber::detail
