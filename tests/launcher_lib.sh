# Shared by the launcher's shell tests (launcher, restart, soak): sourced as
#   source "$(dirname "$0")/launcher_lib.sh" REPO_ROOT BUILD_DIR
# Sets root, launcher, tmp (removed at exit with every node process of this build),
# fail; ok NAME, bad NAME [LOG] (prints the log's tail), nodes_left.
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
