// fiber::io: every call takes one of three paths.
//
//   fiber, io_uring  the operation is an SQE whose user_data is an IoOp on the fiber's stack;
//                    the fiber parks until its completion wakes it (ring_op).
//   fiber, epoll     the call is made non-blocking; on EAGAIN the fiber parks until the engine
//                    reports readiness, then tries again (ready_loop with wait_ready).
//   plain thread     the real call, which blocks; with a deadline, poll() first (ready_loop
//                    with poll_ready).
//
// An early wake (deadline, cancel, io::close) may come while the operation is still in the
// kernel. The fiber then goes home - to the processor whose ring or epoll set holds the
// operation, the only thread that may touch it - and withdraws it there: io_uring gets an
// ASYNC_CANCEL and the fiber waits (shielded from further cancels) for the completion, since
// the kernel may still write into its buffer until then; epoll simply drops the registration.
// If the operation completed anyway, its result stands (no data is lost to a deadline).
#include "fiber/io.hpp"

#include "fiber/blocking.hpp"
#include "fiber/error.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <new>
#include <vector>

#include "io/fd_table.hpp"
#include "io/raw.hpp"
#include "io/poller.hpp"
#include "io/socket.hpp"
#include "sched/fiber.hpp"
#include "sched/processor.hpp"
#include "sched/runtime.hpp"

namespace fiber::detail {

// ------------------------------------------------------------------------------ fd table

FdSlot* FdTable::allocate(std::atomic<FdSlot*>& c) noexcept {
  auto* fresh = new (std::nothrow) FdSlot[1 << kChunkBits];
  if (fresh == nullptr) return nullptr;
  FdSlot* expected = nullptr;
  if (c.compare_exchange_strong(expected, fresh, std::memory_order_acq_rel)) return fresh;
  delete[] fresh;  // another thread published one first
  return expected;
}

FdTable& fd_table() noexcept {
  static FdTable* table = new FdTable();  // never destroyed: used until the last thread ends
  return *table;
}

bool fd_begin(FdSlot* slot, IoOp* op) noexcept {
  std::lock_guard lock(slot->lock);
  if (slot->closing) return false;
  op->slot_prev = nullptr;
  op->slot_next = slot->ops;
  if (slot->ops) slot->ops->slot_prev = op;
  slot->ops = op;
  return true;
}

void fd_end(FdSlot* slot, IoOp* op) noexcept {
  std::lock_guard lock(slot->lock);
  if (op->slot_prev) op->slot_prev->slot_next = op->slot_next; else slot->ops = op->slot_next;
  if (op->slot_next) op->slot_next->slot_prev = op->slot_prev;
  if (slot->ops == nullptr) slot->closers.notify_all();
}

namespace {

// ------------------------------------------------------------------------------ helpers


bool cancel_requested(const Fiber* f) noexcept {
  return WakeWord::unpack(f->wake_word.load(std::memory_order_acquire)).cancelled;
}

// What an early-woken operation reports when it did not complete.
int32_t early_error(const IoOp& op, WakeReason why) noexcept {
  if (op.closed.load(std::memory_order_relaxed)) return -EBADF;
  return why == WakeReason::Timeout ? -ETIMEDOUT : -ECANCELED;
}

// After an early wake: withdraw the operation on its home processor, if it is still pending.
void settle(IoOp& op, Processor* home) noexcept {
  if (op.done.load(std::memory_order_acquire)) return;
  Processor::move_current_to(home);
  // Home now, and only this thread writes `done` here: a plain check is enough.
  if (!op.done.load(std::memory_order_acquire)) {
    Poller& poller = home->poller();
    if (poller.kind() == PollerKind::Uring) {
      op.settling = true;
      waiter_prepare_shielded(op.settle);
      static_cast<UringPoller&>(poller).cancel(&op);
      waiter_wait(op.settle, ParkReason::IO);  // until its completion arrives
    } else {
      static_cast<EpollPoller&>(poller).disarm(&op);
    }
  }
  Processor::unpin_current();
}

// Parks the calling fiber until `op` completes, or the deadline, a cancel or a close ends the
// wait early. `op.w` must be prepared and `op` submitted.
WakeReason park_on(IoOp& op, const io::Deadline& dl) noexcept {
  return dl.is_none() ? waiter_wait(op.w, ParkReason::IO) : waiter_wait_until(op.w, ParkReason::IO, dl.at());
}

// Lists the op on its descriptor for io::close (see fd_table.hpp) for the scope of a call.
class FdGuard {
 public:
  FdGuard(int fd, IoOp* op) noexcept : slot_(fd_table().slot(fd)), op_(op) {
    if (slot_ && !fd_begin(slot_, op_)) {
      slot_ = nullptr;
      ok_ = false;
    }
  }
  ~FdGuard() {
    if (slot_) fd_end(slot_, op_);
  }
  bool ok() const noexcept { return ok_; }
  FdSlot* slot() const noexcept { return slot_; }  // null for descriptors the table does not track

