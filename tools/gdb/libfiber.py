# gdb extension for libfiber: list the fibers of a live process or a core file and print the
# backtrace of a fiber that is not running.
#
#   (gdb) source tools/gdb/libfiber.py        # or: gdb -x tools/gdb/libfiber.py ...
#   (gdb) info fibers                         # the listed and running fibers of every scheduler
#   (gdb) fiber bt 42                         # backtrace of fiber #42 (parked or queued)
#   (gdb) fiber bt 42 -full                   # any `backtrace` options/count go through
#   (gdb) fiber bt all                        # every fiber that has a saved context
#
# Where the data comes from (all read through libfiber's debug info, no hard-coded offsets):
#   fiber_detail_schedulers (extern "C", sched/introspect.cpp): newest SchedulerImpl, linked by
#   next_scheduler_; SchedulerImpl::registry_.shards_ (std::vector<Shard>), each Shard's `head`
#   list linked by Fiber::reg_next; Fiber::{id, name, state, park_reason, last_processor (an
#   index into SchedulerImpl::processors_), ctx, stack, reg_shard}; Processor::{index_, tid_,
#   current_, loop_}. A fiber is listed from its first cancellation point or switch away to its
#   end; a processor's running fiber is shown whether listed or not. The rest - spawned and still
#   queued, with no stack or frames yet - is only counted (from the processors' spawned_ and
#   finished_ and the scheduler's foreign_spawned_, as live_fibers() does).
#
# `fiber bt` works on core files as well as on live processes because it changes nothing in the
# inferior: a Python unwinder (FiberUnwinder) takes over the unwinding of the selected thread's
# innermost non-inline frame and reports, as that frame's caller, the registers the fiber saved
# when it switched away. gdb's normal (DWARF) unwinding then walks the fiber's stack
# from there, and the command prints those frames only, renumbered from #0.
#
# The saved context of a switched-out fiber is Boost.Context's fcontext_t frame (x86-64 SysV,
# as jump_fcontext in Boost 1.74's jump_x86_64_sysv_elf_gas.S lays it out; libfiber's own jump,
# libfiber_jump_fcontext in libfiber/src/context/jump.cpp, keeps the same frame): the stack
# pointer after `lea -0x38(%rsp),%rsp`, pointing at
#   +0x00 mxcsr, +0x04 x87 cw, +0x08 r12, +0x10 r13, +0x18 r14, +0x20 r15, +0x28 rbx,
#   +0x30 rbp, +0x38 return address into the caller of the jump
# so the fiber resumes with pc = *(ctx+0x38) and rsp = ctx+0x40.
import re
import struct

import gdb
import gdb.unwinder

# FiberState and ParkReason are printed as fiber_state_name()/park_reason_name() do: the
# enumerator's name in lower case, except for these.
_ENUM_NAMES = {"BlockOn": "block_on"}
# Fallbacks by value if the enum types have no enumerators in the debug info (same order as the
# C++ enums in sched/fiber.hpp and fiber/detail/wait.hpp).
_STATES = ["created", "runnable", "running", "parking", "parked", "notified", "finished"]
_REASONS = ["none", "yield", "join", "sleep", "block_on", "waitgroup", "channel", "select", "mutex",
            "rwmutex", "condvar", "semaphore", "latch", "barrier", "once", "io", "blocking"]

# (name in the frame, byte offset in the fcontext frame) of the registers the jump saves.
_SAVED_REGS = [("r12", 0x08), ("r13", 0x10), ("r14", 0x18), ("r15", 0x20), ("rbx", 0x28), ("rbp", 0x30)]
_CTX_PC, _CTX_SIZE = 0x38, 0x40
_MAX_FIBERS_PER_SHARD = 10_000_000  # a corrupt (cyclic) list must not hang gdb


class FiberError(gdb.GdbError):
    pass


def _reports_gdb_errors(invoke):
    """Turns a gdb error while reading the runtime's data into a one-line command error."""
    def wrapper(self, arg, from_tty):
        try:
            return invoke(self, arg, from_tty)
        except gdb.GdbError:
            raise
        except (gdb.error, gdb.MemoryError) as e:
            raise gdb.GdbError("libfiber.py: %s (does this libfiber match tools/gdb/libfiber.py, "
                               "and is its debug info available?)" % e)
    wrapper.__doc__ = invoke.__doc__
    return wrapper


