// fiber::blocking, the blocking-offload pool: values, void, move-only and reference results and
// exceptions come back; the job runs on a helper thread from a fiber and inline from a plain
// thread; jobs run concurrently and the processor keeps running other fibers meanwhile; a cancel
// during a job neither abandons it nor hides its result, and takes effect at the next wait;
// $FIBER_BLOCKING_THREADS parsing; a forked child starts with an empty pool.
//
// No test asserts a duration: concurrency is observed directly (jobs running at the same time,
// a fiber making progress while another waits), with bounded waits so a failure cannot hang.
#include "io/blocking_pool.hpp"

#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

// Spins (sleeping between looks: this runs on plain or helper threads) until pred() holds or
// `limit` (scaled) passes; returns pred().
template <typename Pred>
bool spin_until(Pred&& pred, std::chrono::milliseconds limit = 10'000ms) {
  const auto deadline = Clock::now() + scaled(limit);
  while (!pred()) {
    if (Clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(100us);
  }
  return true;
}

void raise_max(std::atomic<int>& max, int now) {
  int m = max.load();
  while (now > m && !max.compare_exchange_weak(m, now)) {
  }
}

}  // namespace

TEST_CASE("blocking: returns values, void, move-only and reference results from a helper thread") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::spawn({.scheduler = &s}, [] {
      const pid_t caller = os_tid();
      pid_t helper = 0;
      std::string helper_name;
      CHECK(fiber::blocking([&] {
              helper = os_tid();
              helper_name = thread_name();
              return 42;
            }) == 42);
      CHECK(helper != 0);
      CHECK(helper != caller);
      CHECK(helper_name == "fiber-blocking");

      bool ran = false;
      fiber::blocking([&] { ran = true; });
      static_assert(std::is_void_v<decltype(fiber::blocking([] {}))>);
      CHECK(ran);

      std::unique_ptr<int> p = fiber::blocking([] { return std::make_unique<int>(7); });
      CHECK((p && *p == 7));

      int x = 1;
      int& r = fiber::blocking([&]() -> int& { return x; });
      CHECK(&r == &x);
      std::string text = "moved";
      std::string&& rr = fiber::blocking([&]() -> std::string&& { return std::move(text); });
      CHECK(&rr == &text);

      // An lvalue callable, invoked as an lvalue; a mutable one keeps its state.
      auto counter = [n = 0]() mutable { return ++n; };
      CHECK(fiber::blocking(counter) == 1);
      CHECK(fiber::blocking(counter) == 2);
      CHECK(counter() == 3);
    }).join();
    const auto stats = fiber::detail::blocking_pool_stats();
    CHECK(stats.threads >= 1);
    CHECK(stats.threads <= stats.max_threads);
  }, {1, 2, 4});
}

TEST_CASE("blocking: rethrows the callable's exception in the fiber") {
  fiber::Scheduler s({.processors = 1, .name = "blkx"});
  fiber::spawn({.scheduler = &s}, [] {
    bool caught = false;
    try {
      fiber::blocking([]() -> int { throw std::runtime_error("disk on fire"); });
    } catch (const std::runtime_error& e) {
      caught = true;
      CHECK(std::string(e.what()) == "disk on fire");
    }
    CHECK(caught);
    CHECK(fiber::blocking([] { return 5; }) == 5);  // the pool is fine afterwards
  }).join();
}

TEST_CASE("blocking: from a plain thread runs inline") {
  auto check_inline = [] {
    const auto caller = std::this_thread::get_id();
    std::thread::id ran_on;
    CHECK(fiber::blocking([&] {
            ran_on = std::this_thread::get_id();
            return 3;
          }) == 3);
    CHECK(ran_on == caller);
    bool caught = false;
    try {
      fiber::blocking([] { throw std::runtime_error("inline"); });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "inline";
    }
    CHECK(caught);
  };
  check_inline();                // the main thread
  run_on_thread(check_inline);   // a fresh plain thread
}

