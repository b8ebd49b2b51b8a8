// The doctest entry point for fiber_tests. Every test source in unit/ and stress/ links into one
// binary; `fiber_tests --test-case='*queue*'` runs a subset.
//
// FIBER_TESTS_NEED_SPIN=1 (ctest's fiber_tests_spin_*, which also set FIBER_SPIN_US) runs the
// suite only where processors can spin before they sleep: with the epoll engine, or a ring
// without IORING_SETUP_TASKRUN_FLAG, Scheduler::spin_before_sleep() is 0 and the run would
// repeat plain fiber_tests. It then exits 77, which ctest reports as skipped.
#include <doctest/doctest.h>

#include <fiber/scheduler.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

bool spin_unavailable() {
  const char* need = std::getenv("FIBER_TESTS_NEED_SPIN");
  if (need == nullptr || std::strcmp(need, "1") != 0) return false;
  fiber::Scheduler probe({.processors = 1, .name = "spin-probe"});
  if (probe.spin_before_sleep().count() != 0) return false;
  std::fputs("fiber_tests: FIBER_TESTS_NEED_SPIN=1, but processors do not spin here (FIBER_SPIN_US unset or 0, "
             "or an engine that cannot poll cheaply): skipped\n",
             stderr);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (spin_unavailable()) return 77;
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