 private:
  FdSlot* slot_;
  IoOp* op_;
  bool ok_ = true;
};

// The checks every call makes first: -ECANCELED, -ETIMEDOUT, or 0 to go on.
int precheck(const Fiber* f, const io::Deadline& dl) noexcept {
  if (f != nullptr) {
    ensure_listed(f);  // an operation that never parks (data waiting) is a cancellation point too
    if (cancel_requested(f)) return -ECANCELED;
  }
  if (dl.expired()) return -ETIMEDOUT;
  return 0;
}

// The kernel moves at most MAX_RW_COUNT (INT_MAX & PAGE_MASK) bytes per call and returns a short
// count beyond it, but an SQE's length has 32 bits: liburing's prep helpers would truncate a
// longer request (4 GiB exactly becomes 0, which a receive reports as end of stream and a send
// as nothing sent). So every request is clamped first, on every path, for the same counts.
constexpr size_t kMaxRwCount = 0x7ffff000;  // 4 KiB pages; with larger ones the kernel clamps further
size_t clamp_len(size_t n) noexcept { return n < kMaxRwCount ? n : kMaxRwCount; }

// ------------------------------------------------------------------------------ io_uring path

// Receives from a known socket (`recv`: net::Stream's, see recv_socket): the kernel first
// attempts a receive and arms a poll only if it would block. A receive usually finds its socket
// empty (a server between requests, a client awaiting a reply), and then that attempt is wasted
// work: a socket lock and unlock, 1-2% of a loopback round trip (tools/bench/run tcp_pingpong).
// So it asks for the poll first (IORING_RECVSEND_POLL_FIRST) unless the last receive on the
// descriptor left data behind (IORING_CQE_F_SOCK_NONEMPTY, kept in its FdSlot): a bulk reader
// keeps receiving at once (tcp_stream: with the poll always first it is 30% slower). Not for io::recv: on a descriptor
// that is not a socket the kernel checks for readability before it fails with ENOTSOCK, so an
// empty pipe would wait forever.
template <typename Prep>
ssize_t ring_op(int fd, const io::Deadline& dl, Prep&& prep, bool recv = false) noexcept {
  IoOp op;
  // Prepared before it is listed: io::close() may claim it from then on.
  waiter_prepare(op.w);
  FdGuard guard(fd, &op);
  if (!guard.ok()) {
    waiter_abandon(op.w);
    return -EBADF;
  }
  Processor* home = current_processor();
  auto& ring = static_cast<UringPoller&>(home->poller());
  io_uring_sqe* sqe = ring.sqe_for(&op);
  prep(sqe);
  FdSlot* slot = guard.slot();
  const bool backlog = recv && slot != nullptr && slot->recv_backlog.load(std::memory_order_relaxed);
  if (recv && !backlog && ring.poll_first_ok()) sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
  const WakeReason why = park_on(op, dl);
  if (why != WakeReason::Notified) {
    settle(op, home);
    // Withdrawn: say why it was woken. (Completed after all, winning the race: its result stands.)
    if (op.res == -ECANCELED || op.res == -EINTR) return early_error(op, why);
  }
  if (recv && slot != nullptr) {
    const bool left = op.res > 0 && (op.cqe_flags & IORING_CQE_F_SOCK_NONEMPTY) != 0;
    if (left != backlog) slot->recv_backlog.store(left, std::memory_order_relaxed);  // the line stays clean
  }
  return op.res;
}

// ------------------------------------------------------------------------------ readiness path

// Whether epoll can watch `fd`: false for a file without a poll method (a regular file,
// /dev/null, /dev/hwrng), which poll(2) calls always ready. Asked of an epoll set made for the
// question: three system calls, only where a character device is waited for. Not one kept for
// good, whose number an application's close_range or double close could free for another
// file. Errors other than EPERM say true, leaving the answer to the wait (EBADF) or, out of
// descriptors, to the ring's poll.
bool epoll_watchable(int fd) noexcept {
  const int probe = static_cast<int>(raw::ret(::syscall(SYS_epoll_create1, EPOLL_CLOEXEC)));
  if (probe < 0) return true;
  epoll_event ev{};
  const bool watchable = ::syscall(SYS_epoll_ctl, probe, EPOLL_CTL_ADD, fd, &ev) == 0 || raw::last_errno() != EPERM;
  raw::close(probe);  // and with it the registration
  return watchable;
}

// Parks until `fd` is ready for `events` (poll(2) bits, which are epoll's). 0, or -errno;
// -EPERM where the engine cannot watch the descriptor (a regular file, /dev/null). The ring's
// poll of such a file does not say so: it completes at once, ready for what poll(2) would
// report (input and output). `probe`: find that out first (a character device, where a call
// made on that false readiness could block the processor's thread).
int wait_ready_fiber(int fd, uint32_t events, const io::Deadline& dl, bool probe) noexcept {
  if (current_processor()->poller().kind() == PollerKind::Uring) {
    if (probe && !epoll_watchable(fd)) return -EPERM;
    const auto rc = ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_poll_add(s, fd, events & 0xffff); });
    if (rc == -EINVAL) return -EPERM;  // events a file without a poll method never has
    return rc > 0 ? 0 : static_cast<int>(rc);  // ERR/HUP/NVAL: the call will say what
  }
  IoOp op;
  op.fd = fd;
  op.events = events;
  waiter_prepare(op.w);  // before it is listed: io::close() may claim it from then on
  FdGuard guard(fd, &op);
  if (!guard.ok()) {
    waiter_abandon(op.w);
    return -EBADF;
  }
  Processor* home = current_processor();
  auto& ep = static_cast<EpollPoller&>(home->poller());
  if (const int rc = ep.arm(&op); rc != 0) {
    waiter_abandon(op.w);
    return rc;
  }
  const WakeReason why = park_on(op, dl);
  if (why == WakeReason::Notified) return 0;
  settle(op, home);
  return early_error(op, why);
}

