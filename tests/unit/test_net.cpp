// fiber::net (fiber/net.hpp) on loopback: Listener on port 0; Stream::write_all / read_exact
// (fewer bytes when the peer closes first) and shutdown(SHUT_WR); reads of data waiting and
// still to come, and a Stream on a pipe; connections refused and
// timing out; addresses that do not parse; close and cancel while accept or read wait; an accept
// loop that survives running out of descriptors (EMFILE, in a child process); 1000 concurrent
// connections against an echo server, every byte checked. Failing calls leak no descriptor.
//
// Like test_io.cpp, these run on the io_uring engine and, with FIBER_IO=epoll, on the epoll one.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <dlfcn.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "integration/process.hpp"  // run_test_case
#include "io/fd_table.hpp"          // the receive hint, read by the test of Stream reads
#include "io/poller.hpp"
#include "io_util.hpp"
#include "sched/processor.hpp"
#include "team.hpp"
#include "test_util.hpp"

// ------------------------------------------------------------------------------ a resolver to steer

// getaddrinfo as libfiber sees it in this binary (the executable's definition comes first in
// symbol lookup, as an LD_PRELOAD'ed one would): names under resolver.test behave as a DNS
// server might, everything else goes to the C library's.
namespace resolver_test {
std::atomic<bool> release{false};  // ends the lookups of hang.resolver.test
std::atomic<int> hanging{0};       // lookups of hang.resolver.test in progress
}  // namespace resolver_test

extern "C" int getaddrinfo(const char* node, const char* service, const addrinfo* hints, addrinfo** res) {
  using Real = int (*)(const char*, const char*, const addrinfo*, addrinfo**);
  static const auto real = reinterpret_cast<Real>(::dlsym(RTLD_NEXT, "getaddrinfo"));
  const std::string_view name = node != nullptr ? node : "";
  if (name == "hang.resolver.test") {  // a server that does not answer, until the test says so
    ++resolver_test::hanging;
    while (!resolver_test::release.load()) ::usleep(1000);
    --resolver_test::hanging;
    return EAI_NONAME;
  }
  if (name == "ok.resolver.test") return real("127.0.0.1", service, hints, res);
  // Names with several addresses, each answered as the C library answers a numeric one: a
  // server down (nothing listens on 127.0.0.2 or .3), one up, one whose SYNs are dropped (.4,
  // when the test fills that listener's queue), and a repeat. The lists of several calls are
  // chained into one, which glibc's freeaddrinfo frees node by node (musl's would not).
  auto several = [&](std::initializer_list<const char*> hosts) {
    addrinfo* head = nullptr;
    addrinfo** tail = &head;
    for (const char* h : hosts) {
      const int rc = real(h, service, hints, tail);
      if (rc != 0) {
        if (head != nullptr) ::freeaddrinfo(head);
        return rc;
      }
      while (*tail != nullptr) tail = &(*tail)->ai_next;
    }
    *res = head;
    return 0;
  };
  if (name == "two.resolver.test") return several({"127.0.0.2", "127.0.0.1", "127.0.0.2"});
  if (name == "down.resolver.test") return several({"127.0.0.2", "127.0.0.3"});
  if (name == "slow.resolver.test") return several({"127.0.0.4", "127.0.0.1"});
  if (name == "again.resolver.test") return EAI_AGAIN;
  if (name == "system.resolver.test") {  // EAI_SYSTEM that leaves no errno
    errno = 0;
    return EAI_SYSTEM;
  }
  return real(node, service, hints, res);
}

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;
namespace io = fiber::io;
namespace net = fiber::net;

void let_it_park(const std::atomic<int>& started) {
  REQUIRE(wait_for([&] { return started.load() >= 1; }));
  fiber::this_fiber::sleep_for(20ms);
}

std::string loopback_str(uint16_t port) { return "127.0.0.1:" + std::to_string(port); }

// A connected pair of Streams: the client dialled the listener's port, the server accepted.
struct StreamPair {
  net::Stream client;
  net::Stream server;
};

StreamPair stream_pair(net::Listener& ln) {
  auto c = net::Stream::dial(loopback_str(ln.port()), patience());
  REQUIRE_MESSAGE(c.ok(), c.message());
  auto a = ln.accept(patience());
  REQUIRE_MESSAGE(a.ok(), a.message());
  return {std::move(*c), std::move(*a)};
}

// A connected pair through a listener of its own (closed once the pair is made).
StreamPair stream_pair() {
  auto ln = net::Listener::listen("127.0.0.1:0");
  REQUIRE_MESSAGE(ln.ok(), ln.message());
  return stream_pair(*ln);
}

// The echo_server sample's connection fiber: reads up to 4096 bytes, writes them back, until
// the peer closes.
void serve_echo(net::Stream conn) {
  char buf[4096];
  for (;;) {
    const ssize_t n = conn.read(buf, sizeof buf, patience());
    if (n <= 0) return;
    if (conn.write_all(buf, static_cast<size_t>(n), patience()) < 0) return;
  }
}

// The echo_server sample's accept loop for `count` connections, with its back-off when out of
// descriptors; counts the back-offs. Joins the connection fibers before it returns.
void accept_loop(net::Listener& ln, int count, std::atomic<int>& backoffs) {
  std::vector<fiber::JoinHandle<void>> conns;
  while (static_cast<int>(conns.size()) < count) {
    auto conn = ln.accept(patience());
    if (conn) {
      conns.push_back(fiber::spawn([c = std::move(*conn)]() mutable { serve_echo(std::move(c)); }));
      continue;
    }
    const int e = conn.error();
    if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
      backoffs.fetch_add(1);
      fiber::this_fiber::sleep_for(10ms);
      continue;
    }
    if (e == ECONNABORTED || e == EINTR) continue;
    FAIL("accept: " << conn.message());
  }
  join_all(conns);
}

// Sends `len` bytes of stream `seed` through an echo connection and checks what comes back.
void echo_roundtrip(net::Stream& s, uint64_t seed, size_t len) {
  std::vector<uint8_t> out(len);
  std::vector<uint8_t> back(len);
  fill_pattern(seed, 0, out.data(), len);
  REQUIRE(s.write_all(out.data(), len, patience()) == static_cast<ssize_t>(len));
  REQUIRE(s.read_exact(back.data(), len, patience()) == static_cast<ssize_t>(len));
  REQUIRE(pattern_mismatch(seed, 0, back.data(), len) == kAllMatch);
}

}  // namespace

// ------------------------------------------------------------------------------ listen, dial

