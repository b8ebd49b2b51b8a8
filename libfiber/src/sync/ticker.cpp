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

TickSource::TickSource(Deadline first, clock::duration period, Scheduler* scheduler)
    : state_(std::make_shared<State>()), scheduler_(scheduler) {
  start(first, period);
}

TickSource& TickSource::operator=(TickSource&& other) noexcept {
  if (this != &other) {
    stop();
    state_ = std::move(other.state_);
    scheduler_ = other.scheduler_;
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

bool TickSource::restart(Deadline first, clock::duration period) {
  const bool pending = stop();
  start(first, period);
  return pending;
}

namespace {
// `at` + `step`, saturating at kNoDeadline.
Deadline later(Deadline at, TickSource::clock::duration step) noexcept {
  return step >= kNoDeadline - at ? kNoDeadline : at + step;
}
}  // namespace

// Each generation's period travels with its fiber: resets racing each other share no field.
void TickSource::start(Deadline first, clock::duration period) {
  std::uint64_t gen;
  CancelToken earlier;  // a fiber an overlapping start() stored: its generation is over too
  {
    std::lock_guard lock(state_->mu);
    gen = ++state_->gen;
    state_->active = true;
    earlier = std::move(state_->token);
  }
  earlier.cancel();
  auto body = [st = state_, gen, period, next = first]() mutable {
    try {
      for (;;) {
        this_fiber::sleep_until(next);  // kNoDeadline: until cancelled; throws Cancelled then
        const clock::time_point now = clock::now();
        std::lock_guard lock(st->mu);
        if (st->gen != gen) return;  // stopped while it woke
        st->ch.try_send(now);          // the value not received yet stays: this one drops
        if (period <= clock::duration::zero()) {
          st->active = false;
          return;
        }
        // The next multiple of the period after now: ticks this fiber was too late for are
        // dropped, not fired in a burst.
        next = later(next, period * ((now - next) / period + 1));
      }
    } catch (const Cancelled&) {
      // Stopped, or the scheduler is stopping: nothing more will be sent.
    } catch (const ChannelClosed&) {
      // Someone closed the channel, which it does not allow: nothing more can be sent.
    }
    std::lock_guard lock(st->mu);
    if (st->gen == gen) st->active = false;
  };
  CancelToken token;
  try {
    auto h = spawn({.scheduler = scheduler_, .name = period > clock::duration::zero() ? "ticker" : "timer"},
                   std::move(body));
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
  // A stop() or start() on another thread ended this generation before its token was stored
  // here: cancel the fiber now, as that call would have.
  token.cancel();
}

}  // namespace detail

void detail::throw_bad_period(const char* what, double seconds) {
  throw UsageError(std::string(what) + ": the period must be positive (got " + std::to_string(seconds) + " s)");
}

}  // namespace fiber
