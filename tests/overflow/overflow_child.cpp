// Overflows a fiber's stack on purpose, for tests/unit/test_overflow.cpp (which runs it as a
// child process and checks how it dies and what it says).
//
//   overflow_child guarded     unbounded recursion in fiber 'deep-diver' (default stack)
//   overflow_child unguarded   16 KiB stack, a little more recursion, then a switch (run with
//                              FIBER_GUARDED_STACKS=0: the red zone check at the switch reports it)
#include <fiber/fiber.hpp>

#include <cstdio>
#include <cstring>

namespace {

__attribute__((noinline)) int dive(volatile char* prev, int depth, int limit) {
  volatile char frame[512];
  frame[0] = static_cast<char>(depth);
  frame[511] = prev ? prev[0] : 0;
  if (limit > 0 && depth >= limit) return frame[0] + frame[511];
  return dive(frame, depth + 1, limit) + frame[3];  // not a tail call
}

}  // namespace

int main(int argc, char** argv) {
  const bool guarded = argc > 1 && std::strcmp(argv[1], "guarded") == 0;
  fiber::Scheduler s({.processors = 1, .name = "overflow"});
  if (guarded) {
    fiber::spawn({.scheduler = &s, .name = "deep-diver"}, [] { return dive(nullptr, 0, 0); }).join();
  } else {
    fiber::spawn({.stack_size = 16 * 1024, .scheduler = &s, .name = "shallow-diver"}, [] {
      const int r = dive(nullptr, 0, 30);  // a little over 16 KiB of frames on a 16 KiB stack
      fiber::this_fiber::yield();           // the switch checks the red zone
      fiber::this_fiber::sleep_for(std::chrono::milliseconds(1));
      return r;
    }).join();
  }
  std::puts("overflow_child: survived (no overflow detected)");
  return 0;
}
