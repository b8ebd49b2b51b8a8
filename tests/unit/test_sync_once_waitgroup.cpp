// fiber::Once (call_once semantics: one run, concurrent callers wait, an exception lets the next
// caller retry, recursion is an error) and fiber::WaitGroup (waiting with fibers and threads, a
// negative counter is an error - also under concurrent add/done - and timed waits).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

}  // namespace

// ------------------------------------------------------------------------------ Once

TEST_CASE("once: runs once; concurrent callers wait for it and see its effects") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Once once;
    std::atomic<int> runs{0};
    int value = 0;  // written by the run, read by everyone after call() (TSan checks the ordering)
    Team team;
    for (int i = 0; i < 12; ++i) {
      team.spawn(i % 3 == 0 ? Where::thread : Where::fiber, s, [&] {
        once.call([&] {
          runs.fetch_add(1);
          fiber::this_fiber::sleep_for(2ms);  // others arrive meanwhile and must wait
          value = 42;
        });
        CHECK(value == 42);
        CHECK(once.done());
      });
    }
    team.join();
    CHECK(runs.load() == 1);
    fiber::call_once(once, [&] { runs.fetch_add(1); });
    CHECK(runs.load() == 1);
  });
}

TEST_CASE("once: an exception lets the next caller retry; recursion is a UsageError") {
  fiber::Once once;
  int attempts = 0;
  auto flaky = [&](int fail_until) {
    ++attempts;
    if (attempts < fail_until) throw std::runtime_error("not yet");
  };
  CHECK_THROWS_AS(once.call(flaky, 3), std::runtime_error);
  CHECK_FALSE(once.done());
  CHECK_THROWS_AS(once.call(flaky, 3), std::runtime_error);
  once.call(flaky, 3);
  CHECK(once.done());
  once.call(flaky, 3);
  CHECK(attempts == 3);

  fiber::Once rec;
  expect_usage_error([&] { rec.call([&] { rec.call([] {}); }); }, "recursively");
  CHECK_FALSE(rec.done());
  rec.call([] {});
  CHECK(rec.done());

  // Waiters woken by a failed run: exactly one of them runs it next.
  fiber::Scheduler s({.processors = 2, .name = "once"});
  fiber::Once o2;
  std::atomic<int> runs{0}, failures{0};
  Team team;
  for (int i = 0; i < 8; ++i) {
    team.spawn(i % 2 ? Where::thread : Where::fiber, s, [&] {
      try {
        o2.call([&] {
          fiber::this_fiber::sleep_for(1ms);
          if (runs.fetch_add(1) < 2) throw std::runtime_error("fail");
        });
      } catch (const std::runtime_error&) {
        failures.fetch_add(1);
      }
    });
  }
  team.join();
  CHECK(failures.load() == 2);
  CHECK(runs.load() == 3);
  CHECK(o2.done());
}

TEST_CASE("once: a cancelled waiter throws Cancelled") {
  fiber::Scheduler s({.processors = 2, .name = "oc"});
  fiber::Once once;
  std::atomic<bool> release{false}, running{false};
  std::thread runner([&] {
    once.call([&] {
      running = true;
      while (!release) std::this_thread::sleep_for(100us);
    });
  });
  CHECK(wait_for([&] { return running.load(); }));
  auto h = spawn_cancellable(s, [&] { once.call([] { FAIL_CHECK("ran twice"); }); });
  std::this_thread::sleep_for(1ms);
  h.cancel();
  CHECK(h.join());  // threw Cancelled
  release = true;
  runner.join();
  CHECK(once.done());
}

// ------------------------------------------------------------------------------ WaitGroup

// Its counter is written by every finishing fiber: it shares its cache line with nothing, on a
// thread's stack, a fiber's stack (realigned in the frame) and the heap.
TEST_CASE("waitgroup: has a cache line to itself wherever it lives") {
  static_assert(sizeof(fiber::WaitGroup) % 64 == 0);
  auto line_aligned = [](const fiber::WaitGroup& wg) { return reinterpret_cast<std::uintptr_t>(&wg) % 64 == 0; };
  fiber::WaitGroup on_thread;
  CHECK(line_aligned(on_thread));
  CHECK(fiber::block_on([&] {
    fiber::WaitGroup on_fiber;
    return line_aligned(on_fiber);
  }));
  auto on_heap = std::make_unique<fiber::WaitGroup>();
  CHECK(line_aligned(*on_heap));
}

