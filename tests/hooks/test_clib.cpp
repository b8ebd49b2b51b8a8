// A plain C library (clib/blocking_lib.c: no libfiber header, compiled as C) used from 1000
// fibers on ONE processor. With the hook its blocking calls park only their fiber, so the calls
// overlap: the library reports entering and leaving its blocking section, and the test counts
// the fibers inside at once. Without the hook every call holds the processor thread, and they
// run one after another (at most one inside).
//
// No timing is asserted. Most cases are gated: nothing lets a fiber leave the blocking section
// until all of them are inside (a sleep loop asks `released`, a read waits for data the test
// writes only then). With the hook the maximum inside is then exactly the number of fibers; if
// the calls serialised, the gate opens after a bounded wait instead, and the count shows it.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "clib/blocking_lib.h"
#include "hook_util.hpp"

using namespace hook_test;

namespace {

constexpr int kFibers = 1000;

// What the C library reports, and the gate it asks.
struct Overlap {
  std::atomic<int> inside{0};
  std::atomic<int> max_inside{0};
  std::atomic<int> entered{0};
  std::atomic<int> left{0};
  std::atomic<bool> open{false};

  static void note(void* ctx, int in) {
    auto* o = static_cast<Overlap*>(ctx);
    if (in) {
      o->entered.fetch_add(1);
      raise_max(o->max_inside, o->inside.fetch_add(1) + 1);
    } else {
      o->inside.fetch_sub(1);
      o->left.fetch_add(1);
    }
  }
  static int released(void* ctx) { return static_cast<Overlap*>(ctx)->open.load() ? 1 : 0; }
  blib_observer observer() { return blib_observer{&Overlap::note, &Overlap::released, this}; }
};

// Runs `count` fibers of body(i) on a fresh one-processor scheduler; the calling (plain) thread
// waits, bounded, until all of them are inside the library, then calls open_gate(), then joins.
// Returns whether they were all inside at once before the gate opened.
template <typename Body, typename Open>
bool run_gated(Overlap& o, int count, Body&& body, Open&& open_gate, std::chrono::milliseconds wait = 20'000ms) {
  Watchdog dog(120'000ms, "C library from many fibers");
  fiber::Scheduler s({.processors = 1, .name = "clib", .watchdog = quiet_watchdog()});
  std::vector<fiber::JoinHandle<long>> hs;
  hs.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) hs.push_back(fiber::spawn({.scheduler = &s}, [&body, i] { return body(i); }));
  const bool all_inside = thread_wait([&] { return o.inside.load() == count; }, wait);
  o.open = true;
  open_gate();
  int failed = 0;
  for (auto& h : hs) {
    const long r = h.join();
    if (r < 0 && failed++ < 3) FAIL_CHECK("a C library call failed: " << r);
  }
  CHECK(failed == 0);
  CHECK(o.left.load() == count);
  return all_inside;
}

}  // namespace

