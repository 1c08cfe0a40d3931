"""Trains gpt-tiny (or llama-tiny) in plain PyTorch for a few steps and writes what the
C++ run is compared with: OUT/init.pt (initial state_dict), OUT/final.pt, OUT/losses.txt.

usage: /usr/bin/python3 tests/support/python/gpt_reference.py OUT_DIR STEPS TOTAL_STEPS
           [--workload gpt-tiny|llama-tiny|moe-tiny] [--layers L] [--heads H] [--kv-heads K]
           [--d-model D] [--d-ff F] [--seq-len T] [--experts E] [--moe-top-k K] [--moe-d-ff F]
           [--moe-every N] [--moe-capacity-factor C]
(the options are those of `troupe train`; the defaults are the workload's)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_tiny  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("total", type=int)
    gpt_tiny.add_shape_args(ap)
    a = ap.parse_args()
    out, steps, total, seq_len = a.out, a.steps, a.total, a.seq_len
    torch.manual_seed(7)
    torch.set_num_threads(2)
    model = gpt_tiny.model_from_args(a)
    torch.save(model.state_dict(), os.path.join(out, "init.pt"))  # as a user saves it
    opt = gpt_tiny.optimizer_for(a, model)

    def losses_of(x, y):
        loss = model(x, y)  # experts: (loss, the load-balancing loss, which joins the backward only)
        return loss if isinstance(loss, tuple) else (loss, 0.0)

    losses = gpt_tiny.train(model, opt, losses_of, steps, total, seq_len)
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write("\n".join(repr(x) for x in losses) + "\n")


if __name__ == "__main__":
    main()
