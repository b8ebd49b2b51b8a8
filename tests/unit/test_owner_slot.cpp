// Tests for OwnerSlot (sched/owner_slot.hpp): the one-fiber slot whose owner uses plain loads
// and stores while a thief may take the fiber through the membarrier protocol.
//
//   1. Single-threaded: put, exchange, take, occupancy, steal from an idle owner.
//   2. Stress: an owner putting, exchanging and taking as fast as it can, a thief stealing as
//      fast as it can;
//      every value put comes out exactly once (no loss, no duplicate), counted.
//
// The slot never dereferences what it holds, so the values are distinct fake Fiber pointers.
#include "sched/owner_slot.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace {

using fiber::detail::Fiber;
using fiber::detail::OwnerSlot;

Fiber* fake(uint64_t id) { return reinterpret_cast<Fiber*>(static_cast<uintptr_t>(id) << 4); }
uint64_t id_of(Fiber* f) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f) >> 4); }

}  // namespace

TEST_CASE("OwnerSlot: put, take, occupancy and a steal, on one thread") {
  OwnerSlot slot;
  CHECK_FALSE(slot.occupied());
  CHECK_FALSE(slot.occupied_for_owner());
  CHECK(slot.take() == nullptr);
  CHECK(slot.steal() == nullptr);
  slot.put(fake(1));
  CHECK(slot.occupied());
  CHECK(slot.occupied_for_owner());
  CHECK(slot.take() == fake(1));
  CHECK(slot.take() == nullptr);
  slot.put(fake(2));
  CHECK(slot.steal() == fake(2));
  CHECK_FALSE(slot.occupied());
  // After a steal the owner's plain path works again.
  slot.put(fake(3));
  CHECK(slot.take() == fake(3));
  CHECK(slot.steal() == nullptr);
  // exchange: puts whether or not the slot is empty, and hands back what it held.
  CHECK(slot.exchange(fake(4)) == nullptr);
  CHECK(slot.exchange(fake(5)) == fake(4));
  CHECK(slot.occupied_for_owner());
  CHECK(slot.steal() == fake(5));
  CHECK(slot.exchange(fake(6)) == nullptr);
  CHECK(slot.take() == fake(6));
}

TEST_CASE("OwnerSlot: stress, one owner and one thief, every value comes out exactly once") {
  const uint64_t n = fiber_test::kSanitized ? 200'000 : 2'000'000;
  OwnerSlot slot;
  std::atomic<bool> done{false};
  std::atomic<uint64_t> steals{0};
  std::vector<uint64_t> stolen;
  std::thread thief([&] {
    while (!done.load(std::memory_order_acquire)) {
      if (Fiber* f = slot.steal()) {
        stolen.push_back(id_of(f));
        steals.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
  std::vector<uint64_t> taken;
  taken.reserve(n);
  uint64_t next = 1;
  uint32_t rng = 12345;
  auto step = [&] {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    if (rng & 2) {
      // As schedule_local does: the new fiber goes in, the one it displaces is ours.
      if (Fiber* prev = slot.exchange(fake(next++))) taken.push_back(id_of(prev));
    } else if (!slot.occupied_for_owner()) {
      slot.put(fake(next++));
    }
    if (rng & 1) {
      if (Fiber* f = slot.take()) taken.push_back(id_of(f));
    }
  };
  while (next <= n) step();
  // On a loaded machine the thief may not have run yet: go on until the race has happened.
  const auto deadline = fiber_test::Clock::now() + fiber_test::scaled(std::chrono::milliseconds(20'000));
  while (steals.load(std::memory_order_relaxed) == 0 && fiber_test::Clock::now() < deadline) {
    for (int i = 0; i < 1000; ++i) step();
  }
  done.store(true, std::memory_order_release);
  thief.join();
  if (Fiber* f = slot.take()) taken.push_back(id_of(f));

  const uint64_t put = next - 1;
  std::vector<uint8_t> seen(put + 1, 0);
  uint64_t out_of_range = 0, duplicates = 0;
  for (const auto* v : {&taken, &stolen}) {
    for (uint64_t id : *v) {
      if (id == 0 || id > put) {
        ++out_of_range;
      } else if (seen[id]++ != 0) {
        ++duplicates;
      }
    }
  }
  uint64_t missing = 0;
  for (uint64_t id = 1; id <= put; ++id) missing += seen[id] == 0;
  MESSAGE("owner took " << taken.size() << ", thief stole " << stolen.size());
  CHECK(out_of_range == 0);
  CHECK(duplicates == 0);
  CHECK(missing == 0);
  CHECK(stolen.size() > 0);  // the race was exercised
}
