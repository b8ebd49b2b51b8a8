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
#include "fiber/detail/wait.hpp"
#include "fiber/io.hpp"

namespace fiber::detail {

// The descriptor a Stream or a Listener owns, with a count of the calls in progress on it, so
// that close() frees the number only once none of them can still act on it (Go's fdMutex,
// reduced to what close needs). Without it, a call that had read the number but not yet started
// its system call when another fiber or thread closed the stream could act on whatever the
// kernel gave that number to next: another connection's bytes.
//
// users_ holds two flags and two counts of the calls holding a Use: plain threads' (bits 31-61)
// and fibers' (bits 0-30). kClosing is set by the first close() and stays until reset(). A call
// counts itself in, then looks at kClosing: set, it fails with EBADF without touching the
// number; clear, the number cannot be freed before the call counts itself out. The first
// close() sets kClosing and takes the number out of fd_, wakes the fibers waiting on the
// descriptor (io::close's drain), shuts the socket down if a call remains that the drain may
// not reach (a plain thread's, blocked in the kernel), and, if calls remain, publishes its wait
// record in closer_ and sets kWaiting, with one CAS while the count is not zero. The call that
// takes the count to zero with kWaiting set clears kWaiting in the same CAS and then wakes the
// closer; no other call reads closer_, and the closer cannot go on before that wake. Every
// step is on users_, so each call's decision and the closer's are ordered by it.
//
// A close() that finds kClosing set waits until the first one has finished (done_): owners
// call close() from the destructor and from move assignment, and the first close() still uses
// the object after the calls it ended have returned. done_ is set under lock_ as the first
// close()'s last use of the object.
class FIBER_API OwnedFd {
 public:
  OwnedFd() noexcept = default;
  explicit OwnedFd(int fd) noexcept : fd_(fd) {}
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;

  // A call's hold on the descriptor for its whole length: fd() is the number, or -1 once close()
  // has begun (or after release()).
  class Use {
   public:
    explicit Use(OwnedFd& o) noexcept : owner_(o), fd_(o.enter(unit_)) {}
    ~Use() { owner_.leave(unit_); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    int fd() const noexcept { return fd_; }

   private:
    OwnedFd& owner_;
    uint64_t unit_ = 0;  // what this call added to users_ (set by enter, before fd_)
    int fd_;
  };

  // The number; -1 once close() has begun.
  int get() const noexcept { return fd_.load(std::memory_order_relaxed); }
  // Gives up ownership: the number, or -1. Not while calls are in progress.
  int release() noexcept { return fd_.exchange(-1, std::memory_order_relaxed); }
  // Owns `fd` afresh, after close() or release() (a move assignment). Calls that counted
  // themselves in on the closed one and have yet to count out keep their count.
  void reset(int fd) noexcept;
  // Closes as described above: 0 or close(2)'s -errno. 0 if there was nothing to close, or if
  // another close() was first (once that one has finished).
  int close() noexcept;

 private:
  static constexpr uint64_t kClosing = uint64_t{1} << 63;
  static constexpr uint64_t kWaiting = uint64_t{1} << 62;
  static constexpr uint64_t kCalls = kWaiting - 1;
  static constexpr uint64_t kThreadCall = uint64_t{1} << 31;
  static constexpr uint64_t kFiberCalls = kThreadCall - 1;
  struct Closing;
  int enter(uint64_t& unit) noexcept;
  void leave(uint64_t unit) noexcept;
  static void wait_for_calls(void* closing, bool fibers_drained) noexcept;

