#include "io/poller.hpp"

#include "io/raw.hpp"

#include <liburing.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "fiber/error.hpp"

namespace fiber::detail {
namespace {

constexpr uint64_t kIgnoreTag = 0;  // completions nobody waits for (cancel requests)
constexpr uint64_t kWakeTag = 1;    // the armed eventfd read (uring) / the eventfd (epoll)

timespec to_timespec(int64_t ns) noexcept {
  return timespec{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
}

// Set once epoll_pwait2 (Linux 5.11) has failed with ENOSYS, or EPERM: a seccomp profile older
// than the call, such as the container profiles that also refuse io_uring and so send processors
// to this engine. Relaxed: each processor finds out for itself at worst.
std::atomic<bool> g_no_epoll_pwait2{false};

// epoll_pwait2 with a timeout in nanoseconds (< 0: none); where it is refused, epoll_pwait with
// the timeout rounded up to whole milliseconds (a timer never fires early).
int epoll_wait_ns(int epfd, epoll_event* evs, int max, int64_t timeout_ns) noexcept {
  if (!g_no_epoll_pwait2.load(std::memory_order_relaxed)) {
    timespec ts{};
    if (timeout_ns >= 0) ts = to_timespec(timeout_ns);
    const int n = epoll_pwait2(epfd, evs, max, timeout_ns >= 0 ? &ts : nullptr, nullptr);
    if (n >= 0 || (errno != ENOSYS && errno != EPERM)) return n;
    g_no_epoll_pwait2.store(true, std::memory_order_relaxed);
  }
  int ms = -1;
  if (timeout_ns >= 0) {
    const int64_t up = timeout_ns / 1'000'000 + (timeout_ns % 1'000'000 != 0);  // no overflow near INT64_MAX
    ms = static_cast<int>(std::min<int64_t>(up, INT_MAX));
  }
  return epoll_pwait(epfd, evs, max, ms, nullptr);
}

}  // namespace

// ------------------------------------------------------------------------------ common

void Poller::complete(IoOp* op) noexcept {
  --inflight_;
  bump(completed_);
  Waiter& w = op->settling ? op->settle : op->w;
  if (waiter_claim(w, WakeReason::Notified)) {
    op->done.store(true, std::memory_order_release);
    waiter_wake(w);  // the fiber cannot resume before this; afterwards `op` may be gone
  } else {
    // Woken early (deadline, cancel, close): it is waiting to see `done`, and may return - and
    // free `op` - as soon as it does. Nothing of `op` is touched after this store.
    op->done.store(true, std::memory_order_release);
  }
}

// ------------------------------------------------------------------------------ io_uring

UringPoller::UringPoller(int efd, io_uring ring) noexcept : Poller(PollerKind::Uring, efd), ring_(ring) { arm(); }

UringPoller::~UringPoller() {
  io_uring_queue_exit(&ring_);
  raw::close(event_fd_);
}

const char* UringPoller::lacks_features(unsigned features) noexcept {
  if ((features & IORING_FEAT_EXT_ARG) == 0) return "no IORING_FEAT_EXT_ARG, which needs Linux 5.11";
  return nullptr;
}

int UringPoller::setup(io_uring* ring, const char*& why) noexcept {
  const unsigned flag_sets[] = {
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
      IORING_SETUP_SINGLE_ISSUER,
      0,
  };
  int rc = -EINVAL;
  for (unsigned flags : flag_sets) {
    io_uring_params p{};
    // A deep completion queue: every parked fiber may have an operation in flight, and an
    // overflow (kept by the kernel, reported as -EBUSY) costs a reap-and-retry.
    p.flags = flags | IORING_SETUP_CQSIZE;
    p.cq_entries = 8192;
    rc = io_uring_queue_init_params(512, ring, &p);
    if (rc != -EINVAL) break;
  }
  if (rc < 0) {
    why = std::strerror(-rc);
    return rc;
  }
  if (const char* lack = lacks_features(ring->features)) {
    io_uring_queue_exit(ring);
    why = lack;
    return -EOPNOTSUPP;
  }
  return 0;
}

io_uring_sqe* UringPoller::get_sqe() noexcept {
  for (;;) {
    if (io_uring_sqe* sqe = io_uring_get_sqe(&ring_)) return sqe;
    submit();  // the submission queue is full: hand it to the kernel
  }
}

void UringPoller::submit() noexcept {
  for (;;) {
    const int rc = io_uring_submit(&ring_);
    if (rc >= 0) return;
    if (rc == -EBUSY || rc == -EAGAIN) {
      // The completion queue overflowed (the kernel holds the rest): make room and retry.
      io_uring_get_events(&ring_);
      reap();
      continue;
    }
    if (rc != -EINTR) return;
  }
}

io_uring_sqe* UringPoller::sqe_for(IoOp* op) noexcept {
  io_uring_sqe* sqe = get_sqe();
  io_uring_sqe_set_data(sqe, op);
  ++inflight_;
  bump(submitted_);
  return sqe;
}

void UringPoller::cancel(IoOp* op) noexcept {
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_cancel(sqe, op, 0);
  io_uring_sqe_set_data64(sqe, kIgnoreTag);
}

unsigned UringPoller::reap() noexcept {
  unsigned head;
  unsigned seen = 0;
  unsigned woke = 0;
  io_uring_cqe* cqe;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++seen;
    const uint64_t tag = cqe->user_data;
    if (tag == kWakeTag) {
      armed_ = false;
    } else if (tag != kIgnoreTag) {
      auto* op = reinterpret_cast<IoOp*>(static_cast<uintptr_t>(tag));
      op->res = cqe->res;
      op->cqe_flags = cqe->flags;
      complete(op);
      ++woke;
    }
  }
  io_uring_cq_advance(&ring_, seen);
  if (!armed_) arm();
  return woke;
}

void UringPoller::wait(int64_t timeout_ns) noexcept {
  io_uring_cqe* cqe = nullptr;
  int rc;
  if (timeout_ns < 0) {
    rc = io_uring_submit_and_wait(&ring_, 1);
  } else {
    __kernel_timespec ts{timeout_ns / 1'000'000'000, timeout_ns % 1'000'000'000};
    rc = io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);  // -ETIME is a timeout
  }
  if (rc == -EBUSY) io_uring_get_events(&ring_);  // overflowed: reap below, submit next time
  reap();
}

