#!/usr/bin/env bash
# launch/troupe --hostfile ... --min-nodes M: a host that stops answering is left out and
# the job goes on, from its newest checkpoint, on the hosts left. The hosts are 127.0.0.x
# reached through a stand-in for ssh that runs the command on this machine, and that
# refuses a host once a node process on it was killed (a machine that died), for its next
# $FAKE_SSH_DOWN_FOR connections (default: for good).
#  1. p1 x d3 on 3 hosts, node 2's host dies: 2 nodes, d2 of 6 micro-batches instead of d3
#     of 4 (same micro-batch size, same global batch); then node 0 dies, and the host is
#     back for that restart: d3 on 3 nodes again. Bit-identical to a run of d3 up to the
#     first checkpoint, then d2 resumed from it up to the second, then d3 again; every
#     step's loss the same.
#  2. p2 x d1 on 2 hosts, node 0's (the coordinator's) host dies: one node on the other
#     host, the job's own layout: bit-identical to the fault-free run. A tensor-parallel
#     group spread over 2 hosts loses one: the group goes on in one node, bit-identical.
#  3. a host back while the job runs without it (--regrow-interval): node 0 ends the job
#     after its step with a checkpoint and it goes on with the host again, bit-identical to
#     the fault-free run; a host lost for good and replaced in the hostfile meanwhile: the
#     same with the new host; without a checkpoint_dir the job stays on the hosts it has.
#  4. hosts that answer but cannot run a node (checked before every launch with `troupe
#     check-host`): one with another fortunes corpus is left out before the start
#     (bit-identical to a d2 run), one with none ends a job without --min-nodes (exit 1);
#     a bad job ends with 2 before any node.
#  5. refusals: --min-nodes above the hosts, or without --hostfile; `troupe elastic-layout`.
#   tests/faults/elastic_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"

