#!/usr/bin/env bash
# Validation on a machine with an NVIDIA GPU (not part of CI, which has none): everything
# the GPU path promises, in one command, after `eval "$(launch/setup-gpu)"`.
#
#   tests/gpu/gpu_check.sh [BUILD_DIR] [OUT_DIR]     (default build-gpu/, a temporary folder)
#
# 1. the GPU gtests (devices, bf16, the GpuEquivalence layouts vs the CPU, a GPU run's
#    checkpoint resumed on the CPU, NCCL) and the checkpoint tests (but those that run
#    /usr/bin/python3: step 3 reads the files with this machine's python instead);
# 2. in-place retries on the GPU (a stage that throws, one that throws after its update):
#    bit-identical to the fault-free GPU run (tests/support/compare_runs.py); the job evaluating
#    its gathered model (eval_mode gather) against its evaluation in the pipeline (1e-5);
# 3. checkpoint folders rotated on the GPU build (keep 2 of 8; PyTorch 2.x's libtorch.so
#    once crashed removing them), every file read by this python's torch.load with
#    weights_only=True.
# 4. the same job as 4 node processes (launch/troupe --nodes 4: every stage, shard group
#    and tied gradient crosses processes; activations through CUDA IPC buffers, the rest
#    staged through host memory over UCX), with node 3 killed and rejoining, and with
#    TROUPE_IPC=0 (everything staged): bit-identical to the one-process run. On the CPU,
#    TROUPE_STAGE_THROUGH_HOST=1 stages the CPU tensors and TROUPE_IPC=host takes POSIX
#    shared memory for the buffers.
#    TROUPE_LINKS=ucx (plain and with node 3 rejoining): the tensors between stages go
#    through in-order links (transport/ordered_p2p.hpp, the ordering NCCL links need) over
#    one UCX tag: bit-identical again; so are p=4 jobs with a stage per node under
#    interleaved-1f1b and dataflow (their one-process runs the references), and a bf16
#    job (bf16 activations, gradients and all-gathers between the nodes).
# 5. TROUPE_NCCL=1 as 4 node processes. On one GPU every shard group's members share it,
#    and so do the two ends of every link, so the nodes keep those collectives on UCX and
#    their tensors off NCCL (bit-identical again). With 2+ GPUs every link is over NCCL
#    (bit-identical; within 1e-4 where a shard group went over NCCL too, 3+ GPUs). On the
#    CPU the setting is refused (exit 2).
# 6. recompute on the GPU against the reference job; generate (key/value cache on and
#    off) and eval on the GPU against the CPU. The gtests-2x step runs the Recompute and
#    Generate tests (on the CPU, but with this machine's LibTorch 2.x attention).
# 7. the zero-bubble schedule on the GPU (plain and with recompute), and dataflow with a
#    split backward, against the 1f1b reference job. The gtests-2x step runs the ZeroBubble tests (CPU, LibTorch 2.x).
# 8. gradient buckets (--bucket-size 50000: 13 per stage) on the GPU: the hooks on the
#    gradient accumulators run on LibTorch's autograd thread of the device, and a bucket
#    goes to its shard behind an event of that thread's stream; bit-identical to the
#    reference, in one process and as 4 node processes (the buckets staged through host
#    memory), with reduce-scatters begun before their stage's last backward ended.
# 9. check-host on the device and a job on a --text of its own there. Also: the reference
#    job twice (ref-again: every bit-for-bit comparison rests on a GPU run repeating), the
#    one-process bf16 job twice, and 4 nodes under --device auto (each must take the GPU).
# 10. the bf16 jobs of 4. run with deterministic = true (LibTorch's deterministic
#    algorithms, strict); sdpa-determinism (tests/gpu/gpu_determinism.py) shows per fused
#    attention backend whether its bf16 backward repeats its bits, without and with them.
# 11. op-times: a gpt-small job's trace on the GPU has its F/B slices from the GPU op clock
#    (most of each step, not the launches; one stream's ops never overlap).
# 12. llama-experts: llama-tiny (p 2, d 2) and moe-tiny with EP 2 of d 2, p 2 (the actor
#    runtime's all-to-alls) on the device against the same jobs on the CPU, within 1e-4.
# 13. tensor-parallel: llama-small with T = 2 and sequence parallelism (two stage actors
#    sharing the GPU, in one process and as two node processes) within 1e-5 of T = 1 in
#    fp32 with deterministic algorithms, again bit for bit, and llama-tiny T = 2, p 2
#    against the CPU within 1e-4.
# Exits 0 when all passed, 77 without a usable GPU, 1 otherwise; logs stay in OUT_DIR.
# TROUPE_CHECK_DEVICE=cpu runs the same checks on the CPU (to try this script anywhere).
# TROUPE_GPU_CHECK_STEPS=REGEX runs only the steps whose whole name matches (e.g.
# 'ref|nodes-4.*'; the steps compared with the reference need 'ref' too): parts of the
# check can then run side by side (tests/gpu/gpu_session.sh does, on a short GPU lease).
set -uo pipefail

