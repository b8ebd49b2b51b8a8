// Scheduler: a set of processor threads that run fibers M:N.
//
//   fiber::Scheduler io({.processors = 2, .name = "io"});
//   auto h = fiber::spawn({.scheduler = &io}, [] { return 42; });
//   int v = h.join();
//   io.stop();  // also done by the destructor
//
// A default scheduler starts on first use with $FIBER_PROCS processors (or one per hardware
// thread); any number of independent schedulers can run beside it.
//
// Each scheduler has a watchdog (Options::watchdog; libfiber/README.md, "Watchdog"): a monitor
// thread that notices a processor whose fiber runs without switching (a CPU loop, a blocking
// call the hooks do not cover), moves the fibers queued behind it to other processors, starts
// extra processor threads up to Options::max_processors when every processor is blocked, and
// reports the fiber once per incident:
//
//   fiber::Scheduler s({.processors = 4, .max_processors = 8,
//                       .watchdog = {.threshold = std::chrono::milliseconds(20),
//                                    .sink = [](const fiber::BlockedReport& r) { log(r); }}});
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "fiber/config.hpp"
#include "fiber/stats.hpp"

namespace fiber {

namespace detail {
class SchedulerImpl;
}

// One watchdog incident: a fiber that kept its processor without switching for longer than
// WatchdogOptions::threshold. The views are valid only during the sink call.
struct BlockedReport {
  std::string_view scheduler;            // the scheduler's name
  unsigned long long fiber_id = 0;       // this_fiber::id() of the blocking fiber
  std::string_view fiber_name;           // its SpawnOptions::name; empty when unnamed
  std::chrono::nanoseconds running_for{};  // since its processor last switched (a lower bound)
  unsigned processor = 0;                // index of the processor it holds
  int thread_id = 0;                     // that processor's OS thread id (gdb, perf, /proc)
  std::size_t queued = 0;                // fibers queued on that processor when it was noticed
  // What its thread was doing, from /proc: "blocked in system call read (#0, first argument 3)
  // at 0x...: libc.so.6 (syscall+0x19)", "running, not in a system call (11.6 ms of CPU in the
  // last 11.7 ms, 0.0 ms of it in spin-waits)", ...; empty if /proc is unavailable. No
  // backtrace (the stack belongs to a thread that is running or inside a call; see the
  // README): use thread_id with gdb/eu-stack.
  std::string_view where;
};

// Counters of the watchdog of one scheduler.
struct WatchdogStats {
  std::uint64_t incidents = 0;        // blocked fibers reported so far
  std::size_t blocked_now = 0;        // processors blocked at the last sample
  std::size_t extra_running = 0;      // extra processor threads running now
  std::uint64_t extra_started = 0;    // extra processor threads started so far
  std::uint64_t extra_retired = 0;    // ... and retired after being idle
};

struct WatchdogOptions {
  // false: no monitor thread - no rescue, no extra processors, no reports.
  bool enabled = true;
  // How often the monitor samples each processor's switch counter (it samples less often while
  // every processor is idle). Must be positive.
  std::chrono::microseconds interval{1000};
  // A processor whose fiber has run this long without switching is blocked: its queued fibers
  // go to other processors; if it is using CPU or sleeping in the kernel (not merely preempted)
  // it is an incident, reported once. Must be positive.
  std::chrono::microseconds threshold{15000};
  // An extra processor (above Options::processors) stops its thread after being idle this long
  // while no processor is blocked. Must not be negative. Any of the three may be as large as
  // microseconds::max(): past 100 years it means never.
  std::chrono::microseconds retire_after{100000};
  // Receives each incident, on the monitor thread; keep it short (it delays the next sample) and
  // do not stop the scheduler from it. Exceptions are ignored. Empty: one line on stderr.
  std::function<void(const BlockedReport&)> sink;
};

class FIBER_API Scheduler {
 public:
  // Options::processors value meaning $FIBER_PROCS if set, else one per hardware thread.
  static constexpr std::size_t auto_processors = ~std::size_t{0};

