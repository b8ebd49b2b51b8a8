#!/usr/bin/env bash
# Exits 0 if this machine lets a process create an io_uring (a seccomp profile or
# kernel.io_uring_disabled may forbid it: then libfiber falls back to its epoll engine).
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/probe.c" <<'C'
#include <linux/io_uring.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  struct io_uring_params p;
  memset(&p, 0, sizeof p);
  long fd = syscall(__NR_io_uring_setup, 4, &p);
  if (fd < 0) { perror("io_uring_setup"); return 1; }
  close((int)fd);
  return 0;
}
C
cc -o "$tmp/probe" "$tmp/probe.c"
"$tmp/probe"
