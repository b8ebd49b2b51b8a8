// A cancel racing the start of a wait, many times over.
//
// A fiber begins each wait with a plain store of its wake word (sync/wait.cpp, waiter_prepare),
// which overwrites the cancel bit of a cancel that lands between the fiber's load of the word
// and that store. The fiber then finds the cancel's flag and sets the bit again; were it not to,
// the cancel would be lost: the cancel saw no wait to end, and the fiber waits on.
//
// Here two fibers ping-pong on unbuffered channels, starting a wait every few tens of
// nanoseconds, while a plain thread cancels both at a random moment. Each must then end with
// fiber::Cancelled; a lost cancel leaves its fiber waiting for its cancelled partner for ever,
// which the bounded wait_for catches (and a second cancel then ends it, so the run goes on).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <chrono>
#include <memory>
#include <random>

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

constexpr int kRounds = kTsan ? 300 : (kSanitized ? 3000 : 20000);  // per processor count

void spin_for(std::chrono::nanoseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

}  // namespace

TEST_CASE("cancel racing wait starts: ping-ponging fibers cancelled at random moments always end") {
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> delay_ns(0, 20'000);
  for (const int procs : {1, 2}) {
    CAPTURE(procs);
    Watchdog dog(120'000ms, "cancel race");
    fiber::Scheduler s({.processors = static_cast<std::size_t>(procs), .name = "cr"});
    int lost = 0;
    int round = 0;
    for (; round < kRounds && lost == 0; ++round) {
      auto ping = std::make_shared<fiber::Channel<int>>();
      auto pong = std::make_shared<fiber::Channel<int>>();
      auto a = fiber::spawn({.scheduler = &s}, [ping, pong] {
        for (;;) {
          ping->send(1);
          (void)pong->recv();
        }
      });
      auto b = fiber::spawn({.scheduler = &s}, [ping, pong] {
        for (;;) {
          (void)ping->recv();
          pong->send(2);
        }
      });
      spin_for(std::chrono::nanoseconds(delay_ns(rng)));
      a.cancel();
      b.cancel();
      for (auto* h : {&a, &b}) {
        if (!h->wait_for(scaled(5'000ms))) {
          ++lost;
          h->cancel();  // this one finds the wait: the fiber ends, the round can be joined
        }
      }
      CHECK_THROWS_AS(a.join(), fiber::Cancelled);
      CHECK_THROWS_AS(b.join(), fiber::Cancelled);
    }
    CHECK_MESSAGE(lost == 0, "a cancel was lost in round " << round << " of " << kRounds);
    quiesce(s);
  }
}
