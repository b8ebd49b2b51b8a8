// The runtime's own system calls, made with syscall(2) so they never reach an interposed libc
// function: with libfiber_hook.so preloaded, ::read inside the runtime would land in the hook,
// which would call back into the runtime (and park a fiber in the middle of the scheduler).
// Each returns the result or -errno, like liburing.
#pragma once

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

namespace fiber::detail::raw {

// errno through a non-inlined read. glibc declares __errno_location() `const`, so once inlined
// into a function that parks, a plain `errno` may reuse the address computed before the park,
// which belongs to the thread the fiber ran on then (invariant 3). Every errno read in code that
// can run on a fiber goes through here.
int last_errno() noexcept;

inline long ret(long rc) noexcept { return rc < 0 ? -last_errno() : rc; }

inline ssize_t read(int fd, void* buf, size_t n) noexcept { return ret(::syscall(SYS_read, fd, buf, n)); }
inline ssize_t write(int fd, const void* buf, size_t n) noexcept { return ret(::syscall(SYS_write, fd, buf, n)); }
inline ssize_t readv(int fd, const iovec* iov, int cnt) noexcept { return ret(::syscall(SYS_readv, fd, iov, cnt)); }
inline ssize_t writev(int fd, const iovec* iov, int cnt) noexcept { return ret(::syscall(SYS_writev, fd, iov, cnt)); }
inline ssize_t pread(int fd, void* buf, size_t n, off_t off) noexcept { return ret(::syscall(SYS_pread64, fd, buf, n, off)); }
inline ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) noexcept {
  return ret(::syscall(SYS_pwrite64, fd, buf, n, off));
}
// preadv2/pwritev2 at the file position (offset -1), for RWF_NOWAIT.
inline ssize_t preadv2(int fd, const iovec* iov, int cnt, int flags) noexcept {
  return ret(::syscall(SYS_preadv2, fd, iov, cnt, -1L, 0L, flags));
}
inline ssize_t pwritev2(int fd, const iovec* iov, int cnt, int flags) noexcept {
  return ret(::syscall(SYS_pwritev2, fd, iov, cnt, -1L, 0L, flags));
}
inline ssize_t recv(int fd, void* buf, size_t n, int flags) noexcept {
  return ret(::syscall(SYS_recvfrom, fd, buf, n, flags, nullptr, nullptr));
}
inline ssize_t send(int fd, const void* buf, size_t n, int flags) noexcept {
  return ret(::syscall(SYS_sendto, fd, buf, n, flags, nullptr, 0));
}
inline ssize_t recvmsg(int fd, msghdr* m, int flags) noexcept { return ret(::syscall(SYS_recvmsg, fd, m, flags)); }
inline ssize_t sendmsg(int fd, const msghdr* m, int flags) noexcept { return ret(::syscall(SYS_sendmsg, fd, m, flags)); }
inline int accept4(int fd, sockaddr* a, socklen_t* len, int flags) noexcept {
  return static_cast<int>(ret(::syscall(SYS_accept4, fd, a, len, flags)));
}
inline int connect(int fd, const sockaddr* a, socklen_t len) noexcept {
  return static_cast<int>(ret(::syscall(SYS_connect, fd, a, len)));
}
#if defined(FIBER_TSAN) || defined(__SANITIZE_THREAD__)
// ThreadSanitizer follows descriptors through its interceptors: a close it does not see leaves
// the number attached to the old file, and the next thread that reuses the number (a socket, an
// opendir) is reported as racing with whoever opened the old one. Under TSan, close through its
// interceptor, which then makes the real call (never a hook: it resolves the next close after
// libtsan, libc's).
inline int close(int fd) noexcept {
  using Fn = int (*)(int);
  static const Fn intercepted = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "__interceptor_close"));
  if (intercepted != nullptr) return static_cast<int>(ret(intercepted(fd)));
  return static_cast<int>(ret(::syscall(SYS_close, fd)));
}
#else
inline int close(int fd) noexcept { return static_cast<int>(ret(::syscall(SYS_close, fd))); }
#endif
inline int ppoll(pollfd* fds, nfds_t n, const timespec* ts) noexcept {
  return static_cast<int>(ret(::syscall(SYS_ppoll, fds, n, ts, nullptr, _NSIG / 8)));
}
inline int poll_now(pollfd* fds, nfds_t n) noexcept {
  const timespec zero{0, 0};
  return ppoll(fds, n, &zero);
}
inline int fcntl(int fd, int cmd, long arg = 0) noexcept { return static_cast<int>(ret(::syscall(SYS_fcntl, fd, cmd, arg))); }

}  // namespace fiber::detail::raw
