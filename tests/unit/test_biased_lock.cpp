// Tests for BiasedLock (fiber/detail/wait.hpp): the channel lock that the thread taking it again
// and again takes with plain loads and stores, until another thread revokes that for good.
//
//   1. When it biases: kBiasAfter locks in a row by one thread, not one fewer; never while
//      threads alternate; never again once revoked.
//   2. Stress: a lock biased to one thread, then taken by it and by others at once, many times
//      over (a fresh lock each round, so every round races a revocation against the owner's plain
//      sections): no two critical sections overlap and no increment is lost, counted.
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

TEST_CASE("BiasedLock: stress, the owner's plain sections against revoking threads, counted") {
  const int rounds = fiber_test::kSanitized ? 40 : 300;
  const int threads = 3;
  const int per_thread = fiber_test::kSanitized ? 300 : 3000;
  const bool can_bias = fiber::detail::membarrier_available();
  int biased_rounds = 0;
  for (int round = 0; round < rounds; ++round) {
    BiasedLock l;
    long counter = 0;           // guarded by l; updated with a gap so overlaps lose updates
    std::atomic<int> inside{0};  // sections in progress: more than one is an overlap
    std::atomic<int> overlaps{0};
    auto section = [&] {
      l.lock();
      if (inside.fetch_add(1, std::memory_order_relaxed) != 0) overlaps.fetch_add(1, std::memory_order_relaxed);
      const long v = counter;
      for (int k = 0; k < 8; ++k) __builtin_ia32_pause();
      counter = v + 1;
      inside.fetch_sub(1, std::memory_order_relaxed);
      l.unlock();
    };
    std::atomic<bool> start{false};
    std::thread owner([&] {
      for (uint32_t i = 0; i < BiasedLock::kBiasAfter; ++i) section();
      start.store(true, std::memory_order_release);
      for (int i = 0; i < per_thread; ++i) section();
    });
    std::vector<std::thread> others;
    for (int t = 0; t < threads - 1; ++t) {
      others.emplace_back([&] {
        while (!start.load(std::memory_order_acquire)) std::this_thread::yield();
        for (int i = 0; i < per_thread; ++i) section();
      });
    }
    // Biased as the others start (unless it could not be), revoked once they have all run.
    owner.join();
    for (auto& t : others) t.join();
    REQUIRE(overlaps.load() == 0);
    REQUIRE(counter == static_cast<long>(BiasedLock::kBiasAfter) + static_cast<long>(threads) * per_thread);
    if (l.revoked()) ++biased_rounds;
  }
  // Every round biased the lock to its owner (the others start only then) and revoked it.
  if (can_bias) CHECK(biased_rounds == rounds);
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
