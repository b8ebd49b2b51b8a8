// fiber::net: TCP over fiber::io. See fiber/net.hpp.
#include "fiber/net.hpp"

#include "fiber/detail/wait.hpp"
#include "fiber/error.hpp"
#include "fiber/semaphore.hpp"
#include "io/blocking_pool.hpp"
#include "io/raw.hpp"
#include "io/socket.hpp"
#include "sched/fiber.hpp"
#include "sched/runtime.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

namespace fiber::net {
namespace raw = fiber::detail::raw;
namespace {

std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

// Splits "host:port" / "[v6]:port"; false if it does not have that shape.
bool split(std::string_view s, std::string_view& host, std::string_view& port) {
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') return false;
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
    return !host.empty() && host != "*";  // brackets hold an address, not "any"
  }
  const auto colon = s.rfind(':');
  if (colon == std::string_view::npos) return false;
  host = s.substr(0, colon);
  if (host.find(':') != std::string_view::npos) return false;  // bare IPv6 needs brackets
  port = s.substr(colon + 1);
  return true;
}

bool parse_port(std::string_view s, uint16_t& out) {
  if (s.empty() || s.size() > 5) return false;
  unsigned v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v > 65535) return false;
  out = static_cast<uint16_t>(v);
  return true;
}

// Lookups whose caller gave up (deadline, cancel) and which still hold a pool thread. They share
// the pool with every fiber::blocking call, so while the resolver does not answer, a dial retried
// in a loop would fill it with them. At kMaxAbandonedLookups new lookups fail at once (EAGAIN)
// until some finish. Relaxed: a heuristic bound, briefly off by one while a caller and its job
// race (it may dip below zero for a moment).
constexpr int kMaxAbandonedLookups = 8;
std::atomic<int> g_abandoned_lookups{0};

// A name lookup (getaddrinfo) on the blocking-offload pool that its caller may stop waiting for
// (a deadline, a cancel) while it goes on. Shared by the caller and the job: whichever lets go
// last frees it, and with it the result.
struct Lookup {
  std::string host;
  addrinfo* res = nullptr;
  int rc = EAI_SYSTEM;
  int sys_errno = 0;         // EAI_SYSTEM's errno, from the thread that made the call
  fiber::Semaphore done{0};  // released once the result is in
  // kRunning, then kFinished (the job, exchange) or kAbandoned (the caller, CAS from kRunning);
  // whichever moves second learns the other's move and keeps g_abandoned_lookups right.
  static constexpr int kRunning = 0, kFinished = 1, kAbandoned = 2;
  std::atomic<int> state{kRunning};
  ~Lookup() {
    if (res != nullptr) freeaddrinfo(res);
  }
  void abandon() noexcept {
    int expected = kRunning;
    if (state.compare_exchange_strong(expected, kAbandoned)) g_abandoned_lookups.fetch_add(1, std::memory_order_relaxed);
  }
  void run() noexcept {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    errno = 0;
    rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
    sys_errno = errno;
  }
  // The pool job: `ref` is the job's own reference.
  static void job(void* ref) noexcept {
    std::unique_ptr<std::shared_ptr<Lookup>> own(static_cast<std::shared_ptr<Lookup>*>(ref));
    Lookup& lk = **own;
    lk.run();
    if (lk.state.exchange(kFinished) == kAbandoned) g_abandoned_lookups.fetch_sub(1, std::memory_order_relaxed);
    lk.done.release();  // the job's reference keeps the semaphore alive through this
  }
};

// getaddrinfo's error as an errno: EAGAIN for a temporary failure (EAI_AGAIN), ENOMEM, the
// system error for EAI_SYSTEM (EIO if it left none), EHOSTUNREACH for a name that does not
// resolve (EAI_NONAME, EAI_NODATA, EAI_FAIL, ...).
int lookup_errno(int rc, int sys_errno) noexcept {
  switch (rc) {
    case EAI_SYSTEM: return sys_errno != 0 ? sys_errno : EIO;
    case EAI_AGAIN: return EAGAIN;
    case EAI_MEMORY: return ENOMEM;
    default: return EHOSTUNREACH;
  }
}

