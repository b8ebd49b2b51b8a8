// fiber::spawn, JoinHandle, `go` and the unhandled-exception handler (fiber/spawn.hpp).
//
//   1. Values through join: int, std::string, move-only, void; argument forwarding.
//   2. Exceptions through join (type preserved).
//   3. Misuse -> fiber::UsageError: join twice, detach+join, self-join, empty callables, stack
//      sizes out of range.
//   4. `go` with go_stack / go_name / go_on.
//   5. Detached fibers' exceptions reach the handler (fiber::Cancelled does not).
//   6. finished(), id(), joins from threads, fibers and other schedulers.
//   7. Timed waits (wait_for / wait_until): time out leaving the handle joinable, succeed once the
//      fiber finishes, race its finish (counted), and misuse.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sched/fiber.hpp"      // current_fiber(), refuse_record_starts: a record started out of memory
#include "sched/injector.hpp"   // Injector::refuse_segments: the global queue out of memory
#include "sched/processor.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

struct TaggedError : std::runtime_error {
  explicit TaggedError(int c) : std::runtime_error("tagged error " + std::to_string(c)), code(c) {}
  int code;
};

struct MoveOnly {
  explicit MoveOnly(int v) : p(std::make_unique<int>(v)) {}
  std::unique_ptr<int> p;
};

}  // namespace

TEST_CASE("spawn: join returns the fiber's value (int, string, move-only, void)") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto hi = fiber::spawn({.scheduler = &s}, [] { return 42; });
    auto hs = fiber::spawn({.scheduler = &s}, [] { return std::string(1000, 'x') + "end"; });
    auto hu = fiber::spawn({.scheduler = &s}, [] { return std::make_unique<int>(7); });
    auto hm = fiber::spawn({.scheduler = &s}, [] { return MoveOnly(8); });
    std::atomic<bool> ran{false};
    auto hv = fiber::spawn({.scheduler = &s}, [&ran] { ran = true; });
    static_assert(std::is_same_v<decltype(hv), fiber::JoinHandle<void>>);
    static_assert(std::is_same_v<decltype(hu), fiber::JoinHandle<std::unique_ptr<int>>>);

    CHECK(hi.join() == 42);
    CHECK(hs.join() == std::string(1000, 'x') + "end");
    std::unique_ptr<int> u = hu.join();
    REQUIRE(u != nullptr);
    CHECK(*u == 7);
    MoveOnly m = hm.join();
    REQUIRE(m.p != nullptr);
    CHECK(*m.p == 8);
    hv.join();
    CHECK(ran.load());
    CHECK_FALSE(hi.joinable());
    CHECK_FALSE(hv.joinable());
  });
}

TEST_CASE("spawn: arguments are forwarded (copied by value, moved when move-only)") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    // By value: the fiber has its own copy, later changes to the original do not reach it.
    std::string text = "original";
    fiber::WaitGroup gate;
    gate.add(1);
    auto h1 = fiber::spawn(
        {.scheduler = &s},
        [&gate](std::string t, int k) {
          gate.wait();
          return t + "/" + std::to_string(k);
        },
        text, 5);
    text = "changed";
    gate.done();
    CHECK(h1.join() == "original/5");

    // Move-only argument.
    auto p = std::make_unique<int>(99);
    int* raw = p.get();
    auto h2 = fiber::spawn({.scheduler = &s}, [raw](std::unique_ptr<int> q) { return q.get() == raw && *q == 99; },
                           std::move(p));
    CHECK(p == nullptr);
    CHECK(h2.join());

    // An rvalue string is moved into the fiber (its buffer travels with it).
    std::string big(4096, 'b');
    const char* buf = big.data();
    auto h3 = fiber::spawn({.scheduler = &s}, [buf](std::string x) { return x.data() == buf && x.size() == 4096; },
                           std::move(big));
    CHECK(h3.join());

    // A function pointer with arguments, and the default-options overload from a plain thread
    // (default scheduler) - the only use of the global scheduler in this file.
    int (*add)(int, int) = [](int a, int b) { return a + b; };
    CHECK(fiber::spawn({.scheduler = &s}, add, 2, 3).join() == 5);
  });
  CHECK(fiber::spawn([](int a) { return a * 2; }, 21).join() == 42);
}

TEST_CASE("spawn: join rethrows the fiber's exception with its type") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto h = fiber::spawn({.scheduler = &s}, []() -> int { throw TaggedError(17); });
    try {
      (void)h.join();
      FAIL_CHECK("join did not throw");
    } catch (const TaggedError& e) {
      CHECK(e.code == 17);
      CHECK(std::string(e.what()) == "tagged error 17");
    } catch (...) {
      FAIL_CHECK("join threw something other than TaggedError");
    }
    CHECK_FALSE(h.joinable());

    // Thrown after blocking (the fiber may have migrated), and a non-std exception type.
    auto h2 = fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::sleep_for(2ms);
      throw 1234;
    });
    CHECK_THROWS_AS(h2.join(), int);

    auto h3 = fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::yield();
      throw std::out_of_range("oor");
    });
    CHECK_THROWS_WITH_AS(h3.join(), "oor", std::out_of_range);
  });
}

TEST_CASE("spawn: joining twice is a UsageError that says the handle was already joined") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto h = fiber::spawn({.scheduler = &s}, [] { return 1; });
    CHECK(h.join() == 1);
    try {
      (void)h.join();
      FAIL_CHECK("second join did not throw");
    } catch (const fiber::UsageError& e) {
      CHECK_MESSAGE(contains(e.what(), "already joined"), "message: " << e.what());
    }
    CHECK_THROWS_AS(h.detach(), fiber::UsageError);

    // Also when the first join rethrew.
    auto h2 = fiber::spawn({.scheduler = &s}, [] { throw TaggedError(1); });
    CHECK_THROWS_AS(h2.join(), TaggedError);
    CHECK_THROWS_AS(h2.join(), fiber::UsageError);
  });
}

