// fiber::CondVar (fiber/condvar.hpp): predicate waits with fiber::Mutex through
// std::unique_lock, notify_one wakes one, notify_all wakes all, timeouts never early, a
// producer/consumer queue with fibers and threads on both sides, other lock types, misuse, and
// cancellation (the lock is re-taken before Cancelled propagates).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <deque>
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

}  // namespace

TEST_CASE("condvar: producer/consumer queue, fibers and threads on both sides") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Mutex mu;
    fiber::CondVar not_empty, not_full;
    std::deque<int> q;  // bounded at 4
    bool done = false;
    const int producers = 3, per = kTsan ? 500 : (kSanitized ? 2000 : 10000);
    std::vector<std::atomic<int>> seen(producers * per);
    fiber::WaitGroup wg;
    wg.add(producers);
    Team team;
    for (int p = 0; p < producers; ++p) {
      team.spawn(p == 0 ? Where::thread : Where::fiber, s, [&, p] {
        for (int i = 0; i < per; ++i) {
          std::unique_lock lk(mu);
          if (i % 2) {
            not_full.wait(lk, [&] { return q.size() < 4; });
          } else {
            while (!not_full.wait_for(lk, 100us, [&] { return q.size() < 4; })) {
            }
          }
          q.push_back(p * per + i);
          lk.unlock();
          not_empty.notify_one();
        }
        wg.done();
      });
    }
    team.spawn(Where::fiber, s, [&] {
      wg.wait();
      {
        std::lock_guard g(mu);
        done = true;
      }
      not_empty.notify_all();
    });
    std::atomic<long> consumed{0};
    for (int c = 0; c < 3; ++c) {
      team.spawn(c == 0 ? Where::thread : Where::fiber, s, [&] {
        for (;;) {
          std::unique_lock lk(mu);
          not_empty.wait(lk, [&] { return !q.empty() || done; });
          if (q.empty()) return;
          const int v = q.front();
          q.pop_front();
          lk.unlock();
          not_full.notify_one();
          seen[v].fetch_add(1);
          consumed.fetch_add(1);
        }
      });
    }
    team.join();
    CHECK(consumed.load() == producers * per);
    int bad = 0;
    for (auto& x : seen) bad += x.load() != 1;
    CHECK(bad == 0);
  });
}

TEST_CASE("condvar: notify_one wakes one waiter, notify_all wakes every waiter") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Mutex mu;
    fiber::CondVar cv;
    int tickets = 0;
    int waiting = 0;
    std::atomic<int> woken{0};
    const int n = 12;
    Team team;
    for (int i = 0; i < n; ++i) {
      team.spawn(i % 3 == 0 ? Where::thread : Where::fiber, s, [&] {
        std::unique_lock lk(mu);
        ++waiting;
        cv.wait(lk, [&] { return tickets > 0; });
        --tickets;
        woken.fetch_add(1);
      });
    }
    CHECK(wait_for([&] {
      std::lock_guard g(mu);
      return waiting == n;
    }));
    {
      std::lock_guard g(mu);
      tickets = 1;
    }
    cv.notify_one();
    CHECK(wait_for([&] { return woken.load() == 1; }));
    std::this_thread::sleep_for(2ms);
    CHECK(woken.load() == 1);  // the others stay asleep (no spurious wakeups)
    {
      std::lock_guard g(mu);
      tickets = n - 1;
    }
    cv.notify_all();
    team.join();
    CHECK(woken.load() == n);
    cv.notify_one();  // no waiter: a no-op
    cv.notify_all();
  });
}

TEST_CASE("condvar: timeouts are never early; negative timeouts return at once") {
  for (Where w : {Where::fiber, Where::thread}) {
    fiber::Scheduler s({.processors = 2, .name = "cvt"});
    Team team;
    team.spawn(w, s, [] {
      fiber::Mutex mu;
      fiber::CondVar cv;
      std::unique_lock lk(mu);
      auto t0 = Clock::now();
      CHECK(cv.wait_for(lk, 20ms) == std::cv_status::timeout);
      CHECK(Clock::now() - t0 >= 20ms);
      CHECK(lk.owns_lock());
      t0 = Clock::now();
      CHECK_FALSE(cv.wait_until(lk, t0 + 10ms, [] { return false; }));
      CHECK(Clock::now() >= t0 + 10ms);
      CHECK(cv.wait_for(lk, -1s) == std::cv_status::timeout);
      CHECK(cv.wait_for(lk, -1s, [] { return true; }));
      CHECK_FALSE(cv.wait_for(lk, 0s, [] { return false; }));
      CHECK(lk.owns_lock());
      CHECK(mu.is_locked());
    });
    team.join();
  }
}

