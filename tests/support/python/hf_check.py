"""Loads a Hugging Face folder that `troupe export` wrote with transformers'
from_pretrained, unchanged, and compares its logits with Troupe's forward.

usage: python hf_check.py DIR TROUPE_PT [SOURCE]
TROUPE_PT (written by the C++ test with Troupe's own state_dict writer) holds `tokens`
(batch, T) and `logits` (batch, T, vocab), Troupe's forward on them. Prints the largest
difference; exit 1 above 1e-4, or when the file's metadata is not {"format": "pt"}.
With SOURCE (the folder DIR's model came from) that has a tokenizer: AutoTokenizer loads
DIR's and encodes a text as SOURCE's does, or exit 1.
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
    if diff > 1e-4:
        return 1
    if len(sys.argv) > 3 and os.path.exists(os.path.join(sys.argv[3], "tokenizer_config.json")):
        from transformers import AutoTokenizer
        text = "w5 w17 w3 w42 w299 unknown"
        theirs, ours = AutoTokenizer.from_pretrained(sys.argv[3]), AutoTokenizer.from_pretrained(folder)
        if theirs(text)["input_ids"] != ours(text)["input_ids"]:
            print("tokenizer differs:", theirs(text)["input_ids"], ours(text)["input_ids"])
            return 1
        print(f"{type(ours).__name__}: the same ids as the source's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
