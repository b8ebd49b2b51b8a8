/* blocking_lib: a plain C library that knows nothing of fibers. It makes ordinary blocking
 * libc calls (blocking sockets, sleep/usleep/nanosleep, poll, select) the way a legacy client
 * library does, and reports through a callback when it enters and leaves its blocking section,
 * so a test can count how many callers are inside at once.
 *
 * Built as C (tests/hooks/clib/blocking_lib.c), into a shared library, without any libfiber
 * header: whatever parks a fiber here is the hook library, interposed on these libc calls.
 *
 * Every function returns >= 0 on success, -1 with errno set on failure. */
#ifndef FIBER_TESTS_HOOKS_BLOCKING_LIB_H
#define FIBER_TESTS_HOOKS_BLOCKING_LIB_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* inside = 1 when entering the blocking section, 0 when leaving it. */
typedef void (*blib_note_fn)(void* ctx, int inside);
/* Nonzero once the caller may leave (for the sleep loops). */
typedef int (*blib_released_fn)(void* ctx);

struct blib_observer {
  blib_note_fn note;         /* may be NULL */
  blib_released_fn released; /* may be NULL: released at once */
  void* ctx;
};

enum blib_sleep_kind { BLIB_SLEEP = 0, BLIB_USLEEP = 1, BLIB_NANOSLEEP = 2 };

/* Sleeps in a loop - sleep(step/1000000 s, at least 1), usleep(step) or nanosleep(step us) -
 * until obs->released() says so. Returns the number of sleeps made. */
long blib_sleep_until_released(const struct blib_observer* obs, enum blib_sleep_kind kind, unsigned step_us);

/* One usleep(us) inside the blocking section. */
int blib_usleep_once(const struct blib_observer* obs, unsigned us);

/* poll(fd, POLLIN, infinite), then read(2) one byte into *out. Returns 1. */
int blib_poll_then_read(const struct blib_observer* obs, int fd, char* out);

/* select(fd readable, no timeout). Returns select's count (1). Leaves the data unread. */
int blib_select_readable(const struct blib_observer* obs, int fd);

/* Reads exactly n bytes with blocking read(2) calls. Returns n, or fewer at end of file. */
ssize_t blib_read_exact(const struct blib_observer* obs, int fd, void* buf, size_t n);

/* A request/response round trip as a blocking client does it: socket, connect to
 * 127.0.0.1:port, write the request, read until `reply_len` bytes came back, close. The blocking
 * section spans connect .. last read. Returns the reply length. */
ssize_t blib_roundtrip(const struct blib_observer* obs, unsigned short port, const char* request, char* reply,
                       size_t reply_len);

/* The address of read(2) as this library binds it (the hook's, or libc's). */
void* blib_read_function(void);

#ifdef __cplusplus
}
#endif

#endif