TEST_CASE("spawn: detach then join (or detach twice) is a UsageError") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto h = fiber::spawn({.scheduler = &s}, [] { return 1; });
    h.detach();
    CHECK_FALSE(h.joinable());
    CHECK(h.id() == 0);
    CHECK_FALSE(h.finished());
    CHECK_THROWS_AS(h.join(), fiber::UsageError);
    CHECK_THROWS_AS(h.detach(), fiber::UsageError);

    // A moved-from handle is empty too.
    auto a = fiber::spawn({.scheduler = &s}, [] { return 2; });
    auto b = std::move(a);
    CHECK_THROWS_AS(a.join(), fiber::UsageError);  // NOLINT(bugprone-use-after-move)
    CHECK(b.join() == 2);

    // A default-constructed handle.
    fiber::JoinHandle<int> empty;
    CHECK_FALSE(empty.joinable());
    CHECK_THROWS_AS(empty.join(), fiber::UsageError);
    quiesce(s);  // the detached fiber
  });
}

TEST_CASE("spawn: a fiber joining itself is a UsageError") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::WaitGroup ready;
    ready.add(1);
    fiber::JoinHandle<std::string> h;
    h = fiber::spawn({.scheduler = &s}, [&]() -> std::string {
      ready.wait();  // until `h` is assigned
      try {
        h.join();
        return "no exception";
      } catch (const fiber::UsageError& e) {
        return e.what();
      }
    });
    ready.done();
    const std::string what = h.join();  // the failed self-join left the handle intact
    CHECK_MESSAGE(contains(what, "itself"), "self-join gave: " << what);
  });
}

TEST_CASE("spawn: an empty callable is a UsageError") {
  fiber::Scheduler s({.processors = 2, .name = "t"});
  void (*null_fn)() = nullptr;
  int (*null_fn_args)(int) = nullptr;
  std::function<int()> empty_fn;
  std::function<void(int)> empty_fn_args;

  CHECK_THROWS_AS(fiber::spawn({.scheduler = &s}, null_fn), fiber::UsageError);
  CHECK_THROWS_AS(fiber::spawn({.scheduler = &s}, null_fn_args, 1), fiber::UsageError);
  CHECK_THROWS_AS(fiber::spawn({.scheduler = &s}, empty_fn), fiber::UsageError);
  CHECK_THROWS_AS(fiber::spawn({.scheduler = &s}, empty_fn_args, 1), fiber::UsageError);
  CHECK_THROWS_AS(fiber::block_on({.scheduler = &s}, empty_fn), fiber::UsageError);
  auto go_empty = [&] { go go_on(s) empty_fn; };
  CHECK_THROWS_AS(go_empty(), fiber::UsageError);
  try {
    fiber::spawn({.scheduler = &s}, empty_fn);
  } catch (const fiber::UsageError& e) {
    CHECK_MESSAGE(contains(e.what(), "empty"), "message: " << e.what());
  }
  // From inside a fiber as well; nothing was left behind.
  CHECK(fiber::block_on({.scheduler = &s}, [&] {
    try {
      fiber::spawn(empty_fn);
      return false;
    } catch (const fiber::UsageError&) {
      return true;
    }
  }));
  // A non-empty std::function runs.
  std::function<int()> fn = [] { return 3; };
  CHECK(fiber::spawn({.scheduler = &s}, fn).join() == 3);
  CHECK(s.live_fibers() == 0);
}

TEST_CASE("spawn: stack sizes out of range are a UsageError; the minimum works") {
  fiber::Scheduler s({.processors = 2, .name = "t"});
  for (std::size_t bad : {std::size_t{1}, std::size_t{1000}, std::size_t{2047}}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(fiber::spawn({.stack_size = bad, .scheduler = &s}, [] {}), fiber::UsageError);
    auto go_small = [&] { go go_on(s) go_stack(bad)[] {}; };
    CHECK_THROWS_AS(go_small(), fiber::UsageError);
  }
  try {
    fiber::spawn({.stack_size = 100, .scheduler = &s}, [] {});
    FAIL_CHECK("no exception");
  } catch (const fiber::UsageError& e) {
    CHECK_MESSAGE(contains(e.what(), "stack size"), "message: " << e.what());
  }
  CHECK_THROWS_AS(fiber::spawn({.stack_size = (std::size_t{1} << 30) + 1, .scheduler = &s}, [] {}),
                  fiber::UsageError);
  CHECK(s.live_fibers() == 0);

  // 2048 (compact, no guard page) and a few odd sizes run trivial code. Not under sanitizers:
  // their runtime checks (UBSan's dynamic type check at the task's virtual call, ASan's
  // reports) need far more than a compact stack offers.
  if (!kSanitized) {
    CHECK(fiber::spawn({.stack_size = fiber::compact_stack_size, .scheduler = &s}, [] { return 5; }).join() == 5);
    CHECK(fiber::spawn({.stack_size = 3000, .scheduler = &s}, [] { return 6; }).join() == 6);
  }
  CHECK(fiber::spawn({.stack_size = 16 << 10, .scheduler = &s}, [] { return 7; }).join() == 7);
}

