#!/usr/bin/env bash
# Sets up the dependencies, builds the release preset and runs the demo program.
#   tools/demo.sh [ARGS...]        ARGS are passed to the demo
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/tools/setup-deps.sh"
cmake --preset release >/dev/null
if [[ ! -f samples/demo.cpp ]]; then
  echo "demo.sh: samples/demo.cpp does not exist yet" >&2
  exit 1
fi
cmake --build --preset release -j"$(nproc 2>/dev/null || echo 2)" --target demo
exec "$root/build/release/samples/demo" "$@"
