#!/usr/bin/env bash
# Sets up the dependencies and runs the whole test suite.
#
#   tools/run-tests.sh [PRESET...]      presets from CMakePresets.json; default: release
#
# For every preset: cmake --preset P, cmake --build --preset P, then ctest --preset P -j N
# (FIBER_TEST_JOBS, default: CPUs + 1) once per I/O engine: FIBER_IO=uring and FIBER_IO=epoll
# (set FIBER_TEST_ENGINES="uring" to run one). Where io_uring is unavailable the uring pass is
# skipped with a note (the runtime falls back to epoll on its own, so it would only repeat the
# epoll pass). A failing preset does not stop the remaining ones; the exit status is non-zero
# if any of them failed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(release)
jobs=$(nproc 2>/dev/null || echo 2)
# Test processes side by side (ctest -j): most tests wait far more than they compute, so one
# more than the CPUs keeps them busy (tests/CMakeLists.txt splits fiber_tests for this).
test_jobs=${FIBER_TEST_JOBS:-$((jobs + 1))}
if ! [[ $test_jobs =~ ^[1-9][0-9]*$ ]]; then
  echo "run-tests: FIBER_TEST_JOBS must be a positive number of test processes, not '$test_jobs'" >&2
  exit 2
fi

"$root/tools/setup-deps.sh"

# TSan shipped with GCC 12 cannot map its shadow memory when the kernel uses more than 28 bits
# of mmap randomisation (the default on recent kernels); run TSan binaries without ASLR there.
tsan_launcher=()
rnd_bits=$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)
if [[ $rnd_bits -gt 28 ]] && command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R true 2>/dev/null; then
  tsan_launcher=(setarch "$(uname -m)" -R)
fi

read -r -a engines <<<"${FIBER_TEST_ENGINES:-uring epoll}"
uring_ok=1
if ! FIBER_IO=uring "$root/tools/io-probe.sh" >/dev/null 2>&1; then uring_ok=0; fi

failed=()
results=()
# What each failing pass printed about its failures, gathered here and printed once more at the
# end, where a log cut down to its head and tail still shows them (build/test-failures.txt).
failures_file="$root/build/test-failures.txt"
mkdir -p "$root/build"
: >"$failures_file"
excerpt_failures() { # $1: label, $2: the pass's full output
  {
    echo "---- $1"
    grep -n -B6 -A10 -E 'ERROR:|FATAL|crashed|[*]{3}(Failed|Timeout|Exception)|runtime error:|WARNING: ThreadSanitizer|AddressSanitizer|terminate called|Segmentation fault|Aborted' "$2" |
      head -n 150 || true
  } >>"$failures_file"
}
for p in "${presets[@]}"; do
  echo "==== [$p] configure"
  start=$SECONDS
  if ! cmake --preset "$p"; then
    failed+=("$p"); results+=("$p: FAILED (configure)"); continue
  fi
  echo "==== [$p] build"
  if ! cmake --build --preset "$p" -j"$jobs"; then
    failed+=("$p"); results+=("$p: FAILED (build)"); continue
  fi
  launcher=()
  [[ $p == tsan ]] && launcher=("${tsan_launcher[@]}")
  ok=1
  for e in "${engines[@]}"; do
    if [[ $e == uring && $uring_ok == 0 ]]; then
      echo "==== [$p] io_uring is not available here: skipping the FIBER_IO=uring pass"
      continue
    fi
    echo "==== [$p] test, FIBER_IO=$e"
    # The install check does not depend on the engine: once is enough.
    extra=()
    [[ $e != "${engines[0]}" ]] && extra=(-LE install)
    log=$(mktemp)
    if ! FIBER_IO=$e "${launcher[@]}" ctest --preset "$p" -j "$test_jobs" "${extra[@]}" 2>&1 | tee "$log"; then
      ok=0; failed+=("$p/$e"); results+=("$p FIBER_IO=$e: FAILED ($((SECONDS - start))s)")
      excerpt_failures "$p FIBER_IO=$e" "$log"
    fi
    rm -f "$log"
  done
  [[ $ok == 1 ]] && results+=("$p: passed under ${engines[*]} ($((SECONDS - start))s)")
done

echo "==== summary"
printf '  %s\n' "${results[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "==== what the failing passes printed about their failures ($failures_file)"
  cat "$failures_file"
  echo "run-tests: FAILED presets: ${failed[*]}" >&2
  exit 1
fi
echo "run-tests: all presets passed: ${presets[*]}"
