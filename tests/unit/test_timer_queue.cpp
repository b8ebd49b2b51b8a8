// Tests for TimerQueue (sched/timer.hpp), the per-processor heap of deadlines: which timers
// fire_expired() claims, and in what order, on deadlines made up for the test (no clock, no
// sleeping, so nothing here depends on how the OS schedules threads).
//
//   1. Only entries due at `now` fire, earliest deadline first, whatever the order of adding.
//   2. Equal deadlines fire in the order they were added (a call's `max` shows it).
//   3. One call fires every due entry, however many batches of kFireBatch that takes.
//   4. A removed entry never fires; next_deadline() follows the heap's head.
//   5. A drained burst gives its storage back; a small heap keeps its own.
//   6. Randomised against a sorted model.
//
// The waiters belong to a plain thread (each test body runs on a fresh one): a claim then only
// records the reason in the Waiter, which is what the checks read.
#include "sched/timer.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "test_util.hpp"

namespace {

using fiber::detail::TimerEntry;
using fiber::detail::TimerQueue;
using fiber::detail::Waiter;
using fiber::detail::WakeReason;

// One timer: its wait record and its heap entry.
struct Timer {
  Waiter w;
  TimerEntry e;
  explicit Timer(int64_t deadline) {
    fiber::detail::waiter_prepare(w);
    e.deadline_ns = deadline;
    e.waiter = &w;
  }
  bool fired() const { return fiber::detail::waiter_state(w) == WakeReason::Timeout; }
};

std::vector<std::unique_ptr<Timer>> make_timers(std::initializer_list<int64_t> deadlines) {
  std::vector<std::unique_ptr<Timer>> v;
  for (int64_t d : deadlines) v.push_back(std::make_unique<Timer>(d));
  return v;
}

// n timers due at first, first + step, ...
std::vector<std::unique_ptr<Timer>> make_timers(std::size_t n, int64_t first, int64_t step) {
  std::vector<std::unique_ptr<Timer>> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(std::make_unique<Timer>(first + static_cast<int64_t>(i) * step));
  return v;
}

}  // namespace

TEST_CASE("TimerQueue: only due entries fire, earliest first, whatever the order of adding") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    auto t = make_timers({30, 10, 20});
    for (auto& x : t) q.add(&x->e);
    CHECK(q.size() == 3);
    CHECK(q.next_deadline() == 10);
    CHECK(q.fire_expired(9) == 0);
    CHECK_FALSE(t[1]->fired());

    CHECK(q.fire_expired(15) == 1);
    CHECK(t[1]->fired());
    CHECK_FALSE(t[0]->fired());
    CHECK_FALSE(t[2]->fired());
    CHECK(q.next_deadline() == 20);

    CHECK(q.fire_expired(20) == 1);  // due at exactly its deadline
    CHECK(t[2]->fired());
    CHECK_FALSE(t[0]->fired());

    CHECK(q.fire_expired(1000) == 1);
    CHECK(t[0]->fired());
    CHECK(q.size() == 0);
    CHECK(q.next_deadline() == TimerQueue::kNone);
  });
}

TEST_CASE("TimerQueue: equal deadlines fire in the order they were added") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    // 20 due at once, a call allowed 16: it takes the 16 added first, and interleaving an
    // earlier deadline in the adds changes nothing about that.
    std::vector<std::unique_ptr<Timer>> t;
    for (int i = 0; i < 20; ++i) t.push_back(std::make_unique<Timer>(i == 7 ? 40 : 50));
    for (auto& x : t) q.add(&x->e);
    CHECK(q.fire_expired(60, 16) == 16);
    int fired = 0;
    for (int i = 0; i < 20; ++i) {
      CAPTURE(i);
      const bool first_batch = i < 16;  // the 40 (i = 7), then the first 15 of the 50s
      CHECK(t[i]->fired() == first_batch);
      fired += t[i]->fired();
    }
    CHECK(fired == 16);
    CHECK(q.fire_expired(60) == 4);
    for (auto& x : t) CHECK(x->fired());
  });
}

TEST_CASE("TimerQueue: one call fires every due entry, beyond one batch") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    // A large expiry (idle timeouts of many connections at once) must not be left to later calls:
    // the watchdog fires a stalled processor's timers once per sample.
    constexpr int kDue = 10 * static_cast<int>(TimerQueue::kFireBatch) + 3;
    std::vector<std::unique_ptr<Timer>> t;
    for (int i = 0; i < kDue + 5; ++i) t.push_back(std::make_unique<Timer>(i < kDue ? 100 + i % 7 : 500));
    for (auto& x : t) q.add(&x->e);
    CHECK(q.fire_expired(200) == static_cast<std::size_t>(kDue));
    for (int i = 0; i < kDue + 5; ++i) {
      CAPTURE(i);
      CHECK(t[i]->fired() == (i < kDue));
    }
    CHECK(q.size() == 5);
    CHECK(q.next_deadline() == 500);
  });
}

