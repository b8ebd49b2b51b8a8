// Introspection: stats(), dump(), the dump signal, and the list of live schedulers that
// fiber::dump and tools/gdb/libfiber.py walk.
//
// The list (fiber_detail_schedulers, newest first) is linked through SchedulerImpl's
// next_scheduler_/prev_scheduler_ under g_schedulers_mu; a scheduler joins it once its
// processors run and leaves it when it is destroyed. The dump signal (FIBER_DUMP_SIGNAL) only
// writes a byte to a pipe: a detached "fiber-dump" thread reads it and prints the dump, so the
// handler stays async-signal-safe and the dump may take locks.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "context/stack.hpp"
#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
#include "fiber/stats.hpp"
#include "io/raw.hpp"
#include "sched/processor.hpp"
#include "sched/scheduler_impl.hpp"
#include "sched/timer.hpp"

// Read by tools/gdb/libfiber.py: C linkage, so the name is easy to find in a core file.
extern "C" {
FIBER_API fiber::detail::SchedulerImpl* fiber_detail_schedulers = nullptr;  // GUARDED_BY(g_schedulers_mu)
}

namespace fiber::detail {
namespace {

std::mutex g_schedulers_mu;

// ---- the dump signal
int g_dump_pipe[2] = {-1, -1};

void on_dump_signal(int) {
  const int saved = errno;
  const char c = 1;
  raw::write(g_dump_pipe[1], &c, 1);
  errno = saved;
}

int parse_signal(const char* v) {
  if (!std::strcmp(v, "USR1") || !std::strcmp(v, "SIGUSR1")) return SIGUSR1;
  if (!std::strcmp(v, "USR2") || !std::strcmp(v, "SIGUSR2")) return SIGUSR2;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end != v && *end == '\0' && n > 0 && n < NSIG && n != SIGKILL && n != SIGSTOP) return static_cast<int>(n);
  throw UsageError(std::string("fiber: invalid FIBER_DUMP_SIGNAL value '") + v +
                   "' (expected USR1, USR2 or a signal number)");
}

void install_dump_signal_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("FIBER_DUMP_SIGNAL");
    if (v == nullptr || *v == '\0') return;
    const int sig = parse_signal(v);
    if (pipe2(g_dump_pipe, O_CLOEXEC) != 0) return;
    std::thread([] {
      pthread_setname_np(pthread_self(), "fiber-dump");
      char c;
      while (raw::read(g_dump_pipe[0], &c, 1) == 1) {
        std::ostringstream out;
        fiber::dump(out);
        const std::string s = out.str();
        raw::write(2, s.data(), s.size());
      }
    }).detach();
    struct sigaction act {};
    act.sa_handler = on_dump_signal;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    sigaction(sig, &act, nullptr);
  });
}

}  // namespace

void register_scheduler(SchedulerImpl* s) {
  install_dump_signal_once();
  std::lock_guard lock(g_schedulers_mu);
  s->prev_scheduler_ = nullptr;
  s->next_scheduler_ = fiber_detail_schedulers;
  if (fiber_detail_schedulers) fiber_detail_schedulers->prev_scheduler_ = s;
  fiber_detail_schedulers = s;
}

void unregister_scheduler(SchedulerImpl* s) noexcept {
  std::lock_guard lock(g_schedulers_mu);
  if (s->prev_scheduler_) {
    s->prev_scheduler_->next_scheduler_ = s->next_scheduler_;
  } else if (fiber_detail_schedulers == s) {
    fiber_detail_schedulers = s->next_scheduler_;
  }
  if (s->next_scheduler_) s->next_scheduler_->prev_scheduler_ = s->prev_scheduler_;
  s->next_scheduler_ = s->prev_scheduler_ = nullptr;
}

