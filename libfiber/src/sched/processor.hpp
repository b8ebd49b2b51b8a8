// Processor: one thread running fibers (libgo's "Processer", Go's P+M, Tokio's worker).
//
// It owns a LocalQueue, a LIFO slot, a timer heap, a stack cache and a poller; it finds work in
// the order of DESIGN §5 (see find_work) and switches fiber to fiber directly, falling back to
// its own thread stack (the "loop context") only when there is nothing to run.
//
// Every switch carries a SwitchMsg to the context it resumes, and that context finishes the
// switch on the fiber that left: saves its context, then yields it (enqueue), parks it
// (publish), or frees its stack (finish). That is the two-phase park of invariant 1.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "context/stack.hpp"
#include "io/poller.hpp"
#include "sched/fiber.hpp"
#include "sched/injector.hpp"
#include "sched/local_queue.hpp"
#include "sched/timer.hpp"

namespace fiber::detail {

class SchedulerImpl;
using RunQueue = LocalQueue<Fiber, 256>;

class Processor {
 public:
  // Tuning (Tokio's defaults, rounded to powers of two for cheap masks).
  static constexpr uint32_t kEventInterval = 64;   // ticks between non-blocking I/O/timer polls
  static constexpr uint32_t kGlobalInterval = 32;  // ticks between injector-first picks
  static constexpr uint32_t kMaxLifoInARow = 3;    // LIFO picks before the queue gets a turn

  Processor(SchedulerImpl& sched, uint32_t index);
  ~Processor();
  Processor(const Processor&) = delete;
  Processor& operator=(const Processor&) = delete;

  void start();          // starts the thread; returns once its poller exists
  void request_shutdown() noexcept;
  void join();

  uint32_t index() const noexcept { return index_; }
  SchedulerImpl& sched() const noexcept { return sched_; }
  Fiber* current() const noexcept { return current_; }
  RunQueue::Stealer stealer() const noexcept { return stealer_; }
  TimerQueue& timers() noexcept { return timers_; }
  Poller& poller() noexcept { return *poller_; }
  uint64_t next_fiber_id() noexcept;

  // ---- Executed only by the running fiber of the calling thread's processor. Static because
  // the fiber may resume on another processor: they never use `this` after switching.
  static void yield_current(Processor* p);  // p: current_processor(), running a fiber
  // Parks the current fiber; its state is already Parking (waiter_prepare) and its wait is
  // visible to wakers. Returns when it has been unparked.
  static void park_current(ParkReason why) noexcept;
  [[noreturn]] static void finish_current() noexcept;

  // ---- Executed only by the owner thread (fiber or loop context).
  void schedule_local(Fiber* f) noexcept;  // a woken or new fiber: LIFO slot
  void schedule_yield(Fiber* f) noexcept;  // a yielding fiber: tail of the queue

  // ---- Any thread.
  void push_inbox(Fiber* f) noexcept;  // fibers pinned here, woken elsewhere
  void wake_thread() noexcept { poller_->wake(); }

 private:
  enum class After : uint8_t { Nothing, Yield, Park, Finish };
  struct SwitchMsg {
    Processor* p;  // the processor on which the switch happens
    Fiber* from;
    Fiber* to;
    After action;
  };

  static Processor* switch_to(Processor* p, Fiber* from, Fiber* to, After action) noexcept;
  static Processor* complete_switch(Transfer t) noexcept;
  static void fiber_main(Transfer t) noexcept;
  void release_finished(Fiber* f) noexcept;

  void thread_main();
  void run(Fiber* f) noexcept;               // from the loop context
  bool prepare_first_run(Fiber* f) noexcept;  // stack + context for a fiber's first run
  Fiber* find_work() noexcept;
  Fiber* find_work_slow() noexcept;
  Fiber* next_local() noexcept;
  Fiber* take_lifo() noexcept;
  Fiber* steal_work() noexcept;
  Fiber* refill_from_injector() noexcept;
  void found_work_while_searching() noexcept;
  bool maintenance() noexcept;  // timers, inbox; true if it made a fiber runnable
  bool drain_inbox() noexcept;
  bool has_local_work() const noexcept;
  void park_thread() noexcept;
  bool transition_to_parked() noexcept;
  bool transition_from_parked() noexcept;
  void check_stack(const Fiber* f) const noexcept;

  SchedulerImpl& sched_;
  const uint32_t index_;

  // ---- owner-only state
  Fiber* current_ = nullptr;  // the fiber running now (or &loop_ in the loop context)
  Fiber loop_;                // this thread's own stack as a switch target
  RunQueue queue_;
  uint32_t tick_ = 0;
  uint32_t lifo_in_a_row_ = 0;
  bool searching_ = false;  // mirrors our share of Idle's searching count
  uint32_t rng_;            // victim selection
  uint64_t id_next_ = 0, id_end_ = 0;  // block of fiber ids
  StackCache stacks_;

  // ---- shared state
  RunQueue::Stealer stealer_;
  // A woken fiber waiting to run next. Exchanged by the owner; (later) taken by the watchdog's
  // rescuers with an exchange too, so take and put are atomic RMWs.
  std::atomic<Fiber*> lifo_{nullptr};
  TimerQueue timers_;
  std::unique_ptr<Poller> poller_;  // created on the thread; immutable after start()
  std::mutex inbox_mu_;
  Fiber* inbox_head_ = nullptr;  // GUARDED_BY(inbox_mu_)
  Fiber* inbox_tail_ = nullptr;  // GUARDED_BY(inbox_mu_)
  std::atomic<bool> inbox_nonempty_{false};  // stored under inbox_mu_
  std::atomic<bool> shutdown_{false};
  std::thread thread_;
};

// Makes a parked fiber runnable (after its wait was claimed). Any thread.
void unpark(Fiber* f) noexcept;

}  // namespace fiber::detail
