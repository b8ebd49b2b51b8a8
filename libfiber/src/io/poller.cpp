#include "io/poller.hpp"

#include <liburing.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "fiber/error.hpp"

namespace fiber::detail {
namespace {

constexpr uint64_t kWakeTag = 1;

timespec to_timespec(int64_t ns) noexcept {
  return timespec{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
}

class UringPoller final : public Poller {
 public:
  UringPoller(int efd, io_uring ring) noexcept : Poller(efd), ring_(ring) { arm(); }
  ~UringPoller() override {
    io_uring_queue_exit(&ring_);
    close(event_fd_);
  }

  // Tries SINGLE_ISSUER|DEFER_TASKRUN, then fewer flags on EINVAL. Returns -errno on failure.
  static int setup(io_uring* ring) noexcept {
    const unsigned flag_sets[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
        IORING_SETUP_SINGLE_ISSUER,
        0,
    };
    int rc = -EINVAL;
    for (unsigned flags : flag_sets) {
      io_uring_params p{};
      p.flags = flags;
      rc = io_uring_queue_init_params(256, ring, &p);
      if (rc != -EINVAL) break;
    }
    return rc;
  }

  void wait(int64_t timeout_ns) noexcept override {
    io_uring_cqe* cqe = nullptr;
    if (timeout_ns < 0) {
      io_uring_submit_and_wait(&ring_, 1);
    } else {
      __kernel_timespec ts{timeout_ns / 1'000'000'000, timeout_ns % 1'000'000'000};
      io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);  // -ETIME is a timeout
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      if (cqe->user_data == kWakeTag) armed_ = false;
    }
    io_uring_cq_advance(&ring_, seen);
    if (!armed_) arm();
  }
  PollerKind kind() const noexcept override { return PollerKind::Uring; }

 private:
  void arm() noexcept {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    io_uring_prep_read(sqe, event_fd_, &wake_buf_, sizeof wake_buf_, 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    armed_ = true;  // submitted with the next wait
  }

  io_uring ring_;
  uint64_t wake_buf_ = 0;
  bool armed_ = false;
};

class EpollPoller final : public Poller {
 public:
  EpollPoller(int efd, int epfd) noexcept : Poller(efd), epfd_(epfd) {}
  ~EpollPoller() override {
    close(epfd_);
    close(event_fd_);
  }
  void wait(int64_t timeout_ns) noexcept override {
    epoll_event evs[16];
    int n;
    if (timeout_ns < 0) {
      n = epoll_pwait2(epfd_, evs, 16, nullptr, nullptr);
    } else {
      timespec ts = to_timespec(timeout_ns);
      n = epoll_pwait2(epfd_, evs, 16, &ts, nullptr);
    }
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.u64 == kWakeTag) drain_eventfd();
    }
  }
  PollerKind kind() const noexcept override { return PollerKind::Epoll; }

 private:
  int epfd_;
};

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
    close(efd);
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
  [[maybe_unused]] ssize_t rc = write(event_fd_, &one, sizeof one);
}

void Poller::drain_eventfd() noexcept {
  uint64_t v;
  [[maybe_unused]] ssize_t rc = read(event_fd_, &v, sizeof v);
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
  const int rc = UringPoller::setup(&ring);
  if (rc == 0) return std::make_unique<UringPoller>(efd, ring);
  if (choice == IoChoice::Uring) {
    close(efd);
    throw ResourceError(std::string("fiber: FIBER_IO=uring but io_uring setup failed: ") + std::strerror(-rc));
  }
  close(efd);
  if (!g_said_fallback.exchange(true)) {
    std::fprintf(stderr, "libfiber: io_uring unavailable (%s); using the epoll engine\n", std::strerror(-rc));
  }
  const int efd2 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd2 < 0) throw ResourceError(std::string("fiber: eventfd failed: ") + std::strerror(errno));
  return make_epoll(efd2);
}

}  // namespace fiber::detail
