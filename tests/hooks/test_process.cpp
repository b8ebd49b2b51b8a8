// Whole-process behaviour of a hooked program:
//   - fork: in the child the hooked calls are the real calls (the runtime's threads do not exist
//     there), whether it forked from a fiber or from a plain thread, and whatever fibers of the
//     parent were waiting on;
//   - getaddrinfo("localhost") from many fibers at once: correct answers, off the processors;
//   - plain threads of a hooked program, while fibers run beside them, see exactly the libc calls.
#include <doctest/doctest.h>

#include <dirent.h>
#include <netdb.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "hook_util.hpp"

using namespace hook_test;

namespace {

// Waits (bounded, polling) for the child; kills it when it does not exit in time. Returns its
// exit code, or -1 if it had to be killed (it hung), -2 if it died from a signal.
int wait_child(pid_t pid, std::chrono::milliseconds limit = 10'000ms) {
  int status = 0;
  const bool exited = wait_for(
      [&] {
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        return r == pid;
      },
      limit, 1ms);
  if (!exited) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return -1;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return -2;
}

// The child's side: only async-signal-safe calls, through the hooks. Returns a bit mask of
// failed checks (0: all good).
int child_checks(int rd_blocking, int rd_nonblocking, int wr) {
  int code = 0;
  char c = 0;
  if (::read(rd_blocking, &c, 1) != 1 || c != 'p') code |= 1;  // blocks until the parent writes
  errno = 0;
  if (::read(rd_nonblocking, &c, 1) != -1 || errno != EAGAIN) code |= 2;
  if (::usleep(1000) != 0) code |= 4;
  timespec ts{0, 1'000'000};
  if (::nanosleep(&ts, nullptr) != 0) code |= 8;
  pollfd pf{rd_nonblocking, POLLIN, 0};
  if (::poll(&pf, 1, 5) != 0) code |= 16;
  if (::write(wr, "child-ok", 8) != 8) code |= 32;
  if (::close(wr) != 0) code |= 64;
  return code;
}

std::string read_all(int fd) {
  std::string s;
  char buf[256];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r <= 0) break;
    s.append(buf, static_cast<size_t>(r));
  }
  return s;
}

int count_threads_named(const std::string& name) {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string line;
    std::getline(comm, line);
    n += line == name;
  }
  ::closedir(d);
  return n;
}

// Forks; the child runs child_checks and reports "child-ok" through a pipe, which the parent
// reads (a hooked read: from a fiber it parks) before it collects the child's exit code.
void fork_and_check_child() {
  Pair to_child = make_pipe(), from_child = make_pipe(), idle = make_pipe(O_NONBLOCK);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    from_child.a.release();
    _exit(child_checks(to_child.a, idle.a, from_child.b));
  }
  from_child.b.reset();
  CHECK(::write(to_child.b, "p", 1) == 1);
  CHECK(read_all(from_child.a) == "child-ok");
  const int code = wait_child(pid);
  CHECK_MESSAGE(code == 0, "child exit code " << code << " (bit mask of failed checks; -1: it hung, -2: it crashed)");
}

}  // namespace

