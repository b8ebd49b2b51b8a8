// fiber::RWMutex (fiber/rwmutex.hpp): shared readers, exclusive writers, writer preference (a
// waiting writer blocks new readers), writers not starved by a stream of readers, ownership
// errors, timed variants, cancellation, and a mixed stress with fibers and threads.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

// Waits until a writer is queued on `mu`: new readers are then refused.
void wait_writer_queued(fiber::RWMutex& mu) {
  CHECK(wait_for([&] {
    if (!mu.try_lock_shared()) return true;
    mu.unlock_shared();
    return false;
  }));
}

}  // namespace

TEST_CASE("rwmutex: readers share, writers exclude, std lock types work") {
  fiber::RWMutex mu;
  CHECK(mu.try_lock_shared());
  CHECK(mu.try_lock_shared());
  CHECK_FALSE(mu.try_lock());
  mu.unlock_shared();
  CHECK_FALSE(mu.try_lock());
  mu.unlock_shared();
  CHECK(mu.try_lock());
  CHECK_FALSE(mu.try_lock_shared());
  CHECK_FALSE(mu.try_lock());
  mu.unlock();
  {
    std::shared_lock r1(mu);
    std::shared_lock r2(mu);
    CHECK_FALSE(mu.try_lock());
  }
  {
    std::unique_lock w(mu);
    CHECK_FALSE(mu.try_lock_shared());
  }
  {
    std::shared_lock r(mu, std::defer_lock);
    CHECK(r.try_lock_for(1ms));
  }
  // All N readers inside at once: a Latch they all pass while holding the read lock.
  fiber::Scheduler s({.processors = 2, .name = "rw"});
  const int n = 8;
  fiber::Latch all_in(n);
  Team team;
  for (int i = 0; i < n; ++i) {
    team.spawn(i % 2 ? Where::thread : Where::fiber, s, [&] {
      std::shared_lock r(mu);
      all_in.arrive_and_wait();
    });
  }
  team.join();
}

TEST_CASE("rwmutex: misuse throws UsageError naming the problem") {
  fiber::RWMutex mu;
  expect_usage_error([&] { mu.unlock(); }, "not held");
  expect_usage_error([&] { mu.unlock_shared(); }, "no read lock");
  mu.lock();
  expect_usage_error([&] { mu.lock(); }, "already holds");
  expect_usage_error([&] { mu.lock_shared(); }, "holds the write lock");
  std::thread([&] { expect_usage_error([&] { mu.unlock(); }, "held by another"); }).join();
  fiber::block_on([&] { expect_usage_error([&] { mu.unlock(); }, "held by another"); });
  mu.unlock();
  CHECK(mu.try_lock());
  mu.unlock();
}

TEST_CASE("rwmutex: a waiting writer blocks new readers and goes before them") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : {Where::fiber, Where::thread}) {
      fiber::RWMutex mu;
      std::mutex order_mu;
      std::vector<std::string> order;
      auto note = [&](const char* what) {
        std::lock_guard g(order_mu);
        order.push_back(what);
      };
      mu.lock_shared();  // R1: this thread
      Team team;
      team.spawn(w, s, [&] {
        std::unique_lock lk(mu);
        note("writer");
      });
      wait_writer_queued(mu);
      team.spawn(w == Where::fiber ? Where::thread : Where::fiber, s, [&] {
        std::shared_lock lk(mu);  // R2 arrives after the writer: must wait for it
        note("reader");
      });
      std::this_thread::sleep_for(2ms);
      {
        std::lock_guard g(order_mu);
        CHECK(order.empty());
      }
      mu.unlock_shared();
      team.join();
      REQUIRE(order.size() == 2);
      CHECK(order[0] == "writer");
      CHECK(order[1] == "reader");
    }
  });
}

TEST_CASE("rwmutex: a writer is not starved by overlapping readers; readers not by writers") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::RWMutex mu;
    std::atomic<bool> stop{false};
    std::atomic<long> reads{0};
    Team team;
    // Readers whose critical sections overlap, so the lock is never free of readers.
    for (int k = 0; k < 4; ++k) {
      team.spawn(k == 0 ? Where::thread : Where::fiber, s, [&] {
        while (!stop.load()) {
          std::shared_lock r(mu);
          reads.fetch_add(1);
          fiber::this_fiber::yield();
        }
      });
    }
    CHECK(wait_for([&] { return reads.load() > 100; }));
    // Writers get in, repeatedly, and readers keep getting in between them.
    team.spawn(Where::fiber, s, [&] {
      for (int i = 0; i < 50; ++i) {
        const long before = reads.load();
        {
          std::lock_guard w(mu);
        }
        if (i % 10 == 9) CHECK(wait_for([&] { return reads.load() > before; }));
      }
      stop = true;
    });
    team.join();
  });
}

