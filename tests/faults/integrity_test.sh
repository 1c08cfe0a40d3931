#!/usr/bin/env bash
# Nothing lost, nothing silently wrong, tried from outside as an operator would:
# - a --save pair whose two files are of different saves is refused, naming both steps
#   (a crash between their renames leaves such a pair); the pair's files load in torch;
# - a checkpoint_dir in use by a running job is refused to a second job (exit 2, before
#   its node processes start); the lock of a job killed by SIGKILL does not block the next;
# - a frozen node 0 (SIGSTOP, never continued) is ended and the job restarts from its
#   newest checkpoint, bit-identical to the fault-free run; without a checkpoint_dir it
#   ends with exit 75 and the reason;
# - SIGKILL of the launcher ends its node processes (and its one process);
# - a `latest` of NUL bytes and a corrupt newest step folder fall back, with warnings, to
#   the newest folder that verifies (the corrupt one kept aside), bit-identical; strict
#   mode refuses; all folders corrupt: refused, not started afresh over;
# - early errors of a 2-node job end it within seconds, before or right after its nodes
#   start; --nodes 64 is refused before any node starts; bad input exits 2;
# - --save on a full file system: warned at the start; the run's last save fails, keeps
#   the previous pair and says where the final weights are (a small tmpfs; skipped where
#   it cannot be mounted);
# - --resume auto on a finished run says so and writes --save from its final folder.
#   tests/faults/integrity_test.sh REPO_ROOT BUILD_DIR
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
# --global-batch 16: half the default batch in as many micro-batches: the same schedule,
# messages and faults in about 60 % of the CPU time (the test suite is CPU-bound).
job=(train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --eval-interval 0 --steps 6 --checkpoint-interval 2 --global-batch 16)
py=/usr/bin/python3
# same_params A B: the two state_dict files hold the same tensors, bit for bit.
same_params() {
  "$py" - "$1" "$2" <<'PY'
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert list(a) == list(b), "different parameter names"
diff = [k for k in a if not torch.equal(a[k], b[k])]
assert not diff, f"parameters differ: {diff[:3]}"
PY
}
seconds_since() { echo "$(date +%s.%N) $1" | awk '{printf "%.1f", $1 - $2}'; }
started() { for ((i = 0; i < 900; i++)); do grep -q "$2" "$1" && return 0; sleep 0.1; done; return 1; }
node_pid() { sed -n "s/^troupe: node $2 of [0-9]*: localhost, pid \([0-9]*\).*/\1/p" "$1" | tail -1; }

# The fault-free run: pairs and folders at steps 2, 4 and 6.
"$launcher" "${job[@]}" --save "$tmp/ref.pt" --checkpoint-dir "$tmp/ref-ck" --metrics "$tmp/ref.jsonl" \
  >"$tmp/ref.log" 2>&1
rc=$?
[ $rc = 0 ] && ok "fault-free run" || bad "fault-free run: exit $rc" "$tmp/ref.log"
"$py" -c "import torch, sys; m = torch.load(sys.argv[1], weights_only=True); o = torch.load(sys.argv[2], weights_only=True); assert int(o['step'][0]) == 6 and len(m) > 0" \
  "$tmp/ref.pt" "$tmp/ref.pt.optim" && ok "--save pair: both files load with torch.load(weights_only=True)" \
  || bad "--save pair: torch.load fails"

# 1. A mixed pair: the step-2 model beside the step-6 optimizer state (what a crash
# between the two renames leaves, or a file copied over one of them) is refused.
"$launcher" train "${small[@]}" --nodes 1 --pipeline 2 --data-parallel 2 --eval-interval 0 --steps 2 --save "$tmp/s2.pt" \
  >"$tmp/s2.log" 2>&1 || bad "the step-2 pair" "$tmp/s2.log"
cp "$tmp/s2.pt" "$tmp/mixed.pt" && cp "$tmp/ref.pt.optim" "$tmp/mixed.pt.optim"
"$launcher" "${job[@]}" --load "$tmp/mixed.pt" >"$tmp/mixed.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "mixed.pt (of step 2) and .*mixed.pt.optim (of step 6) are not the two files of one --save" \
  "$tmp/mixed.log" && ! grep -q "continuing with step" "$tmp/mixed.log" \
  && ok "mixed --save pair: refused naming both steps, exit 2" || bad "mixed --save pair: exit $rc" "$tmp/mixed.log"
