#!/usr/bin/env bash
# The launcher under SLURM, as srun starts it: one launcher per task with SLURM_PROCID,
# SLURM_NTASKS, SLURM_NNODES, SLURM_NODELIST and SLURM_JOB_ID in its environment (srun
# itself is not here: the test starts the tasks the way it would). Checks: two tasks make
# one 2-node job (node 0 on the list's first host; each task's number on its machine from
# SLURM_LOCALID) that ends bit-identical to the same
# job started by the launcher itself; no token exported: a one-line error (exit 2); a
# task whose data is not node 0's: the job does not start, node 0 says why (exit 1);
# without scontrol, the first host of a compressed list ("vm[07-09,12]" -> vm07).
#   tests/integration/slurm_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
cd "$tmp"
job=(train "${small[@]}" --data-parallel 2 --steps 4 --eval-interval 0)
slurm=(SLURM_NTASKS=2 SLURM_NNODES=1 SLURM_NODELIST=localhost SLURM_JOB_ID=4242)

"$launcher" "${job[@]}" --nodes 2 --metrics ref.jsonl --save ref.pt >ref.log 2>&1 \
  && ok "reference: the launcher's own 2 node processes" || bad "reference run" ref.log

# Two srun tasks (the job's flags on every task, as `srun -n 2 launch/troupe train ...`).
export TROUPE_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') TROUPE_PORT=$(free_port)
for t in 0 1; do
  env "${slurm[@]}" SLURM_PROCID=$t SLURM_LOCALID=$t "$launcher" "${job[@]}" --metrics got.jsonl --save got.pt >task$t.log 2>&1 &
  task[$t]=$!
done
wait ${task[0]}; rc0=$?
wait ${task[1]}; rc1=$?
[ $rc0 = 0 ] && [ $rc1 = 0 ] && ok "two SLURM tasks: both exit 0" || bad "SLURM tasks exit $rc0 / $rc1" task0.log
grep -q "SLURM task 1 of 2: node 1 on .*, coordinator localhost:$TROUPE_PORT" task1.log \
  && ok "task 1 joins node 0 on the list's first host" || bad "no task line" task1.log
grep -q "4/4 |" task0.log && ok "progress on task 0" || bad "no progress line" task0.log
grep -q "node 1 on .*(pid [0-9]*, node process 2 of 2 on this machine)" task0.log task1.log \
  && ok "task 1 is the machine's second node process (SLURM_LOCALID)" || bad "no 'node process 2 of 2' line" task1.log
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" ref got 0 2>&1) \
  && ok "bit-identical to the launcher's own run ($out)" || { echo "$out"; bad "results differ" task0.log; }
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"

# No token: refused before anything starts.
env -u TROUPE_JOB_TOKEN "${slurm[@]}" SLURM_PROCID=1 "$launcher" "${job[@]}" >notoken.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "under SLURM export TROUPE_JOB_TOKEN" notoken.log && ok "no token: one-line error, exit 2" \
  || bad "no token: exit $rc" notoken.log

# A task whose machine has other data (fewer fortune files: a mount namespace) does not
# take part: it tells node 0 (node_unfit), which ends the job's start with the reason;
# both exit 1, no step runs.
if unshare -m true 2>/dev/null; then
  mkdir -p fewer && cp /usr/share/games/fortunes/[a-f]* fewer/
  export TROUPE_PORT=$(free_port)
  env "${slurm[@]}" SLURM_PROCID=0 SLURM_LOCALID=0 "$launcher" "${job[@]}" >unfit0.log 2>&1 &
  t0=$!
  env "${slurm[@]}" SLURM_PROCID=1 SLURM_LOCALID=1 unshare -m bash -c \
    'mount --bind "$1" /usr/share/games/fortunes && shift && exec "$@"' _ "$tmp/fewer" "$launcher" "${job[@]}" \
    >unfit1.log 2>&1 &
  t1=$!
  wait $t0; rc0=$?
  wait $t1; rc1=$?
  [ $rc0 = 1 ] && [ $rc1 = 1 ] \
    && grep -q "node 1 on .* cannot run this job: its data ([0-9]* bytes, fnv1a [0-9a-f]*) is not node 0's ([0-9]* bytes, fnv1a [0-9a-f]*): every node must read the same" unfit0.log \
    && grep -q "node 1 on .* cannot run this job: its data" unfit1.log && ! grep -q "1/4 |" unfit0.log \
    && ok "a task with other data: node 0 ends the start with the reason (exit 1 / 1)" \
    || { bad "a task with other data: exit $rc0 / $rc1" unfit0.log; tail -10 unfit1.log; }