TEST_CASE("TimerQueue: a removed entry never fires; next_deadline follows the head") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    auto t = make_timers({10, 20, 30});
    for (auto& x : t) q.add(&x->e);
    q.remove(&t[0]->e);
    CHECK(q.next_deadline() == 20);
    q.remove(&t[0]->e);  // twice: a no-op
    CHECK(q.size() == 2);
    CHECK(q.fire_expired(25) == 1);
    CHECK_FALSE(t[0]->fired());
    CHECK(t[1]->fired());
    q.remove(&t[1]->e);  // already fired: a no-op
    CHECK(q.size() == 1);
    q.remove(&t[2]->e);
    CHECK(q.next_deadline() == TimerQueue::kNone);
    CHECK(q.fire_expired(1000) == 0);
    CHECK_FALSE(t[2]->fired());
  });
}

TEST_CASE("TimerQueue: a drained burst gives its storage back; a small heap keeps its own") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    // One entry more than an empty heap keeps room for: the storage grew past the bound.
    constexpr std::size_t kBurst = TimerQueue::kKeptCapacity + 1;
    auto t = make_timers(kBurst, 100, 1);

    // Fired: storage stays while one entry is left, goes with the last.
    for (auto& x : t) q.add(&x->e);
    REQUIRE(q.capacity() > TimerQueue::kKeptCapacity);
    CHECK(q.fire_expired(100 + static_cast<int64_t>(kBurst) - 2) == kBurst - 1);
    CHECK(q.capacity() >= kBurst);
    CHECK(q.fire_expired(1'000'000'000) == 1);
    CHECK(q.size() == 0);
    CHECK(q.capacity() == 0);
    CHECK(q.next_deadline() == TimerQueue::kNone);

    // Removed (waits that ended another way): the same once the last one leaves.
    t = make_timers(kBurst, 100, 0);
    for (auto& x : t) q.add(&x->e);
    for (std::size_t i = 0; i + 1 < kBurst; ++i) q.remove(&t[i]->e);
    CHECK(q.capacity() >= kBurst);
    q.remove(&t.back()->e);
    CHECK(q.capacity() == 0);

    // The heap works on from nothing, and one that stayed within the bound (half of it: room
    // for at most twice that, a vector growing by doubling or less) keeps its storage when drained.
    constexpr std::size_t kSmall = TimerQueue::kKeptCapacity / 2;
    t = make_timers(kSmall, 50, 1);
    for (auto& x : t) q.add(&x->e);
    CHECK(q.next_deadline() == 50);
    const std::size_t kept = q.capacity();
    REQUIRE(kept <= TimerQueue::kKeptCapacity);
    CHECK(q.fire_expired(1'000'000'000) == kSmall);
    for (auto& x : t) CHECK(x->fired());
    CHECK(q.capacity() == kept);
  });
}

TEST_CASE("TimerQueue: randomised adds, removes and fires agree with a sorted model") {
  fiber_test::run_on_thread([] {
    TimerQueue q;
    std::vector<std::unique_ptr<Timer>> all;
    std::vector<std::pair<int64_t, std::size_t>> model;  // (deadline, add order) still queued
    uint32_t rng = 2463534242u;
    auto next = [&rng] {
      rng ^= rng << 13;
      rng ^= rng >> 17;
      rng ^= rng << 5;
      return rng;
    };
    int64_t now = 0;
    // Few distinct deadlines and rare fires, so many entries tie and a call often has more due
    // than one batch: ties cut at the batch's edge are where insertion order shows.
    std::size_t capped_ties = 0;
    for (int step = 0; step < 20'000; ++step) {
      const uint32_t r = next() % 16;
      if (r < 10) {
        all.push_back(std::make_unique<Timer>(now + 1 + static_cast<int64_t>(next() % 8)));
        q.add(&all.back()->e);
        model.emplace_back(all.back()->e.deadline_ns, all.size() - 1);
      } else if (r < 14 && !model.empty()) {
        const std::size_t k = next() % model.size();
        q.remove(&all[model[k].second]->e);
        model.erase(model.begin() + static_cast<std::ptrdiff_t>(k));
      } else if (r >= 14) {
        now += static_cast<int64_t>(next() % 6);
        std::sort(model.begin(), model.end());
        std::size_t due = 0;
        while (due < model.size() && model[due].first <= now) ++due;
        // Unlimited, or a limit below, at or above one internal batch.
        const std::size_t max = next() % 4 == 0 ? SIZE_MAX : 1 + next() % (2 * TimerQueue::kFireBatch);
        const std::size_t expect = std::min(due, max);
        if (due > expect && expect > 0 && model[expect - 1].first == model[expect].first) ++capped_ties;
        REQUIRE(q.fire_expired(now, max) == expect);
        for (std::size_t i = 0; i < model.size(); ++i) {
          REQUIRE(all[model[i].second]->fired() == (i < expect));
        }
        model.erase(model.begin(), model.begin() + static_cast<std::ptrdiff_t>(expect));
      }
      REQUIRE(q.size() == model.size());
      REQUIRE(q.next_deadline() == (model.empty() ? TimerQueue::kNone
                                                  : std::min_element(model.begin(), model.end())->first));
    }
    MESSAGE(capped_ties << " fires cut a tie at the batch's edge");
    CHECK(capped_ties > 0);  // the case that shows insertion order was reached
  });
}
