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
// slow receiver gets the latest one and the Ticker skips ahead, keeping to its period. stop()
// and reset() take back a value not yet received, so none arrives after they return (Go 1.23's
// rule). Every member is safe to call from any fiber or thread, concurrently.
//
// A running Ticker or Timer is a fiber that sleeps between ticks, on the scheduler given, else
// the calling fiber's, else the default one. Stopping or destroying one cancels that fiber,
// which ends moments later (Scheduler::live_fibers counts it until then; a block_on around it
// waits for that, not for its next tick). The channel belongs to the object: not on a
// moved-from one, and never close it.
#pragma once

#include <chrono>
#include <memory>

#include "fiber/channel.hpp"
#include "fiber/config.hpp"

namespace fiber {

class Scheduler;

namespace detail {

// What Ticker and Timer share: a channel of capacity one, fed by a fiber of a generation that
// stop() retires.
class FIBER_API TickSource {
 public:
  using clock = std::chrono::steady_clock;

  TickSource(clock::duration d, bool periodic, Scheduler* scheduler);
  TickSource(TickSource&&) noexcept = default;
  TickSource& operator=(TickSource&& other) noexcept;
  ~TickSource();

  Channel<clock::time_point>& channel() const noexcept;
  // Retires the running fiber and takes back a value not yet received. True if a value would
  // still have come: the fiber was running, or the value taken back had not been received.
  bool stop() noexcept;
  // stop(), then a new fiber whose first value comes after d. Returns what stop() returned.
  bool restart(clock::duration d);

 private:
  struct State;
  void start(clock::duration d);

  std::shared_ptr<State> state_;
  Scheduler* scheduler_;
  bool periodic_;
};

}  // namespace detail

class FIBER_API Ticker {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  // Ticks every `period`, the first one a period from now. Throws UsageError unless period > 0.
  explicit Ticker(clock::duration period, Scheduler* scheduler = nullptr);

  // Receives the time of each tick (Go's Ticker.C).
  Channel<time_point>& channel() const noexcept { return src_.channel(); }
  // No tick is received after this returns, until reset(). A second stop() does nothing.
  void stop() noexcept { src_.stop(); }
  // Ticks every `period` from now on (also after stop()). Throws UsageError unless period > 0.
  void reset(clock::duration period);

 private:
  detail::TickSource src_;
};

class FIBER_API Timer {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  // Sends the time once, after `d` (at once if d <= 0).
  explicit Timer(clock::duration d, Scheduler* scheduler = nullptr) : src_(d, false, scheduler) {}

  // Receives the time it fired (Go's Timer.C).
  Channel<time_point>& channel() const noexcept { return src_.channel(); }
  // Stops it: nothing is received after this returns. True if that stopped it from being
  // received; false if it had been received already, or stopped.
  bool stop() noexcept { return src_.stop(); }
  // Fires once more, after `d` from now; returns what stop() would have.
  bool reset(clock::duration d) { return src_.restart(d); }

 private:
  detail::TickSource src_;
};

}  // namespace fiber
