// The idle state machine (seed 000 §4, Tokio's idle.rs): which processors sleep, how many
// search for work, and whom a new fiber wakes. See libfiber/README.md, "Idle processors".
//
// Rules:
//   - At most half the processors search (steal) at once; more would only fight over queues.
//   - Making work available (a spawn, a wake, an overflow) wakes one sleeper, and only when no
//     processor is searching and not every processor is already awake: a searcher will find it.
//   - A searcher that finds work stops searching; if it was the last searcher it wakes another
//     sleeper to take over the search (the work it found may have come with more).
//   - The last searcher to park re-checks every queue before it sleeps, so work published while
//     everyone was deciding to sleep is not stranded (no lost wakeup).
// The counters and the pushes they pair with are sequentially consistent: a pusher publishes
// its fiber, then reads the counters; a parker updates the counters, then re-checks the queues.
// One of the two must see the other.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
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
  explicit Idle(uint32_t num_processors)
      : num_(num_processors), counts_(IdleCounts::make(num_processors, 0).raw) {
    sleepers_.reserve(num_processors);
  }

  uint32_t num_processors() const noexcept { return num_; }
  IdleCounts counts() const noexcept { return {counts_.load(std::memory_order_seq_cst)}; }

  // Cheap pre-check for processor_to_notify(): false when no processor should be woken (one is
  // searching already, or all are awake - always so with a single processor).
  bool should_wake() const noexcept {
    const IdleCounts c = counts();
    return c.searching() == 0 && c.unparked() < num_;
  }

  // The processor to wake because work was made available, if one should be woken. The woken
  // processor counts as unparked and searching from here on.
  std::optional<uint32_t> processor_to_notify() {
    if (!should_wake()) return std::nullopt;
    std::lock_guard lock(mu_);
    if (!should_wake() || sleepers_.empty()) return std::nullopt;
    counts_.fetch_add(IdleCounts::kUnparkOne | 1, std::memory_order_seq_cst);
    const uint32_t id = sleepers_.back();
    sleepers_.pop_back();
    return id;
  }

  // Becomes a searcher unless half the processors already search.
  bool transition_to_searching() noexcept {
    const IdleCounts c = counts();
    if (2 * c.searching() >= num_) return false;
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

  bool is_parked(uint32_t id) {
    std::lock_guard lock(mu_);
    return std::find(sleepers_.begin(), sleepers_.end(), id) != sleepers_.end();
  }

  // Every sleeper, for shutdown. Each counts as unparked.
  std::vector<uint32_t> take_all_sleepers() {
    std::lock_guard lock(mu_);
    std::vector<uint32_t> all;
    all.swap(sleepers_);
    counts_.fetch_add(IdleCounts::kUnparkOne * static_cast<uint32_t>(all.size()), std::memory_order_seq_cst);
    return all;
  }

 private:
  const uint32_t num_;
  std::atomic<uint32_t> counts_;  // IdleCounts; see the rules above
  std::mutex mu_;
  std::vector<uint32_t> sleepers_;  // GUARDED_BY(mu_)
};

}  // namespace fiber::detail