TEST_SUITE("hooked") {
TEST_CASE("process: fork from a fiber: the child's hooked calls are the real calls") {
  on_fiber(2, [] {
    fork_and_check_child();  // the parent's read parks its fiber until the child writes
  });
}

TEST_CASE("process: fork from a plain thread while fibers run: the child's calls are the real calls") {
  fiber::Scheduler s({.processors = 2, .name = "hk"});
  Watchdog dog(30'000ms, "fork from a plain thread");
  // Fibers busy in hooked calls meanwhile.
  std::atomic<bool> stop{false};
  std::vector<fiber::JoinHandle<void>> busy;
  for (int i = 0; i < 4; ++i) {
    busy.push_back(fiber::spawn({.scheduler = &s}, [&stop] {
      while (!stop.load()) ::usleep(200);
    }));
  }
  fork_and_check_child();
  stop = true;
  for (auto& h : busy) h.join();
}

// A parent fiber is blocked in read on a descriptor when another forks. The child inherits the
// descriptor and closes it - as a child about to exec does with what it does not need. The
// parent's waiting fiber does not exist in the child, so the close must be the plain close(2).
TEST_CASE("process: fork while a fiber waits on a descriptor: the child can close it") {
  on_fiber(2, [] {
    Pair busy = make_socketpair();
    std::atomic<bool> entering{false};
    auto waiter = fiber::spawn([&] {
      char c;
      entering = true;
      return call([&] { return ::read(busy.a, &c, 1); });
    });
    REQUIRE(wait_for([&] { return entering.load(); }));
    fiber::this_fiber::sleep_for(20ms);  // let it park in the read
    Pair report = make_pipe();
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // The child: close what the parent's fiber waits on, say so, leave.
      const int rc = ::close(busy.a);
      const char ok = rc == 0 ? 'y' : 'n';
      (void)::write(report.b, &ok, 1);
      _exit(rc == 0 ? 0 : 1);
    }
    report.b.reset();
    const int code = wait_child(pid, 5'000ms);
    char got = 0;
    const Res rr = call([&] { return ::read(report.a, &got, 1); });
    CHECK_MESSAGE(code == 0, "the child " << std::string(code == -1 ? "hung (killed after 5 s) in close() of a descriptor "
                                                                      "a parent fiber was waiting on"
                                                                    : "failed")
                                          << "; exit code " << code);
    CHECK((rr.r == 1 && got == 'y'));
    // The parent is unaffected: its fiber still gets the data.
    CHECK(::write(busy.b, "d", 1) == 1);
    const Res r = waiter.join();
    CHECK(r.r == 1);
  });
}

// With every helper thread of the blocking pool held (PoolGate), the fibers' calls queue in the
// pool: all of them are inside getaddrinfo at once before the gate opens - which a call made
// inline on a processor could never be.
// The prefork server pattern: a process that has not started the runtime forks workers, and each
// starts schedulers of its own, with the hooks in effect (hooked calls park). This needs a process
// that has never started a processor thread, which this one has, so the test runs itself again,
// alone, in a new process that does the forking.
TEST_CASE("process: a child forked before the runtime started runs schedulers of its own, hooked") {
  if (std::getenv("FIBER_HOOK_PREFORK_PARENT") == nullptr) {
    char exe[4096];
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    REQUIRE(n > 0);
    exe[n] = '\0';
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::setenv("FIBER_HOOK_PREFORK_PARENT", "1", 1);
      ::execl(exe, exe, "-tc=process: a child forked before the runtime started*", "--no-intro",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const int code = wait_child(pid, 60'000ms);
    CHECK_MESSAGE(code == 0, "the new process's run of this test failed (its output is above); exit code " << code);
    return;
  }
  // The new process: no processor thread yet.
  REQUIRE_FALSE(fiber::Scheduler::started_in_process());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      fiber::Scheduler s({.processors = 1, .name = "worker"});
      code = fiber::spawn({.scheduler = &s}, [] {
        Pair p = make_socketpair();
        char c = 0;
        auto r = parked_call([&] { return call([&] { return ::read(p.a, &c, 1); }); }, [&] { (void)::write(p.b, "w", 1); });
        return (r.value.r == 1 && c == 'w' ? 0 : 1) | (r.parked ? 0 : 2);
      }).join();
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  const int code = wait_child(pid, 30'000ms);
  CHECK_MESSAGE(code == 0, "the worker's exit code " << code << " (1: the read failed; 2: it did not park; 4: an exception; "
                                                        "-1: it hung; -2: it crashed)");
  // This process may start its own as well.
  on_fiber(1, [] {
    Pair p = make_socketpair();
    char c = 0;
    auto r = parked_call([&] { return call([&] { return ::read(p.a, &c, 1); }); }, [&] { (void)::write(p.b, "p", 1); });
    CHECK(r.value.r == 1);
    CHECK_MESSAGE(r.parked, "in the process that forked the worker, the read did not park");
  });
}

TEST_CASE("process: getaddrinfo(localhost) from many fibers at once: correct answers, on the blocking pool") {
  for_each_proc_count([](fiber::Scheduler& s, int n) {
    constexpr int kFibers = 200;
    std::atomic<int> inside{0}, max_inside{0}, wrong{0};
    fiber::spawn({.scheduler = &s}, [&] {
      PoolGate gate;
      REQUIRE(gate.full());
      std::vector<fiber::JoinHandle<void>> hs;
      for (int i = 0; i < kFibers; ++i) {
        hs.push_back(fiber::spawn([&, i] {
          addrinfo hints{};
          hints.ai_family = (i % 3 == 0) ? AF_UNSPEC : AF_INET;
          hints.ai_socktype = SOCK_STREAM;
          const std::string port = std::to_string(20000 + i);
          addrinfo* res = nullptr;
          raise_max(max_inside, inside.fetch_add(1) + 1);
          const int rc = ::getaddrinfo("localhost", port.c_str(), &hints, &res);
          inside.fetch_sub(1);
          if (rc != 0) {
            if (wrong.fetch_add(1) < 3) FAIL_CHECK("getaddrinfo: " << std::string(gai_strerror(rc)));
            return;
          }
          bool loopback_v4 = false;
          for (addrinfo* a = res; a; a = a->ai_next) {
            if (a->ai_family == AF_INET) {
              const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
              if (in->sin_addr.s_addr == htonl(INADDR_LOOPBACK) && ntohs(in->sin_port) == 20000 + i) {
                loopback_v4 = true;
              } else if (wrong.fetch_add(1) < 3) {
                FAIL_CHECK("unexpected IPv4 answer for localhost:" << port);
              }
            } else if (a->ai_family == AF_INET6) {
              const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
              if (hints.ai_family != AF_UNSPEC || !IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) ||
                  ntohs(in6->sin6_port) != 20000 + i) {
                if (wrong.fetch_add(1) < 3) FAIL_CHECK("unexpected IPv6 answer for localhost:" << port);
              }
            }
          }
          if (!loopback_v4 && wrong.fetch_add(1) < 3) FAIL_CHECK("no 127.0.0.1:" << port << " in the answer");
          ::freeaddrinfo(res);
        }));
      }
      const bool all = wait_for([&] { return inside.load() == kFibers; });
      gate.open();
      for (auto& h : hs) h.join();
      CHECK_MESSAGE(all, "processors=" << n << ": only " << max_inside.load() << " of " << kFibers
                                       << " fibers were inside getaddrinfo at once");
    }).join();
    CHECK(wrong.load() == 0);
    CHECK(max_inside.load() == kFibers);
    CHECK(count_threads_named("fiber-blocking") > 0);  // the pool that ran them (idle threads live 10 s)
  }, {1, 4});
}
}  // TEST_SUITE("hooked")

// ================================================================================ plain threads

TEST_SUITE("any") {
// A plain thread of a program whose fibers are busy in hooked calls: every call is the libc one.
TEST_CASE("process: a plain thread beside running fibers sees exactly the libc calls") {
  // Without the hook the fibers' usleep holds their processors: expected, so no reports.
  fiber::Scheduler s({.processors = 2, .name = "hk", .watchdog = quiet_watchdog()});
  std::atomic<bool> stop{false};
  std::vector<fiber::JoinHandle<void>> busy;
  for (int i = 0; i < 4; ++i) {
    busy.push_back(fiber::spawn({.scheduler = &s}, [&stop] {
      Pair p = make_socketpair();
      char c;
      while (!stop.load()) {
        if (::write(p.b, "x", 1) != 1 || ::read(p.a, &c, 1) != 1) break;
        ::usleep(100);
      }
    }));
  }
  run_on_thread([] {
    CHECK_FALSE(fiber::this_fiber::in_fiber());
    // A blocking read on a pipe waits for the writer thread.
    Pair p = make_pipe();
    std::atomic<bool> entering{false}, returned{false};
    std::thread writer([&] {
      thread_wait([&] { return entering.load(); });
      std::this_thread::sleep_for(50ms);
      CHECK_FALSE(returned.load());  // still blocked: nothing was written yet
      CHECK(::write(p.b, "data", 4) == 4);
    });
    char buf[8] = {};
    entering = true;
    const Res r = call([&] { return ::read(p.a, buf, sizeof buf); });
    returned = true;
    writer.join();
    CHECK(r.r == 4);
    CHECK(std::string(buf, 4) == "data");
    // EAGAIN on a non-blocking descriptor.
    Pair nb = make_pipe(O_NONBLOCK);
    const Res e = call([&] { return ::read(nb.a, buf, sizeof buf); });
    CHECK((e.r == -1 && e.e == EAGAIN));
    // Sleeps sleep.
    auto t0 = Clock::now();
    CHECK(::sleep(1) == 0);
    CHECK(Clock::now() - t0 >= 1s);
    t0 = Clock::now();
    CHECK(::usleep(20'000) == 0);
    CHECK(Clock::now() - t0 >= 20ms);
    // SO_RCVTIMEO on a plain thread: the kernel's EAGAIN.
    Pair sp = make_socketpair();
    timeval tv{0, 20'000};
    REQUIRE(::setsockopt(sp.a, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
    const Res t = call([&] { return ::recv(sp.a, buf, 1, 0); });
    CHECK((t.r == -1 && (t.e == EAGAIN || t.e == EWOULDBLOCK)));
    // Flags are the caller's.
    CHECK(::fcntl(p.a, F_GETFL) == O_RDONLY);
    CHECK(::fcntl(nb.a, F_GETFL) == (O_RDONLY | O_NONBLOCK));
    // close.
    const int fd = p.a.release();
    CHECK(::close(fd) == 0);
    const Res c2 = call([&] { return ::close(fd); });
    CHECK((c2.r == -1 && c2.e == EBADF));
  });
  stop = true;
  for (auto& h : busy) h.join();
}
}  // TEST_SUITE("any")
