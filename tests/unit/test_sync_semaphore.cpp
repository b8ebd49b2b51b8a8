// fiber::Semaphore, fiber::Latch and fiber::Barrier: counting, FIFO handover, bounds and misuse,
// timed waits never early, cancellation, and fibers and threads together on 1-8 processors.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

}  // namespace

// ------------------------------------------------------------------------------ Semaphore

TEST_CASE("semaphore: counting, bounds and misuse") {
  fiber::Semaphore sem(2, 3);
  CHECK(sem.available() == 2);
  CHECK(sem.max() == 3);
  CHECK(sem.try_acquire());
  CHECK(sem.try_acquire());
  CHECK_FALSE(sem.try_acquire());
  sem.release(3);
  CHECK(sem.available() == 3);
  expect_usage_error([&] { sem.release(); }, "exceed the maximum of 3");
  CHECK(sem.available() == 3);  // nothing released
  expect_usage_error([&] { sem.release(-1); }, "negative");
  sem.release(0);
  expect_usage_error([] { fiber::Semaphore bad(-1); }, "0 <= initial <= max");
  expect_usage_error([] { fiber::Semaphore bad(5, 4); }, "0 <= initial <= max");
  expect_usage_error([] { fiber::Semaphore bad(0, 0); }, "max >= 1");
  fiber::Semaphore unbounded;
  unbounded.release(fiber::Semaphore::kUnbounded);
  expect_usage_error([&] { unbounded.release(); }, "exceed");
}

TEST_CASE("semaphore: timed acquire is never early; negative means try") {
  for (Where w : {Where::fiber, Where::thread}) {
    fiber::Scheduler s({.processors = 1, .name = "semt"});
    Team team;
    team.spawn(w, s, [] {
      fiber::Semaphore sem(0);
      auto t0 = Clock::now();
      CHECK_FALSE(sem.try_acquire_for(20ms));
      CHECK(Clock::now() - t0 >= 20ms);
      t0 = Clock::now();
      CHECK_FALSE(sem.try_acquire_until(t0 + 10ms));
      CHECK(Clock::now() >= t0 + 10ms);
      CHECK_FALSE(sem.try_acquire_for(-1s));
      sem.release();
      CHECK(sem.try_acquire_for(-1s));
    });
    team.join();
  }
}

TEST_CASE("semaphore: limits concurrency; permits handed over FIFO, none lost") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int permits = 3, workers = 10, iters = kTsan ? 200 : (kSanitized ? 1000 : 5000);
    fiber::Semaphore sem(permits, permits);
    std::atomic<int> inside{0}, max_inside{0};
    std::atomic<long> done{0};
    Team team;
    for (int k = 0; k < workers; ++k) {
      team.spawn(k % 4 == 0 ? Where::thread : Where::fiber, s, [&, k] {
        for (int i = 0; i < iters; ++i) {
          if ((i + k) % 3 == 0) {
            if (!sem.try_acquire_for(50us)) continue;
          } else {
            sem.acquire();
          }
          const int now = inside.fetch_add(1) + 1;
          int m = max_inside.load();
          while (now > m && !max_inside.compare_exchange_weak(m, now)) {
          }
          CHECK(now <= permits);
          if (i % 16 == 0) fiber::this_fiber::yield();
          inside.fetch_sub(1);
          done.fetch_add(1);
          sem.release();
        }
      });
    }
    team.join();
    CHECK(sem.available() == permits);  // every permit came back
    CHECK(max_inside.load() <= permits);
    CHECK(done.load() > 0);
  });
}

TEST_CASE("semaphore: a cancelled waiter leaves no permit behind") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Semaphore sem(0);
    auto h = spawn_cancellable(s, [&] { sem.acquire(); });
    std::this_thread::sleep_for(1ms);
    h.cancel();
    CHECK(h.join());  // threw Cancelled
    sem.release();
    CHECK(sem.available() == 1);  // not handed to the departed waiter
  });
}

// ------------------------------------------------------------------------------ Latch

