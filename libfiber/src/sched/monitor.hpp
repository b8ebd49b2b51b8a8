// Monitor: the blocked-processor watchdog (DESIGN invariant 6; libgo's dispatcher thread, Go's
// sysmon). One thread per scheduler; see libfiber/README.md, "Watchdog".
//
// Every `interval` (less often while nothing can be stalled yet, see run()) it samples each
// running processor's switch counter and current fiber. A processor whose counter has not moved
// for `threshold` while a fiber (not its loop) is current is *stalled*; the monitor then, on
// every sample until it switches:
//   - moves the fibers in its LIFO and yield slots to the injector (which wakes a sleeper), fires
//     its expired timers (their fibers go to the injector too), and wakes a sleeper if its ring
//     has fibers, so idle processors steal them;
//   - decides once whether it is *blocked*: its thread is in the kernel (an unhooked blocking
//     call: /proc/self/task/TID/syscall names it) or is using CPU (a loop: its thread CPU clock
//     moved by at least a quarter of the threshold since a quarter of the threshold into the
//     stall). A thread that only
//     waits for a CPU (preempted, a throttled cgroup) is neither, and is not reported. A blocked
//     processor is one incident: counted, and reported once through the sink.
//   - when every running processor is blocked, fibers are waiting and fewer than max_processors
//     run, starts an extra processor. Extras retire by themselves (Processor::try_retire).
//
// The monitor never touches a processor's owner-only state. It reads `switches_` and `current_`
// (atomics), takes the LIFO slot with the same exchange the owner uses and the yield slot by
// OwnerSlot's membarrier protocol, steals nothing itself (the ring's stealers are the
// processors), and fires timers under the timer queue's lock.
//
// Reading the blocked fiber's id and name: the fiber may finish (and be freed) at any moment, so
// the monitor announces the fiber in a hazard word, then re-checks that the processor has not
// switched since; the processor checks the word before it drops the reference of a fiber that
// finished (Processor::release_finished) and waits while it names that fiber. The two sides
// form a store-buffering pattern that needs a full fence on each; the processor's would cost
// every fiber's finish, so it is made asymmetric: the monitor runs membarrier(2)
// (PRIVATE_EXPEDITED), which puts a full barrier on every running thread of the process, and the
// processor only needs a compiler barrier. Without membarrier both sides use real fences.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fiber/scheduler.hpp"

namespace fiber::detail {

struct Fiber;
class Processor;
class SchedulerImpl;

// A watchdog timing (WatchdogOptions, not negative) in nanoseconds, saturated at 100 years:
// microseconds::max() then means "never" rather than overflowing into a negative threshold (every
// fiber seen twice judged stalled), a negative retire_after (extras retiring at once) or a
// negative sleep (the monitor spinning).
inline int64_t watchdog_ns(std::chrono::microseconds d) noexcept {
  constexpr int64_t kMaxUs = int64_t{100} * 365 * 24 * 3600 * 1'000'000;
  return (d.count() < kMaxUs ? d.count() : kMaxUs) * 1000;
}

// The hazard word that lets the monitor read a running fiber's control block. See above.
class FiberReadHazard {
 public:
  // Monitor side, once: turns the watchdog on (before_free starts checking) and picks the fence.
  void enable() noexcept;

  // Processor side, after the switch away from a finished fiber and before its last reference
  // can go. Not on the switch path proper: once per finished fiber.
  void before_free(const Fiber* f) const noexcept {
    if (!enabled_) return;
    light_fence();
    // Acquire: pairs with the monitor's release in end_read(); its reads of *f happen-before
    // whatever we do to f next.
    while (reading_.load(std::memory_order_acquire) == f) std::this_thread::yield();
  }

  // Monitor side: announces f. The caller must then re-check that f is still its processor's
  // current fiber with the same switch count before reading *f, and call end_read() after.
  // False if the fence could not be made (then do not read).
  bool begin_read(const Fiber* f) noexcept;
  void end_read() noexcept { reading_.store(nullptr, std::memory_order_release); }

 private:
  void light_fence() const noexcept;
  std::atomic<const Fiber*> reading_{nullptr};
  bool enabled_ = false;
  bool membarrier_ = false;  // the heavy side is membarrier(2): the light side is a compiler barrier
};

class Monitor {
 public:
  Monitor(SchedulerImpl& sched, const WatchdogOptions& options);
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  void start();  // starts the monitor thread (throws ResourceError if it cannot)
  void stop();   // stops and joins it; idempotent

  // Processors blocked at the last sample (extras do not retire while any is).
  uint32_t blocked_now() const noexcept { return blocked_now_.load(std::memory_order_relaxed); }
  WatchdogStats stats() const noexcept;

 private:
  // What the monitor knows about one processor slot. Monitor thread only.
  struct Watch {
    uint64_t seq = 0;               // switch count at the last change
    const Fiber* fiber = nullptr;   // current fiber then
    int64_t since = 0;              // when the monitor first saw (seq, fiber), steady ns
    int64_t cpu_mark = -1;          // thread CPU time at cpu_mark_at (-1: not taken / unknown)
    int64_t cpu_mark_at = 0;        // 0: not taken yet
    int64_t spin_mark = 0;          // the CPU time its spin-waits had used at cpu_mark_at
    bool stalled = false;           // no switch for `threshold`
    bool decided = false;           // blocked or not has been decided for this stall
    bool blocked = false;           // an incident (reported)
    std::size_t queued = 0;         // fibers queued when the stall was first seen
  };

  // The fiber of an incident, copied while it was certainly alive.
  struct Culprit {
    unsigned long long id = 0;
    char name[64] = {};
    std::string where;
  };

  // What the last sample saw, which sets how soon the next one comes (see run()).
  enum class Pace {
    Idle,       // no processor was running a fiber
    Switching,  // every processor running a fiber had switched since the sample before
    Watching,   // some processor was running the fiber it ran at the sample before
  };

  void run();
  Pace sample(int64_t now);  // one round
  void rescue(Processor& p, int64_t now);
  bool decide(Processor& p, Watch& w, int64_t now, std::string& where);
  bool identify(Processor& p, const Watch& w, Culprit& c);
  void report(Processor& p, const Watch& w, int64_t now, const Culprit& c);
  bool work_pending() const noexcept;
  void grow();
  void start_processor(uint32_t index) noexcept;

  // A spin-wait for a preempted thread is reported once it has lasted this many thresholds
  // (decide()): longer than a preemption lasts on a loaded machine, sooner than a user looks.
  static constexpr int64_t kSpinWaitReportAfter = 16;

  SchedulerImpl& sched_;
  const int64_t interval_ns_;
  const int64_t threshold_ns_;
  std::function<void(const BlockedReport&)> sink_;
  std::vector<Watch> watch_;  // per processor slot
  bool start_failed_ = false;  // an extra could not be started: do not try again

  std::atomic<uint32_t> blocked_now_{0};
  std::atomic<uint64_t> incidents_{0};
  std::atomic<uint64_t> extra_started_{0};
  std::atomic<uint64_t> extra_retired_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace fiber::detail