# The check in parts that can run side by side, each with its own reference run
# (tests/gpu/gpu_session.sh on a GPU; CTest's gpu_check_on_cpu_N on the CPU):
# TROUPE_GPU_CHECK_PART=N runs part N's steps (N,M,...: those of several parts, one
# reference run for them all); `gpu_check.sh --parts` prints how many parts there are. TROUPE_GPU_CHECK_STEPS=REGEX runs the steps it matches,
# TROUPE_GPU_CHECK_SKIP=REGEX all but those it matches.
parts=(gtests 'gtests-2x|llama-experts|check-host-text|tensor-parallel'
  'ref|ref-again|eval-modes|inplace-.*|checkpoint-rotation|recompute-generate-eval'
  'ref|nodes-4|nodes-4-rejoin|nodes-4-staged|nodes-4-links|nodes-4-links-rejoin|nodes-4-auto|sdpa-determinism|op-times'
  'ref|nodes-4-links-schedules|nodes-4-bf16|nodes-4-nccl|gradient-buckets|zero-bubble')
if [ "${1:-}" = --parts ]; then
  echo "${#parts[@]}"
  exit 0
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build-gpu}
out=${2:-$(mktemp -d /tmp/troupe-gpu-check-XXXXXX)}
mkdir -p "$out"
if [ -n "$(ls -A "$out")" ]; then  # an older check's files would be read: start clean
  echo "gpu_check: $out is not empty" >&2
  exit 1
fi
python=${PYTHON:-python3}
device=${TROUPE_CHECK_DEVICE:-cuda}
if [ "$device" = cuda ] && ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no usable GPU for $python's torch: nothing checked" >&2
  exit 77
