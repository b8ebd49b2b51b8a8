// The semantics a caller keeps inside a fiber (hooks/hook.cpp, header comment; DESIGN.md §8):
//   - the O_NONBLOCK it set, by any means and at any time, still gives EAGAIN;
//   - no timeout unless SO_RCVTIMEO / SO_SNDTIMEO set one; on expiry EAGAIN (a TCP connect:
//     EINPROGRESS), and what the kernel knows of the descriptor is the truth (dup shares it);
//   - close from another fiber (or thread) wakes a fiber blocked on the descriptor with EBADF;
//   - errno is right after a park, after a migration, and per fiber;
//   - a cancelled sleep reports EINTR; a signal handler gets the real calls;
//   - MSG_WAITALL waits for all of it, MSG_ERRQUEUE never waits, a stream socket's sendto writes
//     everything, select never ends early, a huge timeout is for ever, the kernel's own
//     ETIMEDOUT stays ETIMEDOUT;
//   - a number fclose closed and a new descriptor took is the new descriptor (more in
//     test_numbers.cpp);
//   - a MSG_FASTOPEN send on a blocking socket connects and sends; recvfrom with an address
//     and no length is EFAULT.
#include <doctest/doctest.h>

#include <dirent.h>
#include <netinet/tcp.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/select.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hook_util.hpp"

using namespace hook_test;

namespace {

void write_str(int fd, const char* s) {
  const size_t n = std::strlen(s);
  REQUIRE(::write(fd, s, n) == static_cast<ssize_t>(n));
}

void set_timeout(int fd, int opt, std::chrono::microseconds d) {
  timeval tv{static_cast<time_t>(d.count() / 1'000'000), static_cast<suseconds_t>(d.count() % 1'000'000)};
  REQUIRE(::setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv) == 0);
}

std::chrono::microseconds get_timeout(int fd, int opt) {
  timeval tv{};
  socklen_t len = sizeof tv;
  REQUIRE(::getsockopt(fd, SOL_SOCKET, opt, &tv, &len) == 0);
  return std::chrono::seconds(tv.tv_sec) + std::chrono::microseconds(tv.tv_usec);
}

int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

// The kernel keeps socket timeouts in clock ticks: what getsockopt reports may be rounded up.
bool near(std::chrono::microseconds got, std::chrono::microseconds want) {
  return got >= want && got <= want + std::chrono::milliseconds(10);
}

// Blocking calls of one byte on a socket, for tests that run each of them.
using SockCall = long (*)(int);
const std::pair<const char*, SockCall> kOneByteReads[] = {
    {"read", [](int fd) -> long { char c; return ::read(fd, &c, 1); }},
    {"readv", [](int fd) -> long { char c; iovec iov{&c, 1}; return ::readv(fd, &iov, 1); }},
    {"recv", [](int fd) -> long { char c; return ::recv(fd, &c, 1, 0); }},
    {"recvfrom", [](int fd) -> long {
       char c;
       sockaddr_storage ss;
       socklen_t len = sizeof ss;
       return ::recvfrom(fd, &c, 1, 0, reinterpret_cast<sockaddr*>(&ss), &len);
     }},
    {"recvmsg", [](int fd) -> long {
       char c;
       iovec iov{&c, 1};
       msghdr m{};
       m.msg_iov = &iov;
       m.msg_iovlen = 1;
       return ::recvmsg(fd, &m, 0);
     }},
};
const std::pair<const char*, SockCall> kOneByteWrites[] = {
    {"write", [](int fd) -> long { return ::write(fd, "x", 1); }},
    {"writev", [](int fd) -> long { iovec iov{const_cast<char*>("x"), 1}; return ::writev(fd, &iov, 1); }},
    {"send", [](int fd) -> long { return ::send(fd, "x", 1, 0); }},
    {"sendto", [](int fd) -> long { return ::sendto(fd, "x", 1, 0, nullptr, 0); }},
    {"sendmsg", [](int fd) -> long {
       iovec iov{const_cast<char*>("x"), 1};
       msghdr m{};
       m.msg_iov = &iov;
       m.msg_iovlen = 1;
       return ::sendmsg(fd, &m, 0);
     }},
};

// A blocking read of one byte that must park until `writer` end gets a byte.
void expect_read_parks(int rd, int wr, const std::string& what) {
  char c = 0;
  auto r = parked_call([&] { return call([&] { return ::read(rd, &c, 1); }); }, [&] { write_str(wr, "p"); });
  CHECK_MESSAGE(r.value.r == 1, what << ": read gave " << r.value.r << " errno " << err_str(r.value.e));
  CHECK_MESSAGE(r.parked, what << ": the read did not park");
}

// A read of one byte that must give EAGAIN at once. Were it to park instead, a byte written to
// `wr` ends it (and the check fails).
void expect_read_eagain(int rd, int wr, const std::string& what) {
  char c;
  auto r = no_park_call([&] { return call([&] { return ::read(rd, &c, 1); }); }, [&] { write_str(wr, "w"); });
  CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN),
                what << ": read gave " << r.value.r << " errno " << err_str(r.value.e) << " instead of EAGAIN");
  CHECK_MESSAGE(!r.parked, what << ": the read parked");
}

}  // namespace

TEST_SUITE("hooked") {
// ================================================================================ O_NONBLOCK

TEST_CASE("semantics: O_NONBLOCK set with fcntl or FIONBIO after a blocking use gives EAGAIN; clearing it parks again") {
  on_fiber(1, [] {
    Pair p = make_socketpair();
    expect_read_parks(p.a, p.b, "socket, blocking at first");  // the hook has now seen p.a blocking
    REQUIRE(::fcntl(p.a, F_SETFL, ::fcntl(p.a, F_GETFL) | O_NONBLOCK) == 0);
    expect_read_eagain(p.a, p.b, "socket after fcntl(O_NONBLOCK)");
    REQUIRE(::fcntl(p.a, F_SETFL, ::fcntl(p.a, F_GETFL) & ~O_NONBLOCK) == 0);
    expect_read_parks(p.a, p.b, "socket after fcntl cleared O_NONBLOCK");
    int on = 1;
    REQUIRE(::ioctl(p.a, FIONBIO, &on) == 0);
    CHECK(is_nonblocking(p.a));
    expect_read_eagain(p.a, p.b, "socket after ioctl(FIONBIO, 1)");
    int off = 0;
    REQUIRE(::ioctl(p.a, FIONBIO, &off) == 0);
    expect_read_parks(p.a, p.b, "socket after ioctl(FIONBIO, 0)");

    Pair q = make_pipe();
    expect_read_parks(q.a, q.b, "pipe, blocking at first");
    REQUIRE(::fcntl(q.a, F_SETFL, O_NONBLOCK) == 0);
    expect_read_eagain(q.a, q.b, "pipe after fcntl(O_NONBLOCK)");
    REQUIRE(::ioctl(q.a, FIONBIO, &off) == 0);
    expect_read_parks(q.a, q.b, "pipe after ioctl(FIONBIO, 0)");
    REQUIRE(::ioctl(q.a, FIONBIO, &on) == 0);
    expect_read_eagain(q.a, q.b, "pipe after ioctl(FIONBIO, 1)");

    // The caller's flags are exactly what it set: the runtime changed nothing.
    CHECK(::fcntl(p.a, F_GETFL) == O_RDWR);
    CHECK(::fcntl(q.a, F_GETFL) == (O_RDONLY | O_NONBLOCK));
  });
}

TEST_CASE("semantics: SOCK_NONBLOCK, accept4(SOCK_NONBLOCK) and pipe2(O_NONBLOCK) give EAGAIN on every call") {
  on_fiber(1, [] {
    Pair sp = make_socketpair(SOCK_NONBLOCK);
    Pair pp = make_pipe(O_NONBLOCK);
    Listener l = tcp_listener();
    Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    ::connect(c, sa(l.addr), sizeof l.addr);  // EINPROGRESS
    Fd a(::accept4(l.fd, nullptr, nullptr, SOCK_NONBLOCK));
    REQUIRE(a >= 0);
    for (int round = 0; round < 3; ++round) {  // the answer stays the same once known
      expect_read_eagain(sp.a, sp.b, "socketpair(SOCK_NONBLOCK)");
      expect_read_eagain(pp.a, pp.b, "pipe2(O_NONBLOCK)");
      expect_read_eagain(a, c, "accept4(SOCK_NONBLOCK)");
      char buf[4];
      const Res r = call([&] { return ::recv(a, buf, sizeof buf, 0); });
      CHECK((r.r == -1 && r.e == EAGAIN));
      iovec iov{buf, sizeof buf};
      const Res rv = call([&] { return ::readv(pp.a, &iov, 1); });
      CHECK((rv.r == -1 && rv.e == EAGAIN));
    }
    // MSG_DONTWAIT on a blocking socket: EAGAIN too.
    Pair b = make_socketpair();
    char x;
    auto d = no_park_call([&] { return call([&] { return ::recv(b.a, &x, 1, MSG_DONTWAIT); }); },
                          [&] { write_str(b.b, "w"); });
    CHECK((d.value.r == -1 && d.value.e == EAGAIN));
    CHECK(!d.parked);
  });
}

// O_NONBLOCK belongs to the open file description, which dup shares: the kernel applies it to
// every descriptor of that description, however it was set.
TEST_CASE("semantics: O_NONBLOCK and SO_RCVTIMEO set through a dup apply to the original descriptor") {
  on_fiber(1, [] {
    Pair p = make_socketpair();
    expect_read_parks(p.a, p.b, "original, blocking");
    Fd d(::dup(p.a));
    REQUIRE(d >= 0);
    REQUIRE(::fcntl(d, F_SETFL, O_NONBLOCK) == 0);
    REQUIRE(is_nonblocking(p.a));  // the kernel says so
    expect_read_eagain(d, p.b, "the dup after fcntl(O_NONBLOCK) on it");
    expect_read_eagain(p.a, p.b, "the original after fcntl(O_NONBLOCK) on its dup");
  });
  on_fiber(1, [] {
    Pair p = make_socketpair();
    expect_read_parks(p.a, p.b, "original, no timeout");
    Fd d(::dup(p.a));
    set_timeout(d, SO_RCVTIMEO, 40ms);
    REQUIRE(near(get_timeout(p.a, SO_RCVTIMEO), 40ms));  // the kernel says so
    char c;
    auto r = parked_call([&] { return call([&] { return ::read(p.a, &c, 1); }); },
                         [&] {
                           // Were the read to wait on without the timeout, this byte ends it.
                           std::this_thread::sleep_for(scaled(3'000ms));
                           write_str(p.b, "w");
                         });
    CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN),
                  "SO_RCVTIMEO set through a dup did not time out a read on the original: " << r.value.r << " errno "
                                                                                             << err_str(r.value.e));
  });
}

// ================================================================================ timeouts

TEST_CASE("semantics: no timeout by default: a read waits as long as it takes") {
  on_fiber(1, [] {
    Pair p = make_socketpair();
    CHECK(get_timeout(p.a, SO_RCVTIMEO) == 0us);
    char c = 0;
    auto r = parked_call([&] { return call([&] { return ::read(p.a, &c, 1); }); },
                         [&] {
                           std::this_thread::sleep_for(500ms);
                           write_str(p.b, "L");
                         });
    CHECK(r.value.r == 1);
    CHECK(c == 'L');
    CHECK(r.parked);
  });
}

// The hook caches a socket's SO_RCVTIMEO with what it knows of the number. A pipe that took
// the number once read with that timeout: EAGAIN after 100 ms, where the kernel's read of a
// blocking pipe waits for as long as it takes. (A review helper's find.)
TEST_CASE("semantics: a number that held a socket with SO_RCVTIMEO keeps no timeout once a pipe has it") {
  on_fiber(1, [] {
    Pair s = make_socketpair();
    set_timeout(s.a, SO_RCVTIMEO, 100ms);
    write_str(s.b, "s");
    char c = 0;
    REQUIRE(::read(s.a, &c, 1) == 1);  // the hook has learned the number, timeout and all
    const int num = s.a.get();
    Pair p = make_pipe();
    REQUIRE(::dup2(p.a, num) == num);  // the socket is closed; the number reads the pipe now
    auto r = parked_call([&] { return call([&] { return ::read(num, &c, 1); }); },
                         [&] {
                           std::this_thread::sleep_for(500ms);
                           write_str(p.b, "P");
                         });
    CHECK_MESSAGE(r.value.r == 1, "errno " << err_str(r.value.e));
    CHECK(c == 'P');
    CHECK(r.parked);
  });
}

TEST_CASE("semantics: SO_RCVTIMEO expiry gives EAGAIN from every read and from accept") {
  const auto& reads = kOneByteReads;
  on_fiber(1, [&] {
    for (const auto& [name, fn] : reads) {
      Pair p = make_socketpair();
      expect_read_parks(p.a, p.b, "before SO_RCVTIMEO");  // known without a timeout first
      set_timeout(p.a, SO_RCVTIMEO, 40ms);
      CHECK(near(get_timeout(p.a, SO_RCVTIMEO), 40ms));
      const auto t0 = Clock::now();
      auto r = parked_call([&] { return call([&] { return fn(p.a); }); }, [] {});
      CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN),
                    std::string(name) << " with SO_RCVTIMEO: " << r.value.r << " errno " << err_str(r.value.e));
      CHECK_MESSAGE(r.parked, name);
      CHECK_MESSAGE(Clock::now() - t0 >= 40ms, std::string(name) << " timed out early");
      // Data within the timeout still arrives.
      auto ok = parked_call([&] { return call([&] { return fn(p.a); }); }, [&] { write_str(p.b, "d"); });
      CHECK_MESSAGE(ok.value.r == 1, std::string(name) << " within SO_RCVTIMEO");
    }
    // accept on a listener with SO_RCVTIMEO.
    Listener l = tcp_listener();
    set_timeout(l.fd, SO_RCVTIMEO, 40ms);
    auto a = parked_call([&] { return call([&] { return ::accept(l.fd, nullptr, nullptr); }); }, [] {});
    CHECK_MESSAGE((a.value.r == -1 && a.value.e == EAGAIN), "accept with SO_RCVTIMEO: errno " << err_str(a.value.e));
    CHECK(a.parked);
    // Removing the timeout: waits for data again.
    Pair p = make_socketpair();
    set_timeout(p.a, SO_RCVTIMEO, 20ms);
    char c;
    CHECK(::read(p.a, &c, 1) == -1);
    set_timeout(p.a, SO_RCVTIMEO, 0us);
    auto r = parked_call([&] { return call([&] { return ::read(p.a, &c, 1); }); },
                         [&] {
                           std::this_thread::sleep_for(100ms);
                           write_str(p.b, "n");
                         });
    CHECK(r.value.r == 1);
  });
}

