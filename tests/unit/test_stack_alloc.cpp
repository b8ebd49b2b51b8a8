// The stack allocator when the kernel refuses memory: the spawn's join reports a ResourceError,
// and the allocator's books (stacks in use, guarded and not, and its mappings) stay right. The
// refusal comes from a lowered RLIMIT_AS, in a child process: this test binary, running only the
// skipped case below.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <cstdio>

#include "context/stack.hpp"        // StackAllocator: allocate() and stats() directly
#include "integration/process.hpp"  // run_test_case, AddressSpaceLimit
#include "test_util.hpp"

namespace {

using namespace fiber_test;
namespace fd = fiber::detail;

constexpr const char* kNoMemoryChild = "stacks: (child process) the allocator with the address space used up";

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
