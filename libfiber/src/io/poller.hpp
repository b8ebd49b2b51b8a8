// Poller: what a processor waits in when it has nothing to run, and how other threads wake it.
//
// UringPoller waits in the processor's own io_uring (created on the processor's thread with
// SINGLE_ISSUER|DEFER_TASKRUN where the kernel accepts them), with the next timer as timeout;
// an eventfd read is kept armed in the ring so a write from any thread completes it. The I/O
// engine submits to the same ring. EpollPoller is the fallback where io_uring is unavailable
// (EPERM from a seccomp profile, ENOSYS): it waits in epoll_pwait2 on the same eventfd.
// FIBER_IO=uring|epoll forces one. See libfiber/README.md, "I/O engine".
#pragma once

#include <cstdint>
#include <memory>

namespace fiber::detail {

enum class PollerKind { Uring, Epoll };

class Poller {
 public:
  virtual ~Poller() = default;
  // Waits for a wake or an event, at most timeout_ns (-1: no limit; 0: just poll).
  virtual void wait(int64_t timeout_ns) noexcept = 0;
  // Any thread: makes a current or next wait() return.
  void wake() noexcept;
  virtual PollerKind kind() const noexcept = 0;

  // Creates the poller $FIBER_IO asks for (auto by default), on the calling thread.
  // Throws UsageError for an unknown FIBER_IO value, ResourceError if nothing can be created.
  static std::unique_ptr<Poller> create();
  // Checks $FIBER_IO without creating anything (throws UsageError when it is invalid).
  static void validate_env();

 protected:
  explicit Poller(int event_fd) noexcept : event_fd_(event_fd) {}
  void drain_eventfd() noexcept;
  int event_fd_;
};

}  // namespace fiber::detail
