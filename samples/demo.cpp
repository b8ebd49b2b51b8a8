// libfiber demo: a hundred thousand fibers at work on a few processor threads.
//
//   tools/demo.sh            (sets up, builds, runs this)
//
// 1. spawns 100,000 fibers that each sleep a little and add to a total (block_on waits for all
//    of them: they are spawned inside it);
// 2. a fan-out/fan-in: workers hand results back through JoinHandles;
// 3. an exception thrown in a fiber comes out of join().
#include <fiber/fiber.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <vector>

using namespace std::chrono_literals;

int main() {
  auto& sched = fiber::Scheduler::global();
  std::printf("libfiber demo: %zu processor threads\n", sched.processors());

  // 1. Many concurrent sleepers. Each fiber parks on its processor's timer heap, not a thread.
  constexpr int kSleepers = 100'000;
  std::atomic<long> total{0};
  auto t0 = std::chrono::steady_clock::now();
  fiber::block_on([&] {
    for (int i = 0; i < kSleepers; ++i) {
      go [i, &total] {
        fiber::this_fiber::sleep_for(std::chrono::milliseconds(10 + i % 90));
        total += i;
      };
    }
  });
  auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  %d fibers slept 10-99 ms each, concurrently: %.0f ms in all, sum %ld\n", kSleepers, ms,
              total.load());

  // 2. Fan-out / fan-in with typed join handles.
  long sum = fiber::block_on([] {
    std::vector<fiber::JoinHandle<long>> parts;
    for (long k = 0; k < 8; ++k) {
      parts.push_back(fiber::spawn({.name = "summer"}, [k] {
        long s = 0;
        for (long i = k * 1'000'000; i < (k + 1) * 1'000'000; ++i) {
          s += i;
          if (i % 100'000 == 0) fiber::this_fiber::yield();
        }
        return s;
      }));
    }
    long s = 0;
    for (auto& p : parts) s += p.join();
    return s;
  });
  std::printf("  8 fibers summed 0..7,999,999 = %ld\n", sum);

  // 3. Exceptions travel through join().
  try {
    fiber::spawn([] { throw std::runtime_error("thrown inside a fiber"); }).join();
  } catch (const std::exception& e) {
    std::printf("  join() rethrew: %s\n", e.what());
  }
  return total.load() == static_cast<long>(kSleepers) * (kSleepers - 1) / 2 ? 0 : 1;
}
