// fiber::Scheduler (fiber/scheduler.hpp): independent schedulers, options and environment,
// stop() with live fibers, and JoinHandle::cancel().
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace {
using namespace fiber_test;
using namespace std::chrono_literals;

std::string usage_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const fiber::UsageError& e) {
    return e.what();
  } catch (...) {
    return "<some other exception>";
  }
  return "<no exception>";
}

// A thread that sets `release` once s.stop() has begun, which it tells by spawning from outside
// until that is refused: for fibers that must go on only after stop() began.
std::thread release_once_stopping(fiber::Scheduler& s, std::atomic<bool>& release) {
  return std::thread([&s, &release] {
    for (;;) {
      try {
        fiber::spawn({.scheduler = &s}, [] {}).detach();
      } catch (const fiber::UsageError&) {
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    release = true;
  });
}
}  // namespace

TEST_CASE("Scheduler: two independent schedulers run concurrently and join each other's fibers") {
  with_watchdog(60'000ms, "two schedulers", [] {
    fiber::Scheduler a({.processors = 2, .name = "alpha"});
    fiber::Scheduler b({.processors = 3, .name = "beta"});
    CHECK(a.processors() == 2);
    CHECK(b.processors() == 3);
    CHECK(a.name() == "alpha");
    CHECK(b.name() == "beta");

    // Busy work on both at once, each driven from its own plain thread.
    std::atomic<int> wrong_thread{0};
    auto drive = [&wrong_thread](fiber::Scheduler& s, const std::string& prefix) {
      return fiber::block_on({.scheduler = &s}, [&wrong_thread, prefix] {
        std::vector<fiber::JoinHandle<long>> hs;
        for (int i = 0; i < 40; ++i) {
          hs.push_back(fiber::spawn([&wrong_thread, prefix, i] {
            long acc = 0;
            for (int k = 0; k < 200; ++k) {
              acc += k * i;
              if (thread_name().rfind(prefix, 0) != 0) wrong_thread.fetch_add(1);
              if (k % 50 == 0) fiber::this_fiber::sleep_for(100us); else fiber::this_fiber::yield();
            }
            return acc;
          }));
        }
        long total = 0;
        for (auto& h : hs) total += h.join();
        return total;
      });
    };
    long ra = 0, rb = 0;
    std::thread ta([&] { ra = drive(a, "alpha-P"); });
    std::thread tb([&] { rb = drive(b, "beta-P"); });
    ta.join();
    tb.join();
    const long expected = 19900L * (39 * 40 / 2);
    CHECK(ra == expected);
    CHECK(rb == expected);
    CHECK(wrong_thread.load() == 0);

    // A fiber of a joins a fiber of b, and a fiber of b joins a fiber of a, concurrently.
    for (int round = 0; round < 20; ++round) {
      auto on_b = fiber::spawn({.scheduler = &b}, [] {
        fiber::this_fiber::sleep_for(1ms);
        return thread_name();
      });
      auto on_a = fiber::spawn({.scheduler = &a}, [] {
        fiber::this_fiber::yield();
        return thread_name();
      });
      auto a_joins_b = fiber::spawn({.scheduler = &a}, [&on_b] { return on_b.join() + "|" + thread_name(); });
      auto b_joins_a = fiber::spawn({.scheduler = &b}, [&on_a] { return on_a.join() + "|" + thread_name(); });
      const std::string x = a_joins_b.join();
      const std::string y = b_joins_a.join();
      CHECK_MESSAGE(x.rfind("beta-P", 0) == 0, x);
      CHECK_MESSAGE(x.find("|alpha-P") != std::string::npos, x);
      CHECK_MESSAGE(y.rfind("alpha-P", 0) == 0, y);
      CHECK_MESSAGE(y.find("|beta-P") != std::string::npos, y);
    }
    CHECK(a.live_fibers() == 0);
    CHECK(b.live_fibers() == 0);
  });
}

