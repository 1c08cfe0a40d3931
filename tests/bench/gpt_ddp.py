"""gpt-tiny with PyTorch DDP (gloo, 2 processes on this machine, 1 thread each): the
reference for the default job's tokens/s (docs/performance.md). Each rank trains half
of the global batch of 32 as micro-batches of 4 (gradient accumulation with no_sync, one
all-reduce per step), AdamW and global-norm clipping as the C++ job. Prints one JSON line.

usage: /usr/bin/python3 tests/bench/gpt_ddp.py [STEPS]
"""
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "python"))
import gpt_tiny  # noqa: E402

WORLD, GLOBAL_BATCH, MICRO = 2, 32, 4


def run(rank, steps, store_path, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank, world_size=WORLD)
    data, n_train = gpt_tiny.load_fortunes()
    torch.manual_seed(0)
    net = gpt_tiny.GPT()
    # The causal masks are constant bool buffers, which gloo cannot broadcast.
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        net, [name for name, b in net.named_buffers() if b.dtype == torch.bool])
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = gpt_tiny.make_optimizer(model.module)
    per_rank = GLOBAL_BATCH // WORLD
    n_micro = per_rank // MICRO
    elapsed, timed, each = 0.0, 0, []
    for t in range(steps):
        x, y = gpt_tiny.train_batch(data, n_train, 1234, t * GLOBAL_BATCH, GLOBAL_BATCH, 128)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        dist.barrier()
        start = time.perf_counter()
        for k in range(n_micro):
            xs, ys = x[MICRO * k:MICRO * (k + 1)], y[MICRO * k:MICRO * (k + 1)]
            if k < n_micro - 1:
                with model.no_sync():
                    (model(xs, ys) / (n_micro * WORLD) * WORLD).backward()
            else:
                (model(xs, ys) / (n_micro * WORLD) * WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if t > 0:  # the first step is warm-up
            each.append(time.perf_counter() - start)
            elapsed += each[-1]
            timed += 1
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"processes": WORLD, "tokens_per_s": timed * GLOBAL_BATCH * 128 / elapsed,
                       "step_ms": 1000 * elapsed / timed, "median_step_s": sorted(each)[len(each) // 2]}, f)
    dist.destroy_process_group()


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(run, args=(steps, os.path.join(d, "store"), out), nprocs=WORLD, join=True)
        print(open(out).read())


if __name__ == "__main__":
    main()
