// Channel<T> (fiber/channel.hpp): Go's rules - rendezvous and buffered transfer, FIFO order,
// close (drain, then "closed"; send/close on a closed channel throw; close wakes every blocked
// sender and receiver), timed and non-blocking variants, range-for, move-only values - with
// fibers and plain threads on both sides, across processors and schedulers. Stress: every value
// is received exactly once; a timeout racing a wake 10^5 times loses and duplicates nothing.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "team.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

}  // namespace

TEST_CASE("channel: rendezvous and buffered transfer keep order, every side combination") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int n = kSanitized ? 300 : 2000;
    for (std::size_t cap : {std::size_t{0}, std::size_t{1}, std::size_t{7}}) {
      for (Where snd : kBoth) {
        for (Where rcv : kBoth) {
          CAPTURE(cap);
          CAPTURE(where_name(snd));
          CAPTURE(where_name(rcv));
          fiber::Channel<int> ch(cap);
          std::atomic<int> recv_started{0};
          Team team;
          team.spawn(rcv, s, [&] {
            for (int i = 0; i < n; ++i) {
              recv_started.store(i + 1);
              std::optional<int> v = ch.recv();
              REQUIRE(v.has_value());
              CHECK(*v == i);
            }
          });
          team.spawn(snd, s, [&] {
            for (int i = 0; i < n; ++i) {
              ch.send(i);
              // Rendezvous: send returns only once a receiver took the value.
              if (cap == 0) CHECK(recv_started.load() >= i + 1);
            }
          });
          team.join();
          CHECK(ch.size() == 0);
        }
      }
    }
  });
}

TEST_CASE("channel: capacity, try_send/try_recv and FIFO order") {
  fiber::Channel<int> ch(3);
  CHECK(ch.capacity() == 3);
  CHECK(ch.try_send(1));
  CHECK(ch.try_send(2));
  int three = 3;
  CHECK(ch.try_send(three));
  CHECK(ch.size() == 3);
  CHECK_FALSE(ch.try_send(4));  // full
  auto r = ch.try_recv();
  REQUIRE(r);
  CHECK(*r == 1);
  CHECK(ch.try_send(4));
  for (int want : {2, 3, 4}) {
    auto x = ch.try_recv();
    REQUIRE(x.status == fiber::ChanStatus::ok);
    CHECK(*x == want);
  }
  auto e = ch.try_recv();
  CHECK_FALSE(e);
  CHECK(e.status == fiber::ChanStatus::empty);
  CHECK_FALSE(e.value.has_value());

  // Unbuffered: try_send succeeds only with a receiver waiting, try_recv only with a sender.
  fiber::Channel<int> rv;
  CHECK_FALSE(rv.try_send(1));
  CHECK(rv.try_recv().status == fiber::ChanStatus::empty);
  run_on_thread([&] {
    std::thread t([&] { CHECK(rv.recv() == 9); });
    CHECK(wait_for([&] { return rv.try_send(9); }));
    t.join();
  });
}

TEST_CASE("channel: close - drain, then closed; send and double close throw ChannelClosed") {
  fiber::Channel<std::string> ch(4);
  ch.send("a");
  ch.send(std::string("b"));
  CHECK_FALSE(ch.closed());
  ch.close();
  CHECK(ch.closed());
  expect_usage_error([&] { ch.send("c"); }, "send on a closed channel");
  expect_usage_error([&] { ch.try_send("c"); }, "closed channel");
  expect_usage_error([&] { ch.send_for("c", 1ms); }, "closed channel");
  expect_usage_error([&] { ch.close(); }, "already closed");
  CHECK_THROWS_AS(ch.close(), fiber::ChannelClosed);
  CHECK(ch.recv() == "a");
  auto b = ch.try_recv();
  REQUIRE(b);
  CHECK(*b == "b");
  CHECK(ch.recv() == std::nullopt);
  CHECK(ch.try_recv().status == fiber::ChanStatus::closed);
  CHECK(ch.recv_for(1s).status == fiber::ChanStatus::closed);
  CHECK(ch.recv_until(Clock::now() - 1s).status == fiber::ChanStatus::closed);

  // Range-for drains a closed channel and stops.
  fiber::Channel<int> c2(8);
  for (int i = 0; i < 5; ++i) c2.send(i);
  c2.close();
  int next = 0;
  for (int v : c2) CHECK(v == next++);
  CHECK(next == 5);
  // An exception derived from UsageError: callers can catch either.
  static_assert(std::is_base_of_v<fiber::UsageError, fiber::ChannelClosed>);
}

