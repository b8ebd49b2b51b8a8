// Once: runs a function exactly once, however many fibers and threads ask (std::call_once's
// semantics, fiber-aware).
//
//   fiber::Once init;
//   Config* config = nullptr;
//   void use() {
//     init.call([] { config = load_config(); });   // or fiber::call_once(init, f, args...)
//     config->...;                                  // visible: call() synchronises with the run
//   }
//
// Concurrent callers wait (a fiber parks, a thread blocks) until the running call finishes. If
// the function throws, the exception reaches its caller, the Once stays un-done and the next
// caller (or one of the waiters) runs it again. Calling call() on the same Once from inside the
// function throws UsageError instead of deadlocking.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API Once {
 public:
  Once() = default;
  ~Once();  // a waiter still queued is a fatal error
  Once(const Once&) = delete;
  Once& operator=(const Once&) = delete;

  // Runs f(args...) unless a call already completed; waits while another caller runs it.
  // Rethrows what f throws (the Once stays un-done). Throws UsageError on a recursive call,
  // Cancelled if a waiting fiber is cancelled.
  template <typename F, typename... Args>
  void call(F&& f, Args&&... args) {
    if (done()) return;
    if (!enter()) return;
    try {
      std::invoke(std::forward<F>(f), std::forward<Args>(args)...);
    } catch (...) {
      leave(false);
      throw;
    }
    leave(true);
  }
  // True once a call completed (acquire: what it wrote is visible).
  bool done() const noexcept { return state_.load(std::memory_order_acquire) == kDone; }

 private:
  static constexpr std::uint8_t kIdle = 0, kRunning = 1, kDone = 2;
  bool enter();                // true: the caller runs f, then calls leave()
  void leave(bool ok) noexcept;

  std::atomic<std::uint8_t> state_{kIdle};  // changed under mu_; kDone stored with release
  detail::SpinLock mu_;
  std::uint64_t runner_ = 0;   // GUARDED_BY(mu_): who runs f (for the recursion check)
  detail::WaitQueue waiters_;  // GUARDED_BY(mu_)
};

// once.call(f, args...).
template <typename F, typename... Args>
void call_once(Once& once, F&& f, Args&&... args) {
  once.call(std::forward<F>(f), std::forward<Args>(args)...);
}

}  // namespace fiber
