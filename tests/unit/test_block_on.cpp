// block_on and wait_all (fiber/block_on.hpp): values, exceptions, and waiting for every fiber
// spawned (transitively) inside, from plain threads and from fibers.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include "integration/process.hpp"  // run_test_case, AddressSpaceLimit
#include "test_util.hpp"

namespace {
using namespace fiber_test;
using namespace std::chrono_literals;

struct CodeError : std::runtime_error {
  explicit CodeError(int c) : std::runtime_error("code " + std::to_string(c)), code(c) {}
  int code;
};
}  // namespace

TEST_CASE("block_on: returns the root's value or rethrows its exception") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    CHECK(fiber::block_on({.scheduler = &s}, [] { return 7; }) == 7);
    CHECK(fiber::block_on({.scheduler = &s}, [] { return std::string("seven"); }) == "seven");
    auto p = fiber::block_on({.scheduler = &s}, [] { return std::make_unique<int>(77); });
    REQUIRE(p);
    CHECK(*p == 77);
    bool ran = false;
    fiber::block_on({.scheduler = &s}, [&] { ran = fiber::this_fiber::in_fiber(); });
    CHECK(ran);
    // The root ran on s.
    const std::string tn = fiber::block_on({.scheduler = &s}, [] { return thread_name(); });
    CHECK_MESSAGE(tn.rfind("t-P", 0) == 0, "ran on " << tn);

    CHECK_THROWS_AS(fiber::block_on({.scheduler = &s}, []() -> int { throw CodeError(3); }), CodeError);
    try {
      fiber::block_on({.scheduler = &s}, [] {
        fiber::this_fiber::sleep_for(1ms);
        throw CodeError(4);
      });
      FAIL_CHECK("no exception");
    } catch (const CodeError& e) {
      CHECK(e.code == 4);
    }
  });
  // Default scheduler, from main.
  CHECK(fiber::block_on([] { return 5; }) == 5);
}

TEST_CASE("block_on: waits for late descendants") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<bool> grandchild_done{false};
    std::atomic<int> spawned{0};
    std::atomic<int> finished{0};
    const int v = fiber::block_on({.scheduler = &s}, [&] {
      // The brief's shape: child sleeps, spawns a grandchild that sleeps and sets the flag.
      spawned.fetch_add(1);
      fiber::spawn([&] {
        fiber::this_fiber::sleep_for(20ms);
        spawned.fetch_add(1);
        go[&] {
          fiber::this_fiber::sleep_for(20ms);
          grandchild_done = true;
          finished.fetch_add(1);
        };
        finished.fetch_add(1);
      }).detach();
      // And a wider tree: 4 children x 3 grandchildren x 2 great-grandchildren, mixed sleeps
      // and yields, detached and dropped handles.
      for (int c = 0; c < 4; ++c) {
        spawned.fetch_add(1);
        auto h = fiber::spawn([&, c] {
          for (int g = 0; g < 3; ++g) {
            spawned.fetch_add(1);
            go[&, c, g] {
              fiber::this_fiber::sleep_for(std::chrono::milliseconds(1 + (c + g) % 4));
              for (int k = 0; k < 2; ++k) {
                spawned.fetch_add(1);
                fiber::spawn([&, k] {
                  if (k == 0) fiber::this_fiber::yield(); else fiber::this_fiber::sleep_for(5ms);
                  finished.fetch_add(1);
                });  // handle dropped: detached
              }
              finished.fetch_add(1);
            };
          }
          finished.fetch_add(1);
        });
        (void)h;  // dropped at the end of the iteration
      }
      return 99;
    });
    CHECK(v == 99);
    CHECK(grandchild_done.load());
    CHECK(spawned.load() == 2 + 4 * (1 + 3 * (1 + 2)));
    CHECK(finished.load() == spawned.load());
    quiesce(s);  // members count as finished before their group hears: nothing is live
  });
}

TEST_CASE("block_on: rethrows only after the descendants finished") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<bool> late{false};
    CHECK_THROWS_AS(fiber::block_on({.scheduler = &s},
                                    [&] {
                                      go[&] {
                                        fiber::this_fiber::sleep_for(20ms);
                                        late = true;
                                      };
                                      throw CodeError(1);
                                    }),
                    CodeError);
    CHECK(late.load());
    quiesce(s);
  });
}