# ------------------------------------------------------------------------------ reading values

def _member(v, name):
    """v[name], also when the member lives in a base class gdb does not search."""
    try:
        return v[name]
    except gdb.error:
        for f in v.type.strip_typedefs().fields():
            if f.is_base_class:
                try:
                    return _member(v[f], name)
                except gdb.error:
                    pass
        raise


def _atomic(v):
    """The value inside a libstdc++ std::atomic<T> (T integral/enum/bool: _M_i; T*: _M_b._M_p)."""
    for path in (("_M_i",), ("_M_b", "_M_p"), ("_M_base", "_M_i")):
        try:
            x = v
            for p in path:
                x = _member(x, p)
            return x
        except gdb.error:
            continue
    return v  # not an atomic after all (or a layout we do not know): use the value itself


def _std_string(v):
    try:
        p = v["_M_dataplus"]["_M_p"]
        return p.string(length=int(v["_M_string_length"]))
    except (gdb.error, gdb.MemoryError):
        return str(v)


def _vector(v):
    impl = v["_M_impl"]
    start, finish = impl["_M_start"], impl["_M_finish"]
    n = int(finish - start) if int(start) else 0
    for i in range(n):
        yield (start + i).dereference()


def _uint(v):
    return int(v.cast(gdb.lookup_type("unsigned long")))


_enum_cache = {}


def _enum_name(v, fallback):
    """The lower-case name of enum value v, from its type's enumerators."""
    i = int(v)
    t = v.type.strip_typedefs()
    key = str(t)
    if key not in _enum_cache:
        names = {}
        if t.code == gdb.TYPE_CODE_ENUM:
            for f in t.fields():
                short = f.name.rsplit("::", 1)[-1]
                names[int(f.enumval)] = _ENUM_NAMES.get(short, short.lower())
        _enum_cache[key] = names
    names = _enum_cache[key]
    if i in names:
        return names[i]
    if not names and 0 <= i < len(fallback):
        return fallback[i]
    return "?(%d)" % i


# ------------------------------------------------------------------------------ the runtime

def _scheduler_list_head():
    sym = gdb.lookup_global_symbol("fiber_detail_schedulers")
    if sym is not None:
        return sym.value()
    try:
        v = gdb.parse_and_eval("fiber_detail_schedulers")
    except gdb.error as e:
        msg = str(e)
        if "unknown type" in msg:
            raise FiberError("libfiber has no debug info here (fiber_detail_schedulers has no type): "
                             "use a build with -g")
        raise FiberError("no libfiber in this program (or it is not loaded yet): %s" % msg)
    if v.type.strip_typedefs().code != gdb.TYPE_CODE_PTR:
        raise FiberError("fiber_detail_schedulers has an unexpected type (%s)" % v.type)
    return v


def schedulers():
    """Every live fiber::detail::SchedulerImpl (gdb.Value pointers), newest first."""
    s = _scheduler_list_head()
    seen = set()
    while int(s) != 0 and int(s) not in seen:
        seen.add(int(s))
        yield s
        s = s["next_scheduler_"]


def fibers(sched):
    """The listed fibers (gdb.Value Fiber*) of one scheduler, shard by shard, then the running
    fibers of its processors that are not listed (yet)."""
    for shard in _vector(sched["registry_"]["shards_"]):
        f = shard["head"]
        n = 0
        while int(f) != 0 and n < _MAX_FIBERS_PER_SHARD:
            yield f
            n += 1
            f = f["reg_next"]
    try:
        procs = _processors(sched)
    except (gdb.error, gdb.MemoryError):
        return
    for p in procs:
        if int(p) == 0:
            continue
        try:
            f = _atomic(p["current_"])
            if _uint(f) == 0 or _uint(f) == _uint(p["loop_"].address):
                continue
            if int(f["reg_shard"]) == 0xFFFF:  # Fiber::kUnlisted
                yield f
        except (gdb.error, gdb.MemoryError):
            continue


