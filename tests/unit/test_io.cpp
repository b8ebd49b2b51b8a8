// fiber::io (fiber/io.hpp) on real descriptors - loopback TCP sockets, pipes, a temporary file -
// from fibers at 1, 2, 4 and 8 processors and from plain threads: partial transfers and end of
// stream; 64 MiB each way verified byte for byte; a peer that is gone (EPIPE/ECONNRESET, never
// SIGPIPE); deadlines that pass, that are already past, and that race the data; cancellation;
// io::close while other fibers wait, and a closed number reused at once; regular files; bad
// arguments; pipes and non-blocking sockets (inside a fiber a call waits either way); races and
// limits: two waiters woken for one connection or byte, lengths beyond 32 bits, pread on streams,
// MSG_WAITALL, descriptors epoll cannot watch, poll after a lost race, io::close and the
// blocking pool.
//
// The engine is chosen per process (FIBER_IO), so CI runs the whole suite twice: as is
// (io_uring) and with FIBER_IO=epoll. Every test here must pass on both.
//
// Deadlines are never checked against a stopwatch: a call that must time out has to return
// -ETIMEDOUT, and not before its deadline; a call that must succeed gets a generous deadline
// (patience()) so that a bug fails it instead of hanging the suite.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "io/blocking_pool.hpp"  // the pool's state, for the test of io::close and queued file calls
#include "io/fd_table.hpp"
#include "io/poller.hpp"
#include "io_util.hpp"
#include "sched/processor.hpp"
#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;
namespace io = fiber::io;

constexpr size_t kMiB = size_t{1} << 20;

// Waits until a fiber has said it is about to block, then gives it a moment to park (not
// required for correctness: a cancel or close that comes first must have the same outcome).
void let_it_park(const std::atomic<int>& started, int count = 1) {
  REQUIRE(wait_for([&] { return started.load() >= count; }));
  fiber::this_fiber::sleep_for(20ms);
}

// SIGPIPE's default action (the process dies) and unblocked in this thread - and so in the
// threads it starts - for a scope, whatever the harness had set.
class DefaultSigpipe {
 public:
  DefaultSigpipe() {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    REQUIRE(::sigaction(SIGPIPE, &dfl, &old_action_) == 0);
    sigset_t pipe_only;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    REQUIRE(::pthread_sigmask(SIG_UNBLOCK, &pipe_only, &old_mask_) == 0);
  }
  ~DefaultSigpipe() {
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    ::sigaction(SIGPIPE, &old_action_, nullptr);
  }
  DefaultSigpipe(const DefaultSigpipe&) = delete;
  DefaultSigpipe& operator=(const DefaultSigpipe&) = delete;

 private:
  struct sigaction old_action_ {};
  sigset_t old_mask_{};
};

// The four ways to write to a socket, and the four ways to read one.
enum class WriteCall { write, send, writev, sendmsg };
enum class ReadCall { read, recv, readv, recvmsg };
constexpr WriteCall kWriteCalls[] = {WriteCall::write, WriteCall::send, WriteCall::writev, WriteCall::sendmsg};
constexpr ReadCall kReadCalls[] = {ReadCall::read, ReadCall::recv, ReadCall::readv, ReadCall::recvmsg};

const char* name_of(WriteCall c) {
  switch (c) {
    case WriteCall::write: return "write";
    case WriteCall::send: return "send";
    case WriteCall::writev: return "writev";
    case WriteCall::sendmsg: return "sendmsg";
  }
  return "?";
}
const char* name_of(ReadCall c) {
  switch (c) {
    case ReadCall::read: return "read";
    case ReadCall::recv: return "recv";
    case ReadCall::readv: return "readv";
    case ReadCall::recvmsg: return "recvmsg";
  }
  return "?";
}

// The vectored forms split the buffer in two.
ssize_t do_write(WriteCall c, int fd, const void* buf, size_t n, io::Deadline dl = {}) {
  auto* p = static_cast<char*>(const_cast<void*>(buf));
  iovec iov[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = 2;
  switch (c) {
    case WriteCall::write: return io::write(fd, buf, n, dl);
    case WriteCall::send: return io::send(fd, buf, n, 0, dl);
    case WriteCall::writev: return io::writev(fd, iov, 2, dl);
    case WriteCall::sendmsg: return io::sendmsg(fd, &m, 0, dl);
  }
  return -ENOSYS;
}

ssize_t do_read(ReadCall c, int fd, void* buf, size_t n, io::Deadline dl = {}) {
  auto* p = static_cast<char*>(buf);
  iovec iov[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = 2;
  switch (c) {
    case ReadCall::read: return io::read(fd, buf, n, dl);
    case ReadCall::recv: return io::recv(fd, buf, n, 0, dl);
    case ReadCall::readv: return io::readv(fd, iov, 2, dl);
    case ReadCall::recvmsg: return io::recvmsg(fd, &m, 0, dl);
  }
  return -ENOSYS;
}

// Sends `n` bytes of stream `seed` from this thread or fiber into `from` while a new fiber on
// `s` reads them from `to`: every byte must arrive, in order, and nothing else before it.
void expect_transfer(fiber::Scheduler& s, int from, int to, uint64_t seed, size_t n = 64 * 1024) {
  auto reader = fiber::spawn({.scheduler = &s}, [to, seed, n] {
    std::vector<uint8_t> got(n);
    const ssize_t r = read_fully(to, got.data(), n, patience());
    CHECK(r == static_cast<ssize_t>(n));
    if (r > 0) CHECK(pattern_mismatch(seed, 0, got.data(), static_cast<size_t>(r)) == kAllMatch);
  });
  std::vector<uint8_t> data(n);
  fill_pattern(seed, 0, data.data(), n);
  CHECK(write_fully(from, data.data(), n, patience()) == static_cast<ssize_t>(n));
  reader.join();
}

// Fills the send buffer of `fd` (whose peer does not read) until even a 1-byte write with a
// short deadline times out (a socket reports room for a write only once a good part of its
// buffer is free, but a small write may still fit before that). Returns the bytes that went in,
// all 0x5a.
size_t fill_until_full(int fd) {
  std::vector<uint8_t> chunk(64 * 1024, 0x5a);
  size_t total = 0;
  size_t n = chunk.size();
  for (int i = 0; i < 100'000; ++i) {
    const ssize_t r = io::write(fd, chunk.data(), n, 10ms);
    if (r == -ETIMEDOUT) {
      if (n == 1) return total;
      n /= 2;
      continue;
    }
    REQUIRE(r > 0);
    total += static_cast<size_t>(r);
  }
  FAIL("the send buffer never filled up");
  return total;
}

}  // namespace

// ------------------------------------------------------------------------------ partial transfers

TEST_CASE("io: a small read buffer gets a message in pieces, and reads return 0 at end of stream") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where writer : kBoth) {
      for (Where reader : kBoth) {
        CAPTURE(where_name(writer));
        CAPTURE(where_name(reader));
        constexpr size_t kLen = 1000;
        constexpr size_t kPiece = 7;
        Team team;
        SocketPair p = tcp_pair();
        team.spawn(writer, s, [&] {
          std::vector<uint8_t> msg(kLen);
          fill_pattern(1, 0, msg.data(), kLen);
          // In four writes with pauses, so some reads find less than a piece waiting.
          for (size_t off = 0; off < kLen; off += kLen / 4) {
            CHECK(write_fully(p.a.get(), msg.data() + off, kLen / 4) == static_cast<ssize_t>(kLen / 4));
            fiber::this_fiber::sleep_for(1ms);
          }
          REQUIRE(::shutdown(p.a.get(), SHUT_WR) == 0);
        });
        team.spawn(reader, s, [&] {
          uint8_t buf[kPiece];
          size_t got = 0;
          size_t pieces = 0;
          for (;;) {
            // Every read form, with and without a deadline (a thread with one polls first).
            const ReadCall call = kReadCalls[pieces % 4];
            const io::Deadline dl = pieces % 3 == 0 ? io::Deadline(patience()) : io::Deadline();
            const ssize_t r = do_read(call, p.b.get(), buf, kPiece, dl);
            REQUIRE_MESSAGE(r >= 0, name_of(call));
            if (r == 0) break;
            CHECK(static_cast<size_t>(r) <= kPiece);
            REQUIRE(pattern_mismatch(1, got, buf, static_cast<size_t>(r)) == kAllMatch);
            got += static_cast<size_t>(r);
            ++pieces;
          }
          CHECK(got == kLen);
          CHECK(pieces >= kLen / kPiece);
          // End of stream stays: every read form keeps returning 0.
          for (ReadCall c : kReadCalls) {
            CHECK_MESSAGE(do_read(c, p.b.get(), buf, kPiece) == 0, name_of(c));
            CHECK_MESSAGE(do_read(c, p.b.get(), buf, kPiece, patience()) == 0, name_of(c));
          }
        });
        team.join();
      }
    }
  });
}

TEST_CASE("io: writes to a socket with a tiny send buffer come back short; a write loop delivers every byte") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where writer : kBoth) {
      for (Where reader : kBoth) {
        CAPTURE(where_name(writer));
        CAPTURE(where_name(reader));
        const size_t kLen = 4 * kMiB;
        SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096});
        std::vector<uint8_t> data(kLen);
        fill_pattern(2, 0, data.data(), kLen);
        std::atomic<bool> may_read{false};
        Team team;
        team.spawn(writer, s, [&] {
          // Nobody reads yet: a write of 1 MiB takes what fits and returns that count rather
          // than waiting for room for the rest (a plain thread needs a deadline for that: without
          // one it makes the blocking system call, which sends everything).
          const io::Deadline dl = writer == Where::thread ? io::Deadline(patience()) : io::Deadline();
          size_t sent = 0;
          int short_writes = 0;
          ssize_t r = io::write(p.a.get(), data.data(), kMiB, dl);
          REQUIRE(r > 0);
          CHECK(static_cast<size_t>(r) < kMiB);
          sent += static_cast<size_t>(r);
          ++short_writes;
          // Again, with send: what came free meanwhile, if anything, else ETIMEDOUT.
          r = io::send(p.a.get(), data.data() + sent, kMiB, 0, 50ms);
          if (r != -ETIMEDOUT) {
            REQUIRE(r > 0);
            CHECK(static_cast<size_t>(r) < kMiB);
            sent += static_cast<size_t>(r);
            ++short_writes;
          }
          may_read = true;
          // Now a loop of writes, short ones included, delivers the rest.
          size_t calls = 0;
          while (sent < kLen) {
            const size_t want = std::min(kLen - sent, kMiB);
            const WriteCall c = kWriteCalls[calls++ % 4];
            const ssize_t r = do_write(c, p.a.get(), data.data() + sent, want, calls % 2 ? io::Deadline(patience()) : io::Deadline());
            REQUIRE_MESSAGE(r > 0, name_of(c));
            if (static_cast<size_t>(r) < want) ++short_writes;
            sent += static_cast<size_t>(r);
          }
          CHECK(sent == kLen);
          CHECK(short_writes >= 1);
          REQUIRE(::shutdown(p.a.get(), SHUT_WR) == 0);
        });
        team.spawn(reader, s, [&] {
          REQUIRE(wait_for([&] { return may_read.load(); }, patience()));
          std::vector<uint8_t> buf(1000);
          size_t got = 0;
          for (;;) {
            const ssize_t r = io::read(p.b.get(), buf.data(), buf.size(), patience());
            REQUIRE(r >= 0);
            if (r == 0) break;
            REQUIRE(pattern_mismatch(2, got, buf.data(), static_cast<size_t>(r)) == kAllMatch);
            got += static_cast<size_t>(r);
          }
          CHECK(got == kLen);
        });
        team.join();
      }
    }
  });
}

// ------------------------------------------------------------------------------ large transfers