TEST_CASE("wait_all: values in argument order, void as monostate") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto t = fiber::block_on({.scheduler = &s}, [] {
      return fiber::wait_all(
          [] {
            fiber::this_fiber::sleep_for(15ms);
            return 1;
          },
          [] { return std::string("two"); },
          [] { fiber::this_fiber::sleep_for(5ms); },
          [] { return std::make_unique<int>(4); });
    });
    static_assert(std::is_same_v<std::tuple_element_t<2, decltype(t)>, std::monostate>);
    CHECK(std::get<0>(t) == 1);
    CHECK(std::get<1>(t) == "two");
    REQUIRE(std::get<3>(t));
    CHECK(*std::get<3>(t) == 4);

    auto single = fiber::block_on({.scheduler = &s}, [] { return fiber::wait_all([] { return 8; }); });
    CHECK(std::get<0>(single) == 8);
  });
  // From main: the default scheduler.
  auto [a, b] = fiber::wait_all([] { return 1; }, [] { return 2.5; });
  CHECK(a == 1);
  CHECK(b == 2.5);
}

TEST_CASE("wait_all: waits for descendants, rethrows the first exception in argument order") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<int> finished{0};
    std::atomic<bool> late{false};
    auto r = fiber::block_on({.scheduler = &s}, [&] {
      return fiber::wait_all(
          [&] {
            go[&] {
              fiber::this_fiber::sleep_for(25ms);
              late = true;
            };
            finished.fetch_add(1);
            return 1;
          },
          [&] {
            fiber::spawn([&] {
              fiber::this_fiber::sleep_for(10ms);
              finished.fetch_add(1);
            }).detach();
            finished.fetch_add(1);
          });
    });
    CHECK(std::get<0>(r) == 1);
    CHECK(late.load());
    CHECK(finished.load() == 3);

    // Argument 2 fails late, argument 3 fails at once, argument 4 is slow: the exception is
    // argument 2's, and it comes only after argument 4 (and its child) finished.
    std::atomic<bool> slow_done{false};
    std::atomic<bool> slow_child_done{false};
    try {
      fiber::block_on({.scheduler = &s}, [&] {
        fiber::wait_all([] { return 1; },
                        []() -> int {
                          fiber::this_fiber::sleep_for(20ms);
                          throw CodeError(2);
                        },
                        []() -> int { throw CodeError(3); },
                        [&] {
                          go[&] {
                            fiber::this_fiber::sleep_for(30ms);
                            slow_child_done = true;
                          };
                          fiber::this_fiber::sleep_for(10ms);
                          slow_done = true;
                        });
      });
      FAIL_CHECK("no exception");
    } catch (const CodeError& e) {
      CHECK(e.code == 2);
    }
    CHECK(slow_done.load());
    CHECK(slow_child_done.load());
    quiesce(s);
  });
}

TEST_CASE("block_on: nested inside a fiber") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    fiber::Scheduler other({.processors = static_cast<std::size_t>(n % 3 + 1), .name = "other"});
    std::atomic<int> inner_done{0};
    auto result = fiber::block_on({.scheduler = &s}, [&] {
      // Inner block_on on the same scheduler: returns only once its own descendants are done.
      const int a = fiber::block_on([&] {
        for (int i = 0; i < 10; ++i) {
          go[&, i] {
            fiber::this_fiber::sleep_for(std::chrono::milliseconds(i % 5));
            inner_done.fetch_add(1);
          };
        }
        return 10;
      });
      const int seen = inner_done.load();
      // Inner block_on on another scheduler, from this fiber.
      const std::string where = fiber::block_on({.scheduler = &other}, [&] {
        go[&] {
          fiber::this_fiber::sleep_for(5ms);
          inner_done.fetch_add(1);
        };
        return thread_name();
      });
      const int seen2 = inner_done.load();
      // Three levels deep.
      const int deep = fiber::block_on([] { return fiber::block_on([] { return fiber::block_on([] { return 3; }); }); });
      return std::make_tuple(a, seen, where, seen2, deep);
    });
    auto [a, seen, where, seen2, deep] = result;
    CHECK(a == 10);
    CHECK(seen == 10);
    CHECK_MESSAGE(where.rfind("other-P", 0) == 0, "ran on " << where);
    CHECK(seen2 == 11);
    CHECK(deep == 3);
    quiesce(other);
    quiesce(s);
  });
}

