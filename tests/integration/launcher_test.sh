#!/usr/bin/env bash
# The launcher (launch/troupe train) with node processes on this machine: a short job
# ends with node 0's status and no node left behind, each node knowing its number on
# the machine; bad layouts and transport settings are one-line errors (exit 2); Ctrl-C
# (SIGINT) stops every node and exits 130, leaving no process; --help lists the launcher's
# options and the job's flags without starting anything.
#   tests/integration/launcher_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"

# A short job over 2 nodes: exit 0, node lines, progress, nothing left.
"$launcher" train "${small[@]}" --nodes 2 --data-parallel 2 --steps 3 --eval-interval 0 >"$tmp/run.log" 2>&1
rc=$?
[ $rc = 0 ] && ok "2-node job exits 0" || bad "2-node job exit $rc" "$tmp/run.log"
grep -q "node 1 of 2: localhost, pid" "$tmp/run.log" && ok "prints where each node runs" || bad "no node lines" "$tmp/run.log"
grep -q "node 1 on .*(pid [0-9]*, node process 2 of 2 on this machine)" "$tmp/run.log" \
  && ok "node 1 knows it is the machine's second node process (its GPU with --device cuda)" \
  || bad "no 'node process 2 of 2' line" "$tmp/run.log"
grep -q "3/3 |" "$tmp/run.log" && ok "progress lines" || bad "no progress line" "$tmp/run.log"
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left after the job" || bad "$(nodes_left) node(s) left after the job"

# --help: the launcher's own options, then every job flag; no node process started.
"$launcher" train "${small[@]}" --nodes 2 --help >"$tmp/help.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q -- "--min-nodes M" "$tmp/help.log" && grep -q -- "--hostfile FILE" "$tmp/help.log" \
  && grep -q -- "--data-parallel" "$tmp/help.log" && ! grep -q "node 0 of" "$tmp/help.log" \
  && ok "train --help: launcher options and job flags, no node started" || bad "train --help: exit $rc" "$tmp/help.log"

# An output folder that does not exist: node 0 refuses it before the job starts.
"$launcher" train "${small[@]}" --nodes 2 --data-parallel 2 --steps 200 --save "$tmp/nope/model.pt" >"$tmp/save.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "output.save = '$tmp/nope/model.pt': folder $tmp/nope does not exist" "$tmp/save.log" \
  && ! grep -q "step  *1/" "$tmp/save.log" && ok "--save into a missing folder refused before training (exit 2)" \
  || bad "--save into a missing folder: exit $rc" "$tmp/save.log"

# Layouts that do not fit the nodes: one-line error, exit 2, before anything runs.
"$launcher" train "${small[@]}" --nodes 3 --data-parallel 2 --steps 1 >"$tmp/bad.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "divisible by the node count" "$tmp/bad.log" && ok "--nodes 3 with d=2 refused (exit 2)" \
  || bad "--nodes 3 with d=2: exit $rc" "$tmp/bad.log"
# Tensor parallelism (a layout flag: without --nodes one process): 2 node processes, each
# hosting whole tensor-parallel groups (replica r's four stage actors), train one
# process's bits, and each node's line names its (replica, stage, tp).
tp_job=(train "${small[@]}" --tensor-parallel 2 --sequence-parallel true --pipeline 2 --data-parallel 2 --layers 2 --steps 3 --eval-interval 0)
"$launcher" "${tp_job[@]}" --save "$tmp/tp1.pt" --metrics "$tmp/tp1.jsonl" >"$tmp/tp1.log" 2>&1
"$launcher" "${tp_job[@]}" --nodes 2 --save "$tmp/tp2.pt" --metrics "$tmp/tp2.jsonl" >"$tmp/tp2.log" 2>&1
rc=$?
[ $rc = 0 ] && ! grep -q "node 0 of" "$tmp/tp1.log" && grep -q "stages (replica,stage,tp) (1,0,0) (1,0,1) (1,1,0) (1,1,1)" "$tmp/tp2.log" \
  && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/tp1" "$tmp/tp2" 0 \
  && ok "tensor-parallel 2 on 2 nodes: one process's bits, layout lines" || bad "tensor-parallel 2 on 2 nodes: exit $rc" "$tmp/tp2.log"
