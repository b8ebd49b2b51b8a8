// Channel<T>: a typed FIFO between fibers and threads, with Go's semantics (chan T).
//
//   fiber::Channel<int> ch(16);                 // capacity 16; Channel<int> ch; is a rendezvous
//   go [&ch] {
//     for (int i = 0; i < 100; ++i) ch.send(i);  // parks while the buffer is full
//     ch.close();
//   };
//   for (int& v : ch) use(v);                   // receives until closed and drained
//
//   if (std::optional<int> v = ch.recv()) ...   // nullopt: closed and drained
//   if (auto r = ch.recv_for(10ms)) use(*r);     // r.status: ok, timeout or closed
//
// Go's rules:
//   - capacity 0 is a rendezvous: send returns once a receiver has taken the value (it is moved
//     straight into the receiver's result, never through a buffer);
//   - capacity N buffers up to N values; values are received in the order they were sent;
//   - after close(), receivers first drain the buffered values, then learn the channel is closed
//     (recv returns nullopt); close() wakes every blocked receiver and every blocked sender;
//   - sending on a closed channel, and closing a closed channel, throw ChannelClosed (a
//     UsageError); a sender blocked when the channel is closed throws it too (its value is not
//     consumed).
// Every value sent is received exactly once or stays in the channel; a failed try_send/send_for
// leaves the argument untouched (not moved from).
//
// Blocking calls park a fiber and block a plain thread; any mix works, across processors and
// schedulers. A fiber that is cancelled while blocked throws fiber::Cancelled (nothing is
// consumed). Timed calls take a duration or a deadline; a negative duration or a past deadline
// means "already expired": the call still completes if it can do so at once, else reports a
// timeout without blocking.
//
// The object must outlive every operation on it; share it by reference or a shared_ptr.
// Destroying a channel while an operation waits on it is a fatal error. T must be nothrow
// move-constructible (unique_ptr, string, vector, ... are); values still buffered are destroyed
// with the channel.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"
#include "fiber/error.hpp"

// Library-internal members of exported classes.
#ifndef FIBER_HIDDEN
#define FIBER_HIDDEN __attribute__((visibility("hidden")))
#endif

namespace fiber {

// Sending on (or closing) a closed channel. Also thrown by select for a chosen send case whose
// channel is closed.
class FIBER_API ChannelClosed : public UsageError {
 public:
  using UsageError::UsageError;
};

// Outcome of a non-blocking or timed channel operation.
enum class ChanStatus : std::uint8_t {
  ok,       // the value was transferred
  empty,    // try_recv: no value available now (the channel is open)
  timeout,  // the deadline passed first
  closed,   // recv: closed and drained
};

// What try_recv / recv_for / recv_until return: the value (status ok) or why there is none.
//   if (auto r = ch.try_recv()) use(*r); else if (r.status == fiber::ChanStatus::closed) ...
template <typename T>
struct RecvResult {
  std::optional<T> value;  // engaged iff status == ok
  ChanStatus status = ChanStatus::empty;

  explicit operator bool() const noexcept { return status == ChanStatus::ok; }
  T& operator*() & noexcept { return *value; }
  T&& operator*() && noexcept { return std::move(*value); }
  T* operator->() noexcept { return &*value; }
};

template <typename T>
class Channel;

namespace detail {

// A wait record of one blocked channel operation (one per case in a select), linked into a
// channel's send or receive queue. The nodes of a select share one Waiter: the first waker to
// claim it completes that case, and reports the case through waiter->tag.
struct ChanNode {
  Waiter* waiter = nullptr;
  ChanNode* next = nullptr;  // links: owned by whoever holds the channel's lock
  ChanNode* prev = nullptr;
  void* slot = nullptr;      // send: the T to move from; receive: the std::optional<T> to fill
  std::uintptr_t index = 0;  // the case index reported in waiter->tag
};

// Waiter::tag bit set when the channel was closed instead of a value being transferred.
inline constexpr std::uintptr_t kChanClosedTag = std::uintptr_t{1} << (sizeof(std::uintptr_t) * 8 - 1);

// An intrusive FIFO of ChanNodes (WaitQueue's twin). Guarded by the channel's lock.
class ChanQueue {
 public:
  bool empty() const noexcept { return head_ == nullptr; }
  void push_back(ChanNode* n) noexcept {
    n->next = nullptr;
    n->prev = tail_;
    if (tail_) tail_->next = n; else head_ = n;
    tail_ = n;
  }
  void remove(ChanNode* n) noexcept {
    if (n->prev) n->prev->next = n->next; else head_ = n->next;
    if (n->next) n->next->prev = n->prev; else tail_ = n->prev;
    n->next = n->prev = nullptr;
  }
  bool contains(const ChanNode* n) const noexcept { return n->prev != nullptr || head_ == n; }
  void remove_if_queued(ChanNode* n) noexcept {
    if (contains(n)) remove(n);
  }
  ChanNode* pop_front() noexcept {
    ChanNode* n = head_;
    if (n) remove(n);
    return n;
  }

