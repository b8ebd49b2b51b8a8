// libfiber's side of the peer workload suite (../shared/peers/README.md): the same workloads
// with the same semantics, printing the same result lines:
//
//   workload=NAME impl=libfiber value=NUMBER unit=UNIT [extra=K=V,...]
//
// Usage: fiber-bench WORKLOAD [N]. Each run is a fresh process; times are taken inside the
// process around the workload only, with the steady clock. "_1t" workloads and yield use one
// processor, the others one per core (nproc). Beyond the peers' suite: idle_1m_compact (idle_1m
// with compact stacks), mutex (a contended fiber::Mutex), fileread (io::pread through the ring
// against plain pread), and the socket path without a client process: tcp_pingpong (round
// trips, every read parks) and tcp_stream (bulk, most reads find data waiting).
#include <fiber/fiber.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <map>
#include <string>
#include <thread>
#include <vector>

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

// skynet: a fiber per node of a 10-ary tree with 1,000,000 leaves; leaves send their number
// on the parent's unbuffered channel, inner nodes sum their 10 children's and send the sum.
void skynet_node(fiber::Channel<long>& parent, long num, long size) {
  if (size == 1) {
    parent.send(num);
    return;
  }
  fiber::Channel<long> rc;
  for (long i = 0; i < 10; ++i) {
    const long sub = num + i * (size / 10);
    go [&rc, sub, size] { skynet_node(rc, sub, size / 10); };
  }
  long sum = 0;
  for (int i = 0; i < 10; ++i) sum += *rc.recv();
  parent.send(sum);
}

void skynet(const char* name, std::size_t procs, long n) {
  fiber::Scheduler s({.processors = procs, .name = "bench"});
  long sum = 0;
  double ms = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    fiber::Channel<long> c;
    const auto t0 = Clock::now();
    go [&c, n] { skynet_node(c, 0, n); };
    sum = *c.recv();
    ms = ns_since(t0) / 1e6;
  });
  if (sum != n * (n - 1) / 2) fail("skynet: wrong sum");
  std::printf("workload=%s impl=libfiber value=%.1f unit=ms extra=sum=%ld\n", name, ms, sum);
}

// pingpong: A sends i on ping, B answers i+1 on pong; n round trips over unbuffered channels.
void pingpong(const char* name, std::size_t procs, long n) {
  fiber::Scheduler s({.processors = procs, .name = "bench"});
  long acc = 0;
  double ns = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    fiber::Channel<long> ping, pong, done;
    const auto t0 = Clock::now();
    go [&] {
      while (std::optional<long> v = ping.recv()) pong.send(*v + 1);
    };
    go [&] {
      long a = 0;
      for (long i = 0; i < n; ++i) {
        ping.send(i);
        a += *pong.recv() - i;
      }
      ping.close();
      done.send(a);
    };
    acc = *done.recv();
    ns = ns_since(t0) / static_cast<double>(n);
  });
  if (acc != n) fail("pingpong: wrong checksum");
  std::printf("workload=%s impl=libfiber value=%.1f unit=ns/roundtrip extra=roundtrips=%ld\n", name, ns, n);
}

long vm_rss_kib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) fail("cannot open /proc/self/status");
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::strtol(line + 6, nullptr, 10);
  }
  std::fclose(f);
  if (kib < 0) fail("no VmRSS");
  return kib;
}

// idle: n fibers parked on one unbuffered channel; resident memory per parked fiber.
// stack_size 0: the default stacks; otherwise e.g. fiber::compact_stack_size.
void idle(const char* name, long n, std::size_t stack_size) {
  fiber::Scheduler s({.processors = all_threads(), .name = "bench"});
  const long base = vm_rss_kib();
  fiber::Channel<int> gate;
  fiber::WaitGroup started, finished;
  started.add(n);
  finished.add(n);
  for (long i = 0; i < n; ++i) {
    fiber::spawn({.stack_size = stack_size, .scheduler = &s}, [&] {
      started.done();
      gate.recv();
      finished.done();
    }).detach();
  }
  started.wait();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the last ones park
  const long parked = vm_rss_kib();
  gate.close();
  finished.wait();
  std::printf("workload=%s impl=libfiber value=%.3f unit=KiB/fiber extra=fibers=%ld,base_kib=%ld,parked_kib=%ld,stack=%zu\n",
              name, static_cast<double>(parked - base) / static_cast<double>(n), n, base, parked,
              stack_size ? stack_size : std::size_t{64 * 1024});
}

