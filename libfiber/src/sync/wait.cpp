// Waiter: the one parking primitive (see fiber/detail/wait.hpp and libfiber/README.md).
//
// Fiber waits: the claim word is the fiber's wake_word, (generation, cancel bit, reason).
// waiter_prepare starts a new generation and moves the fiber to Parking, with no locked
// instruction where membarrier(2) lets a cancel pay for the fence (plain_wait_start); a claim is
// one CAS from (gen, Pending) to (gen, reason); the winner unparks the fiber. Cancellation sets
// the cancel bit and claims a pending wait, so a wait prepared after a cancel ends at once.
//
// Thread waits: the claim word is the record's own state; the thread sleeps on its
// ThreadParker, a futex word that outlives the record (parkers are pooled, never freed), so a
// waker may touch the parker after the thread has already returned.
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "fiber/detail/wait.hpp"
#include "sched/fiber.hpp"
#include "sched/membarrier.hpp"
#include "sched/processor.hpp"
#include "sched/runtime.hpp"
#include "sched/scheduler_impl.hpp"
#include "sched/timer.hpp"
#include "sync/waiter_impl.hpp"

namespace fiber::detail {

// ------------------------------------------------------------------------------ thread parker

struct ThreadParker {
  // 1 when a wake is pending. unpark stores 1 (release) then wakes the futex; park consumes it
  // with an exchange (acquire), which synchronises with that store.
  std::atomic<uint32_t> token{0};
  ThreadParker* next_free = nullptr;

  void park(const timespec* timeout) noexcept {
    if (token.exchange(0, std::memory_order_acquire) == 1) return;
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&token), FUTEX_WAIT_PRIVATE, 0, timeout, nullptr, 0);
    token.exchange(0, std::memory_order_acquire);
  }
  void unpark() noexcept {
    token.store(1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&token), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
};

namespace {

std::mutex g_parker_mu;
ThreadParker* g_free_parkers = nullptr;  // GUARDED_BY(g_parker_mu)

// This thread's parker. A plain pointer, so it stays readable through every destructor the
// thread runs at its end.
thread_local ThreadParker* t_parker = nullptr;

// Gives a thread's parker back to the pool when the thread ends. A pthread key's destructor:
// glibc runs those after every C++ thread_local destructor, which may still wait on the parker.
// From here on another thread may sleep on it, so t_parker is cleared first: a wait in a later
// key destructor takes a parker afresh and registers it again (glibc calls the destructors
// again while a value is set, up to PTHREAD_DESTRUCTOR_ITERATIONS rounds; one taken after
// those stays with the dead thread, never shared).
void return_parker(void* v) noexcept {
  auto* p = static_cast<ThreadParker*>(v);
  if (t_parker == p) t_parker = nullptr;
  std::lock_guard lock(g_parker_mu);
  p->next_free = g_free_parkers;
  g_free_parkers = p;
}

// The key, made once; -1 if the process ran out of keys (parkers are then never pooled).
long parker_key() noexcept {
  static const long key = [] {
    pthread_key_t k;
    return pthread_key_create(&k, return_parker) == 0 ? static_cast<long>(k) : -1L;
  }();
  return key;
}

}  // namespace

__attribute__((noinline)) ThreadParker* this_thread_parker() {
  if (ThreadParker* p = t_parker) return p;
  ThreadParker* p = nullptr;
  {
    std::lock_guard lock(g_parker_mu);
    if (g_free_parkers) {
      p = g_free_parkers;
      g_free_parkers = p->next_free;
    }
  }
  if (!p) p = new (std::nothrow) ThreadParker();  // never freed: wakers may still hold it
  if (!p) [[unlikely]] {
    // A wait cannot report an error here (a lock may be held): say what ran out.
    std::fputs("libfiber: out of memory for a plain thread's first blocking wait (its parker)\n", stderr);
    std::abort();
  }
  p->token.store(0, std::memory_order_relaxed);
  if (const long key = parker_key(); key >= 0) pthread_setspecific(static_cast<pthread_key_t>(key), p);
  t_parker = p;
  return p;
}

