// The stack allocator when the kernel refuses memory: the spawn's join reports a ResourceError,
// and the allocator's books (stacks in use, guarded and not, and its mappings) stay right. The
// refusal comes from a lowered RLIMIT_AS, in a child process: this test binary, running only the
// skipped case below.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <thread>
#include <vector>

#include "context/stack.hpp"        // StackAllocator: allocate() and stats() directly
#include "integration/process.hpp"  // run_test_case, AddressSpaceLimit
#include "test_util.hpp"

namespace {

using namespace fiber_test;
namespace fd = fiber::detail;

constexpr const char* kNoMemoryChild = "stacks: (child process) the allocator with the address space used up";
constexpr const char* kMakeRoomChild = "stacks: (child process) idle guarded stacks of one size give way to another size";

}  // namespace

// FIBER_GUARDED_STACKS=0 (set by the parent): no stack is guarded, each is carved from a shared
// chunk of 64 MiB. With the address space nearly used up, a chunk cannot be mapped; a stack of
// its own, with a guard page, could be, but the guarded budget is spent (it is zero), so the
// allocator must refuse rather than hand one out uncounted.
TEST_CASE("stacks: (child process) the allocator with the address space used up" * doctest::skip()) {
  auto& alloc = fd::StackAllocator::instance();
  REQUIRE(alloc.stats().guarded_limit == 0);
  fiber::Scheduler s({.processors = 1, .name = "nomem"});
  fiber::spawn({.scheduler = &s}, [] {}).join();  // the scheduler's own first allocations, done
  // A size class nothing here has used: its first stack needs a fresh chunk.
  const std::size_t cls = fd::stack_size_class(std::size_t{1} << 20);
  const fd::StackStats before = alloc.stats();
  for (const std::size_t room : {std::size_t{512} << 10, std::size_t{16} << 20}) {
    // 512 KiB: neither a chunk nor a 1 MiB stack of its own fits (the room is for the sanitizer
    // runtimes' own small mappings); 16 MiB: a stack of its own would fit, a chunk still not.
    CAPTURE(room);
    AddressSpaceLimit limit(mapped_bytes() + room);
    CHECK_THROWS_AS(alloc.allocate(cls), fiber::ResourceError);
    // A fiber that needs such a stack ends before it runs; its join says why.
    auto h = fiber::spawn({.stack_size = cls, .scheduler = &s}, [] {});
    CHECK_THROWS_WITH_AS(h.join(), doctest::Contains("cannot allocate"), fiber::ResourceError);
  }
  const fd::StackStats after = alloc.stats();
  CHECK(after.guarded_live == before.guarded_live);
  CHECK(after.unguarded_live == before.unguarded_live);
  CHECK(after.mappings == before.mappings);
  // With the address space back, the same size is had, from a chunk.
  const fd::Stack st = alloc.allocate(cls);
  CHECK(st.kind == fd::StackKind::Unguarded);
  alloc.release(st);
  fiber::spawn({.stack_size = cls, .scheduler = &s}, [] {}).join();
  std::printf("refused and recovered\n");
  std::fflush(stdout);
}

TEST_CASE("stacks: with the address space used up, spawns fail with ResourceError and the books stay right") {
  const RunResult r = run_test_case(kNoMemoryChild, {"FIBER_GUARDED_STACKS=0"});
  INFO("the child's status " << r.status << "; its stdout:\n" << r.out << "\nits stderr:\n" << r.err);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "refused and recovered"));
}

// FIBER_GUARDED_STACKS=4 (set by the parent; it also keeps guard markers out): four guarded
// stacks of one size, all idle in the pool, once spent the whole budget, so every stack of
// another size was unguarded from then on, for the life of the process.
TEST_CASE(kMakeRoomChild * doctest::skip()) {
  auto& alloc = fd::StackAllocator::instance();
  REQUIRE(alloc.stats().guarded_limit == 4);
  REQUIRE_FALSE(alloc.stats().guard_markers);
  const std::size_t a = fd::stack_size_class(256 * 1024), b = fd::stack_size_class(64 * 1024);
  std::vector<fd::Stack> as;
  for (int i = 0; i < 4; ++i) as.push_back(alloc.allocate(a));
  for (const fd::Stack& s : as) CHECK(s.kind == fd::StackKind::Guarded);
  for (const fd::Stack& s : as) alloc.release(s);
  const fd::StackStats idle = alloc.stats();
  CHECK(idle.guarded_live == 0);
  CHECK(idle.pooled == 4);
  // Each stack of the other size takes the place of an idle one: unmapped, the books even.
  std::vector<fd::Stack> bs;
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    bs.push_back(alloc.allocate(b));
    CHECK(bs.back().kind == fd::StackKind::Guarded);
    reinterpret_cast<volatile char*>(bs.back().top())[-1] = 1;  // mapped and writable
    const fd::StackStats now = alloc.stats();
    CHECK(now.guarded_live == static_cast<std::size_t>(i) + 1);
    CHECK(now.pooled == 3 - static_cast<std::size_t>(i));
    CHECK(now.mappings == idle.mappings);
  }
  // The budget is now spent on stacks in use: the next one is unguarded.
  const fd::Stack fifth = alloc.allocate(b);
  CHECK(fifth.kind == fd::StackKind::Unguarded);
  alloc.release(fifth);
  for (const fd::Stack& s : bs) alloc.release(s);
  // And a size whose stacks are all in the pool takes them back first, unmapping nothing.
  const fd::StackStats before = alloc.stats();
  const fd::Stack again = alloc.allocate(b);
  CHECK(again.kind == fd::StackKind::Guarded);
  CHECK(alloc.stats().mappings == before.mappings);
  alloc.release(again);
  std::printf("guarded stacks made room\n");
  std::fflush(stdout);
}

