// The fiber control block and its lifecycle.
//
// States and who moves a fiber between them (checked by transition() or set_state() on the
// owner's side; see unpark() in processor.cpp for the park steps):
//
//   Created  --submit-->            Runnable   (spawner)
//   Runnable --resume-->            Running    (the processor that dequeued it)
//   Running  --yield-->             Runnable   (itself; enqueued after the switch away)
//   Running  --begin park-->        Parking    (itself, before it becomes visible to wakers)
//   Parking  --after the switch-->  Parked     (the context it switched to)
//   Parking  --unpark-->            Notified   (a waker on its own thread, before the switch)
//   Notified --after the switch-->  Runnable   (the context it switched to, which enqueues it)
//   Parked   --unpark-->            Runnable   (the waker, which enqueues it)
//   Notified --no switch-->         Running    (itself: woken before park_current switched)
//   Parking  --own claim-->         Running    (itself: it claimed its own wait - abandoned,
//                                               or already cancelled - so nobody will wake it)
//   Running  --return-->            Finished   (itself; stack freed after the switch away)
//
// So a fiber becomes runnable only once its stack is no longer in use (invariant 1): the step
// that publishes it runs on the other side of the switch. Only its own thread writes a Parking
// fiber's state, so every step is a plain store: a waker on another thread that finds Parking
// waits for Parked. See libfiber/README.md, "Parking".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>

#include "context/stack.hpp"
#include "context/switch.hpp"
#include "fiber/detail/task.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber::detail {

class Processor;
class SchedulerImpl;
class Group;

// Where a control block's memory came from (runtime.cpp): a slot of 160, 192, 256 or 384 bytes,
// or malloc for bigger ones. Spawn records (below) are slots of 32 or 64 bytes.
enum BlockClass : uint8_t { kMallocBlock, kSlot160, kSlot192, kSlot256, kSlot384, kSlot32, kSlot64 };

enum class FiberState : uint8_t { Created, Runnable, Running, Parking, Parked, Notified, Finished };
const char* fiber_state_name(FiberState s) noexcept;

// The claim word of a fiber's current wait:
//   (generation << 8) | cancel bit | shielded bit | bias bit | local bit | WakeReason.
// `shielded`: this wait ignores cancellation (fiber_cancel does not claim it, and a pending cancel
// does not end it early); used where the wait must outlast a cancel, e.g. for a completion that
// still refers to the fiber's stack.
// `bias`: the processor the fiber waits on (Fiber::last_processor, of its own scheduler) may
// claim this wait with a plain load and store; every other thread closes that processor's
// ClaimGate first (sync/waiter_impl.hpp, claim_wait). Set when the wait starts, never changed.
// `local`: the claim came from that processor (the streak that earns the bias, prepare_wait).
struct WakeWord {
  static constexpr uint64_t kReasonMask = 0x07;
  static constexpr uint64_t kLocalBit = 0x10;
  static constexpr uint64_t kBiasBit = 0x20;
  static constexpr uint64_t kShieldBit = 0x40;
  static constexpr uint64_t kCancelBit = 0x80;
  uint64_t gen;
  bool cancelled;
  WakeReason reason;
  bool shielded = false;

