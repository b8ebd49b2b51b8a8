// Tests for BiasedLock (fiber/detail/wait.hpp): the channel lock that the thread taking it again
// and again takes with plain loads and stores, until another thread revokes that for good.
//
//   1. When it biases: kBiasAfter locks in a row by one thread, not one fewer; never while
//      threads alternate; never again once revoked (two cases).
//   2. Stress: locks biased to one thread, then taken by it and by others at once, with a
//      revocation on each lock racing the owner's plain sections: no two critical sections
//      overlap and no increment is lost, counted. Then the same with membarrier(2) refused at
//      revocation (a test hook), which takes the fallback's path.
//   3. Through a channel: one biased to the processor that used it alone, then fed and drained by
//      plain threads and by fibers of two schedulers at once: every value arrives exactly once.
//
// Where membarrier(2) is not offered nothing biases, and the tests say so rather than pass on
// a plain SpinLock unnoticed: the bias checks are skipped, the stress still runs.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "sched/membarrier.hpp"
#include "test_util.hpp"

namespace {

using fiber::detail::BiasedLock;

void lock_times(BiasedLock& l, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    l.lock();
    l.unlock();
  }
}

// Runs `fn` on a new thread and waits for it.
template <typename Fn>
void on_other_thread(Fn fn) {
  std::thread t(fn);
  t.join();
}

}  // namespace

TEST_CASE("BiasedLock: biased after kBiasAfter locks in a row by one thread, revoked by another for good") {
  if (!fiber::detail::membarrier_available()) {
    MESSAGE("membarrier(2) unavailable here: BiasedLock never biases, bias checks skipped");
    return;
  }
  BiasedLock l;
  CHECK_FALSE(l.biased());
  lock_times(l, BiasedLock::kBiasAfter - 1);
  CHECK_FALSE(l.biased());
  lock_times(l, 1);
  CHECK(l.biased());
  CHECK_FALSE(l.revoked());
  lock_times(l, 1000);  // the owner's plain path
  CHECK(l.biased());
  on_other_thread([&] { lock_times(l, 1); });
  CHECK(l.revoked());
  CHECK_FALSE(l.biased());
  // Never biased again, to either thread.
  lock_times(l, 1000);
  on_other_thread([&] { lock_times(l, 1000); });
  CHECK(l.revoked());
  CHECK_FALSE(l.biased());
}

TEST_CASE("BiasedLock: a streak broken by another thread starts over") {
  if (!fiber::detail::membarrier_available()) {
    MESSAGE("membarrier(2) unavailable here: bias checks skipped");
    return;
  }
  BiasedLock l;
  for (int round = 0; round < 10; ++round) {
    lock_times(l, BiasedLock::kBiasAfter - 1);
    on_other_thread([&] { lock_times(l, 1); });
  }
  CHECK_FALSE(l.biased());
  CHECK_FALSE(l.revoked());
  // The other thread's one lock was a streak of its own, ended by ours: ours starts afresh.
  lock_times(l, BiasedLock::kBiasAfter);
  CHECK(l.biased());
}