TEST_CASE("go: go_stack, go_name and go_on are applied") {
  fiber::Scheduler s({.processors = 2, .name = "t"});
  fiber::Scheduler s2({.processors = 3, .name = "gosched"});

  struct Seen {
    std::string name;
    std::string thread;
    unsigned index = ~0u;
    std::size_t stack = 0;
    bool big_frame_ok = false;
  };
  Seen a, b, c;
  fiber::WaitGroup wg;
  wg.add(3);

  // From a plain thread, with all three options.
  go go_on(s2) go_name("go-fiber") go_stack(512 << 10)[&] {
    a.name = std::string(fiber::this_fiber::name());
    a.thread = thread_name();
    a.index = fiber::this_fiber::processor_index();
    a.stack = fiber::detail::current_fiber()->stack.size;
    // Deeper than the default 64 KiB stack: only fine if go_stack took effect.
    volatile char frame[256 << 10];
    for (std::size_t i = 0; i < sizeof frame; i += 4096) frame[i] = 1;
    a.big_frame_ok = frame[0] == 1;
    wg.done();
  };

  // From a fiber of `s`: go_on(s2) leaves s, plain `go` stays on s.
  fiber::block_on({.scheduler = &s}, [&] {
    go go_on(s2) go_name("hop")[&] {
      b.name = std::string(fiber::this_fiber::name());
      b.thread = thread_name();
      b.index = fiber::this_fiber::processor_index();
      wg.done();
    };
    go[&] {
      c.name = std::string(fiber::this_fiber::name());
      c.thread = thread_name();
      c.index = fiber::this_fiber::processor_index();
      c.stack = fiber::detail::current_fiber()->stack.size;
      wg.done();
    };
  });
  {
    Watchdog wd(10'000ms, "go fibers");
    wg.wait();
  }
  quiesce(s2);

  CHECK(a.name == "go-fiber");
  CHECK(a.index < s2.processors());
  CHECK_MESSAGE(a.thread.rfind("gosched-P", 0) == 0, "ran on thread " << a.thread);
  CHECK(a.thread == "gosched-P" + std::to_string(a.index));
  CHECK(a.stack == (512u << 10));
  CHECK(a.big_frame_ok);

  CHECK(b.name == "hop");
  CHECK(b.index < s2.processors());
  CHECK_MESSAGE(b.thread.rfind("gosched-P", 0) == 0, "ran on thread " << b.thread);

  CHECK(c.name == "");
  CHECK(c.index < s.processors());
  CHECK_MESSAGE(c.thread.rfind("t-P", 0) == 0, "ran on thread " << c.thread);
  CHECK(c.stack == 64u << 10);  // the default
}

TEST_CASE("spawn: name and scheduler options of fiber::spawn") {
  fiber::Scheduler s({.processors = 4, .name = "named"});
  auto h = fiber::spawn({.scheduler = &s, .name = "worker-7"}, [&] {
    return std::make_pair(std::string(fiber::this_fiber::name()), fiber::this_fiber::processor_index());
  });
  auto [name, index] = h.join();
  CHECK(name == "worker-7");
  CHECK(index < s.processors());

  // The name is copied: the caller's buffer may change right after spawn.
  std::string buf = "first";
  fiber::WaitGroup gate;
  gate.add(1);
  auto h2 = fiber::spawn({.scheduler = &s, .name = buf}, [&gate] {
    gate.wait();
    return std::string(fiber::this_fiber::name());
  });
  buf = "XXXXXXXXXXXXXXX";
  gate.done();
  CHECK(h2.join() == "first");
}

// ------------------------------------------------------------------------------ unhandled

namespace {

struct Report {
  unsigned long long id;
  std::string name;
  std::string message;
};
std::mutex g_reports_mu;
std::vector<Report> g_reports;  // GUARDED_BY(g_reports_mu)

void recording_handler(const fiber::UnhandledException& e) {
  std::string msg = "<not a std::exception>";
  try {
    std::rethrow_exception(e.error);
  } catch (const std::exception& ex) {
    msg = ex.what();
  } catch (...) {
  }
  std::lock_guard lock(g_reports_mu);
  g_reports.push_back(Report{e.fiber_id, std::string(e.fiber_name), msg});
}

std::size_t report_count() {
  std::lock_guard lock(g_reports_mu);
  return g_reports.size();
}

std::vector<Report> take_reports() {
  std::lock_guard lock(g_reports_mu);
  return std::exchange(g_reports, {});
}

struct HandlerScope {
  fiber::UnhandledExceptionHandler previous;
  HandlerScope() : previous(fiber::set_unhandled_exception_handler(&recording_handler)) { take_reports(); }
  ~HandlerScope() { fiber::set_unhandled_exception_handler(previous); }
};

}  // namespace

TEST_CASE("spawn: an exception escaping a detached fiber reaches the unhandled-exception handler") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    HandlerScope scope;
    CHECK((fiber::set_unhandled_exception_handler(&recording_handler) == &recording_handler));

    // 1. Detached while still running; throws later.
    unsigned long long id1 = 0;
    {
      auto h = fiber::spawn({.scheduler = &s, .name = "late-thrower"}, [] {
        fiber::this_fiber::sleep_for(5ms);
        throw std::runtime_error("boom-1");
      });
      id1 = h.id();
      h.detach();
    }
    CHECK(wait_for([] { return report_count() > 0; }));
    quiesce(s);
    auto r = take_reports();
    REQUIRE(r.size() == 1);
    CHECK(r[0].id == id1);
    CHECK(r[0].name == "late-thrower");
    CHECK(r[0].message == "boom-1");

    // 2. Finished (with an exception) before the handle is dropped: reported at detach.
    unsigned long long id2 = 0;
    {
      auto h = fiber::spawn({.scheduler = &s}, [] { throw std::logic_error("boom-2"); });
      id2 = h.id();
      CHECK(wait_for([&] { return h.finished(); }));
      CHECK(take_reports().empty());  // not yet: the handle could still join
    }  // ~JoinHandle detaches
    r = take_reports();
    REQUIRE(r.size() == 1);
    CHECK(r[0].id == id2);
    CHECK(r[0].name == "");
    CHECK(r[0].message == "boom-2");

    // 3. A `go` fiber never had a handle; its id is what this_fiber::id() said inside.
    std::atomic<unsigned long long> id3{0};
    go go_on(s) go_name("go-thrower")[&id3] {
      id3 = fiber::this_fiber::id();
      throw TaggedError(3);
    };
    CHECK(wait_for([] { return report_count() > 0; }));
    quiesce(s);
    r = take_reports();
    REQUIRE(r.size() == 1);
    CHECK(r[0].id == id3.load());
    CHECK(r[0].name == "go-thrower");
    CHECK(r[0].message == "tagged error 3");

    // 4. Not reported: fiber::Cancelled escaping (thrown explicitly, or from a cancelled sleep),
    //    and exceptions that were observed through join.
    go go_on(s)[] { throw fiber::Cancelled(); };
    fiber::spawn({.scheduler = &s}, [] { throw fiber::Cancelled("custom cancel"); }).detach();
    {
      auto h = fiber::spawn({.scheduler = &s}, [] { fiber::this_fiber::sleep_for(std::chrono::hours(1)); });
      h.cancel();
      h.detach();
    }
    {
      auto h = fiber::spawn({.scheduler = &s}, [] { fiber::this_fiber::sleep_for(std::chrono::hours(1)); });
      fiber::this_fiber::sleep_for(2ms);
      h.detach();
      // Cancel it through stop-like means is not available for one fiber without a handle; the
      // scheduler's destructor (stop) cancels it below, which must not be reported either.
    }
    auto joined = fiber::spawn({.scheduler = &s}, [] { throw std::runtime_error("observed"); });
    CHECK_THROWS_AS(joined.join(), std::runtime_error);
    // Detached fibers whose exceptions are caught inside do not report anything.
    go go_on(s)[] {
      try {
        throw std::runtime_error("caught");
      } catch (const std::exception&) {
      }
    };
    CHECK(wait_for([&] { return s.live_fibers() == 1; }));  // only the hour-long sleeper is left
    s.stop();  // cancels the sleeper: Cancelled escapes a detached fiber, not reported
    CHECK(s.live_fibers() == 0);
    r = take_reports();
    CHECK_MESSAGE(r.empty(), r.size() << " unexpected report(s), first: " << (r.empty() ? "" : r[0].message));
  });
}

