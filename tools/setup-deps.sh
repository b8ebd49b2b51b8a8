#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages needed to build and test libfiber. Idempotent: when every
# package is already installed it does nothing and prints nothing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config   # toolchain
  libboost-context-dev liburing-dev              # library dependencies
  doctest-dev                                    # unit tests
  gdb                                            # debugger-driven tests
  libhiredis-dev redis-server redis-tools        # samples/legacy_redis (hooks), redis_server tests
  curl wrk                                       # HTTP clients of the integration tests
  clang libclang-rt-14-dev                       # libFuzzer (tools/fuzz.sh)
)

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "setup-deps: dpkg-query not found (not a Debian-based system?); install these yourself:" >&2
  echo "  ${packages[*]}" >&2
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ $status == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "setup-deps: missing packages: ${missing[*]}" >&2
    echo "setup-deps: not root and sudo is unavailable; install them as root" >&2
    exit 1
  fi
fi

echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