// A plain thread's poll(2) until something is ready (the count) or the deadline (-ETIMEDOUT), or
// poll's error; through signals.
int poll_thread(pollfd* fds, nfds_t n, const io::Deadline& dl) noexcept {
  for (;;) {
    timespec ts{};
    timespec* tsp = nullptr;
    if (!dl.is_none()) {
      const auto left = dl.at() - std::chrono::steady_clock::now();
      if (left <= left.zero()) return -ETIMEDOUT;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      ts = {static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
      tsp = &ts;
    }
    const int rc = raw::ppoll(fds, n, tsp);
    if (rc > 0 || (rc < 0 && rc != -EINTR)) return rc;
  }
}

// Plain thread: poll() until ready or the deadline.
int wait_ready_thread(int fd, uint32_t events, const io::Deadline& dl) noexcept {
  pollfd p{fd, static_cast<short>(events & EPOLLIN ? POLLIN : POLLOUT), 0};
  const int rc = poll_thread(&p, 1, dl);
  if (rc > 0) return (p.revents & POLLNVAL) ? -EBADF : 0;  // ERR/HUP: the call will say what
  return rc;
}

int wait_ready(const Fiber* f, int fd, uint32_t events, const io::Deadline& dl, bool probe = false) noexcept {
  // poll() skips a negative descriptor (it would wait out the deadline) and the epoll engine
  // indexes its table with it.
  if (fd < 0) return -EBADF;
  return f ? wait_ready_fiber(fd, events, dl, probe) : wait_ready_thread(fd, events, dl);
}

// Calls `attempt` until it gives something other than EAGAIN, waiting for readiness between
// tries. `ready_first`: wait before the first try (the call would block, not fail with EAGAIN).
// `unpollable`: what to do when epoll cannot watch `fd` (a directory, some character devices).
// poll(2) calls such a file always ready, so by default the call is made and gives its own
// answer; a call that could block its thread there is better sent elsewhere (transfer_ready).
// `probe`: see wait_ready_fiber.
template <typename Attempt, typename Unpollable>
ssize_t ready_loop_or(const Fiber* f, int fd, uint32_t events, const io::Deadline& dl, bool ready_first,
                      Attempt&& attempt, Unpollable&& unpollable, bool probe = false) noexcept {
  for (;;) {
    if (!ready_first) {
      const ssize_t r = attempt();
      if (r != -EAGAIN && r != -EWOULDBLOCK) return r;
      // A descriptor that stays ready while the call keeps saying EAGAIN (another caller's call
      // in progress: call_when_ready) wakes the wait at once every time, before its timer can
      // fire: the deadline is checked here too.
      if (dl.expired()) return -ETIMEDOUT;
    }
    ready_first = false;
    if (const int rc = wait_ready(f, fd, events, dl, probe); rc < 0) {
      if (rc == -EPERM) return unpollable();
      return rc;
    }
  }
}

template <typename Attempt>
ssize_t ready_loop(const Fiber* f, int fd, uint32_t events, const io::Deadline& dl, bool ready_first,
                   Attempt&& attempt, bool probe = false) noexcept {
  return ready_loop_or(f, fd, events, dl, ready_first, attempt, attempt, probe);
}

// io::poll on a descriptor the engine cannot watch (a regular file, /dev/null: epoll says EPERM,
// the ring EINVAL), which poll(2) calls ready for input and output, always, and for nothing else:
// a poll that found none of its events there never will, and waits out its deadline (or a
// cancel), as poll(2) does. A fiber's only (a plain thread polls with ppoll). -ETIMEDOUT or
// -ECANCELED.
int wait_unpollable(const Fiber* f, const io::Deadline& dl) noexcept {
  if (f == nullptr) return -ETIMEDOUT;
  Waiter w;
  waiter_prepare(w);
  const WakeReason r = dl.is_none() ? waiter_wait(w, ParkReason::IO) : waiter_wait_until(w, ParkReason::IO, dl.at());
  return r == WakeReason::Cancelled ? -ECANCELED : -ETIMEDOUT;
}

// Parks a fiber for `pause`, or until the deadline if that comes first, listed on `fd` so that
// io::close ends it: 0 after the pause, -ETIMEDOUT once the deadline has passed, -ECANCELED on a
// cancel, -EBADF when closed.
int pause_on(int fd, const io::Deadline& dl, std::chrono::milliseconds pause) noexcept {
  IoOp op;
  WakeReason why;
  {
    waiter_prepare(op.w);  // before it is listed: io::close() may claim it from then on
    FdGuard guard(fd, &op);
    if (!guard.ok()) {
      waiter_abandon(op.w);
      return -EBADF;
    }
    const auto until = std::min(dl.at(), std::chrono::steady_clock::now() + pause);  // none is the far end
    why = waiter_wait_until(op.w, ParkReason::IO, until);
  }
  // Unlisted now, so a close that marked the op (even one that lost the claim to the timer)
  // has been seen: the number may be about to go to another file.
  if (op.closed.load(std::memory_order_relaxed)) return -EBADF;
  if (why == WakeReason::Cancelled) return -ECANCELED;
  return dl.expired() ? -ETIMEDOUT : 0;
}

// After a wait for writability: how a non-blocking connect ended. Asks connect(2) again, as the
// kernel's blocking connect completes: 0 (it marks the socket connected, so a later connect
// gives EISCONN) or the error, after which the socket may connect again (a "wait for the
// server" loop gets ECONNREFUSED each time). But only once poll(2) says the handshake is over
// (POLLOUT, POLLERR or POLLHUP, which TCP reports in no state where connect(2) sleeps): the
// descriptor may be blocking again by now. Otherwise -EINPROGRESS: wait again.
int connect_outcome(int fd, const sockaddr* addr, socklen_t addrlen) noexcept {
  pollfd p{fd, POLLOUT, 0};
  if (const int rc = raw::poll_now(&p, 1); rc <= 0) return rc < 0 ? rc : -EINPROGRESS;
  const int rc = raw::connect(fd, addr, addrlen);
  return rc == -EISCONN ? 0 : rc;
}

// poll's event bits that a wait can ask for: they are epoll's too (POLLPRI is EPOLLPRI, not any
// data). ERR and HUP are reported unasked; NVAL is poll's alone.
constexpr uint32_t kAskable = EPOLLIN | EPOLLPRI | EPOLLOUT | EPOLLRDNORM | EPOLLRDBAND | EPOLLWRNORM | EPOLLWRBAND |
                              EPOLLMSG | EPOLLRDHUP;
uint32_t askable(short events) noexcept { return static_cast<uint32_t>(static_cast<unsigned short>(events)) & kAskable; }

// Runs call() on the blocking-offload pool while the fiber parks: its result, -ECANCELED for a
// fiber cancelled before it was handed over (a cancel does not end a job once there: see
// fiber::blocking), or -ENOMEM when no helper thread could be started.
template <typename Call>
ssize_t on_pool(Call&& call) noexcept {
  try {
    return fiber::blocking([&]() noexcept -> ssize_t { return call(); });
  } catch (const fiber::Cancelled&) {
    return -ECANCELED;
  } catch (...) {
    return -ENOMEM;
  }
}

// poll(2) on the blocking-offload pool, for the time left: where poll_set cannot build its set.
int poll_on_pool(pollfd* fds, nfds_t n, const io::Deadline& dl) noexcept {
  return static_cast<int>(on_pool([&] { return poll_thread(fds, n, dl); }));
}

// A fiber's wait for poll(2)'s array `fds`, none of which was ready a moment ago: its
// descriptors go into a temporary epoll set, and the engine waits for that one descriptor (an
// epoll set is pollable) as for any other, so the deadline and a cancel end the wait as they end
// any other. Woken, a zero-timeout poll says what is ready. If nothing is (another fiber took
// the data, or the set holds a file whose number now names another: epoll watches files, not
// numbers, and a close leaves a dup'd file in the set), it waits again with a set built afresh.
// (Not a ring poll per descriptor: a ring poll for POLLPRI without POLLIN is not woken when TCP
// urgent data arrives, where epoll is; seen on 6.18.) The count ready, or -errno. `listed`
// (io_uring only; -1: none): the one descriptor polled, under whose fd-table slot the wait is
// listed, so that io::close of it ends the wait with -EBADF as it ends any other.
int poll_set(const Fiber* f, pollfd* fds, nfds_t n, const io::Deadline& dl, int listed = -1) noexcept {
  if (std::none_of(fds, fds + n, [](const pollfd& p) { return p.fd >= 0; })) {
    return wait_unpollable(f, dl);  // nothing to watch: the deadline or a cancel ends it
  }
  for (;;) {
    const int set = static_cast<int>(raw::ret(::syscall(SYS_epoll_create1, EPOLL_CLOEXEC)));
    if (set < 0) return poll_on_pool(fds, n, dl);  // out of descriptors
    bool watched = false;
    long rc = 0;
    for (nfds_t i = 0; i < n && rc >= 0; ++i) {
      const int fd = fds[i].fd;
      if (fd < 0) continue;
      epoll_event ev{askable(fds[i].events), {}};
      rc = raw::ret(::syscall(SYS_epoll_ctl, set, EPOLL_CTL_ADD, fd, &ev));
      if (rc == -EEXIST) {  // the same descriptor again: it waits for all it is asked for
        for (nfds_t j = 0; j < i; ++j) {
          if (fds[j].fd == fd) ev.events |= askable(fds[j].events);
        }
        rc = raw::ret(::syscall(SYS_epoll_ctl, set, EPOLL_CTL_MOD, fd, &ev));
      }
      // No poll method (a regular file): poll(2) calls it ready for input and output, always,
      // and it was not ready for what it is asked: it never will be.
      if (rc == -EPERM) {
        rc = 0;
      } else if (rc == 0) {
        watched = true;
      }
    }
    if (rc == 0 && !watched) {
      rc = wait_unpollable(f, dl);
    } else if (rc == 0 && listed >= 0) {
      // The ring polls the set; the op is listed under `listed` (ring_op lists its first argument).
      rc = ring_op(listed, dl, [&](io_uring_sqe* s) { io_uring_prep_poll_add(s, set, POLLIN); });
      if (rc > 0) rc = 0;
    } else if (rc == 0) {
      rc = wait_ready_fiber(set, EPOLLIN, dl, false);
    }
    io::close(set);
    if (rc == -ETIMEDOUT || rc == -ECANCELED || (rc == -EBADF && listed >= 0)) return static_cast<int>(rc);
    // Woken, or the set could not be built or waited for: closed since the zero-timeout poll
    // (that poll now says POLLNVAL), nested too deep for the engine's epoll (ELOOP), out of
    // memory. What is ready, else poll(2) itself elsewhere.
    if (const int now = raw::poll_now(fds, n); now != 0) return now;
    if (rc != 0) return poll_on_pool(fds, n, dl);
    if (const int early = precheck(f, dl)) return early;  // a wake that keeps coming must not outlast them
  }
}

// Makes `call` - one that blocks the thread when `fd` is not ready for `events` and has no
// non-blocking form (accept4 on a blocking listener, a read of a tty; setting O_NONBLOCK for it
// would show in everyone's F_GETFL) - only when a zero-timeout poll says `fd` is ready; -EAGAIN
// otherwise, for ready_loop to wait again. Readiness alone is not enough: one connection wakes
// every fiber waiting on the listener, and all but the first would block their processor threads
// in accept4 - past their deadlines, deaf to cancels and io::close - until the next one. So the
// check and the call are one step among this process's fibers and threads (FdSlot::ready_call);
// one that finds it taken waits for readiness again, which the holder's call soon ends or uses.
// A plain thread's own blocking call, or another process, can still take the connection in
// between: nothing short of changing the descriptor closes that gap.
template <typename Call>
ssize_t call_when_ready(int fd, short events, Call&& call) noexcept {
  FdSlot* slot = fd_table().slot(fd);
  // Reads and writes each have their own: a write blocked for room must not hold up a read.
  const uint8_t bit = events == POLLOUT ? FdSlot::kReadyCallOut : FdSlot::kReadyCallIn;
  if (slot != nullptr && (slot->ready_call.fetch_or(bit, std::memory_order_acquire) & bit) != 0) return -EAGAIN;
  pollfd p{fd, events, 0};
  const int rc = raw::poll_now(&p, 1);
  const ssize_t r = rc > 0 ? call() : (rc == 0 ? -EAGAIN : rc);  // ERR/HUP/NVAL: the call says what
  if (slot != nullptr) slot->ready_call.fetch_and(static_cast<uint8_t>(~bit), std::memory_order_release);
  return r;
}

// A call the epoll engine cannot wait for (a regular file, a tty's write, a device epoll cannot
// watch): on the blocking-offload pool while the fiber parks. The job gets its own descriptor
// for the file, duplicated here, as a thread blocked in the call holds the file it was given:
// if `fd` is closed (and its number taken by another file) while the job is queued or running,
// the call still reaches this file, never the next one, and io::close does not wait for it (a
// wait that a blocked tty write, or a close made on the pool itself, could make endless).
// `call(d)` makes the call on descriptor d. Out of descriptors, the job uses `fd` itself.
template <typename Call>
ssize_t offload(int fd, Call&& call) noexcept {
  const int own = raw::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own == -EBADF) return own;
  const int use = own >= 0 ? own : fd;
  const ssize_t r = on_pool([&] { return call(use); });
  if (own >= 0) raw::close(own);
  return r;
}

