// fiber::Ticker and fiber::Timer: ticks never early and in order, a slow receiver gets the latest
// tick and none queued, nothing received after stop() or reset() returns, select beside other
// channels, a stopped one leaves no fiber behind (block_on returns), misuse, and stop/reset
// racing the ticks from fibers and threads on 1-8 processors.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Sleeps in a fiber, or in a thread.
void pause(std::chrono::milliseconds d) {
  if (fiber::this_fiber::in_fiber()) {
    fiber::this_fiber::sleep_for(d);
  } else {
    std::this_thread::sleep_for(d);
  }
}

// Nothing arrives on `ch` within `d`.
void expect_silence(fiber::Channel<Clock::time_point>& ch, std::chrono::milliseconds d, const char* what) {
  const auto r = ch.recv_for(d);
  CHECK_MESSAGE(r.status == fiber::ChanStatus::timeout, what);
}

}  // namespace

TEST_CASE("ticker: ticks come a period apart, never early, in order") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      Team team;
      team.spawn(w, s, [&s] {
        constexpr auto kPeriod = 5ms;
        const auto before = Clock::now();
        fiber::Ticker tick(kPeriod, &s);
        Clock::time_point last{};
        for (int k = 1; k <= 5; ++k) {
          const auto t = tick.channel().recv();
          REQUIRE(t.has_value());
          CHECK(*t >= before + k * kPeriod);  // the k-th tick, or a later one (missed ones drop)
          CHECK(*t > last);
          CHECK(Clock::now() >= *t);
          last = *t;
        }
      });
      team.join();
      quiesce(s);  // the Ticker's fiber ends soon after its stop, not with it
    }
  });
}

// How long the first tick takes depends on the machine's load; tests wait for it, never assume.
TEST_CASE("ticker: a slow receiver finds one tick waiting, not the ones it missed") {
  fiber::Ticker tick(2ms);
  REQUIRE(wait_for([&] { return tick.channel().size() == 1; }));
  pause(30ms);  // about fifteen more ticks, unreceived
  CHECK(tick.channel().size() == 1);
  auto first = tick.channel().try_recv();
  REQUIRE(first);
  const auto next = tick.channel().recv();
  REQUIRE(next.has_value());
  CHECK(*next > *first);
}

TEST_CASE("ticker: nothing is received after stop() returns; reset() starts it again") {
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    fiber::Scheduler s({.processors = 2, .name = "tick"});
    Team team;
    team.spawn(w, s, [&s] {
      fiber::Ticker tick(2ms, &s);
      CHECK(tick.channel().recv().has_value());
      pause(10ms);        // a tick waits in the channel
      tick.stop();        // takes it back
      CHECK(tick.channel().size() == 0);
      expect_silence(tick.channel(), 30ms, "a tick after stop()");
      tick.stop();  // again: nothing
      const auto at = Clock::now();
      tick.reset(3ms);
      const auto t = tick.channel().recv();
      REQUIRE(t.has_value());
      CHECK(*t >= at + 3ms);
      pause(10ms);
      tick.reset(1h);  // no stale tick from the old period
      expect_silence(tick.channel(), 30ms, "a tick after reset()");
    });
    team.join();
  }
}

TEST_CASE("timer: fires once; stop() and reset() say whether it was still to be received") {
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    fiber::Scheduler s({.processors = 2, .name = "timer"});
    Team team;
    team.spawn(w, s, [&s] {
      {
        const auto at = Clock::now();
        fiber::Timer t(5ms, &s);
        const auto fired = t.channel().recv();
        REQUIRE(fired.has_value());
        CHECK(*fired >= at + 5ms);
        expect_silence(t.channel(), 20ms, "a second value from a Timer");
        CHECK_FALSE(t.stop());  // received already
        CHECK_FALSE(t.reset(2ms));
        CHECK(t.channel().recv().has_value());  // fires again after a reset
      }
      {
        fiber::Timer t(1h, &s);
        CHECK(t.stop());  // stopped it before it fired
        CHECK_FALSE(t.stop());
        CHECK_FALSE(t.reset(1ms));
        pause(10ms);  // fired, not received
        CHECK(t.stop());  // taken back: it was never received
        expect_silence(t.channel(), 20ms, "a value after stop()");
      }
      {
        fiber::Timer t(-5ms, &s);  // at once
        CHECK(t.channel().recv().has_value());
      }
    });
    team.join();
  }
}

