// The processor loop, the switch protocol and park/unpark. The essay is libfiber/README.md;
// the short version:
//
//   loop:  find_work() -> run it | park the thread in the poller
//   yield: find_work() -> switch to it, the other side enqueues us at the tail (or the yield slot)
//   park:  find_work<true>() (the cheap picks) -> switch to it (or to the loop), the other side
//          publishes us as Parked
//
// find_work() (DESIGN §5): tick; every kEventInterval ticks poll timers/inbox; the LIFO slot (at
// most kMaxLifoInARow times in a row); once due (kGlobalInterval ticks since the last time) the
// injector first; the yield slot once due; the local queue; the yield slot; a batch from the
// injector; steal half from a victim; poll again; nothing.
#include "sched/processor.hpp"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cxxabi.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "fiber/error.hpp"
#include "sched/group.hpp"
#include "sched/runtime.hpp"
#include "sched/scheduler_impl.hpp"

// This thread's processor (current_processor() in sched/fiber.hpp), or nullptr. Initial-exec
// (fiber.hpp's declaration): a %fs-relative load instead of a __tls_get_addr call.
// `used`: on x86-64 only asm reads it, and GCC may drop or rename a variable that only asm names.
__attribute__((used, tls_model("initial-exec"), visibility("hidden"))) __thread fiber::detail::Processor*
    fiber_detail_t_processor = nullptr;
namespace fiber::detail {

#if !defined(__x86_64__)
// Non-inlined on purpose (invariant 3): each call reads this thread's slot afresh.
__attribute__((noinline)) Processor* current_processor() noexcept {
  asm volatile("" ::: "memory");
  return fiber_detail_t_processor;
}
#endif
__attribute__((noinline)) Fiber* current_fiber() noexcept {
  Processor* p = current_processor();
  return p != nullptr ? p->running_fiber() : nullptr;
}
__attribute__((noinline)) void set_current_processor(Processor* p) noexcept { fiber_detail_t_processor = p; }

Processor::Processor(SchedulerImpl& sched, uint32_t index, bool retirable)
    : sched_(sched),
      index_(index),
      retirable_(retirable),
      rng_(index * 2654435761u + 1),
      stealer_(queue_.stealer()) {
  loop_.is_loop = true;
  loop_.state.store(FiberState::Running, std::memory_order_relaxed);
  current_.store(&loop_, std::memory_order_relaxed);
}

Processor::~Processor() = default;

uint64_t Processor::next_fiber_id() noexcept {
  if (id_next_ == id_end_) {
    id_next_ = allocate_fiber_ids(1024);
    id_end_ = id_next_ + 1024;
  }
  return id_next_++;
}

// ------------------------------------------------------------------------------ thread

namespace {
// Set before the first processor thread is created, never cleared (a forked child inherits it):
// see Scheduler::started_in_process.
std::atomic<bool> g_processor_threads_started{false};
}  // namespace

bool processor_threads_started() noexcept { return g_processor_threads_started.load(std::memory_order_relaxed); }

void Processor::start() {
  g_processor_threads_started.store(true, std::memory_order_relaxed);
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  std::exception_ptr error;
  retired_ = false;  // the thread is not running: nobody else reads it now
  life_.store(Life::Running, std::memory_order_release);
  auto body = [&] {
    bool ok = true;
    try {
      auto poller = Poller::create();
      std::lock_guard lock(life_mu_);
      poller_ = std::move(poller);
    } catch (...) {
      error = std::current_exception();
      ok = false;
    }
    {
      // Notify under the lock, and touch nothing of start()'s after it: start() may return (and
      // its locals vanish) as soon as it sees `ready`.
      std::lock_guard lock(mu);
      ready = true;
      cv.notify_one();
    }
    if (ok) thread_main();
  };
  try {
    thread_ = std::thread(body);
  } catch (...) {
    // No thread (EAGAIN: a thread or pid limit): Stopped again. Left Running, the monitor would
    // take it for a live one and never restart it for a pinned fiber waiting in its inbox.
    life_.store(Life::Stopped, std::memory_order_release);
    throw;
  }
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return ready; });
  if (error) {
    lock.unlock();
    thread_.join();
    life_.store(Life::Stopped, std::memory_order_release);
    std::rethrow_exception(error);
  }
}

void Processor::request_shutdown() noexcept {
  std::lock_guard lock(life_mu_);  // a retiring thread may be destroying its poller
  shutdown_.store(true, std::memory_order_release);
  if (poller_) poller_->wake();
}

void Processor::join() {
  if (thread_.joinable()) thread_.join();
  life_.store(Life::Stopped, std::memory_order_release);
}

