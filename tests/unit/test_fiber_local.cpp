// FiberLocal<T> (fiber/fiber_local.hpp): one value per fiber, or per plain thread.
//
//   1. Each fiber has its own value, made on first use, and keeps it across parks and
//      migrations, while a thread_local read in the same places changes with the thread.
//   2. A fiber's values are destroyed on that fiber when its function ends - returned, threw or
//      was cancelled - before join() or block_on returns; a destructor may park (in a fiber not
//      cancelled), and may make values of FiberLocals, which are destroyed too.
//   3. A plain thread's value is its own and is destroyed when the thread exits.
//   4. reset() and emplace() destroy the value they replace; a FiberLocal deleted while fibers
//      hold values leaves them to be destroyed with their fibers, unseen by a new FiberLocal.
//   5. A detached fiber's unhandled-exception handler sees its values; values the handler makes
//      are destroyed too. A thread_local destroyed after the table was emptied may still use a
//      FiberLocal: what it makes is destroyed with the thread.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

// Counts live instances, and checks that each is destroyed where it was made: on the same fiber
// (by id), or the same plain thread.
struct Tracked {
  static inline std::atomic<int> alive{0};
  static inline std::atomic<int> made{0};
  static inline std::atomic<int> wrong_place{0};  // destroyed on another fiber or thread
  int value = -1;
  unsigned long long fiber_id = fiber::this_fiber::id();
  std::thread::id thread = std::this_thread::get_id();

  Tracked() { ++alive, ++made; }
  explicit Tracked(int v) : value(v) { ++alive, ++made; }
  Tracked(const Tracked&) = delete;
  ~Tracked() {
    const bool right = fiber_id != 0 ? fiber::this_fiber::id() == fiber_id : std::this_thread::get_id() == thread;
    if (!right) ++wrong_place;
    --alive;
  }
  static void clear() {
    alive = 0;
    made = 0;
    wrong_place = 0;
  }
};

thread_local int t_marker = 0;
__attribute__((noinline)) int* thread_marker() {
  asm volatile("" ::: "memory");
  return &t_marker;
}

}  // namespace

TEST_CASE("fiber_local: each fiber has its own value, made on first use, kept across parks and migrations") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    Tracked::clear();
    fiber::FiberLocal<Tracked> local;
    constexpr int kFibers = 16;
    constexpr int kRounds = 200;
    std::atomic<int> mismatches{0};
    std::atomic<int> thread_changes{0};
    std::vector<fiber::JoinHandle<void>> hs;
    for (int i = 0; i < kFibers; ++i) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&, i] {
        if (local.has_value()) ++mismatches;  // nothing before the first use
        Tracked& mine = local.get();
        if (mine.value != -1) ++mismatches;  // default-constructed
        mine.value = i;
        int* marker = thread_marker();
        for (int r = 0; r < kRounds; ++r) {
          if (r % 16 == 0) {
            fiber::this_fiber::sleep_for(std::chrono::microseconds(50));
          } else {
            fiber::this_fiber::yield();
          }
          if (&local.get() != &mine || local->value != i || local.get_if() != &mine) ++mismatches;
          if (thread_marker() != marker) {
            ++thread_changes;
            marker = thread_marker();
          }
        }
      }));
    }
    for (auto& h : hs) h.join();
    CHECK(mismatches == 0);
    CHECK(Tracked::made == kFibers);
    CHECK(Tracked::alive == 0);
    CHECK(Tracked::wrong_place == 0);
    if (n > 1) MESSAGE(n << " processors: fibers changed threads " << thread_changes.load() << " times");
    CHECK_FALSE(local.has_value());  // this plain thread never used it
  });
}

