// libfiber_hook: blocking libc calls made inside a fiber park the fiber instead of its thread.
//
//   LD_PRELOAD=libfiber_hook.so ./server     (the program links libfiber.so)
//   or link libfiber_hook.a whole-archive     (target libfiber::fiber_hook_static)
//
// Every hooked call first asks whether it may park: only inside a fiber running on a processor,
// not in the child after fork, not before the runtime has started. Everywhere else it is the
// real call - through the pointer dlsym(RTLD_NEXT) resolved in an early constructor, or a raw
// syscall() before that - and allocates nothing.
//
// Inside a fiber the caller keeps the semantics it knows:
// - A descriptor it made non-blocking (SOCK_NONBLOCK, O_NONBLOCK via fcntl, FIONBIO, accept4,
//   pipe2) gets the real call, and EAGAIN. The runtime never changes a descriptor's flags: the
//   io_uring engine waits on blocking descriptors natively.
// - Timeouts are infinite unless SO_RCVTIMEO / SO_SNDTIMEO set one; on expiry reads, writes and
//   accept fail with EAGAIN, a TCP connect with EINPROGRESS (a Unix one: EAGAIN). connect
//   reports the real SO_ERROR. A negative timeout is the kernel's "never wait": EAGAIN at once.
// - A blocking write writes everything (short writes loop), as on a blocking socket; a
//   MSG_FASTOPEN send that could only start the connection waits for it, then sends.
// - errno is set after the last switch, through a non-inlined store: the fiber may have moved
//   to another thread while it waited.
// - close wakes fibers waiting on the descriptor (fiber::io::close); they see EBADF.
//
// What the hook knows of a descriptor (socket or not, non-blocking, timeouts) it learns from the
// kernel the first time a fiber uses it, and forgets whenever a hooked call may change it
// (fcntl, ioctl, setsockopt, close, dup2/dup3), closes it inside glibc (fclose, closedir,
// close_range, ...) or makes a new descriptor on the number (socket, open, eventfd, SCM_RIGHTS,
// ...), so the kernel stays the source of truth.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <fiber/blocking.hpp>
#include <fiber/error.hpp>
#include <fiber/io.hpp>
#include <fiber/scheduler.hpp>
#include <fiber/this_fiber.hpp>

#include "hook_table.hpp"

// Headers older than the calls (glibc < 2.34, Linux < 5.9).
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

extern "C" {
// Fortified variants (-D_FORTIFY_SOURCE) call these instead of the plain names.
void __chk_fail(void) __attribute__((noreturn));
void __longjmp_chk(jmp_buf env, int val) __attribute__((noreturn));
}

namespace {

// ------------------------------------------------------------------------------ real functions

#define FIBER_HOOK_POINTER(ret, name, params, args) \
  using name##_fn = ret(*) params;                  \
  name##_fn real_##name = nullptr;
FIBER_HOOKS(FIBER_HOOK_POINTER)
#undef FIBER_HOOK_POINTER

std::atomic<bool> g_resolved{false};
// Set in a child forked after the process started the runtime, whose threads (and the fibers
// its records wait for) do not exist there. A child forked before is a new process to the hooks.
std::atomic<bool> g_forked_child{false};

void resolve_all() noexcept {
#define FIBER_HOOK_RESOLVE(ret, name, params, args) \
  real_##name = reinterpret_cast<name##_fn>(dlsym(RTLD_NEXT, #name));
  FIBER_HOOKS(FIBER_HOOK_RESOLVE)
#undef FIBER_HOOK_RESOLVE
  // Every name must resolve; a libc without one is not one we can run on.
  const char* missing = nullptr;
#define FIBER_HOOK_CHECK(ret, name, params, args) \
  if (real_##name == nullptr && missing == nullptr) missing = #name;
  FIBER_HOOKS(FIBER_HOOK_CHECK)
#undef FIBER_HOOK_CHECK
  if (missing != nullptr) {
    char msg[160];
    const int n = std::snprintf(msg, sizeof msg, "libfiber_hook: cannot resolve the real %s; aborting\n", missing);
    ::syscall(SYS_write, 2, msg, n);
    std::abort();
  }
  g_resolved.store(true, std::memory_order_release);
}

bool read_own_setjmp() noexcept;
extern bool g_jmp_sp_readable;

__attribute__((constructor(101))) void hook_init() {
  resolve_all();
  g_jmp_sp_readable = read_own_setjmp();
  pthread_atfork(nullptr, nullptr, [] {
    if (fiber::Scheduler::started_in_process()) g_forked_child.store(true, std::memory_order_relaxed);
  });
}

// Library functions (not system calls) called before the constructor, or that a libc may lack
// (null then): resolve on demand.
template <typename Fn>
Fn lazy(Fn& slot, const char* name) noexcept {
  if (slot == nullptr) slot = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
  return slot;
}

// The real call: the resolved function, or the system call itself before resolution.
#define REAL(name, sysno, ...) \
  (real_##name ? real_##name(__VA_ARGS__) : static_cast<decltype(real_##name(__VA_ARGS__))>(::syscall(sysno, __VA_ARGS__)))

// ------------------------------------------------------------------------------ when to park

// >0 while this thread runs a signal handler the program installed (see sigaction below): a
// hooked call there is the real call, never a park (a handler must not switch stacks). A
// handler left with a longjmp is counted out by the longjmp hooks (below).
thread_local int t_in_signal = 0;

// The runtime makes its own system calls through syscall(2), never through these hooks, so a
// hook never runs inside the scheduler; only user code in a fiber gets here with in_fiber().
bool may_park() noexcept {
  return g_resolved.load(std::memory_order_acquire) && !g_forked_child.load(std::memory_order_relaxed) &&
         t_in_signal == 0 && fiber::this_fiber::in_fiber();
}

// errno through a non-inlined store: __errno_location() is `const`, so the compiler may reuse
// an address computed before a switch, which belonged to the thread the fiber ran on then.
__attribute__((noinline)) void set_errno(int e) noexcept {
  asm volatile("" ::: "memory");
  errno = e;
}
__attribute__((noinline)) int get_errno() noexcept {
  asm volatile("" ::: "memory");
  return errno;
}
__attribute__((noinline)) void set_h_errno(int e) noexcept {  // likewise (__h_errno_location)
  asm volatile("" ::: "memory");
  h_errno = e;
}

// Name resolution's `call` on a helper thread. The errno and h_errno it leaves there (EAI_SYSTEM's
// cause, a lookup's failure) are copied to the calling thread's, where the caller reads them.
template <typename Call>
auto resolve_offloaded(Call&& call) {
  int err = 0;
  int herr = 0;
  auto r = fiber::blocking([&] {
    auto v = call();
    err = errno;
    herr = h_errno;
    return v;
  });
  set_errno(err);
  set_h_errno(herr);
  return r;
}

// -errno -> -1 with errno. ETIMEDOUT becomes `timeout_errno` (a SO_*TIMEO expiry) only when our
// deadline `d` has passed: otherwise it is the kernel's own (TCP_USER_TIMEOUT, keepalive, a dead
// peer), which the real call reports as ETIMEDOUT too.
template <typename T>
T finish(T r, const fiber::io::Deadline& d = {}, int timeout_errno = EAGAIN) noexcept {
  if (r >= 0) return r;
  int e = static_cast<int>(-r);
  if (e == ETIMEDOUT && d.expired()) e = timeout_errno;
  set_errno(e);
  return static_cast<T>(-1);
}

// ------------------------------------------------------------------------------ fd knowledge

// kMessage: a socket that moves whole messages (SOCK_DGRAM, SOCK_SEQPACKET, SOCK_RAW, ...): a send
// is all or nothing and MSG_WAITALL means nothing; only SOCK_STREAM has a byte stream to finish.
// kRecvNoWait / kSendNoWait: a socket whose SO_RCVTIMEO / SO_SNDTIMEO was set negative, which the
// kernel takes as "never wait" (EAGAIN at once, as if non-blocking) but reads back as {0, 0},
// the same as "no timeout": only the hook's own memory of the setsockopt (FdInfo::no_wait)
// tells. Receives and sends then make their one try without waiting and return what it gave,
// which is what the kernel's call does; accept and connect make the kernel's call, which does
// not wait either.
enum : uint8_t { kKnown = 1, kSocket = 2, kNonblock = 4, kSeekable = 8, kMessage = 16, kRecvNoWait = 32, kSendNoWait = 64 };

struct FdInfo {
  std::atomic<uint8_t> flags{0};       // kKnown | kSocket | kNonblock | kSeekable | kMessage | k*NoWait; 0: ask the kernel
  // kRecvNoWait | kSendNoWait as the last successful setsockopt of SO_RCVTIMEO / SO_SNDTIMEO
  // through this number left them (a negative time); cleared with the number (forget), copied
  // to a dup when it is made and to a TCP connection accepted from it (which inherits the
  // listener's timeouts). A change made later through another number of the same socket (a
  // dup, or a copy in another process) is not seen here: a stale "no wait" gives EAGAIN where
  // the call would wait; it never blocks the thread, except an accept or connect.
  std::atomic<uint8_t> no_wait{0};
  // Set by dup*/F_DUPFD on both descriptors: the open file description (O_NONBLOCK) and the socket
  // (SO_*TIMEO) are shared, so a change made through one must reach what is known of the other.
  std::atomic<uint8_t> shared{0};
  std::atomic<uint32_t> epoch{0};       // g_shared_epoch when learned (checked for shared ones)
  std::atomic<int64_t> rcv_timeout{0};  // ns, 0: none
  std::atomic<int64_t> snd_timeout{0};
};

constexpr int kChunkBits = 12;
constexpr int kChunks = 256;
std::atomic<FdInfo*> g_chunks[kChunks];  // published once each with a CAS, never freed

FdInfo* find_info(int fd) noexcept {
  if (fd < 0 || fd >= (kChunks << kChunkBits)) return nullptr;
  FdInfo* c = g_chunks[fd >> kChunkBits].load(std::memory_order_acquire);
  return c ? &c[fd & ((1 << kChunkBits) - 1)] : nullptr;
}

FdInfo* info(int fd) noexcept {
  if (fd < 0 || fd >= (kChunks << kChunkBits)) return nullptr;
  std::atomic<FdInfo*>& slot = g_chunks[fd >> kChunkBits];
  FdInfo* c = slot.load(std::memory_order_acquire);
  if (c == nullptr) {
    // mmap, not malloc: zero-filled (all flags 0) and no allocator reentrancy.
    void* mem = mmap(nullptr, sizeof(FdInfo) << kChunkBits, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return nullptr;
    FdInfo* expected = nullptr;
    if (slot.compare_exchange_strong(expected, static_cast<FdInfo*>(mem), std::memory_order_acq_rel)) {
      c = static_cast<FdInfo*>(mem);
    } else {
      munmap(mem, sizeof(FdInfo) << kChunkBits);
      c = expected;
    }
  }
  return &c[fd & ((1 << kChunkBits) - 1)];
}

// Bumped when a descriptor marked shared changes its flags or timeouts: every shared descriptor
// learned before then asks the kernel again.
std::atomic<uint32_t> g_shared_epoch{1};

void forget(int fd) noexcept {
  if (FdInfo* i = find_info(fd)) {
    i->flags.store(0, std::memory_order_relaxed);
    i->shared.store(0, std::memory_order_relaxed);
    i->no_wait.store(0, std::memory_order_relaxed);
  }
}

// The descriptor's flags or timeouts changed (fcntl F_SETFL, FIONBIO, SO_*TIMEO).
void changed(int fd) noexcept {
  FdInfo* i = find_info(fd);
  if (i != nullptr && i->shared.load(std::memory_order_relaxed)) g_shared_epoch.fetch_add(1, std::memory_order_relaxed);
  if (i != nullptr) i->flags.store(0, std::memory_order_relaxed);
}

// `a` and `b` now share an open file description (dup); `b` is the new number.
void mark_shared(int a, int b) noexcept {
  uint8_t no_wait = 0;
  if (FdInfo* i = info(a)) {
    i->shared.store(1, std::memory_order_relaxed);
    no_wait = i->no_wait.load(std::memory_order_relaxed);
  }
  if (FdInfo* i = info(b)) {
    i->shared.store(1, std::memory_order_relaxed);
    i->no_wait.store(no_wait, std::memory_order_relaxed);
  }
}

// Every number in [first, last] that the hook knows of (close_range, closefrom). Only chunks that
// exist hold anything to forget.
void forget_range(unsigned first, unsigned last) noexcept {
  constexpr unsigned kEnd = static_cast<unsigned>(kChunks) << kChunkBits;
  if (first >= kEnd) return;
  if (last >= kEnd) last = kEnd - 1;
  for (unsigned fd = first; fd <= last;) {
    FdInfo* c = g_chunks[fd >> kChunkBits].load(std::memory_order_acquire);
    const unsigned chunk_end = ((fd >> kChunkBits) + 1) << kChunkBits;  // first number of the next chunk
    if (c == nullptr) {
      fd = chunk_end;
      continue;
    }
    for (; fd <= last && fd < chunk_end; ++fd) forget(static_cast<int>(fd));
  }
}

// The descriptors passed in SCM_RIGHTS (and SCM_PIDFD, Linux 6.5) messages of a received `m`:
// new numbers, made by the kernel out of the hooks' sight.
constexpr int kScmPidfd = 0x04;
void forget_passed(msghdr& m) noexcept {
  if (m.msg_control == nullptr) return;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || (c->cmsg_type != SCM_RIGHTS && c->cmsg_type != kScmPidfd) ||
        c->cmsg_len < CMSG_LEN(0)) {
      continue;
    }
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t k = 0; k < n; ++k) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
      forget(fd);
    }
  }
}

