// hook-bench: the cost of the hook's fast path. Linked with libfiber_hook.a.
//
//   hook-bench [N]
//
// In one fiber, N times: write 64 bytes to one end of a socketpair, read them from the other.
// Both calls find the socket ready, so this is the path every hooked call takes when it does
// not need to wait: the hook's checks plus the system call. The same loop through syscall(2),
// which no hook sees, is the baseline. Prints impl=libfiber (hooked) and impl=raw lines.
#include <fiber/fiber.hpp>

#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {
using Clock = std::chrono::steady_clock;

double run(bool hooked, int a, int b, long n) {
  char out[64] = {1}, in[64];
  const auto t0 = Clock::now();
  for (long i = 0; i < n; ++i) {
    if (hooked) {
      if (write(a, out, sizeof out) != 64 || read(b, in, sizeof in) != 64) std::abort();
    } else {
      if (syscall(SYS_write, a, out, sizeof out) != 64 || syscall(SYS_read, b, in, sizeof in) != 64) std::abort();
    }
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / static_cast<double>(n);
}
}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 1'000'000;
  if (n <= 0) return 2;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
  // No watchdog: the fiber never switches (every call finds its socket ready), on purpose.
  fiber::Scheduler s({.processors = 1, .name = "bench", .watchdog = {.enabled = false}});
  double hooked = 0, raw = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    run(true, sv[0], sv[1], n / 10);  // warm up: the hook learns the descriptors
    run(false, sv[0], sv[1], n / 10);
    // Interleave halves so drift hits both sides alike.
    for (int half = 0; half < 2; ++half) {
      hooked += run(true, sv[0], sv[1], n / 2) / 2;
      raw += run(false, sv[0], sv[1], n / 2) / 2;
    }
  });
  std::printf("workload=hook_rw impl=libfiber value=%.1f unit=ns/write+read extra=ratio=%.3f,n=%ld\n", hooked, hooked / raw, n);
  std::printf("workload=hook_rw impl=raw value=%.1f unit=ns/write+read extra=n=%ld\n", raw, n);
  return 0;
}
