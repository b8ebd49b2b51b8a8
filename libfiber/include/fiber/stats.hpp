// Looking inside a running program: counters per scheduler and processor, and a list of every
// live fiber.
//
//   fiber::SchedulerStats s = fiber::Scheduler::global().stats();
//   std::printf("%zu fibers alive, %llu switches\n", s.fibers_alive, (unsigned long long)s.switches);
//   fiber::dump(std::cerr);   // every live fiber of every scheduler, one line each
//
// Counters are read without stopping anything: each is exact, but two counters read at once may
// be a few events apart. With FIBER_DUMP_SIGNAL set (USR1, USR2 or a signal number), that signal
// prints fiber::dump() to stderr - `kill -USR1 <pid>` on a stuck server.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "fiber/config.hpp"

namespace fiber {

// Why fibers parked: index with a detail::ParkReason value; names from park_reason_names().
inline constexpr std::size_t kParkReasons = 17;
FIBER_API const char* park_reason_name(std::size_t reason) noexcept;

struct ProcessorStats {
  unsigned index = 0;
  bool running = false;             // its thread runs (extra processors come and go)
  std::uint64_t switches = 0;       // fiber switches (and yields with nothing else to run)
  std::uint64_t steals = 0;         // successful steals from other processors' queues
  // Idle time: how often its thread, having nothing to run, entered its engine's wait (for
  // I/O, a timer or a wake), and how often a waker took it off the sleepers list to look for
  // work (another thread, or itself as the last searcher seeing work queued). Many of either
  // per unit of work mean the processors share too little work to stay busy (see
  // libfiber/README.md, "Idle processors").
  std::uint64_t sleeps = 0;
  std::uint64_t wakeups = 0;
  std::uint64_t spawned = 0;        // fibers spawned by fibers running here
  std::uint64_t finished = 0;       // fibers that finished here
  std::uint64_t parks[kParkReasons] = {};  // parks here, by reason
  std::size_t local_queue = 0;      // fibers in its run queue now
  bool lifo_slot = false;           // a fiber waits in its LIFO slot now
  std::uint64_t io_submitted = 0;   // operations handed to its ring / epoll set
  std::uint64_t io_completed = 0;   // ... and completed
  std::size_t io_inflight = 0;      // submitted and not completed now
};

struct SchedulerStats {
  std::string name;
  std::size_t fibers_alive = 0;     // spawned and not finished
  std::uint64_t spawned = 0;        // all time (from fibers and from plain threads)
  std::uint64_t finished = 0;
  std::uint64_t switches = 0;       // sums over the processors
  std::uint64_t steals = 0;
  std::uint64_t sleeps = 0;
  std::uint64_t wakeups = 0;
  std::uint64_t parks[kParkReasons] = {};
  std::size_t injector = 0;         // fibers in the global queue now
  std::uint64_t io_submitted = 0;
  std::uint64_t io_completed = 0;
  std::uint64_t blocked_incidents = 0;  // the watchdog's reports
  std::size_t extra_processors = 0;     // running now
  // Process-wide stack pool (shared by every scheduler).
  std::size_t stacks_guarded_live = 0;    // in use, with a guard page
  std::size_t stacks_unguarded_live = 0;  // in use, without (past the mapping budget, or compact)
  std::size_t stacks_pooled = 0;          // idle in the global pool
  std::size_t stack_mappings = 0;         // kernel mappings the stacks use (vm.max_map_count)
  std::vector<ProcessorStats> processors;  // every processor slot ever started
};

// The default scheduler's counters (starts it if needed).
FIBER_API SchedulerStats stats();
// The live fibers of every scheduler: id, name, state, park reason, the processor it last ran
// on and how long it has waited (to within a few milliseconds), one line each for those that
// have reached a cancellation point or switched away; the rest - still queued, or running since
// they started - are counted in one line ("N queued or running, not listed yet"). Above the
// fibers: how many processors are awake or searching, the fibers in the global queue, and one
// line per processor (awake or asleep, fibers queued on it and in its LIFO slot, switches,
// sleeps and wakeups, I/O in flight). A runnable fiber while every processor sleeps is a lost wakeup.
FIBER_API void dump(std::ostream& out);

}  // namespace fiber
