// Shared helpers of the synchronisation tests: a Team of fibers and plain threads that joins
// them all and rethrows the first failure, a UsageError-message check, and a cancellable spawn.
#pragma once

#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace fiber_test {

enum class Where { fiber, thread };
inline std::string where_name(Where w) { return w == Where::fiber ? "fiber" : "thread"; }
constexpr Where kBoth[] = {Where::fiber, Where::thread};

// Participants of a test: fibers on some scheduler and plain threads. join() waits for all and
// rethrows the first exception; the destructor joins too (so locals outlive every participant).
class Team {
 public:
  Team() = default;
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  ~Team() {
    try {
      join();
    } catch (...) {
    }
  }
  template <typename F>
  void spawn(Where w, fiber::Scheduler& s, F f) {
    if (w == Where::fiber) {
      fibers_.push_back(fiber::spawn({.scheduler = &s}, std::move(f)));
    } else {
      threads_.emplace_back([this, f = std::move(f)]() mutable {
        try {
          f();
        } catch (...) {
          record(std::current_exception());
        }
      });
    }
  }
  void join() {
    for (auto& h : fibers_) {
      try {
        h.join();
      } catch (...) {
        record(std::current_exception());
      }
    }
    for (auto& t : threads_) t.join();
    fibers_.clear();
    threads_.clear();
    std::exception_ptr e;
    {
      std::lock_guard lock(mu_);
      e = std::exchange(error_, nullptr);
    }
    if (e) std::rethrow_exception(e);
  }

 private:
  void record(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = e;
  }
  std::vector<fiber::JoinHandle<void>> fibers_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::exception_ptr error_;
};

template <typename F>
inline void expect_usage_error(F&& f, std::string_view needle) {
  try {
    f();
    FAIL_CHECK("no exception; expected one mentioning '" << needle << "'");
  } catch (const fiber::UsageError& e) {
    CHECK_MESSAGE(contains(e.what(), needle), "message: " << e.what());
  }
}

// Spawns body on s; join() returns true iff body ended by throwing fiber::Cancelled. The fiber
// catches it itself, so the exception object never crosses threads through an exception_ptr
// (which TSan cannot follow: libstdc++'s refcount is not instrumented).
template <typename F>
fiber::JoinHandle<bool> spawn_cancellable(fiber::Scheduler& s, F body) {
  return fiber::spawn({.scheduler = &s}, [body = std::move(body)]() mutable {
    try {
      body();
    } catch (const fiber::Cancelled&) {
      return true;
    }
    return false;
  });
}

}  // namespace fiber_test
