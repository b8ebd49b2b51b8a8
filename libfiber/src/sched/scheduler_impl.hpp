// SchedulerImpl: the processors of one scheduler and what they share (injector, idle state,
// registry of listed fibers, the watchdog).
//
// Processor slots: `max_processors` slots exist from the start (the vector, the idle state's
// per-id arrays and the registry shards are sized for them); the first `base_processors` hold
// processors that run until stop(). The monitor fills the others on demand (extras) and
// publishes each new one by raising processor_slots(), so code that iterates processors reads
// processor_slots() (acquire) first and never sees a slot before its Processor exists.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fiber/detail/wait.hpp"
#include "fiber/scheduler.hpp"
#include "sched/fiber.hpp"
#include "sched/idle.hpp"
#include "sched/injector.hpp"
#include "sched/monitor.hpp"
#include "sched/processor.hpp"

namespace fiber::detail {

// Fibers that have reached a cancellation point or switched away and not finished, for stop()
// to cancel and dump() to list. A fiber lists itself then (ensure_listed), in the shard of the
// processor it runs on, so listing and unlisting (usually on the same processor) meet no other
// thread's lock: listing at spawn put a lock shared by the spawner and the finishers on every
// spawn, and listing at the first run a lock on every fiber, though most finish without ever
// switching away. How many fibers are alive, queued and running ones included, is
// SchedulerImpl::live_fibers().
class Registry {
 public:
  explicit Registry(std::size_t shards) : shards_(shards) {}
  void add(Fiber* f, std::size_t shard) noexcept;
  // A fiber never listed is left alone. Nothing after leave_scheduler may reach ensure_listed:
  // a fiber never listed would list itself there, and be freed while listed.
  void remove(Fiber* f) noexcept;
  // Calls fn(Fiber*) for every listed fiber, one shard lock at a time.
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
    Fiber* head = nullptr;  // GUARDED_BY(mu)
  };
  std::vector<Shard> shards_;
};

class SchedulerImpl;
// The list of live schedulers (introspect.cpp).
void register_scheduler(SchedulerImpl* s);
void unregister_scheduler(SchedulerImpl* s) noexcept;

class SchedulerImpl {
 public:
  explicit SchedulerImpl(const Scheduler::Options& options);
  ~SchedulerImpl();

  void stop();
  bool stopping() const noexcept { return stopping_.load(std::memory_order_acquire); }
  // A thread outside this scheduler (a plain thread, a blocking-pool helper, another
  // scheduler's processor) is making one of our fibers runnable. Once it has, the fiber may
  // run, finish, and let stop() and ~Scheduler go ahead while the waker is still inside
  // inject() or push_inbox(); stop() therefore waits for foreign wakes in progress to end.
  void foreign_wake_begin() noexcept { foreign_wakes_.fetch_add(1, std::memory_order_acq_rel); }
  void foreign_wake_end() noexcept { foreign_wakes_.fetch_sub(1, std::memory_order_acq_rel); }
  void count_foreign_spawn() noexcept { foreign_spawned_.fetch_add(1, std::memory_order_release); }  // see live_fibers()
  // A spawn from outside this scheduler (a plain thread, another scheduler's fiber) between
  // its check of stopping() and its count_foreign_spawn(): stop() waits for those to end, so
  // that such a spawn either throws or is counted (and cancelled) before stop() counts live
  // fibers. begin throws UsageError when the scheduler is stopping.
  void foreign_spawn_begin();
  void foreign_spawn_end() noexcept { foreign_spawns_.fetch_sub(1, std::memory_order_release); }
  // Spawned and not finished, queued ones included. Exact when nothing is running; while fibers
  // spawn and finish it may count one that has just finished, never miss one alive that
  // descends from a spawn made before the call (stop() relies on that). See the definition.
  std::size_t live_fibers() const noexcept;
  SchedulerStats stats() const;
  void dump(std::ostream& out) const;