namespace {
// A handler that blocks: it hands each report to whoever receives on g_report_channel.
fiber::Channel<unsigned long long>* g_report_channel = nullptr;
std::atomic<int> g_blocking_handler_entered{0};
void blocking_handler(const fiber::UnhandledException& e) {
  ++g_blocking_handler_entered;
  g_report_channel->send(e.fiber_id);
}
}  // namespace

TEST_CASE("spawn: an unhandled-exception handler that blocks keeps its fiber alive; stop() cancels it") {
  // The fiber used to count as finished, and be unlisted, before the handler ran: stop() then
  // found nothing alive, shut the processors down under the blocked handler, and a block_on
  // waiting for that fiber never returned.
  fiber::Channel<unsigned long long> reports;  // nobody receives until the end
  g_report_channel = &reports;
  g_blocking_handler_entered = 0;
  struct Restore {  // also when a REQUIRE below ends the test early
    fiber::UnhandledExceptionHandler previous = fiber::set_unhandled_exception_handler(&blocking_handler);
    ~Restore() {
      fiber::set_unhandled_exception_handler(previous);
      g_report_channel = nullptr;
    }
  } restore;
  with_watchdog(20'000ms, "stop() with a blocked handler", [] {
    fiber::Scheduler s({.processors = 2, .name = "handler"});
    std::atomic<bool> block_on_returned{false};
    std::thread t([&] {
      fiber::block_on({.scheduler = &s}, [] { go[] { throw std::runtime_error("reported"); }; });
      block_on_returned = true;
    });
    REQUIRE(wait_for([] { return g_blocking_handler_entered.load() == 1; }));
    CHECK(s.live_fibers() == 1);  // the thrower, blocked in its handler
    CHECK_FALSE(block_on_returned.load());
    s.stop();  // cancels the handler's send: it ends there
    t.join();
    CHECK(block_on_returned.load());
    CHECK(s.live_fibers() == 0);
  });
  CHECK_FALSE(static_cast<bool>(reports.try_recv()));  // the cancelled send delivered nothing
}

TEST_CASE("JoinHandle: concurrent waits on one handle each return or say busy; the winner is woken") {
  // Two waits racing on one handle used to both write its one wait record: the loser's
  // withdrawal then ended the winner's wait, which hung (or, for a fiber, had its control block
  // released twice). Now one takes the record and the others get UsageError at once.
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int rounds = kTsan ? 100 : 1000;
    int busy = 0;
    for (int round = 0; round < rounds; ++round) {
      fiber::Channel<int> gate(1);
      auto target = fiber::spawn({.scheduler = &s}, [&gate] { return *gate.recv(); });
      std::atomic<int> finished_seen{0};
      std::atomic<int> busy_seen{0};
      // Each waiter waits until it sees the target finished; a UsageError (another wait holds
      // the record) sends it round again.
      auto waiter = [&] {
        for (;;) {
          try {
            if (target.wait_for(std::chrono::microseconds(round % 7 * 20))) {
              ++finished_seen;
              return;
            }
          } catch (const fiber::UsageError& e) {
            REQUIRE_MESSAGE(contains(e.what(), "already waiting"), e.what());
            ++busy_seen;
            fiber::this_fiber::yield();
          }
        }
      };
      auto f1 = fiber::spawn({.scheduler = &s}, waiter);
      auto f2 = fiber::spawn({.scheduler = &s}, waiter);
      std::thread t1(waiter);
      if (round % 3 != 0) std::this_thread::yield();
      gate.send(round);
      t1.join();
      f1.join();
      f2.join();
      CHECK(finished_seen.load() == 3);
      REQUIRE(target.join() == round);
      busy += busy_seen.load();
    }
    MESSAGE(busy << " waits found another in progress");
  });
}

TEST_CASE("spawn: set_unhandled_exception_handler returns the previous handler; nullptr restores the default") {
  auto original = fiber::set_unhandled_exception_handler(&recording_handler);
  CHECK((original != nullptr));
  CHECK((fiber::set_unhandled_exception_handler(nullptr) == &recording_handler));
  // nullptr installed the default, which is not our handler.
  auto def = fiber::set_unhandled_exception_handler(original);
  CHECK((def != nullptr));
  CHECK((def != &recording_handler));
}

// ------------------------------------------------------------------------------ handles

TEST_CASE("JoinHandle: finished() and id()") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::WaitGroup gate;
    gate.add(1);
    std::atomic<unsigned long long> inside{0};
    auto h = fiber::spawn({.scheduler = &s}, [&] {
      inside = fiber::this_fiber::id();
      gate.wait();
      return 11;
    });
    CHECK(h.joinable());
    CHECK(h.id() != 0);
    CHECK(wait_for([&] { return inside.load() != 0; }));
    CHECK(inside.load() == h.id());
    fiber::this_fiber::sleep_for(2ms);
    CHECK_FALSE(h.finished());  // parked on the gate
    gate.done();
    CHECK(wait_for([&] { return h.finished(); }));
    CHECK(h.finished());
    CHECK(h.joinable());
    CHECK(h.join() == 11);
    CHECK_FALSE(h.finished());  // empty now
    CHECK(h.id() == 0);
  });
}