TEST_CASE("block_on: from several plain threads at once") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kThreads = 6;
    constexpr int kRounds = 40;
    std::atomic<int> wrong{0};
    std::atomic<int> missing{0};
    with_watchdog(60'000ms, "concurrent block_on", [&] {
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          for (int r = 0; r < kRounds; ++r) {
            std::atomic<int> kids{0};
            const int v = fiber::block_on({.scheduler = &s}, [&, t, r] {
              for (int k = 0; k < 5; ++k) {
                go[&kids, r, k] {  // by value: the root's frame is gone before they run
                  if ((r + k) % 3 == 0) fiber::this_fiber::sleep_for(200us); else fiber::this_fiber::yield();
                  kids.fetch_add(1);
                };
              }
              return t * 1000 + r;
            });
            if (v != t * 1000 + r) wrong.fetch_add(1);
            if (kids.load() != 5) missing.fetch_add(1);
            // `kids` dies here: every member finished (block_on waited), though the last ones
            // may still be switching away - they no longer touch `kids`.
          }
        });
      }
      for (auto& th : threads) th.join();
    });
    CHECK(wrong.load() == 0);
    CHECK(missing.load() == 0);
    quiesce(s);
  });
}

// A processor tells a group about the members that finished on it in one step, when it turns
// to other work (the group's debt, sched/group.hpp). Here the other work never ends on its
// own: fibers outside the group - plain ones, and the root of another thread's block_on - that
// yield until the first block_on has returned. If a processor kept its debt while running
// them, nothing would ever wake the waiter, and the watchdog would fail the run.
TEST_CASE("block_on: returns while its processors go on running other fibers") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int n) {
        std::atomic<bool> released{false};
        std::vector<fiber::JoinHandle<void>> spinners;
        for (int i = 0; i < n; ++i) {
          spinners.push_back(fiber::spawn({.scheduler = &s}, [&] {
            while (!released.load()) fiber::this_fiber::yield();
          }));
        }
        std::atomic<bool> other_group_running{false};
        std::thread other([&] {
          fiber::block_on({.scheduler = &s}, [&] {
            other_group_running = true;
            while (!released.load()) fiber::this_fiber::yield();
          });
        });
        REQUIRE(wait_for([&] { return other_group_running.load(); }));
        for (int round = 0; round < 50; ++round) {
          std::atomic<int> done{0};
          fiber::block_on({.scheduler = &s}, [&] {
            for (int k = 0; k < 8; ++k) {
              go[&done] { done.fetch_add(1); };
              if (k % 3 == 0) fiber::this_fiber::yield();
            }
          });
          CHECK(done.load() == 8);
        }
        released = true;
        other.join();
        for (auto& h : spinners) h.join();
      },
      kProcCounts, true, 20'000ms);
}

namespace {
// A tree of `fanout`^depth leaves; every node yields between spawns, so members spawn on
// processors that owe the group for members finished there, and finish wherever they were
// stolen to.
void grow_tree(std::atomic<int>& finished, int depth, int fanout) {
  if (depth > 0) {
    for (int i = 0; i < fanout; ++i) {
      go[&finished, depth, fanout] { grow_tree(finished, depth - 1, fanout); };
      if (i % 2 == 1) fiber::this_fiber::yield();
    }
  }
  finished.fetch_add(1);
}
}  // namespace

TEST_CASE("block_on: counts its members exactly while they spawn, yield and finish everywhere") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kNodes = 1 + 4 + 16 + 64;  // depth 3, fan-out 4
    int early = 0;
    for (int round = 0; round < 300; ++round) {
      std::atomic<int> finished{0};
      fiber::block_on({.scheduler = &s}, [&] { grow_tree(finished, 3, 4); });
      if (finished.load() != kNodes) ++early;  // returned before every member finished
    }
    CHECK(early == 0);
  });
}

