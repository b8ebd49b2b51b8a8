// The blocked-processor watchdog. The design is in monitor.hpp and libfiber/README.md
// ("Watchdog"); this file is the sampling loop, the rescue, the decision and the report.
#include "io/raw.hpp"
#include "sched/monitor.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <system_error>

#include "fiber/error.hpp"
#include "sched/fiber.hpp"
#include "sched/membarrier.hpp"
#include "sched/processor.hpp"
#include "sched/scheduler_impl.hpp"
#include "sched/timer.hpp"

namespace fiber::detail {

// ------------------------------------------------------------------------------ the hazard word

void FiberReadHazard::enable() noexcept {
  membarrier_ = membarrier_available();
  enabled_ = true;
}

void FiberReadHazard::light_fence() const noexcept {
  // The switch away from the finished fiber stored the processor's switch count before this;
  // the load of reading_ follows. With membarrier the monitor supplies the full barrier.
  if (membarrier_) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    full_fence();
  }
}

bool FiberReadHazard::begin_read(const Fiber* f) noexcept {
  reading_.store(f, std::memory_order_relaxed);
  // Store reading_, full barrier, then (the caller) load the processor's switch count. Either
  // the processor's later before_free() sees f, or we see its switch and do not read.
  if (!membarrier_) {
    full_fence();
    return true;
  }
  if (membarrier_heavy()) return true;
  // Registered but refused (the kernel does not do this): the processors' side has only a
  // compiler barrier, so reading would not be safe.
  reading_.store(nullptr, std::memory_order_relaxed);
  return false;
}

// ------------------------------------------------------------------------------ /proc probes

namespace {

// What a thread is doing, from /proc/self/task/TID/syscall (readable for our own threads).
struct ThreadProbe {
  enum Kind { Unknown, Running, InKernel, InSyscall } kind = Unknown;
  long nr = -1;             // system call number
  unsigned long arg0 = 0;   // its first argument
  unsigned long pc = 0;     // user-space program counter
};

ThreadProbe probe_thread(int tid) noexcept {
  ThreadProbe r;
  if (tid <= 0) return r;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/syscall", tid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return r;
  char buf[256];
  const ssize_t n = raw::read(fd, buf, sizeof buf - 1);
  raw::close(fd);
  if (n <= 0) return r;
  buf[n] = '\0';
  if (std::strncmp(buf, "running", 7) == 0) {
    r.kind = ThreadProbe::Running;
    return r;
  }
  // "NR arg0 .. arg5 sp pc" in a system call; "-1 sp pc" blocked in the kernel otherwise.
  char* p = buf;
  char* end = nullptr;
  r.nr = std::strtol(p, &end, 10);
  if (end == p) return r;
  unsigned long fields[8] = {};
  int k = 0;
  for (p = end; k < 8; ++k, p = end) {
    fields[k] = std::strtoul(p, &end, 0);
    if (end == p) break;
  }
  if (r.nr < 0) {
    r.kind = ThreadProbe::InKernel;
    if (k >= 2) r.pc = fields[1];
  } else {
    r.kind = ThreadProbe::InSyscall;
    r.arg0 = fields[0];
    if (k >= 8) r.pc = fields[7];
  }
  return r;
}

const char* syscall_name(long nr) noexcept {
  struct Entry {
    long nr;
    const char* name;
  };
  static constexpr Entry kNames[] = {
      {SYS_read, "read"}, {SYS_write, "write"}, {SYS_readv, "readv"}, {SYS_writev, "writev"},
      {SYS_pread64, "pread64"}, {SYS_pwrite64, "pwrite64"}, {SYS_recvfrom, "recvfrom"},
      {SYS_sendto, "sendto"}, {SYS_recvmsg, "recvmsg"}, {SYS_sendmsg, "sendmsg"},
      {SYS_accept, "accept"}, {SYS_accept4, "accept4"}, {SYS_connect, "connect"},
      {SYS_ppoll, "ppoll"}, {SYS_pselect6, "pselect6"}, {SYS_epoll_pwait, "epoll_pwait"},
      {SYS_futex, "futex"}, {SYS_nanosleep, "nanosleep"}, {SYS_clock_nanosleep, "clock_nanosleep"},
      {SYS_wait4, "wait4"}, {SYS_waitid, "waitid"}, {SYS_flock, "flock"}, {SYS_fcntl, "fcntl"},
      {SYS_fsync, "fsync"}, {SYS_fdatasync, "fdatasync"}, {SYS_openat, "openat"},
      {SYS_io_uring_enter, "io_uring_enter"}, {SYS_msgrcv, "msgrcv"}, {SYS_semop, "semop"},
#ifdef SYS_poll
      {SYS_poll, "poll"},
#endif
#ifdef SYS_select
      {SYS_select, "select"},
#endif
#ifdef SYS_epoll_wait
      {SYS_epoll_wait, "epoll_wait"},
#endif
#ifdef SYS_pause
      {SYS_pause, "pause"},
#endif
  };
  for (const Entry& e : kNames) {
    if (e.nr == nr) return e.name;
  }
  return "?";
}

// " at 0x...: libc.so.6 (syscall+0x1d)" for a program counter (dynamic symbols only).
std::string describe_pc(unsigned long pc) {
  if (pc == 0) return {};
  char buf[320];
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(pc), &info) != 0 && info.dli_fname != nullptr) {
    const char* base = std::strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    if (info.dli_sname != nullptr && info.dli_saddr != nullptr) {
      std::snprintf(buf, sizeof buf, " at 0x%lx: %s (%s+0x%lx)", pc, base, info.dli_sname,
                    pc - reinterpret_cast<unsigned long>(info.dli_saddr));
    } else {
      std::snprintf(buf, sizeof buf, " at 0x%lx: %s+0x%lx", pc, base,
                    pc - reinterpret_cast<unsigned long>(info.dli_fbase));
    }
  } else {
    std::snprintf(buf, sizeof buf, " at 0x%lx", pc);
  }
  return buf;
}