// reset() of a running one keeps its fiber (no spawn: a deadline renewed per message is cheap)
// and moves its deadline either way: earlier wakes the fiber at once (an hour's wait would hang
// the test), later is not fired at the old time.
TEST_CASE("ticker: reset() of a running one moves its deadline without a new fiber") {
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    fiber::Scheduler s({.processors = 2, .name = "rearm"});
    Team team;
    team.spawn(w, s, [&s] {
      fiber::Timer t(1h, &s);
      fiber::Ticker k(1h, &s);
      const std::uint64_t spawned = s.stats().spawned;
      for (int i = 0; i < 1000; ++i) {
        CHECK(t.reset(1h));  // still to fire: true, as Go's Reset
        k.reset(1h);
      }
      CHECK(s.stats().spawned == spawned);
      const auto at = Clock::now();
      CHECK(t.reset(3ms));  // earlier: without a wake, the fiber would wait out its hour
      k.reset(2ms);
      const auto fired = t.channel().recv_for(scaled(10'000ms));
      REQUIRE_MESSAGE(fired.status == fiber::ChanStatus::ok, "the Timer moved earlier did not fire");
      CHECK(*fired.value >= at + 3ms);
      for (int i = 0; i < 3; ++i) {
        const auto tick = k.channel().recv_for(scaled(10'000ms));
        REQUIRE_MESSAGE(tick.status == fiber::ChanStatus::ok, "the Ticker moved earlier did not tick");
        CHECK(*tick.value >= at + 2ms);
      }
      k.reset(1h);  // later (a Ticker is always running): its 2 ms period is gone
      expect_silence(k.channel(), 30ms, "the Ticker at its old period");
      CHECK(s.stats().spawned == spawned);
    });
    team.join();
    quiesce(s);
  }
}

TEST_CASE("ticker: in a select beside another channel") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Channel<int> jobs(0);
    auto producer = fiber::spawn({.scheduler = &s}, [&] {
      for (int i = 0; i < 20; ++i) {
        jobs.send(i);
        fiber::this_fiber::sleep_for(1ms);
      }
      jobs.close();
    });
    // The jobs and the ticks come in one select. On a loaded machine the jobs may all be done
    // before the first tick: then it waits for a tick beside the deadline, which only keeps a
    // lost tick from hanging the test.
    auto consumer = fiber::spawn({.scheduler = &s}, [&] {
      fiber::Ticker tick(2ms);
      fiber::Timer deadline(scaled(20'000ms));
      std::optional<int> job;
      std::optional<Clock::time_point> t;
      int sum = 0, ticks = 0;
      for (bool open = true; open;) {
        switch (fiber::select(fiber::recv_case(jobs, job), fiber::recv_case(tick.channel(), t),
                              fiber::recv_case(deadline.channel(), t))) {
          case 0:
            if (job) {
              sum += *job;
            } else {
              open = false;
            }
            break;
          case 1: ++ticks; break;
          default: FAIL("the deadline passed before the jobs were done"); return std::pair{sum, ticks};
        }
      }
      while (ticks == 0) {
        if (fiber::select(fiber::recv_case(tick.channel(), t), fiber::recv_case(deadline.channel(), t)) != 0) {
          FAIL("the deadline passed before a tick");
          break;
        }
        ++ticks;
      }
      return std::pair{sum, ticks};
    });
    producer.join();
    const auto [sum, ticks] = consumer.join();
    CHECK(sum == 190);
    CHECK(ticks > 0);
    quiesce(s);
  });
}

// A running Ticker is a fiber; stopping or destroying it must end that fiber at once, or a
// block_on around it would wait for its next tick (an hour here).
TEST_CASE("ticker: a stopped or destroyed one leaves no fiber behind, so block_on returns") {
  with_watchdog(30'000ms, "block_on around a stopped Ticker", [] {
    fiber::block_on([] {
      fiber::Ticker hourly(1h);
      fiber::Timer later(1h);
      fiber::Ticker stopped(1h);
      stopped.stop();
    });
    fiber::Scheduler s({.processors = 2, .name = "gone"});
    {
      fiber::Ticker t(1h, &s);
      fiber::Timer u(1h, &s);
    }
    CHECK(wait_for([&] { return s.live_fibers() == 0; }));
  });
}

TEST_CASE("ticker: a period that is not positive is a UsageError") {
  expect_usage_error([] { fiber::Ticker t(0ms); }, "period must be positive");
  expect_usage_error([] { fiber::Ticker t(-1ms); }, "period must be positive");
  fiber::Ticker t(1h);
  expect_usage_error([&] { t.reset(0ns); }, "period must be positive");
  t.reset(1h);  // still usable
  fiber::Ticker moved = std::move(t);
  moved.stop();
  expect_usage_error([&] { t.reset(1h); }, "moved from");  // NOLINT(bugprone-use-after-move)
  fiber::Timer u(1h);
  fiber::Timer v = std::move(u);
  expect_usage_error([&] { (void)u.reset(1h); }, "moved from");  // NOLINT(bugprone-use-after-move)
  CHECK(v.stop());
}

// stop() and reset() from fibers and threads while the ticks come and a fiber receives: no
// crash, no hang, still ticking after a reset, silent after the last stop (TSan checks the rest).
TEST_CASE("ticker: stop and reset racing the ticks, from fibers and threads") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Ticker tick(100us, &s);
    std::atomic<bool> done{false};
    auto receiver = fiber::spawn({.scheduler = &s}, [&] {
      while (!done.load()) {
        (void)tick.channel().recv_for(1ms);
      }
    });
    Team team;
    for (Where w : kBoth) {
      team.spawn(w, s, [&, w] {
        for (int i = 0; i < 200; ++i) {
          if (i % 2 == 0) {
            tick.stop();
          } else {
            tick.reset(w == Where::fiber ? 100us : 150us);
          }
          if (i % 16 == 0) pause(1ms);
        }
      });
    }
    team.join();
    done = true;
    receiver.join();
    tick.reset(100us);  // whatever the race left, it still ticks
    CHECK(tick.channel().recv_for(scaled(10'000ms)));
    tick.stop();
    expect_silence(tick.channel(), 10ms, "a tick after the last stop()");
    quiesce(s);
  });
}

// A Timer re-armed again and again from a fiber and a thread while its deadline keeps passing,
// with a receiver taking what fires: resets that keep the fiber race its sends. Whatever they
// returned, once stop() returns nothing more is received, and a last reset still fires.
TEST_CASE("timer: resets racing its own deadline leave nothing stale after stop()") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Timer t(100us, &s);
    std::atomic<bool> done{false};
    std::atomic<int> fired{0};
    auto receiver = fiber::spawn({.scheduler = &s}, [&] {
      while (!done.load()) {
        if (t.channel().recv_for(1ms)) ++fired;
      }
    });
    Team team;
    for (Where w : kBoth) {
      team.spawn(w, s, [&] {
        for (int i = 0; i < 300; ++i) {
          (void)t.reset(std::chrono::microseconds(50 + i % 3 * 50));
          if (i % 32 == 0) pause(1ms);
        }
      });
    }
    team.join();
    done = true;
    receiver.join();
    MESSAGE(fired.load() << " values received during the resets");
    (void)t.stop();
    expect_silence(t.channel(), 10ms, "a value after stop()");
    CHECK_FALSE(t.reset(1ms));  // stopped: nothing was still to come
    CHECK(t.channel().recv_for(scaled(10'000ms)));
    // A reset landing just as the Timer fires, with nobody receiving: whichever way it goes,
    // the Timer fires once more. (A fiber that ended after its send, apart from the step that
    // marks it done, would let the reset keep a fiber that is gone: nothing would come.)
    for (int i = 0; i < 200; ++i) {
      (void)t.reset(50us);
      for (const auto until = Clock::now() + std::chrono::microseconds(i % 5 * 25); Clock::now() < until;) {
      }
      (void)t.reset(50us);
      REQUIRE_MESSAGE(t.channel().recv_for(scaled(10'000ms)), "round " << i << ": a reset Timer never fired");
    }
    quiesce(s);
  });
}

// Resets of a stopped one racing each other and stops, so that several start a fiber at once:
// every generation but the last ends, none is left waiting out its hour (quiesce would time out
// waiting for it).
TEST_CASE("ticker: resets racing each other leave one fiber, and none once stopped") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (int round = 0; round < 20; ++round) {
      fiber::Timer t(1h, &s);
      Team team;
      for (Where w : kBoth) {
        team.spawn(w, s, [&] {
          for (int i = 0; i < 20; ++i) {
            t.stop();
            t.reset(1h);
          }
        });
      }
      team.join();
      // One fiber left: every generation a later start() retired has ended (not waiting out
      // its hour, which a block_on would wait for).
      CHECK(wait_for([&] { return s.live_fibers() == 1; }));
      CHECK(t.stop());
    }
    quiesce(s);
  });
}

TEST_CASE("ticker: durations too long to represent never fire, and do not overflow") {
  fiber::Timer never(std::chrono::hours::max());
  fiber::Timer also_never(std::chrono::nanoseconds::max());
  fiber::Ticker rare(std::chrono::hours::max());
  expect_silence(never.channel(), 20ms, "a Timer of hours::max()");
  CHECK(also_never.channel().size() == 0);
  CHECK(rare.channel().size() == 0);
  CHECK(never.stop());  // it was still to fire
  rare.reset(std::chrono::seconds::max());
  rare.stop();
}

TEST_CASE("ticker: a closed channel or a stopped scheduler ends its fiber quietly") {
  {
    fiber::Ticker t(1ms);
    t.channel().close();  // not allowed by the header, but must not abort the process
    pause(20ms);
    t.stop();
  }
  fiber::Scheduler s({.processors = 1, .name = "stopping"});
  fiber::Timer t(1h, &s);
  fiber::Timer u(1h, &s);
  s.stop();  // cancels the timers' fibers
  CHECK(wait_for([&] { return s.live_fibers() == 0; }));
  CHECK_FALSE(t.stop());  // it could no longer fire
  // Its fiber is gone: a reset cannot just move its deadline, it must start one, which a
  // stopped scheduler refuses (rather than a true that nothing would ever follow).
  CHECK_THROWS_AS((void)u.reset(1ms), fiber::UsageError);
  CHECK_FALSE(u.stop());  // the failed spawn left it stopped: nothing is to come
}
