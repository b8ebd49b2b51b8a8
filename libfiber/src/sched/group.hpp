// Group: the block_on / wait_all grouping of seed 003. Counts the unfinished fibers spawned
// (transitively) inside it; group_wait() returns when the count reaches zero.
//
// Fibers inherit their spawner's group through the control block, not a thread_local: a fiber
// may migrate, and the group belongs to the fiber, not the thread.
//
// Counting without a shared line per fiber. A group's members are spawned on one processor and
// often finish on another (stolen), so one counter word touched by both would move between
// their caches once per fiber. Instead a processor keeps a *debt*: members of one group that
// finished on it and are not yet taken off `pending_` (Processor::group_member_done). With D the
// sum of all processors' debts and T the group's unfinished members (plus the creator's token):
//
//   pending_ == T + D, every debt >= 0      so pending_ reaches zero only when T == D == 0;
//   a processor owes a group only while it runs one of the group's fibers, or is between two of
//   them (finishing one, finding the next)      so while it owes, T >= 1, and a debt is settled
//   (one fetch_sub) as soon as the processor turns to anything else: another group's fiber, a
//   plain one, its loop, or sleep (Processor::settle_group_debt).
//
// A member spawned on a processor that owes its group pays off one unit of the debt instead of
// adding to `pending_` (T and D move by one each, pending_ does not). A spawn is never deferred
// the other way: the new fiber may finish on another processor at once.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

#include "fiber/detail/wait.hpp"

namespace fiber::detail {

class Group {
 public:
  // Starts at one: the creator's token, given back by wait(), so members finishing before the
  // last one is spawned (wait_all) cannot bring the count to zero early.
  Group() = default;

  void add() noexcept { pending_.fetch_add(1, std::memory_order_relaxed); }
  // `n` members finished (n >= 1). The group may be gone as soon as this returns: freed by the
  // waiter, or by this call itself once the creator has released it.
  void done(std::size_t n = 1) noexcept;
  // Gives back the creator's token and waits for every member. Throws Cancelled if the waiting
  // fiber is cancelled.
  void wait();
  // The creator is done with the group (after wait(), or instead of it if spawning threw):
  // deletes it now if every member has finished, else leaves that to the last member's done().
  // The creator's token, if wait() did not give it back, is given back here.
  void release() noexcept;

 private:
  // Members still running plus the creator's token plus the processors' debts (see above). The
  // decrement that reaches zero is ordered (acq_rel) after every member's writes - a debt is
  // settled by the thread its members finished on, after their last writes there - and the
  // waiter reads them after `finished_`. It starts a cache line, shared only with the fields
  // below (WaitGroup's reasoning: no unrelated neighbour on the line every spawn writes).
  alignas(64) std::atomic<std::size_t> pending_{1};
  SpinLock mu_;
  bool finished_ = false;     // GUARDED_BY(mu_)
  bool released_ = false;     // GUARDED_BY(mu_): the creator left first; the last done() deletes
  Waiter* waiter_ = nullptr;  // GUARDED_BY(mu_)
  bool token_returned_ = false;  // the creator's only (wait() and release())
};

}  // namespace fiber::detail
