#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
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
  if (const char* env = std::getenv("FIBER_PROCS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(env, &end, 10);
    if (errno != 0 || end == env || *end != '\0' || v < 1 || v > 1024) {
      throw UsageError(std::string("fiber: invalid FIBER_PROCS value '") + env + "' (expected an integer from 1 to 1024)");
    }
    return static_cast<std::size_t>(v);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? hw : 1;
}

namespace {

std::size_t resolve_stack_size(std::size_t requested) {
  if (requested != 0) return stack_size_class(requested);
  if (const char* env = std::getenv("FIBER_STACK_SIZE"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end == env || *end != '\0') {
      throw UsageError(std::string("fiber: invalid FIBER_STACK_SIZE value '") + env + "' (expected bytes)");
    }
    return stack_size_class(v);
  }
  return kDefaultStackSize;
}

}  // namespace

SchedulerImpl::SchedulerImpl(const Scheduler::Options& o)
    : name_(o.name.empty() ? "fiber" : o.name),
      default_stack_class_(resolve_stack_size(o.stack_size)),
      idle_(static_cast<uint32_t>(resolve_processor_count(o.processors))),
      registry_(idle_.num_processors() + 1) {
  Poller::validate_env();
  const uint32_t n = idle_.num_processors();
  processors_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) processors_.push_back(std::make_unique<Processor>(*this, i));
  uint32_t started = 0;
  try {
    for (; started < n; ++started) processors_[started]->start();
  } catch (...) {
    for (uint32_t i = 0; i < started; ++i) processors_[i]->request_shutdown();
    for (uint32_t i = 0; i < started; ++i) processors_[i]->join();
    throw;
  }
}

SchedulerImpl::~SchedulerImpl() { stop(); }

void SchedulerImpl::inject(Fiber* f) noexcept {
  injector_.push(f);
  notify_parked();
}

void SchedulerImpl::notify_parked() noexcept {
  if (auto id = idle_.processor_to_notify()) processors_[*id]->wake_thread();
}

void SchedulerImpl::notify_if_work_pending() noexcept {
  for (auto& p : processors_) {
    if (!p->stealer().is_empty()) {
      notify_parked();
      return;
    }
  }
  if (!injector_.empty()) notify_parked();
}

void SchedulerImpl::stop() {
  if (stopped_.load(std::memory_order_acquire)) return;
  if (Fiber* f = current_fiber(); f != nullptr && f->sched == this) {
    throw UsageError("fiber::Scheduler::stop: called from a fiber of scheduler '" + name_ +
                     "'; it would wait for itself");
  }
  static std::mutex stop_mu;  // serialises concurrent stop() calls; rare
  std::lock_guard lock(stop_mu);
  if (stopped_.load(std::memory_order_acquire)) return;
  stopping_.store(true, std::memory_order_release);
  // Cancel everything alive until nothing is: fibers spawned while unwinding get cancelled on
  // the next round. Backs off from 50 us to 5 ms between rounds.
  auto pause = std::chrono::microseconds(50);
  while (registry_.live() != 0) {
    registry_.for_each([](Fiber* f) { fiber_cancel(f); });
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
  }
  for (auto& p : processors_) p->request_shutdown();
  for (auto& p : processors_) p->join();
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

std::size_t Scheduler::processors() const noexcept { return impl_->num_processors(); }

const std::string& Scheduler::name() const noexcept { return impl_->name(); }

std::size_t Scheduler::live_fibers() const noexcept { return impl_->registry().live(); }

Scheduler& Scheduler::global() {
  // Never destroyed: fibers may run while static destructors do (like Go's runtime at exit).
  static Scheduler* s = new Scheduler(Options{.name = "fiber"});
  return *s;
}

}  // namespace fiber
