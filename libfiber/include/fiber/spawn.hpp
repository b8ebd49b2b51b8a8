// Spawning fibers: fiber::spawn returns a typed JoinHandle; `go` starts a detached fiber.
//
//   auto h = fiber::spawn([](int x) { return x * 2; }, 21);
//   int v = h.join();                        // 42; rethrows what the fiber threw
//
//   go [=] { serve(conn); };                 // detached, Go style
//   go go_stack(256 << 10) go_name("acceptor") [=] { accept_loop(); };
//   fiber::spawn({.stack_size = 16 << 10, .name = "tick"}, [] { ... }).detach();
//
// From inside a fiber, new fibers go to the spawning fiber's scheduler (and join its block_on
// group); from a plain thread, to the default scheduler, unless `scheduler` says otherwise.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "fiber/config.hpp"
#include "fiber/detail/task.hpp"
#include "fiber/detail/wait.hpp"
#include "fiber/error.hpp"

namespace fiber {

class Scheduler;

// The smallest stack that still runs ordinary code comfortably is a few KiB; below a page,
// stacks are "compact": packed without guard pages, for fibers known to need little (a parked
// connection, a waiter). Only the fiber's own frames fit there: run with LD_BIND_NOW=1, and never
// cancel such a fiber or let an exception unwind on it (the unwinder needs more; the overflow
// is reported and aborts). See libfiber/README.md, "Stacks".
inline constexpr std::size_t compact_stack_size = 2048;

struct SpawnOptions {
  std::size_t stack_size = 0;      // 0: the scheduler's default; below 2048: UsageError
  Scheduler* scheduler = nullptr;  // nullptr: the current fiber's scheduler, else the default one
  std::string_view name = {};      // shown by fiber::dump and the gdb extension; copied
};

namespace detail {
class Group;
struct SpawnRequest {
  SpawnOptions options;
  Group* group = nullptr;      // explicit block_on group; nullptr: inherit the spawner's
};

// The callable a fiber runs: f itself when there are no arguments (no wrapper, no empty tuple:
// eight bytes less in the control block, see block_class_for in sched/runtime.cpp), else f
// with its arguments bound. Either way it is invoked once, as an rvalue (TaskImpl::run).
template <typename F, typename... Args>
auto bind_call(F&& f, Args&&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return std::decay_t<F>(std::forward<F>(f));
  } else {
    return [fn = std::decay_t<F>(std::forward<F>(f)),
            tup = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...)]() mutable -> decltype(auto) {
      return std::apply(std::move(fn), std::move(tup));
    };
  }
}

template <typename F>
void check_callable(const F& f) {
  if constexpr (std::is_pointer_v<F> || std::is_member_pointer_v<F>) {
    if (f == nullptr) throw UsageError("fiber::spawn: the callable is empty (a null function pointer)");
  } else if constexpr (requires { f == nullptr; }) {
    if (f == nullptr) throw UsageError("fiber::spawn: the callable is empty (an empty std::function)");
  }
}
}  // namespace detail

// Cancels a fiber without owning it: copyable, usable from any thread, and available for fibers
// started with `go` (which have no JoinHandle). Keeps only the fiber's control block alive, not
// the fiber. Get one from JoinHandle::cancel_token() or this_fiber::cancel_token().
//
//   fiber::CancelToken tok;
//   go [&tok] { tok = fiber::this_fiber::cancel_token(); serve(); };
//   ...
//   tok.cancel();   // serve()'s blocking calls now end with Cancelled / -ECANCELED
class CancelToken {
 public:
  CancelToken() noexcept = default;
  CancelToken(const CancelToken& o) noexcept : f_(o.f_) {
    if (f_) detail::fiber_retain(f_);
  }
  CancelToken(CancelToken&& o) noexcept : f_(std::exchange(o.f_, nullptr)) {}
  CancelToken& operator=(CancelToken o) noexcept {
    std::swap(f_, o.f_);
    return *this;
  }
  ~CancelToken() {
    if (f_) detail::fiber_release(f_);
  }
  // Cancels the fiber, as JoinHandle::cancel(). No effect on a finished fiber or an empty token.
  void cancel() const noexcept {
    if (f_) detail::fiber_cancel(f_);
  }
  bool valid() const noexcept { return f_ != nullptr; }

 private:
  template <typename T>
  friend class JoinHandle;
  friend CancelToken this_fiber_cancel_token();
  explicit CancelToken(detail::Fiber* retained) noexcept : f_(retained) {}
  detail::Fiber* f_ = nullptr;
};

// this_fiber::cancel_token(): see fiber/this_fiber.hpp.
inline CancelToken this_fiber_cancel_token() { return CancelToken(detail::fiber_current_retained()); }
namespace this_fiber {
// A token that cancels the calling fiber; an empty token from a plain thread.
inline CancelToken cancel_token() { return this_fiber_cancel_token(); }
}  // namespace this_fiber

