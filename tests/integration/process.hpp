// Helpers of the integration tests (tests/integration/): real server processes driven by real
// clients, no mocks.
//
//   Server::start(binary, args, env)  starts a sample server as a child process with its stderr
//                               on a pipe, and waits (bounded) for the line every sample prints
//                               once it accepts connections: "... listening on 127.0.0.1:PORT".
//                               Pass port 0 in args; port() is the one the server bound.
//                               stop() sends SIGTERM and returns the exit status; the destructor
//                               kills what is left. log() is everything it wrote to stderr.
//   CHECK_CLEAN_STOP(server)    stops it and checks it exited with status 0, showing its stderr
//                               (a sanitizer report, say) when it did not.
//   run(argv, input, limit)     runs a client (curl, redis-cli, wrk, ...) to completion with
//                               `input` on its stdin; returns its exit status, stdout and stderr.
//                               A client still running after `limit` is killed: status -1.
//   run_test_case(name, env, limit)
//                               runs one test case of this test binary (even one marked
//                               doctest::skip()) in a child process, for what must not happen to
//                               the test process itself: lowered limits, a full descriptor table.
//                               Returns what run() does; the child prints only failures.
//   have_program(name)          whether `name` is on PATH.
//   require_program(name)       fails the test when `name` is not on PATH (tools/setup-deps.sh
//                               installs every client the tests use: a missing one is an error,
//                               never a silent skip).
//   connect_loopback(port)      a blocking TCP socket connected to 127.0.0.1:port (the test
//                               fails if it cannot connect); the caller closes it.
//   raise_nofile(n)             raises RLIMIT_NOFILE to at least n (up to the hard limit);
//                               returns the soft limit now in effect.
//   mapped_bytes()              the address space this process has mapped (VmSize).
//   AddressSpaceLimit lim(n)    lowers the soft RLIMIT_AS to n bytes for its lifetime (for a
//                               child process: the kernel then refuses mappings, stacks say).
//
// The helpers are plain-thread code (posix_spawn, poll): call them from the test's own thread,
// not from inside a fiber.
#pragma once

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.hpp"

extern char** environ;

namespace fiber_test {

struct RunResult {
  int status = -1;  // exit code; 128+N for death by signal N; -1 when killed at the limit
  std::string out;
  std::string err;
};

namespace detail {

inline void set_cloexec(int fd) { ::fcntl(fd, F_SETFD, FD_CLOEXEC); }

// The environment of this process with `extra` ("NAME=value") added or overriding.
inline std::vector<std::string> merged_env(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('=') + 1);
    bool overridden = false;
    for (const auto& x : extra) overridden = overridden || std::string_view(x).substr(0, name.size()) == name;
    if (!overridden) env.emplace_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

inline std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Spawns argv[0] (looked up on PATH) with stdin/stdout/stderr on the given descriptors
// (-1: inherit). Throws on failure.
inline pid_t spawn(std::vector<std::string> argv, const std::vector<std::string>& extra_env, int in_fd, int out_fd,
                   int err_fd) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (in_fd >= 0) posix_spawn_file_actions_adddup2(&actions, in_fd, 0);
  if (out_fd >= 0) posix_spawn_file_actions_adddup2(&actions, out_fd, 1);
  if (err_fd >= 0) posix_spawn_file_actions_adddup2(&actions, err_fd, 2);
  auto env = merged_env(extra_env);
  auto c_argv = c_strings(argv);
  auto c_env = c_strings(env);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, c_argv[0], &actions, nullptr, c_argv.data(), c_env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("posix_spawnp " + argv[0] + ": " + std::strerror(rc));
  return pid;
}

inline int decode_status(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return -1;
}

// Waits up to `limit` for pid; kills it (SIGKILL) and returns nullopt when it is still running.
inline std::optional<int> wait_child(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  for (;;) {
    int wstatus = 0;
    const pid_t r = ::waitpid(pid, &wstatus, WNOHANG);
    if (r == pid) return decode_status(wstatus);
    if (r < 0 && errno != EINTR) return -1;
    if (Clock::now() >= end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &wstatus, 0);
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace detail

inline bool have_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string candidate = dirs.substr(start, end - start) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

inline void require_program(const std::string& name) {
  if (!have_program(name)) FAIL(name << " not found: tools/setup-deps.sh installs it");
}

inline int connect_loopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE_MESSAGE(fd >= 0, "socket: " << std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    FAIL("connect to 127.0.0.1:" << port << ": " << std::strerror(err));
  }
  return fd;
}

inline rlim_t raise_nofile(rlim_t want) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < want) {
    lim.rlim_cur = std::min(want, lim.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &lim);
    ::getrlimit(RLIMIT_NOFILE, &lim);
  }
  return lim.rlim_cur;
}

inline std::size_t mapped_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  REQUIRE(pages > 0);
  return pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_AS, &saved_) == 0);
    rlimit lowered = saved_;
    lowered.rlim_cur = bytes;
    REQUIRE(::setrlimit(RLIMIT_AS, &lowered) == 0);
  }
  ~AddressSpaceLimit() { ::setrlimit(RLIMIT_AS, &saved_); }
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;

 private:
  rlimit saved_{};
};

