// Helpers for the hook tests (tests/hooks/): which hook mode is in effect, descriptors, and the
// two observations every test is built on.
//
//   parked_call(op, release)   runs op() in the calling fiber of a ONE-processor scheduler and
//                              tells whether the fiber parked during it: a probe fiber, queued
//                              before op() starts, can only run on that single processor if op()
//                              gave it up. A plain "releaser" thread completes the operation
//                              (writes the data, drains the peer, connects...) once the probe has
//                              run - or, when it never does because op() blocks the thread, after
//                              a bounded wait, so a missing hook fails the check instead of
//                              hanging the run.
//   no_park_call(op, release)  op() must return at once (EAGAIN on a non-blocking descriptor):
//                              the probe must not have run. Were op() to park all the same,
//                              release() ends it, so the check fails instead of hanging.
//   PoolGate                   holds every thread of the blocking-offload pool, so a call handed
//                              to the pool must park its fiber until the gate opens.
//
// errno is read through noinline functions: glibc declares __errno_location() const, so inside
// one function a compiler may reuse the address computed before a call that switched threads.
#pragma once

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fiber/fiber.hpp>

#include "test_util.hpp"

namespace hook_test {

using namespace fiber_test;
using namespace std::chrono_literals;

// ------------------------------------------------------------------------------ hook mode

enum class Mode { none, linked, preload };

inline std::string mode_name(Mode m) {
  switch (m) {
    case Mode::linked: return "linked";
    case Mode::preload: return "preload";
    default: return "none";
  }
}

// Anchors a dladdr lookup in this executable.
__attribute__((noinline)) inline void exe_anchor() { asm volatile(""); }

// Where ::read, as this program binds it, lives: in this executable (libfiber_hook.a linked in),
// in libfiber_hook.so (preloaded), or elsewhere (libc, a sanitizer's interceptor).
inline Mode detected_mode() {
  ssize_t (*fn)(int, void*, size_t) = ::read;
  void* p;
  std::memcpy(&p, &fn, sizeof p);
  Dl_info where{}, exe{};
  void* anchor;
  void (*a)() = exe_anchor;
  std::memcpy(&anchor, &a, sizeof anchor);
  if (dladdr(p, &where) == 0 || dladdr(anchor, &exe) == 0) return Mode::none;
  if (where.dli_fbase == exe.dli_fbase) return Mode::linked;
  if (where.dli_fname != nullptr && std::strstr(where.dli_fname, "libfiber_hook") != nullptr) return Mode::preload;
  return Mode::none;
}

inline bool hooked() { return detected_mode() != Mode::none; }

// ------------------------------------------------------------------------------ errno

__attribute__((noinline)) inline int err() {
  asm volatile("" ::: "memory");
  return errno;
}
__attribute__((noinline)) inline void set_err(int e) {
  asm volatile("" ::: "memory");
  errno = e;
}

// errno's text (as a std::string: doctest prints a char* as an address).
inline std::string err_str(int e) { return std::strerror(e); }

// A call's result and the errno right after it.
struct Res {
  long r = 0;
  int e = 0;
};
template <typename F>
Res call(F&& f) {
  set_err(0);
  const long r = static_cast<long>(f());
  return Res{r, err()};
}

// ------------------------------------------------------------------------------ descriptors

// Not tests/io_util.hpp's Fd, which closes with fiber::io::close: here the close goes through
// libc, so that under the hook it takes the hooked path (and the hook's descriptor cache sees
// the number go before the kernel reuses it).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  operator int() const { return fd_; }  // NOLINT
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pair {
  Fd a, b;  // socketpair: both ends; pipe: a = read end, b = write end
};

inline Pair make_socketpair(int type_flags = 0, int type = SOCK_STREAM) {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, type | type_flags, 0, sv) == 0);
  return Pair{Fd(sv[0]), Fd(sv[1])};
}

inline Pair make_pipe(int flags = 0) {
  int p[2];
  REQUIRE((flags == 0 ? ::pipe(p) : ::pipe2(p, flags)) == 0);
  return Pair{Fd(p[0]), Fd(p[1])};
}

inline bool is_nonblocking(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  REQUIRE(fl >= 0);
  return (fl & O_NONBLOCK) != 0;
}

inline sockaddr_in loopback(uint16_t port_host_order = 0) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port_host_order);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

inline const sockaddr* sa(const sockaddr_in& a) { return reinterpret_cast<const sockaddr*>(&a); }

struct Listener {
  Fd fd;
  sockaddr_in addr{};
  uint16_t port() const { return ntohs(addr.sin_port); }
};

