#!/usr/bin/env bash
# tools/gdb/libfiber.py against a live process and a core file of tests/gdb/gdb_target.
#
#   check.sh PROGRAM SCRIPT [GDB]
#
# Starts PROGRAM, waits for "ready", attaches gdb (loading SCRIPT with `source`), checks
# `info fibers` and `fiber bt` and writes a core file from the same session
# (generate-core-file); then kills PROGRAM and runs the same checks on the core (loading SCRIPT
# with -x). Exit 0: passed, 1: failed, 77: skipped (no gdb with Python, ptrace not permitted).
set -u

PROGRAM=${1:?usage: check.sh PROGRAM SCRIPT [GDB]}
SCRIPT=${2:?usage: check.sh PROGRAM SCRIPT [GDB]}
GDB=${3:-gdb}
SKIP=77
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

unset DEBUGINFOD_URLS  # never go to the network for symbols
GDB_FLAGS=(-nx -batch -iex "set debuginfod enabled off" -iex "set pagination off" -iex "set width 0")

skip() { echo "SKIP: $*"; exit $SKIP; }
fail() { echo "FAIL: $*"; exit 1; }

command -v "$GDB" >/dev/null 2>&1 || skip "no gdb"
"$GDB" "${GDB_FLAGS[@]}" -ex "python print('py-ok')" 2>/dev/null | grep -q py-ok || skip "gdb has no Python"
if [ -r /proc/sys/kernel/yama/ptrace_scope ] && [ "$(cat /proc/sys/kernel/yama/ptrace_scope)" = 3 ]; then
  skip "ptrace is disabled (kernel.yama.ptrace_scope = 3)"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/libfiber-gdb.XXXXXX") || fail "mktemp"
