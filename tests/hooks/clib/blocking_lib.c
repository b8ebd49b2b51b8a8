/* blocking_lib: see blocking_lib.h. Plain C, no libfiber header; blocking calls only. */
#define _GNU_SOURCE
#include "blocking_lib.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void note(const struct blib_observer* obs, int inside) {
  if (obs != NULL && obs->note != NULL) obs->note(obs->ctx, inside);
}

static int released(const struct blib_observer* obs) {
  return obs == NULL || obs->released == NULL || obs->released(obs->ctx);
}

/* Leaves the blocking section keeping the errno of the call that failed. */
static int fail(const struct blib_observer* obs) {
  const int e = errno;
  note(obs, 0);
  errno = e;
  return -1;
}

long blib_sleep_until_released(const struct blib_observer* obs, enum blib_sleep_kind kind, unsigned step_us) {
  long sleeps = 0;
  note(obs, 1);
  do {
    switch (kind) {
      case BLIB_SLEEP: {
        const unsigned s = step_us / 1000000u;
        if (sleep(s == 0 ? 1 : s) != 0) return fail(obs);
        break;
      }
      case BLIB_USLEEP:
        if (usleep(step_us) != 0) return fail(obs);
        break;
      case BLIB_NANOSLEEP: {
        struct timespec ts;
        ts.tv_sec = step_us / 1000000u;
        ts.tv_nsec = (long)(step_us % 1000000u) * 1000L;
        if (nanosleep(&ts, NULL) != 0) return fail(obs);
        break;
      }
      default:
        errno = EINVAL;
        return fail(obs);
    }
    ++sleeps;
  } while (!released(obs));
  note(obs, 0);
  return sleeps;
}

int blib_usleep_once(const struct blib_observer* obs, unsigned us) {
  note(obs, 1);
  if (usleep(us) != 0) return fail(obs);
  note(obs, 0);
  return 0;
}

int blib_poll_then_read(const struct blib_observer* obs, int fd, char* out) {
  struct pollfd p;
  int r;
  p.fd = fd;
  p.events = POLLIN;
  p.revents = 0;
  note(obs, 1);
  r = poll(&p, 1, -1);
  if (r < 0) return fail(obs);
  if (r != 1 || !(p.revents & POLLIN)) {
    note(obs, 0);
    errno = EPROTO;
    return -1;
  }
  if (read(fd, out, 1) != 1) return fail(obs);
  note(obs, 0);
  return 1;
}

int blib_select_readable(const struct blib_observer* obs, int fd) {
  fd_set rd;
  int r;
  if (fd < 0 || fd >= FD_SETSIZE) {
    errno = EINVAL;
    return -1;
  }
  FD_ZERO(&rd);
  FD_SET(fd, &rd);
  note(obs, 1);
  r = select(fd + 1, &rd, NULL, NULL, NULL);
  if (r < 0) return fail(obs);
  note(obs, 0);
  if (r != 1 || !FD_ISSET(fd, &rd)) {
    errno = EPROTO;
    return -1;
  }
  return r;
}

static ssize_t read_exact(int fd, char* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd, p + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  return (ssize_t)got;
}

ssize_t blib_read_exact(const struct blib_observer* obs, int fd, void* buf, size_t n) {
  ssize_t r;
  note(obs, 1);
  r = read_exact(fd, (char*)buf, n);
  if (r < 0) return fail(obs);
  note(obs, 0);
  return r;
}

ssize_t blib_roundtrip(const struct blib_observer* obs, unsigned short port, const char* request, char* reply,
                       size_t reply_len) {
  struct sockaddr_in addr;
  const size_t len = strlen(request);
  ssize_t r;
  int e;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  memset(&addr, 0, sizeof addr);
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  note(obs, 1);
  if (connect(fd, (const struct sockaddr*)&addr, sizeof addr) != 0) goto failed;
  if (write(fd, request, len) != (ssize_t)len) goto failed;
  r = read_exact(fd, reply, reply_len);
  if (r < 0) goto failed;
  note(obs, 0);
  close(fd);
  return r;
failed:
  e = errno;
  note(obs, 0);
  close(fd);
  errno = e;
  return -1;
}

void* blib_read_function(void) {
  ssize_t (*fn)(int, void*, size_t) = read;
  void* p;
  memcpy(&p, &fn, sizeof p);
  return p;
}