TEST_CASE("JoinHandle: join from a plain thread, from a fiber, and across schedulers") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    fiber::Scheduler other({.processors = static_cast<std::size_t>(n == 1 ? 2 : 1), .name = "other"});

    // From a plain thread other than main, of a fiber that is still sleeping.
    auto h1 = fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::sleep_for(10ms);
      return std::string("from-thread");
    });
    std::string got;
    run_on_thread([&] { got = h1.join(); });
    CHECK(got == "from-thread");

    // From a fiber of the same scheduler: many joiners, each of its own sleeping target.
    auto total = fiber::block_on({.scheduler = &s}, [] {
      std::vector<fiber::JoinHandle<int>> hs;
      for (int i = 0; i < 50; ++i) {
        hs.push_back(fiber::spawn([i] {
          fiber::this_fiber::sleep_for(std::chrono::microseconds(100 * (i % 7)));
          return i;
        }));
      }
      int sum = 0;
      for (auto& h : hs) sum += h.join();
      return sum;
    });
    CHECK(total == 50 * 49 / 2);

    // A fiber of `s` joins a fiber of `other`, and the reverse; the target is still running.
    auto on_other = fiber::spawn({.scheduler = &other}, [] {
      fiber::this_fiber::sleep_for(10ms);
      return std::string(thread_name());
    });
    auto joiner = fiber::spawn({.scheduler = &s}, [&on_other] { return on_other.join(); });
    const std::string other_thread = joiner.join();
    CHECK_MESSAGE(other_thread.rfind("other-P", 0) == 0, "target ran on " << other_thread);

    auto on_s = fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::sleep_for(10ms);
      return std::string(thread_name());
    });
    auto joiner2 = fiber::spawn({.scheduler = &other}, [&on_s] {
      auto v = on_s.join();
      return std::make_pair(v, std::string(thread_name()));
    });
    auto [target_thread, joiner_thread] = joiner2.join();
    CHECK_MESSAGE(target_thread.rfind("t-P", 0) == 0, "target ran on " << target_thread);
    CHECK_MESSAGE(joiner_thread.rfind("other-P", 0) == 0, "joiner ran on " << joiner_thread);

    // A fiber joining a fiber that already finished does not park.
    auto quick = fiber::spawn({.scheduler = &other}, [] { return 5; });
    CHECK(wait_for([&] { return quick.finished(); }));
    CHECK(fiber::spawn({.scheduler = &s}, [&quick] { return quick.join(); }).join() == 5);
    CHECK(other.live_fibers() == 0);
  });
}

TEST_CASE("spawn: fiber ids are unique and match the handles") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kFibers = 2000;
    std::vector<fiber::JoinHandle<unsigned long long>> hs;
    hs.reserve(kFibers);
    // Half spawned from a plain thread, half from inside fibers (per-processor id blocks).
    for (int i = 0; i < kFibers / 2; ++i) hs.push_back(fiber::spawn({.scheduler = &s}, [] { return fiber::this_fiber::id(); }));
    auto inner = fiber::block_on({.scheduler = &s}, [] {
      std::vector<fiber::JoinHandle<unsigned long long>> v;
      for (int i = 0; i < kFibers / 2; ++i) v.push_back(fiber::spawn([] { return fiber::this_fiber::id(); }));
      return v;
    });
    for (auto& h : inner) hs.push_back(std::move(h));
    std::set<unsigned long long> ids;
    int mismatches = 0;
    for (auto& h : hs) {
      const auto expected = h.id();
      const auto got = h.join();
      mismatches += got != expected;
      ids.insert(got);
    }
    CHECK(mismatches == 0);
    CHECK(ids.size() == static_cast<std::size_t>(kFibers));
    CHECK(ids.count(0) == 0);
  });
}

namespace {
// Fibers of `s` that have parked in a join or a timed wait so far.
std::uint64_t join_parks(fiber::Scheduler& s) { return park_count(s, fiber::detail::ParkReason::Join); }
}  // namespace

TEST_CASE("JoinHandle: wait_for / wait_until time out and leave the handle joinable, from threads and fibers") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Channel<int> gate;
    auto h = fiber::spawn({.scheduler = &s}, [&gate] { return *gate.recv() + 1; });

    // From a plain thread: every kind of deadline passes with the fiber still blocked.
    auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(h.wait_for(5ms));
    CHECK(std::chrono::steady_clock::now() - t0 >= 5ms);  // the deadline was kept, not cut short
    CHECK_FALSE(h.wait_for(0ms));
    CHECK_FALSE(h.wait_for(-1s));
    CHECK_FALSE(h.wait_until(std::chrono::steady_clock::now() + 2ms));
    CHECK_FALSE(h.wait_until(std::chrono::system_clock::now() + 2ms));
    CHECK(h.joinable());
    CHECK_FALSE(h.finished());

    // From a fiber of the same scheduler: it parks (the processor runs on) and times out.
    auto waiter = fiber::spawn({.scheduler = &s}, [&h] {
      const auto start = std::chrono::steady_clock::now();
      const bool r = h.wait_for(5ms);
      return std::make_pair(r, std::chrono::steady_clock::now() - start >= 5ms);
    });
    const auto [r, waited] = waiter.join();
    CHECK_FALSE(r);
    CHECK(waited);
    CHECK(h.joinable());

    // Now let it finish: a waiting fiber (parked first) is woken by the finish, well before its
    // deadline; a lost wake would make it return false after 30 s.
    const std::uint64_t parked = join_parks(s);
    auto waiter2 = fiber::spawn({.scheduler = &s}, [&h] { return h.wait_for(std::chrono::seconds(30)); });
    REQUIRE(wait_for([&] { return join_parks(s) > parked; }));
    gate.send(41);
    CHECK(waiter2.join());
    CHECK(h.finished());
    CHECK(h.wait_for(0ms));  // finished: true without waiting, as often as asked
    CHECK(h.wait_until(std::chrono::steady_clock::time_point::min()));
    CHECK(h.join() == 42);

    // A fiber that throws: the wait says finished, join() rethrows.
    auto bad = fiber::spawn({.scheduler = &s}, [] {
      fiber::this_fiber::sleep_for(1ms);
      throw TaggedError(3);
    });
    CHECK(bad.wait_for(std::chrono::hours(1)));
    CHECK_THROWS_AS(bad.join(), TaggedError);
  });
}