TEST_CASE("net: Listener on port 0 gets a free port, port() names it, and dial reaches it") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::spawn({.scheduler = &s}, [] {
      auto ln = net::Listener::listen("127.0.0.1:0");
      REQUIRE_MESSAGE(ln.ok(), ln.message());
      CHECK(ln.error() == 0);
      const uint16_t port = ln->port();
      CHECK(port != 0);
      CHECK(port == local_port(ln->fd()));
      for (const char* host : {"127.0.0.1", "localhost"}) {
        auto c = net::Stream::dial(std::string(host) + ":" + std::to_string(port), patience());
        REQUIRE_MESSAGE(c.ok(), host << ": " << c.message());
        auto a = ln->accept(patience());
        REQUIRE_MESSAGE(a.ok(), a.message());
        auto peer = c->peer_address();
        REQUIRE(peer.ok());
        CHECK(peer->port() == port);
        CHECK(peer->to_string() == loopback_str(port));
        auto back = a->peer_address();
        REQUIRE(back.ok());
        CHECK(back->port() == local_port(c->fd()));
        CHECK(c->write_all("hi", 2) == 2);
        char buf[2];
        CHECK(a->read_exact(buf, 2, patience()) == 2);
        CHECK(std::string(buf, 2) == "hi");
      }
      // The port is taken while the listener lives: a second listen on it fails, naming it.
      auto again = net::Listener::listen(loopback_str(port));
      CHECK_FALSE(again.ok());
      CHECK(again.error() == EADDRINUSE);
      CHECK(contains(again.message(), loopback_str(port)));
      // Moving keeps the descriptor and the port; the moved-from listener is empty.
      net::Listener moved = std::move(*ln);
      CHECK(moved.port() == port);
      CHECK(moved.fd() >= 0);
      CHECK(ln->fd() == -1);
      CHECK(moved.close() == 0);
      CHECK(moved.fd() == -1);
      CHECK(moved.close() == 0);  // already closed: nothing to do
    }).join();
  });
}

// ------------------------------------------------------------------------------ streams

TEST_CASE("net: write_all and read_exact move every byte; read_exact returns fewer when the peer closes first") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where writer : kBoth) {
      for (Where reader : kBoth) {
        CAPTURE(where_name(writer));
        CAPTURE(where_name(reader));
        StreamPair p = stream_pair();
        const size_t len = 8 * 1024 * 1024;
        Team team;
        team.spawn(writer, s, [&] {
          std::mt19937 rng(1);
          std::vector<uint8_t> buf(1 << 20);
          size_t off = 0;
          while (off < len) {
            const size_t n = std::min<size_t>(len - off, 1 + rng() % buf.size());
            fill_pattern(70, off, buf.data(), n);
            REQUIRE(p.client.write_all(buf.data(), n) == static_cast<ssize_t>(n));
            off += n;
          }
          // Then 100 bytes more, and the end: the reader asks for 1000.
          fill_pattern(70, off, buf.data(), 100);
          REQUIRE(p.client.write_all(buf.data(), 100) == 100);
          CHECK(p.client.close() == 0);
          CHECK_FALSE(p.client.is_open());
        });
        team.spawn(reader, s, [&] {
          std::mt19937 rng(2);
          std::vector<uint8_t> buf(1 << 20);
          size_t off = 0;
          while (off < len) {
            const size_t n = std::min<size_t>(len - off, 1 + rng() % buf.size());
            REQUIRE(p.server.read_exact(buf.data(), n, off % 2 ? io::Deadline(patience()) : io::Deadline()) ==
                    static_cast<ssize_t>(n));
            REQUIRE(pattern_mismatch(70, off, buf.data(), n) == kAllMatch);
            off += n;
          }
          CHECK(p.server.read_exact(buf.data(), 1000, patience()) == 100);  // the peer closed first
          CHECK(pattern_mismatch(70, off, buf.data(), 100) == kAllMatch);
          CHECK(p.server.read_exact(buf.data(), 1000) == 0);
          CHECK(p.server.read(buf.data(), 1000) == 0);
          // The peer is gone: writes fail (no SIGPIPE).
          ssize_t r = 0;
          for (int i = 0; i < 1000 && r >= 0; ++i) r = p.server.write_all(buf.data(), 1000);
          CHECK((r == -EPIPE || r == -ECONNRESET));
        });
        team.join();
      }
    }
  });
}

TEST_CASE("net: read_exact with a deadline gives ETIMEDOUT when the bytes do not all come") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      StreamPair p = stream_pair();
      Team team;
      team.spawn(w, s, [&] {
        CHECK(p.client.write_all("12345", 5) == 5);
        char buf[10];
        const auto at = Clock::now() + 30ms;
        CHECK(p.server.read_exact(buf, 10, at) == -ETIMEDOUT);
        CHECK(Clock::now() >= at);
        // The stream carries on: what comes next is read.
        CHECK(p.client.write_all("abc", 3) == 3);
        CHECK(p.server.read_exact(buf, 3, patience()) == 3);
        CHECK(std::string(buf, 3) == "abc");
      });
      team.join();
    }
  });
}

TEST_CASE("net: shutdown(SHUT_WR) lets the peer see end of stream while it can still send back") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      StreamPair p = stream_pair();
      const size_t request = 300 * 1000;
      const size_t response = 500 * 1000;
      Team team;
      // The server reads the request to its end, then answers.
      team.spawn(w, s, [&] {
        std::vector<uint8_t> buf(request + 1);
        CHECK(p.server.read_exact(buf.data(), buf.size(), patience()) == static_cast<ssize_t>(request));
        CHECK(pattern_mismatch(80, 0, buf.data(), request) == kAllMatch);
        std::vector<uint8_t> out(response);
        fill_pattern(81, 0, out.data(), response);
        CHECK(p.server.write_all(out.data(), response, patience()) == static_cast<ssize_t>(response));
        CHECK(p.server.close() == 0);
      });
      team.spawn(Where::fiber, s, [&] {
        std::vector<uint8_t> out(request);
        fill_pattern(80, 0, out.data(), request);
        CHECK(p.client.write_all(out.data(), request) == static_cast<ssize_t>(request));
        CHECK(p.client.shutdown(SHUT_WR) == 0);
        // No more writing...
        const ssize_t r = p.client.write("x", 1);
        CHECK(r == -EPIPE);
        // ...but reading goes on.
        std::vector<uint8_t> in(response + 1);
        CHECK(p.client.read_exact(in.data(), in.size(), patience()) == static_cast<ssize_t>(response));
        CHECK(pattern_mismatch(81, 0, in.data(), response) == kAllMatch);
      });
      team.join();
    }
  });
}