bool UringPoller::poll() noexcept {
  if (io_uring_sq_ready(&ring_) == 0) {
    if (inflight_ == 0) return false;
    // Nothing to submit and, as far as the kernel has flagged, nothing completed: skip the
    // system call. A completion flagged just after this read is reaped by the next poll, or
    // by wait(), which always enters the kernel before the thread sleeps.
    if (nothing_pending()) return false;
  }
  // With DEFER_TASKRUN completions are posted only when we ask for them: submit and get events
  // in one io_uring_enter.
  if (io_uring_submit_and_get_events(&ring_) == -EBUSY) io_uring_get_events(&ring_);
  return reap() > 0;
}

void UringPoller::arm() noexcept {
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_read(sqe, event_fd_, &wake_buf_, sizeof wake_buf_, 0);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  armed_ = true;  // submitted with the next wait or poll
}

// ------------------------------------------------------------------------------ epoll

EpollPoller::EpollPoller(int efd, int epfd) noexcept : Poller(PollerKind::Epoll, efd), epfd_(epfd) {}

EpollPoller::~EpollPoller() {
  raw::close(epfd_);
  raw::close(event_fd_);
}

// fds are registered with data.u64 = fd + 2, so they never collide with the wake tag.
int EpollPoller::rearm(int fd, FdWaiters& fw) noexcept {
  uint32_t want = 0;
  for (IoOp* op = fw.head; op; op = op->next) want |= op->events;
  epoll_event ev{};
  ev.events = want | EPOLLONESHOT;
  ev.data.u64 = static_cast<uint64_t>(fd) + 2;
  int rc = epoll_ctl(epfd_, fw.registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &ev);
  if (rc != 0 && raw::last_errno() == ENOENT) rc = epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);  // closed and reopened
  if (rc != 0 && raw::last_errno() == EEXIST) rc = epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev);
  if (rc != 0) return -raw::last_errno();
  fw.registered = true;
  return 0;
}

int EpollPoller::arm(IoOp* op) noexcept {
  // A bad number must not grow the table (it is indexed by descriptor).
  if (op->fd < 0 || raw::fcntl(op->fd, F_GETFD) < 0) return -EBADF;
  const auto fd = static_cast<std::size_t>(op->fd);
  if (fd >= fds_.size()) fds_.resize(std::max<std::size_t>(fd + 1, fds_.size() * 2));
  FdWaiters& fw = fds_[fd];
  op->prev = nullptr;
  op->next = fw.head;
  if (fw.head) fw.head->prev = op;
  fw.head = op;
  const int rc = rearm(op->fd, fw);
  if (rc != 0) {
    fw.head = op->next;
    if (fw.head) fw.head->prev = nullptr;
    return rc;
  }
  ++inflight_;
  bump(submitted_);
  return 0;
}

