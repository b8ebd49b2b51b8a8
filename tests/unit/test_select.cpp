// select (fiber/select.hpp): one case performed, the others without effect; default and timeout
// cases; closed channels; uniform choice among ready cases (chi-square); blocking selects woken
// by fibers and threads on any scheduler; cancellation; and stress - values conserved through
// many selects racing on shared channels, with timeouts racing wakes.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

}  // namespace

TEST_CASE("select: performs a ready case; cases not chosen have no effect") {
  fiber::Channel<int> a(2);
  fiber::Channel<std::string> b(2);
  fiber::Channel<std::unique_ptr<int>> c(1);
  std::optional<int> got_a;
  std::optional<std::string> got_b;

  a.send(1);
  // Only the receive on `a` is ready; the send to `c` is not (full), the receive on `b` neither.
  c.send(std::make_unique<int>(0));
  auto p = std::make_unique<int>(9);
  std::size_t r = fiber::select(fiber::recv_case(b, got_b), fiber::send_case(c, p), fiber::recv_case(a, got_a));
  CHECK(r == 2);
  REQUIRE(got_a);
  CHECK(*got_a == 1);
  CHECK_FALSE(got_b);
  REQUIRE(p);  // the send case was not chosen: its value was not moved from
  CHECK(*p == 9);
  CHECK(c.size() == 1);

  // Only the send is ready now.
  (void)c.recv();
  got_a.reset();
  r = fiber::select(fiber::recv_case(b, got_b), fiber::send_case(c, p), fiber::recv_case(a, got_a));
  CHECK(r == 1);
  CHECK_FALSE(p);  // sent
  CHECK(**c.recv() == 9);
  CHECK_FALSE(got_a);

  // An rvalue send case and a conversion (const char* -> std::string).
  r = fiber::select(fiber::send_case(b, "hello"), fiber::default_case());
  CHECK(r == 0);
  CHECK(b.recv() == "hello");

  // Default: nothing ready.
  r = fiber::select(fiber::recv_case(a, got_a), fiber::recv_case(b, got_b), fiber::default_case());
  CHECK(r == 2);
  CHECK_FALSE(got_a);
  CHECK_FALSE(got_b);
  CHECK(fiber::select(fiber::default_case()) == 0);
}

TEST_CASE("select: timeout case - never before its deadline; negative means expired") {
  for (Where w : kBoth) {
    fiber::Scheduler s({.processors = 2, .name = "st"});
    Team team;
    team.spawn(w, s, [] {
      fiber::Channel<int> a, b(1);
      std::optional<int> x, y;
      b.send(0);  // full: a send to b is not ready
      auto t0 = Clock::now();
      CHECK(fiber::select(fiber::recv_case(a, x), fiber::timeout_case(20ms), fiber::send_case(b, 5)) == 1);
      CHECK(Clock::now() - t0 >= 20ms);
      CHECK_FALSE(x);
      CHECK(b.size() == 1);
      t0 = Clock::now();
      CHECK(fiber::select(fiber::deadline_case(t0 + 10ms), fiber::recv_case(a, x)) == 0);
      CHECK(Clock::now() >= t0 + 10ms);
      // Expired timeouts: only ready cases can win, at once.
      CHECK(fiber::select(fiber::recv_case(a, x), fiber::timeout_case(-1s)) == 1);
      CHECK(fiber::select(fiber::recv_case(a, x), fiber::timeout_case(0s)) == 1);
      CHECK(fiber::select(fiber::recv_case(b, y), fiber::timeout_case(-1s)) == 0);
      CHECK(y == 0);
      // A timeout alone is a sleep.
      t0 = Clock::now();
      CHECK(fiber::select(fiber::timeout_case(5ms)) == 0);
      CHECK(Clock::now() - t0 >= 5ms);
      // Default beats a timeout.
      t0 = Clock::now();
      CHECK(fiber::select(fiber::timeout_case(10s), fiber::recv_case(a, x), fiber::default_case()) == 2);
      CHECK(Clock::now() - t0 < 5s);
    });
    team.join();
  }
  // A select that could never return is a usage error, not a hang.
  try {
    (void)fiber::select();
    FAIL_CHECK("select() returned");
  } catch (const fiber::UsageError& e) {
    CHECK(contains(e.what(), "block forever"));
  }
  CHECK_THROWS_AS(fiber::select(fiber::timeout_case(std::chrono::hours::max())), fiber::UsageError);
}

