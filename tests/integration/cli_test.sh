#!/usr/bin/env bash
# Command-line tests of the troupe executable: output formats, exit codes, errors.
set -u
troupe=$1
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=$tmp/out err=$tmp/err
check() {  # check NAME EXPECTED_RC COMMAND...
  local name=$1 want=$2; shift 2
  "$@" >"$out" 2>"$err"
  local rc=$?
  if [ "$rc" != "$want" ]; then
    echo "FAIL $name: exit $rc, expected $want"; cat "$err"; fail=1
  else
    echo "ok   $name"
  fi
}
expect_in() {  # expect_in NAME FILE TEXT
  if grep -qF -- "$3" "$2"; then echo "ok   $1"; else echo "FAIL $1: '$3' not in $2:"; cat "$2"; fail=1; fi
}
during() {  # during FILE PATTERN ACTION COMMAND...: runs COMMAND (stdout to $out, stderr to
  # $err), and ACTION (shell code; $pid is COMMAND's) once FILE matches PATTERN (or after
  # 60 s); sets rc to COMMAND's status.
  local file=$1 pattern=$2 action=$3 t
  shift 3
  : >"$out"  # emptied before COMMAND starts: the last command's output must not match
  : >"$err"
  "$@" >"$out" 2>"$err" &
  local pid=$!
  for ((t = 0; t < 600; t++)); do grep -q -- "$pattern" "$file" && break; sleep 0.1; done
  eval "$action"
  wait $pid
  rc=$?
}

check schedule-json 0 "$troupe" schedule --kind 1f1b --stages 4 --microbatches 8 --format json
/usr/bin/python3 - "$out" <<'PY' || fail=1
import json, sys
d = json.load(open(sys.argv[1]))
assert d["kind"] == "1f1b" and d["stages"] == 4 and d["microbatches"] == 8 and d["chunks"] == 1, d
assert len(d["ranks"]) == 4 and len(d["ranks"][0]) == 16
assert d["ranks"][3][:2] == [{"op": "F", "mb": 0, "chunk": 0}, {"op": "B", "mb": 0, "chunk": 0}]
assert abs(d["bubble"] - 3 / 11) < 1e-9, d["bubble"]  # (p-1)/(m+p-1)
print("ok   schedule-json-content")
PY
check schedule-table 0 "$troupe" schedule --kind interleaved-1f1b --stages 2 --microbatches 4 --chunks 2
expect_in schedule-table-row "$out" "stage 1 | F0.0 F1.0 F0.1"
check interleaved-bad-m 2 "$troupe" schedule --kind interleaved-1f1b --stages 4 --microbatches 6 --chunks 2
expect_in interleaved-bad-m-msg "$err" "multiple of stages"
[ "$(wc -l < "$err")" = 1 ] && echo "ok   one-line-error" || { echo "FAIL one-line-error"; fail=1; }
check schedule-zero-bubble 0 "$troupe" schedule --kind zero-bubble --stages 4 --microbatches 8 --format json
/usr/bin/python3 - "$out" <<'PY' || fail=1
import json, sys
d = json.load(open(sys.argv[1]))
assert d["kind"] == "zero-bubble" and len(d["ranks"][0]) == 24, d  # F, B and W of 8 micro-batches
assert [o["op"] for o in d["ranks"][3][7:10]] == ["B", "W", "F"], d["ranks"][3]  # stage 3's W's trail by 3
assert abs(d["bubble"] - 3 / 27) < 1e-9, d["bubble"]  # (p-1)/(3m+p-1) with B = W = F
assert d["peak_activations"] == [4, 4, 4, 4], d
print("ok   schedule-zero-bubble-content")
PY
# The V kinds and the overlapped pairs: table, JSON flags, the drawing (one block per op
# and row), the bad layouts' one-line errors.
check schedule-dualpipev 0 "$troupe" schedule --kind dualpipev --stages 2 --microbatches 4
expect_in schedule-dualpipev-row "$out" "stage 1 | F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1&B0.0 F3.0&B1.1"
check schedule-dualpipev-json 0 "$troupe" schedule --kind dualpipev --stages 2 --microbatches 4 --format json --pair-cost 2.5 --weight-cost 1
/usr/bin/python3 - "$out" <<'PY' || fail=1
import json, sys
d = json.load(open(sys.argv[1]))
assert d["chunks"] == 2 and len(d["idle"]) == 2, d
pairs = sum(1 for row in d["ranks"] for o in row if o.get("paired"))
assert pairs == 6, pairs  # rank 0: 3, rank 1: 3
assert abs(max(d["idle"]) - (2 - 1) * (2.5 + 2 - 3 * 1)) < 1e-9, d["idle"]  # (PP/2-1)(F&B+B-3W)
print("ok   schedule-dualpipev-json-content")
PY
check schedule-svg 0 "$troupe" schedule --kind zbv --stages 4 --microbatches 8 --format svg
/usr/bin/python3 - "$out" <<'PY' || fail=1
import re, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
rows = {}
for r in root.iter("{http://www.w3.org/2000/svg}rect"):
    if r.get("class") == "op":
        rows[r.get("data-row")] = rows.get(r.get("data-row"), 0) + 1