  static constexpr WakeWord unpack(uint64_t v) noexcept {
    return {v >> 8, (v & kCancelBit) != 0, static_cast<WakeReason>(v & kReasonMask), (v & kShieldBit) != 0};
  }
  constexpr uint64_t pack() const noexcept {
    return (gen << 8) | (cancelled ? kCancelBit : 0) | (shielded ? kShieldBit : 0) | static_cast<uint64_t>(reason);
  }
  // On the packed word, for the wait paths (unpack and pack again cost twenty instructions):
  // `v` with its reason replaced (a claim), and the word that starts the next wait (generation
  // + 1, Pending, the cancel bit kept, the shield and bias bits as given).
  static constexpr uint64_t with_reason(uint64_t v, WakeReason r) noexcept {
    return (v & ~kReasonMask) | static_cast<uint64_t>(r);
  }
  // Whether `v` is the word of wait `gen`, still Pending: the only word a claim may change.
  static constexpr bool pending_wait(uint64_t v, uint64_t gen) noexcept {
    return (v >> 8) == gen && (v & kReasonMask) == static_cast<uint64_t>(WakeReason::Pending);
  }
  static constexpr uint64_t next_wait(uint64_t v, bool shield, bool bias = false) noexcept {
    return ((v | 0xff) + 1) | (v & kCancelBit) | (shield ? kShieldBit : 0) | (bias ? kBiasBit : 0) |
           static_cast<uint64_t>(WakeReason::Pending);
  }
};
static_assert(WakeWord::unpack(WakeWord{5, true, WakeReason::Timeout}.pack()).gen == 5);
static_assert(WakeWord::unpack(WakeWord{5, true, WakeReason::Timeout}.pack()).cancelled);
static_assert(WakeWord::unpack(WakeWord{5, false, WakeReason::Cancelled}.pack()).reason == WakeReason::Cancelled);
static_assert(WakeWord::unpack(WakeWord{5, false, WakeReason::Pending, true}.pack()).shielded);
static_assert(WakeWord::unpack(WakeWord{5, false, WakeReason::Pending, true}.pack()).reason == WakeReason::Pending);
static_assert(WakeWord::with_reason(WakeWord{5, true, WakeReason::Pending, true}.pack(), WakeReason::Timeout) ==
              WakeWord{5, true, WakeReason::Timeout, true}.pack());
static_assert(WakeWord::next_wait(WakeWord{5, true, WakeReason::Timeout, false}.pack(), true) ==
              WakeWord{6, true, WakeReason::Pending, true}.pack());
static_assert(WakeWord::next_wait(WakeWord{5, false, WakeReason::Notified, true}.pack(), false) ==
              WakeWord{6, false, WakeReason::Pending, false}.pack());
static_assert(WakeWord::next_wait(WakeWord{5, false, WakeReason::Notified}.pack() | WakeWord::kBiasBit |
                                      WakeWord::kLocalBit, false, true) ==
              (WakeWord{6, false, WakeReason::Pending}.pack() | WakeWord::kBiasBit));
static_assert(WakeWord::unpack(WakeWord{5, false, WakeReason::Timeout}.pack() | WakeWord::kBiasBit).reason ==
              WakeReason::Timeout);

// 128 bytes in release builds, two cache lines (runtime.cpp checks): a `go` fiber capturing a
// pointer fits a 160-byte slot. Hence the bit fields and the 16-bit processor index.
struct Fiber {
  // ---- switch path and waits (first cache line)
  RawContext ctx = nullptr;  // saved context while not running; written by whoever resumes next
  std::atomic<FiberState> state{FiberState::Created};
  // Written by the fiber itself around a park; read racily by dump() and the gdb extension.
  std::atomic<ParkReason> park_reason{ParkReason::None};
  // The processor it last ran on, as its index in the scheduler (kNeverRan before its first
  // run). Written when resumed; read racily by dump() and the gdb extension.
  std::atomic<uint16_t> last_processor{kNeverRan};
  static constexpr uint16_t kNeverRan = 0xffff;  // processor slots: at most 1024
  // Set before the fiber is published (fiber_create, fiber_submit; the loop's by its processor)
  // and not written after: one word, so no bit may change once other threads can see it.
  uint32_t stack_units : 24 = 0;  // size class to allocate when first run, in 256-byte units
  BlockClass block_class : 4 = kMallocBlock;  // which pool its memory came from
  bool is_loop : 1 = false;   // a processor's own thread stack, not a real fiber
  bool has_task : 1 = false;  // task() is constructed: from fiber_submit until destroy_fiber
  bool joinable : 1 = false;  // a JoinHandle's wait record follows the Fiber (join_waiter())
  // Intrusive link: a processor's inbox or pinned queue, or the injector's spill list; or,
  // claimed and not woken yet, a processor's deferred wakes or stop()'s chain (a fiber is in
  // one of them at most). Owned by the holder.
  Fiber* next = nullptr;
  Processor* pinned = nullptr;  // resumed only on this processor (PinGuard); owner-written
  Stack stack;  // empty until first run; written only while the fiber does not run
  SchedulerImpl* sched = nullptr;
  // CAS'd by wakers from any thread, see WakeWord and wait.cpp.
  std::atomic<uint64_t> wake_word{WakeWord{0, false, WakeReason::Notified}.pack()};