def _unique_ptr(u):
    """The pointer a libstdc++ std::unique_ptr holds: the tuple member (_M_head_impl) that is a
    pointer - the deleter's, in another base of the same tuple, has that name too."""
    def search(v):
        t = v.type.strip_typedefs()
        for f in t.fields():
            if f.is_base_class:
                found = search(v[f])
                if found is not None:
                    return found
            elif f.name == "_M_head_impl" and f.type.strip_typedefs().code == gdb.TYPE_CODE_PTR:
                return v[f]
        return None
    p = search(_member(u["_M_t"], "_M_t"))  # __uniq_ptr_impl's std::tuple<pointer, deleter>
    if p is None:
        raise gdb.error("unexpected std::unique_ptr layout")
    return p


def _processors(sched):
    """The Processor* of the scheduler's slots in use (null where one was never made)."""
    slots = int(_atomic(sched["slots_"]))
    return [_unique_ptr(u) for u in _vector(sched["processors_"])][:slots]


def live_count(sched):
    """Fibers spawned and not finished, queued ones included, from the processors' counters as
    SchedulerImpl::live_fibers() reads them; None if they cannot be read."""
    try:
        procs = _processors(sched)
        finished = sum(int(_atomic(p["finished_"])) for p in procs if int(p))
        spawned = int(_atomic(sched["foreign_spawned_"])) + sum(int(_atomic(p["spawned_"])) for p in procs if int(p))
        return max(spawned - finished, 0)
    except (gdb.error, gdb.MemoryError):
        return None


class FiberInfo:
    def __init__(self, sched, f):
        self.sched = sched
        self.ptr = f
        self.id = int(f["id"])
        name = f["name"]
        try:
            self.name = name.string() if int(name) else ""
        except gdb.MemoryError:
            self.name = "<unreadable %#x>" % int(name)
        self.state = _enum_name(_atomic(f["state"]), _STATES)
        self.reason = _enum_name(_atomic(f["park_reason"]), _REASONS)
        self.ctx = _uint(f["ctx"])
        index = int(_atomic(f["last_processor"]))  # kNeverRan (0xffff) before its first run
        self.processor = None
        self.processor_index = -1
        if index != 0xFFFF:
            self.processor_index = index
            self.processor = _unique_ptr(list(_vector(sched["processors_"]))[index])
        stack = f["stack"]
        self.stack_lo = _uint(stack["lo"])
        self.stack_size = int(stack["size"])
        # Still its processor's current fiber although no longer "running": a yield (or a move)
        # marks it runnable before it switches, so a core taken then - an abort on a stack
        # overflow found at that switch, say - has a saved context from its previous switch.
        self.is_current = False
        if self.processor is not None:
            try:
                self.is_current = _uint(_atomic(self.processor["current_"])) == _uint(f)
            except (gdb.error, gdb.MemoryError):
                pass

    @property
    def started(self):
        return self.processor is not None

    def running_thread(self):
        """(gdb thread, tid) of the processor thread running this fiber, or (None, tid)."""
        if self.processor is None:
            return None, 0
        tid = int(_atomic(self.processor["tid_"]))
        for t in gdb.selected_inferior().threads():
            if t.ptid[1] == tid or (t.ptid[1] == 0 and t.ptid[0] == tid):
                return t, tid
        return None, tid

    def saved_context_problem(self):
        """Why this fiber has no usable saved context, or None if ctx can be unwound."""
        if self.state == "running":
            t, tid = self.running_thread()
            where = "processor P%d" % self.processor_index
            if t is not None:
                where += ", gdb thread %d (LWP %d)" % (t.num, tid)
                hint = "`thread %d` then `bt`, or `thread apply %d bt`" % (t.num, t.num)
            else:
                hint = "the backtrace of that processor's thread"
                if tid:
                    where += ", LWP %d" % tid
            return "fiber #%d is running (%s): its saved context is stale; use %s" % (self.id, where, hint)
        if self.is_current:
            t, tid = self.running_thread()
            where = "processor P%d" % self.processor_index
            if t is not None:
                where += ", gdb thread %d" % t.num
            return ("fiber #%d is %s but still the current fiber of %s (caught in a switch): its saved "
                    "context may be stale; see that thread's backtrace" % (self.id, self.state, where))
        if not self.started or self.ctx == 0:
            return "fiber #%d has not started yet: there is no stack to show" % self.id
        if self.state in ("parking", "notified"):
            return ("fiber #%d is %s: it is in the middle of switching away, so its saved context is "
                    "not complete yet" % (self.id, self.state))
        if self.state not in ("parked", "runnable"):
            return "fiber #%d is %s" % (self.id, self.state)
        return None