// A Stream made by dial or accept lets the kernel wait for data before its first receive
// unless the last one left data behind (io.cpp, ring_op); both cases must return every byte.
// A Stream handed some other descriptor must not: on a pipe that wait would never end.
TEST_CASE("net: reads take data already waiting and data still to come; a Stream on a pipe fails with ENOTSOCK") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      StreamPair p = stream_pair();
      Team team;
      team.spawn(w, s, [&] {
        // 64 KiB waiting, read 1000 bytes at a time: each read leaves data behind but the last.
        const size_t len = 64 * 1024;
        std::vector<uint8_t> out(len);
        fill_pattern(90, 0, out.data(), len);
        REQUIRE(p.client.write_all(out.data(), len, patience()) == static_cast<ssize_t>(len));
        std::vector<uint8_t> in(len);
        size_t got = 0;
        // On the ring the descriptor's hint must say "data left" at some read and not at the end.
        const bool ring = w == Where::fiber && fiber::detail::current_processor()->poller().kind() ==
                                                   fiber::detail::PollerKind::Uring;
        fiber::detail::FdSlot* slot = fiber::detail::fd_table().slot(p.server.fd());
        REQUIRE(slot != nullptr);
        bool hinted = false;
        while (got < len) {
          const ssize_t r = p.server.read(in.data() + got, std::min<size_t>(1000, len - got), patience());
          REQUIRE(r > 0);
          got += static_cast<size_t>(r);
          hinted |= slot->recv_backlog.load();
        }
        CHECK(pattern_mismatch(90, 0, in.data(), len) == kAllMatch);
        if (ring) {
          CHECK(hinted);
          CHECK_FALSE(slot->recv_backlog.load());
        }
        // Now the socket is empty: a read waits for the bytes the other side sends later.
        // (A fiber: the round goes into each message, not a CAPTURE; io_util.hpp says why.)
        for (int i = 0; i < 3; ++i) {
          auto later = fiber::spawn({.scheduler = &s}, [&] {
            fiber::this_fiber::sleep_for(5ms);
            CHECK_MESSAGE(p.client.write_all("ping", 4, patience()) == 4, "round " << i);
          });
          char buf[16];
          CHECK_MESSAGE(p.server.read(buf, sizeof buf, patience()) == 4, "round " << i);
          CHECK_MESSAGE(std::string(buf, 4) == "ping", "round " << i);
          later.join();
        }
      });
      team.join();

      // An empty pipe, its write end open: nothing will ever make it readable.
      int fds[2];
      REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
      team.spawn(w, s, [&] {
        net::Stream pipe_stream(fds[0]);  // closes the read end when it goes
        char c;
        CHECK(pipe_stream.read(&c, 1, patience()) == -ENOTSOCK);
        CHECK(pipe_stream.read_exact(&c, 1, patience()) == -ENOTSOCK);
      });
      team.join();
      CHECK(::fcntl(fds[0], F_GETFD) == -1);
      ::close(fds[1]);
    }
  });
}

// ------------------------------------------------------------------------------ dial errors

TEST_CASE("net: connecting to a port nobody listens on is refused") {
  ClosedPort closed = closed_port();
  const std::string where = loopback_str(closed.port);
  const sockaddr_in addr = loopback(closed.port);
  auto body = [&] {
    for (const bool timed : {false, true}) {
      auto dl = [timed] { return timed ? io::Deadline(patience()) : io::Deadline(); };
      const char* ctx = timed ? "with a deadline" : "without a deadline";
      Fd c = tcp_socket();
      const int rc = io::connect(c.get(), sa(addr), sizeof addr, dl());  // may park: not inside the check
      CHECK_MESSAGE(rc == -ECONNREFUSED, ctx);
      auto r = net::Stream::dial(where, dl());
      CHECK_FALSE(r.ok());
      CHECK_FALSE(static_cast<bool>(r));
      CHECK_MESSAGE(r.error() == ECONNREFUSED, ctx);
      CHECK_MESSAGE(contains(r.message(), where), r.message());
      try {
        (void)r.value();
        FAIL_CHECK("value() of a failed dial did not throw");
      } catch (const std::system_error& e) {
        CHECK(e.code().value() == ECONNREFUSED);
        CHECK(contains(e.what(), where));
      }
    }
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); });
  SUBCASE("plain thread") { run_on_thread(body); }
}

TEST_CASE("net: dial and accept with a deadline that passes give ETIMEDOUT") {
  auto body = [] {
    FullListener full = full_listener();  // connects to it stay in progress
    const std::string where = loopback_str(ntohs(full.addr.sin_port));
    const auto at = Clock::now() + 30ms;
    auto r = net::Stream::dial(where, at);
    CHECK_FALSE(r.ok());
    CHECK(r.error() == ETIMEDOUT);
    CHECK_MESSAGE(contains(r.message(), where), r.message());
    CHECK(Clock::now() >= at);

    auto ln = net::Listener::listen("127.0.0.1:0");
    REQUIRE(ln.ok());
    const auto at2 = Clock::now() + 30ms;
    auto a = ln->accept(at2);
    CHECK_FALSE(a.ok());
    CHECK(a.error() == ETIMEDOUT);
    CHECK(Clock::now() >= at2);
    // The listener still works.
    StreamPair p = stream_pair(*ln);
    CHECK(p.client.write_all("ok", 2) == 2);
    char buf[2];
    CHECK(p.server.read_exact(buf, 2, patience()) == 2);
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); });
  SUBCASE("plain thread") { run_on_thread(body); }
}

// ------------------------------------------------------------------------------ bad input

TEST_CASE("net: addresses that do not parse and backlog 0 give EINVAL naming the input; failures leak nothing") {
  auto body = [] {
    const int before = held_fd_count();
    for (int round = 0; round < 3; ++round) {
      // The last: the C library would resolve "ok.resolver.test", a host other than the one given.
      for (const std::string& bad : std::initializer_list<std::string>{
               "nohost", "1.2.3.4:99999", "1.2.3.4:-1", "[::1", "", "1.2.3.4:", ":", "::1:80", "[::1]80", "1.2.3.4:80x",
               "1.2.3.4:123456", "[::1]:", "1.2.3.4: 80", "[]:80", "[*]:80", std::string("ok.resolver.test\0.evil:80", 25)}) {
        const std::string quoted = "'" + bad + "'";
        auto r = net::resolve(bad);
        CHECK_FALSE_MESSAGE(r.ok(), quoted);
        CHECK_MESSAGE(r.error() == EINVAL, quoted);
        CHECK_MESSAGE(contains(r.message(), quoted), r.message());
        auto d = net::Stream::dial(bad, patience());
        CHECK_MESSAGE(d.error() == EINVAL, quoted);
        CHECK_MESSAGE(contains(d.message(), quoted), d.message());
        auto l = net::Listener::listen(bad);
        CHECK_MESSAGE(l.error() == EINVAL, quoted);
        CHECK_MESSAGE(contains(l.message(), quoted), l.message());
      }
      for (const int backlog : {0, -1}) {
        auto l = net::Listener::listen("127.0.0.1:0", backlog);
        CHECK_FALSE_MESSAGE(l.ok(), "backlog " << backlog);
        CHECK_MESSAGE(l.error() == EINVAL, "backlog " << backlog);
        CHECK_MESSAGE(contains(l.message(), "backlog"), l.message());
      }
      // Failures after the socket exists: a refused dial, a port in use, an address not ours.
      ClosedPort closed = closed_port();
      CHECK(net::Stream::dial(loopback_str(closed.port), patience()).error() == ECONNREFUSED);
      auto ln = net::Listener::listen("127.0.0.1:0");
      REQUIRE(ln.ok());
      CHECK(net::Listener::listen(loopback_str(ln->port())).error() == EADDRINUSE);
      CHECK(net::Listener::listen("192.0.2.1:0").error() == EADDRNOTAVAIL);  // TEST-NET-1
    }
    const bool fds_back = fd_count_back_to(before);  // may sleep: not inside the CHECK
    CHECK_MESSAGE(fds_back, open_fd_count() << " descriptors open, " << before << " before");
    // Addresses that do parse.
    auto a = net::resolve("127.0.0.1:80");
    REQUIRE(a.ok());
    CHECK(a->port() == 80);
    CHECK(a->to_string() == "127.0.0.1:80");
    auto b = net::resolve("[::1]:8080");
    REQUIRE(b.ok());
    CHECK(b->to_string() == "[::1]:8080");
    auto c = net::resolve("localhost:65535");
    REQUIRE(c.ok());
    CHECK(c->to_string() == "127.0.0.1:65535");
    for (const char* any : {":0", "*:7"}) {
      auto r = net::resolve(any);
      REQUIRE(r.ok());
      CHECK(contains(r->to_string(), "0.0.0.0:"));
    }
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); }, {1, 4});
  SUBCASE("plain thread") { run_on_thread(body); }
}