// Runs a client to completion; see the header comment.
inline RunResult run(const std::vector<std::string>& argv, const std::string& input = {},
                     std::chrono::milliseconds limit = scaled(std::chrono::milliseconds(30'000)),
                     const std::vector<std::string>& env = {}) {
  int in[2], out[2], err[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  }
  const pid_t pid = detail::spawn(argv, env, in[0], out[1], err[1]);
  ::close(in[0]);
  ::close(out[1]);
  ::close(err[1]);
  ::fcntl(in[1], F_SETFL, O_NONBLOCK);
  RunResult r;
  size_t written = 0;
  int in_fd = in[1];
  if (input.empty()) {
    ::close(in_fd);
    in_fd = -1;
  }
  const auto end = Clock::now() + limit;
  bool out_open = true, err_open = true;
  while ((out_open || err_open) && Clock::now() < end) {
    pollfd fds[3] = {{out_open ? out[0] : -1, POLLIN, 0}, {err_open ? err[0] : -1, POLLIN, 0}, {in_fd, POLLOUT, 0}};
    if (::poll(fds, 3, 50) < 0 && errno != EINTR) break;
    char buf[65536];
    for (int i = 0; i < 2; ++i) {
      if (fds[i].revents == 0) continue;
      const ssize_t n = ::read(i == 0 ? out[0] : err[0], buf, sizeof buf);
      if (n > 0) {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
      } else {
        (i == 0 ? out_open : err_open) = false;
      }
    }
    if (in_fd >= 0 && fds[2].revents != 0) {
      const ssize_t n = ::write(in_fd, input.data() + written, input.size() - written);
      if (n > 0) written += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN) written = input.size();  // the client closed its stdin
      if (written == input.size()) {
        ::close(in_fd);
        in_fd = -1;
      }
    }
  }
  if (in_fd >= 0) ::close(in_fd);
  ::close(out[0]);
  ::close(err[0]);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
  const auto status = detail::wait_child(pid, std::max(left, std::chrono::milliseconds(100)));
  r.status = status ? *status : -1;
  return r;
}

inline RunResult run_test_case(const std::string& name, const std::vector<std::string>& env = {},
                               std::chrono::milliseconds limit = scaled(std::chrono::milliseconds(180'000))) {
  return run({"/proc/self/exe", "--test-case=" + name, "--no-skip=true", "--no-version=true", "--minimal=true"}, {},
             limit, env);
}

// A sample server in a child process; see the header comment.
class Server {
 public:
  // Starts `binary` with `args` and waits for its "listening on HOST:PORT" line.
  static Server start(const std::string& binary, const std::vector<std::string>& args,
                      const std::vector<std::string>& env = {},
                      std::chrono::milliseconds limit = scaled(std::chrono::milliseconds(20'000))) {
    Server s;
    int err[2];
    if (::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    std::vector<std::string> argv{binary};
    argv.insert(argv.end(), args.begin(), args.end());
    s.pid_ = detail::spawn(argv, env, -1, -1, err[1]);
    ::close(err[1]);
    s.log_ = std::make_shared<Log>();
    s.log_->fd = err[0];
    // Read stderr until the listening line appears (or the process dies, or time runs out).
    const auto end = Clock::now() + limit;
    std::string seen;
    while (Clock::now() < end) {
      pollfd p{err[0], POLLIN, 0};
      if (::poll(&p, 1, 50) < 0 && errno != EINTR) break;
      if (p.revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(err[0], buf, sizeof buf);
      if (n <= 0) break;
      seen.append(buf, static_cast<size_t>(n));
      const auto at = seen.find("listening on ");
      const auto nl = at == std::string::npos ? std::string::npos : seen.find('\n', at);
      if (nl != std::string::npos) {
        const auto colon = seen.rfind(':', nl);
        s.port_ = static_cast<uint16_t>(std::atoi(seen.c_str() + colon + 1));
        break;
      }
    }
    s.log_->text = seen;
    if (s.port_ == 0) {
      const std::string text = seen;
      s.kill_now();
      throw std::runtime_error(binary + " did not report a listening port; stderr:\n" + text);
    }
    // Keep draining stderr so the server never blocks on a full pipe.
    s.drain_ = std::thread([log = s.log_] {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(log->fd, buf, sizeof buf)) > 0) {
        const std::lock_guard<std::mutex> lock(log->mu);
        log->text.append(buf, static_cast<size_t>(n));
      }
    });
    return s;
  }

  Server() = default;
  Server(Server&& o) noexcept
      : pid_(std::exchange(o.pid_, -1)), port_(o.port_), log_(std::move(o.log_)), drain_(std::move(o.drain_)) {}
  Server& operator=(Server&&) = delete;
  ~Server() { kill_now(); }

  uint16_t port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  bool running() const {
    if (pid_ <= 0) return false;
    siginfo_t info{};
    return ::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == 0;
  }
  std::string log() const {
    if (!log_) return {};
    const std::lock_guard<std::mutex> lock(log_->mu);
    return log_->text;
  }

  // SIGTERM, then the exit status (128+N for a signal; -1 when it had to be killed).
  int stop(std::chrono::milliseconds limit = scaled(std::chrono::milliseconds(10'000))) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    const auto status = detail::wait_child(pid_, limit);
    pid_ = -1;
    finish_log();
    return status ? *status : -1;
  }

 private:
  struct Log {
    int fd = -1;
    std::mutex mu;
    std::string text;
  };

  void kill_now() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int wstatus = 0;
      ::waitpid(pid_, &wstatus, 0);
      pid_ = -1;
    }
    finish_log();
  }
  void finish_log() {
    if (drain_.joinable()) drain_.join();  // the pipe's write end closed with the process
    if (log_ && log_->fd >= 0) {
      ::close(log_->fd);
      log_->fd = -1;
    }
  }

  pid_t pid_ = -1;
  uint16_t port_ = 0;
  std::shared_ptr<Log> log_;
  std::thread drain_;
};

}  // namespace fiber_test

// See the header comment. A macro, so that a failure names the test's line.
#define CHECK_CLEAN_STOP(server)                                                            \
  do {                                                                                      \
    const int stop_status_ = (server).stop();                                               \
    CHECK_MESSAGE(stop_status_ == 0, "server exit status " << stop_status_ << "; its stderr:\n" \
                                                           << (server).log());             \
  } while (0)