int64_t Processor::thread_cpu_ns() const noexcept {
  if (tid_.load(std::memory_order_relaxed) == 0) return -1;
  timespec ts;
  // A thread CPU clock of this process; fails (EINVAL) once the thread has ended.
  if (clock_gettime(static_cast<clockid_t>(cpu_clock_.load(std::memory_order_relaxed)), &ts) != 0) return -1;
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void Processor::begin_spin_wait() noexcept {
  const int64_t closed = spin_cpu_.load(std::memory_order_relaxed) >> 1;
  spin_cpu_.store((closed - thread_cpu_ns()) * 2 + 1, std::memory_order_relaxed);
  spin_wait_since_.store(steady_now_ns(), std::memory_order_relaxed);
}

void Processor::end_spin_wait() noexcept {
  const int64_t open = spin_cpu_.load(std::memory_order_relaxed) >> 1;
  spin_cpu_.store((open + thread_cpu_ns()) * 2, std::memory_order_relaxed);
  spin_wait_since_.store(0, std::memory_order_relaxed);
}

void spin_wait_begin() noexcept {
  if (Processor* p = current_processor()) p->begin_spin_wait();
}

void spin_wait_end() noexcept {
  if (Processor* p = current_processor()) p->end_spin_wait();
}

void* install_overflow_handler_on_this_thread() noexcept;  // overflow.cpp
void remove_overflow_altstack(void* mem) noexcept;

void Processor::thread_main() {
  set_current_processor(this);
  errno_ = &errno;
  // Like __errno_location(), __cxa_get_globals() is declared `const`: read once per thread.
  eh_ = reinterpret_cast<EhGlobals*>(abi::__cxa_get_globals());
  void* altstack = install_overflow_handler_on_this_thread();
  loop_.san.on_thread();
  const std::string tname = (sched_.name() + "-P" + std::to_string(index_)).substr(0, 15);
  pthread_setname_np(pthread_self(), tname.c_str());
  clockid_t cpu_clock;
  if (pthread_getcpuclockid(pthread_self(), &cpu_clock) == 0) {
    cpu_clock_.store(static_cast<int>(cpu_clock), std::memory_order_relaxed);
    tid_.store(static_cast<int>(::syscall(SYS_gettid)), std::memory_order_relaxed);
  }
  stacks_.emplace();
  if (retirable_) sched_.idle().add_processor();  // base processors are counted from the start

  while (!shutdown_.load(std::memory_order_acquire) && !retired_) {
    if (Fiber* f = find_work()) {
      run(f);
    } else if (Fiber* f = spin_for_work()) {
      run(f);
    } else {
      park_thread();
    }
  }
  settle_group_debt();
  if (searching_) {
    sched_.idle().transition_from_searching();
    searching_ = false;
  }
  stacks_.reset();  // back to the global pool
  remove_overflow_altstack(altstack);
  tid_.store(0, std::memory_order_relaxed);
  set_current_processor(nullptr);
  if (retired_) {
    {
      std::lock_guard lock(life_mu_);
      io_submitted_retired_ += poller_->submitted();
      io_completed_retired_ += poller_->completed();
      poller_.reset();
    }
    // Last touch of this object by this thread: the monitor joins it, and may start it again.
    life_.store(Life::Exited, std::memory_order_release);
  }
}

// ------------------------------------------------------------------------------ switching

void Processor::check_stack(const Fiber* f) const noexcept {
  if (!f->stack.redzone_intact()) report_stack_overflow(f, "its red zone was written");
}

// The half of a switch made before the jump: `to` becomes the processor's current fiber, and
// the message that whoever resumes finishes the switch with (complete_switch).
[[gnu::always_inline]] inline Processor::SwitchMsg Processor::prepare_switch(Processor* p, Fiber* from,
                                                                             Fiber* to, After action) noexcept {
  if (!from->is_loop) p->check_stack(from);
  if (!to->is_loop) {
    to->set_state(FiberState::Runnable, FiberState::Running);
    to->last_processor.store(static_cast<uint16_t>(p->index()), std::memory_order_relaxed);
  }
  p->current_.store(to, std::memory_order_relaxed);
  p->count_switch();  // all the watchdog costs a switch
  return SwitchMsg{p, from, to, action};
}

[[gnu::always_inline]] inline Processor* Processor::switch_inline(Processor* p, Fiber* from, Fiber* to, After action) noexcept {
  SwitchMsg msg = prepare_switch(p, from, to, action);
  // errno belongs to the fiber: saved here, restored on whichever thread resumes us. Through
  // each processor's cached errno address, not `errno`: glibc declares __errno_location()
  // `const`, so the compiler could reuse the old thread's address after the jump.
  const int saved_errno = *p->errno_;
  // The exceptions being handled, and uncaught_exceptions(), are the fiber's too (EhGlobals).
  // Invariant: between two contexts the thread's state is empty. A context that has some takes
  // it along and leaves it empty; one that has none (nearly every switch) reads two words.
  EhGlobals eh_storage;  // set only when used: `saved_eh` is the one word kept across the jump
  EhGlobals* saved_eh = nullptr;
  if (p->eh_->caught_exceptions != nullptr || p->eh_->uncaught_exceptions != 0) [[unlikely]] {
    eh_storage = std::exchange(*p->eh_, EhGlobals{});
    saved_eh = &eh_storage;
  }
  Transfer t = jump(to->ctx, from->san, to->san, &msg);
  // Resumed, possibly on another thread: everything below uses the processor from the message.
  Processor* now = complete_switch(t);
  *now->errno_ = saved_errno;
  if (saved_eh != nullptr) [[unlikely]] *now->eh_ = *saved_eh;
  return now;
}

// The switch for yields, first runs and the rest; a park has it inline (park_current).
Processor* Processor::switch_to(Processor* p, Fiber* from, Fiber* to, After action) noexcept {
  return switch_inline(p, from, to, action);
}

// Runs on the context that was switched to, finishing the switch for the one that left. Inline
// in switch_to and fiber_main, each action out of line: one function holding every case saved
// and restored six registers on every switch for the sake of the rare ones.
[[gnu::always_inline]] inline Processor* Processor::complete_switch(Transfer t) noexcept {
  const SwitchMsg m = *static_cast<SwitchMsg*>(t.data);  // copy: `from`'s stack may be reused below
  m.from->ctx = t.fctx;
  // A park first, and its common case in line: the switch of a channel ping-pong, where the
  // switch's compare chain and the call cost 8 of its 400 instructions per half round trip.
  if (m.action == After::Park) [[likely]] {
    if (m.from->state.load(std::memory_order_relaxed) == FiberState::Parking) [[likely]] {
      m.from->state.store(FiberState::Parked, std::memory_order_release);
      m.p->wake_deferred();
    } else {
      m.p->publish_parked(m.from);
    }
    return m.p;
  }
  switch (m.action) {
    case After::Nothing:
    case After::Park:
      break;
    case After::Yield:
      m.p->schedule_yielded(m.from);
      break;
    case After::Finish:
      m.p->release_finished(m.from);
      break;
    case After::SendHome:
      m.from->pinned->push_inbox(m.from);
      break;
  }
  return m.p;
}

// `f` has switched away to park: it is Parked from now on, unless a waker on this thread came
// while it was still switching away and left the enqueueing to us. A plain load and store: only
// this thread writes a Parking fiber's state (wakers on other threads wait for Parked, unpark).
// complete_switch makes the common case (Parking) in line and calls this for the rest.
void Processor::publish_parked(Fiber* f) noexcept {
  const FiberState s = f->state.load(std::memory_order_relaxed);
  if (s == FiberState::Parking) [[likely]] {
    f->state.store(FiberState::Parked, std::memory_order_release);
  } else {
    if (s != FiberState::Notified) f->bad_transition(s, FiberState::Parking, FiberState::Parked);
    f->state.store(FiberState::Runnable, std::memory_order_release);
    schedule_local(f);
  }
  wake_deferred();  // the wakes `f` made in its window (defer_wake)
}

void Processor::wake_deferred_now() noexcept {
  Fiber* chain = std::exchange(deferred_wakes_, nullptr);
  unpark_chain(chain);
}

void unpark_chain(Fiber* head) noexcept {
  while (Fiber* f = head) {
    head = f->next;
    f->next = nullptr;
    unpark(f);
  }
}

// A fiber's outermost frame, and the one that makes its last switch. That switch never returns,
// so neither do the frames under it: under TSan each would leave an entry on the shadow stack of
// the TSan context, which the next fiber on the recycled context would pile onto (65536 entries
// crash TSan). So this frame is not instrumented (FIBER_TSAN_UNINSTRUMENTED) and makes the last
// jump itself; the frame under it, fiber_body, is instrumented (every shared access is there)
// and returns before that jump.
FIBER_TSAN_UNINSTRUMENTED void Processor::fiber_main(Transfer t) noexcept {
  on_first_entry(static_cast<SwitchMsg*>(t.data)->from->san);
  SwitchMsg last = fiber_body(t);
  jump(last.to->ctx, last.from->san, last.to->san, &last, /*dying=*/true);
  __builtin_unreachable();
}

// A fiber's life up to its last switch, which it prepares: its message lives on in fiber_main's
// frame, on the dying stack, until the side switched to has copied it (complete_switch).
Processor::SwitchMsg Processor::fiber_body(Transfer t) noexcept {
  Fiber* self = static_cast<SwitchMsg*>(t.data)->to;
  complete_switch(t);  // a new fiber handles no exception yet: the switcher left none (switch_to)
  run_task(self);
  // Its FiberLocal values, on its own stack: a JoinHandle's fiber's now, before a join can
  // return; a detached fiber's in complete_fiber, after its unhandled-exception handler, which
  // may want them (a request id to log). Detached is final, so a relaxed look decides.
  if (fls_word(self) != nullptr && self->join_word.load(std::memory_order_relaxed) != Fiber::kJoinDetached) {
    fls_fiber_exit(self);
  }
  complete_fiber(self);  // counts the finish
  self->set_state(FiberState::Running, FiberState::Finished);  // only the fiber leaves Running
  // Read after complete_fiber: the unhandled-exception handler it may call can block, and the
  // fiber resume on another processor.
  Processor* p = current_processor();
  Fiber* next = p->next_to_run_after(self);
  return prepare_switch(p, self, next ? next : &p->loop_, After::Finish);
}

bool Processor::prepare_first_run(Fiber* f) noexcept {
  try {
    // Field by field, from the registers get() returns in. Stack is not a POD, so its
    // assignment copies only its 13 data bytes, never its tail padding; the compiler did that
    // as two overlapping 8-byte moves through the stack, whose reload stalled on store
    // forwarding (spawn_1t 91 -> 81 ns per fiber).
    const Stack st = stacks_->get(f->stack_size());
    f->stack.lo = st.lo;
    f->stack.size = st.size;
    f->stack.kind = st.kind;
  } catch (...) {
    // No stack: the fiber finishes with the error without ever running (join rethrows it).
    f->task()->error = std::current_exception();
    return false;
  }
  f->task()->error = nullptr;  // a failed earlier attempt (run() retries from the loop) is moot
  // Not listed yet (ensure_listed): if stop() has begun, the fiber cancels itself at its first
  // cancellation point or switch away.
  f->san.on_create(f->stack.lo, f->stack.size);
  fls_word(f) = nullptr;  // a recycled stack holds its last fiber's
  f->ctx = make_context(f->stack.top() - kStackTopReserve, f->stack.usable() - kStackTopReserve,
                        &Processor::fiber_main);
  return true;
}

void Processor::run(Fiber* f) noexcept {
  if (is_spawn_record(f)) {
    f = start_spawn_record(f, *this, RecordStart::OrReport);
    if (f == nullptr) return;  // no control block: reported and counted finished
  }
  if (f->pinned != nullptr && f->pinned != this) {
    f->pinned->push_inbox(f);
    return;
  }
  // Before anything of f's runs here, even a failed first run: its completion may call the
  // unhandled-exception handler.
  settle_group_debt_before(f);
  if (f->ctx == nullptr && !prepare_first_run(f)) {
    f->transition(FiberState::Runnable, FiberState::Running);
    complete_fiber(f);  // counts the finish
    f->transition(FiberState::Running, FiberState::Finished);
    drop_fiber_ref(f);
    return;
  }
  switch_to(this, &loop_, f, After::Nothing);
}

namespace {
// Compact stacks (below a page, no guard page; see "Stacks" in libfiber/README.md) hold the
// fiber's own frames and nothing more. The runtime's work around a switch - find_work(), which
// may poll the engine, steal and allocate stacks, and complete_switch(), which runs on the stack
// switched to - must not run there: a compact fiber always switches to and from the loop, whose
// stack is a thread's.
bool is_compact(const Fiber* f) noexcept { return f->stack.kind == StackKind::Compact; }
}  // namespace

// What a fiber leaving the CPU (yield, park, move, finish) switches to: find_work()'s pick,
// directly, when it can run from here. A pick pinned to another processor goes to that one's
// inbox, and we look again. A pick that has no stack yet and cannot get one, or a compact one,
// goes to the LIFO slot for the loop to finish or run, and we switch to the loop; so does a
// compact `self`, without looking. nullptr: nothing to run at all (for a park, kParking:
// nothing cheap to run; the loop looks further).
template <bool kParking>
[[gnu::always_inline]] inline Fiber* Processor::next_to_run_after(const Fiber* self) noexcept {
  if (is_compact(self)) return &loop_;
  for (;;) {
    Fiber* next = find_work<kParking>();
    if (next == nullptr) return nullptr;
    if (is_spawn_record(next)) {
      // In a park's window, which a waker on another thread waits out, only from the slot
      // cache: a control block that needs a slab carved (mmap, populate) or malloc is the
      // loop's to make, after the switch. Out of memory, the loop reports it.
      Fiber* started = start_spawn_record(next, *this, kParking ? RecordStart::CacheOnly : RecordStart::Allocate);
      if (started == nullptr) return leave_to_loop(next);
      next = started;
    }
    if (next->pinned != nullptr && next->pinned != this) [[unlikely]] {
      next->pinned->push_inbox(next);
      continue;
    }
    if ((next->ctx == nullptr && !prepare_first_run(next)) || is_compact(next)) [[unlikely]] {
      return leave_to_loop(next);  // any group debt is settled there (release_finished, run, park_thread)
    }
    settle_group_debt_before(next);
    return next;
  }
}

Fiber* Processor::leave_to_loop(Fiber* f) noexcept {
  schedule_local(f);
  return &loop_;
}

void Processor::yield_current(Processor* p) {
  Fiber* self = p->current();
  throw_if_cancelled(self);
  Fiber* next = p->next_to_run_after(self);
  if (next == nullptr) {
    // Nothing else to run: carry on. Nothing waits behind us either, so for the watchdog this
    // counts as a switch (a fiber yielding alone is not blocking anyone). The search for work
    // found nothing; we are not looking any more, so give up the searcher share, or wakers
    // would count on us and wake nobody while this fiber runs (or blocks the thread).
    p->stop_searching();
    p->count_switch();
    return;
  }
  // Behind whatever runs next, even when that is the loop: returning instead would let a yield
  // loop take a fiber handed to the loop back from the LIFO slot on every turn.
  self->set_state(FiberState::Running, FiberState::Runnable);
  switch_to(p, self, next, After::Yield);
}

// Inline in its callers, the parks of every primitive (fiber_wait, sync/waiter_impl.hpp), with
// the switch inline in it: two calls and their prologues fewer per park (pingpong_1t: 859 -> 835
// instructions per round trip for the switch, -> 824 for the park). The callers are in other
// files, so only link-time optimisation inlines it (other builds call it); GCC warns that a
// function not declared inline may not be inlinable, which here is the point.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wattributes"
[[gnu::always_inline]] void Processor::park_current(ParkReason why) noexcept {
#pragma GCC diagnostic pop
  Processor* p = current_processor();
  Fiber* self = p->current();
  ensure_listed(self);  // parked, stop() must find it (during stop(), this claims the wait)
  self->park_reason.store(why, std::memory_order_relaxed);
  self->parked_at_ns.store(p->coarse_now_ns(), std::memory_order_relaxed);
  bump(p->parks_[static_cast<std::size_t>(why)]);
  // Woken before we even left: nothing to switch for. A plain load and store: once a waker has
  // made it Notified it is done with us, and nothing else moves a Parking fiber.
  if (self->state.load(std::memory_order_acquire) == FiberState::Notified) {
    self->state.store(FiberState::Running, std::memory_order_relaxed);
    p->wake_deferred();
  } else {
    Fiber* next = p->next_to_run_after<true>(self);
    switch_inline(p, self, next ? next : &p->loop_, After::Park);
  }
  self->park_reason.store(ParkReason::None, std::memory_order_relaxed);
}

void Processor::move_current_to(Processor* home) noexcept {
  Processor* p = current_processor();
  Fiber* self = p->current();
  ensure_listed(self);
  if (self->pin_depth++ == 0) self->pinned = home;
  if (self->pinned != home) [[unlikely]] {
    std::fprintf(stderr, "libfiber: broken invariant: fiber #%llu pinned elsewhere has I/O on another processor\n",
                 static_cast<unsigned long long>(self->id));
    std::abort();
  }
  if (p == home) return;
  Fiber* next = p->next_to_run_after(self);
  self->set_state(FiberState::Running, FiberState::Runnable);
  switch_to(p, self, next ? next : &p->loop_, After::SendHome);
}

void Processor::unpin_current() noexcept {
  Fiber* self = current_processor()->current();
  if (--self->pin_depth == 0) self->pinned = nullptr;
}

void Processor::release_finished(Fiber* f) noexcept {
  // Finished into the loop, nothing of its group to run next: the group hears before the last
  // reference goes, which destroys a dropped handle's result (a user destructor).
  if (current() == &loop_) settle_group_debt();
  if (f->stack) {
    f->san.on_destroy();
    stacks_->put(f->stack);
    f->stack = {};
  }
  // The monitor may be reading this control block (the id and name of a fiber it reports):
  // wait for it before the last reference can go. See SchedulerImpl::watchdog_may_free().
  sched_.watchdog_may_free(f);
  drop_fiber_ref(f);
}

// ------------------------------------------------------------------------------ scheduling

void Processor::settle_group_debt_now() noexcept {
  const std::size_t n = group_debt_;
  group_debt_ = 0;
  debt_group_->done(n);  // may wake the group's waiter, here or elsewhere
}

inline bool Processor::queue_back(Fiber* f) noexcept {
  if (!is_spawn_record(f) && f->pinned == this) [[unlikely]] {
    f->next = nullptr;
    if (pinned_tail_) pinned_tail_->next = f; else pinned_head_ = f;
    pinned_tail_ = f;
    pinned_len_.store(pinned_len_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    return false;
  }
  queue_.push_back_or_overflow(f, sched_.injector());
  return true;
}

// The LIFO slot is not stealable, so a fiber put there tells no idle processor; one put out of
// it into the queue may.
void Processor::requeue_displaced(Fiber* prev) noexcept {
  if (queue_back(prev) && sched_.idle().should_wake()) sched_.notify_parked();
}

// A fiber that yielded goes behind the fibers queued now. While every processor is busy, none
// would steal it before we get to it, so it waits in the yield slot rather than the ring, and
// goes before the queue once as many picks have passed as there were fibers queued ahead of it
// (take_queued). Taking it back costs no CAS, which taking from the ring does (it
// races thieves): a yield loop's dominant cost. With a processor idle or searching it goes to
// the ring, where that one can steal it, as before. A fiber already in the slot keeps it.
void Processor::schedule_yielded(Fiber* f) noexcept {
  if (!yielded_.occupied_for_owner() && sched_.idle().all_busy()) {
    // Each later pick ticks once: the queued fibers take the next len() ticks, then it is due.
    yielded_due_ = tick_ + queue_.len() + pinned_len_.load(std::memory_order_relaxed) + 1;
    yielded_.put(f);
    return;
  }
  schedule_yield(f);
}

void Processor::schedule_yield(Fiber* f) noexcept {
  if (queue_back(f) && sched_.idle().should_wake()) sched_.notify_parked();
}

void Processor::push_inbox(Fiber* f) noexcept {
  {
    std::lock_guard lock(inbox_mu_);
    f->next = nullptr;
    if (inbox_tail_) inbox_tail_->next = f; else inbox_head_ = f;
    inbox_tail_ = f;
    inbox_nonempty_.store(true, std::memory_order_release);
  }
  // Either we find it asleep (and wake it), or it re-checks the inbox after going to sleep.
  // A retired processor is neither: the monitor notices its inbox and starts it again.
  if (sched_.idle().wake_by_id(index_)) {
    poller_->wake();
    sched_.idle().wake_done(index_);
  }
}

bool Processor::drain_inbox() noexcept {
  if (!inbox_nonempty_.load(std::memory_order_acquire)) return false;
  Fiber* f;
  {
    std::lock_guard lock(inbox_mu_);
    f = inbox_head_;
    inbox_head_ = inbox_tail_ = nullptr;
    inbox_nonempty_.store(false, std::memory_order_release);
  }
  bool any = false;
  while (f) {
    Fiber* next = f->next;
    schedule_yield(f);
    any = true;
    f = next;
  }
  return any;
}

Fiber* Processor::take_lifo() noexcept { return lifo_.take(); }

// The monitor's take: the owner and the monitor never both get the fiber (owner_slot.hpp).
Fiber* Processor::steal_lifo() noexcept { return lifo_.steal(); }

bool Processor::has_local_work() const noexcept {
  return lifo_.occupied() || queue_.has_tasks() || yielded_.occupied() || pinned_head_ != nullptr ||
         inbox_nonempty_.load(std::memory_order_acquire);
}

Fiber* Processor::next_local() noexcept {
  if (lifo_in_a_row_ < kMaxLifoInARow) {
    if (Fiber* f = take_lifo()) {
      ++lifo_in_a_row_;
      return f;
    }
  } else if (Fiber* f = take_lifo()) {
    // A ping-ponging pair must not starve the queue: the LIFO fiber goes to the back.
    queue_back(f);
  }
  lifo_in_a_row_ = 0;
  // The injector once due: at the first pick not taken from the LIFO slot after kGlobalInterval
  // picks (find_work sends every pick here while it is due), so within kGlobalInterval +
  // kMaxLifoInARow picks. Looking only at ticks that are multiples of it left the injector
  // unread for good behind fibers that wake each other into the LIFO slot at a fixed phase (a
  // channel pair; a sender that yields after each send): they took the slot at every such tick.
  // Reading it before the LIFO slot, as Go and Tokio do, also bounds it, but reorders deep spawn
  // trees (skynet_1t 14% slower: overflowed fibers come back from the injector sooner).
  if (injector_due()) {
    last_injector_tick_ = tick_;
    if (Fiber* f = sched_.injector().pop()) return f;
  }
  if (Fiber* f = take_queued()) return f;
  // Refill from the injector: at most half a ring, so the rest stays for other processors.
  return refill_from_injector();
}

Fiber* Processor::steal_work() noexcept {
  if (!searching_) {
    if (!sched_.idle().transition_to_searching()) return nullptr;
    searching_ = true;
  }
  // Every slot ever started; the ones not running now have empty queues.
  const uint32_t n = sched_.processor_slots();
  rng_ ^= rng_ << 13;
  rng_ ^= rng_ >> 17;
  rng_ ^= rng_ << 5;
  const uint32_t start = rng_ % n;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t victim = (start + i) % n;
    if (victim == index_) continue;
    if (Fiber* f = sched_.processor(victim).stealer().steal_into(queue_)) {
      bump(steals_);
      return f;
    }
  }
  return refill_from_injector();
}

// Takes up to half a ring from the injector (the rest stays for other processors): runs the
// first, queues the others.
Fiber* Processor::refill_from_injector() noexcept {
  Fiber** batch = refill_scratch_;  // not a local array: this runs on (possibly compact) fiber stacks
  const std::size_t room = std::min<std::size_t>(queue_.remaining_slots(), RunQueue::capacity() / 2);
  const std::size_t n = sched_.injector().pop_batch(batch, room);
  if (n == 0) return nullptr;
  if (n > 1) queue_.push_back_batch(batch + 1, static_cast<uint32_t>(n - 1));
  return batch[0];
}

void Processor::stop_searching() noexcept {
  if (!searching_) return;
  searching_ = false;
  // As when parking: the last searcher re-checks every queue, since wakers skipped the
  // notify while it searched.
  if (sched_.idle().transition_from_searching()) sched_.notify_if_work_pending();
}

void Processor::found_work_while_searching(bool elsewhere) noexcept {
  searching_ = false;
  if (!sched_.idle().transition_from_searching()) return;
  // The last searcher hands the search on. Work taken from another processor or the injector
  // may have company there: wake a sleeper. Work of its own (its queue, engine, timers, inbox:
  // what a spinning processor mostly finds) says nothing of the others, so, as when it stops
  // searching empty-handed, wake one only if some queue holds work that wakers left to it.
  if (elsewhere) {
    sched_.notify_parked();
  } else {
    sched_.notify_if_work_pending();
  }
}

bool Processor::maintenance() noexcept {
  now_ns_.store(steady_now_ns(), std::memory_order_relaxed);  // for coarse_now_ns()
  bool any = drain_inbox();
  any |= poller_->poll();  // submit queued I/O, wake fibers whose I/O completed
  if (timers_.next_deadline() != TimerQueue::kNone) any |= timers_.fire_expired(steady_now_ns()) > 0;
  return any;
}

// Inline, and only the common case: with no periodic duty this tick and no search going on, the
// LIFO slot or the ring has a fiber. Everything else is find_work_slow(), out of line, so the
// fast path of a yield or a park saves and restores no registers for the rare ones.
//
// For a park (kParking), only the cheap picks: the LIFO slot and the local queue. Everything
// else - the engine, timers and inbox, the injector, steals - the loop does, after the switch has
// published the fiber as Parked. A waker on another thread that finds it still Parking waits for
// that (unpark), so its window stays short. A due tick (an event tick, or the injector's turn
// with fibers in it) is left for the loop's own find_work.
//
// The injector's turn with the injector empty (nearly always, with a processor's fibers waking
// each other) is taken here: that read is all next_local() would make of it. It went through
// the loop on every kGlobalInterval-th park of a channel ping-pong, a switch there and back
// (pingpong_1t: 824 -> 807 instructions per round trip).
template <bool kParking>
[[gnu::always_inline]] inline Fiber* Processor::find_work() noexcept {
  const uint32_t tick = tick_ + 1;
  bool routine = (tick & (kEventInterval - 1)) != 0 && !searching_;
  if (routine && injector_due(tick)) [[unlikely]] {
    if (sched_.injector().empty()) {
      last_injector_tick_ = tick;
    } else {
      routine = false;
    }
  }
  if constexpr (kParking) {
    if (!routine) [[unlikely]] return nullptr;
  }
  tick_ = tick;
  if (routine) [[likely]] {
    if (lifo_in_a_row_ < kMaxLifoInARow) {
      if (Fiber* f = take_lifo()) {
        ++lifo_in_a_row_;
        return f;
      }
    } else if (!queue_.has_tasks() && !yielded_.occupied_for_owner() && pinned_head_ == nullptr) {
      // Past the LIFO limit with nobody queued to starve (the yield slot's and the pinned
      // queue's fibers count as queued): next_local() would move the LIFO fiber to the back of
      // the empty ring and pop it again (a push and a CAS for a ping-pong pair every fourth
      // switch). Take it as that queue pick.
      if (Fiber* f = take_lifo()) {
        lifo_in_a_row_ = 0;
        return f;
      }
    }
    if (!lifo_.occupied_for_owner()) {
      lifo_in_a_row_ = 0;
      if (Fiber* f = take_queued()) return f;
    }
  }
  if constexpr (kParking) return nullptr;
  return find_work_slow();
}

Fiber* Processor::find_work_slow() noexcept {
  if ((tick_ & (kEventInterval - 1)) == 0) maintenance();
  Fiber* f = next_local();
  bool elsewhere = false;  // from a victim or an injector batch (steal_work)
  if (f == nullptr) elsewhere = (f = steal_work()) != nullptr;
  if (f == nullptr && maintenance()) f = next_local();
  // A searcher stops searching when it has something to run, wherever that came from (its own
  // queue, the injector, a victim). Until then the idle state counts it as looking for work
  // and wakes nobody else.
  if (f != nullptr && searching_) [[unlikely]] found_work_while_searching(elsewhere);
  return f;
}

// ------------------------------------------------------------------------------ parking

// Options::spin_before_sleep: out of fibers, look again and again for up to that long before
// the thread sleeps (park_thread). Each look is find_work(): the LIFO slot and queue, the
// engine (on a ring that flags its completions, no system call while nothing has completed),
// timers and inbox, and - as a searcher, when fewer than half the processors search - other
// processors' queues and the injector. A searcher that keeps searching is why wakers wake
// nobody else meanwhile. nullptr when the time is up or the scheduler stops.
Fiber* Processor::spin_for_work() noexcept {
  const int64_t spin = sched_.spin_ns();
  if (spin == 0 || !poller_->polls_cheaply()) return nullptr;
  settle_group_debt();  // as park_thread() does first: a block_on waiter must not wait for the spin
  const int64_t until = steady_now_ns() + spin;
  do {
    for (int i = 0; i < 16; ++i) __builtin_ia32_pause();
    if (Fiber* f = find_work()) return f;
  } while (!shutdown_.load(std::memory_order_acquire) && steady_now_ns() < until);
  return nullptr;
}

bool Processor::transition_to_parked() noexcept {
  if (has_local_work()) return false;
  const bool last_searcher = sched_.idle().transition_to_parked(index_, searching_);
  searching_ = false;
  if (last_searcher) sched_.notify_if_work_pending();
  return true;
}

bool Processor::transition_from_parked() noexcept {
  if (has_local_work()) {
    // Work of our own (timers, inbox). Still on the sleepers list: leave it, not as a searcher.
    // Already off it: a waker took us off and counted us as searching (processor_to_notify and
    // wake_by_id both do), so we are one.
    searching_ = !sched_.idle().unpark_by_id(index_);
    if (searching_) bump(wakeups_);
    return true;
  }
  if (sched_.idle().is_parked(index_)) return false;
  searching_ = true;  // a waker took us off the list (and counted us as searching)
  bump(wakeups_);
  return true;
}

// An idle extra processor retires: it leaves the idle state for good (so nobody can wake it),
// then thread_main ends the thread. Only with nothing of its own left - no queued fiber, no
// timer (a timer lives in the queue of the processor it was set on) - and no processor
// blocked, since the extra is what stands in for a blocked one. A fiber pinned here that is
// woken later lands in the inbox; the monitor then starts this processor again.
bool Processor::try_retire() noexcept {
  if (sched_.stopping() || sched_.blocked_processors() != 0) return false;
  if (has_local_work() || timers_.next_deadline() != TimerQueue::kNone) return false;
  if (poller_->inflight() != 0) return false;  // I/O of its own fibers is still in its ring
  if (!sched_.idle().retire(index_)) return false;  // a notifier took us: look for work
  retired_ = true;
  return true;
}

void Processor::park_thread() noexcept {
  settle_group_debt();  // first: it may wake a waiter onto this processor
  if (!transition_to_parked()) return;
  const int64_t retire_after = retirable_ ? sched_.retire_after_ns() : 0;
  int64_t idle_since = retirable_ ? steady_now_ns() : 0;
  while (!shutdown_.load(std::memory_order_acquire)) {
    // Timers, inbox and engine - before the first wait and after each one. The engine's poll
    // may consume a waker's eventfd wake, so look for that wake (we are off the sleepers list)
    // every time, whatever maintenance() found, or we would sleep through it.
    maintenance();
    if (transition_from_parked()) return;
    // Likewise request_shutdown's wake: stored before the wake, so once maintenance() has
    // consumed the wake the flag is seen here; the loop's own check came before it.
    if (shutdown_.load(std::memory_order_acquire)) break;
    const int64_t next = timers_.next_deadline();
    const int64_t now = coarse_now_ns();  // maintenance() just read the clock
    int64_t timeout = -1;
    if (next != TimerQueue::kNone) timeout = std::max<int64_t>(0, next - now);
    if (retirable_) {
      int64_t left = idle_since + retire_after - now;
      if (left <= 0) {
        if (try_retire()) return;
        if (transition_from_parked()) return;  // woken meanwhile, or found work
        idle_since = now;
        left = retire_after;
      }
      timeout = timeout < 0 ? left : std::min(timeout, left);
    }
    bump(sleeps_);
    poller_->wait(timeout);
  }
  // Shutting down: leave the sleepers list so counts stay consistent. Already off it: a waker
  // took us off and counted us as searching (transition_from_parked's rule), a share that is
  // ours to give back. (searching_ is false here: every path that sets it returns above.)
  if (!sched_.idle().unpark_by_id(index_)) sched_.idle().transition_from_searching();
  searching_ = false;
}

// ------------------------------------------------------------------------------ stats

bool Processor::polls_cheaply() const noexcept {
  std::lock_guard lock(life_mu_);  // the poller comes and goes with the thread
  return poller_ && poller_->polls_cheaply();
}

static_assert(kParkReasons == static_cast<std::size_t>(ParkReason::Blocking) + 1, "fiber::kParkReasons");

void Processor::stats_into(ProcessorStats& out) const noexcept {
  out.index = index_;
  out.running = life() == Life::Running;
  out.switches = switches_.load(std::memory_order_relaxed);
  out.steals = steals_.load(std::memory_order_relaxed);
  out.sleeps = sleeps_.load(std::memory_order_relaxed);
  out.wakeups = wakeups_.load(std::memory_order_relaxed);
  out.spawned = spawned_.load(std::memory_order_relaxed);
  out.finished = finished_.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < kParkReasons; ++i) out.parks[i] = parks_[i].load(std::memory_order_relaxed);
  out.local_queue = stealer_.len() + (yielded_.occupied() ? 1 : 0) + pinned_queued();
  out.lifo_slot = lifo_occupied();
  std::lock_guard lock(life_mu_);  // the poller comes and goes with the thread
  out.io_submitted = io_submitted_retired_;
  out.io_completed = io_completed_retired_;
  if (poller_) {
    out.io_submitted += poller_->submitted();
    out.io_completed += poller_->completed();
  }
  out.io_inflight = out.io_submitted >= out.io_completed ? out.io_submitted - out.io_completed : 0;
}

