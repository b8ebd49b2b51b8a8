// The hooked functions, each named once (an X-macro). hook.cpp derives from this list the
// pointers to the real functions, their resolution with dlsym(RTLD_NEXT) and the check that
// every one was found.
//
//   FIBER_HOOK(ret, name, (params), (args))
#pragma once

#define FIBER_HOOKS(X)                                                                                   \
  X(int, socket, (int domain, int type, int protocol), (domain, type, protocol))                         \
  X(int, socketpair, (int domain, int type, int protocol, int sv[2]), (domain, type, protocol, sv))       \
  X(int, pipe, (int fds[2]), (fds))                                                                      \
  X(int, pipe2, (int fds[2], int flags), (fds, flags))                                                   \
  X(int, connect, (int fd, const struct sockaddr* addr, socklen_t len), (fd, addr, len))                 \
  X(int, accept, (int fd, struct sockaddr* addr, socklen_t* len), (fd, addr, len))                       \
  X(int, accept4, (int fd, struct sockaddr* addr, socklen_t* len, int flags), (fd, addr, len, flags))    \
  X(ssize_t, read, (int fd, void* buf, size_t n), (fd, buf, n))                                          \
  X(ssize_t, readv, (int fd, const struct iovec* iov, int cnt), (fd, iov, cnt))                          \
  X(ssize_t, pread, (int fd, void* buf, size_t n, off_t off), (fd, buf, n, off))                         \
  X(ssize_t, pread64, (int fd, void* buf, size_t n, off_t off), (fd, buf, n, off))                       \
  X(ssize_t, write, (int fd, const void* buf, size_t n), (fd, buf, n))                                   \
  X(ssize_t, writev, (int fd, const struct iovec* iov, int cnt), (fd, iov, cnt))                         \
  X(ssize_t, pwrite, (int fd, const void* buf, size_t n, off_t off), (fd, buf, n, off))                  \
  X(ssize_t, pwrite64, (int fd, const void* buf, size_t n, off_t off), (fd, buf, n, off))                \
  X(ssize_t, recv, (int fd, void* buf, size_t n, int flags), (fd, buf, n, flags))                        \
  X(ssize_t, recvfrom, (int fd, void* buf, size_t n, int flags, struct sockaddr* addr, socklen_t* len),  \
    (fd, buf, n, flags, addr, len))                                                                      \
  X(ssize_t, recvmsg, (int fd, struct msghdr* msg, int flags), (fd, msg, flags))                         \
  X(ssize_t, send, (int fd, const void* buf, size_t n, int flags), (fd, buf, n, flags))                  \
  X(ssize_t, sendto, (int fd, const void* buf, size_t n, int flags, const struct sockaddr* addr,          \
                      socklen_t len),                                                                    \
    (fd, buf, n, flags, addr, len))                                                                      \
  X(ssize_t, sendmsg, (int fd, const struct msghdr* msg, int flags), (fd, msg, flags))                   \
  X(int, poll, (struct pollfd * fds, nfds_t n, int timeout), (fds, n, timeout))                          \
  X(int, ppoll, (struct pollfd * fds, nfds_t n, const struct timespec* ts, const sigset_t* mask),        \
    (fds, n, ts, mask))                                                                                  \
  X(int, select, (int nfds, fd_set* r, fd_set* w, fd_set* e, struct timeval* tv), (nfds, r, w, e, tv))   \
  X(int, close, (int fd), (fd))                                                                          \
  X(int, fcntl, (int fd, int cmd, void* arg), (fd, cmd, arg))                                            \
  X(int, ioctl, (int fd, unsigned long req, void* arg), (fd, req, arg))                                  \
  X(int, setsockopt, (int fd, int level, int name, const void* val, socklen_t len),                      \
    (fd, level, name, val, len))                                                                         \
  X(int, getsockopt, (int fd, int level, int name, void* val, socklen_t* len), (fd, level, name, val, len)) \
  X(int, open, (const char* path, int flags, mode_t mode), (path, flags, mode))                          \
  X(int, openat, (int dir, const char* path, int flags, mode_t mode), (dir, path, flags, mode))          \
  X(int, eventfd, (unsigned count, int flags), (count, flags))                                           \
  X(int, timerfd_create, (int clock, int flags), (clock, flags))                                         \
  X(int, epoll_create1, (int flags), (flags))                                                            \
  X(int, memfd_create, (const char* name, unsigned flags), (name, flags))                                \
  X(int, inotify_init1, (int flags), (flags))                                                            \
  X(int, fclose, (FILE * f), (f))                                                                        \
  X(int, pclose, (FILE * f), (f))                                                                        \
  X(FILE*, freopen, (const char* path, const char* mode, FILE* f), (path, mode, f))                      \
  X(int, closedir, (DIR * d), (d))                                                                       \
  X(int, creat, (const char* path, mode_t mode), (path, mode))                                           \
  X(int, epoll_create, (int size), (size))                                                               \
  X(int, inotify_init, (void), ())                                                                       \
  X(int, signalfd, (int fd, const sigset_t* mask, int flags), (fd, mask, flags))                          \
  X(int, __open_2, (const char* path, int flags), (path, flags))                                         \
  X(int, __openat_2, (int dir, const char* path, int flags), (dir, path, flags))                         \
  X(int, dup, (int fd), (fd))                                                                            \
  X(int, dup2, (int fd, int fd2), (fd, fd2))                                                             \
  X(int, dup3, (int fd, int fd2, int flags), (fd, fd2, flags))                                           \
  X(unsigned, sleep, (unsigned s), (s))                                                                  \
  X(int, usleep, (useconds_t us), (us))                                                                  \
  X(int, nanosleep, (const struct timespec* req, struct timespec* rem), (req, rem))                      \
  X(int, sigaction, (int sig, const struct sigaction* act, struct sigaction* old), (sig, act, old))     \
  X(void, siglongjmp, (sigjmp_buf env, int val), (env, val))                                             \
  X(void, longjmp, (jmp_buf env, int val), (env, val))                                                   \
  X(void, _longjmp, (jmp_buf env, int val), (env, val))                                                  \
  X(void, __longjmp_chk, (jmp_buf env, int val), (env, val))                                             \
  X(int, getaddrinfo, (const char* node, const char* service, const struct addrinfo* hints,              \
                       struct addrinfo** res),                                                           \
    (node, service, hints, res))                                                                         \
  X(int, getnameinfo, (const struct sockaddr* sa, socklen_t salen, char* host, socklen_t hostlen,        \
                       char* serv, socklen_t servlen, int flags),                                        \
    (sa, salen, host, hostlen, serv, servlen, flags))                                                    \
  X(struct hostent*, gethostbyname, (const char* name), (name))                                          \
  X(int, gethostbyname_r, (const char* name, struct hostent* ret, char* buf, size_t buflen,              \
                           struct hostent** result, int* h_errnop),                                      \
    (name, ret, buf, buflen, result, h_errnop))
