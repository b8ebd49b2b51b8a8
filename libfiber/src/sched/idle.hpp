// The idle state machine (seed 000 §4, Tokio's idle.rs): which processors sleep, how many
// search for work, and whom a new fiber wakes. See libfiber/README.md, "Idle processors".
//
// Rules:
//   - At most half the processors (rounded up, as Tokio) search (steal) at once; more would
//     only fight over queues. A processor woken for work (processor_to_notify, wake_by_id)
//     searches without that check: it was woken to look.
//   - Making work available where another processor can take it (the ring, the injector, an
//     inbox) wakes one sleeper, and only when no processor is searching and not every
//     processor is already awake: a searcher will find it. A fiber put in an empty LIFO slot,
//     or in the pinned queue, wakes nobody (as in Tokio): only this processor can run it, at
//     its next switch (the watchdog moves a LIFO fiber held up by a fiber that does not switch).
//   - A searcher that finds work stops searching; if it was the last searcher it wakes another
//     sleeper to take over the search (the work it found may have come with more).
//   - The last searcher to park re-checks every queue before it sleeps, so work published while
//     everyone was deciding to sleep is not stranded (no lost wakeup).
// A pusher publishes its fiber, then reads the counters; a parker updates the counters, then
// re-checks the queues: one of the two must see the other. For the injector (spawns and wakes
// from other threads, overflows) all four accesses are sequentially consistent, so it does.
// A processor's pushes onto its own ring and LIFO slot are release stores only, and may miss a
// parker's update: no fiber is lost then, since the pusher is awake and checks its own queues
// before it parks, but the fiber waits for it instead of running on the woken processor at once
// - a rare loss of parallelism, traded for no fence on the spawn and wake path. The inbox
// (push_inbox) pairs with the parker through the idle lock instead.
//
// The number of processors changes when the watchdog starts an extra processor (add_processor)
// and when an idle extra retires (retire). `num_` and the unparked count only change under mu_,
// so the decision made under the lock in processor_to_notify() is always consistent.
//
// Waking a sleeper is two steps: it is taken off the list under the lock, then its poller is
// woken outside it. A retiring processor destroys its poller, so it must not go while a waker
// that took it off the list earlier is still between those steps: `waking_[id]` counts them
// (incremented under the lock, decremented by wake_done()), and retire() waits for zero.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace fiber::detail {

// (unparked << 16) | searching, in one atomic.
struct IdleCounts {
  static constexpr uint32_t kSearchMask = 0xffff;
  static constexpr uint32_t kUnparkShift = 16;
  static constexpr uint32_t kUnparkOne = 1u << kUnparkShift;
  uint32_t raw;

  constexpr uint32_t searching() const noexcept { return raw & kSearchMask; }
  constexpr uint32_t unparked() const noexcept { return raw >> kUnparkShift; }
  static constexpr IdleCounts make(uint32_t unparked, uint32_t searching) noexcept {
    return {(unparked << kUnparkShift) | searching};
  }
};
static_assert(IdleCounts::make(3, 2).unparked() == 3);
static_assert(IdleCounts::make(3, 2).searching() == 2);
static_assert(IdleCounts::make(0xffff, 0xffff).searching() == 0xffff);

class Idle {
 public:
  // `num_processors` start awake; ids below `max_processors` may be used.
  Idle(uint32_t num_processors, uint32_t max_processors)
      : num_(num_processors),
        counts_(IdleCounts::make(num_processors, 0).raw),
        waking_(new std::atomic<uint32_t>[max_processors]) {
    sleepers_.reserve(max_processors);
    for (uint32_t i = 0; i < max_processors; ++i) waking_[i].store(0, std::memory_order_relaxed);
  }

  // Processors taking part now (base plus running extras).
  uint32_t num_processors() const noexcept { return num_.load(std::memory_order_seq_cst); }
  IdleCounts counts() const noexcept { return {counts_.load(std::memory_order_seq_cst)}; }

  // Cheap pre-check for processor_to_notify(): false when no processor should be woken (one is
  // searching already, or all are awake - always so with a single processor). Counts first,
  // then num_: add_processor() raises num_ before the unparked count, so this never sees more
  // unparked processors than there are.
  bool should_wake() const noexcept {
    const IdleCounts c = counts();
    return c.searching() == 0 && c.unparked() < num_processors();
  }

  // Every processor is awake and none is searching: work made available now would not be
  // taken by another processor before its owner gets to it (Processor::schedule_yielded).
  bool all_busy() const noexcept {
    const IdleCounts c = counts();
    return c.searching() == 0 && c.unparked() >= num_processors();
  }

