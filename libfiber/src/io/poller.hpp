// Poller: the per-processor I/O engine. What a processor waits in when it has nothing to run,
// how other threads wake it, and where fibers' I/O operations wait.
//
// UringPoller waits in the processor's own io_uring (created on the processor's thread with
// SINGLE_ISSUER|DEFER_TASKRUN where the kernel accepts them), with the next timer as timeout;
// an eventfd read is kept armed in the ring so a write from any thread completes it. A fiber's
// operation is an SQE whose user_data is the IoOp on the fiber's stack; SQEs are batched and
// submitted when the processor polls (every few fibers) or waits.
//
// EpollPoller is the fallback where io_uring is unavailable (EPERM from a seccomp profile,
// ENOSYS, a kernel before 5.11): it waits in epoll_pwait2 (epoll_pwait where that is refused)
// on the same eventfd, and fibers wait there for readiness (one-shot registrations, re-armed
// per wait) and then make the call themselves.
//
// FIBER_IO=uring|epoll forces one. See libfiber/README.md, "I/O engine".
//
// Ownership rule: a pending IoOp belongs to the processor it was submitted on (its "home"); only
// that processor's thread touches the ring, the epoll registrations and the op's bookkeeping.
// A fiber woken early (deadline, cancel, close) goes home before it withdraws its op.
#pragma once

#include <liburing.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "fiber/detail/wait.hpp"

namespace fiber::detail {

enum class PollerKind { Uring, Epoll };

// A fiber's I/O operation, on its stack from submission until it is done.
struct IoOp {
  Waiter w;        // the wait; claimed by the completion, a deadline, a cancel or a close
  Waiter settle;   // the shielded wait for the completion after an early wake (uring)
  int32_t res = 0;  // the completion's result (uring); written by the home thread before `done`
  uint32_t cqe_flags = 0;  // the completion's flags (uring); written with `res`
  // The completion (uring) or readiness (epoll) has arrived and the home thread will not touch
  // this op again. Release-stored by the home thread last; acquire-loaded by the fiber.
  std::atomic<bool> done{false};
  bool settling = false;  // home thread only: the fiber waits on `settle` rather than `w`
  std::atomic<bool> closed{false};  // set by io::close (under the fd slot's lock) before it claims `w`
  // epoll: the descriptor and readiness it waits for, and its link among that fd's waiters.
  int fd = -1;
  uint32_t events = 0;
  IoOp* next = nullptr;
  IoOp* prev = nullptr;
  // The fd table slot's list of ops in progress (see io/fd_table.hpp); guarded by its lock.
  IoOp* slot_next = nullptr;
  IoOp* slot_prev = nullptr;
};

class Poller {
 public:
  virtual ~Poller() = default;
  // Waits for a wake or an event, at most timeout_ns (-1: no limit; 0: just poll), and wakes
  // the fibers whose operations completed.
  virtual void wait(int64_t timeout_ns) noexcept = 0;
  // Without waiting: submits what is queued and wakes the fibers whose operations completed.
  // True if it woke any.
  virtual bool poll() noexcept = 0;
  // Whether poll() finds out that nothing has completed without a system call (a ring set up
  // with TASKRUN_FLAG), so polling in a loop is cheap (Processor::spin_for_work).
  virtual bool polls_cheaply() const noexcept { return false; }
  // Any thread: makes a current or next wait() return.
  void wake() noexcept;
  PollerKind kind() const noexcept { return kind_; }
  // Operations submitted here and not yet completed. Owner thread only.
  uint32_t inflight() const noexcept { return inflight_; }
  // All-time counts, for stats (any thread; single writer, the owner).
  uint64_t submitted() const noexcept { return submitted_.load(std::memory_order_relaxed); }
  uint64_t completed() const noexcept { return completed_.load(std::memory_order_relaxed); }

  // Creates the poller $FIBER_IO asks for (auto by default), on the calling thread.
  // Throws UsageError for an unknown FIBER_IO value, ResourceError if nothing can be created.
  static std::unique_ptr<Poller> create();
  // Checks $FIBER_IO without creating anything (throws UsageError when it is invalid).
  static void validate_env();