TEST_CASE("Scheduler: N busy fibers on N processors run in parallel") {
  // Each fiber spins - without blocking - until all N have arrived (bounded by a deadline, so
  // a failure is a failed check, not a hang). Idle processors must be woken for the queued ones:
  // a single processor running them one after another never gets all N in at once.
  for (int n : {2, 4}) {
    CAPTURE(n);
    for (bool from_fiber : {false, true}) {
      CAPTURE(from_fiber);
      fiber::Scheduler s({.processors = static_cast<std::size_t>(n), .name = "par"});
      std::this_thread::sleep_for(20ms);  // every processor idle and asleep
      std::atomic<int> arrived{0};
      // One deadline for all, generous: waking each processor is a thread wakeup, which a loaded
      // machine delays. (Run one after another, the spinners give up together at it.)
      const auto deadline = Clock::now() + scaled(10'000ms);
      auto spin = [&arrived, n, deadline] {
        arrived.fetch_add(1);
        while (arrived.load() < n && Clock::now() < deadline) {
        }
        return std::make_pair(arrived.load() == n, fiber::this_fiber::processor_index());
      };
      std::vector<fiber::JoinHandle<std::pair<bool, unsigned>>> hs;
      if (from_fiber) {
        hs = fiber::block_on({.scheduler = &s}, [&] {
          std::vector<fiber::JoinHandle<std::pair<bool, unsigned>>> v;
          for (int i = 0; i < n; ++i) v.push_back(fiber::spawn(spin));
          return v;
        });
      } else {
        for (int i = 0; i < n; ++i) hs.push_back(fiber::spawn({.scheduler = &s}, spin));
      }
      int saw_all = 0;
      std::set<unsigned> procs;
      for (auto& h : hs) {
        auto [ok, idx] = h.join();
        saw_all += ok;
        procs.insert(idx);
      }
      CHECK_MESSAGE(saw_all == n, saw_all << " of " << n << " spinning fibers saw all " << n
                                           << " running at once; they ran on " << procs.size() << " processor(s)");
    }
  }
}

TEST_CASE("Scheduler: a fiber that yielded with nothing else to run does not keep others asleep") {
  // F yields while the other processors sleep: the yield searches for work, finds none, and F
  // carries on. Then F holds its thread until a fiber spawned from a plain thread runs. That
  // spawn must wake a sleeping processor: F's processor no longer searches. (A processor that
  // kept its searcher share while F ran made every waker skip the wake.)
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        std::this_thread::sleep_for(50ms);  // let the other processors go to sleep
        std::atomic<bool> holding{false}, ran{false};
        auto f = fiber::spawn({.scheduler = &s}, [&] {
          fiber::this_fiber::yield();
          holding = true;
          // Blocks this processor's thread, as unhooked blocking code would. Bounded so that a
          // stranded spawn fails the test instead of hanging it.
          const auto give_up = Clock::now() + scaled(10'000ms);
          while (!ran.load() && Clock::now() < give_up) std::this_thread::sleep_for(200us);
          return ran.load();
        });
        REQUIRE(wait_for([&] { return holding.load(); }));
        auto g = fiber::spawn({.scheduler = &s}, [&] { ran = true; });
        CHECK(f.join());
        g.join();
      },
      {2, 4, 8});
}

// Whether it was false before this process's first scheduler is checked where it matters, in a
// new process (tests/hooks/test_process.cpp: the prefork case); here, that it stays true.
TEST_CASE("Scheduler: started_in_process is true once a scheduler has run, and stays so") {
  {
    fiber::Scheduler s({.processors = 1, .name = "once"});
    CHECK(fiber::Scheduler::started_in_process());
  }
  CHECK(fiber::Scheduler::started_in_process());  // a forked child would still lack those threads' records
}

TEST_CASE("Scheduler: zero or too many processors is a UsageError") {
  CHECK_THROWS_AS(fiber::Scheduler({.processors = 0, .name = "zero"}), fiber::UsageError);
  CHECK_THROWS_AS(fiber::Scheduler({.processors = 1025, .name = "many"}), fiber::UsageError);
  const std::string msg = usage_message([] { fiber::Scheduler s({.processors = 0}); });
  CHECK_MESSAGE(contains(msg, "processor"), msg);
}