TEST_CASE("JoinHandle: timed waits racing the fiber's finish (counted), from a thread and from a fiber") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    const int rounds = kTsan ? 300 : 2000;
    std::mt19937 rng(static_cast<unsigned>(n));
    int timeouts = 0;
    // One round: a fiber that finishes after 0-50 us of yields and sleeps; the waiter (a plain
    // thread on even rounds, a fiber on odd ones) waits 0-50 us at a time until it says
    // finished, then joins. Every round must end with the right value, and without a hang -
    // including a fiber polling with 0 us on the target's own (single) processor.
    for (int i = 0; i < rounds; ++i) {
      const int work_us = static_cast<int>(rng() % 50), wait_us = static_cast<int>(rng() % 50);
      auto h = fiber::spawn({.scheduler = &s}, [i, work_us] {
        if (work_us % 3 == 0) fiber::this_fiber::yield();
        if (work_us % 3 == 1) fiber::this_fiber::sleep_for(std::chrono::microseconds(work_us));
        return i;
      });
      auto wait_then_join = [&h, wait_us] {
        int waits = 0;
        while (!h.wait_for(std::chrono::microseconds(wait_us))) ++waits;
        return std::make_pair(h.join(), waits);
      };
      std::pair<int, int> got;
      if (i % 2 == 0) {
        got = wait_then_join();
      } else {
        got = fiber::spawn({.scheduler = &s}, wait_then_join).join();
      }
      REQUIRE(got.first == i);
      timeouts += got.second;
    }
    CHECK_MESSAGE(timeouts > 0, "no wait ever timed out: the timeout side of the race was not exercised");
    MESSAGE("procs " << n << ": " << timeouts << " timed-out waits over " << rounds << " rounds");
    CHECK(s.live_fibers() == 0);
  });
}

TEST_CASE("JoinHandle: timed-wait misuse is a UsageError; a cancelled waiter gets Cancelled and withdraws") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::JoinHandle<int> empty;
    try {
      (void)empty.wait_for(1ms);
      FAIL_CHECK("wait_for on an empty handle did not throw");
    } catch (const fiber::UsageError& e) {
      const bool names_it = contains(e.what(), "wait_for") && contains(e.what(), "empty");
      CHECK_MESSAGE(names_it, "message: " << e.what());
    }
    CHECK_THROWS_AS((void)empty.wait_until(std::chrono::steady_clock::now()), fiber::UsageError);

    // A fiber waiting for itself.
    fiber::WaitGroup ready;
    ready.add(1);
    fiber::JoinHandle<std::string> self;
    self = fiber::spawn({.scheduler = &s}, [&]() -> std::string {
      ready.wait();
      try {
        (void)self.wait_for(1ms);
        return "no exception";
      } catch (const fiber::UsageError& e) {
        return e.what();
      }
    });
    ready.done();
    const std::string what = self.join();
    const bool names_it = contains(what, "wait_for") && contains(what, "itself");
    CHECK_MESSAGE(names_it, "self-wait gave: " << what);

    // A second wait while one is in progress is a UsageError naming the problem, and leaves the
    // first alone; a waiter cancelled in its timed wait throws Cancelled; the target is untouched.
    fiber::Channel<int> gate;
    auto target = fiber::spawn({.scheduler = &s}, [&gate] { return *gate.recv(); });
    const std::uint64_t parked = join_parks(s);
    auto waiter = fiber::spawn({.scheduler = &s}, [&target] { return target.wait_for(std::chrono::seconds(30)); });
    REQUIRE(wait_for([&] { return join_parks(s) > parked; }));
    try {
      (void)target.wait_for(1ms);
      FAIL_CHECK("a second concurrent wait did not throw");
    } catch (const fiber::UsageError& e) {
      const bool names_it = contains(e.what(), "already waiting");
      CHECK_MESSAGE(names_it, "message: " << e.what());
    }
    waiter.cancel();
    CHECK_THROWS_AS((void)waiter.join(), fiber::Cancelled);
    CHECK(target.joinable());
    CHECK_FALSE(target.finished());
    CHECK_FALSE(target.wait_for(1ms));  // the cancelled wait was withdrawn: a new one may start
    gate.send(9);
    CHECK(target.join() == 9);
  });
}

TEST_CASE("spawn: 40000 fibers in a row on recycled stacks, then one that takes a mutex") {
  // A fiber's last switch never returns, and neither do the frames under it. Under TSan each of
  // those frames left an entry on the shadow stack of the fiber's TSan context, which is
  // recycled with its stack: fibers run one after another piled up entries on one context until
  // the next stack TSan recorded (a mutex acquisition here) passed its 65536-frame limit and
  // TSan aborted. In every build: each fiber runs, returns its value, and the last one's lock
  // works.
  constexpr int kFibers = 40000;
  std::mutex mu;
  int locked = 0;
  const long sum = fiber::block_on([&] {
    long s = 0;
    for (int i = 0; i < kFibers; ++i) s += fiber::spawn([i] { return static_cast<long>(i); }).join();
    fiber::spawn([&] {
      std::lock_guard lock(mu);
      ++locked;
    }).join();
    return s;
  });
  CHECK(sum == static_cast<long>(kFibers) * (kFibers - 1) / 2);
  CHECK(locked == 1);
}

// A spawner that never yields overflows its local queue into the global one, half a ring at a
// time. With no memory for the global queue's segments, that once ended the process.
TEST_CASE("spawn: a local queue's overflow loses no fiber when the global queue cannot grow") {
  // More than a spare segment (kept from earlier use of the scheduler, never refused) holds.
  static constexpr int kFibers = 2 * static_cast<int>(fiber::detail::Injector::kSegmentEntries) + 1000;
  for_each_proc_count([](fiber::Scheduler& s, int procs) {
    std::atomic<int> ran{0};
    int refused = 0;
    // block_on: returns once every fiber spawned inside has finished, not just counted down
    // (the check after the body wants none live).
    fiber::block_on({.scheduler = &s}, [&] {
      fiber::detail::Injector::refuse_segments.store(1'000'000);
      // Spawn records and control blocks (a named `go` takes the ordinary path) alternate on
      // the spill list, each linked through its own word (queue_link).
      for (int i = 0; i < kFibers; ++i) {
        if (i % 2 == 0) {
          go [&] { ran.fetch_add(1); };
        } else {
          go go_name("spilled")[&] { ran.fetch_add(1); };
        }
      }
      // Each overflow asked for a segment and was refused: the fibers went to the spill list.
      refused = 1'000'000 - fiber::detail::Injector::refuse_segments.exchange(0);
    });
    CHECK(ran.load() == kFibers);
    // Alone, the spawner fills its ring and overflows for certain; with other processors
    // stealing from it, it may not.
    if (procs == 1) CHECK(refused > 0);
  });
}