// A wait this long (~146 years) is for ever; it still adds to a clock reading without overflow.
constexpr int64_t kForeverNs = INT64_MAX / 2;

// A valid (non-negative) time as ns, saturating at kForeverNs: a huge tv_sec must not wrap round
// into a short or negative wait.
int64_t saturated_ns(int64_t sec, int64_t sub_ns) noexcept {
  if (sec >= kForeverNs / 1'000'000'000) return kForeverNs;
  return sec * 1'000'000'000 + sub_ns;
}
int64_t timeval_ns(const timeval& tv) noexcept { return saturated_ns(tv.tv_sec, static_cast<int64_t>(tv.tv_usec) * 1000); }
int64_t timespec_ns(const timespec& ts) noexcept { return saturated_ns(ts.tv_sec, ts.tv_nsec); }

// What is left at this moment of `req` (valid), begun at `start`: never negative, and exact for
// any tv_sec (computed on the timespec, never as a sum of ns that could overflow).
timespec time_left(const timespec& req, std::chrono::steady_clock::time_point start) noexcept {
  const int64_t gone = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  int64_t sec = static_cast<int64_t>(req.tv_sec) - gone / 1'000'000'000;
  int64_t nsec = req.tv_nsec - gone % 1'000'000'000;
  if (nsec < 0) {
    nsec += 1'000'000'000;
    --sec;
  }
  if (sec < 0) return timespec{0, 0};
  return timespec{static_cast<time_t>(sec), static_cast<long>(nsec)};
}

// What we know of `fd`, asking the kernel the first time. kKnown unset: unusable (bad fd).
uint8_t learn(int fd, FdInfo*& out) noexcept {
  FdInfo* i = info(fd);
  out = i;
  if (i == nullptr) return 0;
  uint8_t f = i->flags.load(std::memory_order_relaxed);
  if ((f & kKnown) && (!i->shared.load(std::memory_order_relaxed) ||
                      i->epoch.load(std::memory_order_relaxed) == g_shared_epoch.load(std::memory_order_relaxed))) {
    return f;
  }
  const uint32_t epoch = g_shared_epoch.load(std::memory_order_relaxed);
  const long fl = ::syscall(SYS_fcntl, fd, F_GETFL, 0);
  if (fl < 0) return 0;
  struct stat st;
  if (::syscall(SYS_fstat, fd, &st) != 0) return 0;
  f = kKnown;
  if (fl & O_NONBLOCK) f |= kNonblock;
  if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode)) f |= kSeekable;
  // Only sockets have timeouts: anything else, including a number that held a socket with
  // SO_RCVTIMEO before, waits as long as it takes.
  int64_t rcv_timeout = 0;
  int64_t snd_timeout = 0;
  if (S_ISSOCK(st.st_mode)) {
    f |= kSocket;
    int type = SOCK_STREAM;
    socklen_t tlen = sizeof type;
    if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 && type != SOCK_STREAM) f |= kMessage;
    timeval tv{};
    socklen_t len = sizeof tv;
    if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &len) == 0) rcv_timeout = timeval_ns(tv);
    tv = timeval{};
    len = sizeof tv;
    if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_SNDTIMEO, &tv, &len) == 0) snd_timeout = timeval_ns(tv);
    const uint8_t no_wait = i->no_wait.load(std::memory_order_relaxed);
    if (rcv_timeout == 0) f |= no_wait & kRecvNoWait;  // else a timeout was set since, elsewhere
    if (snd_timeout == 0) f |= no_wait & kSendNoWait;
  }
  i->rcv_timeout.store(rcv_timeout, std::memory_order_relaxed);
  i->snd_timeout.store(snd_timeout, std::memory_order_relaxed);
  i->epoch.store(epoch, std::memory_order_relaxed);
  i->flags.store(f, std::memory_order_relaxed);
  return f;
}

fiber::io::Deadline deadline_of(int64_t timeout_ns) noexcept {
  if (timeout_ns <= 0) return {};
  return fiber::io::Deadline(std::chrono::nanoseconds(timeout_ns));
}

// ------------------------------------------------------------------------------ transfers

// A read-like call on a descriptor that may park. `now` tries without waiting (sockets:
// MSG_DONTWAIT); `wait` is the fiber call with the receive deadline.
template <typename Now, typename Wait>
ssize_t park_read(int fd, Now&& now, Wait&& wait) noexcept {
  FdInfo* i;
  const uint8_t f = learn(fd, i);
  if (!(f & kKnown) || (f & kNonblock)) return -2;  // the caller makes the real call
  if (f & kSocket) {
    const ssize_t r = now();
    if (r >= 0 || get_errno() != EAGAIN || (f & kRecvNoWait)) return r;
  }
  const fiber::io::Deadline d = deadline_of(i->rcv_timeout.load(std::memory_order_relaxed));
  return finish(wait(d), d);
}

size_t iov_total(const msghdr& m) noexcept {
  size_t total = 0;
  for (size_t k = 0; k < m.msg_iovlen; ++k) total += m.msg_iov[k].iov_len;
  return total;
}

// `part` becomes `m` with its iovec advanced past the first `done` bytes, held in `rest`. False
// if the copy cannot be made. Only for an iovec the kernel has accepted (a call with it succeeded
// or would have blocked): before that it may be any pointer, and the real call says EFAULT.
bool advance(const msghdr& m, size_t done, std::vector<iovec>& rest, msghdr& part) noexcept {
  try {
    rest.assign(m.msg_iov, m.msg_iov + m.msg_iovlen);
  } catch (...) {
    return false;
  }
  size_t first = 0;
  while (first < rest.size() && done >= rest[first].iov_len) done -= rest[first++].iov_len;
  if (first < rest.size()) {
    rest[first].iov_base = static_cast<char*>(rest[first].iov_base) + done;
    rest[first].iov_len -= done;
  }
  part = m;
  part.msg_iov = rest.data() + first;
  part.msg_iovlen = rest.size() - first;
  return true;
}

bool wait_all(int flags) noexcept {
  // MSG_PEEK with it would peek the same bytes again for each part: left as one receive.
  return (flags & (MSG_WAITALL | MSG_PEEK)) == MSG_WAITALL;
}