TEST_CASE("Scheduler: FIBER_PROCS") {
  SUBCASE("invalid values are a UsageError naming FIBER_PROCS") {
    for (const char* bad : {"abc", "0", "-3", "2x", "1025", "99999999999999999999"}) {
      CAPTURE(bad);
      EnvGuard env("FIBER_PROCS", bad);
      const std::string msg = usage_message([] { fiber::Scheduler s; });
      CHECK_MESSAGE(contains(msg, "FIBER_PROCS"), "FIBER_PROCS=" << bad << ": " << msg);
      const std::string msg2 = usage_message([] { fiber::Scheduler s({.name = "auto"}); });
      CHECK_MESSAGE(contains(msg2, "FIBER_PROCS"), "FIBER_PROCS=" << bad << ": " << msg2);
    }
  }
  SUBCASE("a valid value sets the processor count") {
    EnvGuard env("FIBER_PROCS", "3");
    fiber::Scheduler s;
    CHECK(s.processors() == 3);
    fiber::Scheduler s2({.processors = fiber::Scheduler::auto_processors, .name = "auto"});
    CHECK(s2.processors() == 3);
    // The processors really are there: a fiber reports an index below 3.
    CHECK(fiber::spawn({.scheduler = &s2}, [] { return fiber::this_fiber::processor_index(); }).join() < 3u);
  }
  SUBCASE("an explicit count ignores FIBER_PROCS") {
    EnvGuard env("FIBER_PROCS", "abc");
    fiber::Scheduler s({.processors = 2});
    CHECK(s.processors() == 2);
  }
  SUBCASE("unset: one per hardware thread") {
    EnvGuard env("FIBER_PROCS", nullptr);
    fiber::Scheduler s;
    const unsigned hw = std::thread::hardware_concurrency();
    CHECK(s.processors() == (hw ? hw : 1u));
  }
}

TEST_CASE("Scheduler: FIBER_STACK_SIZE") {
  SUBCASE("invalid values are a UsageError naming FIBER_STACK_SIZE") {
    // "-4096" once wrapped round to a huge size and was refused only as "above the maximum".
    for (const char* bad : {"abc", "-4096", "64k", "2047", "1073741825", "99999999999999999999"}) {
      CAPTURE(bad);
      EnvGuard env("FIBER_STACK_SIZE", bad);
      const std::string msg = usage_message([] { fiber::Scheduler s({.processors = 1}); });
      CHECK_MESSAGE(contains(msg, "FIBER_STACK_SIZE"), "FIBER_STACK_SIZE=" << bad << ": " << msg);
    }
  }
  SUBCASE("a valid value is used, and an explicit size ignores a bad one") {
    {
      EnvGuard env("FIBER_STACK_SIZE", "131072");
      fiber::Scheduler s({.processors = 1});
      CHECK(fiber::spawn({.scheduler = &s}, [] { return 5; }).join() == 5);
    }
    EnvGuard env("FIBER_STACK_SIZE", "abc");
    fiber::Scheduler s({.processors = 1, .stack_size = 32 * 1024});
    CHECK(fiber::spawn({.scheduler = &s}, [] { return 6; }).join() == 6);
  }
}

// Both are read by process-wide parts, later and elsewhere (the stack allocator on a first
// stack, the blocking pool on a first offloaded call, where an error could only be an errno);
// the constructor checks them so that a bad value is reported to the code that made the mistake.
TEST_CASE("Scheduler: FIBER_GUARDED_STACKS and FIBER_BLOCKING_THREADS are checked by the constructor") {
  {
    // The stack allocator reads FIBER_GUARDED_STACKS once, at its first stack: have that happen
    // with the real environment, so that the "16" below cannot stay with the process when this
    // test runs first.
    fiber::Scheduler warm({.processors = 1});
    fiber::spawn({.scheduler = &warm}, [] {}).join();
  }
  for (const char* var : {"FIBER_GUARDED_STACKS", "FIBER_BLOCKING_THREADS"}) {
    CAPTURE(var);
    // "-1" was once read by strtoull as 2^64 - 1 guarded stacks, and "abc" ignored.
    for (const char* bad : {"abc", "-1", "+4", " 4", "4x", "0x10", "99999999999999999999999"}) {
      CAPTURE(bad);
      EnvGuard env(var, bad);
      const std::string msg = usage_message([] { fiber::Scheduler s({.processors = 1}); });
      CHECK_MESSAGE(contains(msg, var), var << "=" << bad << ": " << msg);
      CHECK_MESSAGE(contains(msg, std::string("'") + bad + "'"), msg);
    }
    EnvGuard env(var, "16");
    fiber::Scheduler s({.processors = 1});
    CHECK(fiber::spawn({.scheduler = &s}, [] { return 8; }).join() == 8);
  }
}

