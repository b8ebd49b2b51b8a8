// Internal: the type-erased body of a fiber and its result slot. Public only because the spawn
// templates construct it; not part of the API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

#include "fiber/config.hpp"

namespace fiber {
struct SpawnOptions;  // fiber/spawn.hpp
}  // namespace fiber

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

// A `go` fiber that has not started yet: its callable, in a record of 32 or 64 bytes, which the
// queues hold instead of a control block until a processor first picks it (go_record_create).
// Starting it moves the callable into the task of a fresh control block and frees the record:
// a million fibers queued at once cost a million small records, not a million control blocks.
// Only for callables that move and die trivially (a lambda capturing pointers and values): the
// move happens wherever the processor picks it - the switch of a fiber that yields, parks,
// finishes or moves, or the loop - where no user code may run.
struct PendingTask {
  virtual std::size_t task_size() const noexcept = 0;  // sizeof the task relocate() makes
  // Moves the callable into a task constructed at `dst` (task_size() bytes, aligned for
  // max_align_t) and ends this object's lifetime (its storage is the caller's to free).
  virtual TaskBase* relocate(void* dst) noexcept = 0;

 protected:
  ~PendingTask() = default;
};

template <typename F, typename T>
struct PendingTaskImpl final : PendingTask {
  static_assert(std::is_trivially_move_constructible_v<F> && std::is_trivially_destructible_v<F>,
                "relocate() runs no user code");
  explicit PendingTaskImpl(F&& f) noexcept : fn(std::move(f)) {}
  std::size_t task_size() const noexcept override { return sizeof(TaskImpl<F, T>); }
  TaskBase* relocate(void* dst) noexcept override {
    TaskBase* t = new (dst) TaskImpl<F, T>(std::move(fn));
    this->~PendingTaskImpl();
    return t;
  }
  F fn;
};

// The largest PendingTaskImpl a record holds (a 64-byte record with its 16-byte header).
inline constexpr std::size_t kMaxPendingTask = 48;

// Whether a `go` of `Call` may queue a record: it moves and dies trivially, and both it and the
// task it becomes fit (an over-aligned callable or result takes the ordinary path, which
// refuses it).
template <typename Call>
constexpr bool fits_spawn_record() {
  if constexpr (!std::is_trivially_move_constructible_v<Call> || !std::is_trivially_destructible_v<Call>) {
    return false;
  } else {
    using T = std::invoke_result_t<Call>;
    using Pending = PendingTaskImpl<Call, T>;
    return sizeof(Pending) <= kMaxPendingTask && alignof(Pending) <= alignof(std::max_align_t) &&
           alignof(TaskImpl<Call, T>) <= alignof(std::max_align_t);
  }
}

struct SpawnRequest;  // fiber/spawn.hpp

// Allocates a control block with room for a task of `task_size` bytes (and, when `joinable`, for
// a JoinHandle's wait record); returns the task storage through `task_storage`.
FIBER_API Fiber* fiber_create(const SpawnRequest& req, bool joinable, std::size_t task_size, std::size_t task_align,
                              void** task_storage);
// Hands a created fiber (whose task is constructed) to its scheduler. `joinable` keeps a
// reference for a JoinHandle.
FIBER_API void fiber_submit(Fiber* f, TaskBase* task, bool joinable);
// `go`'s fast path. Storage (aligned for max_align_t) for a PendingTask of `size` bytes (at
// most kMaxPendingTask) in a record of a fiber to spawn detached with `options`; nullptr when
// the spawn must take the ordinary path (fiber_create): not called on a processor of the
// target scheduler, a name or stack size given. Throws ResourceError when out of memory.
FIBER_API void* go_record_create(const SpawnOptions& options, std::size_t size);
// Hands the record, whose PendingTask of `size` bytes is constructed, to the calling processor.
FIBER_API void go_record_submit(void* task_storage, std::size_t size) noexcept;
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
