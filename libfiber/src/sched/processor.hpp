// Processor: one thread running fibers (libgo's "Processer", Go's P+M, Tokio's worker).
//
// It owns a LocalQueue, a LIFO slot, a timer heap, a stack cache and a poller; it finds work in
// the order of DESIGN §5 (see find_work) and switches fiber to fiber directly, falling back to
// its own thread stack (the "loop context") only when there is nothing to run.
//
// Every switch carries a SwitchMsg to the context it resumes, and that context finishes the
// switch on the fiber that left: saves its context, then yields it (enqueue), parks it
// (publish), or frees its stack (finish). That is the two-phase park of invariant 1.
//
// For the watchdog (sched/monitor.hpp) every switch bumps `switches_` and publishes `current_`;
// another thread may read both at any time. That is all the switch path pays for it.
//
// Lifecycle: base processors start with the scheduler and run until it stops. Extra processors
// (index >= Options::processors) are started by the monitor when every processor is blocked,
// and retire - leave the idle state, free their poller and end their thread - after being
// parked for WatchdogOptions::retire_after with no processor blocked. The Processor object
// stays (its queues are empty), so a retired processor can be started again.
#pragma once

#include <sys/types.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "context/stack.hpp"
#include "io/poller.hpp"
#include "sched/claim_gate.hpp"
#include "sched/fiber.hpp"
#include "sched/injector.hpp"
#include "sched/local_queue.hpp"
#include "sched/owner_slot.hpp"
#include "sched/timer.hpp"
#include "fiber/stats.hpp"

namespace fiber::detail {

class SchedulerImpl;
using RunQueue = LocalQueue<Fiber, 256>;

// True once this process has started a processor thread (Scheduler::started_in_process).
bool processor_threads_started() noexcept;

// The C++ runtime's per-thread exception state: the exceptions being handled (what `throw;` and
// std::current_exception() see, innermost first) and the count std::uncaught_exceptions()
// returns. It is libstdc++'s and libc++abi's __cxa_eh_globals, whose layout is part of the
// Itanium C++ ABI on x86-64 and AArch64 (ARM EABI adds fields). A fiber that switches inside a
// catch block or while unwinding owns its part of it, so switch_to carries it, as it does
// errno: otherwise fibers catching on one thread pop each other's exceptions.
struct EhGlobals {
  void* caught_exceptions;
  unsigned int uncaught_exceptions;
};
#if defined(__ARM_EABI_UNWINDER__)
#error "EhGlobals mirrors the Itanium ABI's __cxa_eh_globals; ARM EABI's has more fields"
#endif

class Processor {
 public:
  // Tuning (Tokio's defaults, rounded to powers of two for cheap masks).
  static constexpr uint32_t kEventInterval = 64;   // ticks between non-blocking I/O/timer polls
  static constexpr uint32_t kGlobalInterval = 32;  // injector-first picks: 32 to 35 ticks apart
  static constexpr uint32_t kMaxLifoInARow = 3;    // LIFO picks before the queue gets a turn

  // Thread lifecycle, read by the monitor.
  enum class Life : uint8_t {
    Stopped,  // never started, or retired and joined
    Running,  // its thread runs the loop
    Exited,   // its thread has retired and ended; join() it
  };

  // `retirable`: an extra processor, which may retire when idle.
  Processor(SchedulerImpl& sched, uint32_t index, bool retirable);
  ~Processor();
  Processor(const Processor&) = delete;
  Processor& operator=(const Processor&) = delete;

  // Starts the thread; returns once its poller exists. Also restarts a Stopped processor.
  // Not concurrently with itself, join() or request_shutdown() on the same processor.
  void start();
  void request_shutdown() noexcept;
  void join();

  uint32_t index() const noexcept { return index_; }
  SchedulerImpl& sched() const noexcept { return sched_; }
  // The fiber running now, or loop_fiber(). Owner: exact. Others: a racy snapshot, see below.
  Fiber* current() const noexcept { return current_.load(std::memory_order_relaxed); }
  // The same, but nullptr while the loop runs: what current_fiber() returns on this thread.
  Fiber* running_fiber() const noexcept {
    Fiber* f = current();
    return f->is_loop ? nullptr : f;
  }
  // The gate to the plain claims of the waits biased to this processor (sched/claim_gate.hpp).
  ClaimGate& claim_gate() noexcept { return claim_gate_; }
  RunQueue::Stealer stealer() const noexcept { return stealer_; }
  TimerQueue& timers() noexcept { return timers_; }
  Poller& poller() noexcept { return *poller_; }
  // Any thread: whether its engine can be polled in a loop cheaply (Poller::polls_cheaply).
  bool polls_cheaply() const noexcept;
  uint64_t next_fiber_id() noexcept;

