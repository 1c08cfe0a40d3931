"""Greedy generation in plain PyTorch, what `troupe generate --temperature 0` is compared
with: loads a state_dict into gpt_tiny.GPT, continues the prompt's bytes with the most
likely byte TOKENS times (each from the last seq_len bytes) and prints the byte values.

usage: /usr/bin/python3 tests/support/python/gpt_generate.py STATE_DICT PROMPT TOKENS
           [--layers L] [--heads H] [--d-model D] [--d-ff F] [--seq-len T]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_tiny  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("state")
    ap.add_argument("prompt")
    ap.add_argument("tokens", type=int)
    gpt_tiny.add_shape_args(ap)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model = gpt_tiny.model_from_args(a)
    model.load_state_dict(torch.load(a.state))
    model.eval()
    ids = list(a.prompt.encode())
    with torch.no_grad():
        for _ in range(a.tokens):
            window = torch.tensor([ids[-a.seq_len:]])
            ids.append(int(model(window)[0, -1].argmax()))
    print(" ".join(str(i) for i in ids))


if __name__ == "__main__":
    main()