 private:
  ChanNode* head_ = nullptr;
  ChanNode* tail_ = nullptr;
};

// The element type, erased: how to move, destroy and hand over a T.
struct ElemOps {
  std::size_t size;
  std::size_t align;
  void (*construct)(void* dst, void* src) noexcept;  // ::new (dst) T(std::move(*src))
  void (*destroy)(void* p) noexcept;                 // p->~T()
  void (*put)(void* opt, void* src) noexcept;        // optional<T>->emplace(std::move(*src))
  void (*reset)(void* opt) noexcept;                 // optional<T>->reset()
};

template <typename T>
struct ElemOpsFor {
  static void construct(void* dst, void* src) noexcept { ::new (dst) T(std::move(*static_cast<T*>(src))); }
  static void destroy(void* p) noexcept { static_cast<T*>(p)->~T(); }
  static void put(void* opt, void* src) noexcept {
    static_cast<std::optional<T>*>(opt)->emplace(std::move(*static_cast<T*>(src)));
  }
  static void reset(void* opt) noexcept { static_cast<std::optional<T>*>(opt)->reset(); }
  static constexpr ElemOps ops{sizeof(T), alignof(T), &construct, &destroy, &put, &reset};
};

// The type-erased channel: buffer, queues and the whole protocol (src/sync/channel.cpp).
//
// Lock discipline (DESIGN §4, wait.hpp): everything below is GUARDED_BY(mu_). A waiter is
// prepared and enqueued under mu_; a waker pops and claims under mu_, moves the value and wakes
// after unlocking (a claimed waiter cannot resume before the wake, so its slot stays valid); a
// waiter whose wait ended by timeout or cancel unlinks itself under mu_. Invariant: receivers
// wait only while the buffer is empty, senders only while it is full (or the capacity is 0).
class FIBER_API ChanBase {
 public:
  enum class Try : std::uint8_t { done, not_ready, closed };
  // A claimed peer to finish after unlocking: move src into dst (if dst), report tag, wake.
  struct Handoff {
    ChanNode* peer = nullptr;
    void* dst = nullptr;
    void* src = nullptr;
    std::uintptr_t tag = 0;
  };
  enum class Wait : std::uint8_t { never, forever, until };

  ChanBase(const ElemOps* ops, std::size_t capacity);
  ~ChanBase();
  ChanBase(const ChanBase&) = delete;
  ChanBase& operator=(const ChanBase&) = delete;

  // Moves *src in. ok, or (wait never) empty, or (wait until) timeout. Throws ChannelClosed,
  // Cancelled. `src` is moved from only when ok.
  ChanStatus send(void* src, Wait wait, Deadline deadline);
  // Receives into the empty std::optional<T> at dst: ok, closed, or empty / timeout. Throws
  // Cancelled.
  ChanStatus recv(void* dst, Wait wait, Deadline deadline);
  FIBER_HIDDEN bool park_locked(ChanQueue& q, ChanNode& node, Wait wait, Deadline deadline);
  void close();
  bool closed() const noexcept;
  std::size_t size() const noexcept;
  std::size_t capacity() const noexcept { return cap_; }
  // Snapshots of the lock's bias (BiasedLock, fiber/detail/wait.hpp), for tests and debugging.
  bool lock_is_biased() const noexcept { return mu_.biased(); }
  bool lock_was_revoked() const noexcept { return mu_.revoked(); }

  // ---- for select (src/sync/select.cpp), inside the library only (hidden: direct calls that
  // the compiler may inline, no PLT); mu_ held.
  void lock() noexcept { mu_.lock(); }
  void unlock() noexcept { mu_.unlock(); }
  FIBER_HIDDEN Try try_send_locked(void* src, Handoff& h) noexcept;
  FIBER_HIDDEN Try try_recv_locked(void* dst, Handoff& h) noexcept;
  ChanQueue& sendq() noexcept { return sendq_; }
  ChanQueue& recvq() noexcept { return recvq_; }
  // Without the lock: completes a handoff (a no-op if there is none).
  FIBER_HIDDEN void finish(const Handoff& h) const noexcept;
  void reset_slot(void* opt) const noexcept { ops_->reset(opt); }
  [[noreturn]] static void throw_closed(const char* what);

 private:
  void* slot(std::size_t i) const noexcept { return buf_ + i * ops_->size; }