assert rows == {"0": 48, "1": 48, "2": 48, "3": 48}, rows  # 8 micro-batches x 2 chunks x F, B, W
print("ok   schedule-svg-content")
PY
check dualpipev-few-microbatches 2 "$troupe" schedule --kind dualpipev --stages 4 --microbatches 6
expect_in dualpipev-few-microbatches-msg "$err" "dualpipev needs at least 2p = 8 micro-batches on 4 stages (got 6)"
check train-dualpipev-one-chunk 2 "$troupe" train --schedule dualpipev --pipeline 2 --microbatches 4
expect_in train-dualpipev-one-chunk-msg "$err" "set chunks = 2"
check train-combined-one-chunk 2 "$troupe" train --schedule combined-1f1b --pipeline 2 --microbatches 4
expect_in train-combined-one-chunk-msg "$err" "needs at least 2 virtual chunks"
# Expert parallelism: both runtimes train with it (the actors' stages meet in all-to-alls
# in a fixed order: dataflow is refused).
check train-moe-ep 0 "$troupe" train --workload moe-tiny --runtime local --data-parallel 2 --expert-parallel 2 \
  --steps 1 --threads 1 --eval-interval 0 --layers 2
expect_in train-moe-ep-log "$err" "expert-parallel 2 (2 of the 4 experts on each rank) x pipeline 1 x data-parallel 2"
expect_in train-moe-ep-line "$out" "aux_loss"
check train-moe-ep-actors 0 "$troupe" train --workload moe-tiny --data-parallel 2 --expert-parallel 2 --pipeline 2 \
  --steps 1 --threads 1 --eval-interval 0 --layers 2
expect_in train-moe-ep-actors-log "$err" "with actors: expert-parallel 2 (2 of the 4 experts on each rank) x pipeline 2 x data-parallel 2"
check train-moe-ep-dataflow 2 "$troupe" train --workload moe-tiny --data-parallel 2 --expert-parallel 2 \
  --schedule dataflow
expect_in train-moe-ep-dataflow-msg "$err" "expert_parallel 2 with schedule dataflow"
check train-moe-ep-divides 2 "$troupe" train --workload moe-tiny --runtime local --expert-parallel 2
expect_in train-moe-ep-divides-msg "$err" "expert_parallel 2 does not divide data_parallel x tensor_parallel 1 x 1"
# A run's trace drawn: one block per op the schedule gave each stage.
check train-dualpipev-trace 0 "$troupe" train --steps 2 --threads 1 --pipeline 2 --chunks 2 --microbatches 4 \
  --schedule dualpipev --eval-interval 0 --trace "$tmp/dpv-trace.json"
check trace-svg 0 "$troupe" trace-svg "$tmp/dpv-trace.json" -o "$tmp/dpv.svg"
/usr/bin/python3 - "$tmp/dpv.svg" <<'PY' || fail=1
import sys, xml.etree.ElementTree as ET
rows = {}
for r in ET.parse(sys.argv[1]).getroot().iter("{http://www.w3.org/2000/svg}rect"):
    if r.get("class") == "op":
        rows[r.get("data-row")] = rows.get(r.get("data-row"), 0) + 1
assert rows == {"0": 19, "1": 18}, rows  # dualpipev's ops per rank at p = 2, m = 4
print("ok   trace-svg-content")
PY
check trace-svg-no-step 2 "$troupe" trace-svg "$tmp/dpv-trace.json" --step 9
expect_in trace-svg-no-step-msg "$err" "no compute events of step 9"
check schedule-weight-cost 2 "$troupe" schedule --kind zero-bubble --stages 2 --microbatches 4 --weight-cost 5
expect_in schedule-weight-cost-msg "$err" "exceeds the backward's (2)"
check train-zero-bubble-chunks 2 "$troupe" train --schedule zero-bubble --chunks 2 --pipeline 2
expect_in train-zero-bubble-chunks-msg "$err" "takes no virtual chunks"
check train-split-1f1b 2 "$troupe" train --split-backward true --pipeline 2
expect_in train-split-1f1b-msg "$err" "split_backward applies to the dataflow schedule (zero-bubble always splits the backward; 1f1b keeps it whole)"
check train-split-bad 2 "$troupe" train --split-backward yes
expect_in train-split-bad-msg "$err" "expected true or false"
check train-dataflow-split 0 "$troupe" train --steps 1 --threads 1 --pipeline 2 --eval-interval 0 --schedule dataflow --split-backward true
expect_in train-dataflow-split-log "$err" "(dataflow, split backward)"
# Output paths that cannot be written: refused before any step (not after the training).
check train-save-missing-folder 2 "$troupe" train --steps 200 --save "$tmp/no-such-folder/model.pt"
expect_in train-save-missing-folder-msg "$err" "output.save = '$tmp/no-such-folder/model.pt': folder $tmp/no-such-folder does not exist"
if grep -q "step  *1/" "$out"; then echo "FAIL train-save-missing-folder: it trained first"; fail=1; fi
check train-trace-missing-folder 2 "$troupe" train --steps 200 --runtime actors --trace "$tmp/no-such-folder/t.json"
expect_in train-trace-missing-folder-msg "$err" "output.trace = '$tmp/no-such-folder/t.json'"
check train-local-save-folder 2 "$troupe" train --steps 200 --runtime local --save "$tmp"
expect_in train-local-save-folder-msg "$err" "is a folder, not a file"
# A trace folder removed during the run: the run still ends (exit 0), saying the trace
# was not written (it used to hang after an exception in the coordinator).
mkdir -p "$tmp/tdir"
during "$out" "step  *2/8" 'rm -rf "$tmp/tdir"' \
  timeout 300 "$troupe" train --steps 8 --threads 1 --pipeline 2 --eval-interval 0 --trace "$tmp/tdir/t.json"
if [ $rc = 0 ] && grep -q "trace not written" "$err"; then echo "ok   train-trace-folder-gone"; else
  echo "FAIL train-trace-folder-gone: exit $rc"; tail -5 "$err"; fail=1; fi
