// What the hook knows of a descriptor belongs to its number only while that descriptor lives
// (hooks/hook.cpp, "descriptors made or closed out of the hooks' sight"). These cases close a
// number the hook has learnt in one of the ways glibc closes inside itself, or make a descriptor
// on a number closed out of any hook's sight (a raw syscall), and check that the hook treats the
// new descriptor as what it is:
//   - closed by pclose, freopen, closedir, close_range or closefrom after the hook learnt it as
//     non-blocking: a blocking socket brought back on the number must park a read, not block
//     the thread in the real call;
//   - made by creat, __open_2, inotify_init, signalfd or received with SCM_RIGHTS after the hook
//     learnt the number as a blocking socket: the call must act on the new descriptor (no
//     ENOTSOCK from a socket-only first try); signalfd on an existing descriptor makes none,
//     and what its dups share stays shared. (epoll_create forgets its number too, but an epoll
//     descriptor has nothing a hooked call does differently for it.)
#include <doctest/doctest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "hook_util.hpp"

extern "C" int __open_2(const char* path, int flags);  // fortified open(2): <bits/fcntl2.h>

using namespace hook_test;

namespace {

// A non-blocking descriptor the hook has learnt: a read through the hook gave EAGAIN.
void learn_nonblocking(int fd) {
  char c;
  const Res r = call([&] { return ::read(fd, &c, 1); });
  REQUIRE_MESSAGE((r.r == -1 && (r.e == EAGAIN || r.e == EISDIR)), "read: " << r.r << " errno " << err_str(r.e));
}

// After `number` was closed: a blocking socket put on it behind the hooks' back (raw calls)
// must be what a read there waits on - a park, ended by a byte from the peer - and not the
// non-blocking descriptor the hook knew (a real read, which blocks the thread).
// Runs in a fiber, so `how` goes into each message rather than a CAPTURE (io_util.hpp says why).
void check_blocking_socket_on(int number, const std::string& how) {
  int sv[2];
  REQUIRE_MESSAGE(::syscall(SYS_socketpair, AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, how);
  const int peer = sv[0] == number ? sv[1] : sv[0];  // the number was free: the pair may have taken it
  if (sv[0] != number && sv[1] != number) {
    REQUIRE_MESSAGE(::syscall(SYS_dup3, sv[1], number, O_CLOEXEC) == number, how);
    REQUIRE_MESSAGE(::syscall(SYS_close, sv[1]) == 0, how);
  }
  Fd keep(peer);
  char c = 0;
  auto r = parked_call([&] { return call([&] { return ::read(number, &c, 1); }); },
                       [&] { (void)::syscall(SYS_write, peer, "z", 1); });
  CHECK_MESSAGE(r.value.r == 1, how << ": read gave " << r.value.r << " errno " << err_str(r.value.e));
  CHECK_MESSAGE(r.parked, how << ": the read did not park (taken for the old non-blocking descriptor)");
  CHECK(c == 'z');
}

// A blocking socket the hook has learnt (a byte read through the hook), then closed with a raw
// close(2), which no hook sees: its number is the lowest free one, which the next descriptor
// made takes. Returns the number.
int learnt_socket_closed_unseen() {
  Pair p = make_socketpair();
  REQUIRE(::write(p.b, "x", 1) == 1);
  char c;
  REQUIRE(call([&] { return ::read(p.a, &c, 1); }).r == 1);  // learnt: a blocking socket
  const int number = p.a.release();
  REQUIRE(::syscall(SYS_close, number) == 0);
  return number;
}

// No watchdog: its monitor thread opens /proc files to see what a slow processor does, and such
// an open takes the lowest free number - the one a case has just freed for its new descriptor.
fiber::WatchdogOptions no_monitor() {
  fiber::WatchdogOptions w;
  w.enabled = false;
  return w;
}

// A signal mask of SIGURG alone (ignored by default: never delivered to these tests).
sigset_t urg_only() {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGURG);
  return mask;
}

std::string temp_dir() {
  char dir[] = "/tmp/fiber_hook_numbers_XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  return dir;
}

}  // namespace

