// SchedulerImpl: the processors of one scheduler and what they share (injector, idle state,
// registry of live fibers).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fiber/detail/wait.hpp"
#include "fiber/scheduler.hpp"
#include "sched/fiber.hpp"
#include "sched/idle.hpp"
#include "sched/injector.hpp"
#include "sched/processor.hpp"

namespace fiber::detail {

// Live fibers, sharded so that spawning on one processor and finishing on another rarely meet
// on the same lock. Shard i belongs to processor i; the last one to spawns from other threads.
class Registry {
 public:
  explicit Registry(std::size_t shards) : shards_(shards) {}
  void add(Fiber* f, std::size_t shard) noexcept;
  void remove(Fiber* f) noexcept;
  std::size_t live() const noexcept;
  // Calls fn(Fiber*) for every live fiber, one shard lock at a time.
  template <typename Fn>
  void for_each(Fn&& fn) {
    for (Shard& s : shards_) {
      std::lock_guard lock(s.mu);
      for (Fiber* f = s.head; f; f = f->reg_next) fn(f);
    }
  }

 private:
  struct alignas(64) Shard {
    SpinLock mu;
    Fiber* head = nullptr;   // GUARDED_BY(mu)
    std::size_t count = 0;   // GUARDED_BY(mu); read racily by live()
  };
  std::vector<Shard> shards_;
};

class SchedulerImpl {
 public:
  explicit SchedulerImpl(const Scheduler::Options& options);
  ~SchedulerImpl();

  void stop();
  bool stopping() const noexcept { return stopping_.load(std::memory_order_acquire); }

  const std::string& name() const noexcept { return name_; }
  uint32_t num_processors() const noexcept { return static_cast<uint32_t>(processors_.size()); }
  Processor& processor(uint32_t i) noexcept { return *processors_[i]; }
  Idle& idle() noexcept { return idle_; }
  Injector& injector() noexcept { return injector_; }
  Registry& registry() noexcept { return registry_; }
  uint32_t external_shard() const noexcept { return num_processors(); }
  std::size_t default_stack_class() const noexcept { return default_stack_class_; }

  // A fiber made runnable from outside this scheduler's processors.
  void inject(Fiber* f) noexcept;
  // Wakes a sleeping processor if the idle rules say one should look for work.
  void notify_parked() noexcept;
  // The last searcher's check before sleeping: wake someone if any queue has work.
  void notify_if_work_pending() noexcept;

 private:
  std::string name_;
  std::size_t default_stack_class_;
  Idle idle_;
  Injector injector_;
  Registry registry_;
  std::vector<std::unique_ptr<Processor>> processors_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};
};

// Resolves Options::processors: explicit value, else $FIBER_PROCS, else hardware concurrency.
// Throws UsageError for 0 or an invalid $FIBER_PROCS.
std::size_t resolve_processor_count(std::size_t requested);

}  // namespace fiber::detail