// The rest of a MSG_WAITALL receive on a stream socket, `done` bytes of `m` already in: the
// kernel's call waits for all of it, but only when it may wait at all, and our first try carried
// MSG_DONTWAIT. So the rest comes part by part until all of it, end of file, an error or the
// receive deadline; after some data those give the count, as the kernel's call does. `ctl` is the
// control buffer's size. A part with ancillary data is the last. The address is the first part's.
ssize_t recv_rest(int fd, msghdr& m, int flags, size_t done, size_t ctl, const fiber::io::Deadline& d) noexcept {
  const size_t total = iov_total(m);
  size_t used = done > 0 ? m.msg_controllen : 0;
  int got = done > 0 ? m.msg_flags : 0;
  std::vector<iovec> rest;
  msghdr part;
  while (done < total) {
    // Data that came with ancillary data (passed descriptors, credentials, TCP_INQ) or stopped
    // at a mark (MSG_OOB) or with a truncated control buffer ends the receive, as the kernel's
    // AF_UNIX receive stops after passed descriptors: going on would give the next part's
    // ancillary data what room is left, or none - descriptors the kernel then closes.
    if (done > 0 && (used > 0 || (got & (MSG_CTRUNC | MSG_OOB)) != 0)) break;
    if (!advance(m, done, rest, part)) {
      if (done > 0) break;
      set_errno(ENOMEM);
      return -1;
    }
    if (m.msg_control != nullptr) {
      part.msg_control = static_cast<char*>(m.msg_control) + std::min(used, ctl);
      part.msg_controllen = ctl - std::min(used, ctl);
    }
    if (done > 0) {
      part.msg_name = nullptr;
      part.msg_namelen = 0;
    }
    const ssize_t w = fiber::io::recvmsg(fd, &part, flags & ~MSG_WAITALL, d);
    if (w < 0) {
      if (done > 0) break;
      return finish(w, d);
    }
    if (done == 0) m.msg_namelen = part.msg_namelen;
    used += part.msg_controllen;
    got |= part.msg_flags;
    if (w == 0) break;  // end of file
    done += static_cast<size_t>(w);
  }
  m.msg_controllen = used;
  m.msg_flags = got;
  return static_cast<ssize_t>(done);
}

// park_read of a MSG_WAITALL receive into `m` (see recv_rest). Where the flag means nothing
// (not a stream socket) it is park_read.
template <typename Now, typename Wait>
ssize_t park_read_all(int fd, msghdr& m, int flags, Now&& now, Wait&& wait) noexcept {
  FdInfo* i;
  const uint8_t f = learn(fd, i);
  if (!(f & kSocket) || (f & kMessage)) return park_read(fd, now, wait);
  if (f & kNonblock) return -2;  // the kernel ignores MSG_WAITALL there too
  const size_t ctl = m.msg_controllen;  // the call overwrites it with what it used
  const ssize_t r = now();
  if ((r < 0 && get_errno() != EAGAIN) || (f & kRecvNoWait)) return r;  // no wait: what is there
  if (r == 0) return 0;  // end of file, or nothing asked
  return recv_rest(fd, m, flags, r > 0 ? static_cast<size_t>(r) : 0, ctl,
                   deadline_of(i->rcv_timeout.load(std::memory_order_relaxed)));
}

}  // namespace

// ------------------------------------------------------------------------------ the hooks

extern "C" {

int socket(int domain, int type, int protocol) noexcept {
  const int fd = REAL(socket, SYS_socket, domain, type, protocol);
  if (fd >= 0) forget(fd);
  return fd;
}

int socketpair(int domain, int type, int protocol, int sv[2]) noexcept {
  const int rc = REAL(socketpair, SYS_socketpair, domain, type, protocol, sv);
  if (rc == 0) {
    forget(sv[0]);
    forget(sv[1]);
  }
  return rc;
}

int pipe(int fds[2]) noexcept {
  const int rc = REAL(pipe, SYS_pipe, fds);
  if (rc == 0) {
    forget(fds[0]);
    forget(fds[1]);
  }
  return rc;
}

int pipe2(int fds[2], int flags) noexcept {
  const int rc = REAL(pipe2, SYS_pipe2, fds, flags);
  if (rc == 0) {
    forget(fds[0]);
    forget(fds[1]);
  }
  return rc;
}

}  // extern "C"

namespace {
// A TCP socket whose connection is on its way (SYN sent; or received, in a simultaneous open).
bool tcp_connecting(int fd) noexcept {
  uint8_t state = 0;  // tcp_info's first member: the kernel copies as much as is asked for
  socklen_t n = sizeof state;
  return ::syscall(SYS_getsockopt, fd, IPPROTO_TCP, TCP_INFO, &state, &n) == 0 && n == 1 &&
         (state == TCP_SYN_SENT || state == TCP_SYN_RECV);
}
}  // namespace

extern "C" {

int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  if (!may_park()) return REAL(connect, SYS_connect, fd, addr, len);
  FdInfo* i;
  const uint8_t f = learn(fd, i);
  if (!(f & kKnown) || (f & (kNonblock | kSendNoWait)) || !(f & kSocket)) return REAL(connect, SYS_connect, fd, addr, len);
  const fiber::io::Deadline d = deadline_of(i->snd_timeout.load(std::memory_order_relaxed));
  // SO_SNDTIMEO's expiry: a TCP connect goes on in the background (EINPROGRESS); a Unix one
  // waited for room in the listener's queue, and gives up (EAGAIN). A connect while an earlier
  // one is still on its way waits for it too, and its expiry says EALREADY.
  const bool unix_family = addr != nullptr && len >= sizeof(sa_family_t) && addr->sa_family == AF_UNIX;
  const int expired = unix_family ? EAGAIN : (!d.is_none() && tcp_connecting(fd)) ? EALREADY : EINPROGRESS;
  return finish(fiber::io::connect(fd, addr, len, d), d, expired);
}

int accept4(int fd, struct sockaddr* addr, socklen_t* len, int flags) {
  // The new number may have held something else: whatever was cached about it goes, on every
  // path (as for socket and open).
  const auto forgotten = [](int r) {
    if (r >= 0) forget(r);
    return r;
  };
  if (!may_park()) return forgotten(REAL(accept4, SYS_accept4, fd, addr, len, flags));
  FdInfo* i;
  const uint8_t f = learn(fd, i);
  int r;
  if (!(f & kKnown) || (f & (kNonblock | kRecvNoWait))) {
    r = forgotten(REAL(accept4, SYS_accept4, fd, addr, len, flags));
  } else {
    const fiber::io::Deadline d = deadline_of(i->rcv_timeout.load(std::memory_order_relaxed));
    r = forgotten(finish(fiber::io::accept(fd, addr, len, flags, d), d));
  }
  // A TCP connection takes its listener's timeouts (a Unix one starts with none).
  if (const uint8_t no_wait = i != nullptr ? i->no_wait.load(std::memory_order_relaxed) : 0; r >= 0 && no_wait != 0) {
    int domain = 0;
    socklen_t dlen = sizeof domain;
    if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) == 0 && (domain == AF_INET || domain == AF_INET6)) {
      if (FdInfo* n = info(r)) n->no_wait.store(no_wait, std::memory_order_relaxed);
    }
  }
  return r;
}

int accept(int fd, struct sockaddr* addr, socklen_t* len) { return accept4(fd, addr, len, 0); }

ssize_t read(int fd, void* buf, size_t n) {
  // A length beyond SSIZE_MAX is the real call's EFAULT; recvfrom, our first try, would clamp it.
  // A length of 0 is the real call's too: read(2) returns 0 at once, where recvfrom would
  // consume (and lose) a datagram, or on a stream wait for data.
  if (may_park() && n != 0 && n <= SSIZE_MAX) {
    const ssize_t r = park_read(
        fd, [&] { return REAL(recvfrom, SYS_recvfrom, fd, buf, n, MSG_DONTWAIT, nullptr, nullptr); },
        [&](fiber::io::Deadline d) { return fiber::io::read(fd, buf, n, d); });
    if (r != -2) return r;
  }
  return REAL(read, SYS_read, fd, buf, n);
}

ssize_t readv(int fd, const struct iovec* iov, int cnt) {
  // A count the kernel refuses is the real call's EINVAL (recvmsg would read nothing for a
  // negative one, or say EMSGSIZE); no buffers at all, its 0 at once (see read).
  if (may_park() && cnt > 0 && cnt <= IOV_MAX) {
    msghdr m{};
    m.msg_iov = const_cast<iovec*>(iov);
    m.msg_iovlen = static_cast<size_t>(cnt);
    const ssize_t r = park_read(
        fd, [&] { return REAL(recvmsg, SYS_recvmsg, fd, &m, MSG_DONTWAIT); },
        [&](fiber::io::Deadline d) { return fiber::io::readv(fd, iov, cnt, d); });
    if (r != -2) return r;
  }
  return REAL(readv, SYS_readv, fd, iov, cnt);
}

ssize_t pread(int fd, void* buf, size_t n, off_t off) {
  // A length beyond SSIZE_MAX is the real call's EFAULT (fiber::io's pread says EINVAL).
  if (may_park() && n <= SSIZE_MAX) {
    FdInfo* i;
    const uint8_t f = learn(fd, i);
    // Only files have offsets: on a pipe or socket the real call fails with ESPIPE at once.
    if ((f & kKnown) && !(f & kNonblock) && (f & kSeekable)) return finish(fiber::io::pread(fd, buf, n, off));
  }
  return REAL(pread, SYS_pread64, fd, buf, n, off);
}
ssize_t pread64(int fd, void* buf, size_t n, off_t off) { return pread(fd, buf, n, off); }

// MSG_ERRQUEUE reads the error queue and MSG_OOB the urgent byte, neither of which ever waits
// (no urgent byte yet: EAGAIN or EINVAL at once): the real call. The fiber receives go
// without MSG_WAITALL, which park_read_all does itself (and which a message socket ignores).
ssize_t recv(int fd, void* buf, size_t n, int flags) {
  if (may_park() && !(flags & (MSG_DONTWAIT | MSG_ERRQUEUE | MSG_OOB))) {
    auto now = [&] { return REAL(recvfrom, SYS_recvfrom, fd, buf, n, flags | MSG_DONTWAIT, nullptr, nullptr); };
    auto wait = [&](fiber::io::Deadline d) { return fiber::io::recv(fd, buf, n, flags & ~MSG_WAITALL, d); };
    iovec iov{buf, n};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    const ssize_t r = wait_all(flags) ? park_read_all(fd, m, flags, now, wait) : park_read(fd, now, wait);
    if (r != -2) return r;
  }
  return REAL(recvfrom, SYS_recvfrom, fd, buf, n, flags, nullptr, nullptr);
}

