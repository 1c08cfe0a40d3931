"""A plain PyTorch training loop over the transformers module of a Hugging Face folder
(WORKLOADS.md section 6): what Troupe's `--model DIR` run is compared with.

usage: python hf_train_reference.py FOLDER OUT STEPS TOTAL_STEPS SEQ_LEN [--document-attention] [DATA...]
Loads FOLDER with AutoModelForCausalLM (fp32, eager attention), trains STEPS steps of
section 1's rules (AdamW (0.9, 0.95), eps 1e-8, the lr schedule over TOTAL_STEPS, weight
decay 0.1 on every parameter of 2 or more dimensions but gpt2's wpe, clipping at 1.0) on
the fortunes corpus's byte windows of SEQ_LEN (batch 32, seed 1234), with section 4's
per-sequence load-balancing term, coefficient router_aux_loss_coef (0 if absent), over
each block with experts. With DATA (.jsonl files, Megatron prefixes), the windows are
section 6's document stream instead: each JSON line's "text" as AutoTokenizer encodes
it, EOS (config.json's eos_token_id) appended unless last; a Megatron dataset's ids
as stored (Megatron-Core's IndexedDataset); the first floor(9 n / 10) tokens train.
With --document-attention, each window is cut into its documents (a new one after each
EOS) and the module runs on each of them alone: positions from 0 and attention within
the document, by construction; the window's logits are theirs in order.
Writes OUT/losses.txt (each step's cross-entropy) and
OUT/final (save_pretrained of the trained model).
"""
import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_tiny  # noqa: E402


def routers(model):
    """The experts' routers: the modules named "...gate" whose weight has one row per
    expert (transformers 4.x's Linear layers, 5.x's TopKRouter modules)."""
    n = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", None)
    if not n:
        return []
    return [m for name, m in model.named_modules()
            if name.endswith(".gate") and getattr(m, "weight", None) is not None and m.weight.dim() == 2
            and m.weight.size(0) == n]


def document_stream(folder, paths, eos):
    """WORKLOADS.md section 6's stream of the documents of `paths`, and its n_train."""
    import json
    ids = []
    for path in paths:
        if path.endswith(".jsonl"):
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(folder)
            for line in open(path, encoding="utf-8"):
                if line.strip():
                    doc = tok(json.loads(line)["text"])["input_ids"]
                    if not doc or doc[-1] != eos:
                        doc.append(eos)
                    ids.extend(doc)
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
            data = IndexedDataset(path)
            for i in range(len(data)):
                ids.extend(int(x) for x in data[i])
    return ids, len(ids) * 9 // 10


def main():
    folder, out, steps, total, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    paths = [a for a in sys.argv[6:] if a != "--document-attention"]
    documents = "--document-attention" in sys.argv[6:]
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    model.train()
    config = model.config
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    top_k = getattr(config, "num_experts_per_tok", 0)
    coeff = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if documents and routers(model):
        sys.exit("--document-attention: the per-sequence load-balancing term is not split by document here")
    logits_of_routers = []
    for r in routers(model):
        # (5.x's routers return (router_logits, weights, indices))
        r.register_forward_hook(lambda mod, inp, outp: logits_of_routers.append(outp[0] if isinstance(outp, tuple) else outp))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("wpe.weight")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("wpe.weight"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def window_logits(x):
        if not documents:
            return model(x).logits
        rows = []
        for seq in x:
            starts = [0] + [t + 1 for t in range(len(seq) - 1) if int(seq[t]) == eos]
            ends = starts[1:] + [len(seq)]
            rows.append(torch.cat([model(seq[a:b].unsqueeze(0)).logits[0] for a, b in zip(starts, ends)]))
        return torch.stack(rows)

    def losses_of(x, y):
        logits_of_routers.clear()
        logits = window_logits(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        aux = 0.0
        for router_logits in logits_of_routers:  # (B T, E) of one block with experts
            B, T = x.shape
            E = router_logits.size(-1)
            p = torch.softmax(router_logits.float(), dim=-1)
            chosen = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
            f = F.one_hot(chosen, E).float().view(B, T * top_k, E).sum(1) / (top_k * T)
            P = p.view(B, T, E).mean(1)
            aux = aux + coeff * E * (f * P).sum(1).mean()
        return loss, aux

    stream = document_stream(folder, paths, eos) if paths else None
    losses = gpt_tiny.train(model, opt, losses_of, steps, total, seq_len, stream=stream)
    model.save_pretrained(os.path.join(out, "final"))
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write("\n".join(repr(v) for v in losses) + "\n")


if __name__ == "__main__":
    sys.exit(main())
