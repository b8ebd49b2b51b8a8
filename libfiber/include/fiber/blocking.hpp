// blocking: run code that blocks its thread on a helper thread while the calling fiber parks.
//
//   std::string text = fiber::blocking([&] { return read_whole_file(path); });
//   fiber::blocking([&] { ::fsync(fd); });          // void is fine
//   auto conn = fiber::blocking([&] { return legacy_connect(host); });  // move-only is fine
//
// Like Tokio's spawn_blocking or Photon's WorkPool. A blocking call (a libc call the runtime does
// not hook, a library's own I/O, a long computation) made directly in a fiber holds its processor
// thread and every fiber queued behind it; through blocking() only a helper thread waits, and the
// processor runs other fibers meanwhile.
//
// The helper threads are one process-wide pool, started on first use: a thread is created when a
// job finds none idle, up to $FIBER_BLOCKING_THREADS (default 64; more jobs queue, FIFO), and an
// idle thread exits after 10 s without work. They are named "fiber-blocking". The callable runs
// there as on any plain thread: fiber primitives block that thread, a nested blocking() runs
// inline, fiber-only functions (this_fiber::name, PinGuard, ...) throw UsageError, and it sees
// the helper's thread_local variables, not the caller's.
//
// Cancellation: a job, once handed to the pool, always runs to its end, because it uses the
// caller's stack (the callable, its captures and the result slot live there). A fiber cancelled
// while it waits keeps waiting; blocking() then returns the job's value (or rethrows its
// exception) as usual, and the cancel stays pending, so the fiber's next blocking call (a
// sleep_for, a channel recv, another blocking()) throws fiber::Cancelled. A fiber already cancelled
// when it calls blocking() gets fiber::Cancelled without the callable running. Scheduler::stop()
// likewise waits for a job in progress, so a job that never returns keeps stop() waiting.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "fiber/config.hpp"
#include "fiber/this_fiber.hpp"

namespace fiber {

namespace detail {

// Runs run(arg) on a pool thread while the calling fiber parks (ParkReason::Blocking), and
// returns once it has finished. `run` must not throw. Throws fiber::Cancelled (without running
// it) if the fiber is already cancelled, UsageError for an invalid $FIBER_BLOCKING_THREADS, and
// ResourceError if no helper thread exists and none can be started. From a plain thread: runs
// run(arg) inline.
FIBER_API void blocking_run(void (*run)(void*) noexcept, void* arg);

// The caller's half of a job: a reference to the callable and a slot for its outcome, on the
// caller's stack. run() executes on the helper thread; take() on the caller, after it returned.
template <typename F, typename R>
struct BlockingCall {
  // A value result is kept in an optional, a reference as a pointer; void needs no slot (an
  // unused nullptr_t stands in).
  using Slot = std::conditional_t<std::is_void_v<R>, std::nullptr_t,
                                  std::conditional_t<std::is_reference_v<R>, std::remove_reference_t<R>*,
                                                     std::optional<R>>>;
  explicit BlockingCall(F& fn) noexcept : f(fn) {}

  F& f;
  Slot value{};
  std::exception_ptr error;

  static void run(void* self) noexcept {
    auto& c = *static_cast<BlockingCall*>(self);
    try {
      if constexpr (std::is_void_v<R>) {
        std::invoke(c.f);
      } else if constexpr (std::is_reference_v<R>) {
        auto&& ref = std::invoke(c.f);  // named, so an rvalue reference result has an address too
        c.value = std::addressof(ref);
      } else {
        c.value.emplace(std::invoke(c.f));
      }
    } catch (...) {
      c.error = std::current_exception();
    }
  }

  R take() {
    if (error) std::rethrow_exception(std::exchange(error, nullptr));
    if constexpr (std::is_reference_v<R>) {
      return static_cast<R>(*value);
    } else if constexpr (!std::is_void_v<R>) {
      return std::move(*value);
    }
  }
};

}  // namespace detail

// Runs f() on a helper thread while the calling fiber parks; returns its value or rethrows its
// exception. Throws fiber::Cancelled (without running f) if the fiber was cancelled before the
// call; a cancel during the call takes effect at the fiber's next blocking call (see above).
// Throws UsageError for an invalid $FIBER_BLOCKING_THREADS, ResourceError if no helper thread
// exists and none can be started. From a plain thread: runs f() inline on the caller.
template <class F>
auto blocking(F&& f) -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  if (!this_fiber::in_fiber()) return std::invoke(f);
  detail::BlockingCall<std::remove_reference_t<F>, R> call(f);
  detail::blocking_run(&decltype(call)::run, &call);
  return call.take();
}

}  // namespace fiber