check unknown-kind 2 "$troupe" schedule --kind zigzag
check bad-number 2 "$troupe" schedule --stages many
check train-bad-flag 2 "$troupe" train --steps ten
expect_in train-bad-flag-msg "$err" "train.steps = 'ten'"
check train-contradiction 2 "$troupe" train --microbatches 5
check train-missing-data 2 "$troupe" train --steps 1 --fortunes-dir /nonexistent
expect_in train-missing-data-msg "$err" "apt-get install fortunes"
check train-missing-config 2 "$troupe" train --config /nonexistent.toml
check train-bad-precision 2 "$troupe" train --precision fp16
expect_in train-bad-precision-msg "$err" "unknown precision 'fp16' (expected fp32 or bf16)"
check train-bad-recompute 2 "$troupe" train --recompute partial
expect_in train-bad-recompute-msg "$err" "unknown recompute 'partial' (expected none, selective or full)"
check train-recompute-mlp 2 "$troupe" train --recompute full --workload fmnist-mlp
expect_in train-recompute-mlp-msg "$err" "fmnist-mlp has none"
check train-recompute 0 "$troupe" train --steps 1 --threads 1 --pipeline 2 --eval-interval 0 --recompute full --precision bf16 \
  --d-model 64 --seq-len 64
expect_in train-recompute-log "$err" "intra-op thread(s) per stage, bf16, recompute full"
expect_in train-recompute-progress "$out" "step 1/1 | loss"
check train-recompute-selective 0 "$troupe" train --steps 1 --threads 1 --pipeline 2 --eval-interval 0 --recompute selective
expect_in train-recompute-selective-log "$err" "intra-op thread(s) per stage, recompute selective"
check train-bad-heads 2 "$troupe" train --heads 5
expect_in train-bad-heads-msg "$err" "d_model 128 is not a multiple of heads (5)"
check train-shape-mlp 2 "$troupe" train --workload fmnist-mlp --d-model 64
expect_in train-shape-mlp-msg "$err" "fmnist-mlp's layers are fixed"
printf '[model]\nlayers = 2\nd_model = 32\nheads = 2\nseq_len = 64\n' > "$tmp/shape.toml"
check train-model-shape 0 "$troupe" train --config "$tmp/shape.toml" --heads 4 --steps 1 --threads 1 --pipeline 2 --eval-interval 0
expect_in train-model-shape-log "$err" "training gpt-tiny (gpt2, 2 layers, d_model 32, 4 heads, d_ff 128, seq_len 64: 0.04 M parameters)"
expect_in train-model-shape-progress "$out" "step 1/1 | loss"
# troupe generate: from a checkpoint folder (its model recorded) and from a state_dict file.
check gen-train 0 "$troupe" train --config "$tmp/shape.toml" --steps 2 --threads 1 --eval-interval 0 \
  --checkpoint-dir "$tmp/gen-ckpt" --save "$tmp/gen.pt" --metrics "$tmp/gen-metrics.jsonl"
check gen-folder 0 "$troupe" generate --checkpoint "$tmp/gen-ckpt" --prompt "Q: " --tokens 30 --seed 3
cp "$out" "$tmp/gen-1.txt"
expect_in gen-folder-log "$err" "generating 30 bytes with gpt-tiny (gpt2, 2 layers, d_model 32, 2 heads"
expect_in gen-folder-log-step "$err" "(after step 2)"
[ "$(head -c 3 "$tmp/gen-1.txt")" = "Q: " ] && [ "$(wc -c < "$tmp/gen-1.txt")" = 34 ] \
  && echo "ok   gen-folder-text" || { echo "FAIL gen-folder-text: not 'Q: ' + 30 bytes + newline:"; cat "$tmp/gen-1.txt"; fail=1; }
check gen-file 0 "$troupe" generate --checkpoint "$tmp/gen.pt" --layers 2 --d-model 32 --heads 2 --seq-len 64 \
  --prompt "Q: " --tokens 30 --seed 3
cmp -s "$out" "$tmp/gen-1.txt" && echo "ok   gen-file-same-text" || { echo "FAIL gen-file-same-text"; cat "$out"; fail=1; }
expect_in gen-file-cache-log "$err" "generated 30 bytes in"
expect_in gen-file-cache-on "$err" "key/value cache on)"
check gen-no-kv-cache 0 "$troupe" generate --checkpoint "$tmp/gen-ckpt" --prompt "Q: " --tokens 30 --seed 3 --no-kv-cache
cmp -s "$out" "$tmp/gen-1.txt" && echo "ok   gen-no-kv-cache-same-text" || { echo "FAIL gen-no-kv-cache-same-text"; cat "$out"; fail=1; }
expect_in gen-no-kv-cache-log "$err" "key/value cache off)"
# (a --save file records its model: no flag needed; flags that name a model replace the record)
check gen-file-records 0 "$troupe" generate --checkpoint "$tmp/gen.pt" --prompt "Q: " --tokens 30 --seed 3
cmp -s "$out" "$tmp/gen-1.txt" && echo "ok   gen-file-records-same-text" || { echo "FAIL gen-file-records-same-text"; cat "$out"; fail=1; }
check gen-file-wrong-shape 2 "$troupe" generate --checkpoint "$tmp/gen.pt" --workload gpt-tiny
expect_in gen-file-wrong-shape-msg "$err" "wte.weight has shape [256, 32], expected [256, 128]"
check gen-folder-with-shape 2 "$troupe" generate --checkpoint "$tmp/gen-ckpt" --layers 3
expect_in gen-folder-with-shape-msg "$err" "a checkpoint folder records its model: --layers does not apply"
check gen-missing 2 "$troupe" generate --checkpoint "$tmp/nothing.pt"
check gen-mlp 2 "$troupe" generate --checkpoint "$tmp/gen.pt" --workload fmnist-mlp
expect_in gen-mlp-msg "$err" "generate needs a gpt workload"
# troupe eval: the loss the training run's last evaluation logged, from a folder and a file.
same_loss() {  # same_loss NAME METRICS_FILE EVAL_OUTPUT KEY...
  local name=$1 metrics=$2 eval=$3; shift 3
  /usr/bin/python3 - "$metrics" "$eval" "$@" <<'PY' && echo "ok   $name" || { echo "FAIL $name"; fail=1; }
import json, math, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]
got = json.loads(open(sys.argv[2]).read())
for key in sys.argv[3:]:
    assert math.isclose(got[key], last[key], rel_tol=1e-6), (key, got[key], last[key])
