// The public entry points behind spawn, JoinHandle, block_on and this_fiber, and the fiber
// lifecycle (create -> submit -> run -> complete -> destroy).
#include "io/raw.hpp"
#include "sched/runtime.hpp"

#include <sys/mman.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it (older kernels refuse it)
#endif
#if defined(FIBER_ASAN)
#include <sanitizer/lsan_interface.h>
#endif
#include <unistd.h>

#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>

#include "fiber/block_on.hpp"
#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
#include "fiber/spawn.hpp"
#include "fiber/this_fiber.hpp"
#include "sched/group.hpp"
#include "sched/membarrier.hpp"
#include "sched/processor.hpp"
#include "sched/scheduler_impl.hpp"

namespace fiber {
namespace detail {
namespace {

std::atomic<uint64_t> g_next_id{1};

void default_unhandled(const UnhandledException& e) {
  std::string what = "an exception not derived from std::exception";
  try {
    std::rethrow_exception(e.error);
  } catch (const std::exception& ex) {
    what = ex.what();
  } catch (...) {
  }
  std::fprintf(stderr, "libfiber: fiber #%llu%s%.*s%s terminated by an uncaught exception: %s\n", e.fiber_id,
               e.fiber_name.empty() ? "" : " '", static_cast<int>(e.fiber_name.size()), e.fiber_name.data(),
               e.fiber_name.empty() ? "" : "'", what.c_str());
  std::abort();
}

std::atomic<UnhandledExceptionHandler> g_unhandled{&default_unhandled};

bool is_cancellation(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const Cancelled&) {
    return true;
  } catch (...) {
    return false;
  }
}

// An exception nobody will observe: a detached fiber's, other than fiber::Cancelled. That one is
// how a fiber ends quietly: the cancellation stop(), JoinHandle::cancel() or a token asked for,
// one the fiber throws itself, or one passed on from a cancelled fiber it joined (tested in
// test_spawn.cpp, "reaches the unhandled-exception handler", part 4).
void report_unobserved(uint64_t id, std::string_view name, const std::exception_ptr& error) noexcept {
  try {
    g_unhandled.load(std::memory_order_acquire)(UnhandledException{id, name, error});
  } catch (const Cancelled&) {
    // stop() (or a token) cancelled a wait the handler made: it ends there, as a fiber would.
  } catch (...) {
    std::fputs("libfiber: the unhandled-exception handler threw an exception; aborting\n", stderr);
    std::abort();
  }
}

void report_if_unobserved(Fiber* f) noexcept {
  TaskBase* task = f->task();
  if (!task || !task->error || is_cancellation(task->error)) return;
  report_unobserved(f->id, f->name ? std::string_view(f->name) : std::string_view(), task->error);
}

// Control blocks (Fiber, join record, task) of up to 384 bytes are slots carved from slabs, in
// four sizes (BlockClass); spawn records (fiber.hpp) in two more, 32 and 64 bytes. Freed slots
// go to a per-thread cache of their size, which hands batches of kSpill slots to a global list
// (one lock per kSpill slots) and takes them back from it. So a fiber costs two list
// operations, whether fibers churn (spawn, run, finish) or a million are alive at once; slabs
// are kept for reuse, never given back (like stacks, see context/stack.hpp). Larger control
// blocks (big captures) use malloc.
//
// Sizes matter because a million fibers queued at once (spawn_1t, a burst of connections) are a
// million control blocks of fresh memory, and committing fresh memory costs this VM about 2 us a
// page: with one 384-byte size that was over half of spawn_1t's time, and each 32 bytes less
// per control block took 8 to 13 ns off it. A Fiber is 128 bytes (static_assert below) and a task
// at least 24 (TaskImpl: a vtable, the exception, the callable in an optional). So a `go` lambda
// capturing one pointer or value takes 160 bytes, up to three 192; a fiber::spawn one, with its
// 64-byte join record and result slot, 256 or 384. A 160-byte slot starts on a cache line or
// half-way into one; the others on a line.
//
// Slabs are mmap'd. A thread's first is 96 KiB. Past that it is spawning in bulk (fibers queue
// faster than they finish), and each further slab is 2 MiB, committed by one
// MADV_POPULATE_WRITE: first touches of fresh slab memory were a page fault per ten control
// blocks, about 40% of spawn_1t's time.
#if !defined(FIBER_ASAN) && !defined(FIBER_TSAN)  // sanitizer builds keep more per stack
static_assert(sizeof(Fiber) <= 128, "a Fiber outgrowing 128 bytes leaves the 160-byte slot no room for a task");
#endif
constexpr std::size_t kSlabBytes = 96 * 1024;
constexpr std::size_t kBulkSlabBytes = std::size_t{2} << 20;
constexpr std::size_t kSpill = 2048;

struct FreeSlot {
  FreeSlot* next;
  // In the first slot of a batch on the global list only:
  FreeSlot* next_batch;
  std::size_t batch_count;  // kSpill, fewer for a thread's leftovers at its exit
};

// One per block size.
template <std::size_t kBlockSize>
struct GlobalSlots {
  std::mutex mu;
  FreeSlot* batches = nullptr;  // GUARDED_BY(mu): linked through next_batch