TEST_CASE("semantics: SO_SNDTIMEO expiry gives EAGAIN from writes, a partial count after progress, EINPROGRESS from connect") {
  const auto& writes = kOneByteWrites;
  on_fiber(1, [&] {
    for (const auto& [name, fn] : writes) {
      Pair p = make_socketpair();
      CHECK(fn(p.b) == 1);  // known without a timeout first
      set_timeout(p.b, SO_SNDTIMEO, 40ms);
      CHECK(near(get_timeout(p.b, SO_SNDTIMEO), 40ms));
      fill(p.b);
      const auto t0 = Clock::now();
      auto r = parked_call([&] { return call([&] { return fn(p.b); }); }, [] {});
      CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN),
                    std::string(name) << " on a full socket with SO_SNDTIMEO: " << r.value.r << " errno " << err_str(r.value.e));
      CHECK_MESSAGE(r.parked, name);
      CHECK_MESSAGE(Clock::now() - t0 >= 40ms, std::string(name) << " timed out early");
    }
    // Some bytes went out before the timeout: the count, not an error.
    Pair p = make_socketpair();
    set_timeout(p.b, SO_SNDTIMEO, 40ms);
    std::vector<char> big(4 << 20);
    auto r = parked_call([&] { return call([&] { return ::write(p.b, big.data(), big.size()); }); }, [] {});
    CHECK_MESSAGE(r.value.r > 0, "a big write with SO_SNDTIMEO: " << r.value.r << " errno " << err_str(r.value.e));
    CHECK(r.value.r < static_cast<long>(big.size()));
    CHECK(r.parked);
  });
  // connect that cannot complete: EINPROGRESS when SO_SNDTIMEO expires. The connection goes on,
  // and a second connect waits for it, as the kernel's does: EALREADY when SO_SNDTIMEO expires
  // again; 0 once the listener has room (the client's next SYN, about a second later). On the
  // ring, the second once said EALREADY at once.
  on_fiber(1, [] {
    FullListener f = full_listener();
    Fd c(::socket(AF_INET, SOCK_STREAM, 0));
    set_timeout(c, SO_SNDTIMEO, 50ms);
    const auto connect_c = [&] { return call([&] { return ::connect(c, sa(f.l.addr), sizeof f.l.addr); }); };
    auto r = parked_call(connect_c, [] {});
    CHECK_MESSAGE((r.value.r == -1 && r.value.e == EINPROGRESS),
                  "connect with SO_SNDTIMEO to a full listener: " << r.value.r << " errno " << err_str(r.value.e));
    CHECK(r.parked);
    const auto t0 = Clock::now();
    auto again = parked_call(connect_c, [] {});
    CHECK_MESSAGE((again.value.r == -1 && again.value.e == EALREADY),
                  "a second connect with SO_SNDTIMEO: " << again.value.r << " errno " << err_str(again.value.e));
    CHECK(again.parked);
    CHECK(Clock::now() - t0 >= 50ms);
    set_timeout(c, SO_SNDTIMEO, 0ms);  // none
    Fd taken(::accept(f.l.fd, nullptr, nullptr));  // the queued connection: room for c's
    REQUIRE(taken >= 0);
    auto done = parked_call(connect_c, [] {}, 30'000ms);
    CHECK_MESSAGE(done.value.r == 0, "a third connect, without a timeout: " << done.value.r << " errno " << err_str(done.value.e));
    CHECK(done.parked);
    CHECK(call([&] { return ::connect(c, sa(f.l.addr), sizeof f.l.addr); }).e == EISCONN);
  });
  // A Unix stream listener with a full queue: the kernel's blocking connect sleeps until there is
  // room and gives EAGAIN when SO_SNDTIMEO expires. So does the hooked one, on either engine.
  on_fiber(1, [] {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = "libfiber-hooks-full-" + std::to_string(::getpid());
    std::memcpy(addr.sun_path + 1, name.data(), name.size());  // abstract: nothing to unlink
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    const auto* a = reinterpret_cast<const sockaddr*>(&addr);
    Fd ln(::socket(AF_UNIX, SOCK_STREAM, 0));
    REQUIRE(::bind(ln, a, len) == 0);
    REQUIRE(::listen(ln, 0) == 0);
    std::vector<Fd> queued;
    for (;;) {
      Fd q(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0));
      if (::connect(q, a, len) != 0) break;
      queued.push_back(std::move(q));
      REQUIRE(queued.size() < 100);
    }
    Fd c(::socket(AF_UNIX, SOCK_STREAM, 0));
    set_timeout(c, SO_SNDTIMEO, 50ms);
    const auto t0 = Clock::now();
    auto r = parked_call([&] { return call([&] { return ::connect(c, a, len); }); }, [] {});
    CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN),
                  "connect with SO_SNDTIMEO to a full Unix listener: " << r.value.r << " errno " << err_str(r.value.e));
    CHECK(r.parked);
    CHECK(Clock::now() - t0 >= 50ms);
  });
}

// The kernel takes a negative SO_RCVTIMEO / SO_SNDTIMEO as "never wait" (EAGAIN at once, as on
// a non-blocking descriptor) but reads it back as {0, 0}, the same as "no timeout"; code that
// sets the time left before a deadline sets one once the deadline has passed. Without the hook's
// memory of the setsockopt, each call below parked until its release.
TEST_CASE("semantics: a negative SO_RCVTIMEO or SO_SNDTIMEO never waits, as the kernel's: EAGAIN at once") {
  const timeval negative{-1, 0};
  const auto set_negative = [&](int fd, int opt) {
    REQUIRE(::setsockopt(fd, SOL_SOCKET, opt, &negative, sizeof negative) == 0);
  };
  const auto expect_eagain = [](const Parked<Res>& r, const std::string& what) {
    CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN), what << ": " << r.value.r << " errno " << err_str(r.value.e));
    CHECK_MESSAGE(!r.parked, what << " parked");
  };
  // The one-byte reads, and a MSG_WAITALL receive (its own path in the hook).
  std::vector<std::pair<const char*, SockCall>> reads(std::begin(kOneByteReads), std::end(kOneByteReads));
  reads.emplace_back("recv MSG_WAITALL", [](int fd) -> long { char c; return ::recv(fd, &c, 1, MSG_WAITALL); });
  const auto& writes = kOneByteWrites;
  {  // The kernel, on a plain thread (real calls there): a TCP connection accepted from a
     // listener with the setting has it too.
    Pair p = make_socketpair();
    set_negative(p.a, SO_RCVTIMEO);
    CHECK(get_timeout(p.a, SO_RCVTIMEO) == 0us);
    char c;
    const Res r = call([&] { return ::read(p.a, &c, 1); });
    CHECK((r.r == -1 && r.e == EAGAIN));
    Listener l = tcp_listener();
    set_negative(l.fd, SO_RCVTIMEO);
    Fd client(::socket(AF_INET, SOCK_STREAM, 0));
    REQUIRE(::connect(client, sa(l.addr), sizeof l.addr) == 0);
    Fd conn(::accept(l.fd, nullptr, nullptr));
    REQUIRE(conn >= 0);
    const Res inherited = call([&] { return ::read(conn, &c, 1); });
    CHECK((inherited.r == -1 && inherited.e == EAGAIN));
  }
  on_fiber(1, [&] {
    char c = 0;
    // Set before the hook first sees the socket, and after it learned that it had no timeout.
    for (const bool learned_first : {false, true}) {
      CAPTURE(learned_first);
      for (const auto& [name, fn] : reads) {
        Pair p = make_socketpair();
        if (learned_first) expect_read_parks(p.a, p.b, "before the negative SO_RCVTIMEO");
        set_negative(p.a, SO_RCVTIMEO);
        expect_eagain(no_park_call([&] { return call([&] { return fn(p.a); }); }, [&] { write_str(p.b, "r"); }), name);
        write_str(p.b, "d");
        CHECK_MESSAGE(fn(p.a) == 1, name << ": what is there is read");
      }
    }
    {  // Only the direction set: a negative SO_SNDTIMEO leaves reads waiting; {0, 0} again is none.
      Pair p = make_socketpair();
      set_negative(p.a, SO_SNDTIMEO);
      expect_read_parks(p.a, p.b, "with a negative SO_SNDTIMEO");
      set_negative(p.a, SO_RCVTIMEO);
      set_timeout(p.a, SO_RCVTIMEO, 0us);
      expect_read_parks(p.a, p.b, "after SO_RCVTIMEO {0, 0}");
    }
    for (const auto& [name, fn] : writes) {
      Pair w = make_socketpair();
      set_negative(w.a, SO_SNDTIMEO);
      const size_t filled = fill(w.a);
      expect_eagain(no_park_call([&] { return call([&] { return fn(w.a); }); }, [&] { drain(w.b, filled + 1); }), name);
    }
    {  // accept, and the TCP connection it gives, which inherits the listener's setting.
      Listener l = tcp_listener();
      set_negative(l.fd, SO_RCVTIMEO);
      Fd client;
      expect_eagain(no_park_call([&] { return call([&] { return ::accept(l.fd, nullptr, nullptr); }); },
                                 [&] {
                                   client = Fd(::socket(AF_INET, SOCK_STREAM, 0));
                                   (void)::connect(client, sa(l.addr), sizeof l.addr);
                                 }),
                    "accept");
      Fd early(::socket(AF_INET, SOCK_STREAM, 0));
      REQUIRE(::connect(early, sa(l.addr), sizeof l.addr) == 0);
      Fd conn(::accept(l.fd, nullptr, nullptr));
      REQUIRE(conn >= 0);
      expect_eagain(no_park_call([&] { return call([&] { return ::read(conn, &c, 1); }); }, [&] { write_str(early, "a"); }),
                    "read on an accepted TCP connection");
    }
    {  // A dup shares the socket, so the setting; a number dup2 makes anew has its new socket's.
      Pair p = make_socketpair();
      set_negative(p.a, SO_RCVTIMEO);
      Fd d(::dup(p.a));
      REQUIRE(d >= 0);
      expect_eagain(no_park_call([&] { return call([&] { return ::read(d, &c, 1); }); }, [&] { write_str(p.b, "u"); }),
                    "read through a dup");
      Pair other = make_socketpair();
      REQUIRE(::dup2(other.a, p.a) == p.a);
      expect_read_parks(p.a, other.b, "a number dup2 gave another socket");
    }
  });
}

