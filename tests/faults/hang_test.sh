#!/usr/bin/env bash
# Hangs diagnosed in seconds with the default configuration (no --step-timeout): a 2-node
# p2 x d2 gpt-tiny job meets a lost activation, a lost gradient, a stalled reduce-scatter
# and a frozen stage actor. Each time the coordinator's watchdog finds no progress within
# its limit (train.hang_min_seconds, 5 s, or 4 median steps on a loaded machine), asks
# every actor what it waits for, logs the wait-for graph naming the right actors and
# message, and the step is retried in place: detected within 5 s of its limit after the
# fault (10 s on an idle machine), and the run ends bit-identical to the fault-free one.
# The frozen actors freeze for 25 s, longer than a loaded machine's limit. A
# tensor-parallel job (p2 x T2 on 2 nodes) meets a frozen TP rank: its peer, whose thread
# waits inside the group's collective, is reported by its node (which collective of which
# group, waiting for whom) and the frozen rank is the root; the same for an
# expert-parallel job (moe-tiny) and its all-to-all. A slow but healthy step (an
# activation delayed 2 s) is not a hang.
# SIGUSR2 to the launcher has node 0 log the graph of a running job, which goes on.
#   tests/faults/hang_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
job=(train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --steps 8 --eval-interval 0 --global-batch 16)

# fault_free NAME WHAT: the fault-free run of the job, the one hang() then compares with.
fault_free() {
  ref=$1
  "$launcher" "${job[@]}" --metrics "$tmp/$ref.jsonl" --save "$tmp/$ref.pt" >"$tmp/$ref.log" 2>&1 \
    && ok "fault-free $2run" || bad "fault-free $2run" "$tmp/$ref.log"
}
fault_free ref ""

# seconds_between LOG A B: seconds from the first line matching A to the first matching B
# (the log lines' [HH:MM:SS.mmm] stamps).
seconds_between() {
  /usr/bin/python3 - "$@" <<'PY'
import re, sys
log, a, b = sys.argv[1:]
def stamp(pattern):
    for line in open(log, errors="replace"):
        if re.search(pattern, line):
            m = re.search(r"\[(\d\d):(\d\d):(\d\d\.\d+)\]", line)
            if m:
                return int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
    sys.exit(f"no line matching {pattern!r} in {log}")
print(f"{(stamp(b) - stamp(a)) % 86400:.2f}")
PY
}

# hang NAME EXPECTED-ROOT-REGEX EXPECTED-WAIT-REGEX FAULT-FLAGS...: the fault is diagnosed
# within its hang limit (as the log states it) + 5 s, with EXPECTED in the graph and its
# root, retried in place, bit-identical.
hang() {
  local name=$1 root_re=$2 wait_re=$3
  shift 3
  "$launcher" "${job[@]}" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" "$@" >"$tmp/$name.log" 2>&1
  local rc=$?
  local secs
  secs=$(seconds_between "$tmp/$name.log" "fault injected" "no progress for .* waits for" 2>&1) || secs=""
  if [ $rc != 0 ] || [ -z "$secs" ]; then
    bad "$name: exit $rc, or no diagnosis ($secs)" "$tmp/$name.log"
    return
  fi
  grep -A30 "no progress for" "$tmp/$name.log" | grep -qE "$wait_re" \
    && ok "$name: the graph says: $(grep -oE "$wait_re" "$tmp/$name.log" | head -1)" \
    || bad "$name: no line matching '$wait_re' in the graph" "$tmp/$name.log"
  grep -A30 "no progress for" "$tmp/$name.log" | grep -E "^  root: " | grep -qE "$root_re" \
    && ok "$name: root: $(grep -E "^  root: " "$tmp/$name.log" | head -1 | cut -c9-)" \
    || bad "$name: the root does not match '$root_re'" "$tmp/$name.log"
  local limit
  limit=$(grep -m1 -oE "no progress for [0-9.]+ s \(hang limit [0-9.]+ s\)" "$tmp/$name.log" | grep -oE "[0-9.]+ s\)" | tr -d ' s)')
  /usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) + 5 else 1)" "$secs" "${limit:-0}" \
    && ok "$name: diagnosed $secs s after the fault (hang limit $limit s)" \
    || bad "$name: diagnosed $secs s after the fault (hang limit ${limit:-?} s, + 5 s allowed)" "$tmp/$name.log"
  grep -q "retrying it in place (1 of" "$tmp/$name.log" && ! grep -q "restart 1" "$tmp/$name.log" \
    || bad "$name: not retried in place" "$tmp/$name.log"
  local out
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/$ref" "$tmp/$name" 0 2>&1) \
    && ok "$name: bit-identical to the fault-free run ($out)" || { echo "$out"; bad "$name: results differ" "$tmp/$name.log"; }
}

s00='stage\[replica 0, stage 0\]' s01='stage\[replica 0, stage 1\]'
s10='stage\[replica 1, stage 0\]' s11='stage\[replica 1, stage 1\]'
# Stage (replica 0, stage 0)'s first message of step 5 is an activation to stage 1 (both
# on node 0); stage (replica 1, stage 1)'s a gradient to stage 0 (node 1).
hang lost-activation "activation mb 0 chunk 0 from $s00 to $s01 was sent and never received: a lost message" \
  "$s01 \(node 0\) waits for activation mb 0 chunk 0 from $s00 \(node 0\)" --message drop@0:0:4