TEST_CASE("latch: waits until the count reaches zero; misuse throws") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int n = 10;
    fiber::Latch start(1), arrived(n);
    std::atomic<int> passed{0};
    Team team;
    for (int i = 0; i < n; ++i) {
      team.spawn(i % 3 == 0 ? Where::thread : Where::fiber, s, [&] {
        start.wait();
        arrived.arrive_and_wait();
        CHECK(arrived.try_wait());
        passed.fetch_add(1);
      });
    }
    std::this_thread::sleep_for(1ms);
    CHECK(passed.load() == 0);
    CHECK(arrived.count() == n);
    start.count_down();
    team.join();
    CHECK(passed.load() == n);
    arrived.wait();  // stays open
  });
  fiber::Latch l(2);
  expect_usage_error([&] { l.count_down(3); }, "exceeds the count 2");
  expect_usage_error([&] { l.count_down(-1); }, "negative");
  CHECK(l.count() == 2);
  expect_usage_error([] { fiber::Latch bad(-1); }, "negative");
  auto t0 = Clock::now();
  CHECK_FALSE(l.wait_for(10ms));
  CHECK(Clock::now() - t0 >= 10ms);
  CHECK_FALSE(l.wait_for(-1s));
  l.count_down(2);
  CHECK(l.wait_for(-1s));
  CHECK(l.wait_until(Clock::now() + 1h));
  {
    fiber::Latch closed_latch(1);  // other clocks' extremes: min() is long past, max() is never
    CHECK_FALSE(closed_latch.wait_until(std::chrono::system_clock::time_point::min()));
    CHECK_FALSE(closed_latch.wait_until(std::chrono::system_clock::now() - 1h));
    closed_latch.count_down();
    CHECK(closed_latch.wait_until(std::chrono::system_clock::time_point::max()));
  }
  expect_usage_error([&] { l.count_down(); }, "exceeds the count 0");
}

namespace {
// For the test below: a thread_local whose destructor waits on a Latch. Constructed before the
// thread's first wait, so it is destroyed after whatever the runtime ties to that wait.
fiber::Latch g_dtor_latch(1), g_other_latch(1);
std::atomic<bool> g_dtor_waiting{false}, g_dtor_done{false}, g_other_done{false};
struct WaitsInDestructor {
  bool armed = false;
  ~WaitsInDestructor() {
    if (!armed) return;
    g_dtor_waiting = true;
    std::this_thread::sleep_for(100ms);  // let the other thread take the pooled parker and sleep
    g_dtor_latch.wait();
    g_dtor_done = true;
  }
};
thread_local WaitsInDestructor t_waits_in_destructor;
}  // namespace

TEST_CASE("thread waits: a wait in a late thread_local destructor shares no parker with another thread") {
  // Once a thread's parker is pooled (its thread_local destructor ran), a later wait of the
  // same thread must not sleep on it: another thread may have taken it from the pool, and one
  // futex word for two sleepers lets a wake meant for one reach the other.
  std::thread t1([] {
    t_waits_in_destructor.armed = true;  // constructed first, destroyed last
    fiber::Latch first(1);
    std::thread helper([&] {
      std::this_thread::sleep_for(10ms);
      first.count_down();
    });
    first.wait();  // the thread's first wait: takes its parker
    helper.join();
  });
  REQUIRE(wait_for([] { return g_dtor_waiting.load(); }));
  std::thread t2([] {
    g_other_latch.wait();  // its first wait: takes the parker t1 pooled
    g_other_done = true;
  });
  std::this_thread::sleep_for(300ms);  // t2 sleeps first, then t1 (any order must work)
  g_dtor_latch.count_down();
  CHECK(wait_for([] { return g_dtor_done.load(); }));
  CHECK_FALSE(g_other_done.load());
  g_other_latch.count_down();
  CHECK(wait_for([] { return g_other_done.load(); }));
  if (!g_dtor_done) g_dtor_latch.count_down();  // already zero; t1 stays stuck: report, don't hang
  t2.join();
  if (g_dtor_done) t1.join(); else t1.detach();
}

namespace {
// For the test below: a pthread key (made after the runtime's own) whose destructor waits.
fiber::Latch g_key_latch(1);
std::atomic<bool> g_key_waiting{false}, g_key_done{false};
void waits_in_key_destructor(void*) {
  g_key_waiting = true;
  g_key_latch.wait();
  g_key_done = true;
}
}  // namespace

