// Helpers shared by the unit and stress tests.
//
//   for_each_proc_count(body)   runs body(scheduler, n) on fresh schedulers with 1, 2, 4 and 8
//                               processors, each as its own doctest SUBCASE ("processors=N"), so
//                               a failure - even one reported from a fiber - names the count.
//                               Each run is under a watchdog, and after the body returns the
//                               scheduler must have no live fibers left.
//   Watchdog / with_watchdog    abort the whole run with a message (instead of hanging the suite)
//                               when a body does not finish in time: a lost wakeup must fail.
//                               Before aborting it prints fiber::dump and (with gdb) the stacks.
//   run_on_thread               runs a body on a fresh std::thread (a plain, non-fiber thread),
//                               under a watchdog, and rethrows what it threw.
//   wait_for / quiesce          bounded polling.
//   SpinBarrier                 releases a few threads together (spinning), so their next steps race.
//
// Lifetimes: the runtime may still be inside WaitGroup::done() (or any other notify) for a moment
// after the woken side returned, so objects that fibers touch must outlive those fibers. Bodies
// either join what they spawn, or call quiesce(s) (every fiber finished) before their locals go.
#pragma once

#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <pthread.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace fiber_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

#if defined(FIBER_ASAN) || defined(FIBER_TSAN) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#if defined(FIBER_TSAN) || defined(__SANITIZE_THREAD__)
inline constexpr bool kTsan = true;
#else
inline constexpr bool kTsan = false;
#endif

// Time limits grow under sanitizers, which slow everything down by 2-20x.
inline constexpr int kSlowdown = kTsan ? 10 : (kSanitized ? 4 : 1);
inline std::chrono::milliseconds scaled(std::chrono::milliseconds d) { return d * kSlowdown; }

