// What net::Stream uses of io.cpp beyond the public fiber::io calls.
#pragma once

#include <sys/types.h>

#include "fiber/io.hpp"

namespace fiber::detail {

// io::recv(fd, buf, n, 0, dl) for a descriptor known to be a socket: on the io_uring path it may
// ask the kernel to wait for data before its first attempt (see io.cpp, ring_op). On anything
// but a socket that would wait for readability and only then fail with ENOTSOCK, so callers
// must know: net::Stream does for the sockets it made.
ssize_t recv_socket(int fd, void* buf, size_t n, io::Deadline dl) noexcept;

// io::close(fd), calling `before_close(ctx, drained)` once every fiber waiting on `fd` has been
// woken and has left, and before the number is freed. Meanwhile the descriptor stays marked
// closing, so no fiber operation can start on it (they fail with -EBADF). `drained` is false
// where the descriptor has no slot in the fd table (beyond FdTable::kMaxFds, or out of memory):
// then fiber operations on it are not listed, and nothing was drained. net::Stream and
// net::Listener wait there for their own calls in progress (fiber/net.hpp, OwnedFd). With a
// `before_close`, the slot is made if missing (io::close itself allocates nothing).
int close_draining(int fd, void (*before_close)(void*, bool), void* ctx) noexcept;

}  // namespace fiber::detail