TEST_CASE("io: 64 MiB each way at once, between fibers and between a fiber and a thread, byte for byte") {
  const size_t len = kTsan ? 4 * kMiB : (kSanitized ? 16 * kMiB : 64 * kMiB);
  for_each_proc_count([len](fiber::Scheduler& s, int) {
    for (Where far : kBoth) {
      CAPTURE(where_name(far));
      SocketPair p = tcp_pair();
      // Writes of random sizes, alternating write and writev, then end of stream.
      auto pump = [len](int fd, uint64_t seed) {
        std::mt19937 rng(static_cast<unsigned>(seed));
        std::vector<uint8_t> buf(256 * 1024);
        size_t off = 0;
        int i = 0;
        while (off < len) {
          const size_t n = std::min<size_t>(len - off, 1 + rng() % buf.size());
          fill_pattern(seed, off, buf.data(), n);
          const WriteCall c = (i++ % 2) ? WriteCall::writev : WriteCall::write;
          size_t done = 0;
          while (done < n) {
            const ssize_t r = do_write(c, fd, buf.data() + done, n - done);
            REQUIRE(r > 0);
            done += static_cast<size_t>(r);
          }
          off += n;
          fiber::this_fiber::yield();  // share the processor (a socket with room never parks)
        }
        REQUIRE(::shutdown(fd, SHUT_WR) == 0);
      };
      // Reads of random sizes, alternating read and recv, checking every byte, until the end.
      auto drain = [len](int fd, uint64_t seed) {
        std::mt19937 rng(static_cast<unsigned>(seed * 7));
        std::vector<uint8_t> buf(256 * 1024);
        size_t off = 0;
        int i = 0;
        for (;;) {
          const size_t n = 1 + rng() % buf.size();
          const ssize_t r = do_read((i++ % 2) ? ReadCall::recv : ReadCall::read, fd, buf.data(), n);
          REQUIRE(r >= 0);
          if (r == 0) break;
          const size_t bad = pattern_mismatch(seed, off, buf.data(), static_cast<size_t>(r));
          if (bad != kAllMatch) FAIL("stream " << seed << ": wrong byte at offset " << off + bad);
          off += static_cast<size_t>(r);
          fiber::this_fiber::yield();
        }
        CHECK(off == len);
      };
      Team team;
      team.spawn(Where::fiber, s, [&] { pump(p.a.get(), 11); });
      team.spawn(Where::fiber, s, [&] { drain(p.a.get(), 12); });
      team.spawn(far, s, [&] { pump(p.b.get(), 12); });
      team.spawn(far, s, [&] { drain(p.b.get(), 11); });
      team.join();
    }
  });
}

// ------------------------------------------------------------------------------ peer gone

TEST_CASE("io: writing to a socket whose peer is gone fails with EPIPE or ECONNRESET and raises no SIGPIPE") {
  DefaultSigpipe sigpipe_kills;  // a SIGPIPE would end the whole test run here
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      // The peer closed normally: the first write may still go out (the peer's RST answers
      // it); a later one fails, and so does every one after it. Within 5 s, not 1000 writes:
      // when the peer's answer to the first segment is not an RST, Nagle holds the next ones
      // until the retransmission timer (200 ms or more) resends it, and a plain thread's 1000
      // sleeps of 100 us ended before that about one run in ten (57b530a too).
      for (WriteCall c : kWriteCalls) {
        CAPTURE(name_of(c));
        SocketPair p = tcp_pair();
        p.b.reset();
        Team team;
        team.spawn(w, s, [&] {
          ssize_t r = 0;
          const auto give_up = std::chrono::steady_clock::now() + 5s;
          while (std::chrono::steady_clock::now() < give_up) {
            r = do_write(c, p.a.get(), "ping", 4);
            if (r < 0) break;
            CHECK(r == 4);
            fiber::this_fiber::sleep_for(100us);
          }
          CHECK_MESSAGE((r == -EPIPE || r == -ECONNRESET), std::string(name_of(c)) << " from a " << where_name(w)
                                                                << ": the last write returned " << r
                                                                << "; TCP state " << tcp_state(p.a.get()));
          for (WriteCall again : kWriteCalls) {
            r = do_write(again, p.a.get(), "ping", 4);
            CHECK_MESSAGE((r == -EPIPE || r == -ECONNRESET), std::string(name_of(again)) << " returned " << r);
            r = do_write(again, p.a.get(), "ping", 4, patience());
            CHECK_MESSAGE((r == -EPIPE || r == -ECONNRESET),
                          std::string(name_of(again)) << " (with a deadline) returned " << r);
          }
        });
        team.join();
      }
      // A writer waiting on a full send buffer when the peer goes away (closing with unread
      // data, so it sends an RST): the waiting write, or the next, fails.
      {
        SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096});
        std::atomic<int> started{0};
        Team team;
        team.spawn(w, s, [&] {
          std::vector<uint8_t> big(kMiB, 0x11);
          started = 1;
          ssize_t r;
          do {
            r = io::write(p.a.get(), big.data(), big.size());
          } while (r > 0);
          CHECK((r == -EPIPE || r == -ECONNRESET));
        });
        let_it_park(started);
        p.b.reset();
        team.join();
      }
    }
  });
}

TEST_CASE("io: once the peer resets the connection, reads fail with ECONNRESET") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      for (ReadCall c : kReadCalls) {
        CAPTURE(where_name(w));
        CAPTURE(name_of(c));
        // The RST arrived before the read.
        {
          SocketPair p = tcp_pair();
          close_with_reset(p.b);
          Team team;
          team.spawn(w, s, [&] {
            char buf[64];
            CHECK(do_read(c, p.a.get(), buf, sizeof buf) == -ECONNRESET);
            const ssize_t r = io::write(p.a.get(), "x", 1);
            CHECK((r == -EPIPE || r == -ECONNRESET));
          });
          team.join();
        }
        // The RST arrives while the read waits (with a deadline on every other call form).
        {
          SocketPair p = tcp_pair();
          std::atomic<int> started{0};
          Team team;
          team.spawn(w, s, [&] {
            char buf[64];
            started = 1;
            const io::Deadline dl = (c == ReadCall::recv || c == ReadCall::readv) ? io::Deadline(patience()) : io::Deadline();
            CHECK(do_read(c, p.a.get(), buf, sizeof buf, dl) == -ECONNRESET);
          });
          let_it_park(started);
          close_with_reset(p.b);
          team.join();
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------ deadlines

TEST_CASE("io: a deadline that passes ends read, recv, accept, connect and write with ETIMEDOUT; the next call works") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      Team team;
      team.spawn(w, s, [&] {
        // Returns -ETIMEDOUT, and not before its deadline.
        auto expect_timeout = [](const char* what, auto&& call) {
          const auto at = Clock::now() + 20ms;
          const auto r = call(io::Deadline(at));
          CHECK_MESSAGE(r == -ETIMEDOUT, what);
          CHECK_MESSAGE(Clock::now() >= at, what);
        };
        SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096});
        char buf[64];
        uint64_t seed = 100;
        // Nothing to read; afterwards the socket still works both ways.
        for (ReadCall c : kReadCalls) {
          expect_timeout(name_of(c), [&](io::Deadline dl) { return do_read(c, p.a.get(), buf, sizeof buf, dl); });
          expect_transfer(s, p.b.get(), p.a.get(), ++seed, 1000);
          expect_transfer(s, p.a.get(), p.b.get(), ++seed, 1000);
        }
        // Nothing to accept; then a connection is accepted.
        Fd ln = tcp_listener();
        const sockaddr_in ln_addr = loopback(local_port(ln.get()));
        expect_timeout("accept", [&](io::Deadline dl) { return io::accept(ln.get(), nullptr, nullptr, 0, dl); });
        {
          Fd c = tcp_socket();
          CHECK(io::connect(c.get(), sa(ln_addr), sizeof ln_addr, patience()) == 0);
          Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
          CHECK(conn.get() >= 0);
          expect_transfer(s, c.get(), conn.get(), ++seed, 1000);
        }
        // A connect that cannot complete (the listener's queue is full): its connection goes on
        // in the background (see "connect again after a deadline passed"); a new socket connects.
        {
          FullListener full = full_listener();
          Fd c = tcp_socket();
          expect_timeout("connect", [&](io::Deadline dl) { return io::connect(c.get(), sa(full.addr), sizeof full.addr, dl); });
          Fd c2 = tcp_socket();
          CHECK(io::connect(c2.get(), sa(ln_addr), sizeof ln_addr, patience()) == 0);
          Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
          CHECK(conn.get() >= 0);
          expect_transfer(s, conn.get(), c2.get(), ++seed, 1000);
        }
        // No room to write (the peer does not read); then the peer reads and writes work.
        const size_t filled = fill_until_full(p.a.get());
        CHECK(filled > 0);
        for (WriteCall c : kWriteCalls) {
          expect_timeout(name_of(c), [&](io::Deadline dl) { return do_write(c, p.a.get(), buf, sizeof buf, dl); });
        }
        std::vector<uint8_t> sink(filled);
        CHECK(read_fully(p.b.get(), sink.data(), filled, patience()) == static_cast<ssize_t>(filled));
        CHECK(std::all_of(sink.begin(), sink.end(), [](uint8_t b) { return b == 0x5a; }));  // only the filler
        expect_transfer(s, p.a.get(), p.b.get(), ++seed);
      });
      team.join();
    }
  });
}

TEST_CASE("io: a deadline already past fails at once with ETIMEDOUT and consumes nothing") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where w : kBoth) {
      CAPTURE(where_name(w));
      Team team;
      team.spawn(w, s, [&] {
        SocketPair p = tcp_pair();
        Fd ln = tcp_listener();
        const sockaddr_in ln_addr = loopback(local_port(ln.get()));
        Fd pending = tcp_socket();
        connect_now(pending.get(), ln_addr);  // a connection waiting to be accepted
        CHECK(io::write(p.b.get(), "hello", 5) == 5);  // data waiting to be read
        REQUIRE(wait_for([&] {
          char c;
          return ::recv(p.a.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) == 1;
        }));
        char buf[64];
        for (const io::Deadline past : {io::Deadline(Clock::now() - 1s), io::Deadline(0ms), io::Deadline(-5ms),
                                         io::Deadline(Clock::now())}) {
          CHECK(past.expired());
          for (ReadCall c : kReadCalls) {
            CHECK_MESSAGE(do_read(c, p.a.get(), buf, sizeof buf, past) == -ETIMEDOUT, name_of(c));
          }
          for (WriteCall c : kWriteCalls) {
            CHECK_MESSAGE(do_write(c, p.a.get(), "XXXX", 4, past) == -ETIMEDOUT, name_of(c));
          }
          CHECK(io::accept(ln.get(), nullptr, nullptr, 0, past) == -ETIMEDOUT);
          Fd c = tcp_socket();
          CHECK(io::connect(c.get(), sa(ln_addr), sizeof ln_addr, past) == -ETIMEDOUT);
          sockaddr_in peer{};
          socklen_t len = sizeof peer;
          CHECK(::getpeername(c.get(), reinterpret_cast<sockaddr*>(&peer), &len) == -1);  // never connected
        }
        // Everything is still there: the data, the pending connection; nothing was written.
        CHECK(read_fully(p.a.get(), buf, 5, patience()) == 5);
        CHECK(std::string(buf, 5) == "hello");
        CHECK(io::recv(p.a.get(), buf, sizeof buf, MSG_DONTWAIT) == -EAGAIN);
        CHECK(io::recv(p.b.get(), buf, sizeof buf, MSG_DONTWAIT) == -EAGAIN);
        Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
        REQUIRE(conn.get() >= 0);
        expect_transfer(s, pending.get(), conn.get(), 7, 1000);
        CHECK(io::accept(ln.get(), nullptr, nullptr, 0, 10ms) == -ETIMEDOUT);  // there was only one
      });
      team.join();
    }
  });
}

TEST_CASE("io: deadlines racing the data: each read gets data or ETIMEDOUT, and no byte is lost or duplicated") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where rw : kBoth) {
      CAPTURE(where_name(rw));
      const int rounds = kTsan ? 300 : (kSanitized ? 800 : 2000);
      SocketPair p = tcp_pair();
      std::atomic<uint64_t> sent{0};
      std::atomic<bool> sender_done{false};
      int timeouts = 0;
      int with_data = 0;
      uint64_t received = 0;
      Team team;
      team.spawn(Where::fiber, s, [&] {
        std::mt19937 rng(3);
        uint8_t chunk[64];
        uint64_t off = 0;
        for (int i = 0; i < rounds; ++i) {
          // The data lands before, about at, or after the reader's deadline.
          switch (rng() % 4) {
            case 0: break;
            case 1: fiber::this_fiber::yield(); break;
            default: fiber::this_fiber::sleep_for(std::chrono::microseconds(rng() % 300)); break;
          }
          const size_t n = 1 + rng() % sizeof chunk;
          fill_pattern(5, off, chunk, n);
          REQUIRE(write_fully(p.a.get(), chunk, n) == static_cast<ssize_t>(n));
          off += n;
        }
        sent = off;
        sender_done = true;
      });
      team.spawn(rw, s, [&] {
        std::mt19937 rng(4);
        uint8_t buf[256];
        // One read per round with a short deadline (sometimes zero): data or ETIMEDOUT only.
        for (int i = 0; i < rounds; ++i) {
          const auto dl = std::chrono::microseconds(rng() % 250);
          const ReadCall c = kReadCalls[i % 4];
          const size_t want = 1 + rng() % sizeof buf;
          const ssize_t r = do_read(c, p.b.get(), buf, want, dl);
          if (r == -ETIMEDOUT) {
            ++timeouts;
            continue;
          }
          REQUIRE_MESSAGE(r > 0, name_of(c));
          REQUIRE(pattern_mismatch(5, received, buf, static_cast<size_t>(r)) == kAllMatch);
          received += static_cast<uint64_t>(r);
          ++with_data;
        }
        // Then drain the rest: the total must match exactly.
        REQUIRE(wait_for([&] { return sender_done.load(); }, patience()));
        while (received < sent.load()) {
          const ssize_t r = io::read(p.b.get(), buf, sizeof buf, patience());
          REQUIRE(r > 0);
          REQUIRE(pattern_mismatch(5, received, buf, static_cast<size_t>(r)) == kAllMatch);
          received += static_cast<uint64_t>(r);
        }
        // Nothing more: no byte was delivered twice.
        CHECK(io::recv(p.b.get(), buf, sizeof buf, MSG_DONTWAIT) == -EAGAIN);
      });
      team.join();
      INFO(with_data << " reads got data, " << timeouts << " timed out");
      CHECK(received == sent.load());
    }
  });
}

