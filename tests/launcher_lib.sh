# Shared by the launcher's shell tests (launcher, restart, soak): sourced as
#   source "$(dirname "$0")/launcher_lib.sh" REPO_ROOT BUILD_DIR
# Sets root, launcher, tmp (removed at exit with every node process of this build),
# fail; ok NAME, bad NAME [LOG] (prints the log's tail), nodes_left, unpack_debs.
set -u
root=$1
export TROUPE_BUILD_DIR=$2 TROUPE_SETUP_LOG=$(mktemp)
launcher=$root/launch/troupe
tmp=$(mktemp -d)
fail=0
cleanup() { pkill -KILL -f "$TROUPE_BUILD_DIR/troupe-node" 2>/dev/null; rm -rf "$tmp" "$TROUPE_SETUP_LOG"; }
trap cleanup EXIT
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; shift; [ $# -gt 0 ] && tail -30 "$1"; fail=1; }
nodes_left() { pgrep -f "$TROUPE_BUILD_DIR/troupe-node" | wc -l; }
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
