// echo_server: a TCP echo server with one fiber per connection.
//
//   build/release/samples/echo_server [PORT]        (default 18080; $PORT also works)
//   FIBER_PROCS=1 build/release/samples/echo_server 18080
//
// Drive it with the peers' load generator (see README.md, "Echo server"):
//   ../shared/peers/run's c/echo_load, or tools/bench/echo-server with LIBFIBER_ECHO_SERVER.
//
// Each connection's fiber reads up to 4096 bytes and writes them back until the peer closes.
// The accept loop survives running out of descriptors (EMFILE/ENFILE): it backs off and tries
// again once connections have closed. SIGTERM or SIGINT closes the listener and ends the server:
// a process killed with an accept still in its ring keeps the port listening for a moment
// (the kernel tears rings down after the process is gone), and the next server to bind it fails.
#include <fiber/fiber.hpp>

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

void serve(fiber::net::Stream conn) {
  char buf[4096];
  for (;;) {
    const ssize_t n = conn.read(buf, sizeof buf);
    if (n <= 0) return;  // peer closed, or reset
    if (conn.write_all(buf, static_cast<size_t>(n)) < 0) return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // SIGTERM/SIGINT are taken by a thread of ours (blocked here, before any other thread starts,
  // so every thread inherits the mask).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  const char* env_port = std::getenv("PORT");
  const std::string port = argc > 1 ? argv[1] : (env_port ? env_port : "18080");
  auto ln = fiber::net::Listener::listen("127.0.0.1:" + port);
  if (!ln) {
    std::fprintf(stderr, "echo_server: %s\n", ln.message().c_str());
    return 1;
  }
  std::fprintf(stderr, "echo_server: listening on 127.0.0.1:%u with %zu processors\n", ln->port(),
               fiber::Scheduler::global().processors());
  std::atomic<bool> stopping{false};
  std::thread([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    stopping = true;
    ln->close();  // from a plain thread: ends the accept below with EBADF, then closes
  }).detach();
  fiber::block_on([&] {
    for (;;) {
      auto conn = ln->accept();
      if (stopping) return;
      if (conn) {
        go [c = std::move(*conn)]() mutable { serve(std::move(c)); };
        continue;
      }
      if (conn.error() == EMFILE || conn.error() == ENFILE || conn.error() == ENOBUFS || conn.error() == ENOMEM) {
        // Out of descriptors: wait for connections to close rather than spin.
        fiber::this_fiber::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (conn.error() == ECONNABORTED || conn.error() == EINTR) continue;
      std::fprintf(stderr, "echo_server: %s\n", conn.message().c_str());
      return;
    }
  });
  return stopping ? 0 : 1;
}
