#!/usr/bin/env bash
# A node process (not node 0) killed (SIGKILL) in the middle of a job: the launcher starts
# it again, it rejoins the running job (no job restart: no resume line), every node
# rebuilds its actors in place, the lost node's optimizer shards from the copies on the
# next node (its buddy) and its stages' parameters all-gathered from them; the run ends
# bit-identical to the fault-free one with the same loss log (also with expert
# parallelism across the nodes, with context parallelism, with a tensor-parallel group spread over two nodes, and
# with hybrid sharding of experts). Also: the last node (whose
# buddy is node 0), a node that does not come back in time (exit 75, the launcher restarts
# the job from its newest checkpoint), a node and its buddy lost together (the same), and
# --max-node-restarts 0 (no buddy copies, a job restart); node 0 stalled past the
# connection timeout (node 1 ends, is started again and rejoins).
#   tests/faults/rejoin_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
job=(train "${small[@]}" --pipeline 2 --data-parallel 2 --steps 10 --eval-interval 0 --global-batch 16)

reference() {  # name, then the layout's flags
  local name=$1; shift
  "$launcher" "${job[@]}" "$@" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" >"$tmp/$name.log" 2>&1 \
    && ok "$name: fault-free run" || bad "$name: fault-free run" "$tmp/$name.log"
}
same() {  # reference, name, resumes: bit-identical, the same loss log
  local out
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/$1" "$tmp/$2" "$3" 2>&1) \
    && ok "$2: bit-identical ($out)" || { echo "$out"; bad "$2: results differ" "$tmp/$2.log"; }
}
rejoined() {  # reference, name, node, then the layout's and the fault's flags
  local ref=$1 name=$2 node=$3; shift 3
  "$launcher" "${job[@]}" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" "$@" >"$tmp/$name.log" 2>&1
  local rc=$?
  if [ $rc = 0 ] && grep -q "fault injected: node $node kills" "$tmp/$name.log" \
    && grep -q "node $node rejoined .* rebuilding its actors from the copies on node" "$tmp/$name.log" \
    && grep -q "node $node: state of .* optimizer shard.* before step .* taken from the buddy node" "$tmp/$name.log" \
    && grep -q '"rejoined_nodes":\['"$node"'\]' "$tmp/$name.jsonl" && ! grep -q "the job failed" "$tmp/$name.log"; then
    ok "$name: node $node rejoined, no job restart"
    same "$ref" "$name" 0
  else
    bad "$name: exit $rc, or node $node did not rejoin" "$tmp/$name.log"
  fi
}
restarted() {  # reference, name, what must be in the log, then the flags
  local ref=$1 name=$2 why=$3; shift 3
  "$launcher" "${job[@]}" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" --checkpoint-dir "$tmp/$name.ck" \
    --checkpoint-interval 2 "$@" >"$tmp/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] && grep -q "$why" "$tmp/$name.log" && grep -q "restart 1 of at most" "$tmp/$name.log" \
    && ok "$name: '$why', the job restarted from its checkpoint" || bad "$name: exit $rc" "$tmp/$name.log"
  same "$ref" "$name" 1
}