TEST_CASE("Scheduler: spin_before_sleep and FIBER_SPIN_US") {
  SUBCASE("out of range is a UsageError naming the option") {
    for (const auto bad : {-2us, 1'000'001us}) {
      CAPTURE(bad.count());
      const std::string msg = usage_message([bad] { fiber::Scheduler s({.processors = 1, .spin_before_sleep = bad}); });
      CHECK_MESSAGE(contains(msg, "spin_before_sleep"), msg);
    }
  }
  SUBCASE("invalid FIBER_SPIN_US values are a UsageError naming it") {
    for (const char* bad : {"abc", "-1", "5x", "1000001", "99999999999999999999"}) {
      CAPTURE(bad);
      EnvGuard env("FIBER_SPIN_US", bad);
      const std::string msg = usage_message([] { fiber::Scheduler s({.processors = 1}); });
      CHECK_MESSAGE(contains(msg, "FIBER_SPIN_US"), "FIBER_SPIN_US=" << bad << ": " << msg);
    }
  }
  SUBCASE("FIBER_SPIN_US sets it; an explicit value ignores it; unset is no spin") {
    {
      // Zero where the engine cannot spin (epoll; a ring without TASKRUN_FLAG), which an explicit
      // request tells apart from the variable being ignored.
      const bool can_spin = fiber::Scheduler({.processors = 1, .spin_before_sleep = 1s}).spin_before_sleep() != 0us;
      EnvGuard env("FIBER_SPIN_US", "40");
      fiber::Scheduler s({.processors = 1});
      CHECK(s.spin_before_sleep() == (can_spin ? 40us : 0us));
    }
    {
      EnvGuard env("FIBER_SPIN_US", "abc");
      fiber::Scheduler s({.processors = 1, .spin_before_sleep = 0us});
      CHECK(s.spin_before_sleep() == 0us);
    }
    EnvGuard env("FIBER_SPIN_US", nullptr);
    fiber::Scheduler s({.processors = 1});
    CHECK(s.spin_before_sleep() == 0us);
  }
}

// A second of spin outlasts everything below by far: processors that spin neither sleep nor
// need waking. Where the engine cannot spin they sleep as usual, which is checked instead.
TEST_CASE("Scheduler: spinning processors run spawns, timers and I/O without sleeping or being woken") {
  for_each_proc_count([](fiber::Scheduler&, int n) {
    fiber::Scheduler s({.processors = static_cast<std::size_t>(n), .name = "spin", .spin_before_sleep = 1s});
    const bool spins = s.spin_before_sleep() == 1s;
    if (!spins) CHECK(s.spin_before_sleep() == 0us);
    // Without a spin every processor would be asleep by now (the idle-stats test).
    std::this_thread::sleep_for(5ms);
    // From a plain thread: the global queue.
    CHECK(fiber::spawn({.scheduler = &s}, [] { return 7; }).join() == 7);
    // A timer.
    fiber::spawn({.scheduler = &s}, [] { fiber::this_fiber::sleep_for(1ms); }).join();
    // An engine completion: a read that parks until this thread writes.
    int p[2];
    REQUIRE(::pipe(p) == 0);
    std::atomic<bool> reading{false};
    auto reader = fiber::spawn({.scheduler = &s}, [&] {
      char c = 0;
      reading.store(true);
      return fiber::io::read(p[0], &c, 1) == 1 ? c : '?';
    });
    REQUIRE(wait_for([&] { return reading.load(); }));
    std::this_thread::sleep_for(2ms);  // most likely parked in the read by now
    REQUIRE(::write(p[1], "k", 1) == 1);
    CHECK(reader.join() == 'k');
    ::close(p[0]);
    ::close(p[1]);
    const fiber::SchedulerStats st = s.stats();
    if (spins) {
      CHECK(st.sleeps == 0);
      CHECK(st.wakeups == 0);
    } else {
      CHECK(wait_for([&] { return s.stats().sleeps > 0; }));
    }
    s.stop();  // a processor in its spin leaves it for stop()
  }, {1, 2});
}

TEST_CASE("Scheduler: FIBER_IO") {
  {
    EnvGuard env("FIBER_IO", "carrier-pigeon");
    const std::string msg = usage_message([] { fiber::Scheduler s({.processors = 1}); });
    CHECK_MESSAGE(contains(msg, "FIBER_IO"), msg);
  }
  {
    EnvGuard env("FIBER_IO", "epoll");
    fiber::Scheduler s({.processors = 2, .name = "ep"});
    CHECK(fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::sleep_for(2ms);
      return 1;
    }).join() == 1);
  }
}

