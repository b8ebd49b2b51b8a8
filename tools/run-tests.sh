#!/usr/bin/env bash
# Sets up the dependencies and runs the whole test suite.
#
#   tools/run-tests.sh [PRESET...]      presets from CMakePresets.json; default: release
#
# For every preset: cmake --preset P, cmake --build --preset P, ctest --preset P. A failing preset
# does not stop the remaining ones; the exit status is non-zero if any of them failed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/tools/setup-deps.sh"

presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(release)
jobs=$(nproc 2>/dev/null || echo 2)

# TSan shipped with GCC 12 cannot map its shadow memory when the kernel uses more than 28 bits
# of mmap randomisation (the default on recent kernels); run TSan binaries without ASLR there.
tsan_launcher=()
rnd_bits=$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)
if [[ $rnd_bits -gt 28 ]] && command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R true 2>/dev/null; then
  tsan_launcher=(setarch "$(uname -m)" -R)
fi

failed=()
results=()
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
  echo "==== [$p] test"
  launcher=()
  [[ $p == tsan ]] && launcher=("${tsan_launcher[@]}")
  if ! "${launcher[@]}" ctest --preset "$p"; then
    failed+=("$p"); results+=("$p: FAILED (tests, $((SECONDS - start))s)"); continue
  fi
  results+=("$p: passed ($((SECONDS - start))s)")
done

echo "==== summary"
printf '  %s\n' "${results[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run-tests: FAILED presets: ${failed[*]}" >&2
  exit 1
fi
echo "run-tests: all presets passed: ${presets[*]}"