// Device: a character device (a tty, /dev/null), which may have no poll method; Pipe: a pipe
// or FIFO; Other: the rest (eventfd, timerfd, inotify, directories...).
enum class FdKind { Socket, File, Device, Pipe, Other, Bad };

FdKind classify(int fd) noexcept {
  struct stat st;
  // fstat(2) itself where the architecture has it: glibc's fstat is newfstatat(fd, "",
  // AT_EMPTY_PATH), a path walk that costs some 100 ns more here, on every ring read.
#if defined(SYS_fstat) && defined(__LP64__)
  if (::syscall(SYS_fstat, fd, &st) != 0) return FdKind::Bad;
#else
  if (::fstat(fd, &st) != 0) return FdKind::Bad;
#endif
  if (S_ISSOCK(st.st_mode)) return FdKind::Socket;
  if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode)) return FdKind::File;
  if (S_ISFIFO(st.st_mode)) return FdKind::Pipe;
  return S_ISCHR(st.st_mode) ? FdKind::Device : FdKind::Other;
}

// Whether this kernel's pipes take RWF_NOWAIT (IOCB_NOWAIT): asked once, of an empty pipe.
bool pipes_nowait() noexcept {
  static const bool yes = [] {
    int p[2];
    if (::syscall(SYS_pipe2, p, O_CLOEXEC) != 0) return false;
    char c;
    const iovec v{&c, 1};
    const bool eagain = raw::preadv2(p[0], &v, 1, RWF_NOWAIT) == -EAGAIN;
    raw::close(p[0]);
    raw::close(p[1]);
    return eagain;
  }();
  return yes;
}

// Whether a positional call on `fd` goes to the ring: 1 for a regular file or a block device; 0
// for the rest, whose pread(2)/pwrite(2) the kernel must answer itself (ESPIPE, or /dev/zero's
// data) - the ring's READ/WRITE would ignore the offset there and take or add stream data; or
// -EBADF. Asked every call: a cached answer would outlive the descriptor across dup2.
int ring_positional(int fd) noexcept {
  const FdKind kind = classify(fd);
  if (kind == FdKind::Bad) return -EBADF;
  return kind == FdKind::File ? 1 : 0;
}