  // ---- lifetime: one reference for the runtime until it finishes, one for a JoinHandle, one
  // per CancelToken and per join waiting on another fiber. Invariant: a reference is only ever
  // taken by a holder of one (a handle, a token, or the fiber itself while it runs), so a count
  // of 1 seen by its holder stays 1 (drop_fiber_ref frees without a decrement).
  std::atomic<uint32_t> refs{1};
  // PinGuard nesting, plus one while an I/O call holds the fiber on its ring; owner only.
  uint16_t pin_depth = 0;
  static constexpr uint16_t kMaxUserPinDepth = 0xff00;  // PinGuard refuses to nest deeper
  static constexpr uint16_t kUnlisted = 0xffff;  // shards are processor slots: at most 1024
  // Registry shard it is listed in, from its first cancellation point or switch away
  // (ensure_listed); kUnlisted before. Written by the fiber itself, read by it and its finish
  // (and by the gdb extension, in a stopped process).
  uint16_t reg_shard = kUnlisted;
  SanitizerStack san;  // here, not last: in release builds it fills what would be padding
  // ---- join: 0 (running, nobody waits), kJoinArming (a waiter has taken the record and is
  // writing it), kJoinWaiting (join_waiter() is armed), kJoinFinishing (complete_fiber has
  // taken the word: counted finished, then kJoinFinished), kJoinFinished, kJoinDetached. Only the
  // waiter that moved the word 0 -> kJoinArming writes the record: a second, concurrent wait
  // fails that CAS and never touches it.
  std::atomic<uint8_t> join_word{0};
  // Set (never cleared) by a cancel before it sets wake_word's cancel bit. A wait begins with
  // a plain store of wake_word, which could overwrite a bit set in the meantime; the fiber
  // then finds this flag and sets the bit again (sync/waiter_impl.hpp, prepare_wait;
  // runtime.cpp, fiber_cancel).
  std::atomic<bool> cancel_requested{false};
  // Fiber-private (prepare_wait): waits in a row claimed by the processor they were made on
  // (saturating), and how often a biased wait was claimed from elsewhere anyway (each doubles
  // the streak the next bias takes; at kMaxClaimRevokes the fiber is never biased again).
  uint8_t claim_streak = 0;
  uint8_t claim_revokes = 0;
  static constexpr uint8_t kJoinWaiting = 1;
  static constexpr uint8_t kJoinFinished = 2;
  static constexpr uint8_t kJoinDetached = 3;
  static constexpr uint8_t kJoinArming = 4;
  static constexpr uint8_t kJoinFinishing = 5;  // complete_fiber holds the word; Finished next

  uint64_t id = 0;
  Group* group = nullptr;          // block_on group, counted until the fiber finishes
  char* name = nullptr;            // owned, nul-terminated; nullptr when unnamed
  // For dumps (read racily by dump() and the gdb extension, hence a relaxed atomic):
  std::atomic<int64_t> parked_at_ns{0};  // coarse steady time of its last park

  // Registry of listed fibers (stop, dump): links guarded by the scheduler's registry lock.
  Fiber* reg_prev = nullptr;
  Fiber* reg_next = nullptr;