TEST_CASE("semantics: connect refused gives ECONNREFUSED, also from many fibers on several processors") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const RefusedAddr held = refused_addr();
    const sockaddr_in nobody = held.addr;
    std::vector<fiber::JoinHandle<Res>> hs;
    for (int i = 0; i < 32; ++i) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&nobody] {
        Fd c(::socket(AF_INET, SOCK_STREAM, 0));
        return call([&] { return ::connect(c, sa(nobody), sizeof nobody); });
      }));
    }
    for (auto& h : hs) {
      const Res r = h.join();
      CHECK_MESSAGE((r.r == -1 && r.e == ECONNREFUSED), "connect: " << r.r << " errno " << err_str(r.e));
    }
  }, {1, 4});
}

// ================================================================================ close wakes

TEST_CASE("semantics: close from another fiber wakes a fiber blocked on the descriptor with EBADF") {
  using BlockedCall = long (*)(int);
  const std::pair<const char*, BlockedCall> calls[] = {
      {"read", [](int fd) -> long { char c; return ::read(fd, &c, 1); }},
      {"recv", [](int fd) -> long { char c; return ::recv(fd, &c, 1, 0); }},
      {"readv", [](int fd) -> long { char c; iovec iov{&c, 1}; return ::readv(fd, &iov, 1); }},
      {"accept", [](int fd) -> long { return ::accept(fd, nullptr, nullptr); }},
  };
  for_each_proc_count([&](fiber::Scheduler& s, int n) {
    for (const auto& [name, fn] : calls) {
      for (bool pipe : {false, true}) {
        const bool listener = std::string(name) == "accept";
        if (pipe && (listener || std::string(name) == "recv")) continue;
        Pair p = pipe ? make_pipe() : make_socketpair();
        Listener l;
        if (listener) l = tcp_listener();
        const int fd = listener ? l.fd.release() : p.a.release();
        std::atomic<bool> entering{false};
        auto blocked = fiber::spawn({.scheduler = &s}, [&entering, fn, fd] {
          entering = true;
          return call([&] { return fn(fd); });
        });
        auto closer = fiber::spawn({.scheduler = &s}, [&entering, fd, n] {
          while (!entering.load()) fiber::this_fiber::yield();
          // On one processor this fiber runs only once the other has parked; elsewhere give it a
          // moment to (were it not parked yet, its call fails with EBADF all the same).
          if (n > 1) fiber::this_fiber::sleep_for(20ms);
          return call([&] { return ::close(fd); });
        });
        const Res c = closer.join();
        const Res r = blocked.join();
        CHECK_MESSAGE(c.r == 0, std::string(name) << ": close gave errno " << err_str(c.e));
        CHECK_MESSAGE((r.r == -1 && r.e == EBADF), std::string(name) << (pipe ? " on a pipe" : " on a socket") << " woken by close: "
                                                       << r.r << " errno " << err_str(r.e));
        CHECK(::fcntl(fd, F_GETFD) == -1);  // and the descriptor is closed
      }
    }
  }, {1, 2, 4});
}

TEST_CASE("semantics: close from another fiber wakes a fiber in poll on the descriptor") {
  on_fiber(1, [] {
    Pair p = make_socketpair();
    const int fd = p.a.release();
    std::atomic<bool> entering{false};
    auto blocked = fiber::spawn([&] {
      pollfd pf{fd, POLLIN, 0};
      entering = true;
      const Res r = call([&] { return ::poll(&pf, 1, -1); });
      return std::make_pair(r, pf.revents);
    });
    while (!entering.load()) fiber::this_fiber::yield();
    CHECK(::close(fd) == 0);
    auto [r, revents] = blocked.join();
    // The kernel's poll would not notice a close; the hook ends it with POLLNVAL (or EBADF).
    CHECK_MESSAGE(((r.r == 1 && (revents & POLLNVAL)) || (r.r == -1 && r.e == EBADF)),
                  "poll woken by close: " << r.r << " revents " << revents << " errno " << err_str(r.e));
  });
}

TEST_CASE("semantics: close from a plain thread wakes a fiber blocked in read") {
  fiber::Scheduler s({.processors = 1, .name = "hk"});
  Watchdog dog(30'000ms, "close from a plain thread");
  Pair p = make_socketpair();
  const int fd = p.a.release();
  std::atomic<bool> entering{false};
  auto blocked = fiber::spawn({.scheduler = &s}, [&] {
    entering = true;
    char c;
    return call([&] { return ::read(fd, &c, 1); });
  });
  REQUIRE(thread_wait([&] { return entering.load(); }));
  std::this_thread::sleep_for(20ms);  // let it park (were it not parked yet: EBADF all the same)
  CHECK(::close(fd) == 0);
  const Res r = blocked.join();
  CHECK_MESSAGE((r.r == -1 && r.e == EBADF), "read woken by close: " << r.r << " errno " << err_str(r.e));
}

// ================================================================================ dup

TEST_CASE("semantics: dup, dup2, dup3 and F_DUPFD give descriptors that behave as the kernel says") {
  on_fiber(1, [] {
    // dup of a blocking socket parks; of a non-blocking one gives EAGAIN.
    Pair p = make_socketpair();
    Fd d(::dup(p.a));
    REQUIRE(d >= 0);
    expect_read_parks(d, p.b, "dup of a blocking socket");
    Pair nb = make_socketpair(SOCK_NONBLOCK);
    Fd dn(::dup(nb.a));
    expect_read_eagain(dn, nb.b, "dup of a non-blocking socket");

    // dup2 over a number the hook knew as non-blocking, with a blocking socket: parks now.
    Pair target = make_socketpair(SOCK_NONBLOCK);
    expect_read_eagain(target.a, target.b, "the target, non-blocking");
    Pair src = make_socketpair();
    REQUIRE(::dup2(src.a, target.a) == target.a);
    CHECK_FALSE(is_nonblocking(target.a));
    expect_read_parks(target.a, src.b, "dup2 of a blocking socket over a known non-blocking number");

    // ... and the other way round, with dup3(O_CLOEXEC): EAGAIN now.
    Pair t2 = make_socketpair();
    expect_read_parks(t2.a, t2.b, "the target, blocking");
    Pair src2 = make_socketpair(SOCK_NONBLOCK);
    REQUIRE(::dup3(src2.a, t2.a, O_CLOEXEC) == t2.a);
    CHECK((::fcntl(t2.a, F_GETFD) & FD_CLOEXEC) != 0);
    expect_read_eagain(t2.a, src2.b, "dup3 of a non-blocking socket over a known blocking number");

    // A pipe dup2'ed over a socket number: read parks as on a pipe.
    Pair t3 = make_socketpair();
    expect_read_parks(t3.a, t3.b, "the target, a socket");
    Pair pp = make_pipe();
    REQUIRE(::dup2(pp.a, t3.a) == t3.a);
    expect_read_parks(t3.a, pp.b, "dup2 of a pipe over a known socket number");
    char c;
    const Res notsock = call([&] { return ::recv(t3.a, &c, 1, 0); });
    CHECK((notsock.r == -1 && notsock.e == ENOTSOCK));

    // F_DUPFD / F_DUPFD_CLOEXEC.
    Fd fd1(::fcntl(p.a, F_DUPFD, 100));
    CHECK(fd1 >= 100);
    expect_read_parks(fd1, p.b, "F_DUPFD of a blocking socket");
    Fd fd2(::fcntl(nb.a, F_DUPFD_CLOEXEC, 0));
    REQUIRE(fd2 >= 0);
    CHECK((::fcntl(fd2, F_GETFD) & FD_CLOEXEC) != 0);
    expect_read_eagain(fd2, nb.b, "F_DUPFD_CLOEXEC of a non-blocking socket");

    // The kernel's errors.
    const Res e1 = call([] { return ::dup(-1); });
    CHECK((e1.r == -1 && e1.e == EBADF));
    CHECK(::dup2(p.a, p.a) == p.a);
    const Res e2 = call([&] { return ::dup3(p.a, p.a, 0); });
    CHECK((e2.r == -1 && e2.e == EINVAL));
    const Res e3 = call([&] { return ::dup3(p.a, 200, 0x7fff); });
    CHECK((e3.r == -1 && e3.e == EINVAL));
  });
}

TEST_CASE("semantics: setsockopt and getsockopt pass through") {
  on_fiber(1, [] {
    Pair p = make_socketpair();
    int type = 0;
    socklen_t len = sizeof type;
    CHECK(::getsockopt(p.a, SOL_SOCKET, SO_TYPE, &type, &len) == 0);
    CHECK(type == SOCK_STREAM);
    int sz = 1 << 16;
    CHECK(::setsockopt(p.a, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz) == 0);
    set_timeout(p.a, SO_SNDTIMEO, 1500ms);
    CHECK(near(get_timeout(p.a, SO_SNDTIMEO), 1500ms));
    CHECK(get_timeout(p.a, SO_RCVTIMEO) == 0us);
    const Res bad = call([&] { return ::setsockopt(p.a, SOL_SOCKET, SO_RCVTIMEO, &sz, 1); });
    CHECK((bad.r == -1 && bad.e == EINVAL));
    Pair pp = make_pipe();
    const Res ns = call([&] { return ::getsockopt(pp.a, SOL_SOCKET, SO_TYPE, &type, &len); });
    CHECK((ns.r == -1 && ns.e == ENOTSOCK));
  });
}

// ================================================================================ errno

// Many fibers on several processors, each making calls that park and then fail with a known
// errno, and checking it - after the call may have resumed on another thread. Runs until it has
// seen at least a few calls that changed threads (bounded).
TEST_CASE("semantics: errno is right after a park and after a migration") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    const RefusedAddr held = refused_addr();
    const sockaddr_in nobody = held.addr;
    std::atomic<int> migrated{0}, checked{0}, wrong{0};
    std::atomic<bool> stop{false};
    std::vector<fiber::JoinHandle<void>> hs;
    for (int f = 0; f < 24; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&, f] {
        Pair p = make_socketpair();
        set_timeout(p.a, SO_RCVTIMEO, std::chrono::microseconds(500 + 100 * (f % 5)));
        for (int i = 0; !stop.load() && i < 4000; ++i) {
          const pid_t before = os_tid();
          int want;
          Res r;
          switch ((i + f) % 4) {
            case 0: {
              char c;
              want = EAGAIN;
              set_err(-7);
              r = call([&] { return ::read(p.a, &c, 1); });
              break;
            }
            case 1: {
              Fd c(::socket(AF_INET, SOCK_STREAM, 0));
              want = ECONNREFUSED;
              r = call([&] { return ::connect(c, sa(nobody), sizeof nobody); });
              break;
            }
            case 2: {
              // A successful park (usleep), then a failure without a park: EBADF.
              ::usleep(50);
              char c;
              want = EBADF;
              r = call([&] { return ::read(-1, &c, 1); });
              break;
            }
            default: {
              char c;
              iovec iov{&c, 1};
              want = EAGAIN;
              r = call([&] { return ::readv(p.a, &iov, 1); });
              break;
            }
          }
          const pid_t after = os_tid();
          checked.fetch_add(1);
          if (!(r.r == -1 && r.e == want)) {
            if (wrong.fetch_add(1) < 5) {
              FAIL_CHECK("fiber " << f << " call " << i << ": " << r.r << " errno " << r.e << " (" << err_str(r.e)
                                  << "), expected " << err_str(want) << std::string(before != after ? " after migrating" : ""));
            }
          }
          if (before != after) migrated.fetch_add(1);
          if (n > 1 && migrated.load() >= 50 && i >= 40) break;
          if (n == 1 && i >= 40) break;
        }
      }));
    }
    // Bounded: stop asking once enough migrations were seen or the time is up.
    if (n > 1) {
      wait_for([&] { return migrated.load() >= 50; }, 20'000ms, 1ms);
      stop = true;
    }
    for (auto& h : hs) h.join();
    CHECK(wrong.load() == 0);
    MESSAGE("processors=" << n << ": " << checked.load() << " calls checked, " << migrated.load()
                          << " resumed on another thread");
    if (n > 1) CHECK_MESSAGE(migrated.load() > 0, "no call resumed on another thread: migration was not exercised");
  }, {1, 2, 4}, true, 90'000ms);
}

