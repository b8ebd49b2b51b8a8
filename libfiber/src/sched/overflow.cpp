// Stack overflow reports. A fiber that runs off the bottom of a guarded stack faults on the
// guard page; the SIGSEGV handler - on an alternate signal stack, since the fiber's stack is
// exhausted - sees that the address is the guard page of the fiber running on this thread,
// writes one line naming the fiber (id, name, stack size) and aborts. Any other fault goes to
// the handler that was installed before ours (or the default action: a core dump), as if we were
// not there. Unguarded stacks are checked by the red zone at every switch instead
// (Processor::check_stack -> report_stack_overflow).
//
// Not under AddressSanitizer, which owns SIGSEGV and reports stack overflows itself.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>

#include "sched/fiber.hpp"
#include "sched/processor.hpp"
#include "sched/runtime.hpp"

namespace fiber::detail {
namespace {

constexpr std::size_t kAltStack = 64 * 1024;
struct sigaction g_previous_segv {}, g_previous_bus {};
std::size_t g_page = 4096;

// The fiber this thread runs, if any: safe in a signal handler (a TLS read and a load).
const Fiber* faulting_fiber() noexcept {
  Processor* p = current_processor();
  if (p == nullptr) return nullptr;
  const Fiber* f = p->current();
  return (f == nullptr || f->is_loop) ? nullptr : f;
}

void chain(const struct sigaction& prev, int sig, siginfo_t* info, void* uc) {
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) {
      prev.sa_sigaction(sig, info, uc);
      return;
    }
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler != nullptr) {
    prev.sa_handler(sig);
    return;
  }
  // Default action: restore it; returning re-executes the faulting instruction, which then
  // takes the default (a core dump) with the original state intact.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
}

// Unused in sanitizer builds, which keep their own SIGSEGV handler.
[[maybe_unused]] void on_fault(int sig, siginfo_t* info, void* uc) {
  const Fiber* f = faulting_fiber();
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (f != nullptr && f->stack) {
    // Guarded: the guard page. Unguarded: whatever lies just below (unmapped, or protected) -
    // an overflow that the red zone check at the next switch would otherwise have caught.
    const bool guarded = f->stack.kind == StackKind::Guarded;
    const auto lo = reinterpret_cast<uintptr_t>(f->stack.lo);
    const uintptr_t below = guarded ? g_page : 64 * 1024;
    if (addr >= lo - below && addr < lo + kRedZone) {
      report_stack_overflow(f, guarded ? "it touched its guard page" : "it touched the memory below its stack");
    }
  }
  chain(sig == SIGBUS ? g_previous_bus : g_previous_segv, sig, info, uc);
}

}  // namespace

void* install_overflow_handler_on_this_thread() noexcept {
#if !defined(FIBER_ASAN) && !defined(__SANITIZE_ADDRESS__) && !defined(FIBER_TSAN) && !defined(__SANITIZE_THREAD__)
  static std::once_flag once;
  std::call_once(once, [] {
    g_page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    struct sigaction act {};
    act.sa_sigaction = on_fault;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigaction(SIGSEGV, &act, &g_previous_segv);
    sigaction(SIGBUS, &act, &g_previous_bus);
  });
  // This thread's alternate stack, unless it has one already (the program's own).
  stack_t cur{};
  if (sigaltstack(nullptr, &cur) == 0 && !(cur.ss_flags & SS_DISABLE)) return nullptr;
  void* mem = mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return nullptr;
  stack_t ss{};
  ss.ss_sp = mem;
  ss.ss_size = kAltStack;
  if (sigaltstack(&ss, nullptr) != 0) {
    munmap(mem, kAltStack);
    return nullptr;
  }
  return mem;
#else
  return nullptr;
#endif
}

void remove_overflow_altstack(void* mem) noexcept {
  if (mem == nullptr) return;
  stack_t ss{};
  ss.ss_flags = SS_DISABLE;
  sigaltstack(&ss, nullptr);
  munmap(mem, kAltStack);
}

}  // namespace fiber::detail
