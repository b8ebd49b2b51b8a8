// What every sample server shares: listening, the accept loop, and a clean stop.
//
//   int main(int argc, char** argv) {
//     sample::Server server("http_server", sample::port_arg(argc, argv, "8080"));
//     if (!server.listening()) return 1;
//     return server.run([](fiber::net::Stream conn) { serve(std::move(conn)); });
//   }
//
// - The constructor blocks SIGTERM and SIGINT (construct the Server first in main, before any
//   thread starts, so every thread inherits the mask), raises the RLIMIT_NOFILE soft limit to the
//   hard limit (one descriptor per connection), and listens on 127.0.0.1:PORT (port 0: any free
//   port). It then prints one line on stderr, "NAME: listening on 127.0.0.1:PORT with N
//   processors"; the integration tests wait for it.
// - run() accepts connections and runs `handler` in a fiber of its own for each one. The loop
//   survives running out of descriptors (EMFILE/ENFILE): it backs off and retries once
//   connections have closed, rather than spin or die; nor does one client's failed connection
//   end it. classify_accept_error() holds that policy, for a server with an accept loop of its
//   own (samples/chat) to share.
// - SIGTERM/SIGINT cancel the accept loop, which closes the listener, and every connection's
//   fiber: its blocked read or write ends with -ECANCELED, so a handler that returns on I/O
//   errors returns. run() returns 0 once every connection fiber has finished. If the accept loop
//   fails for another reason, it says why on stderr and cancels the connections the same way,
//   and run() returns 1. Closing the listener before exit matters: a process killed with an
//   accept still in its io_uring keeps the port listening for a moment after it is gone, and the
//   next server to bind it fails.
#pragma once

#include <fiber/fiber.hpp>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace sample {

// The port: the first argument that does not start with "--", else $PORT, else `fallback`.
inline std::string port_arg(int argc, char** argv, const char* fallback) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] != '-') return argv[i];
    if (std::string(argv[i]).rfind("--", 0) == 0 && std::string(argv[i]).find('=') == std::string::npos) ++i;
  }
  const char* env = std::getenv("PORT");
  return env != nullptr ? env : fallback;
}

// Blocks SIGTERM and SIGINT in the calling thread and returns them as a set for sigwait. Call it
// first in main, before any thread starts, so that every thread inherits the mask and the
// signals go to whoever waits for them.
inline sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// One descriptor per connection: raises the RLIMIT_NOFILE soft limit to the hard limit (keeps
// the soft one if that fails).
inline void raise_nofile_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// Closes a connection after a last response without losing it: stops sending (the client sees
// end of stream after the response), then reads and drops what the client still sends - up to
// 1 MiB, for at most `limit` - before the caller closes. Closing with input unread would make the
// kernel send a reset, which may destroy the response before the client has read it.
inline void linger_close(fiber::net::Stream& conn, std::chrono::milliseconds limit) {
  conn.shutdown(SHUT_WR);
  const fiber::io::Deadline until(limit);
  char sink[16 * 1024];
  for (size_t total = 0; total < (size_t{1} << 20);) {
    const ssize_t n = conn.read(sink, sizeof sink, until);
    if (n <= 0) break;
    total += static_cast<size_t>(n);
  }
}

// What an accept loop does after accept() failed with `error` (every sample server's loop asks
// this, so they agree on which errors end a server).
enum class AcceptFailure {
  kRetry,  // accept again at once
  kPause,  // accept again after kAcceptPause
  kFatal,  // the listener itself is broken: stop accepting
};
constexpr std::chrono::milliseconds kAcceptPause{10};

inline AcceptFailure classify_accept_error(int error) noexcept {
  switch (error) {
    // Out of descriptors or memory: wait for connections to close rather than spin. And one
    // connection's trouble, not the listener's: the network errors Linux passes on from the
    // new socket (accept(2): retry them as EAGAIN), EPERM from a firewall rule among them;
    // a short pause too, in case one keeps coming (a seccomp rule, a network down for good).
    case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM:
    case EPROTO: case ENOPROTOOPT: case EHOSTDOWN: case ENONET: case EHOSTUNREACH: case EOPNOTSUPP:
    case ENETDOWN: case ENETUNREACH: case EPERM:
      return AcceptFailure::kPause;
    case ECONNABORTED: case EINTR:  // a client that went away before its turn
      return AcceptFailure::kRetry;
    default:
      return AcceptFailure::kFatal;
  }
}