def all_fibers():
    """FiberInfo of every started fiber: scheduler by scheduler (newest first), by id within one."""
    for s in schedulers():
        yield from sorted((FiberInfo(s, f) for f in fibers(s)), key=lambda fi: fi.id)


def find_fiber(fid):
    matches = [fi for fi in all_fibers() if fi.id == fid]
    if not matches:
        raise FiberError("no started fiber #%d (one still queued has no frames yet; see `info fibers`)" % fid)
    if len(matches) > 1:
        gdb.write("warning: %d fibers have id %d; using the one of scheduler '%s'\n"
                  % (len(matches), fid, _std_string(matches[0].sched["name_"])))
    return matches[0]


# ------------------------------------------------------------------------------ info fibers

class InfoFibers(gdb.Command):
    """List the fibers of every libfiber scheduler.

Usage: info fibers

For each scheduler (newest first), one line per listed fiber (one that has reached a
cancellation point or switched away) and per running one: its id, name, state, park reason
(for a parked fiber) and the index of the processor that last ran it. The rest, still queued,
are counted in one line.
A running fiber also names the gdb thread of its processor. Works on live processes and core
files. `fiber bt ID` prints the backtrace of one that is not running."""

    def __init__(self):
        super().__init__("info fibers", gdb.COMMAND_STATUS)

    @_reports_gdb_errors
    def invoke(self, arg, from_tty):
        if arg.strip():
            raise gdb.GdbError("info fibers takes no arguments")
        any_sched = False
        for s in schedulers():
            any_sched = True
            rows = []
            for f in fibers(s):
                try:
                    rows.append(FiberInfo(s, f))
                except (gdb.error, gdb.MemoryError) as e:
                    rows.append(e)
            sched = s.dereference()
            live = max(live_count(sched) or 0, len(rows))
            gdb.write("Scheduler '%s' (%s): %d live fibers, %d processors\n"
                      % (_std_string(sched["name_"]), s.format_string(raw=True, symbols=False),
                         live, int(sched["base_"])))
            if live > len(rows):
                gdb.write("  %d queued, not started yet\n" % (live - len(rows)))
            if not rows:
                continue
            rows.sort(key=lambda r: r.id if isinstance(r, FiberInfo) else -1)
            name_w = max([len("Name")] + [len(r.name) for r in rows if isinstance(r, FiberInfo)])
            gdb.write("  %8s  %-*s  %-9s  %-9s  %s\n" % ("Id", name_w, "Name", "State", "Reason", "Last P"))
            for r in rows:
                if not isinstance(r, FiberInfo):
                    gdb.write("  (unreadable fiber: %s)\n" % r)
                    continue
                waiting = r.state in ("parking", "parked", "notified")
                reason = r.reason if waiting else "-"
                proc = str(r.processor_index) if r.started else "-"
                extra = ""
                if r.state == "running":
                    t, tid = r.running_thread()
                    if t is not None:
                        extra = "  (gdb thread %d, LWP %d)" % (t.num, tid)
                    elif tid:
                        extra = "  (LWP %d)" % tid
                elif not r.started:
                    extra = "  (not started)"
                line = "  %8d  %-*s  %-9s  %-9s  %-6s%s" % (r.id, name_w, r.name, r.state, reason, proc, extra)
                gdb.write(line.rstrip() + "\n")
        if not any_sched:
            gdb.write("No libfiber scheduler is running.\n")


# ------------------------------------------------------------------------------ fiber bt

class _FrameId:
    def __init__(self, sp, pc):
        self.sp = sp
        self.pc = pc


