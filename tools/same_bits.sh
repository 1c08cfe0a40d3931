#!/usr/bin/env bash
# Runs a set of short jobs with two builds and checks that they end with the same bits:
# every tensor of the --save pair, the metrics lines (loss, grad norm, validation), the
# text `generate` samples and the numbers `eval` prints. For refactorings that must not
# change results.
#   tools/same_bits.sh OLD_BUILD_DIR NEW_BUILD_DIR [WORK_DIR]
set -euo pipefail
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd)
work=${3:-$(mktemp -d)}
mkdir -p "$work"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$("$new/troupe" blas-core)} OMP_WAIT_POLICY=PASSIVE
jobs=(
  "gpt|--workload gpt-tiny --steps 3 --pipeline 2 --data-parallel 2 --microbatches 4"
  "gpt-local|--workload gpt-tiny --steps 3 --runtime local --pipeline 2 --microbatches 4 --recompute selective"
  "gpt-tp-sp-bf16|--workload gpt-tiny --steps 2 --tensor-parallel 2 --sequence-parallel true --precision bf16 --fp32-residual false"
  "llama-zb|--workload llama-tiny --steps 3 --runtime local --pipeline 2 --microbatches 4 --schedule zero-bubble"
  "llama-full|--workload llama-tiny --steps 3 --runtime local --recompute full --tensor-parallel 2"
  "moe-ep|--workload moe-tiny --steps 3 --runtime local --data-parallel 2 --expert-parallel 2 --moe-capacity-factor 1.0 --recompute full"
  "moe-actors|--workload moe-tiny --steps 2 --pipeline 2 --microbatches 4 --schedule dataflow --split-backward true"
  "mlp|--workload fmnist-mlp --steps 3 --runtime local"
)
# The tensors of a --save file (torch.save's zip archive), without the pair mark's record
# (an id drawn per save).
tensors() {
  python3 - "$1" <<'PY'
import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in sorted(z.namelist()):
    if not n.endswith("troupe_save_pair"):
        print(n.split("/", 1)[-1], hashlib.sha256(z.read(n)).hexdigest())
PY
}
failed=0
for j in "${jobs[@]}"; do
  name=${j%%|*} args=${j#*|}
  for side in old new; do
    dir=$work/$name-$side build=${!side}
    rm -rf "$dir" && mkdir -p "$dir"
    # shellcheck disable=SC2086
    if ! (cd "$dir" && "$build/troupe" train $args --save m.pt --metrics metrics.jsonl >log.txt 2>&1); then
      echo "$name: $side build failed (see $dir/log.txt)"
      failed=1
      continue 2
    fi
    { tensors "$dir/m.pt"; tensors "$dir/m.pt.optim"; } >"$dir/tensors.txt"
    # (The metrics lines without their times.)
    python3 -c 'import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print({k: v for k, v in d.items() if not (k.endswith("_s") or "seconds" in k or k in ("bubble", "tokens_per_s", "eta"))})' \
      "$dir/metrics.jsonl" >"$dir/metrics.txt"
    case $name in gpt-local|llama-zb)
      w=$( [ "$name" = gpt-local ] && echo gpt-tiny || echo llama-tiny )
      "$build/troupe" generate --workload "$w" --checkpoint "$dir/m.pt" --tokens 60 --seed 3 2>/dev/null | sed "s#$dir#DIR#g" >"$dir/generate.txt"
      "$build/troupe" eval --workload "$w" --checkpoint "$dir/m.pt" 2>&1 | grep -v "^\[" | sed "s# in [0-9.]*s##; s#$dir#DIR#g" >"$dir/eval.txt" || true
    esac
  done
  same=1
  for f in tensors.txt metrics.txt generate.txt eval.txt; do
    [ -f "$work/$name-old/$f" ] || continue
    cmp -s "$work/$name-old/$f" "$work/$name-new/$f" || { echo "$name: $f differs"; same=0; failed=1; }
  done
  [ $same = 1 ] && echo "$name: same bits ($(wc -l <"$work/$name-new/tensors.txt") tensors, $(wc -l <"$work/$name-new/metrics.txt") metrics lines)"
done
exit $failed