// Whether the ring's own read or write *at the file position* suits a descriptor of this kind:
// sockets and (where they take IOCB_NOWAIT: pipes_nowait) pipes. Not regular files: the ring's
// current-position op (offset -1) reads the position when it is issued and stores it back when
// it completes, without the file's position lock that read(2) and write(2) hold, so two writers
// sharing a descriptor (stdout redirected to a log, fibers on two processors, or one write
// punted to the ring's workers) wrote at the same offset and lost records, and two readers read
// the same bytes. Files at their position take the readiness path, which hands them to a helper
// thread (the plain call, which holds the lock); pread/pwrite at an offset still use the ring
// (ring_positional). Not the rest either (a tty, an eventfd): the
// ring makes the call without IOCB_NOWAIT on a file that lacks it (a tty) once a poll of its own
// says ready - on the processor's thread, in io_uring_enter. Two fibers woken by one byte then
// both read, and the second blocks its processor in the kernel's tty_read, deaf to cancels,
// deadlines and io::close; a write blocks it until all is written. Those take the readiness
// path, which waits with a ring poll and calls only when the call cannot block
// (transfer_ready): about 1.6 us more per pipe round trip, were pipes sent there too. -EBADF's
// kind goes there too, to fail.
bool ring_transfers(FdKind kind) noexcept {
  return kind == FdKind::Socket || (kind == FdKind::Pipe && pipes_nowait());
}

bool is_nonblocking(int fd) noexcept {
  const int fl = raw::fcntl(fd, F_GETFL);
  return fl >= 0 && (fl & O_NONBLOCK) != 0;
}

// The readiness path of a transfer on `fd`, of kind `kind` (classify): `sock` is the socket form
// (MSG_DONTWAIT, never blocks), `plain(d)` the call for other descriptors on descriptor d (made
// once the descriptor is ready, or directly for regular files, which are always ready), `nowait`
// its RWF_NOWAIT form (-EAGAIN rather than blocking, where the file supports it: pipes and FIFOs;
// else -EOPNOTSUPP).
template <typename Sock, typename Plain, typename NoWait>
ssize_t transfer_ready(const Fiber* f, int fd, FdKind kind, uint32_t events, const io::Deadline& dl, Sock&& sock,
                       Plain&& plain, NoWait&& nowait) noexcept {
  switch (kind) {
    case FdKind::Bad: return -EBADF;
    case FdKind::Socket: return ready_loop(f, fd, events, dl, false, sock);
    case FdKind::File: return f ? offload(fd, plain) : plain(fd);
    case FdKind::Device:
    case FdKind::Pipe:
    case FdKind::Other: {
      const bool probe = kind == FdKind::Device;
      const auto here = [&] { return plain(fd); };
      if (is_nonblocking(fd)) return ready_loop(f, fd, events, dl, false, here, probe);
      // Blocking: readiness does not make the plain call safe (a pipe write waits for room for
      // all of it, stalling the processor or outliving the deadline). Try without blocking.
      const ssize_t r = nowait();
      if (r == -EOPNOTSUPP) {
        // No RWF_NOWAIT here (a tty, a character device): a fiber's write goes to the pool (a
        // tty may take part of a write and block for the rest); a read, or a plain thread's
        // write, is made once the descriptor is ready (call_when_ready) - or, on a device epoll
        // cannot watch (which poll(2) calls always ready, though a read may block), a fiber's
        // on the pool too.
        if (f != nullptr && events == EPOLLOUT) return offload(fd, plain);
        const short pev = events == EPOLLOUT ? POLLOUT : POLLIN;
        // Waits first: a device epoll cannot watch must be found out before any call.
        return ready_loop_or(
            f, fd, events, dl, true, [&] { return call_when_ready(fd, pev, here); },
            [&] { return f != nullptr ? offload(fd, plain) : here(); }, probe);
      }
      if (r != -EAGAIN) return r;
      return ready_loop(f, fd, events, dl, true, nowait, probe);
    }
  }
  return -EBADF;
}

// Which path a call takes.
enum class Path { Uring, Ready, Thread };

Path path_of(const Fiber* f, const io::Deadline& dl) noexcept {
  if (f == nullptr) return dl.is_none() ? Path::Thread : Path::Ready;
  return current_processor()->poller().kind() == PollerKind::Uring ? Path::Uring : Path::Ready;
}

bool bad_len(size_t n) noexcept { return n > static_cast<size_t>(SSIZE_MAX); }
bool bad_iov(int iovcnt) noexcept { return iovcnt < 0 || iovcnt > IOV_MAX; }

msghdr iov_msg(const iovec* iov, int iovcnt) noexcept {
  msghdr m{};
  m.msg_iov = const_cast<iovec*>(iov);
  m.msg_iovlen = static_cast<size_t>(iovcnt);
  return m;
}

// A socket send made at once when the buffer has room; -ENOTSOCK for other descriptors.
ssize_t send_now(int fd, const void* buf, size_t n, int flags) noexcept {
  return raw::send(fd, buf, n, flags | MSG_DONTWAIT | MSG_NOSIGNAL);
}

bool is_stream_socket(int fd) noexcept {
  int type = 0;
  socklen_t len = sizeof type;
  return ::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}

// MSG_PEEK with MSG_WAITALL: not for the ring, whose retry after a short receive on a stream
// socket peeks again from the start into the rest of the buffer, so the call returns the first
// bytes twice. The readiness path peeks once (recv_ready).
bool peek_all(int flags) noexcept { return (flags & (MSG_PEEK | MSG_WAITALL)) == (MSG_PEEK | MSG_WAITALL); }

