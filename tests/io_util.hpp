// Helpers of the I/O tests (unit/test_io.cpp, unit/test_net.cpp): real descriptors, no mocks.
//
//   Fd                     a descriptor that closes itself (with fiber::io::close, so fibers
//                          still waiting on it are woken first)
//   tcp_pair()             a connected pair of TCP sockets on 127.0.0.1, made with plain system
//                          calls (a loopback connect completes at once, also inside a fiber)
//   full_listener()        a listener whose accept queue is full: a connect to it stays in
//                          progress (the kernel drops the SYNs), so it blocks until cancelled
//   closed_port()          a port on 127.0.0.1 that nobody listens on: connects are refused
//   fill_pattern / pattern_mismatch
//                          a pseudo-random byte stream per seed: a lost, duplicated or reordered
//                          piece of a transfer shows as a mismatch at a known offset
//   open_fd_count()        entries of /proc/self/fd, to check that failing calls leak nothing
//   held_fd_count() / fd_count_back_to(before)
//                          the same, counting only what stays: other threads of the process (the
//                          watchdog's monitor reads /proc) hold a descriptor for a moment now and
//                          then, which a single look may catch
//   FdLimit                RLIMIT_NOFILE for a scope, restored afterwards
//
// Inside fibers, give assertions their context with CHECK_MESSAGE / REQUIRE_MESSAGE, never with
// CAPTURE or INFO: doctest keeps those in a thread_local stack, and a fiber that blocks inside
// their scope may resume on another thread and pop the wrong thread's stack (a crash).
#pragma once

#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace fiber_test {

// A limit for calls that are expected to succeed: they then fail with -ETIMEDOUT instead of
// hanging the suite when they do not.
inline std::chrono::milliseconds patience() { return scaled(std::chrono::milliseconds(20'000)); }

// ------------------------------------------------------------------------------ descriptors

// Owns a descriptor; closes it with fiber::io::close (from a fiber or a thread).
class Fd {
 public:
  Fd() noexcept = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) fiber::io::close(std::exchange(fd_, -1));
  }

 private:
  int fd_ = -1;
};

inline void set_nonblocking(int fd, bool on = true) {
  const int fl = ::fcntl(fd, F_GETFL);
  REQUIRE(fl >= 0);
  REQUIRE(::fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK)) == 0);
}

inline void set_int_option(int fd, int level, int name, int value) {
  REQUIRE(::setsockopt(fd, level, name, &value, sizeof value) == 0);
}

// Closes with an RST instead of a FIN (SO_LINGER with a zero timeout).
inline void close_with_reset(Fd& fd) {
  const linger lg{1, 0};
  REQUIRE(::setsockopt(fd.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);
  fd.reset();
}

// Entries of /proc/self/fd (the directory's own descriptor included, the same every time).
inline int open_fd_count() {
  DIR* d = ::opendir("/proc/self/fd");
  REQUIRE(d != nullptr);
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n;
}

// The descriptors held for good: the fewest seen in five looks a millisecond apart.
inline int held_fd_count() {
  int n = open_fd_count();
  for (int i = 0; i < 4; ++i) {
    fiber::this_fiber::sleep_for(std::chrono::milliseconds(1));
    n = std::min(n, open_fd_count());
  }
  return n;
}

// Whether the count comes back to `before` (held_fd_count()) within the usual bound. A leaked
// descriptor never goes and one closed by mistake never comes back, so both still fail; a
// passing moment's goes.
inline bool fd_count_back_to(int before) {
  return fiber_test::wait_for([before] { return open_fd_count() == before; });
}

// The highest open descriptor number.
inline int highest_open_fd() {
  DIR* d = ::opendir("/proc/self/fd");
  REQUIRE(d != nullptr);
  int top = -1;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') top = std::max(top, std::atoi(e->d_name));
  }
  ::closedir(d);
  return top;
}