namespace {
// A callable carrying `Bytes` bytes of pattern, counting its live copies, and checking its bytes
// when it runs: the capture must arrive whole whichever control-block size it lands in. When it
// runs it also records which size that was (Fiber::block_class).
template <std::size_t Bytes>
struct Payload {
  static_assert(Bytes >= 16 && Bytes % 8 == 0);
  std::atomic<int>* live;
  unsigned char bytes[Bytes - 8];
  explicit Payload(std::atomic<int>* l) : live(l) {
    for (std::size_t i = 0; i < sizeof bytes; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + Bytes);
    ++*live;
  }
  Payload(const Payload& o) : live(o.live) {
    std::memcpy(bytes, o.bytes, sizeof bytes);
    ++*live;
  }
  ~Payload() { --*live; }
  long operator()() const {
    for (std::size_t i = 0; i < sizeof bytes; ++i) {
      if (bytes[i] != static_cast<unsigned char>(i * 7 + Bytes)) return -1;
    }
    return static_cast<long>(Bytes);
  }
};

// What a Payload fiber reports: the value it computed and the block size it ran in.
struct PayloadReport {
  std::atomic<long> seen{0};
  fiber::detail::BlockClass block = fiber::detail::kMallocBlock;
  fiber::WaitGroup wg;
};

// Spawns a Payload<Bytes> joined and detached (`go`), each capturing the Payload and a PayloadReport
// pointer, and with a bound argument; checks each saw its bytes. In release builds also that the
// joined and the `go` one landed in the block sizes given (sanitizer builds have a bigger Fiber).
// Runs in a fiber too, so the size goes into each message: no CAPTURE (io_util.hpp says why).
template <std::size_t Bytes>
void check_payload(fiber::Scheduler& s, std::atomic<int>& live, fiber::detail::BlockClass joined,
                   fiber::detail::BlockClass detached) {
  PayloadReport rj, rd;
  rd.wg.add(1);
  fiber::spawn({.scheduler = &s}, [r = &rj, p = Payload<Bytes>(&live)] {
    r->seen = p();
    r->block = fiber::detail::current_fiber()->block_class;
  }).join();
  go go_on(s)[r = &rd, p = Payload<Bytes>(&live)] {
    r->seen = p();
    r->block = fiber::detail::current_fiber()->block_class;
    r->wg.done();
  };
  rd.wg.wait();
  CHECK_MESSAGE(rj.seen.load() == static_cast<long>(Bytes), "Bytes = " << Bytes);
  CHECK_MESSAGE(rd.seen.load() == static_cast<long>(Bytes), "Bytes = " << Bytes);
  if (!kSanitized) {
    CHECK_MESSAGE(static_cast<int>(rj.block) == static_cast<int>(joined), "Bytes = " << Bytes);
    CHECK_MESSAGE(static_cast<int>(rd.block) == static_cast<int>(detached), "Bytes = " << Bytes);
  }
  auto with_arg = [](const Payload<Bytes>& p, long k) { return p() + k; };
  CHECK_MESSAGE(fiber::spawn({.scheduler = &s}, with_arg, Payload<Bytes>(&live), 1000L).join() ==
                    static_cast<long>(Bytes) + 1000,
                "Bytes = " << Bytes);
}
}  // namespace

TEST_CASE("spawn: callables of every size run with their captures whole, in the block size that fits") {
  // Control blocks are slots of 160, 192, 256 or 384 bytes, or malloc'd past that
  // (sched/runtime.cpp). A `go` fiber's is the Fiber (128 bytes) and its task: 16 bytes and the
  // callable in an optional, here a pointer and the Payload, so 160 + Bytes. A joinable fiber's
  // also holds the joiner's wait record (64 bytes): 224 + Bytes. Sizes on each side of every
  // boundary, each spawned from a plain thread and from a fiber.
  using namespace fiber::detail;
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<int> live{0};
    auto all_sizes = [&] {
      // The smallest slot: a `go` lambda capturing one pointer, 128 + 32 bytes.
      PayloadReport r;
      r.wg.add(1);
      go go_on(s)[&r] {
        r.block = fiber::detail::current_fiber()->block_class;
        r.wg.done();
      };
      r.wg.wait();
      if (!kSanitized) CHECK(static_cast<int>(r.block) == static_cast<int>(kSlot160));
      check_payload<16>(s, live, kSlot256, kSlot192);
      check_payload<32>(s, live, kSlot256, kSlot192);  // both exactly full
      check_payload<40>(s, live, kSlot384, kSlot256);
      check_payload<96>(s, live, kSlot384, kSlot256);  // go: 256, exactly full
      check_payload<104>(s, live, kSlot384, kSlot384);
      check_payload<160>(s, live, kSlot384, kSlot384);  // joined: 384, exactly full
      check_payload<168>(s, live, kMallocBlock, kSlot384);
      check_payload<224>(s, live, kMallocBlock, kSlot384);  // go: 384, exactly full
      check_payload<232>(s, live, kMallocBlock, kMallocBlock);
      check_payload<1024>(s, live, kMallocBlock, kMallocBlock);
    };
    all_sizes();
    fiber::block_on({.scheduler = &s}, all_sizes);
    // Each callable goes as soon as its fiber returns; the detached ones may still be on their
    // way out when wg.wait() returns, so wait for the count. So may the first `go` fiber, which
    // for_each_proc_count would then find still counted live (seen once under ASan).
    CHECK(wait_for([&] { return live.load() == 0; }));
    CHECK(wait_for([&] { return s.live_fibers() == 0; }));
  });
}

namespace {
// `Bytes` bytes of pattern, trivially copyable: with the two pointers go_pattern's lambda adds,
// the kind of callable a `go` from a fiber may queue as a spawn record (fiber/detail/task.hpp).
template <std::size_t Bytes>
struct Pattern {
  unsigned char bytes[Bytes];
  Pattern() {
    for (std::size_t i = 0; i < Bytes; ++i) bytes[i] = static_cast<unsigned char>(i * 5 + Bytes);
  }
  bool whole() const {
    for (std::size_t i = 0; i < Bytes; ++i) {
      if (bytes[i] != static_cast<unsigned char>(i * 5 + Bytes)) return false;
    }
    return true;
  }
};
static_assert(std::is_trivially_copyable_v<Pattern<16>>);

// From a fiber, `go`s each capturing a Pattern<Bytes> and two pointers, `n` times; returns how
// many arrived whole (each fiber counts itself either way).
template <std::size_t Bytes>
long go_pattern(long n) {
  std::atomic<long> whole{0};
  fiber::WaitGroup wg;
  wg.add(n);
  for (long i = 0; i < n; ++i) {
    go [p = Pattern<Bytes>(), &whole, &wg] {
      if (p.whole()) whole.fetch_add(1);
      wg.done();
    };
  }
  wg.wait();
  return whole.load();
}

struct alignas(64) OverAligned {
  char c;
};
}  // namespace