TEST_CASE("thread waits: waits in a pthread key destructor work, and the thread's parkers are not lost") {
  // Key destructors run after every thread_local destructor, when the thread has given its
  // parker back; a wait there takes another. Under ASan, LeakSanitizer checks none is lost.
  fiber::Latch warm(1);
  CHECK_FALSE(warm.wait_until(std::chrono::steady_clock::now() + 1ms));  // a thread wait: the runtime's key exists first
  pthread_key_t key;
  REQUIRE(pthread_key_create(&key, waits_in_key_destructor) == 0);
  std::thread t([key] {
    fiber::Latch mine(1);
    std::thread helper([&] { mine.count_down(); });
    mine.wait();
    helper.join();
    pthread_setspecific(key, &g_key_done);
  });
  REQUIRE(wait_for([] { return g_key_waiting.load(); }));
  std::this_thread::sleep_for(20ms);  // let it sleep
  CHECK_FALSE(g_key_done.load());
  g_key_latch.count_down();
  CHECK(wait_for([] { return g_key_done.load(); }));
  t.join();
  pthread_key_delete(key);
}

// ------------------------------------------------------------------------------ Barrier

TEST_CASE("barrier: phases with fibers and threads; one completer per phase") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int parties = 6, rounds = kSanitized ? 50 : 300;
    fiber::Barrier bar(parties);
    std::vector<std::atomic<int>> arrivals(rounds);
    std::vector<std::atomic<int>> completers(rounds);
    Team team;
    for (int k = 0; k < parties; ++k) {
      team.spawn(k % 3 == 0 ? Where::thread : Where::fiber, s, [&] {
        for (int r = 0; r < rounds; ++r) {
          arrivals[r].fetch_add(1);
          if (bar.arrive_and_wait()) completers[r].fetch_add(1);
          // Nobody passes round r's barrier before every party arrived at it.
          CHECK(arrivals[r].load() == parties);
        }
      });
    }
    team.join();
    int bad = 0;
    for (auto& c : completers) bad += c.load() != 1;
    CHECK(bad == 0);
    CHECK(bar.phase() == static_cast<std::uint64_t>(rounds));
  });
}

TEST_CASE("barrier: arrive_and_drop, cancellation and misuse") {
  fiber::Scheduler s({.processors = 2, .name = "bar"});
  fiber::Barrier bar(3);
  Team team;
  std::atomic<int> passed{0};
  team.spawn(Where::fiber, s, [&] {
    bar.arrive_and_wait();
    passed.fetch_add(1);
    bar.arrive_and_wait();  // the next phase expects 2
    passed.fetch_add(1);
  });
  team.spawn(Where::thread, s, [&] {
    bar.arrive_and_wait();
    passed.fetch_add(1);
    bar.arrive_and_wait();
    passed.fetch_add(1);
  });
  std::this_thread::sleep_for(1ms);
  bar.arrive_and_drop();  // completes phase 0 (3 expected: 2 arrived + this one)
  team.join();
  CHECK(passed.load() == 4);
  CHECK(bar.phase() == 2);

  // A cancelled waiter's arrival is withdrawn: the phase still needs a full set.
  fiber::Barrier b2(2);
  auto h = spawn_cancellable(s, [&] { b2.arrive_and_wait(); });
  std::this_thread::sleep_for(1ms);
  h.cancel();
  CHECK(h.join());  // threw Cancelled
  CHECK(b2.phase() == 0);
  team.spawn(Where::fiber, s, [&] { (void)b2.arrive_and_wait(); });
  team.spawn(Where::thread, s, [&] { b2.arrive_and_wait(); });
  team.join();
  CHECK(b2.phase() == 1);

  // The arrival that completes a phase is told so, arrive_and_drop's too: a drop that leaves
  // the phase short returns false and the arrival that fills it true.
  fiber::Barrier b3(2);
  CHECK_FALSE(b3.arrive_and_drop());
  CHECK(b3.phase() == 0);
  CHECK(fiber::spawn({.scheduler = &s}, [&] { return b3.arrive_and_wait(); }).join());
  CHECK(b3.phase() == 1);

  fiber::Barrier one(1);
  CHECK(one.arrive_and_wait());  // a single participant completes every phase itself
  CHECK(one.arrive_and_drop());  // and its drop completes one too
  CHECK(one.phase() == 2);
  expect_usage_error([&] { one.arrive_and_wait(); }, "dropped out");
  expect_usage_error([&] { one.arrive_and_drop(); }, "dropped out");
  expect_usage_error([] { fiber::Barrier bad(0); }, "at least one participant");
}
