// The context switch itself: save the callee-saved state on the running stack, load another
// stack's, resume it. The frame is Boost.Context's fcontext frame (x86-64 SysV, Boost 1.74's
// jump_x86_64_sysv_elf_gas.S), so make_fcontext makes the contexts and tools/gdb/libfiber.py
// reads them unchanged:
//
//   ctx+0x00 MXCSR, +0x04 x87 control word, +0x08 r12, +0x10 r13, +0x18 r14, +0x20 r15,
//   +0x28 rbx, +0x30 rbp, +0x38 return address
//
// One difference: Boost leaves with `jmp *%r8` to the saved return address, we with `ret`.
// The CPU predicts returns from a stack of the return addresses of calls it has seen. A `jmp`
// pops nothing from it, so after a switch every return of the resumed fiber was predicted with
// the entry meant for the one before it, and missed: several mispredicted returns per switch.
// With `ret` the switch's own return pops its own call's entry, whose address is the resumed
// fiber's too (every fiber parks through the same switch_to), and returns further up are
// predicted right as long as the two fibers' call chains agree, as they do when both park in
// the same kind of call (a channel ping-pong, a yield loop). Measured on this machine, two
// contexts switching under a 4-deep call chain: 29 ns per switch with Boost's jump, 14 with
// this one. A new context's first `ret` lands on make_fcontext's trampoline, as Boost's jump
// would.
//
// The MXCSR and x87 control words stay per fiber, as with Boost (the SysV ABI makes their
// control bits callee-saved): a fiber that changes the rounding mode keeps it to itself. Unlike
// Boost, the resumed context's words are loaded only when their control bits differ from the
// ones just saved (MXCSR bits 6-15, the whole x87 word), which is almost never: ldmxcsr and
// fldcw took 11.5 cycles a switch on this machine (a loop of the pair against one of the saves
// alone), the compares are a few plain instructions. The MXCSR's status bits (0-5, the sticky
// exception flags) are caller-saved, so no fiber may count on them across the call that
// switched; Boost loaded the resumed context's stale ones, this leaves the thread's.
#include "context/switch.hpp"

#if defined(__x86_64__) && defined(__linux__)
// A naked function rather than a top-level asm block: link-time optimisation sees its symbol.
// On a cache line of its own start: where the linker happened to put it, unrelated code
// elsewhere in the library moved it, and the yield benchmark with it, by 15% (9.6 -> 11.1 ns
// per switch when io.cpp grew at 579d466, the switch 48 bytes into a line; 10.4 both ways
// once aligned, medians of 7 interleaved runs).
extern "C" [[gnu::naked, gnu::noinline, gnu::aligned(64)]] fiber::detail::Transfer libfiber_jump_fcontext(fiber::detail::RawContext,
                                                                                    void*) noexcept {
  asm(R"(
  leaq -0x38(%rsp), %rsp
  stmxcsr (%rsp)
  fnstcw 0x4(%rsp)
  movq %r12, 0x8(%rsp)
  movq %r13, 0x10(%rsp)
  movq %r14, 0x18(%rsp)
  movq %r15, 0x20(%rsp)
  movq %rbx, 0x28(%rsp)
  movq %rbp, 0x30(%rsp)
  movq %rsp, %rax
  movq %rdi, %rsp
  movl (%rsp), %ecx
  xorl (%rax), %ecx
  testl $0xffc0, %ecx
  jnz 1f
  movzwl 0x4(%rsp), %ecx
  cmpw 0x4(%rax), %cx
  jne 1f
2:
  movq 0x8(%rsp), %r12
  movq 0x10(%rsp), %r13
  movq 0x18(%rsp), %r14
  movq 0x20(%rsp), %r15
  movq 0x28(%rsp), %rbx
  movq 0x30(%rsp), %rbp
  leaq 0x38(%rsp), %rsp
  movq %rsi, %rdx
  movq %rax, %rdi
  ret
1:
  ldmxcsr (%rsp)
  fldcw 0x4(%rsp)
  jmp 2b
)");
}
#endif
