# Run by tests/gdb/check.sh after tools/gdb/libfiber.py, with $fiber_id set to a parked fiber.
#
# `fiber bt` must not rely on the fiber's top frame being an inline one (jump() inlined into
# Processor::switch_to): gdb ends a backtrace at a normal frame whose id is inner to (below) the
# frame it was unwound from, and fiber stacks usually lie below the main thread's. So unwind
# from the registers of a deeper, normal, frame of the fiber as if they were its saved context,
# from the selected thread, and print that backtrace. The frame must be one whose pc is outside
# any inlined function (its newer frame is a normal one), or the backtrace starts with inline
# frames again: the library's parking frames all have their switch inline, so it is the target's
# park_here_alpha, which calls recv_in_alpha (gdb_target.cpp).
import gdb

fi = find_fiber(int(gdb.convenience_variable("fiber_id")))  # noqa: F821 (libfiber.py globals)
regs = None
with fiber_frames(_saved_registers(fi)) as ff:  # noqa: F821
    f = gdb.newest_frame()
    while f is not None and not (f.level() > ff.first and f.type() == gdb.NORMAL_FRAME
                                 and f.newer().type() == gdb.NORMAL_FRAME):
        f = f.older()
    if f is None:
        raise gdb.GdbError("below_inline: no normal frame called from outside an inline one in the fiber")
    regs = {r: int(f.read_register(r)) for r in ("rip", "rsp", "rbp", "rbx", "r12", "r13", "r14", "r15")}
for line in backtrace_from_registers(regs):  # noqa: F821
    gdb.write(line + "\n")
