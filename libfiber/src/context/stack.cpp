#include "context/stack.hpp"

#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fiber/error.hpp"
#include "io/raw.hpp"
#include "sched/env.hpp"

namespace fiber::detail {
namespace {

std::size_t read_max_map_count() {
  std::size_t v = 65530;
  if (FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
    unsigned long long x = 0;
    if (std::fscanf(f, "%llu", &x) == 1 && x > 0) v = x;
    std::fclose(f);
  }
  return v;
}

constexpr std::size_t kChunkBytes = std::size_t{64} << 20;  // shared mappings for unguarded stacks

// Older headers lack these (x86-64 numbers; the probe below finds out whether they work).
#ifndef MADV_GUARD_INSTALL
#define MADV_GUARD_INSTALL 102  // Linux 6.13
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_process_madvise
#define SYS_process_madvise 440
#endif

// Installs guard markers on `n` ranges of this process: one process_madvise call, through a
// pidfd opened for it (not kept: a descriptor the program never opened would outlive it).
// 0, or the errno of the failure (EIO: only part of the ranges were done).
int install_guards(const iovec* ranges, std::size_t n, std::size_t bytes) noexcept {
  const long pidfd = ::syscall(SYS_pidfd_open, ::getpid(), 0);
  if (pidfd < 0) return raw::last_errno();
  const long r = ::syscall(SYS_process_madvise, pidfd, ranges, n, MADV_GUARD_INSTALL, 0);
  const int err = r < 0 ? raw::last_errno() : (r == static_cast<long>(bytes) ? 0 : EIO);
  raw::close(static_cast<int>(pidfd));
  return err;
}

// Whether this kernel installs guard markers through process_madvise on the calling process.
bool guard_markers_work(std::size_t page) noexcept {
  void* p = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  const iovec guard{p, page};
  const bool ok = install_guards(&guard, 1, page) == 0;
  munmap(p, 2 * page);
  return ok;
}

// Whether the object's PLT is bound at load time (DF_BIND_NOW / DF_1_NOW), or has no PLT.
bool bound_now(const dl_phdr_info* info) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
    const auto* d = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    bool has_plt = false;
    for (; d->d_tag != DT_NULL; ++d) {
      if (d->d_tag == DT_FLAGS && (d->d_un.d_val & DF_BIND_NOW) != 0) return true;
      if (d->d_tag == DT_FLAGS_1 && (d->d_un.d_val & DF_1_NOW) != 0) return true;
      if (d->d_tag == DT_JMPREL) has_plt = true;
    }
    return !has_plt;
  }
  return true;  // no dynamic section: nothing to bind
}

// Compact stacks hold nothing but the fiber's own frames, and the dynamic linker's lazy binding
// saves the whole extended register state on the stack of the first caller of a function
// (1-3 KiB with AVX-512). libfiber and the programs linking it are bound immediately (-z now),
// but shared libraries such as libstdc++ and libc are not unless LD_BIND_NOW is set. Says so
// once, naming the first such library, when the first compact stack is handed out.
void warn_if_lazily_bound() {
  const char* env = std::getenv("LD_BIND_NOW");
  if (env != nullptr && *env != '\0') return;
  const char* lazy = nullptr;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (bound_now(info)) return 0;
        *static_cast<const char**>(out) = info->dlpi_name[0] != '\0' ? info->dlpi_name : "the program";
        return 1;
      },
      &lazy);
  if (lazy != nullptr) {
    std::fprintf(stderr,
                 "libfiber: compact stacks in use, but %s is bound lazily: a fiber that is the first to call one "
                 "of its functions can overflow a compact stack. Run with LD_BIND_NOW=1 (see \"Stacks\" in "
                 "libfiber/README.md).\n",
                 lazy);
  }
}


}  // namespace

std::size_t stack_size_class(std::size_t requested) {
  if (requested < kMinStackSize) {
    throw UsageError("fiber: stack size " + std::to_string(requested) + " is below the minimum of " +
                     std::to_string(kMinStackSize) + " bytes");
  }
  if (requested > kMaxStackSize) {
    throw UsageError("fiber: stack size " + std::to_string(requested) + " is above the maximum of " +
                     std::to_string(kMaxStackSize) + " bytes");
  }
  const std::size_t page = 4096;
  if (requested < page) return (requested + 255) & ~std::size_t{255};  // compact: 256-byte steps
  return (requested + page - 1) & ~(page - 1);
}