// A fiber waiting in block_on can be cancelled: the wait throws Cancelled at once, and the
// members - not cancelled themselves - go on and finish later, after the group's creator has
// left. The group must outlive them (ASan would catch a member finishing into a freed group).
TEST_CASE("block_on: a cancelled waiter leaves at once; its members finish on their own") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<bool> root_started{false};
    std::atomic<bool> released{false};
    std::atomic<int> finished{0};
    auto outer = fiber::spawn({.scheduler = &s}, [&] {
      fiber::block_on([&] {
        root_started = true;
        for (int i = 0; i < 3; ++i) {
          go[&] {
            while (!released.load()) fiber::this_fiber::sleep_for(1ms);
            finished.fetch_add(1);
          };
        }
        while (!released.load()) fiber::this_fiber::sleep_for(1ms);
        finished.fetch_add(1);
      });
    });
    REQUIRE(wait_for([&] { return root_started.load(); }));
    outer.cancel();
    CHECK_THROWS_AS(outer.join(), fiber::Cancelled);
    CHECK(finished.load() == 0);
    released = true;
    CHECK(wait_for([&] { return finished.load() == 4; }));
    quiesce(s);
  });
}

namespace {
struct alignas(64) Overaligned {  // over max_align_t: spawning it is a UsageError
  void operator()() const {}
};
}  // namespace

// wait_all spawns its roots one by one; when one spawn throws, the roots already spawned run
// on, detached, and the group is freed by the last of them (ASan would report a use after free,
// LeakSanitizer a leak). The order the roots are spawned in is the compiler's (an unspecified
// order of evaluation), so the throwing one goes once last and once first: in exactly one of
// the two calls the other root is spawned before the throw.
TEST_CASE("wait_all: a spawn that throws leaves the roots already spawned to finish") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<int> ran{0};
    std::atomic<int> threw{0};
    fiber::block_on({.scheduler = &s}, [&] {
      auto root = [&] {
        fiber::this_fiber::sleep_for(5ms);
        ran.fetch_add(1);
      };
      try {
        fiber::wait_all(root, Overaligned{});
      } catch (const fiber::UsageError& e) {
        if (contains(e.what(), "alignment")) threw.fetch_add(1);
      }
      try {
        fiber::wait_all(Overaligned{}, root);
      } catch (const fiber::UsageError& e) {
        if (contains(e.what(), "alignment")) threw.fetch_add(1);
      }
    });
    CHECK(threw.load() == 2);
    CHECK(wait_for([&] { return ran.load() == 1; }));
    quiesce(s);
    CHECK(ran.load() == 1);
  });
}

namespace {
// A result whose destructor blocks the thread until `release` is set (or 20 s pass, which the
// test reports). Moved-from ones do not block. The flags are shared: the destructor runs after
// the fiber counts as finished, possibly after the test has moved on.
struct BlockingFlags {
  std::atomic<bool> release{false};
  std::atomic<bool> gave_up{false};
  std::atomic<bool> destroyed{false};
};
struct BlockingResult {
  std::shared_ptr<BlockingFlags> flags;
  explicit BlockingResult(std::shared_ptr<BlockingFlags> f) : flags(std::move(f)) {}
  BlockingResult(BlockingResult&&) noexcept = default;
  BlockingResult& operator=(BlockingResult&&) = delete;
  ~BlockingResult() {
    if (!flags) return;
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    while (!flags->release.load() && !flags->gave_up.load()) {
      if (std::chrono::steady_clock::now() > give_up) flags->gave_up = true;
      std::this_thread::sleep_for(1ms);
    }
    flags->destroyed = true;
  }
};
}  // namespace

// The last member's result, its handle dropped, is destroyed when the fiber's last reference
// goes - on its processor, after it finished. block_on must have heard of the member by then:
// here the destructor holds the processor until block_on has returned.
TEST_CASE("block_on: returns before a finished member's result is destroyed") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        auto flags = std::make_shared<BlockingFlags>();
        fiber::block_on({.scheduler = &s}, [flags] {
          (void)fiber::spawn([flags] { return BlockingResult(flags); });  // handle dropped
        });
        flags->release = true;
        CHECK(wait_for([&] { return flags->destroyed.load(); }, 30'000ms));
        CHECK_FALSE(flags->gave_up.load());
        quiesce(s);
      },
      {1, 2}, true, 60'000ms);
}

