"""GPU benchmark: gpt-small (GPT-2 124M shape, seq 1024, 256-byte vocabulary) training
throughput of Troupe's actor runtime on one GPU against PyTorch eager (Python) training
the same model, batch and optimizer on the same GPU in the same run, and model FLOPs
utilisation against the GPU's bf16 matrix-product peak measured in the same run.

usage: python3 tests/bench/gpu_bench.py BUILD_DIR [STEPS]
  (BUILD_DIR from launch/setup-gpu; run on a machine with a GPU and the fortunes corpus)

Also runs p=4 as 2 node processes on the GPU (CUDA IPC buffers for activations, host staging for the rest), and
first BUILD_DIR/troupe_staging_bench cuda (staged and CUDA IPC transfers between two processes vs a device-to-device
copy; a short run, printed before the long ones so that a run cut short still has it).

TROUPE_GPU_BENCH_ONLY=REGEX runs only the runs, overhead rows and kernel profiles whose name it matches (the
eager reference always runs); TROUPE_GPU_BENCH_ROUNDS=N (default 1) runs the bf16 / fp32 residual-stream pairs N
times, alternating.

Prints a Markdown table. MFU = model FLOPs per second / measured peak, with model FLOPs
per token = 6 N + 12 L T d (N parameters, L layers, T sequence length, d model width;
PaLM's formula: forward + backward, attention scores and values counted in full).
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "python"))
import gpt_tiny  # noqa: E402  (data loading: the same samples as Troupe)
from pipeline_ops import op_means, simulate  # noqa: E402

L, H, D, FF, T, V = 12, 12, 768, 3072, 1024, 256
GLOBAL_BATCH, MICRO = 16, 4
ONLY = re.compile(os.environ.get("TROUPE_GPU_BENCH_ONLY", ""))
FP32_RESIDUAL = ("--fp32-residual", "true")


def wanted(name):
    return ONLY.search(name) is not None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.mlp_proj = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        B = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1))


def n_params():
    return V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D


def flops_per_token():
    return 6 * n_params() + 12 * L * T * D


def bf16_peak():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def eager_tokens_per_s(data, n_train, steps):
    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for t in range(steps):
        x, y = gpt_tiny.train_batch(data, n_train, 1234, t * GLOBAL_BATCH, GLOBAL_BATCH, T)
        torch.cuda.synchronize()
        start = time.perf_counter()
        x, y = x.cuda(), y.cuda()
        mbs = GLOBAL_BATCH // MICRO
        for k in range(MICRO):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x[k * mbs:(k + 1) * mbs], y[k * mbs:(k + 1) * mbs]) / MICRO
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times = sorted(times[3:])
    return GLOBAL_BATCH * T / times[len(times) // 2]


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def troupe_run(build, steps, pipeline, micro, extra=(), timeout=150, nodes=1, env=None, workload="gpt-small",
               batch=GLOBAL_BATCH, trace=False):
    """One `troupe train` run; returns its median tokens/s over steps 4.., step seconds, the
    median sum of the stages' busy seconds per step (the metrics' stage_busy_s), the
    model's parameter count (from its log line) and, with `trace`, its mean op times.

    nodes > 1: that many node processes on this machine (launch/troupe), sharing the GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        if trace:
            extra = (*extra, "--trace", os.path.join(tmp, "trace.json"))
        exe = [os.path.join(build, "troupe")] if nodes == 1 else [os.path.join(ROOT, "launch", "troupe")]
        if nodes > 1:
            extra = (*extra, "--nodes", str(nodes))
        cmd = [*exe, "train", "--workload", workload, "--device", "cuda",
               "--precision", "bf16", "--steps", str(steps), "--pipeline", str(pipeline),
               "--microbatches", str(micro), "--global-batch", str(batch), "--eval-interval", "0", "--threads", "1",
               "--metrics", metrics, *extra]
        start = time.perf_counter()
        label = " ".join(cmd[1:]) + "".join(f" [{k}={v}]" for k, v in (env or {}).items())
        try:
            run_env = dict(os.environ, TROUPE_BUILD_DIR=build, TROUPE_SKIP_SETUP="1", **(env or {}))
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(label + f" did not finish in {timeout} s:\n" + (e.stderr or b"")[-3000:].decode())
        if run.returncode != 0:
            raise RuntimeError(label + " failed:\n" + run.stderr[-3000:])
        rows = [json.loads(line) for line in open(metrics) if '"tokens_per_s"' in line][3:]
        med = lambda xs: sorted(xs)[len(xs) // 2]
        params = re.search(r"([0-9.]+) M parameters", run.stdout + run.stderr)
        r = {"tps": med([x["tokens_per_s"] for x in rows]), "step_s": med([x["step_seconds"] for x in rows]),
             "busy_s": med([sum(x.get("stage_busy_s") or [0]) for x in rows]),
             "params": float(params.group(1)) * 1e6 if params else None}
        if trace:
            r["ops"] = op_means(os.path.join(tmp, "trace.json"), first_step=3)
        # each figure as soon as it is measured: a run cut short still leaves the ones before
        print(f"  ({label}: {time.perf_counter() - start:.0f} s, {r['tps']:,.0f} tokens/s, step {r['step_s'] * 1e3:.1f} ms,"
              f" stages busy {r['busy_s'] * 1e3:.1f} ms)", file=sys.stderr, flush=True)
        return r


def mps_env(tmp):
    """Starts the CUDA MPS daemon (kernels of several processes run side by side instead of
    taking turns); returns the clients' environment and a function that stops it, or None
    where the machine has no MPS."""
    ctl = shutil.which("nvidia-cuda-mps-control") or next(
        (c for c in ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
         if os.path.exists(c)), None)
    if not ctl:
        return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(tmp, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(tmp, "log")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    full = dict(os.environ, **env)
    if subprocess.run([ctl, "-d"], env=full, timeout=30).returncode != 0:
        return None

    def stop():
        subprocess.run([ctl], input="quit\n", text=True, env=full, timeout=30)
        time.sleep(1)
    return env, stop


def kernel_profile(build, steps, pipeline, micro, label, out_dir, **kw):
    """A run with TROUPE_KERNEL_PROFILE (steps 5..6); returns kernel_summary.py's table of it."""
    path = os.path.join(out_dir or tempfile.gettempdir(), f"kernels-{label}.json")
    troupe_run(build, steps, pipeline, micro, env={"TROUPE_KERNEL_PROFILE": f"{path}:5:6"}, **kw)
    summary = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_summary.py"),
                              path, "2", "12"], capture_output=True, text=True)
    text = summary.stdout or summary.stderr
    print(text, file=sys.stderr, flush=True)
    return text