TEST_CASE("select: closed channels - a receive case is ready (out reset), a send case throws") {
  fiber::Channel<int> a(1), closed_ch(1);
  closed_ch.close();
  std::optional<int> x = 77, y;
  // The closed receive is the only ready case.
  CHECK(fiber::select(fiber::recv_case(a, y), fiber::recv_case(closed_ch, x)) == 1);
  CHECK_FALSE(x);
  CHECK_FALSE(y);
  // A chosen send case on a closed channel throws, naming the problem.
  try {
    (void)fiber::select(fiber::send_case(closed_ch, 1));
    FAIL_CHECK("no exception");
  } catch (const fiber::ChannelClosed& e) {
    CHECK(contains(e.what(), "closed channel"));
  }
  // Buffered values are still drained before "closed".
  fiber::Channel<int> d(2);
  d.send(4);
  d.close();
  CHECK(fiber::select(fiber::recv_case(d, x)) == 0);
  CHECK(x == 4);
  CHECK(fiber::select(fiber::recv_case(d, x)) == 0);
  CHECK_FALSE(x);
}

TEST_CASE("select: a receive case's channel may be destroyed as soon as its close() returns") {
  // The woken select reset its out slot through the channel after the wake, so a closer that
  // destroyed its channel right after close() had it read freed memory (seen under ASan).
  // close() now resets the slot before the wake; a select that wakes touches no closed channel.
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const auto select_parks = [&] { return park_count(s, fiber::detail::ParkReason::Select); };
    for (int round = 0; round < (kSanitized ? 50 : 200); ++round) {
      auto doomed = std::make_unique<fiber::Channel<std::string>>();
      fiber::Channel<std::string>* ch = doomed.get();
      fiber::Channel<int> other;
      const std::uint64_t parked_before = select_parks();
      // Every other round the channel is in two cases: close() takes both nodes off it, and the
      // woken select must not go back to the channel to withdraw the second.
      const bool twice = round % 2 == 1;
      auto h = fiber::spawn({.scheduler = &s}, [ch, &other, twice] {
        std::optional<std::string> got = std::string(64, 'x'), got2 = std::string(64, 'y');  // reset on close
        std::optional<int> never;
        const std::size_t i =
            twice ? fiber::select(fiber::recv_case(other, never), fiber::recv_case(*ch, got), fiber::recv_case(*ch, got2))
                  : fiber::select(fiber::recv_case(other, never), fiber::recv_case(*ch, got));
        const bool reset = (i == 1 && !got.has_value()) || (twice && i == 2 && !got2.has_value());
        return reset && !never.has_value();
      });
      REQUIRE(wait_for([&] { return select_parks() > parked_before; }));
      doomed->close();
      doomed.reset();  // at once: the select may not have run yet
      CHECK(h.join());
    }
  });
}