// ------------------------------------------------------------------------------ cancellation

TEST_CASE("io: cancelling a fiber blocked in read, accept, connect or write ends the call with ECANCELED") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    // A reader: its later calls fail too; no half-withdrawn read is left to steal data.
    {
      SocketPair p = tcp_pair();
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        char buf[64];
        std::vector<ssize_t> r;
        started = 1;
        r.push_back(io::read(p.b.get(), buf, sizeof buf));
        r.push_back(io::read(p.b.get(), buf, sizeof buf));
        r.push_back(io::recv(p.b.get(), buf, sizeof buf, 0, patience()));
        r.push_back(io::write(p.b.get(), "x", 1));
        r.push_back(io::send(p.b.get(), "x", 1, 0));
        return r;
      });
      let_it_park(started);
      h.cancel();
      for (ssize_t r : h.join()) CHECK(r == -ECANCELED);
      char c;
      CHECK(io::recv(p.a.get(), &c, 1, MSG_DONTWAIT) == -EAGAIN);  // the cancelled writes sent nothing
      expect_transfer(s, p.a.get(), p.b.get(), 21);
      expect_transfer(s, p.b.get(), p.a.get(), 22);
    }
    // An acceptor: afterwards another fiber accepts the next connection.
    {
      Fd ln = tcp_listener();
      const sockaddr_in addr = loopback(local_port(ln.get()));
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        std::vector<ssize_t> r;
        started = 1;
        r.push_back(io::accept(ln.get(), nullptr, nullptr));
        r.push_back(io::accept(ln.get(), nullptr, nullptr, 0, patience()));
        Fd c = tcp_socket();
        r.push_back(io::connect(c.get(), sa(addr), sizeof addr));
        return r;
      });
      let_it_park(started);
      h.cancel();
      for (ssize_t r : h.join()) CHECK(r == -ECANCELED);
      auto acceptor = fiber::spawn({.scheduler = &s}, [&] { return io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()); });
      Fd client = tcp_socket();
      connect_now(client.get(), addr);
      Fd conn(acceptor.join());
      REQUIRE(conn.get() >= 0);
      expect_transfer(s, client.get(), conn.get(), 23);
    }
    // A connector (to a listener whose queue is full, so the connect stays in progress).
    {
      FullListener full = full_listener();
      Fd ln = tcp_listener();
      const sockaddr_in addr = loopback(local_port(ln.get()));
      Fd c = tcp_socket();
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        std::vector<ssize_t> r;
        started = 1;
        r.push_back(io::connect(c.get(), sa(full.addr), sizeof full.addr));
        Fd c2 = tcp_socket();
        r.push_back(io::connect(c2.get(), sa(addr), sizeof addr, patience()));
        return r;
      });
      let_it_park(started);
      h.cancel();
      for (ssize_t r : h.join()) CHECK(r == -ECANCELED);
      CHECK(io::accept(ln.get(), nullptr, nullptr, 0, 10ms) == -ETIMEDOUT);  // the second never connected
      // Another fiber connects fine.
      auto connector = fiber::spawn({.scheduler = &s}, [&] {
        Fd c3 = tcp_socket();
        CHECK(io::connect(c3.get(), sa(addr), sizeof addr, patience()) == 0);
        return c3.release();
      });
      Fd c3(connector.join());
      Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
      REQUIRE(conn.get() >= 0);
      expect_transfer(s, c3.get(), conn.get(), 24);
    }
    // A writer waiting for room: what the peer receives is exactly what the writes reported.
    {
      SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096});
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        std::vector<uint8_t> chunk(256 * 1024);
        uint64_t off = 0;
        started = 1;
        ssize_t r;
        for (;;) {
          fill_pattern(25, off, chunk.data(), chunk.size());
          r = io::write(p.a.get(), chunk.data(), chunk.size());
          if (r <= 0) break;
          off += static_cast<uint64_t>(r);
        }
        CHECK(r == -ECANCELED);
        CHECK(io::write(p.a.get(), chunk.data(), chunk.size()) == -ECANCELED);
        // close still works in a cancelled fiber.
        CHECK(io::close(p.a.release()) == 0);
        return off;
      });
      let_it_park(started);
      h.cancel();
      const uint64_t reported = h.join();
      std::vector<uint8_t> buf(64 * 1024);
      uint64_t got = 0;
      for (;;) {
        const ssize_t r = io::read(p.b.get(), buf.data(), buf.size(), patience());
        REQUIRE(r >= 0);
        if (r == 0) break;
        REQUIRE(pattern_mismatch(25, got, buf.data(), static_cast<size_t>(r)) == kAllMatch);
        got += static_cast<uint64_t>(r);
      }
      CHECK(got == reported);
    }
  });
}

// ------------------------------------------------------------------------------ close

TEST_CASE("io: io::close ends the waits of other fibers on the descriptor with EBADF; closing again gives EBADF") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where closer : kBoth) {
      CAPTURE(where_name(closer));
      // A reader and a writer (waiting for room) on one socket.
      {
        SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096});
        const int fd = p.a.release();
        std::atomic<int> started{0};
        Team team;
        team.spawn(Where::fiber, s, [&] {
          char buf[16];
          started.fetch_add(1);
          CHECK(io::recv(fd, buf, sizeof buf, 0) == -EBADF);
        });
        team.spawn(Where::fiber, s, [&] {
          std::vector<uint8_t> big(kMiB);
          started.fetch_add(1);
          ssize_t r;
          do {
            r = io::write(fd, big.data(), big.size());
          } while (r > 0);
          CHECK(r == -EBADF);
        });
        let_it_park(started, 2);
        team.spawn(closer, s, [&] {
          CHECK(io::close(fd) == 0);
          // No second close to see EBADF: another thread (the watchdog reads /proc) may already
          // hold the number again, and closing it would close theirs.
        });
        team.join();
      }
      // An acceptor.
      {
        Fd ln = tcp_listener();
        const int fd = ln.release();
        std::atomic<int> started{0};
        Team team;
        team.spawn(Where::fiber, s, [&] {
          started = 1;
          CHECK(io::accept(fd, nullptr, nullptr) == -EBADF);
        });
        let_it_park(started);
        team.spawn(closer, s, [&] {
          CHECK(io::close(fd) == 0);
          // No second close to see EBADF: another thread (the watchdog reads /proc) may already
          // hold the number again, and closing it would close theirs.
        });
        team.join();
      }
    }
  });
}

TEST_CASE("io: fibers woken early by a plain thread (close, cancel) always get home to withdraw their wait") {
  // A wait ended by a plain thread resumes the fiber wherever there is room, and the fiber then
  // goes back to the processor that holds its operation (its home) to withdraw it: a home that
  // is just going to sleep must still notice it. Many rounds of many waiters, to meet that
  // moment; a lost fiber hangs its round (and the watchdog fails the test).
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        const int rounds = kSanitized ? 100 : 300;
        constexpr int kReaders = 8;
        for (int i = 0; i < rounds; ++i) {
          // Readers, and a writer waiting for room, on one socket.
          int sv[2];
          REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
          set_int_option(sv[0], SOL_SOCKET, SO_SNDBUF, 4096);
          Fd peer(sv[1]);
          std::atomic<int> started{0};
          std::vector<fiber::JoinHandle<ssize_t>> waiters;
          for (int k = 0; k < kReaders; ++k) {
            waiters.push_back(fiber::spawn({.scheduler = &s}, [&] {
              char c;
              started.fetch_add(1);
              return io::recv(sv[0], &c, 1, 0);
            }));
          }
          waiters.push_back(fiber::spawn({.scheduler = &s}, [&] {
            std::vector<char> chunk(64 * 1024);
            started.fetch_add(1);
            ssize_t r;
            do {
              r = io::write(sv[0], chunk.data(), chunk.size());
            } while (r > 0);
            return r;
          }));
          REQUIRE(wait_for([&] { return started.load() == kReaders + 1; }));
          fiber::this_fiber::sleep_for(std::chrono::microseconds(500 + i % 5 * 300));
          const bool close_it = i % 2 == 0;
          if (close_it) {
            CHECK(io::close(sv[0]) == 0);
          } else {
            for (auto& h : waiters) h.cancel();
          }
          for (auto& h : waiters) CHECK(h.join() == (close_it ? -EBADF : -ECANCELED));
          if (!close_it) CHECK(io::close(sv[0]) == 0);
        }
      },
      {2, 4});
}

TEST_CASE("io: processors with I/O in flight still wake for fibers that a plain thread spawns") {
  // Fibers parked in reads keep I/O in flight on every processor, so an idle processor polls
  // its engine before it sleeps; a plain thread meanwhile spawns and joins short fibers one at
  // a time, so its wakes keep arriving just as processors go to sleep. A wake lost there leaves
  // a fiber that never runs (the join hangs, and the watchdog fails the test).
  for_each_proc_count(
      [](fiber::Scheduler& s, int n) {
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        Fd a(sv[0]);
        Fd b(sv[1]);
        std::vector<fiber::JoinHandle<ssize_t>> readers;
        for (int k = 0; k < 4 * n; ++k) {
          readers.push_back(fiber::spawn({.scheduler = &s}, [&] {
            char c;
            return io::recv(a.get(), &c, 1, 0);
          }));
        }
        const int rounds = kSanitized ? 3000 : 20000;
        int ran = 0;
        for (int i = 0; i < rounds; ++i) ran += fiber::spawn({.scheduler = &s}, [] { return 1; }).join();
        CHECK(ran == rounds);
        for (auto& h : readers) h.cancel();
        for (auto& h : readers) CHECK(h.join() == -ECANCELED);
      },
      {2, 4});
}

TEST_CASE("io: a descriptor number that io::close just freed works at once for whoever gets it next") {
  // Fibers on every processor and plain threads open, use and io::close socket pairs in a loop, so
  // one often gets a number another is closing at that moment. Every call must succeed: none
  // may find the number still "being closed" (EBADF), and every close must close (no leak).
  for_each_proc_count(
      [](fiber::Scheduler& s, int n) {
        const int rounds = kSanitized ? 300 : 3000;
        const int before = held_fd_count();
        std::atomic<int> failures{0};
        Team team;
        for (int i = 0; i < 2 * n + 2; ++i) {
          team.spawn(i % 4 == 3 ? Where::thread : Where::fiber, s, [&] {
            for (int r = 0; r < rounds; ++r) {
              int sv[2];
              REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
              char c = 'x';
              const ssize_t w = io::write(sv[0], &c, 1);
              const ssize_t rd = io::read(sv[1], &c, 1);
              const int c0 = io::close(sv[0]);
              const int c1 = io::close(sv[1]);
              if (w != 1 || rd != 1 || c0 != 0 || c1 != 0) {
                if (failures.fetch_add(1) < 5) {
                  MESSAGE("write " << w << ", read " << rd << ", close " << c0 << " and " << c1);
                }
              }
            }
          });
        }
        team.join();
        CHECK(failures.load() == 0);
        const bool fds_back = fd_count_back_to(before);  // may sleep: not inside the CHECK
        CHECK_MESSAGE(fds_back, open_fd_count() << " descriptors open, " << before << " before");
      },
      {2, 4, 8});
}

// ------------------------------------------------------------------------------ files