// Default limit for one for_each_proc_count run (one scheduler) and for with_watchdog.
inline constexpr std::chrono::milliseconds kDefaultLimit{60'000};

inline bool contains(std::string_view hay, std::string_view needle) {
  return hay.find(needle) != std::string_view::npos;
}

// The kernel thread id of the calling thread. A real system call each time: unlike
// pthread_self() or std::this_thread::get_id() (pthread_self is declared __attribute__((const))),
// the compiler can never reuse a value read before a fiber switch, so it always names the thread
// the caller runs on *now*.
inline pid_t os_tid() noexcept { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// The calling thread's name (processor threads are named "NAME-P<i>"). Not inlined, for the same
// reason as os_tid.
__attribute__((noinline)) inline std::string thread_name() {
  asm volatile("" ::: "memory");
  char buf[32] = {};
  pthread_getname_np(pthread_self(), buf, sizeof buf);
  return buf;
}

// Polls pred every `step` until it holds or `limit` passes. Works from threads and fibers
// (this_fiber::sleep_for blocks a thread, parks a fiber).
template <typename Pred>
bool wait_for(Pred&& pred, std::chrono::milliseconds limit = 10'000ms,
              std::chrono::microseconds step = 200us) {
  const auto deadline = Clock::now() + scaled(limit);
  while (!pred()) {
    if (Clock::now() >= deadline) return pred();
    fiber::this_fiber::sleep_for(step);
  }
  return true;
}

// How many times fibers of `s` have parked for `why` so far: waiting for this to grow tells a
// test that a fiber is (or was) parked there.
inline std::uint64_t park_count(fiber::Scheduler& s, fiber::detail::ParkReason why) {
  return s.stats().parks[static_cast<std::size_t>(why)];
}

// Waits (bounded) until `s` has no live fiber and checks that it got there. Use before the locals
// that fibers touch go out of scope when the fibers were not joined.
inline void quiesce(fiber::Scheduler& s, std::chrono::milliseconds limit = 10'000ms) {
  const bool idle = wait_for([&] { return s.live_fibers() == 0; }, limit);
  CHECK_MESSAGE(idle, "scheduler '" << s.name() << "' still has " << s.live_fibers() << " live fibers");
}

// Aborts the process with a message when not destroyed within `limit`. A hang (lost wakeup,
// deadlock) then fails loudly instead of stalling the suite forever.
class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds limit, std::string what)
      : what_(std::move(what)), limit_(scaled(limit)), thread_([this] { watch(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void watch() {
    std::unique_lock lock(mu_);
    if (cv_.wait_for(lock, limit_, [this] { return done_; })) return;
    std::fprintf(stderr,
                 "\n*** WATCHDOG: '%s' did not finish within %lld ms: a lost wakeup or a deadlock. "
                 "Aborting the test run. ***\n",
                 what_.c_str(), static_cast<long long>(limit_.count()));
    std::fflush(stderr);
    report_hang();
    FAIL_CHECK("watchdog expired: '" << what_ << "' did not finish within " << limit_.count() << " ms");
    std::fflush(stdout);
    std::abort();
  }

  // What the hang looks like, printed to stderr before the abort: every scheduler's processors
  // and fibers (fiber::dump, the first kDumpLines lines), then, where gdb is installed, every
  // thread's stack, and every parked fiber's when there are few enough to print. Each step is
  // bounded in time, so a dump that blocks on a lock the hung code holds cannot keep the run
  // from ending. Only the first watchdog to expire reports; a second one waits for its abort.
  static void report_hang() {
    static std::atomic_flag reporting = ATOMIC_FLAG_INIT;
    if (reporting.test_and_set()) {
      for (;;) std::this_thread::sleep_for(1s);
    }
    constexpr int kDumpLines = 300;
    // The promise keeps the shared state alive for a dump thread that outlives this call.
    std::promise<std::string> promise;
    std::future<std::string> text = promise.get_future();
    std::thread([p = std::move(promise)]() mutable {
      std::ostringstream out;
      fiber::dump(out);
      p.set_value(out.str());
    }).detach();
    int fibers = -1;  // unknown unless the dump finished
    if (text.wait_for(5s) != std::future_status::ready) {
      std::fprintf(stderr, "(fiber::dump did not finish within 5 s)\n");
    } else {
      std::istringstream in(text.get());
      std::string line;
      int lines = 0;
      fibers = 0;
      while (std::getline(in, line)) {
        fibers += contains(line, "  fiber #");
        if (++lines <= kDumpLines) std::fprintf(stderr, "%s\n", line.c_str());
      }
      if (lines > kDumpLines) std::fprintf(stderr, "(%d more lines of fiber::dump left out)\n", lines - kDumpLines);
    }
#ifdef FIBER_TEST_GDB_SCRIPT
    if (std::system("command -v gdb >/dev/null 2>&1") != 0) return;
    ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // Yama: let a child attach to us
    constexpr int kMaxFiberBacktraces = 200;
    // Threads first: with very many fibers the per-fiber part is what the time limit cuts off.
    std::string cmd = "timeout -k 5 60 gdb -batch -nx -p " + std::to_string(::getpid()) + " -x '" +
                      FIBER_TEST_GDB_SCRIPT + "' -ex 'thread apply all bt'";
    if (fibers >= 0 && fibers <= kMaxFiberBacktraces) cmd += " -ex 'info fibers' -ex 'fiber bt all'";
    cmd += " </dev/null 1>&2";
    std::fprintf(stderr, "--- %s\n", cmd.c_str());
    std::fflush(stderr);
    (void)std::system(cmd.c_str());
#endif
  }

  std::string what_;
  std::chrono::milliseconds limit_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // GUARDED_BY(mu_)
  std::thread thread_;  // last: starts after everything above exists
};

// Runs body() on the calling thread under a watchdog.
template <typename F>
decltype(auto) with_watchdog(std::chrono::milliseconds limit, const std::string& what, F&& body) {
  Watchdog wd(limit, what);
  return std::forward<F>(body)();
}

// Runs body() on a new plain thread and waits for it, under a watchdog; rethrows what it threw.
template <typename F>
void run_on_thread(F&& body, std::chrono::milliseconds limit = kDefaultLimit, const std::string& what = "plain thread") {
  Watchdog wd(limit, what);
  std::exception_ptr error;
  std::thread t([&] {
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
  });
  t.join();
  if (error) std::rethrow_exception(error);
}

inline constexpr std::initializer_list<int> kProcCounts = {1, 2, 4, 8};

// Runs body(scheduler, n) once per processor count, each time on a fresh, independent scheduler
// named `name` (its threads are "NAME-P<i>"), as a doctest SUBCASE named "processors=N". The body
// must join or quiesce everything it spawns: afterwards the scheduler must have no live fiber
// (pass check_no_live = false for bodies that stop the scheduler with fibers left on purpose).
template <typename F>
void for_each_proc_count(F&& body, std::initializer_list<int> counts = kProcCounts, bool check_no_live = true,
                         std::chrono::milliseconds limit = kDefaultLimit, const char* name = "t") {
  for (int n : counts) {
    const std::string label = "processors=" + std::to_string(n);
    SUBCASE(label.c_str()) {
      Watchdog wd(limit, label);
      fiber::Scheduler s({.processors = static_cast<std::size_t>(n), .name = name});
      REQUIRE(s.processors() == static_cast<std::size_t>(n));
      body(s, n);
      if (check_no_live) {
        CHECK_MESSAGE(s.live_fibers() == 0, label << ": " << s.live_fibers() << " fibers still live after the body");
      }
    }
  }
}

// Sets an environment variable for a scope and restores the previous value (or unsets it).
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  }
  ~EnvGuard() {
    if (had_) ::setenv(name_.c_str(), old_.c_str(), 1); else ::unsetenv(name_.c_str());
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

// Counts its destructions: RAII evidence that a fiber's stack was unwound.
struct DtorCounter {
  std::atomic<int>* counter;
  explicit DtorCounter(std::atomic<int>& c) : counter(&c) {}
  DtorCounter(const DtorCounter&) = delete;
  DtorCounter& operator=(const DtorCounter&) = delete;
  ~DtorCounter() { counter->fetch_add(1, std::memory_order_acq_rel); }
};

// A barrier for a few threads that spins briefly before it yields, so that they leave it close
// together.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 4096) {
        __builtin_ia32_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<int> gen_{0};
};

}  // namespace fiber_test