TEST_CASE("select: a blocked select is completed by fibers and threads, across schedulers") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    fiber::Scheduler other({.processors = 1, .name = "other"});
    for (Where selector : kBoth) {
      for (Where peer : kBoth) {
        for (fiber::Scheduler* ps : {&s, &other}) {
          fiber::Channel<int> in;
          fiber::Channel<std::string> out;
          fiber::Channel<bool> never;
          std::optional<int> x;
          std::optional<bool> nv;
          // 1: the peer sends into `in`.
          {
            Team team;
            team.spawn(selector, s, [&] {
              CHECK(fiber::select(fiber::recv_case(never, nv), fiber::recv_case(in, x), fiber::send_case(out, "s")) == 1);
              CHECK(x == 11);
            });
            team.spawn(peer, *ps, [&] { in.send(11); });
            team.join();
          }
          // 2: the peer receives from `out`.
          {
            Team team;
            std::string keep = "payload";
            team.spawn(selector, s, [&] {
              CHECK(fiber::select(fiber::recv_case(never, nv), fiber::recv_case(in, x), fiber::send_case(out, keep)) == 2);
              CHECK(keep.empty());  // moved out (std::string's moved-from state is empty in practice)
            });
            team.spawn(peer, *ps, [&] { CHECK(out.recv() == "payload"); });
            team.join();
          }
          // 3: close wakes a blocked select: a receive case reports closed.
          {
            Team team;
            x = 5;
            team.spawn(selector, s, [&] {
              CHECK(fiber::select(fiber::recv_case(never, nv), fiber::recv_case(in, x), fiber::timeout_case(60s)) == 1);
              CHECK_FALSE(x);
            });
            team.spawn(peer, *ps, [&] {
              fiber::this_fiber::sleep_for(1ms);
              in.close();
            });
            team.join();
          }
          // 4: close wakes a blocked send case: it throws ChannelClosed.
          {
            Team team;
            team.spawn(selector, s, [&] {
              CHECK_THROWS_AS(fiber::select(fiber::recv_case(never, nv), fiber::send_case(out, "x")), fiber::ChannelClosed);
            });
            team.spawn(peer, *ps, [&] {
              fiber::this_fiber::sleep_for(1ms);
              out.close();
            });
            team.join();
          }
          // The losing cases left nothing behind in `never`.
          CHECK_FALSE(never.try_send(true));
        }
      }
    }
  });
}

TEST_CASE("select: the same channel in several cases") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        fiber::Channel<int> ch;
        std::optional<int> x, y;
        Team team;
        // A select that both sends to and receives from one unbuffered channel cannot pair with
        // itself; a peer completes one of the two cases.
        team.spawn(Where::fiber, s, [&] {
          const std::size_t r = fiber::select(fiber::send_case(ch, 1), fiber::recv_case(ch, x), fiber::recv_case(ch, y));
          if (r == 0) {
            CHECK_FALSE(x);
          } else {
            CHECK((r == 1 ? x : y) == 2);
          }
        });
        team.spawn(Where::thread, s, [&] {
          // Either take its value or give it one.
          for (;;) {
            if (auto v = ch.try_recv()) {
              CHECK(*v == 1);
              return;
            }
            if (ch.try_send(2)) return;
            std::this_thread::yield();
          }
        });
        team.join();
      },
      {1, 2});
}

TEST_CASE("select: ready cases are chosen uniformly at random") {
  // Four always-ready cases of different kinds and types, one never-ready case. Pearson's
  // chi-square over 4 cells (3 degrees of freedom): P(X^2 > 60) < 1e-12 for a uniform choice.
  const int rounds = kSanitized ? 20'000 : 80'000;
  fiber::Channel<int> ints(rounds);
  fiber::Channel<std::string> strs(rounds);
  fiber::Channel<double> sink(rounds);
  fiber::Channel<int> closed_ch;
  fiber::Channel<char> empty;
  closed_ch.close();
  for (int i = 0; i < rounds; ++i) {
    ints.send(i);
    strs.send("s");
  }
  auto run = [&] {
    std::array<long, 5> hits{};
    std::optional<int> i, c;
    std::optional<std::string> str;
    std::optional<char> e;
    for (int k = 0; k < rounds; ++k) {
      double d = k;
      ++hits[fiber::select(fiber::recv_case(ints, i), fiber::recv_case(empty, e), fiber::recv_case(strs, str),
                           fiber::send_case(sink, d), fiber::recv_case(closed_ch, c))];
    }
    return hits;
  };
  std::array<long, 5> hits{};
  SUBCASE("from a fiber") { hits = fiber::block_on(run); }
  SUBCASE("from a thread") { hits = run(); }
  CHECK(hits[1] == 0);
  const double expected = rounds / 4.0;
  double chi2 = 0;
  for (int k : {0, 2, 3, 4}) chi2 += (hits[k] - expected) * (hits[k] - expected) / expected;
  CHECK_MESSAGE(chi2 < 60.0, "hits " << hits[0] << " " << hits[2] << " " << hits[3] << " " << hits[4] << ", chi2 " << chi2);
  // Not chosen = no effect: each channel lost exactly what its case took.
  CHECK(ints.size() == static_cast<std::size_t>(rounds - hits[0]));
  CHECK(strs.size() == static_cast<std::size_t>(rounds - hits[2]));
  CHECK(sink.size() == static_cast<std::size_t>(hits[3]));
}

