// FiberLocal (fiber/fiber_local.hpp): keys, and the per-fiber and per-thread tables of values.
//
// A key is a slot index plus the generation the slot had when the key was made; deleting the
// key bumps the generation, so values stored under it no longer match a later key on the same
// slot. A table is an array indexed by slot, each entry holding (generation, value, destroy),
// and is owned by one fiber (its word at the top of its stack, fls_word) or one plain thread
// (t_table). Only its owner touches it, so the tables need no synchronisation; the key registry
// is shared and locked, but only key creation and deletion take the lock.
#include <pthread.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "fiber/fiber_local.hpp"
#include "sched/fiber.hpp"
#include "sched/runtime.hpp"

namespace fiber::detail {

namespace {

struct Entry {
  std::uint64_t gen;   // the key's generation when stored; 0: never stored
  void* value;         // nullptr: none (reset, or never set)
  FlsDestroy destroy;  // set with the value: the key may be gone when the value is destroyed
};

struct Table {
  std::uint32_t size = 0;  // entries
  Entry* entries = nullptr;
};

struct Registry {
  std::mutex mu;
  std::vector<std::uint64_t> gens;  // GUARDED_BY(mu): per slot, the generation of its key (live or next)
  std::vector<std::uint32_t> free;  // GUARDED_BY(mu): slots whose key was deleted
};

// Never destroyed: FiberLocals with static storage are deleted at exit, in any order.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// A plain thread's table (a Table*, typed as the fiber's word is). Emptied at thread exit twice
// over: by t_exit, a thread_local destructor (on the main thread too, where exit() runs those);
// and by a pthread key's destructor, which glibc runs after every thread_local destructor of a
// thread that ends (not the main thread), so values made by a thread_local destructor that ran
// after t_exit's are destroyed as well.
thread_local void* t_table = nullptr;
thread_local bool t_exit_armed = false;  // t_exit touched (so registered) and the key set
void destroy_values(void** slot) noexcept;
struct ThreadExit {
  bool used = false;
  ~ThreadExit() { destroy_values(&t_table); }
};
thread_local ThreadExit t_exit;

void thread_key_exit(void*) noexcept { destroy_values(&t_table); }

// The key, made once; -1 if the process ran out of keys (then only t_exit empties the table).
long thread_key() noexcept {
  static const long key = [] {
    pthread_key_t k;
    return pthread_key_create(&k, thread_key_exit) == 0 ? static_cast<long>(k) : -1L;
  }();
  return key;
}

// Called when a plain thread makes a table. The key's value is any non-null pointer, set again
// for a table made during the key's own destructor (glibc then calls it again, up to
// PTHREAD_DESTRUCTOR_ITERATIONS rounds).
void arm_thread_exit() noexcept {
  if (!t_exit_armed) {
    t_exit_armed = true;
    t_exit.used = true;  // its first use registers its destructor with this thread
  }
  if (const long key = thread_key(); key >= 0) pthread_setspecific(static_cast<pthread_key_t>(key), &t_table);
}

// Where the caller's table pointer lives: its fiber's stack word, or its thread's. Not inlined
// (invariant 3): a fiber may be on another thread than at its last call.
__attribute__((noinline)) void** table_slot() noexcept {
  asm volatile("" ::: "memory");
  if (Fiber* f = current_fiber()) return &fls_word(f);
  return &t_table;
}

// The caller's table with room for `index`; throws std::bad_alloc with nothing changed.
Table* table_with(void** slot, std::uint32_t index) {
  auto* t = static_cast<Table*>(*slot);
  if (t != nullptr && index < t->size) return t;
  const std::uint32_t want = index < 8 ? 8 : index + index / 2 + 1;
  auto* entries = new Entry[want]();  // zeroed: gen 0, no value
  if (t == nullptr) {
    try {
      t = new Table;
    } catch (...) {
      delete[] entries;
      throw;
    }
    if (slot == &t_table) arm_thread_exit();
  } else {
    std::memcpy(entries, t->entries, t->size * sizeof(Entry));
    delete[] t->entries;
  }
  t->entries = entries;
  t->size = want;
  *slot = t;
  return t;
}

// Destroys every value of a table and frees it. A destructor may store values again (through
// other FiberLocals, or the same one): up to four rounds, as pthread's key destructors get; what
// a fifth round would find is left. Re-reads the slot after each destructor, which may have
// grown the table.
void destroy_values(void** slot) noexcept {
  for (int round = 0; round < 4 && *slot != nullptr; ++round) {
    bool any = false;
    for (std::uint32_t i = 0; *slot != nullptr && i < static_cast<Table*>(*slot)->size; ++i) {
      Entry& e = static_cast<Table*>(*slot)->entries[i];
      if (e.value == nullptr) continue;
      void* value = e.value;
      const FlsDestroy destroy = e.destroy;
      e.value = nullptr;
      destroy(value);
      any = true;
    }
    if (!any) break;
  }
  if (auto* t = static_cast<Table*>(*slot)) {
    *slot = nullptr;
    delete[] t->entries;
    delete t;
  }
}

}  // namespace

FlsKey fls_key_create() {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (!r.free.empty()) {
    const std::uint32_t index = r.free.back();
    r.free.pop_back();
    return {index, r.gens[index]};
  }
  r.gens.push_back(1);
  return {static_cast<std::uint32_t>(r.gens.size() - 1), 1};
}

void fls_key_delete(FlsKey key) noexcept {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  ++r.gens[key.index];  // values stored under `key` stop matching
  try {
    r.free.push_back(key.index);
  } catch (...) {
    // Out of memory: the slot is not reused. Its values still die with their fibers.
  }
}

void* fls_get(FlsKey key) noexcept {
  const auto* t = static_cast<const Table*>(*table_slot());
  if (t == nullptr || key.index >= t->size) return nullptr;
  const Entry& e = t->entries[key.index];
  return e.gen == key.gen ? e.value : nullptr;
}

void fls_set(FlsKey key, void* value, FlsDestroy destroy) {
  void** slot = table_slot();
  Table* t = table_with(slot, key.index);  // the only step that may throw
  // The value replaced (maybe a deleted key's, on this slot) goes first, out of the table, so
  // its destructor sees none; it may use FiberLocals, this one included, and grow the table.
  if (void* old = t->entries[key.index].value) {
    const FlsDestroy old_destroy = t->entries[key.index].destroy;
    t->entries[key.index].value = nullptr;
    old_destroy(old);
    t = table_with(slot, key.index);  // cannot throw: the table had room for `index`
  }
  Entry& e = t->entries[key.index];
  void* interloper = e.value;  // set by that destructor: replaced by `value` as well
  const FlsDestroy interloper_destroy = e.destroy;
  e = {key.gen, value, destroy};
  if (interloper != nullptr) interloper_destroy(interloper);
}

void fls_reset(FlsKey key) noexcept {
  auto* t = static_cast<Table*>(*table_slot());
  if (t == nullptr || key.index >= t->size) return;
  Entry& e = t->entries[key.index];
  if (e.gen != key.gen || e.value == nullptr) return;
  void* value = e.value;
  e.value = nullptr;
  e.destroy(value);
}

void fls_fiber_exit(Fiber* self) noexcept {
  destroy_values(&fls_word(self));
}

}  // namespace fiber::detail