  const std::string& name() const noexcept { return name_; }
  // Options::processors: started with the scheduler, never retire.
  uint32_t base_processors() const noexcept { return base_; }
  // Options::max_processors as resolved (>= base_processors()).
  uint32_t max_processors() const noexcept { return static_cast<uint32_t>(processors_.size()); }
  // Slots [0, processor_slots()) hold a Processor (running or not). Never shrinks.
  uint32_t processor_slots() const noexcept { return slots_.load(std::memory_order_acquire); }
  Processor& processor(uint32_t i) noexcept { return *processors_[i]; }
  // Monitor thread only: the processor of slot i (< max_processors()), made if needed.
  Processor& ensure_processor(uint32_t i);
  Idle& idle() noexcept { return idle_; }
  Injector& injector() noexcept { return injector_; }
  Registry& registry() noexcept { return registry_; }
  std::size_t default_stack_class() const noexcept { return default_stack_class_; }

  // A fiber made runnable from outside this scheduler's processors.
  void inject(Fiber* f) noexcept;
  // Wakes a sleeping processor if the idle rules say one should look for work.
  void notify_parked() noexcept;
  // The last searcher's check before sleeping: wake someone if any queue has work.
  void notify_if_work_pending() noexcept;

  // ---- watchdog (sched/monitor.hpp)
  // Processors blocked at the monitor's last sample; 0 without a monitor.
  uint32_t blocked_processors() const noexcept { return monitor_ ? monitor_->blocked_now() : 0; }
  int64_t retire_after_ns() const noexcept { return retire_after_ns_; }
  int64_t spin_ns() const noexcept { return spin_ns_; }  // Options::spin_before_sleep
  FiberReadHazard& hazard() noexcept { return hazard_; }
  // A processor is about to drop its reference to finished fiber `f`: wait while the monitor
  // reads it. A compiler barrier and one load when nothing is being read.
  void watchdog_may_free(const Fiber* f) const noexcept { hazard_.before_free(f); }
  // Zero without a monitor; extra_running is counted from the processors' states.
  WatchdogStats watchdog_stats() const noexcept;

 private:
  std::string name_;
  std::size_t default_stack_class_;
  uint32_t base_;
  int64_t retire_after_ns_;
  int64_t spin_ns_;
  Idle idle_;
  Injector injector_;
  mutable Registry registry_;  // mutable: dump() walks it under its locks
  FiberReadHazard hazard_;
  std::vector<std::unique_ptr<Processor>> processors_;  // max_processors() slots
  std::atomic<uint32_t> slots_{0};  // see processor_slots(); stored with release after the slot is made
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};
  // Foreign wakes in progress (see foreign_wake_begin). Incremented before the fiber is
  // published, so a stop() that saw the fiber finish also sees the increment.
  std::atomic<uint32_t> foreign_wakes_{0};
  std::atomic<uint64_t> foreign_spawned_{0};  // spawned from threads that are not our processors (see live_fibers())
  // Foreign spawns past their stopping() check and not yet counted. Invariant (a store-load
  // pair, hence seq_cst on both sides): a spawner increments this before it reads stopping_,
  // stop() stores stopping_ before it reads this; so either the spawner sees the flag and
  // throws, or stop() sees the spawn in flight and waits for it to be counted.
  std::atomic<uint32_t> foreign_spawns_{0};
  std::mutex stop_mu_;  // serialises stop() calls on this scheduler (one per scheduler: a fiber
                        // may stop another scheduler while a thread is stopping ours)

 public:
  // Every scheduler alive, newest first (fiber::dump, the dump signal, tools/gdb/libfiber.py).
  // GUARDED_BY(g_schedulers_mu) - see introspect.cpp.
  SchedulerImpl* next_scheduler_ = nullptr;
  SchedulerImpl* prev_scheduler_ = nullptr;
  // Last: destroyed first, while the processors it watches still exist.
  std::unique_ptr<Monitor> monitor_;
};

// Resolves Options::processors: explicit value, else $FIBER_PROCS, else hardware concurrency.
// Throws UsageError for 0 or an invalid $FIBER_PROCS.
std::size_t resolve_processor_count(std::size_t requested);

}  // namespace fiber::detail