if "val_loss" in got:
    assert math.isclose(got["perplexity"], math.exp(got["val_loss"]), rel_tol=1e-9), got
PY
}
check eval-folder 0 "$troupe" eval --checkpoint "$tmp/gen-ckpt"
same_loss eval-folder-loss "$tmp/gen-metrics.jsonl" "$out" val_loss
expect_in eval-folder-step "$out" '"step":2'
expect_in eval-folder-log "$err" "(perplexity "
check eval-file 0 "$troupe" eval --checkpoint "$tmp/gen.pt" --config "$tmp/shape.toml"
same_loss eval-file-loss "$tmp/gen-metrics.jsonl" "$out" val_loss
# A Hugging Face folder gives its model (config.json: no shape flag) to eval, generate and
# train; a flag that disagrees with it is named.
check hf-export 0 "$troupe" export "$tmp/gen-ckpt" --to "$tmp/gen-hf"
check eval-hf 0 "$troupe" eval --checkpoint "$tmp/gen-hf"
same_loss eval-hf-loss "$tmp/gen-metrics.jsonl" "$out" val_loss
check gen-hf 0 "$troupe" generate --checkpoint "$tmp/gen-hf" --prompt "Q: " --tokens 30 --seed 3
cmp -s "$out" "$tmp/gen-1.txt" && echo "ok   gen-hf-same-text" || { echo "FAIL gen-hf-same-text"; cat "$out"; fail=1; }
check train-hf-disagrees 2 "$troupe" train --model "$tmp/gen-hf" --layers 3 --steps 1
expect_in train-hf-disagrees-msg "$err" "model.layers 3 (config.json's n_layer 2)"
check train-hf 0 "$troupe" train --model "$tmp/gen-hf" --steps 1 --threads 1 --eval-interval 0
expect_in train-hf-log "$err" "training $tmp/gen-hf (gpt2, 2 layers, d_model 32, 2 heads"
check eval-folder-with-shape 2 "$troupe" eval --checkpoint "$tmp/gen-ckpt" --heads 4
expect_in eval-folder-with-shape-msg "$err" "a checkpoint folder records its model: --heads does not apply"
# A --save file records its model (torch.load passes the record over): eval and export
# need no flag; flags that name a model replace the record, and one that does not fit is named.
check eval-file-records 0 "$troupe" eval --checkpoint "$tmp/gen.pt"
same_loss eval-file-records-loss "$tmp/gen-metrics.jsonl" "$out" val_loss
check export-file-records 0 "$troupe" export "$tmp/gen.pt" --to "$tmp/gen-pt-hf"
expect_in export-file-records-config "$tmp/gen-pt-hf/config.json" '"n_layer": 2'
/usr/bin/python3 -c "import torch, sys; sd = torch.load(sys.argv[1]); assert 'wte.weight' in sd, list(sd)" "$tmp/gen.pt" &&
  echo "ok   torch-load-recorded-file" || { echo "FAIL torch-load-recorded-file"; fail=1; }
check eval-file-wrong-shape 2 "$troupe" eval --checkpoint "$tmp/gen.pt" --workload gpt-tiny
expect_in eval-file-wrong-shape-msg "$err" "wte.weight has shape [256, 32], expected [256, 128]"
check eval-mlp-train 0 "$troupe" train --workload fmnist-mlp --steps 2 --threads 1 --save "$tmp/mlp.pt" \
  --metrics "$tmp/mlp-metrics.jsonl"
check eval-mlp 0 "$troupe" eval --checkpoint "$tmp/mlp.pt" --workload fmnist-mlp
same_loss eval-mlp-loss "$tmp/mlp-metrics.jsonl" "$out" test_loss test_accuracy
check eval-missing-data 2 "$troupe" eval --checkpoint "$tmp/mlp.pt" --workload fmnist-mlp --fmnist-dir "$tmp/none"
expect_in eval-missing-data-msg "$err" "Fashion-MNIST file not found: $tmp/none/"
# data.text: a text of one's own. The fortunes corpus as one file, and split over a folder's
# files (with a dot file and a subfolder not read), train bit for bit as the corpus itself
# (losses, gradient norms, validation loss), and check-host prints its fingerprint; eval
# of a checkpoint folder reads the text the run trained on. Too short a text, a missing
# one, one for fmnist-mlp: refused before any step.
(cd /usr/share/games/fortunes && for f in $(ls | LC_ALL=C sort); do
  case $f in *.*) continue ;; esac
  [ -f "$f" ] && [ ! -L "$f" ] && cat "$f"
