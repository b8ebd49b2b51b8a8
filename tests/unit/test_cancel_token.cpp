// fiber::CancelToken (fiber/spawn.hpp): cancelling a fiber without owning it.
//
//   1. A token from a JoinHandle, or from this_fiber inside a `go` fiber, cancels its blocking
//      calls (Cancelled from sleep, -ECANCELED from I/O).
//   2. Tokens are copyable, outlive the fiber, and an empty token does nothing.
//   3. A fiber's captures are destroyed when it finishes, even while a token is held.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>

#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;

TEST_CASE("cancel_token: from a JoinHandle cancels a sleeping fiber, from any thread") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    std::atomic<bool> started{false};
    auto h = fiber::spawn({.scheduler = &s}, [&] {
      started = true;
      fiber::this_fiber::sleep_for(1h);
    });
    fiber::CancelToken tok = h.cancel_token();
    REQUIRE(tok.valid());
    REQUIRE(wait_for([&] { return started.load(); }));
    run_on_thread([tok] { tok.cancel(); });  // a copy, used on a plain thread
    CHECK_THROWS_AS(h.join(), fiber::Cancelled);
    tok.cancel();  // the fiber is gone: no effect
  });
}

// A fiber that never blocks learns of its cancel only by asking.
TEST_CASE("this_fiber::cancelled: false until a cancel, from a token or a handle; false on a plain thread") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    for (bool by_token : {false, true}) {
      std::atomic<bool> started{false};
      auto h = fiber::spawn({.scheduler = &s}, [&] {
        const bool before = fiber::this_fiber::cancelled();
        started = true;
        long spins = 0;
        while (!fiber::this_fiber::cancelled()) ++spins;  // no blocking call: nothing throws
        return before;
      });
      REQUIRE(wait_for([&] { return started.load(); }));
      if (by_token) run_on_thread([tok = h.cancel_token()] { tok.cancel(); }); else h.cancel();
      CHECK_FALSE(h.join());  // not cancelled before: it returned normally, once cancelled
    }
  });
  CHECK_FALSE(fiber::this_fiber::cancelled());
}

TEST_CASE("cancel_token: this_fiber's token ends a go fiber's blocking recv with -ECANCELED") {
  for_each_proc_count([](fiber::Scheduler& s, int) {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    fiber::CancelToken tok;
    std::atomic<bool> have_token{false};
    std::atomic<long> first{1}, second{1};
    fiber::WaitGroup wg;
    wg.add(1);
    go go_on(s) [&] {
      tok = fiber::this_fiber::cancel_token();
      have_token = true;
      char c;
      first = fiber::io::recv(sv[0], &c, 1, 0);   // parks until cancelled
      second = fiber::io::recv(sv[0], &c, 1, 0);  // cancelled fibers stay cancelled
      wg.done();
    };
    REQUIRE(wait_for([&] { return have_token.load(); }));
    tok.cancel();
    wg.wait();
    CHECK(first.load() == -ECANCELED);
    CHECK(second.load() == -ECANCELED);
    ::close(sv[0]);
    ::close(sv[1]);
    quiesce(s);
  });
}

TEST_CASE("cancel_token: empty tokens do nothing; this_fiber's token on a plain thread is empty") {
  fiber::CancelToken empty;
  CHECK_FALSE(empty.valid());
  empty.cancel();
  fiber::CancelToken from_thread = fiber::this_fiber::cancel_token();
  CHECK_FALSE(from_thread.valid());
  fiber::JoinHandle<void> none;
  CHECK_FALSE(none.cancel_token().valid());
}

TEST_CASE("cancel_token: captures are destroyed when the fiber ends, while a token is held") {
  fiber::Scheduler s({.processors = 2, .name = "tok"});
  auto alive = std::make_shared<int>(7);
  std::weak_ptr<int> watch = alive;
  auto h = fiber::spawn({.scheduler = &s}, [p = std::move(alive)] { return *p; });
  fiber::CancelToken tok = h.cancel_token();
  CHECK(h.join() == 7);
  CHECK(watch.expired());  // the capture went with the fiber, not with the token
  CHECK(tok.valid());
}

}  // namespace