  // The processor to wake because work was made available, if one should be woken. The woken
  // processor counts as unparked and searching from here on. The caller wakes its poller, then
  // calls wake_done(id).
  std::optional<uint32_t> processor_to_notify() {
    if (!should_wake()) return std::nullopt;
    std::lock_guard lock(mu_);
    if (!should_wake() || sleepers_.empty()) return std::nullopt;
    counts_.fetch_add(IdleCounts::kUnparkOne | 1, std::memory_order_seq_cst);
    const uint32_t id = sleepers_.back();
    sleepers_.pop_back();
    waking_[id].fetch_add(1, std::memory_order_relaxed);  // read by retire() under mu_
    return id;
  }

  // A waker returned by processor_to_notify() or wake_by_id() has woken the poller of `id`.
  // Release: retire() (acquire) destroys that poller only after every such wake is done.
  void wake_done(uint32_t id) noexcept { waking_[id].fetch_sub(1, std::memory_order_release); }

  // Becomes a searcher unless half the processors already search.
  bool transition_to_searching() noexcept {
    const IdleCounts c = counts();
    if (2 * c.searching() >= num_processors()) return false;
    // Racy with other would-be searchers; exceeding the half briefly is harmless.
    counts_.fetch_add(1, std::memory_order_seq_cst);
    return true;
  }

  // Stops searching; true if this was the last searcher.
  bool transition_from_searching() noexcept {
    const IdleCounts prev{counts_.fetch_sub(1, std::memory_order_seq_cst)};
    return prev.searching() == 1;
  }

  // Goes to sleep; true if this was the last searcher (the caller must then re-check every
  // queue and notify if it finds work).
  bool transition_to_parked(uint32_t id, bool searching) {
    std::lock_guard lock(mu_);
    const uint32_t dec = IdleCounts::kUnparkOne | (searching ? 1u : 0u);
    const IdleCounts prev{counts_.fetch_sub(dec, std::memory_order_seq_cst)};
    sleepers_.push_back(id);
    return searching && prev.searching() == 1;
  }

  // Wakes processor `id` for work it found in its own queues (not searching). False if it was
  // not in the sleepers list (someone already woke it).
  bool unpark_by_id(uint32_t id) {
    std::lock_guard lock(mu_);
    auto it = std::find(sleepers_.begin(), sleepers_.end(), id);
    if (it == sleepers_.end()) return false;
    sleepers_.erase(it);
    counts_.fetch_add(IdleCounts::kUnparkOne, std::memory_order_seq_cst);
    return true;
  }

  // For a waker that will then wake the poller of `id` (and call wake_done). Like
  // processor_to_notify(), it counts the woken processor as unparked *and searching*: a
  // processor taken off the list by someone else always believes it was woken to search (see
  // Processor::transition_from_parked), and will later give up a searcher's share it must have.
  bool wake_by_id(uint32_t id) {
    std::lock_guard lock(mu_);
    auto it = std::find(sleepers_.begin(), sleepers_.end(), id);
    if (it == sleepers_.end()) return false;
    sleepers_.erase(it);
    counts_.fetch_add(IdleCounts::kUnparkOne | 1, std::memory_order_seq_cst);
    waking_[id].fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // A new (extra) processor joins, awake and not searching. Called on its own thread.
  void add_processor() {
    std::lock_guard lock(mu_);
    num_.fetch_add(1, std::memory_order_seq_cst);  // before the count: see should_wake()
    counts_.fetch_add(IdleCounts::kUnparkOne, std::memory_order_seq_cst);
  }

  // A parked processor leaves for good (an idle extra retiring). False if it is not in the
  // sleepers list (a notifier took it: it must look for work instead). On success no waker can
  // reach it any more, and every earlier waker has finished with its poller.
  bool retire(uint32_t id) {
    {
      std::lock_guard lock(mu_);
      auto it = std::find(sleepers_.begin(), sleepers_.end(), id);
      if (it == sleepers_.end()) return false;
      sleepers_.erase(it);
      num_.fetch_sub(1, std::memory_order_seq_cst);  // it was parked: the unparked count stays
    }
    // A waker that took `id` off the list in an earlier round may still be writing its eventfd.
    while (waking_[id].load(std::memory_order_acquire) != 0) std::this_thread::yield();
    return true;
  }

  bool is_parked(uint32_t id) const {
    std::lock_guard lock(mu_);
    return std::find(sleepers_.begin(), sleepers_.end(), id) != sleepers_.end();
  }

 private:
  std::atomic<uint32_t> num_;     // processors taking part; written under mu_
  std::atomic<uint32_t> counts_;  // IdleCounts; see the rules above
  mutable std::mutex mu_;
  std::vector<uint32_t> sleepers_;  // GUARDED_BY(mu_)
  // Per processor id: wakers between taking it off the list and waking its poller.
  std::unique_ptr<std::atomic<uint32_t>[]> waking_;
};

}  // namespace fiber::detail