hang lost-gradient "gradient mb 0 chunk 0 from $s11 to $s10 was sent and never received: a lost message" \
  "$s10 \(node 1\) waits for gradient mb 0 chunk 0 from $s11 \(node 1\)" --message drop@1:1:4
hang stalled-reduce-scatter "shard\[stage 1, rank 0\] \(node 0\) waits for nothing \(holds every gradient bucket and started no reduce-scatter" \
  "shard\[stage 1, rank 1\] \(node 1\) waits for the reduce-scatter of its gradients from shard\[stage 1, rank 0\] \(node 0\)" \
  --stall 1:0:4
hang frozen-actor "$s01 \(node 0\) does not answer \(its node answered, but its thread is in no op" \
  "$s01 \(node 0\) did not answer within 2 s" --freeze 0:1:4:25

# A slow but healthy step: an activation delayed 2 s. No diagnosis, no retry, the same bits.
"$launcher" "${job[@]}" --metrics "$tmp/slow.jsonl" --save "$tmp/slow.pt" --message delay=2@0:0:4 >"$tmp/slow.log" 2>&1
rc=$?
if [ $rc = 0 ] && grep -q "fault injected" "$tmp/slow.log" && ! grep -q "no progress for\|retrying it in place" "$tmp/slow.log"; then
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/slow" 0 2>&1) \
    && ok "a step slowed by 2 s is not a hang ($out)" || { echo "$out"; bad "slow step: results differ" "$tmp/slow.log"; }
  /usr/bin/python3 - "$tmp/slow.jsonl" <<'PY' && ok "the slow step took 2 s or more" || bad "the slow step was not slow" "$tmp/slow.log"
import json, sys
steps = {j["step"]: j for j in map(json.loads, open(sys.argv[1])) if "loss" in j}
sys.exit(0 if steps[4]["step_seconds"] >= 2 else 1)
PY
else
  bad "slow step: exit $rc, or called a hang" "$tmp/slow.log"
fi

# SIGUSR2 to the launcher: node 0 logs the graph of the running job, which goes on.
"$launcher" train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --steps 400 --eval-interval 0 --global-batch 16 >"$tmp/status.log" 2>&1 &
pid=$!
for ((i = 0; i < 600; i++)); do grep -q "step  *3/400 |" "$tmp/status.log" && break; sleep 0.1; done
kill -USR2 $pid
for ((i = 0; i < 100; i++)); do grep -q "status of step" "$tmp/status.log" && break; sleep 0.1; done
kill -TERM $pid
wait $pid
rc=$?
grep -q "status of step .* what each actor waits for" "$tmp/status.log" && ! grep -q "retrying it in place\|no progress for" "$tmp/status.log" \
  && [ $rc = 130 ] && ok "SIGUSR2: node 0 logged the wait-for graph, the job went on" \
  || bad "SIGUSR2: no status logged, or the job was disturbed (exit $rc)" "$tmp/status.log"

# Tensor parallelism: pipeline 1 (replica 0's TP rank 1) freezes at its second op of step
# index 4; rank 0 computes that op and waits inside the group's first collective of it.
job=(train "${small[@]}" --nodes 2 --pipeline 2 --tensor-parallel 2 --steps 8 --eval-interval 0 --global-batch 16)
fault_free tp-ref "tensor-parallel "
t0='stage\[replica 0, stage 0, tp 0\]' t1='stage\[replica 0, stage 0, tp 1\]'
hang frozen-tp-rank "$t1 \(node 0\) does not answer" \
  "$t0 \(node 0\) waits for all-(reduce|gather) #[0-9]+ of the tensor-parallel group of replica 0, stage 0 from $t1 \(node 0\); its thread is in op F1 \(mb 1, chunk 0\)" \
  --freeze 1:0:4:25

# Context parallelism (ring attention; each node hosts a replica's ring): pipeline 1
# (replica 0's cp rank 1) freezes at its second op of step index 4; cp rank 0 computes
# that op and waits for the ring's shift of its next key/value block.
job=(train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --context-parallel 2 --steps 8 --eval-interval 0
  --global-batch 16)
fault_free cp-ref "context-parallel "
c0='stage\[replica 0, stage 0, cp 0\]' c1='stage\[replica 0, stage 0, cp 1\]'
hang frozen-cp-rank "$c1 \(node 0\) does not answer" \
  "$c0 \(node 0\) waits for ring shift #[0-9]+ of the context-parallel group of replica 0, stage 0 from $c1 \(node 0\); its thread is in op F1 \(mb 1, chunk 0\)" \
  --freeze 1:0:4:25

# Expert parallelism (moe-tiny, EP 2 x p2 x d2, one process): replica 1's stage 1 freezes
# at its second op; replica 0's stage 1 waits in its backward's all-to-all for it.
job=(train "${small[@]}" --workload moe-tiny --expert-parallel 2 --data-parallel 2 --pipeline 2 --steps 6 --eval-interval 0 --global-batch 16)
fault_free ep-ref "expert-parallel "
hang frozen-ep-rank "$s11 \(node 0\) does not answer" \
  "$s01 \(node 0\) waits for all-to-all #[0-9]+ of the expert-parallel group of replicas 0-1, stage 1 \(backwards\) from $s11 \(node 0\); its thread is in op B0" \
  --freeze 1:1:4:25

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
