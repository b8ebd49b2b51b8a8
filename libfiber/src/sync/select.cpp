// select: one Waiter, one ChanNode per case (see fiber/select.hpp for the rules).
//
//   1. Shuffle the cases (a uniform random permutation) and lock every distinct channel in
//      address order - a global order, so two selects over overlapping channels cannot deadlock,
//      and a plain channel operation takes only one lock.
//   2. Poll the cases in the shuffled order; the first that can complete does so. Taking the
//      first ready case of a uniform permutation chooses uniformly among the ready cases.
//   3. None ready: default -> return; else prepare one Waiter, link one node per case into the
//      send/receive queues (all locks still held, so no case can become ready unseen), unlock,
//      park. The first waker to claim the Waiter completes its case and writes the case index
//      (plus the closed bit) into waiter.tag; every other waker's claim fails and it drops the
//      node (single-waker rule, DESIGN §4.2).
//   4. Woken: withdraw the remaining nodes, each under its own channel's lock.
//
// Rejected: checking each channel under its own lock only. Then the Waiter is visible in some
// channels while later ones are still checked, and a case found ready there races with a peer
// claiming us through an earlier channel; resolving that needs a self-claim and a retry loop, for
// no gain at the small case counts select sees.
#include <chrono>
#include <cstdint>
#include <ctime>

#include "fiber/error.hpp"
#include "fiber/select.hpp"

namespace fiber::detail {

namespace {

thread_local std::uint64_t t_rng = 0;

// xorshift64*, per thread. Not inlined: a fiber may migrate across the park below, and this must
// read the state of the thread it runs on now (DESIGN §4.3).
__attribute__((noinline)) std::uint64_t next_random() noexcept {
  asm volatile("" ::: "memory");
  std::uint64_t x = t_rng;
  if (x == 0) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    x = (reinterpret_cast<std::uintptr_t>(&t_rng) * 0x9E3779B97F4A7C15ull) ^
        (static_cast<std::uint64_t>(ts.tv_nsec) << 20) ^ static_cast<std::uint64_t>(ts.tv_sec);
    if (x == 0) x = 0x2545F4914F6CDD1Dull;
  }
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  t_rng = x;
  return x * 0x2545F4914F6CDD1Dull;
}

// Uniform in [0, n) (Lemire's multiply-shift; the bias for n <= 2^16 is below 2^-16 and the
// permutation is re-drawn every select).
inline std::uint32_t below(std::uint32_t n) noexcept {
  return static_cast<std::uint32_t>(((next_random() >> 32) * n) >> 32);
}

void unlock_all(const SelectCase* cases, const std::uint32_t* lockorder, std::size_t n) noexcept {
  ChanBase* prev = nullptr;
  for (std::size_t k = 0; k < n; ++k) {
    ChanBase* ch = cases[lockorder[k]].ch;
    if (ch != prev) ch->unlock();
    prev = ch;
  }
}

}  // namespace

std::size_t select_impl(SelectCase* cases, ChanNode* nodes, std::uint32_t* scratch, std::size_t n, SelectWait wait,
                        Deadline deadline) {
  if (n == 0 && wait == SelectWait::forever) {
    throw UsageError("fiber::select: no channel case and no finite timeout or default case: it would block forever");
  }
  std::uint32_t* order = scratch;         // poll order: a uniform random permutation
  std::uint32_t* lockorder = scratch + n;  // cases sorted by channel address
  for (std::uint32_t i = 0; i < n; ++i) order[i] = lockorder[i] = i;
  for (std::size_t i = n; i > 1; --i) {
    const std::uint32_t j = below(static_cast<std::uint32_t>(i));
    std::swap(order[i - 1], order[j]);
  }
  for (std::size_t i = 1; i < n; ++i) {  // insertion sort: n is small
    const std::uint32_t v = lockorder[i];
    std::size_t k = i;
    for (; k > 0 && cases[lockorder[k - 1]].ch > cases[v].ch; --k) lockorder[k] = lockorder[k - 1];
    lockorder[k] = v;
  }

  {
    ChanBase* prev = nullptr;
    for (std::size_t k = 0; k < n; ++k) {
      ChanBase* ch = cases[lockorder[k]].ch;
      if (ch != prev) ch->lock();
      prev = ch;
    }
  }

  // ---- 2. poll
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint32_t i = order[k];
    SelectCase& c = cases[i];
    ChanBase::Handoff h;
    const ChanBase::Try t = c.send ? c.ch->try_send_locked(c.slot, h) : c.ch->try_recv_locked(c.slot, h);
    if (t == ChanBase::Try::not_ready) continue;
    unlock_all(cases, lockorder, n);
    if (t == ChanBase::Try::closed) {
      if (c.send) ChanBase::throw_closed("fiber::select: send on a closed channel");
      c.ch->reset_slot(c.slot);
      return i;
    }
    c.ch->finish(h);
    return i;
  }
  if (wait == SelectWait::never || (wait == SelectWait::until && deadline <= std::chrono::steady_clock::now())) {
    unlock_all(cases, lockorder, n);
    return n;
  }

  // ---- 3. wait on every case
  Waiter w;
  waiter_prepare(w);
  for (std::size_t i = 0; i < n; ++i) {
    nodes[i] = ChanNode{&w, nullptr, nullptr, cases[i].slot, i};
    (cases[i].send ? cases[i].ch->sendq() : cases[i].ch->recvq()).push_back(&nodes[i]);
  }
  unlock_all(cases, lockorder, n);
  const WakeReason r = wait == SelectWait::until ? waiter_wait_until(w, ParkReason::Select, deadline)
                                                 : waiter_wait(w, ParkReason::Select);

  // ---- 4. withdraw the nodes no waker took (the chosen one was popped by its waker)
  const std::size_t chosen = r == WakeReason::Notified ? static_cast<std::size_t>(w.tag & ~kChanClosedTag) : n;
  // Woken by a close: close() took every node off that channel's queues, the other cases' on it
  // too, and the channel may be gone already. Only the other channels are withdrawn from.
  const ChanBase* closed = chosen < n && (w.tag & kChanClosedTag) ? cases[chosen].ch : nullptr;
  for (std::size_t i = 0; i < n; ++i) {
    if (i == chosen || cases[i].ch == closed) continue;
    ChanBase* ch = cases[i].ch;
    ch->lock();
    (cases[i].send ? ch->sendq() : ch->recvq()).remove_if_queued(&nodes[i]);
    ch->unlock();
  }
  if (r == WakeReason::Cancelled) throw Cancelled();
  if (r == WakeReason::Timeout) return n;
  // A receive case closed while we waited had its slot reset by close(): the channel may be gone.
  if ((w.tag & kChanClosedTag) && cases[chosen].send) {
    ChanBase::throw_closed("fiber::select: the channel of a send case was closed while select waited");
  }
  return chosen;
}

}  // namespace fiber::detail