void default_sink(const BlockedReport& r) {
  char buf[1024];
  const int n = std::snprintf(
      buf, sizeof buf,
      "libfiber: watchdog: fiber #%llu%s%.*s%s has run for %.1f ms without switching, holding processor %u of "
      "scheduler '%.*s' (thread %d, %zu fibers queued on it)%s%.*s. A CPU loop or a blocking call the hooks do not "
      "cover stalls its processor; see \"Watchdog\" in libfiber/README.md.\n",
      r.fiber_id, r.fiber_name.empty() ? "" : " '", static_cast<int>(r.fiber_name.size()), r.fiber_name.data(),
      r.fiber_name.empty() ? "" : "'", static_cast<double>(r.running_for.count()) / 1e6, r.processor,
      static_cast<int>(r.scheduler.size()), r.scheduler.data(), r.thread_id, r.queued, r.where.empty() ? "" : ": ",
      static_cast<int>(r.where.size()), r.where.data());
  if (n > 0) [[maybe_unused]] auto rc = detail::raw::write(2, buf, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof buf - 1));
}

}  // namespace

// ------------------------------------------------------------------------------ Monitor

Monitor::Monitor(SchedulerImpl& sched, const WatchdogOptions& o)
    : sched_(sched),
      interval_ns_(watchdog_ns(o.interval)),
      threshold_ns_(watchdog_ns(o.threshold)),
      sink_(o.sink),
      watch_(sched.max_processors()) {}

Monitor::~Monitor() { stop(); }

void Monitor::start() {
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    throw ResourceError(std::string("fiber::Scheduler: cannot start the watchdog thread: ") + e.what());
  }
}

void Monitor::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  blocked_now_.store(0, std::memory_order_relaxed);
}

