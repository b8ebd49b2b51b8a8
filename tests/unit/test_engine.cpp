// The I/O engines on kernels and sandboxes older or stricter than this one: a process whose
// seccomp profile refuses io_uring_setup and epoll_pwait2, as container profiles that predate
// them do (the engine there must be epoll, and epoll must still wait, for readiness and for
// timers), and a ring from a kernel before 5.11, which is refused.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "integration/process.hpp"  // run_test_case
#include "io/poller.hpp"
#include "io_util.hpp"
#include "sched/processor.hpp"
#include "sched/scheduler_impl.hpp"
#include "test_util.hpp"

namespace {

using namespace fiber_test;
using namespace std::chrono_literals;
namespace fd = fiber::detail;

constexpr const char* kSeccompChild = "engine: (child process) io_uring_setup and epoll_pwait2 refused";

// Makes the system calls `nrs` fail with `err` for this thread and the threads it starts from
// now on. False (errno set) where the filter cannot be installed.
bool refuse_syscalls(std::initializer_list<long> nrs, int err) {
  std::vector<sock_filter> prog;
  prog.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  for (const long nr : nrs) {
    prog.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<__u32>(nr), 0, 1));
    prog.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<__u32>(err) & SECCOMP_RET_DATA)));
  }
  prog.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  const sock_fprog fprog{static_cast<unsigned short>(prog.size()), prog.data()};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) == 0;
}

}  // namespace

// Before the fix, epoll_pwait2 refused made every wait of the epoll engine return at once with
// nothing: the processors spun and no fiber was ever woken by readiness, so the recv below ran
// into its deadline.
TEST_CASE("engine: (child process) io_uring_setup and epoll_pwait2 refused" * doctest::skip()) {
  if (!refuse_syscalls({SYS_io_uring_setup, SYS_epoll_pwait2}, EPERM)) {
    std::printf("no seccomp: %s\n", std::strerror(errno));
    return;
  }
  fiber::Scheduler s({.processors = 2, .name = "seccomp"});
  // Every processor's engine: each made it on its thread before the constructor returned.
  for (uint32_t i = 0; i < s.processors(); ++i) {
    CAPTURE(i);
    CHECK(s.impl().processor(i).poller().kind() == fd::PollerKind::Epoll);
  }
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  Fd a(sv[0]), b(sv[1]);
  // Readiness: the fiber parks in the engine until the peer writes, several times over.
  std::atomic<int> reading{0};
  auto reader = fiber::spawn({.scheduler = &s}, [&] {
    std::string got;
    for (int i = 0; i < 5; ++i) {
      char c = 0;
      reading.store(i + 1);
      if (fiber::io::recv(a.get(), &c, 1, 0, patience()) != 1) break;
      got += c;
    }
    return got;
  });
  for (int i = 0; i < 5; ++i) {
    REQUIRE(wait_for([&] { return reading.load() == i + 1; }));
    std::this_thread::sleep_for(2ms);  // most likely parked by now
    REQUIRE(::write(b.get(), &"abcde"[i], 1) == 1);
  }
  CHECK(reader.join() == "abcde");
  // Timers: a sleep ends, and a receive with nothing to read times out, not before its deadline.
  fiber::spawn({.scheduler = &s}, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    fiber::this_fiber::sleep_for(5ms);
    CHECK(std::chrono::steady_clock::now() - t0 >= 5ms);
    char c;
    CHECK(fiber::io::recv(a.get(), &c, 1, 0, 5ms) == -ETIMEDOUT);
    CHECK(std::chrono::steady_clock::now() - t0 >= 10ms);
  }).join();
  std::printf("epoll engine waited\n");
  std::fflush(stdout);
}

TEST_CASE("engine: with io_uring and epoll_pwait2 refused, the epoll engine runs and waits") {
  // FIBER_IO unset: the engine is chosen, not forced (the epoll pass of the suite forces it).
  const RunResult r = run_test_case(kSeccompChild, {"FIBER_IO="});
  INFO("the child's status " << r.status << "; its stdout:\n" << r.out << "\nits stderr:\n" << r.err);
  if (contains(r.out, "no seccomp")) {
    MESSAGE("seccomp filters cannot be installed here; not tested: " << r.out);
    return;
  }
  CHECK(r.status == 0);
  CHECK(contains(r.out, "epoll engine waited"));
  CHECK(contains(r.err, "io_uring unavailable (Operation not permitted); using the epoll engine"));
}

// Before Linux 5.11 (no IORING_FEAT_EXT_ARG) liburing times a wait with a counted timeout SQE
// of its own: the completion of the previous wait's one satisfies it at once, so a wait can be
// left with no timeout at all (a fiber's deadline then never fires), and reap() would take its
// completion for an IoOp. Such a ring is refused and the processor uses epoll. This kernel's
// rings are not like that, so the decision is what can be checked here.
TEST_CASE("engine: a ring without IORING_FEAT_EXT_ARG (before Linux 5.11) is refused") {
  const char* why = fd::UringPoller::lacks_features(0);
  REQUIRE(why != nullptr);
  CHECK(contains(why, "IORING_FEAT_EXT_ARG"));
  CHECK(fd::UringPoller::lacks_features(~unsigned{IORING_FEAT_EXT_ARG}) != nullptr);
  CHECK(fd::UringPoller::lacks_features(IORING_FEAT_EXT_ARG) == nullptr);
}