// The owner's handle on a spawned fiber. Move-only. Destroying it without join() detaches.
template <typename T>
class JoinHandle {
 public:
  JoinHandle() = default;
  JoinHandle(JoinHandle&& o) noexcept : f_(std::exchange(o.f_, nullptr)), slot_(std::exchange(o.slot_, nullptr)) {}
  JoinHandle& operator=(JoinHandle&& o) noexcept {
    if (this != &o) {
      reset();
      f_ = std::exchange(o.f_, nullptr);
      slot_ = std::exchange(o.slot_, nullptr);
    }
    return *this;
  }
  ~JoinHandle() { reset(); }

  // Waits for the fiber (parks a fiber, blocks a thread) and returns its value or rethrows its
  // exception. Throws UsageError if the handle was already joined or detached, or if a fiber
  // joins itself.
  T join() {
    if (!f_) throw UsageError("fiber::JoinHandle::join: the handle is empty (already joined, detached or moved from)");
    detail::fiber_join(f_);
    detail::Fiber* f = std::exchange(f_, nullptr);
    struct Release {
      detail::Fiber* f;
      ~Release() { detail::fiber_release(f); }
    } release{f};
    // Move the exception out: the control block (and its copy) may be freed on another thread.
    if (slot_->error) std::rethrow_exception(std::exchange(slot_->error, nullptr));
    if constexpr (!std::is_void_v<T>) return std::move(*slot_->value);
  }

  // Lets the fiber run on unobserved. An exception it throws is then reported as unhandled
  // (see set_unhandled_exception_handler). Throws UsageError on an empty handle.
  void detach() {
    if (!f_) throw UsageError("fiber::JoinHandle::detach: the handle is empty (already joined, detached or moved from)");
    reset();
  }

  // Waits at most `d` / until `tp` for the fiber to finish (parks a fiber, blocks a thread):
  // true once it has - join() then returns at once - and false on timeout. A deadline already
  // past only checks (a fiber still yields once). The handle stays joinable either way: wait
  // again, cancel() or detach(). Like join(), one wait at a time per handle. Throws UsageError
  // on an empty handle, when a fiber waits for itself, or when another wait on the same fiber
  // is in progress; fiber::Cancelled if the waiting fiber is cancelled.
  template <typename Rep, typename Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    return wait_until_(detail::deadline_after(d), "fiber::JoinHandle::wait_for");
  }
  template <typename Clock, typename Duration>
  bool wait_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return wait_until_(detail::to_deadline(tp), "fiber::JoinHandle::wait_until");
  }

  bool joinable() const noexcept { return f_ != nullptr; }
  // True once the fiber has finished (join() will not wait).
  bool finished() const noexcept { return f_ && detail::fiber_finished(f_); }
  // The fiber's id (as this_fiber::id() returns inside it); 0 for an empty handle.
  unsigned long long id() const noexcept { return f_ ? detail::fiber_id(f_) : 0; }
  // Cancels the fiber: its current and later blocking calls throw fiber::Cancelled.
  void cancel() noexcept {
    if (f_) detail::fiber_cancel(f_);
  }
  // A token that cancels this fiber and outlives the handle (empty for an empty handle).
  CancelToken cancel_token() const noexcept {
    if (f_) detail::fiber_retain(f_);
    return CancelToken(f_);
  }

 private:
  template <typename F, typename... Args>
  friend auto spawn_in(const detail::SpawnRequest& req, F&& f, Args&&... args);
  JoinHandle(detail::Fiber* f, detail::ResultSlot<T>* slot) noexcept : f_(f), slot_(slot) {}
  void reset() noexcept {
    if (f_) detail::fiber_detach(std::exchange(f_, nullptr));
  }
  bool wait_until_(detail::Deadline d, const char* what) {
    if (!f_) throw UsageError(std::string(what) + ": the handle is empty (already joined, detached or moved from)");
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d.time_since_epoch()).count();
    return detail::fiber_wait_until(f_, ns, what);
  }

  detail::Fiber* f_ = nullptr;
  detail::ResultSlot<T>* slot_ = nullptr;
};

namespace detail {
// Creates and submits a fiber running `call`; returns it and its result slot.
template <typename Call>
auto submit_call(const SpawnRequest& req, Call&& call, bool joinable) {
  using T = std::invoke_result_t<Call>;
  using Task = TaskImpl<Call, T>;
  void* mem = nullptr;
  Fiber* fib = fiber_create(req, joinable, sizeof(Task), alignof(Task), &mem);
  Task* task;
  try {
    task = new (mem) Task(std::move(call));
  } catch (...) {
    fiber_abandon(fib);
    throw;
  }
  fiber_submit(fib, task, joinable);
  return std::pair<Fiber*, ResultSlot<T>*>(fib, task);
}
}  // namespace detail