namespace {

// kLocks locks in turn: the owner thread biases one (kBiasAfter sections), then it and two other
// threads, released together, take it `passes` times each, so the others' first sections (one
// revokes) race the owner's plain ones. Every critical section checks it is alone and
// increments the lock's counter with a gap (a read, a pause, a write), so overlapping sections
// both fail the check and lose an increment. Returns how many locks were biased and then
// revoked (all of them where membarrier works).
int stress_revocations(int rounds, int passes) {
  constexpr int kLocks = 32;
  constexpr int kThreads = 3;
  // The gap: about a microsecond, as long as a revocation's membarrier, so that a revoker that
  // did not wait for the owner would find it still inside.
  constexpr int kGap = 64;
  int revoked = 0;
  for (int round = 0; round < rounds; ++round) {
    struct Guarded {
      BiasedLock lock;
      long counter = 0;           // guarded by lock
      std::atomic<int> inside{0};  // sections in progress
    };
    std::vector<Guarded> g(kLocks);
    std::atomic<int> overlaps{0};
    auto section = [&](Guarded& x) {
      x.lock.lock();
      if (x.inside.fetch_add(1, std::memory_order_relaxed) != 0) overlaps.fetch_add(1, std::memory_order_relaxed);
      const long v = x.counter;
      for (int k = 0; k < kGap; ++k) __builtin_ia32_pause();
      x.counter = v + 1;
      x.inside.fetch_sub(1, std::memory_order_relaxed);
      x.lock.unlock();
    };
    fiber_test::SpinBarrier barrier(kThreads);
    auto run = [&](bool is_owner) {
      for (auto& x : g) {
        if (is_owner) {
          for (uint32_t i = 0; i < BiasedLock::kBiasAfter; ++i) section(x);
        }
        barrier.arrive_and_wait();
        for (int p = 0; p < passes; ++p) section(x);
      }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(run, t == 0);
    for (auto& t : threads) t.join();
    REQUIRE(overlaps.load() == 0);
    for (auto& x : g) {
      REQUIRE(x.counter == static_cast<long>(BiasedLock::kBiasAfter) + static_cast<long>(kThreads) * passes);
      if (x.lock.revoked()) ++revoked;
    }
  }
  return revoked;
}

}  // namespace

TEST_CASE("BiasedLock: stress: the owner's plain sections against revoking threads (counted)") {
  const int rounds = fiber_test::kSanitized ? 20 : 150;
  const int revoked = stress_revocations(rounds, fiber_test::kSanitized ? 20 : 60);
  // Every lock was biased to its owner (the others start only then) and revoked.
  if (fiber::detail::membarrier_available()) CHECK(revoked == rounds * 32);
}

TEST_CASE("BiasedLock: stress: membarrier refused at revocation (counted)") {
  // A revocation that finds membarrier(2) refused (a seccomp filter installed after the process
  // registered) waits out the owner's store buffer instead, and still excludes it.
  fiber::detail::refuse_revoke_fences.store(1);
  const int rounds = fiber_test::kSanitized ? 3 : 10;
  const int revoked = stress_revocations(rounds, 20);
  fiber::detail::refuse_revoke_fences.store(0);
  if (fiber::detail::membarrier_available()) CHECK(revoked == rounds * 32);
}

TEST_CASE("BiasedLock: a channel biased to one processor, then used by threads and two schedulers at once") {
  for (const std::size_t procs : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    CAPTURE(procs);
    fiber::Scheduler a({.processors = procs, .name = "bias-a"});
    fiber::Scheduler b({.processors = 2, .name = "bias-b"});
    fiber::Channel<long> ch(16);
    // Alone first: one fiber sends and receives through it until its lock is biased to the
    // thread that fiber runs on.
    fiber::block_on({.scheduler = &a}, [&] {
      for (long i = 0; i < 1000; ++i) {
        ch.send(i);
        REQUIRE(*ch.recv() == i);
      }
    });
    if (fiber::detail::membarrier_available()) CHECK(fiber::detail::ChanAccess::base(ch).lock_is_biased());
    // Then everyone: producers on both schedulers and a plain thread, consumers likewise.
    const long per = fiber_test::kSanitized ? 2000 : 20000;
    constexpr int kProducers = 3;
    std::atomic<long> sum{0}, count{0};
    auto produce = [&](long base) {
      for (long i = 0; i < per; ++i) ch.send(base + i);
    };
    auto consume = [&] {
      while (std::optional<long> v = ch.recv()) {
        sum.fetch_add(*v, std::memory_order_relaxed);
        count.fetch_add(1, std::memory_order_relaxed);
      }
    };
    fiber::WaitGroup consumers;
    consumers.add(3);
    std::thread plain_consumer([&] {
      consume();
      consumers.done();
    });
    fiber::spawn({.scheduler = &a}, [&] { consume(); consumers.done(); }).detach();
    fiber::spawn({.scheduler = &b}, [&] { consume(); consumers.done(); }).detach();
    fiber::WaitGroup producers;
    producers.add(kProducers);
    std::thread plain_producer([&] {
      produce(0);
      producers.done();
    });
    fiber::spawn({.scheduler = &a}, [&] { produce(per); producers.done(); }).detach();
    fiber::spawn({.scheduler = &b}, [&] { produce(2 * per); producers.done(); }).detach();
    producers.wait();
    ch.close();
    consumers.wait();
    plain_producer.join();
    plain_consumer.join();
    const long n = kProducers * per;
    CHECK(count.load() == n);
    CHECK(sum.load() == n * (n - 1) / 2);
    if (fiber::detail::membarrier_available()) CHECK(fiber::detail::ChanAccess::base(ch).lock_was_revoked());
  }
}