TEST_CASE("Scheduler: stop() cancels parked fibers, unwinds their stacks, and returns") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        std::atomic<int> destroyed{0};
        std::atomic<int> parked{0};
        std::atomic<int> cancelled_once{0};
        std::atomic<bool> runner_finished{false};
        std::atomic<bool> rescue_spawned{false};
        fiber::WaitGroup never;  // never reaches zero
        never.add(1);
        int expected_dtors = 0;

        // 1. Sleeping for an hour.
        auto sleeper = fiber::spawn({.scheduler = &s, .name = "sleeper"}, [&] {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          fiber::this_fiber::sleep_for(std::chrono::hours(1));
        });
        ++expected_dtors;
        // 2. Waiting on a WaitGroup (detached).
        go go_on(s) go_name("wg-waiter")[&] {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          never.wait();
        };
        ++expected_dtors;
        // 3. A never-finishing fiber, and one joining it.
        auto forever = fiber::spawn({.scheduler = &s}, [&] {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          for (;;) fiber::this_fiber::sleep_for(std::chrono::hours(1));
        });
        auto joiner = fiber::spawn({.scheduler = &s}, [&, h = std::move(forever)]() mutable {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          h.join();
        });
        expected_dtors += 2;
        // 4. Catches Cancelled once, then blocks again (and is cancelled again).
        go go_on(s)[&] {
          DtorCounter d(destroyed);
          try {
            parked.fetch_add(1);
            fiber::this_fiber::sleep_for(std::chrono::hours(1));
          } catch (const fiber::Cancelled&) {
            cancelled_once.fetch_add(1);
          }
          DtorCounter d2(destroyed);
          never.wait();
        };
        expected_dtors += 2;
        // 5. Catches Cancelled, then spawns a fiber while unwinding; that one is cancelled too.
        go go_on(s)[&] {
          DtorCounter d(destroyed);
          try {
            parked.fetch_add(1);
            never.wait();
          } catch (const fiber::Cancelled&) {
            go[&] {
              DtorCounter d3(destroyed);
              fiber::this_fiber::sleep_for(std::chrono::hours(1));
            };
            rescue_spawned = true;
            throw;
          }
        };
        expected_dtors += 2;
        // 6. Yields in a loop (never parks for long): its next yield throws.
        go go_on(s)[&] {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          for (;;) fiber::this_fiber::yield();
        };
        ++expected_dtors;
        // 7. Never blocks after stop() begins: runs to its end.
        std::atomic<bool> release_runner{false};
        std::atomic<bool> runner_busy{false};
        auto runner = fiber::spawn({.scheduler = &s}, [&] {
          DtorCounter d(destroyed);
          parked.fetch_add(1);
          while (!release_runner.load()) fiber::this_fiber::sleep_for(200us);
          // From here on no blocking call: a plain busy loop that stop() begins during.
          runner_busy = true;
          const auto until = Clock::now() + 30ms;
          while (Clock::now() < until) {
          }
          runner_finished = true;
          return 42;
        });
        ++expected_dtors;

        REQUIRE(wait_for([&] { return parked.load() == 8; }));
        fiber::this_fiber::sleep_for(5ms);  // let them all reach their blocking calls
        CHECK(s.live_fibers() == 8);

        release_runner = true;
        REQUIRE(wait_for([&] { return runner_busy.load(); }));
        with_watchdog(20'000ms, "stop() with parked fibers", [&] { s.stop(); });

        CHECK(s.live_fibers() == 0);
        CHECK(destroyed.load() == expected_dtors);
        CHECK(cancelled_once.load() == 1);
        CHECK(rescue_spawned.load());
        // What the joined fibers ended with.
        CHECK_THROWS_AS(sleeper.join(), fiber::Cancelled);
        CHECK_THROWS_AS(joiner.join(), fiber::Cancelled);
        // The runner never blocked again after stop() began: it ran to its end.
        CHECK(runner.join() == 42);
        CHECK(runner_finished.load());

        // stop() again, and from another thread, is a no-op.
        with_watchdog(5'000ms, "second stop()", [&] {
          s.stop();
          run_on_thread([&] { s.stop(); });
        });
      },
      kProcCounts, /*check_no_live=*/true);
}