// The readiness path of a receive. MSG_DONTWAIT makes each attempt return what is there, so
// MSG_WAITALL on a stream socket is done here as the kernel does it: wait for the rest until all
// n bytes, end of stream, an error, the deadline or a cancel; what came in before those stands.
// (Datagram sockets ignore MSG_WAITALL; with MSG_PEEK the first attempt's count is returned.)
ssize_t recv_ready(const Fiber* f, int fd, void* buf, size_t n, int flags, const io::Deadline& dl) noexcept {
  auto* p = static_cast<char*>(buf);
  size_t got = 0;
  const auto attempt = [&] { return raw::recv(fd, p + got, n - got, flags | MSG_DONTWAIT); };
  const ssize_t first = ready_loop(f, fd, EPOLLIN, dl, false, attempt);
  if (!(flags & MSG_WAITALL) || (flags & MSG_PEEK) || first <= 0 || static_cast<size_t>(first) == n ||
      !is_stream_socket(fd)) {
    return first;
  }
  got = static_cast<size_t>(first);
  while (got < n) {
    const ssize_t r = ready_loop(f, fd, EPOLLIN, dl, false, attempt);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

// The readiness path of recvmsg: MSG_WAITALL on a stream socket as recv_ready does it, the rest
// received into the buffers past what came. Ancillary data ends it, as the kernel's AF_UNIX
// receive stops after a part that carried passed descriptors: a part with some is the last
// (and the first part's would leave the next no control buffer, its descriptors closed by the
// kernel). So does a part ending at an urgent mark (MSG_OOB) or with its control cut (MSG_CTRUNC).
ssize_t recvmsg_ready(const Fiber* f, int fd, msghdr* msg, int flags, const io::Deadline& dl) noexcept {
  const auto once = [&] { return raw::recvmsg(fd, msg, flags | MSG_DONTWAIT); };
  // A null msg: the kernel's EFAULT.
  if ((flags & (MSG_WAITALL | MSG_PEEK)) != MSG_WAITALL || msg == nullptr) return ready_loop(f, fd, EPOLLIN, dl, false, once);
  const size_t ctl = msg->msg_controllen;  // the call overwrites it with what it used
  const ssize_t first = ready_loop(f, fd, EPOLLIN, dl, false, once);
  if (first <= 0) return first;  // the kernel read msg and its buffers: from here they are sound
  size_t total = 0;
  for (size_t i = 0; i < msg->msg_iovlen; ++i) total += msg->msg_iov[i].iov_len;
  if (static_cast<size_t>(first) == total || msg->msg_controllen > 0 || (msg->msg_flags & (MSG_CTRUNC | MSG_OOB)) != 0 ||
      !is_stream_socket(fd)) {
    return first;
  }
  std::vector<iovec> rest;
  try {
    rest.assign(msg->msg_iov, msg->msg_iov + msg->msg_iovlen);
  } catch (...) {
    return first;  // what came stands
  }
  auto got = static_cast<size_t>(first);
  while (got < total) {
    size_t skip = got;
    size_t i = 0;
    while (skip >= msg->msg_iov[i].iov_len) skip -= msg->msg_iov[i++].iov_len;  // got < total: stops inside one
    rest[i] = {static_cast<char*>(msg->msg_iov[i].iov_base) + skip, msg->msg_iov[i].iov_len - skip};
    msghdr part{};
    part.msg_iov = rest.data() + i;
    part.msg_iovlen = rest.size() - i;
    part.msg_control = msg->msg_control;  // none used so far
    part.msg_controllen = ctl;
    const ssize_t r = ready_loop(f, fd, EPOLLIN, dl, false, [&] { return raw::recvmsg(fd, &part, flags | MSG_DONTWAIT); });
    if (r <= 0) break;  // end of stream, an error, the deadline or a cancel: what came stands
    got += static_cast<size_t>(r);
    msg->msg_flags |= part.msg_flags;
    if (part.msg_controllen > 0 || (part.msg_flags & (MSG_CTRUNC | MSG_OOB)) != 0) {
      msg->msg_controllen = part.msg_controllen;
      break;
    }
  }
  return static_cast<ssize_t>(got);
}

// io::recv; `socket`: the caller knows fd is a socket (recv_socket).
ssize_t recv_on(int fd, void* buf, size_t n, int flags, const io::Deadline& dl, bool socket) noexcept {
  if (bad_len(n)) return -EINVAL;
  n = clamp_len(n);
  if (flags & MSG_DONTWAIT) return raw::recv(fd, buf, n, flags);
  const Fiber* f = current_fiber();
  if (const int rc = precheck(f, dl)) return rc;
  switch (path_of(f, dl)) {
    case Path::Uring:
      if (peek_all(flags)) return recv_ready(f, fd, buf, n, flags, dl);
      return ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_recv(s, fd, buf, n, flags); }, socket);
    case Path::Ready:
      return recv_ready(f, fd, buf, n, flags, dl);
    case Path::Thread: break;
  }
  return raw::recv(fd, buf, n, flags);
}

}  // namespace

ssize_t recv_socket(int fd, void* buf, size_t n, io::Deadline dl) noexcept { return recv_on(fd, buf, n, 0, dl, true); }

int close_draining(int fd, void (*before_close)(void*, bool), void* ctx) noexcept {
  // No slot yet: no fiber operation was ever listed on this descriptor's range. (But one could
  // list itself from now on, so a caller that waits for its own calls gets the slot made.)
  FdSlot* slot = before_close ? fd_table().slot(fd) : fd_table().find(fd);
  if (slot == nullptr) {
    if (before_close) before_close(ctx, false);
    return static_cast<int>(raw::close(fd));
  }
  std::unique_lock lock(slot->lock);
  if (slot->closing) return -EBADF;  // closed twice, concurrently
  slot->closing = true;
  // Wake every fiber still waiting on it; each withdraws its operation and unlists itself.
  for (IoOp* op = slot->ops; op; op = op->slot_next) {
    op->closed.store(true, std::memory_order_relaxed);
    waiter_notify(op->w, WakeReason::Cancelled);
  }
  while (slot->ops != nullptr) {
    Waiter w;
    // Shielded: the close must finish even if the closing fiber is cancelled meanwhile.
    waiter_prepare_shielded(w);
    slot->closers.push_back(&w);
    lock.unlock();
    waiter_wait(w, ParkReason::IO);
    lock.lock();
    slot->closers.remove_if_queued(&w);
  }
  if (before_close) {
    // It may wait, so not under the lock. Nothing can list itself meanwhile: the slot is closing.
    lock.unlock();
    before_close(ctx, true);
    lock.lock();
  }
  // Still under the lock: once closed, the kernel may hand the number to a new descriptor at
  // once, and an operation (or close) on that one must not find the slot still closing.
  const int rc = static_cast<int>(raw::close(fd));
  slot->closing = false;
  // The number's next descriptor starts afresh.
  slot->recv_backlog.store(false, std::memory_order_relaxed);
  return rc;
}

}  // namespace fiber::detail

namespace fiber::io {

using detail::Fiber;
using detail::Path;
namespace raw = detail::raw;

// read/write are readv/writev of one buffer: the same paths, one place to keep them right.
ssize_t read(int fd, void* buf, size_t n, Deadline dl) noexcept {
  if (detail::bad_len(n)) return -EINVAL;
  const iovec v{buf, detail::clamp_len(n)};
  return readv(fd, &v, 1, dl);
}

ssize_t write(int fd, const void* buf, size_t n, Deadline dl) noexcept {
  if (detail::bad_len(n)) return -EINVAL;
  const iovec v{const_cast<void*>(buf), detail::clamp_len(n)};
  return writev(fd, &v, 1, dl);
}

ssize_t readv(int fd, const iovec* iov, int iovcnt, Deadline dl) noexcept {
  if (detail::bad_iov(iovcnt)) return -EINVAL;
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  const Path path = detail::path_of(f, dl);
  if (path == Path::Thread) return raw::readv(fd, iov, iovcnt);
  const detail::FdKind kind = detail::classify(fd);
  if (path == Path::Uring && detail::ring_transfers(kind)) {
    return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_readv(s, fd, iov, static_cast<unsigned>(iovcnt), -1); });
  }
  msghdr m = detail::iov_msg(iov, iovcnt);
  return detail::transfer_ready(
      f, fd, kind, EPOLLIN, dl, [&] { return raw::recvmsg(fd, &m, MSG_DONTWAIT); },
      [&](int d) { return raw::readv(d, iov, iovcnt); }, [&] { return raw::preadv2(fd, iov, iovcnt, RWF_NOWAIT); });
}