else
  echo "SKIP a task with other data: no mount namespaces here (unshare -m needs root)"
fi

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

# --- a real SLURM: slurmctld and slurmd of Debian's packages (unpacked, not installed) ---
# One node (this machine), auth/none, ports of their own; `srun -n 2` starts the tasks.
real_slurm() {
  local deps=$TROUPE_BUILD_DIR/test-deps/slurm
  if [ ! -x "$deps/usr/bin/srun" ]; then
    unpack_debs "$deps" "$tmp/apt-slurm.log" slurmctld slurmd slurm-client slurm-wlm-basic-plugins libmunge2 munge \
      liblua5.1-0 || return 1
  fi
  local lib=$deps/usr/lib/x86_64-linux-gnu s=$tmp/slurm host
  host=$(hostname)
  mkdir -p "$s/state" "$s/spool"
  cat >"$s/slurm.conf" <<CONF
ClusterName=troupe-test
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/none
CredType=cred/none
PluginDir=$lib/slurm-wlm
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
KillWait=5
ReturnToService=2
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF=$s/slurm.conf LD_LIBRARY_PATH=$lib:$lib/slurm-wlm${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$deps/usr/bin:$PATH
  "$deps/usr/sbin/slurmctld-wlm" -i && "$deps/usr/sbin/slurmd-wlm" -d "$deps/usr/sbin/slurmstepd-wlm" || return 2
  for ((i = 0; i < 100; i++)); do sinfo -h -o %t 2>/dev/null | grep -q idle && return 0; sleep 0.1; done
  return 3
}
stop_slurm() {  # the daemons, then what launcher_lib.sh cleans up
  local pids=() f
  for f in "$tmp"/slurm/slurmd.pid "$tmp"/slurm/slurmctld.pid; do [ -f "$f" ] && pids+=("$(cat "$f")"); done
  [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
  for ((i = 0; i < 50; i++)); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1; done
  cleanup
}
trap stop_slurm EXIT
if [ "$(id -u)" != 0 ]; then
  echo "SKIP real srun: slurmd must run as root here"
elif real_slurm; then
  ok "slurmctld and slurmd up ($(sinfo -h -o '%P %t %N'))"
  srun -n 2 "$launcher" "${job[@]}" --metrics srun.jsonl --save srun.pt >srun.log 2>&1 \
    && ok "srun -n 2 launch/troupe train: exit 0" || bad "srun: exit $?" srun.log
  grep -q "SLURM task 1 of 2: node 1 on $(hostname), coordinator $(hostname):" srun.log \
    && ok "srun's task 1 joins node 0 (scontrol's first host)" || bad "no task line" srun.log
  grep -q "node 1 on .*(pid [0-9]*, node process 2 of 2 on this machine)" srun.log \
    && ok "srun's task 1 is the machine's second node process" || bad "no 'node process 2 of 2' line" srun.log
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" ref srun 0 2>&1) \
    && ok "under srun bit-identical to the launcher's own run ($out)" || { echo "$out"; bad "srun results differ" srun.log; }
  # scancel stops the whole job: srun ends, no node process is left.
  srun -n 2 "$launcher" train "${small[@]}" --data-parallel 2 --steps 500 --eval-interval 0 >scancel.log 2>&1 &
  srun_pid=$!
  for ((i = 0; i < 300; i++)); do grep -q "^step  *1/" scancel.log 2>/dev/null && break; sleep 0.1; done
  scancel "$(squeue -h -o %i | head -1)"
  for ((i = 0; i < 100; i++)); do kill -0 $srun_pid 2>/dev/null || break; sleep 0.1; done
  kill -0 $srun_pid 2>/dev/null && bad "srun still running 10 s after scancel" scancel.log
  wait $srun_pid
  rc=$?
  sleep 0.5
  [ $rc != 0 ] && [ "$(nodes_left)" = 0 ] && ok "scancel: srun exits $rc, no node left" \
    || bad "scancel: srun exit $rc, $(nodes_left) node(s) left" scancel.log
else
  echo "SKIP real srun: no slurmctld/slurmd to be had (real_slurm returned $?; see $tmp/apt-slurm.log)"
fi
exit $fail