// mutex (ours only): 4 fibers per processor take one fiber::Mutex n times in all.
void mutex_contended(long n) {
  const std::size_t procs = all_threads();
  fiber::Scheduler s({.processors = procs, .name = "bench"});
  fiber::Mutex mu;
  long counter = 0;
  double ns = 0;
  const long workers = static_cast<long>(4 * procs);
  fiber::block_on({.scheduler = &s}, [&] {
    const auto t0 = Clock::now();
    fiber::WaitGroup wg;
    wg.add(workers);
    for (long w = 0; w < workers; ++w) {
      go [&, w] {
        for (long i = w; i < n; i += workers) {
          std::lock_guard lock(mu);
          ++counter;
        }
        wg.done();
      };
    }
    wg.wait();
    ns = ns_since(t0) / static_cast<double>(n);
  });
  if (counter != n) fail("mutex: lost increments");
  std::printf("workload=mutex impl=libfiber value=%.1f unit=ns/lock extra=locks=%ld,fibers=%ld\n", ns, n, workers);
}

// fileread (ours only): 4 KiB reads at random offsets of a 64 MiB file in the page cache.
// 64 fibers on one processor share n io::pread calls (through the ring); then one plain thread
// makes n ::pread calls, the baseline. Two lines: impl=libfiber and impl=pread.
void fileread(long n) {
  constexpr std::size_t kFile = 64 << 20, kBlock = 4096;
  char path[] = "/tmp/fiber-bench-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) fail("fileread: mkstemp failed");
  unlink(path);
  {
    std::string block(1 << 20, 'x');
    for (std::size_t off = 0; off < kFile; off += block.size()) {
      if (::pwrite(fd, block.data(), block.size(), static_cast<off_t>(off)) != static_cast<ssize_t>(block.size())) {
        fail("fileread: cannot write the file");
      }
    }
  }
  auto offset = [](uint64_t& x) {  // xorshift: a fresh block each time, no locking
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<off_t>((x % (kFile / kBlock)) * kBlock);
  };
  // Warm the page cache once so both sides read from memory.
  {
    char buf[kBlock];
    for (std::size_t off = 0; off < kFile; off += kBlock) (void)::pread(fd, buf, kBlock, static_cast<off_t>(off));
  }
  fiber::Scheduler s({.processors = 1, .name = "bench"});
  constexpr long kFibers = 64;
  std::atomic<long> bad{0};
  double fiber_ns = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    const auto t0 = Clock::now();
    fiber::WaitGroup wg;
    wg.add(kFibers);
    for (long w = 0; w < kFibers; ++w) {
      go [&, w] {
        char buf[kBlock];
        uint64_t x = 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(w);
        for (long i = w; i < n; i += kFibers) {
          if (fiber::io::pread(fd, buf, kBlock, offset(x)) != static_cast<ssize_t>(kBlock)) ++bad;
        }
        wg.done();
      };
    }
    wg.wait();
    fiber_ns = ns_since(t0) / static_cast<double>(n);
  });
  const auto t0 = Clock::now();
  char buf[kBlock];
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (long i = 0; i < n; ++i) {
    if (::pread(fd, buf, kBlock, offset(x)) != static_cast<ssize_t>(kBlock)) ++bad;
  }
  const double plain_ns = ns_since(t0) / static_cast<double>(n);
  ::close(fd);
  if (bad.load() != 0) fail("fileread: short or failed reads");
  std::printf("workload=fileread impl=libfiber value=%.1f unit=ns/read extra=reads=%ld,block=4096,fibers=%ld,procs=1\n",
              fiber_ns, n, kFibers);
  std::printf("workload=fileread impl=pread value=%.1f unit=ns/read extra=reads=%ld,block=4096,threads=1\n", plain_ns, n);
}

