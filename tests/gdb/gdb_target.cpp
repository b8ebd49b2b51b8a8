// The program tests/gdb/check.sh inspects with gdb and tools/gdb/libfiber.py.
//
// On a scheduler named "gdbtest" (2 processors, no watchdog) it leaves:
//   alpha-waiter   parked on a Channel recv, inside park_here_alpha()
//   beta-sleeper   parked in this_fiber::sleep_for(1h), inside sleep_in_beta()
//   (unnamed)      parked joining alpha-waiter, inside join_in_gamma()
//   delta-runner   running: it holds its processor in a blocking usleep loop (spin_in_delta())
//   (unnamed)      spawned by delta-runner, queued behind it: never run
// then prints "NAME=ID" for each, then "ready", and waits to be killed (it exits by itself
// after 120 s, so an interrupted test leaves nothing behind).
#include <fiber/fiber.hpp>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>

namespace {

std::atomic<unsigned long long> g_alpha{0}, g_beta{0}, g_gamma{0}, g_delta{0};
std::atomic<bool> g_delta_go{true};

// Called, not inlined, from park_here_alpha: so that frame's pc is a call made outside any
// inlined function, which below_inline.py needs (the library's own parking frames have their
// switch inline).
__attribute__((noinline)) std::optional<int> recv_in_alpha(fiber::Channel<int>& ch) {
  auto v = ch.recv();  // nobody sends
  asm volatile("" ::: "memory");
  return v;
}

__attribute__((noinline)) void park_here_alpha(fiber::Channel<int>& ch) {
  g_alpha = fiber::this_fiber::id();
  auto v = recv_in_alpha(ch);
  asm volatile("" ::: "memory");
  std::printf("alpha got %d\n", v ? *v : -1);
}

__attribute__((noinline)) void sleep_in_beta() {
  g_beta = fiber::this_fiber::id();
  fiber::this_fiber::sleep_for(std::chrono::hours(1));
  asm volatile("" ::: "memory");
}

__attribute__((noinline)) void join_in_gamma(fiber::JoinHandle<void>& alpha) {
  g_gamma = fiber::this_fiber::id();
  alpha.join();
  asm volatile("" ::: "memory");
}

__attribute__((noinline)) void spin_in_delta() {
  // Spawned here, it waits in this processor's LIFO slot (which nobody steals from) while delta
  // holds the processor: alive, never run - counted by `info fibers`, not listed.
  go[] {};
  g_delta = fiber::this_fiber::id();
  while (g_delta_go.load()) ::usleep(20'000);  // blocks the processor thread, stays "running"
  asm volatile("" ::: "memory");
}

// Counts "parked" lines in fiber::dump's output.
int parked_fibers() {
  std::ostringstream out;
  fiber::dump(out);
  const std::string s = out.str();
  int n = 0;
  for (std::size_t pos = 0; (pos = s.find(" parked on ", pos)) != std::string::npos; ++pos) ++n;
  return n;
}

}  // namespace

int main() {
  ::alarm(120);  // never outlive a broken test run
#if defined(PR_SET_PTRACER)
  ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // Yama ptrace_scope 1: let gdb attach
#endif
  fiber::Scheduler::Options opts;
  opts.processors = 2;
  opts.name = "gdbtest";
  opts.watchdog.enabled = false;
  fiber::Scheduler sched(opts);
  fiber::Channel<int> ch(0);

  fiber::JoinHandle<void> alpha =
      fiber::spawn({.scheduler = &sched, .name = "alpha-waiter"}, [&ch] { park_here_alpha(ch); });
  fiber::spawn({.scheduler = &sched, .name = "beta-sleeper"}, [] { sleep_in_beta(); }).detach();
  fiber::spawn({.scheduler = &sched}, [&alpha] { join_in_gamma(alpha); }).detach();

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (parked_fibers() < 3) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "gdb_target: the fibers did not park\n");
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  fiber::spawn({.scheduler = &sched, .name = "delta-runner"}, [] { spin_in_delta(); }).detach();
  while (g_delta.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));

  std::printf("alpha-waiter=%llu\nbeta-sleeper=%llu\ngamma=%llu\ndelta-runner=%llu\nready\n", g_alpha.load(),
              g_beta.load(), g_gamma.load(), g_delta.load());
  std::fflush(stdout);
  for (;;) ::pause();
}