TEST_CASE("io: regular files: pwrite/pread at offsets, write/read at the file position, readv/writev, 0 at end of file") {
  auto body = [] {
    char path[] = "/tmp/fiber_test_io_XXXXXX";
    Fd fd(::mkstemp(path));
    REQUIRE(fd.get() >= 0);
    ::unlink(path);
    const size_t len = 300 * 1000;
    std::vector<uint8_t> data(len);
    fill_pattern(30, 0, data.data(), len);

    // pwrite in pieces, last piece first; pread back in other pieces. The position stays at 0.
    const size_t piece = 7000;
    for (size_t off = (len - 1) / piece * piece;; off -= piece) {
      const size_t n = std::min(piece, len - off);
      CHECK(io::pwrite(fd.get(), data.data() + off, n, static_cast<off_t>(off)) == static_cast<ssize_t>(n));
      if (off == 0) break;
    }
    std::vector<uint8_t> back(len);
    for (size_t off = 0; off < len; off += 4096) {
      const size_t n = std::min<size_t>(4096, len - off);
      CHECK(io::pread(fd.get(), back.data() + off, n, static_cast<off_t>(off), patience()) == static_cast<ssize_t>(n));
    }
    CHECK(pattern_mismatch(30, 0, back.data(), len) == kAllMatch);
    CHECK(::lseek(fd.get(), 0, SEEK_CUR) == 0);
    uint8_t b[16];
    CHECK(io::pread(fd.get(), b, sizeof b, static_cast<off_t>(len)) == 0);        // at the end
    CHECK(io::pread(fd.get(), b, sizeof b, static_cast<off_t>(len) + 5000) == 0); // beyond it
    CHECK(io::pread(fd.get(), b, sizeof b, static_cast<off_t>(len) - 3) == 3);    // up to it

    // write/read at the file position, which they move.
    REQUIRE(::ftruncate(fd.get(), 0) == 0);
    size_t written = 0;
    for (size_t n : {size_t{1}, size_t{4095}, size_t{100'000}, len - 104'096}) {
      CHECK(io::write(fd.get(), data.data() + written, n) == static_cast<ssize_t>(n));
      written += n;
      CHECK(::lseek(fd.get(), 0, SEEK_CUR) == static_cast<off_t>(written));
    }
    REQUIRE(::lseek(fd.get(), 0, SEEK_SET) == 0);
    std::fill(back.begin(), back.end(), 0);
    CHECK(read_fully(fd.get(), back.data(), len) == static_cast<ssize_t>(len));
    CHECK(pattern_mismatch(30, 0, back.data(), len) == kAllMatch);
    CHECK(io::read(fd.get(), b, sizeof b) == 0);  // end of file
    CHECK(io::read(fd.get(), b, sizeof b, patience()) == 0);

    // writev with three buffers at the position, readv with four of other sizes.
    REQUIRE(::ftruncate(fd.get(), 0) == 0);
    REQUIRE(::lseek(fd.get(), 0, SEEK_SET) == 0);
    iovec out[3] = {{data.data(), 10}, {data.data() + 10, 5000}, {data.data() + 5010, 3}};
    CHECK(io::writev(fd.get(), out, 3) == 5013);
    CHECK(io::writev(fd.get(), out, 0) == 0);
    REQUIRE(::lseek(fd.get(), 0, SEEK_SET) == 0);
    std::vector<uint8_t> in(6000, 0);
    iovec vin[4] = {{in.data(), 1}, {in.data() + 1, 2000}, {in.data() + 2001, 3000}, {in.data() + 5001, 999}};
    CHECK(io::readv(fd.get(), vin, 4) == 5013);
    CHECK(pattern_mismatch(30, 0, in.data(), 5013) == kAllMatch);
    CHECK(io::readv(fd.get(), vin, 4, patience()) == 0);  // end of file
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); });
  SUBCASE("plain thread") { run_on_thread(body); }
}

// write(2) and read(2) at the file position hold the file's position lock, so writers sharing a
// descriptor (stdout redirected to a file, a log) never overwrite each other, and readers never
// read a part twice. The ring's current-position ops read and move the position without that
// lock: writes from fibers on several processors (or one punted to the ring's workers) once
// landed on the same offset and records were lost.
TEST_CASE("io: fibers writing and reading at one file position lose no record and read none twice") {
  constexpr int kWriters = 8;
  constexpr int kRecords = 1000;
  constexpr std::size_t kRecord = 64;
  char path[] = "/tmp/fiber_test_pos_XXXXXX";
  Fd fd(::mkstemp(path));  // no O_APPEND: the position is shared and moved by each call
  REQUIRE(fd.get() >= 0);
  ::unlink(path);
  auto record = [](int w, int i) {
    char r[kRecord + 1];
    std::snprintf(r, sizeof r, "%02d:%06d:%-53s\n", w, i, "record");
    return std::string(r, kRecord);
  };
  fiber::Scheduler s({.processors = 4, .name = "filepos"});
  std::atomic<int> short_writes{0};
  fiber::block_on({.scheduler = &s}, [&] {
    for (int w = 0; w < kWriters; ++w) {
      go [&, w] {
        for (int i = 0; i < kRecords; ++i) {
          const std::string r = record(w, i);
          if (io::write(fd.get(), r.data(), r.size()) != static_cast<ssize_t>(r.size())) short_writes.fetch_add(1);
        }
      };
    }
  });
  CHECK(short_writes.load() == 0);
  const off_t size = ::lseek(fd.get(), 0, SEEK_END);
  CHECK(size == static_cast<off_t>(kWriters * kRecords * kRecord));
  std::string all(static_cast<std::size_t>(size), '\0');
  REQUIRE(::pread(fd.get(), all.data(), all.size(), 0) == size);
  std::set<std::string> seen;
  for (std::size_t off = 0; off + kRecord <= all.size(); off += kRecord) seen.insert(all.substr(off, kRecord));
  CHECK(seen.size() == static_cast<std::size_t>(kWriters * kRecords));

  // Readers sharing the position: each record read once, none twice.
  REQUIRE(::lseek(fd.get(), 0, SEEK_SET) == 0);
  std::mutex mu;
  std::vector<std::string> got;
  std::atomic<int> bad_reads{0};
  fiber::block_on({.scheduler = &s}, [&] {
    for (int k = 0; k < kWriters; ++k) {
      go [&] {
        char buf[kRecord];
        for (;;) {
          const ssize_t n = io::read(fd.get(), buf, kRecord);
          if (n == 0) break;
          if (n != static_cast<ssize_t>(kRecord)) {
            bad_reads.fetch_add(1);
            break;
          }
          std::lock_guard lock(mu);
          got.emplace_back(buf, kRecord);
        }
      };
    }
  });
  CHECK(bad_reads.load() == 0);
  CHECK(got.size() == static_cast<std::size_t>(kWriters * kRecords));
  CHECK(std::set<std::string>(got.begin(), got.end()).size() == got.size());
}

// ------------------------------------------------------------------------------ bad input