TEST_SUITE("hooked") {
TEST_CASE("C library: 1000 fibers on one processor overlap in usleep, nanosleep and sleep loops") {
  for (blib_sleep_kind kind : {BLIB_USLEEP, BLIB_NANOSLEEP, BLIB_SLEEP}) {
    const char* name = kind == BLIB_USLEEP ? "usleep" : kind == BLIB_NANOSLEEP ? "nanosleep" : "sleep";
    Overlap o;
    blib_observer obs = o.observer();
    const unsigned step = kind == BLIB_SLEEP ? 1'000'000u : 2'000u;
    const bool all = run_gated(
        o, kFibers, [&](int) { return blib_sleep_until_released(&obs, kind, step); }, [] {});
    CHECK_MESSAGE(all, std::string(name) << ": only " << o.max_inside.load() << " of " << kFibers << " fibers were inside at once");
    CHECK_MESSAGE(o.max_inside.load() == kFibers, std::string(name) << ": max inside " << o.max_inside.load());
    MESSAGE(std::string(name) << ": max inside at once " << o.max_inside.load() << " of " << kFibers);
  }
}

TEST_CASE("C library: 1000 fibers on one processor overlap in poll then read on blocking sockets") {
  Overlap o;
  blib_observer obs = o.observer();
  std::vector<Pair> pairs;
  for (int i = 0; i < kFibers; ++i) pairs.push_back(make_socketpair());
  std::vector<char> got(kFibers, 0);
  const bool all = run_gated(
      o, kFibers, [&](int i) -> long { return blib_poll_then_read(&obs, pairs[i].a, &got[i]); },
      [&] {
        for (int i = 0; i < kFibers; ++i) {
          const char c = static_cast<char>('a' + i % 26);
          REQUIRE(::write(pairs[i].b, &c, 1) == 1);
        }
      });
  CHECK_MESSAGE(all, "poll: only " << o.max_inside.load() << " of " << kFibers << " inside at once");
  CHECK(o.max_inside.load() == kFibers);
  int wrong = 0;
  for (int i = 0; i < kFibers; ++i) wrong += got[i] != static_cast<char>('a' + i % 26);
  CHECK(wrong == 0);
}

TEST_CASE("C library: 1000 fibers on one processor overlap in blocking reads") {
  Overlap o;
  blib_observer obs = o.observer();
  std::vector<Pair> pairs;
  for (int i = 0; i < kFibers; ++i) pairs.push_back(make_socketpair());
  std::vector<std::array<char, 8>> got(kFibers);
  const bool all = run_gated(
      o, kFibers, [&](int i) -> long { return blib_read_exact(&obs, pairs[i].a, got[i].data(), 8) == 8 ? 0 : -1; },
      [&] {
        for (int i = 0; i < kFibers; ++i) {
          char msg[16];  // 8 characters; the room is for GCC, which cannot see that i < 10^7
          std::snprintf(msg, sizeof msg, "m%07d", i);
          // In two pieces: the library's read loop has to put them together.
          REQUIRE(::write(pairs[i].b, msg, 3) == 3);
          REQUIRE(::write(pairs[i].b, msg + 3, 5) == 5);
        }
      });
  CHECK_MESSAGE(all, "read: only " << o.max_inside.load() << " of " << kFibers << " inside at once");
  CHECK(o.max_inside.load() == kFibers);
  int wrong = 0;
  for (int i = 0; i < kFibers; ++i) {
    char msg[16];
    std::snprintf(msg, sizeof msg, "m%07d", i);
    wrong += std::memcmp(got[i].data(), msg, 8) != 0;
  }
  CHECK(wrong == 0);
}

TEST_CASE("C library: 1000 fibers on one processor overlap in select on one shared pipe") {
  Overlap o;
  blib_observer obs = o.observer();
  Pair p = make_pipe();
  REQUIRE(p.a.get() < FD_SETSIZE);
  const bool all = run_gated(
      o, kFibers, [&](int) -> long { return blib_select_readable(&obs, p.a); },
      [&] { REQUIRE(::write(p.b, "!", 1) == 1); });  // nobody reads it: every waiter sees it readable
  CHECK_MESSAGE(all, "select: only " << o.max_inside.load() << " of " << kFibers << " inside at once");
  CHECK(o.max_inside.load() == kFibers);
}

// A loopback server (its own scheduler) that answers every request only once all clients are
// inside the library; each client's socket/connect/write/read/close runs in the C library.
TEST_CASE("C library: 1000 fibers on one processor overlap in request/response round trips") {
  Overlap o;
  blib_observer obs = o.observer();
  Listener l = tcp_listener(4096);
  fiber::WaitGroup reply;  // the servers wait on it; the test completes it
  reply.add(1);
  std::atomic<int> served{0};
  fiber::Scheduler server({.processors = 2, .name = "srv"});  // stops (and cancels) before those go
  auto acceptor = fiber::spawn({.scheduler = &server}, [&] {
    for (int i = 0; i < kFibers; ++i) {
      const int c = ::accept(l.fd, nullptr, nullptr);
      if (c < 0) return -1;
      fiber::spawn([&, c] {
        Fd conn(c);
        char req[8];
        size_t got = 0;
        while (got < sizeof req) {
          const ssize_t r = ::read(conn, req + got, sizeof req - got);
          if (r <= 0) return;
          got += static_cast<size_t>(r);
        }
        reply.wait();
        char resp[8];
        for (size_t k = 0; k < sizeof resp; ++k) resp[k] = static_cast<char>(req[sizeof req - 1 - k]);
        if (::write(conn, resp, sizeof resp) == static_cast<ssize_t>(sizeof resp)) served.fetch_add(1);
      }).detach();
    }
    return 0;
  });
  std::vector<std::array<char, 8>> got(kFibers);
  const bool all = run_gated(
      o, kFibers,
      [&](int i) -> long {
        char req[16];
        std::snprintf(req, sizeof req, "%08d", i);
        return blib_roundtrip(&obs, l.port(), req, got[i].data(), 8) == 8 ? 0 : -1;
      },
      [&] { reply.done(); });
  CHECK(acceptor.join() == 0);
  CHECK_MESSAGE(all, "round trips: only " << o.max_inside.load() << " of " << kFibers << " inside at once");
  CHECK(o.max_inside.load() == kFibers);
  int wrong = 0;
  for (int i = 0; i < kFibers; ++i) {
    char req[16];
    std::snprintf(req, sizeof req, "%08d", i);
    for (int k = 0; k < 8; ++k) wrong += got[i][k] != req[7 - k];
  }
  CHECK(wrong == 0);
  quiesce(server);
  CHECK(served.load() == kFibers);
}

// Ungated: each fiber makes one short usleep. Overlap is likely, not forced, so only > 1 is
// asserted (the counterpart of the unhooked case below).
TEST_CASE("C library: short ungated usleeps from 20 fibers on one processor overlap") {
  Overlap o;
  blib_observer obs = o.observer();
  o.open = true;
  run_gated(o, 20, [&](int) -> long { return blib_usleep_once(&obs, 20'000); }, [] {}, 0ms);
  CHECK_MESSAGE(o.max_inside.load() > 1, "max inside at once: " << o.max_inside.load());
  MESSAGE("max inside at once: " << o.max_inside.load() << " of 20");
}
}  // TEST_SUITE("hooked")

TEST_SUITE("unhooked") {
// Without the hook (hooks_none) the same library serialises its callers: each usleep holds the
// only processor thread, so no second fiber can even enter the library meanwhile.
TEST_CASE("C library, no hook: 20 fibers on one processor serialise (max inside == 1)") {
  REQUIRE_MESSAGE(!hooked(), "this case checks the program WITHOUT the hook; the hook is in effect");
  Overlap o;
  blib_observer obs = o.observer();
  o.open = true;
  run_gated(o, 20, [&](int) -> long { return blib_usleep_once(&obs, 20'000); }, [] {}, 0ms);
  CHECK(o.max_inside.load() == 1);
  CHECK(o.entered.load() == 20);
}
}  // TEST_SUITE("unhooked")