ssize_t recvmsg(int fd, struct msghdr* msg, int flags) {
  ssize_t r = -2;
  if (may_park() && !(flags & (MSG_DONTWAIT | MSG_ERRQUEUE | MSG_OOB))) {
    auto now = [&] { return REAL(recvmsg, SYS_recvmsg, fd, msg, flags | MSG_DONTWAIT); };
    auto wait = [&](fiber::io::Deadline d) { return fiber::io::recvmsg(fd, msg, flags & ~MSG_WAITALL, d); };
    // A null msg is the real call's EFAULT (through park_read's first try).
    r = wait_all(flags) && msg != nullptr ? park_read_all(fd, *msg, flags, now, wait) : park_read(fd, now, wait);
  }
  if (r == -2) r = REAL(recvmsg, SYS_recvmsg, fd, msg, flags);
  if (r >= 0 && msg != nullptr) forget_passed(*msg);
  return r;
}

ssize_t recvfrom(int fd, void* buf, size_t n, int flags, struct sockaddr* addr, socklen_t* len) {
  if (addr == nullptr) return recv(fd, buf, n, flags);
  if (may_park() && !(flags & (MSG_DONTWAIT | MSG_ERRQUEUE | MSG_OOB))) {
    iovec iov{buf, n};
    msghdr m{};
    m.msg_name = addr;
    m.msg_namelen = len ? *len : 0;
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    const ssize_t r = recvmsg(fd, &m, flags);
    if (r >= 0 && len == nullptr) {  // the kernel's call too takes the data, then fails to store
      set_errno(EFAULT);             // the address's length
      return -1;
    }
    if (r >= 0) *len = m.msg_namelen;
    return r;
  }
  return REAL(recvfrom, SYS_recvfrom, fd, buf, n, flags, addr, len);
}

}  // extern "C"

namespace {

// The kernel raises SIGPIPE at the writing thread when a send on a stream or seqpacket socket
// fails with EPIPE because the peer has gone, unless MSG_NOSIGNAL is among `flags`. The
// runtime's socket calls always pass MSG_NOSIGNAL, so a hooked socket write whose runtime call
// `w` failed so raises it here, on the thread that runs the fiber now, as the blocking call
// would have. Not where the real call made the try (it raised its own), not after a part was
// written (the kernel's call returns that count, without a signal), and not for pipes: their
// writes, direct or on the ring, run on the processor's thread without MSG_NOSIGNAL, and the
// kernel signals there itself.
void sigpipe_on_epipe(ssize_t w, int flags) noexcept {
  if (w == -EPIPE && !(flags & MSG_NOSIGNAL)) {
    ::syscall(SYS_tgkill, ::syscall(SYS_getpid), ::syscall(SYS_gettid), SIGPIPE);
  }
}

// A write-like call that blocks until everything is written (as a blocking socket does): one
// try without waiting, then the fiber call with the send deadline for the rest. A timeout or
// error after some bytes went out returns the count, as the kernel does.
template <typename Now, typename Wait>
ssize_t park_write(int fd, size_t total, int flags, Now&& now, Wait&& wait) noexcept {
  FdInfo* i;
  const uint8_t f = learn(fd, i);
  if (!(f & kKnown) || (f & kNonblock)) return -2;
  size_t done = 0;
  if (!(f & kSocket)) {  // pipes, files: a blocking write(2) writes everything too
    // ... except that a regular file's stops short at a limit (RLIMIT_FSIZE, a full disk): one
    // call, whose short count the caller sees, as from the kernel's (a second would raise SIGXFSZ).
    if (f & kSeekable) {
      const ssize_t w = wait(0, deadline_of(0));
      return w < 0 ? finish(w) : w;
    }
    while (done < total) {
      const ssize_t w = wait(done, deadline_of(0));
      if (w < 0) return done > 0 ? static_cast<ssize_t>(done) : finish(w);
      if (w == 0) break;
      done += static_cast<size_t>(w);
    }
    return static_cast<ssize_t>(done);
  }
  const ssize_t r = now();
  if ((r < 0 && get_errno() != EAGAIN) || (f & kSendNoWait)) return r;  // no wait: what went
  const fiber::io::Deadline d = deadline_of(i->snd_timeout.load(std::memory_order_relaxed));
  if (f & kMessage) {  // one message, whole (even empty)
    if (r >= 0) return r;
    const ssize_t w = wait(0, d);
    sigpipe_on_epipe(w, flags);
    return finish(w, d);
  }
  if (r > 0) done = static_cast<size_t>(r);
  while (done < total) {
    const ssize_t w = wait(done, d);
    if (w < 0 && done == 0) sigpipe_on_epipe(w, flags);
    if (w < 0) return done > 0 ? static_cast<ssize_t>(done) : finish(w, d);
    done += static_cast<size_t>(w);
  }
  return static_cast<ssize_t>(done);
}

}  // namespace

extern "C" {

ssize_t write(int fd, const void* buf, size_t n) {
  // A length beyond SSIZE_MAX is the real call's EFAULT; sendto, our first try, would clamp it
  // and send what lies past the caller's buffer.
  if (may_park() && n <= SSIZE_MAX) {
    const char* p = static_cast<const char*>(buf);
    const ssize_t r = park_write(
        fd, n, 0, [&] { return REAL(sendto, SYS_sendto, fd, buf, n, MSG_DONTWAIT, nullptr, 0); },
        [&](size_t off, fiber::io::Deadline d) { return fiber::io::write(fd, p + off, n - off, d); });
    if (r != -2) return r;
  }
  return REAL(write, SYS_write, fd, buf, n);
}

ssize_t send(int fd, const void* buf, size_t n, int flags) {
  if (may_park() && !(flags & MSG_DONTWAIT)) {
    const char* p = static_cast<const char*>(buf);
    const ssize_t r = park_write(
        fd, n, flags, [&] { return REAL(sendto, SYS_sendto, fd, buf, n, flags | MSG_DONTWAIT, nullptr, 0); },
        [&](size_t off, fiber::io::Deadline d) { return fiber::io::send(fd, p + off, n - off, flags, d); });
    if (r != -2) return r;
  }
  return REAL(sendto, SYS_sendto, fd, buf, n, flags, nullptr, 0);
}

}  // extern "C"

namespace {

// sendmsg/writev on a blocking descriptor: everything is written (as the kernel's blocking call
// does), `done` bytes of `m` already were. The rest goes out from a copy of the iovec advanced
// past what was sent (advance: the first part was the caller's, which the kernel checked);
// ancillary data went with the first bytes. Returns the total, or the count so far when a later
// part times out or fails.
ssize_t send_rest(int fd, const msghdr& m, int flags, size_t done, const fiber::io::Deadline& d, bool socket) noexcept {
  const size_t total = iov_total(m);
  std::vector<iovec> rest;
  msghdr part;
  while (done < total && advance(m, done, rest, part)) {
    ssize_t w;
    if (socket) {
      if (done > 0) {
        part.msg_control = nullptr;
        part.msg_controllen = 0;
      }
      w = fiber::io::sendmsg(fd, &part, flags, d);
    } else {
      w = fiber::io::writev(fd, part.msg_iov, static_cast<int>(part.msg_iovlen), d);
    }
    if (w < 0 && done == 0 && socket) sigpipe_on_epipe(w, flags);
    if (w < 0) return done > 0 ? static_cast<ssize_t>(done) : finish(w, d);
    if (w == 0) break;
    done += static_cast<size_t>(w);
  }
  return static_cast<ssize_t>(done);
}

// Waits until a connection in progress on `fd` is made: 0, or -errno (its SO_ERROR, or the wait's).
int connected(int fd, const fiber::io::Deadline& d) noexcept {
  const int ready = fiber::io::poll(fd, POLLOUT, d);
  if (ready < 0) return ready;
  int error = 0;
  socklen_t len = sizeof error;
  if (::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) return -get_errno();
  return -error;
}

// A send on a blocking socket after the first try without waiting gave `r`: on a stream the rest
// (send_rest); a message (kMessage) goes whole or not at all, so it was sent, or is sent once
// there is room - never in parts, which would be several messages.
ssize_t send_after(int fd, const msghdr& m, int flags, ssize_t r, uint8_t f, const fiber::io::Deadline& d) noexcept {
  if ((flags & MSG_FASTOPEN) && !(f & kMessage) && (r > 0 || (r < 0 && get_errno() == EINPROGRESS))) {
    // TCP Fast Open: the first try started the connection, with the first r bytes in the SYN
    // (a cookie for the peer, or TCP_FASTOPEN_NO_COOKIE) or none (EINPROGRESS). The kernel's
    // blocking call waits for the connection, then sends the rest as on any connected socket,
    // without the flag (a second Fast Open send would fail: EALREADY, EISCONN). A connection
    // that fails is the call's error even after data went in the SYN; a send timeout returns
    // what went (EINPROGRESS if nothing did), as the kernel's does.
    const int c = connected(fd, d);
    if (c < 0) return (r > 0 && c == -ETIMEDOUT && d.expired()) ? r : finish(c, d, EINPROGRESS);
    return send_rest(fd, m, flags & ~MSG_FASTOPEN, r > 0 ? static_cast<size_t>(r) : 0, d, true);
  }
  if (r < 0 && get_errno() != EAGAIN) return r;
  if (f & kMessage) {
    if (r >= 0) return r;
    const ssize_t w = fiber::io::sendmsg(fd, &m, flags, d);
    sigpipe_on_epipe(w, flags);
    return finish(w, d);
  }
  return send_rest(fd, m, flags, r > 0 ? static_cast<size_t>(r) : 0, d, true);
}

}  // namespace