void decide_wait_start() noexcept {
  if (membarrier_available()) g_plain_wait_start.store(true, std::memory_order_relaxed);
}

// ------------------------------------------------------------------------------ waiter

void waiter_prepare(Waiter& w) noexcept { prepare_wait(w, false); }
void waiter_prepare_shielded(Waiter& w) noexcept { prepare_wait(w, true); }

bool waiter_claim(Waiter& w, WakeReason reason) noexcept { return claim_wait(w, reason); }
void waiter_wake(Waiter& w) noexcept { wake_wait(w); }

void wake_thread_wait(Waiter& w) noexcept {
  ThreadParker* p = w.parker;  // read before the record may vanish
  const uint8_t s = w.state.load(std::memory_order_relaxed) & ~Waiter::kClaimBusy;
  w.state.store(s, std::memory_order_release);  // the thread may return from here on
  p->unpark();
}

WakeReason waiter_state(const Waiter& w) noexcept {
  if (w.fiber != nullptr) {
    const WakeWord ww = WakeWord::unpack(w.fiber->wake_word.load(std::memory_order_acquire));
    return ww.gen == w.gen ? ww.reason : WakeReason::Notified;
  }
  const uint8_t s = w.state.load(std::memory_order_acquire);
  return (s & Waiter::kClaimBusy) ? WakeReason::Pending : static_cast<WakeReason>(s);
}

void waiter_abandon(Waiter& w) noexcept {
  if (w.fiber == nullptr) {
    w.state.store(static_cast<uint8_t>(WakeReason::Notified), std::memory_order_relaxed);
    return;
  }
  if (claim_wait(w, WakeReason::Notified)) {
    end_self_claimed_wait(w.fiber);
    return;
  }
  // A cancel (or a close) claimed it first and is about to unpark us: let that unpark land
  // (at once if it already has) rather than race it.
  Processor::park_current(ParkReason::None);
}

WakeReason thread_wait(Waiter& w, const int64_t* deadline_ns) noexcept {
  for (;;) {
    const uint8_t s = w.state.load(std::memory_order_acquire);
    if (s != kWaitPending && !(s & Waiter::kClaimBusy)) return static_cast<WakeReason>(s);
    if (s == kWaitPending && deadline_ns) {
      const int64_t left = *deadline_ns - steady_now_ns();
      if (left <= 0) {
        uint8_t expected = kWaitPending;
        if (w.state.compare_exchange_strong(expected, static_cast<uint8_t>(WakeReason::Timeout),
                                            std::memory_order_acq_rel)) {
          return WakeReason::Timeout;
        }
        continue;  // claimed by a waker: wait for its wake
      }
      const timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
      w.parker->park(&ts);
    } else {
      w.parker->park(nullptr);
    }
  }
}

WakeReason waiter_wait(Waiter& w, ParkReason why) noexcept { return wait_claimed(w, why); }

WakeReason waiter_wait_until(Waiter& w, ParkReason why, std::chrono::steady_clock::time_point deadline) noexcept {
  // No deadline (a limit saturated by to_deadline/deadline_after): no timer entry, whose
  // deadline would be the timer queue's "none" value.
  if (deadline == kNoDeadline) return waiter_wait(w, why);
  const int64_t deadline_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
  if (w.fiber == nullptr) return thread_wait(w, &deadline_ns);
  TimerEntry entry;
  entry.deadline_ns = deadline_ns;
  entry.waiter = &w;
  current_processor()->timers().add(&entry);
  const WakeReason r = fiber_wait(w, why);
  entry.queue->remove(&entry);  // the queue it was added to, wherever we resumed
  return r;
}

// ------------------------------------------------------------------------------ claim bias

ClaimGate& wait_processor_gate(const Fiber* f) noexcept {
  return f->sched->processor(f->last_processor.load(std::memory_order_acquire)).claim_gate();
}

