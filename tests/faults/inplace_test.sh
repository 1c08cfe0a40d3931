#!/usr/bin/env bash
# In-place retries across node processes: a 2-node p2 x d2 job meets one fault that leaves
# every node process alive (an actor that throws before or after the update, a corrupt or
# lost activation, a stalled reduce-scatter, a lost loss report), also with a
# context-parallel and an expert-parallel group split over the two nodes. Every node rebuilds its
# actors from the in-memory snapshots on fresh UCX communicators and the step runs again:
# no restart (no resume line), parameters bit-identical to the fault-free run and the same
# loss for every step. With max_step_retries = 0 the same fault restarts the job instead.
#   tests/faults/inplace_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
job=(train "${small[@]}" --pipeline 2 --data-parallel 2 --steps 10 --eval-interval 0 --checksum true --global-batch 16)
# The faults found by the step timeout (or the hang watchdog, whichever comes first) get a
# shorter one, still long enough for a healthy step of a heavily loaded machine (3 s and
# more beside CI's other multi-process entries); those that announce themselves keep the
# default, so that a slow step cannot time out before its fault fires (the retry does not
# inject it again).
tight=(--step-timeout 10)

reference() {  # name, then the layout's flags
  local name=$1; shift
  "$launcher" "${job[@]}" "$@" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" >"$tmp/$name.log" 2>&1 \
    && ok "$name: fault-free run" || bad "$name: fault-free run" "$tmp/$name.log"
}
retried() {  # reference, name, then the layout's and the fault's flags
  local ref=$1 name=$2; shift 2
  "$launcher" "${job[@]}" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" "$@" >"$tmp/$name.log" 2>&1
  local rc=$?
  if [ $rc = 0 ] && grep -q "fault injected" "$tmp/$name.log" && grep -q "retrying it in place (1 of" "$tmp/$name.log" \
    && grep -q "actors rebuilt from the in-memory snapshots" "$tmp/$name.log" && ! grep -q "restart 1" "$tmp/$name.log"; then
    local out
    out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/$ref" "$tmp/$name" 0 2>&1) \
      && ok "$name: retried in place, bit-identical ($out)" || { echo "$out"; bad "$name: results differ" "$tmp/$name.log"; }
  else
    bad "$name: exit $rc, or not retried in place" "$tmp/$name.log"
  fi
}
two=(--nodes 2)
reference ref "${two[@]}"
retried ref throw "${two[@]}" --throw-at 1:1:3  # stage (replica 1, stage 1) on node 1
retried ref throw-after-update "${two[@]}" --throw-at 0:0:5:late
retried ref corrupt "${two[@]}" --message corrupt@0:0:4  # activation node 0 -> node 0's stage 1 (checksum)
retried ref lost "${two[@]}" --message drop@1:0:6 "${tight[@]}"           # lost activation: the step timeout
retried ref stall "${two[@]}" --stall 1:0:2 "${tight[@]}"                 # shard (stage 1, rank 0) never starts its reduce-scatter
retried ref lost-loss "${two[@]}" --message drop@0:1:7:loss "${tight[@]}" # a lost control message
# Over TCP only (what nodes on different machines use): the stalled collective's transfers
# are aborted and the retry makes fresh UCX workers that connect over TCP again.
UCX_TLS=tcp,self retried ref stall-tcp "${two[@]}" --stall 1:0:2 "${tight[@]}"
# Four nodes, one slot each, two virtual chunks per stage: every stage's parameters are
# gathered (per chunk) from its shards on two nodes.
four=(--nodes 4 --chunks 2 --schedule interleaved-1f1b)
reference ref4 "${four[@]}"
retried ref4 four-nodes-interleaved "${four[@]}" --throw-at 1:0:3

# No in-place retries allowed: the launcher restarts the job (from step 0: no checkpoints).
"$launcher" "${job[@]}" "${two[@]}" --metrics "$tmp/nr.jsonl" --save "$tmp/nr.pt" --max-step-retries 0 --throw-at 1:1:3 \
  >"$tmp/nr.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "restart 1 of at most" "$tmp/nr.log" && ! grep -q "retrying it in place" "$tmp/nr.log" \
  && ok "max_step_retries = 0: restarted instead" || bad "max_step_retries = 0: exit $rc" "$tmp/nr.log"
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/nr" 1 2>&1) \
  && ok "max_step_retries = 0: bit-identical ($out)" || { echo "$out"; bad "max_step_retries = 0: results differ" "$tmp/nr.log"; }
# Groups split over the node processes: a context-parallel ring (each node holds one cp
# rank of both stages) and an expert-parallel all-to-all (each node a replica). The
# group's abort fails the transfers still pending to the failed rank, sends included
# (UCX cannot cancel those), so the surviving ranks leave the collective and rebuild.
job=(train "${small[@]}" --pipeline 2 --steps 10 --eval-interval 0 --checksum true --global-batch 16)
split=(--nodes 2 --context-parallel 2)
reference cp-split-ref "${split[@]}"
retried cp-split-ref cp-split "${split[@]}" --throw-at 1:0:4
split=(--nodes 2 --data-parallel 2 --workload moe-tiny --expert-parallel 2)
reference ep-split-ref "${split[@]}"
retried ep-split-ref ep-split "${split[@]}" --throw-at 1:1:4

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