done) > "$tmp/fortunes.txt"
mkdir -p "$tmp/texts/sub"
head -c 1000000 "$tmp/fortunes.txt" > "$tmp/texts/part-1.txt"
tail -c +1000001 "$tmp/fortunes.txt" > "$tmp/texts/part-2"
echo "not read" > "$tmp/texts/.notes"
echo "not read" > "$tmp/texts/sub/part-0"
text_job=(train --config "$tmp/shape.toml" --steps 3 --threads 1 --pipeline 2 --eval-interval 2)
check text-reference 0 "$troupe" "${text_job[@]}" --metrics "$tmp/text-ref.jsonl"
check text-file 0 "$troupe" "${text_job[@]}" --metrics "$tmp/text-file.jsonl" --text "$tmp/fortunes.txt" \
  --checkpoint-dir "$tmp/text-ckpt"
expect_in text-file-log "$err" "training gpt-tiny (gpt2, 2 layers, d_model 32, 2 heads, d_ff 128, seq_len 64: 0.04 M parameters) on the text in $tmp/fortunes.txt for 3 steps"
check text-folder 0 "$troupe" "${text_job[@]}" --metrics "$tmp/text-folder.jsonl" --text "$tmp/texts"
same_run() {  # same_run NAME A.jsonl B.jsonl: every step's loss, grad_norm and val_loss equal
  /usr/bin/python3 - "$2" "$3" <<'PY' && echo "ok   $1" || { echo "FAIL $1"; fail=1; }
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
keys = ("step", "loss", "grad_norm", "val_loss")
assert len(a) == len(b) == 3 and "val_loss" in a[2], (a, b)
assert [[l.get(k) for k in keys] for l in a] == [[l.get(k) for k in keys] for l in b], (a, b)
PY
}
same_run text-file-same-run "$tmp/text-ref.jsonl" "$tmp/text-file.jsonl"
# deterministic = true (LibTorch's deterministic algorithms, strict): on the CPU no op of
# the job lacks a deterministic kernel, and the run is the default one; a
# CUBLAS_WORKSPACE_CONFIG that is not one of cuBLAS's deterministic settings is refused.
check text-deterministic 0 "$troupe" "${text_job[@]}" --metrics "$tmp/text-det.jsonl" --deterministic true
expect_in text-deterministic-log "$err" "1f1b), 1 intra-op thread(s) per stage, deterministic"
same_run text-deterministic-same-run "$tmp/text-ref.jsonl" "$tmp/text-det.jsonl"
check text-deterministic-local 0 "$troupe" train --config "$tmp/shape.toml" --steps 2 --threads 1 --eval-interval 0 \
  --runtime local --deterministic true
expect_in text-deterministic-local-log "$err" "threads on the CPU, deterministic"
check deterministic-bad-cublas 2 env CUBLAS_WORKSPACE_CONFIG=:0:0 "$troupe" train --steps 1 --deterministic true
expect_in deterministic-bad-cublas-msg "$err" "deterministic = true needs CUBLAS_WORKSPACE_CONFIG :4096:8 or :16:8"
same_run text-folder-same-run "$tmp/text-ref.jsonl" "$tmp/text-folder.jsonl"
# --val-text: the corpus's first 90 % as the training text and the rest as the validation
# text give the corpus's own samples and windows: the same run again.
n_all=$(wc -c < "$tmp/fortunes.txt")
head -c $((n_all * 9 / 10)) "$tmp/fortunes.txt" > "$tmp/train.txt"
tail -c +$((n_all * 9 / 10 + 1)) "$tmp/fortunes.txt" > "$tmp/val.txt"
check text-val 0 "$troupe" "${text_job[@]}" --metrics "$tmp/text-val.jsonl" --text "$tmp/train.txt" \
  --val-text "$tmp/val.txt" --checkpoint-dir "$tmp/text-val-ckpt"
expect_in text-val-log "$err" "on the text in $tmp/train.txt, validated on $tmp/val.txt for 3 steps"
same_run text-val-same-run "$tmp/text-ref.jsonl" "$tmp/text-val.jsonl"
check text-val-eval 0 "$troupe" eval --checkpoint "$tmp/text-val-ckpt"
same_loss text-val-eval-loss "$tmp/text-val.jsonl" "$out" val_loss
expect_in text-val-eval-log "$err" "validation windows on the text in $tmp/train.txt, validated on $tmp/val.txt"
head -c 90 "$tmp/val.txt" > "$tmp/val-short.txt"
check text-val-short 2 "$troupe" "${text_job[@]}" --text "$tmp/train.txt" --val-text "$tmp/val-short.txt"
expect_in text-val-short-msg "$err" "validation text $tmp/val-short.txt holds 90 bytes: too few for seq_len 64, which needs at least 97 (32 validation windows)"
check text-val-alone 2 "$troupe" train --val-text "$tmp/val.txt"
expect_in text-val-alone-msg "$err" "give its training text too (data.text)"
check text-check-host 0 "$troupe" check-host --quick --text "$tmp/texts"
expect_in text-check-host-data "$out" "data 2576674 bytes, fnv1a 2015a6f2b7de2d3d"
check text-resume-without 2 "$troupe" "${text_job[@]}" --resume "$tmp/text-ckpt"
expect_in text-resume-without-msg "$err" "data.text \"$tmp/fortunes.txt\" (checkpoint) vs (absent) (this run)"
check text-eval 0 "$troupe" eval --checkpoint "$tmp/text-ckpt"
same_loss text-eval-loss "$tmp/text-file.jsonl" "$out" val_loss
expect_in text-eval-log "$err" "validation windows on the text in $tmp/fortunes.txt"
head -c 1000 "$tmp/fortunes.txt" > "$tmp/short.txt"
check text-too-short 2 "$troupe" train --text "$tmp/short.txt" --save "$tmp/short.pt"
expect_in text-too-short-msg "$err" "text corpus $tmp/short.txt holds 1000 bytes: too few for seq_len 128, which needs at least 1601"
[ ! -e "$tmp/short.pt" ] && echo "ok   text-too-short-nothing-written" || { echo "FAIL text-too-short-nothing-written"; fail=1; }
check text-too-short-nodes 1 "$troupe" check-host --quick --text "$tmp/short.txt"
check text-missing 2 "$troupe" train --text "$tmp/none.txt"
expect_in text-missing-msg "$err" "text corpus not found: $tmp/none.txt does not exist"
check text-generate 2 "$troupe" generate --checkpoint "$tmp/text-ckpt" --text "$tmp/fortunes.txt"
expect_in text-generate-msg "$err" "unknown flag --text"
check text-mlp 2 "$troupe" train --workload fmnist-mlp --text "$tmp/fortunes.txt"
expect_in text-mlp-msg "$err" "is a corpus for the decoder workloads"
check gen-bad-temperature 2 "$troupe" generate --checkpoint "$tmp/gen.pt" --temperature -1
expect_in gen-bad-temperature-msg "$err" "temperature must be in [0, 100]"
check train-bad-device 2 "$troupe" train --device tpu
expect_in train-bad-device-msg "$err" "unknown device 'tpu'"
if ! command -v nvidia-smi >/dev/null; then  # no GPU here: asking for one is a clear error
  check train-cuda-without-gpu 2 "$troupe" train --steps 1 --device cuda
  expect_in train-cuda-without-gpu-msg "$err" "device 'cuda'"
