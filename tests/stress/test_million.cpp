// 1,000,000 fibers alive at once, with the default stack size, under the kernel's default
// vm.max_map_count (65530).
//
// Where the kernel has guard markers (Linux 6.13), guarded stacks cost no mapping of their own and
// all million are guarded. Elsewhere guarded stacks cost two mappings each, so a million of them
// cannot exist; the runtime must switch to unguarded stacks carved from shared mappings once its
// guarded budget is spent. Every
// fiber parks on one WaitGroup (the gate) until all have started; then the gate opens and all
// finish. Sanitizer builds run a reduced count (their per-fiber bookkeeping is far larger).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <elf.h>
#include <link.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "context/stack.hpp"  // StackAllocator::stats(): guarded vs. unguarded stacks in use
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

constexpr long kFibers = kTsan ? 2'000 : (kSanitized ? 100'000 : 1'000'000);

std::size_t count_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::size_t n = 0;
  std::string line;
  while (std::getline(maps, line)) ++n;
  return n;
}

std::size_t max_map_count() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  std::size_t v = 65530;
  f >> v;
  return v;
}

}  // namespace

TEST_CASE("Million: 10^6 fibers alive at once with the default stack size") {
  // Declared before the scheduler: the fibers touch them until the scheduler is gone.
  fiber::WaitGroup gate;
  fiber::WaitGroup finished;
  std::atomic<long> started{0};
  std::atomic<long> released{0};
  gate.add(1);
  finished.add(kFibers);

  const auto t0 = Clock::now();
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  {
    fiber::Scheduler s({.processors = 4, .name = "million"});
    with_watchdog(240'000ms, "a million fibers", [&] {
      for (long i = 0; i < kFibers; ++i) {
        fiber::spawn({.scheduler = &s}, [&] {
          started.fetch_add(1, std::memory_order_relaxed);
          gate.wait();
          released.fetch_add(1, std::memory_order_relaxed);
          finished.done();
        }).detach();
      }
      MESSAGE(kFibers << " fibers spawned after " << secs() << " s");

      // Wait until every fiber has started and parked on the gate.
      const bool all_started = wait_for([&] { return started.load() == kFibers; }, 180'000ms, 2ms);
      REQUIRE_MESSAGE(all_started, "only " << started.load() << " of " << kFibers << " fibers started");
      MESSAGE("all started after " << secs() << " s");

      // The peak: all of them alive, none past the gate.
      CHECK(s.live_fibers() == static_cast<std::size_t>(kFibers));
      CHECK(released.load() == 0);
      const auto st = fiber::detail::StackAllocator::instance().stats();
      const std::size_t maps = count_mappings();
      MESSAGE("peak: " << s.live_fibers() << " live fibers; stacks guarded " << st.guarded_live << " (limit "
                       << st.guarded_limit << "), unguarded " << st.unguarded_live << "; " << maps
                       << " mappings (vm.max_map_count " << max_map_count() << ")");
      CHECK(maps < max_map_count());
      if (st.guard_markers) {
        // Guard markers cost no mapping: every stack is guarded, however many.
        CHECK(st.guarded_live >= static_cast<std::size_t>(kFibers));
        CHECK(st.unguarded_live == 0);
      } else {
        CHECK(st.guarded_live <= st.guarded_limit);
        if (kFibers > static_cast<long>(st.guarded_limit) + 4 * 128) {
          CHECK(st.unguarded_live > 0);  // the fallback was used
        }
      }

      gate.done();
      finished.wait();
      MESSAGE("all finished after " << secs() << " s");
      CHECK(released.load() == kFibers);
      quiesce(s, 60'000ms);
      CHECK(s.live_fibers() == 0);
    });
  }
  CHECK(finished.count() == 0);
}

// Compact stacks (2 KiB, no guard page) hold the fiber's frames and nothing more, so nothing
// else may ever run on them: not the runtime's scheduling work (a compact fiber switches to and
// from its processor's loop), and not the dynamic linker's lazy binding, which saves the whole
// extended register state on the stack the first time a function is called through the PLT.
// Before libfiber linked with -z now (and ctest ran this with LD_BIND_NOW=1, which binds the
// shared libraries too), the benchmark doing the same crashed in about half its runs: whichever
// fiber first called a function overflowed into its neighbour's wait record.
TEST_CASE("Million: 10^6 fibers parked on compact stacks, woken by a close from a thread") {
  if (kSanitized) return;  // sanitizer checks need far more than 2 KiB of stack
  constexpr long kCompact = 1'000'000;
  fiber::Channel<int> gate;
  fiber::WaitGroup started, finished;
  std::atomic<long> closed_seen{0};
  started.add(kCompact);
  finished.add(kCompact);
  {
    fiber::Scheduler s({.processors = 2, .name = "compact"});
    with_watchdog(240'000ms, "a million compact fibers", [&] {
      for (long i = 0; i < kCompact; ++i) {
        fiber::spawn({.stack_size = fiber::compact_stack_size, .scheduler = &s}, [&] {
          started.done();
          if (!gate.recv()) closed_seen.fetch_add(1, std::memory_order_relaxed);
          finished.done();
        }).detach();
      }
      started.wait();
      gate.close();  // from this plain thread: wakes every parked receiver
      finished.wait();
      CHECK(closed_seen.load() == kCompact);
      quiesce(s, 60'000ms);
    });
  }
}

TEST_CASE("Million: programs linking libfiber are bound immediately (-z now)") {
  // Part of what keeps lazy binding off compact stacks (see above): libfiber's link interface
  // adds -Wl,-z,now to every program that links it, this one included. (Shared libraries need
  // LD_BIND_NOW=1; the runtime warns when a compact stack is used without it.)
  bool now = false;
  for (const ElfW(Dyn)* d = _DYNAMIC; d->d_tag != DT_NULL; ++d) {
    if (d->d_tag == DT_FLAGS && (d->d_un.d_val & DF_BIND_NOW) != 0) now = true;
    if (d->d_tag == DT_FLAGS_1 && (d->d_un.d_val & DF_1_NOW) != 0) now = true;
  }
  CHECK(now);
}
