// Channel: the type-erased core of fiber::Channel<T> (see fiber/channel.hpp for the rules).
//
// State: a ring buffer of `cap_` slots, a closed flag, and two queues of ChanNodes (blocked
// receivers, blocked senders), all under one SpinLock. Every operation is "try under the lock,
// else enqueue a node and park":
//
//   send: closed -> error; a receiver waits -> pop it, claim it, then (unlocked) move the value
//         straight into its result and wake it; room in the buffer -> push; else wait.
//   recv: a value is buffered -> take it, and refill the freed slot from the first waiting
//         sender (so FIFO order holds); unbuffered and a sender waits -> take its value directly;
//         closed -> nothing; else wait.
//   close: mark closed, claim every waiter under the lock, wake them after it.
//
// Popped nodes whose claim fails belong to waits that already ended (timed out, cancelled, or a
// select that another channel completed); they are dropped, never touched again. Their owners
// find them unlinked when they withdraw. See wait.hpp for the claim/wake contract.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>

#include "fiber/channel.hpp"
#include "sync/waiter_impl.hpp"

namespace fiber::detail {

namespace {
unsigned char* allocate_buffer(const ElemOps* ops, std::size_t cap) {
  if (cap == 0) return nullptr;
  if (cap > static_cast<std::size_t>(-1) / ops->size) throw std::bad_alloc();
  return static_cast<unsigned char*>(::operator new(cap * ops->size, std::align_val_t(ops->align)));
}
}  // namespace

ChanBase::ChanBase(const ElemOps* ops, std::size_t capacity)
    : ops_(ops), cap_(capacity), buf_(allocate_buffer(ops, capacity)) {}

ChanBase::~ChanBase() {
  if (!recvq_.empty() || !sendq_.empty()) {
    std::fprintf(stderr, "libfiber: fiber::Channel destroyed while an operation was waiting on it\n");
    std::abort();
  }
  for (std::size_t i = 0; i < count_; ++i) ops_->destroy(slot((head_ + i) % cap_));
  if (buf_) ::operator delete(buf_, std::align_val_t(ops_->align));
}

void ChanBase::throw_closed(const char* what) { throw ChannelClosed(what); }

bool ChanBase::closed() const noexcept {
  std::lock_guard lock(mu_);
  return closed_;
}

std::size_t ChanBase::size() const noexcept {
  std::lock_guard lock(mu_);
  return count_;
}

ChanBase::Try ChanBase::try_send_locked(void* src, Handoff& h) noexcept {
  if (closed_) return Try::closed;
  while (ChanNode* r = recvq_.pop_front()) {
    if (claim_wait(*r->waiter, WakeReason::Notified)) {
      h = Handoff{r, r->slot, src, r->index};
      return Try::done;
    }
  }
  if (count_ < cap_) {
    std::size_t tail = head_ + count_;
    if (tail >= cap_) tail -= cap_;
    ops_->construct(slot(tail), src);
    ++count_;
    return Try::done;
  }
  return Try::not_ready;
}

ChanBase::Try ChanBase::try_recv_locked(void* dst, Handoff& h) noexcept {
  if (count_ > 0) {
    void* p = slot(head_);
    ops_->put(dst, p);
    ops_->destroy(p);
    if (++head_ == cap_) head_ = 0;
    --count_;
    // Refill the slot from the first waiting sender: it was full, so senders may wait.
    while (ChanNode* s = sendq_.pop_front()) {
      if (claim_wait(*s->waiter, WakeReason::Notified)) {
        std::size_t tail = head_ + count_;
        if (tail >= cap_) tail -= cap_;
        ops_->construct(slot(tail), s->slot);
        ++count_;
        h = Handoff{s, nullptr, nullptr, s->index};
        return Try::done;
      }
    }
    return Try::done;
  }
  while (ChanNode* s = sendq_.pop_front()) {
    if (claim_wait(*s->waiter, WakeReason::Notified)) {
      h = Handoff{s, dst, s->slot, s->index};
      return Try::done;
    }
  }
  return closed_ ? Try::closed : Try::not_ready;
}

namespace {
// finish(), inline in send and recv.
[[gnu::always_inline]] inline void finish_handoff(const ElemOps* ops, const ChanBase::Handoff& h) noexcept {
  if (h.peer == nullptr) return;
  Waiter* w = h.peer->waiter;
  if (h.dst) ops->put(h.dst, h.src);
  w->tag = h.tag;
  wake_wait(*w);  // `h.peer` and `*w` may be gone from here on
}
}  // namespace

void ChanBase::finish(const Handoff& h) const noexcept { finish_handoff(ops_, h); }

// The blocking half of send and recv, entered with mu_ held: queue `node`, unlock, park until a
// peer or close() claims it (true), or the deadline passes (false; the node is withdrawn).
// Throws Cancelled (node withdrawn) if the fiber is cancelled. Inline in send and recv, with the
// Waiter steps it makes (sync/waiter_impl.hpp): calls and their prologues fewer on every park
// (pingpong_1t: park_locked inline, 962 -> 888 instructions per round trip; the Waiter steps
// and finish() inline, 888 -> 844).
[[gnu::always_inline]] inline bool ChanBase::park_locked(ChanQueue& q, ChanNode& node, Wait wait, Deadline deadline) {
  Waiter& w = *node.waiter;
  prepare_wait(w, false);
  q.push_back(&node);
  mu_.unlock();
  const WakeReason r = wait == Wait::until ? waiter_wait_until(w, ParkReason::Channel, deadline)
                                           : wait_claimed(w, ParkReason::Channel);
  if (r == WakeReason::Notified) [[likely]] return true;
  {
    std::lock_guard lock(mu_);
    q.remove_if_queued(&node);
  }
  if (r == WakeReason::Cancelled) throw Cancelled();
  return false;
}

ChanStatus ChanBase::send(void* src, Wait wait, Deadline deadline) {
  Handoff h;
  mu_.lock();
  const Try t = try_send_locked(src, h);
  if (t != Try::not_ready) [[likely]] {
    mu_.unlock();
    if (t == Try::closed) throw_closed("fiber::Channel::send: send on a closed channel");
    finish_handoff(ops_, h);
    return ChanStatus::ok;
  }
  if (wait == Wait::never || (wait == Wait::until && deadline <= std::chrono::steady_clock::now())) {
    mu_.unlock();
    return wait == Wait::never ? ChanStatus::empty : ChanStatus::timeout;
  }
  Waiter w;
  ChanNode node{&w, nullptr, nullptr, src, 0};
  if (!park_locked(sendq_, node, wait, deadline)) return ChanStatus::timeout;
  // A receiver took the value, or close() woke us.
  if (w.tag & kChanClosedTag) throw_closed("fiber::Channel::send: the channel was closed while the sender waited");
  return ChanStatus::ok;
}

ChanStatus ChanBase::recv(void* dst, Wait wait, Deadline deadline) {
  Handoff h;
  mu_.lock();
  const Try t = try_recv_locked(dst, h);
  if (t != Try::not_ready) [[likely]] {
    mu_.unlock();
    if (t == Try::closed) return ChanStatus::closed;
    finish_handoff(ops_, h);
    return ChanStatus::ok;
  }
  if (wait == Wait::never || (wait == Wait::until && deadline <= std::chrono::steady_clock::now())) {
    mu_.unlock();
    return wait == Wait::never ? ChanStatus::empty : ChanStatus::timeout;
  }
  Waiter w;
  ChanNode node{&w, nullptr, nullptr, dst, 0};
  if (!park_locked(recvq_, node, wait, deadline)) return ChanStatus::timeout;
  return (w.tag & kChanClosedTag) ? ChanStatus::closed : ChanStatus::ok;
}

void ChanBase::close() {
  ChanQueue receivers, senders;  // claimed under the lock, woken after it
  {
    std::lock_guard lock(mu_);
    if (closed_) throw_closed("fiber::Channel::close: the channel is already closed");
    closed_ = true;
    // Receivers wait only while the buffer is empty, so all of them learn "closed" now; senders
    // fail (Go: a blocked sender panics when its channel is closed).
    for (ChanQueue* q : {&recvq_, &sendq_}) {
      while (ChanNode* n = q->pop_front()) {
        if (claim_wait(*n->waiter, WakeReason::Notified)) {
          n->waiter->tag = n->index | kChanClosedTag;
          (q == &recvq_ ? receivers : senders).push_back(n);
        }
      }
    }
  }
  // A receiver's slot gets "no value" before its wake, as a value would be moved in: once woken
  // it never touches the channel again, which the closer may destroy once close() returns.
  // (select used to reset it after the wake, through the channel.) Outside the lock: an old
  // value's destructor may do anything.
  while (ChanNode* n = receivers.pop_front()) {
    reset_slot(n->slot);
    wake_wait(*n->waiter);
  }
  while (ChanNode* n = senders.pop_front()) wake_wait(*n->waiter);
}

}  // namespace fiber::detail