TEST_CASE("channel: close wakes every blocked receiver and every blocked sender") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int per_side = kSanitized ? 16 : 64;
    // Receivers blocked on an empty channel (fibers and threads) all learn "closed".
    {
      fiber::Channel<int> ch;
      std::atomic<int> closed_seen{0};
      Team team;
      for (int i = 0; i < per_side; ++i) {
        team.spawn(i % 4 == 0 ? Where::thread : Where::fiber, s, [&] {
          CHECK(ch.recv() == std::nullopt);
          closed_seen.fetch_add(1);
        });
      }
      fiber::this_fiber::sleep_for(5ms);  // let most of them block (not required for correctness)
      ch.close();
      team.join();
      CHECK(closed_seen.load() == per_side);
    }
    // Senders blocked on a full channel all throw ChannelClosed, keeping their values; the
    // buffered value is still delivered.
    {
      fiber::Channel<std::unique_ptr<int>> ch(1);
      ch.send(std::make_unique<int>(-1));
      std::atomic<int> failed{0};
      Team team;
      for (int i = 0; i < per_side; ++i) {
        team.spawn(i % 4 == 1 ? Where::thread : Where::fiber, s, [&, i] {
          auto p = std::make_unique<int>(i);
          try {
            ch.send(std::move(p));
            FAIL_CHECK("send on a channel closed while waiting returned");
          } catch (const fiber::ChannelClosed& e) {
            CHECK(contains(e.what(), "closed"));
            REQUIRE(p);  // not consumed
            CHECK(*p == i);
            failed.fetch_add(1);
          }
        });
      }
      fiber::this_fiber::sleep_for(5ms);
      ch.close();
      team.join();
      CHECK(failed.load() == per_side);
      auto v = ch.recv();
      REQUIRE(v.has_value());
      CHECK(**v == -1);
      CHECK(ch.recv() == std::nullopt);
    }
  });
}

TEST_CASE("channel: move-only values through buffer, rendezvous and range-for") {
  for_each_proc_count(
      [](fiber::Scheduler& s, int) {
        for (std::size_t cap : {std::size_t{0}, std::size_t{3}}) {
          fiber::Channel<std::unique_ptr<int>> ch(cap);
          Team team;
          team.spawn(Where::fiber, s, [&] {
            for (int i = 0; i < 100; ++i) ch.send(std::make_unique<int>(i));
            auto keep = std::make_unique<int>(7);
            if (cap > 0) {
              // A failing try_send leaves its argument alone.
              while (ch.try_send(std::make_unique<int>(1000))) {
              }
            }
            ch.close();
            CHECK(*keep == 7);
          });
          int next = 0;
          team.spawn(Where::thread, s, [&] {
            for (auto& p : ch) {
              REQUIRE(p);
              if (*p == 1000) continue;
              CHECK(*p == next++);
              std::unique_ptr<int> mine = std::move(p);  // move out of the range element
            }
          });
          team.join();
          CHECK(next == 100);
        }
        // Values left in a buffered channel are destroyed with it (ASan: no leak).
        fiber::Channel<std::unique_ptr<std::string>> left(4);
        left.send(std::make_unique<std::string>("left behind"));
        left.send(std::make_unique<std::string>("and another"));
      },
      {1, 2});
}

TEST_CASE("channel: timed send and receive; negative timeouts are already expired") {
  for (Where w : kBoth) {
    CAPTURE(where_name(w));
    fiber::Scheduler s({.processors = 2, .name = "tc"});
    Team team;
    team.spawn(w, s, [] {
      fiber::Channel<int> ch(1);
      // Timeouts: never before the deadline.
      auto t0 = Clock::now();
      auto r = ch.recv_for(20ms);
      CHECK(Clock::now() - t0 >= 20ms);
      CHECK(r.status == fiber::ChanStatus::timeout);
      CHECK_FALSE(r.value.has_value());
      t0 = Clock::now();
      CHECK(ch.recv_until(t0 + 15ms).status == fiber::ChanStatus::timeout);
      CHECK(Clock::now() >= t0 + 15ms);
      // Another clock's deadline.
      const auto sys0 = std::chrono::system_clock::now();
      t0 = Clock::now();
      CHECK(ch.recv_until(sys0 + 10ms).status == fiber::ChanStatus::timeout);
      CHECK(Clock::now() - t0 >= 9ms);  // clocks differ by the conversion's rounding only

      CHECK(ch.send_for(1, 10ms));  // room: at once
      int v = 2;
      t0 = Clock::now();
      CHECK_FALSE(ch.send_for(std::move(v), 20ms));
      CHECK(Clock::now() - t0 >= 20ms);
      CHECK(v == 2);
      CHECK_FALSE(ch.send_until(3, Clock::now() + 5ms));

      // Negative / zero / past: already expired, but an operation that can complete at once does.
      CHECK_FALSE(ch.send_for(4, -5s));
      CHECK_FALSE(ch.send_for(4, 0ms));
      auto got = ch.recv_for(-1s);
      REQUIRE(got);
      CHECK(*got == 1);
      t0 = Clock::now();
      CHECK(ch.recv_for(-1s).status == fiber::ChanStatus::timeout);
      CHECK(ch.recv_until(Clock::now() - 1h).status == fiber::ChanStatus::timeout);
      CHECK(ch.recv_for(std::chrono::nanoseconds::min()).status == fiber::ChanStatus::timeout);
      CHECK(Clock::now() - t0 < 5s);  // returned without waiting (a generous bound)
      // A huge timeout does not overflow: the value arrives first.
      CHECK(ch.send_for(5, std::chrono::hours::max()));
      CHECK(*ch.recv_for(std::chrono::hours::max()) == 5);
    });
    team.join();
  }
}

