// Stack overflow reports (issue: see inside a running program): a fiber that overflows its
// stack, in a child process, is reported with its id, name and stack size before the process
// aborts - through the guard page (guarded stacks) or the red zone check at the next switch
// (unguarded stacks, FIBER_GUARDED_STACKS=0).
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "context/stack.hpp"  // StackAllocator::stats(): whether this kernel gives guard markers
#include "test_util.hpp"

extern char** environ;

namespace {

using namespace fiber_test;

std::string child_path() {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return {};
  std::string p(exe, static_cast<std::size_t>(n));
  return p.substr(0, p.rfind('/')) + "/overflow_child";
}

// Runs the child with `arg` (and an extra environment entry, if any); returns its stderr and
// wait status.
std::pair<std::string, int> run_child(const char* arg, const char* env = nullptr) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  std::vector<char*> envp;
  // Ours decides the guard kind, not one the suite's environment happens to carry.
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "FIBER_GUARDED_STACKS=", 21) != 0) envp.push_back(*e);
  }
  if (env != nullptr) envp.push_back(const_cast<char*>(env));
  envp.push_back(nullptr);
  const std::string path = child_path();
  char* argv[] = {const_cast<char*>(path.c_str()), const_cast<char*>(arg), nullptr};
  pid_t pid;
  REQUIRE(posix_spawn(&pid, path.c_str(), &fa, nullptr, argv, envp.data()) == 0);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 30'000) <= 0) break;  // bounded: a hung child fails the test below
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  ::kill(pid, SIGKILL);  // no-op if it already ended
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {out, status};
}

}  // namespace

// Default: guard markers where the kernel has them (Linux 6.13), else a PROT_NONE page per stack.
// FIBER_GUARDED_STACKS set: always the PROT_NONE page (its own mapping), as on older kernels.
TEST_CASE("overflow: a guarded stack's overflow is reported with the fiber's id, name and size") {
  if (kSanitized) return;  // the sanitizers own SIGSEGV and report overflows themselves
  const char* env = nullptr;
  SUBCASE("default guard") {
    // The child runs the same probe on the same kernel as this process (which did it unless
    // its own environment set FIBER_GUARDED_STACKS).
    if (std::getenv("FIBER_GUARDED_STACKS") == nullptr) {
      const bool markers = fiber::detail::StackAllocator::instance().stats().guard_markers;
      const std::string kind = markers ? "guard markers" : "PROT_NONE pages (no guard markers here)";
      MESSAGE("default guard: " << kind);
    }
  }
  SUBCASE("PROT_NONE guard page") { env = "FIBER_GUARDED_STACKS=100"; }
  const auto [out, status] = run_child("guarded", env);
  INFO(out);
  CHECK(contains(out, "it touched its guard page"));
  CHECK(contains(out, "libfiber: stack overflow in fiber #"));
  CHECK(contains(out, "'deep-diver'"));
  CHECK(contains(out, "guarded"));
  CHECK(contains(out, "65536 bytes"));
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK_FALSE(contains(out, "survived"));
}

TEST_CASE("overflow: an unguarded stack's overflow is reported (red zone or the memory below)") {
  if (kSanitized) return;
  const auto [out, status] = run_child("unguarded", "FIBER_GUARDED_STACKS=0");
  INFO(out);
  CHECK(contains(out, "libfiber: stack overflow in fiber #"));
  CHECK(contains(out, "'shallow-diver'"));
  CHECK(contains(out, "unguarded"));
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK_FALSE(contains(out, "survived"));
}