SchedulerStats SchedulerImpl::stats() const {
  SchedulerStats s;
  s.name = name_;
  s.fibers_alive = live_fibers();
  s.spawned = foreign_spawned_.load(std::memory_order_relaxed);
  const uint32_t n = processor_slots();
  s.processors.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    ProcessorStats& p = s.processors[i];
    processors_[i]->stats_into(p);
    s.spawned += p.spawned;
    s.finished += p.finished;
    s.switches += p.switches;
    s.steals += p.steals;
    s.sleeps += p.sleeps;
    s.wakeups += p.wakeups;
    for (std::size_t r = 0; r < kParkReasons; ++r) s.parks[r] += p.parks[r];
    s.io_submitted += p.io_submitted;
    s.io_completed += p.io_completed;
    if (i >= base_ && p.running) ++s.extra_processors;
  }
  s.injector = injector_.len();
  if (monitor_) s.blocked_incidents = monitor_->stats().incidents;
  const StackStats st = StackAllocator::instance().stats();
  s.stacks_guarded_live = st.guarded_live;
  s.stacks_unguarded_live = st.unguarded_live;
  s.stacks_pooled = st.pooled;
  s.stack_mappings = st.mappings;
  return s;
}

void SchedulerImpl::dump(std::ostream& out) const {
  struct Line {
    unsigned long long id;
    std::string name;
    FiberState state;
    ParkReason reason;
    int processor;
    int64_t parked_at;
  };
  std::vector<Line> lines;
  const std::size_t live = live_fibers();
  lines.reserve(live + 16);
  // Copy under the shard locks, print outside them.
  registry_.for_each([&](Fiber* f) {
    const uint16_t last = f->last_processor.load(std::memory_order_relaxed);
    const int processor = last != Fiber::kNeverRan ? static_cast<int>(last) : -1;
    lines.push_back(Line{f->id, f->name ? f->name : "", f->state.load(std::memory_order_relaxed),
                         f->park_reason.load(std::memory_order_relaxed), processor,
                         f->parked_at_ns.load(std::memory_order_relaxed)});
  });
  const int64_t now = steady_now_ns();
  // Fibers are listed from their first cancellation point or switch away: the rest of the live
  // count is queued, or running since it started (or has just finished, the two counts being
  // read a moment apart).
  const std::size_t shown = std::max(live, lines.size());
  out << "scheduler '" << name_ << "': " << shown << " live fibers, " << base_ << " processors\n";
  if (shown > lines.size()) out << "  " << shown - lines.size() << " queued or running, not listed yet\n";
  // Where runnable fibers wait and who is awake to run them: what a lost wakeup looks like.
  const IdleCounts counts = idle_.counts();
  out << "  " << counts.unparked() << " of " << idle_.num_processors() << " processors awake, " << counts.searching()
      << " searching; " << injector_.len() << " in the global queue\n";
  for (uint32_t i = 0; i < processor_slots(); ++i) {
    ProcessorStats p;
    processors_[i]->stats_into(p);
    if (!p.running && i >= base_) continue;  // an extra processor that is not running now
    out << "  P" << i << ": " << (!p.running ? "stopped" : idle_.is_parked(i) ? "asleep" : "awake") << ", "
        << p.local_queue << " queued" << (p.lifo_slot ? " + 1 in the LIFO slot" : "") << ", " << p.switches
        << " switches, " << p.sleeps << " sleeps, " << p.wakeups << " wakeups, " << p.io_inflight
        << " I/O in flight\n";
  }
  for (const Line& l : lines) {
    out << "  fiber #" << l.id;
    if (!l.name.empty()) out << " '" << l.name << "'";
    out << " " << fiber_state_name(l.state);
    if (l.state == FiberState::Parked || l.state == FiberState::Parking) {
      out << " on " << park_reason_name(l.reason);
      if (l.parked_at > 0) out << " for " << (now - l.parked_at) / 1'000'000 << " ms";
    }
    if (l.processor >= 0) out << ", last on P" << l.processor;  // always, for a listed fiber (a racy read)
    out << "\n";
  }
}

}  // namespace fiber::detail

namespace fiber {

const char* park_reason_name(std::size_t reason) noexcept {
  if (reason >= kParkReasons) return "?";
  return detail::park_reason_name(static_cast<detail::ParkReason>(reason));
}

SchedulerStats Scheduler::stats() const { return impl_->stats(); }
void Scheduler::dump(std::ostream& out) const { impl_->dump(out); }

SchedulerStats stats() { return Scheduler::global().stats(); }

void dump(std::ostream& out) {
  std::lock_guard lock(detail::g_schedulers_mu);
  for (detail::SchedulerImpl* s = fiber_detail_schedulers; s; s = s->next_scheduler_) s->dump(out);
}

}  // namespace fiber