TEST_CASE("channel: a timed receive completes when a value arrives in time") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (Where rcv : kBoth) {
      fiber::Channel<int> ch;
      Team team;
      team.spawn(rcv, s, [&] {
        auto r = ch.recv_for(60s);
        REQUIRE(r);
        CHECK(*r == 42);
      });
      team.spawn(Where::fiber, s, [&] { CHECK(ch.send_for(42, 60s)); });
      team.join();
    }
  });
}

TEST_CASE("channel: MPMC stress - every value received exactly once") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    const int producers = 4, consumers = 4;
    const int per_producer = kTsan ? 500 : (kSanitized ? 1500 : 5000);
    for (std::size_t cap : {std::size_t{0}, std::size_t{1}, std::size_t{16}}) {
      CAPTURE(cap);
      fiber::Channel<int> ch(cap);
      std::vector<std::atomic<int>> seen(producers * per_producer);
      fiber::WaitGroup wg;
      wg.add(producers);
      Team team;
      for (int p = 0; p < producers; ++p) {
        team.spawn(p == 0 ? Where::thread : Where::fiber, s, [&, p] {
          for (int i = 0; i < per_producer; ++i) {
            const int v = p * per_producer + i;
            if (i % 3 == 0) {
              while (!ch.try_send(int(v))) fiber::this_fiber::yield();
            } else if (i % 3 == 1) {
              while (!ch.send_for(int(v), 200us)) {
              }
            } else {
              ch.send(int(v));
            }
          }
          wg.done();
        });
      }
      team.spawn(Where::fiber, s, [&] {
        wg.wait();
        ch.close();
      });
      std::atomic<long> received{0};
      for (int c = 0; c < consumers; ++c) {
        team.spawn(c == 0 ? Where::thread : Where::fiber, s, [&, c] {
          std::vector<int> last(producers, -1);  // per-producer FIFO
          auto take = [&](int v) {
            seen[v].fetch_add(1);
            const int p = v / per_producer, i = v % per_producer;
            CHECK(i > last[p]);
            last[p] = i;
            received.fetch_add(1);
          };
          if (c % 2 == 0) {
            for (int v : ch) take(v);
          } else {
            for (;;) {
              auto r = ch.recv_for(300us);
              if (r) take(*r);
              else if (r.status == fiber::ChanStatus::closed) break;
            }
          }
        });
      }
      team.join();
      CHECK(received.load() == producers * per_producer);
      int bad = 0;
      for (auto& x : seen) bad += x.load() != 1;
      CHECK(bad == 0);
    }
  });
}

