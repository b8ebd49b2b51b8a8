// echo_server: a TCP echo server with one fiber per connection.
//
//   build/release/samples/echo_server [PORT]        (default 18080; $PORT also works)
//   FIBER_PROCS=1 build/release/samples/echo_server 18080
//
// Drive it with the peers' load generator (see README.md, "Echo server"):
//   ../shared/peers/run's c/echo_load, or tools/bench/echo-server with LIBFIBER_ECHO_SERVER.
//
// Each connection's fiber reads up to 4096 bytes and writes them back until the peer closes.
// The accept loop and the stop on SIGTERM/SIGINT are samples/common/server.hpp's.
#include <fiber/fiber.hpp>

#include <utility>

#include "common/server.hpp"

namespace {

void serve(fiber::net::Stream conn) {
  char buf[4096];
  for (;;) {
    const ssize_t n = conn.read(buf, sizeof buf);
    if (n <= 0) return;  // peer closed, reset, or the server is stopping
    if (conn.write_all(buf, static_cast<size_t>(n)) < 0) return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  sample::Server server("echo_server", sample::port_arg(argc, argv, "18080"));
  if (!server.listening()) return 1;
  return server.run(serve);
}