int socket_for(const Address& a) {
  const int fd = ::socket(a.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  return fd < 0 ? -raw::last_errno() : fd;
}

void nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// The deadline of one connect among several (Go's partial deadline): the time left, shared
// evenly among the addresses left to try, but at least kMinAttempt when that much is left, so
// that an address that never answers (its SYNs dropped) still leaves time for the next ones.
io::Deadline attempt_deadline(io::Deadline overall, std::size_t addresses_left) {
  using namespace std::chrono;
  constexpr auto kMinAttempt = duration_cast<steady_clock::duration>(2s);
  if (overall.is_none() || addresses_left <= 1) return overall;
  const auto now = steady_clock::now();
  const auto left = overall.at() - now;
  auto share = left / static_cast<long>(addresses_left);
  if (share < kMinAttempt) share = std::min(left, kMinAttempt);
  return io::Deadline(now + share);
}

}  // namespace

uint16_t Address::port() const noexcept {
  if (storage.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  if (storage.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  return 0;
}

std::string Address::to_string() const {
  char buf[INET6_ADDRSTRLEN] = {};
  if (storage.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof buf);
    return std::string(buf) + ":" + std::to_string(port());
  }
  if (storage.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]:" + std::to_string(port());
  }
  return "?";
}

Result<std::vector<Address>> resolve_all(std::string_view host_port, io::Deadline deadline) {
  using Addresses = std::vector<Address>;
  auto parse_error = [&](const char* why) {
    return Result<Addresses>::failure(EINVAL, "fiber::net: " + quoted(host_port) + " is not host:port (" + why + ")");
  };
  std::string_view host, port_s;
  if (!split(host_port, host, port_s)) return parse_error("expected host:port");
  uint16_t port;
  if (!parse_port(port_s, port)) return parse_error("the port is not a number from 0 to 65535");
  // The C library would see the name end at the NUL: a different host than the one given.
  if (host.find('\0') != std::string_view::npos) return parse_error("the host contains a NUL byte");
  Address a;
  if (host.empty() || host == "*") {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.storage);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_ANY);
    in->sin_port = htons(port);
    a.len = sizeof(sockaddr_in);
    return Addresses{a};
  }
  const std::string h(host == "localhost" ? std::string_view("127.0.0.1") : host);
  auto* in = reinterpret_cast<sockaddr_in*>(&a.storage);
  if (inet_pton(AF_INET, h.c_str(), &in->sin_addr) == 1) {
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    a.len = sizeof(sockaddr_in);
    return Addresses{a};
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (inet_pton(AF_INET6, h.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    a.len = sizeof(sockaddr_in6);
    return Addresses{a};
  }
  // A name: getaddrinfo blocks (DNS). A plain thread without a deadline calls it; otherwise it
  // runs on the blocking-offload pool, and the caller waits for it until the deadline or a
  // cancel, whichever comes first (the lookup then finishes unwatched).
  auto fail = [&](int err, const std::string& why) {
    return Result<Addresses>::failure(err, "fiber::net: resolving " + quoted(host) + ": " + why);
  };
  if (deadline.expired()) return fail(ETIMEDOUT, "the deadline passed");
  const detail::Fiber* self = detail::current_fiber();
  if (self != nullptr) {
    detail::ensure_listed(self);
    if (self->cancel_requested.load(std::memory_order_acquire)) return fail(ECANCELED, "cancelled");
  }
  auto lk = std::make_shared<Lookup>();
  lk->host = h;
  if (self == nullptr && deadline.is_none()) {
    lk->run();
  } else {
    if (g_abandoned_lookups.load(std::memory_order_relaxed) >= kMaxAbandonedLookups) {
      return fail(EAGAIN, std::to_string(kMaxAbandonedLookups) +
                              " earlier lookups whose callers gave up have not finished (is the resolver answering?)");
    }
    auto ref = std::make_unique<std::shared_ptr<Lookup>>(lk);
    try {
      detail::blocking_detach(&Lookup::job, ref.get());
      (void)ref.release();  // the job's now
      if (deadline.is_none()) {
        lk->done.acquire();
      } else if (!lk->done.try_acquire_until(deadline.at())) {
        lk->abandon();
        return fail(ETIMEDOUT, "the deadline passed");
      }
    } catch (const fiber::Cancelled&) {
      lk->abandon();  // no-op if the job has finished
      return fail(ECANCELED, "cancelled");
    } catch (const fiber::ResourceError& e) {  // no helper thread could be started
      return fail(EAGAIN, e.what());
    } catch (const fiber::UsageError& e) {  // an invalid $FIBER_BLOCKING_THREADS
      return fail(EINVAL, e.what());
    }
  }
  if (lk->rc != 0 || lk->res == nullptr) {
    const int err = lookup_errno(lk->rc, lk->sys_errno);
    return Result<Addresses>::failure(err, "fiber::net: cannot resolve " + quoted(host) + ": " +
                                               (lk->rc == EAI_SYSTEM ? std::strerror(err) : gai_strerror(lk->rc)));
  }
  // Every IPv4 and IPv6 address, each once, in the resolver's order (RFC 3484/6724 destination
  // sorting, as resolve_all's header says): a name listed twice (/etc/hosts) gives one twice.
  Addresses all;
  for (const addrinfo* ai = lk->res; ai != nullptr; ai = ai->ai_next) {
    const int family = ai->ai_addr ? ai->ai_addr->sa_family : AF_UNSPEC;
    if ((family != AF_INET && family != AF_INET6) || ai->ai_addrlen > sizeof(a.storage)) continue;
    Address b;
    std::memcpy(&b.storage, ai->ai_addr, ai->ai_addrlen);
    b.len = ai->ai_addrlen;
    if (family == AF_INET) reinterpret_cast<sockaddr_in*>(&b.storage)->sin_port = htons(port);
    if (family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&b.storage)->sin6_port = htons(port);
    const bool seen = std::any_of(all.begin(), all.end(), [&](const Address& c) {
      return c.len == b.len && std::memcmp(&c.storage, &b.storage, b.len) == 0;
    });
    if (!seen) all.push_back(b);
  }
  if (all.empty()) {
    return Result<Addresses>::failure(EHOSTUNREACH, "fiber::net: cannot resolve " + quoted(host) +
                                                        ": the resolver gave no IPv4 or IPv6 address");
  }
  return all;
}

Result<Address> resolve(std::string_view host_port, io::Deadline deadline) {
  auto all = resolve_all(host_port, deadline);
  if (!all) return Result<Address>::failure(all.error(), all.message());
  return all->front();
}

// ------------------------------------------------------------------------------ Stream

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    close();
    fd_.reset(o.release());
    known_socket_ = o.known_socket_;
  }
  return *this;
}

