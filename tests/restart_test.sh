#!/usr/bin/env bash
# Node processes killed (SIGKILL) in the middle of a 2-node job that cannot go on without
# them (node 0, or another node with --max-node-restarts 0; tests/rejoin_test.sh covers a
# node that rejoins): the launcher restarts the job from its newest checkpoint and the run ends with parameters bit-identical to the
# fault-free run and the same loss for every step in the metrics log. Also: the restart
# limit, a failure a restart cannot cure (no restart), and no process left behind.
#   tests/restart_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/launcher_lib.sh" "$@"
job=(train --nodes 2 --pipeline 2 --data-parallel 2 --eval-interval 0)

same_run() { /usr/bin/python3 "$root/tests/compare_runs.py" "$tmp/ref" "$tmp/$1" 1 "$2"; }

"$launcher" "${job[@]}" --steps 20 --metrics "$tmp/ref.jsonl" --save "$tmp/ref.pt" >"$tmp/ref.log" 2>&1
rc=$?
[ $rc = 0 ] && ok "fault-free run" || bad "fault-free run: exit $rc" "$tmp/ref.log"

# Node 1 dies as step index 7 begins and is not started again; checkpoints every 5 steps:
# steps 5 and 6 run again.
"$launcher" "${job[@]}" --steps 20 --metrics "$tmp/k1.jsonl" --save "$tmp/k1.pt" --checkpoint-dir "$tmp/ck1" \
  --checkpoint-interval 5 --kill-node 1:7 --max-node-restarts 0 >"$tmp/k1.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "fault injected: node 1 kills" "$tmp/k1.log" && grep -q "restart 1 of at most 3" "$tmp/k1.log" \
  && ok "node 1 killed: the job restarted and finished" || bad "node 1 killed: exit $rc" "$tmp/k1.log"
out=$(same_run k1 2 2>&1) && ok "node 1 killed: bit-identical to the fault-free run ($out)" || { echo "$out"; bad "node 1 killed: results differ" "$tmp/k1.log"; }

# Node 0 (the coordinator's) dies as step index 12 begins: steps 10 and 11 run again.
TROUPE_FAULTS=kill_node=0:12 "$launcher" "${job[@]}" --steps 20 --metrics "$tmp/k0.jsonl" --save "$tmp/k0.pt" \
  --checkpoint-dir "$tmp/ck0" --checkpoint-interval 5 >"$tmp/k0.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "fault injected: node 0 kills" "$tmp/k0.log" && grep -q "restart 1 of at most 3" "$tmp/k0.log" \
  && ok "node 0 killed (TROUPE_FAULTS): the job restarted and finished" || bad "node 0 killed: exit $rc" "$tmp/k0.log"
out=$(same_run k0 2 2>&1) && ok "node 0 killed: bit-identical to the fault-free run ($out)" || { echo "$out"; bad "node 0 killed: results differ" "$tmp/k0.log"; }

# No restarts allowed: the job ends with the recoverable status and says so.
"$launcher" "${job[@]}" --steps 4 --max-restarts 0 --max-node-restarts 0 --kill-node 1:2 >"$tmp/nr.log" 2>&1
rc=$?
[ $rc = 75 ] && grep -q "giving up" "$tmp/nr.log" && ok "--max-restarts 0: exit 75, no restart" \
  || bad "--max-restarts 0: exit $rc" "$tmp/nr.log"

# A failure a restart would meet again (NaN gradients beyond the limit): exit 1 at once.
"$launcher" "${job[@]}" --steps 4 --nan-at 1 --max-skipped-steps 0 >"$tmp/nan.log" 2>&1
rc=$?
[ $rc = 1 ] && ! grep -q "restart 1" "$tmp/nan.log" && ok "non-recoverable failure: exit 1, no restart" \
  || bad "non-recoverable failure: exit $rc" "$tmp/nan.log"

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
