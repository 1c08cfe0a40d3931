"""Plain PyTorch reference of WORKLOADS.md's gpt-tiny: model, data and training loop.

Used by the equivalence test (tests/pytorch_reference_test) and the benchmark
(tests/bench/). Run with Debian's /usr/bin/python3 and python3-torch.
"""
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

MASK64 = (1 << 64) - 1


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def load_fortunes(folder="/usr/share/games/fortunes"):
    names = sorted(
        n for n in os.listdir(folder)
        if "." not in n and not os.path.islink(os.path.join(folder, n))
        and os.path.isfile(os.path.join(folder, n)))
    data = b"".join(open(os.path.join(folder, n), "rb").read() for n in names)
    return data, len(data) * 9 // 10


def train_batch(data, n_train, seed, first, count, seq_len):
    rows = []
    for g in range(first, first + count):
        off = splitmix64(((seed << 32) + g) & MASK64) % (n_train - seq_len)
        rows.append(list(data[off:off + seq_len + 1]))
    t = torch.tensor(rows, dtype=torch.int64)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Block(nn.Module):
    def __init__(self, d, n_head, d_ff):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, d_ff)
        self.mlp.c_proj = nn.Linear(d_ff, d)

    def forward(self, x, causal):
        B, T, d = x.shape
        H = self.n_head
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q = q.view(B, T, H, d // H).transpose(1, 2)
        k = k.view(B, T, H, d // H).transpose(1, 2)
        v = v.view(B, T, H, d // H).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // H))
        att = att.masked_fill(causal[:T, :T].logical_not(), float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, d)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer=8, n_head=4, d=128, d_ff=512, seq_len=128, vocab=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(Block(d, n_head, d_ff) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.register_buffer("causal", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(),
                             persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        """The mean loss against `targets`; without them, the logits."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x, self.causal)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model, lr=1e-3):
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "wpe.weight"]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n != "wpe.weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(t, total, warmup=20, max_lr=1e-3, min_lr=1e-4):
    if t < warmup:
        return max_lr * (t + 1) / warmup
    return min_lr + 0.5 * (max_lr - min_lr) * (
        1 + math.cos(math.pi * (t - warmup) / max(1, total - 1 - warmup)))


def train(model, opt, losses_of, steps, total, seq_len, seed=1234, batch=32, stream=None):
    """Section 1's loop: `steps` steps of `batch` windows of the fortunes corpus (or of
    `stream`: (token ids, n_train)), the lr schedule over `total` steps, the backward of
    loss + aux (`losses_of(x, y)`), clipping at global norm 1.0; returns each step's loss."""
    data, n_train = load_fortunes() if stream is None else stream
    losses = []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(t, total)
        x, y = train_batch(data, n_train, seed, t * batch, batch, seq_len)
        loss, aux = losses_of(x, y)
        opt.zero_grad()
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def add_shape_args(parser):
    """The workload and shape flags of `troupe train` (0: the workload's own)."""
    parser.add_argument("--workload", default="gpt-tiny", choices=["gpt-tiny", "llama-tiny", "moe-tiny"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=0, help="llama: 0: 2")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--d-ff", type=int, default=0, help="0: 4 x d_model (gpt), 3 x d_model (llama)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--experts", type=int, default=0, help="0: moe-tiny 4")
    parser.add_argument("--moe-top-k", type=int, default=2)
    parser.add_argument("--moe-d-ff", type=int, default=0, help="0: moe-tiny 192")
    parser.add_argument("--moe-every", type=int, default=1)
    parser.add_argument("--moe-capacity-factor", type=float, default=0.0, help="0: no token dropped")


def model_from_args(a):
    """The model (GPT, or llama_tiny.Llama) of the workload and shape add_shape_args's flags give."""
    if a.workload in ("llama-tiny", "moe-tiny"):
        import llama_tiny
        experts = ((a.experts or 4, a.moe_d_ff or 192, a.moe_top_k, 0.01, a.moe_every, a.moe_capacity_factor)
                   if a.workload == "moe-tiny" else None)
        return llama_tiny.Llama(a.layers, a.heads, a.kv_heads or 2, a.d_model, a.d_ff or 3 * a.d_model, a.seq_len,
                                experts=experts)
    return GPT(a.layers, a.heads, a.d_model, a.d_ff or 4 * a.d_model, a.seq_len)


def optimizer_for(a, model):
    """The workload's AdamW parameter groups (WORKLOADS.md)."""
    if a.workload in ("llama-tiny", "moe-tiny"):
        import llama_tiny
        return llama_tiny.make_optimizer(model)
    return make_optimizer(model)
