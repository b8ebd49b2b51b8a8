// Functions about the calling fiber. Each says what it does when called from a plain thread.
#pragma once

#include <chrono>
#include <string_view>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber::this_fiber {

// Lets other runnable fibers run; the caller continues later on some processor. From a plain
// thread: std::this_thread::yield(). In a cancelled fiber: throws fiber::Cancelled.
FIBER_API void yield();

// The calling fiber's id (unique in the process, never 0); 0 from a plain thread.
FIBER_API unsigned long long id() noexcept;

// True when called from a fiber.
FIBER_API bool in_fiber() noexcept;
// True once the calling fiber has been cancelled (JoinHandle::cancel, a CancelToken, stop()):
// its blocking calls throw fiber::Cancelled or fail with ECANCELED from then on. A loop that
// retries an interrupted call can ask this to stop. False from a plain thread.
FIBER_API bool cancelled() noexcept;

// The calling fiber's name ("" if unnamed). Throws UsageError from a plain thread.
FIBER_API std::string_view name();

// Index of the processor running the caller within its scheduler. Throws UsageError from a
// plain thread. May change across any blocking call unless the fiber is pinned.
FIBER_API unsigned processor_index();

// Parks the fiber until `deadline` (blocks the thread when called from one). A deadline in the
// past returns at once (after a yield, in a fiber). Throws fiber::Cancelled if cancelled.
FIBER_API void sleep_until(std::chrono::steady_clock::time_point deadline);

// Sleeps for `d`; a d of 100 years or more (hours::max(), say) sleeps until cancelled.
template <typename Rep, typename Period>
void sleep_for(std::chrono::duration<Rep, Period> d) {
  sleep_until(detail::deadline_after(d));
}

// Pins the calling fiber to the processor it runs on for the guard's lifetime: it is resumed
// only there, so thread_local variables keep their meaning across blocking calls. Use it around
// code that caches thread-local state (see libfiber/README.md, "Migration"). Nests, up to 65280
// deep. Throws UsageError from a plain thread, or nested deeper than that.
class FIBER_API PinGuard {
 public:
  PinGuard();
  ~PinGuard();
  PinGuard(const PinGuard&) = delete;
  PinGuard& operator=(const PinGuard&) = delete;
};

}  // namespace fiber::this_fiber