fake=$tmp/fake-ssh
cat >"$fake" <<'EOF'
#!/usr/bin/env bash
# ssh HOST COMMAND, run here; HOST in $FAKE_SSH_DOOMED is gone (exit 255) once a command
# run on it was killed by SIGKILL, for its next $FAKE_SSH_DOWN_FOR connections.
while [ $# -gt 0 ]; do case "$1" in -o|-F|-p) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1
shift
gone=$FAKE_SSH_DIR/gone-$host
if [ -e "$gone" ]; then
  left=$(cat "$gone")
  if [ "$left" -gt 0 ]; then
    echo $((left - 1)) >"$gone"
    echo "ssh: connect to host $host port 22: Connection refused" >&2
    exit 255
  fi
  rm -f "$gone"
fi
# HOST=DIR in $FAKE_SSH_FORTUNES: on HOST the fortunes folder holds DIR's files instead (a
# mount namespace), a host with other data.
run=(bash -c "$*")
for m in ${FAKE_SSH_FORTUNES:-}; do
  [ "${m%%=*}" != "$host" ] ||
    run=(unshare -m bash -c 'mount --bind "$1" /usr/share/games/fortunes && exec bash -c "$2"' _ "${m#*=}" "$*")
done
"${run[@]}" <&0 &
c=$!
trap 'kill -TERM $c 2>/dev/null' TERM
wait $c
s=$?
while kill -0 $c 2>/dev/null; do wait $c; s=$?; done
case " ${FAKE_SSH_DOOMED:-} " in *" $host "*) [ $s != 137 ] || echo "${FAKE_SSH_DOWN_FOR:-1000000}" >"$gone" ;; esac
exit $s
EOF
chmod +x "$fake"
export TROUPE_SSH=$fake FAKE_SSH_DIR=$tmp
same_run() { /usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/$1" "$tmp/$2" 1 "$3"; }
# Checkpoint folders written before training goes on (--checkpoint-async false): a node
# killed two steps after a checkpoint finds its folder complete, and the references resume
# from it (a background folder may still be being written then, on a busy machine:
# tests/faults/checkpoint_write_test.sh covers those).
sync_ck=(--checkpoint-async false)
cd "$tmp"

# --- 1. a host of a data-parallel job lost: fewer replicas ----------------------------
printf '127.0.0.1\n127.0.0.2\n127.0.0.3\n' >hosts3
job=("${small[@]}" --pipeline 1 --global-batch 36 --steps 14 --eval-interval 0 --checkpoint-interval 5 --threads 1 "${sync_ck[@]}")
# Node 2 dies as step index 7 begins (launch 0), node 0 as index 10 begins (launch 1); the
# host of node 2 refuses the launcher's two probes (when node 2 ends, before restart 1)
# and answers the one before restart 2.
FAKE_SSH_DOOMED=127.0.0.3 FAKE_SSH_DOWN_FOR=2 TROUPE_FAULTS=kill_node=2:7 TROUPE_FAULTS_1=kill_node=0:10 \
  "$launcher" train --hostfile hosts3 --min-nodes 2 "${job[@]}" --data-parallel 3 --microbatches 4 \
  --checkpoint-dir ck1 --metrics e1.jsonl --save e1.pt >e1.log 2>&1
rc=$?
[ $rc = 0 ] && ok "host of node 2 lost: the job finished (exit 0)" || bad "host of node 2 lost: exit $rc" e1.log
grep -q "node 2 ended (status 137) and its host 127.0.0.3 cannot run a node (ssh: connect to host 127.0.0.3 port 22: Connection refused): stopping the job" e1.log \
  && ok "the launcher saw node 2's host gone" || bad "no line about node 2's host" e1.log
grep -q "going on without host(s) 127.0.0.3, pipeline 1 x data-parallel 3 of 4 micro-batches -> pipeline 1 x data-parallel 2 of 6 micro-batches (of 3 samples) on 2 node(s): 127.0.0.1 127.0.0.2" e1.log \
  && grep -q "node 1 of 2: 127.0.0.2" e1.log && ! grep -q "node 2 of 2" e1.log \
  && ok "went on with 2 nodes, d2 of 6 micro-batches" || bad "no shrunk launch" e1.log
grep -q "every host can run a node again: pipeline 1 x data-parallel 3 of 4 micro-batches -> pipeline 1 x data-parallel 3 of 4 micro-batches (of 3 samples) on 3 node(s): 127.0.0.1 127.0.0.2 127.0.0.3" e1.log \
  && [ "$(grep -c "node 2 of 3: 127.0.0.3" e1.log)" = 2 ] && ok "took the host back at the next restart: d3 on 3 nodes" \
  || bad "host not taken back" e1.log
# The reference, in one process: d3 of 4 micro-batches up to the checkpoint of step 5 (the
# newest when node 2 died as step index 7 began), d2 of 6 micro-batches from it up to the
# checkpoint of step 10 (node 0 died as index 10 began), then d3 again.
"$launcher" train --nodes 1 "${job[@]}" --data-parallel 3 --microbatches 4 --checkpoint-dir ref1a \
  --metrics ref1.jsonl >ref1a.log 2>&1 &&
  "$launcher" train --nodes 1 "${job[@]}" --data-parallel 2 --microbatches 6 --resume ref1a/step-00000005 \
    --checkpoint-dir ref1b --metrics ref1.jsonl >ref1b.log 2>&1 &&
  "$launcher" train --nodes 1 "${job[@]}" --data-parallel 3 --microbatches 4 --resume ref1b/step-00000010 \
    --metrics ref1.jsonl --save ref1.pt >ref1c.log 2>&1
rc=$?
[ $rc = 0 ] && ok "reference: d3 to step 5, d2 to step 10, d3" || bad "reference runs: exit $rc" ref1c.log
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" ref1 e1 2 2>&1) \
  && ok "bit-identical to d3, d2, d3, the same loss every step ($out)" \
  || { echo "$out"; bad "host lost and back: results differ from the reference"; }

# --- 2. node 0's host lost: the coordinator moves to the next host --------------------
printf '127.0.0.1\n127.0.0.2\n' >hosts2
job=("${small[@]}" --pipeline 2 --data-parallel 1 --global-batch 16 --microbatches 4 --steps 12 --eval-interval 0 --threads 1 "${sync_ck[@]}")
"$launcher" train --nodes 1 "${job[@]}" --metrics ref2.jsonl --save ref2.pt >ref2.log 2>&1
rc=$?
[ $rc = 0 ] && ok "fault-free p2 run" || bad "fault-free p2 run: exit $rc" ref2.log
FAKE_SSH_DOOMED=127.0.0.1 "$launcher" train --hostfile hosts2 --min-nodes 1 "${job[@]}" --checkpoint-dir ck2 \
  --checkpoint-interval 5 --kill-node 0:7 --metrics e2.jsonl --save e2.pt >e2.log 2>&1
rc=$?
[ $rc = 0 ] && grep -q "going on without host(s) 127.0.0.1, .* on 1 node(s): 127.0.0.2" e2.log \
  && grep -q "node 0 of 1: 127.0.0.2" e2.log && ok "node 0's host lost: went on with node 0 on 127.0.0.2" \
  || bad "node 0's host lost: exit $rc" e2.log
out=$(same_run ref2 e2 2 2>&1) && ok "bit-identical to the fault-free run ($out)" \
  || { echo "$out"; bad "node 0's host lost: results differ"; }

# Tensor parallelism: a T2 group spread over the 2 hosts (one rank on each); node 1's
# host is lost: the group goes on whole in one node, from the checkpoint of step 5, and
# the run is bit-identical to the fault-free one (the same group in one process).
rm -f gone-*
job=("${small[@]}" --pipeline 1 --tensor-parallel 2 --global-batch 16 --microbatches 4 --steps 10 --eval-interval 0 --threads 1 "${sync_ck[@]}")
"$launcher" train --nodes 1 "${job[@]}" --metrics reft.jsonl --save reft.pt >reft.log 2>&1 \
  || bad "fault-free T2 run" reft.log
FAKE_SSH_DOOMED=127.0.0.2 "$launcher" train --hostfile hosts2 --min-nodes 1 "${job[@]}" --checkpoint-dir ckt \
  --checkpoint-interval 5 --kill-node 1:7 --metrics et.jsonl --save et.pt >et.log 2>&1
rc=$?
[ $rc = 0 ] && grep -q "stages (replica,stage,tp) (0,0,1)" et.log \
  && grep -q "going on without host(s) 127.0.0.2, pipeline 1 x data-parallel 1 x tensor-parallel 2 of 4 micro-batches -> pipeline 1 x data-parallel 1 x tensor-parallel 2 of 4 micro-batches (of [0-9]* samples) on 1 node(s): 127.0.0.1" et.log \
  && ok "a spread tensor-parallel group's host lost: went on with the group in one node" \
  || bad "a spread tensor-parallel group's host lost: exit $rc" et.log
out=$(same_run reft et 2 2>&1) && ok "bit-identical to the fault-free T2 run ($out)" \
  || { echo "$out"; bad "tensor-parallel host lost: results differ"; }

# --- 3. a host back while the job runs without it: taken back without a failure -------
# p1 x d2 on 2 hosts; node 1 dies as step index 5 begins, and its host refuses the next 3
# connections (the launcher's probe when node 1 ended, the check before restart 1, the
# first regrow check): the job goes on from the checkpoint of step 4 on 1 node (both
# replicas there). A later regrow check (every second) finds the host back: node 0 ends
# the job after its step with a checkpoint, and the job goes on from it on 2 nodes, a
# launch that is no failure restart. Bit-identical to the fault-free run.
rm -f gone-*
# gpt-tiny's own shape here, not $small: the job must still be running when the host is
# back (3 refused connections, then a check a second), and small steps end 30 of them first.
job=(--pipeline 1 --data-parallel 2 --global-batch 8 --microbatches 4 --steps 30 --eval-interval 0 --threads 1 "${sync_ck[@]}")
"$launcher" train --nodes 1 "${job[@]}" --metrics rg1.jsonl --save rg1.pt >rg1.log 2>&1 || bad "fault-free d2 run" rg1.log
FAKE_SSH_DOOMED=127.0.0.2 FAKE_SSH_DOWN_FOR=3 TROUPE_FAULTS=kill_node=1:5 \
  "$launcher" train --hostfile hosts2 --min-nodes 1 --regrow-interval 1 "${job[@]}" --checkpoint-dir ck6 \
  --checkpoint-interval 2 --metrics g1.jsonl --save g1.pt >g1.log 2>&1
rc=$?
stopped=$(sed -n 's/.*stopped by SIGTERM after step \([0-9]*\) of 30.*/\1/p' g1.log | head -1)
[ $rc = 0 ] && grep -q "going on without host(s) 127.0.0.2, .* on 1 node(s): 127.0.0.1$" g1.log \
  && grep -q "checking host(s) 127.0.0.2 every 1 s to take them back (--regrow-interval)" g1.log \
  && ok "host of node 1 lost: on 1 node, the host checked every second" || bad "host lost, regrow: exit $rc" g1.log
grep -q "host(s) 127.0.0.2 can run a node: node 0 ends the job after its step with a checkpoint, to go on with them (.* on 2 node(s))" g1.log \
  && [ -n "$stopped" ] && [ "$stopped" -gt 4 ] && [ "$stopped" -lt 30 ] \
  && grep -q "every host can run a node again: .* on 2 node(s): 127.0.0.1 127.0.0.2" g1.log \
  && [ "$(grep -c "node 1 of 2: 127.0.0.2" g1.log)" = 2 ] \
  && [ "$(grep -c "the job failed" g1.log)" = 1 ] && ! grep -q "not restarting" g1.log \
  && ok "host back: stopped after step $stopped with a checkpoint, on 2 nodes again (one failure restart)" \
  || bad "host back: not taken back while running (stopped: '$stopped')" g1.log
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" rg1 g1 2 2>&1) && ok "bit-identical to the fault-free run ($out)" \
  || { echo "$out"; bad "host taken back: results differ from the fault-free run"; }
# The metrics log says why each launch resumed, and how long the one taking the host back
# took from its stop request to its first step.
out=$(/usr/bin/python3 - g1.jsonl <<'PY' 2>&1
import json, sys
r = [j for j in map(json.loads, open(sys.argv[1])) if j.get("event") == "resume"]
assert [j.get("cause") for j in r] == ["failure", "hosts back"], r
assert "seconds_from_failure_to_step" in r[0] and "seconds_from_stop_to_step" not in r[0], r[0]
s = r[1]["seconds_from_stop_to_step"]
assert 0 < s < 60 and "seconds_from_failure_to_step" not in r[1], r[1]
print(f"from the stop request to the next step: {s:.2f} s")
PY
) && ok "resume lines: cause failure, then hosts back ($out)" || bad "resume lines: $out"
# A host lost for good and replaced in the hostfile while the job runs without it: the
# next check reads the hostfile again and takes the new host.
printf '127.0.0.1\n127.0.0.2\n' >hosts-swap
FAKE_SSH_DOOMED=127.0.0.2 TROUPE_FAULTS=kill_node=1:5 \
  "$launcher" train --hostfile hosts-swap --min-nodes 1 --regrow-interval 1 "${job[@]}" --checkpoint-dir ck7 \
  --checkpoint-interval 2 --metrics g3.jsonl --save g3.pt >g3.log 2>&1 &
launch=$!
for ((i = 0; i < 600; i++)); do grep -q "checking host(s) 127.0.0.2" g3.log && break; sleep 0.1; done
printf '127.0.0.1\n127.0.0.3   # in place of 127.0.0.2\n' >hosts-swap.new && mv hosts-swap.new hosts-swap
wait $launch
rc=$?
[ $rc = 0 ] && grep -q "hostfile hosts-swap now names: 127.0.0.1 127.0.0.3" g3.log \
  && grep -q "host(s) 127.0.0.3 can run a node: node 0 ends the job after its step with a checkpoint" g3.log \
  && grep -q "every host can run a node again: .* on 2 node(s): 127.0.0.1 127.0.0.3" g3.log \
  && grep -q "node 1 of 2: 127.0.0.3" g3.log && [ "$(grep -c "the job failed" g3.log)" = 1 ] \
  && ok "a lost host replaced in the hostfile: taken while the job runs" || bad "host replaced: exit $rc" g3.log
out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" rg1 g3 2 2>&1) && ok "bit-identical to the fault-free run ($out)" \
  || { echo "$out"; bad "host replaced: results differ from the fault-free run"; }
# Without a checkpoint_dir nothing can go on from where the job is: it stays shrunk.
rm -f gone-*
job=("${small[@]}" --pipeline 1 --global-batch 8 --steps 8 --eval-interval 0 --threads 1)
FAKE_SSH_DOOMED=127.0.0.2 FAKE_SSH_DOWN_FOR=2 TROUPE_FAULTS=kill_node=1:3 \
  "$launcher" train --hostfile hosts2 --min-nodes 1 --regrow-interval 1 "${job[@]}" --data-parallel 2 \
  --microbatches 4 >g2.log 2>&1
rc=$?
[ $rc = 0 ] && grep -q "the job has no checkpoint_dir: it stays on 1 node(s) (taking host(s) 127.0.0.2 back needs a checkpoint to go on from)" g2.log \
  && ! grep -q "stopped by SIGTERM" g2.log && ! grep -q "checking host(s)" g2.log \
  && ok "no checkpoint_dir: stays on 1 node" || bad "no checkpoint_dir, regrow: exit $rc" g2.log

# --- 4. hosts that answer ssh but cannot run a node of the job -------------------------
rm -f gone-*  # every host is back
if unshare -m true 2>/dev/null; then
  mkdir -p fewer empty
  cp /usr/share/games/fortunes/[a-f]* fewer/ 2>/dev/null
  job=("${small[@]}" --pipeline 1 --global-batch 24 --steps 6 --eval-interval 0 --threads 1)
  # a) 127.0.0.3 reads another corpus: with --min-nodes the job starts without it, as d2
  #    of 6 micro-batches on 2 nodes (not on data other than the job's).
  FAKE_SSH_FORTUNES="127.0.0.3=$tmp/fewer" "$launcher" train --hostfile hosts3 --min-nodes 2 "${job[@]}" \
    --data-parallel 3 --microbatches 4 --metrics e3.jsonl --save e3.pt >e3.log 2>&1
  rc=$?
  [ $rc = 0 ] && grep -q "host 127.0.0.3 cannot run a node: its data ([0-9]* bytes, fnv1a [0-9a-f]*) is not the other hosts' ([0-9]* bytes, fnv1a [0-9a-f]*): every node must read the same" e3.log \
    && grep -q "going on without host(s) 127.0.0.3, .* data-parallel 2 of 6 micro-batches .* on 2 node(s): 127.0.0.1 127.0.0.2" e3.log \
    && ! grep -q "node 2 of" e3.log && ! grep -q "restart" e3.log \
    && ok "a host with other data: left out before the start, d2 on 2 nodes" || bad "a host with other data: exit $rc" e3.log
  "$launcher" train --nodes 1 "${job[@]}" --data-parallel 2 --microbatches 6 --metrics ref3.jsonl --save ref3.pt \
    >ref3.log 2>&1 || bad "reference d2 run" ref3.log
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" ref3 e3 0 2>&1) && ok "bit-identical to a d2 run ($out)" \
    || { echo "$out"; bad "a host with other data: results differ from a d2 run"; }
  # b) Without --min-nodes a host with no data ends the job before anything starts.
  FAKE_SSH_FORTUNES="127.0.0.2=$tmp/empty" "$launcher" train --hostfile hosts3 "${job[@]}" --data-parallel 3 \
    --microbatches 4 >e4.log 2>&1
  rc=$?
  [ $rc = 1 ] && grep -q "host 127.0.0.2 cannot run a node: fortunes corpus in /usr/share/games/fortunes is empty" e4.log \
    && grep -q "host(s) 127.0.0.2 cannot run a node (with --min-nodes M the job goes on without such hosts)" e4.log \
    && ! grep -q "node 0 of" e4.log && ok "a host without data, no --min-nodes: exit 1 before any node started" \
    || bad "a host without data: exit $rc" e4.log
else
  echo "SKIP hosts that cannot run a node: no mount namespaces here (unshare -m needs root)"
fi
# A bad job is the job's fault, not a host's: exit 2 before any node, with --min-nodes too.
"$launcher" train "${small[@]}" --hostfile hosts3 --min-nodes 1 --pipeline 1 --global-batch 24 --data-parallel 3 \
  --microbatches 5 --steps 2 >e5.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "troupe: error: .*global_batch 24 is not divisible by data_parallel (3) x microbatches (5)" e5.log \
  && ! grep -q "node 0 of" e5.log && ! grep -q "cannot run a node" e5.log \
  && ok "a bad job: exit 2 before any node" || bad "a bad job over a hostfile: exit $rc" e5.log

# --- 5. refusals ----------------------------------------------------------------------
"$launcher" train "${small[@]}" --hostfile hosts2 --min-nodes 3 --steps 1 >r1.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "min-nodes must be a count from 1 to the hostfile's 2, not '3'" r1.log \
  && ok "--min-nodes above the hosts: exit 2" || bad "--min-nodes 3 of 2 hosts: exit $rc" r1.log
"$launcher" train "${small[@]}" --hostfile hosts2 --min-nodes 1 --regrow-interval 1.5 --steps 1 >r3.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "regrow-interval must be whole seconds, not '1.5'" r3.log && ! grep -q "node 0 of" r3.log \
  && ok "--regrow-interval 1.5: exit 2" || bad "--regrow-interval 1.5: exit $rc" r3.log
"$launcher" train "${small[@]}" --nodes 2 --min-nodes 1 --steps 1 >r2.log 2>&1
rc=$?
[ $rc = 2 ] && grep -q "min-nodes needs --hostfile" r2.log && ok "--min-nodes without --hostfile: exit 2" \
  || bad "--min-nodes without a hostfile: exit $rc" r2.log
out=$("$TROUPE_BUILD_DIR/troupe" elastic-layout --hosts 2 --min-nodes 1 --pipeline 1 --data-parallel 4 --device cuda 2>&1)
rc=$?
[ $rc = 0 ] && [ "$(head -1 <<<"$out")" = "2 4 8" ] && ok "elastic-layout of a GPU job on a launcher host without a GPU: $(head -1 <<<"$out")" \
  || bad "elastic-layout --device cuda: exit $rc: $out"
out=$("$TROUPE_BUILD_DIR/troupe" elastic-layout --hosts 3 --min-nodes 3 --pipeline 1 --data-parallel 4 2>&1)
rc=$?
[ $rc = 2 ] && [[ $out == *"fits 3 node(s)"* ]] && ok "no layout for 3 nodes of d4: exit 2 ($out)" \
  || bad "elastic-layout d4 on 3 nodes: exit $rc: $out"

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