  // ---- For the monitor (any thread).
  // Switches so far. Loaded with acquire: pairs with the release store in switch_to, so the
  // current() read next is the fiber switched to by that switch or a later one.
  uint64_t switches() const noexcept { return switches_.load(std::memory_order_acquire); }
  const Fiber* loop_fiber() const noexcept { return &loop_; }
  Life life() const noexcept { return life_.load(std::memory_order_acquire); }
  int os_tid() const noexcept { return tid_.load(std::memory_order_relaxed); }
  // CPU time its thread has used, in ns; -1 if unknown (not running).
  int64_t thread_cpu_ns() const noexcept;
  // Its thread's spin-waits for a preempted thread (spin_wait_begin in detail/wait.hpp): since
  // when (steady_now_ns()) it has been in one, 0 if it is not; and the thread CPU time they have
  // used, the open one's up to `cpu` included, for `cpu` a thread_cpu_ns() reading taken now.
  int64_t spin_wait_since() const noexcept { return spin_wait_since_.load(std::memory_order_relaxed); }
  int64_t spin_wait_cpu(int64_t cpu) const noexcept {
    const int64_t v = spin_cpu_.load(std::memory_order_relaxed);
    return (v >> 1) + ((v & 1) != 0 ? cpu : 0);
  }
  // Its own thread, around a spin-wait's yields.
  void begin_spin_wait() noexcept;
  void end_spin_wait() noexcept;
  // Takes the fiber waiting in the LIFO slot, if any (the monitor moves it to the injector
  // while this processor is blocked).
  Fiber* steal_lifo() noexcept;
  // Takes the fiber waiting in the yield slot, if any (the same rescue).
  Fiber* steal_yielded() noexcept { return yielded_.steal(); }
  bool lifo_occupied() const noexcept { return lifo_.occupied(); }
  bool yielded_occupied() const noexcept { return yielded_.occupied(); }
  std::size_t pinned_queued() const noexcept { return pinned_len_.load(std::memory_order_relaxed); }  // racy
  bool inbox_pending() const noexcept { return inbox_nonempty_.load(std::memory_order_acquire); }

  // ---- Executed only by the running fiber of the calling thread's processor. Static because
  // the fiber may resume on another processor: they never use `this` after switching.
  static void yield_current(Processor* p);  // p: current_processor(), running a fiber
  // Parks the current fiber; its state is already Parking (waiter_prepare) and its wait is
  // visible to wakers. Returns when it has been unparked.
  static void park_current(ParkReason why) noexcept;
  // Pins the current fiber to `home` (as PinGuard does) and moves it there if it runs
  // elsewhere: through home's inbox, after the switch away. The I/O engine uses it to withdraw
  // an operation on the processor that owns it. Undo with unpin_current().
  static void move_current_to(Processor* home) noexcept;
  static void unpin_current() noexcept;

  // ---- Counters (fiber/stats.hpp). Owner-written; stats() reads them from any thread. The
  // spawn and finish counts also make SchedulerImpl::live_fibers(), which stop() waits on:
  // release stores (see there), taken before the fiber can run or be joined. A fiber is
  // counted where it is spawned and where it finishes, on lines no other processor writes.
  void count_spawn() noexcept { bump(spawned_, std::memory_order_release); }
  void count_finish() noexcept { bump(finished_, std::memory_order_release); }
  uint64_t spawned_count() const noexcept { return spawned_.load(std::memory_order_acquire); }
  uint64_t finished_count() const noexcept { return finished_.load(std::memory_order_acquire); }
  void stats_into(ProcessorStats& out) const noexcept;
  // The steady clock as of this processor's last look at it (at most kEventInterval switches or
  // one idle wait ago): what a fiber parking here records as the start of its wait.
  int64_t coarse_now_ns() const noexcept { return now_ns_.load(std::memory_order_relaxed); }

