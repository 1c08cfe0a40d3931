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
    data, n_train = gpt_tiny.load_fortunes()
    opt = gpt_tiny.optimizer_for(a, model)
    seed, batch = 1234, 32
    losses = []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = gpt_tiny.lr_at(t, total)
        x, y = gpt_tiny.train_batch(data, n_train, seed, t * batch, batch, seq_len)
        loss = model(x, y)
        aux = 0.0
        if isinstance(loss, tuple):  # experts: the load-balancing loss joins the backward only
            loss, aux = loss
        opt.zero_grad()
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write("\n".join(repr(x) for x in losses) + "\n")


if __name__ == "__main__":
    main()
