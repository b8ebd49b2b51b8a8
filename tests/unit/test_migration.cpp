// Migration: a fiber may resume on another processor (thread) after any blocking call.
//
//   1. It does migrate, and what it reads through non-inlined thread_local accessors always
//      belongs to the thread it runs on *now* (and matches this_fiber::processor_index()).
//   2. errno is per fiber: it survives switches and migrations, and fibers sharing a thread do
//      not see each other's value.
//   3. PinGuard keeps a fiber on one processor through yields, sleeps and wakes from other
//      threads; after the guard it migrates again.
//   4. The floating-point rounding mode (x87 control word and MXCSR) is per fiber, as errno is.
//
// Thread identity is read with the gettid system call (os_tid): pthread_self() and errno's
// address are declared __attribute__((const)), so a compiler may reuse a value read before a
// switch. The thread_local / errno accessors below are noinline for the same reason.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <cerrno>
#include <cfenv>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

thread_local pid_t t_cached_tid = 0;

// The tid of the thread whose thread_local block this reads, cached there on first use.
__attribute__((noinline)) pid_t tls_tid() {
  asm volatile("" ::: "memory");
  if (t_cached_tid == 0) t_cached_tid = os_tid();
  return t_cached_tid;
}
__attribute__((noinline)) void set_errno(int v) {
  asm volatile("" ::: "memory");
  errno = v;
}
__attribute__((noinline)) int get_errno() {
  asm volatile("" ::: "memory");
  return errno;
}

// Fibers that keep every processor of a scheduler busy (yields, short sleeps), so that queues
// fill, idle processors steal, and fibers move between threads.
class Churn {
 public:
  Churn(fiber::Scheduler& s, int fibers) {
    for (int i = 0; i < fibers; ++i) {
      hs_.push_back(fiber::spawn({.scheduler = &s, .name = "churn"}, [this, i] {
        long n = 0;
        while (!stop_.load(std::memory_order_relaxed)) {
          for (int k = 0; k < 50; ++k) fiber::this_fiber::yield();
          fiber::this_fiber::sleep_for(std::chrono::microseconds(50 + 25 * (i % 4)));
          ++n;
        }
        return n;
      }));
    }
  }
  ~Churn() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& h : hs_) {
      if (h.joinable()) h.join();
    }
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<fiber::JoinHandle<long>> hs_;
};

// A plain thread that wakes fibers: a fiber calls wait_for_thread(), which parks it on a
// WaitGroup that this thread completes. Every wait gets its own WaitGroup, never reused, all
// alive until the Waker is destroyed (after the fibers are done).
class Waker {
 public:
  explicit Waker(std::size_t capacity) : wgs_(capacity), thread_([this] { run(); }) {}
  ~Waker() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  // Parks the calling fiber until the waker thread wakes it.
  void wait_for_thread() {
    const std::size_t i = next_.fetch_add(1);
    if (i >= wgs_.size()) {  // a test bug; no doctest macro here (it could touch errno)
      std::fprintf(stderr, "Waker: capacity %zu exceeded\n", wgs_.size());
      std::abort();
    }
    fiber::WaitGroup& wg = wgs_[i];
    wg.add(1);
    {
      std::lock_guard lock(mu_);
      queue_.push_back(i);
    }
    cv_.notify_one();
    wg.wait();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      const std::size_t i = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::this_thread::sleep_for(20us);  // let the fiber park first, mostly
      wgs_[i].done();
      lock.lock();
    }
  }

  std::vector<fiber::WaitGroup> wgs_;
  std::atomic<std::size_t> next_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::size_t> queue_;  // GUARDED_BY(mu_)
  bool stop_ = false;              // GUARDED_BY(mu_)
  std::thread thread_;
};

struct TaggedValue {
  int value;
};

struct Observed {
  int iterations = 0;
  int changes = 0;          // resumed on a different thread than before
  int tls_mismatch = 0;     // thread_local read gave another thread's value
  int index_mismatch = 0;   // processor_index() disagrees with the thread's name
  std::size_t threads = 0;  // distinct threads seen
};