# Context parallelism over node processes (gpt2's learned positions): 2 nodes, each
# hosting whole replicas (both context-parallel ranks of replica r, its group in process),
# train one process's bits; so do 2 nodes that split one replica (its context-parallel
# ranks' ring over UCX).
cp_job=(train "${small[@]}" --context-parallel 2 --pipeline 2 --data-parallel 2 --layers 2 --steps 3 --eval-interval 0)
"$launcher" "${cp_job[@]}" --save "$tmp/cp1.pt" --metrics "$tmp/cp1.jsonl" >"$tmp/cp1.log" 2>&1
"$launcher" "${cp_job[@]}" --nodes 2 --save "$tmp/cp2.pt" --metrics "$tmp/cp2.jsonl" >"$tmp/cp2.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "stages (replica,stage,cp) (1,0,0) (1,1,0) (1,0,1) (1,1,1)" "$tmp/cp2.log" \
  && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/cp1" "$tmp/cp2" 0 \
  && ok "context-parallel 2 on 2 nodes: one process's bits, layout lines" || bad "context-parallel 2 on 2 nodes: exit $rc" "$tmp/cp2.log"
cp_split=(train "${small[@]}" --context-parallel 2 --pipeline 2 --data-parallel 1 --layers 2 --steps 3 --eval-interval 2)
"$launcher" "${cp_split[@]}" --save "$tmp/cps1.pt" --metrics "$tmp/cps1.jsonl" >"$tmp/cps1.log" 2>&1
"$launcher" "${cp_split[@]}" --nodes 2 --save "$tmp/cps2.pt" --metrics "$tmp/cps2.jsonl" >"$tmp/cps2.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "stages (replica,stage,cp) (0,0,1) (0,1,1)" "$tmp/cps2.log" && grep -q "eval" "$tmp/cps2.jsonl" \
  && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/cps1" "$tmp/cps2" 0 \
  && ok "context-parallel 2 with its ranks on 2 nodes: one process's bits" || bad "context-parallel over nodes: exit $rc" "$tmp/cps2.log"
# Parameters sharded (ZeRO-3) over node processes: each op's all-gather and
# reduce-scatter between the nodes' stage actors over UCX, the evaluation from the
# shards; the bits of one process.
fsdp_job=(train "${small[@]}" --shard parameters --pipeline 1 --data-parallel 2 --steps 3 --eval-interval 2)
"$launcher" "${fsdp_job[@]}" --save "$tmp/fsdp1.pt" --metrics "$tmp/fsdp1.jsonl" >"$tmp/fsdp1.log" 2>&1
"$launcher" "${fsdp_job[@]}" --nodes 2 --save "$tmp/fsdp2.pt" --metrics "$tmp/fsdp2.jsonl" >"$tmp/fsdp2.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "eval" "$tmp/fsdp2.jsonl" \
  && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/fsdp1" "$tmp/fsdp2" 0 \
  && ok "shard parameters on 2 nodes: one process's bits" || bad "shard parameters on 2 nodes: exit $rc" "$tmp/fsdp2.log"
# Hybrid sharding: groups of one replica, replicated across the two nodes (the shard
# groups' sums cross the nodes over UCX point-to-point); the bits of one process.
hsdp_job=(train "${small[@]}" --shard gradients --shard-group 1 --pipeline 1 --data-parallel 2 --steps 3 --eval-interval 0)
"$launcher" "${hsdp_job[@]}" --save "$tmp/hsdp1.pt" --metrics "$tmp/hsdp1.jsonl" >"$tmp/hsdp1.log" 2>&1
"$launcher" "${hsdp_job[@]}" --nodes 2 --save "$tmp/hsdp2.pt" --metrics "$tmp/hsdp2.jsonl" >"$tmp/hsdp2.log" 2>&1
rc=$?
[ $rc = 0 ] && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/hsdp1" "$tmp/hsdp2" 0 \
  && ok "shard gradients in groups of 1 on 2 nodes: one process's bits" || bad "shard-group 1 on 2 nodes: exit $rc" "$tmp/hsdp2.log"
# With experts over 2 expert-parallel ranks: parameters sharded in groups of 2 of the 4
# replicas, each group an expert-parallel group; the replicas of each piece, dense and
# experts', sum across the nodes.
hsdp_job=(train "${small[@]}" --workload moe-tiny --expert-parallel 2 --shard parameters --shard-group 2 --pipeline 1
  --data-parallel 4 --global-batch 16 --microbatches 2 --steps 3 --eval-interval 0)