TEST_CASE("rwmutex: timed variants - never before the deadline") {
  with_watchdog(60'000ms, "rwmutex timed variants", [] {
    for (Where w : {Where::fiber, Where::thread}) {
      fiber::Scheduler s({.processors = 2, .name = "rwt"});
      fiber::RWMutex mu;
      Team team;
      mu.lock();  // a writer (this thread) holds it
      team.spawn(w, s, [&] {
        auto t0 = Clock::now();
        CHECK_FALSE(mu.try_lock_shared_for(15ms));
        CHECK(Clock::now() - t0 >= 15ms);
        t0 = Clock::now();
        CHECK_FALSE(mu.try_lock_for(15ms));
        CHECK(Clock::now() - t0 >= 15ms);
        CHECK_FALSE(mu.try_lock_until(Clock::now() - 1s));
        CHECK_FALSE(mu.try_lock_shared_for(-1s));
      });
      team.join();
      mu.unlock();
      // A writer that timed out must not keep readers out.
      mu.lock_shared();
      team.spawn(w, s, [&] { CHECK_FALSE(mu.try_lock_for(5ms)); });
      team.join();
      CHECK(mu.try_lock_shared());
      mu.unlock_shared();
      mu.unlock_shared();
      // And readers queued behind it are released when it gives up. It tries again until the
      // reader is in, so a main thread preempted past one 30 ms window still finds it queued; a
      // reader not released stays out for good and the watchdog ends the run.
      mu.lock_shared();
      std::atomic<bool> reader_in{false};
      team.spawn(w, s, [&] {
        while (!reader_in.load()) CHECK_FALSE(mu.try_lock_for(30ms));
      });
      wait_writer_queued(mu);
      team.spawn(Where::fiber, s, [&] {
        std::shared_lock r(mu);
        reader_in = true;
      });
      team.join();
      CHECK(reader_in.load());
      mu.unlock_shared();
      CHECK(mu.try_lock());
      mu.unlock();
    }
  });
}

TEST_CASE("rwmutex: cancelled waiters throw Cancelled and leave the queues") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::RWMutex mu;
    mu.lock();
    auto reader = spawn_cancellable(s, [&] { std::shared_lock r(mu); });
    auto writer = spawn_cancellable(s, [&] { std::unique_lock w(mu); });
    std::this_thread::sleep_for(1ms);
    reader.cancel();
    writer.cancel();
    CHECK(reader.join());  // threw Cancelled
    CHECK(writer.join());  // threw Cancelled
    mu.unlock();
    CHECK(mu.try_lock());
    mu.unlock();
    CHECK(mu.try_lock_shared());
    mu.unlock_shared();
  });
}

TEST_CASE("rwmutex: stress - readers see consistent state, writers are exclusive") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::RWMutex mu;
    long a = 0, b = 0;  // invariant under the lock: a == b
    std::atomic<int> writers_in{0}, readers_in{0};
    const int iters = kTsan ? 500 : (kSanitized ? 2000 : 10000);
    Team team;
    for (int k = 0; k < 6; ++k) {
      const bool writer = k < 2;
      team.spawn(k % 3 == 0 ? Where::thread : Where::fiber, s, [&, writer, k] {
        for (int i = 0; i < iters; ++i) {
          if (writer) {
            bool got = true;
            if (i % 3 == 0) {
              got = mu.try_lock_for(100us);
            } else {
              mu.lock();
            }
            if (!got) continue;
            CHECK(writers_in.fetch_add(1) == 0);
            CHECK(readers_in.load() == 0);
            ++a;
            if (i % 32 == 0) fiber::this_fiber::yield();
            ++b;
            writers_in.fetch_sub(1);
            mu.unlock();
          } else {
            bool got = true;
            if ((i + k) % 3 == 0) {
              got = mu.try_lock_shared_for(100us);
            } else {
              mu.lock_shared();
            }
            if (!got) continue;
            readers_in.fetch_add(1);
            CHECK(writers_in.load() == 0);
            CHECK(a == b);
            readers_in.fetch_sub(1);
            mu.unlock_shared();
          }
        }
      });
    }
    team.join();
    CHECK(a == b);
    CHECK(mu.try_lock());
    mu.unlock();
  });
}
