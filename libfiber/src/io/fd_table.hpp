// FdTable: per-descriptor bookkeeping shared by every processor: which fiber operations are in
// progress on a descriptor, so io::close() can end them before it closes it.
//
// close(2) alone does not end an io_uring operation in flight (the ring holds its own reference
// to the file) nor an epoll wait (the registration just vanishes), so a fiber waiting on a
// descriptor another fiber closes would wait forever. Every fiber operation therefore lists
// itself in its descriptor's slot while it runs; io::close() marks the slot closing (new
// operations fail with -EBADF), claims the wait of each listed op (which then withdraws its
// operation on its home processor, see io.cpp) and waits until the list is empty before the
// real close.
//
// Slots are allocated in chunks on first use and never freed; descriptors beyond kMaxFds are
// not tracked (their operations work, but close() does not wake their waiters).
#pragma once

#include <atomic>
#include <cstdint>

#include "fiber/detail/wait.hpp"
#include "io/poller.hpp"

namespace fiber::detail {

struct FdSlot {
  SpinLock lock;
  bool closing = false;     // GUARDED_BY(lock): io::close() is draining this descriptor
  IoOp* ops = nullptr;      // GUARDED_BY(lock): fiber operations in progress (slot_next links)
  WaitQueue closers;        // GUARDED_BY(lock): io::close() calls waiting for `ops` to drain
  // The last ring receive on this descriptor left data in the socket (IORING_CQE_F_SOCK_NONEMPTY),
  // so the next one tries at once instead of waiting for readiness first (see io.cpp, ring_op).
  // A hint, not guarded: fibers receiving on one socket at once may leave it stale, and so may a
  // descriptor closed without io::close (which clears it), which costs one wasted attempt or one
  // poll round, never data. Relaxed.
  std::atomic<bool> recv_backlog{false};
  // Callers between the readiness check and the call of a call that would block its thread
  // if the descriptor were not ready (a blocking listener's accept, a tty's read: io.cpp,
  // call_when_ready), one bit per direction. Held for those two system calls, never across a
  // park.
  static constexpr uint8_t kReadyCallIn = 1, kReadyCallOut = 2;
  std::atomic<uint8_t> ready_call{0};
};

class FdTable {
 public:
  static constexpr int kChunkBits = 12;
  static constexpr int kChunks = 256;
  static constexpr int kMaxFds = kChunks << kChunkBits;  // 1,048,576

  // The slot of `fd` if its chunk exists (no allocation); nullptr otherwise.
  FdSlot* find(int fd) noexcept {
    if (fd < 0 || fd >= kMaxFds) return nullptr;
    FdSlot* chunk = chunks_[fd >> kChunkBits].load(std::memory_order_acquire);
    return chunk == nullptr ? nullptr : &chunk[fd & ((1 << kChunkBits) - 1)];
  }
  // The slot of `fd`, or nullptr if fd is negative or beyond kMaxFds.
  FdSlot* slot(int fd) noexcept {
    if (fd < 0 || fd >= kMaxFds) return nullptr;
    std::atomic<FdSlot*>& c = chunks_[fd >> kChunkBits];
    FdSlot* chunk = c.load(std::memory_order_acquire);
    if (chunk == nullptr) [[unlikely]] chunk = allocate(c);
    return chunk == nullptr ? nullptr : &chunk[fd & ((1 << kChunkBits) - 1)];
  }

 private:
  static FdSlot* allocate(std::atomic<FdSlot*>& c) noexcept;
  // Each chunk is published once with a release CAS and never changes or goes away.
  std::atomic<FdSlot*> chunks_[kChunks] = {};
};

FdTable& fd_table() noexcept;

// Lists `op` as in progress on the slot's descriptor; false if the descriptor is being closed.
bool fd_begin(FdSlot* slot, IoOp* op) noexcept;
// Unlists it, waking a close() waiting for the last one.
void fd_end(FdSlot* slot, IoOp* op) noexcept;

}  // namespace fiber::detail