extern "C" {

// With an address: on a datagram socket one message, on a (connected) stream socket a send
// like any other, written in full - the address goes with each part, for the kernel to ignore
// (TCP) or refuse (AF_UNIX: EISCONN) as its own sendto does.
ssize_t sendto(int fd, const void* buf, size_t n, int flags, const struct sockaddr* addr, socklen_t len) {
  if (addr == nullptr) return send(fd, buf, n, flags);
  if (may_park() && !(flags & MSG_DONTWAIT)) {
    FdInfo* i;
    const uint8_t f = learn(fd, i);
    if ((f & kSocket) && !(f & kNonblock)) {
      const ssize_t r = REAL(sendto, SYS_sendto, fd, buf, n, flags | MSG_DONTWAIT, addr, len);
      if (f & kSendNoWait) return r;
      iovec iov{const_cast<void*>(buf), n};
      msghdr m{};
      m.msg_name = const_cast<sockaddr*>(addr);
      m.msg_namelen = len;
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      return send_after(fd, m, flags, r, f, deadline_of(i->snd_timeout.load(std::memory_order_relaxed)));
    }
  }
  return REAL(sendto, SYS_sendto, fd, buf, n, flags, addr, len);
}

ssize_t sendmsg(int fd, const struct msghdr* msg, int flags) {
  if (may_park() && !(flags & MSG_DONTWAIT)) {
    FdInfo* i;
    const uint8_t f = learn(fd, i);
    if ((f & kKnown) && !(f & kNonblock)) {
      // A failure other than EAGAIN (a bad msg among them) is returned unread by send_after.
      const ssize_t r = REAL(sendmsg, SYS_sendmsg, fd, msg, flags | MSG_DONTWAIT);
      if (f & kSendNoWait) return r;
      return send_after(fd, *msg, flags, r, f, deadline_of(i->snd_timeout.load(std::memory_order_relaxed)));
    }
  }
  return REAL(sendmsg, SYS_sendmsg, fd, msg, flags);
}

ssize_t writev(int fd, const struct iovec* iov, int cnt) {
  if (may_park()) {
    FdInfo* i;
    const uint8_t f = learn(fd, i);
    if ((f & kKnown) && !(f & kNonblock)) {
      if (cnt < 0 || cnt > IOV_MAX) return REAL(writev, SYS_writev, fd, iov, cnt);  // EINVAL
      msghdr m{};
      m.msg_iov = const_cast<iovec*>(iov);
      m.msg_iovlen = static_cast<size_t>(cnt);
      // The first part goes with the caller's iovec as it is, so the kernel checks it (EFAULT)
      // before send_rest reads it.
      if (!(f & kSocket)) {
        const ssize_t r = fiber::io::writev(fd, iov, cnt);
        if (r < 0) return finish(r);
        if (f & kSeekable) return r;  // a regular file: one call (park_write)
        return send_rest(fd, m, 0, static_cast<size_t>(r), fiber::io::Deadline(), false);
      }
      const ssize_t r = REAL(sendmsg, SYS_sendmsg, fd, &m, MSG_DONTWAIT);
      if (f & kSendNoWait) return r;
      return send_after(fd, m, 0, r, f, deadline_of(i->snd_timeout.load(std::memory_order_relaxed)));
    }
  }
  return REAL(writev, SYS_writev, fd, iov, cnt);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  if (may_park() && n <= SSIZE_MAX) {  // as pread
    FdInfo* i;
    const uint8_t f = learn(fd, i);
    if ((f & kKnown) && !(f & kNonblock) && (f & kSeekable)) return finish(fiber::io::pwrite(fd, buf, n, off));
  }
  return REAL(pwrite, SYS_pwrite64, fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }

// ---- poll, ppoll, select

}  // extern "C"

namespace {

// poll(2) inside a fiber, `timeout_ns` < 0 for none; io::poll's wait, which a cancel ends too.
int fiber_poll(struct pollfd* fds, nfds_t n, int64_t timeout_ns) noexcept {
  // timeout_ns is never 0 here (poll, ppoll and select make the real call for that), so
  // deadline_of's "<= 0: none" reads as "< 0: wait for ever".
  const int r = fiber::io::poll(fds, n, deadline_of(timeout_ns));
  return r == -ETIMEDOUT ? 0 : finish(r);
}

// select's sets as the kernel reads poll's answer (fs/select.c: POLLIN_SET, POLLOUT_SET,
// POLLEX_SET). POLLHUP and POLLERR, which poll reports whatever was asked, count only for the
// read and write sets: for a descriptor only in exceptfds they are no answer at all.
constexpr short kInSet = POLLIN | POLLRDNORM | POLLRDBAND | POLLHUP | POLLERR;
constexpr short kOutSet = POLLOUT | POLLWRNORM | POLLWRBAND | POLLERR;
constexpr short kExSet = POLLPRI;

std::vector<pollfd> select_fds(int nfds, const fd_set* r, const fd_set* w, const fd_set* e) {
  std::vector<pollfd> fds;
  for (int fd = 0; fd < nfds; ++fd) {
    short ev = 0;
    if (r && FD_ISSET(fd, r)) ev |= POLLIN;
    if (w && FD_ISSET(fd, w)) ev |= POLLOUT;
    if (e && FD_ISSET(fd, e)) ev |= POLLPRI;
    if (ev) fds.push_back(pollfd{fd, ev, 0});
  }
  return fds;
}

// The bits poll's answer sets, each in a set the descriptor was asked for; into the sets when
// `r`, `w`, `e` are given (and cleared first).
int select_bits(const std::vector<pollfd>& fds, fd_set* r, fd_set* w, fd_set* e) noexcept {
  if (r) FD_ZERO(r);
  if (w) FD_ZERO(w);
  if (e) FD_ZERO(e);
  int count = 0;
  auto mark = [&](fd_set* set, int fd) {
    if (set) FD_SET(fd, set);
    ++count;
  };
  for (const pollfd& p : fds) {
    if ((p.events & POLLIN) && (p.revents & kInSet)) mark(r, p.fd);
    if ((p.events & POLLOUT) && (p.revents & kOutSet)) mark(w, p.fd);
    if ((p.events & POLLPRI) && (p.revents & kExSet)) mark(e, p.fd);
  }
  return count;
}

timeval to_timeval(const timespec& ts) noexcept {  // rounded up: never a shorter wait
  timeval tv{ts.tv_sec, static_cast<suseconds_t>((ts.tv_nsec + 999) / 1000)};
  if (tv.tv_usec == 1'000'000) tv = timeval{tv.tv_sec + 1, 0};
  return tv;
}

using select_fn = int (*)(int, fd_set*, fd_set*, fd_set*, timeval*);

// select when poll reports what select does not (POLLHUP/POLLERR of a descriptor only in
// exceptfds): poll would report it again at once, so waiting with it would spin, and returning
// would be select returning 0 before its timeout. The real select waits it out as the kernel's
// does, on a blocking-offload helper thread for the time left (`tv` begun at `start`), while the
// fiber parks.
int select_offloaded(select_fn real, int nfds, fd_set* r, fd_set* w, fd_set* e, timeval* tv,
                     std::chrono::steady_clock::time_point start) noexcept {
  timeval left{};
  if (tv) left = to_timeval(time_left(timespec{tv->tv_sec, static_cast<long>(tv->tv_usec) * 1000}, start));
  int err = 0;
  try {
    const int rc = fiber::blocking([&] {
      const int x = real(nfds, r, w, e, tv ? &left : nullptr);
      if (x < 0) err = errno;
      return x;
    });
    if (tv) *tv = left;
    if (rc < 0) set_errno(err);
    return rc;
  } catch (const fiber::Cancelled&) {
    set_errno(ECANCELED);  // as fiber_poll's: a loop retrying EINTR would spin
    return -1;
  } catch (...) {
    set_errno(ENOMEM);  // no helper thread could be started: select's "cannot allocate"
    return -1;
  }
}

}  // namespace

extern "C" {

int poll(struct pollfd* fds, nfds_t n, int timeout) {
  if (timeout == 0 || !may_park()) {
    const timespec ts{timeout / 1000, (timeout % 1000) * 1'000'000};
    return real_poll ? real_poll(fds, n, timeout)
                     : static_cast<int>(::syscall(SYS_ppoll, fds, n, timeout < 0 ? nullptr : &ts, nullptr, _NSIG / 8));
  }
  // Ready already? Then no park at all.
  const int now = real_poll(fds, n, 0);
  if (now != 0) return now;
  return fiber_poll(fds, n, timeout < 0 ? -1 : static_cast<int64_t>(timeout) * 1'000'000);
}

int ppoll(struct pollfd* fds, nfds_t n, const struct timespec* ts, const sigset_t* mask) {
  // A signal mask changes what the call means; leave those to the kernel.
  if (mask != nullptr || (ts && ts->tv_sec == 0 && ts->tv_nsec == 0) || !may_park() ||
      (ts && (ts->tv_sec < 0 || ts->tv_nsec < 0 || ts->tv_nsec >= 1'000'000'000))) {  // invalid: EINVAL
    if (real_ppoll != nullptr) return real_ppoll(fds, n, ts, mask);
    // Before resolution: the system call, which takes the mask's size and writes what is left
    // of the timeout back (glibc's ppoll passes a copy).
    timespec left{};
    if (ts != nullptr) left = *ts;
    return static_cast<int>(::syscall(SYS_ppoll, fds, n, ts ? &left : nullptr, mask, _NSIG / 8));
  }
  const int now = real_poll(fds, n, 0);
  if (now != 0) return now;
  return fiber_poll(fds, n, ts ? timespec_ns(*ts) : -1);
}

int select(int nfds, fd_set* r, fd_set* w, fd_set* e, struct timeval* tv) {
  auto* real = lazy(real_select, "select");
  // Invalid arguments are the kernel's to report (EINVAL), as is a zero timeout.
  if (!may_park() || nfds < 0 || nfds > FD_SETSIZE || (tv && tv->tv_sec == 0 && tv->tv_usec == 0) ||
      (tv && (tv->tv_sec < 0 || tv->tv_usec < 0))) {
    return real(nfds, r, w, e, tv);
  }
  // A tv_usec of a second or more is valid: Linux carries it into tv_sec ("tv.tv_usec =
  // ms * 1000" is common). Normalised here, so that the wait parks like any other; the time
  // left written back is normalised, as the kernel's is.
  if (tv && tv->tv_usec >= 1'000'000) {
    const time_t carry = static_cast<time_t>(tv->tv_usec / 1'000'000);
    tv->tv_sec = tv->tv_sec > std::numeric_limits<time_t>::max() - carry ? std::numeric_limits<time_t>::max()
                                                                          : tv->tv_sec + carry;
    tv->tv_usec %= 1'000'000;
  }
  // As poll: the sets become pollfds, the result goes back into the sets.
  const auto start = std::chrono::steady_clock::now();
  std::vector<pollfd> fds;
  try {
    fds = select_fds(nfds, r, w, e);
  } catch (...) {
    return real(nfds, r, w, e, tv);
  }
  int rc = real_poll(fds.data(), fds.size(), 0);
  if (rc == 0) rc = fiber_poll(fds.data(), fds.size(), tv ? timeval_ns(*tv) : -1);
  if (rc < 0) return rc;
  for (const pollfd& p : fds) {
    if (p.revents & POLLNVAL) {
      set_errno(EBADF);
      return -1;
    }
  }
  if (rc > 0 && select_bits(fds, nullptr, nullptr, nullptr) == 0) return select_offloaded(real, nfds, r, w, e, tv, start);
  const int count = select_bits(fds, r, w, e);
  // Linux updates the timeout with what is left (nothing, when it ran out).
  if (tv) *tv = rc == 0 ? timeval{0, 0} : to_timeval(time_left(timespec{tv->tv_sec, static_cast<long>(tv->tv_usec) * 1000}, start));
  return count;
}

// ---- descriptors

int close(int fd) {
  // Forgotten before (no call may go on using the cache once we start) and after: a lookup
  // racing the close could have cached the closing file again in between (as close_range).
  forget(fd);
  int rc;
  // Always through the runtime (also from plain threads): fibers waiting on `fd` must wake.
  // io::close allocates nothing and, with no fiber ever having waited, is the plain close.
  // In a forked child the runtime's threads and fibers do not exist: nothing there can wait on
  // `fd`, and io::close would wait for the parent's waiters forever.
  // In a signal handler likewise: a handler must not park, nor take the runtime's locks, which
  // the code it interrupted may hold; fibers waiting on `fd` then see what the kernel does.
  if (!g_resolved.load(std::memory_order_acquire) || g_forked_child.load(std::memory_order_relaxed) || t_in_signal > 0) {
    rc = static_cast<int>(::syscall(SYS_close, fd));
  } else {
    rc = finish(fiber::io::close(fd));
  }
  forget(fd);  // stores to the table only: errno stays the close's
  return rc;
}

int fcntl(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  const int rc = REAL(fcntl, SYS_fcntl, fd, cmd, arg);
  if (rc >= 0) {
    if (cmd == F_SETFL) changed(fd);
    if (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) {
      forget(rc);
      mark_shared(fd, rc);
    }
  }
  return rc;
}

// glibc 2.28+: programs built with _FILE_OFFSET_BITS=64 call fcntl64.
int fcntl64(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  return fcntl(fd, cmd, arg);
}

int ioctl(int fd, unsigned long req, ...) noexcept {
  va_list ap;
  va_start(ap, req);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  const int rc = REAL(ioctl, SYS_ioctl, fd, req, arg);
  if (rc == 0 && req == FIONBIO) changed(fd);
  return rc;
}

int setsockopt(int fd, int level, int name, const void* val, socklen_t len) noexcept {
  const int rc = REAL(setsockopt, SYS_setsockopt, fd, level, name, val, len);
  if (rc == 0 && level == SOL_SOCKET && (name == SO_RCVTIMEO || name == SO_SNDTIMEO)) {
    // Accepted, so `val` holds a timeval (the kernel copied one from it).
    const uint8_t bit = name == SO_RCVTIMEO ? kRecvNoWait : kSendNoWait;
    if (FdInfo* i = info(fd)) {
      if (static_cast<const timeval*>(val)->tv_sec < 0) {
        i->no_wait.fetch_or(bit, std::memory_order_relaxed);
      } else {
        i->no_wait.fetch_and(static_cast<uint8_t>(~bit), std::memory_order_relaxed);
      }
    }
    changed(fd);
  }
  return rc;
}

int getsockopt(int fd, int level, int name, void* val, socklen_t* len) noexcept {
  return REAL(getsockopt, SYS_getsockopt, fd, level, name, val, len);
}

int dup(int fd) noexcept {
  const int rc = REAL(dup, SYS_dup, fd);
  if (rc >= 0) {
    forget(rc);
    mark_shared(fd, rc);
  }
  return rc;
}

int dup2(int fd, int fd2) noexcept {
  const int rc = REAL(dup2, SYS_dup2, fd, fd2);
  if (rc >= 0 && fd != fd2) {
    forget(rc);
    mark_shared(fd, rc);
  }
  return rc;
}

int dup3(int fd, int fd2, int flags) noexcept {
  const int rc = REAL(dup3, SYS_dup3, fd, fd2, flags);
  if (rc >= 0) {
    forget(rc);
    mark_shared(fd, rc);
  }
  return rc;
}

// ---- descriptors made or closed out of the hooks' sight
//
// What the hook knows of a number must not outlive its descriptor: a number that glibc closed
// internally (fclose) and that comes back as a new descriptor would be taken for the old one -
// a non-blocking eventfd for a blocking socket, parking where the caller expects EAGAIN. So
// every call that closes one inside glibc forgets its number, and every common call that makes
// one forgets the number it returns. (A raw syscall(2) that closes or makes descriptors is beyond
// any hook.)

namespace {
// open(2) and friends read a mode only when they create a file.
bool takes_mode(int flags) noexcept { return (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE; }
// p != nullptr for a parameter glibc declares nonnull (closedir's), which the compiler would
// otherwise take as proven.
bool given(const void* p) noexcept {
  asm("" : "+r"(p));
  return p != nullptr;
}
int made(int fd) noexcept {
  if (fd >= 0) forget(fd);
  return fd;
}
mode_t mode_arg(int flags, va_list ap) noexcept { return takes_mode(flags) ? static_cast<mode_t>(va_arg(ap, unsigned)) : 0; }
}  // namespace

int open(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return made(REAL(open, SYS_open, path, flags, mode));
}

int openat(int dir, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return made(REAL(openat, SYS_openat, dir, path, flags, mode));
}

// On 64-bit Linux the *64 names are the same calls (O_LARGEFILE is implied).
int open64(const char* path, int flags, ...) __attribute__((alias("open")));
int openat64(int dir, const char* path, int flags, ...) __attribute__((alias("openat")));

int eventfd(unsigned count, int flags) noexcept { return made(REAL(eventfd, SYS_eventfd2, count, flags)); }
int timerfd_create(int clock, int flags) noexcept { return made(REAL(timerfd_create, SYS_timerfd_create, clock, flags)); }
int epoll_create1(int flags) noexcept { return made(REAL(epoll_create1, SYS_epoll_create1, flags)); }
int memfd_create(const char* name, unsigned flags) noexcept { return made(REAL(memfd_create, SYS_memfd_create, name, flags)); }
int inotify_init1(int flags) noexcept { return made(REAL(inotify_init1, SYS_inotify_init1, flags)); }

int creat(const char* path, mode_t mode) { return made(REAL(creat, SYS_creat, path, mode)); }
int creat64(const char* path, mode_t mode) __attribute__((alias("creat")));
int epoll_create(int size) noexcept { return made(REAL(epoll_create, SYS_epoll_create, size)); }
int inotify_init() noexcept {
  return made(real_inotify_init ? real_inotify_init() : static_cast<int>(::syscall(SYS_inotify_init)));
}
// With an existing descriptor only its mask changes: the same file, still shared with its dups.
int signalfd(int fd, const sigset_t* mask, int flags) noexcept {
  const int rc = real_signalfd ? real_signalfd(fd, mask, flags)
                               : static_cast<int>(::syscall(SYS_signalfd4, fd, mask, _NSIG / 8, flags));
  return fd == -1 ? made(rc) : rc;
}
// The fortified open(2)s (-D_FORTIFY_SOURCE) open through glibc's internal calls.
int __open_2(const char* path, int flags) { return made(lazy(real___open_2, "__open_2")(path, flags)); }
int __open64_2(const char* path, int flags) __attribute__((alias("__open_2")));
int __openat_2(int dir, const char* path, int flags) { return made(lazy(real___openat_2, "__openat_2")(dir, path, flags)); }
int __openat64_2(int dir, const char* path, int flags) __attribute__((alias("__openat_2")));

// The closes glibc makes internally: each forgets the number first (the stream or directory is
// gone after). freopen may bring a new descriptor back on it, or on another number.
int fclose(FILE* f) {
  // fileno of a FILE without a descriptor (fmemopen, fopencookie) is -1, which forget ignores.
  if (f != nullptr) forget(::fileno(f));
  return lazy(real_fclose, "fclose")(f);
}

int pclose(FILE* f) {
  if (f != nullptr) forget(::fileno(f));
  return lazy(real_pclose, "pclose")(f);
}

FILE* freopen(const char* path, const char* mode, FILE* f) {
  if (f != nullptr) forget(::fileno(f));
  FILE* r = lazy(real_freopen, "freopen")(path, mode, f);
  if (r != nullptr) forget(::fileno(r));
  return r;
}
FILE* freopen64(const char* path, const char* mode, FILE* f) __attribute__((alias("freopen")));

int closedir(DIR* d) {
  if (given(d)) forget(::dirfd(d));
  return lazy(real_closedir, "closedir")(d);
}

// close_range and closefrom (glibc 2.34, Linux 5.9) are looked up when first called, so that
// neither is required of the libc the hook is built for. The numbers are forgotten after the
// call: a learning racing it would otherwise keep what it learned of a descriptor it closed.
int close_range(unsigned first, unsigned last, int flags) noexcept {
  static int (*real_close_range)(unsigned, unsigned, int) = nullptr;
  auto* real = lazy(real_close_range, "close_range");
  const int rc = real != nullptr ? real(first, last, flags) : static_cast<int>(::syscall(SYS_close_range, first, last, flags));
  if (rc == 0 && !(flags & CLOSE_RANGE_CLOEXEC)) forget_range(first, last);
  return rc;
}

void closefrom(int low) noexcept {
  static void (*real_closefrom)(int) = nullptr;
  if (auto* real = lazy(real_closefrom, "closefrom")) {
    real(low);
  } else {
    (void)::syscall(SYS_close_range, static_cast<unsigned>(std::max(low, 0)), ~0U, 0);
  }
  forget_range(static_cast<unsigned>(std::max(low, 0)), ~0U);  // glibc takes a negative low as 0
}

// ---- signal handlers: the program's handlers run inside a trampoline that marks the thread
// as "in a signal handler", so the hooks make real calls there. sigaction reports the program's
// own handler back, as if the trampoline were not there.

}  // extern "C"

namespace {

using SigInfoHandler = void (*)(int, siginfo_t*, void*);
using PlainHandler = void (*)(int);
// The handler the program installed per signal, and whether it takes siginfo. Written by
// sigaction before the trampoline is installed, read by the trampoline.
std::atomic<void*> g_user_handler[_NSIG];
std::atomic<bool> g_user_siginfo[_NSIG];

// Where each handler level of this thread runs, so that a longjmp can tell which levels it
// leaves (the SIGALRM-timeout pattern jumps out of the handler and never returns through the
// trampoline): the trampoline's frame, and the bounds of the alternate stack it runs on (0, 0
// if none). Only the outermost kMaxHandlerFrames levels have a record; a jump that leaves the
// deepest recorded level leaves every level nested in it too.
constexpr int kMaxHandlerFrames = 8;
struct HandlerFrame {
  uintptr_t sp;
  uintptr_t alt_lo, alt_hi;
};
thread_local HandlerFrame t_handler_frames[kMaxHandlerFrames];

// The stack pointer a jmp_buf jumps to. glibc stores it mangled (PTR_MANGLE: xor with the
// thread's pointer guard at %fs:0x30, then rotate left by 17 on x86-64); jmp_sp_readable()
// checks the reading once against a setjmp of its own, and without it a longjmp counts no
// handler out (the hooks then stay real calls in that thread, as before there were these hooks).
uintptr_t jmp_target_sp(const __jmp_buf_tag* env) noexcept {
#if defined(__x86_64__) && defined(__GLIBC__)
  uintptr_t guard;
  asm("mov %%fs:0x30, %0" : "=r"(guard));
  const auto v = static_cast<uintptr_t>(env->__jmpbuf[6]);  // JB_RSP
  return ((v >> 17) | (v << 47)) ^ guard;
#else
  (void)env;
  return 0;
#endif
}

__attribute__((noinline)) bool read_own_setjmp() noexcept {
  jmp_buf jb;
  if (setjmp(jb) != 0) return false;  // never jumped to
  const auto here = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  const uintptr_t sp = jmp_target_sp(jb);
  return sp != 0 && sp <= here && here - sp < 65536;  // within this very frame
}

// Decided in hook_init, before any handler can run: a function-local static first evaluated
// in a signal handler could wait on its own guard in a nested one.
bool g_jmp_sp_readable = false;
bool jmp_sp_readable() noexcept { return g_jmp_sp_readable; }

// True if a jump to stack address `target` leaves the handler level `fr`: a target above its
// frame (an outer level's, or the interrupted code's, on the same stack), or one off the
// alternate stack it runs on (the interrupted code's, wherever that stack is mapped).
bool jump_leaves(const HandlerFrame& fr, uintptr_t target) noexcept {
  return target > fr.sp || (fr.alt_hi != 0 && (target < fr.alt_lo || target >= fr.alt_hi));
}

// A longjmp to `env` is about to leave this thread's innermost handler levels: count them out.
// A gap left open: glibc's siglongjmp restores the saved signal mask before it leaves the
// handler's stack, so a signal that unblocks runs there with the levels already counted out.
// Should that handler jump back into the level being left (not return, not jump out), that
// level runs uncounted. Telling this apart from code that merely runs deep on another fiber's
// stack would take more than the stack pointers recorded here.
void count_out_handlers(const __jmp_buf_tag* env) noexcept {
  if (t_in_signal == 0 || !jmp_sp_readable()) return;
  const uintptr_t target = jmp_target_sp(env);
  while (t_in_signal > 0) {
    // Levels deeper than the records lie inside the deepest recorded one. A jump that stays in
    // it but leaves some of them is not seen; the trampoline resets the count as levels return.
    const int level = std::min(t_in_signal, kMaxHandlerFrames);
    if (!jump_leaves(t_handler_frames[level - 1], target)) break;
    t_in_signal = level - 1;
  }
}

// The record for a handler level whose trampoline frame is at `sp`. The kernel saves the
// thread's alternate stack in the ucontext before SS_AUTODISARM disarms it, so the frame is on
// that stack if it lies within those bounds; a level nested in one on the alternate stack while
// it is disarmed runs on the same memory, and inherits the outer level's bounds.
HandlerFrame frame_record(uintptr_t sp, const void* uc, int level) noexcept {
  if (uc != nullptr) {
    const stack_t& ss = static_cast<const ucontext_t*>(uc)->uc_stack;
    const auto lo = reinterpret_cast<uintptr_t>(ss.ss_sp);
    if (ss.ss_size != 0 && sp >= lo && sp - lo < ss.ss_size) return {sp, lo, lo + ss.ss_size};
  }
  if (level > 0 && level <= kMaxHandlerFrames) {
    const HandlerFrame& outer = t_handler_frames[level - 1];
    if (outer.alt_hi != 0 && sp >= outer.alt_lo && sp < outer.alt_hi) return {sp, outer.alt_lo, outer.alt_hi};
  }
  return {sp, 0, 0};
}

void trampoline(int sig, siginfo_t* info, void* uc) {
  const int saved = errno;  // handlers may clobber it; the interrupted code must not see that
  const int level = t_in_signal;
  const HandlerFrame me = frame_record(reinterpret_cast<uintptr_t>(__builtin_frame_address(0)), uc, level);
  // The record is written before the count says it exists, so a nested handler that jumps
  // never reads a stale one. A signal taken between the two ran at this same level and wrote
  // its own record over ours: write ours again once the count has moved past it.
  if (level < kMaxHandlerFrames) t_handler_frames[level] = me;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_in_signal = level + 1;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (level < kMaxHandlerFrames) t_handler_frames[level] = me;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  void* h = g_user_handler[sig].load(std::memory_order_acquire);
  if (g_user_siginfo[sig].load(std::memory_order_relaxed)) {
    reinterpret_cast<SigInfoHandler>(h)(sig, info, uc);
  } else if (h != nullptr) {
    reinterpret_cast<PlainHandler>(h)(sig);
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_in_signal = level;  // not a decrement: this also settles levels a jump left uncounted
  errno = saved;
}

}  // namespace

extern "C" {

int sigaction(int sig, const struct sigaction* act, struct sigaction* old) noexcept {
  auto* real = lazy(real_sigaction, "sigaction");
  if (sig <= 0 || sig >= _NSIG) return real(sig, act, old);  // the real call reports EINVAL
  const bool is_handler = act != nullptr && act->sa_handler != SIG_DFL && act->sa_handler != SIG_IGN;
  void* prev = g_user_handler[sig].load(std::memory_order_acquire);
  const bool prev_siginfo = g_user_siginfo[sig].load(std::memory_order_relaxed);
  struct sigaction mine;
  const struct sigaction* use = act;
  if (is_handler) {
    const bool si = (act->sa_flags & SA_SIGINFO) != 0;
    g_user_siginfo[sig].store(si, std::memory_order_relaxed);
    g_user_handler[sig].store(si ? reinterpret_cast<void*>(act->sa_sigaction) : reinterpret_cast<void*>(act->sa_handler),
                              std::memory_order_release);
    mine = *act;
    mine.sa_flags |= SA_SIGINFO;
    mine.sa_sigaction = trampoline;
    use = &mine;
  }
  const int rc = real(sig, use, old);
  if (rc == 0 && old != nullptr && old->sa_sigaction == trampoline) {
    // Report what the program installed, not our trampoline.
    if (prev_siginfo) {
      old->sa_sigaction = reinterpret_cast<SigInfoHandler>(prev);
    } else {
      old->sa_flags &= ~SA_SIGINFO;
      old->sa_handler = reinterpret_cast<PlainHandler>(prev);
    }
  }
  return rc;
}

// glibc exports it under this name too (older libraries call it).
int __sigaction(int sig, const struct sigaction* act, struct sigaction* old) noexcept __attribute__((alias("sigaction")));

// longjmp and friends (fortified builds call __longjmp_chk): count out the handler levels the
// jump leaves, then jump.
[[noreturn]] void siglongjmp(sigjmp_buf env, int val) noexcept {
  count_out_handlers(env);
  lazy(real_siglongjmp, "siglongjmp")(env, val);
  __builtin_unreachable();
}
[[noreturn]] void longjmp(jmp_buf env, int val) noexcept {
  count_out_handlers(env);
  lazy(real_longjmp, "longjmp")(env, val);
  __builtin_unreachable();
}
[[noreturn]] void _longjmp(jmp_buf env, int val) noexcept {
  count_out_handlers(env);
  lazy(real__longjmp, "_longjmp")(env, val);
  __builtin_unreachable();
}
[[noreturn]] void __longjmp_chk(jmp_buf env, int val) {
  count_out_handlers(env);
  lazy(real___longjmp_chk, "__longjmp_chk")(env, val);
  __builtin_unreachable();
}

// glibc's signal(), sysv_signal(), sigset() and siginterrupt() change handlers through an
// internal sigaction no preload sees, so a handler they installed would run without the
// trampoline and a hooked call inside it could park. They are redone here on the sigaction
// above, with glibc's semantics.

}  // extern "C"

namespace {

// Signals siginterrupt() asked to interrupt system calls: signal() installs them without
// SA_RESTART (glibc keeps the same set for the same purpose).
std::atomic<bool> g_sig_interrupts[_NSIG];

// Installs `handler` for `sig` with `flags`, blocking `sig` in it unless SA_NODEFER; the
// previous handler, or SIG_ERR with errno.
sighandler_t install_handler(int sig, sighandler_t handler, int flags) noexcept {
  if (handler == SIG_ERR || sig <= 0 || sig >= _NSIG) {  // sigaction would take SIG_ERR for an address
    set_errno(EINVAL);
    return SIG_ERR;
  }
  struct sigaction act {}, old {};
  act.sa_handler = handler;
  sigemptyset(&act.sa_mask);
  if (!(flags & SA_NODEFER)) sigaddset(&act.sa_mask, sig);
  act.sa_flags = flags;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

}  // namespace

extern "C" {

// BSD semantics: the handler stays installed and blocks its signal while it runs; interrupted
// calls restart unless siginterrupt() said otherwise.
sighandler_t signal(int sig, sighandler_t handler) noexcept {
  const bool interrupts = sig > 0 && sig < _NSIG && g_sig_interrupts[sig].load(std::memory_order_relaxed);
  return install_handler(sig, handler, interrupts ? 0 : SA_RESTART);
}
// glibc's other names for the same function.
sighandler_t bsd_signal(int sig, sighandler_t handler) noexcept __attribute__((alias("signal")));
sighandler_t ssignal(int sig, sighandler_t handler) noexcept __attribute__((alias("signal")));

// System V semantics: the handler is reset to SIG_DFL as it runs and does not block its signal
// (SA_INTERRUPT: no SA_RESTART; kernels since 5.11 drop the bit, older ones read it back). A
// program built for strict ISO C or POSIX (no _DEFAULT_SOURCE) calls signal() as __sysv_signal.
sighandler_t sysv_signal(int sig, sighandler_t handler) noexcept {
  return install_handler(sig, handler, SA_RESETHAND | SA_NODEFER | SA_INTERRUPT);
}
sighandler_t __sysv_signal(int sig, sighandler_t handler) noexcept __attribute__((alias("sysv_signal")));

int siginterrupt(int sig, int interrupt) noexcept {
  if (sig <= 0 || sig >= _NSIG) {
    set_errno(EINVAL);
    return -1;
  }
  struct sigaction act {};
  if (sigaction(sig, nullptr, &act) != 0) return -1;
  g_sig_interrupts[sig].store(interrupt != 0, std::memory_order_relaxed);
  if (interrupt != 0) {
    act.sa_flags &= ~SA_RESTART;
  } else {
    act.sa_flags |= SA_RESTART;
  }
  return sigaction(sig, &act, nullptr);
}

// System V sigset(): SIG_HOLD adds `sig` to the thread's mask; anything else installs it (no
// flags, nothing blocked while it runs) and takes `sig` out of the mask. Returns SIG_HOLD if
// `sig` was blocked, else the previous handler. SIG_ERR is refused with EINVAL, as by signal():
// glibc's sigset installs it, and the trampoline would then call address -1.
sighandler_t sigset(int sig, sighandler_t disp) noexcept {
  if (disp == SIG_ERR || sig <= 0 || sig >= _NSIG) {
    set_errno(EINVAL);
    return SIG_ERR;
  }
  sigset_t one, was;
  sigemptyset(&one);
  sigaddset(&one, sig);
  struct sigaction old {};
  if (disp == SIG_HOLD) {
    if (const int e = ::pthread_sigmask(SIG_BLOCK, &one, &was); e != 0) {
      set_errno(e);
      return SIG_ERR;
    }
    if (sigismember(&was, sig)) return SIG_HOLD;
    if (sigaction(sig, nullptr, &old) != 0) return SIG_ERR;
    return old.sa_handler;
  }
  struct sigaction act {};
  act.sa_handler = disp;
  sigemptyset(&act.sa_mask);
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  if (const int e = ::pthread_sigmask(SIG_UNBLOCK, &one, &was); e != 0) {
    set_errno(e);
    return SIG_ERR;
  }
  return sigismember(&was, sig) ? SIG_HOLD : old.sa_handler;
}

// ---- sleeping

int nanosleep(const struct timespec* req, struct timespec* rem) {
  // Invalid requests are the kernel's to report (EFAULT, EINVAL).
  if (!may_park() || req == nullptr || req->tv_nsec < 0 || req->tv_nsec >= 1'000'000'000 || req->tv_sec < 0) {
    return REAL(nanosleep, SYS_nanosleep, req, rem);
  }
  // Cancelled already: ECANCELED, not EINTR, or a caller's loop retrying EINTR with the time
  // left (libstdc++'s sleep_for, most msleep helpers) would spin for the rest of its sleep,
  // and with nothing left, for ever, holding up stop(). Only a sleep the cancel cut short ends
  // with EINTR and the time left.
  if (fiber::this_fiber::cancelled()) {
    set_errno(ECANCELED);
    return -1;
  }
  const timespec want = *req;
  const auto start = std::chrono::steady_clock::now();
  // A request too long for the clock (a huge tv_sec) sleeps until interrupted, as the kernel's
  // does in effect; it must not wrap round into no sleep at all.
  const int64_t ns = timespec_ns(want);
  const auto until = ns >= kForeverNs ? std::chrono::steady_clock::time_point::max() : start + std::chrono::nanoseconds(ns);
  try {
    fiber::this_fiber::sleep_until(until);
  } catch (const fiber::Cancelled&) {
    if (rem) *rem = time_left(want, start);
    set_errno(EINTR);
    return -1;
  }
  return 0;
}

int usleep(useconds_t us) {
  const timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
  return nanosleep(&ts, nullptr);
}

unsigned sleep(unsigned s) {
  const timespec ts{static_cast<time_t>(s), 0};
  timespec rem{};
  // Rounded to the nearest second, as glibc's sleep does.
  if (nanosleep(&ts, &rem) != 0) return static_cast<unsigned>(rem.tv_sec + (rem.tv_nsec >= 500'000'000 ? 1 : 0));
  return 0;
}

// ---- name resolution: glibc's resolver makes its own socket/poll calls through internal
// aliases no preload reaches, so the whole call goes to a blocking-offload helper thread
// (resolve_offloaded, above).

int getaddrinfo(const char* node, const char* service, const struct addrinfo* hints, struct addrinfo** res) {
  auto* fn = lazy(real_getaddrinfo, "getaddrinfo");
  if (!may_park()) return fn(node, service, hints, res);
  try {
    return resolve_offloaded([&] { return fn(node, service, hints, res); });
  } catch (...) {
    set_errno(ECANCELED);
    return EAI_SYSTEM;
  }
}

int getnameinfo(const struct sockaddr* sa, socklen_t salen, char* host, socklen_t hostlen, char* serv,
                socklen_t servlen, int flags) {
  auto* fn = lazy(real_getnameinfo, "getnameinfo");
  if (!may_park()) return fn(sa, salen, host, hostlen, serv, servlen, flags);
  try {
    return resolve_offloaded([&] { return fn(sa, salen, host, hostlen, serv, servlen, flags); });
  } catch (...) {
    set_errno(ECANCELED);
    return EAI_SYSTEM;
  }
}

struct hostent* gethostbyname(const char* name) {
  auto* fn = lazy(real_gethostbyname, "gethostbyname");
  if (!may_park()) return fn(name);
  try {
    return resolve_offloaded([&] { return fn(name); });
  } catch (...) {
    set_h_errno(TRY_AGAIN);
    return nullptr;
  }
}

int gethostbyname_r(const char* name, struct hostent* ret, char* buf, size_t buflen, struct hostent** result,
                    int* h_errnop) {
  auto* fn = lazy(real_gethostbyname_r, "gethostbyname_r");
  if (!may_park()) return fn(name, ret, buf, buflen, result, h_errnop);
  try {
    return resolve_offloaded([&] { return fn(name, ret, buf, buflen, result, h_errnop); });
  } catch (...) {
    if (h_errnop) *h_errnop = TRY_AGAIN;
    return ECANCELED;
  }
}

// ---- fortified variants (-D_FORTIFY_SOURCE): check, then the hooked call.

ssize_t __read_chk(int fd, void* buf, size_t n, size_t buflen) {
  if (n > buflen) __chk_fail();
  return read(fd, buf, n);
}
ssize_t __recv_chk(int fd, void* buf, size_t n, size_t buflen, int flags) {
  if (n > buflen) __chk_fail();
  return recv(fd, buf, n, flags);
}
ssize_t __recvfrom_chk(int fd, void* buf, size_t n, size_t buflen, int flags, struct sockaddr* addr, socklen_t* len) {
  if (n > buflen) __chk_fail();
  return recvfrom(fd, buf, n, flags, addr, len);
}
ssize_t __pread_chk(int fd, void* buf, size_t n, off_t off, size_t buflen) {
  if (n > buflen) __chk_fail();
  return pread(fd, buf, n, off);
}
ssize_t __pread64_chk(int fd, void* buf, size_t n, off_t off, size_t buflen) {
  if (n > buflen) __chk_fail();
  return pread(fd, buf, n, off);
}
int __poll_chk(struct pollfd* fds, nfds_t n, int timeout, size_t fdslen) {
  if (fdslen / sizeof(*fds) < n) __chk_fail();
  return poll(fds, n, timeout);
}
int __ppoll_chk(struct pollfd* fds, nfds_t n, const struct timespec* ts, const sigset_t* mask, size_t fdslen) {
  if (fdslen / sizeof(*fds) < n) __chk_fail();
  return ppoll(fds, n, ts, mask);
}

}  // extern "C"
