// Ticker and Timer (fiber/ticker.hpp): a fiber per running one, sleeping on its processor's
// timers between values. stop() must guarantee that nothing is received after it returns, from
// any thread, without waiting for that fiber (a cancelled caller could not join it). So each
// fiber carries a generation, and sends only under the state's mutex while its generation is
// the current one; stop() retires the generation under the same mutex, takes back a value not
// yet received, and cancels the fiber so that it ends now rather than at its next tick (a
// block_on would otherwise wait for it).
#include "fiber/ticker.hpp"

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "fiber/error.hpp"
#include "fiber/spawn.hpp"
#include "fiber/this_fiber.hpp"

namespace fiber {
namespace detail {

struct TickSource::State {
  Channel<clock::time_point> ch{1};
  // Held only for a few non-blocking steps (never across a wait), so a plain mutex serves
  // fibers and threads alike.
  std::mutex mu;
  std::uint64_t gen = 0;  // GUARDED_BY(mu): the generation allowed to send; stop() bumps it
  bool active = false;    // GUARDED_BY(mu): a fiber of generation `gen` will still send
  CancelToken token;      // GUARDED_BY(mu): that fiber, once spawned
};

TickSource::TickSource(clock::duration d, bool periodic, Scheduler* scheduler)
    : state_(std::make_shared<State>()), scheduler_(scheduler), periodic_(periodic) {
  start(d);
}

TickSource& TickSource::operator=(TickSource&& other) noexcept {
  if (this != &other) {
    stop();
    state_ = std::move(other.state_);
    scheduler_ = other.scheduler_;
    periodic_ = other.periodic_;
  }
  return *this;
}

TickSource::~TickSource() { stop(); }

Channel<TickSource::clock::time_point>& TickSource::channel() const noexcept { return state_->ch; }

bool TickSource::stop() noexcept {
  if (!state_) return false;  // moved from
  CancelToken fiber;
  bool pending;
  {
    std::lock_guard lock(state_->mu);
    ++state_->gen;
    pending = state_->active;
    state_->active = false;
    fiber = std::move(state_->token);
    if (state_->ch.try_recv()) pending = true;  // sent, never received
  }
  fiber.cancel();  // no effect once it has ended
  return pending;
}

bool TickSource::restart(clock::duration d) {
  const bool pending = stop();
  start(d);
  return pending;
}

void TickSource::start(clock::duration d) {
  std::uint64_t gen;
  {
    std::lock_guard lock(state_->mu);
    gen = ++state_->gen;
    state_->active = true;
  }
  const clock::time_point first = clock::now() + d;
  auto body = [st = state_, gen, period = d, periodic = periodic_, next = first]() mutable {
    try {
      for (;;) {
        this_fiber::sleep_until(next);  // throws Cancelled once stopped
        const clock::time_point now = clock::now();
        std::lock_guard lock(st->mu);
        if (st->gen != gen) return;  // stopped while it woke
        st->ch.try_send(now);          // the last value not received yet stays: this one drops
        if (!periodic) {
          st->active = false;
          return;
        }
        // The next multiple of the period after now: ticks missed while the processor was
        // busy are dropped, not fired in a burst.
        next += period * ((now - next) / period + 1);
      }
    } catch (const Cancelled&) {
      // Stopped (or the scheduler is stopping): nothing more to send.
    }
  };
  CancelToken token;
  try {
    auto h = spawn({.scheduler = scheduler_, .name = periodic_ ? "ticker" : "timer"}, std::move(body));
    token = h.cancel_token();
    h.detach();
  } catch (...) {
    std::lock_guard lock(state_->mu);
    if (state_->gen == gen) state_->active = false;
    throw;
  }
  {
    std::lock_guard lock(state_->mu);
    if (state_->gen == gen) {
      state_->token = std::move(token);
      return;
    }
  }
  // A stop() on another thread retired this generation before its token was stored here:
  // cancel the fiber now, as that stop() would have.
  token.cancel();
}

}  // namespace detail

namespace {
Ticker::clock::duration positive_period(Ticker::clock::duration period, const char* what) {
  if (period <= Ticker::clock::duration::zero()) {
    throw UsageError(std::string(what) + ": the period must be positive (got " + std::to_string(period.count()) + " ns)");
  }
  return period;
}
}  // namespace

Ticker::Ticker(clock::duration period, Scheduler* scheduler)
    : src_(positive_period(period, "fiber::Ticker"), true, scheduler) {}

void Ticker::reset(clock::duration period) { src_.restart(positive_period(period, "fiber::Ticker::reset")); }

}  // namespace fiber
