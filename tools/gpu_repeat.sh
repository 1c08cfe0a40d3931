#!/usr/bin/env bash
# Do bf16 runs on a GPU repeat their bits, and match as 4 node processes, with and
# without deterministic algorithms? (An experiment, not a check: it prints, it asserts
# nothing; docs/gpu.md gives what it showed on an H200.)
#
#   TROUPE_DEBS=.debs tools/gpu_repeat.sh OUT_DIR    (builds build-gpu/ with launch/setup-gpu)
#   TROUPE_GPU_BUILD_DIR=build-gpu tools/gpu_repeat.sh OUT_DIR   (a build already there)
#
# Runs gpt-tiny bf16 p2 d2 (6 steps) three times in one process and as 4 node processes
# (CUDA IPC, staged), then gpt-small bf16 p=4 (6 steps) twice without and twice with
# --deterministic true; prints each run's first grad norms and which runs are identical.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: tools/gpu_repeat.sh OUT_DIR}
mkdir -p "$out"
exec > >(tee -a "$out/repeat.log") 2>&1
nvidia-smi -L
t0=$SECONDS
b=${TROUPE_GPU_BUILD_DIR:-}
if [ -z "$b" ]; then
  command -v ninja >/dev/null && export CMAKE_GENERATOR=Ninja
  env_lines=$(TROUPE_BUILD_TARGET=troupe "$root/launch/setup-gpu" 2>"$out/build.log") || { tail -40 "$out/build.log"; exit 1; }
  eval "$env_lines"
  b=$TROUPE_BUILD_DIR
  echo "built in $((SECONDS - t0)) s"
fi
w=$(mktemp -d /tmp/troupe-gpu-repeat-XXXXXX)
same() {  # same A B: are runs A and B identical (tests/support/compare_runs.py)?
  if python3 "$root/tests/support/compare_runs.py" "$w/$1" "$w/$2" 0 >/dev/null 2>"$w/cmp.err"; then
    echo "$1 = $2: identical"
  else
    echo "$1 vs $2: $(tail -1 "$w/cmp.err")"
  fi
}
norms() {  # the first three steps' grad norms of run $1
  python3 -c 'import json, sys; r = [json.loads(l) for l in open(sys.argv[1]) if "grad_norm" in l]
print(sys.argv[2], "grad norms", ["%.12g" % x["grad_norm"] for x in r[:3]])' "$w/$1.jsonl" "$1"
}
one() {  # one NAME ARGS...: a one-process run
  local name=$1
  shift
  "$b/troupe" "$@" --metrics "$w/$name.jsonl" --save "$w/$name.pt" >"$w/$name.run" 2>&1 ||
    { echo "$name failed"; tail -5 "$w/$name.run"; }
  norms "$name"
}
tiny=(train --device cuda --pipeline 2 --data-parallel 2 --steps 6 --eval-interval 0 --precision bf16)
nodes() {  # nodes NAME ENV...: tiny as 4 node processes
  local name=$1
  shift
  env TROUPE_BUILD_DIR="$b" TROUPE_SKIP_SETUP=1 "$@" "$root/launch/troupe" "${tiny[@]}" --nodes 4 \
    --metrics "$w/$name.jsonl" --save "$w/$name.pt" >"$w/$name.run" 2>&1 || { echo "$name failed"; tail -5 "$w/$name.run"; }
  norms "$name"
}
for i in 1 2 3; do one "tiny-$i" "${tiny[@]}"; done
same tiny-1 tiny-2
same tiny-1 tiny-3
nodes tiny-nodes4
nodes tiny-nodes4-staged TROUPE_IPC=0
same tiny-1 tiny-nodes4
same tiny-1 tiny-nodes4-staged
same tiny-nodes4 tiny-nodes4-staged
small=(train --workload gpt-small --device cuda --precision bf16 --pipeline 4 --steps 6 --eval-interval 0)
one small-1 "${small[@]}"
one small-2 "${small[@]}"
one small-det-1 "${small[@]}" --deterministic true
one small-det-2 "${small[@]}" --deterministic true
same small-1 small-2
same small-det-1 small-det-2
same small-1 small-det-1
echo "done in $((SECONDS - t0)) s (runs in $w)"