TEST_CASE("io: bad descriptors give EBADF; bad lengths, counts and offsets give EINVAL; nothing leaks") {
  auto body = [](fiber::Scheduler* s) {
    char path[] = "/tmp/fiber_test_io_XXXXXX";
    Fd file(::mkstemp(path));
    REQUIRE(file.get() >= 0);
    ::unlink(path);
    SocketPair p = tcp_pair();
    char buf[64] = {};
    iovec iov[1] = {{buf, sizeof buf}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = 1;
    sockaddr_in addr = loopback(1);
    const int before = held_fd_count();

    for (int round = 0; round < 3; ++round) {
      // -1, and a descriptor number that is not open. Not one just closed: other threads of this
      // process (the watchdog reads /proc) may be handed that number again at any moment. The
      // highest number the limit allows is the last the kernel would give out.
      const int closed = static_cast<int>(::sysconf(_SC_OPEN_MAX)) - 1;
      REQUIRE(closed > 2);
      REQUIRE(::fcntl(closed, F_GETFD) == -1);
      for (int bad : {-1, closed}) {
        for (const bool timed : {false, true}) {
          // A fresh deadline per call, far enough away not to pass first.
          auto dl = [timed] { return timed ? io::Deadline(scaled(1000ms)) : io::Deadline(); };
          const std::string ctx = "fd " + std::to_string(bad) + (timed ? " with" : " without") + " a deadline";
          // Each call first, then the check: doctest's message scope is per thread, and a call may
          // park (the epoll engine hands pread/pwrite to the blocking pool) and resume elsewhere.
          {
            const auto r = io::read(bad, buf, sizeof buf, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::write(bad, buf, sizeof buf, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::readv(bad, iov, 1, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::writev(bad, iov, 1, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::pread(bad, buf, sizeof buf, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::pwrite(bad, buf, sizeof buf, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::recv(bad, buf, sizeof buf, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::send(bad, buf, sizeof buf, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::recvmsg(bad, &m, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::sendmsg(bad, &m, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::accept(bad, nullptr, nullptr, 0, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
          {
            const auto r = io::connect(bad, sa(addr), sizeof addr, dl());
            CHECK_MESSAGE(r == -EBADF, ctx);
          }
        }
        CHECK(io::close(bad) == -EBADF);  // -1, or a number nobody has: nothing else is closed
      }
      // Lengths that do not fit in ssize_t, negative and oversized counts, negative offsets.
      for (const size_t huge : {SIZE_MAX, static_cast<size_t>(SSIZE_MAX) + 1}) {
        CHECK(io::read(p.a.get(), buf, huge) == -EINVAL);
        CHECK(io::write(p.a.get(), buf, huge) == -EINVAL);
        CHECK(io::recv(p.a.get(), buf, huge, 0) == -EINVAL);
        CHECK(io::send(p.a.get(), buf, huge, 0) == -EINVAL);
        CHECK(io::pread(file.get(), buf, huge, 0) == -EINVAL);
        CHECK(io::pwrite(file.get(), buf, huge, 0) == -EINVAL);
      }
      for (const int count : {-1, INT_MIN, IOV_MAX + 1}) {
        CHECK(io::readv(p.a.get(), iov, count) == -EINVAL);
        CHECK(io::writev(p.a.get(), iov, count) == -EINVAL);
        CHECK(io::readv(file.get(), iov, count, patience()) == -EINVAL);
        CHECK(io::writev(file.get(), iov, count, patience()) == -EINVAL);
      }
      for (const off_t off : {off_t{-1}, std::numeric_limits<off_t>::min()}) {
        CHECK(io::pread(file.get(), buf, sizeof buf, off) == -EINVAL);
        CHECK(io::pwrite(file.get(), buf, sizeof buf, off) == -EINVAL);
      }
    }
    const bool fds_back = fd_count_back_to(before);  // may sleep: not inside the CHECK
    CHECK_MESSAGE(fds_back, open_fd_count() << " descriptors open, " << before << " before");
    // The rejected calls moved nothing: the file is empty, the sockets carry only what follows.
    struct stat st {};
    REQUIRE(::fstat(file.get(), &st) == 0);
    CHECK(st.st_size == 0);
    CHECK(io::recv(p.a.get(), buf, sizeof buf, MSG_DONTWAIT) == -EAGAIN);
    CHECK(io::recv(p.b.get(), buf, sizeof buf, MSG_DONTWAIT) == -EAGAIN);
    if (s != nullptr) expect_transfer(*s, p.a.get(), p.b.get(), 40, 1000);
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body, &s).join(); });
  SUBCASE("plain thread") { run_on_thread([&] { body(nullptr); }); }
}

// ------------------------------------------------------------------------------ pipes

namespace {

// 1 MiB through a pipe whose ends are blocking or not, the writer and the reader each a fiber or
// a thread; then the writer closes and the reader sees end of file. A reader on an empty pipe
// and a writer on a full one wait (never -EAGAIN), and with a deadline end with -ETIMEDOUT.
// A plain thread without a deadline makes the system call itself, which on a non-blocking end
// may fail with EAGAIN (io.hpp promises waiting either way only inside a fiber, or with a
// deadline): there, threads always pass one.
void pipe_transfer(fiber::Scheduler& s, bool nonblocking) {
  for (Where writer : kBoth) {
    for (Where reader : kBoth) {
      CAPTURE(where_name(writer));
      CAPTURE(where_name(reader));
      int fds[2];
      REQUIRE(::pipe2(fds, O_CLOEXEC | (nonblocking ? O_NONBLOCK : 0)) == 0);
      Fd rd(fds[0]);
      Fd wr(fds[1]);
      const size_t len = kMiB;
      std::atomic<int> reader_started{0};
      Team team;
      team.spawn(reader, s, [&] {
        std::vector<uint8_t> buf(4000);
        uint8_t b;
        // Empty: a deadline ends the wait with ETIMEDOUT, not EAGAIN.
        CHECK(io::read(rd.get(), &b, 1, 10ms) == -ETIMEDOUT);
        reader_started = 1;
        const bool always_deadline = nonblocking && reader == Where::thread;
        size_t got = 0;
        for (int i = 0;; ++i) {
          const bool timed = always_deadline || i % 2 == 1;
          const ssize_t r = io::read(rd.get(), buf.data(), buf.size(), timed ? io::Deadline(patience()) : io::Deadline());
          REQUIRE(r >= 0);
          if (r == 0) break;
          REQUIRE(pattern_mismatch(50, got, buf.data(), static_cast<size_t>(r)) == kAllMatch);
          got += static_cast<size_t>(r);
        }
        CHECK(got == len);
        CHECK(io::read(rd.get(), &b, 1, patience()) == 0);
      });
      team.spawn(writer, s, [&] {
        // Let the reader wait on the empty pipe first (not required for correctness).
        REQUIRE(wait_for([&] { return reader_started.load() == 1; }, patience()));
        fiber::this_fiber::sleep_for(5ms);
        std::vector<uint8_t> data(len);
        fill_pattern(50, 0, data.data(), len);
        // Chunks well above the pipe's capacity (64 KiB): each write needs the reader to go on.
        const bool always_deadline = nonblocking && writer == Where::thread;
        for (size_t off = 0; off < len; off += 256 * 1024) {
          const bool timed = always_deadline || off % (512 * 1024) != 0;
          CHECK(write_fully(wr.get(), data.data() + off, 256 * 1024, timed ? io::Deadline(patience()) : io::Deadline()) ==
                256 * 1024);
        }
        wr.reset();
      });
      team.join();
    }
  }
  // A full pipe: a write with a deadline returns what fitted, or ETIMEDOUT once nothing does.
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC | (nonblocking ? O_NONBLOCK : 0)) == 0);
    Fd rd(fds[0]);
    Fd wr(fds[1]);
    Team team;
    size_t in_pipe = 0;
    team.spawn(w, s, [&] {
      std::vector<uint8_t> data(kMiB, 0x77);
      for (int i = 0; i < 1000; ++i) {
        const ssize_t r = io::write(wr.get(), data.data(), data.size(), 20ms);
        if (r == -ETIMEDOUT) break;
        REQUIRE(r > 0);
        CHECK(static_cast<size_t>(r) < data.size());  // nobody reads: it cannot all fit
        in_pipe += static_cast<size_t>(r);
      }
      CHECK(in_pipe > 0);
      const auto at = Clock::now() + 20ms;
      CHECK(io::write(wr.get(), data.data(), 1, at) == -ETIMEDOUT);
      CHECK(Clock::now() >= at);
    });
    team.join();
    wr.reset();
    std::vector<uint8_t> buf(64 * 1024);
    size_t got = 0;
    for (ssize_t r; (r = io::read(rd.get(), buf.data(), buf.size(), patience())) > 0;) got += static_cast<size_t>(r);
    CHECK(got == in_pipe);
  }
}

}  // namespace

TEST_CASE("io: pipes with non-blocking ends, between fibers and threads: the calls wait, deadlines give ETIMEDOUT") {
  for_each_proc_count([](fiber::Scheduler& s, int) { pipe_transfer(s, true); });
}

TEST_CASE("io: pipes with blocking ends, between fibers and threads: the calls wait, deadlines give ETIMEDOUT") {
  for_each_proc_count([](fiber::Scheduler& s, int) { pipe_transfer(s, false); });
}

// ------------------------------------------------------------------------------ non-blocking sockets

TEST_CASE("io: non-blocking sockets: inside a fiber, reads, writes, accept and connect wait as on blocking ones") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    SocketPair p = tcp_pair({.sndbuf = 4096, .rcvbuf = 4096, .flags = SOCK_NONBLOCK});
    Fd ln = tcp_listener(128, SOCK_NONBLOCK);
    const sockaddr_in addr = loopback(local_port(ln.get()));
    // Every read form waits for data that comes later (it does not fail with EAGAIN).
    for (ReadCall c : kReadCalls) {
      CAPTURE(name_of(c));
      std::atomic<int> started{0};
      auto reader = fiber::spawn({.scheduler = &s}, [&] {
        char buf[8];
        started = 1;
        return do_read(c, p.b.get(), buf, sizeof buf);
      });
      let_it_park(started);
      CHECK(::send(p.a.get(), "abcd", 4, MSG_NOSIGNAL) == 4);
      CHECK(reader.join() == 4);
    }
    // accept waits for a connection; connect completes (0, never -EINPROGRESS).
    std::atomic<int> started{0};
    auto acceptor = fiber::spawn({.scheduler = &s}, [&] {
      started = 1;
      return io::accept(ln.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    });
    let_it_park(started);
    auto connector = fiber::spawn({.scheduler = &s}, [&] {
      Fd c = tcp_socket(SOCK_NONBLOCK);
      CHECK(io::connect(c.get(), sa(addr), sizeof addr) == 0);
      return c.release();
    });
    Fd c(connector.join());
    Fd conn(acceptor.join());
    REQUIRE(conn.get() >= 0);
    REQUIRE(c.get() >= 0);
    CHECK((::fcntl(conn.get(), F_GETFL) & O_NONBLOCK) != 0);
    expect_transfer(s, c.get(), conn.get(), 60);
    // A writer on a full buffer waits for room: every write form, no deadline, while a fiber
    // reads slowly; every byte arrives.
    const size_t len = 2 * kMiB;
    Team team;
    team.spawn(Where::fiber, s, [&] {
      std::vector<uint8_t> data(len);
      fill_pattern(61, 0, data.data(), len);
      size_t off = 0;
      for (int i = 0; off < len; ++i) {
        const WriteCall wc = kWriteCalls[i % 4];
        const ssize_t r = do_write(wc, p.a.get(), data.data() + off, std::min<size_t>(len - off, 256 * 1024));
        REQUIRE_MESSAGE(r > 0, name_of(wc));
        off += static_cast<size_t>(r);
      }
      REQUIRE(::shutdown(p.a.get(), SHUT_WR) == 0);
    });
    team.spawn(Where::fiber, s, [&] {
      std::vector<uint8_t> buf(3000);
      size_t got = 0;
      for (int i = 0;; ++i) {
        const ReadCall rc = kReadCalls[i % 4];
        const ssize_t r = do_read(rc, p.b.get(), buf.data(), buf.size());
        REQUIRE_MESSAGE(r >= 0, name_of(rc));
        if (r == 0) break;
        REQUIRE(pattern_mismatch(61, got, buf.data(), static_cast<size_t>(r)) == kAllMatch);
        got += static_cast<size_t>(r);
      }
      CHECK(got == len);
    });
    team.join();
  });
}

// ------------------------------------------------------------------------------ plain threads

TEST_CASE("io: on a plain thread the calls block the thread until the peer acts, with and without deadlines") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        run_on_thread([&] {
          for (const bool with_deadline : {false, true}) {
            CAPTURE(with_deadline);
            const io::Deadline dl = with_deadline ? io::Deadline(patience()) : io::Deadline();
            SocketPair p = tcp_pair();
            Fd ln = tcp_listener();
            const sockaddr_in addr = loopback(local_port(ln.get()));
            // Each step of the fiber happens only after the thread blocked for it; the thread
            // checks it saw the step's effect only after the step was taken.
            std::atomic<int> step{0};
            auto peer = fiber::spawn({.scheduler = &s}, [&] {
              REQUIRE(wait_for([&] { return step.load() == 1; }, patience()));
              fiber::this_fiber::sleep_for(10ms);
              step = 2;
              CHECK(io::write(p.b.get(), "abc", 3) == 3);
              REQUIRE(wait_for([&] { return step.load() == 3; }, patience()));
              fiber::this_fiber::sleep_for(10ms);
              step = 4;
              Fd c = tcp_socket();
              CHECK(io::connect(c.get(), sa(addr), sizeof addr, patience()) == 0);
              char buf[8];
              CHECK(read_fully(c.get(), buf, 2, patience()) == 2);
              CHECK(std::string(buf, 2) == "ok");
            });
            char buf[8];
            step = 1;
            CHECK(io::read(p.a.get(), buf, sizeof buf, dl) == 3);
            CHECK(step.load() == 2);
            CHECK(std::string(buf, 3) == "abc");
            step = 3;
            Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, dl));
            CHECK(step.load() == 4);
            REQUIRE(conn.get() >= 0);
            CHECK(io::write(conn.get(), "ok", 2, dl) == 2);
            peer.join();
            // A short deadline with nothing coming: ETIMEDOUT, not before the deadline.
            const auto at = Clock::now() + 20ms;
            CHECK(io::recv(p.a.get(), buf, sizeof buf, 0, at) == -ETIMEDOUT);
            CHECK(Clock::now() >= at);
          }
        });
      },
      {1, 4});
}

// ------------------------------------------------------------------------------ races and limits

namespace {

// Two fibers wait in `call` on one descriptor, and `poke` makes it ready once (one connection,
// one byte): both may be woken, one gets it. The other must go on waiting in its engine - not in
// the kernel's blocking call, where it would hold its processor thread past its deadline and
// deaf to cancels and io::close - so a cancel ends it with ECANCELED. `call` returns > 0 when it
// got the thing. If the loser does not end, a second poke frees it (and the test fails).
void expect_one_winner(fiber::Scheduler& s, const std::function<ssize_t()>& call, const std::function<void()>& poke) {
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  std::vector<fiber::JoinHandle<ssize_t>> waiters;
  for (int i = 0; i < 2; ++i) {
    waiters.push_back(fiber::spawn({.scheduler = &s}, [&] {
      started.fetch_add(1);
      const ssize_t r = call();
      finished.fetch_add(1);
      return r;
    }));
  }
  let_it_park(started, 2);
  poke();
  REQUIRE(wait_for([&] { return finished.load() >= 1; }, patience()));
  for (auto& h : waiters) h.cancel();
  const bool loser_ended = wait_for([&] { return finished.load() == 2; });
  CHECK_MESSAGE(loser_ended, "the second waiter is stuck in the system call");
  if (!loser_ended) poke();
  int won = 0;
  int cancelled = 0;
  for (auto& h : waiters) {
    const ssize_t r = h.join();
    if (r > 0) ++won;
    if (r == -ECANCELED) ++cancelled;
  }
  CHECK(won == (loser_ended ? 1 : 2));
  CHECK(cancelled == (loser_ended ? 1 : 0));
}

// expect_one_winner for two fibers reading one byte from `in`, which a write of one byte to
// `out` makes readable.
void expect_one_byte_winner(fiber::Scheduler& s, int in, int out) {
  expect_one_winner(
      s,
      [in]() -> ssize_t {
        char c;
        return io::read(in, &c, 1, patience());
      },
      [out] { REQUIRE(::write(out, "x", 1) == 1); });
}

// A pseudo-terminal in raw mode: a descriptor without RWF_NOWAIT, which the epoll engine reads
// only once a poll says it is ready.
struct Pty {
  Fd master, slave;
};
Pty raw_pty() {
  Pty p{Fd(::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC)), Fd()};
  REQUIRE(p.master.get() >= 0);
  REQUIRE(::grantpt(p.master.get()) == 0);
  REQUIRE(::unlockpt(p.master.get()) == 0);
  p.slave = Fd(::open(::ptsname(p.master.get()), O_RDWR | O_NOCTTY | O_CLOEXEC));
  REQUIRE(p.slave.get() >= 0);
  termios t{};
  REQUIRE(::tcgetattr(p.slave.get(), &t) == 0);
  ::cfmakeraw(&t);
  REQUIRE(::tcsetattr(p.slave.get(), TCSANOW, &t) == 0);
  return p;
}

}  // namespace

TEST_CASE("io: one connection for two fibers accepting on a blocking listener: one gets it, the other keeps waiting") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    Fd ln = tcp_listener();  // blocking
    const sockaddr_in addr = loopback(local_port(ln.get()));
    std::vector<Fd> clients;
    expect_one_winner(
        s,
        [&]() -> ssize_t {
          const int c = io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience());
          if (c < 0) return c;
          io::close(c);
          return 1;
        },
        [&] {
          Fd c = tcp_socket();
          connect_now(c.get(), addr);
          clients.push_back(std::move(c));
        });
  });
}

TEST_CASE("io: one byte for two fibers reading a blocking tty: one gets it, the other keeps waiting") {
  // A pty's master end: a descriptor without RWF_NOWAIT, which the epoll engine reads only once
  // a poll says it is ready.
  for_each_proc_count([](fiber::Scheduler& s, int) {
    Pty pty = raw_pty();
    expect_one_byte_winner(s, pty.master.get(), pty.slave.get());
  });
}

TEST_CASE("io: one byte for two fibers reading a blocking pipe: one gets it, the other keeps waiting") {
  // Pipes stay on the ring's own read where they take RWF_NOWAIT: the ring then retries a read
  // that finds the byte gone without blocking, so the loser waits in the ring, cancellable.
  for_each_proc_count([](fiber::Scheduler& s, int) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    Fd in(fds[0]), out(fds[1]);
    expect_one_byte_winner(s, in.get(), out.get());
  });
}