two=(--nodes 2)
reference ref "${two[@]}"
rejoined ref kill-node-1 1 "${two[@]}" --kill-node 1:4
# Expert parallelism across the two nodes: node 1's stage actors share every all-to-all
# with node 0's; the rejoined node's new actors meet theirs in fresh groups.
moe=(--workload moe-tiny --layers 2 --expert-parallel 2 "${two[@]}")
reference moe-ref "${moe[@]}"
rejoined moe-ref moe-kill-node-1 1 "${moe[@]}" --kill-node 1:4
# Context parallelism: node 1 hosts replica 1's two context-parallel ranks (their ring in
# its process); killed, it rejoins with a fresh group, its shards from the buddy copies.
cp=(--context-parallel 2 --layers 2 "${two[@]}")
reference cp-ref "${cp[@]}"
rejoined cp-ref cp-kill-node-1 1 "${cp[@]}" --kill-node 1:4
# Tensor parallelism with more nodes than pipeline x data-parallel (one GPU each): a group
# spans node processes (its collectives over UCX): p 2, d 1, T 2 on 4 nodes, one stage
# actor each; node 1 (stage 0's rank 1) killed while its peer on node 0 waits in their
# collective. (Whole groups on a node: launcher_test.sh.)
tp=(--tensor-parallel 2 --sequence-parallel true --layers 2)
saved_job=("${job[@]}")
job=(train "${small[@]}" --pipeline 2 --data-parallel 1 --steps 10 --eval-interval 0 --global-batch 16)
reference tp-spread-one "${tp[@]}" --nodes 1
reference tp-spread "${tp[@]}" --nodes 4
same tp-spread-one tp-spread 0
rejoined tp-spread tp-spread-kill-node-1 1 "${tp[@]}" --nodes 4 --kill-node 1:4
# Hybrid sharding with experts: parameters sharded in groups of 2 of the 4 replicas (a
# node's two), each share of the experts over its rank in the group; node 1's shards come
# back from their buddy copies on node 0.
job=(train "${small[@]}" --pipeline 1 --data-parallel 4 --microbatches 2 --steps 10 --eval-interval 0 --global-batch 16)
hsdp=(--workload moe-tiny --layers 2 --expert-parallel 2 --shard parameters --shard-group 2 "${two[@]}")
reference hsdp-ep-ref "${hsdp[@]}"
rejoined hsdp-ep-ref hsdp-ep-kill-node-1 1 "${hsdp[@]}" --kill-node 1:4
job=("${saved_job[@]}")
# Node 0 stalled (SIGSTOP for 8 s: a paused VM, a swapped-out process) past the connection
# timeout (5 s): node 1 loses it and ends with the recoverable status (75), the launcher
# starts it again, and it rejoins the job in place once node 0 runs again (no job
# restart); the run ends bit-identical to the fault-free one.
stalled() {
  local name=node-0-stalled i pid rc
  "$launcher" "${job[@]}" "${two[@]}" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" >"$tmp/$name.log" 2>&1 &
  local launch=$!
  for ((i = 0; i < 600; i++)); do
    grep -q "^step  3/10 |" "$tmp/$name.log" 2>/dev/null && break
    sleep 0.1
  done
  pid=$(grep -o "node 0 of 2: localhost, pid [0-9]*" "$tmp/$name.log" | grep -o "[0-9]*$")
  if [ -z "$pid" ] || ! grep -q "^step  3/10 |" "$tmp/$name.log"; then
    wait $launch
    bad "$name: no step 3 or no pid of node 0" "$tmp/$name.log"
    return
  fi
  kill -STOP "$pid"
  sleep 8
  kill -CONT "$pid"
  wait $launch
  rc=$?
  if [ $rc = 0 ] && grep -q "node 1: lost the coordinator (node 0)" "$tmp/$name.log" \
    && grep -q "node 1 ended (status 75); starting it again" "$tmp/$name.log" \
    && grep -q "node 1 rejoined .* rebuilding its actors from the copies on node 0" "$tmp/$name.log" \
    && ! grep -q "the job failed" "$tmp/$name.log"; then
    ok "$name: node 1 lost node 0, was started again and rejoined, no job restart"
    same ref "$name" 0
  else
    bad "$name: exit $rc, or node 1 did not rejoin" "$tmp/$name.log"
  fi
}
stalled
# Over TCP only (nodes on different machines): the rejoined process's workers connect to
# the others' fresh ones over TCP, the buddy copies travel over TCP.
UCX_TLS=tcp,self rejoined ref kill-node-1-tcp 1 "${two[@]}" --kill-node 1:4
# Four nodes, one slot each, two chunks per stage; node 3's buddy is node 0.
four=(--nodes 4 --chunks 2 --schedule interleaved-1f1b)
reference ref4 "${four[@]}"
rejoined ref4 four-kill-node-3 3 "${four[@]}" --kill-node 3:3
rejoined ref4 four-kill-node-1 1 "${four[@]}" --kill-node 1:6
# Node 1 and its buddy (node 2) lost at once: node 1's copies are gone with node 2.
restarted ref4 four-kill-node-1-and-buddy "optimizer shard copies, are both lost" "${four[@]}" \
  --kill-node 1:5+2:5
# The launcher starts node 1 again after 4 s; the coordinator waits 1 s.
restarted ref late-rejoin "node 1 did not rejoin within 1 s" "${two[@]}" --kill-node 1:5 --rejoin-timeout 1 \
  --restart-backoff 4
restarted ref no-node-restarts "node 1 is gone" "${two[@]}" --kill-node 1:5 --max-node-restarts 0
! grep -q "rejoin" "$tmp/no-node-restarts.log" && ok "no-node-restarts: no rejoin" || bad "no-node-restarts: rejoined" "$tmp/no-node-restarts.log"

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
