// Tests for claim bias (sched/claim_gate.hpp, sync/waiter_impl.hpp): a fiber whose waits keep
// being claimed on the processor it waits on gets waits that processor claims with a plain load
// and store; every other claimer closes the processor's gate first.
//
//   1. When a wait is biased: after kClaimBiasAfter waits in a row claimed on the processor, not
//      one fewer; a claim from a plain thread ends the streak and doubles the next one; after
//      kMaxClaimRevokes such claims never again. Counted wait by wait, with the gate's closes.
//   2. The protocol, raced head-on: a plain claim on the processor against a claim or a cancel
//      from a plain thread, released together round after round: one winner, no lost cancel bit.
//   3. Stress: every wait biased (the fiber resets its own streak), each a timed receive whose
//      timer (on the processor, plain) races a plain thread's send (through the gate): every value
//      arrives exactly once and in order, at 1, 2 and 4 processors.
//   4. End to end: a cancel from a plain thread (Handle::cancel, through the gate) reaching a
//      fiber whose biased waits the processor keeps claiming, at a random point of its loop:
//      once cancel() has returned, the fiber's next cancellation point throws, and the join
//      reports Cancelled. The window in which a plain store could hide the bit is a few
//      instructions wide, which this rarely hits: the head-on race is test 2's.
//
// Where membarrier(2) is not offered nothing is biased; the tests say so and skip.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "sched/fiber.hpp"
#include "sched/membarrier.hpp"
#include "sched/processor.hpp"
#include "sched/runtime.hpp"
#include "sync/waiter_impl.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;
using fiber::detail::Fiber;
using fiber::detail::WakeWord;

bool bias_possible() {
  if (fiber::detail::membarrier_available()) return true;
  MESSAGE("membarrier(2) unavailable here: waits are never biased, claim-bias checks skipped");
  return false;
}

// The calling fiber's last wait, which has just ended: was it biased, was it claimed locally.
struct LastWait {
  bool biased;
  bool local;
};
LastWait last_wait() {
  const uint64_t w = fiber::detail::current_fiber()->wake_word.load(std::memory_order_acquire);
  return {(w & WakeWord::kBiasBit) != 0, (w & WakeWord::kLocalBit) != 0};
}

// Makes the calling fiber's next wait biased, whatever its history (its own private state).
void force_bias() {
  Fiber* f = fiber::detail::current_fiber();
  f->claim_streak = 0xff;
  f->claim_revokes = 0;
}

}  // namespace