  // The joiner's wait record. It lives with the control block rather than on the joiner's
  // stack, so a joiner that gives up (cancelled) never leaves a dangling record; and only a
  // fiber spawned with a JoinHandle has one, right after the Fiber (fiber_create), so `go`
  // fibers do without its 64 bytes. Call it only for those: only a JoinHandle waits.
  std::size_t stack_size() const noexcept { return std::size_t{stack_units} << 8; }
  void set_stack_size(std::size_t size_class) noexcept {
    static_assert((kMaxStackSize >> 8) < (1u << 24), "stack_units holds every size class");
    stack_units = static_cast<uint32_t>(size_class >> 8) & 0xffffff;  // classes are 256-byte multiples
  }

  Waiter& join_waiter() noexcept {
    return *std::launder(reinterpret_cast<Waiter*>(reinterpret_cast<char*>(this) + sizeof(Fiber)));
  }
  // The task, after the Fiber and its join record (task_offset): found, not stored, to keep the
  // Fiber at 128 bytes. nullptr before fiber_submit, for a loop, or once abandoned.
  static std::size_t task_offset(bool joinable) noexcept;
  TaskBase* task() noexcept {
    if (!has_task) return nullptr;
    return std::launder(reinterpret_cast<TaskBase*>(reinterpret_cast<char*>(this) + task_offset(joinable)));
  }

  // Checked transition with a CAS, for steps that may race (rare paths).
  void transition(FiberState from, FiberState to) noexcept {
    FiberState expected = from;
    if (!state.compare_exchange_strong(expected, to, std::memory_order_acq_rel)) {
      bad_transition(expected, from, to);
    }
  }
  // For steps no other thread can race with (Runnable -> Running, Running -> Runnable,
  // Running -> Finished): nobody else writes the state of a fiber that is queued or running,
  // so a checked store suffices. (unpark's Parked -> Runnable is a plain store too: only the
  // one waker that claimed the wait moves a Parked fiber.)
  void set_state(FiberState from, FiberState to) noexcept {
    const FiberState actual = state.load(std::memory_order_relaxed);
    if (actual != from) [[unlikely]] bad_transition(actual, from, to);
    state.store(to, std::memory_order_release);
  }
  [[noreturn]] void bad_transition(FiberState actual, FiberState from, FiberState to) const noexcept;
};
static_assert(sizeof(Fiber) % alignof(Waiter) == 0, "join_waiter() follows the Fiber");

// On a max_align_t boundary, whatever the task's own alignment (spawn refuses stricter ones), so
// that the offset follows from `joinable` alone.
inline std::size_t Fiber::task_offset(bool joinable) noexcept {
  constexpr std::size_t a = alignof(std::max_align_t);
  return (sizeof(Fiber) + (joinable ? sizeof(Waiter) : 0) + a - 1) & ~(a - 1);
}
static_assert(std::is_trivially_destructible_v<Waiter>, "a fiber's join record is never destroyed");

// A started fiber's stack keeps kStackTopReserve bytes above its first frame. The first word is
// the fiber's FiberLocal table (fiber_local.cpp): nullptr until the fiber stores a value, read
// and written only by the fiber itself (prepare_first_run clears it before the first switch in).
// There rather than in the Fiber, which is full at 128 bytes, and a fiber that never runs needs
// none.
inline constexpr std::size_t kStackTopReserve = 16;  // keeps the first frame 16-byte aligned
inline void*& fls_word(Fiber* f) noexcept {
  return *reinterpret_cast<void**>(f->stack.top() - kStackTopReserve);
}

