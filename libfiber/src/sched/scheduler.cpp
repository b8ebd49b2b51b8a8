#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "context/stack.hpp"
#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
#include "io/blocking_pool.hpp"
#include "sched/env.hpp"
#include "sched/runtime.hpp"
#include "sched/scheduler_impl.hpp"

namespace fiber {
namespace detail {

std::size_t resolve_processor_count(std::size_t requested) {
  if (requested != Scheduler::auto_processors) {
    if (requested == 0) throw UsageError("fiber::Scheduler: a scheduler needs at least one processor (got 0)");
    if (requested > 1024) {
      throw UsageError("fiber::Scheduler: " + std::to_string(requested) + " processors is more than the limit of 1024");
    }
    return requested;
  }
  if (const auto v = env_in_range("FIBER_PROCS", 1, 1024, "an integer from 1 to 1024")) {
    return static_cast<std::size_t>(*v);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? hw : 1;
}

namespace {

std::size_t resolve_stack_size(std::size_t requested) {
  if (requested != 0) return stack_size_class(requested);
  static_assert(kMaxStackSize <= static_cast<std::size_t>(LONG_MAX), "env_in_range parses a long");
  if (const auto v = env_in_range("FIBER_STACK_SIZE", static_cast<long>(kMinStackSize), static_cast<long>(kMaxStackSize),
                                  "bytes from 2048 to 1073741824")) {
    return stack_size_class(static_cast<std::size_t>(*v));
  }
  return kDefaultStackSize;
}

// Options::max_processors as resolved: at least `base`, at most 1024.
uint32_t resolve_max_processors(std::size_t requested, uint32_t base) {
  if (requested > 1024) {
    throw UsageError("fiber::Scheduler: max_processors " + std::to_string(requested) +
                     " is more than the limit of 1024");
  }
  return static_cast<uint32_t>(std::max<std::size_t>(requested, base));
}

// Options::spin_before_sleep as resolved, in ns: -1 reads $FIBER_SPIN_US (microseconds).
int64_t resolve_spin_ns(std::chrono::microseconds requested) {
  constexpr long kMaxUs = 1'000'000;
  if (requested.count() != -1) {
    if (requested.count() < 0 || requested.count() > kMaxUs) {
      throw UsageError("fiber::Scheduler: spin_before_sleep " + std::to_string(requested.count()) +
                       " us is outside 0 to 1 s (-1: $FIBER_SPIN_US)");
    }
    return requested.count() * 1000;
  }
  const auto v = env_in_range("FIBER_SPIN_US", 0, kMaxUs, "microseconds from 0 to 1000000");
  return v ? static_cast<int64_t>(*v) * 1000 : 0;
}

// Checks the watchdog options; returns retire_after in ns.
int64_t checked_retire_after_ns(const WatchdogOptions& w) {
  if (w.enabled) {
    if (w.interval.count() <= 0) throw UsageError("fiber::Scheduler: watchdog.interval must be positive");
    if (w.threshold.count() <= 0) throw UsageError("fiber::Scheduler: watchdog.threshold must be positive");
    if (w.retire_after.count() < 0) throw UsageError("fiber::Scheduler: watchdog.retire_after must not be negative");
  }
  return watchdog_ns(w.retire_after);
}

}  // namespace

SchedulerImpl::SchedulerImpl(const Scheduler::Options& o)
    : name_(o.name.empty() ? "fiber" : o.name),
      default_stack_class_(resolve_stack_size(o.stack_size)),
      base_(static_cast<uint32_t>(resolve_processor_count(o.processors))),
      retire_after_ns_(checked_retire_after_ns(o.watchdog)),
      spin_ns_(resolve_spin_ns(o.spin_before_sleep)),
      idle_(base_, resolve_max_processors(o.max_processors, base_)),
      registry_(resolve_max_processors(o.max_processors, base_)),
      processors_(resolve_max_processors(o.max_processors, base_)) {
  // Variables read later, by process-wide parts, are checked here, where a bad one is reported to
  // the code that constructs the scheduler.
  Poller::validate_env();
  (void)parse_guarded_stacks(std::getenv("FIBER_GUARDED_STACKS"));
  (void)parse_blocking_threads(std::getenv("FIBER_BLOCKING_THREADS"));
  decide_wait_start();  // before any processor thread exists: they read it without a lock
  if (o.watchdog.enabled) {
    hazard_.enable();  // before any processor thread exists: they read it without a lock
    monitor_ = std::make_unique<Monitor>(*this, o.watchdog);
  }
  for (uint32_t i = 0; i < base_; ++i) processors_[i] = std::make_unique<Processor>(*this, i, false);
  slots_.store(base_, std::memory_order_release);
  uint32_t started = 0;
  try {
    for (; started < base_; ++started) processors_[started]->start();
    if (monitor_) monitor_->start();
    register_scheduler(this);
  } catch (...) {
    if (monitor_) monitor_->stop();
    for (uint32_t i = 0; i < started; ++i) processors_[i]->request_shutdown();
    for (uint32_t i = 0; i < started; ++i) processors_[i]->join();
    throw;
  }
}

SchedulerImpl::~SchedulerImpl() {
  unregister_scheduler(this);
  stop();
}

Processor& SchedulerImpl::ensure_processor(uint32_t i) {
  if (!processors_[i]) processors_[i] = std::make_unique<Processor>(*this, i, i >= base_);
  // Slots are taken lowest first, so this extends the range by one; release publishes the
  // Processor to every thread that iterates slots.
  if (slots_.load(std::memory_order_relaxed) <= i) slots_.store(i + 1, std::memory_order_release);
  return *processors_[i];
}

WatchdogStats SchedulerImpl::watchdog_stats() const noexcept {
  if (!monitor_) return {};
  WatchdogStats s = monitor_->stats();
  const uint32_t n = processor_slots();
  for (uint32_t i = base_; i < n; ++i) {
    if (processors_[i]->life() == Processor::Life::Running) ++s.extra_running;
  }
  return s;
}

void SchedulerImpl::inject(Fiber* f) noexcept {
  injector_.push(f);
  notify_parked();
}

void SchedulerImpl::notify_parked() noexcept {
  if (auto id = idle_.processor_to_notify()) {
    processors_[*id]->wake_thread();
    idle_.wake_done(*id);
  }
}

void SchedulerImpl::notify_if_work_pending() noexcept {
  const uint32_t n = processor_slots();
  for (uint32_t i = 0; i < n; ++i) {
    if (!processors_[i]->stealer().is_empty()) {
      notify_parked();
      return;
    }
  }
  if (!injector_.empty()) notify_parked();
}

// Finish counts first, then spawn counts. A finish read here (acquire; the counters are
// stored with release) brings along everything before it: the fiber's own spawn and every
// spawn it made while it ran, on whatever processor (the slot count is read again for that).
// So no fiber counts less than zero, and one counted as finished has its children counted as
// spawned: down the tree of any spawn that happened before this call, the sum stays above zero
// while one of them is unfinished. stop() relies on that - each fiber descends from a spawn
// made before stop(). A spawn from outside racing stop() is counted before stop() gets here
// (foreign_spawns_), and a fiber counts as finished only once its unhandled-exception handler,
// which may spawn, has returned. While fibers come and go the sum may count one that has just
// finished.
std::size_t SchedulerImpl::live_fibers() const noexcept {
  uint64_t finished = 0;
  for (uint32_t i = 0, n = processor_slots(); i < n; ++i) finished += processors_[i]->finished_count();
  uint64_t spawned = foreign_spawned_.load(std::memory_order_acquire);
  for (uint32_t i = 0, n = processor_slots(); i < n; ++i) spawned += processors_[i]->spawned_count();
  return spawned > finished ? static_cast<std::size_t>(spawned - finished) : 0;
}

void SchedulerImpl::foreign_spawn_begin() {
  foreign_spawns_.fetch_add(1, std::memory_order_seq_cst);
  if (stopping_.load(std::memory_order_seq_cst)) {
    UsageError stopped("fiber::spawn: scheduler '" + name_ + "' is stopped");
    foreign_spawn_end();  // our last touch: stop() may go on, and the scheduler go away
    throw stopped;
  }
}

void SchedulerImpl::stop() {
  if (stopped_.load(std::memory_order_acquire)) return;
  if (Fiber* f = current_fiber(); f != nullptr && f->sched == this) {
    throw UsageError("fiber::Scheduler::stop: called from a fiber of scheduler '" + name_ +
                     "'; it would wait for itself");
  }
  std::lock_guard lock(stop_mu_);
  if (stopped_.load(std::memory_order_acquire)) return;
  stopping_.store(true, std::memory_order_seq_cst);
  // Spawns from outside that passed their check before the store above: let them be counted
  // (foreign_spawns_). They take microseconds; their fibers cancel themselves when they list
  // themselves (list_self).
  while (foreign_spawns_.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  // Cancel everything alive until nothing is: fibers spawned while unwinding get cancelled on
  // a later round. Fibers list themselves only at their first cancellation point or switch
  // away (ensure_listed): one not listed yet, queued or running, cancels itself when it lists
  // itself (list_self lists before it looks at stopping(): either this loop finds it listed or
  // it sees the flag). Backs off from 50 us to 5 ms between rounds.
  auto pause = std::chrono::microseconds(50);
  while (live_fibers() != 0) {
    // One fence for the whole round, not one membarrier per fiber (fiber_cancel). Were it
    // refused, the next round's claims find any wait this one missed.
    registry_.for_each([](Fiber* f) { fiber_cancel_mark(f); });
    (void)fiber_cancel_fence();
    // Claimed under the shard locks, woken after them: a wake may wait for a fiber still
    // switching away (unpark), and no waker may wait holding a lock a window can take (a
    // fiber's window takes a shard lock when it lists itself at its first park). A claimed
    // fiber cannot resume until woken, so it stays listed and alive, and its queue link is
    // free (only the claimer enqueues it): the claimed are chained through it.
    Fiber* claimed = nullptr;
    registry_.for_each([&claimed](Fiber* f) {
      if (!fiber_cancel_try_claim(f)) return;
      f->next = claimed;
      claimed = f;
    });
    unpark_chain(claimed);
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
  }
  // The monitor keeps watching until every fiber is gone (a blocked processor may hold fibers
  // that must run to unwind), then stops before the processors, so it starts none of them.
  if (monitor_) monitor_->stop();
  const uint32_t n = processor_slots();
  for (uint32_t i = 0; i < n; ++i) processors_[i]->request_shutdown();
  for (uint32_t i = 0; i < n; ++i) processors_[i]->join();
  // A waker from outside may still be inside inject()/push_inbox() for a fiber that has since
  // finished: let it leave before the processors and queues go away.
  while (foreign_wakes_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  stopped_.store(true, std::memory_order_release);
}

}  // namespace detail

Scheduler::Scheduler() : Scheduler(Options{}) {}

Scheduler::Scheduler(Options options) : impl_(new detail::SchedulerImpl(options)) {}

Scheduler::~Scheduler() {
  impl_->stop();
  delete impl_;
}

void Scheduler::stop() { impl_->stop(); }

std::size_t Scheduler::processors() const noexcept { return impl_->base_processors(); }

std::chrono::microseconds Scheduler::spin_before_sleep() const noexcept {
  // Processor 0 is a base processor: its thread and engine live as long as the scheduler runs.
  if (impl_->spin_ns() == 0 || !impl_->processor(0).polls_cheaply()) return std::chrono::microseconds{0};
  return std::chrono::microseconds{impl_->spin_ns() / 1000};
}

std::size_t Scheduler::extra_processors() const noexcept { return impl_->watchdog_stats().extra_running; }

std::uint64_t Scheduler::blocked_incidents() const noexcept { return impl_->watchdog_stats().incidents; }

WatchdogStats Scheduler::watchdog_stats() const noexcept { return impl_->watchdog_stats(); }

const std::string& Scheduler::name() const noexcept { return impl_->name(); }

std::size_t Scheduler::live_fibers() const noexcept { return impl_->live_fibers(); }

bool Scheduler::started_in_process() noexcept { return detail::processor_threads_started(); }

Scheduler& Scheduler::global() {
  // Never destroyed: fibers may run while static destructors do (like Go's runtime at exit).
  static Scheduler* s = new Scheduler(Options{.name = "fiber"});
  return *s;
}

}  // namespace fiber