TEST_CASE("claim bias: earned by a streak of local claims, lost to a claim from a thread, given up for good") {
  if (!bias_possible()) return;
  using fiber::detail::kClaimBiasAfter;
  // Waits (1-based) whose value comes from a plain thread: the first, the second and the third
  // biased wait that another thread claims.
  const int b1 = kClaimBiasAfter + 1;             // the first biased wait
  const int r1 = b1 + 5;                          // claimed remotely: the streak starts over
  const int b2 = r1 + 1 + 2 * kClaimBiasAfter;    // biased again after twice the streak
  const int r2 = b2 + 3;
  const int b3 = r2 + 1 + 4 * kClaimBiasAfter;
  const int r3 = b3;                              // its very first biased wait
  const int total = r3 + 8 * kClaimBiasAfter + 50;  // never biased again, not even after 8x
  auto remote = [&](int k) { return k == r1 || k == r2 || k == r3; };

  fiber::Scheduler s({.processors = 1, .name = "bias"});
  fiber::Channel<int> c;
  std::atomic<int> received{0};         // values the receiver has taken
  std::atomic<Fiber*> receiver{nullptr};
  std::vector<LastWait> waits(static_cast<std::size_t>(total) + 1);
  uint64_t closes_before = 0, closes_after = 0;
  int wrong = 0;  // the first wait that received another value

  // The remote sender: for each remote wait, once the receiver is parked in it.
  std::thread t([&] {
    for (int k = 1; k <= total; ++k) {
      if (!remote(k)) continue;
      wait_for([&] { return received.load() == k - 1; }, 10'000ms);
      Fiber* f = receiver.load();
      wait_for([&] { return f->state.load() == fiber::detail::FiberState::Parked; }, 10'000ms);
      c.send(k);
    }
  });
  fiber::block_on({.scheduler = &s}, [&] {
    // The local sender: every other value, each once the receiver waits for it.
    go [&] {
      for (int k = 1; k <= total; ++k) {
        while (received.load() != k - 1) fiber::this_fiber::yield();
        if (remote(k)) continue;
        c.send(k);
        fiber::this_fiber::yield();
      }
    };
    receiver = fiber::detail::current_fiber();
    closes_before = fiber::detail::current_processor()->claim_gate().closes();
    for (int k = 1; k <= total; ++k) {
      const int v = c.recv().value();
      waits[static_cast<std::size_t>(k)] = last_wait();
      if (v != k && wrong == 0) wrong = k;
      received = k;
    }
    closes_after = fiber::detail::current_processor()->claim_gate().closes();
  });
  t.join();
  quiesce(s);

  CHECK(wrong == 0);
  for (int k = 1; k <= total; ++k) {
    const bool biased = (k >= b1 && k <= r1) || (k >= b2 && k <= r2) || (k >= b3 && k <= r3);
    CAPTURE(k);
    CHECK(waits[static_cast<std::size_t>(k)].biased == biased);
    CHECK(waits[static_cast<std::size_t>(k)].local == !remote(k));
  }
  CHECK(closes_after - closes_before == 3);  // one per biased wait claimed by the thread
}

// The protocol itself, on a stand-in for a parked fiber whose wait is biased to processor 0 (only
// its wake word and where it waits are read): round after round, a fiber on that processor
// claims it plainly while a plain thread, released at the same instant, claims it too, or
// cancels it; the plain claim after a random delay across the thread's (membarrier-long) claim.
// Exactly one claim may win, and a cancel that loses to the plain claim must still leave its
// bit. Without the gate (a remote CAS or fetch_or straight on the word) the plain store lands on
// top of the other's write now and then: hundreds of rounds in 100,000.
TEST_CASE("claim bias: a plain claim on the processor raced by a claim or a cancel from a thread, one wins") {
  if (!bias_possible()) return;
  const int rounds = kTsan ? 5'000 : (kSanitized ? 20'000 : 50'000);
  fiber::Scheduler s({.processors = 1, .name = "biasrace", .watchdog = {.enabled = false}});
  std::minstd_rand rng(11);
  for (const bool cancel : {false, true}) {
    CAPTURE(cancel);
    Fiber fake;
    SpinBarrier start(2), end(2);
    std::atomic<bool> other_won{false};
    // How long the thread's claim takes, a running average: its membarrier interrupts the
    // processor's CPU, microseconds in a VM.
    std::atomic<int64_t> other_ns{1000};
    int owner_wins = 0, other_wins = 0, both = 0, lost_bits = 0;
    std::thread t([&] {
      fiber::detail::Waiter w;
      w.fiber = &fake;
      for (int r = 1; r <= rounds; ++r) {
        w.gen = static_cast<uint64_t>(r);
        start.arrive_and_wait();
        const auto t0 = Clock::now();
        other_won.store(cancel ? fiber::detail::fiber_cancel_try_claim(&fake)
                               : fiber::detail::claim_wait(w, fiber::detail::WakeReason::Timeout),
                        std::memory_order_relaxed);
        const int64_t took = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
        other_ns.store((other_ns.load(std::memory_order_relaxed) * 15 + took) / 16, std::memory_order_relaxed);
        end.arrive_and_wait();
      }
    });
    fiber::block_on({.scheduler = &s}, [&] {
      fake.sched = fiber::detail::current_fiber()->sched;
      fake.last_processor.store(static_cast<uint16_t>(fiber::detail::current_processor()->index()));
      fiber::detail::Waiter w;
      w.fiber = &fake;
      for (int r = 1; r <= rounds; ++r) {
        w.gen = static_cast<uint64_t>(r);
        fake.wake_word.store((static_cast<uint64_t>(r) << 8) | WakeWord::kBiasBit |
                                 static_cast<uint64_t>(fiber::detail::WakeReason::Pending),
                             std::memory_order_release);
        start.arrive_and_wait();
        // A jitter across the thread's membarrier, so that the plain claim falls before it,
        // during it, and just as the thread's own write comes after it.
        const int64_t span = 2 * other_ns.load(std::memory_order_relaxed) + 100;
        const auto until = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(rng() % static_cast<uint64_t>(span)));
        while (Clock::now() < until) {
        }
        const bool mine = fiber::detail::claim_wait(w, fiber::detail::WakeReason::Notified);
        end.arrive_and_wait();
        const bool theirs = other_won.load(std::memory_order_relaxed);
        owner_wins += mine ? 1 : 0;
        other_wins += theirs ? 1 : 0;
        both += mine == theirs ? 1 : 0;
        if (cancel && mine && !(fake.wake_word.load() & WakeWord::kCancelBit)) ++lost_bits;
      }
    });
    t.join();
    CHECK_MESSAGE(both == 0, both << " rounds of " << rounds << " had two winners or none");
    CHECK_MESSAGE(lost_bits == 0, lost_bits << " cancels lost their bit to the plain claim");
    CHECK(owner_wins + other_wins == rounds);
    MESSAGE("cancel=" << cancel << ": the processor won " << owner_wins << ", the thread " << other_wins
                       << " (its claim took " << other_ns.load() << " ns)");
  }
}

TEST_CASE("claim bias stress: a processor's timer and a thread's send race for biased waits, no value lost") {
  if (!bias_possible()) return;
  const int n = kTsan ? 2'000 : (kSanitized ? 10'000 : 40'000);
  for (const int procs : {1, 2, 4}) {
    CAPTURE(procs);
    Watchdog dog(120'000ms, "claim bias stress");
    fiber::Scheduler s({.processors = static_cast<std::size_t>(procs), .name = "biasst"});
    fiber::Channel<int> c;
    std::thread t([&] {
      for (int v = 0; v < n; ++v) c.send(v);
    });
    int expected = 0, wrong = 0, timeouts = 0, biased = 0;
    fiber::block_on({.scheduler = &s}, [&] {
      std::minstd_rand rng(procs);
      while (expected < n && wrong == 0) {
        force_bias();
        auto r = c.recv_for(std::chrono::microseconds(rng() % 30));
        biased += last_wait().biased ? 1 : 0;
        if (!r) {
          ++timeouts;
        } else if (*r == expected) {
          ++expected;
        } else {
          ++wrong;
        }
      }
    });
    t.join();
    CHECK_MESSAGE(wrong == 0, "value " << expected << " lost or out of order");
    CHECK(expected == n);
    CHECK(biased > 0);
    MESSAGE("procs=" << procs << ": " << timeouts << " timeouts, " << biased << " biased waits");
    quiesce(s);
  }
}

TEST_CASE("claim bias: a cancel from a thread ends a fiber in biased waits, wherever it is in its loop") {
  if (!bias_possible()) return;
  const int rounds = kTsan ? 200 : (kSanitized ? 1'000 : 5'000);
  fiber::Scheduler s({.processors = 1, .name = "biascx"});
  Watchdog dog(120'000ms, "claim bias cancel");
  std::minstd_rand rng(7);
  int survived = 0, not_cancelled = 0;
  for (int round = 0; round < rounds && survived == 0; ++round) {
    auto c = std::make_shared<fiber::Channel<int>>();
    auto cancel_done = std::make_shared<std::atomic<bool>>(false);
    auto stop = std::make_shared<std::atomic<bool>>(false);
    auto ran_on = std::make_shared<std::atomic<bool>>(false);
    // Waits, each biased, each claimed on the processor by the sender below; once the cancel
    // has returned, a yield (a cancellation point that reads the cancel bit) must throw.
    auto w = fiber::spawn({.scheduler = &s}, [c, cancel_done, ran_on] {
      for (;;) {
        force_bias();
        (void)c->recv();
        if (cancel_done->load(std::memory_order_acquire)) {
          fiber::this_fiber::yield();
          ran_on->store(true);
          return;
        }
      }
    });
    auto l = fiber::spawn({.scheduler = &s}, [c, stop] {
      while (!stop->load(std::memory_order_relaxed)) {
        (void)c->try_send(1);
        fiber::this_fiber::yield();
      }
    });
    const auto delay = std::chrono::nanoseconds(rng() % 20'000);
    const auto until = Clock::now() + delay;
    while (Clock::now() < until) {
    }
    w.cancel();
    cancel_done->store(true, std::memory_order_release);
    bool cancelled = false;
    try {
      w.join();
    } catch (const fiber::Cancelled&) {
      cancelled = true;
    }
    if (ran_on->load()) ++survived;
    if (!cancelled) ++not_cancelled;
    stop->store(true);
    l.join();
  }
  CHECK_MESSAGE(survived == 0, "a fiber ran past a cancellation point after cancel() returned");
  CHECK(not_cancelled == 0);
  quiesce(s);
}