bool claim_biased_elsewhere(Waiter& w, WakeReason reason) noexcept {
  Fiber* f = w.fiber;
  // Read after claim_wait's acquire load found this wait pending and biased: while it is
  // pending the fiber has not run since it made it, so this is the processor it was made on.
  // If a claim ends it meanwhile (and the fiber moves on), the CAS below fails, whichever gate.
  ClaimGate& gate = wait_processor_gate(f);
  gate.close();
  uint64_t cur = f->wake_word.load(std::memory_order_acquire);
  bool claimed = false;
  while (!claimed && WakeWord::pending_wait(cur, w.gen)) {
    claimed = f->wake_word.compare_exchange_weak(cur, WakeWord::with_reason(cur, reason), std::memory_order_acq_rel);
  }
  gate.open();
  return claimed;
}

// ------------------------------------------------------------------------------ biased lock

void BiasedLock::lock_slow(uintptr_t me) noexcept {
  locked_.lock();
  const uintptr_t owner = owner_.load(std::memory_order_relaxed);  // only locked_'s holders write it
  if (owner == kUnbiased) {
    if (last_ != me) {
      last_ = me;
      streak_ = 1;
    } else if (++streak_ == kBiasAfter && me != 0 && membarrier_available()) {
      owner_.store(me, std::memory_order_relaxed);  // published by our unlock of locked_
    }
  } else if (owner != kRevoked && owner != me) {
    // Biased to another thread, which may be in a plain section now.
    owner_.store(kRevoked, std::memory_order_relaxed);
    // Biased only if membarrier_available(): registered. (The test hook plays a refusal.)
    const bool fenced = refuse_revoke_fences.load(std::memory_order_relaxed) == 0 && membarrier_heavy_retrying();
    if (!fenced) [[unlikely]] {
      // Refused: the owner's busy_ = true may still sit in its store buffer, after a load that
      // found it still the owner. A store buffer drains in far less than this; then the wait
      // below sees it (the reasoning of fiber_cancel's refused fence).
      full_fence();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    spin_until([this] { return !busy_.load(std::memory_order_acquire); });
  }
}

// ------------------------------------------------------------------------------ names

const char* park_reason_name(ParkReason r) noexcept {
  switch (r) {
    case ParkReason::None: return "none";
    case ParkReason::Yield: return "yield";
    case ParkReason::Join: return "join";
    case ParkReason::Sleep: return "sleep";
    case ParkReason::BlockOn: return "block_on";
    case ParkReason::WaitGroup: return "waitgroup";
    case ParkReason::Channel: return "channel";
    case ParkReason::Select: return "select";
    case ParkReason::Mutex: return "mutex";
    case ParkReason::RWMutex: return "rwmutex";
    case ParkReason::CondVar: return "condvar";
    case ParkReason::Semaphore: return "semaphore";
    case ParkReason::Latch: return "latch";
    case ParkReason::Barrier: return "barrier";
    case ParkReason::Once: return "once";
    case ParkReason::IO: return "io";
    case ParkReason::Blocking: return "blocking";
  }
  return "?";
}

const char* fiber_state_name(FiberState s) noexcept {
  switch (s) {
    case FiberState::Created: return "created";
    case FiberState::Runnable: return "runnable";
    case FiberState::Running: return "running";
    case FiberState::Parking: return "parking";
    case FiberState::Parked: return "parked";
    case FiberState::Notified: return "notified";
    case FiberState::Finished: return "finished";
  }
  return "?";
}

void Fiber::bad_transition(FiberState actual, FiberState from, FiberState to) const noexcept {
  std::fprintf(stderr, "libfiber: broken invariant: fiber #%llu moved %s -> %s but was %s\n",
               static_cast<unsigned long long>(id), fiber_state_name(from), fiber_state_name(to),
               fiber_state_name(actual));
  std::abort();
}

}  // namespace fiber::detail
