// See membarrier.hpp.
#include "sched/membarrier.hpp"

#include "fiber/detail/wait.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#if __has_include(<linux/membarrier.h>)
#include <linux/membarrier.h>
#define FIBER_HAVE_MEMBARRIER 1  // its commands are enumerators, not macros: test the header
#endif

namespace fiber::detail {

#if defined(SYS_membarrier) && defined(FIBER_HAVE_MEMBARRIER)
bool membarrier_available() noexcept {
  static const bool ok = [] {
    const long cmds = ::syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    if (cmds < 0 || (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
    return ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  }();
  return ok;
}
bool membarrier_heavy() noexcept { return ::syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0; }
#else
bool membarrier_available() noexcept { return false; }
bool membarrier_heavy() noexcept { return false; }
#endif

bool membarrier_heavy_retrying() noexcept {
  if (membarrier_heavy()) return true;
  spin_wait_begin();  // the yields below are the runtime's, not the current fiber's (see monitor.cpp)
  bool done = false;
  for (int i = 1; i < 64 && !done; ++i) {
    std::this_thread::yield();
    done = membarrier_heavy();
  }
  spin_wait_end();
  return done;
}

void full_fence() noexcept {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wtsan"  // TSan ignores fences; the protocols' acquire/release is what it checks
#endif
  std::atomic_thread_fence(std::memory_order_seq_cst);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
}

}  // namespace fiber::detail