// ---- a processor that owes a group runs a fiber whose first run fails
//
// The unhandled-exception handler of a fiber that could not get a stack runs on the loop of the
// processor that tried. That processor may owe a block_on group for members that finished on
// it (sched/group.hpp); it must settle before the handler runs, or block_on waits for the
// handler. The stack is refused by a lowered RLIMIT_AS, so this runs in a child process.
namespace {
constexpr const char* kFailedFirstRunChild = "block_on: (child process) a failed first run on a processor that owes the group";

struct HandlerFlags {
  std::atomic<bool> entered{false};
  std::atomic<bool> resource_error{false};
  std::atomic<bool> block_on_returned{false};
  std::atomic<bool> gave_up{false};
  std::atomic<bool> left{false};
};
HandlerFlags g_handler;

// Holds the processor's loop until block_on has returned (or 20 s pass: reported).
void wait_for_block_on(const fiber::UnhandledException& e) {
  try {
    std::rethrow_exception(e.error);
  } catch (const fiber::ResourceError&) {
    g_handler.resource_error = true;
  } catch (...) {
  }
  g_handler.entered = true;
  const auto give_up = std::chrono::steady_clock::now() + 20s;
  while (!g_handler.block_on_returned.load()) {
    if (std::chrono::steady_clock::now() > give_up) {
      g_handler.gave_up = true;
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  g_handler.left = true;
}
}  // namespace

// Two processors, P and Q. A hog holds Q. On P the root spawns a member, which finishes there
// and hands P straight back to the root (same group: P now owes the group one). The root then
// waits, and P's next fiber, one of no group, cannot get a stack: its handler runs on P's loop
// and holds it until block_on returns. Q, freed from the hog, resumes the root, which finishes
// there. block_on returns only if P settled before the handler ran.
TEST_CASE("block_on: (child process) a failed first run on a processor that owes the group" * doctest::skip()) {
  const auto previous = fiber::set_unhandled_exception_handler(&wait_for_block_on);
  fiber::Scheduler s({.processors = 2, .name = "owes"});
  // A size class nothing here has used: its first stack needs a fresh 64 MiB chunk.
  const std::size_t big = std::size_t{1} << 20;
  std::atomic<int> hog_on{-1};
  std::atomic<bool> release_hog{false};
  go go_on(s)[&] {
    fiber::this_fiber::PinGuard pin;
    hog_on = static_cast<int>(fiber::this_fiber::processor_index());
    while (!release_hog.load()) {
    }
  };
  REQUIRE(wait_for([&] { return hog_on.load() >= 0; }));

  std::atomic<int> root_on{-1};
  std::atomic<bool> ready{false};
  std::atomic<bool> queued{false};
  fiber::Latch wake(1);
  std::thread waiter([&] {
    fiber::block_on({.scheduler = &s}, [&] {
      {
        fiber::this_fiber::PinGuard pin;
        root_on = static_cast<int>(fiber::this_fiber::processor_index());
        go [] {};
        fiber::this_fiber::yield();  // the member runs, finishes, and P comes back to us
        ready = true;
        while (!queued.load()) {  // P runs nothing else until the doomed fiber is queued
        }
      }
      wake.wait();  // P turns to the doomed fiber
    });
    g_handler.block_on_returned = true;
  });

  REQUIRE(wait_for([&] { return ready.load(); }));
  {
    AddressSpaceLimit limit(mapped_bytes() + (std::size_t{512} << 10));
    go go_stack(big) go_on(s)[] {};
    queued = true;
    REQUIRE(wait_for([&] { return g_handler.entered.load(); }));
  }
  release_hog = true;
  wake.count_down();
  waiter.join();
  REQUIRE(wait_for([&] { return g_handler.left.load(); }, 30'000ms));
  fiber::set_unhandled_exception_handler(previous);
  CHECK(root_on.load() != hog_on.load());
  CHECK(g_handler.resource_error.load());
  CHECK_FALSE(g_handler.gave_up.load());
  if (!g_handler.gave_up.load()) std::printf("handler saw block_on return\n");
  std::fflush(stdout);
}

TEST_CASE("block_on: a processor that owes the group settles before a failed first run's handler") {
  const RunResult r = run_test_case(kFailedFirstRunChild, {"FIBER_GUARDED_STACKS=0"});
  INFO("the child's status " << r.status << "; its stdout:\n" << r.out << "\nits stderr:\n" << r.err);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "handler saw block_on return"));
}