TEST_CASE("waitgroup: fibers and threads wait for fibers and threads") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::WaitGroup wg;
    const int workers = 10;
    std::atomic<int> finished{0};
    wg.add(workers);
    Team team;
    for (int i = 0; i < workers; ++i) {
      team.spawn(i % 3 == 0 ? Where::thread : Where::fiber, s, [&] {
        fiber::this_fiber::sleep_for(1ms);
        finished.fetch_add(1);
        wg.done();
      });
    }
    std::atomic<int> waiters_ok{0};
    for (int i = 0; i < 4; ++i) {
      team.spawn(i % 2 ? Where::thread : Where::fiber, s, [&] {
        wg.wait();
        CHECK(finished.load() == workers);
        waiters_ok.fetch_add(1);
      });
    }
    team.join();
    CHECK(waiters_ok.load() == 4);
    CHECK(wg.count() == 0);
    wg.wait();  // zero: returns at once
  });
}

TEST_CASE("waitgroup: a negative counter is a UsageError, also under concurrent add/done") {
  fiber::WaitGroup wg;
  expect_usage_error([&] { wg.done(); }, "negative");
  CHECK(wg.count() == 0);
  wg.add(2);
  expect_usage_error([&] { wg.add(-3); }, "negative");
  CHECK(wg.count() == 2);
  wg.add(-2);
  // Beyond the counter's range: an error too, not a signed overflow (undefined; in practice a
  // wrap to a negative count).
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  wg.add(kMax);
  expect_usage_error([&] { wg.add(1); }, "overflow");
  expect_usage_error([&] { wg.add(kMax); }, "overflow");
  CHECK(wg.count() == kMax);
  wg.add(-kMax);
  CHECK(wg.count() == 0);
  // Regression: a failing add(-2) must never make a concurrent, valid done() fail (the old add
  // applied the delta and undid it, so others could see the transient negative value). Two
  // threads meet at a spin barrier every round and act after a random jitter of a few dozen
  // cycles, so the two calls overlap in every possible order.
  const int rounds = kTsan ? 3000 : (kSanitized ? 10000 : 30000);
  std::atomic<int> spurious{0}, missed_errors{0};
  std::atomic<int> arrived{0}, generation{0};
  auto spin_barrier = [&] {
    const int g = generation.load();
    if (arrived.fetch_add(1) == 1) {
      arrived.store(0);
      generation.fetch_add(1);
    } else {
      for (int spins = 0; generation.load() == g; ++spins) {
        if (spins < 256) __builtin_ia32_pause(); else std::this_thread::yield();  // partner descheduled
      }
    }
  };
  auto jitter = [](std::minstd_rand& rng) {
    for (unsigned j = rng() % 48; j > 0; --j) __builtin_ia32_pause();
  };
  std::thread bad([&] {
    std::minstd_rand rng(7);
    for (int r = 0; r < rounds; ++r) {
      spin_barrier();
      jitter(rng);
      try {
        wg.add(-2);  // the counter is 1 or 0: always an error
        missed_errors.fetch_add(1);
      } catch (const fiber::UsageError&) {
      }
      spin_barrier();
    }
  });
  std::minstd_rand rng(8);
  for (int r = 0; r < rounds; ++r) {
    wg.add(1);
    spin_barrier();
    jitter(rng);
    try {
      wg.done();
    } catch (const fiber::UsageError&) {
      spurious.fetch_add(1);
      wg.done();
    }
    spin_barrier();
    if (wg.count() != 0) {
      FAIL_CHECK("round " << r << ": count " << wg.count());
      while (wg.count() > 0) wg.done();
    }
  }
  bad.join();
  CHECK(spurious.load() == 0);
  CHECK(missed_errors.load() == 0);
}

TEST_CASE("waitgroup: timed wait is never early") {
  for (Where w : {Where::fiber, Where::thread}) {
    fiber::Scheduler s({.processors = 1, .name = "wgt"});
    Team team;
    team.spawn(w, s, [] {
      fiber::WaitGroup wg;
      CHECK(wg.wait_for(-1s));
      wg.add(1);
      auto t0 = Clock::now();
      CHECK_FALSE(wg.wait_for(15ms));
      CHECK(Clock::now() - t0 >= 15ms);
      CHECK_FALSE(wg.wait_until(Clock::now() - 1s));
      wg.done();
      CHECK(wg.wait_until(Clock::now() + 1h));
    });
    team.join();
  }
}