WatchdogStats Monitor::stats() const noexcept {
  return WatchdogStats{
      .incidents = incidents_.load(std::memory_order_relaxed),
      .blocked_now = blocked_now_.load(std::memory_order_relaxed),
      .extra_running = 0,  // counted by the scheduler from the processors' states
      .extra_started = extra_started_.load(std::memory_order_relaxed),
      .extra_retired = extra_retired_.load(std::memory_order_relaxed),
  };
}

void Monitor::run() {
  const std::string tname = (sched_.name() + "-mon").substr(0, 15);
  pthread_setname_np(pthread_self(), tname.c_str());
  // The pace. Every `interval` while some processor kept its fiber since the last sample: a
  // stall may be starting, and it is timed from the first sample that saw it. While every
  // processor running a fiber has switched since, nothing can be stalled yet: up to a quarter
  // of the threshold apart (at most 10 ms), so a server whose fibers all keep switching does not
  // wake this thread a thousand times a second. While no processor runs a fiber nothing can
  // block: after 50 such samples, up to half the threshold (at most 10 ms). A stall is thus
  // reported up to a quarter of the threshold later than at a steady `interval` while busy, up
  // to half after an idle spell; so is a retired extra restarted for a pinned fiber woken there.
  const int64_t switching_max = std::max(interval_ns_, std::min<int64_t>(threshold_ns_ / 4, 10'000'000));
  const int64_t idle_max = std::max(interval_ns_, std::min<int64_t>(threshold_ns_ / 2, 10'000'000));
  int64_t sleep = interval_ns_;
  int quiet_rounds = 0;
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::nanoseconds(sleep), [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    const Pace pace = sample(steady_now_ns());
    lock.lock();
    switch (pace) {
      case Pace::Watching:
        quiet_rounds = 0;
        sleep = interval_ns_;
        break;
      case Pace::Switching:
        quiet_rounds = 0;
        sleep = std::min(sleep * 2, switching_max);
        break;
      case Pace::Idle:
        if (++quiet_rounds >= 50) sleep = std::min(sleep * 2, idle_max);
        break;
    }
  }
}

Monitor::Pace Monitor::sample(int64_t now) {
  const uint32_t slots = sched_.processor_slots();
  const uint32_t base = sched_.base_processors();
  uint32_t running = 0, blocked = 0;
  Pace pace = Pace::Idle;
  for (uint32_t i = 0; i < slots; ++i) {
    Processor& p = sched_.processor(i);
    Watch& w = watch_[i];
    const Processor::Life life = p.life();
    if (life != Processor::Life::Running) {
      w = Watch{};
      if (life == Processor::Life::Exited) {  // an extra retired: its thread has ended
        p.join();
        extra_retired_.fetch_add(1, std::memory_order_relaxed);
      }
      // A fiber pinned to a retired extra was woken: only that processor may run it.
      if (i >= base && p.inbox_pending()) start_processor(i);
      continue;
    }
    ++running;
    // Acquire, then the current fiber: `f` is the fiber of switch `seq` or of a later one.
    const uint64_t seq = p.switches();
    const Fiber* f = p.current();
    if (f != p.loop_fiber() && pace == Pace::Idle) pace = Pace::Switching;
    if (f == p.loop_fiber() || seq != w.seq || f != w.fiber) {
      // Switched since the last sample, or idle / between fibers: nothing can be blocked.
      w = Watch{.seq = seq, .fiber = f, .since = now};
      continue;
    }
    pace = Pace::Watching;
    const int64_t ran = now - w.since;  // no switch for at least this long
    if (w.cpu_mark_at == 0 && ran >= threshold_ns_ / 4) {
      w.cpu_mark = p.thread_cpu_ns();
      w.cpu_mark_at = now;
      w.spin_mark = p.spin_wait_cpu(w.cpu_mark);
    }
    if (ran < threshold_ns_) continue;
    if (!w.stalled) {
      w.stalled = true;
      w.queued = p.stealer().len() + (p.lifo_occupied() ? 1 : 0) + (p.yielded_occupied() ? 1 : 0) + p.pinned_queued();
    }
    // Name the culprit before the rescue: once its queue moves it may well stop blocking.
    std::optional<Culprit> culprit;
    if (!w.decided && decide(p, w, now, culprit.emplace().where)) {
      w.decided = true;
      w.blocked = identify(p, w, *culprit);
    } else {
      culprit.reset();
    }
    rescue(p, now);
    if (w.blocked) {
      ++blocked;
      if (culprit) report(p, w, now, *culprit);
    }
  }
  blocked_now_.store(blocked, std::memory_order_relaxed);
  if (running > 0 && blocked == running && running < sched_.max_processors() && !start_failed_ && work_pending()) {
    grow();
  }
  return pace;
}

