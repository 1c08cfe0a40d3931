"""Times gpt-tiny training steps in plain PyTorch (Python), the same model, batch and
optimizer as the C++ loop. Prints one JSON line per thread count.

usage: /usr/bin/python3 tests/bench/gpt_pytorch_step.py [SECONDS] [fp32|bf16] [THREADS,...] [gpt-tiny|llama-tiny]

bf16: the forward and backward under CPU autocast (bf16 matrix products, fp32
parameters and optimizer), as Troupe's --precision bf16 on the CPU.
"""
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "python"))
import gpt_tiny  # noqa: E402
import llama_tiny  # noqa: E402


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    if precision not in ("fp32", "bf16"):
        sys.exit(f"precision must be fp32 or bf16, not {precision!r}")
    thread_counts = [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2]
    workload = sys.argv[4] if len(sys.argv) > 4 else "gpt-tiny"

    def amp():
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    data, n_train = gpt_tiny.load_fortunes()
    for threads in thread_counts:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        if workload == "llama-tiny":
            model = llama_tiny.Llama()
            opt = llama_tiny.make_optimizer(model)
        else:
            model = gpt_tiny.GPT()
            opt = gpt_tiny.make_optimizer(model)
        steps, elapsed, t = 0, 0.0, 0
        while elapsed < seconds or steps < 3:
            x, y = gpt_tiny.train_batch(data, n_train, 1234, t * 32, 32, 128)
            start = time.perf_counter()
            loss = torch.zeros(())
            for k in range(8):  # 8 micro-batches of 4, as the C++ default
                with amp():
                    mb = model(x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]) / 8
                mb.backward()
                loss += mb.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if t > 0:  # first step is warm-up
                elapsed += time.perf_counter() - start
                steps += 1
            t += 1
        print(json.dumps({"workload": workload, "threads": threads, "precision": precision, "tokens_per_s": steps * 32 * 128 / elapsed,
                          "step_ms": 1000 * elapsed / steps}))


if __name__ == "__main__":
    main()