Result<Stream> Stream::dial(std::string_view host_port, io::Deadline deadline) {
  auto addrs = resolve_all(host_port, deadline);
  if (!addrs) return Result<Stream>::failure(addrs.error(), addrs.message());
  // Each address in turn until one connects, as Go's dialer does without its parallel IPv4
  // fallback: a name with an IPv6 address on a host without IPv6 routes, or with one server
  // down, still connects. The errno is the first attempt's (Go's firstErr), unless a cancel
  // or the deadline passing before every address was tried ended the tries; the message lists
  // every attempt.
  int err = 0;
  std::string attempts;
  const std::size_t n = addrs->size();
  for (std::size_t i = 0; i < n; ++i) {
    if (i > 0 && deadline.expired()) {
      attempts += "; the deadline passed before the other " + std::to_string(n - i) + " address(es)";
      err = ETIMEDOUT;
      break;
    }
    const Address& a = (*addrs)[i];
    const int fd = socket_for(a);
    int rc = fd;
    if (fd >= 0) {
      Stream s(fd, true);
      rc = io::connect(fd, a.get(), a.len, attempt_deadline(deadline, n - i));
      if (rc == 0) {
        nodelay(fd);
        return s;
      }
    }
    if (err == 0) err = -rc;
    attempts += i ? "; " : ": ";
    if (n > 1) attempts += a.to_string() + ": ";
    attempts += std::string(fd < 0 ? "socket: " : "") + std::strerror(-rc);
    if (rc == -ECANCELED) {
      if (i + 1 < n) attempts += "; cancelled before the other " + std::to_string(n - i - 1) + " address(es)";
      err = ECANCELED;
      break;
    }
  }
  return Result<Stream>::failure(err, "fiber::net::Stream::dial " + quoted(host_port) + attempts);
}

// Every call below holds a Use for its whole length, loops included: see OwnedFd. A Use taken
// once close() has begun holds -1, which each system call (and fiber::io call) below answers
// with EBADF, as it did before the count, when close() left -1 in the stream.

