// Ticker and Timer: Go's time.Ticker and time.Timer, a channel that receives the time every
// period (Ticker) or once (Timer), to wait on in a select beside other channels.
//
//   fiber::Ticker tick(100ms);
//   fiber::Timer give_up(5s);
//   std::optional<Job> job;
//   std::optional<fiber::Ticker::time_point> t;
//   for (;;) {
//     switch (fiber::select(fiber::recv_case(jobs, job), fiber::recv_case(tick.channel(), t),
//                           fiber::recv_case(give_up.channel(), t))) {
//       case 0: run(*job); break;
//       case 1: report_progress(); break;
//       case 2: return;  // five seconds passed
//     }
//   }
//
// The channel holds one value. A tick the receiver is not ready for is dropped, not queued: a
// slow receiver finds the first tick it missed, and the Ticker keeps to its period (ticks its
// own fiber was too late for are dropped too, not fired in a burst). stop() and reset() take
// back a value not yet received, so none arrives after they return (Go 1.23's rule).
// channel(), stop() and reset() are safe to call from any fiber or thread, concurrently.
//
// A running Ticker or Timer is a fiber that waits between ticks, spawned as by fiber::spawn
// from the caller of the constructor, or of a reset() that had to start one: on the scheduler
// given, else the calling fiber's, else the default one; and, like any fiber, a member of that
// caller's block_on group (stop one made inside a block_on before it ends, or block_on waits
// for it). Stopping or destroying one wakes that fiber to end, moments later
// (Scheduler::live_fibers counts it until then). reset() of a running Ticker, or of a Timer that
// has not fired, keeps that fiber, where it is: it only moves the next deadline, under a lock
// (tens of nanoseconds, so a deadline renewed on every message is cheap). After stop(), or once
// a Timer fired or its fiber ended otherwise (cancelled by a stopping scheduler), reset() spawns
// one again, and throws as fiber::spawn does. A scheduler given must outlive the object;
// reset() of a moved-from one is a UsageError.
//
// The channel belongs to the object: never close it, and not on a moved-from one (moving one
// into another ends the target's ticks and leaves references to its channel dangling).
#pragma once

#include <chrono>
#include <memory>

#include "fiber/channel.hpp"
#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class Scheduler;

namespace detail {

// What Ticker and Timer share: a channel of capacity one, fed by a fiber of a generation that
// stop() retires.
class FIBER_API TickSource {
 public:
  using clock = std::chrono::steady_clock;

  // The first value at `first` (kNoDeadline: never), then, if `period` is positive, one every
  // period (saturating at kNoDeadline).
  TickSource(Deadline first, clock::duration period, Scheduler* scheduler);
  TickSource(TickSource&&) noexcept = default;
  TickSource& operator=(TickSource&& other) noexcept;
  ~TickSource();

  Channel<clock::time_point>& channel() const noexcept;
  // Retires the running fiber and takes back a value not yet received. True if a value would
  // still have come: the fiber was running, or the value taken back had not been received.
  bool stop() noexcept;
  // The next value at `first`, then every `period`, as the constructor's. A running fiber is
  // kept and given the new times (true, as stop() would return); otherwise stop(), then a new
  // fiber. Returns what stop() would have; on an exception (the spawn's) it stays stopped.
  bool restart(Deadline first, clock::duration period);

 private:
  struct State;
  void start(Deadline first, clock::duration period);

  std::shared_ptr<State> state_;
  Scheduler* scheduler_;
};

// A positive duration as a ticker's period, capped at kFarDeadline (a longer one never ticks);
// UsageError naming `what` otherwise.
[[noreturn]] FIBER_API void throw_bad_period(const char* what, double seconds);
template <typename Rep, typename Period>
std::chrono::steady_clock::duration checked_period(std::chrono::duration<Rep, Period> d, const char* what) {
  if (!(d > d.zero())) throw_bad_period(what, std::chrono::duration<double>(d).count());
  if (std::chrono::duration<double>(d) >= kFarDeadline) return kFarDeadline;
  return std::chrono::ceil<std::chrono::steady_clock::duration>(d);
}

}  // namespace detail

class FIBER_API Ticker {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  // Ticks every `period`, the first one a period from now (never, for 100 years or more).
  // Throws UsageError unless period > 0; ResourceError, UsageError as fiber::spawn does.
  template <typename Rep, typename Period>
  explicit Ticker(std::chrono::duration<Rep, Period> period, Scheduler* scheduler = nullptr)
      : Ticker(detail::checked_period(period, "fiber::Ticker"), scheduler, 0) {}

  // Receives the time of each tick (Go's Ticker.C).
  Channel<time_point>& channel() const noexcept { return src_.channel(); }
  // No tick is received after this returns, until reset(). A second stop() does nothing.
  void stop() noexcept { src_.stop(); }
  // Ticks every `period` from now on (also after stop()). Throws as the constructor; stopped
  // then.
  template <typename Rep, typename Period>
  void reset(std::chrono::duration<Rep, Period> period) {
    const clock::duration p = detail::checked_period(period, "fiber::Ticker::reset");
    src_.restart(detail::deadline_after(p), p);
  }

 private:
  Ticker(clock::duration period, Scheduler* scheduler, int)
      : src_(detail::deadline_after(period), period, scheduler) {}

  detail::TickSource src_;
};

class FIBER_API Timer {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  // Sends the time once, after `d` (at once if d <= 0; never, for 100 years or more). Throws
  // ResourceError, UsageError as fiber::spawn does.
  template <typename Rep, typename Period>
  explicit Timer(std::chrono::duration<Rep, Period> d, Scheduler* scheduler = nullptr)
      : src_(detail::deadline_after(d), clock::duration::zero(), scheduler) {}

  // Receives the time it fired (Go's Timer.C).
  Channel<time_point>& channel() const noexcept { return src_.channel(); }
  // Stops it: nothing is received after this returns. True if that stopped it from being
  // received; false if it had been received already, or stopped.
  bool stop() noexcept { return src_.stop(); }
  // Fires once more, after `d` from now; returns what stop() would have. Throws as the
  // constructor; stopped then.
  template <typename Rep, typename Period>
  bool reset(std::chrono::duration<Rep, Period> d) {
    return src_.restart(detail::deadline_after(d), clock::duration::zero());
  }

 private:
  detail::TickSource src_;
};

}  // namespace fiber