TEST_CASE("io: a fiber's tty write blocked for room does not hold up its processor") {
  // A fiber writes more than a pty holds to its master; a fiber of the same scheduler reads it
  // from the slave. At one processor the reader runs only if the write parks its fiber, not the
  // processor's thread (in io_uring_enter, where the ring makes a tty's write blocking once its
  // own poll says there is room). If the reader is not done in time, a plain thread drains the
  // slave, so that a failure ends.
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        Pty pty = raw_pty();
        const std::vector<char> big(1 << 20, 'a');
        auto writer = fiber::spawn({.scheduler = &s}, [&] { return io::write(pty.master.get(), big.data(), big.size(), patience()); });
        std::atomic<bool> read_all{false};
        auto reader = fiber::spawn({.scheduler = &s}, [&] {
          std::vector<char> sink(64 * 1024);
          size_t got = 0;
          while (got < big.size()) {
            const ssize_t r = io::read(pty.slave.get(), sink.data(), sink.size(), patience());
            if (r <= 0) break;
            got += static_cast<size_t>(r);
          }
          read_all = got == big.size();
          return got;
        });
        const bool in_time = wait_for([&] { return read_all.load(); }, patience());
        CHECK_MESSAGE(in_time, "the write holds its processor's thread");
        if (!in_time) {  // drain until the write ends: until the slave stays empty a while
          std::vector<char> sink(64 * 1024);
          pollfd p{pty.slave.get(), POLLIN, 0};
          while (::poll(&p, 1, 500) > 0 && ::read(pty.slave.get(), sink.data(), sink.size()) > 0) {}
        }
        CHECK(writer.join() == static_cast<ssize_t>(big.size()));
        (void)reader.join();
      },
      {1, 2});
}

TEST_CASE("io: a tty write blocked for room does not hold up a read of the same descriptor") {
  // A plain thread's write (with a deadline, so on the readiness path) to a pty's master blocks
  // until the slave side reads; meanwhile a byte arrives for the master. A fiber's read of it
  // must get it, not wait behind the write (nor spin until its deadline).
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        Pty pty = raw_pty();
        Fd& master = pty.master;
        Fd& slave = pty.slave;
        std::vector<char> big(1 << 20, 'a');
        std::atomic<bool> writing{false};
        std::thread writer([&] {
          writing = true;
          (void)io::write(master.get(), big.data(), big.size(), patience());
        });
        REQUIRE(wait_for([&] { return writing.load(); }));
        std::this_thread::sleep_for(50ms);  // the write fills the tty and blocks (or is about to)
        REQUIRE(::write(slave.get(), "x", 1) == 1);
        auto reader = fiber::spawn({.scheduler = &s}, [&] {
          char c = 0;
          const ssize_t r = io::read(master.get(), &c, 1, patience());
          return r == 1 ? c : static_cast<char>(-r);
        });
        CHECK(reader.join() == 'x');
        // Let the writer finish: read what it wrote.
        std::thread drain([&] {
          std::vector<char> sink(64 * 1024);
          size_t got = 0;
          while (got < big.size()) {
            const ssize_t r = io::read(slave.get(), sink.data(), sink.size(), 2s);  // ends if the writer gave up
            if (r <= 0) break;
            got += static_cast<size_t>(r);
          }
        });
        writer.join();
        drain.join();
      },
      {1, 2});
}

TEST_CASE("io: lengths of 4 GiB and more are not cut to 32 bits: recv gets the data, send sends some") {
  // A length the ring would see modulo 2^32: 4 GiB as 0 (a fake end of stream, nothing sent),
  // 4 GiB + 1 as 1. The buffer is reserved address space only; a few bytes of it are used.
  const size_t four_gib = size_t{1} << 32;
  const size_t map_len = four_gib + 4096;
  void* m = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(m != MAP_FAILED);
  auto* big = static_cast<char*>(m);
  for_each_proc_count(
      [&](fiber::Scheduler& s, int) {
        for (Where w : kBoth) {
          CAPTURE(where_name(w));
          SocketPair p = tcp_pair({.sndbuf = 4096});
          Team team;
          team.spawn(w, s, [&] {
            for (const size_t n : {four_gib, four_gib + 1}) {
              REQUIRE(::send(p.b.get(), "data", 4, MSG_NOSIGNAL) == 4);
              CHECK_MESSAGE(io::recv(p.a.get(), big, n, 0, patience()) == 4, "n " << n);
              CHECK(std::memcmp(big, "data", 4) == 0);
              REQUIRE(::send(p.b.get(), "more", 4, MSG_NOSIGNAL) == 4);
              CHECK_MESSAGE(io::read(p.a.get(), big, n, patience()) == 4, "n " << n);
            }
            // A full send buffer sends the 4 GiB through the engine once the peer reads.
            fill_until_full(p.a.get());
            std::atomic<bool> sent{false};
            auto drain = fiber::spawn({.scheduler = &s}, [&] {
              std::vector<char> sink(64 * 1024);
              while (!sent.load()) (void)io::read(p.b.get(), sink.data(), sink.size(), 5ms);
            });
            const ssize_t r = io::send(p.a.get(), big, four_gib, 0, patience());
            sent = true;
            drain.join();
            CHECK(r > 0);
          });
          team.join();
        }
      },
      {1, 4});
  ::munmap(m, map_len);
}

TEST_CASE("io: pread and pwrite on a socket or a pipe fail with ESPIPE and leave the stream alone") {
  auto body = [] {
    char buf[16];
    SocketPair p = tcp_pair();
    int pipe_fds[2];
    REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
    Fd rd(pipe_fds[0]);
    Fd wr(pipe_fds[1]);
    struct Stream {
      int in, out;
    };
    for (const Stream st : {Stream{p.a.get(), p.b.get()}, Stream{rd.get(), wr.get()}}) {
      REQUIRE(::write(st.out, "hello", 5) == 5);
      CHECK(io::pread(st.in, buf, sizeof buf, 0, patience()) == -ESPIPE);
      CHECK(io::pwrite(st.out, "zz", 2, 0, patience()) == -ESPIPE);
      CHECK(io::read(st.in, buf, sizeof buf, patience()) == 5);  // all there, nothing added
      CHECK(std::string(buf, 5) == "hello");
    }
    // Descriptors that accept lseek(2) but have no position: pread/pwrite are ESPIPE there too,
    // and the counter is left alone.
    Fd ev(::eventfd(3, EFD_CLOEXEC));
    Fd tfd(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC));
    REQUIRE(ev.get() >= 0);
    REQUIRE(tfd.get() >= 0);
    uint64_t v = 0;
    CHECK(io::pread(ev.get(), &v, sizeof v, 0, patience()) == -ESPIPE);
    CHECK(io::pwrite(ev.get(), &v, sizeof v, 0, patience()) == -ESPIPE);
    CHECK(io::pread(tfd.get(), &v, sizeof v, 0, patience()) == -ESPIPE);
    CHECK(::read(ev.get(), &v, sizeof v) == static_cast<ssize_t>(sizeof v));
    CHECK(v == 3);
    // A number that held a file (pread worked there) and holds a pipe after dup2.
    {
      char tpath[] = "/tmp/fiber_test_io_XXXXXX";
      const int tf = ::mkstemp(tpath);
      REQUIRE(tf >= 0);
      ::unlink(tpath);
      CHECK(io::pwrite(tf, "abc", 3, 0) == 3);
      CHECK(io::pread(tf, buf, sizeof buf, 0) == 3);
      REQUIRE(::dup2(rd.get(), tf) == tf);
      REQUIRE(::write(wr.get(), "kept", 4) == 4);
      CHECK(io::pread(tf, buf, sizeof buf, 0) == -ESPIPE);
      CHECK(io::read(rd.get(), buf, sizeof buf, patience()) == 4);
      ::close(tf);
    }
    // A number that was a file (where pread works) and is a pipe after io::close.
    char path[] = "/tmp/fiber_test_io_XXXXXX";
    const int file = ::mkstemp(path);
    REQUIRE(file >= 0);
    ::unlink(path);
    CHECK(io::pwrite(file, "abc", 3, 0) == 3);
    CHECK(io::pread(file, buf, sizeof buf, 0) == 3);
    CHECK(io::close(file) == 0);
    REQUIRE(::write(wr.get(), "pipe", 4) == 4);
    Fd again(::fcntl(rd.get(), F_DUPFD_CLOEXEC, file));  // `file`'s number unless another thread took it
    REQUIRE(again.get() >= 0);
    CHECK(io::pread(again.get(), buf, sizeof buf, 0) == -ESPIPE);
    CHECK(io::read(again.get(), buf, sizeof buf, patience()) == 4);
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); }, {1, 2});
  SUBCASE("plain thread") { run_on_thread(body); }
}

TEST_CASE("io: recv and recvmsg with MSG_WAITALL wait for all n bytes, or return what came before end of stream or the deadline") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (const auto& [w, msg] : {std::pair{Where::fiber, false}, std::pair{Where::thread, false}, std::pair{Where::fiber, true},
                                std::pair{Where::thread, true}}) {
      CAPTURE(where_name(w));
      CAPTURE(msg);
      // io::recv, or io::recvmsg into two buffers of 1 and n-1 bytes.
      const auto recv = [msg](int fd, char* buf, size_t n, int flags, io::Deadline dl) -> ssize_t {
        if (!msg) return io::recv(fd, buf, n, flags, dl);
        iovec iov[2] = {{buf, 1}, {buf + 1, n - 1}};
        msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = 2;
        return io::recvmsg(fd, &m, flags, dl);
      };
      // Half now, half once the call waits.
      {
        SocketPair p = tcp_pair();
        REQUIRE(::send(p.b.get(), "ab", 2, MSG_NOSIGNAL) == 2);
        std::atomic<int> started{0};
        Team team;
        team.spawn(w, s, [&] {
          char buf[8] = {};
          started = 1;
          CHECK(recv(p.a.get(), buf, 4, MSG_WAITALL, patience()) == 4);
          CHECK(std::string(buf, 4) == "abcd");
        });
        let_it_park(started);
        REQUIRE(::send(p.b.get(), "cd", 2, MSG_NOSIGNAL) == 2);
        team.join();
      }
      // End of stream, and a deadline, after part of it: the part.
      {
        SocketPair p = tcp_pair();
        Team team;
        team.spawn(w, s, [&] {
          char buf[8] = {};
          REQUIRE(::send(p.b.get(), "ab", 2, MSG_NOSIGNAL) == 2);
          CHECK(recv(p.a.get(), buf, 4, MSG_WAITALL, 20ms) == 2);
          REQUIRE(::send(p.b.get(), "cd", 2, MSG_NOSIGNAL) == 2);
          REQUIRE(::shutdown(p.b.get(), SHUT_WR) == 0);
          CHECK(recv(p.a.get(), buf, 4, MSG_WAITALL, patience()) == 2);
          CHECK(std::string(buf, 2) == "cd");
          CHECK(recv(p.a.get(), buf, 4, MSG_WAITALL, patience()) == 0);
        });
        team.join();
      }
      // With MSG_PEEK: what is there, each byte once (the ring's retry once peeked the first
      // bytes again into the rest of the buffer), and still there for the next receive.
      {
        SocketPair p = tcp_pair();
        Team team;
        team.spawn(w, s, [&] {
          char buf[8] = {};
          REQUIRE(::send(p.b.get(), "ab", 2, MSG_NOSIGNAL) == 2);
          const ssize_t r = recv(p.a.get(), buf, 4, MSG_PEEK | MSG_WAITALL, patience());
          CHECK_MESSAGE((r >= 1 && r <= 2), "peeked " << r);
          CHECK(std::string(buf, r > 0 ? static_cast<size_t>(r) : 0) == std::string("ab").substr(0, r > 0 ? r : 0));
          REQUIRE(::send(p.b.get(), "cd", 2, MSG_NOSIGNAL) == 2);
          CHECK(recv(p.a.get(), buf, 4, MSG_WAITALL, patience()) == 4);
          CHECK(std::string(buf, 4) == "abcd");
        });
        team.join();
      }
      // Datagrams: one at a time, as the kernel does (MSG_WAITALL does not join them).
      {
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv) == 0);
        Fd a(sv[0]);
        Fd b(sv[1]);
        Team team;
        team.spawn(w, s, [&] {
          char buf[8] = {};
          REQUIRE(::send(b.get(), "ab", 2, 0) == 2);
          REQUIRE(::send(b.get(), "cd", 2, 0) == 2);
          CHECK(io::recv(a.get(), buf, 4, MSG_WAITALL, patience()) == 2);
          CHECK(io::recv(a.get(), buf, 4, MSG_WAITALL, patience()) == 2);
          CHECK(std::string(buf, 2) == "cd");
        });
        team.join();
      }
    }
  });
}

