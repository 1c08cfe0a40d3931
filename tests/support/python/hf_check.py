"""Loads a Hugging Face folder that `troupe export` wrote with transformers'
from_pretrained, unchanged, and compares its logits with Troupe's forward.

usage: python hf_check.py DIR TROUPE_PT
TROUPE_PT (written by the C++ test with Troupe's own state_dict writer) holds `tokens`
(batch, T) and `logits` (batch, T, vocab), Troupe's forward on them. Prints the largest
difference; exit 1 above 1e-4, or when the file's metadata is not {"format": "pt"}.
"""
import os
import sys

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM


def main():
    folder, troupe_pt = sys.argv[1], sys.argv[2]
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        if f.metadata() != {"format": "pt"}:
            print("metadata", f.metadata())
            return 1
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    ref = torch.load(troupe_pt)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"{type(model).__name__}: max |logits - Troupe's| = {diff:.3g} (logits up to {ref['logits'].abs().max().item():.3g})")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