fi
failed=0
only=${TROUPE_GPU_CHECK_STEPS:-}
if [ -n "${TROUPE_GPU_CHECK_PART:-}" ]; then
  only=""
  for p in ${TROUPE_GPU_CHECK_PART//,/ }; do
    [[ $p =~ ^[0-9]+$ ]] && [ "$p" -lt ${#parts[@]} ] || { echo "gpu_check: no part '$p' (0 to $((${#parts[@]} - 1)))" >&2; exit 1; }
    only+=${only:+|}${parts[$p]}
  done
fi
# TROUPE_GPU_CHECK_SKIP=REGEX leaves out the steps whose whole name matches.
skip=${TROUPE_GPU_CHECK_SKIP:-}
selected() { { [ -z "$only" ] || [[ $1 =~ ^($only)$ ]]; } && { [ -z "$skip" ] || ! [[ $1 =~ ^($skip)$ ]]; }; }
for exe in troupe $(selected gtests || selected gtests-2x && echo troupe_tests); do
  [ -x "$build/$exe" ] || { echo "gpu_check: no $build/$exe (run launch/setup-gpu first)" >&2; exit 1; }
done
step() {  # step NAME CMD...: runs CMD, logs to OUT/NAME.log, prints the verdict
  local name=$1
  shift
  selected "$name" || return 0
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name ($((SECONDS - t0)) s): see $out/$name.log"
    tail -5 "$out/$name.log" | sed 's/^/    /'
    failed=1
  fi
}

# The GPU tests (gtests), and the CPU tests that run with this machine's LibTorch 2.x
# (gtests-2x): two steps that run side by side. The tests that run /usr/bin/python3 are left
# out (that python has no torch here: checkpoint-rotation reads the files with this one's).
gtests() {  # gtests NAME MIN FILTER: on the GPU a skipped GPU test is a failure (a build without CUDA or NCCL)
  if [ "$device" = cpu ]; then  # CI runs these tests itself: check that the filter selects them
    "$build/troupe_tests" --gtest_list_tests --gtest_filter="$3" | tee "$out/$1.list"
    local n
    n=$(grep -c '^  ' "$out/$1.list")
    echo "the filter selects $n tests"
    [ "$n" -ge "$2" ]
    return
  fi
  "$build/troupe_tests" --gtest_filter="$3" || return 1
  ! grep -E '^\[  SKIPPED \] [A-Za-z/_0-9.]+ \(' "$out/$1.log" | grep -v -E 'ABuildWithoutNcclSaysSo|WithoutAGpu'
}
# TROUPE_GPU_GTESTS=FILTER: the gtests step runs these (at least one) instead.
step gtests gtests gtests "$([ -n "${TROUPE_GPU_GTESTS:-}" ] && echo 1 || echo 30)" \
  "${TROUPE_GPU_GTESTS:-Device*:Precision*:*Gpu*:KernelProfile*:*Nccl*:Checkpoint*:-Checkpoint.Python*}"
step gtests-2x gtests gtests-2x 8 'Recompute*:Generate*:ZeroBubble*:-Generate.GreedyEqualsPlainPytorch*'

# TROUPE_GPU_CHECK_JOB_STEPS: the steps of the job most checks run (default 14; at least 8:
# a checkpoint folder every 7 steps, a node killed at step 5). CTest's run on the CPU
# takes 8, which exercises the same code in less time.
job_steps=${TROUPE_GPU_CHECK_JOB_STEPS:-14}
[ "$job_steps" -ge 8 ] || { echo "gpu_check: TROUPE_GPU_CHECK_JOB_STEPS must be at least 8" >&2; exit 1; }
# TROUPE_GPU_CHECK_JOB_FLAGS: flags added to every p2 x d2 job of the check (the shared
# job, the --device auto one and the bf16 one). CTest's run on the CPU halves their batch
# (--global-batch 16 --microbatches 4: micro-batches of 2 samples, as the default job's) of the
# model at half its width and sequence length (--d-model 64 --seq-len 64):
# the same code and comparisons in less time.
read -r -a job_flags <<<"${TROUPE_GPU_CHECK_JOB_FLAGS:-}"
# Their [model] flags: generate and eval of the jobs' state_dict files take them too.
model_flags=()
for ((i = 0; i < ${#job_flags[@]}; i++)); do
  case ${job_flags[i]} in
    --layers | --heads | --d-model | --d-ff | --seq-len) model_flags+=("${job_flags[i]}" "${job_flags[i + 1]}") && i=$((i + 1)) ;;
  esac
done
job=(train --device "$device" --pipeline 2 --data-parallel 2 --steps "$job_steps" --eval-interval 0 "${job_flags[@]}")
run_job() { "$build/troupe" "${job[@]}" --metrics "$out/$1.jsonl" --save "$out/$1.pt" "${@:2}"; }
inplace() {  # inplace NAME FAULT...: the fault is retried in place (no resume), bit-identical to ref
  run_job "$@" >"$out/$1.run" 2>&1 || { cat "$out/$1.run"; return 1; }
  grep "retrying it in place" "$out/$1.run" || { echo "no in-place retry in $out/$1.run"; return 1; }
  "$python" "$root/tests/support/compare_runs.py" "$out/ref" "$out/$1" 0
}
step ref run_job ref
# repeats REF NAME: the caller's job run again as NAME is REF bit for bit (every
# comparison that asks for identical bits rests on a GPU run repeating exactly)
repeats() {
  run_job "$2" >"$out/$2.run" 2>&1 || { cat "$out/$2.run"; return 1; }
  "$python" "$root/tests/support/compare_runs.py" "$out/$1" "$out/$2" 0
}
step ref-again repeats ref ref-again
# The final evaluation of ref ran in the pipeline (eval_mode pipeline, the default): the
# same job evaluating the gathered model on node 0 (gather) trains bit for bit as ref and
# gets its validation loss within 1e-5 (fp32: the same forwards on the same device).
eval_modes() {
  run_job eval-gather --eval-mode gather >"$out/eval-gather.run" 2>&1 || { cat "$out/eval-gather.run"; return 1; }
  "$python" "$root/tests/support/compare_runs.py" "$out/ref" "$out/eval-gather" 0 || return 1
  "$python" - "$out/ref.jsonl" "$out/eval-gather.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["val_loss"] for l in open(f) if "val_loss" in l] for f in sys.argv[1:])
print("validation loss, pipeline / gather:", a, b)
assert len(a) == len(b) == 1 and abs(a[0] - b[0]) <= 1e-5 * b[0], (a, b)
PY
}
step eval-modes eval_modes
step inplace-throw inplace throw --throw-at 1:1:6
step inplace-throw-after-update inplace late --throw-at 0:0:5:late

rotate() {
  "$build/troupe" train --device "$device" --steps 8 --eval-interval 0 --checkpoint-dir "$out/ckpt" \
    --checkpoint-interval 1 --keep-checkpoints 2 || return 1
  "$python" - "$out/ckpt" <<'PY'
import os, sys, torch
root = sys.argv[1]
folders = sorted(d for d in os.listdir(root) if d.startswith("step-"))
assert folders == ["step-00000007", "step-00000008"], folders
for d in folders:
    for f in os.listdir(os.path.join(root, d)):
        if f.endswith(".pt"):
            sd = torch.load(os.path.join(root, d, f), weights_only=True)
            assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in sd.values()), f
print("kept", folders)
PY
}
step checkpoint-rotation rotate

nodes() {  # nodes NAME ipc|staged|links FLAGS...: 4 node processes of "${job[@]}", bit-identical to $ref (default: ref)
  local env=(TROUPE_BUILD_DIR="$build" TROUPE_SKIP_SETUP=1) want="go through CUDA IPC buffers"
  [ "$device" = cpu ] && env+=(TROUPE_STAGE_THROUGH_HOST=1) && want="TROUPE_IPC=host"
  [ "$device" = cpu ] && [ "$2" != staged ] && env+=(TROUPE_IPC=host)
  [ "$2" = staged ] && env+=(TROUPE_IPC=0) && want="no shared buffers"
  [ "$2" = links ] && env+=(TROUPE_LINKS=ucx) && want="TROUPE_LINKS=ucx"
  env "${env[@]}" "$root/launch/troupe" "${job[@]}" --nodes 4 \
    --metrics "$out/$1.jsonl" --save "$out/$1.pt" "${@:3}" >"$out/$1.run" 2>&1 || { cat "$out/$1.run"; return 1; }
  grep -E "staged through host memory|every tensor between nodes goes through a host copy" "$out/$1.run" ||
    { echo "no staging line in $out/$1.run"; return 1; }
  grep -F "$want" "$out/$1.run" || { echo "no '$want' in $out/$1.run"; return 1; }
  if [ "$2" = ipc ]; then
    grep -E "tensors to node\(s\) .* \(this machine\): .*point-to-point on this machine through" "$out/$1.run" ||
      { echo "no node put shared buffers under its world communicator in $out/$1.run"; return 1; }
  fi
  if [ "$2" = links ]; then  # every node passes tensors to its pipeline neighbour through links
    [ "$(grep -c "tensors between nodes: .*; in-order links to rank(s) " "$out/$1.run")" -ge 4 ] ||
      { echo "not every node put in-order links under its world communicator in $out/$1.run"; return 1; }
  fi
  "$python" "$root/tests/support/compare_runs.py" "$out/${ref:-ref}" "$out/$1" 0
}
# nodes_with_folder NAME ipc|staged|links: nodes with checkpoint folders (every 7 steps and
# at the end), which the nodes' stages write themselves (GPU tensors to host files): the
# last folder's stage files, read by this python's torch.load (weights_only=True, CPU
# tensors), are the --save file bit for bit (fp32 main parameters in bf16 jobs too), its
# optimizer files hold both moments of every parameter, and the manifest is of the last step.
nodes_with_folder() {
  local i steps
  for ((i = 0; i < ${#job[@]}; i++)); do [ "${job[$i]}" = --steps ] && steps=${job[$((i + 1))]}; done
  nodes "$1" "$2" --checkpoint-dir "$out/$1.ckpt" --checkpoint-interval 7 "${@:3}" || return 1
  "$python" - "$out/$1.ckpt" "$out/$1.pt" "$steps" <<'PY'
import json, os, sys, torch
root, save, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
folder = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
manifest = json.load(open(os.path.join(folder, "manifest.json")))
want = torch.load(save, weights_only=True)
got, optim = {}, {}
for f in sorted(os.listdir(folder)):
    if f.endswith(".pt"):
        sd = torch.load(os.path.join(folder, f), weights_only=True)
        assert all(v.device.type == "cpu" for v in sd.values()), f
        (optim if f.startswith("optim-") else got).update(sd)
assert manifest["step"] == steps, (manifest["step"], steps)
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
for k in want:
    assert torch.equal(got[k], want[k]), f"{k}: folder and --save differ by {(got[k] - want[k]).abs().max().item()}"
for k in want:
    for m in ("exp_avg.", "exp_avg_sq."):
        assert optim[m + k].shape == want[k].shape, m + k
print(f"{os.path.basename(folder)}: {len(got)} parameters equal to the --save file, {len(optim)} optimizer entries")
PY
}
step nodes-4 nodes_with_folder nodes-4 ipc
step nodes-4-rejoin nodes nodes-4-rejoin ipc --kill-node 3:5
step nodes-4-staged nodes nodes-4-staged staged
step nodes-4-links nodes nodes-4-links links
step nodes-4-links-rejoin nodes nodes-4-links-rejoin links --kill-node 3:5
# --device auto with several nodes: the GPU when node 0 has one (as --device cuda above).
auto_nodes() {
  local job=(train --device auto --pipeline 2 --data-parallel 2 --steps "$job_steps" --eval-interval 0 "${job_flags[@]}")
  nodes nodes-4-auto ipc || return 1
  [ "$device" = cpu ] || [ "$(grep -c "computes on cuda:" "$out/nodes-4-auto.run")" = 4 ] ||
    { echo "not every node computes on a GPU"; return 1; }
}
step nodes-4-auto auto_nodes

# Links under the schedules that order their messages otherwise, p=4 with a stage per
# node (links between neighbours and between the first and last stage):
# interleaved-1f1b with 2 chunks (each stage sends both ways in every phase) and dataflow
# (a stage runs whatever is ready: receives posted in another order than the sends). A
# one-process run of the same job is the reference.
links_schedules() {
  local name ref job
  for name in interleaved dataflow; do
    job=(train --device "$device" --pipeline 4 --data-parallel 1 --steps 6 --eval-interval 0)
    [ $name = interleaved ] && job+=(--schedule interleaved-1f1b --chunks 2) || job+=(--schedule dataflow --microbatches 8)
    ref=p4-$name-ref
    run_job "$ref" >"$out/$ref.run" 2>&1 || { cat "$out/$ref.run"; return 1; }
    nodes "p4-$name-links" links || return 1
  done
}
step nodes-4-links-schedules links_schedules

# bf16 as 4 node processes: activations and their gradients cross the nodes in bf16
# (CUDA IPC buffers), the shard groups all-gather bf16 parameter values (staged through
# host memory): bit-identical to the one-process bf16 run, both with deterministic = true.
# Without it the one-process bf16 run on the H200 gave other bits in another session
# (grad norm of step 1 apart by 2e-9 relative; the 4-node run the same bits both times):
# the stages compute at the same time on the one GPU there, and the default bf16
# attention backward need not repeat its bits (sdpa-determinism below tells).
bf16_nodes() {
  local ref=bf16-ref job=(train --device "$device" --pipeline 2 --data-parallel 2 --steps 6 --eval-interval 0
    --precision bf16 --deterministic true "${job_flags[@]}")
  run_job "$ref" >"$out/$ref.run" 2>&1 || { cat "$out/$ref.run"; return 1; }
  grep -F ", bf16, deterministic" "$out/$ref.run" || { echo "no deterministic mode in the log"; return 1; }
  local rc=0
  repeats "$ref" bf16-ref-again || rc=1  # else a difference below is the one-process run's own
  nodes_with_folder nodes-4-bf16 ipc || rc=1
  [ "$device" = cpu ] || [ "$(grep -c "computes on cuda:0 with deterministic algorithms" "$out/nodes-4-bf16.run")" = 4 ] ||
    { echo "not every node computes with deterministic algorithms"; rc=1; }
  # the same with every tensor staged through host memory (no CUDA IPC)
  nodes nodes-4-bf16-staged staged || rc=1
  return $rc
}
step nodes-4-bf16 bf16_nodes

# Whether LibTorch's bf16 attention backward repeats its bits on this GPU, per fused
# backend, with deterministic algorithms off and on (strict): fails when the default
# choice does not with them on (what deterministic = true promises).
sdpa_determinism() {
  [ "$device" = cpu ] && { echo "the fused attention kernels are the GPU's: nothing to check on the CPU"; return 0; }
  "$python" "$root/tests/gpu/gpu_determinism.py" 12
}
step sdpa-determinism sdpa_determinism

# On the GPU the trace's F and B slices are when the stage's stream ran them
# (gpu_op_clock), not their launches: a gpt-small p=1 job's forwards and backwards take
# most of each step (their launches take a small part of it), and one stream's ops do
# not overlap.
op_times() {
  [ "$device" = cpu ] && { echo "on the CPU the ops run while the host calls them: nothing to check"; return 0; }
  "$build/troupe" train --workload gpt-small --device "$device" --precision bf16 --steps 5 --eval-interval 0 \
    --trace "$out/op-times.trace.json" --metrics "$out/op-times.jsonl" >"$out/op-times.run" 2>&1 ||
    { cat "$out/op-times.run"; return 1; }
  "$python" - "$out/op-times.trace.json" "$out/op-times.jsonl" <<'PY'
import json, re, statistics, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X" and re.fullmatch(r"[FBW]\d+", e["name"])]
steps = [json.loads(line) for line in open(sys.argv[2]) if '"step_seconds"' in line]
share = []
for r in steps[2:]:  # past the allocator's and cuBLAS's first steps
    busy = []
    for track in {(e["pid"], e["tid"]) for e in ev}:  # a stage: one stream
        ops = sorted((e for e in ev if e["args"]["step"] == r["step"] and (e["pid"], e["tid"]) == track),
                     key=lambda e: e["ts"])
        assert ops, f"no F/B slices of step {r['step']} on track {track}"
        for a, b in zip(ops, ops[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, f"ops overlap on one stream: {a} {b}"
        busy.append(sum(e["dur"] for e in ops) / 1e6)
    share.append(max(busy) / r["step_seconds"])
print("share of each step in its busiest stage's F/B slices:", ", ".join(f"{x:.2f}" for x in share))
assert statistics.median(share) > 0.5, "the F/B slices are not the GPU's time (launches only?)"
PY
}
step op-times op_times

# TROUPE_NCCL=1 on one GPU: the nodes each take GPU 0 (the machine's only one), see that
# the members of every shard group and both ends of every link share it (NCCL puts one
# rank per GPU) and keep those collectives on UCX and their tensors off NCCL:
# bit-identical to the one-process run. With 2 or more GPUs the nodes take GPUs 0, 1, ...
# in turn: every node's link to its neighbour's (another GPU) is over NCCL (8 link lines);
# point-to-point moves bytes without summing, so the run stays bit-identical unless a
# shard group went over NCCL too (3+ GPUs), whose sums follow NCCL's order: then within
# 1e-4 (parameters and losses). On the CPU: refused (exit 2).
nccl_nodes() {
  local env=(TROUPE_BUILD_DIR="$build" TROUPE_SKIP_SETUP=1 TROUPE_NCCL=1) rc=0 run="$out/nodes-4-nccl.run" gpus
  env "${env[@]}" "$root/launch/troupe" "${job[@]}" --nodes 4 \
    --metrics "$out/nodes-4-nccl.jsonl" --save "$out/nodes-4-nccl.pt" >"$run" 2>&1 || rc=$?
  if [ "$device" = cpu ]; then
    [ $rc = 2 ] && grep -F "TROUPE_NCCL=1: the job does not run on a GPU" "$run"
    return
  fi
  [ $rc = 0 ] || { cat "$run"; return 1; }
  gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" = 1 ]; then
    [ "$(grep -c "computes on cuda:0 (this machine has 1 GPU(s))" "$run")" = 4 ] ||
      { echo "not every node computes on cuda:0"; return 1; }
    [ "$(grep -c "shard collectives stay on UCX: ranks 0 and 1 share a GPU" "$run")" = 4 ] ||
      { echo "not every node kept its shard group on UCX"; return 1; }
    [ "$(grep -c "tensors to node [0-9] stay off NCCL: nodes [0-9] and [0-9] as ranks 0 and 1 share a GPU" "$run")" = 4 ] ||
      { echo "not every node kept its tensors to its neighbour off NCCL"; return 1; }
  else
    [ "$(grep -c "tensors \(to\|from\) node [0-9] over a NCCL link on cuda:" "$run")" = 8 ] ||
      { echo "not every node made its two NCCL links ($gpus GPUs)"; return 1; }
    if grep -q "shard collectives (rank [0-9] of [0-9]) over NCCL" "$run"; then
      "$python" - "$out/ref" "$out/nodes-4-nccl" <<'PY'
import json, sys
import torch
ref, got = sys.argv[1], sys.argv[2]
a, b = torch.load(ref + ".pt"), torch.load(got + ".pt")
assert list(a) == list(b), "different parameter names"
worst = max((a[k] - b[k]).abs().max().item() for k in a)
assert worst <= 1e-4, f"parameters differ by {worst}"
def losses(p):
    return {l["step"]: l["loss"] for l in map(json.loads, open(p + ".jsonl")) if "loss" in l}
la, lb = losses(ref), losses(got)
assert la.keys() == lb.keys(), "different steps"
worst_loss = max(abs(la[s] - lb[s]) for s in la)
assert worst_loss <= 1e-4, f"losses differ by {worst_loss}"
print(f"within NCCL's sum order: parameters {worst:.2e}, losses {worst_loss:.2e}")
PY
      return
    fi
  fi
  "$python" "$root/tests/support/compare_runs.py" "$out/ref" "$out/nodes-4-nccl" 0
}
step nodes-4-nccl nccl_nodes

# 6. Activation recomputation on the GPU (the same job with --recompute full: the
#    recomputed forward runs the same kernels, so the run should be bit-identical; the
#    check takes 1e-5 and prints the difference, as attention's backward kernels may sum
#    in another order), then generate and eval of the reference run's file on the GPU:
#    the greedy text with and without the key/value cache and on the CPU is the same,
#    and eval's loss is the CPU's within 1e-4.
near_ref() {  # near_ref NAME: NAME's parameters and losses are ref's within 1e-5 (printed)
  "$python" - "$out/ref" "$out/$1" <<'PY'
import json, sys
import torch
a, b = torch.load(sys.argv[1] + ".pt"), torch.load(sys.argv[2] + ".pt")
worst = max((a[k] - b[k]).abs().max().item() for k in a)
la = [l["loss"] for l in map(json.loads, open(sys.argv[1] + ".jsonl")) if "loss" in l]
lb = [l["loss"] for l in map(json.loads, open(sys.argv[2] + ".jsonl")) if "loss" in l]
worst_loss = max(abs(x - y) for x, y in zip(la, lb))
print(f"{sys.argv[2]} vs ref: parameters {worst:.2e}, losses {worst_loss:.2e}")
assert len(la) == len(lb) and worst <= 1e-5 and worst_loss <= 1e-5
PY
}
recompute_generate_eval() {
  run_job recompute --recompute full >"$out/recompute.run" 2>&1 || { cat "$out/recompute.run"; return 1; }
  near_ref recompute || return 1
  local gen=(generate --checkpoint "$out/ref.pt" --prompt "The " --tokens 200 --temperature 0 "${model_flags[@]}") d
  for d in "$device" cpu; do
    "$build/troupe" "${gen[@]}" --device "$d" >"$out/gen-$d.txt" 2>"$out/gen-$d.err" || { cat "$out/gen-$d.err"; return 1; }
    "$build/troupe" "${gen[@]}" --device "$d" --no-kv-cache >"$out/gen-$d-nocache.txt" 2>>"$out/gen-$d.err" ||
      { cat "$out/gen-$d.err"; return 1; }
    cat "$out/gen-$d.err"
    "$build/troupe" eval --checkpoint "$out/ref.pt" --device "$d" "${model_flags[@]}" >"$out/eval-$d.json" || return 1
  done
  cmp "$out/gen-$device.txt" "$out/gen-$device-nocache.txt" && cmp "$out/gen-$device.txt" "$out/gen-cpu.txt" || return 1
  "$python" -c 'import json, sys; a, b = (json.load(open(f))["val_loss"] for f in sys.argv[1:]); print(a, b); assert abs(a - b) <= 1e-4 * b' \
    "$out/eval-$device.json" "$out/eval-cpu.json"
}
step recompute-generate-eval recompute_generate_eval

# 7. The zero-bubble schedule on the GPU (B and W split, the W's inputs kept on the
#    device until the W runs), plain and with recomputation, against the 1f1b reference
#    within 1e-5: the weight gradients are the same products, summed in another order.
#    Then dataflow with a split backward (a W runs whenever nothing else is ready).
zero_bubble() {
  run_job zero-bubble --schedule zero-bubble >"$out/zero-bubble.run" 2>&1 || { cat "$out/zero-bubble.run"; return 1; }
  near_ref zero-bubble || return 1
  run_job zero-bubble-recompute --schedule zero-bubble --recompute full >"$out/zero-bubble-recompute.run" 2>&1 ||
    { cat "$out/zero-bubble-recompute.run"; return 1; }
  near_ref zero-bubble-recompute || return 1
  run_job dataflow-split --schedule dataflow --split-backward true >"$out/dataflow-split.run" 2>&1 ||
    { cat "$out/dataflow-split.run"; return 1; }
  near_ref dataflow-split
}
step zero-bubble zero_bubble

# 8. Gradient buckets: bit-identical to the reference (each element sums the same ranks'
#    gradients in the same order whichever bucket holds it; a bucket sent before its
#    gradients were on the device would differ), and the trace shows each stage's
#    buckets and reduce-scatters begun while the stage still computed.
buckets_overlap() {  # buckets_overlap TRACE: prints and checks the overlap
  "$python" - "$1" <<'PY'
import collections, json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
last = collections.defaultdict(float)  # (step, replica, stage) -> its last compute op's end
for e in events:
    if e.get("cat") == "compute":
        a = e["args"]
        k = (a["step"], a["replica"], a["stage"])
        last[k] = max(last[k], e["ts"] + e["dur"])
rs = [e for e in events if e.get("name") == "reduce-scatter" and "bucket" in e.get("args", {})]
buckets = collections.defaultdict(set)
early = 0
for e in rs:
    a = e["args"]
    k = (a["step"], a["replica"], a["stage"])
    buckets[k].add((a["chunk"], a["bucket"]))
    early += e["ts"] < last[k]
fewest = min(len(b) for b in buckets.values()) if buckets else 0
print(f"{len(rs)} bucket reduce-scatters, at least {fewest} buckets per stage and step, {early} begun before their stage's last op ended")
assert fewest > 1 and early > 0
PY
}
gradient_buckets() {
  run_job buckets --bucket-size 50000 --trace "$out/buckets.trace.json" >"$out/buckets.run" 2>&1 ||
    { cat "$out/buckets.run"; return 1; }
  "$python" "$root/tests/support/compare_runs.py" "$out/ref" "$out/buckets" 0 || return 1
  buckets_overlap "$out/buckets.trace.json" || return 1
  nodes nodes-4-buckets ipc --bucket-size 50000
}
step gradient-buckets gradient_buckets

# 9. check-host on the device (the launcher asks it of every host: a kernel on the GPU),
#    and a job on a text of its own (--text; here the README) on the device with
#    validation: its steps and validations report finite losses.
host_and_text() {
  "$build/troupe" check-host --device "$device" | tee /dev/stderr | grep -E "^ready: .*device $device" || return 1
  "$build/troupe" train --device "$device" --text "$root/README.md" --steps 6 --eval-interval 3 \
    --metrics "$out/text.jsonl" >"$out/text.run" 2>&1 || { cat "$out/text.run"; return 1; }
  grep -F "README.md" "$out/text.run" || { echo "the log does not name the text"; return 1; }
  "$python" - "$out/text.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r["loss"] for r in rows if "loss" in r]
val = [r["val_loss"] for r in rows if "val_loss" in r]
print("losses", train, "validation", val)
assert len(train) == 6 and len(val) >= 2 and all(math.isfinite(x) for x in train + val)
PY
}
step check-host-text host_and_text

# 12. The Llama architecture and expert parallelism on the device against the CPU (1e-4:
#     the same products, in the device's summation order).
near_cpu() {  # near_cpu NAME ARGS...: the job on the device and on the CPU, within 1e-4
  local name=$1 d
  shift
  for d in "$device" cpu; do
    "$build/troupe" train --device "$d" --steps 6 --eval-interval 0 --save "$out/$name-$d.pt" \
      --metrics "$out/$name-$d.jsonl" "$@" >"$out/$name-$d.run" 2>&1 || { cat "$out/$name-$d.run"; return 1; }
  done
  "$python" - "$out/$name-$device" "$out/$name-cpu" <<'PY'
import json, sys
import torch
a, b = torch.load(sys.argv[1] + ".pt"), torch.load(sys.argv[2] + ".pt")
assert list(a) == list(b), "different parameter names"
worst = max((a[k] - b[k]).abs().max().item() for k in a)
la = [l["loss"] for l in map(json.loads, open(sys.argv[1] + ".jsonl")) if "loss" in l]
lb = [l["loss"] for l in map(json.loads, open(sys.argv[2] + ".jsonl")) if "loss" in l]
worst_loss = max(abs(x - y) for x, y in zip(la, lb))
print(f"{sys.argv[1]} vs the CPU: parameters {worst:.2e}, losses {worst_loss:.2e}")
assert len(la) == len(lb) == 6 and worst <= 1e-4 and worst_loss <= 1e-4
PY
}
llama_experts() {  # on the CPU (CI) the same jobs twice: left out
  [ "$device" != cpu ] || { echo "the device is the CPU: nothing to compare"; return 0; }
  near_cpu llama --workload llama-tiny --pipeline 2 --data-parallel 2 || return 1
  near_cpu ep --workload moe-tiny --pipeline 2 --data-parallel 2 --expert-parallel 2
}
step llama-experts llama_experts
# Tensor parallelism on the device: T = 2 stage actors per stage sharing it (in-process
# groups, ordered on the members' CUDA streams; and as two node processes, their group
# over UCX) with sequence parallelism, against T = 1 on the same device within 1e-5
# (fp32, deterministic algorithms: llama-small on a GPU, llama-tiny on the CPU), and
# repeated bit for bit; on a GPU also T = 2 against the CPU.
tensor_parallel() {
  local model=(--workload llama-small) name
  [ "$device" != cpu ] || model=(--workload llama-tiny --layers 2)
  for name in t1 t2 t2-again t2-nodes; do
    local width=(--tensor-parallel 2 --sequence-parallel true) run=("$build/troupe")
    [ $name != t1 ] || width=(--tensor-parallel 1)
    # t2-nodes: the two ranks as two node processes sharing the device (their group over UCX)
    [ $name != t2-nodes ] || run=(env TROUPE_BUILD_DIR="$build" TROUPE_SKIP_SETUP=1 "$root/launch/troupe")
    [ $name != t2-nodes ] || width+=(--nodes 2)
    "${run[@]}" train --device "$device" --steps 3 --eval-interval 0 --deterministic true "${model[@]}" \
      "${width[@]}" --save "$out/tp-$name.pt" --metrics "$out/tp-$name.jsonl" >"$out/tp-$name.run" 2>&1 \
      || { cat "$out/tp-$name.run"; return 1; }
  done
  "$python" "$root/tests/support/compare_runs.py" "$out/tp-t2" "$out/tp-t2-again" 0 || return 1
  for name in t2 t2-nodes; do
  "$python" - "$out/tp-$name" "$out/tp-t1" <<'PY' || return 1
import json, sys
import torch
a, b = torch.load(sys.argv[1] + ".pt"), torch.load(sys.argv[2] + ".pt")
assert list(a) == list(b), "different parameter names"
worst = max((a[k] - b[k]).abs().max().item() for k in a)
la, lb = ([l["loss"] for l in map(json.loads, open(f + ".jsonl")) if "loss" in l] for f in sys.argv[1:])
worst_loss = max(abs(x - y) for x, y in zip(la, lb))
print(f"{sys.argv[1]}: T = 2 (sequence parallel) vs T = 1: parameters {worst:.2e}, losses {worst_loss:.2e}")
assert len(la) == len(lb) == 3 and worst <= 1e-5 and worst_loss <= 1e-5
PY
  done
  [ "$device" != cpu ] || return 0
  near_cpu tp --workload llama-tiny --tensor-parallel 2 --sequence-parallel true --pipeline 2
}
step tensor-parallel tensor_parallel

what=${only:+"the steps matching '$only'"}${skip:+"${only:+ }but those matching '$skip'"}
[ $failed = 0 ] && echo "gpu_check: ${what:-all} passed (logs in $out)" || echo "gpu_check: FAILED (logs in $out)"
exit $failed
