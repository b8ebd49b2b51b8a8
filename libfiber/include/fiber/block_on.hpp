// block_on / wait_all: run fibers and wait for them *and everything they spawned*.
//
//   int main() {
//     int v = fiber::block_on([] {
//       go [] { background(); };   // block_on also waits for this one
//       return compute();
//     });
//   }
//
//   auto [a, b] = fiber::wait_all([] { return 1; }, [] { return std::string("x"); });
//
// Every fiber spawned (transitively) from inside the group belongs to it; the call returns when
// the count of unfinished members reaches zero, then yields the root's value or rethrows its
// exception (wait_all: the first failing root's, in argument order). Callable from main or any
// plain thread (blocks it) and from a fiber (parks it).
//
// Cancelling a fiber waiting in block_on / wait_all ends the wait with fiber::Cancelled at once.
// The group's fibers are not cancelled by that: they run on, detached, and an exception a root
// throws then is reported as unobserved.
#pragma once

#include <exception>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "fiber/config.hpp"
#include "fiber/spawn.hpp"

namespace fiber {

namespace detail {
// A block_on group: counts unfinished member fibers.
FIBER_API Group* group_create();
FIBER_API void group_wait(Group* g);  // until no member is unfinished
// The creator is done with the group: freed now, or by its last member to finish if the wait
// was cancelled (or never made, the spawn having thrown).
FIBER_API void group_release(Group* g) noexcept;

struct GroupGuard {
  Group* g = group_create();
  ~GroupGuard() { group_release(g); }
};

template <typename T>
using Joined = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

template <typename T>
Joined<T> join_value(JoinHandle<T>& h) {
  if constexpr (std::is_void_v<T>) {
    h.join();
    return {};
  } else {
    return h.join();
  }
}
}  // namespace detail

// Runs f on a fiber (of options.scheduler, else the caller's or the default scheduler) and waits
// until it and every fiber spawned inside it have finished. Returns f's value or rethrows.
template <typename F>
auto block_on(const SpawnOptions& options, F&& f) {
  detail::GroupGuard group;
  auto h = spawn_in(detail::SpawnRequest{options, group.g}, std::forward<F>(f));
  detail::group_wait(group.g);
  return h.join();
}
template <typename F>
auto block_on(F&& f) {
  return block_on(SpawnOptions{}, std::forward<F>(f));
}

// Runs each callable on its own fiber, waits for all of them and all they spawned, and returns
// their values as a tuple (std::monostate for void). Rethrows the first exception in argument
// order once everything has finished.
template <typename... F>
auto wait_all(F&&... fs) {
  detail::GroupGuard group;
  auto handles = std::make_tuple(spawn_in(detail::SpawnRequest{SpawnOptions{}, group.g}, std::forward<F>(fs))...);
  detail::group_wait(group.g);
  // Join in argument order (braced init is evaluated left to right); every exception counts as
  // observed, the first one is rethrown.
  std::exception_ptr first;
  auto take = [&first](auto& h) {
    using V = decltype(detail::join_value(h));
    try {
      return std::optional<V>(detail::join_value(h));
    } catch (...) {
      if (!first) first = std::current_exception();
      return std::optional<V>();
    }
  };
  auto results = std::apply([&](auto&... h) { return std::tuple<decltype(take(h))...>{take(h)...}; }, handles);
  if (first) std::rethrow_exception(first);
  return std::apply([](auto&... r) { return std::make_tuple(std::move(*r)...); }, results);
}

}  // namespace fiber