TEST_CASE("io: on descriptors epoll cannot watch (a directory, /dev/null, /dev/zero) or read (an epoll set) the calls give the system call's answer") {
  auto body = [] {
    Fd dir(::open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    REQUIRE(dir.get() >= 0);
    char buf[16];
    iovec iov{buf, sizeof buf};
    for (const io::Deadline dl : {io::Deadline(), io::Deadline(patience())}) {
      CHECK(io::read(dir.get(), buf, sizeof buf, dl) == -EISDIR);
      CHECK(io::readv(dir.get(), &iov, 1, dl) == -EISDIR);
      CHECK(io::recv(dir.get(), buf, sizeof buf, 0, dl) == -ENOTSOCK);
      CHECK((io::poll(dir.get(), POLLIN, dl) & POLLIN) != 0);
    }
    Fd null_dev(::open("/dev/null", O_RDWR | O_CLOEXEC));
    Fd zero_dev(::open("/dev/zero", O_RDONLY | O_CLOEXEC));
    REQUIRE(null_dev.get() >= 0);
    REQUIRE(zero_dev.get() >= 0);
    CHECK(io::read(null_dev.get(), buf, sizeof buf, patience()) == 0);
    CHECK(io::write(null_dev.get(), "abc", 3, patience()) == 3);
    CHECK(io::read(zero_dev.get(), buf, sizeof buf, patience()) == static_cast<ssize_t>(sizeof buf));
    // No read or write method at all: read(2) says EINVAL at once (the ring's own read would
    // wait for ever, its poll never ready).
    Fd ep(::epoll_create1(EPOLL_CLOEXEC));
    REQUIRE(ep.get() >= 0);
    CHECK(io::read(ep.get(), buf, sizeof buf, patience()) == -EINVAL);
    CHECK(io::write(ep.get(), "abc", 3, patience()) == -EINVAL);
  };
  for_each_proc_count([&](fiber::Scheduler& s, int) { fiber::spawn({.scheduler = &s}, body).join(); }, {1, 2});
  SUBCASE("plain thread") { run_on_thread(body); }
}

TEST_CASE("io: poll on a file the engine cannot watch waits out its deadline for events it will never have") {
  // poll(2) calls a regular file ready for input and output, always, and for nothing else.
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        char path[] = "/tmp/fiber_test_io_XXXXXX";
        Fd file(::mkstemp(path));
        REQUIRE(file.get() >= 0);
        ::unlink(path);
        auto h = fiber::spawn({.scheduler = &s}, [&] {
          CHECK((io::poll(file.get(), POLLIN | POLLOUT, patience()) & (POLLIN | POLLOUT)) == (POLLIN | POLLOUT));
          CHECK(io::poll(file.get(), POLLPRI, 20ms) == -ETIMEDOUT);
        });
        h.join();
        // With no deadline, only a cancel ends it.
        std::atomic<int> started{0};
        auto forever = fiber::spawn({.scheduler = &s}, [&] {
          started = 1;
          return io::poll(file.get(), POLLPRI);
        });
        let_it_park(started);
        forever.cancel();
        CHECK(forever.join() == -ECANCELED);
      },
      {1, 2});
}

TEST_CASE("io: poll woken by a hang-up reports the events asked for, plus POLLHUP/POLLERR, and no others") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        SocketPair p = tcp_pair();
        std::atomic<int> started{0};
        auto poller = fiber::spawn({.scheduler = &s}, [&] {
          started = 1;
          return io::poll(p.a.get(), POLLIN, patience());
        });
        let_it_park(started);
        REQUIRE(::shutdown(p.b.get(), SHUT_WR) == 0);  // readable (end of stream), and RDHUP
        const int r = poller.join();
        CHECK((r & POLLIN) != 0);
        CHECK_MESSAGE((r & ~(POLLIN | POLLERR | POLLHUP | POLLNVAL)) == 0, "revents " << r);
      },
      {1, 2});
}

TEST_CASE("io: poll reports only what is ready: ordinary data does not end a wait for POLLRDHUP") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    SocketPair p = tcp_pair();
    std::atomic<int> started{0};
    auto poller = fiber::spawn({.scheduler = &s}, [&] {
      started = 1;
      const int r = io::poll(p.a.get(), POLLRDHUP, patience());
      // Said the peer has shut down its side: it must have.
      pollfd now{p.a.get(), POLLRDHUP, 0};
      const int seen = ::poll(&now, 1, 0);
      CHECK_MESSAGE(r > 0, "poll " << r);
      CHECK_MESSAGE((r & POLLRDHUP) != 0, "revents " << r);
      CHECK_MESSAGE((seen == 1 && (now.revents & POLLRDHUP) != 0), "POLLRDHUP reported before the peer shut down");
    });
    let_it_park(started);
    REQUIRE(::send(p.b.get(), "x", 1, MSG_NOSIGNAL) == 1);  // readable, no hangup
    fiber::this_fiber::sleep_for(20ms);                     // time to (wrongly) end the wait
    REQUIRE(::shutdown(p.b.get(), SHUT_WR) == 0);
    poller.join();
  });
}

TEST_CASE("io: poll woken with the data already taken by another fiber waits again") {
  // One processor, a poller and a reader waiting on one socket, and one byte: the reader may take
  // it before the poller looks. The poller then waits for the next byte, and whatever it
  // reports is there when it returns (on the epoll engine, which reports what it sees after the
  // wake; the ring's poll reports the moment it completed, before the reader ran).
  for (const bool poller_first : {true, false}) {
    CAPTURE(poller_first);
    fiber::Scheduler s({.processors = 1, .name = "pollw"});
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    Fd a(sv[0]);
    Fd b(sv[1]);
    std::atomic<int> started{0};
    auto spawn_poller = [&] {
      return fiber::spawn({.scheduler = &s}, [&] {
        started.fetch_add(1);
        const int r = io::poll(a.get(), POLLIN, patience());
        char c;
        const ssize_t there = ::recv(a.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
        CHECK_MESSAGE((r & POLLIN) != 0, "revents " << r);
        if (fiber::detail::current_processor()->poller().kind() == fiber::detail::PollerKind::Epoll) {
          CHECK_MESSAGE(there == 1, "POLLIN reported with nothing to read");
        }
      });
    };
    auto spawn_reader = [&] {
      return fiber::spawn({.scheduler = &s}, [&] {
        char buf[16];
        started.fetch_add(1);
        return io::read(a.get(), buf, sizeof buf, patience());
      });
    };
    fiber::JoinHandle<void> poller;
    fiber::JoinHandle<ssize_t> reader;
    if (poller_first) {
      poller = spawn_poller();
      let_it_park(started, 1);
      reader = spawn_reader();
    } else {
      reader = spawn_reader();
      let_it_park(started, 1);
      poller = spawn_poller();
    }
    let_it_park(started, 2);
    REQUIRE(::send(b.get(), "1", 1, MSG_NOSIGNAL) == 1);
    CHECK(reader.join() == 1);
    fiber::this_fiber::sleep_for(20ms);  // time for a poller that lost the byte to (wrongly) return
    REQUIRE(::send(b.get(), "2", 1, MSG_NOSIGNAL) == 1);  // for a poller still waiting
    poller.join();
  }
}

TEST_CASE("io: poll over several descriptors waits for the first one ready and reports each as poll(2) does") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    Fd in(fds[0]);
    Fd out(fds[1]);
    SocketPair q = tcp_pair();
    char path[] = "/tmp/fiber_test_io_XXXXXX";
    Fd file(::mkstemp(path));
    REQUIRE(file.get() >= 0);
    ::unlink(path);
    // Nothing ready: a pipe and a socket not yet written to, a skipped entry, a regular file asked
    // only for what it never has (the engine cannot watch it), and the socket again for urgent
    // data. Data on the socket ends the wait, and only its entry reports it.
    {
      pollfd set[5] = {{in.get(), POLLIN, 0}, {q.a.get(), POLLPRI, 0}, {-1, POLLIN, 0}, {file.get(), POLLPRI, 0},
                       {q.a.get(), POLLIN, 0}};
      std::atomic<int> started{0};
      std::atomic<bool> returned{false};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        started = 1;
        const int r = io::poll(set, 5, patience());
        returned = true;
        return r;
      });
      let_it_park(started);
      CHECK_MESSAGE(!returned.load(), "poll returned with nothing ready");
      REQUIRE(::send(q.b.get(), "x", 1, MSG_NOSIGNAL) == 1);
      CHECK(h.join() == 1);
      CHECK(set[0].revents == 0);
      CHECK(set[1].revents == 0);
      CHECK(set[2].revents == 0);
      CHECK(set[3].revents == 0);
      CHECK(set[4].revents == POLLIN);
      char c;
      REQUIRE(::recv(q.a.get(), &c, 1, 0) == 1);
    }
    // Urgent data, for a wait on POLLPRI alone: over several descriptors and on one.
    for (const nfds_t n : {nfds_t{2}, nfds_t{1}}) {
      CAPTURE(n);
      pollfd set[2] = {{q.a.get(), POLLPRI, 0}, {in.get(), POLLIN, 0}};
      std::atomic<int> started{0};
      std::atomic<bool> returned{false};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        started = 1;
        const int r = io::poll(set, n, patience());
        returned = true;
        return r;
      });
      let_it_park(started);
      CHECK_MESSAGE(!returned.load(), "poll for urgent data returned before it came");
      REQUIRE(::send(q.b.get(), "!", 1, MSG_OOB | MSG_NOSIGNAL) == 1);
      CHECK(h.join() == 1);
      CHECK(set[0].revents == POLLPRI);
      char c;
      REQUIRE(::recv(q.a.get(), &c, 1, MSG_OOB) == 1);
    }
    // io::close of a descriptor waited on for urgent data alone ends the wait, as any other.
    {
      SocketPair u = tcp_pair();
      const int fd = u.a.release();
      std::atomic<int> started{0};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        started = 1;
        return io::poll(fd, POLLPRI, patience());
      });
      let_it_park(started);
      CHECK(fiber::spawn({.scheduler = &s}, [&] { return io::close(fd); }).join() == 0);
      CHECK(h.join() == -EBADF);
    }
    // The deadline, with descriptors, with none, and with only skipped ones.
    auto timed = fiber::spawn({.scheduler = &s}, [&] {
      pollfd set[2] = {{in.get(), POLLIN, 0}, {q.a.get(), POLLIN, 0}};
      pollfd skipped{-1, POLLIN, 0};
      return std::vector<int>{io::poll(set, 2, 20ms), io::poll(nullptr, 0, 20ms), io::poll(&skipped, 1, 20ms)};
    });
    for (const int r : timed.join()) CHECK(r == -ETIMEDOUT);
    // Epoll sets nested 1 to 5 deep: each is polled, and times out, as by poll(2) (a set holding
    // one nested 4 deep is too deep for the epoll engine's own set to hold: that one waits on
    // the blocking pool).
    for (int depth = 1; depth <= 5; ++depth) {
      CAPTURE(depth);
      std::vector<Fd> chain;
      int inner = in.get();
      for (int i = 0; i < depth; ++i) {
        chain.emplace_back(::epoll_create1(EPOLL_CLOEXEC));
        REQUIRE(chain.back().get() >= 0);
        epoll_event ev{EPOLLIN, {}};
        REQUIRE(::epoll_ctl(chain.back().get(), EPOLL_CTL_ADD, inner, &ev) == 0);
        inner = chain.back().get();
      }
      auto nested = fiber::spawn({.scheduler = &s}, [&] {
        pollfd set[2] = {{inner, POLLIN, 0}, {q.a.get(), POLLIN, 0}};
        return io::poll(set, 2, 20ms);
      });
      CHECK(nested.join() == -ETIMEDOUT);
    }
    // A closed descriptor is POLLNVAL at once; ready ones are all reported.
    int closed;
    {
      Fd gone = tcp_socket();
      closed = gone.get();
    }
    REQUIRE(::write(out.get(), "p", 1) == 1);
    auto nval = fiber::spawn({.scheduler = &s}, [&] {
      pollfd set[3] = {{closed, POLLIN, 0}, {q.a.get(), POLLIN, 0}, {in.get(), POLLIN, 0}};
      const int r = io::poll(set, 3, patience());
      CHECK(set[0].revents == POLLNVAL);
      CHECK(set[1].revents == 0);
      CHECK(set[2].revents == POLLIN);
      return r;
    });
    CHECK(nval.join() == 2);
    char c;
    REQUIRE(::read(in.get(), &c, 1) == 1);
  });
}

