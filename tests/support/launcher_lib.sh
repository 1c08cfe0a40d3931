# Shared by the launcher's shell tests (launcher, restart, soak): sourced as
#   source "$(dirname "$0")/launcher_lib.sh" REPO_ROOT BUILD_DIR
# Sets root, launcher, tmp (removed at exit with every node process this test started),
# fail, small; ok NAME, bad NAME [LOG] (prints the log's tail), own_pids, nodes_left,
# free_port, unpack_debs.
#
# The test's own processes carry TROUPE_TEST_TAG (unique to the test; the launcher passes
# TROUPE_* variables to every node, locally, over ssh and under srun), so that a test
# signals, counts and ends only what it started, never another test's nodes under ctest -j.
set -u
root=$1
# The build tests/run made: the launcher runs it as it is (no apt-get, no make: tests run
# side by side, and none may rebuild what the others run).
export TROUPE_BUILD_DIR=$2 TROUPE_SETUP_LOG=$(mktemp) TROUPE_SKIP_SETUP=1
launcher=$root/launch/troupe
# The model the tests' jobs train: gpt-tiny's (or the workload's) layers and heads, at half
# its width and sequence length. Faults, recovery, layouts and comparisons are the same;
# a step costs about a third of the CPU time (the suite is CPU-bound).
small=(--d-model 64 --seq-len 64)
tmp=$(mktemp -d)
export TROUPE_TEST_TAG=$tmp
fail=0
# own_pids [COMM]: the pids of this test's processes (those whose name is COMM, default
# troupe-node), found by the tag in their environment.
own_pids() {
  local comm=${1:-troupe-node} e p
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}
    p=${p%/environ}
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$comm" ] || continue
    grep -qzxF "TROUPE_TEST_TAG=$TROUPE_TEST_TAG" "$e" 2>/dev/null && echo "$p"
  done
}
cleanup() { own_pids | xargs -r kill -KILL 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$tmp" "$TROUPE_SETUP_LOG"; }
trap cleanup EXIT
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; shift; [ $# -gt 0 ] && tail -30 "$1"; fail=1; }
nodes_left() { own_pids | wc -l; }
# A free TCP port below the kernel's ephemeral range (as the launcher picks its own).
free_port() { /usr/bin/python3 "$root/launch/free_port.py"; }
# unpack_debs DIR LOG PACKAGE...: Debian packages fetched with `apt-get download` (after
# an `apt-get update` if the first try fails) and unpacked into DIR (nothing installed);
# 1 when they cannot be had (the apt output in LOG).
unpack_debs() {
  local dir=$1 log=$2 d
  shift 2
  mkdir -p "$dir/debs"
  (cd "$dir/debs" && apt-get download -q "$@") >"$log" 2>&1 ||
    { apt-get update -q >>"$log" 2>&1 && (cd "$dir/debs" && apt-get download -q "$@") >>"$log" 2>&1; } || return 1
  for d in "$dir"/debs/*.deb; do dpkg -x "$d" "$dir"; done
}
