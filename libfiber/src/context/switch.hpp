// The switch layer: one raw fcontext jump (Boost.Context's frame, our jump: context/jump.cpp),
// plus the sanitizer bookkeeping that Boost's fcontext backend does not do itself.
//
// A context is only a saved stack pointer (fcontext_t). jump() passes one pointer to the context
// it resumes; that side learns the context it came from through the returned Transfer. Everything
// else (which fiber, what to do after the switch) is the scheduler's business, see
// sched/processor.cpp.
#pragma once

#include <boost/context/detail/fcontext.hpp>
#include <pthread.h>

#include <cstddef>
#include <mutex>
#include <vector>

#if defined(FIBER_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(FIBER_TSAN)
#include <sanitizer/tsan_interface.h>
#endif
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define FIBER_HAVE_VALGRIND 1
#endif

// TSan only: a function it does not instrument (no shadow-stack entry, no checked accesses), and
// one kept out of line so that it stays instrumented when called from such a function. See
// Processor::fiber_main.
#if defined(FIBER_TSAN)
#define FIBER_TSAN_UNINSTRUMENTED __attribute__((no_sanitize("thread")))
#define FIBER_TSAN_OUT_OF_LINE __attribute__((noinline))
#else
#define FIBER_TSAN_UNINSTRUMENTED
#define FIBER_TSAN_OUT_OF_LINE
#endif

namespace fiber::detail {

using RawContext = boost::context::detail::fcontext_t;
using Transfer = boost::context::detail::transfer_t;
using EntryFn = void (*)(Transfer);

inline RawContext make_context(void* stack_top, std::size_t size, EntryFn fn) noexcept {
  return boost::context::detail::make_fcontext(stack_top, size, fn);
}

#if defined(__x86_64__) && defined(__linux__)
// Boost's jump with `ret` for its `jmp`: see context/jump.cpp.
#define FIBER_OWN_JUMP 1
extern "C" Transfer libfiber_jump_fcontext(RawContext to, void* data) noexcept;
#endif

#if defined(FIBER_TSAN)
// TSan fiber contexts are expensive to create (each allocates and clears a vector clock), so
// they are recycled: pool(nullptr) takes one, pool(f) gives f back. Every switch synchronises
// (flags 0), so a recycled context carries no ordering a fresh one would not get anyway.
// Never destroyed, like the global scheduler: its processors may still finish fibers while
// static destructors run at exit.
inline void* tsan_fiber_pool(void* give_back) noexcept {
  struct Pool {
    std::mutex mu;
    std::vector<void*> free;
  };
  static Pool* const pool = new Pool;
  std::lock_guard lock(pool->mu);
  if (give_back) {
    pool->free.push_back(give_back);
    return nullptr;
  }
  if (pool->free.empty()) return __tsan_create_fiber(0);
  void* f = pool->free.back();
  pool->free.pop_back();
  return f;
}
#endif

// What a sanitizer needs to know about one execution stack (a fiber's, or a processor thread's
// own stack). Empty in plain builds, so the fast path carries nothing.
struct SanitizerStack {
#if defined(FIBER_ASAN)
  const void* bottom = nullptr;  // lowest address
  std::size_t size = 0;
  void* fake_stack = nullptr;    // ASan's fake-stack handle saved across a switch
#endif
#if defined(FIBER_TSAN)
  void* tsan_fiber = nullptr;    // __tsan_create_fiber, or the thread's own for a loop context
  bool owns_tsan_fiber = false;
#endif
#if defined(FIBER_HAVE_VALGRIND)
  unsigned valgrind_id = 0;
#endif

  // Called once when a fiber stack is created / destroyed.
  void on_create(void* lo, std::size_t sz) noexcept {
    (void)lo;
    (void)sz;
#if defined(FIBER_ASAN)
    bottom = lo;
    size = sz;
#endif
#if defined(FIBER_TSAN)
    tsan_fiber = tsan_fiber_pool(nullptr);
    owns_tsan_fiber = true;
#endif
#if defined(FIBER_HAVE_VALGRIND)
    valgrind_id = VALGRIND_STACK_REGISTER(lo, static_cast<char*>(lo) + sz);
#endif
  }
  void on_destroy() noexcept {
#if defined(FIBER_ASAN)
    // A finished fiber's last frames never return, so their redzones are still poisoned; the
    // stack is recycled, so clear them before another fiber's frames land there.
    if (bottom) __asan_unpoison_memory_region(bottom, size);
#endif
#if defined(FIBER_TSAN)
    if (owns_tsan_fiber) tsan_fiber_pool(tsan_fiber);
    tsan_fiber = nullptr;
    owns_tsan_fiber = false;
#endif
#if defined(FIBER_HAVE_VALGRIND)
    if (valgrind_id) VALGRIND_STACK_DEREGISTER(valgrind_id);
    valgrind_id = 0;
#endif
  }
  // For a processor thread's own stack (the scheduler loop context).
  void on_thread() noexcept {
#if defined(FIBER_ASAN)
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* lo = nullptr;
      std::size_t sz = 0;
      pthread_attr_getstack(&attr, &lo, &sz);
      pthread_attr_destroy(&attr);
      bottom = lo;
      size = sz;
    }
#endif
#if defined(FIBER_TSAN)
    tsan_fiber = __tsan_get_current_fiber();
    owns_tsan_fiber = false;
#endif
  }
};

// Jump from the running stack `from` to the suspended context `to` (whose stack is `to_stack`).
// `dying` says the running stack will never be resumed (ASan then frees its fake frames).
// Returns the Transfer delivered by whoever resumes `from` later. Always inline: a dying fiber's
// last jump never returns, and an out-of-line copy would be one more frame it never leaves.
[[gnu::always_inline]] inline Transfer jump(RawContext to, SanitizerStack& from, SanitizerStack& to_stack,
                                            void* data, bool dying = false) noexcept {
  (void)from;
  (void)to_stack;
  (void)dying;
#if defined(FIBER_ASAN)
  __sanitizer_start_switch_fiber(dying ? nullptr : &from.fake_stack, to_stack.bottom, to_stack.size);
#endif
#if defined(FIBER_TSAN)
  __tsan_switch_to_fiber(to_stack.tsan_fiber, 0);
#endif
#if defined(FIBER_OWN_JUMP)
  Transfer t = libfiber_jump_fcontext(to, data);
#else
  Transfer t = boost::context::detail::jump_fcontext(to, data);
#endif
#if defined(FIBER_ASAN)
  // Back on `from`: learn nothing about the stack we came from (it recorded its own bounds).
  __sanitizer_finish_switch_fiber(from.fake_stack, nullptr, nullptr);
#endif
  return t;
}

// First thing a brand-new context does: complete the sanitizer half of the switch into it.
// `prev` is the stack we came from; for a thread's loop stack we record its bounds here, since
// ASan only reports them on the first switch away from it.
inline void on_first_entry(SanitizerStack& prev) noexcept {
  (void)prev;
#if defined(FIBER_ASAN)
  const void* bottom = nullptr;
  std::size_t size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
  if (prev.bottom == nullptr) {
    prev.bottom = bottom;
    prev.size = size;
  }
#endif
}

}  // namespace fiber::detail