// One blocking step of kind i % 4: yield, sleep, a wake from a plain thread, sleep_until.
void blocking_step(int i, Waker* waker) {
  switch (i % 4) {
    case 0: fiber::this_fiber::yield(); break;
    case 1: fiber::this_fiber::sleep_for(30us); break;
    case 2:
      if (waker) waker->wait_for_thread(); else fiber::this_fiber::yield();
      break;
    default: fiber::this_fiber::sleep_until(Clock::now() + 10us); break;
  }
}

bool index_matches_thread(const std::string& sched_name) {
  return thread_name() == sched_name + "-P" + std::to_string(fiber::this_fiber::processor_index());
}

}  // namespace

TEST_CASE("migration: fibers change threads, and thread_locals read through noinline calls follow") {
  with_watchdog(60'000ms, "migration observation", [] {
    fiber::Scheduler s({.processors = 4, .name = "mig"});
    constexpr int kFibers = 4;
    constexpr int kIters = 1200;
    Waker waker(kFibers * kIters / 4 + 16);
    Churn churn(s, 6);
    std::vector<fiber::JoinHandle<Observed>> hs;
    for (int f = 0; f < kFibers; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&waker] {
        Observed o;
        std::set<pid_t> seen;
        pid_t prev = os_tid();
        seen.insert(prev);
        for (int i = 0; i < kIters; ++i) {
          blocking_step(i, &waker);
          const pid_t now = os_tid();
          o.tls_mismatch += tls_tid() != now;
          o.index_mismatch += !index_matches_thread("mig");
          o.changes += now != prev;
          seen.insert(now);
          prev = now;
          ++o.iterations;
        }
        o.threads = seen.size();
        return o;
      }));
    }
    int total_changes = 0;
    for (auto& h : hs) {
      const Observed o = h.join();
      CHECK(o.iterations == kIters);
      CHECK(o.tls_mismatch == 0);
      CHECK(o.index_mismatch == 0);
      CHECK(o.threads <= 4u);
      total_changes += o.changes;
      MESSAGE("fiber migrated " << o.changes << " times over " << o.threads << " threads");
    }
    CHECK_MESSAGE(total_changes > 0, "no fiber ever changed threads on a 4-processor scheduler");
    churn.stop();
    quiesce(s);
  });
}

TEST_CASE("migration: errno survives switches and migrations, per fiber") {
  with_watchdog(60'000ms, "errno", [] {
    fiber::Scheduler s({.processors = 4, .name = "errno"});
    constexpr int kFibers = 8;
    constexpr int kIters = 800;
    Waker waker(kFibers * kIters / 4 + 16);
    Churn churn(s, 4);
    struct Result {
      int wrong = 0;
      int first_wrong_value = 0;
      int changes = 0;
    };
    std::vector<fiber::JoinHandle<Result>> hs;
    for (int f = 0; f < kFibers; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&waker, f] {
        Result r;
        int mine = 1234 + 1000 * f;
        set_errno(mine);
        pid_t prev = os_tid();
        for (int i = 0; i < kIters; ++i) {
          blocking_step(i + f, &waker);
          const int got = get_errno();
          if (got != mine) {
            if (r.wrong++ == 0) r.first_wrong_value = got;
          }
          const pid_t now = os_tid();
          r.changes += now != prev;
          prev = now;
          if (i % 10 == 9) {  // a new value now and then: the latest one must survive
            mine = 1234 + 1000 * f + i;
            set_errno(mine);
          }
        }
        return r;
      }));
    }
    int changes = 0;
    for (int f = 0; f < kFibers; ++f) {
      const Result r = hs[f].join();
      CHECK_MESSAGE(r.wrong == 0, "fiber " << f << ": errno wrong " << r.wrong << " times, first value "
                                            << r.first_wrong_value);
      changes += r.changes;
    }
    CHECK_MESSAGE(changes > 0, "no migration happened, so errno was never carried across threads");
    churn.stop();
    quiesce(s);
  });
}