fi
check train-two-steps 0 "$troupe" train --steps 2 --threads 1 --pipeline 2 --metrics "$tmp/m.jsonl" --save "$tmp/model.pt" --trace "$tmp/trace.json"
expect_in train-progress "$out" "step 2/2 | loss"
/usr/bin/python3 - "$tmp" <<'PY' || fail=1
import json, sys, torch
lines = [json.loads(l) for l in open(sys.argv[1] + "/m.jsonl")]
assert [l["step"] for l in lines] == [0, 1], lines
for key in ("loss", "lr", "grad_norm", "tokens_per_s", "bubble", "stage_busy_s", "grad_reduce_tail_s"):
    assert all(key in l for l in lines), key
assert all(0 <= l["grad_reduce_tail_s"] < 60 for l in lines), lines
assert "val_loss" in lines[-1]
sd = torch.load(sys.argv[1] + "/model.pt")
assert "h.0.attn.c_attn.weight" in sd and "ln_f.weight" in sd and len(sd) == 100, len(sd)
trace = json.load(open(sys.argv[1] + "/trace.json"))["traceEvents"]
ops = [e for e in trace if e.get("cat") == "compute"]
assert len(ops) == 2 * 2 * 2 * 8, len(ops)
assert set(ops[0]["args"]) >= {"step", "stage", "op", "mb", "chunk", "replica"}, ops[0]
print("ok   metrics-checkpoint-trace")
PY
# Parameters sharded: every shard writes its pieces of the folder; docs/fsdp.md's Python
# puts them together into what --save wrote (the parameters and the moments).
check train-sharded-folder 0 "$troupe" train --steps 2 --threads 1 --d-model 64 --seq-len 64 --pipeline 2 \
  --data-parallel 2 --shard parameters --eval-interval 0 --checkpoint-dir "$tmp/fsdp-ck" --save "$tmp/fsdp.pt"
/usr/bin/python3 - "$tmp" <<'PY' || fail=1
import glob, sys, torch
files = sorted(glob.glob(sys.argv[1] + "/fsdp-ck/step-00000002/stage-*-shard-*.pt"))
assert len(files) == 4, files
flat = {}
for f in files:
    for key, piece in torch.load(f).items():
        kind, _, rest = key.partition(".")
        if kind not in ("main", "exp_avg", "exp_avg_sq"):
            continue
        name, where = rest.rsplit("@", 1)
        offset, numel = map(int, where.split("/"))
        flat.setdefault((kind, name), torch.zeros(numel))[offset:offset + piece.numel()] = piece
model, optim = torch.load(sys.argv[1] + "/fsdp.pt"), torch.load(sys.argv[1] + "/fsdp.pt.optim")
assert {n for k, n in flat if k == "main"} == set(model), sorted(set(model) ^ {n for k, n in flat if k == "main"})
for (kind, name), t in flat.items():
    want = model[name] if kind == "main" else optim[kind + "." + name]
    assert torch.equal(t.view(want.shape), want), (kind, name)
print("ok   sharded-folder-pieces-in-python")
PY
# A fresh run starts its metrics log anew (both runtimes): no lines of the run before.
for runtime in actors local; do
  check "train-$runtime-metrics-anew" 0 "$troupe" train --steps 1 --runtime $runtime --threads 1 --metrics "$tmp/m.jsonl"
  /usr/bin/python3 -c "import json,sys; s=[json.loads(l)['step'] for l in open(sys.argv[1])]; assert s == [0], s" \
    "$tmp/m.jsonl" && echo "ok   $runtime-metrics-anew-lines" || { echo "FAIL $runtime-metrics-anew-lines"; fail=1; }
