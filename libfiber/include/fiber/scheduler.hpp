// Scheduler: a set of processor threads that run fibers M:N.
//
//   fiber::Scheduler io({.processors = 2, .name = "io"});
//   auto h = fiber::spawn({.scheduler = &io}, [] { return 42; });
//   int v = h.join();
//   io.stop();  // also done by the destructor
//
// A default scheduler starts on first use with $FIBER_PROCS processors (or one per hardware
// thread); any number of independent schedulers can run beside it.
#pragma once

#include <cstddef>
#include <string>

#include "fiber/config.hpp"

namespace fiber {

namespace detail {
class SchedulerImpl;
}

class FIBER_API Scheduler {
 public:
  // Options::processors value meaning $FIBER_PROCS if set, else one per hardware thread.
  static constexpr std::size_t auto_processors = ~std::size_t{0};

  struct Options {
    // Processor threads (1..1024). auto_processors: $FIBER_PROCS, else hardware concurrency.
    std::size_t processors = auto_processors;
    // Upper bound the blocked-processor watchdog may grow to; 0 means `processors`.
    std::size_t max_processors = 0;
    // Default stack size of this scheduler's fibers in bytes; 0 means $FIBER_STACK_SIZE or 64 KiB.
    std::size_t stack_size = 0;
    // Names the processor threads ("NAME-P0", ...) for debuggers and top.
    std::string name = "fiber";
  };

  // Starts the processors. Throws UsageError for zero processors or an invalid $FIBER_PROCS,
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

  std::size_t processors() const noexcept;
  const std::string& name() const noexcept;
  // Fibers spawned and not yet finished.
  std::size_t live_fibers() const noexcept;

  // The process-wide default scheduler, started on first use. It is never destroyed.
  static Scheduler& global();

  detail::SchedulerImpl& impl() const noexcept { return *impl_; }

 private:
  struct GlobalTag {};
  detail::SchedulerImpl* impl_;
};

}  // namespace fiber