// ------------------------------------------------------------------------------ name lookups

namespace {

// Lets the lookups of hang.resolver.test finish and waits until they have; false if they do not.
bool let_lookups_finish() {
  resolver_test::release = true;
  const bool finished = wait_for([] { return resolver_test::hanging.load() == 0; });
  resolver_test::release = false;
  return finished;
}

// For a test's scope, lookups of hang.resolver.test hang; at its end, also when a REQUIRE ends it
// early, they are let finish: left hanging they would hold pool threads the later tests need.
struct HangingLookups {
  HangingLookups() { resolver_test::release = false; }
  ~HangingLookups() { let_lookups_finish(); }
};

}  // namespace

// Names (not numeric addresses, not localhost) go through getaddrinfo; the steered resolver above
// stands in for DNS servers that answer, fail, or never answer.
TEST_CASE("net: name lookups: a result, resolver failures as errnos, and a lookup that hangs ends at the deadline or a cancel") {
  HangingLookups scope;
  auto answers = [] {
    auto ok = net::resolve("ok.resolver.test:8080");
    REQUIRE_MESSAGE(ok.ok(), ok.message());
    CHECK(ok->to_string() == "127.0.0.1:8080");
    auto ok_dl = net::resolve("ok.resolver.test:8081", patience());
    REQUIRE_MESSAGE(ok_dl.ok(), ok_dl.message());
    CHECK(ok_dl->to_string() == "127.0.0.1:8081");
    // EAI_SYSTEM without an errno once gave failure(0, ...): ok() true with no address.
    auto sys = net::resolve("system.resolver.test:80");
    CHECK_FALSE(sys.ok());
    CHECK(sys.error() == EIO);
    auto again = net::resolve("again.resolver.test:80", patience());
    CHECK(again.error() == EAGAIN);
    CHECK_MESSAGE(contains(again.message(), "'again.resolver.test'"), again.message());
    // The deadline covers the lookup: dial once waited for the resolver's own timeouts.
    const int before = resolver_test::hanging.load();
    auto r = net::resolve("hang.resolver.test:80", 30ms);
    CHECK(r.error() == ETIMEDOUT);
    CHECK_MESSAGE(contains(r.message(), "'hang.resolver.test'"), r.message());
    auto d = net::Stream::dial("hang.resolver.test:80", 30ms);
    CHECK(d.error() == ETIMEDOUT);
    CHECK(resolver_test::hanging.load() >= before + 1);  // returned while lookups still hang
    auto past = net::resolve("hang.resolver.test:80", std::chrono::steady_clock::now() - 1s);
    CHECK(past.error() == ETIMEDOUT);
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) {
    fiber::spawn({.scheduler = &s}, answers).join();
    // A cancel ends a lookup without a deadline (it once waited for the lookup to finish).
    const int before = resolver_test::hanging.load();
    auto h = fiber::spawn({.scheduler = &s}, [] { return net::Stream::dial("hang.resolver.test:80").error(); });
    REQUIRE(wait_for([&] { return resolver_test::hanging.load() > before; }));
    h.cancel();
    CHECK(h.join() == ECANCELED);
    CHECK(let_lookups_finish());  // they finish unwatched
  }, {1, 2});
  run_on_thread(answers);
  CHECK(let_lookups_finish());
}

// A name with several addresses: dial once tried only the first, so one server down (or an
// IPv6 address on a host without IPv6 routes) failed the dial though the next would answer.
TEST_CASE("net: dial tries a name's addresses in order until one connects; a failure lists every attempt") {
  auto ln = net::Listener::listen("127.0.0.1:0");
  REQUIRE_MESSAGE(ln.ok(), ln.message());
  const std::string port = std::to_string(ln->port());
  auto body = [&] {
    auto all = net::resolve_all("two.resolver.test:" + port, patience());
    REQUIRE_MESSAGE(all.ok(), all.message());
    REQUIRE(all->size() == 2);  // in the resolver's order, the repeat dropped
    CHECK((*all)[0].to_string() == "127.0.0.2:" + port);
    CHECK((*all)[1].to_string() == "127.0.0.1:" + port);
    auto first = net::resolve("two.resolver.test:" + port);
    REQUIRE_MESSAGE(first.ok(), first.message());
    CHECK(first->to_string() == "127.0.0.2:" + port);
    auto one = net::resolve_all("127.0.0.1:" + port);
    REQUIRE_MESSAGE(one.ok(), one.message());
    CHECK(one->size() == 1);
    CHECK(net::resolve_all("no-port").error() == EINVAL);

    for (bool with_deadline : {false, true}) {
      auto c = with_deadline ? net::Stream::dial("two.resolver.test:" + port, patience())
                             : net::Stream::dial("two.resolver.test:" + port);
      REQUIRE_MESSAGE(c.ok(), c.message());  // 127.0.0.2 refused, 127.0.0.1 answered
      auto a = ln->accept(patience());
      REQUIRE_MESSAGE(a.ok(), a.message());
      CHECK(c->write_all("x", 1) == 1);
      char byte = 0;
      CHECK(a->read_exact(&byte, 1, patience()) == 1);
      CHECK(byte == 'x');
    }
    auto down = net::Stream::dial("down.resolver.test:" + port, patience());
    CHECK(down.error() == ECONNREFUSED);
    CHECK_MESSAGE(contains(down.message(), "'down.resolver.test:" + port + "'"), down.message());
    CHECK_MESSAGE(contains(down.message(), "127.0.0.2:" + port + ": "), down.message());
    CHECK_MESSAGE(contains(down.message(), "127.0.0.3:" + port + ": "), down.message());
    // One address: the message is as before, without the address list.
    auto single = net::Stream::dial("127.0.0.2:" + port, patience());
    CHECK(single.error() == ECONNREFUSED);
    CHECK_MESSAGE(!contains(single.message(), "127.0.0.2:" + port + ":"), single.message());
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); }, {1, 2});
  run_on_thread(body);
}

