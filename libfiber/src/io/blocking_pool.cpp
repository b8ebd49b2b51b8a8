// The blocking-offload pool behind fiber::blocking (see fiber/blocking.hpp; DESIGN §7).
//
// One process-wide pool: a FIFO of jobs and the helper threads that run them, all under one
// std::mutex. This is not a hot path (every job costs a thread wakeup anyway), so a mutex and a
// condvar are enough. A job is a record on the calling fiber's stack - the type-erased call (a
// function pointer and its argument, both pointing further into that stack) and the fiber's
// Waiter - so a call allocates nothing.
//
// The caller waits shielded (waiter_prepare_shielded): the helper uses the caller's stack until
// the job's end, so a cancel must not resume the fiber earlier. The wake is the helper's last
// touch of the job. unpark() goes on to wake a processor of the fiber's scheduler after the
// fiber is queued - meanwhile the fiber may run and finish - but such a foreign wake is counted,
// and Scheduler::stop() waits for it to end (SchedulerImpl::foreign_wake_begin).
//
// Threads: a job that finds no idle thread for it starts one, up to max_threads; past that it
// queues for a busy thread, which looks at the queue before it idles. An idle thread exits after
// kIdleTimeout. Threads are detached and the pool is never destroyed, so a helper still running
// a job during static destruction or at exit finds its pool intact (and exit ends it).
//
// fork(): the child has none of the parent's helpers, and the pool's mutex or condvar may have
// been held or waited on by them at the fork. The child therefore drops the pool (keeping it
// reachable, for leak checkers) and starts a fresh one on first use.
#include "io/blocking_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <climits>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "fiber/blocking.hpp"
#include "fiber/detail/wait.hpp"
#include "fiber/error.hpp"
#include "sched/env.hpp"
#include "sched/fiber.hpp"
#include "sched/runtime.hpp"

namespace fiber::detail {

namespace {

constexpr auto kIdleTimeout = std::chrono::seconds(10);

// One blocking() call, on the calling fiber's stack; or a detached job (blocking_detach), on the
// heap, which nobody waits for and its helper deletes.
struct Job {
  void (*run)(void*) noexcept;
  void* arg;
  Waiter waiter;        // the caller's, prepared shielded before the job is queued; unused if detached
  Job* next = nullptr;  // queue link; GUARDED_BY(Pool::mu_)
  bool detached = false;
};

class Pool {
 public:
  explicit Pool(std::size_t max_threads) : max_threads_(max_threads) {}

  // Queues `job` and makes sure a thread will take it: wakes an idle one, else starts one, else
  // (at the limit) leaves it to a busy one. Throws ResourceError, with the job not queued, if no
  // helper thread exists and none can be started.
  void submit(Job& job);
  BlockingPoolStats stats() noexcept;

  Pool* forked_away = nullptr;  // a pool an earlier fork() dropped; written only in the child

 private:
  void worker() noexcept;
  void push(Job& job) noexcept;
  Job* pop() noexcept;
  void unlink(Job& job) noexcept;

