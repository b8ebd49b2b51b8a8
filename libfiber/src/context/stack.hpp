// Fiber stacks: mmap'd, lazily committed, recycled.
//
// Three kinds, chosen per allocation:
//   Guarded   - a guard page below it. Where the kernel has guard markers (MADV_GUARD_INSTALL,
//               Linux 6.13, through process_madvise on ourselves: probed), every stack of a page
//               or more: carved from large shared mappings, the guard pages of a new mapping's
//               stacks installed by one process_madvise call, no mapping per stack. (The budget
//               of the path below counts these too, should the kernel refuse markers later.)
//               Elsewhere (or with FIBER_GUARDED_STACKS set), its own mapping with a PROT_NONE
//               guard page (two kernel mappings, an mmap and an mprotect), used while the
//               mapping budget allows (StackAllocator::guarded_limit()).
//   Unguarded - carved from large shared mappings, no guard page: the fallback once that budget
//               is spent, so a million fibers fit under vm.max_map_count = 65530.
//   Compact   - below a page, packed back to back in shared mappings, never guarded: the
//               documented option for fibers known to need little stack.
// Every stack has a zero red zone at its lowest addresses, checked at each switch away from it;
// for unguarded and compact stacks that check is the only overflow detection.
//
// Stacks are recycled through a per-processor StackCache (owner-only, no locking) in front of
// the process-wide StackAllocator (mutex), which an empty cache draws from in batches. No
// system call runs under that mutex but the mmap and madvise of an unguarded chunk
// (microseconds). Memory is committed lazily: a stack that only ever used its top page costs
// one page of RSS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace fiber::detail {

enum class StackKind : uint8_t { None, Guarded, Unguarded, Compact };

// The lowest bytes of every stack are a red zone that must stay zero (never-touched memory reads
// as zero without being committed, so checking it costs no RSS). A write there means the fiber
// overflowed its stack; the check runs at every switch away from a fiber (see check_stack).
inline constexpr std::size_t kRedZone = 256;
inline constexpr std::size_t kMinStackSize = 2048;
inline constexpr std::size_t kDefaultStackSize = 64 * 1024;
inline constexpr std::size_t kMaxStackSize = std::size_t{1} << 30;
static_assert(kMaxStackSize <= UINT32_MAX, "Stack::size is 32 bits");

// 16 bytes: it sits in the fiber control block, whose size bounds how many fibers fit in a
// page of control blocks (see block_class_for in sched/runtime.cpp).
struct Stack {
  char* lo = nullptr;  // lowest usable address; the canary lives here
  uint32_t size = 0;   // usable bytes, lo + size is the initial stack pointer
  StackKind kind = StackKind::None;

  Stack() = default;
  Stack(char* lo_, std::size_t size_, StackKind kind_) noexcept
      : lo(lo_), size(static_cast<uint32_t>(size_)), kind(kind_) {}

  char* top() const noexcept { return lo + size; }
  std::size_t usable() const noexcept { return size - kRedZone; }
  explicit operator bool() const noexcept { return lo != nullptr; }
  // The word at the top of the red zone is the first an overflow writes.
  bool redzone_intact() const noexcept {
    return *reinterpret_cast<const uint64_t*>(lo + kRedZone - sizeof(uint64_t)) == 0;
  }
};

// Rounds a requested size to the size class actually allocated; throws fiber::UsageError for a
// size below kMinStackSize or above kMaxStackSize.
std::size_t stack_size_class(std::size_t requested);

struct StackStats {
  std::size_t guarded_live = 0;    // guarded stacks handed out and not yet returned
  std::size_t guarded_limit = 0;   // budget for guarded stacks
  std::size_t unguarded_live = 0;  // unguarded + compact stacks handed out
  std::size_t mappings = 0;        // kernel mappings this allocator holds (approximate)
  std::size_t pooled = 0;          // stacks idle in the global pool
  bool guard_markers = false;      // guard pages are markers: every stack of a page or more is guarded
};

// $FIBER_GUARDED_STACKS = `value`: how many stacks may have a guard page of their own; nullopt
// for nullptr or "" (the default budget applies). Anything but a decimal integer of digits alone
// throws UsageError naming the variable. The Scheduler's constructor checks it too, so a bad value
// is reported there rather than wherever the allocator is first used.
std::optional<std::size_t> parse_guarded_stacks(const char* value);

// Process-wide. Thread-safe.
class StackAllocator {
 public:
  static StackAllocator& instance();