// The fibers queued behind a stalled processor go where others can run them.
void Monitor::rescue(Processor& p, int64_t now) {
  // The LIFO and yield slots are the places other processors do not steal from.
  if (Fiber* f = p.steal_lifo()) sched_.inject(f);  // inject wakes a sleeper
  if (Fiber* f = p.steal_yielded()) sched_.inject(f);
  // Its timers fire only on its thread: fire the due ones here (the timer queue is locked, and
  // the woken fibers go to the injector, since this thread is not a processor).
  if (p.timers().next_deadline() <= now) p.timers().fire_expired(now);
  // Its ring is stealable: make sure a processor is looking.
  if (!p.stealer().is_empty()) sched_.notify_parked();
}

// Whether a stalled processor is blocked (an incident) or only waiting for a CPU.
bool Monitor::decide(Processor& p, Watch& w, int64_t now, std::string& where) {
  char buf[192];
  // In a spin-wait for a thread preempted in a window of a few instructions (a parking fiber's,
  // a finishing one's, a wait-queue lock's), when there are more threads than CPUs: like a thread
  // waiting for a CPU, not blocked by its fiber, though its yields use CPU time (which would
  // make it pass for a CPU loop) and are system calls. Looked at again on the next sample. A
  // window still open far longer than a preemption lasts is reported: a runtime bug, or a
  // blocking call of the user's inside one (a park's window holds a user lock's unlock()).
  if (const int64_t since = p.spin_wait_since(); since != 0) {
    const int64_t spun = now - since;
    if (spun < kSpinWaitReportAfter * threshold_ns_) return false;
    std::snprintf(buf, sizeof buf,
                  "in the runtime's spin-wait for %.1f ms for another thread's few instructions (a runtime bug, "
                  "or a blocking call in that window)",
                  static_cast<double>(spun) / 1e6);
    where = buf;
    return true;
  }
  ThreadProbe t = probe_thread(p.os_tid());
  const int64_t cpu = p.thread_cpu_ns();
  // A spin-wait begun since the look above: the probe may have caught one of its yields.
  if (p.spin_wait_since() != 0) return false;
  // A yield never blocks: judged by CPU time, as a thread running (a CPU loop that yields).
  if (t.kind == ThreadProbe::InSyscall && t.nr == SYS_sched_yield) t.kind = ThreadProbe::Running;
  switch (t.kind) {
    case ThreadProbe::InSyscall:
      std::snprintf(buf, sizeof buf, "blocked in system call %s (#%ld, first argument %lu)", syscall_name(t.nr), t.nr,
                    t.arg0);
      where = buf + describe_pc(t.pc);
      return true;
    case ThreadProbe::InKernel:
      where = "blocked in the kernel outside a system call (a page fault?)" + describe_pc(t.pc);
      return true;
    case ThreadProbe::Running:
    case ThreadProbe::Unknown:
      break;
  }
  if (cpu < 0 || w.cpu_mark < 0) {
    where = t.kind == ThreadProbe::Running ? "running, not in a system call" : "";
    return true;  // cannot tell a preempted thread from a busy one: count it
  }
  // Busy: at least a quarter of the threshold in CPU time since the mark (a third of the time
  // from the mark to the threshold), less what spin-waits used since (see above: a fiber may go
  // from one to the next without a switch, joining fibers that finish on a preempted thread).
  // A thread waiting for a CPU (preempted, its cgroup throttled) uses next to none; it is looked
  // at again on the next sample.
  const int64_t used = cpu - w.cpu_mark;
  const int64_t spun = std::clamp<int64_t>(p.spin_wait_cpu(cpu) - w.spin_mark, 0, std::max<int64_t>(used, 0));
  if ((used - spun) * 4 < threshold_ns_) return false;
  std::snprintf(buf, sizeof buf,
                "running, not in a system call (%.1f ms of CPU in the last %.1f ms, %.1f ms of it in spin-waits)",
                static_cast<double>(used) / 1e6, static_cast<double>(now - w.cpu_mark_at) / 1e6,
                static_cast<double>(spun) / 1e6);
  where = buf;
  return true;
}

