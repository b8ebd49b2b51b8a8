// FiberLocal<T>: a variable with one value per fiber, where thread_local would go wrong.
//
//   fiber::FiberLocal<std::string> request_id;      // usually a global or a static member
//
//   void handle(Request& r) {                       // runs in a fiber, one per request
//     *request_id = r.id();                         // this fiber's value
//     backend.call(r);                              // parks; may resume on another thread
//     log("done", *request_id);                     // still this fiber's value
//   }
//
// A fiber may resume on another processor thread after any call that parks, so a thread_local
// seen before the call and after it are two different objects (libfiber/README.md, "Migration").
// A FiberLocal follows the fiber instead. It is Boost.Fiber's fiber_specific_ptr and Tokio's
// task_local, with thread_local's lazy default construction:
//
// - Each fiber's value is made on its first get() (default-constructed) or emplace(), and is
//   destroyed on the fiber once its function has returned or thrown: for a fiber spawned with a
//   JoinHandle before join() can return; for a detached one (`go`) after the unhandled-exception
//   handler, which still sees them, and before block_on stops waiting for it. A destructor run
//   there may use FiberLocals; the values it makes are destroyed too (in up to four rounds, as
//   pthread keys; what a fifth round would find is left). A destructor must not throw, and one
//   that blocks in a cancelled fiber gets fiber::Cancelled as any blocking call there does.
// - On a plain thread (main, or any std::thread) the value belongs to the thread and is
//   destroyed when the thread exits, after its thread_local objects (a value one of their
//   destructors makes included); the main thread's when exit() destroys its thread_locals.
//   Code run by fiber::blocking() is on a helper thread, and sees that thread's values.
// - A value is reached only by its own fiber (or thread): no locking, and none needed. Handing
//   out a pointer to it is the caller's business, as with any object.
// - Destroying a FiberLocal (typically at exit) makes every value it still has unreachable; each
//   is destroyed when its fiber or thread ends. A new FiberLocal never sees an old one's values.
//
// get()/emplace() allocate (the value, and the first time a fiber uses a FiberLocal its table):
// they throw std::bad_alloc when memory runs out, with nothing changed. get() on a value already
// made costs a few loads and three calls (the runtime's, to find the calling fiber). The table's
// pointer takes 16 bytes at the top of every fiber's stack.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <utility>

#include "fiber/config.hpp"

namespace fiber {

namespace detail {

// A FiberLocal's key: a slot in every fiber's table, and the slot's generation when the key was
// made (a slot is reused after its key is deleted; values of the old key then no longer match).
struct FlsKey {
  std::uint32_t index;
  std::uint64_t gen;
};
using FlsDestroy = void (*)(void*) noexcept;

FIBER_API FlsKey fls_key_create();
FIBER_API void fls_key_delete(FlsKey key) noexcept;
// The calling fiber's (or plain thread's) value for `key`, nullptr if none.
FIBER_API void* fls_get(FlsKey key) noexcept;
// Makes `value` the caller's value for `key`, to be destroyed with `destroy`; destroys the value
// it replaces. Throws std::bad_alloc (nothing changed, `value` not taken) if the table cannot grow.
FIBER_API void fls_set(FlsKey key, void* value, FlsDestroy destroy);
// Destroys the caller's value for `key`, if it has one.
FIBER_API void fls_reset(FlsKey key) noexcept;

}  // namespace detail

template <typename T>
class FiberLocal {
 public:
  FiberLocal() : key_(detail::fls_key_create()) {}
  ~FiberLocal() { detail::fls_key_delete(key_); }
  FiberLocal(const FiberLocal&) = delete;
  FiberLocal& operator=(const FiberLocal&) = delete;

  // The caller's value, default-constructed on the first call in this fiber (or thread).
  T& get()
    requires std::default_initializable<T>
  {
    if (T* p = get_if()) return *p;
    return emplace();
  }
  T& operator*()
    requires std::default_initializable<T>
  {
    return get();
  }
  T* operator->()
    requires std::default_initializable<T>
  {
    return &get();
  }

  // The caller's value, or nullptr if it has none yet (or reset it).
  T* get_if() const noexcept { return static_cast<T*>(detail::fls_get(key_)); }
  bool has_value() const noexcept { return get_if() != nullptr; }

  // Makes the caller's value T(args...), destroying the one it had (whose destructor sees none,
  // and whatever it stores here is replaced too). If T's constructor throws, the old value stays.
  template <typename... Args>
  T& emplace(Args&&... args) {
    auto value = std::make_unique<T>(std::forward<Args>(args)...);
    detail::fls_set(key_, value.get(), &destroy);
    return *value.release();
  }

  // Destroys the caller's value now, if it has one; the next get() makes a new one.
  void reset() noexcept { detail::fls_reset(key_); }

 private:
  static void destroy(void* p) noexcept { delete static_cast<T*>(p); }

  const detail::FlsKey key_;
};

}  // namespace fiber