// ------------------------------------------------------------------------------ unpark

namespace {

// A woken fiber that may not run on this thread: to the processor it is pinned to, or its
// scheduler's injector. Once published, `f` may finish and its scheduler stop before we are out
// of inject()/push_inbox(): everything is read first, and stop() waits for the end mark.
[[gnu::noinline]] void enqueue_foreign(Fiber* f) noexcept {
  SchedulerImpl* s = f->sched;
  Processor* pinned = f->pinned;
  s->foreign_wake_begin();
  if (pinned != nullptr) pinned->push_inbox(f); else s->inject(f);
  s->foreign_wake_end();
}

// unpark's second half: `f`, Parked, becomes Runnable and goes to this processor's LIFO slot
// when it may run here, else to its own processor or its scheduler.
[[gnu::always_inline]] inline void enqueue_woken(Fiber* f) noexcept {
  // A store, not a CAS: a parked fiber's one waker is the one that claimed its wait (us), and
  // the fiber itself cannot move until we enqueue it.
  f->state.store(FiberState::Runnable, std::memory_order_release);
  Processor* p = current_processor();
  if (p != nullptr && (f->pinned != nullptr ? f->pinned == p : &p->sched() == f->sched)) [[likely]] {
    p->schedule_local(f);
    return;
  }
  enqueue_foreign(f);
}

// unpark of a fiber found in state `s`, not Parked: one still switching away (Parking), or a
// broken invariant.
[[gnu::noinline]] void unpark_not_parked(Fiber* f, FiberState s) noexcept {
  if (s == FiberState::Parking) {
    Fiber* self = current_fiber();
    if (f == self) {
      // Woken in its own window (cancelling itself as it lists itself during stop(), or reaping
      // its own completion while it submits to a full ring): park_current does not switch, or
      // the context it switched to enqueues it. Nobody else writes a Parking fiber's state.
      f->state.store(FiberState::Notified, std::memory_order_relaxed);
      return;
    }
    // In a window of our own (user code in a CondVar wait, unlocking its lock): f's window
    // could be waiting for ours. Woken when ours has ended (every way a window ends drains the
    // list). Not otherwise: a fiber that is Running, or Finished and settling its group on its
    // way out, has no window, so nothing waits for it (and a Finished one would never drain
    // the list); nor the loop or a plain thread.
    const FiberState mine = self != nullptr ? self->state.load(std::memory_order_relaxed) : FiberState::Running;
    if (mine == FiberState::Parking || mine == FiberState::Notified) {
      current_processor()->defer_wake(f);
      return;
    }
    // Still switching away on another thread: wait until that switch is complete, as a Go
    // waker waits on the channel lock the parker holds until then. A window is usually a few
    // hundred instructions (the primitive's own, a timer add, the cheap picks of
    // find_work<true>, the switch); at worst a first run's stack allocation, a spawn record's
    // start (its control block from the slot cache only), the fiber's own listing at its first
    // park (a shard spinlock), a submission or a user lock's unlock().
    // It takes no lock that a waker holds while it wakes: wakers wake outside the primitives'
    // locks (stop() too, outside the registry's), and those that wake under one (io::close and
    // fd_end, under a descriptor's slot lock) wake fibers already past taking it.
    spin_until([f, &s] { return (s = f->state.load(std::memory_order_acquire)) != FiberState::Parking; });
  }
  if (s != FiberState::Parked) [[unlikely]] f->bad_transition(s, FiberState::Parked, FiberState::Runnable);
  enqueue_woken(f);
}

}  // namespace

// The common case in line (a parked fiber woken on a processor it may run on: its own
// scheduler's, or the one it is pinned to), the rest out of it: before the split, the one
// function holding both halves saved and restored three registers on every wake.
void unpark(Fiber* f) noexcept {
  const FiberState s = f->state.load(std::memory_order_acquire);
  if (s != FiberState::Parked) [[unlikely]] {
    unpark_not_parked(f, s);
    return;
  }
  enqueue_woken(f);
}

}  // namespace fiber::detail