  const std::size_t max_threads_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // idle threads wait here for head_ != nullptr
  // FIFO of jobs no thread has taken yet. GUARDED_BY(mu_). Every queued job gets taken: each
  // submit wakes an idle thread if there is one, starts one more while jobs outnumber idle
  // threads (up to the limit), and never leaves a job queued with threads_ == 0; a helper
  // re-checks the queue after each job before it idles.
  Job* head_ = nullptr;
  Job* tail_ = nullptr;
  std::size_t queued_ = 0;   // GUARDED_BY(mu_); the length of that FIFO
  std::size_t threads_ = 0;  // GUARDED_BY(mu_); helpers started and not yet exited; <= max_threads_
  std::size_t idle_ = 0;     // GUARDED_BY(mu_); of those, the ones waiting on work_cv_; <= threads_
};

void Pool::push(Job& job) noexcept {
  job.next = nullptr;
  if (tail_) tail_->next = &job; else head_ = &job;
  tail_ = &job;
  ++queued_;
}

Job* Pool::pop() noexcept {
  Job* job = head_;
  head_ = job->next;
  if (head_ == nullptr) tail_ = nullptr;
  --queued_;
  return job;
}

void Pool::unlink(Job& job) noexcept {
  Job* prev = nullptr;
  for (Job* j = head_; j != nullptr; prev = j, j = j->next) {
    if (j != &job) continue;
    if (prev) prev->next = j->next; else head_ = j->next;
    if (tail_ == j) tail_ = prev;
    --queued_;
    return;
  }
}

void Pool::submit(Job& job) {
  std::lock_guard lock(mu_);
  push(job);
  // An idle thread takes it; a woken one that finds the queue empty (a finishing helper was
  // quicker) just waits again. With more jobs queued than idle threads, start one more.
  if (idle_ > 0) work_cv_.notify_one();
  if (queued_ <= idle_) return;
  if (threads_ == max_threads_) return;  // at the limit: a busy thread takes it when done
  ++threads_;
  try {
    std::thread([this] { worker(); }).detach();
  } catch (const std::exception& e) {  // std::system_error (EAGAIN), std::bad_alloc
    --threads_;
    if (threads_ > 0) return;  // some helper comes back to the queue and takes it
    unlink(job);  // no helper exists, so nobody saw it
    throw ResourceError(std::string("fiber::blocking: cannot start a helper thread: ") + e.what());
  }
}

void Pool::worker() noexcept {
  pthread_setname_np(pthread_self(), "fiber-blocking");
  std::unique_lock lock(mu_);
  for (;;) {
    if (head_ == nullptr) {
      ++idle_;
      const bool got = work_cv_.wait_for(lock, kIdleTimeout, [this] { return head_ != nullptr; });
      --idle_;
      if (!got) break;  // idle for kIdleTimeout: exit
    }
    Job* job = pop();
    lock.unlock();
    job->run(job->arg);
    if (job->detached) {
      delete job;
    } else {
      // The claim (acq_rel) publishes what run() wrote on the caller's stack; after the wake the
      // job may be gone.
      waiter_notify(job->waiter);
    }
    lock.lock();
  }
  --threads_;
}

BlockingPoolStats Pool::stats() noexcept {
  std::lock_guard lock(mu_);
  return {.threads = threads_, .idle = idle_, .queued = queued_, .max_threads = max_threads_};
}

// The pool; nullptr until first use. Set once per process image (the CAS in pool()), cleared
// only by the fork child handler (then the child is single-threaded).
std::atomic<Pool*> g_pool{nullptr};
Pool* g_forked_away = nullptr;  // pools dropped by fork(), chained; touched only in a child

void forget_pool_in_child() noexcept {
  Pool* old = g_pool.exchange(nullptr, std::memory_order_relaxed);
  if (old == nullptr) return;
  old->forked_away = g_forked_away;
  g_forked_away = old;
}

[[maybe_unused]] const int g_atfork_registered = pthread_atfork(nullptr, nullptr, &forget_pool_in_child);

// The pool, created on first use. Throws UsageError for an invalid $FIBER_BLOCKING_THREADS.
Pool& pool() {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
  auto fresh = std::make_unique<Pool>(parse_blocking_threads(std::getenv("FIBER_BLOCKING_THREADS")));
  Pool* expected = nullptr;
  if (g_pool.compare_exchange_strong(expected, fresh.get(), std::memory_order_acq_rel)) {
    return *fresh.release();  // never destroyed, see the top of the file
  }
  return *expected;  // another thread was first
}

}  // namespace

std::size_t parse_blocking_threads(const char* value) {
  const auto v = parse_env_in_range("FIBER_BLOCKING_THREADS", value, 1, LONG_MAX, "a positive integer");
  return v ? static_cast<std::size_t>(*v) : kDefaultBlockingThreads;
}

BlockingPoolStats blocking_pool_stats() noexcept {
  Pool* p = g_pool.load(std::memory_order_acquire);
  return p ? p->stats() : BlockingPoolStats{};
}

void blocking_detach(void (*run)(void*) noexcept, void* arg) {
  Pool& p = pool();
  std::unique_ptr<Job> job(new Job{run, arg});
  job->detached = true;
  p.submit(*job);  // throws with the job not queued
  (void)job.release();  // the helper deletes it
}

void blocking_run(void (*run)(void*) noexcept, void* arg) {
  Fiber* self = current_fiber();
  if (self == nullptr) {
    run(arg);
    return;
  }
  throw_if_cancelled(self);
  Pool& p = pool();
  Job job{run, arg};
  waiter_prepare_shielded(job.waiter);
  try {
    p.submit(job);
  } catch (...) {
    waiter_abandon(job.waiter);
    throw;
  }
  const WakeReason r = waiter_wait(job.waiter, ParkReason::Blocking);
  if (r != WakeReason::Notified) {
    // Only the helper may end this wait: cancels skip a shielded wait and it has no deadline.
    std::fprintf(stderr, "libfiber: broken invariant: a blocking() wait ended before its job (reason %d)\n",
                 static_cast<int>(r));
    std::abort();
  }
}

}  // namespace fiber::detail