// The C++ runtime keeps the exceptions being handled (a catch block's, for `throw;` and
// std::current_exception) and std::uncaught_exceptions() per thread. A fiber that switches
// inside a catch block, or while unwinding, must find its own on whatever thread resumes it, and
// must not see or disturb another fiber's: without the switch carrying them, fibers that catch
// on one thread popped each other's exceptions (leaked under ASan, a wrong `throw;` otherwise).
TEST_CASE("migration: exceptions being handled, and uncaught_exceptions(), are per fiber") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kFibers = 8;
    constexpr int kRounds = 200;
    std::vector<fiber::JoinHandle<int>> hs;
    for (int f = 0; f < kFibers; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [f] {
        int wrong = 0;
        for (int i = 0; i < kRounds; ++i) {
          const int mine = f * 100'000 + i;
          try {
            throw TaggedValue{mine};
          } catch (const TaggedValue&) {
            fiber::this_fiber::yield();  // others catch and rethrow meanwhile, here or elsewhere
            try {
              throw;  // must rethrow this fiber's exception
            } catch (const TaggedValue& again) {
              wrong += again.value != mine;
            }
            wrong += std::uncaught_exceptions() != 0;
          }
          // Unwinding through a destructor that switches: uncaught_exceptions() is 1 in it, and
          // 0 again for every other fiber meanwhile.
          try {
            struct SwitchesInDestructor {
              int* wrong;
              int unwinding;  // 1 while an exception passes through, else 0
              ~SwitchesInDestructor() {
                *wrong += std::uncaught_exceptions() != unwinding;
                fiber::this_fiber::yield();
                *wrong += std::uncaught_exceptions() != unwinding;
              }
            } guard{&wrong, i % 2 == 0 ? 1 : 0};
            if (i % 2 == 0) throw TaggedValue{mine};
            wrong += std::uncaught_exceptions() != 0;
          } catch (const TaggedValue& e) {
            wrong += e.value != mine;
          }
          if (i % 2 == 1) fiber::this_fiber::yield();
          wrong += std::uncaught_exceptions() != 0;
        }
        return wrong;
      }));
    }
    for (int f = 0; f < kFibers; ++f) CHECK_MESSAGE(hs[f].join() == 0, "fiber " << f);
  });
}

// The switch saves and restores the x87 control word and MXCSR with the other callee-saved
// state (context/jump.cpp): a fiber's rounding mode is its own. Four fibers, one per mode, on
// two processors, each checking its mode and a quotient that depends on it across yields.
TEST_CASE("migration: the floating-point rounding mode is per fiber, across switches and migrations") {
  with_watchdog(60'000ms, "rounding", [] {
    fiber::Scheduler s({.processors = 2, .name = "fenv"});
    constexpr int kModes[] = {FE_TONEAREST, FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO};
    constexpr int kYields = 2000;
    std::atomic<int> started{0};
    struct Result {
      int wrong_mode = 0;
      int wrong_sse = 0;
      int wrong_value = 0;
      double third = 0;
    };
    std::vector<fiber::JoinHandle<Result>> hs;
    for (int mode : kModes) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [mode, &started] {
        Result r;
        REQUIRE(std::fesetround(mode) == 0);
        volatile double one = 1.0, three = 3.0;
        r.third = one / three;
        started.fetch_add(1);
        while (started.load() < 4) fiber::this_fiber::yield();  // all four modes live at once
        for (int i = 0; i < kYields; ++i) {
          fiber::this_fiber::yield();
          r.wrong_mode += std::fegetround() != mode;  // the x87 control word
#if defined(__x86_64__)
          // MXCSR's rounding control (bits 13-14) uses the same encoding, shifted.
          r.wrong_sse += static_cast<int>(_mm_getcsr() & 0x6000) != mode << 3;
#endif
          r.wrong_value += one / three != r.third;  // SSE arithmetic
        }
        std::fesetround(FE_TONEAREST);
        return r;
      }));
    }
    std::vector<double> thirds;
    for (std::size_t i = 0; i < hs.size(); ++i) {
      const Result r = hs[i].join();
      CHECK_MESSAGE(r.wrong_mode == 0, "fiber " << i << ": fegetround() wrong " << r.wrong_mode << " times");
      CHECK_MESSAGE(r.wrong_sse == 0, "fiber " << i << ": MXCSR rounding wrong " << r.wrong_sse << " times");
      CHECK_MESSAGE(r.wrong_value == 0, "fiber " << i << ": 1/3 changed " << r.wrong_value << " times");
      thirds.push_back(r.third);
    }
    // The modes really differ: upward and downward round 1/3 apart.
    CHECK(thirds[1] > thirds[2]);
    CHECK(std::fegetround() == FE_TONEAREST);  // the test's own thread is untouched
    quiesce(s);
  });
}

