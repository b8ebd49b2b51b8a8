// this_fiber: yield, sleep_for/sleep_until, id, name, processor_index, PinGuard - in fibers and
// from plain threads (fiber/this_fiber.hpp).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {
using namespace fiber_test;
using namespace std::chrono_literals;
}  // namespace

TEST_CASE("yield: from a plain thread is std::this_thread::yield") {
  CHECK_FALSE(fiber::this_fiber::in_fiber());
  CHECK_NOTHROW(fiber::this_fiber::yield());
  for (int i = 0; i < 100; ++i) fiber::this_fiber::yield();
  run_on_thread([] { CHECK_NOTHROW(fiber::this_fiber::yield()); });
}

TEST_CASE("yield: two fibers on one processor alternate strictly") {
  // No watchdog: if this thread is preempted for its threshold, the monitor moves the fiber in
  // the yield slot to the injector, and for a moment it is in neither, so the other one's yield
  // finds nothing else to run. The order checked here is the scheduler's own.
  fiber::Scheduler s({.processors = 1, .name = "t", .watchdog = {.enabled = false}});
  constexpr int kRounds = 500;
  std::mutex mu;
  std::vector<char> order;
  std::atomic<int> started{0};
  auto body = [&](char me) {
    // Both must be running before the recording starts: a fiber yielding while nothing else is
    // runnable simply continues.
    started.fetch_add(1);
    while (started.load() < 2) fiber::this_fiber::yield();
    for (int i = 0; i < kRounds; ++i) {
      {
        std::lock_guard lock(mu);
        order.push_back(me);
      }
      fiber::this_fiber::yield();
    }
  };
  auto a = fiber::spawn({.scheduler = &s}, body, 'A');
  auto b = fiber::spawn({.scheduler = &s}, body, 'B');
  with_watchdog(20'000ms, "alternation", [&] {
    a.join();
    b.join();
  });
  REQUIRE(order.size() == 2 * kRounds);
  int breaks = 0;
  std::size_t first_break = 0;
  for (std::size_t i = 1; i < order.size(); ++i) {
    if (order[i] == order[i - 1]) {
      if (breaks++ == 0) first_break = i;
    }
  }
  CHECK_MESSAGE(breaks == 0, breaks << " places where a fiber ran twice in a row, first at index " << first_break);
  CHECK(s.live_fibers() == 0);
}

TEST_CASE("yield: a fiber yielding in a loop does not starve the others (1 processor)") {
  fiber::Scheduler s({.processors = 1, .name = "t"});
  std::atomic<bool> stop{false};
  auto spinner = fiber::spawn({.scheduler = &s}, [&] {
    long n = 0;
    while (!stop.load()) {
      fiber::this_fiber::yield();
      ++n;
    }
    return n;
  });
  // Sleeping and newly spawned fibers still get to run.
  auto sleeper = fiber::spawn({.scheduler = &s}, [] {
    for (int i = 0; i < 5; ++i) fiber::this_fiber::sleep_for(1ms);
    return 1;
  });
  with_watchdog(20'000ms, "yield starvation", [&] {
    CHECK(sleeper.join() == 1);
    for (int i = 0; i < 20; ++i) CHECK(fiber::spawn({.scheduler = &s}, [i] { return i; }).join() == i);
    stop = true;
    CHECK(spinner.join() > 0);
  });
}