def main():
    build = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    out_dir = os.environ.get("TROUPE_BENCH_OUT")  # kernel profiles kept there
    # What a tensor between node processes costs on the host-staged and CUDA IPC paths,
    # against a device-to-device copy in the same run.
    if wanted("staging bench"):
        subprocess.run([os.path.join(build, "troupe_staging_bench"), "cuda"], check=True)
    print()
    sys.stdout.flush()
    data, n_train = gpt_tiny.load_fortunes()
    peak = bf16_peak()
    start = time.perf_counter()
    eager = eager_tokens_per_s(data, n_train, steps)
    print(f"  (eager: {time.perf_counter() - start:.0f} s, {eager:,.0f} tokens/s)", file=sys.stderr, flush=True)
    runs = [("PyTorch eager (Python), bf16 autocast, 4 micro-batches of 4 x 1024", {"tps": eager, "params": n_params()})]
    summaries = []

    def add(name, *a, **kw):
        if not wanted(name):
            return
        try:
            runs.append((name, troupe_run(build, steps, *a, **kw)))
        except Exception as e:  # one failing layout must not lose the others
            print(f"  ({name}: {e})", file=sys.stderr, flush=True)
            runs.append((name + " (failed, see bench.err)", None))

    for p, m in ((1, 4), (1, 2), (4, 8)):
        add(f"Troupe actors p={p}, {m} micro-batches of {GLOBAL_BATCH // m} x 1024", p, m)
    # The residual stream in bf16 (the default, Megatron's) against fp32 (fp32_residual =
    # true, autocast's), alternating.
    for r in range(int(os.environ.get("TROUPE_GPU_BENCH_ROUNDS", "1"))):
        for stream, extra in (("", ()), (", fp32 residual stream", FP32_RESIDUAL)):
            add(f"Troupe actors p=1, 1 micro-batch of 16 x 1024{stream}", 1, 1, extra)
            add(f"Troupe actors p=1, global batch 32 x 1024, 2 micro-batches of 16 x 1024{stream}", 1, 2, extra,
                batch=32)
            add(f"Troupe actors llama-small p=1, 1 micro-batch of 16 x 1024{stream}", 1, 1, extra,
                workload="llama-small")
            add(f"Troupe actors p=4, 4 micro-batches of 4 x 1024{stream}", 4, 4, extra)
        # Each stage's backward on its own thread, not on LibTorch's one autograd thread for
        # the GPU (what expert parallelism needs; compute/runtime/device.hpp).
        add("Troupe actors p=4, 4 micro-batches of 4 x 1024, backwards on the stage threads", 4, 4,
            env={"TROUPE_BACKWARD_ON_STAGE_THREAD": "1"})
    add("Troupe actors llama-small p=1, 4 micro-batches of 4 x 1024", 1, 4, workload="llama-small")
    # Inputs copied to the GPU without waiting for the stage's stream (to_device_async)
    # against a plain .to(), which waits for the previous micro-batch's kernels, alternating.
    for r in range(int(os.environ.get("TROUPE_GPU_BENCH_ROUNDS", "1"))):
        for name, env in (("", None), (", blocking input copies", {"TROUPE_BLOCKING_INPUT_COPIES": "1"})):
            add(f"Troupe actors p=1, 4 micro-batches of 4 x 1024, round {r + 1}{name}", 1, 4, env=env)
    # What the same bits every run cost (LibTorch's deterministic kernels, strict).
    add("Troupe actors p=4, deterministic = true, 4 micro-batches", 4, 4, ("--deterministic", "true"))
    add("Troupe actors p=1, deterministic = true, 4 micro-batches", 1, 4, ("--deterministic", "true"))
    for name, extra in (("zero-bubble", ("--schedule", "zero-bubble")),
                        ("interleaved-1f1b, 2 chunks", ("--schedule", "interleaved-1f1b", "--chunks", "2")),
                        ("dataflow, split backward", ("--schedule", "dataflow", "--split-backward", "true"))):
        add(f"Troupe actors p=4, {name}, 8 micro-batches", 4, 8, extra)
    # Pipeline overhead beyond the bubble: the measured step against the makespan the
    # simulator gives with the run's own mean F and B times (the GPU op clock's), p=4, m=8.
    overheads = []
    for kind, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        if not wanted(f"pipeline overhead {kind}"):
            continue
        try:
            r = troupe_run(build, steps, 4, 8, ("--schedule", kind, "--chunks", str(chunks)), trace=True)
            sim = simulate(os.path.join(build, "troupe"), kind, 4, 8, chunks, r["ops"])["makespan"]
            overheads.append((kind, r, sim))
        except Exception as e:
            print(f"  (pipeline overhead {kind}: {e})", file=sys.stderr, flush=True)
    # Gradient buckets reduce-scattered during the last backward (gpt-small p=1: 4 buckets
    # of the default 40M elements) against one bucket, two replicas sharing the GPU.
    for name, extra in (("one gradient bucket", ("--bucket-size", "0")), ("default buckets (40M elements)", ())):
        add(f"Troupe actors p=1 d=2 (2 replicas share the GPU), {name}, 4 micro-batches", 1, 4,
            ("--data-parallel", "2", *extra))
    add("Troupe p=4 as 2 node processes sharing the GPU, 4 micro-batches", 4, 4, nodes=2)
    add("Troupe p=1 d=2 as 2 node processes sharing the GPU, 4 micro-batches", 1, 4, ("--data-parallel", "2"), nodes=2)
    for label, p, m, nodes, extra in (("p1-m4", 1, 4, 1, ()), ("p1-m1", 1, 1, 1, ()),
                                      ("p1-m1-fp32-residual", 1, 1, 1, FP32_RESIDUAL), ("p4-m4", 4, 4, 1, ()),
                                      ("p4-m4-fp32-residual", 4, 4, 1, FP32_RESIDUAL), ("nodes2-p4", 4, 4, 2, ())):
        if not wanted(f"kernel profile {label}"):
            continue
        try:
            text = kernel_profile(build, 8, p, m, label, out_dir, nodes=nodes, extra=extra)
            where = f"p={p}" + (f" as {nodes} node processes (node 0's process)" if nodes > 1 else "")
            stream = ", fp32 residual stream" if extra else ""
            summaries.append((f"gpt-small {where}, {m} micro-batches of {GLOBAL_BATCH // m} x 1024{stream}, steps 6-7",
                              text))
        except Exception as e:
            print(f"  (kernel profile {label}: {e})", file=sys.stderr, flush=True)
    # Last (it changes how the GPU is shared): the node processes with CUDA MPS.
    with tempfile.TemporaryDirectory() as tmp:
        mps = mps_env(tmp) if wanted("CUDA MPS") else None
        if not wanted("CUDA MPS"):
            pass
        elif mps is None:
            print("  (no CUDA MPS on this machine)", file=sys.stderr, flush=True)
        else:
            env, stop = mps
            try:
                add("Troupe p=4 as 2 node processes sharing the GPU under CUDA MPS, 4 micro-batches", 4, 4, nodes=2,
                    env=env)
                add("Troupe actors p=4 under CUDA MPS, 4 micro-batches (one process)", 4, 4, env=env)
            finally:
                stop()
    gpt = flops_per_token()
    print(f"GPU: {torch.cuda.get_device_name()}; measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
          f"gpt-small {n_params() / 1e6:.1f} M parameters, {gpt / 1e9:.2f} GFLOP per token; bf16; "
          f"global batch {GLOBAL_BATCH} x {T} tokens unless named; median of steps 4..{steps}. "
          f"MFU: model FLOPs (6 N + 12 L T d per token) / measured peak; of 989 TFLOP/s in brackets")
    print("| run | tokens/s | vs eager | MFU | step ms | stages busy ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in runs:
        if r is None:
            print(f"| {name} | - | - | - | - | - |")
            continue
        fpt = 6 * (r["params"] or n_params()) + 12 * L * T * D
        step = f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-"
        busy = f"{r['busy_s'] * 1e3:.1f}" if "busy_s" in r else "-"
        print(f"| {name} | {r['tps']:,.0f} | {r['tps'] / eager:.2f} | {r['tps'] * fpt / peak:.1%} "
              f"({r['tps'] * fpt / 989e12:.1%}) | {step} | {busy} |")
    if overheads:
        print("\nPipeline overhead, p=4, 8 micro-batches: measured step / simulated makespan (the run's mean "
              "F and B from its trace, steps 4 on)\n")
        print("| schedule | mean F / B ms | simulated makespan ms | measured step ms | ratio |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for kind, r, sim in overheads:
            print(f"| {kind} | {r['ops']['F']:.2f} / {r['ops']['B']:.2f} | {sim:.1f} | {r['step_s'] * 1e3:.1f} | "
                  f"{r['step_s'] * 1e3 / sim:.2f} |")
    for name, text in summaries:
        print(f"\nKernel profile, {name}:\n\n{text}")


if __name__ == "__main__":
    main()