TEST_CASE("select: a cancelled fiber throws Cancelled and withdraws every case") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (bool timed : {false, true}) {
      fiber::Channel<int> a, b;
      fiber::Channel<std::string> c;
      std::optional<int> x;
      std::string v = "kept";
      auto h = spawn_cancellable(s, [&] {
        if (timed) {
          (void)fiber::select(fiber::recv_case(a, x), fiber::send_case(c, v), fiber::recv_case(b, x), fiber::timeout_case(1h));
        } else {
          (void)fiber::select(fiber::recv_case(a, x), fiber::send_case(c, v), fiber::recv_case(b, x));
        }
        FAIL_CHECK("select returned in a cancelled fiber");
      });
      fiber::this_fiber::sleep_for(1ms);
      h.cancel();
      CHECK(h.join());  // threw Cancelled
      CHECK(v == "kept");
      CHECK_FALSE(a.try_send(1));
      CHECK_FALSE(b.try_send(1));
      CHECK(c.try_recv().status == fiber::ChanStatus::empty);
    }
  });
}

TEST_CASE("select: stress - values are conserved through racing selects, timeouts included") {
  // Producers feed two input channels of different types; selectors move values from either input
  // to the output (selecting over both inputs, the output, and a short timeout); consumers drain
  // the output. Every value must come out exactly once.
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int per_input = kTsan ? 400 : (kSanitized ? 1500 : 6000);
    const int selectors = 4;
    for (std::size_t cap : {std::size_t{0}, std::size_t{3}}) {
      CAPTURE(cap);
      fiber::Channel<int> in_a(cap);
      fiber::Channel<long> in_b(cap);
      fiber::Channel<long> out(cap);
      std::vector<std::atomic<int>> seen(2 * per_input);
      std::atomic<long> forwarded{0};
      fiber::WaitGroup producers, movers;
      producers.add(2);
      movers.add(selectors);
      Team team;
      team.spawn(Where::fiber, s, [&] {
        for (int i = 0; i < per_input; ++i) in_a.send(i);
        producers.done();
      });
      team.spawn(Where::thread, s, [&] {
        for (int i = 0; i < per_input; ++i) {
          std::optional<long> unused;
          long v = per_input + i;
          // A select with one send case and a timeout: retried until it sends.
          while (fiber::select(fiber::send_case(in_b, v), fiber::timeout_case(50us), fiber::recv_case(out, unused)) != 0) {
            if (unused) {  // took an output value: put it back for the consumers
              out.send(long(*unused));
              unused.reset();
            }
          }
        }
        producers.done();
      });
      team.spawn(Where::fiber, s, [&] {
        producers.wait();
        in_a.close();
        in_b.close();
        movers.wait();
        out.close();
      });
      for (int k = 0; k < selectors; ++k) {
        team.spawn(k == 0 ? Where::thread : Where::fiber, s, [&] {
          bool a_open = true, b_open = true;
          std::optional<long> pending;  // a value taken from an input, not yet forwarded
          fiber::Channel<int> dead_a;    // stands in for a closed input (never ready)
          fiber::Channel<long> dead_b;
          while (a_open || b_open || pending) {
            if (pending) {
              std::optional<int> xa;
              std::optional<long> xb;
              // Forward, or keep taking inputs? Only forwarding is allowed while one is pending.
              const std::size_t r = fiber::select(fiber::send_case(out, *pending), fiber::timeout_case(100us));
              if (r == 0) {
                pending.reset();
                forwarded.fetch_add(1);
              }
              continue;
            }
            std::optional<int> xa;
            std::optional<long> xb;
            const std::size_t r = fiber::select(fiber::recv_case(a_open ? in_a : dead_a, xa),
                                                fiber::recv_case(b_open ? in_b : dead_b, xb), fiber::timeout_case(200us));
            if (r == 0) {
              if (xa) pending = *xa; else a_open = false;
            } else if (r == 1) {
              if (xb) pending = *xb; else b_open = false;
            }
          }
          movers.done();
        });
      }
      std::atomic<long> consumed{0};
      for (int k = 0; k < 2; ++k) {
        team.spawn(k == 0 ? Where::fiber : Where::thread, s, [&] {
          for (long v : out) {
            REQUIRE(v >= 0);
            REQUIRE(v < 2 * per_input);
            seen[v].fetch_add(1);
            consumed.fetch_add(1);
          }
        });
      }
      team.join();
      CHECK(consumed.load() == 2 * per_input);
      CHECK(forwarded.load() == 2 * per_input);
      int bad = 0;
      for (auto& c : seen) bad += c.load() != 1;
      CHECK(bad == 0);
    }
  });
}