done
check train-local-runtime 0 "$troupe" train --steps 1 --runtime local
expect_in train-local-runtime-cpu "$err" "threads on the CPU"
# The plain loop is the fp32 reference on the CPU: asking it for bf16 or a GPU is an error.
check train-local-bf16 2 "$troupe" train --steps 1 --runtime local --precision bf16
expect_in train-local-bf16-msg "$err" "precision bf16 needs the actors runtime (the local loop computes in fp32)"
check train-local-cuda 2 "$troupe" train --steps 1 --runtime local --device cuda:0
expect_in train-local-cuda-msg "$err" "needs the actors runtime (the local loop runs on the CPU)"
# SIGTERM stops the local loop after its step too, with a checkpoint (--save) that --load
# continues from: parameters and every step's loss equal an uninterrupted run's.
local_job=(train --runtime local --steps 8 --threads 1 --eval-interval 0)
check train-local-reference 0 "$troupe" "${local_job[@]}" --save "$tmp/lref.pt" --metrics "$tmp/lref.jsonl"
during "$out" "^step 3/8" 'kill -TERM $pid' "$troupe" "${local_job[@]}" --save "$tmp/lst.pt" --metrics "$tmp/lst.jsonl"
[ $rc = 143 ] && echo "ok   train-local-sigterm" || { echo "FAIL train-local-sigterm: exit $rc"; cat "$err"; fail=1; }
expect_in train-local-sigterm-msg "$err" "of 8: its checkpoint is $tmp/lst.pt (continue with --load $tmp/lst.pt)"
check train-local-continue 0 "$troupe" "${local_job[@]}" --load "$tmp/lst.pt" --save "$tmp/lst.pt" --metrics "$tmp/lst.jsonl"
expect_in train-local-continue-log "$err" "resumed from $tmp/lst.pt at step"
/usr/bin/python3 "$(dirname "$0")/../support/compare_runs.py" "$tmp/lref" "$tmp/lst" 0 && echo "ok   train-local-stop-equals-reference" \
  || { echo "FAIL train-local-stop-equals-reference"; fail=1; }
# A checkpoint that cannot be written (a full disk: 50 MB of a 64 MB tmpfs taken, a
# checkpoint folder of gpt-tiny is 20 MB) does not end the run: logged, no partial folder
# left, training goes on; once space is freed the next one is written, and the run ends
# as one without the fault (the same parameters and losses).
disk=$tmp/disk
mkdir -p "$disk"
if mount -t tmpfs -o size=64m none "$disk" 2>/dev/null; then
  head -c 50M /dev/zero >"$disk/ballast"
  full_job=(train --steps 8 --threads 1 --eval-interval 0 --checkpoint-interval 2 --keep-checkpoints 1)
  check train-full-disk-reference 0 "$troupe" "${full_job[@]}" --metrics "$tmp/fref.jsonl" --save "$tmp/fref.pt"
  during "$err" "checkpoint not written" 'rm -f "$disk/ballast"' \
    "$troupe" "${full_job[@]}" --checkpoint-dir "$disk/ck" --metrics "$tmp/full.jsonl" --save "$tmp/full.pt"
  [ $rc = 0 ] && echo "ok   train-full-disk" || { echo "FAIL train-full-disk: exit $rc"; cat "$err"; fail=1; }
  expect_in train-full-disk-warning "$err" "checkpoint_dir $disk/ck has "
  expect_in train-full-disk-warning-end "$err" "checkpoints that do not fit are logged and skipped (the run's last must fit)"
  expect_in train-full-disk-msg "$err" "step 2: checkpoint not written: stage "
  expect_in train-full-disk-msg-file "$err" ": cannot write $disk/ck/.step-00000002.tmp/"
  expect_in train-full-disk-msg-reason "$err" "No space left on device; training goes on (the next checkpoint is due at step 4)"
  [ "$(ls -A "$disk/ck" | tr "\n" " ")" = ".lock latest step-00000008 " ] && echo "ok   train-full-disk-folders" \
    || { echo "FAIL train-full-disk-folders: $(ls -A "$disk/ck")"; fail=1; }
  /usr/bin/python3 "$(dirname "$0")/../support/compare_runs.py" "$tmp/fref" "$tmp/full" 0 && echo "ok   train-full-disk-equals-reference" \
    || { echo "FAIL train-full-disk-equals-reference"; fail=1; }
  # The run's last checkpoint must be written: a full disk there is the run's failure.
  head -c 60M /dev/zero >"$disk/ballast" 2>/dev/null
  check train-full-disk-last 1 "$troupe" train --steps 2 --threads 1 --eval-interval 0 --checkpoint-dir "$disk/ck2"
  expect_in train-full-disk-last-msg "$err" "cannot write the checkpoint of step 2 (the run's last): "
  umount "$disk"
else
  echo "SKIP train-full-disk: cannot mount a tmpfs here (needs root)"
