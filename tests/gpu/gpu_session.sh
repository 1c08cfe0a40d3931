#!/usr/bin/env bash
# Everything a GPU lease is for, in one command that ends inside a deadline (device time
# is short: a lease may have 15 minutes, machine start included):
#   1. build against the machine's CUDA LibTorch (launch/setup-gpu; Ninja where present);
#   2. tests/gpu/gpu_check.sh as four parts side by side (the gtests; the one-process jobs; two
#      of the node-process jobs), each part with its own reference run;
#   3. tests/bench/gpu_bench.py with the time left (it starts with troupe_staging_bench
#      cuda: CUDA IPC and host-staged transfers between two processes vs a device-to-device
#      copy; its kernel profiles go into logs.tar.gz). TROUPE_GPU_SESSION_BENCH_S (default
#      210) is the time the checks leave it.
#
#   TROUPE_DEBS=.debs tests/gpu/gpu_session.sh OUT_DIR [SECONDS]     (default 560 s)
#
# OUT_DIR gets session.log (every phase, its verdicts and times), bench.md, bench.err and
# logs.tar.gz (the build log and every check's logs; no parameter files).
# TROUPE_GPU_BUILD_DIR=dir uses a build already there (no step 1); with
# TROUPE_CHECK_DEVICE=cpu the checks run on the CPU and step 3 is left out (a dry run of
# this script on a machine without a GPU). TROUPE_GPU_SESSION_BENCH=0 leaves step 3 out
# (checks only).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:?usage: tests/gpu/gpu_session.sh OUT_DIR [SECONDS]}
budget=${2:-560}
work=$(mktemp -d /tmp/troupe-gpu-session-XXXXXX)
mkdir -p "$out"
exec > >(tee -a "$out/session.log") 2>&1
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
phase() { echo "== $* (at $((SECONDS - t0)) s, $(left) s left)"; }
pack() {
  tar czf "$out/logs.tar.gz" -C "$work" --exclude='*.pt' --exclude='*.optim' --exclude=ckpt . 2>/dev/null
  phase "done"
}
trap pack EXIT

phase "machine"
nproc
nvidia-smi -L 2>&1 | head -4
ls /usr/local/nvidia/bin 2>/dev/null | tr "\n" " "; command -v nvidia-cuda-mps-control nsys ncu; echo
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())' 2>&1

device=${TROUPE_CHECK_DEVICE:-cuda}
bench=${TROUPE_GPU_SESSION_BENCH:-1}
[ "$device" = cuda ] || bench=0
build=${TROUPE_GPU_BUILD_DIR:-}
if [ -z "$build" ]; then
  phase "build"
  command -v ninja >/dev/null && export CMAKE_GENERATOR=Ninja
  build=$root/build-gpu
  if ! env_lines=$(TROUPE_BUILD_DIR="$build" timeout "$(left)" "$root/launch/setup-gpu" 2>"$work/build.log"); then
    echo "build failed: every error follows (the build again, keeping going)"
    timeout "$(( $(left) - 10 ))" cmake --build "$build" -- -k 0 >>"$work/build.log" 2>&1
    grep -E -A4 "error|Error" "$work/build.log" | head -150
    exit 1
  fi
  eval "$env_lines"
  tail -3 "$work/build.log"
fi

# TROUPE_GPU_SESSION_PARTS='REGEX REGEX ...': these parts instead of gpu_check's own (each
# a TROUPE_GPU_CHECK_STEPS regex; a lease spent on a few checks and a longer bench).
read -r -a custom <<<"${TROUPE_GPU_SESSION_PARTS:-}"
if [ ${#custom[@]} -gt 0 ]; then
  nparts=${#custom[@]}
else
  nparts=$("$root/tests/gpu/gpu_check.sh" --parts)  # each with its own reference run
fi
phase "gpu_check, $nparts parts side by side"
reserve=10
[ "$bench" = 1 ] && reserve=${TROUPE_GPU_SESSION_BENCH_S:-210}  # the bench's time
limit=$(( $(left) - reserve ))
[ "$limit" -lt 120 ] && limit=120
pids=()
for ((i = 0; i < nparts; i++)); do
  if [ ${#custom[@]} -gt 0 ]; then
    TROUPE_GPU_CHECK_STEPS=${custom[$i]} timeout -k 5 "$limit" "$root/tests/gpu/gpu_check.sh" "$build" \
      "$work/check-$i" >"$work/check-$i.txt" 2>&1 &
  else
    TROUPE_GPU_CHECK_PART=$i timeout -k 5 "$limit" "$root/tests/gpu/gpu_check.sh" "$build" "$work/check-$i" \
      >"$work/check-$i.txt" 2>&1 &
  fi
  pids+=($!)
done
rc=0
for ((i = 0; i < nparts; i++)); do
  wait "${pids[$i]}"; r=$?
  echo "-- part $i: rc $r"
  cat "$work/check-$i.txt"
  [ $r = 0 ] || rc=1
done

if [ "$bench" = 1 ] && [ "$(left)" -gt 60 ]; then
  phase "gpu_bench"
  PYTHONUNBUFFERED=1 TROUPE_BENCH_OUT=$work timeout -k 5 "$(( $(left) - 10 ))" python3 "$root/tests/bench/gpu_bench.py" "$build" \
    >"$out/bench.md" 2>"$out/bench.err"
  echo "rc $?"; cat "$out/bench.md"; tail -20 "$out/bench.err"
fi
exit $rc