std::optional<std::size_t> parse_guarded_stacks(const char* value) {
  const auto v = parse_env_in_range("FIBER_GUARDED_STACKS", value, 0, LONG_MAX,
                                    "a number of stacks: a non-negative integer");
  if (!v) return std::nullopt;
  return static_cast<std::size_t>(*v);
}

StackAllocator& StackAllocator::instance() {
  // Never destroyed: stacks may be returned by threads still running during static destruction.
  static StackAllocator* a = new StackAllocator();
  return *a;
}

StackAllocator::StackAllocator() {
  page_ = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  // Guarded stacks cost two mappings each. Spend at most a quarter of vm.max_map_count on them,
  // leaving the rest to the program (its heap, libraries, files). FIBER_GUARDED_STACKS overrides.
  guarded_limit_ = read_max_map_count() / 8;
  if (const auto v = parse_guarded_stacks(std::getenv("FIBER_GUARDED_STACKS"))) {
    guarded_limit_ = *v;
  } else {
    // Guard markers cost no mapping: no budget, every stack of a page or more is guarded.
    guard_markers_ = guard_markers_work(page_);
  }
  guarded_alone_ = !guard_markers_;
}

// Guard-marker stacks: slots of a guard page and the stack, carved from a shared mapping whose
// guard pages are installed all at once. mmap plus mprotect per stack, under the mmap lock that
// every page fault of the other processors takes too, was a third of skynet's time on two
// processors (FIBER_GUARDED_STACKS=0: 272 -> 174 ms).
//
// Mapped outside the allocator's lock: installing a chunk's thousand guard pages takes a few
// milliseconds, and while a million fibers start (idle_1m) every processor needs fresh stacks,
// so under the lock the others waited on it, long enough for the watchdog to report them.
// Returns an empty chunk, and sets `err`, when the kernel refuses.
StackAllocator::Chunk StackAllocator::map_marked_chunk(std::size_t size, int& err) const {
  const std::size_t slot = size + page_;
  const std::size_t n = std::clamp<std::size_t>(kChunkBytes / slot, 16, kMaxMarkedPerChunk);
  const std::size_t bytes = n * slot;
  std::vector<iovec> guards(n);  // before the mapping, which a throw here would leak
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    err = raw::last_errno();
    return {};
  }
  madvise(p, bytes, MADV_NOHUGEPAGE);  // stacks touch one page each
  for (std::size_t i = 0; i < n; ++i) guards[i] = iovec{static_cast<char*>(p) + i * slot, page_};
  err = install_guards(guards.data(), n, n * page_);
  if (err != 0) {
    munmap(p, bytes);
    return {};
  }
  return Chunk{static_cast<char*>(p), static_cast<char*>(p) + bytes};
}

void StackAllocator::adopt_marked_locked(std::size_t size, Chunk fresh) {
  ++mappings_;
  Chunk& c = marked_chunks_[size];
  if (static_cast<std::size_t>(c.end - c.next) < size + page_) {
    c = fresh;  // what was left of the old one cannot hold a stack
  } else {
    spare_marked_[size].push_back(fresh);  // another thread mapped one meanwhile: use it next
  }
}

Stack StackAllocator::carve_marked_locked(std::size_t size) {
  const std::size_t slot = size + page_;
  Chunk& c = marked_chunks_[size];
  if (static_cast<std::size_t>(c.end - c.next) < slot) {
    auto spare = spare_marked_.find(size);
    if (spare == spare_marked_.end() || spare->second.empty()) return {};
    c = spare->second.back();
    spare->second.pop_back();
  }
  Stack s{c.next + page_, size, StackKind::Guarded};
  c.next += slot;
  return s;
}

Stack StackAllocator::allocate_guarded(std::size_t size) {
  const std::size_t total = size + page_;
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK,
                 -1, 0);
  if (p == MAP_FAILED) return {};
  if (mprotect(p, page_, PROT_NONE) != 0) {
    munmap(p, total);
    return {};
  }
  return Stack{static_cast<char*>(p) + page_, size, StackKind::Guarded};
}

