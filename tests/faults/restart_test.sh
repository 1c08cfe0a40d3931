#!/usr/bin/env bash
# Node processes killed (SIGKILL) in the middle of a 2-node job that cannot go on without
# them (node 0, or another node with --max-node-restarts 0; tests/faults/rejoin_test.sh covers a
# node that rejoins): the launcher restarts the job from its newest checkpoint and the run ends with parameters bit-identical to the
# fault-free run and the same loss for every step in the metrics log. Also: the restart
# limit, a failure a restart cannot cure (no restart), a job stopped on request (SIGTERM
# to the launcher, SIGUSR1 to every node) with a checkpoint it resumes from without
# replaying a step, and no process left behind.
#   tests/faults/restart_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
# Checkpoint folders written before training goes on: a node killed two steps after a
# checkpoint finds its folder complete (a background one may still be being written then,
# on a busy machine: tests/faults/checkpoint_write_test.sh covers those).
job=(train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --eval-interval 0 --global-batch 16
  --checkpoint-async false)

same_run() { /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/$1" 1 "$2"; }

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

# SIGTERM to the launcher (as Ctrl-C): node 0 ends the job after its step with a
# checkpoint, the launcher exits 130 without a restart; the job run again from that
# checkpoint ends bit-identical to the fault-free run, no step replayed.
started() { for ((i = 0; i < 900; i++)); do grep -q "step  *$2/20 |" "$1" && return 0; sleep 0.1; done; return 1; }
"$launcher" "${job[@]}" --steps 20 --metrics "$tmp/st.jsonl" --save "$tmp/st.pt" --checkpoint-dir "$tmp/ckst" \
  >"$tmp/st.log" 2>&1 &
pid=$!
started "$tmp/st.log" 5 || bad "the job to stop did not start" "$tmp/st.log"
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 130 ] && grep -q "stopped by SIGTERM after step .* of 20: its checkpoint is in $tmp/ckst" "$tmp/st.log" \
  && ! grep -q "restart 1" "$tmp/st.log" && ! grep -q "step 20/20" "$tmp/st.log" \
  && ok "SIGTERM to the launcher: node 0 stopped after its step with a checkpoint, exit 130" \
  || bad "SIGTERM to the launcher: exit $rc" "$tmp/st.log"
"$launcher" "${job[@]}" --steps 20 --metrics "$tmp/st.jsonl" --save "$tmp/st.pt" --checkpoint-dir "$tmp/ckst" \
  --resume "$tmp/ckst" >"$tmp/st2.log" 2>&1
rc=$?
out=$(same_run st 0 2>&1) && [ $rc = 0 ] && ok "stopped and resumed: bit-identical, nothing replayed ($out)" \
  || { echo "$out"; bad "stopped and resumed: exit $rc" "$tmp/st2.log"; }

# SIGUSR1 to every node process (SLURM's --signal=USR1@T reaches every task): node 0 stops
# after its step with a checkpoint, node 1 ignores it; no restart, status 143.
"$launcher" "${job[@]}" --steps 20 --checkpoint-dir "$tmp/ckusr" >"$tmp/usr.log" 2>&1 &
pid=$!
started "$tmp/usr.log" 3 || bad "the job to signal did not start" "$tmp/usr.log"
own_pids | xargs -r kill -USR1
wait $pid
rc=$?
[ $rc = 143 ] && grep -q "stopped by SIGUSR1 after step" "$tmp/usr.log" && grep -q "not restarting" "$tmp/usr.log" \
  && ! grep -q "is gone" "$tmp/usr.log" && ls "$tmp/ckusr"/step-* >/dev/null 2>&1 \
  && ok "SIGUSR1 to every node: node 0 stopped with a checkpoint, node 1 ignored it, exit 143, no restart" \
  || bad "SIGUSR1 to every node: exit $rc" "$tmp/usr.log"

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