ssize_t Stream::read_on(int fd, void* buf, size_t n, io::Deadline deadline) noexcept {
  return known_socket_ ? detail::recv_socket(fd, buf, n, deadline) : io::recv(fd, buf, n, 0, deadline);
}

ssize_t Stream::read(void* buf, size_t n, io::Deadline deadline) noexcept {
  const detail::OwnedFd::Use use(fd_);
  return read_on(use.fd(), buf, n, deadline);
}

ssize_t Stream::write(const void* buf, size_t n, io::Deadline deadline) noexcept {
  const detail::OwnedFd::Use use(fd_);
  return io::send(use.fd(), buf, n, 0, deadline);
}

ssize_t Stream::read_exact(void* buf, size_t n, io::Deadline deadline) noexcept {
  const detail::OwnedFd::Use use(fd_);
  auto* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read_on(use.fd(), p + got, n - got, deadline);
    if (r == -EINTR) continue;  // a plain thread's signal handler ran: the count is not lost
    if (r < 0) return r;
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

ssize_t Stream::write_all(const void* buf, size_t n, io::Deadline deadline) noexcept {
  const detail::OwnedFd::Use use(fd_);
  const auto* p = static_cast<const char*>(buf);
  size_t sent = 0;
  while (sent < n) {
    const ssize_t r = io::send(use.fd(), p + sent, n - sent, 0, deadline);
    if (r == -EINTR) continue;  // as read_exact
    if (r < 0) return r;
    sent += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(sent);
}

int Stream::shutdown(int how) noexcept {
  const detail::OwnedFd::Use use(fd_);
  return ::shutdown(use.fd(), how) == 0 ? 0 : -raw::last_errno();
}

int Stream::close() noexcept { return fd_.close(); }

int Stream::set_nodelay(bool on) noexcept {
  const detail::OwnedFd::Use use(fd_);
  const int v = on ? 1 : 0;
  return setsockopt(use.fd(), IPPROTO_TCP, TCP_NODELAY, &v, sizeof v) == 0 ? 0 : -raw::last_errno();
}

Result<Address> Stream::peer_address() const {
  const detail::OwnedFd::Use use(fd_);
  Address a;
  a.len = sizeof a.storage;
  if (getpeername(use.fd(), reinterpret_cast<sockaddr*>(&a.storage), &a.len) != 0) {
    const int err = raw::last_errno();
    return Result<Address>::failure(err, std::string("fiber::net::Stream::peer_address: ") + std::strerror(err));
  }
  return a;
}

// ------------------------------------------------------------------------------ Listener

Listener& Listener::operator=(Listener&& o) noexcept {
  if (this != &o) {
    close();
    fd_.reset(o.fd_.release());
    port_ = o.port_;
  }
  return *this;
}

Result<Listener> Listener::listen(std::string_view host_port, int backlog) {
  auto addr = resolve(host_port);
  if (!addr) return Result<Listener>::failure(addr.error(), addr.message());
  if (backlog <= 0) return Result<Listener>::failure(EINVAL, "fiber::net::Listener::listen: backlog must be positive");
  const int fd = socket_for(*addr);
  auto fail = [&](const char* what) {
    const int err = raw::last_errno();
    ::close(fd);
    return Result<Listener>::failure(err, "fiber::net::Listener::listen " + quoted(host_port) + ": " + what + ": " +
                                              std::strerror(err));
  };
  if (fd < 0) {
    return Result<Listener>::failure(-fd, std::string("fiber::net::Listener::listen: socket: ") + std::strerror(-fd));
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, addr->get(), addr->len) != 0) return fail("bind");
  if (::listen(fd, backlog) != 0) return fail("listen");
  Address bound;
  bound.len = sizeof bound.storage;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound.storage), &bound.len) != 0) return fail("getsockname");
  Listener l;
  l.fd_.reset(fd);
  l.port_ = bound.port();
  return l;
}

Result<Stream> Listener::accept(io::Deadline deadline) {
  const detail::OwnedFd::Use use(fd_);
  const int conn = io::accept(use.fd(), nullptr, nullptr, SOCK_CLOEXEC, deadline);
  if (conn < 0) return Result<Stream>::failure(-conn, std::string("fiber::net::Listener::accept: ") + std::strerror(-conn));
  nodelay(conn);
  return Stream(conn, true);
}

int Listener::close() noexcept { return fd_.close(); }

}  // namespace fiber::net