// Spawns `f(args...)` per `req` (lower level than spawn; used by block_on and wait_all).
template <typename F, typename... Args>
auto spawn_in(const detail::SpawnRequest& req, F&& f, Args&&... args) {
  detail::check_callable(f);
  auto call = detail::bind_call(std::forward<F>(f), std::forward<Args>(args)...);
  using T = std::invoke_result_t<decltype(call)>;
  auto [fib, slot] = detail::submit_call(req, std::move(call), true);
  return JoinHandle<T>(fib, slot);
}

// Spawns a fiber running f(args...) and returns its JoinHandle.
template <typename F, typename... Args>
  requires std::invocable<std::decay_t<F>&, std::decay_t<Args>...>
auto spawn(F&& f, Args&&... args) {
  return spawn_in(detail::SpawnRequest{}, std::forward<F>(f), std::forward<Args>(args)...);
}
template <typename F, typename... Args>
  requires std::invocable<std::decay_t<F>&, std::decay_t<Args>...>
auto spawn(const SpawnOptions& options, F&& f, Args&&... args) {
  return spawn_in(detail::SpawnRequest{options}, std::forward<F>(f), std::forward<Args>(args)...);
}

// What to do with an exception that escapes a detached fiber. fiber::Cancelled is not reported:
// it ends a fiber quietly, whether a cancel asked for it, the fiber threw it, or a join passed
// it on from a cancelled fiber. The default prints the fiber's id, name and the exception's message to stderr and aborts. The
// handler runs on that fiber, which counts as alive until it returns: it may block (send on a
// channel, write a log), and Scheduler::stop() waits for it and cancels such a wait (a
// Cancelled escaping the handler then ends it quietly; any other exception escaping it aborts
// the process). Returns the previous handler.
struct UnhandledException {
  unsigned long long fiber_id;
  std::string_view fiber_name;
  std::exception_ptr error;
};
using UnhandledExceptionHandler = void (*)(const UnhandledException&);
FIBER_API UnhandledExceptionHandler set_unhandled_exception_handler(UnhandledExceptionHandler h) noexcept;

namespace detail {
// `go` support: `Go{} - f` spawns f detached; options chain in front of it.
struct Go {
  SpawnOptions options;
  template <typename F>
    requires std::invocable<std::decay_t<F>&>
  void operator-(F&& f) const {
    check_callable(f);
    auto call = bind_call(std::forward<F>(f));
    using Call = decltype(call);
    if constexpr (fits_spawn_record<Call>()) {
      using Pending = PendingTaskImpl<Call, std::invoke_result_t<Call>>;
      if (void* mem = go_record_create(options, sizeof(Pending))) {
        go_record_submit(static_cast<PendingTask*>(new (mem) Pending(std::move(call))), sizeof(Pending));
        return;
      }
    }
    submit_call(SpawnRequest{options}, std::move(call), false);  // born detached
  }
};
struct GoOption {
  enum Kind { Stack, Name, On } kind;
  std::size_t stack = 0;
  std::string_view name = {};
  Scheduler* sched = nullptr;
};
inline Go operator-(Go g, const GoOption& o) {
  switch (o.kind) {
    case GoOption::Stack: g.options.stack_size = o.stack; break;
    case GoOption::Name: g.options.name = o.name; break;
    case GoOption::On: g.options.scheduler = o.sched; break;
  }
  return g;
}
}  // namespace detail

}  // namespace fiber

// go f;                        spawn f detached on the current (or default) scheduler
// go go_stack(N) f;            with an N-byte stack
// go go_name("x") f;           named (the name is copied)
// go go_on(sched) f;           on scheduler `sched` (a fiber::Scheduler&)
// Options combine: go go_name("acceptor") go_stack(1 << 20) [=] { ... };
// A plain `go` from a fiber of the target scheduler, with a callable of up to 40 bytes that
// moves and is destroyed trivially (a lambda capturing up to five pointers or values), queues
// only the callable; the fiber's control block is made when it first runs (libfiber/README.md,
// "Spawn records"). Out of memory then, the fiber never runs and its fiber::ResourceError goes
// to the unhandled-exception handler, as one it threw would; on every other path `go` throws
// fiber::ResourceError itself.
#ifndef FIBER_NO_GO_MACRO
#define go ::fiber::detail::Go{} -
#endif
#define go_stack(n) ::fiber::detail::GoOption{::fiber::detail::GoOption::Stack, (n)} -
#define go_name(s) ::fiber::detail::GoOption{::fiber::detail::GoOption::Name, 0, (s)} -
#define go_on(s) ::fiber::detail::GoOption{::fiber::detail::GoOption::On, 0, {}, &(s)} -
