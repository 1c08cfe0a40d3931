#!/usr/bin/env bash
# The launcher under SLURM, as srun starts it: one launcher per task with SLURM_PROCID,
# SLURM_NTASKS, SLURM_NNODES, SLURM_NODELIST and SLURM_JOB_ID in its environment (srun
# itself is not here: the test starts the tasks the way it would). Checks: two tasks make
# one 2-node job (node 0 on the list's first host) that ends bit-identical to the same
# job started by the launcher itself; no token exported: a one-line error (exit 2);
# without scontrol, the first host of a compressed list ("vm[07-09,12]" -> vm07).
#   tests/slurm_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/launcher_lib.sh" "$@"
cd "$tmp"
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
job=(train --data-parallel 2 --steps 4 --eval-interval 0)
slurm=(SLURM_NTASKS=2 SLURM_NNODES=1 SLURM_NODELIST=localhost SLURM_JOB_ID=4242)

"$launcher" "${job[@]}" --nodes 2 --metrics ref.jsonl --save ref.pt >ref.log 2>&1 \
  && ok "reference: the launcher's own 2 node processes" || bad "reference run" ref.log

# Two srun tasks (the job's flags on every task, as `srun -n 2 launch/troupe train ...`).
export TROUPE_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') TROUPE_PORT=$(free_port)
for t in 0 1; do
  env "${slurm[@]}" SLURM_PROCID=$t "$launcher" "${job[@]}" --metrics got.jsonl --save got.pt >task$t.log 2>&1 &
  task[$t]=$!
done
wait ${task[0]}; rc0=$?
wait ${task[1]}; rc1=$?
[ $rc0 = 0 ] && [ $rc1 = 0 ] && ok "two SLURM tasks: both exit 0" || bad "SLURM tasks exit $rc0 / $rc1" task0.log
grep -q "SLURM task 1 of 2: node 1 on .*, coordinator localhost:$TROUPE_PORT" task1.log \
  && ok "task 1 joins node 0 on the list's first host" || bad "no task line" task1.log
grep -q "4/4 |" task0.log && ok "progress on task 0" || bad "no progress line" task0.log
out=$(/usr/bin/python3 "$root/tests/compare_runs.py" ref got 0 2>&1) \
  && ok "bit-identical to the launcher's own run ($out)" || { echo "$out"; bad "results differ" task0.log; }
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"

# No token: refused before anything starts.
env -u TROUPE_JOB_TOKEN "${slurm[@]}" SLURM_PROCID=1 "$launcher" "${job[@]}" >notoken.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "under SLURM export TROUPE_JOB_TOKEN" notoken.log && ok "no token: one-line error, exit 2" \
  || bad "no token: exit $rc" notoken.log

# A compressed node list, no scontrol: node 0's host is the list's first (the task is
# stopped once it has said so; vm07 does not exist here).
if ! command -v scontrol >/dev/null; then
  env SLURM_NTASKS=2 SLURM_NNODES=2 SLURM_NODELIST='vm[07-09,12],cpu1' SLURM_JOB_ID=4242 SLURM_PROCID=1 \
    "$launcher" "${job[@]}" >list.log 2>&1 &
  pid=$!
  for ((i = 0; i < 50; i++)); do grep -q "coordinator" list.log 2>/dev/null && break; sleep 0.1; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  grep -q "coordinator vm07:$TROUPE_PORT" list.log && ok "'vm[07-09,12],cpu1': node 0 on vm07" \
    || bad "compressed node list" list.log
fi
exit $fail