// Two fibers yielding to each other pass the yield slot back and forth; a fiber queued in the
// ring meanwhile still gets its turn (the slot's fiber waits for the picks of those queued when
// it yielded). The queued one is pinned and woken from a plain thread, so it reaches the ring
// through the processor's inbox without either yielding fiber being queued behind it.
TEST_CASE("yield: two fibers yielding to each other do not starve a queued one (1 processor)") {
  with_watchdog(20'000ms, "yield pair starvation", [] {
    fiber::Scheduler s({.processors = 1, .name = "pair"});
    std::atomic<bool> stop{false};
    std::atomic<long> yields[2] = {0, 0};
    fiber::Channel<int> wake;
    auto pinned = fiber::spawn({.scheduler = &s}, [&] {
      fiber::this_fiber::PinGuard pin;
      return wake.recv().value_or(-1);
    });
    auto yielder = [&](int me) {
      long n = 0;
      while (!stop.load()) {
        fiber::this_fiber::yield();
        yields[me].fetch_add(1);
        ++n;
      }
      return n;
    };
    auto a = fiber::spawn({.scheduler = &s}, yielder, 0);
    auto b = fiber::spawn({.scheduler = &s}, yielder, 1);
    // The pair is in place before the wake: each has yielded many times. (Waiting for the sum
    // let a loaded machine send the wake while the second one was still in the injector.)
    REQUIRE(wait_for([&] { return yields[0].load() > 1000 && yields[1].load() > 1000; }));
    wake.send(7);  // from this plain thread: the pinned fiber goes through the inbox
    CHECK_MESSAGE(pinned.wait_for(scaled(5'000ms)), "the woken fiber never ran behind the yielding pair");
    // And the pair goes on, both of them, after it.
    const long a_then = yields[0].load(), b_then = yields[1].load();
    CHECK(wait_for([&] { return yields[0].load() > a_then + 1000 && yields[1].load() > b_then + 1000; }));
    stop = true;
    CHECK(pinned.join() == 7);
    a.join();
    b.join();
  });
}

// A yield goes to the processor's yield slot, which other processors cannot steal from, only
// while every processor is busy. Two fibers yielding to each other on one processor while the
// other is held by a spinner (the watchdog moves anything queued behind the spinner) must spread
// out once the spinner ends and its processor goes idle: they then run at the same time.
TEST_CASE("yield: fibers yielding on one processor spread out when another goes idle (2 processors)") {
  with_watchdog(60'000ms, "yield spread", [] {
    fiber::Scheduler s({.processors = 2, .name = "spread"});
    std::atomic<int> yields{0};
    std::atomic<int> inside{0};
    std::atomic<bool> overlapped{false};
    auto spinner = fiber::spawn({.scheduler = &s}, [&] {
      const auto deadline = Clock::now() + scaled(20'000ms);
      while (yields.load() < 400 && Clock::now() < deadline) {
      }
      return yields.load() >= 400;
    });
    auto yielder = [&] {
      const auto deadline = Clock::now() + scaled(20'000ms);
      while (!overlapped.load() && Clock::now() < deadline) {
        inside.fetch_add(1);
        for (int k = 0; k < 2000 && !overlapped.load(); ++k) {
          if (inside.load() == 2) overlapped.store(true);
        }
        inside.fetch_sub(1);
        yields.fetch_add(1);
        fiber::this_fiber::yield();
      }
      return overlapped.load();
    };
    auto a = fiber::spawn({.scheduler = &s}, yielder);
    auto b = fiber::spawn({.scheduler = &s}, yielder);
    CHECK(spinner.join());
    CHECK_MESSAGE(a.join(), "the two yielding fibers never ran at the same time after a processor went idle");
    CHECK(b.join());
  });
}

// A channel pair wakes each other into the LIFO slot at every step; past the LIFO limit the
// queue gets a pick, and a fiber waiting in the yield slot counts as queued.
TEST_CASE("yield: a channel ping-pong pair does not starve a yielding fiber (1 processor)") {
  with_watchdog(20'000ms, "yield behind a ping-pong pair", [] {
    fiber::Scheduler s({.processors = 1, .name = "pp-yield"});
    std::atomic<bool> stop{false};
    std::atomic<long> yields{0};
    fiber::Channel<int> ping, pong;
    auto yielder = fiber::spawn({.scheduler = &s}, [&] {
      while (!stop.load()) {
        fiber::this_fiber::yield();
        yields.fetch_add(1);
      }
    });
    auto echo = fiber::spawn({.scheduler = &s}, [&] {
      while (std::optional<int> v = ping.recv()) pong.send(*v);
    });
    auto driver = fiber::spawn({.scheduler = &s}, [&] {
      long n = 0;
      while (!stop.load()) {
        ping.send(1);
        n += *pong.recv();
      }
      ping.close();
      return n;
    });
    // Both loops run for good: the yielder must keep advancing while the pair does.
    REQUIRE(wait_for([&] { return yields.load() > 10; }));
    const long before = yields.load();
    CHECK_MESSAGE(wait_for([&] { return yields.load() > before + 1000; }, 5'000ms),
                  "the yielding fiber advanced only " << yields.load() - before << " times behind the pair");
    stop = true;
    CHECK(driver.join() > 0);
    echo.join();
    yielder.join();
  });
}

TEST_CASE("yield: a fiber yielding in a loop lets a compact-stack fiber run (1 processor)") {
  // A compact fiber is never switched to directly: the yielder hands it to the loop and must
  // still yield itself, or its loop takes the compact fiber back on every turn.
  if (kSanitized) return;  // sanitizer checks need far more than a compact stack
  fiber::Scheduler s({.processors = 1, .name = "t"});
  std::atomic<bool> ran{false};
  auto yielder = fiber::spawn({.scheduler = &s}, [&] {
    fiber::spawn({.stack_size = fiber::compact_stack_size}, [&] { ran = true; }).detach();
    CHECK_FALSE(ran.load());  // not switched to directly: it runs only once we yield
    while (!ran.load()) fiber::this_fiber::yield();
  });
  with_watchdog(20'000ms, "a compact fiber behind a yield loop", [&] { yielder.join(); });
}

namespace {
// Fibers spawned from a plain thread go to the injector; on one processor they must still run
// while `busy` keeps the processor switching. Both patterns below wake a fiber into the LIFO
// slot at a fixed phase of the processor's ticks.
void check_injector_not_starved(const char* what, const std::function<long(fiber::Scheduler&, std::atomic<bool>&)>& busy) {
  fiber::Scheduler s({.processors = 1, .name = "t"});
  std::atomic<bool> stop{false};
  auto runner = fiber::spawn({.scheduler = &s}, [&] { return busy(s, stop); });
  with_watchdog(20'000ms, what, [&] {
    for (int i = 0; i < 20; ++i) CHECK(fiber::spawn({.scheduler = &s}, [i] { return i; }).join() == i);
    stop = true;
    CHECK(runner.join() > 0);
  });
}
}  // namespace

TEST_CASE("scheduler: a ping-ponging pair does not starve fibers spawned from a plain thread (1 processor)") {
  check_injector_not_starved("injector starvation behind a ping-ponging pair", [](fiber::Scheduler& s, auto& stop) {
    fiber::Channel<int> ping(0), pong(0);
    auto echo = fiber::spawn({.scheduler = &s}, [&] {
      while (auto v = ping.recv()) pong.send(*v);
    });
    long rounds = 0;
    for (; !stop.load(std::memory_order_relaxed); ++rounds) {
      ping.send(1);
      pong.recv();
    }
    ping.close();
    echo.join();
    return rounds;
  });
}

TEST_CASE("scheduler: a sender that yields after each send does not starve fibers spawned from a plain thread (1 processor)") {
  // Each send wakes the receiver into the LIFO slot, each yield puts the sender in the ring:
  // ring and LIFO picks alternate, and the LIFO cap is never reached.
  check_injector_not_starved("injector starvation behind a yielding sender", [](fiber::Scheduler& s, auto& stop) {
    fiber::Channel<int> ch(1);
    auto receiver = fiber::spawn({.scheduler = &s}, [&] {
      long n = 0;
      while (ch.recv()) ++n;
      return n;
    });
    long sent = 0;
    for (; !stop.load(std::memory_order_relaxed); ++sent) {
      ch.send(1);
      fiber::this_fiber::yield();
    }
    ch.close();
    CHECK(receiver.join() == sent);
    return sent;
  });
}

// End to end, the order fibers resume in also depends on the OS: a processor thread that is not
// scheduled until two deadlines have passed fires both timers at once, and the fibers then run
// in whatever order the run queue gives (the LIFO slot reverses a pair, as Go's runnext does).
// So an attempt out of order is tried again: a timer that fires late every time (on the wrong
// processor, or only with a later one) fails all of them. The firing order itself is checked
// deterministically in test_timer_queue.cpp. No fiber may ever wake early.
TEST_CASE("sleep: fibers wake in deadline order (30, 10, 20 ms)") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::mutex mu;
    std::vector<int> woke;
    bool early = false;
    auto attempt = [&](bool absolute, std::initializer_list<int> delays_ms) {
      woke.clear();
      const auto base = Clock::now();
      std::vector<fiber::JoinHandle<void>> hs;
      for (int ms : delays_ms) {
        hs.push_back(fiber::spawn({.scheduler = &s}, [&, absolute, ms] {
          // sleep_until: from a common base. sleep_for: from when each fiber starts.
          const auto start = Clock::now();
          const auto deadline = (absolute ? base : start) + std::chrono::milliseconds(ms);
          if (absolute) fiber::this_fiber::sleep_until(deadline); else fiber::this_fiber::sleep_for(deadline - start);
          const bool too_early = Clock::now() < deadline;
          std::lock_guard lock(mu);
          woke.push_back(ms);
          early |= too_early;
        }));
      }
      for (auto& h : hs) h.join();
      std::vector<int> sorted(delays_ms);
      std::sort(sorted.begin(), sorted.end());
      return woke == sorted;
    };
    for (bool absolute : {true, false}) {
      CAPTURE(absolute);
      bool in_order = false;
      for (int i = 0; i < 3 && !in_order; ++i) {
        // sleep_for spaces them more: each is relative to its own fiber's start.
        in_order = absolute ? attempt(true, {30, 10, 20}) : attempt(false, {90, 30, 60, 0, 45});
        if (!in_order) MESSAGE("attempt " << i << " out of order: " << doctest::toString(woke));
      }
      CHECK_MESSAGE(in_order, "every attempt woke out of deadline order, the last " << doctest::toString(woke));
      CHECK_FALSE(early);
    }
  });
}