  const ElemOps* const ops_;
  const std::size_t cap_;
  unsigned char* const buf_;  // cap_ slots of T; [head_, head_ + count_) mod cap_ are live
  mutable BiasedLock mu_;
  std::size_t head_ = 0;      // GUARDED_BY(mu_)
  std::size_t count_ = 0;     // GUARDED_BY(mu_)
  bool closed_ = false;       // GUARDED_BY(mu_)
  ChanQueue recvq_;           // GUARDED_BY(mu_): receivers waiting for a value
  ChanQueue sendq_;           // GUARDED_BY(mu_): senders waiting for room or a receiver
};

struct ChanAccess {
  template <typename T>
  static ChanBase& base(Channel<T>& ch) noexcept {
    return ch.core_;
  }
};

}  // namespace detail

template <typename T>
class Channel {
  static_assert(std::is_object_v<T> && !std::is_array_v<T> && !std::is_const_v<T>,
                "fiber::Channel<T>: T must be a non-const object type");
  static_assert(std::is_nothrow_move_constructible_v<T> && std::is_nothrow_destructible_v<T>,
                "fiber::Channel<T>: T must be nothrow move-constructible and nothrow destructible");

 public:
  using value_type = T;
  using Status = ChanStatus;

  // A channel with room for `capacity` buffered values (0: rendezvous).
  explicit Channel(std::size_t capacity = 0) : core_(&detail::ElemOpsFor<T>::ops, capacity) {}
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Sends v, waiting for room (or, unbuffered, for a receiver). Throws ChannelClosed, Cancelled.
  void send(T&& v) { core_.send(&v, Wait::forever, {}); }
  void send(const T& v)
    requires std::is_copy_constructible_v<T>
  {
    T tmp(v);
    send(std::move(tmp));
  }
  // Sends v if that needs no waiting; false (v untouched) otherwise. Throws ChannelClosed.
  bool try_send(T&& v) { return core_.send(&v, Wait::never, {}) == Status::ok; }
  bool try_send(const T& v)
    requires std::is_copy_constructible_v<T>
  {
    T tmp(v);
    return try_send(std::move(tmp));
  }
  // Sends v, waiting at most d; false (v untouched) on timeout. Throws ChannelClosed, Cancelled.
  template <typename Rep, typename Period>
  bool send_for(T&& v, std::chrono::duration<Rep, Period> d) {
    return send_until_(&v, detail::deadline_after(d));
  }
  // Sends v, waiting until tp at the latest; false (v untouched) on timeout.
  template <typename Clock, typename Duration>
  bool send_until(T&& v, const std::chrono::time_point<Clock, Duration>& tp) {
    return send_until_(&v, detail::to_deadline(tp));
  }

  // Receives a value, waiting for one; nullopt once the channel is closed and drained.
  // Throws Cancelled.
  std::optional<T> recv() {
    std::optional<T> out;
    core_.recv(&out, Wait::forever, {});
    return out;
  }
  // Receives a value if one is available now: status ok, empty (open, nothing buffered or sent)
  // or closed (closed and drained).
  RecvResult<T> try_recv() {
    RecvResult<T> r;
    r.status = core_.recv(&r.value, Wait::never, {});
    return r;
  }
  // Receives a value, waiting at most d: status ok, timeout or closed. Throws Cancelled.
  template <typename Rep, typename Period>
  RecvResult<T> recv_for(std::chrono::duration<Rep, Period> d) {
    return recv_until_(detail::deadline_after(d));
  }
  // Receives a value, waiting until tp at the latest: status ok, timeout or closed.
  template <typename Clock, typename Duration>
  RecvResult<T> recv_until(const std::chrono::time_point<Clock, Duration>& tp) {
    return recv_until_(detail::to_deadline(tp));
  }

  // Closes the channel and wakes every blocked sender and receiver. Throws ChannelClosed if it
  // was already closed.
  void close() { core_.close(); }
  // True once close() was called (values may still be buffered).
  bool closed() const noexcept { return core_.closed(); }
  // Buffered values now (a snapshot).
  std::size_t size() const noexcept { return core_.size(); }
  std::size_t capacity() const noexcept { return core_.capacity(); }

  // Range-for: receives until the channel is closed and drained. `for (auto& v : ch)`; move
  // from v freely (`for (auto v : ch)` copies, so needs a copyable T).
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = T*;
    using reference = T&;
    iterator() = default;
    explicit iterator(Channel* ch) : ch_(ch), cur_(ch->recv()) {}
    T& operator*() const noexcept { return *cur_; }
    T* operator->() const noexcept { return &*cur_; }
    iterator& operator++() {
      cur_ = ch_->recv();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept { return !it.cur_; }

   private:
    Channel* ch_ = nullptr;
    mutable std::optional<T> cur_;
  };
  iterator begin() { return iterator(this); }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  using Wait = detail::ChanBase::Wait;
  friend struct detail::ChanAccess;

  bool send_until_(T* v, detail::Deadline d) {
    return core_.send(v, d == detail::kNoDeadline ? Wait::forever : Wait::until, d) == Status::ok;
  }
  RecvResult<T> recv_until_(detail::Deadline d) {
    RecvResult<T> r;
    r.status = core_.recv(&r.value, d == detail::kNoDeadline ? Wait::forever : Wait::until, d);
    return r;
  }

  detail::ChanBase core_;
};

}  // namespace fiber