  // Throws fiber::ResourceError when no memory or mapping can be had.
  Stack allocate(std::size_t size_class);
  // Up to `n` stacks into `out`, taking the lock once (a cache refilling): how many, at least one.
  // Fewer when the next would need a system call outside the lock. Throws as allocate() does.
  std::size_t allocate_batch(std::size_t size_class, Stack* out, std::size_t n);
  void release(Stack s) noexcept;
  // Returns many stacks at once (a cache overflowing), taking the lock once.
  void release_batch(Stack* stacks, std::size_t n) noexcept;

  // The most guarded stacks in use at once: unlimited (SIZE_MAX) with guard markers.
  std::size_t guarded_limit() noexcept;
  StackStats stats();

 private:
  struct Chunk {
    char* next = nullptr;  // next free byte in the current chunk
    char* end = nullptr;
  };
  // What take_locked found: a stack, or the step to take outside the lock before one can be had.
  // reserve_evicting: reserve, and unmap the pooled guarded stack (of another size) handed back.
  enum class Take : uint8_t { stack, map_marked, reserve, reserve_evicting, none };

  StackAllocator();
  Take take_locked(std::size_t size, bool may_reserve, bool markers, Stack& out);  // REQUIRES(mu_)
  Stack allocate_guarded(std::size_t size);
  void unmap_guarded(Stack s) const noexcept;  // one that allocate_guarded mapped
  Chunk map_marked_chunk(std::size_t size, int& err) const;
  void adopt_marked_locked(std::size_t size, Chunk fresh);  // REQUIRES(mu_)
  Stack carve_locked(std::size_t size);  // REQUIRES(mu_)
  Stack carve_marked_locked(std::size_t size);  // REQUIRES(mu_)
  void release_locked(Stack s) noexcept; // REQUIRES(mu_)

  std::size_t page_ = 4096;
  std::size_t guarded_limit_ = 0;  // immutable after construction
  bool guard_markers_ = false;     // GUARDED_BY(mu_) after construction: cleared if the kernel refuses
  // No guard markers at construction: every pooled guarded stack is a mapping of its own
  // (allocate_guarded), which may be unmapped to make room in the budget. Immutable.
  bool guarded_alone_ = false;

  std::mutex mu_;
  // Everything below is GUARDED_BY(mu_).
  std::size_t guarded_live_ = 0;
  std::size_t unguarded_live_ = 0;
  std::size_t mappings_ = 0;
  std::unordered_map<std::size_t, Chunk> chunks_;                 // per size class
  std::unordered_map<std::size_t, Chunk> marked_chunks_;          // per size class, guard markers
  std::unordered_map<std::size_t, std::vector<Chunk>> spare_marked_;  // mapped while one was in use
  static constexpr std::size_t kMaxMarkedPerChunk = 1024;        // one process_madvise (UIO_MAXIOV)
  // Pools of returned stacks. Deques, not vectors: when a million fibers end, a vector's growth
  // copied megabytes into fresh memory under mu_ (a 4 MiB copy and 2048 page faults at 262144
  // stacks), long enough to stall the other processors returning theirs.
  std::unordered_map<std::size_t, std::deque<Stack>> free_;      // unguarded/compact, per class
  std::unordered_map<std::size_t, std::deque<Stack>> free_guarded_;  // per class
  std::size_t pooled_guarded() const noexcept {  // REQUIRES(mu_)
    std::size_t n = 0;
    for (const auto& [size, v] : free_guarded_) n += v.size();
    return n;
  }
  std::size_t pooled_ = 0;
};

// A processor's private cache of stacks. Executed only by the owner processor.
class StackCache {
 public:
  static constexpr std::size_t kMaxCached = 128;  // per size class
  // An empty bin takes up to this many bytes of stacks (at least one, at most kRefillMax) from
  // the allocator at once: one lock for a batch while fibers start faster than they end.
  static constexpr std::size_t kRefillBytes = std::size_t{1} << 20;
  static constexpr std::size_t kRefillMax = 16;

  StackCache() = default;
  StackCache(const StackCache&) = delete;
  StackCache& operator=(const StackCache&) = delete;
  ~StackCache();

  Stack get(std::size_t size_class);
  void put(Stack s) noexcept;

 private:
  struct Bin {
    std::size_t size_class = 0;
    std::vector<Stack> stacks;
  };
  Bin& bin(std::size_t size_class);
  std::vector<Bin> bins_;  // few size classes in practice; linear search
  std::size_t last_ = 0;   // index of the bin used last (nearly always the default size)
};

}  // namespace fiber::detail