TEST_CASE("fiber_local: values die on their fiber when it returns, throws or is cancelled, before join returns") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    Tracked::clear();
    fiber::FiberLocal<Tracked> a;
    fiber::FiberLocal<std::string> b;

    auto returns = fiber::spawn({.scheduler = &s}, [&] {
      a.emplace(1);
      *b = "text";
      return a->value;
    });
    CHECK(returns.join() == 1);
    CHECK(Tracked::alive == 0);

    auto throws = fiber::spawn({.scheduler = &s}, [&] {
      a.emplace(2);
      throw std::runtime_error("boom");
    });
    CHECK_THROWS_WITH_AS(throws.join(), "boom", std::runtime_error);
    CHECK(Tracked::alive == 0);

    std::atomic<bool> parked{false};
    auto cancelled = fiber::spawn({.scheduler = &s}, [&] {
      a.emplace(3);
      parked = true;
      fiber::this_fiber::sleep_for(std::chrono::hours(1));
    });
    REQUIRE(wait_for([&] { return parked.load(); }));
    cancelled.cancel();
    CHECK_THROWS_AS(cancelled.join(), fiber::Cancelled);
    CHECK(Tracked::alive == 0);

    // A destructor that parks: join waits for it, and it still runs on its fiber.
    struct Slow {
      std::atomic<bool>* done;
      ~Slow() {
        fiber::this_fiber::sleep_for(2ms);
        *done = true;
      }
    };
    fiber::FiberLocal<Slow> slow;
    std::atomic<bool> slow_done{false};
    fiber::spawn({.scheduler = &s}, [&] { slow.emplace(&slow_done); }).join();
    CHECK(slow_done);

    // Detached fibers (go), waited for by block_on.
    fiber::block_on({.scheduler = &s}, [&] {
      for (int i = 0; i < 100; ++i) {
        go go_on(s)[&, i] {
          a.emplace(i);
          fiber::this_fiber::yield();
        };
      }
    });
    CHECK(Tracked::made == 103);
    CHECK(Tracked::alive == 0);
    CHECK(Tracked::wrong_place == 0);
  });
}

TEST_CASE("fiber_local: a destructor may use FiberLocals; the values it makes are destroyed too") {
  Tracked::clear();
  fiber::FiberLocal<Tracked> last;
  struct MakesLast {
    fiber::FiberLocal<Tracked>* last;
    ~MakesLast() { last->emplace(7); }
  };
  fiber::FiberLocal<MakesLast> first;
  struct SeesItself {
    fiber::FiberLocal<SeesItself>* self;
    bool* saw_none;
    ~SeesItself() { *saw_none = self->get_if() == nullptr; }  // taken out before it is destroyed
  };
  fiber::FiberLocal<SeesItself> itself;
  bool saw_none = false;
  fiber::Scheduler s({.processors = 1, .name = "fls"});
  fiber::spawn({.scheduler = &s}, [&] {
    first.emplace(&last);
    itself.emplace(&itself, &saw_none);
  }).join();
  CHECK(Tracked::made == 1);
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
  CHECK(saw_none);

  // The same on a plain thread, at its exit.
  Tracked::clear();
  std::thread t([&] { first.emplace(&last); });
  t.join();
  CHECK(Tracked::made == 1);
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
}

TEST_CASE("fiber_local: a plain thread has its own value, destroyed when the thread exits") {
  Tracked::clear();
  fiber::FiberLocal<Tracked> local;
  local.emplace(100);  // this thread's
  Tracked* mine = local.get_if();
  run_on_thread([&] {
    CHECK_FALSE(local.has_value());
    local->value = 5;
    CHECK(local.get().value == 5);
    CHECK(Tracked::alive == 2);
  });
  CHECK(Tracked::alive == 1);  // the other thread's went with it
  CHECK(local.get_if() == mine);
  CHECK(local->value == 100);
  // A fiber does not see the thread's value, nor does block_on's root fiber.
  fiber::Scheduler s({.processors = 2, .name = "fls"});
  fiber::block_on({.scheduler = &s}, [&] { CHECK_FALSE(local.has_value()); });
  local.reset();
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
}

TEST_CASE("fiber_local: reset and emplace destroy what they replace; a deleted FiberLocal's values stay unseen") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    Tracked::clear();
    auto local = std::make_unique<fiber::FiberLocal<Tracked>>();
    fiber::Channel<int> step(0);
    std::atomic<int> failures{0};
    auto h = fiber::spawn({.scheduler = &s}, [&] {
      local->emplace(1);
      local->emplace(2);  // replaces 1
      if (Tracked::alive != 1 || (*local)->value != 2) ++failures;
      local->reset();
      if (Tracked::alive != 0 || local->has_value()) ++failures;
      local->reset();  // nothing to reset
      if ((*local)->value != -1) ++failures;  // made again
      step.send(1);
      step.recv();  // meanwhile: `local` is deleted and a new FiberLocal made
      if (local->has_value()) ++failures;  // the new one has no value here
      if (Tracked::alive != 1) ++failures;  // the old one's lives on, unseen, until the fiber ends
    });
    step.recv();
    local.reset();                                              // deletes the FiberLocal...
    local = std::make_unique<fiber::FiberLocal<Tracked>>();     // ...likely reusing its slot
    step.send(1);
    h.join();
    CHECK(failures == 0);
    CHECK(Tracked::made == 3);  // 1, 2 and the default made again, which died with the fiber
    CHECK(Tracked::alive == 0);
    CHECK(Tracked::wrong_place == 0);
  });
}