TEST_CASE("migration: PinGuard keeps a fiber on its processor; afterwards it migrates again") {
  with_watchdog(90'000ms, "PinGuard", [] {
    fiber::Scheduler s({.processors = 4, .name = "pin"});
    constexpr int kPinned = 4;
    constexpr int kSteps = 200;
    Waker waker(kPinned * (kSteps / 4 + 2000) + 16);
    Churn churn(s, 6);
    struct Result {
      int moved_while_pinned = 0;
      int index_changed = 0;
      int tls_mismatch = 0;
      int name_mismatch = 0;
      bool migrated_after = false;
      int steps_until_migrated = 0;
    };
    std::vector<fiber::JoinHandle<Result>> hs;
    for (int f = 0; f < kPinned; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&waker, f] {
        Result r;
        pid_t pinned_tid = 0;
        {
          fiber::this_fiber::PinGuard pin;
          pinned_tid = os_tid();
          const unsigned idx = fiber::this_fiber::processor_index();
          for (int i = 0; i < kSteps; ++i) {
            if (i % 25 == 0) {
              fiber::this_fiber::PinGuard nested;  // nesting keeps the pin
              fiber::this_fiber::yield();
            } else {
              blocking_step(i + f, &waker);
            }
            r.moved_while_pinned += os_tid() != pinned_tid;
            r.index_changed += fiber::this_fiber::processor_index() != idx;
            r.tls_mismatch += tls_tid() != os_tid();
            r.name_mismatch += !index_matches_thread("pin");
          }
        }
        // Unpinned: keep blocking until it resumes on another thread (bounded).
        const auto deadline = Clock::now() + scaled(5'000ms);
        for (int i = 0; Clock::now() < deadline; ++i) {
          blocking_step(i, i % 4 == 2 && i < 2000 ? &waker : nullptr);
          r.tls_mismatch += tls_tid() != os_tid();
          if (os_tid() != pinned_tid) {
            r.migrated_after = true;
            r.steps_until_migrated = i + 1;
            break;
          }
        }
        return r;
      }));
    }
    for (int f = 0; f < kPinned; ++f) {
      const Result r = hs[f].join();
      CAPTURE(f);
      CHECK(r.moved_while_pinned == 0);
      CHECK(r.index_changed == 0);
      CHECK(r.tls_mismatch == 0);
      CHECK(r.name_mismatch == 0);
      CHECK_MESSAGE(r.migrated_after, "fiber " << f << " never left its processor after the PinGuard");
      MESSAGE("fiber " << f << " migrated " << r.steps_until_migrated << " steps after unpinning");
    }
    churn.stop();
    quiesce(s);
  });
}

TEST_CASE("migration: PinGuard on a busy single fiber with only plain-thread wakes") {
  // Every resume of the pinned fiber comes from the waker thread (inject -> any processor), so
  // each one must be redirected to the pinned processor.
  with_watchdog(60'000ms, "PinGuard wakes", [] {
    fiber::Scheduler s({.processors = 4, .name = "pw"});
    constexpr int kWakes = 300;
    Waker waker(kWakes + 16);
    Churn churn(s, 3);
    auto moved = fiber::spawn({.scheduler = &s}, [&waker] {
      fiber::this_fiber::PinGuard pin;
      const pid_t t0 = os_tid();
      int moved = 0;
      for (int i = 0; i < kWakes; ++i) {
        waker.wait_for_thread();
        moved += os_tid() != t0;
      }
      return moved;
    }).join();
    CHECK(moved == 0);
    churn.stop();
    quiesce(s);
  });
}