// tcp_pingpong (ours only): the socket path without a client process. kPairs TCP connections
// over loopback, both ends on one processor; on each, one fiber sends 64 bytes and waits for
// them back while the other echoes them, n round trips in all. Every read finds its socket
// empty and parks, as a server's does between requests.
void tcp_pingpong(long n) {
  constexpr long kPairs = 32;
  if (n < kPairs) fail("tcp_pingpong: N must be at least 32 (one round trip per connection)");
  constexpr std::size_t kMsg = 64;
  fiber::Scheduler s({.processors = 1, .name = "bench"});
  std::atomic<long> bad{0};
  double ns = 0;
  fiber::block_on({.scheduler = &s}, [&] {
    auto ln = fiber::net::Listener::listen("127.0.0.1:0");
    if (!ln) fail("tcp_pingpong: cannot listen");
    const std::string addr = "127.0.0.1:" + std::to_string(ln->port());
    std::vector<fiber::net::Stream> near, far;
    for (long i = 0; i < kPairs; ++i) {
      auto c = fiber::net::Stream::dial(addr);
      auto a = ln->accept();
      if (!c || !a) fail("tcp_pingpong: cannot connect");
      near.push_back(std::move(*c));
      far.push_back(std::move(*a));
    }
    const long per = n / kPairs;
    const auto t0 = Clock::now();
    fiber::WaitGroup wg;
    wg.add(2 * kPairs);
    for (long i = 0; i < kPairs; ++i) {
      go [&, i] {
        char buf[kMsg] = {};
        for (long k = 0; k < per; ++k) {
          if (near[i].write_all(buf, kMsg) != kMsg || near[i].read_exact(buf, kMsg) != kMsg) ++bad;
        }
        wg.done();
      };
      go [&, i] {
        char buf[kMsg];
        for (long k = 0; k < per; ++k) {
          if (far[i].read_exact(buf, kMsg) != kMsg || far[i].write_all(buf, kMsg) != kMsg) ++bad;
        }
        wg.done();
      };
    }
    wg.wait();
    ns = ns_since(t0) / static_cast<double>(per * kPairs);
  });
  if (bad.load() != 0) fail("tcp_pingpong: short or failed transfers");
  std::printf("workload=tcp_pingpong impl=libfiber value=%.1f unit=ns/roundtrip extra=roundtrips=%ld,conns=%ld,msg=%zu,procs=1\n",
              ns, (n / kPairs) * kPairs, kPairs, kMsg);
}

// tcp_stream (ours only): bulk transfer over one loopback TCP connection on one processor: one
// fiber writes n MiB in 1 MiB writes, the other reads them in 16 KiB reads, so most reads find
// data already waiting (the case Stream::read must not slow down by polling first).
void tcp_stream(long n) {
  constexpr std::size_t kWrite = 1 << 20, kRead = 16 << 10;
  fiber::Scheduler s({.processors = 1, .name = "bench"});
  double ns = 0;
  long got = 0;
  bool ok = true;
  fiber::block_on({.scheduler = &s}, [&] {
    auto ln = fiber::net::Listener::listen("127.0.0.1:0");
    if (!ln) fail("tcp_stream: cannot listen");
    auto c = fiber::net::Stream::dial("127.0.0.1:" + std::to_string(ln->port()));
    auto a = ln->accept();
    if (!c || !a) fail("tcp_stream: cannot connect");
    const auto t0 = Clock::now();
    fiber::WaitGroup wg;
    wg.add(2);
    go [&] {
      std::vector<char> buf(kWrite, 'x');
      for (long k = 0; k < n && ok; ++k) ok = c->write_all(buf.data(), buf.size()) == static_cast<ssize_t>(kWrite);
      c->shutdown(SHUT_WR);
      wg.done();
    };
    go [&] {
      std::vector<char> buf(kRead);
      ssize_t r;
      while ((r = a->read(buf.data(), buf.size())) > 0) got += r;
      if (r < 0) {
        ok = false;
        a->shutdown(SHUT_RDWR);  // the writer's next write fails rather than waiting for room
      }
      wg.done();
    };
    wg.wait();
    ns = ns_since(t0) / static_cast<double>(n);
  });
  if (!ok || got != n * static_cast<long>(kWrite)) fail("tcp_stream: short or failed transfer");
  std::printf("workload=tcp_stream impl=libfiber value=%.1f unit=us/MiB extra=mib=%ld,read=%zu,procs=1\n", ns / 1000, n,
              kRead);
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
      {"skynet", {1'000'000, [](long n) { skynet("skynet", all_threads(), n); }}},
      {"skynet_1t", {1'000'000, [](long n) { skynet("skynet_1t", 1, n); }}},
      {"pingpong", {1'000'000, [](long n) { pingpong("pingpong", all_threads(), n); }}},
      {"pingpong_1t", {1'000'000, [](long n) { pingpong("pingpong_1t", 1, n); }}},
      {"idle", {100'000, [](long n) { idle("idle", n, 0); }}},
      {"idle_1m", {1'000'000, [](long n) { idle("idle_1m", n, 0); }}},
      {"idle_1m_compact", {1'000'000, [](long n) { idle("idle_1m_compact", n, fiber::compact_stack_size); }}},
      {"mutex", {2'000'000, [](long n) { mutex_contended(n); }}},
      {"fileread", {1'000'000, [](long n) { fileread(n); }}},
      {"tcp_stream", {4000, [](long n) { tcp_stream(n); }}},
      {"tcp_pingpong", {1'000'000, [](long n) { tcp_pingpong(n); }}},
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
