# Run by tests/gdb/check.sh after tools/gdb/libfiber.py, with $fiber_id set to a parked fiber.
#
# `fiber bt` must not rely on the fiber's top frame being an inline one (jump() inlined into
# Processor::switch_to): gdb ends a backtrace at a normal frame whose id is inner to (below) the
# frame it was unwound from, and fiber stacks usually lie below the main thread's. So unwind
# from the registers of a deeper, normal, frame of the fiber (Processor::park_current) as if
# they were its saved context, from the selected thread, and print that backtrace.
import gdb

fi = find_fiber(int(gdb.convenience_variable("fiber_id")))  # noqa: F821 (libfiber.py globals)
regs = None
with fiber_frames(_saved_registers(fi)) as ff:  # noqa: F821
    f = gdb.newest_frame()
    while f is not None and not (f.level() >= ff.first and f.type() == gdb.NORMAL_FRAME
                                 and (f.name() or "").endswith("Processor::park_current")):
        f = f.older()
    if f is None:
        raise gdb.GdbError("below_inline: no normal Processor::park_current frame in the fiber")
    regs = {r: int(f.read_register(r)) for r in ("rip", "rsp", "rbp", "rbx", "r12", "r13", "r14", "r15")}
for line in backtrace_from_registers(regs):  # noqa: F821
    gdb.write(line + "\n")