TEST_CASE("migration: waking pinned fibers from a plain thread does not stop idle processors from being woken") {
  // A pinned fiber woken from outside goes to its processor's inbox, and that processor is woken
  // directly. That path must keep the idle bookkeeping (who sleeps, who searches) balanced: if
  // it does not, a later spawn from a plain thread may wake nobody and never run (a lost
  // wakeup). The check is bounded; if the fiber is stranded, a pinned helper is woken the same
  // way to rescue it, so the scheduler can still be stopped.
  with_watchdog(60'000ms, "pinned wakes", [] {
    fiber::Scheduler s({.processors = 4, .name = "pw2"});
    constexpr int kWakes = 300;
    auto wgs = std::make_unique<fiber::WaitGroup[]>(kWakes);
    fiber::WaitGroup rescue;
    rescue.add(1);
    std::atomic<bool> helper_parked{false};
    auto helper = fiber::spawn({.scheduler = &s}, [&] {
      fiber::this_fiber::PinGuard pin;
      helper_parked = true;
      rescue.wait();
    });
    REQUIRE(wait_for([&] { return helper_parked.load(); }));

    std::atomic<int> parked_at{-1};
    auto pinned = fiber::spawn({.scheduler = &s}, [&] {
      fiber::this_fiber::PinGuard pin;
      for (int i = 0; i < kWakes; ++i) {
        wgs[i].add(1);
        parked_at = i;
        wgs[i].wait();
      }
    });
    for (int i = 0; i < kWakes; ++i) {
      while (parked_at.load() < i) std::this_thread::yield();
      std::this_thread::sleep_for(50us);  // it parks, its processor goes to sleep
      wgs[i].done();
    }
    pinned.join();
    std::this_thread::sleep_for(20ms);  // every processor idle again

    std::atomic<bool> ran{false};
    fiber::spawn({.scheduler = &s}, [&ran] { ran = true; }).detach();
    const bool ran_in_time = wait_for([&] { return ran.load(); }, 3'000ms);
    CHECK_MESSAGE(ran_in_time, "a fiber spawned from a plain thread after " << kWakes
                                                                        << " wakes of a pinned fiber never ran: no "
                                                                           "processor was woken for it");
    rescue.done();  // wakes the pinned helper's processor, which also finds a stranded fiber
    CHECK(wait_for([&] { return ran.load(); }, 10'000ms));
    helper.join();
    quiesce(s);
  });
}

TEST_CASE("migration: a pinned fiber's yields stay off the stealable queue; nobody is woken for them") {
  // A fiber pinned here that yielded went to the ring while another processor slept: that one
  // was woken to steal it, found it pinned elsewhere and sent it back through the inbox - a
  // thread wake, a steal and a locked inbox push per switch, for nothing. Fibers pinned to a
  // processor now wait in a queue of its own that no thief sees, and nobody is woken for them.
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        constexpr int kYields = 10'000;
        struct Counts {
          std::uint64_t steals = 0, wakeups = 0;
          bool moved = false;
        };
        // Two fibers pinned to one processor, yielding to each other (a lone fiber's yield with
        // nothing else to run queues nothing).
        const Counts c = fiber::spawn({.scheduler = &s}, [&s] {
          fiber::this_fiber::PinGuard pin;
          const pid_t tid = os_tid();
          std::atomic<bool> partner_pinned{false};
          // Spawned here into the LIFO slot, which no thief takes: it runs here, and pins here.
          auto partner = fiber::spawn([&partner_pinned, tid] {
            fiber::this_fiber::PinGuard pin;
            bool moved = false;
            partner_pinned = true;
            for (int i = 0; i < kYields; ++i) {
              fiber::this_fiber::yield();
              moved |= os_tid() != tid;
            }
            return moved;
          });
          while (!partner_pinned) fiber::this_fiber::yield();
          const fiber::SchedulerStats before = s.stats();
          Counts r;
          for (int i = 0; i < kYields; ++i) {
            fiber::this_fiber::yield();
            r.moved |= os_tid() != tid;
          }
          const fiber::SchedulerStats after = s.stats();
          r.moved |= partner.join();
          r.steals = after.steals - before.steals;
          r.wakeups = after.wakeups - before.wakeups;
          return r;
        }).join();
        CHECK_FALSE(c.moved);
        CHECK_MESSAGE(c.steals < 50, c.steals << " steals during " << kYields << " yields of a pinned fiber");
        CHECK_MESSAGE(c.wakeups < 50, c.wakeups << " wakeups during " << kYields << " yields of a pinned fiber");
      },
      {2, 4});
}