  std::atomic<int> fd_{-1};
  std::atomic<uint64_t> users_{0};
  Waiter* closer_ = nullptr;  // written by the closer before it sets kWaiting; read by the call that clears it
  SpinLock lock_;
  bool done_ = false;         // GUARDED_BY(lock_): the first close() has finished with the object
  WaitQueue later_closers_;   // GUARDED_BY(lock_): close() calls waiting for done_
};

}  // namespace fiber::detail

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
  ssize_t write(const void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  // Exactly n bytes: returns n; fewer if the peer closed first (the count read); -errno on an
  // error (the bytes read before it are in buf, their count is lost). A signal interrupting a
  // plain thread's wait (EINTR) does not end it.
  ssize_t read_exact(void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  // All n bytes, looping over short writes (and EINTR, as read_exact): n, or -errno.
  ssize_t write_all(const void* buf, size_t n, io::Deadline deadline = {}) noexcept;
  // shutdown(2): SHUT_WR sends end-of-stream to the peer. 0 or -errno.
  int shutdown(int how = SHUT_WR) noexcept;
  // Closes it: the one call that may run while other fibers or threads use the stream, the way
  // to stop a reader. From its start, is_open() is false and calls that begin fail with EBADF.
  // Calls in progress end first, and close() returns once they have, so none can act on a
  // number the kernel has reused: a fiber's call at its next wait, with -EBADF (as io::close
  // wakes them), or when it completes. If a call the drain may not reach is still running, such
  // as a plain thread's blocking read, close() shuts the socket down (shutdown(2), both ways),
  // which ends it as if the peer had gone (0, -EPIPE, an accept's EINVAL); that acts on the
  // socket, so a dup of it, another process's too, is shut down with it. (A Stream(int) that is
  // not a socket cannot be shut down: a plain thread's call blocked in it holds close() up until
  // it returns.) 0 or -errno; 0 if already closed. A close() racing another returns 0 once that
  // one has finished, so the destructor of a stream that another fiber is closing waits for it.
  int close() noexcept;
  int set_nodelay(bool on) noexcept;

  // The number, for calls of your own; close() does not wait for those (as with close(2)).
  int fd() const noexcept { return fd_.get(); }
  bool is_open() const noexcept { return fd() >= 0; }
  // Gives up ownership of the descriptor (not while other calls are in progress on it).
  int release() noexcept { return fd_.release(); }
  Result<Address> peer_address() const;

 private:
  friend class Listener;
  Stream(int fd, bool known_socket) noexcept : fd_(fd), known_socket_(known_socket) {}
  ssize_t read_on(int fd, void* buf, size_t n, io::Deadline deadline) noexcept;
  // The descriptor and the count of calls in progress on it; mutable so that const calls
  // (peer_address) count themselves in too.
  mutable detail::OwnedFd fd_;
  // Made by dial() or accept(), so certainly a socket: read() may let the kernel wait for data
  // before its first attempt (see libfiber/src/io/io.cpp, ring_op). A descriptor handed to
  // Stream(int) is not trusted with that: on a pipe it would wait instead of failing (ENOTSOCK).
  bool known_socket_ = false;
};

// A listening TCP socket. Move-only; closes its descriptor when destroyed.
class FIBER_API Listener {
 public:
  Listener() noexcept = default;
  Listener(Listener&& o) noexcept : fd_(o.fd_.release()), port_(o.port_) {}
  Listener& operator=(Listener&& o) noexcept;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  ~Listener() { close(); }

  // Binds "host:port" (port 0: any free port, see port()) with SO_REUSEADDR and listens.
  static Result<Listener> listen(std::string_view host_port, int backlog = 4096);

  // The next connection (TCP_NODELAY set). Fails with -EMFILE/-ENFILE when out of descriptors:
  // the caller should back off and retry (see samples/echo_server.cpp).
  Result<Stream> accept(io::Deadline deadline = {});
  // Closes it, as Stream::close: may run while other fibers or threads are in accept(), which
  // then fails with EBADF (a fiber's) or EINVAL (a plain thread's, ended by shutdown(2): a
  // listening socket shared with other processes stops listening for them too).
  int close() noexcept;

  uint16_t port() const noexcept { return port_; }
  int fd() const noexcept { return fd_.get(); }

 private:
  detail::OwnedFd fd_;  // as Stream's
  uint16_t port_ = 0;
};

}  // namespace fiber::net