// Sets the soft RLIMIT_NOFILE for a scope (capped at the hard limit) and restores it.
class FdLimit {
 public:
  explicit FdLimit(rlim_t soft) {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &old_) == 0);
    rlimit now = old_;
    now.rlim_cur = std::min(soft, old_.rlim_max);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &now) == 0);
  }
  ~FdLimit() { ::setrlimit(RLIMIT_NOFILE, &old_); }
  FdLimit(const FdLimit&) = delete;
  FdLimit& operator=(const FdLimit&) = delete;
  static rlim_t soft() {
    rlimit r{};
    ::getrlimit(RLIMIT_NOFILE, &r);
    return r.rlim_cur;
  }

 private:
  rlimit old_{};
};

// ------------------------------------------------------------------------------ sockets

inline sockaddr_in loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  return a;
}

inline const sockaddr* sa(const sockaddr_in& a) { return reinterpret_cast<const sockaddr*>(&a); }

inline uint16_t local_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  return ntohs(a.sin_port);
}

inline Fd tcp_socket(int flags = 0) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | flags, 0));
  REQUIRE(fd.get() >= 0);
  return fd;
}

// The kernel's TCP state of a socket (TCP_ESTABLISHED, TCP_CLOSE_WAIT, ...), -errno on failure:
// for failure messages.
inline int tcp_state(int fd) {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return -errno;
  return info.tcpi_state;
}

// A listening socket on 127.0.0.1, any free port (see local_port).
inline Fd tcp_listener(int backlog = 128, int flags = 0) {
  Fd ln = tcp_socket(flags);
  const sockaddr_in a = loopback(0);
  REQUIRE(::bind(ln.get(), sa(a), sizeof a) == 0);
  REQUIRE(::listen(ln.get(), backlog) == 0);
  return ln;
}

// A plain non-blocking connect that must complete within a few seconds (loopback, with room in
// the accept queue: at once). Leaves the socket's blocking mode as it was.
inline void connect_now(int fd, const sockaddr_in& to) {
  const int fl = ::fcntl(fd, F_GETFL);
  REQUIRE(fl >= 0);
  set_nonblocking(fd, true);
  if (::connect(fd, sa(to), sizeof to) != 0) {
    REQUIRE(errno == EINPROGRESS);
    pollfd p{fd, POLLOUT, 0};
    REQUIRE(::poll(&p, 1, static_cast<int>(patience().count())) == 1);
    int err = 0;
    socklen_t len = sizeof err;
    REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0);
    REQUIRE(err == 0);
  }
  REQUIRE(::fcntl(fd, F_SETFL, fl) == 0);
}

struct SocketOptions {
  int sndbuf = 0;  // SO_SNDBUF of both sockets; 0: the system's default
  int rcvbuf = 0;  // SO_RCVBUF of both sockets (set before the connection, so the window is small)
  int flags = 0;   // SOCK_NONBLOCK: both ends non-blocking
};

// `a` connected to `b` over loopback.
struct SocketPair {
  Fd a;
  Fd b;
};