TEST_CASE("Scheduler: stop() cancels fibers that were still queued when it began") {
  fiber::Scheduler::Options o;
  o.processors = 1;
  o.name = "stop-queued";
  o.watchdog.enabled = false;  // the hog below holds its processor on purpose
  fiber::Scheduler s(o);
  std::atomic<bool> release{false};
  std::atomic<int> destroyed{0};
  std::atomic<int> jobs_ran{0};
  // Holds the only processor without a blocking call, so the fibers below stay queued
  // (spawned, never run) until stop() has begun.
  auto hog = fiber::spawn({.scheduler = &s}, [&] {
    while (!release.load()) {
    }
  });
  constexpr int kQueued = 20;
  std::vector<fiber::JoinHandle<void>> queued;
  for (int i = 0; i < kQueued; ++i) {
    queued.push_back(fiber::spawn({.scheduler = &s}, [&] {
      DtorCounter d(destroyed);
      // Cancelled at its first cancellation point (blocking()'s check lists it and sees
      // stop()): this throws, and the job never starts.
      fiber::blocking([&] { jobs_ran.fetch_add(1); });
      fiber::this_fiber::sleep_for(std::chrono::hours(1));
    }));
  }
  CHECK(s.live_fibers() == kQueued + 1);
  std::thread releaser = release_once_stopping(s, release);
  with_watchdog(20'000ms, "stop() with queued fibers", [&] { s.stop(); });
  releaser.join();
  CHECK(s.live_fibers() == 0);
  CHECK(destroyed.load() == kQueued);
  CHECK(jobs_ran.load() == 0);
  hog.join();
  for (auto& h : queued) CHECK_THROWS_AS(h.join(), fiber::Cancelled);
}

TEST_CASE("Scheduler: stop() ends fibers that ran from before it without parking, polling cancelled() or I/O") {
  // Fibers list themselves for stop() only at their first cancellation point or switch away
  // (libfiber/README.md, "Shutdown"). These two run from before stop() begins and have done neither:
  // one then polls this_fiber::cancelled(), the other receives from a socket that always has
  // data (with the epoll engine the receive never parks). Both must see the cancel.
  fiber::Scheduler::Options o;
  o.processors = 2;
  o.name = "stop-running";
  o.watchdog.enabled = false;  // both hold their processors on purpose
  fiber::Scheduler s(o);
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  REQUIRE(::write(sv[1], "x", 1) == 1);
  std::atomic<int> started{0};
  std::atomic<bool> release{false};
  auto poller = fiber::spawn({.scheduler = &s}, [&] {
    started.fetch_add(1);
    while (!release.load()) {
    }
    while (!fiber::this_fiber::cancelled()) {
    }
  });
  auto receiver = fiber::spawn({.scheduler = &s}, [&] {
    started.fetch_add(1);
    while (!release.load()) {
    }
    char c;
    for (;;) {
      const ssize_t n = fiber::io::recv(sv[0], &c, 1, MSG_PEEK);
      if (n == -ECANCELED) return;
      if (n != 1) throw std::runtime_error("recv: " + std::to_string(n));
    }
  });
  if (!wait_for([&] { return started.load() == 2; })) {
    release = true;  // let them end rather than hang the scheduler's destructor
    FAIL("the two fibers did not both start");
  }
  std::thread releaser = release_once_stopping(s, release);
  with_watchdog(20'000ms, "stop() with fibers running since before it", [&] { s.stop(); });
  releaser.join();
  CHECK(s.live_fibers() == 0);
  CHECK_NOTHROW(poller.join());
  CHECK_NOTHROW(receiver.join());
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST_CASE("Scheduler: spawning onto a stopped scheduler is a UsageError") {
  fiber::Scheduler other({.processors = 2, .name = "other"});
  fiber::Scheduler s({.processors = 2, .name = "t"});
  CHECK(fiber::spawn({.scheduler = &s}, [] { return 1; }).join() == 1);
  s.stop();
  CHECK_THROWS_AS(fiber::spawn({.scheduler = &s}, [] { return 1; }), fiber::UsageError);
  const std::string msg = usage_message([&] { fiber::spawn({.scheduler = &s}, [] {}); });
  CHECK_MESSAGE(contains(msg, "stopped"), msg);
  auto go_stopped = [&] { go go_on(s)[] {}; };
  CHECK_THROWS_AS(go_stopped(), fiber::UsageError);
  CHECK_THROWS_AS(fiber::block_on({.scheduler = &s}, [] { return 1; }), fiber::UsageError);
  // From a fiber of another scheduler too.
  CHECK(fiber::spawn({.scheduler = &other}, [&] {
    try {
      fiber::spawn({.scheduler = &s}, [] {});
      return false;
    } catch (const fiber::UsageError&) {
      return true;
    }
  }).join());
  CHECK(s.live_fibers() == 0);
  CHECK(other.live_fibers() == 0);
}

TEST_CASE("Scheduler: stop() twice, then the destructor, is fine") {
  with_watchdog(10'000ms, "stop twice", [] {
    fiber::Scheduler s({.processors = 3, .name = "t"});
    go go_on(s)[] { fiber::this_fiber::sleep_for(std::chrono::hours(1)); };
    s.stop();
    s.stop();
    CHECK(s.live_fibers() == 0);
  });
  // An idle scheduler that never ran anything stops too.
  with_watchdog(10'000ms, "stop idle", [] {
    fiber::Scheduler s({.processors = 8, .name = "idle"});
  });
}

TEST_CASE("Scheduler: stop() from one of its own fibers is a UsageError") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const std::string msg = fiber::spawn({.scheduler = &s}, [&s] { return usage_message([&s] { s.stop(); }); }).join();
    CHECK_MESSAGE(contains(msg, "stop"), msg);
    CHECK(msg != "<no exception>");
    // The scheduler still works afterwards.
    CHECK(fiber::spawn({.scheduler = &s}, [] { return 2; }).join() == 2);
  });
}

