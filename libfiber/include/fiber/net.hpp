// A small TCP layer over fiber::io: listen, accept, dial, and a stream with exact reads and
// complete writes.
//
//   auto ln = fiber::net::Listener::listen("127.0.0.1:0");
//   if (!ln) die(ln.message());
//   uint16_t port = ln->port();
//   for (;;) {
//     auto conn = ln->accept();
//     if (!conn) continue;                          // conn.error() is the errno
//     fiber::go [c = std::move(*conn)]() mutable {
//       char buf[4096];
//       ssize_t n;
//       while ((n = c.read(buf, sizeof buf)) > 0) {
//         if (c.write_all(buf, n) < 0) break;
//       }
//     };
//   }
//
// Errors, as in fiber/io.hpp: calls returning a count or a descriptor return -errno; calls
// returning an object return a Result<T>, which holds the object or the errno and a message
// saying what failed. Addresses are "host:port": an IPv4 address, "[IPv6]", "localhost" or
// another name (resolved on the blocking-offload pool), or "" / "*" for any address. A string
// that does not parse gives EINVAL, as does a host with a NUL byte in it or "[]" / "[*]".
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fiber/config.hpp"
#include "fiber/io.hpp"

namespace fiber::net {

// An object, or the errno and a message saying why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit, like std::expected
  static Result failure(int err, std::string message) {
    Result r;
    r.err_ = err;
    r.message_ = std::move(message);
    return r;
  }

  bool ok() const noexcept { return err_ == 0; }
  explicit operator bool() const noexcept { return ok(); }
  int error() const noexcept { return err_; }  // the errno, 0 on success
  const std::string& message() const noexcept { return message_; }
  // The object; throws std::system_error (with the message) when there is none.
  T& value() & {
    if (err_ != 0) throw std::system_error(err_, std::generic_category(), message_);
    return value_;
  }
  T&& value() && { return std::move(value()); }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }

 private:
  Result() = default;
  T value_{};
  int err_ = 0;
  std::string message_;
};

// A parsed address.
struct Address {
  sockaddr_storage storage{};
  socklen_t len = 0;
  const sockaddr* get() const noexcept { return reinterpret_cast<const sockaddr*>(&storage); }
  uint16_t port() const noexcept;
  std::string to_string() const;  // "1.2.3.4:80" / "[::1]:80"
};
// Parses "host:port" (see above). Names other than numeric ones and localhost are resolved
// with getaddrinfo, on the blocking-offload pool inside a fiber or with a deadline; the caller
// waits until the deadline (ETIMEDOUT) or a cancel (ECANCELED), whichever comes first, and a
// lookup still running then finishes unwatched, holding a pool thread; while 8 such lookups are
// unfinished (a resolver that does not answer), new ones fail at once with EAGAIN rather than
// fill the pool that fiber::blocking shares. A name that does not resolve gives EHOSTUNREACH, a
// temporary resolver failure EAGAIN, a system error its errno.
// The first address of resolve_all().
FIBER_API Result<Address> resolve(std::string_view host_port, io::Deadline deadline = {});
// Every IPv4 and IPv6 address a name has, each once, in the resolver's order (RFC 3484/6724
// destination sorting); a numeric address or "localhost" gives one. Errors as resolve().
FIBER_API Result<std::vector<Address>> resolve_all(std::string_view host_port, io::Deadline deadline = {});

// A connected TCP socket. Move-only; closes its descriptor when destroyed.
class FIBER_API Stream {
 public:
  Stream() noexcept = default;
  // Takes ownership of a connected stream socket.
  explicit Stream(int fd) noexcept : fd_(fd) {}
  Stream(Stream&& o) noexcept : fd_(o.release()), known_socket_(o.known_socket_) {}
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { close(); }

  // Connects to "host:port" (TCP_NODELAY set). The deadline covers resolution and connect.
  // A name with several addresses (resolve_all) is tried one address at a time, in order, until
  // one connects, as Go's dialer does: with a deadline, each attempt gets an even share of the
  // time left, and at least 2 s when that much is left, so an address that never answers does
  // not use it all. On failure the errno is the first attempt's, as Go's; but ECANCELED after a
  // cancel, and ETIMEDOUT when the deadline passed before every address was tried. The message
  // lists every attempt.
  static Result<Stream> dial(std::string_view host_port, io::Deadline deadline = {});

  // Up to n bytes; 0 when the peer has closed; -errno.
  ssize_t read(void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  ssize_t write(const void* buf, size_t n, io::Deadline deadline = {}) noexcept { return io::send(fd(), buf, n, 0, deadline); }
  // Exactly n bytes: returns n; fewer if the peer closed first (the count read); -errno on an
  // error (the bytes read before it are in buf, their count is lost). A signal interrupting a
  // plain thread's wait (EINTR) does not end it.
  ssize_t read_exact(void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  // All n bytes, looping over short writes (and EINTR, as read_exact): n, or -errno.
  ssize_t write_all(const void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  // shutdown(2): SHUT_WR sends end-of-stream to the peer. 0 or -errno.
  int shutdown(int how = SHUT_WR) noexcept;
  // Closes now (as io::close: wakes fibers waiting on it; calls made after it returns fail with
  // EBADF). 0 or -errno; 0 if already closed. The one call that may run while other fibers use
  // the stream. (A call that has already read the descriptor number but not yet started its
  // operation when close() runs may still act on that number, as with close(2) itself.)
  int close() noexcept;
  int set_nodelay(bool on) noexcept;

  int fd() const noexcept { return fd_.load(std::memory_order_relaxed); }
  bool is_open() const noexcept { return fd() >= 0; }
  // Gives up ownership of the descriptor.
  int release() noexcept { return fd_.exchange(-1, std::memory_order_relaxed); }
  Result<Address> peer_address() const;

 private:
  friend class Listener;
  Stream(int fd, bool known_socket) noexcept : fd_(fd), known_socket_(known_socket) {}
  // Atomic because close() may run while another fiber is in a call (relaxed: the descriptor's
  // own synchronisation is io::close's; this only makes the number's read well defined).
  std::atomic<int> fd_{-1};
  // Made by dial() or accept(), so certainly a socket: read() may let the kernel wait for data
  // before its first attempt (see libfiber/src/io/io.cpp, ring_op). A descriptor handed to
  // Stream(int) is not trusted with that: on a pipe it would wait instead of failing (ENOTSOCK).
  bool known_socket_ = false;
};

// A listening TCP socket. Move-only; closes its descriptor when destroyed.
class FIBER_API Listener {
 public:
  Listener() noexcept = default;
  Listener(Listener&& o) noexcept : fd_(o.fd_.exchange(-1, std::memory_order_relaxed)), port_(o.port_) {}
  Listener& operator=(Listener&& o) noexcept;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  ~Listener() { close(); }

  // Binds "host:port" (port 0: any free port, see port()) with SO_REUSEADDR and listens.
  static Result<Listener> listen(std::string_view host_port, int backlog = 4096);

  // The next connection (TCP_NODELAY set). Fails with -EMFILE/-ENFILE when out of descriptors:
  // the caller should back off and retry (see samples/echo_server.cpp).
  Result<Stream> accept(io::Deadline deadline = {});
  // Closes now, waking a fiber waiting in accept() (which then fails with EBADF); may run while
  // another fiber uses the listener.
  int close() noexcept;

  uint16_t port() const noexcept { return port_; }
  int fd() const noexcept { return fd_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int> fd_{-1};  // atomic as Stream's
  uint16_t port_ = 0;
};

}  // namespace fiber::net