TEST_CASE("io: poll over several descriptors keeps its deadline when a file it no longer polls is ready") {
  // epoll watches files, not numbers: after dup2 over a polled number, the set still holds the
  // old file, kept open by a dup. Its data must not wake the poll for ever (a loop that never
  // reaches its deadline, holding its processor).
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        int p[2], q[2], r[2];
        REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
        REQUIRE(::pipe2(q, O_CLOEXEC) == 0);
        REQUIRE(::pipe2(r, O_CLOEXEC) == 0);
        Fd p_in(p[0]), p_out(p[1]), q_in(q[0]), q_out(q[1]), r_in(r[0]), r_out(r[1]);
        Fd kept(::fcntl(p_in.get(), F_DUPFD_CLOEXEC, 0));  // the old file stays open
        REQUIRE(kept.get() >= 0);
        std::atomic<int> started{0};
        auto h = fiber::spawn({.scheduler = &s}, [&] {
          pollfd set[2] = {{p_in.get(), POLLIN, 0}, {q_in.get(), POLLIN, 0}};
          started = 1;
          return io::poll(set, 2, 300ms);
        });
        let_it_park(started);
        REQUIRE(::dup3(r_in.get(), p_in.get(), O_CLOEXEC) == p_in.get());  // the number now names r's pipe
        REQUIRE(::write(p_out.get(), "x", 1) == 1);                       // the old file is ready
        CHECK(h.join() == -ETIMEDOUT);                                      // r and q never were
      },
      {1, 2});
}

TEST_CASE("io: a cancel ends poll over several descriptors, or none, with ECANCELED; Scheduler::stop ends it too") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    SocketPair p = tcp_pair();
    SocketPair q = tcp_pair();
    std::atomic<int> started{0};
    auto many = fiber::spawn({.scheduler = &s}, [&] {
      pollfd set[2] = {{p.a.get(), POLLIN, 0}, {q.a.get(), POLLIN, 0}};
      started.fetch_add(1);
      return io::poll(set, 2);
    });
    auto none = fiber::spawn({.scheduler = &s}, [&] {
      started.fetch_add(1);
      return io::poll(nullptr, 0);
    });
    let_it_park(started, 2);
    many.cancel();
    none.cancel();
    CHECK(many.join() == -ECANCELED);
    CHECK(none.join() == -ECANCELED);
  });
  // Out of descriptors, a poll of none (a sleep) still ends on a cancel: it needs no epoll set,
  // so it never falls back to poll(2) on the blocking pool, which a cancel does not reach. The
  // fiber starts before the descriptors run out and ends after they are back: UBSan's first
  // check of a type's vptr makes a pipe, and without one it reports the object as invalid.
  with_watchdog(kDefaultLimit, "a poll of none, out of descriptors", [] {
    fiber::Scheduler s({.processors = 1, .name = "pollfull"});
    std::atomic<int> started{0};
    std::atomic<bool> full{false};
    std::atomic<int> polled{1};
    auto none = fiber::spawn({.scheduler = &s}, [&] {
      started = 1;
      while (!full.load()) fiber::this_fiber::yield();
      polled = io::poll(nullptr, 0);
      while (full.load()) std::this_thread::yield();  // cancelled: a fiber yield would throw
    });
    REQUIRE(wait_for([&] { return started.load() == 1; }));
    FdLimit limit(2048);
    std::vector<Fd> filler;
    for (;;) {
      Fd d(::fcntl(0, F_DUPFD_CLOEXEC, 0));
      if (d.get() < 0) break;
      filler.push_back(std::move(d));
    }
    // The cancel must find the fiber parked in its poll (not before it, where any poll ends
    // with ECANCELED at once): wait for the scheduler's park count to move.
    const auto parks = [&s] {
      const fiber::SchedulerStats st = s.stats();
      return std::accumulate(std::begin(st.parks), std::end(st.parks), std::uint64_t{0});
    };
    const std::uint64_t before = parks();
    full = true;
    const bool parked = wait_for([&] { return parks() > before; });
    none.cancel();
    const bool ended = wait_for([&] { return polled.load() != 1; });
    filler.clear();
    full = false;
    none.join();
    CHECK(parked);
    CHECK(ended);
    CHECK(polled.load() == -ECANCELED);
  });
  // stop() cancels what is still alive: a poll with no deadline must not keep it waiting.
  SocketPair p = tcp_pair();
  SocketPair q = tcp_pair();
  std::atomic<int> result{1};
  std::atomic<int> started{0};
  {
    fiber::Scheduler s({.processors = 2, .name = "pollstop"});
    fiber::spawn({.scheduler = &s}, [&] {
      pollfd set[2] = {{p.a.get(), POLLIN, 0}, {q.a.get(), POLLIN, 0}};
      started = 1;
      result = io::poll(set, 2);
    }).detach();
    REQUIRE(wait_for([&] { return started.load() == 1; }));
    std::this_thread::sleep_for(20ms);
    s.stop();
  }
  CHECK(result.load() == -ECANCELED);
}

TEST_CASE("io: poll over several descriptors from a plain thread blocks until one is ready or the deadline") {
  SocketPair p = tcp_pair();
  SocketPair q = tcp_pair();
  pollfd set[2] = {{p.a.get(), POLLIN, 0}, {q.a.get(), POLLIN, 0}};
  CHECK(io::poll(set, 2, 20ms) == -ETIMEDOUT);
  std::thread writer([&] {
    std::this_thread::sleep_for(20ms);
    ::send(q.b.get(), "t", 1, MSG_NOSIGNAL);
  });
  CHECK(io::poll(set, 2, patience()) == 1);
  writer.join();
  CHECK(set[0].revents == 0);
  CHECK(set[1].revents == POLLIN);
}

TEST_CASE("io: a file write queued on the blocking pool lands in its own file, never the number's next, and io::close does not wait for it") {
  // The epoll engine writes regular files on the blocking-offload pool. With every helper busy
  // the write queues. io::close must not wait for it (a wait a blocked tty write, or a close made
  // on the pool itself, would make endless), and the write must not land in the file that gets
  // the number after the close: like a thread blocked in write(2), it writes to the file it was
  // given. (io_uring writes on the ring: the write is done before the close.)
  char path1[] = "/tmp/fiber_test_io_XXXXXX";
  char path2[] = "/tmp/fiber_test_io_XXXXXX";
  const int file = ::mkstemp(path1);
  Fd spare(::mkstemp(path2));
  REQUIRE(file >= 0);
  REQUIRE(spare.get() >= 0);
  ::unlink(path2);
  std::atomic<bool> release{false};
  std::atomic<size_t> busy{0};
  std::atomic<bool> written{false};
  std::atomic<bool> closed{false};
  int reused = -1;
  // Declared after what its fibers use, so a failed REQUIRE still stops it first.
  fiber::Scheduler s({.processors = 2, .name = "poolw"});
  struct Release {  // lets the helpers go however the test ends, before the scheduler stops
    std::atomic<bool>& flag;
    void now() {
      flag = true;
      flag.notify_all();
    }
    ~Release() { now(); }
  } releaser{release};
  fiber::spawn({.scheduler = &s}, [] { fiber::blocking([] {}); }).join();  // the pool exists
  const size_t helpers = fiber::detail::blocking_pool_stats().max_threads;
  REQUIRE(helpers > 0);
  std::vector<fiber::JoinHandle<void>> blockers;
  for (size_t i = 0; i < helpers; ++i) {
    blockers.push_back(fiber::spawn({.scheduler = &s}, [&] {
      fiber::blocking([&] {
        busy.fetch_add(1);
        while (!release.load()) release.wait(false);
      });
    }));
  }
  REQUIRE(wait_for([&] { return busy.load() == helpers; }));

  auto writer = fiber::spawn({.scheduler = &s}, [&] {
    const ssize_t r = io::write(file, "AAAA", 4);
    written = true;
    return r;
  });
  REQUIRE(wait_for([&] { return written.load() || fiber::detail::blocking_pool_stats().queued > 0; }));
  auto closer = fiber::spawn({.scheduler = &s}, [&] {
    CHECK(io::close(file) == 0);
    reused = ::fcntl(spare.get(), F_DUPFD_CLOEXEC, file);  // `file`'s number unless another thread took it
    closed = true;
  });
  // The close ends while the write may still be queued: every helper is still held.
  CHECK_MESSAGE(wait_for([&] { return closed.load(); }), "io::close waited for the queued write");
  releaser.now();
  for (auto& h : blockers) h.join();
  closer.join();
  const ssize_t w = writer.join();
  CHECK(w == 4);
  struct stat st1 {}, st2 {};
  REQUIRE(::stat(path1, &st1) == 0);
  REQUIRE(::fstat(spare.get(), &st2) == 0);
  CHECK(st1.st_size == 4);
  CHECK_MESSAGE(st2.st_size == 0, "the write landed in the descriptor that took the number");
  if (reused >= 0) ::close(reused);
  ::unlink(path1);
}

// A Unix stream listener whose queue is full makes a non-blocking connect fail with EAGAIN
// (not EINPROGRESS), and its socket never becomes "ready" for it: a blocking connect sleeps in
// the kernel until the listener accepts. io::connect waits likewise, on either engine.
TEST_CASE("io: connect to a Unix listener whose queue is full waits until it accepts") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = "libfiber-test-full-" + std::to_string(::getpid()) + "-" +
                             std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
    std::memcpy(addr.sun_path + 1, name.data(), name.size());  // abstract: nothing to unlink
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    Fd ln(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(::bind(ln.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0);
    REQUIRE(::listen(ln.get(), 0) == 0);
    // Fill the queue.
    std::vector<Fd> queued;
    for (;;) {
      Fd c(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (::connect(c.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
        REQUIRE(errno == EAGAIN);
        break;
      }
      queued.push_back(std::move(c));
      REQUIRE(queued.size() < 100);
    }
    std::atomic<bool> started{false};
    auto connector = fiber::spawn({.scheduler = &s}, [&] {
      Fd c(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      started = true;
      const int rc = io::connect(c.get(), reinterpret_cast<const sockaddr*>(&addr), len, patience());
      if (rc == 0) CHECK(io::write(c.get(), "u", 1, patience()) == 1);
      return rc;
    });
    REQUIRE(wait_for([&] { return started.load(); }));
    fiber::this_fiber::sleep_for(20ms);
    CHECK_FALSE(connector.finished());  // still waiting, not failed with EAGAIN
    // Accept every queued connection: the waiting connect gets in and sends its byte.
    char got = 0;
    for (std::size_t i = 0; i <= queued.size() && got != 'u'; ++i) {
      Fd conn(io::accept(ln.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
      REQUIRE(conn.get() >= 0);
      if (i == queued.size()) CHECK(io::read(conn.get(), &got, 1, patience()) == 1);
    }
    CHECK(connector.join() == 0);
    CHECK(got == 'u');
  });
}

// A connect whose deadline passed goes on in the background; connecting the socket again waits
// for it, as a blocking connect(2) does. The ring answered EALREADY at once instead, unlike the
// epoll engine and a plain thread. One scheduler only: each case waits out the client's second
// SYN, about a second.
TEST_CASE("io: connect again after a deadline passed waits for the connection still on its way") {
  fiber::Scheduler s({.processors = 2, .name = "conn-again"});
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    Team team;
    team.spawn(w, s, [&] {
      FullListener full = full_listener();
      Fd c = tcp_socket();
      CHECK(io::connect(c.get(), sa(full.addr), sizeof full.addr, 20ms) == -ETIMEDOUT);
      const auto t0 = Clock::now();
      CHECK(io::connect(c.get(), sa(full.addr), sizeof full.addr, 20ms) == -ETIMEDOUT);  // still on its way
      CHECK(Clock::now() - t0 >= 20ms);
      Fd first(io::accept(full.listener.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));  // room for c
      REQUIRE(first.get() >= 0);
      CHECK(io::connect(c.get(), sa(full.addr), sizeof full.addr, patience()) == 0);
      Fd conn(io::accept(full.listener.get(), nullptr, nullptr, SOCK_CLOEXEC, patience()));
      REQUIRE(conn.get() >= 0);
      expect_transfer(s, c.get(), conn.get(), 7, 1000);
    });
    team.join();
  }
}

// A refused connect leaves the socket able to connect again, as the kernel's does: a "wait for
// the server" loop that retries on one socket gets ECONNREFUSED each time, and connects once
// someone listens. (Reading the outcome through SO_ERROR alone would leave the socket
// "connecting", and the retry would fail with ECONNABORTED.)
TEST_CASE("io: connect retried on one socket after ECONNREFUSED is refused again, then connects") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    auto h = fiber::spawn({.scheduler = &s}, [] {
      ClosedPort closed = closed_port();
      const sockaddr_in to = loopback(closed.port);
      Fd c = tcp_socket();
      CHECK(io::connect(c.get(), sa(to), sizeof to, patience()) == -ECONNREFUSED);
      CHECK(io::connect(c.get(), sa(to), sizeof to, patience()) == -ECONNREFUSED);
      REQUIRE(::listen(closed.holder.get(), 1) == 0);  // the server is up
      CHECK(io::connect(c.get(), sa(to), sizeof to, patience()) == 0);
      CHECK(io::connect(c.get(), sa(to), sizeof to, patience()) == -EISCONN);
    });
    h.join();
  });
}