TEST_CASE("Scheduler: stop() of another scheduler from a fiber") {
  fiber::Scheduler s({.processors = 2, .name = "t"});
  auto victim = std::make_unique<fiber::Scheduler>(fiber::Scheduler::Options{.processors = 2, .name = "victim"});
  std::atomic<int> destroyed{0};
  go go_on(*victim)[&] {
    DtorCounter d(destroyed);
    fiber::this_fiber::sleep_for(std::chrono::hours(1));
  };
  REQUIRE(wait_for([&] { return victim->live_fibers() == 1; }));
  with_watchdog(20'000ms, "stop() from a fiber of another scheduler", [&] {
    fiber::spawn({.scheduler = &s}, [&] { victim->stop(); }).join();
  });
  CHECK(destroyed.load() == 1);
  CHECK(victim->live_fibers() == 0);
  victim.reset();
}

TEST_CASE("Scheduler: a fiber stopping its own inner scheduler while a thread stops the outer one") {
  // stop() calls were serialised by one lock for every scheduler: the outer stop() held it
  // while it waited for the fiber, whose unwinding ~Scheduler waited for the same lock.
  with_watchdog(20'000ms, "nested stop()", [] {
    fiber::Scheduler outer({.processors = 1, .name = "outer"});
    std::atomic<bool> inner_running{false};
    std::atomic<int> inner_destroyed{0};
    go go_on(outer)[&] {
      fiber::Scheduler inner({.processors = 1, .name = "inner"});
      go go_on(inner)[&] {
        DtorCounter d(inner_destroyed);
        fiber::this_fiber::sleep_for(std::chrono::hours(1));
      };
      inner_running = true;
      fiber::this_fiber::sleep_for(std::chrono::hours(1));  // cancelled by outer.stop(); ~inner stops it
    };
    REQUIRE(wait_for([&] { return inner_running.load() && outer.live_fibers() == 1; }));
    outer.stop();
    CHECK(outer.live_fibers() == 0);
    CHECK(inner_destroyed.load() == 1);
  });
}

TEST_CASE("Scheduler: spawns from a plain thread racing stop() either throw or run (cancelled)") {
  // A spawn from outside that passed its stopping() check used to be counted only when it was
  // queued: stop() could find no fiber alive, shut the processors down, and leave that fiber
  // never run (its join hung) and the spawner inside a freed scheduler.
  const int rounds = kTsan ? 40 : 300;
  std::mt19937 rng(7);
  int refused = 0, ran = 0, cancelled = 0;
  for (int round = 0; round < rounds; ++round) {
    with_watchdog(20'000ms, "spawn racing stop()", [&] {
      fiber::Scheduler s({.processors = 2, .name = "racing"});
      std::vector<fiber::JoinHandle<int>> handles;
      std::atomic<bool> started{false};
      std::thread spawner([&] {
        for (int i = 0;; ++i) {
          try {
            handles.push_back(fiber::spawn({.scheduler = &s}, [i] { return i; }));
          } catch (const fiber::UsageError& e) {
            CHECK_MESSAGE(contains(e.what(), "stopped"), e.what());
            ++refused;
            return;
          }
          started = true;
        }
      });
      while (!started) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
      s.stop();
      spawner.join();
      for (std::size_t i = 0; i < handles.size(); ++i) {
        try {
          REQUIRE(handles[i].join() == static_cast<int>(i));
          ++ran;
        } catch (const fiber::Cancelled&) {
          ++cancelled;
        }
      }
      CHECK(s.live_fibers() == 0);
    });
  }
  CHECK(refused == rounds);
  MESSAGE(ran << " spawns ran, " << cancelled << " were cancelled");
}