"$launcher" train "${small[@]}" --nodes 1 --runtime local --pipeline 2 --data-parallel 2 --eval-interval 0 --steps 6 \
  --load "$tmp/mixed.pt" >"$tmp/mixed-local.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "are not the two files of one --save" "$tmp/mixed-local.log" \
  && ok "mixed --save pair: the plain loop refuses it too" || bad "mixed pair, plain loop: exit $rc" "$tmp/mixed-local.log"

# 2. Two jobs on one checkpoint_dir: the second is refused (in one process, and as a
# 2-node job before its nodes start); after SIGKILL of the first, its lock is gone.
"$launcher" train "${small[@]}" --nodes 1 --steps 2000 --eval-interval 0 --checkpoint-dir "$tmp/shared" >"$tmp/first.log" 2>&1 &
first=$!
started "$tmp/first.log" "step  *2/2000 |" || bad "the first job did not start" "$tmp/first.log"
"$launcher" train "${small[@]}" --nodes 1 --steps 20 --seed 99 --eval-interval 0 --checkpoint-dir "$tmp/shared" >"$tmp/second.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "checkpoint_dir = '$tmp/shared' is in use by another running job (pid [0-9]* on" "$tmp/second.log" \
  && ok "a second job on a checkpoint_dir in use: refused, exit 2" || bad "second job: exit $rc" "$tmp/second.log"
"$launcher" "${job[@]}" --seed 99 --checkpoint-dir "$tmp/shared" >"$tmp/second2.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "is in use by another running job" "$tmp/second2.log" && ! grep -q "node 0 of 2" "$tmp/second2.log" \
  && ok "a second 2-node job on it: refused before its nodes start" || bad "second 2-node job: exit $rc" "$tmp/second2.log"
kill -KILL "$first"  # (the launcher: its one process ends with it, part 4)
wait "$first" 2>/dev/null
for ((i = 0; i < 50; i++)); do [ "$(own_pids troupe | wc -l)" = 0 ] && break; sleep 0.1; done
"$launcher" train "${small[@]}" --nodes 1 --steps 2 --eval-interval 0 --checkpoint-dir "$tmp/shared" >"$tmp/third.log" 2>&1
rc=$?
[ $rc = 0 ] && ok "after SIGKILL of the first job its lock does not block the next" || bad "third job: exit $rc" "$tmp/third.log"

# 3. Node 0 frozen (SIGSTOP, never continued): node 1 loses it, its rejoin cannot reach
# it, the launcher ends node 0 and the job restarts from the step-2 checkpoint.
TROUPE_JOIN_TIMEOUT_MS=8000 "$launcher" "${job[@]}" --save "$tmp/frozen.pt" --checkpoint-dir "$tmp/frozen-ck" \
  --metrics "$tmp/frozen.jsonl" >"$tmp/frozen.log" 2>&1 &
launch=$!
if started "$tmp/frozen.log" "step 3/6 |"; then
  kill -STOP "$(node_pid "$tmp/frozen.log" 0)"
  stopped_at=$(date +%s.%N)
fi
wait $launch
rc=$?
took=$(seconds_since "${stopped_at:-0}")
[ $rc = 0 ] && grep -q "could not reach the coordinator (node 0) within its join timeout: ending node 0" "$tmp/frozen.log" \
  && grep -q "restart 1 of at most 3" "$tmp/frozen.log" \
  && ok "frozen node 0: ended by the launcher, the job restarted and finished (${took} s after the stop)" \
  || bad "frozen node 0: exit $rc" "$tmp/frozen.log"
same_params "$tmp/ref.pt" "$tmp/frozen.pt" && ok "frozen node 0: bit-identical to the fault-free run" \
  || bad "frozen node 0: parameters differ"
# Without node restarts node 1 is not started again to find out; node 0 does not end the
# job (it is frozen), so the launcher ends it after 15 s. Without a checkpoint_dir there is
# nothing to restart from: a clear error, in bounded time.
"$launcher" train "${small[@]}" --nodes 2 --pipeline 2 --data-parallel 2 --eval-interval 0 --steps 2000 --max-node-restarts 0 \
  >"$tmp/frozen-bare.log" 2>&1 &
launch=$!
if started "$tmp/frozen-bare.log" "step  *3/2000 |"; then
  kill -STOP "$(node_pid "$tmp/frozen-bare.log" 0)"
  stopped_at=$(date +%s.%N)
fi
wait $launch
rc=$?
took=$(seconds_since "${stopped_at:-0}")
[ $rc = 75 ] && grep -q "node 0 has not ended the job within 15 s of losing a node that is not started again" \
  "$tmp/frozen-bare.log" && grep -q "node 0 did not answer and was ended; the job has no checkpoint_dir to restart from" \
  "$tmp/frozen-bare.log" && ! grep -q "; restart 1 of" "$tmp/frozen-bare.log" \
  && ok "frozen node 0, no checkpoint_dir: exit 75 with the reason, ${took} s after the stop" \
  || bad "frozen node 0, no checkpoint_dir: exit $rc" "$tmp/frozen-bare.log"

# 4. SIGKILL of the launcher: its node processes end with it (2 nodes, and one process).
for n in 2 1; do
  "$launcher" train "${small[@]}" --nodes $n --pipeline 2 --data-parallel 2 --steps 2000 --eval-interval 0 >"$tmp/orphan$n.log" 2>&1 &
  launch=$!
  started "$tmp/orphan$n.log" "step  *2/2000 |" || bad "the job to orphan ($n) did not start" "$tmp/orphan$n.log"
  comm=troupe-node
  [ $n = 2 ] || comm=troupe
  before=$(own_pids $comm | wc -l)
  kill -KILL $launch
  wait $launch 2>/dev/null
  for ((i = 0; i < 50; i++)); do [ "$(own_pids $comm | wc -l)" = 0 ] && break; sleep 0.1; done
  left=$(own_pids $comm | wc -l)
  [ "$before" -gt 0 ] && [ "$left" = 0 ] && ok "SIGKILL of the launcher ($n node(s)): its $before process(es) ended with it" \
    || bad "SIGKILL of the launcher ($n): $left of $before process(es) left"
done

# 5, 6 and 10. Copies of the fault-free run's folder. A `latest` of NUL bytes and a
# corrupt newest folder: the newest that verifies (step 4) continues, bit-identical, and
# the corrupt one is kept aside. The intact copy: already complete, --save written from it.
cp -r "$tmp/ref-ck" "$tmp/bad-ck"
printf '\0\0\0\0' >"$tmp/bad-ck/latest"
"$py" -c "import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 0xff; open(p, 'wb').write(b)" \
  "$tmp/bad-ck/step-00000006/stage-1.pt"
cp -r "$tmp/bad-ck" "$tmp/strict-ck"
"$launcher" "${job[@]}" --checkpoint-dir "$tmp/strict-ck" --resume auto --strict-resume true >"$tmp/strict.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "step-00000006: stage-1.pt is truncated or corrupt .* (output.strict_resume" "$tmp/strict.log" \
  && [ -d "$tmp/strict-ck/step-00000006" ] && ok "corrupt newest folder, strict: refused, exit 2" \
  || bad "strict: exit $rc" "$tmp/strict.log"
"$launcher" "${job[@]}" --checkpoint-dir "$tmp/bad-ck" --resume auto --save "$tmp/fallback.pt" >"$tmp/fallback.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "'latest' holds no step folder's name; taking the newest complete step folder" "$tmp/fallback.log" \
  && grep -q "step-00000006 does not verify (stage-1.pt is truncated or corrupt" "$tmp/fallback.log" \
  && grep -q "continuing with step 5" "$tmp/fallback.log" && [ -d "$tmp/bad-ck/corrupt-step-00000006" ] \
  && ok "NUL 'latest' and a corrupt newest folder: warned, continued from step 4, the bad one kept aside" \
  || bad "fall-back: exit $rc" "$tmp/fallback.log"
same_params "$tmp/ref.pt" "$tmp/fallback.pt" && ok "fall-back: bit-identical to the fault-free run" \
  || bad "fall-back: parameters differ"
mkdir -p "$tmp/all-bad" && cp -r "$tmp/ref-ck/step-00000006" "$tmp/all-bad/"
truncate -s 100 "$tmp/all-bad/step-00000006/stage-0.pt"
for run in 1 2; do  # nothing is moved aside: the second run refuses as the first did
  "$launcher" "${job[@]}" --checkpoint-dir "$tmp/all-bad" --resume auto >"$tmp/all-bad.log" 2>&1
  rc=$?
  [ $rc = 2 ] && grep -q "no checkpoint in $tmp/all-bad verifies .*refusing to start from step 0" "$tmp/all-bad.log" \
    && [ -d "$tmp/all-bad/step-00000006" ] && ok "every folder corrupt (run $run): refused (exit 2), not started afresh over them" \
    || bad "all bad (run $run): exit $rc" "$tmp/all-bad.log"
done
cp -r "$tmp/ref-ck" "$tmp/done-ck"
"$launcher" "${job[@]}" --checkpoint-dir "$tmp/done-ck" --resume auto --save "$tmp/done.pt" >"$tmp/done.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "the run is already complete: checkpoint .*step-00000006 is at step 6 of 6" "$tmp/done.log" \
  && grep -q "checkpoint written to $tmp/done.pt" "$tmp/done.log" && same_params "$tmp/ref.pt" "$tmp/done.pt" \
  && "$py" -c "import torch, sys; assert int(torch.load(sys.argv[1])['step'][0]) == 6" "$tmp/done.pt.optim" \
  && ok "--resume auto on a finished folder: says so, --save written from it" || bad "finished folder: exit $rc" "$tmp/done.log"

# 7 and 8. Early errors of a 2-node job: found before its nodes start (bad data, too many
# nodes), or by node 0 (a corrupt checkpoint folder named by --resume): exit 2 within seconds.
t0=$(date +%s.%N)
"$launcher" "${job[@]}" --text "$tmp/no-such-text" >"$tmp/early-text.log" 2>&1
rc=$? took=$(seconds_since "$t0")
[ $rc = 2 ] && ! grep -q "node 0 of 2" "$tmp/early-text.log" \
  && ok "bad --text, 2 nodes: exit 2 before any node starts (${took} s)" || bad "bad --text: exit $rc" "$tmp/early-text.log"
"$launcher" train "${small[@]}" --nodes 64 --eval-interval 0 >"$tmp/early-64.log" 2>&1
rc=$?
[ $rc = 2 ] && grep -q "64 nodes" "$tmp/early-64.log" && ! grep -q "node 0 of 64" "$tmp/early-64.log" \
  && ok "--nodes 64: refused before any node starts" || bad "--nodes 64: exit $rc" "$tmp/early-64.log"
# (From node 0's error to the launcher's end: it waited 10 s for node 1 before.)
mkdir -p "$tmp/early" && cp -r "$tmp/ref-ck/step-00000004" "$tmp/early/"
truncate -s 1000 "$tmp/early/step-00000004/optim-stage-0.pt"
"$launcher" "${job[@]}" --resume "$tmp/early/step-00000004" >"$tmp/early-ckpt.log" 2>&1 &
launch=$!
started "$tmp/early-ckpt.log" "troupe: error: node 0" && t0=$(date +%s.%N)
wait $launch
rc=$? took=$(seconds_since "${t0:-0}")
[ $rc = 2 ] && grep -q "optim-stage-0.pt is truncated or corrupt" "$tmp/early-ckpt.log" \
  && awk -v t="$took" 'BEGIN { exit !(t < 5) }' \
  && ok "a corrupt --resume folder found by node 0: exit 2, the launcher ended ${took} s after node 0's error" \
  || bad "corrupt --resume: exit $rc, ${took} s after the error" "$tmp/early-ckpt.log"
"$launcher" train "${small[@]}" --nodes 1 --steps 1 --init "$tmp/ref.jsonl" >"$tmp/bad-init.log" 2>&1
rc=$?
[ $rc = 2 ] && ok "a bad --init file: exit 2" || bad "bad --init: exit $rc" "$tmp/bad-init.log"

# 9. --save on a full file system (a 1 MB tmpfs: the pair takes about 10 MB).
if mkdir -p "$tmp/small" && mount -t tmpfs -o size=1m tmpfs "$tmp/small" 2>/dev/null; then
  "$launcher" "${job[@]}" --save "$tmp/small/m.pt" --checkpoint-dir "$tmp/full-ck" >"$tmp/full.log" 2>&1
  rc=$?
  umount "$tmp/small"
  [ $rc = 1 ] && grep -q "output.save $tmp/small/m.pt: its folder has [0-9]* MB free" "$tmp/full.log" \
    && grep -q "cannot write --save $tmp/small/m.pt at step 6 (the run's last).*are as they were before this run; the run's final weights are in checkpoint folder $tmp/full-ck/step-00000006" "$tmp/full.log" \
    && [ -f "$tmp/full-ck/step-00000006/manifest.json" ] \
    && ok "--save on a full disk: warned at the start; the last save failed saying where the weights are" \
    || bad "--save on a full disk: exit $rc" "$tmp/full.log"
else
  echo "skip --save on a full disk: cannot mount a tmpfs here"
fi

sleep 0.5
[ "$(nodes_left)" = 0 ] && [ "$(own_pids troupe | wc -l)" = 0 ] && ok "no process left" || bad "$(nodes_left) node(s) left"
exit $fail