class Server {
 public:
  Server(std::string name, const std::string& port) : name_(std::move(name)), stop_signals_(block_stop_signals()) {
    raise_nofile_limit();
    auto ln = fiber::net::Listener::listen("127.0.0.1:" + port);
    if (!ln) {
      std::fprintf(stderr, "%s: %s\n", name_.c_str(), ln.message().c_str());
      return;
    }
    listener_ = std::move(*ln);
    std::fprintf(stderr, "%s: listening on 127.0.0.1:%u with %zu processors\n", name_.c_str(), listener_.port(),
                 fiber::Scheduler::global().processors());
  }

  bool listening() const noexcept { return listener_.fd() >= 0; }
  uint16_t port() const noexcept { return listener_.port(); }

  int run(std::function<void(fiber::net::Stream)> handler) {
    std::thread stopper([this] {
      int sig = 0;
      sigwait(&stop_signals_, &sig);
      {
        const std::lock_guard<std::mutex> lock(mu_);
        if (finished_) return;  // woken by run() below: nothing to stop
      }
      stop();
    });
    // The stopper thread uses this object: it must be finished before run() returns, or throws
    // (block_on rethrows what the accept loop threw, bad_alloc say; a joinable std::thread would
    // then terminate the process). If no signal came, wake it; if one came, it is finishing
    // stop() or has exited (then the signal goes nowhere: it is blocked in every thread).
    struct JoinStopper {
      Server& server;
      std::thread& stopper;
      ~JoinStopper() {
        {
          const std::lock_guard<std::mutex> lock(server.mu_);
          server.finished_ = true;
        }
        pthread_kill(stopper.native_handle(), SIGTERM);
        stopper.join();
      }
    } join_stopper{*this, stopper};
    bool failed = false;
    fiber::block_on([&] {
      {
        const std::lock_guard<std::mutex> lock(mu_);
        accept_loop_ = fiber::this_fiber::cancel_token();
        if (stopping_) return;
      }
      failed = accept_connections(handler);
      listener_.close();
      // block_on waits for every connection fiber: without this, a failed accept loop would
      // leave run() waiting for the clients to hang up.
      if (failed) stop();
    });
    return failed ? 1 : 0;
  }

 private:
  // The accept loop, in a fiber of block_on's group: each connection gets a fiber of its own.
  // Returns true when it ended on an error rather than on stop().
  bool accept_connections(const std::function<void(fiber::net::Stream)>& handler) {
    for (;;) {
      auto conn = listener_.accept();
      if (conn) {
        go [this, &handler, c = std::move(*conn)]() mutable { run_connection(handler, std::move(c)); };
        continue;
      }
      if (conn.error() == ECANCELED) return false;  // stop()
      switch (classify_accept_error(conn.error())) {
        case AcceptFailure::kRetry:
          break;
        case AcceptFailure::kPause:
          try {
            fiber::this_fiber::sleep_for(kAcceptPause);
          } catch (const fiber::Cancelled&) {
            return false;  // stop() came during the back-off
          }
          break;
        case AcceptFailure::kFatal:
          std::fprintf(stderr, "%s: %s\n", name_.c_str(), conn.message().c_str());
          return true;
      }
    }
  }

  // One entry per live connection fiber, so that stop() can cancel them all.
  void run_connection(const std::function<void(fiber::net::Stream)>& handler, fiber::net::Stream conn) {
    std::list<fiber::CancelToken>::iterator self;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      self = connections_.insert(connections_.end(), fiber::this_fiber::cancel_token());
      // A connection accepted just before stop() cancelled the others is cancelled here.
      if (stopping_) self->cancel();
    }
    struct Unregister {  // also when the handler throws
      Server* server;
      std::list<fiber::CancelToken>::iterator self;
      ~Unregister() {
        const std::lock_guard<std::mutex> lock(server->mu_);
        server->connections_.erase(self);
      }
    } unregister{this, self};
    handler(std::move(conn));
  }

  // Cancels the accept loop and every connection: from the signal thread, or from the accept
  // loop when it failed (both may come; cancelling twice is harmless).
  void stop() {
    const std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    accept_loop_.cancel();
    for (const auto& token : connections_) token.cancel();
  }

  std::string name_;
  sigset_t stop_signals_{};
  fiber::net::Listener listener_;
  // mu_ guards what stop() needs: the flag and every fiber to cancel, so that a fiber
  // registering itself either is in stop()'s sweep or sees the flag. A std::mutex, not a
  // fiber::Mutex: the critical sections are a few pointer moves and never park, and stop()
  // runs on a plain thread (or on the accept loop's fiber, which then blocks only its processor
  // for those few moves).
  std::mutex mu_;
  bool stopping_ = false;  // connections registering from now on cancel themselves
  bool finished_ = false;  // run() is done: the stopper thread just exits
  fiber::CancelToken accept_loop_;
  std::list<fiber::CancelToken> connections_;
};

}  // namespace sample