TEST_CASE("JoinHandle::cancel") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<int> destroyed{0};
    // A sleeping fiber: join rethrows fiber::Cancelled and the stack was unwound.
    std::atomic<bool> asleep{false};
    auto h = fiber::spawn({.scheduler = &s}, [&] {
      DtorCounter d(destroyed);
      asleep = true;
      fiber::this_fiber::sleep_for(std::chrono::hours(1));
      return 1;
    });
    REQUIRE(wait_for([&] { return asleep.load(); }));
    fiber::this_fiber::sleep_for(1ms);
    with_watchdog(10'000ms, "cancel a sleeper", [&] {
      h.cancel();
      CHECK_THROWS_AS(h.join(), fiber::Cancelled);
    });
    CHECK(destroyed.load() == 1);

    // Cancelled before it ever ran: its first blocking call throws.
    fiber::WaitGroup never;
    never.add(1);
    auto h2 = fiber::spawn({.scheduler = &s}, [&] { never.wait(); });
    h2.cancel();
    CHECK_THROWS_AS(h2.join(), fiber::Cancelled);

    // Cancelled while waiting on a WaitGroup, by another fiber.
    std::atomic<bool> waiting{false};
    auto h3 = fiber::spawn({.scheduler = &s}, [&] {
      waiting = true;
      never.wait();
    });
    REQUIRE(wait_for([&] { return waiting.load(); }));
    fiber::spawn({.scheduler = &s}, [&h3] { h3.cancel(); }).join();
    CHECK_THROWS_AS(h3.join(), fiber::Cancelled);

    // A cancelled fiber that catches it may finish normally.
    auto h4 = fiber::spawn({.scheduler = &s}, [&] {
      try {
        never.wait();
      } catch (const fiber::Cancelled&) {
        return std::string("caught");
      }
      return std::string("not cancelled");
    });
    fiber::this_fiber::sleep_for(1ms);
    h4.cancel();
    CHECK(h4.join() == "caught");

    // Cancelling a finished fiber changes nothing.
    auto h5 = fiber::spawn({.scheduler = &s}, [] { return 5; });
    REQUIRE(wait_for([&] { return h5.finished(); }));
    h5.cancel();
    CHECK(h5.join() == 5);

    // A fiber that does not block runs to its end despite the cancel.
    std::atomic<bool> go_on_flag{false};
    auto h6 = fiber::spawn({.scheduler = &s}, [&] {
      while (!go_on_flag.load()) {
      }
      return 6;
    });
    h6.cancel();
    go_on_flag = true;
    CHECK(h6.join() == 6);

    // A fiber joining a cancelled fiber gets its Cancelled.
    auto h7 = fiber::spawn({.scheduler = &s}, [] { fiber::this_fiber::sleep_for(std::chrono::hours(1)); });
    auto joiner = fiber::spawn({.scheduler = &s}, [&h7] {
      try {
        h7.join();
        return false;
      } catch (const fiber::Cancelled&) {
        return true;
      }
    });
    fiber::this_fiber::sleep_for(1ms);
    h7.cancel();
    CHECK(joiner.join());

    // Cancelling the joiner (not the target) makes its join throw; the target keeps running.
    fiber::WaitGroup gate;
    gate.add(1);
    auto target = fiber::spawn({.scheduler = &s}, [&gate] {
      gate.wait();
      return 8;
    });
    auto joiner2 = fiber::spawn({.scheduler = &s}, [&target] { (void)target.join(); });
    fiber::this_fiber::sleep_for(1ms);
    joiner2.cancel();
    CHECK_THROWS_AS(joiner2.join(), fiber::Cancelled);
    CHECK_FALSE(target.finished());
    gate.done();
    CHECK(target.join() == 8);
    never.done();
  });
}