TEST_CASE("select: a timeout racing a wake, 10^5 times - exactly one outcome each time") {
  // A selector waits on two channels with a tiny random timeout while two peers send with tiny
  // random timeouts. Every value a peer was told it delivered must arrive exactly once, in order
  // per peer; every timed-out send must not arrive.
  const int rounds = kTsan ? 5'000 : (kSanitized ? 20'000 : 100'000);
  for (Where peer : kBoth) {
    with_watchdog(120s, "select timeout race", [&] {
      fiber::Scheduler s({.processors = 2, .name = "srace"});
      fiber::Channel<long> a;
      fiber::Channel<int> b;
      std::atomic<bool> done{false};
      long sent_a = 0, got_a = 0;
      int sent_b = 0, got_b = 0;
      Team team;
      team.spawn(Where::fiber, s, [&] {
        std::minstd_rand rng(3);
        std::optional<long> xa;
        std::optional<int> xb;
        for (int i = 0; i < rounds; ++i) {
          const auto d = std::chrono::microseconds(static_cast<int>(rng() % 30) - 3);
          const std::size_t r = fiber::select(fiber::recv_case(a, xa), fiber::timeout_case(d), fiber::recv_case(b, xb));
          if (r == 0) {
            REQUIRE(*xa == got_a);
            ++got_a;
          } else if (r == 2) {
            REQUIRE(*xb == got_b);
            ++got_b;
          }
        }
        done.store(true);
      });
      team.spawn(peer, s, [&] {
        std::minstd_rand rng(4);
        while (!done.load()) {
          if (a.send_for(long(sent_a), std::chrono::microseconds(static_cast<int>(rng() % 30) - 3))) ++sent_a;
        }
      });
      team.spawn(Where::fiber, s, [&] {
        std::minstd_rand rng(5);
        while (!done.load()) {
          if (b.send_for(int(sent_b), std::chrono::microseconds(static_cast<int>(rng() % 30) - 3))) ++sent_b;
        }
      });
      team.join();
      CHECK(sent_a == got_a);
      CHECK(sent_b == got_b);
    });
  }
}