namespace {
// Sockets in SYN_SENT towards `to`, from /proc/net/tcp (addresses there are hex, in memory order).
int syn_sent_to(const sockaddr_in& to) {
  char want[32];
  std::snprintf(want, sizeof want, "%08X:%04X", to.sin_addr.s_addr, ntohs(to.sin_port));
  std::FILE* f = std::fopen("/proc/net/tcp", "r");
  if (f == nullptr) return -1;
  int n = 0;
  char line[512];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    char local[64], remote[64];
    unsigned state = 0;
    if (std::sscanf(line, " %*u: %63s %63s %x", local, remote, &state) == 3 && remote == std::string_view(want) &&
        state == 2) {
      ++n;
    }
  }
  std::fclose(f);
  return n;
}
}  // namespace

// Not in the case above: its subcases would run this one's seconds of waiting again.
TEST_CASE("net: dial gives each address a share of the deadline, and a cancel ends the tries") {
  auto ln = net::Listener::listen("127.0.0.1:0");
  REQUIRE_MESSAGE(ln.ok(), ln.message());
  const std::string port = std::to_string(ln->port());
  // A cancel ends the tries: the first address never answers, and the second is not tried.
  fiber::Scheduler s({.processors = 1, .name = "dial"});
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(held >= 0);
  Fd held_fd(held);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(ln->port());
  at.sin_addr.s_addr = htonl(0x7f000004);  // 127.0.0.4, the port the listener has on .1
  REQUIRE(::bind(held, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
  REQUIRE(::listen(held, 0) == 0);
  // Fill its accept queue (one connection, for a backlog of 0, and one more to be sure): the
  // kernel then drops further SYNs, as a firewall or a host that is gone would. (Linux 4.12 and
  // later; older kernels answered the SYN and dropped the handshake's last ACK instead.)
  std::vector<Fd> fillers;
  for (int i = 0; i < 2; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    REQUIRE(fd >= 0);
    fillers.emplace_back(fd);
    const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof at);
    REQUIRE((rc == 0 || errno == EINPROGRESS));
  }
  ::usleep(50'000);  // the handshakes complete (loopback): the queue is full
  const int syn_sent_before = syn_sent_to(at);
  auto h = fiber::spawn({.scheduler = &s}, [&] { return net::Stream::dial("slow.resolver.test:" + port); });
  // Cancelled once its connect to .4 is under way (its SYN unanswered), past the lookup.
  REQUIRE(wait_for([&] { return syn_sent_to(at) > syn_sent_before; }));
  h.cancel();
  auto cancelled = h.join();
  CHECK(cancelled.error() == ECANCELED);
  CHECK_MESSAGE(contains(cancelled.message(), "cancelled before the other 1 address(es)"), cancelled.message());

  // A deadline shorter than 2 s all goes to the first attempt; the second is never made.
  auto short_deadline =
      fiber::spawn({.scheduler = &s}, [&] { return net::Stream::dial("slow.resolver.test:" + port, 300ms); }).join();
  CHECK(short_deadline.error() == ETIMEDOUT);
  CHECK_MESSAGE(contains(short_deadline.message(), "127.0.0.4:" + port + ": "), short_deadline.message());
  CHECK_MESSAGE(contains(short_deadline.message(), "the deadline passed before the other 1 address(es)"),
                short_deadline.message());

  // With a deadline, each attempt gets its share of the time left, at least 2 s: the address
  // that drops SYNs gives way to the one that answers before the 4 s are up. (Once, the first
  // attempt would have had all 4 s, and the dial failed with ETIMEDOUT.)
  auto slow = fiber::spawn({.scheduler = &s}, [&] { return net::Stream::dial("slow.resolver.test:" + port, 4s); }).join();
  REQUIRE_MESSAGE(slow.ok(), slow.message());
  auto a = ln->accept(patience());
  REQUIRE_MESSAGE(a.ok(), a.message());
}

// Every abandoned lookup holds a thread of the pool fiber::blocking shares until the resolver
// answers. A dial retried in a loop against a resolver that does not answer once filled it,
// and every fiber::blocking call waited behind them.
TEST_CASE("net: lookups abandoned to a resolver that does not answer are bounded; new ones fail fast with EAGAIN") {
  HangingLookups scope;
  fiber::Scheduler s({.processors = 2, .name = "lookups"});
  fiber::spawn({.scheduler = &s}, [] {
    int timed_out = 0;
    net::Result<net::Address> r = net::resolve("ok.resolver.test:1");
    // Each gives up after 10 ms; the lookups go on, until the bound stops new ones.
    for (int i = 0; i < 100 && (r = net::resolve("hang.resolver.test:80", 10ms)).error() == ETIMEDOUT; ++i) ++timed_out;
    CHECK(timed_out == 8);
    CHECK(r.error() == EAGAIN);
    CHECK_MESSAGE(contains(r.message(), "have not finished"), r.message());
    CHECK(net::resolve("ok.resolver.test:1", patience()).error() == EAGAIN);  // any name, while they hang
    CHECK(net::resolve("127.0.0.1:1", patience()).ok());                      // numeric: no lookup
    CHECK(fiber::blocking([] { return 7; }) == 7);  // the pool still serves others
  }).join();
  REQUIRE(let_lookups_finish());
  // Once they have finished, lookups work again.
  CHECK(wait_for([&] {
    return fiber::spawn({.scheduler = &s}, [] { return net::resolve("ok.resolver.test:1", patience()).ok(); }).join();
  }));
}

// ------------------------------------------------------------------------------ signals

// On a plain thread, a signal handler installed without SA_RESTART interrupts a blocked send or
// recv with EINTR. write_all and read_exact once returned it, losing the count already moved
// (for write_all, how much reached the peer).
TEST_CASE("net: write_all and read_exact on a plain thread go on after EINTR") {
  struct sigaction sa {}, old{};
  sa.sa_handler = [](int) {};
  sa.sa_flags = 0;  // no SA_RESTART
  sigemptyset(&sa.sa_mask);
  REQUIRE(::sigaction(SIGUSR2, &sa, &old) == 0);
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  net::Stream a(sv[0]), b(sv[1]);
  const int small = 4096;
  ::setsockopt(a.fd(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  // Signals the thread until it is done, while the peer holds back.
  auto interrupt = [](pthread_t t, const std::atomic<bool>& done) {
    for (int i = 0; i < 20 && !done.load(); ++i) {
      std::this_thread::sleep_for(5ms);
      if (!done.load()) ::pthread_kill(t, SIGUSR2);
    }
  };
  // write_all: more than the socket holds, so the thread blocks (and is interrupted) until the
  // peer drains it.
  std::string data(1 << 20, '\0');
  std::mt19937 rng(11);
  for (char& c : data) c = static_cast<char>(rng());
  std::atomic<bool> done{false};
  ssize_t wrote = 0;
  std::thread writer([&] {
    wrote = a.write_all(data.data(), data.size());
    done = true;
  });
  interrupt(writer.native_handle(), done);
  std::string got(data.size(), '\0');
  CHECK(b.read_exact(got.data(), got.size(), patience()) == static_cast<ssize_t>(got.size()));
  writer.join();
  CHECK(wrote == static_cast<ssize_t>(data.size()));
  CHECK(got == data);
  // read_exact: half the bytes now, the rest after the interruptions.
  done = false;
  ssize_t read = 0;
  char buf[8] = {};
  REQUIRE(b.write_all("abcd", 4) == 4);
  std::thread reader([&] {
    read = a.read_exact(buf, sizeof buf);
    done = true;
  });
  interrupt(reader.native_handle(), done);
  REQUIRE(b.write_all("efgh", 4) == 4);
  reader.join();
  CHECK(read == 8);
  CHECK(std::string(buf, 8) == "abcdefgh");
  ::sigaction(SIGUSR2, &old, nullptr);
}

// ------------------------------------------------------------------------------ close, cancel

TEST_CASE("net: close ends an accept or a read waiting in another fiber with EBADF; cancel with ECANCELED") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    // Listener::close while another fiber accepts.
    {
      auto ln = net::Listener::listen("127.0.0.1:0");
      REQUIRE(ln.ok());
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        started = 1;
        auto a = ln->accept();
        return a.error();
      });
      let_it_park(started);
      CHECK(ln->close() == 0);
      CHECK(h.join() == EBADF);
    }
    // Stream::close while another fiber reads.
    {
      StreamPair p = stream_pair();
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        char buf[16];
        started = 1;
        return p.server.read(buf, sizeof buf);
      });
      let_it_park(started);
      CHECK(p.server.close() == 0);
      CHECK(h.join() == -EBADF);
      char c;
      CHECK(p.client.read(&c, 1, patience()) == 0);  // the peer sees the end
    }
    // A cancelled fiber's accept and read fail with ECANCELED; the listener and the stream
    // still serve another fiber.
    {
      auto ln = net::Listener::listen("127.0.0.1:0");
      REQUIRE(ln.ok());
      StreamPair p = stream_pair(*ln);
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        char buf[16];
        started = 1;
        const ssize_t r = p.server.read(buf, sizeof buf);
        auto a = ln->accept(patience());
        auto d = net::Stream::dial(loopback_str(ln->port()));
        return std::vector<ssize_t>{r, a.error(), d.error(), p.server.write_all("x", 1), p.server.read_exact(buf, 1)};
      });
      let_it_park(started);
      h.cancel();
      const std::vector<ssize_t> got = h.join();
      CHECK(got == std::vector<ssize_t>{-ECANCELED, ECANCELED, ECANCELED, -ECANCELED, -ECANCELED});
      auto other = fiber::spawn({.scheduler = &s}, [&] {
        StreamPair q = stream_pair(*ln);
        CHECK(q.client.write_all("next", 4) == 4);
        char buf[4];
        CHECK(q.server.read_exact(buf, 4, patience()) == 4);
        CHECK(p.client.write_all("more", 4) == 4);
        CHECK(p.server.read_exact(buf, 4, patience()) == 4);
        CHECK(std::string(buf, 4) == "more");
      });
      other.join();
    }
  });
}

