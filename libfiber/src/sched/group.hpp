// Group: the block_on / wait_all grouping of seed 003. Counts the unfinished fibers spawned
// (transitively) inside it; group_wait() returns when the count reaches zero.
//
// Fibers inherit their spawner's group through the control block, not a thread_local: a fiber
// may migrate, and the group belongs to the fiber, not the thread.
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
  // A member finished. The group may be destroyed by the waiter as soon as this returns.
  void done() noexcept;
  // Gives back the creator's token and waits for every member. Throws Cancelled if the waiting
  // fiber is cancelled.
  void wait();

 private:
  // Members still running plus the creator's token. The decrement that reaches zero is ordered
  // (acq_rel) after every member's writes, and the waiter reads them after `finished_`.
  std::atomic<std::size_t> pending_{1};
  SpinLock mu_;
  bool finished_ = false;     // GUARDED_BY(mu_)
  Waiter* waiter_ = nullptr;  // GUARDED_BY(mu_)
};

}  // namespace fiber::detail
