// legacy_redis: an unmodified blocking client library (hiredis) inside fibers.
//
//   build/release/samples/legacy_redis                     1000 fibers, ONE processor, no hook
//   LD_PRELOAD=build/release/hooks/libfiber_hook.so build/release/samples/legacy_redis
//   build/release/samples/legacy_redis --threads           1000 plain threads instead
//
// Starts a redis-server on a free loopback port (killed at exit), then each of N clients
// (1000 by default: --clients N) connects with hiredis's blocking API and makes --ops GET/SET
// round trips (20 by default), checking every reply. Without the hook every hiredis call blocks
// the single processor thread, so the fibers run one after another; with libfiber_hook.so
// preloaded the same calls park only their fiber, and the round trips of all clients overlap.
// Prints the wall time and round trips per second, and the most clients seen inside a call at
// once (1 means they serialised).
#include <fiber/fiber.hpp>
#include <hiredis/hiredis.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  int clients = 1000;
  int ops = 20;
  bool threads = false;
};

pid_t g_server = -1;

void stop_server() {
  if (g_server > 0) {
    kill(g_server, SIGTERM);
    waitpid(g_server, nullptr, 0);
    g_server = -1;
  }
}

// Starts redis-server on a free port; returns the port once it answers PING.
int start_server() {
  auto ln = fiber::net::Listener::listen("127.0.0.1:0");  // borrow a free port number
  if (!ln) return -1;
  const int port = ln->port();
  ln->close();
  g_server = fork();
  if (g_server == 0) {
    // The server is not ours to hook, and its chatter is not ours to print.
    unsetenv("LD_PRELOAD");
    if (std::freopen("/dev/null", "w", stdout) == nullptr || std::freopen("/dev/null", "w", stderr) == nullptr) _exit(126);
    const std::string p = std::to_string(port);
    execlp("redis-server", "redis-server", "--port", p.c_str(), "--bind", "127.0.0.1", "--save", "", "--appendonly",
           "no", "--maxclients", "10000", "--loglevel", "warning", static_cast<char*>(nullptr));
    std::perror("legacy_redis: exec redis-server");
    _exit(127);
  }
  if (g_server < 0) return -1;
  std::atexit(stop_server);
  for (int i = 0; i < 200; ++i) {
    if (redisContext* c = redisConnect("127.0.0.1", port); c && !c->err) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      const bool ok = r && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
      redisFree(c);
      if (ok) return port;
    } else if (c) {
      redisFree(c);
    }
    usleep(20'000);
  }
  return -1;
}

std::atomic<int> g_inside{0}, g_max_inside{0}, g_errors{0};

void note_inside(int delta) {
  const int now = g_inside.fetch_add(delta) + delta;
  int m = g_max_inside.load();
  while (now > m && !g_max_inside.compare_exchange_weak(m, now)) {
  }
}

// One client: connect, then ops SET/GET pairs with its own key, every reply checked.
void client(int port, int id, int ops) {
  note_inside(+1);
  redisContext* c = redisConnect("127.0.0.1", port);
  if (c == nullptr || c->err) {
    ++g_errors;
    if (c) redisFree(c);
    note_inside(-1);
    return;
  }
  const std::string key = "k" + std::to_string(id);
  for (int i = 0; i < ops; ++i) {
    const std::string val = std::to_string(id * 100000 + i);
    auto* r = static_cast<redisReply*>(redisCommand(c, "SET %s %s", key.c_str(), val.c_str()));
    if (!r || r->type != REDIS_REPLY_STATUS) ++g_errors;
    if (r) freeReplyObject(r);
    r = static_cast<redisReply*>(redisCommand(c, "GET %s", key.c_str()));
    if (!r || r->type != REDIS_REPLY_STRING || val != std::string(r->str, r->len)) ++g_errors;
    if (r) freeReplyObject(r);
  }
  redisFree(c);
  note_inside(-1);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads")) {
      o.threads = true;
    } else if (!std::strcmp(argv[i], "--clients") && i + 1 < argc) {
      o.clients = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--ops") && i + 1 < argc) {
      o.ops = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: legacy_redis [--threads] [--clients N] [--ops N]\n");
      return 2;
    }
  }
  if (o.clients <= 0 || o.ops <= 0) {
    std::fprintf(stderr, "legacy_redis: --clients and --ops must be positive\n");
    return 2;
  }
  const int port = start_server();
  if (port < 0) {
    std::fprintf(stderr, "legacy_redis: could not start redis-server (is it installed? tools/setup-deps.sh)\n");
    return 1;
  }
  const bool hooked = std::getenv("LD_PRELOAD") && std::strstr(std::getenv("LD_PRELOAD"), "libfiber_hook");
  const auto t0 = std::chrono::steady_clock::now();
  if (o.threads) {
    std::vector<std::thread> ts;
    ts.reserve(static_cast<std::size_t>(o.clients));
    for (int i = 0; i < o.clients; ++i) ts.emplace_back(client, port, i, o.ops);
    for (auto& t : ts) t.join();
  } else {
    fiber::Scheduler s({.processors = 1, .name = "redis"});
    fiber::block_on({.scheduler = &s}, [&] {
      for (int i = 0; i < o.clients; ++i) {
        go [=] { client(port, i, o.ops); };
      }
    });
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double rt = 2.0 * o.clients * o.ops;
  std::printf("legacy_redis: %d %s x %d SET+GET (%s): %.3f s, %.0f round trips/s, at most %d clients in a call at once, %d errors\n",
              o.clients, o.threads ? "threads" : "fibers on 1 processor", o.ops,
              o.threads ? "no hook" : (hooked ? "hooked" : "no hook"), secs, rt / secs, g_max_inside.load(),
              g_errors.load());
  return g_errors.load() == 0 ? 0 : 1;
}