// close() of one descriptor while other fibers create descriptors - which the kernel may give
// the number just freed - and use them at once. Every call on a new descriptor must work, and
// every close must close (0): nothing may leak.
TEST_CASE("semantics: a descriptor number reused right after close works at once") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const RefusedAddr held = refused_addr();
    const sockaddr_in nobody = held.addr;
    const int open_before = open_fds();
    std::atomic<int> stray_ebadf{0}, bad_close{0}, other{0};
    std::vector<fiber::JoinHandle<void>> hs;
    for (int f = 0; f < 16; ++f) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&] {
        for (int i = 0; i < 200; ++i) {
          const int c = ::socket(AF_INET, SOCK_STREAM, 0);
          if (c < 0) {
            other.fetch_add(1);
            continue;
          }
          const Res r = call([&] { return ::connect(c, sa(nobody), sizeof nobody); });
          if (r.r == -1 && r.e == EBADF) stray_ebadf.fetch_add(1);
          else if (!(r.r == -1 && r.e == ECONNREFUSED)) other.fetch_add(1);
          if (::close(c) != 0) bad_close.fetch_add(1);
        }
      }));
    }
    for (auto& h : hs) h.join();
    CHECK_MESSAGE(stray_ebadf.load() == 0, stray_ebadf.load() << " connects on a freshly created socket failed with EBADF");
    CHECK_MESSAGE(bad_close.load() == 0, bad_close.load() << " closes of a freshly created socket failed");
    CHECK(other.load() == 0);
    CHECK_MESSAGE(open_fds() == open_before, "descriptors leaked: " << open_fds() - open_before);
  }, {2, 4});
}

// ================================================================================ cancellation

TEST_CASE("semantics: a cancelled fiber's sleep ends with EINTR and the time left") {
  on_fiber(2, [] {
    std::atomic<bool> entering{false};
    auto h = fiber::spawn([&] {
      timespec req{30, 0}, rem{0, 0};
      entering = true;
      const Res r = call([&] { return ::nanosleep(&req, &rem); });
      return std::make_pair(r, rem);
    });
    REQUIRE(wait_for([&] { return entering.load(); }));
    fiber::this_fiber::sleep_for(20ms);
    h.cancel();
    auto [r, rem] = h.join();
    CHECK((r.r == -1 && r.e == EINTR));
    CHECK(rem.tv_sec > 0);  // most of the 30 s were left
    CHECK(rem.tv_sec <= 30);

    std::atomic<bool> entering2{false};
    auto h2 = fiber::spawn([&] {
      entering2 = true;
      return ::sleep(30);
    });
    REQUIRE(wait_for([&] { return entering2.load(); }));
    fiber::this_fiber::sleep_for(20ms);
    h2.cancel();
    const unsigned left = h2.join();
    CHECK(left > 0);
    CHECK(left <= 30);
  });
}

// Only the sleep the cancel cut short ends with EINTR. A loop retrying EINTR with the time left
// (libstdc++'s this_thread::sleep_for, most msleep helpers) once spun for the rest of its sleep,
// and with nothing left, for ever: nanosleep({0, 0}) kept failing with EINTR, and stop() waited
// for that fiber. The next sleep of a cancelled fiber is ECANCELED.
TEST_CASE("semantics: a cancelled fiber's EINTR-retry sleep loops end: its next sleep is ECANCELED") {
  on_fiber(2, [] {
    std::atomic<int> entering{0};
    auto loop = fiber::spawn([&] {
      timespec ts{30, 0};
      entering.fetch_add(1);
      int rc;
      while ((rc = ::nanosleep(&ts, &ts)) == -1 && errno == EINTR) {
      }
      return Res{rc, errno};
    });
    auto std_sleep = fiber::spawn([&] {
      entering.fetch_add(2);
      std::this_thread::sleep_for(30s);  // libstdc++: the same loop, inside the library
      return ::usleep(1000) == -1 ? errno : 0;
    });
    REQUIRE(wait_for([&] { return entering.load() == 3; }));
    fiber::this_fiber::sleep_for(20ms);
    loop.cancel();
    std_sleep.cancel();
    const Res r = loop.join();
    CHECK((r.r == -1 && r.e == ECANCELED));
    CHECK(std_sleep.join() == ECANCELED);  // and usleep after it too

    auto already = fiber::spawn([] {
      while (!fiber::this_fiber::cancelled()) {
        // spin, not sleep: a sleep here would itself throw fiber::Cancelled
      }
      const timespec req{1, 0};
      const Res n = call([&] { return ::nanosleep(&req, nullptr); });
      return std::make_pair(n, ::sleep(30));
    });
    already.cancel();
    auto [n, left] = already.join();
    CHECK((n.r == -1 && n.e == ECANCELED));
    CHECK(left == 0);  // a `while ((left = sleep(left)))` loop ends
  });
  CHECK_FALSE(fiber::this_fiber::cancelled());  // a plain thread
}

// read(2) with a length of 0 returns 0 at once and touches no queue. The hook's first try, a
// zero-length recvfrom, consumed the next datagram (lost), and on a stream socket waited.
TEST_CASE("semantics: a zero-length read returns 0 at once and consumes nothing") {
  on_fiber(1, [] {
    Pair dg = make_socketpair(0, SOCK_DGRAM);
    REQUIRE(::send(dg.b, "first", 5, 0) == 5);
    REQUIRE(::send(dg.b, "second", 6, 0) == 6);
    char buf[16] = {};
    CHECK(call([&] { return ::read(dg.a, buf, 0); }).r == 0);
    CHECK(call([&] { return ::readv(dg.a, nullptr, 0); }).r == 0);
    CHECK(::read(dg.a, buf, sizeof buf) == 5);
    CHECK(std::string(buf, 5) == "first");

    Pair st = make_socketpair();
    auto zero = no_park_call([&] { return ::read(st.a, buf, 0); }, [&] { REQUIRE(::write(st.b, "x", 1) == 1); });
    CHECK(zero.value == 0);
    CHECK_FALSE(zero.parked);
    auto zero_v = no_park_call([&] { return ::readv(st.a, nullptr, 0); }, [&] { REQUIRE(::write(st.b, "y", 1) == 1); });
    CHECK(zero_v.value == 0);
    CHECK_FALSE(zero_v.parked);
  });
}