  // ---- Executed only by the owner thread (fiber or loop context).
  // A woken or new fiber: into the LIFO slot; the fiber it displaces goes to the back of the
  // queue (queue_back: the ring, or the pinned list). Inline: a channel ping-pong wakes twice
  // per round trip, and the out-of-line version saved and restored three registers for its
  // rare half.
  void schedule_local(Fiber* f) noexcept {
    if (Fiber* prev = lifo_.exchange(f)) [[unlikely]] requeue_displaced(prev);
  }
  // unpark() called by a fiber that is parking itself (user code in its window: a CondVar's
  // lock's unlock()) for a fiber still parking on another thread: it may not wait for that
  // switch, which could be waiting for ours. Queued through `next` (a claimed fiber is in no
  // queue) and woken once our window has ended: after our switch, or where it ends without one.
  void defer_wake(Fiber* f) noexcept {
    f->next = deferred_wakes_;
    deferred_wakes_ = f;
  }
  void wake_deferred() noexcept {
    if (deferred_wakes_ != nullptr) [[unlikely]] wake_deferred_now();
  }
  [[gnu::noinline]] void schedule_yield(Fiber* f) noexcept;  // a yielding fiber: tail of the queue
  void schedule_yielded(Fiber* f) noexcept;  // the same, or the yield slot: see there
  // block_on group counts, kept as a debt (sched/group.hpp). A member of `g` finished here.
  void group_member_done(Group* g) noexcept {
    if (g != debt_group_) {
      settle_group_debt();
      debt_group_ = g;
    }
    ++group_debt_;
  }
  // A member of `g` is being spawned here: true if it paid off a unit of our debt to `g`, and
  // the group's count must not be raised for it.
  bool group_member_spawned(Group* g) noexcept {
    if (g != debt_group_ || group_debt_ == 0) return false;
    --group_debt_;
    return true;
  }
  // Before running `next`: a debt to any other group is settled.
  void settle_group_debt_before(const Fiber* next) noexcept {
    if (group_debt_ != 0 && next->group != debt_group_) [[unlikely]] settle_group_debt_now();
  }
  // Any debt at all (thread sleeps or ends, fiber finished into the loop).
  void settle_group_debt() noexcept {
    if (group_debt_ != 0) [[unlikely]] settle_group_debt_now();
  }
  [[gnu::noinline]] void settle_group_debt_now() noexcept;

  // ---- Any thread.
  void push_inbox(Fiber* f) noexcept;  // fibers pinned here, woken elsewhere
  void wake_thread() noexcept { poller_->wake(); }

 private:
  enum class After : uint8_t { Nothing, Yield, Park, Finish, SendHome };
  struct SwitchMsg {
    Processor* p;  // the processor on which the switch happens
    Fiber* from;
    Fiber* to;
    After action;
  };

  static SwitchMsg prepare_switch(Processor* p, Fiber* from, Fiber* to, After action) noexcept;
  static Processor* switch_to(Processor* p, Fiber* from, Fiber* to, After action) noexcept;
  static Processor* switch_inline(Processor* p, Fiber* from, Fiber* to, After action) noexcept;  // switch_to, inline
  static Processor* complete_switch(Transfer t) noexcept;
  [[noreturn]] static void fiber_main(Transfer t) noexcept;
  FIBER_TSAN_OUT_OF_LINE static SwitchMsg fiber_body(Transfer t) noexcept;
  [[gnu::noinline]] void release_finished(Fiber* f) noexcept;
  [[gnu::noinline]] void publish_parked(Fiber* f) noexcept;