// Deadlines that pass while the processor is busy are all due at its next timer pass. Each wake
// took the LIFO slot and pushed the one before it to the back of the queue, so such a batch ran
// last-first-then-the-rest (3, 0, 1, 2): now it runs in deadline order. One processor, so that
// nothing else runs them; 40 sleepers, more than one claim batch of the timer queue.
TEST_CASE("sleep: deadlines that pass together wake in deadline order (1 processor)") {
  fiber::Scheduler s({.processors = 1, .name = "sleep-order"});
  constexpr int kSleepers = 40;
  std::vector<int> woke;  // one processor: no lock needed
  fiber::spawn({.scheduler = &s}, [&] {
    const auto t0 = Clock::now() + 30ms;
    std::vector<fiber::JoinHandle<void>> hs;
    for (int i = 0; i < kSleepers; ++i) {
      hs.push_back(fiber::spawn([&, i] {
        fiber::this_fiber::sleep_until(t0 + std::chrono::microseconds(i));
        woke.push_back(i);
      }));
    }
    // Busy from before the first deadline until after the last, without a switch: they all
    // come due in the one timer pass after it.
    fiber::this_fiber::sleep_until(t0 - 2ms);
    while (Clock::now() < t0 + std::chrono::microseconds(kSleepers) + 1ms) {
    }
    for (auto& h : hs) h.join();
  }).join();
  std::vector<int> in_order(kSleepers);
  std::iota(in_order.begin(), in_order.end(), 0);
  std::string order;
  for (int i : woke) order += std::to_string(i) + " ";
  CHECK_MESSAGE(woke == in_order, "woke in the order " << order);
}

