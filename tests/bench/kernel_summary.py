"""Sums up a GPU kernel profile (a Chrome trace JSON from LibTorch's Kineto profiler:
`TROUPE_KERNEL_PROFILE=FILE:FIRST:LAST troupe train ...`, or torch.profiler's export).

usage: python3 tests/bench/kernel_summary.py TRACE.json [STEPS] [TOP]

Prints, as Markdown: the profiled span (first GPU activity to last), the time the GPU was
busy (the union of kernel, copy and set intervals on all streams), kernels per step, their
mean length, the time by kind of kernel (matrix products, attention, normalisation,
element-wise, reductions, optimizer, copies, collectives), and the TOP kernels by time.
STEPS (default 2) divides the counts into per-step figures.
"""
import collections
import json
import re
import sys

KINDS = [  # first match wins
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp|cudnn.*(mha|sdpa)"),
    ("matrix product", r"gemm|cutlass|xmma|nvjet|sm\d+_.*(tn|nt|nn|tt)|cublas|matmul|wgmma"),
    ("normalisation", r"layer_norm|layernorm|rms_?norm|batch_norm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("reduction", r"reduce|norm_kernel|sum_kernel|nonzero|masked_select|cub::"),
    ("cross entropy / log-softmax", r"log_softmax|nll_loss|cross_entropy|softmax"),
    ("GELU / SiLU", r"gelu|silu|swiglu"),
    ("embedding", r"embedding|index_select|indexSelect|gather|scatter"),
    ("copy / cast", r"copy|cast|fill|CatArray|cat_|contiguous|transpose"),
    ("element-wise", r"elementwise|vectorized|unrolled|pointwise|binary|unary"),
    ("collective", r"nccl"),
]


def kind(name):
    for k, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return k
    return "other"


def union(intervals):
    total, end = 0.0, None
    for b, e in sorted(intervals):
        if end is None or b > end:
            total += e - b
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main():
    path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        sys.exit(f"{path}: no GPU activity recorded (CUPTI unavailable, or no kernel ran in the profiled steps)")
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", "")]
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    ktime = sum(e["dur"] for e in kernels)
    streams = {(e.get("args", {}).get("device"), e.get("args", {}).get("stream")) for e in kernels}
    print(f"profiled span {span / 1e3:.2f} ms ({steps} steps), GPU busy {busy / 1e3:.2f} ms ({busy / span:.1%}), "
          f"{len(kernels) / steps:,.0f} kernels per step on {len(streams)} stream(s), mean {ktime / max(1, len(kernels)):.1f} us, "
          f"{len(launches) / steps:,.0f} launch calls per step recorded")
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = e["cat"] if e["cat"] != "kernel" else kind(e["name"])
        by_kind[k][0] += 1
        by_kind[k][1] += e["dur"]
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    total = sum(t for _, t in by_kind.values())
    print("\n| kind | per step | ms per step | share of GPU time |")
    print("| --- | ---: | ---: | ---: |")
    for k, (n, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n / steps:,.0f} | {t / steps / 1e3:.2f} | {t / total:.1%} |")
    print(f"\n| top kernels | per step | ms per step | mean us |")
    print("| --- | ---: | ---: | ---: |")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short}` | {n / steps:,.0f} | {t / steps / 1e3:.2f} | {t / n:.1f} |")


if __name__ == "__main__":
    main()