void StackAllocator::unmap_guarded(Stack s) const noexcept {
  munmap(s.lo - page_, s.size + page_);  // the guard page and the stack: allocate_guarded's mapping
}

Stack StackAllocator::carve_locked(std::size_t size) {
  Chunk& c = chunks_[size];
  if (c.next == nullptr || static_cast<std::size_t>(c.end - c.next) < size) {
    const std::size_t bytes = size >= kChunkBytes / 16 ? size * 16 : kChunkBytes;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return {};
    // Stacks touch one page each; huge pages would commit megabytes per fiber.
    madvise(p, bytes, MADV_NOHUGEPAGE);
    ++mappings_;
    c.next = static_cast<char*>(p);
    c.end = c.next + bytes;
  }
  Stack s{c.next, size, size < page_ ? StackKind::Compact : StackKind::Unguarded};
  c.next += size;
  return s;
}

// One stack, with the lock held: Take::stack (in `out`), or what the caller has to do outside the
// lock first. Pooled guarded stacks first, then guard-marker chunks (unless `markers` is false:
// mapping one just failed), then a guarded stack of its own while the budget lasts (reserved
// here only if `may_reserve`: a batch ends where one would be) or while idle guarded stacks of
// other sizes can be unmapped to make room, then pooled or carved unguarded.
StackAllocator::Take StackAllocator::take_locked(std::size_t size, bool may_reserve, bool markers, Stack& out) {
  const bool compact = size < page_;
  auto g = free_guarded_.find(size);
  if (g != free_guarded_.end() && !g->second.empty()) {
    out = g->second.back();  // a pooled guarded stack: no syscall at all
    g->second.pop_back();
    --pooled_;
    ++guarded_live_;
    return Take::stack;
  }
  if (!compact && markers && guard_markers_) {
    if (!(out = carve_marked_locked(size))) return Take::map_marked;
    ++guarded_live_;
    return Take::stack;
  }
  if (!compact && guarded_live_ + pooled_guarded() < guarded_limit_) {
    if (may_reserve) ++guarded_live_;  // mapped outside the lock
    return Take::reserve;
  }
  // The budget is spent, but partly on idle guarded stacks of other sizes, which only their own
  // size could reuse: unmap one (outside the lock) to make room. Otherwise a past burst of one
  // size would leave every later stack of the others unguarded for the life of the process.
  // Only stacks returned to this pool are reached: those still in a processor's StackCache (at
  // most kMaxCached per size per processor) keep their share of the budget.
  if (!compact && may_reserve && guarded_alone_ && guarded_live_ < guarded_limit_) {
    for (auto& [other, pool] : free_guarded_) {
      if (pool.empty()) continue;  // (the pool of `size` itself is empty: checked first)
      out = pool.back();
      pool.pop_back();
      --pooled_;
      ++guarded_live_;  // the new stack's
      return Take::reserve_evicting;
    }
  }
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    out = it->second.back();
    it->second.pop_back();
    --pooled_;
  } else if (!(out = carve_locked(size))) {
    return Take::none;
  }
  ++unguarded_live_;
  return Take::stack;
}

Stack StackAllocator::allocate(std::size_t size) {
  Stack s;
  allocate_batch(size, &s, 1);
  return s;
}