ssize_t writev(int fd, const iovec* iov, int iovcnt, Deadline dl) noexcept {
  if (detail::bad_iov(iovcnt)) return -EINVAL;
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  msghdr m = detail::iov_msg(iov, iovcnt);
  const Path path = detail::path_of(f, dl);
  if (path == Path::Thread) {
    const ssize_t r = raw::sendmsg(fd, &m, MSG_NOSIGNAL);
    return r == -ENOTSOCK ? raw::writev(fd, iov, iovcnt) : r;
  }
  if (path == Path::Uring) {
    // Sockets: straight into the send buffer when it has room (no park), MSG_NOSIGNAL always.
    const ssize_t r = raw::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r == -EAGAIN) {
      return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_sendmsg(s, fd, &m, MSG_NOSIGNAL); });
    }
    if (r != -ENOTSOCK) return r;
  }
  const detail::FdKind kind = detail::classify(fd);
  if (path == Path::Uring && detail::ring_transfers(kind)) {
    return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_writev(s, fd, iov, static_cast<unsigned>(iovcnt), -1); });
  }
  return detail::transfer_ready(
      f, fd, kind, EPOLLOUT, dl, [&] { return raw::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL); },
      [&](int d) { return raw::writev(d, iov, iovcnt); }, [&] { return raw::pwritev2(fd, iov, iovcnt, RWF_NOWAIT); });
}

ssize_t pread(int fd, void* buf, size_t n, off_t off, Deadline dl) noexcept {
  if (detail::bad_len(n) || off < 0) return -EINVAL;
  n = detail::clamp_len(n);
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  if (detail::path_of(f, dl) == Path::Uring) {
    const int on_ring = detail::ring_positional(fd);
    if (on_ring < 0) return on_ring;
    if (on_ring) return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_read(s, fd, buf, static_cast<unsigned>(n), static_cast<uint64_t>(off)); });
  }
  if (f != nullptr) return detail::offload(fd, [&](int d) { return raw::pread(d, buf, n, off); });
  return raw::pread(fd, buf, n, off);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off, Deadline dl) noexcept {
  if (detail::bad_len(n) || off < 0) return -EINVAL;
  n = detail::clamp_len(n);
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  if (detail::path_of(f, dl) == Path::Uring) {
    const int on_ring = detail::ring_positional(fd);
    if (on_ring < 0) return on_ring;
    if (on_ring) return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_write(s, fd, buf, static_cast<unsigned>(n), static_cast<uint64_t>(off)); });
  }
  if (f != nullptr) return detail::offload(fd, [&](int d) { return raw::pwrite(d, buf, n, off); });
  return raw::pwrite(fd, buf, n, off);
}

ssize_t recv(int fd, void* buf, size_t n, int flags, Deadline dl) noexcept {
  return detail::recv_on(fd, buf, n, flags, dl, false);
}

ssize_t send(int fd, const void* buf, size_t n, int flags, Deadline dl) noexcept {
  if (detail::bad_len(n)) return -EINVAL;
  n = detail::clamp_len(n);
  flags |= MSG_NOSIGNAL;
  if (flags & MSG_DONTWAIT) return raw::send(fd, buf, n, flags);
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  switch (detail::path_of(f, dl)) {
    case Path::Uring: {
      const ssize_t r = detail::send_now(fd, buf, n, flags);
      if (r != -EAGAIN) return r;
      return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_send(s, fd, buf, n, flags); });
    }
    case Path::Ready:
      return detail::ready_loop(f, fd, EPOLLOUT, dl, false, [&] { return detail::send_now(fd, buf, n, flags); });
    case Path::Thread: break;
  }
  return raw::send(fd, buf, n, flags);
}

ssize_t recvmsg(int fd, msghdr* msg, int flags, Deadline dl) noexcept {
  if (flags & MSG_DONTWAIT) return raw::recvmsg(fd, msg, flags);
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  switch (detail::path_of(f, dl)) {
    case Path::Uring:
      if (detail::peek_all(flags)) return detail::recvmsg_ready(f, fd, msg, flags, dl);
      return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_recvmsg(s, fd, msg, static_cast<unsigned>(flags)); });
    case Path::Ready:
      return detail::recvmsg_ready(f, fd, msg, flags, dl);
    case Path::Thread: break;
  }
  return raw::recvmsg(fd, msg, flags);
}

ssize_t sendmsg(int fd, const msghdr* msg, int flags, Deadline dl) noexcept {
  flags |= MSG_NOSIGNAL;
  if (flags & MSG_DONTWAIT) return raw::sendmsg(fd, msg, flags);
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  switch (detail::path_of(f, dl)) {
    case Path::Uring: {
      const ssize_t r = raw::sendmsg(fd, msg, flags | MSG_DONTWAIT);
      if (r != -EAGAIN) return r;
      return detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_sendmsg(s, fd, msg, static_cast<unsigned>(flags)); });
    }
    case Path::Ready:
      return detail::ready_loop(f, fd, EPOLLOUT, dl, false, [&] { return raw::sendmsg(fd, msg, flags | MSG_DONTWAIT); });
    case Path::Thread: break;
  }
  return raw::sendmsg(fd, msg, flags);
}