namespace {

// Whether plain thread `tid` of this process is blocked in system call `nr` (its first field in
// /proc: the number while in a call, "running" otherwise).
bool thread_in_syscall(pid_t tid, long nr) {
  std::FILE* f = std::fopen(("/proc/self/task/" + std::to_string(tid) + "/syscall").c_str(), "r");
  if (f == nullptr) return false;
  long got = -1;
  const bool read = std::fscanf(f, "%ld", &got) == 1;
  std::fclose(f);
  return read && got == nr;
}

// Waits until a close() of `owned` has begun: a call starting then gets no number. Asked from a
// fiber of `s`, since a plain thread's call still counted when the close looks would have it
// shut the socket down.
bool close_begun(fiber::Scheduler& s, fiber::detail::OwnedFd& owned) {
  return fiber::spawn({.scheduler = &s}, [&] {
           return wait_for([&] {
             fiber::detail::OwnedFd::Use use(owned);
             return use.fd() == -1;
           });
         }).join();
}

// A call that has read the number (its Use) and not yet made its system call: a fiber of `s`
// that holds a Use of `owned` until the returned latch counts down, then runs then(number).
// Returns once the Use is held, with the fiber's handle and the latch.
template <typename F>
auto hold_call(fiber::Scheduler& s, fiber::detail::OwnedFd& owned, F then) {
  auto held = std::make_shared<std::atomic<bool>>(false);
  auto release = std::make_shared<fiber::Latch>(1);
  auto holder = fiber::spawn({.scheduler = &s}, [&owned, held, release, then] {
    fiber::detail::OwnedFd::Use use(owned);
    *held = true;
    release->wait();
    return then(use.fd());
  });
  REQUIRE(wait_for([&] { return held->load(); }));
  return std::pair{std::move(holder), release};
}

// Whether the peer of `s` sees the end of the stream within a short wait (false: still open).
bool peer_sees_end(net::Stream& s) {
  char c;
  const ssize_t r = s.read(&c, 1, 50ms);
  REQUIRE((r == 0 || r == -ETIMEDOUT));
  return r == 0;
}

}  // namespace

// A call holds the stream (OwnedFd::Use) from before it reads the descriptor number to after
// its last system call. Without that, a close() running between the read of the number and the
// call freed the number, and the call acted on whatever the kernel gave it to next.
TEST_CASE("net: close waits for a call between reading the number and using it, and later calls get EBADF") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    StreamPair p = stream_pair();
    const int fd = p.server.fd();
    fiber::detail::OwnedFd owned(p.server.release());
    auto [holder, release] = hold_call(s, owned, [fd](int number) {
      // The number is still this socket's: nothing can have reused it.
      CHECK(number == fd);
      CHECK(::send(number, "held", 4, MSG_NOSIGNAL) == 4);
    });
    std::atomic<bool> closed{false};
    auto closer = fiber::spawn({.scheduler = &s}, [&] {
      const int rc = owned.close();
      closed = true;
      return rc;
    });
    // Once close() has begun, a call starting gets no number.
    REQUIRE(close_begun(s, owned));
    fiber::this_fiber::sleep_for(20ms);
    CHECK_FALSE(closed.load());  // waiting for the holder
    CHECK_FALSE(peer_sees_end(p.client));  // and a fiber's call is not ended by a shutdown
    release->count_down();
    CHECK(closer.join() == 0);
    holder.join();
    char buf[4];
    CHECK(p.client.read_exact(buf, 4, patience()) == 4);
    CHECK(std::string(buf, 4) == "held");
    CHECK(peer_sees_end(p.client));
    CHECK(owned.get() == -1);
    CHECK(owned.close() == 0);  // again: nothing to close
  });
}