TEST_CASE("blocking: jobs of many fibers on one processor run concurrently") {
  fiber::Scheduler s({.processors = 1, .name = "blkc"});
  const int fibers = kTsan ? 64 : 200;
  std::atomic<int> running{0}, max_running{0}, done{0};
  std::atomic<bool> gave_up{false};
  std::vector<fiber::JoinHandle<void>> hs;
  for (int i = 0; i < fibers; ++i) {
    hs.push_back(fiber::spawn({.scheduler = &s}, [&] {
      fiber::blocking([&] {
        raise_max(max_running, running.fetch_add(1) + 1);
        // Hold the thread until some other job is seen running too, then a little longer.
        // Bounded, once: a serial pool fails the check below instead of hanging.
        if (!spin_until([&] { return max_running.load() > 1 || gave_up.load(); }, 2'000ms)) gave_up.store(true);
        std::this_thread::sleep_for(20ms);
        running.fetch_sub(1);
      });
      done.fetch_add(1);
    }));
  }
  for (auto& h : hs) h.join();
  CHECK(done.load() == fibers);
  CHECK(max_running.load() > 1);
  const auto stats = fiber::detail::blocking_pool_stats();
  CHECK(stats.threads <= stats.max_threads);
}

TEST_CASE("blocking: other fibers keep running on the processor while one waits") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<int> ticks{0};
    std::atomic<bool> released{false};
    auto waiter = fiber::spawn({.scheduler = &s}, [&] {
      // The job needs the ticking fiber to progress: it only can if this fiber's processor is
      // free while the job runs.
      return fiber::blocking([&] { return spin_until([&] { return released.load(); }); });
    });
    auto ticker = fiber::spawn({.scheduler = &s}, [&] {
      for (int i = 0; i < 100; ++i) {
        ticks.fetch_add(1);
        fiber::this_fiber::yield();
      }
      released.store(true);
    });
    ticker.join();
    CHECK(waiter.join());
    CHECK(ticks.load() == 100);
  }, {1, 2});
}

TEST_CASE("blocking: a cancel during the job waits for it, returns its result, then takes effect") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    // Two fibers, each cancelled while its job runs; after the job one sleeps, the other calls
    // blocking() again. Both see Cancelled only there.
    for (int next_is_blocking = 0; next_is_blocking < 2; ++next_is_blocking) {
      std::atomic<bool> started{false}, cancelled{false}, got_result{false}, second_ran{false};
      auto h = spawn_cancellable(s, [&] {
        int slot = 0;  // on the fiber's stack; the job writes it after the cancel
        const int v = fiber::blocking([&] {
          started.store(true);
          spin_until([&] { return cancelled.load(); });
          std::this_thread::sleep_for(5ms);  // let a wrongly woken fiber run ahead
          slot = 7;
          return 42;
        });
        CHECK(v == 42);
        CHECK(slot == 7);
        got_result.store(true);
        if (next_is_blocking) {
          fiber::blocking([&] { second_ran.store(true); });  // already cancelled: throws, f not run
        } else {
          fiber::this_fiber::sleep_for(1h);  // the next ordinary wait throws at once
        }
      });
      REQUIRE(spin_until([&] { return started.load(); }));
      h.cancel();
      cancelled.store(true);
      CHECK(h.join());  // ended by Cancelled
      CHECK(got_result.load());
      CHECK_FALSE(second_ran.load());
    }
  }, {1, 2});
}

TEST_CASE("blocking: FIBER_BLOCKING_THREADS parsing") {
  using fiber::detail::parse_blocking_threads;
  CHECK(parse_blocking_threads(nullptr) == fiber::detail::kDefaultBlockingThreads);
  CHECK(parse_blocking_threads("") == fiber::detail::kDefaultBlockingThreads);
  CHECK(fiber::detail::kDefaultBlockingThreads == 64);
  CHECK(parse_blocking_threads("1") == 1);
  CHECK(parse_blocking_threads("128") == 128);
  for (const char* bad : {"0", "-1", "+4", " 4", "4 ", "4x", "abc", "0x10", "99999999999999999999999"}) {
    CAPTURE(bad);
    expect_usage_error([&] { parse_blocking_threads(bad); }, "FIBER_BLOCKING_THREADS");
  }
  expect_usage_error([] { parse_blocking_threads("abc"); }, "'abc'");
}

// TSan aborts a multi-threaded process's child that starts threads (die_after_fork).
TEST_CASE("blocking: a forked child starts with an empty pool" * doctest::skip(kTsan)) {
  {
    fiber::Scheduler s({.processors = 1, .name = "blkf"});
    fiber::spawn({.scheduler = &s}, [] { fiber::blocking([] {}); }).join();
  }
  REQUIRE(fiber::detail::blocking_pool_stats().threads >= 1);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Only async-signal-safe exits from here: no doctest, no static destructors.
    const auto st = fiber::detail::blocking_pool_stats();
    if (st.threads != 0 || st.queued != 0 || st.max_threads != 0) ::_exit(2);
    int v = 0;
    {
      fiber::Scheduler s({.processors = 1, .name = "blkfc"});
      v = fiber::spawn({.scheduler = &s}, [] {
            const pid_t caller = os_tid();
            return fiber::blocking([caller] { return os_tid() != caller ? 9 : 3; });
          }).join();
    }
    ::_exit(v == 9 ? 0 : 3);
  }
  int status = 0;
  const bool exited = spin_until([&] { return ::waitpid(child, &status, WNOHANG) == child; }, 30'000ms);
  if (!exited) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  }
  REQUIRE_MESSAGE(exited, "the forked child did not finish");
  REQUIRE(WIFEXITED(status));
  CHECK_MESSAGE(WEXITSTATUS(status) == 0, "child exit code " << WEXITSTATUS(status)
                                                             << " (2: pool not empty after fork, 3: job ran inline)");
}