TEST_CASE("go from a fiber: small trivially copyable callables queued as spawn records run once, whole") {
  // A `go` from a fiber of the target scheduler, with no name or stack size and a trivially
  // copyable callable of at most 40 bytes, queues a 32- or 64-byte record; the processor that
  // first picks it moves the callable into a control block (sched/runtime.cpp,
  // start_spawn_record). Sizes on each side of the boundaries: 8 (a 32-byte record), 32 (a
  // 64-byte one), 40 (one exactly full), 48 (the ordinary path). Enough of each to overflow the
  // ring into the injector. (Records on the injector's spill list: "a local queue's overflow
  // loses no fiber when the global queue cannot grow".)
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::block_on({.scheduler = &s}, [&] {
      constexpr long kN = 3000;
      std::atomic<long> ran{0};
      for (long i = 0; i < kN; ++i) {
        go [&ran] { ran.fetch_add(1); };
      }
      CHECK(go_pattern<16>(kN) == kN);
      CHECK(go_pattern<24>(kN) == kN);
      CHECK(go_pattern<32>(kN) == kN);
      CHECK(wait_for([&] { return ran.load() == kN; }));
      // An over-aligned result is refused as on the ordinary path, not built misaligned.
      CHECK_THROWS_AS((go [] { return OverAligned{}; }), fiber::UsageError);
    });
  });
}

TEST_CASE("go from a fiber: a record fiber gets its id when it starts; other spawns when they are made") {
  // Observable only through the id: one processor, so ids come from one block in order. A
  // record's fiber takes its id when it starts, after a fiber::spawn made after it; a `go` that
  // takes the ordinary path (too big, not trivially copyable, named) takes it at once.
  fiber::Scheduler s({.processors = 1, .name = "records"});
  fiber::block_on({.scheduler = &s}, [] {
    std::atomic<unsigned long long> record{0}, big{0}, nontrivial{0}, named{0};
    go [&record] { record = fiber::this_fiber::id(); };
    go [&big, pad = Pattern<40>()] { big = pad.whole() ? fiber::this_fiber::id() : 1; };
    go [&nontrivial, text = std::string("not trivially copyable")] { nontrivial = fiber::this_fiber::id(); };
    go go_name("named")[&named] { named = fiber::this_fiber::id(); };
    auto later = fiber::spawn([] {});
    const unsigned long long later_id = later.id();
    later.join();
    CHECK(wait_for([&] { return record != 0 && big != 0 && nontrivial != 0 && named != 0; }));
    CHECK(record.load() > later_id);
    CHECK(big.load() < later_id);
    CHECK(big.load() != 1);
    CHECK(nontrivial.load() < later_id);
    CHECK(named.load() < later_id);
  });
}

TEST_CASE("go from a fiber: an exception escaping a fiber started from a spawn record is reported with its id") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    HandlerScope scope;
    std::atomic<unsigned long long> id{0};
    fiber::block_on({.scheduler = &s}, [&id] {
      go [&id] {
        id = fiber::this_fiber::id();
        throw TaggedError(9);
      };
    });
    quiesce(s);
    auto r = take_reports();
    REQUIRE(r.size() == 1);
    CHECK(id.load() != 0);
    CHECK(r[0].id == id.load());
    CHECK(r[0].name == "");
    CHECK(r[0].message == "tagged error 9");
  });
}

TEST_CASE("go from a fiber: a record whose control block cannot be had never runs; its ResourceError reaches the handler") {
  // Out of memory when a record starts (sched/fiber.hpp, refuse_record_starts): a switch's pick
  // (a yield, a park's window, a finish) hands the record to the loop, which reports a
  // ResourceError under a fresh id, counts the fiber finished and leaves its block_on group.
  // It must not end the process (the default handler would; this one records).
  for_each_proc_count([](fiber::Scheduler& s, int) {
    HandlerScope scope;
    constexpr std::size_t kN = 50;
    std::atomic<int> ran{0};
    fiber::detail::refuse_record_starts.store(1'000'000);
    fiber::block_on({.scheduler = &s}, [&ran] {
      for (std::size_t i = 0; i < kN; ++i) {
        go [&ran] { ran.fetch_add(1); };
      }
      fiber::this_fiber::yield();               // a yield's pick
      fiber::this_fiber::sleep_for(1ms);        // a park's pick
    });                                         // then the finish's, and the loop's
    fiber::detail::refuse_record_starts.store(0);
    CHECK(ran.load() == 0);
    quiesce(s);
    const auto r = take_reports();
    REQUIRE(r.size() == kN);
    std::set<unsigned long long> ids;
    for (const Report& x : r) {
      CHECK(x.message.find("out of memory for fiber control blocks") != std::string::npos);
      CHECK(x.name.empty());
      ids.insert(x.id);
    }
    CHECK(ids.size() == kN);
    CHECK(ids.count(0) == 0);
    // Memory back, records start again.
    fiber::block_on({.scheduler = &s}, [&ran] {
      for (std::size_t i = 0; i < kN; ++i) {
        go [&ran] { ran.fetch_add(1); };
      }
    });
    CHECK(ran.load() == static_cast<int>(kN));
    CHECK(take_reports().empty());
  });
}

TEST_CASE("PinGuard: nesting deeper than the documented limit is a UsageError") {
  fiber::Scheduler s({.processors = 2, .name = "pin-depth"});
  fiber::block_on({.scheduler = &s}, [] {
    std::vector<std::unique_ptr<fiber::this_fiber::PinGuard>> pins;
    for (int i = 0; i < 0xff00; ++i) pins.push_back(std::make_unique<fiber::this_fiber::PinGuard>());
    try {
      fiber::this_fiber::PinGuard one_more;
      FAIL("PinGuard nested past the limit did not throw");
    } catch (const fiber::UsageError& e) {
      CHECK(std::string(e.what()).find("nested more than 65280 deep") != std::string::npos);
    }
    pins.clear();
    fiber::this_fiber::yield();  // unpinned again: yielding and returning still works
  });
}
