// Idle protocol stress: 10^6 cycles in which work appears while processors are going to sleep.
//
// Every cycle is a round trip with a plain thread that blocks until the fiber side answers, so
// between cycles every processor runs out of work, searches and parks; the next cycle's spawn
// or wake then races with those transitions. A lost wakeup (work published while the last
// searcher decided to sleep and nobody woke a processor for it) leaves a cycle hanging forever:
// the watchdog turns that into a failure instead of a stuck suite.
//
// The cycles are split over configurations (processor counts 2, 4, 8; spawn vs. wake of a
// parked fiber; WaitGroup vs. join; one or two driving threads; wakes of a pinned fiber, which
// go through its processor's inbox, mixed with spawns through the injector). Every WaitGroup is
// used for one cycle only and outlives the scheduler's fibers (see test_util.hpp on lifetimes).
// The pinned mix bounds each wait itself, reports a lost wakeup as a failed check and rescues
// the stranded fiber, so the rest of the suite still runs.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

// Cycle counts per configuration; they add up to 1,000,000 in a normal build.
constexpr long kScaleDiv = kTsan ? 20 : (kSanitized ? 4 : 1);
constexpr long cycles(long n) { return n / kScaleDiv; }

constexpr long kSpawnWg2 = cycles(250'000);     // 2 processors: spawn, fiber does wg.done()
constexpr long kSpawnJoin4 = cycles(200'000);   // 4 processors: spawn, thread joins
constexpr long kPingPong2 = cycles(200'000);    // 2 processors: wake a parked fiber and back
constexpr long kTwoThreads8 = cycles(150'000);  // 8 processors: two threads spawning at once (total)
constexpr long kFanOut4 = cycles(100'000);      // 4 processors: the fiber spawns two children
constexpr long kPinnedMix4 = cycles(100'000);   // 4 processors: wake a pinned fiber / spawn, alternately
static_assert(kScaleDiv != 1 ||
              kSpawnWg2 + kSpawnJoin4 + kPingPong2 + kTwoThreads8 + kFanOut4 + kPinnedMix4 == 1'000'000);

// Limit for one configuration; a normal run takes a few seconds each.
constexpr auto kConfigLimit = 120'000ms;

// Waits for wg to reach zero from a plain thread, but gives up after `limit`: used where a lost
// wakeup is expected to be possible and must be reported (and rescued) rather than hang.
bool bounded_wait(fiber::WaitGroup& wg, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + scaled(limit);
  for (int spins = 0; wg.count() != 0; ++spins) {
    if (spins < 2000) {
      std::this_thread::yield();
    } else {
      if (Clock::now() >= deadline) return wg.count() == 0;
      std::this_thread::sleep_for(50us);
    }
  }
  return true;
}

struct Timer {
  Clock::time_point start = Clock::now();
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start).count(); }
};

}  // namespace

TEST_CASE("Idle protocol: 10^6 spawn/park cycles with no lost wakeup") {
  long total = 0;

  SUBCASE("2 processors: spawn from a thread, WaitGroup back") {
    auto wgs = std::make_unique<fiber::WaitGroup[]>(kSpawnWg2);
    long completed = 0;
    {
      fiber::Scheduler s({.processors = 2, .name = "idle2"});
      Timer t;
      with_watchdog(kConfigLimit, "idle: 2 processors, spawn + WaitGroup", [&] {
        for (long i = 0; i < kSpawnWg2; ++i) {
          fiber::WaitGroup& wg = wgs[i];
          wg.add(1);
          fiber::spawn({.scheduler = &s}, [&wg] { wg.done(); }).detach();
          wg.wait();
          ++completed;
        }
      });
      MESSAGE(kSpawnWg2 << " spawn/WaitGroup cycles on 2 processors in " << t.seconds() << " s");
      quiesce(s);
    }  // the scheduler (and so every fiber) is gone before the WaitGroups
    CHECK(completed == kSpawnWg2);
    total += completed;
  }

  SUBCASE("4 processors: spawn from a thread, join") {
    fiber::Scheduler s({.processors = 4, .name = "idle4"});
    long sum = 0;
    Timer t;
    with_watchdog(kConfigLimit, "idle: 4 processors, spawn + join", [&] {
      for (long i = 0; i < kSpawnJoin4; ++i) sum += fiber::spawn({.scheduler = &s}, [i] { return i & 1; }).join();
    });
    MESSAGE(kSpawnJoin4 << " spawn/join cycles on 4 processors in " << t.seconds() << " s");
    CHECK(sum == kSpawnJoin4 / 2);
    CHECK(s.live_fibers() == 0);
    total += kSpawnJoin4;
  }

  SUBCASE("2 processors: wake a parked fiber from a thread and back") {
    auto ping = std::make_unique<fiber::WaitGroup[]>(kPingPong2);
    auto pong = std::make_unique<fiber::WaitGroup[]>(kPingPong2);
    for (long i = 0; i < kPingPong2; ++i) {
      ping[i].add(1);
      pong[i].add(1);
    }
    long answered = 0;
    {
      fiber::Scheduler s({.processors = 2, .name = "pp2"});
      // A second, always-parked fiber keeps the scheduler from being trivially empty.
      fiber::WaitGroup hold;
      hold.add(1);
      auto holder = fiber::spawn({.scheduler = &s}, [&hold] { hold.wait(); });
      auto responder = fiber::spawn({.scheduler = &s}, [&] {
        long n = 0;
        for (long i = 0; i < kPingPong2; ++i) {
          ping[i].wait();
          ++n;
          pong[i].done();
        }
        return n;
      });
      Timer t;
      with_watchdog(kConfigLimit, "idle: 2 processors, ping-pong with a parked fiber", [&] {
        for (long i = 0; i < kPingPong2; ++i) {
          ping[i].done();
          pong[i].wait();
          ++answered;
        }
        hold.done();
        CHECK(responder.join() == kPingPong2);
        holder.join();
      });
      MESSAGE(kPingPong2 << " ping-pong cycles on 2 processors in " << t.seconds() << " s");
      CHECK(s.live_fibers() == 0);
    }
    CHECK(answered == kPingPong2);
    total += answered;
  }

  SUBCASE("8 processors: two threads spawning concurrently") {
    const long per_thread = kTwoThreads8 / 2;
    auto wgs = std::make_unique<fiber::WaitGroup[]>(kTwoThreads8);
    std::atomic<long> completed{0};
    {
      fiber::Scheduler s({.processors = 8, .name = "idle8"});
      Timer t;
      with_watchdog(kConfigLimit, "idle: 8 processors, two spawning threads", [&] {
        std::vector<std::thread> threads;
        for (int th = 0; th < 2; ++th) {
          threads.emplace_back([&, th] {
            for (long i = 0; i < per_thread; ++i) {
              fiber::WaitGroup& wg = wgs[th * per_thread + i];
              wg.add(1);
              if (i % 2 == 0) {
                fiber::spawn({.scheduler = &s}, [&wg] { wg.done(); }).detach();
              } else {
                // Half the fibers block once more before answering: a sleep that is already due.
                fiber::spawn({.scheduler = &s}, [&wg] {
                  fiber::this_fiber::sleep_for(0ms);
                  wg.done();
                }).detach();
              }
              wg.wait();
              completed.fetch_add(1, std::memory_order_relaxed);
            }
          });
        }
        for (auto& th : threads) th.join();
      });
      MESSAGE((2 * per_thread) << " cycles from two threads on 8 processors in " << t.seconds() << " s");
      quiesce(s);
    }
    CHECK(completed.load() == 2 * per_thread);
    total += completed.load();
  }

  SUBCASE("4 processors: the spawned fiber fans out to two children") {
    auto wgs = std::make_unique<fiber::WaitGroup[]>(kFanOut4);
    long completed = 0;
    {
      fiber::Scheduler s({.processors = 4, .name = "fan4"});
      Timer t;
      with_watchdog(kConfigLimit, "idle: 4 processors, fan-out", [&] {
        for (long i = 0; i < kFanOut4; ++i) {
          fiber::WaitGroup& wg = wgs[i];
          wg.add(2);
          // The parent's first child goes to its LIFO slot, the second pushes the first into the
          // stealable queue and wakes a sleeping processor for it.
          fiber::spawn({.scheduler = &s}, [&wg] {
            go[&wg] { wg.done(); };
            go[&wg] { wg.done(); };
          }).detach();
          wg.wait();
          ++completed;
        }
      });
      MESSAGE(kFanOut4 << " fan-out cycles on 4 processors in " << t.seconds() << " s");
      quiesce(s);
    }
    CHECK(completed == kFanOut4);
    total += completed;
  }

  SUBCASE("4 processors: wake a pinned fiber, then spawn a fresh one, alternately") {
    // A pinned fiber woken from a plain thread goes through its processor's inbox and wakes that
    // processor directly; the spawns in between go through the injector and need the idle
    // protocol to wake someone. Each wait is bounded: a spawn that wakes nobody is reported, and
    // then rescued by waking the pinned fiber's processor (which also drains the injector).
    const long half = kPinnedMix4 / 2;
    auto ping = std::make_unique<fiber::WaitGroup[]>(half + 1);
    auto pong = std::make_unique<fiber::WaitGroup[]>(half + 1);
    auto spawned = std::make_unique<fiber::WaitGroup[]>(half + 1);
    for (long i = 0; i <= half; ++i) {
      ping[i].add(1);
      pong[i].add(1);
    }
    long cycles_done = 0;
    std::string lost;
    {
      fiber::Scheduler s({.processors = 4, .name = "pinmix"});
      std::atomic<bool> stop{false};
      auto responder = fiber::spawn({.scheduler = &s}, [&] {
        fiber::this_fiber::PinGuard pin;
        for (long i = 0; i <= half; ++i) {
          ping[i].wait();
          if (stop.load()) return i;
          pong[i].done();
        }
        return half + 1;
      });
      Timer t;
      with_watchdog(kConfigLimit, "idle: 4 processors, pinned wakes and spawns", [&] {
        long j = 0, k = 0;
        for (long c = 0; c < kPinnedMix4 && lost.empty(); ++c) {
          if (c % 2 == 0) {
            ping[j].done();
            if (!bounded_wait(pong[j], 5'000ms)) lost = "the pinned fiber was not woken in cycle " + std::to_string(c);
            ++j;
          } else {
            fiber::WaitGroup& wg = spawned[k++];
            wg.add(1);
            fiber::spawn({.scheduler = &s}, [&wg] { wg.done(); }).detach();
            if (!bounded_wait(wg, 5'000ms)) {
              lost = "a fiber spawned in cycle " + std::to_string(c) + " (after " + std::to_string(j) +
                     " pinned wakes) never ran";
            }
          }
          if (lost.empty()) ++cycles_done;
        }
        stop = true;
        ping[j].done();  // ends the responder; after a lost wakeup, also wakes a processor
        responder.join();
        if (k > 0) CHECK(bounded_wait(spawned[k - 1], 10'000ms));  // rescued, if it was stranded
      });
      MESSAGE(cycles_done << " pinned-wake/spawn cycles on 4 processors in " << t.seconds() << " s");
      quiesce(s);
    }
    CHECK_MESSAGE(lost.empty(), "lost wakeup: " << lost);
    CHECK(cycles_done == kPinnedMix4);
    total += cycles_done;
  }

  CHECK(total > 0);
}