  struct Options {
    // Processor threads (1..1024). auto_processors: $FIBER_PROCS, else hardware concurrency.
    std::size_t processors = auto_processors;
    // Processor threads the watchdog may run at most, counting `processors`, when every one
    // is blocked (at most 1024); values below `processors` (0 included) mean `processors`.
    std::size_t max_processors = 0;
    // Default stack size of this scheduler's fibers in bytes; 0 means $FIBER_STACK_SIZE or 64 KiB.
    std::size_t stack_size = 0;
    // Names the processor threads ("NAME-P0", ...) and the monitor ("NAME-mon").
    std::string name = "fiber";
    // The blocked-processor watchdog; see WatchdogOptions.
    WatchdogOptions watchdog = {};
    // How long a processor that has run out of fibers keeps looking for more (its engine, its
    // queues, other processors') before its thread sleeps. Sleeping costs a thread switch, and
    // waking a sleeper a system call from whoever wakes it (on loopback, the peer that sends to
    // it): a short spin trades otherwise idle CPU for both, in servers whose requests come
    // closer together than a sleep and a wake. -1: $FIBER_SPIN_US microseconds, else 0 (no
    // spin). Spins only on the io_uring engine where the kernel flags completions (TASKRUN_FLAG,
    // Linux 6.1): elsewhere each look is a system call. See "Spinning" in libfiber/README.md.
    std::chrono::microseconds spin_before_sleep{-1};
  };

  // Starts the processors (and the watchdog's monitor thread). Throws UsageError for zero
  // processors, an invalid $FIBER_PROCS or $FIBER_SPIN_US, a spin_before_sleep below -1 or
  // above one second, max_processors above 1024 or invalid watchdog timings,
  // ResourceError when threads or rings cannot be created.
  Scheduler();
  explicit Scheduler(Options options);
  ~Scheduler();  // stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Stops the scheduler. Policy: every live fiber is cancelled - the blocking call it is parked
  // in (and every later one) throws fiber::Cancelled, which unwinds its stack; a fiber that does
  // not block runs to its end. stop() returns once every fiber has finished, then joins the
  // processor threads and frees every stack. Spawning onto a stopped scheduler throws
  // UsageError. Idempotent. Must not be called from one of this scheduler's own fibers.
  void stop();

  // Options::processors as resolved: the base count, without the watchdog's extra processors.
  std::size_t processors() const noexcept;
  // Options::spin_before_sleep in effect: as resolved (option or $FIBER_SPIN_US), or zero where
  // the engine cannot spin (epoll, or a ring without TASKRUN_FLAG).
  std::chrono::microseconds spin_before_sleep() const noexcept;
  // Extra processor threads the watchdog runs now (0 when none is needed).
  std::size_t extra_processors() const noexcept;
  // Blocked-fiber incidents the watchdog has reported so far.
  std::uint64_t blocked_incidents() const noexcept;
  // All watchdog counters at once (zero when it is disabled).
  WatchdogStats watchdog_stats() const noexcept;
  const std::string& name() const noexcept;
  // Fibers spawned and not yet finished.
  std::size_t live_fibers() const noexcept;
  // Counters of this scheduler and its processors (see fiber/stats.hpp).
  SchedulerStats stats() const;
  // This scheduler's live fibers, one line each for those that have reached a cancellation point
  // or switched away (the rest, queued or running since they started, are only counted), and
  // its processors' states; see fiber::dump for all schedulers.
  void dump(std::ostream& out) const;

  // The process-wide default scheduler, started on first use. It is never destroyed.
  static Scheduler& global();

  // True once this process has started a processor thread (of any scheduler). A child forked
  // before then is a new process to libfiber and its hooks: it may start schedulers of its own
  // (the prefork server pattern). One forked after may use libfiber only to exec: the parent's
  // processor threads, and the fibers its records wait for, did not come along.
  static bool started_in_process() noexcept;

  detail::SchedulerImpl& impl() const noexcept { return *impl_; }

 private:
  struct GlobalTag {};
  detail::SchedulerImpl* impl_;
};

}  // namespace fiber