int accept(int fd, sockaddr* addr, socklen_t* addrlen, int flags, Deadline dl) noexcept {
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  const Path path = detail::path_of(f, dl);
  if (path == Path::Thread) return raw::accept4(fd, addr, addrlen, flags);
  // Both waiting paths would wait for ever on a socket that is not listening (the ring for a
  // connection, epoll for readiness), where the kernel's own accept fails at once.
  int listening = 1;
  socklen_t len = sizeof listening;
  if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) return -raw::last_errno();
  if (listening == 0) {
    // The kernel's errno, without its call (which, were another thread to call listen(2) just
    // now, would block this thread): sockets that cannot accept at all (datagram ones) say
    // EOPNOTSUPP, stream ones that do not listen EINVAL.
    int type = SOCK_STREAM;
    len = sizeof type;
    if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return -raw::last_errno();
    return type == SOCK_STREAM || type == SOCK_SEQPACKET ? -EINVAL : -EOPNOTSUPP;
  }
  if (path == Path::Uring) {
    return static_cast<int>(
        detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_accept(s, fd, addr, addrlen, flags); }));
  }
  const auto attempt = [&] { return raw::accept4(fd, addr, addrlen, flags); };
  if (detail::is_nonblocking(fd)) return static_cast<int>(detail::ready_loop(f, fd, EPOLLIN, dl, false, attempt));
  // A blocking listener blocks in accept4 whenever its queue is empty, as it is for every fiber
  // but one after a connection wakes them all: accept only what a poll has just seen.
  return static_cast<int>(detail::ready_loop(f, fd, EPOLLIN, dl, false,
                                             [&] { return detail::call_when_ready(fd, POLLIN, attempt); }));
}

int connect(int fd, const sockaddr* addr, socklen_t addrlen, Deadline dl) noexcept {
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  const Path path = detail::path_of(f, dl);
  // Until the connection in progress on `fd` (EINPROGRESS: this call's; EALREADY: one started
  // earlier) has ended: as a blocking connect(2), which waits for an earlier one too.
  const auto wait_connected = [&](int rc) {
    while (rc == -EINPROGRESS || rc == -EALREADY) {
      rc = detail::wait_ready(f, fd, EPOLLOUT, dl);
      if (rc != 0) break;
      rc = detail::connect_outcome(fd, addr, addrlen);
    }
    return rc;
  };
  if (path == Path::Uring) {
    // The ring waits for a connection it starts, but answers EALREADY at once for one already
    // on its way (a connect whose deadline passed, or a non-blocking one).
    return wait_connected(static_cast<int>(
        detail::ring_op(fd, dl, [&](io_uring_sqe* s) { io_uring_prep_connect(s, fd, addr, addrlen); })));
  }
  if (path == Path::Thread) return static_cast<int>(raw::connect(fd, addr, addrlen));
  // Readiness: connect with O_NONBLOCK set for that call alone, then wait until writable and
  // read the outcome. The flags go back before any wait on the descriptor: once a wait has
  // ended (an io::close ends it too) the number may already belong to another file, whose flags
  // must not change.
  const int fl = raw::fcntl(fd, F_GETFL);
  if (fl < 0) return fl;
  const bool blocking = !(fl & O_NONBLOCK);
  if (blocking) {
    if (const int rc = raw::fcntl(fd, F_SETFL, fl | O_NONBLOCK); rc != 0) return rc;
  }
  int rc = static_cast<int>(raw::connect(fd, addr, addrlen));
  // EAGAIN: a Unix stream socket whose listener's queue is full (other families use it for "no
  // route cache entry", an error). Nothing epoll can watch says when there is room (the kernel's
  // blocking connect sleeps on the listener's queue), so try again after a pause that doubles
  // from 1 ms to 64 ms, until the deadline or a cancel. (The ring's connect waits by itself.)
  // A Unix connect never goes on in the background: it ends here, and the flags go back after.
  if (rc == -EAGAIN && addrlen >= sizeof(sa_family_t) && addr->sa_family == AF_UNIX) {
    for (std::chrono::milliseconds pause{1}; rc == -EAGAIN; pause = std::min(pause * 2, std::chrono::milliseconds{64})) {
      if (const int p = detail::pause_on(fd, dl, pause); p != 0) {
        rc = p;
        break;
      }
      rc = static_cast<int>(raw::connect(fd, addr, addrlen));
    }
  }
  if (blocking && rc != -EBADF) raw::fcntl(fd, F_SETFL, fl);
  return wait_connected(rc);
}

int poll(int fd, short events, Deadline dl) noexcept {
  if (fd < 0) return -EBADF;
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  pollfd p{fd, events, 0};
  if (f == nullptr) {
    const int rc = detail::poll_thread(&p, 1, dl);
    return rc > 0 ? p.revents : rc;
  }
  if (const int rc = raw::poll_now(&p, 1); rc != 0) return rc < 0 ? rc : p.revents;  // ready now
  if (detail::path_of(f, dl) == Path::Uring) {
    // The ring's poll for POLLPRI without POLLIN misses TCP urgent data (poll_set).
    if ((events & POLLPRI) && !(events & POLLIN)) {
      const int rc = detail::poll_set(f, &p, 1, dl, fd);
      return rc > 0 ? p.revents : rc;
    }
    const int rc = static_cast<int>(detail::ring_op(fd, dl, [&](io_uring_sqe* s) {
      io_uring_prep_poll_add(s, fd, static_cast<unsigned>(static_cast<unsigned short>(events)));
    }));
    if (rc == -EINVAL) return detail::wait_unpollable(f, dl);  // the arguments were fine for poll_now
    // The ring reports the whole mask (POLLRDHUP with POLLIN, say): only what poll(2) would.
    return rc > 0 ? rc & (static_cast<unsigned short>(events) | POLLERR | POLLHUP | POLLNVAL) : rc;
  }
  // Wait for exactly the events asked for, so a wake means one of them - or ERR/HUP.
  const uint32_t want = detail::askable(events);
  for (;;) {
    if (const int rc = detail::wait_ready(f, fd, want, dl); rc < 0) {
      return rc == -EPERM ? detail::wait_unpollable(f, dl) : rc;
    }
    const int rc = raw::poll_now(&p, 1);  // what exactly is ready
    if (rc != 0) return rc < 0 ? rc : p.revents;
    // Ready when the engine looked, not any more (another fiber took the data): wait again,
    // until the same deadline.
  }
}

int poll(pollfd* fds, nfds_t n, Deadline dl) noexcept {
  const Fiber* f = detail::current_fiber();
  if (const int rc = detail::precheck(f, dl)) return rc;
  if (f == nullptr) return detail::poll_thread(fds, n, dl);
  if (const int rc = raw::poll_now(fds, n); rc != 0) return rc;  // ready now, or poll's error
  if (n == 1 && fds[0].fd >= 0) {  // one descriptor: its own wait
    const int rc = poll(fds[0].fd, fds[0].events, dl);
    if (rc == -EBADF) {  // io::close()d while it waited: poll(2)'s answer for a closed descriptor
      fds[0].revents = POLLNVAL;
      return 1;
    }
    if (rc < 0) return rc;
    fds[0].revents = static_cast<short>(rc);
    return 1;
  }
  return detail::poll_set(f, fds, n, dl);
}

int close(int fd) noexcept { return detail::close_draining(fd, nullptr, nullptr); }

}  // namespace fiber::io