TEST_CASE("channel: timeouts racing wakes - nothing lost, nothing delivered twice") {
  // The receiver calls recv_for with tiny random timeouts (some already expired) while the sender
  // calls send_for likewise: each timed wait is claimed either by its timer or by its peer,
  // exactly once. Values are consecutive, so a lost value (a sender told "delivered" whose value
  // never arrived) or a duplicate (a sender told "timed out" whose value did arrive) breaks the
  // sequence.
  struct Config {
    Where rcv, snd;
    int procs;
    int waits;
  };
  const int big = kTsan ? 5'000 : (kSanitized ? 20'000 : 100'000);
  const int small = big / 4;
  for (const Config& c : {Config{Where::fiber, Where::fiber, 2, big}, Config{Where::fiber, Where::fiber, 1, small},
                          Config{Where::fiber, Where::thread, 2, small}, Config{Where::thread, Where::fiber, 2, small},
                          Config{Where::thread, Where::thread, 1, small}}) {
    CAPTURE(where_name(c.rcv));
    CAPTURE(where_name(c.snd));
    CAPTURE(c.procs);
    with_watchdog(120s, "channel timeout race", [&] {
      fiber::Scheduler s({.processors = static_cast<std::size_t>(c.procs), .name = "race"});
      for (std::size_t cap : {std::size_t{0}, std::size_t{1}}) {
        fiber::Channel<long> ch(cap);
        std::atomic<bool> done{false};
        long sent = 0, received = 0, timeouts = 0;
        Team team;
        team.spawn(c.rcv, s, [&] {
          std::minstd_rand rng(1);
          for (int i = 0; i < c.waits; ++i) {
            const auto d = std::chrono::microseconds(static_cast<int>(rng() % 40) - 5);
            auto r = ch.recv_for(d);
            if (r) {
              REQUIRE(*r == received);
              ++received;
            } else {
              REQUIRE(r.status == fiber::ChanStatus::timeout);
              ++timeouts;
            }
          }
          done.store(true);
        });
        team.spawn(c.snd, s, [&] {
          std::minstd_rand rng(2);
          while (!done.load()) {
            const auto d = std::chrono::microseconds(static_cast<int>(rng() % 40) - 5);
            if (ch.send_for(long(sent), d)) ++sent;
          }
        });
        team.join();
        // Whatever is still buffered was sent but not received.
        long left = 0;
        while (auto r = ch.try_recv()) {
          CHECK(*r == received + left);
          ++left;
        }
        CHECK(sent == received + left);
        CHECK(received + timeouts == c.waits);
      }
    });
  }
}

TEST_CASE("channel: two schedulers and plain threads share one channel") {
  with_watchdog(60s, "two schedulers", [] {
    fiber::Scheduler a({.processors = 2, .name = "A"});
    fiber::Scheduler b({.processors = 3, .name = "B"});
    const int n = kSanitized ? 500 : 5000;
    fiber::Channel<int> ping, pong(2);
    Team team;
    team.spawn(Where::fiber, a, [&] {
      for (int i = 0; i < n; ++i) {
        ping.send(i);
        CHECK(pong.recv() == i * 2);
      }
      ping.close();
    });
    team.spawn(Where::fiber, b, [&] {
      for (int v : ping) pong.send(v * 2);
    });
    team.join();
    // Fibers of A and B plus a thread, all on one buffered channel.
    fiber::Channel<int> ch(4);
    std::atomic<long> sum{0};
    team.spawn(Where::fiber, a, [&] {
      for (int i = 1; i <= n; ++i) ch.send(i);
    });
    team.spawn(Where::thread, a, [&] {
      for (int i = 1; i <= n; ++i) ch.send(-i);
    });
    team.spawn(Where::fiber, b, [&] {
      for (int i = 0; i < n; ++i) sum += *ch.recv();
    });
    team.spawn(Where::fiber, a, [&] {
      for (int i = 0; i < n; ++i) sum += *ch.recv();
    });
    team.join();
    CHECK(sum.load() == 0);
  });
}

TEST_CASE("channel: a cancelled fiber throws Cancelled and leaves the channel as if it never waited") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (bool timed : {false, true}) {
      fiber::Channel<int> in, out(1);
      out.send(0);  // full: a sender blocks
      std::atomic<int> unwound{0};
      auto receiver = spawn_cancellable(s, [&] {
        DtorCounter d(unwound);
        if (timed) (void)in.recv_for(1h); else (void)in.recv();
        FAIL_CHECK("recv returned in a cancelled fiber");
      });
      auto sender = spawn_cancellable(s, [&] {
        DtorCounter d(unwound);
        if (timed) (void)out.send_for(1, 1h); else out.send(1);
        FAIL_CHECK("send returned in a cancelled fiber");
      });
      fiber::this_fiber::sleep_for(2ms);  // usually parked by now; either way they must unwind
      receiver.cancel();
      sender.cancel();
      CHECK(receiver.join());  // threw Cancelled
      CHECK(sender.join());  // threw Cancelled
      CHECK(unwound.load() == 2);
      // Their nodes were withdrawn: no receiver waits on `in`, the sender's value never arrived.
      CHECK_FALSE(in.try_send(3));
      CHECK(*out.recv() == 0);
      CHECK(out.try_recv().status == fiber::ChanStatus::empty);
    }
  });
}