"$launcher" "${hsdp_job[@]}" --save "$tmp/hsdp-ep1.pt" --metrics "$tmp/hsdp-ep1.jsonl" >"$tmp/hsdp-ep1.log" 2>&1
"$launcher" "${hsdp_job[@]}" --nodes 2 --save "$tmp/hsdp-ep2.pt" --metrics "$tmp/hsdp-ep2.jsonl" >"$tmp/hsdp-ep2.log" 2>&1
rc=$?
[ $rc = 0 ] && /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/hsdp-ep1" "$tmp/hsdp-ep2" 0 \
  && ok "shard parameters in groups of 2 with experts on 2 nodes: one process's bits" \
  || bad "shard-group 2 with experts on 2 nodes: exit $rc" "$tmp/hsdp-ep2.log"
# Without layout flags any node count runs the default job's layout (p2 d2).
"$launcher" train "${small[@]}" --nodes 1 --steps 1 --eval-interval 0 >"$tmp/one.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "pipeline 2 x data-parallel 2" "$tmp/one.log" \
  && ok "--nodes 1 without layout flags runs the default job's pipeline 2 x data-parallel 2" \
  || bad "--nodes 1 without layout flags: exit $rc" "$tmp/one.log"
"$launcher" train "${small[@]}" --nodes zero >"$tmp/bad2.log" 2>&1
rc=$?
[ $rc = 2 ] && ok "--nodes zero refused (exit 2)" || bad "--nodes zero: exit $rc" "$tmp/bad2.log"
# A GPU asked for where the build has none (CI's): the nodes start, node 0 refuses the
# job with the reason, every node ends.
if "$TROUPE_BUILD_DIR/troupe" train --device cuda --steps 1 --eval-interval 0 2>&1 | grep -q "has no CUDA"; then
  "$launcher" train "${small[@]}" --nodes 2 --device cuda --steps 2 >"$tmp/cuda.log" 2>&1
  rc=$?
  [ $rc = 2 ] && grep -q "device 'cuda': this build's LibTorch has no CUDA" "$tmp/cuda.log" \
    && ok "--device cuda with 2 nodes on a build without CUDA refused (exit 2)" || bad "--device cuda: exit $rc" "$tmp/cuda.log"
fi
# Transport settings that cannot hold: the nodes refuse them with the reason (exit 2).
for setting in "TROUPE_NCCL=1|TROUPE_NCCL=1: the job does not run on a GPU" \
               "TROUPE_NCCL=yes|TROUPE_NCCL=yes: expected 1 or 0" \
               "TROUPE_IPC=shm|TROUPE_IPC=shm: expected host, cuda, 0 or off" \
               "TROUPE_LINKS=nccl|TROUPE_LINKS=nccl: expected ucx or 0"; do
  env "${setting%%|*}" "$launcher" train "${small[@]}" --nodes 2 --data-parallel 2 --steps 2 >"$tmp/setting.log" 2>&1
  rc=$?
  [ $rc = 2 ] && grep -qF "${setting#*|}" "$tmp/setting.log" && ok "${setting%%|*} on a CPU job refused (exit 2)" \
    || bad "${setting%%|*}: exit $rc" "$tmp/setting.log"
done
# TROUPE_SKIP_SETUP=1 (launch/setup-gpu's builds) without a build: a one-line error.
TROUPE_SKIP_SETUP=1 TROUPE_BUILD_DIR="$tmp/no-build" "$launcher" train "${small[@]}" --nodes 2 >"$tmp/skip.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "TROUPE_SKIP_SETUP=1 but no $tmp/no-build/troupe-node" "$tmp/skip.log" \
  && ok "TROUPE_SKIP_SETUP=1 without a build refused (exit 2)" || bad "TROUPE_SKIP_SETUP=1: exit $rc" "$tmp/skip.log"
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left after refused jobs" || bad "$(nodes_left) node(s) left after refused jobs"

# Ctrl-C: SIGINT to the launcher stops the whole job. (Job control on: a non-interactive
# shell starts background commands with SIGINT ignored.)
set -m
"$launcher" train "${small[@]}" --nodes 2 --data-parallel 2 --steps 5000 --eval-interval 0 >"$tmp/int.log" 2>&1 &
pid=$!
for ((i = 0; i < 600; i++)); do grep -q "2/5000 |" "$tmp/int.log" 2>/dev/null && break; sleep 0.2; done
grep -q "2/5000 |" "$tmp/int.log" || bad "the long job did not start" "$tmp/int.log"
kill -INT $pid
wait $pid
rc=$?
set +m
[ $rc = 130 ] && ok "SIGINT: launcher exits 130" || bad "SIGINT: launcher exit $rc" "$tmp/int.log"
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "SIGINT: no node left" || bad "SIGINT: $(nodes_left) node(s) left"
exit $fail