std::size_t StackAllocator::allocate_batch(std::size_t size, Stack* out, std::size_t n) {
  if (size < page_) {
    static std::once_flag warned;
    std::call_once(warned, warn_if_lazily_bound);
  }
  std::size_t got = 0;
  bool markers = true;  // false once mapping a marked chunk failed: the next kind for this call
  Chunk fresh;          // a marked chunk mapped outside the lock, to adopt under it
  int map_err = 0;
  for (;;) {
    Take t = Take::none;
    {
      std::lock_guard lock(mu_);
      if (fresh.next) adopt_marked_locked(size, std::exchange(fresh, Chunk{}));
      // Refused for good (seccomp, a changed policy): mmap + mprotect from now on. Anything else
      // (no descriptor or memory to spare): the other kinds, for this call only.
      if (map_err == EINVAL || map_err == ENOSYS || map_err == EPERM) guard_markers_ = false;
      while (got < n && (t = take_locked(size, got == 0, markers, out[got])) == Take::stack) ++got;
    }
    if (t == Take::map_marked && got == 0) {
      fresh = map_marked_chunk(size, map_err);
      if (!fresh.next) markers = false;
      continue;
    }
    // Only a reserved stack is mapped on its own. One sent to the chunks (the guarded budget
    // spent, or a compact one) whose chunk cannot be mapped is refused: mapped alone it would
    // overrun the budget, uncounted.
    if ((t == Take::reserve || t == Take::reserve_evicting) && got == 0) {
      if (t == Take::reserve_evicting) unmap_guarded(out[got]);
      Stack s = allocate_guarded(size);
      std::lock_guard lock(mu_);
      if (t == Take::reserve_evicting) mappings_ -= 2;
      if (s) {
        mappings_ += 2;
      } else {
        // Out of mappings or memory for a guarded stack: fall back to the unguarded pool.
        --guarded_live_;
        s = carve_locked(size);
        if (s) ++unguarded_live_;
      }
      if (s) out[got++] = s;
    }
    break;
  }
  if (got == 0) {
    throw ResourceError("fiber: cannot allocate a " + std::to_string(size) + "-byte stack: " +
                        std::strerror(raw::last_errno()));
  }
  return got;
}

void StackAllocator::release_locked(Stack s) noexcept {
  // Stacks are not unmapped when returned: munmap (and mprotect) shoot down TLB entries on every
  // CPU, which under load costs far more than the address space kept. (The one exception is a
  // guarded stack taken back for the budget, in take_locked.) Pages a fiber touched stay
  // committed for the next fiber of that size class.
  if (s.kind == StackKind::Guarded) {
    --guarded_live_;
    free_guarded_[s.size].push_back(s);
    ++pooled_;
    return;
  }
  --unguarded_live_;
  free_[s.size].push_back(s);
  ++pooled_;
}

void StackAllocator::release(Stack s) noexcept {
  std::lock_guard lock(mu_);
  release_locked(s);
}

void StackAllocator::release_batch(Stack* stacks, std::size_t n) noexcept {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < n; ++i) release_locked(stacks[i]);
}

std::size_t StackAllocator::guarded_limit() noexcept { return stats().guarded_limit; }

StackStats StackAllocator::stats() {
  std::lock_guard lock(mu_);
  return StackStats{guarded_live_, guard_markers_ ? SIZE_MAX : guarded_limit_, unguarded_live_, mappings_, pooled_,
                    guard_markers_};
}

// ------------------------------------------------------------------------------------ cache

StackCache::~StackCache() {
  for (Bin& b : bins_) StackAllocator::instance().release_batch(b.stacks.data(), b.stacks.size());
}

StackCache::Bin& StackCache::bin(std::size_t size_class) {
  if (last_ < bins_.size() && bins_[last_].size_class == size_class) return bins_[last_];
  for (std::size_t i = 0; i < bins_.size(); ++i) {
    if (bins_[i].size_class == size_class) {
      last_ = i;
      return bins_[i];
    }
  }
  last_ = bins_.size();
  bins_.push_back(Bin{size_class, {}});
  bins_.back().stacks.reserve(kMaxCached);
  return bins_.back();
}

Stack StackCache::get(std::size_t size_class) {
  Bin& b = bin(size_class);
  if (!b.stacks.empty()) {
    Stack s = b.stacks.back();
    b.stacks.pop_back();
    return s;
  }
  Stack batch[kRefillMax];
  const std::size_t want = std::clamp<std::size_t>(kRefillBytes / size_class, 1, kRefillMax);
  const std::size_t got = StackAllocator::instance().allocate_batch(size_class, batch, want);
  b.stacks.insert(b.stacks.end(), batch + 1, batch + got);
  return batch[0];
}

void StackCache::put(Stack s) noexcept {
  Bin& b = bin(s.size);
  if (b.stacks.size() >= kMaxCached) {
    // Give half back in one batch so a producer/consumer imbalance between processors does not
    // pin memory in one cache.
    const std::size_t half = kMaxCached / 2;
    StackAllocator::instance().release_batch(b.stacks.data() + half, b.stacks.size() - half);
    b.stacks.resize(half);
  }
  b.stacks.push_back(s);
}

}  // namespace fiber::detail