namespace fiber::detail {

// ------------------------------------------------------------------------------ OwnedFd

struct OwnedFd::Closing {
  OwnedFd* owner;
  int fd;
};

int OwnedFd::enter(uint64_t& unit) noexcept {
  unit = current_fiber() != nullptr ? 1 : kThreadCall;
  if (users_.fetch_add(unit, std::memory_order_acq_rel) & kClosing) [[unlikely]] return -1;
  return fd_.load(std::memory_order_relaxed);  // -1 if the close began after the add: fine too
}

void OwnedFd::leave(uint64_t unit) noexcept {
  uint64_t cur = users_.load(std::memory_order_relaxed);
  for (;;) {
    const bool last = (cur & kWaiting) && (cur & kCalls) == unit;
    const uint64_t next = (cur - unit) & ~(last ? kWaiting : 0);
    if (users_.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
      // The closer waits for this wake: closer_ and its record are still there to read.
      if (last) [[unlikely]] waiter_notify(*closer_);
      return;
    }
  }
}

void OwnedFd::reset(int fd) noexcept {
  {
    // Both under the lock: a close() that saw kClosing and is about to wait for done_ finds
    // the flag gone instead, and returns (the close it raced has finished).
    std::lock_guard lock(lock_);
    done_ = false;
    users_.fetch_and(kCalls & ~kWaiting, std::memory_order_acq_rel);  // kWaiting is clear by now anyway
  }
  fd_.store(fd, std::memory_order_relaxed);
}

int OwnedFd::close() noexcept {
  if (users_.fetch_or(kClosing, std::memory_order_acq_rel) & kClosing) {
    // Another close() is first: return once it has finished with the object.
    Waiter w;
    {
      std::lock_guard lock(lock_);
      if (done_ || !(users_.load(std::memory_order_acquire) & kClosing)) return 0;  // finished (and reset)
      waiter_prepare_shielded(w);  // not ended by a cancel: a destructor may be waiting
      later_closers_.push_back(&w);
    }
    waiter_wait(w, ParkReason::IO);
    return 0;
  }
  // From here on calls get -1 (from enter() or from fd_) or are counted, and waited for.
  const int fd = fd_.exchange(-1, std::memory_order_relaxed);
  int rc = 0;
  if (fd >= 0) {
    Closing closing{this, fd};
    rc = close_draining(fd, &OwnedFd::wait_for_calls, &closing);
  }
  WaitQueue later;
  {
    std::lock_guard lock(lock_);
    done_ = true;
    std::swap(later, later_closers_);
  }
  // The object may be gone from here on (a later close() returned, its owner went).
  while (Waiter* w = later.pop_front()) waiter_notify(*w);
  return rc;
}

// From close_draining, after the drain (if the descriptor has a slot in the fd table:
// `fibers_drained`) and while no fiber's operation can start on it, before close(2).
void OwnedFd::wait_for_calls(void* closing, bool fibers_drained) noexcept {
  const auto& c = *static_cast<const Closing*>(closing);
  OwnedFd& o = *c.owner;
  uint64_t cur = o.users_.load(std::memory_order_acquire);
  if ((cur & kCalls) == 0) return;
  // A fiber's call still counted after the drain is on its way out: it had read the number but
  // not listed itself yet, and now fails at its next wait, or ends when it completes (a write
  // the socket has room for). A plain thread's may be blocked in the kernel, where neither the
  // drain nor close(2) reaches it, and so may a fiber's on a descriptor without a slot; shutting
  // the socket down ends a read, write or accept there. It acts on the socket, not the
  // descriptor: a dup of it (another process's too) is shut down with it.
  if (!fibers_drained || (cur & kCalls & ~kFiberCalls)) ::shutdown(c.fd, SHUT_RDWR);
  Waiter w;
  waiter_prepare_shielded(w);  // the close must finish even if the closing fiber is cancelled
  o.closer_ = &w;
  for (;;) {
    if ((cur & kCalls) == 0) {
      waiter_notify(w);  // the last call left meanwhile: the wait below returns at once
      break;
    }
    if (o.users_.compare_exchange_weak(cur, cur | kWaiting, std::memory_order_acq_rel, std::memory_order_acquire)) break;
  }
  waiter_wait(w, ParkReason::IO);
}

}  // namespace fiber::detail
