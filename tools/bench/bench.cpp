// libfiber's side of the peer workload suite (../shared/peers/README.md): the same workloads
// with the same semantics, printing the same result lines:
//
//   workload=NAME impl=libfiber value=NUMBER unit=UNIT [extra=K=V,...]
//
// Usage: fiber-bench WORKLOAD [N]. Each run is a fresh process; times are taken inside the
// process around the workload only, with the steady clock. "_1t" workloads and yield use one
// processor, the others one per core (nproc).
#include <fiber/fiber.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

double ns_since(Clock::time_point t0) { return std::chrono::duration<double, std::nano>(Clock::now() - t0).count(); }

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fiber-bench: %s\n", what);
  std::exit(1);
}

std::size_t all_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? n : 1;
}

// yield: one processor; two fibers each yield n/2 times while the spawning fiber waits in join.
void yield(long n) {
  fiber::Scheduler s({.processors = 1, .name = "bench"});
  const long per = n / 2;
  double ns = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    auto body = [per] {
      for (long i = 0; i < per; ++i) fiber::this_fiber::yield();
    };
    const auto t0 = Clock::now();
    auto a = fiber::spawn(body);
    auto b = fiber::spawn(body);
    a.join();
    b.join();
    ns = ns_since(t0) / static_cast<double>(2 * per);
  });
  std::printf("workload=yield impl=libfiber value=%.2f unit=ns/switch extra=switches=%ld\n", ns, 2 * per);
}

// spawn: the timing fiber spawns n trivial fibers in a plain loop, each counting down a
// WaitGroup, then waits for zero.
void spawn(const char* name, std::size_t procs, long n) {
  fiber::Scheduler s({.processors = procs, .name = "bench"});
  double ns = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    fiber::WaitGroup wg;
    wg.add(n);
    const auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) {
      go [&wg] { wg.done(); };
    }
    wg.wait();
    ns = ns_since(t0) / static_cast<double>(n);
  });
  std::printf("workload=%s impl=libfiber value=%.1f unit=ns/fiber extra=fibers=%ld\n", name, ns, n);
}

struct Workload {
  long default_n;
  std::function<void(long)> run;
};

std::map<std::string, Workload> workloads() {
  return {
      {"yield", {10'000'000, [](long n) { yield(n); }}},
      {"spawn", {1'000'000, [](long n) { spawn("spawn", all_threads(), n); }}},
      {"spawn_1t", {1'000'000, [](long n) { spawn("spawn_1t", 1, n); }}},
  };
}

}  // namespace

int main(int argc, char** argv) {
  auto all = workloads();
  if (argc < 2 || all.find(argv[1]) == all.end()) {
    std::string names;
    for (auto& [k, v] : all) names += " " + k;
    std::fprintf(stderr, "usage: fiber-bench WORKLOAD [N]\nworkloads:%s\n", names.c_str());
    return 2;
  }
  const Workload& w = all[argv[1]];
  long n = w.default_n;
  if (argc > 2) {
    char* end = nullptr;
    n = std::strtol(argv[2], &end, 10);
    if (end == argv[2] || *end != '\0' || n <= 0) fail("N must be a positive integer");
  }
  w.run(n);
  return 0;
}