class FiberUnwinder(gdb.unwinder.Unwinder):
    """While armed, gives the frame at `level` the fiber's saved registers as its caller's."""

    def __init__(self):
        super().__init__("libfiber")
        self.level = None
        self.regs = None  # {register name: int}

    def arm(self, level, regs):
        self.level, self.regs = level, regs

    def disarm(self):
        self.level = self.regs = None

    def __call__(self, pending_frame):
        if self.regs is None or pending_frame.level() != self.level:
            return None
        sp = pending_frame.read_register("rsp")
        pc = pending_frame.read_register("rip")
        # The frame's id: its real pc, but as its stack address the fiber's saved context,
        # just below the fiber's first frame. gdb stops a backtrace at a normal frame whose
        # id is inner to (below) the frame it was unwound from ("previous frame inner to this
        # frame"), and the fiber's stack may well lie below the thread's; only an inline top
        # frame (jump() inlined into switch_to) would otherwise hide that.
        frame_sp = gdb.Value(self.regs["rsp"] - _CTX_SIZE).cast(sp.type)
        info = pending_frame.create_unwind_info(_FrameId(frame_sp, pc))
        u64 = gdb.lookup_type("unsigned long")
        for name, value in self.regs.items():
            if name == "rip":
                v = gdb.Value(value).cast(pc.type)
            elif name == "rsp":
                v = gdb.Value(value).cast(sp.type)
            else:
                v = gdb.Value(value).cast(u64)
            info.add_saved_register(name, v)
        return info


_unwinder = FiberUnwinder()
gdb.unwinder.register_unwinder(None, _unwinder, replace=True)


