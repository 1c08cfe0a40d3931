#!/usr/bin/env bash
# A node process that is alive but frozen (SIGSTOP) is fenced: node 0 sees it gone after
# the connection timeout, ends it (SIGKILL: it lives on this machine and carries the job's
# token), the launcher starts its replacement, which rejoins from the buddy copies; the
# step is retried in place. The run ends bit-identical to the fault-free one, no step
# replayed, and no process left. Then the same with node 1 on another machine (a
# --hostfile job; a stand-in for ssh runs its hosts' commands here, 127.0.0.2's in an IPC
# namespace of their own, so that the nodes take it for another machine): node 0 asks for
# it to be ended, and the launcher has the watcher on its host end it. Then under SLURM
# (a stand-in for srun, task 1 on "another machine"): node 0's task passes the request to
# task 1, which ends its node and starts it again.
#   tests/faults/fence_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
job=(train "${small[@]}" --pipeline 2 --data-parallel 2 --steps 24 --eval-interval 0 --global-batch 16)

"$launcher" "${job[@]}" --nodes 2 --metrics "$tmp/ref.jsonl" --save "$tmp/ref.pt" >"$tmp/ref.log" 2>&1 \
  && ok "fault-free run" || bad "fault-free run" "$tmp/ref.log"

# frozen NAME FENCED_LINE LAUNCHER_ARGS...: the job with node 1 stopped after step 6; node 0's
# log must hold FENCED_LINE (PID: node 1's).
frozen() {
  local name=$1 fenced=$2 pid rc out secs node1 stopped_at i
  shift 2
  ${srun:-} "$launcher" "${job[@]}" "$@" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" >"$tmp/$name.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 600; i++)); do grep -q "step  *6/24 |" "$tmp/$name.log" && break; sleep 0.1; done
  node1=$(own_pids | while read -r p; do grep -qzx "TROUPE_NODE=1" "/proc/$p/environ" 2>/dev/null && echo "$p"; done | head -1)
  stopped_at=$(date +%s.%N)
  kill -STOP "${node1:-0}" && ok "$name: node 1 (pid $node1) stopped (SIGSTOP) after step 6" \
    || bad "$name: no node 1 to stop" "$tmp/$name.log"
  wait $pid
  rc=$?
  [ $rc = 0 ] && grep -qF "${fenced//PID/$node1}" "$tmp/$name.log" \
    && grep -q "node 1 ended (status 137); starting it again" "$tmp/$name.log" && grep -q "node 1 rejoined" "$tmp/$name.log" \
    && ok "$name: the frozen node was fenced and replaced; its replacement rejoined" \
    || bad "$name: not fenced and replaced (exit $rc)" "$tmp/$name.log"
  ! grep -q "the job failed" "$tmp/$name.log" && ok "$name: no job restart" || bad "$name: the job was restarted" "$tmp/$name.log"
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/$name" 0 2>&1) \
    && ok "$name: bit-identical to the fault-free run, no step replayed ($out)" \
    || { echo "$out"; bad "$name: results differ" "$tmp/$name.log"; }
  # From the SIGSTOP to the retried step's start (the log's clock: the same machine).
  secs=$(/usr/bin/python3 - "$tmp/$name.log" "$stopped_at" <<'PY'
import datetime, re, sys
log, stopped = sys.argv[1], float(sys.argv[2])
day = datetime.datetime.fromtimestamp(stopped)
base = day.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
for line in open(log, errors="replace"):
    if "running it again" in line:
        m = re.search(r"\[(\d\d):(\d\d):(\d\d\.\d+)\]", line)
        t = base + int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        print(f"{(t - stopped) % 86400:.1f}")
        break
PY
)
  [ -n "$secs" ] && /usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 20 else 1)" "$secs" \
    && ok "$name: the step ran again $secs s after the node froze" \
    || bad "$name: the step ran again after ${secs:-?} s" "$tmp/$name.log"
  kill -0 "$node1" 2>/dev/null && bad "$name: the frozen process (pid $node1) still exists" \
    || ok "$name: the frozen process is gone"
}

frozen local "node 1 is lost to the job but its process (pid PID) is stopped: ended it (SIGKILL)" --nodes 2

fake=$tmp/fake-ssh
cat >"$fake" <<'SSH'
#!/usr/bin/env bash
# ssh HOST COMMAND, run here; on 127.0.0.2 in an IPC namespace of its own (another machine
# to the nodes: their machine key).
while [ $# -gt 0 ]; do case "$1" in -o|-F|-p) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1
shift
if [ "$host" = 127.0.0.2 ]; then exec unshare --ipc bash -c "$*"; else exec bash -c "$*"; fi
SSH
chmod +x "$fake"
printf '127.0.0.1\n127.0.0.2\n' >"$tmp/hosts"
if unshare --ipc true 2>/dev/null; then
  TROUPE_SSH=$fake frozen remote "node 1 is lost to the job; its process (pid PID) runs on another machine: the launcher ends it there if it lives on (fence request: node 1 pid PID)" \
    --hostfile "$tmp/hosts"
  grep -q "troupe: ending node 1's process (pid [0-9]*) on its host" "$tmp/remote.log" \
    && ok "remote: the launcher passed node 0's request on to node 1's host" \
    || bad "remote: the launcher did not pass node 0's request on" "$tmp/remote.log"
else
  echo "skip remote: unshare --ipc needs root"
fi

# Under SLURM: a stand-in for `srun -n 2` starts the two tasks, task 1 in an IPC namespace
# of its own (another machine). Node 0's task passes the request on through the fence
# folder, task 1 ends its frozen node and starts it again to rejoin.
cat >"$tmp/srun-2" <<'SRUN'
#!/usr/bin/env bash
cd "$(dirname "$0")"  # (srun: the submitting folder)
export SLURM_NTASKS=2 SLURM_NNODES=2 SLURM_NODELIST=localhost SLURM_JOB_ID=$$
SLURM_PROCID=0 SLURM_LOCALID=0 "$@" &
t0=$!
SLURM_PROCID=1 SLURM_LOCALID=0 unshare --ipc "$@" &
t1=$!
wait $t0
rc=$?
[ $rc = 0 ] || kill -TERM $t1 2>/dev/null  # (as srun ends the other tasks)
wait $t1
rc1=$?
[ $rc != 0 ] || rc=$rc1
exit $rc
SRUN
chmod +x "$tmp/srun-2"
if unshare --ipc true 2>/dev/null; then
  export TROUPE_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n') TROUPE_PORT=$(free_port)
  srun=$tmp/srun-2 frozen slurm "fence request: node 1 pid PID"
  grep -q "troupe: ending node 1's process (pid [0-9]*) on its host (node 0's fence request)" "$tmp/slurm.log" \
    && ok "slurm: task 1 ended its node on node 0's request (the fence folder)" \
    || bad "slurm: task 1 did not end its node" "$tmp/slurm.log"
  ! ls -d "$tmp"/.troupe-fence-* 2>/dev/null && ok "slurm: the fence folder is gone" || bad "slurm: the fence folder is left"
  unset TROUPE_JOB_TOKEN TROUPE_PORT
else
  echo "skip slurm: unshare --ipc needs root"
fi
sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