  void thread_main();
  void run(Fiber* f) noexcept;               // from the loop context
  bool prepare_first_run(Fiber* f) noexcept;  // stack + context for a fiber's first run
  template <bool kParking = false>
  Fiber* find_work() noexcept;
  template <bool kParking = false>
  Fiber* next_to_run_after(const Fiber* self) noexcept;  // yield/park/move/finish: see there
  [[gnu::noinline]] void wake_deferred_now() noexcept;
  // schedule_local's other half: `prev`, put out of the LIFO slot, to the back of the queue.
  [[gnu::noinline]] void requeue_displaced(Fiber* prev) noexcept;
  // next_to_run_after's pick that the loop must run: to the LIFO slot; returns the loop. Out of
  // line, so that the inline schedule_local costs the parking path no registers.
  [[gnu::noinline]] Fiber* leave_to_loop(Fiber* f) noexcept;
  [[gnu::noinline]] Fiber* find_work_slow() noexcept;
  Fiber* next_local() noexcept;
  Fiber* take_lifo() noexcept;
  // queue_.pop(), and a prefetch of the control block of the fiber queued after it. Fibers of a
  // spawn tree or a burst wait long enough for their control blocks to leave the cache; the
  // next one's misses then overlap with the run of this one (skynet_1t 9% faster).
  Fiber* pop_queue() noexcept {
    Fiber* f = queue_.pop();
    if (f != nullptr) {
      if (const Fiber* n = queue_.peek()) {
        const char* p = reinterpret_cast<const char*>(n);
        __builtin_prefetch(p, 1);
        __builtin_prefetch(p + 64, 1);
        __builtin_prefetch(p + 128, 1);
      }
    }
    return f;
  }
  // The queue's pick, the yield slot being the queue's tail: its fiber once the fibers queued
  // ahead of it when it yielded have had their picks (yielded_due_); else, at every other pick
  // while it has any and whenever the ring is empty, the pinned queue's head (a turn of its own,
  // not the tick's parity, which LIFO picks in between can hold at one phase for good); else
  // the ring's head; else the slot's fiber anyway.
  Fiber* take_queued() noexcept {
    if (yielded_.occupied_for_owner() && static_cast<int32_t>(tick_ - yielded_due_) >= 0) return yielded_.take();
    if (pinned_head_ != nullptr) [[unlikely]] {
      pinned_turn_ = !pinned_turn_;
      if (pinned_turn_ || !queue_.has_tasks()) return take_pinned();
    }
    if (Fiber* f = pop_queue()) return f;
    return yielded_.take();
  }
  // To the back of the queue: the ring, or the pinned queue for a fiber pinned here. True when
  // it went to the ring, where another processor may take it (the caller may wake one).
  bool queue_back(Fiber* f) noexcept;
  Fiber* take_pinned() noexcept {
    Fiber* f = pinned_head_;
    pinned_head_ = f->next;
    if (pinned_head_ == nullptr) pinned_tail_ = nullptr;
    pinned_len_.store(pinned_len_.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
    return f;
  }
  // kGlobalInterval picks have passed since next_local() last read the injector first.
  bool injector_due(uint32_t tick) const noexcept { return tick - last_injector_tick_ >= kGlobalInterval; }
  bool injector_due() const noexcept { return injector_due(tick_); }
  Fiber* steal_work() noexcept;
  Fiber* refill_from_injector() noexcept;
  void found_work_while_searching(bool elsewhere) noexcept;
  void stop_searching() noexcept;  // found nothing and carries on running: leave the search
  bool maintenance() noexcept;  // timers, inbox; true if it made a fiber runnable
  bool drain_inbox() noexcept;
  bool has_local_work() const noexcept;
  Fiber* spin_for_work() noexcept;
  void park_thread() noexcept;
  bool transition_to_parked() noexcept;
  bool transition_from_parked() noexcept;
  bool try_retire() noexcept;
  void check_stack(const Fiber* f) const noexcept;
  // Single writer (the owner): a plain load and store, no locked instruction.
  static void bump(std::atomic<uint64_t>& c, std::memory_order order = std::memory_order_relaxed) noexcept {
    c.store(c.load(std::memory_order_relaxed) + 1, order);
  }
  // A scheduling point that is not a switch (a yield with nothing else to run).
  // Release pairs with the monitor's acquire in switches().
  void count_switch() noexcept { bump(switches_, std::memory_order_release); }

  SchedulerImpl& sched_;
  const uint32_t index_;
  const bool retirable_;

  // ---- written by the owner on every switch, read by the monitor. Own cache line: the
  // monitor's reads then cost the owner one miss per sample, and nothing else is disturbed.
  // current_: relaxed stores and loads compile to plain moves, as the former plain pointer did.
  alignas(64) std::atomic<Fiber*> current_{nullptr};  // the fiber running now, or &loop_
  std::atomic<uint64_t> switches_{0};                  // see count_switch()

  // ---- owner-only state
  alignas(64) Fiber loop_;  // this thread's own stack as a switch target
  ClaimGate claim_gate_;    // owner-written busy flag; closed by other threads, rarely
  int* errno_ = nullptr;    // this thread's errno (switch_to saves and restores it per fiber)
  EhGlobals* eh_ = nullptr;  // this thread's exception state (likewise: see EhGlobals)
  RunQueue queue_;
  uint32_t tick_ = 0;
  uint32_t last_injector_tick_ = 0;  // tick_ when next_local() last read the injector first
  uint32_t lifo_in_a_row_ = 0;
  uint32_t yielded_due_ = 0;  // the tick from which the yield slot's fiber goes before the queue
  // defer_wake(), linked through Fiber::next. Owner thread only; empty whenever no window is
  // open on this processor (drained by publish_parked, park_current's no-switch path,
  // waiter_abandon's and fiber_wait's own claims).
  Fiber* deferred_wakes_ = nullptr;
  // Runnable fibers pinned to this processor (yielded, woken here, back from the inbox), in
  // order, linked through Fiber::next. In the ring a thief would take one, find it pinned
  // elsewhere and send it back through the inbox: a wake, a steal and a locked push for
  // nothing. No thief sees this queue, and nobody is woken for what only we may run.
  Fiber* pinned_head_ = nullptr;
  Fiber* pinned_tail_ = nullptr;
  bool pinned_turn_ = false;  // whose turn the next queue pick is, while both have fibers
  // Counted among the fibers queued ahead of a yield (yielded_due_); read racily by stats and
  // the watchdog's report, hence atomic (owner-written, relaxed).
  std::atomic<uint32_t> pinned_len_{0};
  bool searching_ = false;  // mirrors our share of Idle's searching count
  bool retired_ = false;    // try_retire() succeeded: leave the loop
  uint32_t rng_;            // victim selection
  uint64_t id_next_ = 0, id_end_ = 0;  // block of fiber ids
  std::optional<StackCache> stacks_;   // made when the thread starts, emptied when it retires
  // Members of debt_group_ that finished here, not yet taken off its count. Nonzero only while
  // this thread runs a fiber of that group or is between two of them: settled before it runs
  // anything else (next_to_run_after, run), when a fiber finishes into the loop
  // (release_finished), before it sleeps (park_thread), and when it ends.
  Group* debt_group_ = nullptr;
  std::size_t group_debt_ = 0;
  Fiber* refill_scratch_[RunQueue::capacity() / 2];  // refill_from_injector's batch (owner only)
  // Counters for stats(): single writer (the owner), relaxed (spawned_ and finished_: release,
  // see count_spawn()); readers may see them a few events apart from each other.
  std::atomic<uint64_t> steals_{0}, spawned_{0}, finished_{0};
  std::atomic<uint64_t> sleeps_{0}, wakeups_{0};  // see ProcessorStats
  std::atomic<uint64_t> parks_[kParkReasons] = {};
  std::atomic<int64_t> now_ns_{0};  // see coarse_now_ns()

  // ---- shared state
  RunQueue::Stealer stealer_;
  // A woken fiber waiting to run next. The owner puts and takes; the monitor steals when this
  // processor is blocked (steal_lifo). See sched/owner_slot.hpp.
  OwnerSlot lifo_;
  // The fiber that yielded last, when no other processor could take it sooner (see
  // schedule_yielded): in effect the tail of the queue, but put and taken without a locked
  // instruction. The owner puts and takes; the monitor steals. See sched/owner_slot.hpp.
  OwnerSlot yielded_;
  TimerQueue timers_;
  // Created on the thread when it starts, destroyed by it when it retires, both under life_mu_.
  // Wakers reach it only through the idle state, which keeps a retiring processor waiting
  // until they are done (Idle::retire).
  std::unique_ptr<Poller> poller_;
  mutable std::mutex life_mu_;  // poller_ creation/destruction vs request_shutdown(), stats_into()
  // I/O counts of pollers this processor had before it last retired. GUARDED_BY(life_mu_).
  uint64_t io_submitted_retired_ = 0, io_completed_retired_ = 0;
  std::mutex inbox_mu_;
  Fiber* inbox_head_ = nullptr;  // GUARDED_BY(inbox_mu_)
  Fiber* inbox_tail_ = nullptr;  // GUARDED_BY(inbox_mu_)
  std::atomic<bool> inbox_nonempty_{false};  // stored under inbox_mu_
  std::atomic<bool> shutdown_{false};
  std::atomic<Life> life_{Life::Stopped};
  std::atomic<int> tid_{0};            // OS thread id while running
  // Written only by its own thread, around a spin-wait's yields; read by the monitor. Relaxed:
  // each is one word read whole, and nothing else is published through them. spin_cpu_ is
  // 2 * a + open: closed, `a` is the thread CPU time of the waits so far; open, it is that total
  // less the CPU clock at the wait's start, so that a + the clock now is the total now - one
  // word, no torn pair. A reader's clock reading and its load of the word differ by the
  // thread's CPU time between the two, microseconds.
  std::atomic<int64_t> spin_wait_since_{0};
  std::atomic<int64_t> spin_cpu_{0};
  std::atomic<int> cpu_clock_{0};      // its CPU-time clock (a clockid_t) while running
  std::thread thread_;
};

// Makes a parked fiber runnable (after its wait was claimed). Any thread.
void unpark(Fiber* f) noexcept;
// unpark() for each fiber of a chain linked through Fiber::next (claimed fibers, in no queue).
void unpark_chain(Fiber* head) noexcept;

}  // namespace fiber::detail