fi
# Words that are no flag: named in the command line's order; an unknown flag with the
# closest one (a typo, or one it starts with).
check train-extras 2 "$troupe" train --steps 1 foo bar
expect_in train-extras-msg "$err" "unexpected argument(s): foo bar; see troupe train --help"
check train-unknown-flag 2 "$troupe" train --warmup-steps 5 --pipline 2
expect_in train-unknown-flag-msg "$err" "unknown flag --warmup-steps (did you mean --warmup?); unknown flag --pipline (did you mean --pipeline?); see troupe train --help"
check train-dataflow-chunks 2 "$troupe" train --schedule dataflow --chunks 2 --pipeline 2
# Tokenizers and exports: bad input named.
check tokenizer-small-vocab 2 "$troupe" tokenizer --vocab-size 300 --out "$tmp/small.model"
expect_in tokenizer-small-vocab-msg "$err" "Vocabulary size is smaller than required_chars"
check tokenizer-missing-text 2 "$troupe" tokenizer --text "$tmp/no-such-text" --vocab-size 400 --out "$tmp/t.model"
expect_in tokenizer-missing-text-msg "$err" "no-such-text"
check train-missing-tokenizer 2 "$troupe" train --tokenizer "$tmp/no-such.model"
expect_in train-missing-tokenizer-msg "$err" "tokenizer $tmp/no-such.model does not exist"
check export-mlp 2 "$troupe" export "$tmp/no-such.pt" --workload fmnist-mlp --to "$tmp/hf"
expect_in export-mlp-msg "$err" "export writes the decoder workloads' models"
# The [model] keys of the architectures: each bad combination named.
check llama-kv-heads 2 "$troupe" train --workload llama-tiny --heads 3 --d-model 96
expect_in llama-kv-heads-msg "$err" "heads 3 is not a multiple of kv_heads (2)"
check gpt2-kv-heads 2 "$troupe" train --kv-heads 2
expect_in gpt2-kv-heads-msg "$err" "kv_heads 2 with architecture gpt2"
check bad-architecture 2 "$troupe" train --architecture mamba
expect_in bad-architecture-msg "$err" "unknown architecture 'mamba' (expected gpt2, llama, mistral, qwen2 or qwen3)"
check bad-tie 2 "$troupe" train --tie-embeddings maybe
expect_in bad-tie-msg "$err" "expected auto, true or false"
check llama-odd-head-dim 2 "$troupe" train --workload llama-tiny --d-model 132 --heads 4 --kv-heads 4
expect_in llama-odd-head-dim-msg "$err" "head dimension 33 (d_model / heads) is odd"
# Tensor parallelism: the local loop runs it and says so; layouts that cannot work say what fits.
check tp-local 0 "$troupe" train --runtime local --tensor-parallel 2 --sequence-parallel true --steps 2 --layers 2 --eval-interval 0
expect_in tp-local-log "$err" "tensor-parallel 2 (sequence parallel) x pipeline 1"
check tp-heads 2 "$troupe" train --runtime local --tensor-parallel 3
expect_in tp-heads-msg "$err" "parallel.tensor_parallel = 3 does not divide model.heads = 4 (each rank holds an equal part); tensor_parallel values that fit this model: 1, 2, 4"
check tp-actors 0 "$troupe" train --tensor-parallel 2 --sequence-parallel true --pipeline 2 --steps 2 --layers 2 --eval-interval 0
expect_in tp-actors-log "$err" "with actors: tensor-parallel 2 (sequence parallel) x pipeline 2"
check tp-dataflow 2 "$troupe" train --tensor-parallel 2 --schedule dataflow
expect_in tp-dataflow-msg "$err" "tensor_parallel 2 with schedule dataflow"
# Experts: the load-balancing loss beside the cross-entropy; bad settings say what fits.
check moe-local 0 "$troupe" train --runtime local --workload moe-tiny --steps 1 --layers 2 --eval-interval 0 --metrics "$tmp/moe.jsonl"
expect_in moe-local-aux "$out" "| aux_loss 0.0"
expect_in moe-local-metrics "$tmp/moe.jsonl" '"aux_loss":'
check moe-top-k 2 "$troupe" train --workload moe-tiny --moe-top-k 5
expect_in moe-top-k-msg "$err" "moe_top_k 5 with 4 experts: expected 1 to 4"
check train-bad-init 2 "$troupe" train --steps 1 --init "$tmp/m.jsonl"
expect_in train-bad-init-msg "$err" "not a readable PyTorch file"
# docs/configuration.md is generated from the keys' table (troupe config-reference): it
# must be the current one.
check config-reference 0 "$troupe" config-reference
if diff -u "$(dirname "$0")/../../docs/configuration.md" "$out" >"$tmp/reference.diff"; then
  echo "ok   config-reference-is-docs-configuration-md"
else
  echo "FAIL docs/configuration.md is not 'troupe config-reference' (regenerate it: build/troupe config-reference > docs/configuration.md):"
  head -40 "$tmp/reference.diff"
  fail=1
fi
expect_in config-reference-has-every-section "$out" "## [faults]"
# troupe plan: the ranked layouts, restrictions, and refusals.
check plan-json 0 "$troupe" plan --workload llama3-8b --devices 64 --device h100 --top 5 --format json
/usr/bin/python3 - "$out" <<'PY' || fail=1
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["layouts"]
assert len(rows) == 5 and d["fitting"] >= 5 and d["considered"] > d["fitting"], d
for r in rows:
    assert r["tp"] * r["pp"] * r["dp"] * r["cp"] == 64, r
    assert r["dp"] * r["micro_batch"] * r["microbatches"] == 2048, r
    assert sum(r["memory_bytes"].values()) <= 72e9, r
assert [r["step_seconds"] for r in rows] == sorted(r["step_seconds"] for r in rows), rows
print("ok   plan-json-content")
PY
check plan-table 0 "$troupe" plan --workload llama3-8b --devices 16 --device a100 --tp 8 --top 3
expect_in plan-table-tp "$out" "1   8    "
check plan-no-fit 1 "$troupe" plan --workload llama3-405b --devices 8 --device h100
expect_in plan-no-fit-msg "$err" "no layout fits"
check plan-bad-device 2 "$troupe" plan --workload gpt-tiny --devices 2 --device tpu
expect_in plan-bad-device-msg "$err" "unknown device 'tpu'"
printf '[inter]\nbandwidth = 5\n' >"$tmp/net.toml"
check plan-bad-network 2 "$troupe" plan --workload gpt-tiny --devices 2 --network "$tmp/net.toml"
expect_in plan-bad-network-msg "$err" "inter.bandwidth"
exit $fail