TEST_CASE("sleep: many fibers with staggered deadlines all wake, none early") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kFibers = 200;
    std::atomic<int> early{0};
    std::atomic<int> done{0};
    const auto base = Clock::now() + 5ms;
    std::vector<fiber::JoinHandle<void>> hs;
    for (int i = 0; i < kFibers; ++i) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&, i] {
        // Several sleeps each, so timers are added on whichever processor the fiber is on now.
        for (int k = 0; k < 3; ++k) {
          const auto deadline = base + std::chrono::microseconds(100 * ((i * 7 + k * 13) % 97)) + k * 5ms;
          fiber::this_fiber::sleep_until(deadline);
          if (Clock::now() < deadline) early.fetch_add(1);
        }
        done.fetch_add(1);
      }));
    }
    for (auto& h : hs) h.join();
    CHECK(done.load() == kFibers);
    CHECK(early.load() == 0);
  });
}

TEST_CASE("sleep: zero, negative and past deadlines return at once") {
  // Plain thread: an hour in the past, so a sign slip (sleeping |d|) or a duration taken as a
  // huge unsigned one hangs into the watchdog.
  with_watchdog(10'000ms, "zero sleeps on a plain thread", [] {
    fiber::this_fiber::sleep_for(0ms);
    fiber::this_fiber::sleep_for(-1h);
    fiber::this_fiber::sleep_for(std::chrono::nanoseconds(-1));
    fiber::this_fiber::sleep_until(Clock::now() - 1h);
    fiber::this_fiber::sleep_until(Clock::time_point{});
  });

  for_each_proc_count([](fiber::Scheduler& s, int) {
    // In a fiber they do not wait on a timer at all: no park for Sleep (a yield at most).
    const auto sleep_parks = [&s] {
      return s.stats().parks[static_cast<std::size_t>(fiber::detail::ParkReason::Sleep)];
    };
    const std::uint64_t before = sleep_parks();
    fiber::spawn({.scheduler = &s}, [] {
      for (int i = 0; i < 100; ++i) {
        fiber::this_fiber::sleep_for(0ms);
        fiber::this_fiber::sleep_for(-1ms);
        fiber::this_fiber::sleep_for(std::chrono::nanoseconds(-1));
        fiber::this_fiber::sleep_until(Clock::now() - 10ms);
        fiber::this_fiber::sleep_until(Clock::time_point{});
      }
    }).join();
    CHECK(sleep_parks() == before);
    // A short positive sleep really sleeps.
    auto slept = fiber::spawn({.scheduler = &s}, [] {
      const auto start = Clock::now();
      fiber::this_fiber::sleep_for(5ms);
      return Clock::now() - start;
    }).join();
    CHECK(slept >= 5ms);
  });
}