// Linux carries a tv_usec of a second or more into tv_sec, so it is a valid timeout
// (tv.tv_usec = ms * 1000 is common). The hook took it for an invalid one and made the real
// call, which blocked the processor for the whole timeout.
TEST_CASE("semantics: select with tv_usec of a second or more parks for the carried timeout") {
  on_fiber(1, [] {
    Pair p = make_pipe();
    fd_set r;
    timeval tv{0, 1'100'000};
    auto waited = parked_call(
        [&] {
          FD_ZERO(&r);
          FD_SET(p.a.get(), &r);
          const auto t0 = Clock::now();
          const Res res = call([&] { return ::select(p.a + 1, &r, nullptr, nullptr, &tv); });
          return std::make_pair(res, Clock::now() - t0);
        },
        [] {});
    auto [res, took] = waited.value;
    CHECK(res.r == 0);  // timed out, nothing ready
    CHECK(waited.parked);
    CHECK(took >= 1100ms);  // the whole carried timeout: select never ends early
    CHECK((tv.tv_sec == 0 && tv.tv_usec == 0));  // the time left, normalised
  }, 60'000ms, "select carry", quiet_watchdog());
}

TEST_CASE("semantics: a cancelled fiber's poll, ppoll or select over several descriptors ends with ECANCELED") {
  // Before, several descriptors waited in the kernel's poll on a helper thread, which no cancel
  // reached: the fiber (and Scheduler::stop) waited for a descriptor or the timeout.
  on_fiber(2, [] {
    Pair p = make_pipe();
    Pair q = make_socketpair();
    const int nfds = std::max(p.a.get(), q.a.get()) + 1;
    for (int kind = 0; kind < 3; ++kind) {  // in a fiber: kind goes into the messages, no CAPTURE
      std::atomic<bool> entering{false};
      auto h = fiber::spawn([&] {
        pollfd set[2] = {{p.a, POLLIN, 0}, {q.a, POLLIN, 0}};
        fd_set rd;
        FD_ZERO(&rd);
        FD_SET(p.a, &rd);
        FD_SET(q.a, &rd);
        entering = true;
        return call([&] {
          if (kind == 0) return ::poll(set, 2, -1);
          if (kind == 1) return ::ppoll(set, 2, nullptr, nullptr);
          return ::select(nfds, &rd, nullptr, nullptr, nullptr);
        });
      });
      REQUIRE_MESSAGE(wait_for([&] { return entering.load(); }), "kind " << kind);
      fiber::this_fiber::sleep_for(20ms);
      h.cancel();
      const Res r = h.join();
      CHECK_MESSAGE((r.r == -1 && r.e == ECANCELED), "kind " << kind << " gave " << r.r << " errno " << err_str(r.e));
    }
  });
}

// ================================================================================ signals

namespace {
std::atomic<int> g_handled{0};
std::atomic<long> g_handler_write{0};
std::atomic<int> g_handler_sleep{0};
int g_handler_fd = -1;

void on_usr1(int) {
  // Hooked calls inside a handler: the real ones (a handler must not switch stacks).
  errno = EIO;  // handlers clobber errno; the interrupted code must not see it
  g_handler_write = ::write(g_handler_fd, "s", 1);
  g_handler_sleep = ::usleep(1000);
  g_handled.fetch_add(1);
}
}  // namespace

namespace {
std::atomic<int> g_sigpipes{0};
void count_sigpipe(int) { g_sigpipes.fetch_add(1); }
}  // namespace

// A blocking send that parks goes through the runtime, whose socket calls pass MSG_NOSIGNAL; the
// kernel's blocking send on a stream whose peer has gone raises SIGPIPE at the writer, and so
// must the hook (once), unless the caller passed MSG_NOSIGNAL. (A review helper's find.)
TEST_CASE("semantics: a parked send to a peer that has gone raises SIGPIPE, unless MSG_NOSIGNAL") {
  struct sigaction act {}, old {};
  act.sa_handler = count_sigpipe;
  sigemptyset(&act.sa_mask);
  REQUIRE(::sigaction(SIGPIPE, &act, &old) == 0);
  for (const bool nosignal : {false, true}) {
    CAPTURE(nosignal);
    g_sigpipes.store(0);
    on_fiber(1, [nosignal] {
      Pair p = make_socketpair();
      fill(p.a);  // the next send parks
      const std::vector<char> buf(4096, 'x');
      auto r = parked_call(
          [&] { return call([&] { return ::send(p.a, buf.data(), buf.size(), nosignal ? MSG_NOSIGNAL : 0); }); },
          [&] { p.b.reset(); });
      CHECK(r.value.r == -1);
      CHECK(r.value.e == EPIPE);
      CHECK(r.parked);
    });
    // Thread-directed, as the kernel's: delivered before send returned.
    CHECK(g_sigpipes.load() == (nosignal ? 0 : 1));
  }
  ::sigaction(SIGPIPE, &old, nullptr);
}

// glibc's signal() refuses SIG_ERR as a handler (EINVAL); the hook once installed its trampoline
// for it, which would then have called address -1 on the signal.
TEST_CASE("semantics: signal(sig, SIG_ERR) is EINVAL and changes nothing") {
  const sighandler_t before = ::signal(SIGUSR2, SIG_IGN);
  REQUIRE((before != SIG_ERR));
  set_err(0);
  CHECK((::signal(SIGUSR2, SIG_ERR) == SIG_ERR));
  CHECK(err() == EINVAL);
  CHECK((::signal(SIGUSR2, before) == SIG_IGN));  // still what it was
}

TEST_CASE("semantics: a signal handler interrupting a fiber makes real calls; errno is kept") {
  on_fiber(1, [] {
    Pair p = make_pipe();
    g_handler_fd = p.b;
    struct sigaction act{}, old{};
    act.sa_handler = on_usr1;
    sigemptyset(&act.sa_mask);
    REQUIRE(::sigaction(SIGUSR1, &act, &old) == 0);
    struct sigaction now{};
    REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
    CHECK((now.sa_handler == on_usr1));  // the program's own handler is reported
    auto r = no_park_call([] {
      set_err(ENOENT);
      ::raise(SIGUSR1);
      return err();
    });
    CHECK(g_handled.load() == 1);
    CHECK(g_handler_write.load() == 1);
    CHECK(g_handler_sleep.load() == 0);
    CHECK_MESSAGE(!r.parked, "a hooked call inside the signal handler parked the fiber");
    CHECK(r.value == ENOENT);
    char c;
    CHECK(::read(p.a, &c, 1) == 1);
    // signal() too.
    REQUIRE((::signal(SIGUSR1, on_usr1) != SIG_ERR));
    auto r2 = no_park_call([] {
      ::raise(SIGUSR1);
      return 0;
    });
    CHECK(!r2.parked);
    CHECK(g_handled.load() == 2);
    CHECK((::signal(SIGUSR1, SIG_DFL) == on_usr1));
    ::sigaction(SIGUSR1, &old, nullptr);
  });
}

// glibc's other handler installers call its internal sigaction, which no preload sees: the hooks
// redo them, so their handlers too run behind the trampoline, with glibc's semantics. Old
// interfaces, still in libc and in old code: C++ gets no declaration of bsd_signal, and some
// of the others are deprecated.
extern "C" sighandler_t bsd_signal(int sig, sighandler_t handler) noexcept;
extern "C" int __sigaction(int sig, const struct sigaction* act, struct sigaction* old) noexcept;  // glibc's other name
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST_CASE("semantics: handlers from bsd_signal, ssignal, sysv_signal, __sysv_signal, sigset and __sigaction make real calls") {
  using Installer = sighandler_t (*)(int, sighandler_t);
  const struct {
    const char* name;
    Installer install;
    unsigned flags;  // what sigaction must read back
    bool once;  // reset to SIG_DFL as it runs
  } installers[] = {
      {"bsd_signal", bsd_signal, SA_RESTART, false},
      {"ssignal", ssignal, SA_RESTART, false},
      {"sysv_signal", ::sysv_signal, SA_RESETHAND | SA_NODEFER, true},
      {"__sysv_signal", ::__sysv_signal, SA_RESETHAND | SA_NODEFER, true},
      {"sigset", ::sigset, 0, false},
      {"__sigaction",
       [](int sig, sighandler_t h) {
         struct sigaction a{}, o{};
         a.sa_handler = h;
         sigemptyset(&a.sa_mask);
         a.sa_flags = SA_RESTART;
         return __sigaction(sig, &a, &o) == 0 ? o.sa_handler : SIG_ERR;
       },
       SA_RESTART, false},
  };
  struct sigaction old{};
  REQUIRE(::sigaction(SIGUSR1, nullptr, &old) == 0);
  on_fiber(1, [&] {
    Pair p = make_pipe();
    g_handler_fd = p.b;
    for (const auto& in : installers) {
      INFO("installer: " << std::string(in.name));
      REQUIRE(::sigaction(SIGUSR1, &old, nullptr) == 0);
      g_handled = 0;
      REQUIRE((in.install(SIGUSR1, on_usr1) != SIG_ERR));
      struct sigaction now{};
      REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
      CHECK((now.sa_handler == on_usr1));  // the program's own handler is reported
      CHECK((static_cast<unsigned>(now.sa_flags) & (SA_RESTART | SA_RESETHAND | SA_NODEFER | SA_SIGINFO)) == in.flags);
      auto r = no_park_call([] {
        ::raise(SIGUSR1);
        return 0;
      });
      CHECK_MESSAGE(!r.parked, "a hooked call inside the handler parked the fiber");
      CHECK(g_handled.load() == 1);
      CHECK(g_handler_sleep.load() == 0);
      char c;
      CHECK(::read(p.a, &c, 1) == 1);
      REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
      CHECK((now.sa_handler == (in.once ? SIG_DFL : on_usr1)));
    }
  });
  // sigset's SIG_HOLD: blocks the signal and reports the handler, then SIG_HOLD until a handler
  // is installed again, which unblocks it.
  REQUIRE((::sigset(SIGUSR1, on_usr1) != SIG_ERR));
  CHECK((::sigset(SIGUSR1, SIG_HOLD) == on_usr1));
  sigset_t mask;
  REQUIRE(::pthread_sigmask(SIG_BLOCK, nullptr, &mask) == 0);
  CHECK(sigismember(&mask, SIGUSR1) == 1);
  CHECK((::sigset(SIGUSR1, SIG_HOLD) == SIG_HOLD));
  CHECK((::sigset(SIGUSR1, on_usr1) == SIG_HOLD));
  REQUIRE(::pthread_sigmask(SIG_BLOCK, nullptr, &mask) == 0);
  CHECK(sigismember(&mask, SIGUSR1) == 0);
  set_err(0);
  CHECK((::sigset(SIGUSR1, SIG_ERR) == SIG_ERR));
  CHECK(err() == EINVAL);
  ::sigaction(SIGUSR1, &old, nullptr);
}

TEST_CASE("semantics: siginterrupt decides whether signal() restarts calls, and keeps the handler") {
  struct sigaction old{}, now{};
  REQUIRE(::sigaction(SIGUSR1, nullptr, &old) == 0);
  REQUIRE((::signal(SIGUSR1, on_usr1) != SIG_ERR));
  REQUIRE(::siginterrupt(SIGUSR1, 1) == 0);
  REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
  CHECK((now.sa_handler == on_usr1));
  CHECK((now.sa_flags & SA_RESTART) == 0);
  // signal() remembers it, as glibc's does.
  REQUIRE((::signal(SIGUSR1, on_usr1) == on_usr1));
  REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
  CHECK((now.sa_flags & SA_RESTART) == 0);
  REQUIRE(::siginterrupt(SIGUSR1, 0) == 0);
  REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
  CHECK((now.sa_flags & SA_RESTART) != 0);
  REQUIRE((::signal(SIGUSR1, on_usr1) == on_usr1));
  REQUIRE(::sigaction(SIGUSR1, nullptr, &now) == 0);
  CHECK((now.sa_flags & SA_RESTART) != 0);
  // Still behind the trampoline: the handler's hooked calls are the real ones.
  on_fiber(1, [] {
    Pair p = make_pipe();
    g_handler_fd = p.b;
    g_handled = 0;
    auto r = no_park_call([] {
      ::raise(SIGUSR1);
      return 0;
    });
    CHECK(!r.parked);
    CHECK(g_handled.load() == 1);
  });
  set_err(0);
  CHECK(::siginterrupt(0, 1) == -1);
  CHECK(err() == EINVAL);
  ::sigaction(SIGUSR1, &old, nullptr);
}
#pragma GCC diagnostic pop

namespace {
sigjmp_buf g_out_of_handler;
sigjmp_buf g_within_handler;
std::atomic<bool> g_probe_ran{false};
// How the SIGUSR2 handler leaves.
enum JumpHow : int {
  kSiglongjmpOut,         // siglongjmp out
  kLongjmpOut,            // longjmp out
  kJumpWithinThenOut,     // a jump within the handler, then out
  kOutFromAltStack,       // siglongjmp out from the alternate signal stack
  kOutFromDisarmed,       // the same, with SS_AUTODISARM (the alternate stack reads as disabled)
  kNestedOnAltStack,      // a nested handler on the same alternate stack jumps back into this
                          // one, which then returns normally
  kNestedOutFromDisarmed, // a nested handler, on the disarmed alternate stack's memory, jumps out
  kOutFromTenDeep,        // siglongjmp out from ten nested levels (SA_NODEFER), more than are recorded
  kTenDeepBackIntoNinth,  // the tenth level jumps back into the ninth; then every level returns
};
constexpr JumpHow kAllJumps[] = {kSiglongjmpOut,   kLongjmpOut,       kJumpWithinThenOut,
                                 kOutFromAltStack, kOutFromDisarmed,  kNestedOnAltStack,
                                 kNestedOutFromDisarmed, kOutFromTenDeep, kTenDeepBackIntoNinth};
bool on_alt_stack(JumpHow how) {
  return how == kOutFromAltStack || how == kOutFromDisarmed || how == kNestedOnAltStack || how == kNestedOutFromDisarmed;
}
bool disarmed(JumpHow how) { return how == kOutFromDisarmed || how == kNestedOutFromDisarmed; }
bool ten_deep(JumpHow how) { return how == kOutFromTenDeep || how == kTenDeepBackIntoNinth; }
bool nested_usr1(JumpHow how) { return how == kNestedOnAltStack || how == kNestedOutFromDisarmed; }
bool returns_normally(JumpHow how) { return how == kNestedOnAltStack || how == kTenDeepBackIntoNinth; }

std::atomic<int> g_jump_how{kSiglongjmpOut};
std::atomic<bool> g_parked_in_handler{false};
std::atomic<int> g_depth{0};

// Still in a handler: a hooked sleep is the real one, so the probe fiber cannot have run.
void check_real_sleep_in_handler() {
  ::usleep(2000);
  if (g_probe_ran.load()) g_parked_in_handler = true;
}
// SIGUSR1, raised inside the SIGUSR2 handler.
void nested_handler(int) {
  if (g_jump_how == kNestedOutFromDisarmed) siglongjmp(g_out_of_handler, 1);
  siglongjmp(g_within_handler, 1);
}
// TSan holds back a signal raised inside a handler until the handler has returned, so handlers
// never nest under it: the variants that need nesting run in the other builds.
#if defined(FIBER_TSAN) || defined(__SANITIZE_THREAD__)
constexpr bool kHandlersNest = false;
#else
constexpr bool kHandlersNest = true;
#endif
void jumping_handler(int) {
  switch (g_jump_how.load()) {
    case kJumpWithinThenOut:
      if (sigsetjmp(g_within_handler, 0) == 0) siglongjmp(g_within_handler, 1);
      check_real_sleep_in_handler();
      break;
    case kNestedOnAltStack:
      if (sigsetjmp(g_within_handler, 1) == 0) ::raise(SIGUSR1);  // lands back here
      check_real_sleep_in_handler();
      return;
    case kNestedOutFromDisarmed:
      ::raise(SIGUSR1);  // never returns
      break;
    case kOutFromTenDeep:
      if (++g_depth < 10) ::raise(SIGUSR2);  // SA_NODEFER: runs nested at once, never returns
      break;
    case kTenDeepBackIntoNinth: {
      const int depth = ++g_depth;
      if (depth == 10) siglongjmp(g_within_handler, 1);
      if (depth == 9 && sigsetjmp(g_within_handler, 1) != 0) {  // the tenth landed here
        check_real_sleep_in_handler();
        return;
      }
      ::raise(SIGUSR2);
      return;
    }
    case kLongjmpOut:
      longjmp(g_out_of_handler, 1);
  }
  siglongjmp(g_out_of_handler, 1);
}
// Raises SIGUSR2 at this thread; true if the handler jumped back here, false if it returned.
__attribute__((noinline)) bool raise_and_land() {
  if (sigsetjmp(g_out_of_handler, 1) != 0) return true;
  ::raise(SIGUSR2);
  return false;
}
#ifndef SS_AUTODISARM
#define SS_AUTODISARM (1U << 31)  // <linux/signal.h>; glibc does not define it
#endif
// Maps an alternate signal stack *above* the calling thread's stack, so that a jump back down to
// that stack counts as leaving a handler only by the alternate stack's bounds, not by its
// address. Installed with `flags` until destroyed, then the thread's previous one is back.
// (A handler left with a jump leaves an SS_AUTODISARM stack disarmed: hence `mem`, not what
// sigaltstack reads back.)
struct AltStackAbove {
  static constexpr size_t kSize = 1 << 16;
  void* mem = MAP_FAILED;
  stack_t prev{};
  explicit AltStackAbove(int flags);
  ~AltStackAbove() {
    ::sigaltstack(&prev, nullptr);
    ::munmap(mem, kSize);
  }
};
AltStackAbove::AltStackAbove(int flags) {
  const auto here = reinterpret_cast<uintptr_t>(&flags) & ~uintptr_t{0xfff};
  for (uintptr_t k = 1; k <= 64 && mem == MAP_FAILED; ++k) {
    mem = ::mmap(reinterpret_cast<void*>(here + k * (uintptr_t{64} << 20)), kSize, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  }
  REQUIRE(mem != MAP_FAILED);
  stack_t ss{};
  ss.ss_sp = mem;
  ss.ss_size = kSize;
  ss.ss_flags = flags;
  const bool ok = reinterpret_cast<uintptr_t>(mem) > here && ::sigaltstack(&ss, &prev) == 0;
  if (!ok) ::munmap(mem, kSize);  // the destructor will not run
  REQUIRE(ok);
}
// Puts a signal's disposition back when the scope ends, however it ends.
struct KeepDisposition {
  int sig;
  struct sigaction old{};
  explicit KeepDisposition(int s) : sig(s) { REQUIRE(::sigaction(sig, nullptr, &old) == 0); }
  ~KeepDisposition() { ::sigaction(sig, &old, nullptr); }
};
}  // namespace

// The alarm-timeout pattern: a handler leaves with a longjmp and never returns through the
// hook's trampoline, which counts the thread "in a handler" (hooked calls then the real ones).
// The longjmp hooks count it out; before them every later hooked call on that processor's
// thread was a real, blocking one. Each case runs on a new processor thread, so one that leaves
// the count wrong does not fail the others.
TEST_CASE("semantics: a signal handler left with siglongjmp or longjmp leaves hooked calls parking again") {
  KeepDisposition keep_usr1(SIGUSR1), keep_usr2(SIGUSR2);
  for (const JumpHow how : kAllJumps) {
    CAPTURE(how);
    if (!kHandlersNest && (nested_usr1(how) || ten_deep(how))) continue;
    g_jump_how = how;
    g_depth = 0;
    struct sigaction act{};
    act.sa_handler = jumping_handler;
    sigemptyset(&act.sa_mask);
    if (on_alt_stack(how)) act.sa_flags |= SA_ONSTACK;
    if (ten_deep(how)) act.sa_flags |= SA_NODEFER;
    REQUIRE(::sigaction(SIGUSR2, &act, nullptr) == 0);
    if (nested_usr1(how)) {
      struct sigaction nested{};
      nested.sa_handler = nested_handler;
      sigemptyset(&nested.sa_mask);
      nested.sa_flags = SA_ONSTACK;
      REQUIRE(::sigaction(SIGUSR1, &nested, nullptr) == 0);
    }
    // Ten nested signal frames need more than the default stack.
    on_fiber(1, [&] { fiber::spawn({.stack_size = 1 << 20}, [&] {
      std::optional<AltStackAbove> alt_stack;
      if (on_alt_stack(how)) alt_stack.emplace(disarmed(how) ? static_cast<int>(SS_AUTODISARM) : 0);
      g_probe_ran = false;
      g_parked_in_handler = false;
      auto probe = fiber::spawn([] { g_probe_ran = true; });  // runs only if we park
      const bool jumped = raise_and_land();
      CHECK_MESSAGE(jumped == !returns_normally(how), "the handler " << (jumped ? "jumped out" : "returned"));
      CHECK_FALSE(g_parked_in_handler.load());
      if (ten_deep(how)) CHECK(g_depth.load() == 10);
      alt_stack.reset();
      probe.join();
      Pair p = make_socketpair();
      expect_read_parks(p.a, p.b, "after the handler was left");
    }).join(); });
  }
}
// ================================================================================ the kernel's semantics, case by case

TEST_CASE("semantics: MSG_WAITALL on a stream socket waits for the whole length, end of file, or SO_RCVTIMEO") {
  on_fiber(1, [] {
    // recv: half of it there; the rest is written once the call has parked.
    {
      Pair p = make_socketpair();
      write_str(p.b, "0123456789");
      char buf[21] = {};
      auto r = parked_call([&] { return call([&] { return ::recv(p.a, buf, 20, MSG_WAITALL); }); },
                           [&] { write_str(p.b, "abcdefghij"); });
      CHECK_MESSAGE(r.value.r == 20, "recv(MSG_WAITALL) gave " << r.value.r << " errno " << err_str(r.value.e));
      CHECK(std::string(buf) == "0123456789abcdefghij");
      CHECK(r.parked);
    }
    // recvmsg into two buffers, nothing there at first, the data in two pieces.
    {
      Pair p = make_socketpair();
      char b1[5] = {}, b2[7] = {};
      iovec iov[2] = {{b1, 4}, {b2, 6}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      auto r = parked_call([&] { return call([&] { return ::recvmsg(p.a, &m, MSG_WAITALL); }); },
                           [&] {
                             write_str(p.b, "ab");
                             std::this_thread::sleep_for(20ms);  // likely a receive in between
                             write_str(p.b, "cdefghij");
                           });
      CHECK_MESSAGE(r.value.r == 10, "recvmsg(MSG_WAITALL) gave " << r.value.r << " errno " << err_str(r.value.e));
      CHECK(std::string(b1) == "abcd");
      CHECK(std::string(b2) == "efghij");
    }
    // End of file: what came before it.
    {
      Pair p = make_socketpair();
      write_str(p.b, "xyz");
      char buf[20];
      auto r = parked_call([&] { return call([&] { return ::recv(p.a, buf, sizeof buf, MSG_WAITALL); }); },
                           [&] { ::shutdown(p.b, SHUT_WR); });
      CHECK(r.value.r == 3);
      CHECK(r.parked);
    }
    // SO_RCVTIMEO: the count received before it expired; with nothing, EAGAIN.
    {
      Pair p = make_socketpair();
      set_timeout(p.a, SO_RCVTIMEO, 50ms);
      write_str(p.b, "12345");
      char buf[20];
      auto r = parked_call([&] { return call([&] { return ::recv(p.a, buf, sizeof buf, MSG_WAITALL); }); }, [] {});
      CHECK_MESSAGE(r.value.r == 5, "recv(MSG_WAITALL) with SO_RCVTIMEO gave " << r.value.r << " errno " << err_str(r.value.e));
      CHECK(r.parked);
      const Res none = call([&] { return ::recv(p.a, buf, sizeof buf, MSG_WAITALL); });
      CHECK((none.r == -1 && none.e == EAGAIN));
    }
    // TCP, through recvfrom with an address.
    {
      Listener l = tcp_listener();
      Fd c(::socket(AF_INET, SOCK_STREAM, 0));
      REQUIRE(::connect(c, sa(l.addr), sizeof l.addr) == 0);
      Fd s(::accept(l.fd, nullptr, nullptr));
      REQUIRE(s >= 0);
      write_str(c, "hello");
      char buf[12] = {};
      sockaddr_in from{};
      socklen_t len = sizeof from;
      auto r = parked_call(
          [&] { return call([&] { return ::recvfrom(s, buf, 11, MSG_WAITALL, reinterpret_cast<sockaddr*>(&from), &len); }); },
          [&] { write_str(c, " world"); });
      CHECK_MESSAGE(r.value.r == 11, "recvfrom(MSG_WAITALL) on TCP gave " << r.value.r << " errno " << err_str(r.value.e));
      CHECK(std::string(buf) == "hello world");
    }
    // The caller's non-blocking choice stands: what there is, at once.
    {
      Pair p = make_socketpair();
      Pair nb = make_socketpair(SOCK_NONBLOCK);
      write_str(p.b, "abc");
      write_str(nb.b, "abc");
      char buf[20];
      auto d = no_park_call([&] { return call([&] { return ::recv(p.a, buf, sizeof buf, MSG_WAITALL | MSG_DONTWAIT); }); },
                            [&] { ::shutdown(p.b, SHUT_WR); });
      CHECK(d.value.r == 3);
      CHECK(!d.parked);
      auto n = no_park_call([&] { return call([&] { return ::recv(nb.a, buf, sizeof buf, MSG_WAITALL); }); },
                            [&] { ::shutdown(nb.b, SHUT_WR); });
      CHECK(n.value.r == 3);
      CHECK(!n.parked);
    }
    // A message socket: one message (MSG_WAITALL means nothing there).
    {
      Pair p = make_socketpair(0, SOCK_SEQPACKET);
      char buf[20];
      auto r = parked_call([&] { return call([&] { return ::recv(p.a, buf, sizeof buf, MSG_WAITALL); }); },
                           [&] {
                             write_str(p.b, "ab");
                             write_str(p.b, "cd");
                           });
      CHECK_MESSAGE(r.value.r == 2, "recv(MSG_WAITALL) on SOCK_SEQPACKET gave " << r.value.r);
    }
  });
}

TEST_CASE("semantics: MSG_ERRQUEUE reads the error queue without waiting: EAGAIN when it is empty") {
  on_fiber(1, [] {
    for (const bool use_msg : {false, true}) {
      const int u = ::socket(AF_INET, SOCK_DGRAM, 0);
      REQUIRE(u >= 0);
      std::atomic<bool> closed{false};
      char buf[64];
      iovec iov{buf, sizeof buf};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      auto r = no_park_call(
          [&] {
            return call([&] { return use_msg ? ::recvmsg(u, &m, MSG_ERRQUEUE) : ::recv(u, buf, sizeof buf, MSG_ERRQUEUE); });
          },
          [&] {  // were it to wait, the close ends it
            closed = true;
            ::close(u);
          });
      const char* name = use_msg ? "recvmsg(MSG_ERRQUEUE)" : "recv(MSG_ERRQUEUE)";
      CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN), name << ": " << r.value.r << " errno " << err_str(r.value.e));
      CHECK_MESSAGE(!r.parked, name << " waited");
      if (!closed.load()) ::close(u);
    }
  });
}

TEST_CASE("semantics: sendto with an address writes all of it on a connected stream socket, one message on a datagram one") {
  on_fiber(1, [] {
    Listener l = tcp_listener();
    Fd c(::socket(AF_INET, SOCK_STREAM, 0));
    REQUIRE(::connect(c, sa(l.addr), sizeof l.addr) == 0);
    Fd s(::accept(l.fd, nullptr, nullptr));
    REQUIRE(s >= 0);
    // More than the socket buffers hold: the first try sends a part.
    const size_t n = 16 << 20;
    std::vector<char> big(n);
    for (size_t k = 0; k < n; ++k) big[k] = static_cast<char>(k * 7);
    size_t got = 0, bad = 0;
    std::thread reader([&] { got = drain(s, n, 10'000ms, 0, &bad); });
    const Res r = call([&] { return ::sendto(c, big.data(), n, 0, sa(l.addr), sizeof l.addr); });
    ::shutdown(c, SHUT_WR);
    reader.join();
    CHECK_MESSAGE(r.r == static_cast<long>(n), "sendto on connected TCP: " << r.r << " of " << n << ", errno " << err_str(r.e));
    CHECK(got == n);
    CHECK(bad == 0);

    // AF_UNIX stream: the kernel refuses an address on a connected socket.
    Pair p = make_socketpair();
    const sockaddr_in any = loopback(9);
    const Res u = call([&] { return ::sendto(p.a, "x", 1, 0, sa(any), sizeof any); });
    CHECK_MESSAGE((u.r == -1 && u.e == EISCONN), "sendto on AF_UNIX stream: " << u.r << " errno " << err_str(u.e));

    // UDP: one datagram, whole.
    Udp rx = udp_receiver();
    Fd tx(::socket(AF_INET, SOCK_DGRAM, 0));
    const Res d = call([&] { return ::sendto(tx, big.data(), 1000, 0, sa(rx.addr), sizeof rx.addr); });
    CHECK(d.r == 1000);
    char buf[2000];
    CHECK(::recv(rx.fd, buf, sizeof buf, 0) == 1000);
  });
}

namespace {
#ifndef TCP_FASTOPEN_NO_COOKIE
#define TCP_FASTOPEN_NO_COOKIE 34
#endif
// A TCP Fast Open send of `n` bytes to `to` on a new blocking socket, with sendto or sendmsg;
// `no_cookie`: the first bytes go in the SYN (TCP_FASTOPEN_NO_COOKIE), else they do only if this
// machine holds a cookie for the address. False if the socket refuses the option.
bool fastopen_send(bool no_cookie, bool use_sendmsg, const sockaddr_in& to, const char* data, size_t n, Res& out) {
  Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(c >= 0);
  const int one = 1;
  if (no_cookie && ::setsockopt(c, IPPROTO_TCP, TCP_FASTOPEN_NO_COOKIE, &one, sizeof one) != 0) return false;
  out = call([&] {
    if (!use_sendmsg) return ::sendto(c, data, n, MSG_FASTOPEN, sa(to), sizeof to);
    iovec iov{const_cast<char*>(data), n};
    msghdr m{};
    m.msg_name = const_cast<sockaddr_in*>(&to);
    m.msg_namelen = sizeof to;
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    return ::sendmsg(c, &m, MSG_FASTOPEN);
  });
  ::shutdown(c, SHUT_WR);
  return true;
}
}  // namespace

TEST_CASE("semantics: a MSG_FASTOPEN send on a blocking socket connects, then writes all of it; refused is ECONNREFUSED") {
  // The first try (which may not wait) starts the connection and says EINPROGRESS with nothing
  // sent, or - with a cookie for the peer, or TCP_FASTOPEN_NO_COOKIE - puts the first bytes in
  // the SYN and returns their count. Either way the blocking call waits for the connection, then
  // sends the rest, as connect + send; a refused connection is its error.
  int tfo = 0;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/tcp_fastopen", "r")) {
    if (std::fscanf(f, "%d", &tfo) != 1) tfo = 0;
    std::fclose(f);
  }
  if (!(tfo & 1)) {
    MESSAGE("skipped: TCP Fast Open is off for clients (net.ipv4.tcp_fastopen = " << tfo << ")");
    return;
  }
  on_fiber(1, [] {
    const size_t n = 4 << 20;  // more than the socket buffers hold: the rest waits for room
    std::vector<char> big(n);
    for (size_t k = 0; k < n; ++k) big[k] = static_cast<char>(k * 7);  // drain's pattern
    const RefusedAddr held = refused_addr();
    const sockaddr_in nobody = held.addr;
    for (const bool no_cookie : {false, true}) {
      for (const bool use_sendmsg : {false, true}) {
        CAPTURE(no_cookie);
        CAPTURE(use_sendmsg);
        Listener l = tcp_listener();
        size_t got = 0, bad = 0;
        std::thread reader([&] {  // a plain thread: the real accept
          Fd s(::accept(l.fd, nullptr, nullptr));
          if (s >= 0) got = drain(s, n, 10'000ms, 0, &bad);
        });
        Res r;
        const bool ran = fastopen_send(no_cookie, use_sendmsg, l.addr, big.data(), n, r);
        if (!ran) {
          Fd wake(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));  // ends the reader's accept
          REQUIRE(::connect(wake, sa(l.addr), sizeof l.addr) == 0);
          reader.join();
          MESSAGE("skipped: TCP_FASTOPEN_NO_COOKIE refused");
          continue;
        }
        reader.join();
        CHECK_MESSAGE(r.r == static_cast<long>(n), "Fast Open send: " << r.r << " of " << n << ", errno " << err_str(r.e));
        CHECK(got == n);
        CHECK(bad == 0);

        Res refused;
        REQUIRE(fastopen_send(no_cookie, use_sendmsg, nobody, "x", 1, refused));
        CHECK_MESSAGE((refused.r == -1 && refused.e == ECONNREFUSED),
                      "Fast Open send to a closed port: " << refused.r << " errno " << err_str(refused.e));
      }
    }
  });
}

TEST_CASE("semantics: recvfrom with an address but a null length fails with EFAULT, as the kernel's") {
  on_fiber(1, [] {
    Udp rx = udp_receiver();
    Fd tx(::socket(AF_INET, SOCK_DGRAM, 0));
    sockaddr_in from{};
    char buf[16];
    for (const bool hooked_call : {false, true}) {
      CAPTURE(hooked_call);
      REQUIRE(::sendto(tx, "abc", 3, 0, sa(rx.addr), sizeof rx.addr) == 3);
      const Res r = call([&] {
        return hooked_call ? ::recvfrom(rx.fd, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), nullptr)
                           : ::syscall(SYS_recvfrom, rx.fd.get(), buf, sizeof buf, 0, &from, nullptr);
      });
      CHECK_MESSAGE((r.r == -1 && r.e == EFAULT), "recvfrom: " << r.r << " errno " << err_str(r.e));
    }
  });
}

TEST_CASE("semantics: select never returns 0 early; exceptfds is POLLPRI, a hang-up is no exception") {
  on_fiber(1, [] {
    Pair hup = make_socketpair();
    hup.b.reset();  // peer gone: poll reports POLLHUP on hup.a, whatever it asked
    Pair q = make_pipe();
    const int nfds = std::max(hup.a.get(), q.a.get()) + 1;
    // No timeout: only the pipe's data ends it.
    fd_set rd, ex;
    FD_ZERO(&rd);
    FD_ZERO(&ex);
    FD_SET(q.a, &rd);
    FD_SET(hup.a, &ex);
    auto r = parked_call([&] { return call([&] { return ::select(nfds, &rd, nullptr, &ex, nullptr); }); },
                         [&] { write_str(q.b, "s"); });
    CHECK_MESSAGE(r.value.r == 1, "select (no timeout, a hung-up socket in exceptfds) gave " << r.value.r << " errno "
                                                                                            << err_str(r.value.e));
    CHECK(FD_ISSET(q.a, &rd));
    CHECK_FALSE(FD_ISSET(hup.a, &ex));
    CHECK(r.parked);
    char c;
    REQUIRE(::read(q.a, &c, 1) == 1);
    // With a timeout: 0 only once it has passed, and nothing left of it.
    FD_ZERO(&ex);
    FD_SET(hup.a, &ex);
    timeval tv{0, 100'000};
    const auto t0 = Clock::now();
    const Res t = call([&] { return ::select(nfds, nullptr, nullptr, &ex, &tv); });
    CHECK(t.r == 0);
    CHECK_MESSAGE(Clock::now() - t0 >= 100ms, "select returned 0 before its timeout");
    CHECK((tv.tv_sec == 0 && tv.tv_usec == 0));
    // Bits only in the sets a descriptor was asked for: the hung-up socket is writable, not readable.
    fd_set rs, ws;
    FD_ZERO(&rs);
    FD_ZERO(&ws);
    FD_SET(q.a, &rs);
    FD_SET(hup.a, &ws);
    timeval tv2{5, 0};
    const Res b = call([&] { return ::select(nfds, &rs, &ws, nullptr, &tv2); });
    CHECK(b.r == 1);
    CHECK(FD_ISSET(hup.a, &ws));
    CHECK_FALSE(FD_ISSET(hup.a, &rs));
    CHECK_FALSE(FD_ISSET(q.a, &rs));
    // Urgent data is what exceptfds reports, and its arrival ends the wait. (The io_uring
    // engine's poll for POLLPRI alone once missed it.)
    Listener l = tcp_listener();
    Fd cl(::socket(AF_INET, SOCK_STREAM, 0));
    REQUIRE(::connect(cl, sa(l.addr), sizeof l.addr) == 0);
    Fd sv(::accept(l.fd, nullptr, nullptr));
    REQUIRE(sv >= 0);
    FD_ZERO(&ex);
    FD_SET(sv, &ex);
    timeval tv3{5, 0};
    std::atomic<ssize_t> sent{0};
    auto u = parked_call([&] { return call([&] { return ::select(sv + 1, nullptr, nullptr, &ex, &tv3); }); },
                         [&] { sent = ::send(cl, "!", 1, MSG_OOB); });
    REQUIRE(sent.load() == 1);
    CHECK_MESSAGE(u.value.r == 1, "select for urgent data gave " << u.value.r << " errno " << err_str(u.value.e));
    CHECK(FD_ISSET(sv, &ex));
    CHECK(u.parked);
  });
}

namespace {
// tv_sec * 10^9 wraps round to 512 ns in 64 bits: a timeout converted without saturating ends at once.
constexpr time_t kWrapsSec = 20'211'507'185'753'197;
}  // namespace

TEST_CASE("semantics: a sleep or timeout too long for the clock lasts until interrupted; an invalid one is EINVAL") {
  on_fiber(2, [] {
    for (const time_t sec : {time_t{LONG_MAX}, kWrapsSec}) {
      std::atomic<bool> entering{false}, done{false};
      auto h = fiber::spawn([&] {
        timespec req{sec, 0}, rem{0, 0};
        entering = true;
        const Res r = call([&] { return ::nanosleep(&req, &rem); });
        done = true;
        return std::make_pair(r, rem);
      });
      REQUIRE(wait_for([&] { return entering.load(); }));
      fiber::this_fiber::sleep_for(100ms);
      CHECK_MESSAGE(!done.load(), "nanosleep({" << sec << ", 0}) returned at once");
      h.cancel();
      auto [r, rem] = h.join();
      CHECK((r.r == -1 && r.e == EINTR));
      CHECK(rem.tv_sec >= sec - 10);  // nearly all of it left
    }
  });
  on_fiber(1, [] {
    // ppoll and select: only the descriptor ends them, however long the timeout.
    Pair q = make_pipe();
    const timespec ts{kWrapsSec, 0};
    pollfd pf{q.a, POLLIN, 0};
    auto p = parked_call([&] { return call([&] { return ::ppoll(&pf, 1, &ts, nullptr); }); },
                         [&] { write_str(q.b, "p"); }, 5'000ms, 200ms);
    CHECK_MESSAGE(p.value.r == 1, "ppoll with a huge timeout gave " << p.value.r);
    CHECK_MESSAGE(p.released, "ppoll with a huge timeout returned on its own");
    char c;
    REQUIRE(::read(q.a, &c, 1) == 1);
    fd_set rd;
    FD_ZERO(&rd);
    FD_SET(q.a, &rd);
    timeval tv{kWrapsSec, 0};
    auto s = parked_call([&] { return call([&] { return ::select(q.a + 1, &rd, nullptr, nullptr, &tv); }); },
                         [&] { write_str(q.b, "s"); }, 5'000ms, 200ms);
    CHECK_MESSAGE(s.value.r == 1, "select with a huge timeout gave " << s.value.r);
    CHECK_MESSAGE(s.released, "select with a huge timeout returned on its own");
    REQUIRE(::read(q.a, &c, 1) == 1);
    // Invalid requests: the kernel's EINVAL, at once.
    for (const timespec bad : {timespec{-1, 0}, timespec{0, -1}, timespec{0, 1'000'000'000}}) {
      auto b = no_park_call([&] { return call([&] { return ::nanosleep(&bad, nullptr); }); });
      CHECK_MESSAGE((b.value.r == -1 && b.value.e == EINVAL), "nanosleep({" << bad.tv_sec << ", " << bad.tv_nsec << "})");
      CHECK(!b.parked);
    }
  });
}

TEST_CASE("semantics: the kernel's own ETIMEDOUT (TCP_USER_TIMEOUT) stays ETIMEDOUT, with or without SO_SNDTIMEO") {
  on_fiber(1, [] {
    FullListener f = full_listener();  // its SYNs are dropped: the connect retransmits until the user timeout
    for (const bool sndtimeo : {false, true}) {
      Fd c(::socket(AF_INET, SOCK_STREAM, 0));
      const unsigned uto = 100;  // ms; the kernel checks it when the first SYN retransmit is due
      REQUIRE(::setsockopt(c, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof uto) == 0);
      if (sndtimeo) set_timeout(c, SO_SNDTIMEO, 30'000ms);
      auto r = parked_call([&] { return call([&] { return ::connect(c, sa(f.l.addr), sizeof f.l.addr); }); }, [] {});
      CHECK_MESSAGE((r.value.r == -1 && r.value.e == ETIMEDOUT), "connect with TCP_USER_TIMEOUT" << (sndtimeo ? " and SO_SNDTIMEO" : "")
                                                                  << ": " << r.value.r << " errno " << err_str(r.value.e));
      CHECK(r.parked);
    }
  });
}

namespace {
int g_close_fd = -1;
std::atomic<int> g_close_rc{-2};
void close_in_handler(int) { g_close_rc = ::close(g_close_fd); }
}  // namespace

TEST_CASE("semantics: close in a signal handler is the real close: no park, no wait for the descriptor's fibers") {
  on_fiber(1, [] {
    Pair p = make_pipe();
    Fd keep(::dup(p.a));  // the pipe outlives the handler's close, so the reader can be ended later
    REQUIRE(keep >= 0);
    const int fd = p.a.release();
    g_close_fd = fd;
    std::atomic<bool> entering{false};
    auto reader = fiber::spawn([&] {
      entering = true;
      char c;
      return call([&] { return ::read(fd, &c, 1); });
    });
    while (!entering.load()) fiber::this_fiber::yield();  // one processor: the reader has parked in read
    struct sigaction act{}, old{};
    act.sa_handler = close_in_handler;
    sigemptyset(&act.sa_mask);
    REQUIRE(::sigaction(SIGUSR2, &act, &old) == 0);
    auto r = no_park_call(
        [] {
          ::raise(SIGUSR2);
          return g_close_rc.load();
        },
        [&] { write_str(p.b, "x"); });
    ::sigaction(SIGUSR2, &old, nullptr);
    CHECK_MESSAGE(!r.parked, "close in a signal handler parked the interrupted fiber");
    CHECK(r.value == 0);
    CHECK(::fcntl(fd, F_GETFD) == -1);  // closed
    // The kernel's close wakes no reader: a byte ends its read (on the engine's hold of the pipe).
    write_str(p.b, "y");
    const Res rr = reader.join();
    CHECK_MESSAGE((rr.r == 1 || (rr.r == -1 && rr.e == EBADF)), "the reader: " << rr.r << " errno " << err_str(rr.e));
  });
}

TEST_CASE("semantics: a number closed by fclose and made again (eventfd, open) is a new descriptor to the hook") {
  // The hook learns a blocking socket on a number; glibc's fclose closes it out of the hooks'
  // sight, and a non-blocking eventfd takes the number: a read there must be EAGAIN at once,
  // not a park as on the blocking socket the hook knew. Likewise a file open(2) brings back.
  on_fiber(1, [] {
    for (const bool by_open : {false, true}) {
      CAPTURE(by_open);
      Pair p = make_socketpair();
      write_str(p.b, "x");
      char c;
      REQUIRE(call([&] { return ::read(p.a, &c, 1); }).r == 1);  // learnt: a blocking socket
      const int number = p.a.release();
      FILE* f = ::fdopen(number, "r");
      REQUIRE(f != nullptr);
      REQUIRE(::fclose(f) == 0);
      const int fd = by_open ? ::open("/dev/null", O_RDONLY | O_NONBLOCK | O_CLOEXEC)
                             : ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      uint64_t v = 0;
      auto r = no_park_call([&] { return call([&] { return ::read(fd, &v, sizeof v); }); },
                            [&] {  // were it to wait, a count (or the close) ends it
                              const uint64_t one = 1;
                              if (!by_open) (void)::syscall(SYS_write, fd, &one, sizeof one);
                            });
      if (by_open) {
        CHECK_MESSAGE(r.value.r == 0, "read of /dev/null: " << r.value.r << " errno " << err_str(r.value.e));
      } else {
        CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN), "read of an empty non-blocking eventfd: " << r.value.r
                                                                   << " errno " << err_str(r.value.e));
      }
      CHECK_MESSAGE(!r.parked, "the read waited as on the old descriptor");
      ::close(fd);
    }
  });
}

namespace {
int fds_in(msghdr& m) {
  int n = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
      ::close(fd);
      ++n;
    }
  }
  return n;
}
}  // namespace

TEST_CASE("semantics: MSG_WAITALL ends with data that carried descriptors, as the kernel's; none is lost") {
  // Two 8-byte messages, each with a descriptor, and room for 16 bytes but one descriptor: the
  // kernel's receive stops after the first 8 (its descriptor), and the second comes with the next
  // call. Reading on would leave the second descriptor no room (MSG_CTRUNC: the kernel closes it),
  // or park for data a peer waiting for a reply never sends.
  on_fiber(1, [] {
    Pair p = make_socketpair();
    Fd a(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    Fd b(::open("/dev/zero", O_RDONLY | O_CLOEXEC));
    send_with_fd(p.b, "AAAAAAAA", 8, a);
    send_with_fd(p.b, "BBBBBBBB", 8, b);
    char buf[16];
    iovec iov{buf, sizeof buf};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    const Res r = call([&] { return ::recvmsg(p.a, &m, MSG_WAITALL); });
    CHECK_MESSAGE(r.r == 8, "recvmsg(MSG_WAITALL) gave " << r.r << " errno " << err_str(r.e));
    CHECK((m.msg_flags & MSG_CTRUNC) == 0);
    CHECK(fds_in(m) == 1);
    m.msg_controllen = sizeof cbuf;
    m.msg_flags = 0;
    const Res r2 = call([&] { return ::recvmsg(p.a, &m, MSG_WAITALL); });
    CHECK_MESSAGE(r2.r == 8, "the second recvmsg gave " << r2.r << " errno " << err_str(r2.e));
    CHECK_MESSAGE(fds_in(m) == 1, "the second descriptor was lost");
  });
}

TEST_CASE("semantics: a blocking write past RLIMIT_FSIZE returns the short count, as the kernel's, with no SIGXFSZ") {
  on_fiber(1, [] {
    static std::atomic<int> signals{0};
    struct sigaction sa {}, old_sa {};
    sa.sa_handler = [](int) { signals.fetch_add(1); };
    REQUIRE(::sigaction(SIGXFSZ, &sa, &old_sa) == 0);
    rlimit old_lim{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_lim) == 0);
    char path[] = "/tmp/fiber_hook_fsize_XXXXXX";
    Fd file(::mkstemp(path));
    REQUIRE(file.get() >= 0);
    ::unlink(path);
    const rlimit lim{10, old_lim.rlim_max};
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
    const Res w = call([&] { return ::write(file, "01234567890123456789", 20); });
    iovec iov[2] = {{const_cast<char*>("0123456789"), 10}, {const_cast<char*>("abcdefghij"), 10}};
    REQUIRE(::ftruncate(file, 0) == 0);
    REQUIRE(::lseek(file, 0, SEEK_SET) == 0);
    const Res wv = call([&] { return ::writev(file, iov, 2); });
    ::setrlimit(RLIMIT_FSIZE, &old_lim);
    ::sigaction(SIGXFSZ, &old_sa, nullptr);
    CHECK_MESSAGE(w.r == 10, "write gave " << w.r << " errno " << err_str(w.e));
    CHECK_MESSAGE(wv.r == 10, "writev gave " << wv.r << " errno " << err_str(wv.e));
    CHECK_MESSAGE(signals.load() == 0, "a second write past the limit raised SIGXFSZ");
  });
}
}  // TEST_SUITE("hooked")