TEST_CASE("fiber_local: many FiberLocals in one fiber; the next fiber (on the same stack, likely) starts with none") {
  Tracked::clear();
  std::vector<std::unique_ptr<fiber::FiberLocal<Tracked>>> locals;
  for (int i = 0; i < 100; ++i) locals.push_back(std::make_unique<fiber::FiberLocal<Tracked>>());
  fiber::Scheduler s({.processors = 1, .name = "fls"});
  for (int round = 0; round < 3; ++round) {
    const int failures = fiber::spawn({.scheduler = &s}, [&] {
      int bad = 0;
      for (auto& l : locals) bad += l->has_value();  // nothing left over from the last round
      for (int i = 0; i < 100; ++i) locals[i]->emplace(i);
      for (int i = 0; i < 100; ++i) bad += (*locals[i])->value != i;
      return bad;
    }).join();
    CHECK(failures == 0);
    CHECK(Tracked::alive == 0);
  }
  CHECK(Tracked::made == 300);
  CHECK(Tracked::wrong_place == 0);
}

namespace {
fiber::FiberLocal<Tracked>* g_handler_local = nullptr;
std::atomic<int> g_handler_saw{0};
void handler_using_local(const fiber::UnhandledException&) {
  if (const Tracked* t = g_handler_local->get_if()) g_handler_saw = t->value;
  fiber::FiberLocal<Tracked> made_here;  // a FiberLocal the fiber never used: a new value
  made_here.emplace(99);
  // made_here goes now, its value stays in the table until the fiber's end.
}
}  // namespace

TEST_CASE("fiber_local: a detached fiber's unhandled-exception handler sees its values; those it makes die too") {
  Tracked::clear();
  fiber::FiberLocal<Tracked> local;
  g_handler_local = &local;
  g_handler_saw = 0;
  const auto previous = fiber::set_unhandled_exception_handler(&handler_using_local);
  fiber::Scheduler s({.processors = 2, .name = "fls"});
  fiber::block_on({.scheduler = &s}, [&] {
    go go_on(s)[&] {
      local.emplace(42);
      throw std::runtime_error("unobserved");
    };
  });
  fiber::set_unhandled_exception_handler(previous);
  CHECK(g_handler_saw == 42);
  CHECK(Tracked::made == 2);
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
}

namespace {
fiber::FiberLocal<Tracked>* g_late_local = nullptr;
// A thread_local made before the thread's first FiberLocal value, so destroyed after the
// runtime's own thread_local cleanup has run: its destructor makes a value all the same.
struct UsesLocalAtExit {
  bool armed = false;
  ~UsesLocalAtExit() {
    if (armed) g_late_local->emplace(7);
  }
};
thread_local UsesLocalAtExit t_uses_local_at_exit;
}  // namespace

TEST_CASE("fiber_local: a value made by a thread_local's destructor at thread exit is destroyed too") {
  Tracked::clear();
  fiber::FiberLocal<Tracked> local;
  g_late_local = &local;
  std::thread t([&] {
    t_uses_local_at_exit.armed = true;  // constructed first
    local.emplace(1);
  });
  t.join();
  CHECK(Tracked::made == 2);
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
}

TEST_CASE("fiber_local: a replaced value's destructor may set the same FiberLocal; emplace's value wins") {
  struct Reenters {
    fiber::FiberLocal<Reenters>* self;
    int value;
    bool reenter;
    Reenters(fiber::FiberLocal<Reenters>* s, int v, bool r) : self(s), value(v), reenter(r) { ++Tracked::alive; }
    ~Reenters() {
      --Tracked::alive;
      if (reenter) {
        if (self->get_if() != nullptr) ++Tracked::wrong_place;  // out of the table already
        self->emplace(self, -1, false);  // replaced at once by the emplace in progress
      }
    }
  };
  Tracked::clear();
  fiber::FiberLocal<Reenters> local;
  fiber::Scheduler s({.processors = 1, .name = "fls"});
  const int got = fiber::spawn({.scheduler = &s}, [&] {
    local.emplace(&local, 1, true);
    Reenters& r = local.emplace(&local, 2, false);
    return r.value == 2 && local.get_if() == &r ? local.get_if()->value : -100;
  }).join();
  CHECK(got == 2);
  CHECK(Tracked::alive == 0);
  CHECK(Tracked::wrong_place == 0);
}
