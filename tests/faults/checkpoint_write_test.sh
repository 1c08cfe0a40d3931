#!/usr/bin/env bash
# Node processes killed (SIGKILL) at random moments of a background checkpoint write
# (output.checkpoint_async, the default): the folder being written is never taken for a
# complete one. A node that rejoins leaves the job running (the folder abandoned, the next
# one written); a job restarted resumes from the newest complete folder, which is the one
# being written only if every part of it was durable before the kill, else the one before.
# Every run ends bit-identical to the fault-free run with the same loss log, and no
# temporary folder is left behind.
#   tests/faults/checkpoint_write_test.sh REPO_ROOT BUILD_DIR [sharded]
#   sharded: pipeline 2 x data-parallel 2 with the parameters sharded, whose shards (not
#   the stages) each write their own file of a folder
#   SEED=N: the trials' random choices (printed; default: from the clock)
source "$(dirname "$0")/../support/launcher_lib.sh" "$@"
steps=8
layout=(--pipeline 2)
[ "${3:-}" = sharded ] && layout=(--pipeline 2 --data-parallel 2 --shard parameters)
job=(train "${small[@]}" --nodes 2 "${layout[@]}" --steps $steps --eval-interval 0 --global-batch 16
  --checkpoint-interval 2)
seed=${SEED:-$(date +%s)}
RANDOM=$seed
echo "seed $seed (SEED=$seed reruns these trials)"

"$launcher" "${job[@]}" --checkpoint-dir "$tmp/ref.ck" --metrics "$tmp/ref.jsonl" --save "$tmp/ref.pt" \
  >"$tmp/ref.log" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "checkpoint snapshot taken in" "$tmp/ref.log" && ok "fault-free run (background checkpoints)" \
  || bad "fault-free run: exit $rc" "$tmp/ref.log"
# (A step aborted in a run without faults is a bug: parameters sharded, a shard once
# reported its step done before its buddy copy was acknowledged, and the next step hung.)
! grep -q "aborted" "$tmp/ref.log" && ok "fault-free run: no step aborted" || bad "fault-free run: a step aborted" "$tmp/ref.log"
if [ "${3:-}" = sharded ]; then
  last="$tmp/ref.ck/step-$(printf %08d $steps)"
  ls "$last" | grep -qx "stage-1-shard-1.pt" && ! ls "$last" | grep -q "^optim" \
    && ok "fault-free run: every shard wrote its own file" || bad "fault-free run: not written by the shards" "$tmp/ref.log"
fi
# How long a background folder takes to be durable here: the kills fall within 1.5 times it.
durable=$(grep -o "durable [0-9.]* s after its snapshot" "$tmp/ref.log" | awk '{ s += $2; n++ } END { print n ? s / n : 0.05 }')
echo "background folders durable $durable s after their snapshot (fault-free run)"