inline SocketPair tcp_pair(SocketOptions opt = {}) {
  Fd ln = tcp_socket();
  Fd a = tcp_socket();
  for (int fd : {ln.get(), a.get()}) {
    if (opt.sndbuf > 0) set_int_option(fd, SOL_SOCKET, SO_SNDBUF, opt.sndbuf);
    if (opt.rcvbuf > 0) set_int_option(fd, SOL_SOCKET, SO_RCVBUF, opt.rcvbuf);  // accepted sockets inherit
  }
  const sockaddr_in any = loopback(0);
  REQUIRE(::bind(ln.get(), sa(any), sizeof any) == 0);
  REQUIRE(::listen(ln.get(), 1) == 0);
  connect_now(a.get(), loopback(local_port(ln.get())));
  Fd b(::accept4(ln.get(), nullptr, nullptr, SOCK_CLOEXEC));
  REQUIRE(b.get() >= 0);
  // The accepted connection is a's, not a stray one that reached the same port.
  sockaddr_in peer{};
  socklen_t peer_len = sizeof peer;
  REQUIRE(::getpeername(b.get(), reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0);
  REQUIRE(ntohs(peer.sin_port) == local_port(a.get()));
  if (opt.sndbuf > 0) set_int_option(b.get(), SOL_SOCKET, SO_SNDBUF, opt.sndbuf);
  if (opt.flags & SOCK_NONBLOCK) {
    set_nonblocking(a.get());
    set_nonblocking(b.get());
  }
  return {std::move(a), std::move(b)};
}

// A listener with backlog 0 whose one accept-queue place is taken by a connection nobody
// accepts: the kernel drops further SYNs (the queue is full), so a connect to `addr` stays in
// progress, retransmitting, until that connection is accepted.
struct FullListener {
  Fd listener;
  Fd queued;  // the connection that fills the queue
  sockaddr_in addr{};
};

inline FullListener full_listener() {
  FullListener f;
  f.listener = tcp_listener(0);
  f.addr = loopback(local_port(f.listener.get()));
  f.queued = tcp_socket();
  connect_now(f.queued.get(), f.addr);
  return f;
}

// A port on 127.0.0.1 that nobody listens on: `holder` is bound to it (so no one else takes it)
// but does not listen, so a connect there is answered with an RST (ECONNREFUSED).
struct ClosedPort {
  Fd holder;
  uint16_t port = 0;
};

inline ClosedPort closed_port() {
  ClosedPort c;
  c.holder = tcp_socket();
  const sockaddr_in a = loopback(0);
  REQUIRE(::bind(c.holder.get(), sa(a), sizeof a) == 0);
  c.port = local_port(c.holder.get());
  return c;
}

// ------------------------------------------------------------------------------ byte pattern

inline uint64_t splitmix64(uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The 8-byte word of stream `seed` that holds offset `off`.
inline uint64_t pattern_word(uint64_t seed, uint64_t off) noexcept {
  return splitmix64(seed * 0x100000001b3ULL ^ (off >> 3));
}

// Fills buf with bytes [off, off + n) of stream `seed`.
inline void fill_pattern(uint64_t seed, uint64_t off, void* buf, size_t n) noexcept {
  auto* p = static_cast<uint8_t*>(buf);
  size_t i = 0;
  while (i < n) {
    const uint64_t pos = off + i;
    const uint64_t w = pattern_word(seed, pos);
    for (unsigned b = static_cast<unsigned>(pos & 7); b < 8 && i < n; ++b, ++i) {
      p[i] = static_cast<uint8_t>(w >> (b * 8));
    }
  }
}

inline constexpr size_t kAllMatch = SIZE_MAX;

// The index in buf of the first byte that is not byte off + index of stream `seed`; kAllMatch
// if they all are.
inline size_t pattern_mismatch(uint64_t seed, uint64_t off, const void* buf, size_t n) noexcept {
  const auto* p = static_cast<const uint8_t*>(buf);
  size_t i = 0;
  while (i < n) {
    const uint64_t pos = off + i;
    const uint64_t w = pattern_word(seed, pos);
    for (unsigned b = static_cast<unsigned>(pos & 7); b < 8 && i < n; ++b, ++i) {
      if (p[i] != static_cast<uint8_t>(w >> (b * 8))) return i;
    }
  }
  return kAllMatch;
}

// Joins every handle, then rethrows the first exception any of them threw (joining stops at
// none: a handle left unjoined would detach its fiber, whose failure then aborts the run).
template <typename T>
void join_all(std::vector<fiber::JoinHandle<T>>& handles) {
  std::exception_ptr first;
  for (auto& h : handles) {
    try {
      h.join();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  handles.clear();
  if (first) std::rethrow_exception(first);
}

// ------------------------------------------------------------------------------ whole transfers

// io::write until all n bytes are written: n, or the first error.
inline ssize_t write_fully(int fd, const void* buf, size_t n, fiber::io::Deadline dl = {}) {
  const auto* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = fiber::io::write(fd, p + done, n - done, dl);
    if (r < 0) return r;
    REQUIRE(r > 0);  // a write of a non-zero count never returns 0
    done += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(done);
}

// io::read until n bytes are read or end of file: the count, or the first error.
inline ssize_t read_fully(int fd, void* buf, size_t n, fiber::io::Deadline dl = {}) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = fiber::io::read(fd, p + done, n - done, dl);
    if (r < 0) return r;
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(done);
}

}  // namespace fiber_test
