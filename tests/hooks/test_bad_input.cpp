// Bad input through the hooks: invalid descriptors, null buffers and bad flags give exactly what
// the real call gives (same return value, same errno), inside a fiber as on a plain thread. The
// reference is the system call made with syscall(2), which no hook sees.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <functional>
#include <string>
#include <thread>
#include <vector>

// The calls below pass null buffers, negative counts and SIZE_MAX lengths on purpose; GCC sees
// them through the inlined lambdas and warns about each.
#pragma GCC diagnostic ignored "-Wnonnull"
#pragma GCC diagnostic ignored "-Wstringop-overflow"

namespace {

struct Res {
  long r;
  int e;
};

// errno through non-inlined calls: the hooked call may have moved the fiber to another thread.
__attribute__((noinline)) void clear_errno() { errno = 0; }
__attribute__((noinline)) int read_errno() { return errno; }

Res hooked(const std::function<long()>& call) {
  clear_errno();
  const long r = call();
  return Res{r, r < 0 ? read_errno() : 0};
}

struct Case {
  std::string name;
  std::function<long()> hooked_call;  // through libc (hooked when the hook is in)
  std::function<long()> raw_call;     // the bare system call
};

}  // namespace

TEST_CASE("bad input: hooked calls fail exactly as the real calls do, in fibers and on threads") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  // Data waiting, so reads with a null buffer fail (EFAULT) rather than wait.
  REQUIRE(::syscall(SYS_write, sv[1], "0123456789", 10) == 10);
  // A number that is not open (not one just closed: another thread may get that one back).
  const int closed = static_cast<int>(::sysconf(_SC_OPEN_MAX)) - 1;
  REQUIRE(::syscall(SYS_fcntl, closed, F_GETFD, 0) == -1);
  int pp[2];  // a pipe: writev on it takes the non-socket path
  REQUIRE(::syscall(SYS_pipe2, pp, 0) == 0);
  char buf[16];
  iovec iov{buf, sizeof buf};
  const timespec bad_ts{0, 2'000'000'000};
  const timespec neg_ts{-1, 0};
  const sockaddr_storage any{AF_INET, {}, 0};
  char file_path[] = "/tmp/hook_bad_input_XXXXXX";
  const int file = ::mkstemp(file_path);  // a regular file: pread/pwrite go to fiber::io's
  REQUIRE(file >= 0);
  ::unlink(file_path);
  int dg[2];  // datagram sockets cannot accept at all: EOPNOTSUPP, not EINVAL
  REQUIRE(::socketpair(AF_UNIX, SOCK_DGRAM, 0, dg) == 0);

  const std::vector<Case> cases = {
      {"read(-1)", [&] { return long(::read(-1, buf, 1)); }, [&] { return ::syscall(SYS_read, -1, buf, 1); }},
      {"read(closed)", [&] { return long(::read(closed, buf, 1)); }, [&] { return ::syscall(SYS_read, closed, buf, 1); }},
      {"write(-1)", [&] { return long(::write(-1, buf, 1)); }, [&] { return ::syscall(SYS_write, -1, buf, 1); }},
      {"readv(-1)", [&] { return long(::readv(-1, &iov, 1)); }, [&] { return ::syscall(SYS_readv, -1, &iov, 1); }},
      {"writev(sock, cnt -1)", [&] { return long(::writev(sv[0], &iov, -1)); }, [&] { return ::syscall(SYS_writev, sv[0], &iov, -1); }},
      {"writev(pipe, null iov)", [&] { return long(::writev(pp[1], nullptr, 1)); }, [&] { return ::syscall(SYS_writev, pp[1], nullptr, 1); }},
      {"writev(pipe, cnt IOV_MAX+1)", [&] { return long(::writev(pp[1], &iov, IOV_MAX + 1)); },
       [&] { return ::syscall(SYS_writev, pp[1], &iov, IOV_MAX + 1); }},
      {"readv(sock with data, cnt -1)", [&] { return long(::readv(sv[0], &iov, -1)); }, [&] { return ::syscall(SYS_readv, sv[0], &iov, -1); }},
      {"readv(sock with data, cnt IOV_MAX+1)", [&] { return long(::readv(sv[0], &iov, IOV_MAX + 1)); },
       [&] { return ::syscall(SYS_readv, sv[0], &iov, IOV_MAX + 1); }},
      {"recvmsg(sock, null msg, MSG_WAITALL)", [&] { return long(::recvmsg(sv[0], nullptr, MSG_WAITALL)); },
       [&] { return ::syscall(SYS_recvmsg, sv[0], nullptr, MSG_WAITALL); }},
      {"sendto(connected unix stream, an address)",
       [&] { return long(::sendto(sv[0], buf, 1, MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&any), sizeof any)); },
       [&] { return ::syscall(SYS_sendto, sv[0], buf, 1, MSG_NOSIGNAL, &any, sizeof any); }},
      {"read(sock with data, SIZE_MAX)", [&] { return long(::read(sv[0], buf, SIZE_MAX)); },
       [&] { return ::syscall(SYS_read, sv[0], buf, SIZE_MAX); }},
      {"write(sock, SIZE_MAX)", [&] { return long(::write(sv[0], buf, SIZE_MAX)); },
       [&] { return ::syscall(SYS_write, sv[0], buf, SIZE_MAX); }},
      {"recv(sock, null buffer)", [&] { return long(::recv(sv[0], nullptr, 4, 0)); },
       [&] { return ::syscall(SYS_recvfrom, sv[0], nullptr, 4, 0, nullptr, nullptr); }},
      {"read(sock, null buffer)", [&] { return long(::read(sv[0], nullptr, 4)); }, [&] { return ::syscall(SYS_read, sv[0], nullptr, 4); }},
      {"send(sock, null buffer)", [&] { return long(::send(sv[0], nullptr, 4, MSG_NOSIGNAL)); },
       [&] { return ::syscall(SYS_sendto, sv[0], nullptr, 4, MSG_NOSIGNAL, nullptr, 0); }},
      {"recv(sock, bad flags)", [&] { return long(::recv(sv[0], buf, 1, MSG_OOB | MSG_ERRQUEUE)); },
       [&] { return ::syscall(SYS_recvfrom, sv[0], buf, 1, MSG_OOB | MSG_ERRQUEUE, nullptr, nullptr); }},
      {"pread(-1)", [&] { return long(::pread(-1, buf, 1, 0)); }, [&] { return ::syscall(SYS_pread64, -1, buf, 1, 0); }},
      {"pread(sock)", [&] { return long(::pread(sv[0], buf, 1, 0)); }, [&] { return ::syscall(SYS_pread64, sv[0], buf, 1, 0); }},
      {"pread(file, SIZE_MAX)", [&] { return long(::pread(file, buf, SIZE_MAX, 0)); },
       [&] { return ::syscall(SYS_pread64, file, buf, SIZE_MAX, 0); }},
      {"pwrite(file, SIZE_MAX)", [&] { return long(::pwrite(file, buf, SIZE_MAX, 0)); },
       [&] { return ::syscall(SYS_pwrite64, file, buf, SIZE_MAX, 0); }},
      {"accept(-1)", [&] { return long(::accept(-1, nullptr, nullptr)); }, [&] { return ::syscall(SYS_accept4, -1, nullptr, nullptr, 0); }},
      {"accept(unix datagram)", [&] { return long(::accept(dg[0], nullptr, nullptr)); },
       [&] { return ::syscall(SYS_accept4, dg[0], nullptr, nullptr, 0); }},
      {"accept(not listening)", [&] { return long(::accept(sv[0], nullptr, nullptr)); },
       [&] { return ::syscall(SYS_accept4, sv[0], nullptr, nullptr, 0); }},
      {"connect(-1)", [&] { return long(::connect(-1, nullptr, 0)); }, [&] { return ::syscall(SYS_connect, -1, nullptr, 0); }},
      {"poll(null, 1)", [&] { return long(::poll(nullptr, 1, 10)); }, [&] { return ::syscall(SYS_poll, nullptr, 1, 10); }},
      {"nanosleep(bad)", [&] { return long(::nanosleep(&bad_ts, nullptr)); }, [&] { return ::syscall(SYS_nanosleep, &bad_ts, nullptr); }},
      {"nanosleep(negative)", [&] { return long(::nanosleep(&neg_ts, nullptr)); }, [&] { return ::syscall(SYS_nanosleep, &neg_ts, nullptr); }},
      {"select(-1)", [&] { return long(::select(-1, nullptr, nullptr, nullptr, nullptr)); },
       [&] { return ::syscall(SYS_select, -1, nullptr, nullptr, nullptr, nullptr); }},
      {"fcntl(-1)", [&] { return long(::fcntl(-1, F_GETFL)); }, [&] { return ::syscall(SYS_fcntl, -1, F_GETFL, 0); }},
      {"dup(-1)", [&] { return long(::dup(-1)); }, [&] { return ::syscall(SYS_dup, -1); }},
      {"setsockopt(bad level)", [&] { int v = 1; return long(::setsockopt(sv[0], 12345, 1, &v, sizeof v)); },
       [&] { int v = 1; return ::syscall(SYS_setsockopt, sv[0], 12345, 1, &v, sizeof v); }},
      {"close(-1)", [&] { return long(::close(-1)); }, [&] { return ::syscall(SYS_close, -1); }},
  };

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' own interceptors check pointers before the kernel does: skip the null ones.
  constexpr bool kSkipNull = true;
#else
  constexpr bool kSkipNull = false;
#endif
  fiber::Scheduler s({.processors = 2, .name = "bad"});
  for (const Case& c : cases) {
    if (kSkipNull && (c.name.find("null") != std::string::npos)) continue;
    const Res want = hooked(c.raw_call);
    const Res in_fiber = fiber::spawn({.scheduler = &s}, [&] { return hooked(c.hooked_call); }).join();
    Res on_thread{};
    std::thread([&] { on_thread = hooked(c.hooked_call); }).join();
    CHECK_MESSAGE((in_fiber.r == want.r && in_fiber.e == want.e),
                  c.name << " in a fiber: " << in_fiber.r << "/" << in_fiber.e << ", real: " << want.r << "/" << want.e);
    CHECK_MESSAGE((on_thread.r == want.r && on_thread.e == want.e),
                  c.name << " on a thread: " << on_thread.r << "/" << on_thread.e << ", real: " << want.r << "/" << want.e);
  }
  ::close(sv[0]);
  ::close(sv[1]);
  ::close(pp[0]);
  ::close(pp[1]);
  ::close(file);
  ::close(dg[0]);
  ::close(dg[1]);
}