inline Listener tcp_listener(int backlog = 128, int type_flags = 0) {
  Listener l;
  l.fd = Fd(::socket(AF_INET, SOCK_STREAM | type_flags, 0));
  REQUIRE(l.fd >= 0);
  const int one = 1;
  REQUIRE(::setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
  l.addr = loopback();
  REQUIRE(::bind(l.fd, sa(l.addr), sizeof l.addr) == 0);
  socklen_t len = sizeof l.addr;
  REQUIRE(::getsockname(l.fd, reinterpret_cast<sockaddr*>(&l.addr), &len) == 0);
  REQUIRE(::listen(l.fd, backlog) == 0);
  return l;
}

// A UDP socket bound to a loopback port, and its address.
struct Udp {
  Fd fd;
  sockaddr_in addr{};
};
inline Udp udp_receiver() {
  Udp u{Fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)), loopback()};
  REQUIRE(u.fd >= 0);
  REQUIRE(::bind(u.fd, sa(u.addr), sizeof u.addr) == 0);
  socklen_t len = sizeof u.addr;
  REQUIRE(::getsockname(u.fd, reinterpret_cast<sockaddr*>(&u.addr), &len) == 0);
  return u;
}

// A message of data (`iov`) with room for one descriptor in its SCM_RIGHTS control buffer.
struct FdMessage {
  iovec iov;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  FdMessage(void* data, size_t n) : iov{data, n} {
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
  // The descriptor a received message carried, or -1.
  int passed() {
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
  }
};

// Sends `n` bytes of `data` with descriptor `fd` in an SCM_RIGHTS message, by a raw sendmsg (no
// hook on the way).
inline void send_with_fd(int sock, const char* data, size_t n, int fd) {
  FdMessage msg(const_cast<char*>(data), n);
  cmsghdr* c = CMSG_FIRSTHDR(&msg.m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  REQUIRE(::syscall(SYS_sendmsg, sock, &msg.m, 0) == static_cast<long>(n));
}

// A loopback address nobody listens on: `holder` stays bound to its port, never listening, so
// a connect there is refused and no other process (the suites run side by side) can take the
// port and accept the connect instead.
struct RefusedAddr {
  Fd holder;
  sockaddr_in addr;
};

inline RefusedAddr refused_addr() {
  RefusedAddr r{Fd(::socket(AF_INET, SOCK_STREAM, 0)), loopback()};
  REQUIRE(r.holder >= 0);
  REQUIRE(::bind(r.holder, sa(r.addr), sizeof r.addr) == 0);
  socklen_t len = sizeof r.addr;
  REQUIRE(::getsockname(r.holder, reinterpret_cast<sockaddr*>(&r.addr), &len) == 0);
  return r;
}

// A listener whose accept queue is full (backlog 0 plus one queued connection, never accepted):
// the kernel drops further SYNs, so a new connect waits until `queued` is accepted.
struct FullListener {
  Listener l;
  Fd queued;
};
inline FullListener full_listener() {
  FullListener f{tcp_listener(0), Fd()};
  f.queued = Fd(::socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(f.queued >= 0);
  REQUIRE(::connect(f.queued, sa(f.l.addr), sizeof f.l.addr) == 0);
  return f;
}

// Fills `fd`'s send path (socket buffer plus the peer's receive buffer, or a pipe) with
// MSG_DONTWAIT / a temporarily non-blocking write until it would block. Returns the bytes put in.
inline size_t fill(int fd, bool socket = true) {
  static char chunk[4096] = {};
  size_t total = 0;
  const int flags = ::fcntl(fd, F_GETFL);
  REQUIRE(flags >= 0);
  if (!socket) REQUIRE(::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0);
  for (;;) {
    const ssize_t r = socket ? ::send(fd, chunk, sizeof chunk, MSG_DONTWAIT) : ::write(fd, chunk, sizeof chunk);
    if (r > 0) {
      total += static_cast<size_t>(r);
      continue;
    }
    const int e = err();
    REQUIRE_MESSAGE((r < 0 && (e == EAGAIN || e == EWOULDBLOCK)), "fill: " << err_str(e));
    break;
  }
  if (!socket) REQUIRE(::fcntl(fd, F_SETFL, flags) == 0);
  return total;
}

// Reads from `fd` (on a plain thread) until `want` bytes came or `limit` passes without any;
// returns the bytes read. With `check_pattern`, byte i must be static_cast<char>(i * 7) offset by
// `pattern_from`, and *bad counts the mismatches.
inline size_t drain(int fd, size_t want, std::chrono::milliseconds limit = 10'000ms, long pattern_from = -1,
                    size_t* bad = nullptr) {
  static thread_local char buf[65536];
  size_t got = 0;
  while (got < want) {
    pollfd p{fd, POLLIN, 0};
    const int pr = ::poll(&p, 1, static_cast<int>(scaled(limit).count()));
    if (pr <= 0) break;
    const size_t n = std::min(sizeof buf, want - got);
    const ssize_t r = ::read(fd, buf, n);
    if (r <= 0) break;
    if (pattern_from >= 0 && bad != nullptr) {
      for (ssize_t i = 0; i < r; ++i) {
        const size_t pos = got + static_cast<size_t>(i) - static_cast<size_t>(pattern_from);
        if (got + static_cast<size_t>(i) >= static_cast<size_t>(pattern_from) && buf[i] != static_cast<char>(pos * 7)) ++*bad;
      }
    }
    got += static_cast<size_t>(r);
  }
  return got;
}

// ------------------------------------------------------------------------------ fibers

// Silences the watchdog's report (tests that block a processor on purpose).
inline fiber::WatchdogOptions quiet_watchdog() {
  fiber::WatchdogOptions w;
  w.sink = [](const fiber::BlockedReport&) {};
  return w;
}

// Runs body() on a fiber of a fresh scheduler with `procs` processors and waits for it (and
// rethrows what it threw), under a watchdog.
template <typename F>
void on_fiber(int procs, F&& body, std::chrono::milliseconds limit = 60'000ms, const char* what = "fiber body",
              fiber::WatchdogOptions wd = {}) {
  Watchdog dog(limit, what);
  fiber::Scheduler s({.processors = static_cast<std::size_t>(procs), .name = "hk", .watchdog = std::move(wd)});
  fiber::spawn({.scheduler = &s}, std::forward<F>(body)).join();
  quiesce(s);
}

// Sleeps on a plain thread until pred() or `limit` (scaled); returns pred().
template <typename Pred>
bool thread_wait(Pred&& pred, std::chrono::milliseconds limit = 5'000ms) {
  const auto deadline = Clock::now() + scaled(limit);
  while (!pred()) {
    if (Clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(200us);
  }
  return true;
}

template <typename R>
struct Parked {
  R value;
  bool parked;     // another fiber ran on the (single) processor while op() was in progress
  bool released;   // the releaser ran release() (op() was still in progress)
};

// See the header comment. Call from a fiber of a one-processor scheduler. release() runs on a
// plain thread; it must not wait unboundedly. With a `grace` period the releaser, once the probe
// has run, first waits that long (scaled) for op() to return on its own: `released` then says
// whether op() needed the release at all.
template <typename Op, typename Release>
auto parked_call(Op&& op, Release&& release, std::chrono::milliseconds limit = 5'000ms,
                 std::chrono::milliseconds grace = 0ms) {
  using R = decltype(op());
  std::atomic<bool> probe{false};
  std::atomic<bool> done{false};
  std::atomic<bool> released{false};
  std::atomic<bool> finished{false};
  auto h = fiber::spawn([&probe] { probe.store(true); });
  std::thread releaser([&] {
    thread_wait([&] { return probe.load() || done.load(); }, limit);
    if (grace.count() > 0) thread_wait([&] { return done.load(); }, grace);
    if (!done.load()) {
      released.store(true);
      release();
    }
    finished.store(true);
  });
  R value = op();
  const bool parked = probe.load();
  done.store(true);
  wait_for([&] { return finished.load(); }, 60'000ms);  // parks, rather than blocking the processor in join
  releaser.join();
  h.join();
  return Parked<R>{std::move(value), parked, released.load()};
}

// op() must not park: the probe fiber queued before it must not have run when it returns. If
// it does park (the hook got it wrong), release() - run on a plain thread once the probe has run -
// must make op() return, so that the check fails instead of the run hanging.
template <typename Op, typename Release>
auto no_park_call(Op&& op, Release&& release) {
  return parked_call(std::forward<Op>(op), std::forward<Release>(release));
}
// For calls that cannot wait forever even when they wrongly park (a zero timeout, ready data).
template <typename Op>
auto no_park_call(Op&& op) {
  return parked_call(std::forward<Op>(op), [] {});
}

// The blocking-offload pool's thread limit: $FIBER_BLOCKING_THREADS, else 64 (fiber/blocking.hpp).
inline int pool_limit() {
  const char* v = std::getenv("FIBER_BLOCKING_THREADS");
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? n : 64;
}

// Occupies every helper thread of the blocking-offload pool with a job that waits for open(). A
// job handed to the pool meanwhile queues behind them, so the fiber that handed it over must park
// until open() - where a call made inline on the processor would simply return. Construct and
// use it from a fiber; the occupying fibers run on that fiber's scheduler.
class PoolGate {
 public:
  PoolGate() {
    const int n = pool_limit();
    for (int i = 0; i < n; ++i) {
      hs_.push_back(fiber::spawn([this] {
        fiber::blocking([this] {
          inside_.fetch_add(1);
          while (!open_.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        });
      }));
    }
    full_ = wait_for([&] { return inside_.load() == n; });
  }
  ~PoolGate() {
    open();
    for (auto& h : hs_) h.join();
  }
  PoolGate(const PoolGate&) = delete;
  PoolGate& operator=(const PoolGate&) = delete;
  bool full() const { return full_; }  // every helper thread is held
  void open() { open_.store(true); }

 private:
  std::atomic<int> inside_{0};
  std::atomic<bool> open_{false};
  bool full_ = false;
  std::vector<fiber::JoinHandle<void>> hs_;
};

// Raises `max` to at least `now`.
inline void raise_max(std::atomic<int>& max, int now) {
  int m = max.load();
  while (now > m && !max.compare_exchange_weak(m, now)) {
  }
}

}  // namespace hook_test
