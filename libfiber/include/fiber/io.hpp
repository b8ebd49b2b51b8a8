// Fiber-aware I/O on file descriptors: the calls of <unistd.h> and <sys/socket.h>, parking only
// the calling fiber.
//
//   fiber::go [fd] {
//     char buf[4096];
//     for (;;) {
//       ssize_t n = fiber::io::recv(fd, buf, sizeof buf, 0, std::chrono::seconds(30));
//       if (n <= 0) break;                       // 0: peer closed; -ETIMEDOUT: idle too long
//       if (fiber::io::send(fd, buf, n, 0) < 0) break;
//     }
//     fiber::io::close(fd);
//   };
//
// Errors: every call returns -errno on failure (as liburing and the kernel do), never sets
// errno and never throws for an I/O error. Beyond the system call's own errors:
//   -ETIMEDOUT  the deadline passed first (a deadline already past fails at once);
//   -ECANCELED  the fiber was cancelled (JoinHandle::cancel, CancelToken, Scheduler::stop);
//               its later calls fail the same way;
//   -EBADF      the descriptor was closed with io::close() while the call waited;
//   -EINVAL     a length that does not fit in ssize_t, a negative count.
// A call that transferred data is never turned into an error: if the data came in as the
// deadline passed or the cancel arrived, the call returns it.
//
// Where it waits: inside a fiber, on the processor's io_uring (or the epoll engine, see
// FIBER_IO in the README); on a plain thread, the same call simply blocks the thread (with a
// deadline it polls first). Descriptors may be blocking or not: inside a fiber the call waits
// either way (it never returns EAGAIN to wait for readiness). Regular files go through the
// ring (epoll engine: the blocking-offload pool).
//
// Writes to a socket never raise SIGPIPE: a peer that has gone away gives -EPIPE.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber::io {

// When a call gives up: a point on the steady clock, or a duration from now, or none.
//   io::read(fd, buf, n, std::chrono::milliseconds(200));      // 200 ms from now
//   io::read(fd, buf, n, std::chrono::steady_clock::now() + 1s); // a point in time
class Deadline {
 public:
  constexpr Deadline() noexcept = default;  // no deadline
  Deadline(std::chrono::steady_clock::time_point at) noexcept : at_(detail::to_deadline(at)) {}  // NOLINT
  template <typename Rep, typename Period>
  Deadline(std::chrono::duration<Rep, Period> after) noexcept : at_(detail::deadline_after(after)) {}  // NOLINT

  static constexpr Deadline none() noexcept { return Deadline(); }
  bool is_none() const noexcept { return at_ == detail::kNoDeadline; }
  std::chrono::steady_clock::time_point at() const noexcept { return at_; }
  bool expired() const noexcept { return !is_none() && std::chrono::steady_clock::now() >= at_; }

 private:
  std::chrono::steady_clock::time_point at_ = detail::kNoDeadline;
};

// read(2): up to n bytes; 0 at end of file.
FIBER_API ssize_t read(int fd, void* buf, size_t n, Deadline deadline = {}) noexcept;
// write(2): up to n bytes (may be short; see write_all in fiber/net.hpp for all of them).
FIBER_API ssize_t write(int fd, const void* buf, size_t n, Deadline deadline = {}) noexcept;
FIBER_API ssize_t readv(int fd, const iovec* iov, int iovcnt, Deadline deadline = {}) noexcept;
FIBER_API ssize_t writev(int fd, const iovec* iov, int iovcnt, Deadline deadline = {}) noexcept;
// pread(2)/pwrite(2): at offset `off` (>= 0), without moving the file position.
FIBER_API ssize_t pread(int fd, void* buf, size_t n, off_t off, Deadline deadline = {}) noexcept;
FIBER_API ssize_t pwrite(int fd, const void* buf, size_t n, off_t off, Deadline deadline = {}) noexcept;
// recv(2)/send(2) and the msghdr forms; `flags` as for the system calls (MSG_NOSIGNAL is always
// added to sends; MSG_DONTWAIT makes the call return -EAGAIN rather than wait). MSG_WAITALL on a
// stream socket waits for all n bytes, as the kernel's call does; end of stream, an error, the
// deadline or a cancel after some data return the count so far (and for recvmsg, a part that
// brings ancillary data is the last). With MSG_WAITALL, recvmsg reads *msg itself before the
// first receive: msg must be null (-EFAULT) or point to a msghdr. In a fiber (and on a plain
// thread with a deadline), MSG_PEEK with MSG_WAITALL peeks at what is there once something is,
// which may be less than n: unlike the kernel's call it does not wait for all of it.
FIBER_API ssize_t recv(int fd, void* buf, size_t n, int flags, Deadline deadline = {}) noexcept;
FIBER_API ssize_t send(int fd, const void* buf, size_t n, int flags, Deadline deadline = {}) noexcept;
FIBER_API ssize_t recvmsg(int fd, msghdr* msg, int flags, Deadline deadline = {}) noexcept;
FIBER_API ssize_t sendmsg(int fd, const msghdr* msg, int flags, Deadline deadline = {}) noexcept;
// accept4(2): the new descriptor (flags: SOCK_NONBLOCK, SOCK_CLOEXEC), or -errno.
FIBER_API int accept(int fd, sockaddr* addr, socklen_t* addrlen, int flags = 0, Deadline deadline = {}) noexcept;
// connect(2) to completion: 0 once connected, else -errno (-ECONNREFUSED, -ETIMEDOUT, ...).
// A connection already in progress on `fd` is waited for, as by a blocking connect(2) (on a
// plain thread, only if `fd` is blocking: a non-blocking one gets -EALREADY, as from the
// kernel). One whose deadline passed goes on in the background: connect again to wait for it,
// or close.
FIBER_API int connect(int fd, const sockaddr* addr, socklen_t addrlen, Deadline deadline = {}) noexcept;
// Waits until `fd` is ready for `events` (POLLIN, POLLOUT, ...): the revents (> 0, as poll(2)
// reports them, including POLLERR/POLLHUP/POLLNVAL), or -errno (-ETIMEDOUT, -ECANCELED, ...).
FIBER_API int poll(int fd, short events, Deadline deadline = {}) noexcept;
// poll(2) over `n` descriptors: waits until at least one is ready, fills every revents as poll(2)
// does (a negative descriptor is skipped, an invalid one reports POLLNVAL), and returns how many
// are ready (> 0); or -errno: -ETIMEDOUT, -ECANCELED, poll(2)'s -EFAULT, -EINVAL (n above
// RLIMIT_NOFILE) and -ENOMEM. With n == 0 it waits for the deadline or a cancel. In a fiber,
// several descriptors wait as one: a temporary epoll set of them, which the engine watches like
// any descriptor (n + 2 system calls more than one descriptor's wait). Where no set can be made
// (no descriptor left for it), poll(2) waits on the blocking-offload pool instead, and a cancel
// does not end that wait. A descriptor closed while the call waits is not noticed, as with
// poll(2).
FIBER_API int poll(pollfd* fds, nfds_t n, Deadline deadline = {}) noexcept;
// close(2). Fibers waiting in a call on `fd` first end with -EBADF; the descriptor is closed
// once none of them still uses it. 0 or -errno.
FIBER_API int close(int fd) noexcept;

}  // namespace fiber::io
