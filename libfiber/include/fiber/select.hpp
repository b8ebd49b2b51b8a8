// select: waits on several channel operations at once and performs exactly one (Go's select).
//
//   fiber::Channel<int> jobs;  fiber::Channel<std::string> log(8);  fiber::Channel<bool> quit;
//   std::optional<int> job;  std::optional<bool> q;  std::string line = "tick";
//   switch (fiber::select(fiber::recv_case(jobs, job),       // 0
//                         fiber::send_case(log, line),       // 1: line is moved only if chosen
//                         fiber::recv_case(quit, q),         // 2
//                         fiber::timeout_case(50ms))) {      // 3
//     case 0: if (job) run(*job); else /* jobs closed */; break;
//     case 1: break;                                         // line was sent
//     case 2: return;
//     case 3: idle(); break;
//   }
//
// select returns the position (0-based, in argument order) of the case it performed:
//   recv_case(ch, out)     receives into `out` (a std::optional<T>&): engaged with the value, or
//                          reset if the channel is closed and drained (Go's ok == false).
//   send_case(ch, v)       sends v. An lvalue v is moved from only if this case is chosen; an
//                          rvalue is moved into the case object when the case is built.
//   timeout_case(d)        chosen when no channel case became ready within d (a duration) ...
//   deadline_case(tp)      ... or by the time point tp. Negative/past: expired at once.
//   default_case()         chosen at once when no channel case is ready (non-blocking select).
// Rules:
//   - when several channel cases are ready, one of them is chosen uniformly at random;
//   - cases not chosen have no effect: nothing is sent, received or moved;
//   - a chosen send case on a closed channel throws ChannelClosed (as send does), also when the
//     channel is closed while select waits; a closed receive case is ready (out is reset);
//   - at most one timeout/deadline case and one default case (checked at compile time); with a
//     default case a timeout never fires; a select with no case at all throws UsageError;
//   - a fiber cancelled while waiting throws fiber::Cancelled (no case had any effect).
// Works from fibers (parks) and plain threads (blocks), on channels of any element types. A case
// object must be passed straight to select (it refers to its channel and, for lvalues, its value).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "fiber/channel.hpp"
#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

namespace detail {

// One channel case, type-erased.
struct SelectCase {
  ChanBase* ch;
  void* slot;  // send: the T to move from; receive: the std::optional<T> to fill
  bool send;
};
enum class SelectWait : std::uint8_t { forever, never, until };

// Performs one of cases[0..n) and returns its index, or n when the default case (never) or the
// timeout (until) was taken. `nodes` and `scratch` are caller-provided storage of n and 2n
// entries. Throws ChannelClosed, Cancelled, UsageError (n == 0 with wait forever).
FIBER_API std::size_t select_impl(SelectCase* cases, ChanNode* nodes, std::uint32_t* scratch, std::size_t n,
                                  SelectWait wait, Deadline deadline);

template <typename T>
struct RecvCase {
  Channel<T>* ch;
  std::optional<T>* out;
  SelectCase erase() const noexcept { return {&ChanAccess::base(*ch), out, false}; }
};
template <typename T>
struct SendRefCase {
  Channel<T>* ch;
  T* value;
  SelectCase erase() const noexcept { return {&ChanAccess::base(*ch), value, true}; }
};
template <typename T>
struct SendValCase {
  Channel<T>* ch;
  mutable T value;
  SelectCase erase() const noexcept { return {&ChanAccess::base(*ch), &value, true}; }
};
struct TimeoutCase {
  Deadline deadline;
};
struct DefaultCase {};

template <typename C>
inline constexpr bool is_chan_case = requires(const C& c) {
  { c.erase() } -> std::same_as<SelectCase>;
};
template <typename C>
inline constexpr bool is_select_case =
    is_chan_case<C> || std::is_same_v<C, TimeoutCase> || std::is_same_v<C, DefaultCase>;

}  // namespace detail

// Receive case: when chosen, `out` holds the value received (reset: the channel is closed).
template <typename T>
detail::RecvCase<T> recv_case(Channel<T>& ch, std::optional<T>& out) noexcept {
  return {&ch, &out};
}
// Send case for an lvalue: `value` is moved from only if the case is chosen.
template <typename T>
detail::SendRefCase<T> send_case(Channel<T>& ch, std::type_identity_t<T>& value) noexcept {
  return {&ch, &value};
}
// Send case for an rvalue (or a value to convert): held by the case until select returns.
template <typename T>
detail::SendValCase<T> send_case(Channel<T>& ch, std::type_identity_t<T>&& value) {
  return {&ch, std::move(value)};
}
// Timeout case: chosen when no channel case is ready within d (d <= 0: only if none is ready now).
template <typename Rep, typename Period>
detail::TimeoutCase timeout_case(std::chrono::duration<Rep, Period> d) noexcept {
  return {detail::deadline_after(d)};
}
// Deadline case: chosen when no channel case is ready by tp.
template <typename Clock, typename Duration>
detail::TimeoutCase deadline_case(const std::chrono::time_point<Clock, Duration>& tp) noexcept {
  return {detail::to_deadline(tp)};
}
// Default case: chosen at once when no channel case is ready.
inline detail::DefaultCase default_case() noexcept { return {}; }

// Performs exactly one of the cases and returns its position in the argument list (see above).
template <typename... Cases>
  requires(detail::is_select_case<std::remove_cvref_t<Cases>> && ...)
std::size_t select(Cases&&... cases) {
  constexpr std::size_t kChan = (std::size_t{detail::is_chan_case<std::remove_cvref_t<Cases>>} + ... + 0);
  constexpr std::size_t kTimeouts = (std::size_t{std::is_same_v<std::remove_cvref_t<Cases>, detail::TimeoutCase>} + ... + 0);
  constexpr std::size_t kDefaults = (std::size_t{std::is_same_v<std::remove_cvref_t<Cases>, detail::DefaultCase>} + ... + 0);
  static_assert(kTimeouts <= 1, "fiber::select: at most one timeout_case/deadline_case");
  static_assert(kDefaults <= 1, "fiber::select: at most one default_case");
  constexpr std::size_t kSlots = kChan > 0 ? kChan : 1;

  detail::SelectCase erased[kSlots];
  std::size_t position[kSlots];
  detail::ChanNode nodes[kSlots];
  std::uint32_t scratch[2 * kSlots];
  std::size_t timeout_pos = 0, default_pos = 0;
  detail::Deadline deadline = detail::kNoDeadline;

  std::size_t next = 0, pos = 0;
  auto add = [&](const auto& c) {
    using C = std::remove_cvref_t<decltype(c)>;
    if constexpr (detail::is_chan_case<C>) {
      erased[next] = c.erase();
      position[next++] = pos;
    } else if constexpr (std::is_same_v<C, detail::TimeoutCase>) {
      timeout_pos = pos;
      deadline = c.deadline;
    } else {
      default_pos = pos;
    }
    ++pos;
  };
  (add(cases), ...);
  (void)add;  // select() with no case at all

  detail::SelectWait wait = detail::SelectWait::forever;
  if constexpr (kDefaults > 0) {
    wait = detail::SelectWait::never;
  } else if constexpr (kTimeouts > 0) {
    if (deadline != detail::kNoDeadline) wait = detail::SelectWait::until;
  }
  const std::size_t r = detail::select_impl(erased, nodes, scratch, kChan, wait, deadline);
  if (r < kChan) return position[r];
  return kDefaults > 0 ? default_pos : timeout_pos;
}

}  // namespace fiber
