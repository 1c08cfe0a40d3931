"""GPU benchmark: gpt-small (GPT-2 124M shape, seq 1024, 256-byte vocabulary) training
throughput of Troupe's actor runtime on one GPU against PyTorch eager (Python) training
the same model, batch and optimizer on the same GPU in the same run, and model FLOPs
utilisation against the GPU's bf16 matrix-product peak measured in the same run.

usage: python3 tests/bench/gpu_bench.py BUILD_DIR [STEPS]
  (BUILD_DIR from launch/setup-gpu; run on a machine with a GPU and the fortunes corpus)

Also runs p=4 as 2 node processes on the GPU (CUDA IPC buffers for activations, host staging for the rest), and
first BUILD_DIR/troupe_staging_bench cuda (staged and CUDA IPC transfers between two processes vs a device-to-device
copy; a short run, printed before the long ones so that a run cut short still has it).

Prints a Markdown table. MFU = model FLOPs per second / measured peak, with model FLOPs
per token = 6 N + 12 L T d (N parameters, L layers, T sequence length, d model width;
PaLM's formula: forward + backward, attention scores and values counted in full).
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "python"))
import gpt_tiny  # noqa: E402  (data loading: the same samples as Troupe)

L, H, D, FF, T, V = 12, 12, 768, 3072, 1024, 256
GLOBAL_BATCH, MICRO = 16, 4


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


def troupe_tokens_per_s(build, steps, pipeline, micro, extra=(), timeout=150, nodes=1):
    """nodes > 1: that many node processes on this machine (launch/troupe), sharing the GPU;
    tensors between them go through host memory over UCX."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        exe = [os.path.join(build, "troupe")] if nodes == 1 else [os.path.join(ROOT, "launch", "troupe")]
        if nodes > 1:
            extra = (*extra, "--nodes", str(nodes))
        cmd = [*exe, "train", "--workload", "gpt-small", "--device", "cuda",
               "--precision", "bf16", "--steps", str(steps), "--pipeline", str(pipeline),
               "--microbatches", str(micro), "--eval-interval", "0", "--threads", "1",
               "--metrics", metrics, *extra]
        start = time.perf_counter()
        try:
            env = dict(os.environ, TROUPE_BUILD_DIR=build, TROUPE_SKIP_SETUP="1")
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(" ".join(cmd) + f" did not finish in {timeout} s:\n" + (e.stderr or b"")[-3000:].decode())
        print(f"  ({' '.join(cmd[1:])}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        if run.returncode != 0:
            raise RuntimeError(" ".join(cmd) + " failed:\n" + run.stderr[-3000:])
        rows = [json.loads(line) for line in open(metrics) if '"tokens_per_s"' in line]
        tps = sorted(r["tokens_per_s"] for r in rows[3:])
        # each figure as soon as it is measured: a run cut short still leaves the ones before
        print(f"  ({' '.join(cmd[1:])}: {tps[len(tps) // 2]:,.0f} tokens/s)", file=sys.stderr, flush=True)
        return tps[len(tps) // 2]


def main():
    build = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    # What a tensor between node processes costs on the host-staged and CUDA IPC paths,
    # against a device-to-device copy in the same run.
    subprocess.run([os.path.join(build, "troupe_staging_bench"), "cuda"], check=True)
    print()
    sys.stdout.flush()
    data, n_train = gpt_tiny.load_fortunes()
    peak = bf16_peak()
    start = time.perf_counter()
    eager = eager_tokens_per_s(data, n_train, steps)
    print(f"  (eager: {time.perf_counter() - start:.0f} s, {eager:,.0f} tokens/s)", file=sys.stderr, flush=True)
    runs = [("PyTorch eager (Python), bf16 autocast, 4 micro-batches", eager)]
    for p, m in ((1, 4), (4, 4), (4, 8)):
        runs.append((f"Troupe actors p={p} (stage actors share the GPU, own streams), {m} micro-batches, bf16",
                     troupe_tokens_per_s(build, steps, p, m)))
    # What the same bits every run cost (LibTorch's deterministic kernels, strict).
    runs.append(("Troupe actors p=4, deterministic = true, 4 micro-batches, bf16",
                 troupe_tokens_per_s(build, steps, 4, 4, ("--deterministic", "true"))))
    for name, extra in (("zero-bubble", ("--schedule", "zero-bubble")),
                        ("dataflow, split backward", ("--schedule", "dataflow", "--split-backward", "true"))):
        runs.append((f"Troupe actors p=4, {name}, 8 micro-batches, bf16", troupe_tokens_per_s(build, steps, 4, 8, extra)))
    # Gradient buckets reduce-scattered during the last backward (gpt-small p=1: 4 buckets
    # of the default 40M elements) against one bucket, two replicas sharing the GPU.
    for name, extra in (("one gradient bucket", ("--bucket-size", "0")), ("default buckets (40M elements)", ())):
        runs.append((f"Troupe actors p=1 d=2 (2 replicas share the GPU), {name}, 4 micro-batches, bf16",
                     troupe_tokens_per_s(build, steps, 1, 4, ("--data-parallel", "2", *extra))))
    runs.append(("Troupe p=4 as 2 node processes sharing the GPU (tensors between them staged through host "
                 "memory over UCX), 4 micro-batches, bf16", troupe_tokens_per_s(build, steps, 4, 4, nodes=2)))
    fpt = flops_per_token()
    print(f"GPU: {torch.cuda.get_device_name()}; measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
          f"gpt-small {n_params() / 1e6:.1f} M parameters, {fpt / 1e9:.2f} GFLOP per token; "
          f"global batch {GLOBAL_BATCH} x {T} tokens; median of steps 4..{steps}")
    print("| run | tokens/s | vs eager | MFU |")
    print("| --- | ---: | ---: | ---: |")
    for name, tps in runs:
        print(f"| {name} | {tps:,.0f} | {tps / eager:.2f} | {tps * fpt / peak:.1%} |")


if __name__ == "__main__":
    main()