TEST_CASE("condvar: works with other locks; misuse is a UsageError") {
  fiber::CondVar cv;
  // std::mutex and fiber::RWMutex (write side) from threads and fibers.
  std::mutex smu;
  fiber::RWMutex rw;
  bool flag = false, flag2 = false;
  fiber::Scheduler s({.processors = 2, .name = "cvo"});
  Team team;
  team.spawn(Where::fiber, s, [&] {
    std::unique_lock lk(rw);
    cv.wait(lk, [&] { return flag2; });
  });
  team.spawn(Where::thread, s, [&] {
    std::unique_lock lk(smu);
    cv.wait(lk, [&] { return flag; });
  });
  std::this_thread::sleep_for(1ms);
  {
    std::lock_guard g(smu);
    flag = true;
  }
  {
    std::lock_guard g(rw);
    flag2 = true;
  }
  cv.notify_all();
  team.join();

  fiber::Mutex mu;
  std::unique_lock<fiber::Mutex> not_held(mu, std::defer_lock);
  try {
    cv.wait(not_held);
    FAIL_CHECK("no exception");
  } catch (const fiber::UsageError& e) {
    CHECK(contains(e.what(), "not held"));
  }
  CHECK_FALSE(mu.is_locked());
}

TEST_CASE("condvar: a cancelled waiter re-takes the lock, then throws Cancelled") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Mutex mu;
    fiber::CondVar cv;
    std::atomic<bool> waiting{false};
    std::atomic<bool> held_after{false};
    auto h = spawn_cancellable(s, [&] {
      std::unique_lock lk(mu);
      waiting = true;
      try {
        cv.wait(lk);
      } catch (const fiber::Cancelled&) {
        held_after = lk.owns_lock() && mu.is_locked();
        throw;
      }
    });
    CHECK(wait_for([&] { return waiting.load(); }));
    std::this_thread::sleep_for(1ms);
    h.cancel();
    CHECK(h.join());  // threw Cancelled
    CHECK(held_after.load());
    CHECK_FALSE(mu.is_locked());  // released by the unique_lock during unwinding
    cv.notify_one();              // the queue is empty again
  });
}

TEST_CASE("condvar: a notified waiter whose re-lock is cancelled passes the notify on") {
  // c1 is notified, then cancelled while the notifier still holds the mutex: its re-lock
  // throws Cancelled, and the notify_one it consumed must reach c2, which waits for the same
  // item. One processor, so c1 runs its re-lock while the notifier sleeps holding the lock.
  fiber::Scheduler s({.processors = 1});
  fiber::Mutex mu;
  fiber::CondVar cv;
  int items = 0;  // guarded by mu
  std::atomic<int> waiting{0}, consumed{0}, cancelled{0};
  auto consumer = [&] {
    try {
      std::unique_lock lk(mu);
      ++waiting;
      cv.wait(lk, [&] { return items > 0; });
      --items;
      ++consumed;
    } catch (const fiber::Cancelled&) {
      ++cancelled;
      throw;
    }
  };
  auto c1 = spawn_cancellable(s, consumer);
  REQUIRE(wait_for([&] { return waiting.load() == 1; }));
  auto c2 = spawn_cancellable(s, consumer);
  REQUIRE(wait_for([&] { return waiting.load() == 2; }));
  fiber::block_on({.scheduler = &s}, [&] {
    std::unique_lock lk(mu);
    items = 1;
    cv.notify_one();  // claims c1, the longest waiter
    c1.cancel();
    fiber::this_fiber::sleep_for(20ms);  // c1 now finds the mutex held and takes the cancel
  });
  const bool c2_consumed = wait_for([&] { return consumed.load() == 1; });
  CHECK(c2_consumed);
  if (!c2_consumed) c2.cancel();  // the notify was lost: end c2 rather than hang
  CHECK(c1.join());               // threw Cancelled
  CHECK_FALSE(c2.join());
  CHECK(cancelled.load() == 1);
  CHECK(items == 0);
}

namespace {
// A lock whose unlock() notifies another condition variable: a wait on it runs that notify in
// its window, between making itself wakeable and switching away.
struct NotifyingLock {
  fiber::Mutex mu;
  fiber::CondVar* notifies = nullptr;
  void lock() { mu.lock(); }
  void unlock() {
    mu.unlock();
    notifies->notify_all();
  }
};
}  // namespace

TEST_CASE("condvar: two waits whose unlocks notify each other, on two threads, never wait for each other") {
  // A's unlock wakes B, B's wakes A, each from inside its own wait's window (on two schedulers,
  // so on two threads). A waker that finds its fiber still switching away waits for the switch
  // (processor.cpp, unpark); were that true inside a window as well, two such windows would
  // wait for each other for ever. Both run their rounds to the end.
  constexpr int kRounds = 20'000;
  fiber::Scheduler s1({.processors = 1, .name = "cva"});
  fiber::Scheduler s2({.processors = 1, .name = "cvb"});
  fiber::CondVar ca, cb;
  NotifyingLock la{.notifies = &cb}, lb{.notifies = &ca};
  std::atomic<int> rounds{0};
  auto body = [&rounds](NotifyingLock& l, fiber::CondVar& cv) {
    for (int i = 0; i < kRounds; ++i) {
      std::unique_lock lk(l);
      cv.wait_for(lk, 100us);  // the other's unlock, or the timeout
      rounds.fetch_add(1, std::memory_order_relaxed);
    }
  };
  with_watchdog(scaled(60'000ms), "mutually notifying condvar waits", [&] {
    auto a = fiber::spawn({.scheduler = &s1}, [&] { body(la, ca); });
    auto b = fiber::spawn({.scheduler = &s2}, [&] { body(lb, cb); });
    a.join();
    b.join();
  });
  CHECK(rounds.load() == 2 * kRounds);
}
