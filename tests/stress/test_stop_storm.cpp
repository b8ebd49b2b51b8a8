// stop() storm: stop() while fibers are still spawning trees of fibers, round after round, at
// 1, 2, 4 and 8 processors.
//
// stop() may return only once every fiber has finished. It learns that from live_fibers(),
// which sums per-processor spawn and finish counters, and it can cancel only the listed fibers
// (a fiber lists itself at its first cancellation point or switch away; one listed after stop()
// began cancels itself). Here every fiber counts
// itself as it ends, and its spawner counts it before spawning: a stop() that returned early
// would leave the two counts apart (or shut a processor down under a queued fiber). Each
// fiber yields in a loop until cancelled, spawning a child on every turn while the round's
// total is below kCap, so at the moment stop() begins some fibers are running, some queued,
// some mid-spawn and some unwinding.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

constexpr int kRounds = kTsan ? 4 : (kSanitized ? 15 : 40);  // per processor count
constexpr int kRoots = 4;
// Fibers per round (a few more: the check and the add race). Far fewer under sanitizers: TSan
// keeps state for every fiber it has seen, and at 5000 (6 rounds) a CI run of the whole suite
// went past this machine's 24 GiB.
constexpr long kCap = kTsan ? 200 : (kSanitized ? 2000 : 5000);

struct Counts {
  std::atomic<long> spawned{0};
  std::atomic<long> ended{0};
};

struct EndCounter {
  std::atomic<long>* n;
  ~EndCounter() { n->fetch_add(1); }
};

void grow(Counts& c) {
  EndCounter end{&c.ended};
  for (;;) {
    if (c.spawned.load() < kCap) {
      c.spawned.fetch_add(1);
      go[&c] { grow(c); };
    }
    fiber::this_fiber::yield();  // throws Cancelled once stop() reaches this fiber
  }
}

}  // namespace

TEST_CASE("stop() storm: stop() while fibers spawn trees; every spawned fiber has ended when it returns") {
  for (int procs : kProcCounts) {
    long total = 0;
    int mid_growth = 0;  // rounds whose stop() began before the cap was reached (for the log)
    for (int round = 0; round < kRounds; ++round) {
      Counts c;
      {
        fiber::Scheduler::Options o;
        o.processors = static_cast<std::size_t>(procs);
        o.name = "stop-storm";
        o.watchdog.enabled = false;  // the yield loops would only add noise to stderr
        fiber::Scheduler s(o);
        for (int r = 0; r < kRoots; ++r) {
          c.spawned.fetch_add(1);
          go go_on(s)[&c] { grow(c); };
        }
        // Stop at a different point of the growth each round: from at once to about 2 ms in.
        std::this_thread::sleep_for(std::chrono::microseconds((round % 9) * 250));
        if (c.spawned.load() < kCap) ++mid_growth;
        with_watchdog(60'000ms, "stop() during a spawn storm", [&] { s.stop(); });
        CHECK(s.live_fibers() == 0);
      }
      INFO("processors " << procs << ", round " << round);
      REQUIRE(c.ended.load() == c.spawned.load());
      total += c.spawned.load();
    }
    MESSAGE(procs << " processors: " << kRounds << " stops (" << mid_growth << " while still spawning), " << total
                  << " fibers");
    CHECK(total > kRounds * kRoots);  // the roots did spawn before stop()
  }
}
