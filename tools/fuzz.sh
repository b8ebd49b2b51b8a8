#!/usr/bin/env bash
# Fuzzes the protocol parsers with libFuzzer (clang) for a bounded time.
#
#   tools/fuzz.sh [TARGET...]        targets: http resp (default: all); FUZZ_SECONDS each (60),
#                                    the targets side by side
#
# Each target is tests/fuzz/fuzz_<target>.cpp built with its parser under
# -fsanitize=fuzzer,address,undefined into $FUZZ_BUILD (default /tmp/libfiber-fuzz), started from
# a copy of tests/fuzz/corpus/<target> (new inputs stay in $FUZZ_BUILD; copy the interesting ones
# into the corpus by hand). A crash, a sanitizer report or a failed differential check stops
# that target with the input saved as $FUZZ_BUILD/<target>/crash-*, and the script exits 1.
# The ctest entries fuzz_replay_<target> replay the committed corpus in every build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${FUZZ_BUILD:-/tmp/libfiber-fuzz}
seconds=${FUZZ_SECONDS:-60}
cxx=${FUZZ_CXX:-clang++}

# The parser sources of each target (plain C++: no runtime).
declare -A sources=(
  [http]="$root/samples/http/http_parser.cpp"
  [resp]="$root/samples/redis/resp.cpp"
)
# Each target once, in the order given: two runs of one target would share its directory.
targets=()
for t in "$@"; do [[ " ${targets[*]} " == *" $t "* ]] || targets+=("$t"); done
[[ ${#targets[@]} -gt 0 ]] || targets=(http resp)

"$root/tools/setup-deps.sh"  # clang and its libFuzzer runtime (idempotent, silent when present)
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found (tools/setup-deps.sh installs clang)" >&2; exit 1; }
for t in "${targets[@]}"; do
  [[ -n ${sources[$t]:-} ]] || { echo "fuzz: unknown target '$t' (known: ${!sources[*]})" >&2; exit 2; }
done

# Fuzzes target $1 for $seconds; its output goes to $out/$1/log, its verdict to $out/$1/verdict.
fuzz_one() {
  local t=$1 dir="$out/$1"
  # A small ASan quarantine: the targets free each input copy before the next call, so a
  # dangling view is caught by the very next call, and the default 256 MiB quarantine, with the
  # allocator's caches for every copy size, took a fresh corpus to 1.2 GB in 60 s and a grown
  # one past the 2 GB limit (an out-of-memory "failure" of the fuzzer, not of the parser).
  if (cd "$dir" && ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=16" \
        ./"fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$dir/" corpus 2>"$dir/log"); then
    echo ok >"$dir/verdict"
  else
    echo failed >"$dir/verdict"
  fi
}

for t in "${targets[@]}"; do
  src=${sources[$t]}
  dir="$out/$t"
  mkdir -p "$dir/corpus"
  rm -f "$dir/verdict"
  cp -n "$root/tests/fuzz/corpus/$t/"* "$dir/corpus/" 2>/dev/null || true
  echo "==== fuzz $t: build"
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$(dirname "$src")" "$root/tests/fuzz/fuzz_$t.cpp" "$src" -o "$dir/fuzz_$t"
done
# The targets side by side: each fuzzer is one process on one CPU.
echo "==== fuzz ${targets[*]}: ${seconds}s, side by side"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT  # stopped early, the script stops its fuzzers
for t in "${targets[@]}"; do
  fuzz_one "$t" &
  pids+=($!)
done
wait "${pids[@]}" || true
status=0
for t in "${targets[@]}"; do
  dir="$out/$t"
  if [[ $(cat "$dir/verdict" 2>/dev/null) != ok ]]; then
    tail -40 "$dir/log" >&2
    echo "fuzz $t: FAILED (input saved in $dir)" >&2
    status=1
  else
    { grep -E '^stat::(number_of_executed_units|new_units_added)' "$dir/log" || true; } | sed "s/^/  $t /"
    echo "  $t corpus: $(ls "$dir/corpus" | wc -l) inputs"
  fi
done
exit $status