TEST_SUITE("hooked") {

TEST_CASE("numbers: a number closed inside glibc (pclose, freopen, closedir, close_range, closefrom) is forgotten") {
  on_fiber(1, [] {
    {  // close_range
      Pair p = make_socketpair(SOCK_NONBLOCK);
      learn_nonblocking(p.a);
      const int number = p.a.release();
      REQUIRE(::close_range(number, number, 0) == 0);
      check_blocking_socket_on(number, "close_range");
      ::close(number);
    }
    {  // closefrom
      // A number above every other descriptor of the process, so closefrom closes only it.
      Pair p = make_socketpair(SOCK_NONBLOCK);
      const int number = static_cast<int>(::syscall(SYS_fcntl, p.a.get(), F_DUPFD_CLOEXEC, 4000));
      REQUIRE(number >= 4000);
      learn_nonblocking(number);
      ::closefrom(number);
      check_blocking_socket_on(number, "closefrom");
      ::close(number);
    }
    {  // closedir
      const std::string dir = temp_dir();
      const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
      REQUIRE(fd >= 0);
      learn_nonblocking(fd);  // EISDIR, but learnt: O_NONBLOCK is among its flags
      DIR* d = ::fdopendir(fd);
      REQUIRE(d != nullptr);
      REQUIRE(::closedir(d) == 0);
      check_blocking_socket_on(fd, "closedir");
      ::close(fd);
      ::rmdir(dir.c_str());
    }
    {  // pclose
      FILE* f = ::popen("exec true", "r");
      REQUIRE(f != nullptr);
      const int fd = ::fileno(f);
      REQUIRE(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) == 0);
      // Learnt (EAGAIN, or end of file once the child is gone); then the end of file, so that
      // pclose's wait for the child is short: a processor blocked for long has the watchdog
      // probe it, and the probe's open(2) of a /proc file would take (and forget) free numbers.
      char c;
      Res r = call([&] { return ::read(fd, &c, 1); });
      REQUIRE_MESSAGE((r.r == 0 || (r.r == -1 && r.e == EAGAIN)), "read: " << r.r << " errno " << err_str(r.e));
      while (r.r != 0) {
        fiber::this_fiber::sleep_for(1ms);
        r = call([&] { return ::read(fd, &c, 1); });
        REQUIRE((r.r == 0 || (r.r == -1 && r.e == EAGAIN)));
      }
      REQUIRE(::pclose(f) == 0);
      check_blocking_socket_on(fd, "pclose");
      ::close(fd);
    }
    {  // freopen
      Pair p = make_socketpair(SOCK_NONBLOCK);
      learn_nonblocking(p.a);
      FILE* f = ::fdopen(p.a.release(), "r");
      REQUIRE(f != nullptr);
      f = ::freopen("/dev/null", "r", f);  // closes the socket; /dev/null gets a number, likely the same
      REQUIRE(f != nullptr);
      const int number = ::fileno(f);
      check_blocking_socket_on(number, "freopen");
      REQUIRE(::fclose(f) == 0);  // closes the socket put on the number
    }
  }, 60'000ms, "fiber body", no_monitor());
}

TEST_CASE("numbers: a descriptor made by creat, __open_2, inotify_init, signalfd or SCM_RIGHTS is new to the hook") {
  on_fiber(1, [] {
    const std::string dir = temp_dir();
    const std::string file = dir + "/f";
    const std::string created = dir + "/g";  // inotify's event
    {  // creat
      const int number = learnt_socket_closed_unseen();
      const int fd = ::creat(file.c_str(), 0600);
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      const Res w = call([&] { return ::write(fd, "abc", 3); });
      CHECK_MESSAGE(w.r == 3, "write to a file made by creat: " << w.r << " errno " << err_str(w.e));
      ::close(fd);
    }
    {  // __open_2
      REQUIRE(::close(::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600)) == 0);
      const int number = learnt_socket_closed_unseen();
      const int fd = __open_2(file.c_str(), O_RDWR | O_CLOEXEC);
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      const Res w = call([&] { return ::write(fd, "abc", 3); });
      CHECK_MESSAGE(w.r == 3, "write to a file made by __open_2: " << w.r << " errno " << err_str(w.e));
      ::close(fd);
    }
    {  // inotify_init
      const int number = learnt_socket_closed_unseen();
      const int fd = ::inotify_init();
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      REQUIRE(::inotify_add_watch(fd, dir.c_str(), IN_CREATE) >= 0);
      REQUIRE(::close(::open(created.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600)) == 0);
      alignas(inotify_event) char buf[sizeof(inotify_event) + 256];
      const Res r = call([&] { return ::read(fd, buf, sizeof buf); });
      CHECK_MESSAGE(r.r >= static_cast<long>(sizeof(inotify_event)), "read of an inotify event: " << r.r << " errno "
                                                                          << err_str(r.e));
      ::close(fd);
    }
    {  // signalfd
      const int number = learnt_socket_closed_unseen();
      const sigset_t mask = urg_only();
      const int fd = ::signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      signalfd_siginfo si;
      const Res r = call([&] { return ::read(fd, &si, sizeof si); });
      CHECK_MESSAGE((r.r == -1 && r.e == EAGAIN), "read of a quiet non-blocking signalfd: " << r.r << " errno "
                                                                                          << err_str(r.e));
      ::close(fd);
    }
    {  // signalfd on an existing descriptor changes its mask only: still the file its dup shares
      const sigset_t mask = urg_only();
      const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC);  // blocking
      REQUIRE(sfd >= 0);
      Fd d(::dup(sfd));
      REQUIRE(::signalfd(sfd, &mask, SFD_CLOEXEC) == sfd);
      char buf[sizeof(signalfd_siginfo)];
      REQUIRE(::pread(sfd, buf, sizeof buf, 0) == -1);  // learnt (blocking); the real call: ESPIPE
      REQUIRE(::fcntl(d, F_SETFL, O_NONBLOCK) == 0);    // through the dup: sfd is non-blocking too
      auto r = no_park_call([&] { return call([&] { return ::read(sfd, buf, sizeof buf); }); },
                            [&] { ::close(sfd); });  // were it to wait, the close ends it
      CHECK_MESSAGE((r.value.r == -1 && r.value.e == EAGAIN), "read of a signalfd made non-blocking through a dup: "
                                                                  << r.value.r << " errno " << err_str(r.value.e));
      CHECK_MESSAGE(!r.parked, "the read waited: O_NONBLOCK set through the dup was not seen");
      if (!r.released) ::close(sfd);
    }
    {  // SCM_RIGHTS
      Pair carrier = make_socketpair();
      Fd passed(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      REQUIRE(passed >= 0);
      send_with_fd(carrier.b, "d", 1, passed);  // before the number is freed: only the receive can take it
      const int number = learnt_socket_closed_unseen();
      char data;
      FdMessage msg(&data, 1);
      REQUIRE(::recvmsg(carrier.a, &msg.m, MSG_CMSG_CLOEXEC) == 1);  // the hooked receive
      const int fd = msg.passed();
      REQUIRE_MESSAGE(fd == number, "another thread took the number");
      uint64_t v;
      const Res r = call([&] { return ::read(fd, &v, sizeof v); });
      CHECK_MESSAGE((r.r == -1 && r.e == EAGAIN), "read of a received empty non-blocking eventfd: " << r.r << " errno "
                                                                                                   << err_str(r.e));
      ::close(fd);
    }
    ::unlink(file.c_str());
    ::unlink(created.c_str());
    ::rmdir(dir.c_str());
  }, 60'000ms, "fiber body", no_monitor());
}

}  // TEST_SUITE("hooked")