TEST_CASE("this_fiber::id: nonzero and unique in fibers, 0 on a plain thread") {
  CHECK(fiber::this_fiber::id() == 0);
  run_on_thread([] { CHECK(fiber::this_fiber::id() == 0); });
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kFibers = 500;
    std::vector<fiber::JoinHandle<std::pair<unsigned long long, unsigned long long>>> hs;
    for (int i = 0; i < kFibers; ++i) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [] {
        const auto before = fiber::this_fiber::id();
        fiber::this_fiber::sleep_for(100us);  // the id follows the fiber, not the thread
        fiber::this_fiber::yield();
        return std::make_pair(before, fiber::this_fiber::id());
      }));
    }
    std::set<unsigned long long> ids;
    int unstable = 0;
    int zero = 0;
    for (auto& h : hs) {
      const auto expected = h.id();
      auto [a, b] = h.join();
      unstable += (a != b) || (a != expected);
      zero += a == 0;
      ids.insert(a);
    }
    CHECK(unstable == 0);
    CHECK(zero == 0);
    CHECK(ids.size() == static_cast<std::size_t>(kFibers));
  });
}

TEST_CASE("this_fiber: in_fiber, name, processor_index and PinGuard from a plain thread") {
  auto check_plain = [] {
    CHECK_FALSE(fiber::this_fiber::in_fiber());
    CHECK_THROWS_AS(fiber::this_fiber::name(), fiber::UsageError);
    CHECK_THROWS_AS(fiber::this_fiber::processor_index(), fiber::UsageError);
    CHECK_THROWS_AS(fiber::this_fiber::PinGuard(), fiber::UsageError);
    try {
      (void)fiber::this_fiber::name();
    } catch (const fiber::UsageError& e) {
      CHECK_MESSAGE(contains(e.what(), "plain thread"), "message: " << e.what());
    }
  };
  check_plain();
  run_on_thread(check_plain);

  fiber::Scheduler s({.processors = 2, .name = "t"});
  auto r = fiber::spawn({.scheduler = &s}, [] {
    const bool in = fiber::this_fiber::in_fiber();
    const std::string name(fiber::this_fiber::name());
    const unsigned idx = fiber::this_fiber::processor_index();
    { fiber::this_fiber::PinGuard pin; }
    return std::make_tuple(in, name, idx);
  }).join();
  CHECK(std::get<0>(r));
  CHECK(std::get<1>(r) == "");  // unnamed
  CHECK(std::get<2>(r) < 2u);
}