// Copies the blocking fiber's id and name. False if the processor switched meanwhile (then it
// was not blocked after all).
bool Monitor::identify(Processor& p, const Watch& w, Culprit& c) {
  FiberReadHazard& hazard = sched_.hazard();
  if (!hazard.begin_read(w.fiber)) return true;  // cannot read it safely: report it unnamed (id 0)
  // Still the same fiber with no switch since: it cannot have finished, and if it finishes from
  // now on its processor waits in before_free() until end_read().
  const bool still = p.switches() == w.seq && p.current() == w.fiber;
  if (still) {
    c.id = w.fiber->id;
    if (w.fiber->name != nullptr) std::strncpy(c.name, w.fiber->name, sizeof c.name - 1);
  }
  hazard.end_read();
  return still;
}

// Counts the incident and hands the report to the sink.
void Monitor::report(Processor& p, const Watch& w, int64_t now, const Culprit& c) {
  incidents_.fetch_add(1, std::memory_order_relaxed);
  const BlockedReport r{
      .scheduler = sched_.name(),
      .fiber_id = c.id,
      .fiber_name = c.name,
      .running_for = std::chrono::nanoseconds(now - w.since),
      .processor = p.index(),
      .thread_id = p.os_tid(),
      .queued = w.queued,
      .where = c.where,
  };
  if (sink_) {
    try {
      sink_(r);
    } catch (...) {
      // The sink's problem; the watchdog carries on.
    }
  } else {
    default_sink(r);
  }
}

bool Monitor::work_pending() const noexcept {
  if (!sched_.injector().empty()) return true;
  const uint32_t slots = sched_.processor_slots();
  for (uint32_t i = 0; i < slots; ++i) {
    Processor& p = sched_.processor(i);
    if (p.life() == Processor::Life::Running && (!p.stealer().is_empty() || p.lifo_occupied() || p.yielded_occupied())) {
      return true;
    }
  }
  return false;
}

// Every running processor is blocked and fibers wait: one more processor (per sample at most;
// it is not blocked, so the next sample does not grow again until it is).
void Monitor::grow() {
  const uint32_t max = sched_.max_processors();
  for (uint32_t i = sched_.base_processors(); i < max; ++i) {
    if (i < sched_.processor_slots() && sched_.processor(i).life() != Processor::Life::Stopped) continue;
    start_processor(i);
    return;
  }
}

// Starts (or restarts) extra processor `index`, making its slot first if it never ran.
void Monitor::start_processor(uint32_t index) noexcept {
  // Counted first: the new thread may run (and finish) fibers before start() returns here.
  extra_started_.fetch_add(1, std::memory_order_relaxed);
  try {
    sched_.ensure_processor(index).start();
  } catch (const std::exception& e) {
    extra_started_.fetch_sub(1, std::memory_order_relaxed);
    if (!start_failed_) {
      std::fprintf(stderr, "libfiber: watchdog: cannot start extra processor %u of scheduler '%s': %s\n", index,
                   sched_.name().c_str(), e.what());
    }
    start_failed_ = true;
  }
}

}  // namespace fiber::detail