same() {  # name, resumes: bit-identical to the fault-free run, the same loss log
  local out
  out=$(/usr/bin/python3 "$root/tests/support/compare_runs.py" "$tmp/ref" "$tmp/$1" "$2" 2>&1) \
    && ok "$1: bit-identical ($out)" || { echo "$out"; bad "$1: results differ" "$tmp/$1.log"; }
}
no_temporary() {  # name: no .step-*.tmp left in its checkpoint folder
  local left
  left=$(find "$tmp/$1.ck" -maxdepth 1 -name '.step-*' | wc -l)
  [ "$left" = 0 ] && ok "$1: no temporary folder left" || bad "$1: $left temporary folder(s) left" "$tmp/$1.log"
}
# trial NAME NODE INDEX DELAY MODE [random]: node NODE kills itself DELAY s into its background
# write of the checkpoint after step index INDEX (the folder of step INDEX + 1); MODE
# rejoin (node 1 comes back into the running job) or restart (--max-node-restarts 0: the
# launcher restarts the job). A node lost before node 0 has every stage's snapshot answer
# is lost between steps, where the job restarts in either mode. `random`: the moment may
# fall after the node's run has ended (see below).
trial() {
  local name=$1 node=$2 index=$3 delay=$4 mode=$5 random=${6:-} folder=$(($3 + 1)) extra=()
  [ "$mode" = restart ] && extra=(--max-node-restarts 0)
  "$launcher" "${job[@]}" --checkpoint-dir "$tmp/$name.ck" --metrics "$tmp/$name.jsonl" --save "$tmp/$name.pt" \
    --kill-in-write "$node:$index:$delay" "${extra[@]}" >"$tmp/$name.log" 2>&1
  local rc=$? log=$tmp/$name.log
  echo "$name: node $node killed $delay s into its write of step $folder's folder ($mode)"
  if ! grep -q "fault injected: node $node kills its own process (SIGKILL) .* into its background write of step $folder's" \
    "$log" && [ "$random" = random ]; then
    [ $rc = 0 ] && ok "$name: the run ended before the kill was due (it does not fire then)" || bad "$name: exit $rc" "$log"
    same "$name" 0
    return
  fi
  grep -q "fault injected: node $node kills its own process (SIGKILL) .* into its background write of step $folder's" \
    "$log" && [ $rc = 0 ] && ok "$name: the fault fired, the run finished" || bad "$name: exit $rc" "$log"
  # What node 0 saw before the job's restart (if there is one): every snapshot taken,
  # the folder complete (node 0 completes it).
  local first taken=0 completed=0
  first=$(sed '/the job failed (status/q' "$log")
  grep -q "step $folder: checkpoint snapshot taken" <<<"$first" && taken=1
  grep -q "step $folder: checkpoint written to .*: durable" <<<"$first" && completed=1
  # A kill that falls in an evaluation (a random one, late in a slow write, in the run's
  # last) loses the node between steps too: the job restarts (docs/faults.md).
  local between=0
  grep -q "the evaluation after step [0-9/]* failed: node $node is gone" <<<"$first" && between=1
  if [ "$mode" = rejoin ] && [ $taken = 1 ] && [ $between = 0 ]; then
    if [ $completed = 0 ]; then
      grep -q "step $folder: checkpoint not written: .*\(background writer ended before its files were durable\|no answer\)" \
        "$log" && ok "$name: the folder of step $folder was abandoned, training went on" \
        || bad "$name: the folder of step $folder neither written nor abandoned" "$log"
    fi
    if grep -q "node 1 rejoined" "$log"; then
      ok "$name: node 1 rejoined (the folder complete before the kill: $completed)"
    elif [ "$random" = random ] && ! grep -q "the job failed (status" "$log" && ! grep -q "aborted" "$log"; then
      # (A random moment past the run's last use of the node: node 0 had everything.)
      ok "$name: node 1 was killed after the run's last step needed it (no rejoin, no restart)"
    else
      bad "$name: node 1 did not rejoin" "$log"
    fi
    same "$name" 0
  else
    # The newest folder node 0 completed before the job failed: the killed write's, the
    # one before it, or (a kill late in a fast write) a later one.
    local expect from also=-1
    expect=$(grep -o "checkpoint written to [^ ]*/step-[0-9]*" <<<"$first" | tail -1 | grep -o "[0-9]*$")
    expect=$((10#${expect:-0}))
    # Node 0 killed just as it completes the folder: renamed, but its log line lost with it.
    [ $completed = 0 ] && [ "$node" = 0 ] && also=$folder
    from=$(grep -o "resumed from [^ ]*: continuing with step [0-9]*" "$log" | head -1)
    { [[ "$from" == *"step-$(printf %08d $expect): continuing with step $((expect + 1))" ]] ||
      [[ "$from" == *"step-$(printf %08d $also): continuing with step $((also + 1))" ]]; } \
      && ok "$name: restarted from the newest complete folder, step $expect (the killed write's folder complete: $completed; every snapshot taken: $taken; lost in an evaluation: $between)" \
      || bad "$name: resumed '$from', expected the folder of step $expect" "$log"
    same "$name" 1
  fi
  no_temporary "$name"
  [ -e "$tmp/$name.ck/step-$(printf %08d $steps)/manifest.json" ] && ok "$name: the final folder is there" \
    || bad "$name: no final folder" "$log"
}

# Early in the write (10 ms; 0 s: as it begins, perhaps before node 0 has the stage's
# answer): the folder of step 4 cannot be complete.
trial rejoin-early 1 3 0.01 rejoin
trial restart-0 1 3 0 restart
# Random moments of random writes (step indexes 3 and 5: the background folders 4 and 6,
# with a complete folder before them), up to 1.5 times the fault-free run's write (a
# moment after the node's run has ended, on a machine less busy than then, fires
# nothing): node 1 rejoining, and node 0 or 1 lost with the job restarted.
pick() { awk -v r=$RANDOM -v d="$durable" 'BEGIN { printf "%.3f", r / 32767 * 1.5 * d }'; }
trial rejoin-r 1 $((RANDOM % 2 * 2 + 3)) "$(pick)" rejoin random
trial restart-r $((RANDOM % 2)) $((RANDOM % 2 * 2 + 3)) "$(pick)" restart random

sleep 0.5
[ "$(nodes_left)" = 0 ] && ok "no node left" || bad "$(nodes_left) node(s) left"
exit $fail
