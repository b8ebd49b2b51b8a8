#!/usr/bin/env bash
# Usage: tests/install/check.sh BUILD_DIR
#
# Installs an already built libfiber build tree into a temporary prefix, then builds and runs the
# consumer in this directory twice over:
#   1. CMake:      find_package(libfiber CONFIG) via CMAKE_PREFIX_PATH, linking libfiber::fiber
#                  and libfiber::fiber_static;
#   2. pkg-config: libfiber.pc via PKG_CONFIG_PATH, compiled with g++ directly, shared and
#                  (pkg-config --static) static.
# Removes the temporary prefix afterwards; exits non-zero on the first failure.
set -euo pipefail

die() { echo "check.sh: FAIL: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
[[ -f "$1/CMakeCache.txt" ]] || die "'$1' is not a configured CMake build directory"
build_dir=$(cd "$1" && pwd)
src_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cache_get() { sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt" | head -n1; }
generator=$(cache_get CMAKE_GENERATOR)
make_program=$(cache_get CMAKE_MAKE_PROGRAM)
cxx=$(cache_get CMAKE_CXX_COMPILER)
libdir_rel=$(cache_get CMAKE_INSTALL_LIBDIR)
incdir_rel=$(cache_get CMAKE_INSTALL_INCLUDEDIR)
[[ -n "$cxx" ]] || cxx=c++
[[ -n "$libdir_rel" ]] || libdir_rel=lib
[[ -n "$incdir_rel" ]] || incdir_rel=include
[[ -z "$(cache_get FIBER_SANITIZE)" ]] || die "sanitizer build trees are not installable consumers; use a plain build"

work=$(mktemp -d "${TMPDIR:-/tmp}/libfiber-install.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

prefix=$work/prefix
log=$work/log
[[ "$libdir_rel" = /* ]] && libdir=$libdir_rel || libdir=$prefix/$libdir_rel
[[ "$incdir_rel" = /* ]] && incdir=$incdir_rel || incdir=$prefix/$incdir_rel

# Run a command quietly; show its output only when it fails.
run() {
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    die "command failed: $*"
  fi
}

# Asserts on the dynamic section of an executable: whether libfiber.so is a NEEDED entry.
needs_libfiber() { LC_ALL=C readelf -d "$1" | grep -q 'NEEDED.*\[libfiber\.so'; }
check_linkage() {  # check_linkage EXE shared|static
  if ! command -v readelf >/dev/null; then return 0; fi
  if [[ $2 == shared ]]; then
    needs_libfiber "$1" || die "$1 does not link libfiber.so"
  else
    ! needs_libfiber "$1" || die "$1 links libfiber.so although it should use libfiber.a"
  fi
}
run_exe() {  # run_exe EXE: must print the consumer's ok line and exit 0
  local out rc=0
  out=$(env -u LD_LIBRARY_PATH "$1" 2>&1) || rc=$?
  [[ $rc -eq 0 ]] || { echo "$out" >&2; die "$1 exited with status $rc"; }
  [[ $out == *"consumer: ok"* ]] || { echo "$out" >&2; die "$1 did not report success"; }
}

# ---------------------------------------------------------------- install
run cmake --install "$build_dir" --prefix "$prefix"
for f in "$incdir/fiber/fiber.hpp" "$libdir/libfiber.a" "$libdir/libfiber.so" "$libdir/pkgconfig/libfiber.pc" \
         "$libdir/cmake/libfiber/libfiber-config.cmake" "$libdir/cmake/libfiber/libfiber-config-version.cmake"; do
  [[ -e $f ]] || die "not installed: ${f#"$prefix"/}"
done
soname=$(LC_ALL=C readelf -d "$libdir/libfiber.so" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ -n $soname && -e $libdir/$soname ]] || die "soname link '${soname:-?}' of libfiber.so not installed"
[[ -L $libdir/libfiber.so ]] || die "libfiber.so is not a symlink to the versioned library"
echo "check.sh: installed into temporary prefix (soname $soname)"

# ---------------------------------------------------------------- find_package consumer
cm_args=(-S "$src_dir" -B "$work/cmake-build" -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx"
         -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
[[ -n "$generator" ]] && cm_args+=(-G "$generator")
[[ -n "$make_program" ]] && cm_args+=(-DCMAKE_MAKE_PROGRAM="$make_program")
run cmake "${cm_args[@]}"
grep -q "^libfiber_DIR:PATH=$prefix/" "$work/cmake-build/CMakeCache.txt" \
  || die "find_package(libfiber) did not pick the package from the temporary prefix"
run cmake --build "$work/cmake-build"
check_linkage "$work/cmake-build/consumer_shared" shared
check_linkage "$work/cmake-build/consumer_static" static
run_exe "$work/cmake-build/consumer_shared"
run_exe "$work/cmake-build/consumer_static"
echo "check.sh: find_package consumer ok (libfiber::fiber, libfiber::fiber_static)"

# ---------------------------------------------------------------- pkg-config consumer
command -v pkg-config >/dev/null || die "pkg-config not found"
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
pc_libdir=$(pkg-config --variable=libdir libfiber) || die "pkg-config cannot find libfiber"
[[ $(cd "$pc_libdir" && pwd -P) == $(cd "$libdir" && pwd -P) ]] \
  || die "libfiber.pc resolves libdir to '$pc_libdir', expected '$libdir'"
[[ $(pkg-config --modversion libfiber) == "$(cache_get CMAKE_PROJECT_VERSION)" ]] \
  || die "libfiber.pc version does not match the project version"
gxx=${CXX_FOR_PKGCONFIG:-g++}
read -r -a pc_cflags <<<"$(pkg-config --cflags libfiber)"
read -r -a pc_libs <<<"$(pkg-config --libs libfiber)"
read -r -a pc_static_libs <<<"$(pkg-config --static --libs libfiber | sed 's/\(^\| \)-lfiber\( \|$\)/\1-l:libfiber.a\2/')"
run "$gxx" -std=c++20 -O1 "${pc_cflags[@]}" "$src_dir/main.cpp" -o "$work/pc_shared" \
    "${pc_libs[@]}" "-Wl,-rpath,$pc_libdir"
run "$gxx" -std=c++20 -O1 "${pc_cflags[@]}" "$src_dir/main.cpp" -o "$work/pc_static" "${pc_static_libs[@]}"
check_linkage "$work/pc_shared" shared
check_linkage "$work/pc_static" static
run_exe "$work/pc_shared"
run_exe "$work/pc_static"
echo "check.sh: pkg-config consumer ok (shared, --static)"
echo "check.sh: PASS"
