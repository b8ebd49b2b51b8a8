// Internal: the type-erased body of a fiber and its result slot. Public only because the spawn
// templates construct it; not part of the API.
#pragma once

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

#include "fiber/config.hpp"

namespace fiber::detail {

struct Fiber;  // the control block, libfiber/src/sched/fiber.hpp

// The callable a fiber runs, placed in the same allocation as its control block.
struct TaskBase {
  virtual void run() = 0;  // runs the callable, storing its value; may throw
  virtual ~TaskBase() = default;
  std::exception_ptr error;  // set by the runtime when run() throws
};

template <typename T>
struct ResultSlot : TaskBase {
  std::optional<T> value;
};
template <>
struct ResultSlot<void> : TaskBase {};

template <typename F, typename T>
struct TaskImpl final : ResultSlot<T> {
  explicit TaskImpl(F&& f) : fn(std::in_place, std::move(f)) {}
  // The callable (and what it captured) is destroyed as soon as it returns or throws, on the
  // fiber itself - not when the last handle or token on the control block goes away.
  void run() override {
    struct Drop {
      std::optional<F>& fn;
      ~Drop() { fn.reset(); }
    } drop{fn};
    if constexpr (std::is_void_v<T>) {
      std::move(*fn)();
    } else {
      this->value.emplace(std::move(*fn)());
    }
  }
  std::optional<F> fn;
};

struct SpawnRequest;  // fiber/spawn.hpp

// Allocates a control block with room for a task of `task_size` bytes (and, when `joinable`, for
// a JoinHandle's wait record); returns the task storage through `task_storage`.
FIBER_API Fiber* fiber_create(const SpawnRequest& req, bool joinable, std::size_t task_size, std::size_t task_align,
                              void** task_storage);
// Hands a created fiber (whose task is constructed) to its scheduler. `joinable` keeps a
// reference for a JoinHandle.
FIBER_API void fiber_submit(Fiber* f, TaskBase* task, bool joinable);
// Frees a created fiber whose task constructor threw.
FIBER_API void fiber_abandon(Fiber* f) noexcept;
// JoinHandle support: wait for the fiber to finish (parks a fiber, blocks a thread).
FIBER_API void fiber_join(Fiber* f);
// The same, until `deadline_ns` on the steady clock (nanoseconds since its epoch): true once it
// has finished, false on timeout. Throws UsageError, naming `what`, if the fiber is the caller.
FIBER_API bool fiber_wait_until(Fiber* f, std::int64_t deadline_ns, const char* what);
FIBER_API bool fiber_finished(const Fiber* f) noexcept;
// Gives up the handle's reference without joining; reports an unobserved exception.
FIBER_API void fiber_detach(Fiber* f) noexcept;
// Drops the handle's reference after a join.
FIBER_API void fiber_release(Fiber* f) noexcept;
// One more reference to the control block (a CancelToken's); fiber_release drops it.
FIBER_API void fiber_retain(Fiber* f) noexcept;
// The calling fiber, with a reference taken for the caller; nullptr from a plain thread.
FIBER_API Fiber* fiber_current_retained() noexcept;
FIBER_API unsigned long long fiber_id(const Fiber* f) noexcept;
// Requests cancellation: the fiber's current and later parks end with fiber::Cancelled.
FIBER_API void fiber_cancel(Fiber* f) noexcept;

}  // namespace fiber::detail