  static GlobalSlots& instance() {
    static GlobalSlots* g = new GlobalSlots();  // never destroyed: threads may free at exit
    return *g;
  }
};

// A thread's free slots, in two lists. Frees go to `freed`, and allocations take from it first:
// the slot freed last is the warmest. Once `freed` holds kSpill slots it goes to the global list
// whole. When `freed` is empty, allocations take from `head`, a batch taken from the global list.
// So a thread caches fewer than 2 * kSpill slots of each size, and no step walks a list: a walk
// of kSpill slots freed by another thread was a cache miss per slot.
template <std::size_t kBlockSize>
struct SlotCache {
  static_assert(kBlockSize % 32 == 0, "slots start on cache lines or half-way into one");
  FreeSlot* freed = nullptr;  // freed by this thread
  std::size_t freed_count = 0;
  FreeSlot* head = nullptr;   // the rest of a batch from the global list
  std::size_t count = 0;      // slots in `head`
  char* bump = nullptr;  // the unused rest of this thread's current slab
  char* bump_end = nullptr;
  bool carved_one = false;  // this thread has had a slab: the next ones are bulk slabs

  // Thread exit: the cached slots and the rest of the slab go to the global list (short batches
  // are fine). Threads come and go (a scheduler's, a retired processor's), slabs stay.
  ~SlotCache() {
    if (head) give(head, count);
    if (freed) give(freed, freed_count);
    // Emptied, not just handed over: a free after this (another thread_local's destructor
    // dropping the last JoinHandle) starts a new list, leaked with the thread, instead of
    // linking into slots the global list now hands to others.
    head = freed = nullptr;
    count = freed_count = 0;
    while (bump != bump_end) {
      FreeSlot* batch = nullptr;
      std::size_t n = 0;
      for (; n < kSpill && bump != bump_end; ++n, bump += kBlockSize) {
        auto* slot = reinterpret_cast<FreeSlot*>(bump);
        slot->next = batch;
        batch = slot;
      }
      give(batch, n);
    }
  }
  static void give(FreeSlot* batch, std::size_t n) noexcept {
    GlobalSlots<kBlockSize>& g = GlobalSlots<kBlockSize>::instance();
    batch->batch_count = n;
    std::lock_guard lock(g.mu);
    batch->next_batch = g.batches;
    g.batches = batch;
  }
  void free(FreeSlot* n) noexcept {
    n->next = freed;
    freed = n;
    if (++freed_count == kSpill) {
      give(freed, kSpill);
      freed = nullptr;
      freed_count = 0;
    }
  }
  // Throws ResourceError when no memory can be had; never returns nullptr (a batch from the
  // global list is never empty, a new slab holds many slots).
  void* allocate() {
    if (void* p = allocate_cached()) return p;
    if (!refill()) new_slab();
    return allocate_cached();
  }
  // From this thread's lists or slab only: no lock, no system call. nullptr when all are empty.
  void* allocate_cached() noexcept {
    if (FreeSlot* n = freed) {
      freed = n->next;
      --freed_count;
      return n;
    }
    if (FreeSlot* n = head) {
      head = n->next;
      --count;
      return n;
    }
    if (bump == bump_end) return nullptr;
    void* p = bump;
    bump += kBlockSize;
    // A bulk slab was populated (zeroed) up to 2 MiB ago, so its lines have left the cache: a
    // spawner carving slot after slot (a million `go`s in a loop) stalls on each first write.
    // Ask for the slot 8 ahead now (a prefetch never faults, past the slab's end included).
    // spawn_1t: 171 -> 164 ns per fiber (medians of 11 interleaved runs).
    for (std::size_t line = 0; line < kBlockSize; line += 64) __builtin_prefetch(bump + 8 * kBlockSize + line, 1);
    return p;
  }
  // `head` is empty: a batch from the global list. False if there is none.
  bool refill() noexcept {
    GlobalSlots<kBlockSize>& g = GlobalSlots<kBlockSize>::instance();
    std::lock_guard lock(g.mu);
    if (!g.batches) return false;
    head = g.batches;
    count = head->batch_count;
    g.batches = head->next_batch;
    return true;
  }
  // Throws ResourceError when no memory can be had.
  void new_slab() {
    std::size_t bytes = kBulkSlabBytes;
    char* slab = carved_one ? map_slab(bytes) : nullptr;
    if (slab == nullptr) {
      bytes = kSlabBytes;
      slab = map_slab(bytes);
      if (slab == nullptr) throw ResourceError("fiber::spawn: out of memory for fiber control blocks");
    }
    carved_one = true;
    bump = slab;
    bump_end = slab + bytes / kBlockSize * kBlockSize;  // whole slots: alloc tests bump == bump_end
  }
  // A mapping of `bytes`; kBulkSlabBytes ones populated at once. nullptr
  // if it cannot be had. Reserved (no MAP_NORESERVE): under strict overcommit a refusal is a
  // failed mmap here, not a signal at first touch.
  static char* map_slab(std::size_t bytes) noexcept {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    const auto slab = reinterpret_cast<uintptr_t>(p);
    if (bytes == kBulkSlabBytes) {
      // Small pages, committed in one call (best effort: before Linux 5.14 they fault in on
      // first touch). Huge pages halved spawn_1t on a warm machine, but on this VM a huge page
      // fresh from the host after another process freed memory cost 2-3x instead (spawn_1t
      // 600-990 ns right after Go's run, against 230-300 with small pages populated).
      madvise(p, bytes, MADV_NOHUGEPAGE);
      madvise(p, bytes, MADV_POPULATE_WRITE);
    }
#if defined(FIBER_ASAN)
    // The leak checker scans malloc'd memory and roots only: control blocks hold the callables'
    // captures, and the free lists run through them.
    __lsan_register_root_region(reinterpret_cast<void*>(slab), bytes);
#endif
    return reinterpret_cast<char*>(slab);
  }
};
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<160> t_slots160;
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<192> t_slots192;
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<256> t_slots256;
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<384> t_slots384;
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<32> t_slots32;  // spawn records
__attribute__((tls_model("initial-exec"))) thread_local SlotCache<64> t_slots64;

BlockClass block_class_for(std::size_t size) noexcept {
  if (size <= 160) return kSlot160;
  if (size <= 192) return kSlot192;
  if (size <= 256) return kSlot256;
  return size <= 384 ? kSlot384 : kMallocBlock;
}

// fn(cache) with this thread's cache for slot class `c` (not kMallocBlock).
template <typename Fn>
decltype(auto) with_slot_cache(BlockClass c, Fn&& fn) {
  if (c == kSlot160) return fn(t_slots160);
  if (c == kSlot192) return fn(t_slots192);
  if (c == kSlot256) return fn(t_slots256);
  if (c == kSlot32) return fn(t_slots32);
  if (c == kSlot64) return fn(t_slots64);
  return fn(t_slots384);
}

// Both read the thread's slot caches, so neither may be inlined (invariant 3): free_block runs
// in complete_switch, after a jump, and with link-time optimisation a caller could otherwise
// reuse a thread-local address computed before it.
__attribute__((noinline)) void* allocate_block(std::size_t size, BlockClass c) {
  if (c != kMallocBlock) return with_slot_cache(c, [](auto& cache) { return cache.allocate(); });
  void* p = std::malloc(size);
  if (!p) throw ResourceError("fiber::spawn: out of memory for a fiber control block");
  return p;
}

// allocate_block without the slow ways: a slot from this thread's cache, or nullptr.
__attribute__((noinline)) void* allocate_block_cached(BlockClass c) noexcept {
  if (c == kMallocBlock) return nullptr;
  return with_slot_cache(c, [](auto& cache) { return cache.allocate_cached(); });
}

__attribute__((noinline)) void free_block(void* p, BlockClass c) noexcept {
  if (c == kMallocBlock) {
    std::free(p);
    return;
  }
  with_slot_cache(c, [p](auto& cache) { cache.free(static_cast<FreeSlot*>(p)); });
}

void destroy_fiber(Fiber* f) noexcept {
  if (TaskBase* task = f->task()) task->~TaskBase();
  delete[] f->name;
  const BlockClass c = f->block_class;
  f->~Fiber();
  free_block(f, c);
}

// Whether a spawn onto `s` made on processor `p` (nullptr: a plain thread) comes from outside
// `s`: fiber_create, fiber_submit and fiber_abandon, on one thread, must agree on it.
bool spawning_from_outside(const Processor* p, const SchedulerImpl& s) noexcept {
  return p == nullptr || &p->sched() != &s;
}

SchedulerImpl& target_scheduler(const SpawnOptions& o, const Fiber* cur) {
  if (o.scheduler) return o.scheduler->impl();
  if (cur) return *cur->sched;
  return Scheduler::global().impl();
}

}  // namespace

uint64_t allocate_fiber_ids(uint64_t n) noexcept { return g_next_id.fetch_add(n, std::memory_order_relaxed); }

namespace {
// A Created control block in `mem` (of class `c`), as fiber_create and start_spawn_record make it.
Fiber* construct_fiber(void* mem, BlockClass c, SchedulerImpl& s, std::size_t stack_class, uint64_t id,
                       Group* group) noexcept {
  Fiber* f = new (mem) Fiber();
  f->block_class = c;
  f->sched = &s;
  f->set_stack_size(stack_class);
  f->id = id;
  f->group = group;
  return f;
}

// `task`, constructed where Fiber::task() finds it, is f's; a joinable fiber keeps a reference
// for its JoinHandle, a `go` one is born detached.
void attach_task(Fiber* f, TaskBase* task, bool joinable) noexcept {
  f->has_task = true;
  // Found, not stored (Fiber::task()): after the Fiber and any wait record, as TaskBase, the
  // first base.
  if (f->task() != task) [[unlikely]] {
    std::fputs("libfiber: internal error: a task's TaskBase is not where its storage starts\n", stderr);
    std::abort();
  }
  if (joinable) {
    f->refs.store(2, std::memory_order_relaxed);
  } else {
    f->join_word.store(Fiber::kJoinDetached, std::memory_order_relaxed);  // `go`: born detached
  }
}

// A spawn record's slot: 32 bytes when its PendingTask of `size` bytes fits, else 64.
BlockClass record_class_for(std::size_t size) noexcept {
  return SpawnRecord::kTaskOffset + size <= 32 ? kSlot32 : kSlot64;
}
}  // namespace

Fiber* fiber_create(const SpawnRequest& req, bool joinable, std::size_t task_size, std::size_t task_align,
                    void** task_storage) {
  Fiber* cur = current_fiber();
  SchedulerImpl& s = target_scheduler(req.options, cur);
  const std::size_t size_class =
      req.options.stack_size ? stack_size_class(req.options.stack_size) : s.default_stack_class();
  if (task_align > alignof(std::max_align_t)) {
    throw UsageError("fiber::spawn: the callable's alignment exceeds alignof(std::max_align_t)");
  }
  std::unique_ptr<char[]> name;
  if (!req.options.name.empty()) {
    name.reset(new char[req.options.name.size() + 1]);
    std::memcpy(name.get(), req.options.name.data(), req.options.name.size());
    name[req.options.name.size()] = '\0';
  }
  // A fiber of s may spawn while s stops (its children are cancelled as they start), and so
  // may s's processors' own loops (an unhandled-exception handler run there); a spawn from
  // outside may not, and is counted in flight until fiber_submit or fiber_abandon.
  Processor* p = current_processor();
  const bool foreign = spawning_from_outside(p, s);
  if (foreign) s.foreign_spawn_begin();  // throws when s is stopping
  const std::size_t off = Fiber::task_offset(joinable);
  const BlockClass c = block_class_for(off + task_size);
  void* mem;
  try {
    mem = allocate_block(off + task_size, c);  // slots and malloc: aligned for max_align_t
  } catch (...) {
    if (foreign) s.foreign_spawn_end();
    throw;
  }
  Fiber* f = construct_fiber(mem, c, s, size_class, foreign ? allocate_fiber_ids(1) : p->next_fiber_id(),
                             req.group ? req.group : (cur ? cur->group : nullptr));
  if (joinable) new (static_cast<char*>(mem) + sizeof(Fiber)) Waiter();
  f->joinable = joinable;
  f->name = name.release();
  *task_storage = static_cast<char*>(mem) + off;
  return f;
}

void* go_record_create(const SpawnOptions& options, std::size_t size) {
  Processor* p = current_processor();
  if (p == nullptr || !options.name.empty() || options.stack_size != 0) return nullptr;
  Fiber* cur = current_fiber();
  if (&target_scheduler(options, cur) != &p->sched()) return nullptr;
  void* mem = allocate_block(0, record_class_for(size));
  new (mem) SpawnRecord{nullptr, cur ? cur->group : nullptr};
  return static_cast<char*>(mem) + SpawnRecord::kTaskOffset;
}

void go_record_submit(void* task_storage, std::size_t size) noexcept {
  auto* r = reinterpret_cast<SpawnRecord*>(static_cast<char*>(task_storage) - SpawnRecord::kTaskOffset);
  Processor* p = current_processor();  // the spawner's (go_record_create): no switch since
  if (r->group && !p->group_member_spawned(r->group)) r->group->add();
  p->count_spawn();
  p->schedule_local(tag_spawn_record(r, record_class_for(size) == kSlot64));
}

// Test hook (fiber.hpp): true while it refuses starts, counting one down.
static bool refused_record_start() noexcept {
  int n = refuse_record_starts.load(std::memory_order_relaxed);
  while (n > 0 && !refuse_record_starts.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n > 0;
}

// start_spawn_record's failure in the loop: the record's fiber never runs, and says why where an
// exception escaping it would have gone (its id is taken now, as a start would).
static void fail_spawn_record(Fiber* tagged, Processor& p, const std::exception_ptr& error) noexcept {
  SpawnRecord* r = spawn_record_of(tagged);
  Group* g = r->group;
  free_block(r, spawn_record_class(tagged));  // the callable is trivially destructible
  report_unobserved(p.next_fiber_id(), {}, error);
  // Read afresh: the handler may block, as after any detached fiber's (complete_fiber).
  Processor* now = current_processor();
  now->count_finish();
  if (g) now->group_member_done(g);
}

Fiber* start_spawn_record(Fiber* tagged, Processor& p, RecordStart how) noexcept {
  SpawnRecord* r = spawn_record_of(tagged);
  PendingTask* pending = r->task();
  const std::size_t off = Fiber::task_offset(false);
  const std::size_t size = off + pending->task_size();
  const BlockClass c = block_class_for(size);
  void* mem = nullptr;
  try {
    if (refused_record_start()) [[unlikely]] {
      throw ResourceError("fiber::spawn: out of memory for fiber control blocks (refused by the test hook)");
    }
    // allocate_block never returns nullptr; the cache alone may.
    mem = how == RecordStart::CacheOnly ? allocate_block_cached(c) : allocate_block(size, c);
  } catch (...) {
    if (how == RecordStart::OrReport) fail_spawn_record(tagged, p, std::current_exception());
    return nullptr;
  }
  if (mem == nullptr) return nullptr;  // CacheOnly: not in the cache
  Fiber* f = construct_fiber(mem, c, p.sched(), p.sched().default_stack_class(), p.next_fiber_id(), r->group);
  attach_task(f, pending->relocate(static_cast<char*>(mem) + off), false);
  free_block(r, spawn_record_class(tagged));
  f->set_state(FiberState::Created, FiberState::Runnable);
  return f;
}

void fiber_abandon(Fiber* f) noexcept {
  f->has_task = false;
  if (spawning_from_outside(current_processor(), *f->sched)) f->sched->foreign_spawn_end();
  destroy_fiber(f);
}

void fiber_submit(Fiber* f, TaskBase* task, bool joinable) {
  attach_task(f, task, joinable);
  Processor* p = current_processor();
  if (f->group && !(p && p->group_member_spawned(f->group))) f->group->add();
  SchedulerImpl& s = *f->sched;  // f may run, finish and be freed once published
  f->set_state(FiberState::Created, FiberState::Runnable);  // not yet visible to anyone
  if (!spawning_from_outside(p, s)) {
    p->count_spawn();
    p->schedule_local(f);
  } else {
    s.count_foreign_spawn();
    s.inject(f);
    s.foreign_spawn_end();  // counted now: stop() may go on (our last touch of s)
  }
}

void run_task(Fiber* self) noexcept {
  try {
    self->task()->run();
  } catch (...) {
    self->task()->error = std::current_exception();
  }
}

// Unlisted (stop() no longer finds it) and counted finished (live_fibers()).
static void leave_scheduler(Fiber* f) noexcept {
  f->sched->registry().remove(f);
  current_processor()->count_finish();  // read afresh: the fiber may have moved
}

void complete_fiber(Fiber* f) noexcept {
  Group* g = f->group;
  // Not detached yet: claim the word (kJoinFinishing) so that no detach can slip in between and
  // leave an exception to report after the fiber was counted finished. A detach from now on
  // reports it itself (fiber_detach), and a waiter waits out the few instructions to
  // kJoinFinished (wait_out_finishing). Detached is final: nobody else writes the word, so `go`
  // fibers (born detached) skip the locked instruction.
  uint8_t old = f->join_word.load(std::memory_order_acquire);
  while (old != Fiber::kJoinDetached &&
         !f->join_word.compare_exchange_weak(old, Fiber::kJoinFinishing, std::memory_order_acq_rel)) {
  }
  // A detached fiber's unhandled-exception handler may block: the fiber stays listed and
  // counted alive until it returns, for stop() to cancel that wait rather than shut the
  // processors down under it. A joinable one is counted finished before a joiner can see it
  // so: join() returned means live_fibers() no longer counts it.
  if (old == Fiber::kJoinDetached) {
    report_if_unobserved(f);
    // Its FiberLocal values (those the handler made too), still counted alive, as the handler
    // is: their destructors may block. A fiber that never got a stack has none.
    if (f->stack && fls_word(f) != nullptr) fls_fiber_exit(f);
  }
  leave_scheduler(f);
  f->join_word.store(Fiber::kJoinFinished, std::memory_order_release);
  // kJoinArming: a waiter is writing the record; its CAS to kJoinWaiting fails and it ends its
  // wait itself. Nothing to notify.
  if (old == Fiber::kJoinWaiting) {
    // A waiting fiber lent us a reference to itself (fiber_wait_until): its claim word, which
    // waiter_notify reads, is in its own control block, and it may have given up already.
    Fiber* joiner = f->join_waiter().fiber;
    waiter_notify(f->join_waiter());
    if (joiner) drop_fiber_ref(joiner);
  }
  // Read afresh: the handler above may have blocked, and the fiber moved.
  if (g) current_processor()->group_member_done(g);  // settled when it leaves the group (group.hpp)
}

void drop_fiber_ref(Fiber* f) noexcept {
  // Ours is the only reference: nobody else can take one (a reference is taken only through
  // one already held: a handle's, a token's, or the runtime's while the fiber runs), so no
  // decrement is needed. The acquire pairs with the release of the decrement that left it at 1.
  if (f->refs.load(std::memory_order_acquire) == 1) {
    destroy_fiber(f);
    return;
  }
  if (f->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) destroy_fiber(f);
}

void fiber_join(Fiber* f) {
  fiber_wait_until(f, std::numeric_limits<int64_t>::max(), "fiber::JoinHandle::join");
}

// `f` is in complete_fiber, past its claim of the join word (kJoinFinishing): a few
// instructions from kJoinFinished, with no switch in between. Waits them out, so that a wait
// that says "finished" means counted finished too (live_fibers()).
static void wait_out_finishing(const Fiber* f) noexcept {
  spin_until([f] { return f->join_word.load(std::memory_order_acquire) != Fiber::kJoinFinishing; });
}

bool fiber_wait_until(Fiber* f, int64_t deadline_ns, const char* what) {
  Fiber* self = current_fiber();
  if (self == f) throw UsageError(std::string(what) + ": a fiber cannot wait for itself");
  if (f->join_word.load(std::memory_order_acquire) == Fiber::kJoinFinished) return true;
  const bool timed = deadline_ns != std::numeric_limits<int64_t>::max();
  if (timed && steady_now_ns() >= deadline_ns) {
    // Out of time already. A fiber still yields, as sleep_until does, so that a loop of short
    // waits cannot keep the target (or its timers) from running on a single processor.
    if (self == nullptr) return false;
    this_fiber::yield();
    return f->join_word.load(std::memory_order_acquire) == Fiber::kJoinFinished;
  }
  const auto busy = [what] {
    return UsageError(std::string(what) +
                      ": another fiber or thread is already waiting for this fiber (a JoinHandle takes one wait at a time)");
  };
  // Take the record before writing it: two waits racing on one handle (two fibers, or a fiber
  // and a thread) would otherwise both write it, and the loser's withdrawal would end the
  // winner's wait. The loser fails this CAS without touching the record.
  uint8_t expected = 0;
  if (!f->join_word.compare_exchange_strong(expected, Fiber::kJoinArming, std::memory_order_acq_rel)) {
    if (expected != Fiber::kJoinFinished && expected != Fiber::kJoinFinishing) {
      throw busy();  // kJoinArming or kJoinWaiting: another wait holds the record
    }
    wait_out_finishing(f);
    return true;
  }
  // The record lives in `f`, but a waiting fiber's claim word is in its own control block, and
  // the finisher reads it after its exchange in complete_fiber - possibly after a timed-out or
  // cancelled waiter has given up, returned and ended. So a waiting fiber lends the finisher a
  // reference to itself: complete_fiber drops it after its notify, and we drop it whenever
  // nobody will notify (nothing published, or withdrawn). A thread's claim word is in the
  // record and its parker is never freed, so a thread lends nothing.
  if (self) fiber_retain(self);
  waiter_prepare(f->join_waiter());
  expected = Fiber::kJoinArming;
  if (!f->join_word.compare_exchange_strong(expected, Fiber::kJoinWaiting, std::memory_order_acq_rel)) {
    // Only complete_fiber moves the word off kJoinArming: it finished in between, and saw no
    // one to notify.
    waiter_abandon(f->join_waiter());
    if (self) drop_fiber_ref(self);
    wait_out_finishing(f);
    return true;
  }
  const WakeReason r =
      timed ? waiter_wait_until(f->join_waiter(), ParkReason::Join, Deadline(std::chrono::nanoseconds(deadline_ns)))
            : waiter_wait(f->join_waiter(), ParkReason::Join);
  if (r == WakeReason::Notified) return true;
  // Timed out or cancelled: withdraw. If it finished meanwhile, its claim failed on our ended
  // wait, it keeps the lent reference to drop, and it is finished for the caller. Either way
  // nobody touches the record again before the next waiter_prepare: a later wait sees
  // kJoinFinished first, or finds the word back at 0 and publishes a fresh wait.
  expected = Fiber::kJoinWaiting;
  const bool withdrawn = f->join_word.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
  if (withdrawn && self) drop_fiber_ref(self);
  if (r == WakeReason::Cancelled) throw Cancelled();
  if (withdrawn) return false;
  wait_out_finishing(f);
  return true;
}

bool fiber_finished(const Fiber* f) noexcept {
  return f->join_word.load(std::memory_order_acquire) == Fiber::kJoinFinished;
}

void fiber_detach(Fiber* f) noexcept {
  uint8_t expected = 0;
  // Finishing or finished: complete_fiber saw no detach, so the report is ours to make (the
  // task's outcome is final once it finishes; our reference keeps the block).
  if (!f->join_word.compare_exchange_strong(expected, Fiber::kJoinDetached, std::memory_order_acq_rel) &&
      (expected == Fiber::kJoinFinished || expected == Fiber::kJoinFinishing)) {
    report_if_unobserved(f);
  }
  drop_fiber_ref(f);
}

void fiber_release(Fiber* f) noexcept { drop_fiber_ref(f); }

void fiber_retain(Fiber* f) noexcept { f->refs.fetch_add(1, std::memory_order_relaxed); }

Fiber* fiber_current_retained() noexcept {
  Fiber* f = current_fiber();
  if (f) fiber_retain(f);
  return f;
}

unsigned long long fiber_id(const Fiber* f) noexcept { return f->id; }

// A cancel is three steps. The flag first: a wait that starts with a plain store of wake_word
// (waiter_prepare) may overwrite the cancel bit set below, and then finds the flag instead. That
// is a store-buffering pattern (the fiber: wake_word, then the flag; the cancel: the flag, then
// wake_word), whose full barriers fiber_cancel_fence supplies on every thread at once: after it,
// either the fiber's wait began early enough for fiber_cancel_claim's CAS to see it, or
// late enough to see the flag.
void fiber_cancel_mark(Fiber* f) noexcept { f->cancel_requested.store(true, std::memory_order_relaxed); }

bool fiber_cancel_fence() noexcept {
  if (!plain_wait_start()) return true;  // waits start with a CAS: the cancel bit cannot be lost
  return membarrier_heavy_retrying();  // refused: the caller does without
}

void fiber_cancel(Fiber* f) noexcept {
  // A finished fiber starts no wait; a cancel bit already set came with an earlier cancel's
  // fence, which covers every wait start from then on. Neither needs a membarrier (a syscall
  // that interrupts every running thread of the process), only the claim.
  if (f->state.load(std::memory_order_acquire) == FiberState::Finished) return;
  fiber_cancel_mark(f);
  const bool fenced = (f->wake_word.load(std::memory_order_acquire) & WakeWord::kCancelBit) != 0 || fiber_cancel_fence();
  fiber_cancel_claim(f);
  if (!fenced) [[unlikely]] {
    // Refused: a wait start racing the claim may have overwritten the bit and missed the flag,
    // leaving its wait unclaimed. Its store is visible within microseconds; claim again then.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    fiber_cancel_claim(f);
  }
}

void fiber_cancel_claim(Fiber* f) noexcept {
  if (fiber_cancel_try_claim(f)) unpark(f);
}

namespace {

// The cancel bit set on `cur` and, for a pending wait that is not shielded, the wait claimed as
// Cancelled. Not waiting, or in a shielded wait: only the bit, which its next (unshielded) wait
// sees.
uint64_t cancelled_word(uint64_t cur, bool& claims) noexcept {
  const WakeWord w = WakeWord::unpack(cur);
  claims = w.reason == WakeReason::Pending && !w.shielded;
  const uint64_t marked = cur | WakeWord::kCancelBit;
  return claims ? WakeWord::with_reason(marked, WakeReason::Cancelled) : marked;
}

bool is_biased_pending(uint64_t cur) noexcept {
  return (cur & WakeWord::kBiasBit) != 0 && (cur & WakeWord::kReasonMask) == static_cast<uint64_t>(WakeReason::Pending);
}

// A pending wait biased to its processor, which could overwrite the bit with a plain claim: set
// it (and claim) behind that processor's closed gate. If the fiber has moved on to a wait biased
// to another processor meanwhile, again with that one's.
[[gnu::noinline]] bool cancel_biased(Fiber* f) noexcept {
  for (;;) {
    ClaimGate& gate = wait_processor_gate(f);
    gate.close();
    uint64_t cur = f->wake_word.load(std::memory_order_acquire);
    for (;;) {
      if (is_biased_pending(cur) && &wait_processor_gate(f) != &gate) break;
      bool claims = false;
      const uint64_t desired = cancelled_word(cur, claims);
      // desired == cur: the bit was set already, and nothing is claimable (claims is false).
      if (desired == cur || f->wake_word.compare_exchange_weak(cur, desired, std::memory_order_acq_rel)) {
        gate.open();
        return claims;
      }
    }
    gate.open();
  }
}

}  // namespace

bool fiber_cancel_try_claim(Fiber* f) noexcept {
  // A CAS rather than a fetch_or: it must not land on a biased wait's word outside the gate.
  uint64_t cur = f->wake_word.load(std::memory_order_acquire);
  for (;;) {
    if (is_biased_pending(cur)) [[unlikely]] return cancel_biased(f);
    bool claims = false;
    const uint64_t desired = cancelled_word(cur, claims);
    if (desired == cur) return false;  // the bit already set, nothing to claim
    if (f->wake_word.compare_exchange_weak(cur, desired, std::memory_order_acq_rel)) return claims;
  }
}

void throw_cancelled_unless_unwinding() {
  if (std::uncaught_exceptions() == 0) throw Cancelled();
}

void report_stack_overflow(const Fiber* f, const char* how) noexcept {
  char buf[320];
  const int n = std::snprintf(buf, sizeof buf,
                              "libfiber: stack overflow in fiber #%llu%s%s%s (stack %zu bytes, %s): %s; aborting\n",
                              static_cast<unsigned long long>(f->id), f->name ? " '" : "", f->name ? f->name : "",
                              f->name ? "'" : "", static_cast<std::size_t>(f->stack.size),
                              f->stack.kind == StackKind::Guarded ? "guarded" : "unguarded", how);
  if (n > 0) detail::raw::write(2, buf, static_cast<std::size_t>(std::min(n, static_cast<int>(sizeof buf) - 1)));
  std::abort();
}

// ------------------------------------------------------------------------------ groups

void Group::done(std::size_t n) noexcept {
  if (pending_.fetch_sub(n, std::memory_order_acq_rel) != n) return;
  Waiter* w = nullptr;
  bool orphaned;
  {
    std::lock_guard lock(mu_);
    finished_ = true;
    // Claim under the lock (a cancelled waiter withdraws under it), wake outside it.
    if (waiter_ && waiter_claim(*waiter_, WakeReason::Notified)) w = waiter_;
    waiter_ = nullptr;
    orphaned = released_;
  }
  if (orphaned) {
    delete this;  // the creator has left (release): we were the last to refer to the group
  } else if (w) {
    waiter_wake(*w);
  }
}

void Group::release() noexcept {
  const bool token_held = !token_returned_;  // the creator's own field: read before unlocking
  bool finished;
  {
    std::lock_guard lock(mu_);
    finished = finished_;
    released_ = !finished;
  }
  if (finished) {
    delete this;
  } else if (token_held) {
    done();  // holding the token, no member could have reached zero: this or a later done frees
  }
  // Else members are still running and the last of them frees the group; it may have already.
}

void Group::wait() {
  token_returned_ = true;
  done();  // the creator's token
  Waiter w;
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    waiter_prepare(w);
    waiter_ = &w;
  }
  if (waiter_wait(w, ParkReason::BlockOn) == WakeReason::Cancelled) {
    std::lock_guard lock(mu_);
    if (waiter_ == &w) waiter_ = nullptr;
    throw Cancelled();
  }
}

Group* group_create() { return new Group(); }
void group_wait(Group* g) { g->wait(); }
void group_release(Group* g) noexcept { g->release(); }

// ------------------------------------------------------------------------------ registry

void list_self(const Fiber* running) noexcept {
  Fiber* f = const_cast<Fiber*>(running);  // the caller is f: its registry fields are its own
  f->sched->registry().add(f, current_processor()->index());
  // Listed after stop() began: stop() may have walked our shard before (the shard lock orders
  // its walk and our add; its stopping_ store precedes its walk), so cancel ourselves. On our
  // own thread no wait of ours can be starting meanwhile: no fence (fiber_cancel_mark). A wait
  // of ours already pending (park_current lists first) is claimed, and ends at once.
  if (f->sched->stopping()) [[unlikely]] {
    fiber_cancel_mark(f);
    fiber_cancel_claim(f);
  }
}

void Registry::add(Fiber* f, std::size_t shard) noexcept {
  Shard& s = shards_[shard];
  std::lock_guard lock(s.mu);
  f->reg_prev = nullptr;
  f->reg_next = s.head;
  if (s.head) s.head->reg_prev = f;
  s.head = f;
  // Once linked: a core dumped in between shows the running fiber as unlisted (gdb shows it).
  f->reg_shard = static_cast<uint16_t>(shard);  // below kUnlisted: at most 1024 slots
}

void Registry::remove(Fiber* f) noexcept {
  if (f->reg_shard == Fiber::kUnlisted) return;
  Shard& s = shards_[f->reg_shard];
  std::lock_guard lock(s.mu);
  if (f->reg_prev) f->reg_prev->reg_next = f->reg_next; else s.head = f->reg_next;
  if (f->reg_next) f->reg_next->reg_prev = f->reg_prev;
  f->reg_prev = f->reg_next = nullptr;
}

}  // namespace detail