// The idiom close() is for: a reader owns the stream, another fiber closes it to stop the read,
// and the reader, seeing EBADF, destroys the stream while that close() is still finishing. The
// destructor's own close() waits for the first one, so the object outlives it (ASan would see
// a use after free otherwise) and the socket is closed when the destructor returns.
TEST_CASE("net: a reader that destroys its stream once a close ended its read waits for that close") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (int round = 0; round < 20; ++round) {
      StreamPair p = stream_pair();
      auto owned = std::make_unique<net::Stream>(std::move(p.server));
      const int server_fd = owned->fd();
      std::atomic<bool> reading{false};
      auto reader = fiber::spawn({.scheduler = &s}, [&] {
        char buf[16];
        reading = true;
        const ssize_t r = owned->read(buf, sizeof buf);
        owned.reset();
        // The number is closed by now (nothing else in this test makes descriptors meanwhile).
        const bool closed = ::fcntl(server_fd, F_GETFD) == -1 && errno == EBADF;
        return std::pair<ssize_t, bool>{r, closed};
      });
      REQUIRE(wait_for([&] { return reading.load(); }));
      fiber::this_fiber::sleep_for(1ms);
      auto closer = fiber::spawn({.scheduler = &s}, [&, stream = owned.get()] { return stream->close(); });
      const auto [r, closed] = reader.join();
      CHECK(closer.join() == 0);
      CHECK((r == -EBADF || r == 0));
      CHECK(closed);
      CHECK(peer_sees_end(p.client));
    }
  });
}

// A call counted in on a descriptor whose fd-table chunk does not exist yet, so a close finds no
// slot to mark: the close makes it, and the call that then lists itself fails with EBADF
// instead of waiting (with the close waiting for it) until data comes.
TEST_CASE("net: close of a descriptor with no fd-table slot yet still ends a call that lists itself after") {
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &lim) == 0);
  constexpr int kChunk = 1 << fiber::detail::FdTable::kChunkBits;
  int base = -1;
  for (int k = 1; static_cast<rlim_t>(k) * kChunk < lim.rlim_max && k < fiber::detail::FdTable::kChunks; ++k) {
    if (fiber::detail::fd_table().find(k * kChunk) == nullptr) {
      base = k * kChunk;
      break;
    }
  }
  if (base < 0) {
    MESSAGE("skipped: RLIMIT_NOFILE's hard limit (" << lim.rlim_max << ") leaves no fd-table chunk unused");
    return;
  }
  const rlimit raised{std::max<rlim_t>(lim.rlim_cur, std::min<rlim_t>(static_cast<rlim_t>(base) + kChunk, lim.rlim_max)), lim.rlim_max};
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &raised) == 0);
  struct Restore {
    rlimit lim;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &lim); }
  } restore{lim};
  for_each_proc_count([&](fiber::Scheduler& s, int) {
    StreamPair p = stream_pair();
    const int high = ::fcntl(p.server.fd(), F_DUPFD_CLOEXEC, base);
    REQUIRE(high >= base);
    REQUIRE(fiber::detail::fd_table().find(high) == nullptr);
    fiber::detail::OwnedFd owned(high);
    auto [holder, release] = hold_call(s, owned, [](int number) {
      char c;
      return io::read(number, &c, 1, patience());  // lists itself now: the slot is closing
    });
    auto closer = fiber::spawn({.scheduler = &s}, [&] { return owned.close(); });
    REQUIRE(close_begun(s, owned));
    fiber::this_fiber::sleep_for(5ms);
    release->count_down();
    CHECK(holder.join() == -EBADF);
    CHECK(closer.join() == 0);
    CHECK(::fcntl(high, F_GETFD) == -1);  // closed (no other thread here makes descriptors that high)
  }, {2});  // one count only: the close makes the chunk, and there are few to spare
}

TEST_CASE("net: close ends a plain thread's blocking read and accept, and returns after they do") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    // A read blocked in recv(2), without a deadline: the close shuts the socket down, which ends
    // it as if the peer had gone (close(2) alone leaves it blocked for good).
    {
      StreamPair p = stream_pair();
      std::atomic<pid_t> tid{0};
      ssize_t got = 1;
      std::thread reader([&] {
        char buf[16];
        tid = os_tid();
        got = p.server.read(buf, sizeof buf);
      });
      REQUIRE(wait_for([&] { return tid.load() != 0 && thread_in_syscall(tid.load(), SYS_recvfrom); }));
      auto h = fiber::spawn({.scheduler = &s}, [&] { return p.server.close(); });
      CHECK(h.join() == 0);
      reader.join();
      CHECK(got == 0);
      CHECK(peer_sees_end(p.client));
    }
    // An accept blocked in accept4(2): it fails with EINVAL (a listener shut down).
    {
      auto ln = net::Listener::listen("127.0.0.1:0");
      REQUIRE(ln.ok());
      std::atomic<pid_t> tid{0};
      int err = 0;
      std::thread acceptor([&] {
        tid = os_tid();
        err = ln->accept().error();
      });
      REQUIRE(wait_for([&] { return tid.load() != 0 && thread_in_syscall(tid.load(), SYS_accept4); }));
      auto h = fiber::spawn({.scheduler = &s}, [&] { return ln->close(); });
      CHECK(h.join() == 0);
      acceptor.join();
      CHECK(err == EINVAL);
    }
  });
}

// Closes racing a reader that is busy reading, each closed number handed at once to a new
// connection whose ends both send other bytes: no read may return those bytes.
TEST_CASE("net: reads racing a close never read the connection that reuses the number") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    constexpr int kRounds = 200;
    constexpr std::size_t kMine = 16 * 1024;
    auto ln = net::Listener::listen("127.0.0.1:0");
    REQUIRE(ln.ok());
    int foreign = 0;
    for (int round = 0; round < kRounds; ++round) {
      StreamPair p = stream_pair(*ln);
      REQUIRE(p.client.write_all(std::string(kMine, 'm').data(), kMine) == static_cast<ssize_t>(kMine));
      std::atomic<std::size_t> got{0};
      auto reader = fiber::spawn({.scheduler = &s}, [&] {
        char buf[16];
        std::string seen;
        ssize_t r;
        while ((r = p.server.read(buf, sizeof buf, patience())) > 0) {
          seen.append(buf, static_cast<size_t>(r));
          got.store(seen.size());
        }
        return seen;
      });
      // The closer is a plain thread, so it runs truly alongside the reader. The new
      // connection's two sockets take the lowest free numbers, the closed one among them, and
      // both ends send, so whichever took it has bytes to read.
      net::Stream dialled, accepted;
      std::thread closer([&] {
        while (got.load() == 0) std::this_thread::yield();
        p.server.close();
        if (auto d = net::Stream::dial(loopback_str(ln->port()), patience())) dialled = std::move(*d);
        if (auto a = ln->accept(patience())) accepted = std::move(*a);
        dialled.write_all("THEIRS", 6);
        accepted.write_all("THEIRS", 6);
      });
      closer.join();
      REQUIRE(dialled.is_open());
      REQUIRE(accepted.is_open());
      const std::string seen = reader.join();
      if (seen.find_first_not_of('m') != std::string::npos) ++foreign;
    }
    CHECK(foreign == 0);
  }, {1, 2});
}

