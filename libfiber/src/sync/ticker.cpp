// Ticker and Timer (fiber/ticker.hpp): a fiber per running one, waiting on a condition
// variable until the next value is due. stop() must guarantee that nothing is received after it
// returns, from any thread, without waiting for that fiber (a cancelled caller could not join
// it). So each fiber carries a generation, and sends only under the state's mutex while its
// generation is the current one; stop() retires the generation under the same mutex, takes back
// a value not yet received, and notifies the fiber, which sees it retired and ends now rather
// than at its next tick (a block_on would otherwise wait for it).
//
// reset() of a running one only moves the next deadline (and period) under the mutex: the
// fiber re-reads them whenever it wakes, and is woken at once only when the new deadline is
// earlier than the one it waits for. A fiber that ends, however it ends - even without ever
// running its body (a spawned fiber that gets no stack finishes with the error) - clears
// `active` for its generation, or resets would keep re-arming a fiber that is gone: the body on
// its way out, under the lock of its last look, and its callable's destructor in any case (also
// when spawn() throws, the callable going with the exception).
#include "fiber/ticker.hpp"

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "fiber/condvar.hpp"
#include "fiber/error.hpp"
#include "fiber/spawn.hpp"

namespace fiber {
namespace detail {

struct TickSource::State {
  Channel<clock::time_point> ch{1};
  // Held only for a few non-blocking steps (the fiber's CondVar wait releases it), so a plain
  // mutex serves fibers and threads alike.
  std::mutex mu;
  CondVar cv;  // the fiber waits here until `next`; notified when it is moved earlier or retired
  std::uint64_t gen = 0;  // GUARDED_BY(mu): the generation allowed to send; stop() bumps it
  bool active = false;    // GUARDED_BY(mu): a fiber of generation `gen` exists and will still send
  Deadline next{};        // GUARDED_BY(mu): when that fiber sends next (kNoDeadline: never)
  clock::duration period{};  // GUARDED_BY(mu): then every period; not positive: only once
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
  bool pending;
  {
    std::lock_guard lock(state_->mu);
    ++state_->gen;
    pending = state_->active;
    state_->active = false;
    if (state_->ch.try_recv()) pending = true;  // sent, never received
  }
  state_->cv.notify_all();  // the retired fiber (and any older one still waiting) ends now
  return pending;
}

bool TickSource::restart(Deadline first, clock::duration period) {
  if (!state_) throw UsageError("fiber::Ticker/Timer::reset: the object was moved from");
  bool running, sooner = false;
  {
    std::lock_guard lock(state_->mu);
    running = state_->active;
    if (running) {
      // Its fiber keeps going with the new times: no spawn. A value not yet received is taken
      // back, as stop() would.
      (void)state_->ch.try_recv();
      sooner = first < state_->next;
      state_->next = first;
      state_->period = period;
    }
  }
  if (running) {
    if (sooner) state_->cv.notify_all();  // it waits for the later deadline: wake it to re-wait
    return true;
  }
  const bool pending = stop();  // takes back a value sent and not received
  start(first, period);
  return pending;
}

namespace {
// `at` + `step`, saturating at kNoDeadline.
Deadline later(Deadline at, TickSource::clock::duration step) noexcept {
  return step >= kNoDeadline - at ? kNoDeadline : at + step;
}
}  // namespace

void TickSource::start(Deadline first, clock::duration period) {
  std::uint64_t gen;
  {
    std::lock_guard lock(state_->mu);
    gen = ++state_->gen;
    state_->active = true;
    state_->next = first;
    state_->period = period;
  }
  state_->cv.notify_all();  // a fiber of an overlapping start() is retired too: let it go
  // Owned by the fiber's callable, so it goes when the fiber ends, even one whose body never
  // ran, or with the exception when spawn() throws: the body clears `active` itself on every way
  // out, this for the rest.
  struct Ending {
    std::shared_ptr<State> st;
    std::uint64_t gen;
    Ending(std::shared_ptr<State> s, std::uint64_t g) noexcept : st(std::move(s)), gen(g) {}
    Ending(Ending&& o) noexcept : st(std::move(o.st)), gen(o.gen) {}
    Ending& operator=(Ending&&) = delete;
    ~Ending() {
      if (!st) return;  // moved from
      std::lock_guard lock(st->mu);
      if (st->gen == gen) st->active = false;  // a newer generation's `active` is not ours
    }
  };
  auto body = [end = Ending(state_, gen)] {
    State* const st = end.st.get();
    const std::uint64_t gen = end.gen;
    std::unique_lock lock(st->mu);
    try {
      while (st->gen == gen) {
        const Deadline next = st->next;
        if (next == kNoDeadline || clock::now() < next) {
          // Woken by a notify (moved earlier, or retired), or at `next`: look again either
          // way, since a reset may have moved it while this fiber waited.
          st->cv.wait_until(lock, next);
          continue;
        }
        const clock::time_point now = clock::now();
        st->ch.try_send(now);  // the value not received yet stays: this one drops
        if (st->period <= clock::duration::zero()) {
          st->active = false;  // a Timer: done, under the lock of its send (no reset in between)
          return;
        }
        // The next multiple of the period after now: ticks this fiber was too late for are
        // dropped, not fired in a burst.
        st->next = later(next, st->period * ((now - next) / st->period + 1));
      }
      // Retired: stop() or a newer start() took over `active`.
    } catch (const Cancelled&) {
      // The scheduler is stopping: nothing more will be sent.
    } catch (const ChannelClosed&) {
      // Someone closed the channel, which it does not allow: nothing more can be sent.
    }
    if (!lock.owns_lock()) lock.lock();
    if (st->gen == gen) st->active = false;
  };
  spawn({.scheduler = scheduler_, .name = period > clock::duration::zero() ? "ticker" : "timer"}, std::move(body))
      .detach();
}

}  // namespace detail

void detail::throw_bad_period(const char* what, double seconds) {
  throw UsageError(std::string(what) + ": the period must be positive (got " + std::to_string(seconds) + " s)");
}

}  // namespace fiber