// ------------------------------------------------------------------------------ public API

UnhandledExceptionHandler set_unhandled_exception_handler(UnhandledExceptionHandler h) noexcept {
  return detail::g_unhandled.exchange(h ? h : &detail::default_unhandled, std::memory_order_acq_rel);
}

namespace this_fiber {

void yield() {
  detail::Processor* p = detail::current_processor();
  if (p == nullptr || p->current()->is_loop) {
    std::this_thread::yield();
    return;
  }
  detail::Processor::yield_current(p);
}

unsigned long long id() noexcept {
  const detail::Fiber* f = detail::current_fiber();
  return f ? f->id : 0;
}

bool in_fiber() noexcept { return detail::current_fiber() != nullptr; }

bool cancelled() noexcept {
  const detail::Fiber* f = detail::current_fiber();
  if (f == nullptr) return false;
  detail::ensure_listed(f);  // a fiber polling in a loop that never parks: stop() must find it
  return f->cancel_requested.load(std::memory_order_acquire);
}

static detail::Fiber& require_fiber(const char* what) {
  detail::Fiber* f = detail::current_fiber();
  if (f == nullptr) throw UsageError(std::string("fiber::this_fiber::") + what + ": called from a plain thread, not a fiber");
  return *f;
}

std::string_view name() {
  const detail::Fiber& f = require_fiber("name");
  return f.name ? std::string_view(f.name) : std::string_view();
}

unsigned processor_index() {
  require_fiber("processor_index");
  return detail::current_processor()->index();
}

void sleep_until(std::chrono::steady_clock::time_point deadline) {
  detail::Fiber* f = detail::current_fiber();
  if (f == nullptr) {
    std::this_thread::sleep_until(deadline);
    return;
  }
  detail::throw_if_cancelled(f);
  if (deadline <= std::chrono::steady_clock::now()) {
    yield();
    return;
  }
  detail::Waiter w;
  detail::waiter_prepare(w);
  if (detail::waiter_wait_until(w, detail::ParkReason::Sleep, deadline) == detail::WakeReason::Cancelled) {
    throw Cancelled();
  }
}

PinGuard::PinGuard() {
  detail::Fiber& f = require_fiber("PinGuard");
  if (f.pin_depth >= detail::Fiber::kMaxUserPinDepth) {
    throw UsageError("fiber::this_fiber::PinGuard: nested more than " +
                     std::to_string(detail::Fiber::kMaxUserPinDepth) + " deep");
  }
  if (f.pin_depth++ == 0) f.pinned = detail::current_processor();
}

PinGuard::~PinGuard() {
  detail::Fiber* f = detail::current_fiber();
  if (f && --f->pin_depth == 0) f->pinned = nullptr;
}

}  // namespace this_fiber
}  // namespace fiber