TEST_CASE("stacks: idle guarded stacks of one size do not keep guard pages from another (FIBER_GUARDED_STACKS=4)") {
  const RunResult r = run_test_case(kMakeRoomChild, {"FIBER_GUARDED_STACKS=4"});
  INFO("the child's status " << r.status << "; its stdout:\n" << r.out << "\nits stderr:\n" << r.err);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "guarded stacks made room"));
}

TEST_CASE("stacks: FIBER_GUARDED_STACKS parsing") {
  using fd::parse_guarded_stacks;
  CHECK_FALSE(parse_guarded_stacks(nullptr).has_value());
  CHECK_FALSE(parse_guarded_stacks("").has_value());
  CHECK(parse_guarded_stacks("0") == std::optional<std::size_t>(0));
  CHECK(parse_guarded_stacks("100") == std::optional<std::size_t>(100));
  for (const char* bad : {"-1", "+4", " 4", "4 ", "abc", "1e3", "99999999999999999999999"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse_guarded_stacks(bad), doctest::Contains("FIBER_GUARDED_STACKS"), fiber::UsageError);
  }
}

// Caches refill in batches (allocate_batch), and where the kernel has guard markers a fresh chunk
// is mapped outside the allocator's lock, so threads that run out at once each map one and the
// spare is kept for later. Whatever the path, every stack handed out is its own, laid out as its
// kind says, counted once, and pooled again when released.
TEST_CASE("stacks: batches taken by threads at once are distinct, laid out as their kind says, and counted") {
  auto& alloc = fd::StackAllocator::instance();
  const std::size_t page = 4096;
  const std::size_t cls = fd::stack_size_class(28 * 1024);  // a size class nothing else uses
  constexpr int kThreads = 4;
  constexpr int kBatches = 150;  // 4 x 150 x 16 stacks: several chunks of at most 1024 stacks
  constexpr std::size_t kBatch = 16;
  const fd::StackStats before = alloc.stats();

  auto take_all = [&] {
    std::vector<std::vector<fd::Stack>> per_thread(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        fd::Stack batch[kBatch];
        for (int i = 0; i < kBatches; ++i) {
          const std::size_t got = alloc.allocate_batch(cls, batch, kBatch);
          per_thread[t].insert(per_thread[t].end(), batch, batch + got);
        }
      });
    }
    for (auto& th : threads) th.join();
    std::vector<fd::Stack> all;
    for (auto& v : per_thread) all.insert(all.end(), v.begin(), v.end());
    return all;
  };

  std::vector<fd::Stack> all = take_all();
  REQUIRE(all.size() >= static_cast<std::size_t>(kThreads * kBatches));  // at least one per call
  std::sort(all.begin(), all.end(), [](const fd::Stack& a, const fd::Stack& b) { return a.lo < b.lo; });
  std::size_t guarded = 0, overlaps = 0, bad = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const fd::Stack& st = all[i];
    if (st.size != cls || st.kind == fd::StackKind::None || st.kind == fd::StackKind::Compact) ++bad;
    guarded += st.kind == fd::StackKind::Guarded;
    // A guarded stack's guard page lies below it, between it and the stack before.
    if (i > 0 && all[i - 1].top() + (st.kind == fd::StackKind::Guarded ? page : 0) > st.lo) ++overlaps;
  }
  CHECK(bad == 0);
  CHECK(overlaps == 0);
  const fd::StackStats taken = alloc.stats();
  if (taken.guard_markers) CHECK(guarded == all.size());
  CHECK(taken.guarded_live - before.guarded_live == guarded);
  CHECK(taken.unguarded_live - before.unguarded_live == all.size() - guarded);
  // The top of a stack is where a fiber starts: each is writable there, and its red zone is clean.
  for (const fd::Stack& st : {all.front(), all[all.size() / 2], all.back()}) {
    reinterpret_cast<volatile char*>(st.top())[-1] = 1;
    CHECK(st.redzone_intact());
  }

  const std::size_t n = all.size();
  alloc.release_batch(all.data(), n);
  const fd::StackStats released = alloc.stats();
  CHECK(released.guarded_live == before.guarded_live);
  CHECK(released.unguarded_live == before.unguarded_live);
  CHECK(released.pooled - before.pooled == n);

  // As many taken again come from the pool: no new mapping.
  all.clear();
  while (all.size() < n) {
    fd::Stack batch[kBatch];
    const std::size_t got = alloc.allocate_batch(cls, batch, std::min(kBatch, n - all.size()));
    all.insert(all.end(), batch, batch + got);
  }
  CHECK(alloc.stats().mappings == released.mappings);
  CHECK(alloc.stats().pooled == released.pooled - n);
  alloc.release_batch(all.data(), all.size());
  CHECK(alloc.stats().pooled == released.pooled);
}