PID=
cleanup() {
  if [ -n "$PID" ]; then kill -9 "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# ---- start the program and wait until every fiber is where it should be
# FIBER_GUARDED_STACKS: PROT_NONE guard pages, not guard markers. gdb's generate-core-file
# reads each mapping through /proc/PID/mem, a read that touches a guard marker fails, and gdb
# leaves the stacks around it out of the core (libfiber/README.md, "Stacks").
FIBER_GUARDED_STACKS=1024 "$PROGRAM" >"$WORK/out" 2>"$WORK/err" &
PID=$!
for _ in $(seq 200); do
  grep -qx ready "$WORK/out" && break
  kill -0 "$PID" 2>/dev/null || { cat "$WORK/out" "$WORK/err"; fail "the program exited early"; }
  sleep 0.1
done
grep -qx ready "$WORK/out" || { cat "$WORK/out" "$WORK/err"; fail "the program did not print 'ready' in 20 s"; }
id_of() { sed -n "s/^$1=\([0-9][0-9]*\)$/\1/p" "$WORK/out"; }
ALPHA=$(id_of alpha-waiter); BETA=$(id_of beta-sleeper); GAMMA=$(id_of gamma); DELTA=$(id_of delta-runner)
if [ -z "$ALPHA" ] || [ -z "$BETA" ] || [ -z "$GAMMA" ] || [ -z "$DELTA" ]; then
  cat "$WORK/out"
  fail "missing fiber ids"
fi
echo "fibers: alpha-waiter=#$ALPHA beta-sleeper=#$BETA (unnamed)=#$GAMMA delta-runner=#$DELTA"

# The commands run in both sessions; "@@name" lines split the output into sections.
COMMANDS=(
  -ex "echo @@info\n" -ex "info fibers"
  -ex "echo @@alpha\n" -ex "fiber bt $ALPHA"
  -ex "echo @@beta\n" -ex "fiber bt $BETA"
  -ex "echo @@gamma\n" -ex "fiber bt $GAMMA full"
  -ex "echo @@delta\n" -ex "fiber bt $DELTA"
  -ex "echo @@missing\n" -ex "fiber bt 987654321"
  -ex "echo @@count\n" -ex "fiber bt $ALPHA 2 -frame-arguments none"
  -ex "echo @@thread-bt\n" -ex "bt"
  -ex "echo @@all\n" -ex "fiber bt all"
  -ex "echo @@current\n" -ex "python print('current:', *[fi.id for fi in all_fibers() if fi.is_current])"
  -ex "echo @@below-inline\n" -ex "set \$fiber_id = $ALPHA" -x "$HERE/below_inline.py"
  -ex "echo @@end\n"
)

section() {  # section FILE NAME: the lines between "@@NAME" and the next "@@"
  awk -v want="@@$2" '/^@@/ { on = ($0 == want); next } on' "$1"
}

FAILED=0
expect() {  # expect WHAT FILE SECTION ERE: SECTION of FILE has a line matching ERE
  if ! section "$2" "$3" | grep -Eq -- "$4"; then
    echo "  FAIL [$1] section '$3' has no line matching: $4"
    FAILED=1
  fi
}
reject() {  # reject WHAT FILE SECTION ERE: no line of SECTION matches ERE
  if section "$2" "$3" | grep -Eq -- "$4"; then
    echo "  FAIL [$1] section '$3' has a line matching: $4"
    FAILED=1
  fi
}

check_output() {  # check_output WHAT FILE
  local what=$1 f=$2
  expect "$what" "$f" info "^Scheduler 'gdbtest' \(0x[0-9a-f]+\): 5 live fibers, 2 processors$"
  expect "$what" "$f" info "^  1 queued, not started yet$"
  expect "$what" "$f" info "^ +Id +Name +State +Reason +Last P$"
  expect "$what" "$f" info "^ +$ALPHA +alpha-waiter +parked +channel +[01]$"
  expect "$what" "$f" info "^ +$BETA +beta-sleeper +parked +sleep +[01]$"
  expect "$what" "$f" info "^ +$GAMMA +parked +join +[01]$"
  expect "$what" "$f" info "^ +$DELTA +delta-runner +running +- +[01] +\(gdb thread [0-9]+, LWP [0-9]+\)$"
  # alpha: parked in a Channel recv called from park_here_alpha, frames renumbered from #0,
  # ending in the fiber's entry point; none of the attached thread's own frames.
  expect "$what" "$f" alpha "^#0  0x[0-9a-f]+ in .*(jump|switch_to)"
  expect "$what" "$f" alpha "^#[0-9]+ .*fiber::detail::Processor::park_current \("
  # The reason shows on a frame of the parking path (park_current's own `why` may be optimised
  # out when link-time optimisation inlines its callers' argument away).
  expect "$what" "$f" alpha "^#[0-9]+ .*fiber::detail::.*(park_current|fiber_wait|waiter_wait(_until)?) \(.*why=.*Channel"
  expect "$what" "$f" alpha "^#[0-9]+ .*ChanBase::recv"
  expect "$what" "$f" alpha "^#[0-9]+ .*park_here_alpha \(.*gdb_target\.cpp:[0-9]+$"
  expect "$what" "$f" alpha "^#[0-9]+ .*Processor::fiber_main"
  reject "$what" "$f" alpha "pause|__libc|main \(\) at|0x0+ in \?\?"
  expect "$what" "$f" beta "^#[0-9]+ .*fiber::this_fiber::sleep_until"
  expect "$what" "$f" beta "^#[0-9]+ .*sleep_in_beta \(\) at .*gdb_target\.cpp:[0-9]+$"
  reject "$what" "$f" beta "park_here_alpha|join_in_gamma"
  expect "$what" "$f" gamma "^#[0-9]+ .*fiber::detail::fiber_join"
  expect "$what" "$f" gamma "^#[0-9]+ .*join_in_gamma \(alpha=.*gdb_target\.cpp:[0-9]+$"
  expect "$what" "$f" gamma "^ +self = 0x[0-9a-f]+$"  # -full: locals of fiber_body
  expect "$what" "$f" delta "fiber #$DELTA is running \(processor P[01], gdb thread [0-9]+ \(LWP [0-9]+\)\)"
  reject "$what" "$f" delta "^#"
  expect "$what" "$f" missing "no started fiber #987654321"
  # options go through; an optimised build may name a specialised clone of switch_to, and a
  # park has it inline (switch_inline, whose arguments gdb lists last to first)
  expect "$what" "$f" count "^#1  fiber::detail::Processor::(switch_to(\(.*\) \[clone [^]]+\])? \(p=\.\.\., from=\.\.\., to=\.\.\., action=\.\.\.\)|switch_inline \(action=\.\.\., to=\.\.\., from=\.\.\., p=\.\.\.\)) at "
  reject "$what" "$f" count "^#2 |park_here_alpha"
  # The thread's own backtrace is back to normal afterwards.
  expect "$what" "$f" thread-bt "^#[0-9]+ .*main \(\) at .*gdb_target\.cpp"
  reject "$what" "$f" thread-bt "park_here_alpha|fiber_main"
  expect "$what" "$f" all "^Fiber #$ALPHA 'alpha-waiter' \(parked on channel\):$"
  expect "$what" "$f" all "park_here_alpha"
  expect "$what" "$f" all "sleep_in_beta"
  expect "$what" "$f" all "join_in_gamma"
  expect "$what" "$f" all "fiber #$DELTA is running"
  # The fibers that are their processor's current one: the running one, not the parked ones.
  expect "$what" "$f" current "^current:( [0-9]+)* $DELTA( |$)"
  reject "$what" "$f" current " ($ALPHA|$BETA|$GAMMA)( |$)"
  # Unwinding from a normal (not inline) top frame, see below_inline.py.
  expect "$what" "$f" below-inline "^#0  0x[0-9a-f]+ in \(anonymous namespace\)::park_here_alpha"
  expect "$what" "$f" below-inline "^#[0-9]+ .*park_here_alpha"
  reject "$what" "$f" below-inline "inner to this frame|pause"
  if ! grep -qx "@@end" "$f"; then
    echo "  FAIL [$what] gdb did not run every command"
    FAILED=1
  fi
}

# ---- live: attach, check, and write the core from the same session
CORE="$WORK/core"
timeout 60 "$GDB" "${GDB_FLAGS[@]}" -p "$PID" -ex "source $SCRIPT" "${COMMANDS[@]}" \
  -ex "generate-core-file $CORE" >"$WORK/live.txt" 2>&1
if grep -Eq "ptrace: Operation not permitted|Could not attach to process|ptrace: No such process" "$WORK/live.txt"; then
  sed -n 1,20p "$WORK/live.txt"
  skip "gdb cannot attach (ptrace not permitted here)"
fi
kill -0 "$PID" 2>/dev/null || { cat "$WORK/live.txt"; fail "the program died while gdb was attached"; }
kill -9 "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=

echo "== live process"
check_output live "$WORK/live.txt"
[ $FAILED = 0 ] || { echo "---- gdb output (live)"; cat "$WORK/live.txt"; fail "live process"; }
echo "ok"

# ---- core file
[ -s "$CORE" ] || { cat "$WORK/live.txt"; fail "gdb wrote no core file"; }
echo "== core file ($(du -h "$CORE" | cut -f1))"
timeout 60 "$GDB" "${GDB_FLAGS[@]}" "$PROGRAM" "$CORE" -x "$SCRIPT" "${COMMANDS[@]}" >"$WORK/core.txt" 2>&1
check_output core "$WORK/core.txt"
[ $FAILED = 0 ] || { echo "---- gdb output (core)"; cat "$WORK/core.txt"; fail "core file"; }
echo "ok"
echo "PASS"