def _saved_registers(fi):
    mem = bytes(gdb.selected_inferior().read_memory(fi.ctx, _CTX_SIZE))
    words = struct.unpack("<8Q", mem)
    regs = {name: words[off // 8] for name, off in _SAVED_REGS}
    regs["rip"] = words[_CTX_PC // 8]
    regs["rsp"] = fi.ctx + _CTX_SIZE
    return regs


_FRAME_LINE = re.compile(r"^#(\d+)\s+")
# The frame below make_fcontext's trampoline: a zero return address, not part of the fiber.
_NULL_FRAME = re.compile(r"^#\d+\s+0x0+ in \?\? \(\)$")


class fiber_frames:
    """Context manager: while active, the selected thread's frames at levels >= `first` are
    those of a stack switched out with registers REGS ({name: int}: rip, rsp, rbp, rbx,
    r12..r15). Frames below `first` are the thread's own innermost ones (the frame the unwinder
    hooks and the inline frames inside it); `first` is set on entry. Restores the selected
    frame on exit. Changes nothing in the inferior, so it works on core files."""

    def __init__(self, regs):
        self.regs = regs
        self.first = None

    def __enter__(self):
        if gdb.selected_thread() is None:
            raise FiberError("no thread selected (no process or core file?)")
        try:
            self.selected_level = gdb.selected_frame().level()
        except gdb.error:
            self.selected_level = 0
        # Hook the innermost non-inline frame: inline frames are not unwound by unwinders.
        f = gdb.newest_frame()
        while f.type() == gdb.INLINE_FRAME and f.older() is not None:
            f = f.older()
        anchor = f.level()
        self.first = anchor + 1
        _unwinder.arm(anchor, self.regs)
        gdb.invalidate_cached_frames()
        return self

    def __exit__(self, *exc):
        _unwinder.disarm()
        gdb.invalidate_cached_frames()
        try:
            f = gdb.newest_frame()
            for _ in range(self.selected_level):
                if f.older() is None:
                    break
                f = f.older()
            f.select()
        except gdb.error:
            pass
        return False


def backtrace_from_registers(regs, bt_args=()):
    """The text of `backtrace BT_ARGS` for the stack REGS describe, frames numbered from #0."""
    with fiber_frames(regs) as ff:
        skip = ff.first
        # `backtrace` wants its options and qualifiers before the count. A positive count
        # ("fiber bt 3 5") counts the fiber's frames: shift it past the thread's own.
        options = [a for a in bt_args if not re.fullmatch(r"-?\d+", a)]
        counts = [str(int(a) + skip) if int(a) > 0 else a for a in bt_args if re.fullmatch(r"-?\d+", a)]
        try:
            text = gdb.execute("backtrace " + " ".join(options + counts), to_string=True)
        except gdb.error as e:
            raise gdb.GdbError("fiber bt: %s" % e)

    out = []
    keep = False
    for line in text.splitlines():
        m = _FRAME_LINE.match(line)
        if m:
            n = int(m.group(1))
            keep = n >= skip and not _NULL_FRAME.match(line)
            if keep:
                line = "#%-2d " % (n - skip) + line[m.end():]
        elif line.startswith("(More stack frames follow...)") or line.startswith("Backtrace stopped"):
            keep = True
        if keep:
            out.append(line)
    return out


def fiber_backtrace(fi, bt_args=()):
    """The text of `backtrace BT_ARGS` for a fiber with a saved context, frames renumbered."""
    if fi.stack_lo and not (fi.stack_lo <= fi.ctx < fi.stack_lo + fi.stack_size):
        gdb.write("warning: fiber #%d's saved context %#x is outside its stack [%#x, %#x)\n"
                  % (fi.id, fi.ctx, fi.stack_lo, fi.stack_lo + fi.stack_size))
    out = backtrace_from_registers(_saved_registers(fi), bt_args)
    if not out:
        out.append("(no frames: could not unwind from the saved context at %#x)" % fi.ctx)
    return "\n".join(out) + "\n"


class FiberPrefix(gdb.Command):
    """Commands for libfiber fibers (see also `info fibers`).

fiber bt ID [BACKTRACE-OPTIONS...] -- backtrace of fiber ID (parked or queued)
fiber bt all [BACKTRACE-OPTIONS...] -- backtraces of every fiber that is not running"""

    def __init__(self):
        super().__init__("fiber", gdb.COMMAND_STACK, gdb.COMPLETE_COMMAND, prefix=True)


class FiberBt(gdb.Command):
    """Print the backtrace of a fiber that is not running.

Usage: fiber bt ID [COUNT] [-full] [other `backtrace` options]
       fiber bt all [...]

ID is the fiber id shown by `info fibers` (fiber::this_fiber::id()). The fiber must be switched
out (parked, or queued after running); its frames are unwound from the registers it saved
when it switched away, so this works on core files too. A running fiber's frames are on its
processor's thread: `info fibers` names that thread. COUNT and the options are those of
`backtrace` (e.g. `fiber bt 7 -full` for locals), counted in the fiber's frames."""

    def __init__(self):
        super().__init__("fiber bt", gdb.COMMAND_STACK)

    @_reports_gdb_errors
    def invoke(self, arg, from_tty):
        argv = gdb.string_to_argv(arg)
        if not argv:
            raise gdb.GdbError("usage: fiber bt ID|all [backtrace options]")
        target, bt_args = argv[0], argv[1:]
        if target == "all":
            shown = 0
            for fi in all_fibers():
                problem = fi.saved_context_problem()
                label = "Fiber #%d%s (%s%s)" % (fi.id, " '%s'" % fi.name if fi.name else "", fi.state,
                                                " on " + fi.reason if fi.state == "parked" else "")
                gdb.write("\n%s:\n" % label)
                if problem:
                    gdb.write("  %s\n" % problem)
                    continue
                try:
                    gdb.write(fiber_backtrace(fi, bt_args))
                    shown += 1
                except (gdb.error, gdb.MemoryError) as e:
                    gdb.write("  cannot unwind: %s\n" % e)
            if shown == 0:
                gdb.write("(no fiber with a saved context)\n")
            return
        try:
            fid = int(target, 0)
        except ValueError:
            raise gdb.GdbError("fiber bt: '%s' is not a fiber id (see `info fibers`)" % target)
        fi = find_fiber(fid)
        problem = fi.saved_context_problem()
        if problem:
            raise FiberError(problem)
        try:
            gdb.write(fiber_backtrace(fi, bt_args))
        except gdb.MemoryError as e:
            raise FiberError("fiber #%d: cannot read its saved context at %#x: %s" % (fi.id, fi.ctx, e))


InfoFibers()
FiberPrefix()
FiberBt()