// ------------------------------------------------------------------------------ EMFILE

namespace {
constexpr const char* kEmfileChild = "net: (child process) an accept loop out of descriptors";
}  // namespace

// Runs only in the child process the next test starts (skipped otherwise): it lowers
// RLIMIT_NOFILE and uses up every descriptor, which must not happen to the test process itself.
//
// UBSan's vptr check opens a pipe whenever its cache of checked types misses (cache slots are
// shared by hash, so a miss can come at any time), and reports a false "invalid vptr" when the
// pipe cannot be made. So every fiber here has run, and every type been checked, before the
// table is full; while it is full only the accept loop's back-off runs; and in that build the
// recovery frees every descriptor, where the others free just two and let the rest trickle in.
TEST_CASE("net: (child process) an accept loop out of descriptors" * doctest::skip()) {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    auto ln = net::Listener::listen("127.0.0.1:0");
    REQUIRE(ln.ok());
    const sockaddr_in addr = loopback(ln->port());
    std::atomic<int> backoffs{0};
    std::atomic<int> echoed{0};
    // The accept loop, and a client fiber per socket in `socks` (made beforehand: connecting
    // one needs no new descriptor). Each waits at `gate` once it has run; `shut` runs when all
    // have arrived, then the gate opens and `meanwhile` runs.
    auto run = [&](std::vector<Fd>& socks, const std::function<void()>& shut, const std::function<void()>& meanwhile) {
      fiber::WaitGroup gate;
      gate.add(1);
      std::atomic<int> arrived{0};
      auto acceptor = fiber::spawn({.scheduler = &s}, [&] {
        arrived.fetch_add(1);
        gate.wait();
        accept_loop(*ln, static_cast<int>(socks.size()), backoffs);
      });
      std::vector<fiber::JoinHandle<void>> clients;
      for (size_t i = 0; i < socks.size(); ++i) {
        clients.push_back(fiber::spawn({.scheduler = &s}, [&, i] {
          arrived.fetch_add(1);
          gate.wait();
          REQUIRE(io::connect(socks[i].get(), sa(addr), sizeof addr, patience()) == 0);  // queued in the kernel
          net::Stream conn(socks[i].release());
          echo_roundtrip(conn, 90 + i, 10'000);
          echoed.fetch_add(1);
        }));
      }
      REQUIRE(wait_for([&] { return arrived.load() == static_cast<int>(socks.size()) + 1; }, patience()));
      shut();
      gate.done();
      meanwhile();
      clients.push_back(std::move(acceptor));  // joined last, failures or not
      join_all(clients);
    };
    // Once with descriptors to spare, so that nothing runs for the first time with none left.
    std::vector<Fd> socks(1);
    socks[0] = tcp_socket();
    run(socks, [] {}, [] {});
    REQUIRE(echoed.load() == 1);
    echoed = 0;
    backoffs = 0;

    constexpr int kClients = 6;
    socks.clear();
    for (int i = 0; i < kClients; ++i) socks.push_back(tcp_socket());
    std::vector<int> filler;
    {
      // Room for a few more descriptors only; then take them all.
      FdLimit limit(static_cast<rlim_t>(highest_open_fd() + 1 + 16));
      auto take_all = [&] {
        for (;;) {
          const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          if (fd < 0) {
            REQUIRE(errno == EMFILE);
            break;
          }
          filler.push_back(fd);
        }
        REQUIRE(filler.size() >= static_cast<size_t>(kClients) + 2);
      };
      run(socks, take_all, [&] {
        // Every connection waits in the queue while accept fails: the loop backs off, again
        // and again.
        REQUIRE(wait_for([&] { return backoffs.load() >= 3; }, patience()));
        CHECK(echoed.load() == 0);
        // Two descriptors free (every one under UBSan): connections are accepted (and, as
        // clients finish and close, the rest too).
#if FIBER_ASAN
        const size_t keep = 0;
#else
        const size_t keep = filler.size() - 2;
#endif
        while (filler.size() > keep) {
          ::close(filler.back());
          filler.pop_back();
        }
      });
      CHECK(echoed.load() == kClients);
      for (int fd : filler) ::close(fd);
    }
    // Report to the parent which runs finished.
    std::printf("processors=%d backoffs=%d\n", n, backoffs.load());
    std::fflush(stdout);
  });
}

TEST_CASE("net: an accept loop backs off on EMFILE and accepts again once descriptors are free") {
  // In a child process (this test binary, running only the test above), so that the lowered
  // descriptor limit and the exhausted descriptor table never touch this process.
  const RunResult r = run_test_case(kEmfileChild);
  INFO("the child's status " << r.status << "; its stdout:\n" << r.out << "\nits stderr:\n" << r.err);
  CHECK(r.status == 0);
  for (int n : kProcCounts) CHECK(contains(r.out, "processors=" + std::to_string(n) + " "));
}

// ------------------------------------------------------------------------------ many connections

TEST_CASE("net: 1000 concurrent connections to an echo server, every byte checked") {
  int clients = kTsan ? 250 : 1000;
  // Two descriptors a connection, and some to spare.
  const rlim_t need = static_cast<rlim_t>(2 * clients + 256);
  FdLimit limit(std::max(need, FdLimit::soft()));
  if (FdLimit::soft() < need) {
    clients = static_cast<int>((FdLimit::soft() - 256) / 2);
    MESSAGE("RLIMIT_NOFILE allows only " << clients << " connections");
  }
  REQUIRE(clients > 0);
  for_each_proc_count([clients](fiber::Scheduler& s, int) {
    auto ln = net::Listener::listen("127.0.0.1:0");
    REQUIRE(ln.ok());
    const std::string where = loopback_str(ln->port());
    std::atomic<int> backoffs{0};
    std::atomic<int> done{0};
    fiber::Latch all_connected(clients);
    auto acceptor = fiber::spawn({.scheduler = &s}, [&] { accept_loop(*ln, clients, backoffs); });
    std::vector<fiber::JoinHandle<void>> hs;
    hs.reserve(static_cast<size_t>(clients));
    for (int i = 0; i < clients; ++i) {
      hs.push_back(fiber::spawn({.scheduler = &s}, [&, i] {
        auto c = net::Stream::dial(where, patience());
        REQUIRE_MESSAGE(c.ok(), c.message());
        // All of them connected at once before any talks.
        all_connected.count_down();
        REQUIRE(all_connected.wait_for(patience()));
        echo_roundtrip(*c, 1000 + static_cast<uint64_t>(i), 1 + (static_cast<size_t>(i) * 7919) % 20'000);
        echo_roundtrip(*c, 5000 + static_cast<uint64_t>(i), 100);
        done.fetch_add(1);
      }));
    }
    hs.push_back(std::move(acceptor));  // joined last, failures or not
    join_all(hs);
    CHECK(done.load() == clients);
    CHECK(backoffs.load() == 0);
  });
}