// A `go` fiber not started yet (task.hpp, PendingTask): the spawner's group and the callable,
// in a 32- or 64-byte slot. Queues (LIFO slot, ring, injector) hold it as a tagged Fiber*: bit 0
// says "record", bit 1 "64-byte slot" (slots are 32-byte aligned). Nothing reads a queue entry
// as a Fiber before the processor that picks it has started it (start_spawn_record), except
// through these helpers: queue_back's pinned check, and the injector's spill link.
struct SpawnRecord {
  Fiber* next;  // the injector's spill link, as Fiber::next (queue_link)
  Group* group;
  static constexpr std::size_t kTaskOffset = 16;
  PendingTask* task() noexcept {
    return std::launder(reinterpret_cast<PendingTask*>(reinterpret_cast<char*>(this) + kTaskOffset));
  }
};
inline bool is_spawn_record(const Fiber* f) noexcept { return (reinterpret_cast<uintptr_t>(f) & 1) != 0; }
inline Fiber* tag_spawn_record(SpawnRecord* r, bool big) noexcept {
  return reinterpret_cast<Fiber*>(reinterpret_cast<uintptr_t>(r) | 1 | (big ? 2 : 0));
}
inline SpawnRecord* spawn_record_of(Fiber* f) noexcept {
  return reinterpret_cast<SpawnRecord*>(reinterpret_cast<uintptr_t>(f) & ~uintptr_t{3});
}
inline BlockClass spawn_record_class(const Fiber* f) noexcept {
  return (reinterpret_cast<uintptr_t>(f) & 2) != 0 ? kSlot64 : kSlot32;
}
// The intrusive link of a queue entry, fiber or record.
inline Fiber*& queue_link(Fiber* f) noexcept { return is_spawn_record(f) ? spawn_record_of(f)->next : f->next; }
// How start_spawn_record may get the control block, and what it does when it cannot.
enum class RecordStart : uint8_t {
  CacheOnly,  // a park's window: the thread's slot cache only, no lock or system call
  Allocate,   // a fiber's switch (yield, finish, move): any way; no user code on failure
  OrReport,   // the loop: any way; on failure, reports and drops the record (below)
};
// Starts a record taken from a queue by `p`, its owner thread: a Runnable fiber of p's scheduler
// that has never run, holding the record's callable; the record is freed. nullptr when no
// control block can be had that way: CacheOnly and Allocate leave the record untouched, for the
// caller to hand to the loop; OrReport (out of memory) reports a fiber::ResourceError to the
// unhandled-exception handler, as if the `go` fiber had thrown it, counts the fiber finished
// (live_fibers(), its block_on group) and frees the record. A plain `go` is detached, so that
// is where an error at its start goes, as for a fiber whose first stack cannot be had.
Fiber* start_spawn_record(Fiber* tagged, Processor& p, RecordStart how) noexcept;
// Test hook: while positive, that many record starts (counted down) behave as out of memory.
inline std::atomic<int> refuse_record_starts{0};

}  // namespace fiber::detail
// The thread's processor slot (processor.cpp), named in C so that current_processor() can name
// it in its asm. Read it only through current_processor().
extern "C" {
extern __thread fiber::detail::Processor* fiber_detail_t_processor
    __attribute__((tls_model("initial-exec"), visibility("hidden")));
}
namespace fiber::detail {

// The current processor and fiber of this thread, read afresh on every call: a fiber may resume
// on another thread after any switch, and the compiler may otherwise keep a thread_local's
// address cached across the call that switched (invariant 3). The slot is this thread's own
// and never shared, so this is about the compiler, not about ordering between threads: on
// x86-64 current_processor() is inline, the initial-exec load the compiler would emit itself,
// in asm whose memory clobber makes it a compiler barrier, so the compiler neither reuses the
// value nor moves the load across a call (pingpong_1t: 837 to 806 instructions per round trip,
// with prepare_wait's current_fiber() inline too); elsewhere it is a call. current_fiber() is
// a call (Processor::running_fiber() is its inline body).
#if defined(__x86_64__)
[[gnu::always_inline]] inline Processor* current_processor() noexcept {
  Processor* p;
  asm volatile("movq fiber_detail_t_processor@gottpoff(%%rip), %0\n\tmovq %%fs:(%0), %0" : "=r"(p) : : "memory");
  return p;
}
#else
Processor* current_processor() noexcept;
#endif
Fiber* current_fiber() noexcept;
void set_current_processor(Processor* p) noexcept;

}  // namespace fiber::detail