void EpollPoller::disarm(IoOp* op) noexcept {
  FdWaiters& fw = fds_[static_cast<std::size_t>(op->fd)];
  if (op->prev) op->prev->next = op->next; else fw.head = op->next;
  if (op->next) op->next->prev = op->prev;
  --inflight_;
  bump(completed_);  // withdrawn
  // Its registration may still fire once (one-shot); dispatch then finds nobody.
}

unsigned EpollPoller::dispatch(int fd, uint32_t events) noexcept {
  if (static_cast<std::size_t>(fd) >= fds_.size()) return 0;
  FdWaiters& fw = fds_[static_cast<std::size_t>(fd)];
  const bool all = (events & (EPOLLERR | EPOLLHUP)) != 0;  // both directions learn of it
  unsigned woke = 0;
  for (IoOp* op = fw.head; op != nullptr;) {
    IoOp* next = op->next;
    if (all || (op->events & events) != 0) {
      if (op->prev) op->prev->next = op->next; else fw.head = op->next;
      if (op->next) op->next->prev = op->prev;
      complete(op);
      ++woke;
    }
    op = next;
  }
  if (fw.head) rearm(fd, fw);  // one-shot: waiters for the other direction need it again
  return woke;
}

unsigned EpollPoller::wait_events(int64_t timeout_ns) noexcept {
  epoll_event evs[64];
  const int n = epoll_wait_ns(epfd_, evs, 64, timeout_ns);
  unsigned woke = 0;
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == kWakeTag) {
      drain_eventfd();
    } else {
      woke += dispatch(static_cast<int>(evs[i].data.u64 - 2), evs[i].events);
    }
  }
  return woke;
}

void EpollPoller::wait(int64_t timeout_ns) noexcept { wait_events(timeout_ns); }

bool EpollPoller::poll() noexcept {
  if (inflight_ == 0) return false;
  return wait_events(0) > 0;
}

namespace {

enum class IoChoice { Auto, Uring, Epoll };

IoChoice io_choice() {
  const char* env = std::getenv("FIBER_IO");
  if (env == nullptr || *env == '\0') return IoChoice::Auto;
  std::string_view v(env);
  if (v == "uring" || v == "io_uring") return IoChoice::Uring;
  if (v == "epoll") return IoChoice::Epoll;
  throw UsageError("fiber: unknown FIBER_IO value '" + std::string(v) + "' (expected 'uring' or 'epoll')");
}

std::unique_ptr<Poller> make_epoll(int efd) {
  int epfd = epoll_create1(EPOLL_CLOEXEC);
  if (epfd < 0) {
    raw::close(efd);
    throw ResourceError(std::string("fiber: epoll_create1 failed: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  epoll_ctl(epfd, EPOLL_CTL_ADD, efd, &ev);
  return std::make_unique<EpollPoller>(efd, epfd);
}

std::atomic<bool> g_said_fallback{false};

}  // namespace

void Poller::wake() noexcept {
  const uint64_t one = 1;
  // EAGAIN (counter saturated) still leaves the fd readable: the wake is not lost.
  raw::write(event_fd_, &one, sizeof one);
}

void Poller::drain_eventfd() noexcept {
  uint64_t v;
  raw::read(event_fd_, &v, sizeof v);
}

void Poller::validate_env() { (void)io_choice(); }

std::unique_ptr<Poller> Poller::create() {
  const IoChoice choice = io_choice();
  // Non-blocking for epoll (drained after EPOLLIN); blocking for io_uring, which then waits for
  // the read by polling instead of failing it with EAGAIN.
  const int efd = eventfd(0, EFD_CLOEXEC | (choice == IoChoice::Epoll ? EFD_NONBLOCK : 0));
  if (efd < 0) throw ResourceError(std::string("fiber: eventfd failed: ") + std::strerror(errno));
  if (choice == IoChoice::Epoll) return make_epoll(efd);
  io_uring ring;
  const char* why = nullptr;
  if (UringPoller::setup(&ring, why) == 0) return std::make_unique<UringPoller>(efd, ring);
  raw::close(efd);
  if (choice == IoChoice::Uring) {
    throw ResourceError(std::string("fiber: FIBER_IO=uring but io_uring setup failed: ") + why);
  }
  if (!g_said_fallback.exchange(true)) {
    std::fprintf(stderr, "libfiber: io_uring unavailable (%s); using the epoll engine\n", why);
  }
  const int efd2 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd2 < 0) throw ResourceError(std::string("fiber: eventfd failed: ") + std::strerror(errno));
  return make_epoll(efd2);
}

}  // namespace fiber::detail