 protected:
  Poller(PollerKind kind, int event_fd) noexcept : event_fd_(event_fd), kind_(kind) {}
  void drain_eventfd() noexcept;
  // Marks `op` complete and wakes its fiber (or, if it was woken early, lets it go on).
  void complete(IoOp* op) noexcept;
  // Single writer (the owner): a plain increment, published relaxed for stats readers.
  static void bump(std::atomic<uint64_t>& c) noexcept { c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }
  int event_fd_;
  uint32_t inflight_ = 0;  // owner thread only
  std::atomic<uint64_t> submitted_{0}, completed_{0};  // single writer (the owner)

 private:
  PollerKind kind_;
};

class UringPoller final : public Poller {
 public:
  UringPoller(int efd, io_uring ring) noexcept;
  ~UringPoller() override;
  // Tries SINGLE_ISSUER|DEFER_TASKRUN|TASKRUN_FLAG, then fewer flags on EINVAL. Returns -errno on
  // failure, with `why` saying what failed (a static string); a ring the kernel sets up but
  // lacks_features() is refused (-EOPNOTSUPP).
  static int setup(io_uring* ring, const char*& why) noexcept;
  // What a ring with these IORING_FEAT_* bits lacks for this engine, or nullptr. EXT_ARG (Linux
  // 5.11): without it liburing times a wait with a counted timeout SQE of its own, which a
  // completion of the previous wait's one can satisfy at once, leaving the wait with no timeout
  // at all; and that SQE's completion carries a tag reap() would take for an IoOp.
  static const char* lacks_features(unsigned features) noexcept;

  void wait(int64_t timeout_ns) noexcept override;
  bool poll() noexcept override;
  bool polls_cheaply() const noexcept override { return (ring_.flags & IORING_SETUP_TASKRUN_FLAG) != 0; }

  // An SQE for `op` (user_data set); never null: submits (and reaps, on -EBUSY) to make room.
  io_uring_sqe* sqe_for(IoOp* op) noexcept;
  // Asks the kernel to cancel `op` (its completion then arrives with -ECANCELED, or its real
  // result if it won the race).
  void cancel(IoOp* op) noexcept;
  // Whether socket receives may carry IORING_RECVSEND_POLL_FIRST (Linux 5.19): a
  // ring the kernel set up with SINGLE_ISSUER (6.0) is new enough.
  bool poll_first_ok() const noexcept { return (ring_.flags & IORING_SETUP_SINGLE_ISSUER) != 0; }

 private:
  io_uring_sqe* get_sqe() noexcept;
  void submit() noexcept;
  unsigned reap() noexcept;  // handles every CQE there is; returns how many woke a fiber
  void arm() noexcept;
  // The ring has nothing for reap() and no completion waiting to be posted. Known only on a
  // ring set up with TASKRUN_FLAG (the kernel then flags, in the SQ ring, completions that
  // DEFER_TASKRUN holds until we enter the kernel); false, so the caller enters, elsewhere.
  bool nothing_pending() const noexcept {
    if (!polls_cheaply()) return false;
    const unsigned f = __atomic_load_n(ring_.sq.kflags, __ATOMIC_ACQUIRE);
    return (f & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW)) == 0 && io_uring_cq_ready(&ring_) == 0;
  }

  io_uring ring_;
  uint64_t wake_buf_ = 0;
  bool armed_ = false;
};

class EpollPoller final : public Poller {
 public:
  EpollPoller(int efd, int epfd) noexcept;
  ~EpollPoller() override;

  void wait(int64_t timeout_ns) noexcept override;
  bool poll() noexcept override;

  // Registers `op` to be completed when op->fd is ready for op->events (EPOLLIN/EPOLLOUT);
  // 0, or -errno from epoll_ctl (EPERM: the fd does not support polling, e.g. a regular file).
  int arm(IoOp* op) noexcept;
  // Withdraws an op that has not completed.
  void disarm(IoOp* op) noexcept;

 private:
  struct FdWaiters {
    IoOp* head = nullptr;
    bool registered = false;  // epoll_ctl ADD done (it may have vanished on close: ENOENT)
  };
  int rearm(int fd, FdWaiters& fw) noexcept;
  unsigned dispatch(int fd, uint32_t events) noexcept;
  unsigned wait_events(int64_t timeout_ns) noexcept;

  int epfd_;
  std::vector<FdWaiters> fds_;  // indexed by fd; owner thread only
};

}  // namespace fiber::detail
