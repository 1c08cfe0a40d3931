"""Plain PyTorch reference of WORKLOADS.md's llama-tiny (section 3), written from its text:
RMSNorm (statistics in fp32), rotary embeddings in the rotate_half convention (tables in
fp32), grouped-query attention, SwiGLU, no biases, an untied lm_head, Hugging Face names;
and of moe-tiny (section 4): Mixtral's top-2 sparse MLP with the per-sequence
load-balancing loss.
Data, sampling and training are gpt-tiny's (gpt_tiny.py). Run with Debian's
/usr/bin/python3 and python3-torch.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim, seq_len, theta):
    """cos, sin (seq_len, head_dim): angles t * inv_freq[j], twice over."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.arange(seq_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Expert(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)
        self.w3 = nn.Linear(d, d_ff, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    """WORKLOADS.md section 4: router softmax in fp32, the top-k experts (ties: the lower
    index), weights renormalised, no token dropped; forward returns the output and the
    load-balancing loss (mean over the sequences).

    capacity_factor (Troupe's model.moe_capacity_factor; 0: none): in training, of each
    sequence's (token, choice) pairs routed to an expert only the ceil(factor T k / E)
    with the highest router probability (ties: the earlier token) are computed; the others
    add nothing. The load-balancing loss counts the choices before dropping."""

    def __init__(self, d, d_ff, n_experts, top_k, coeff, capacity_factor=0.0):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, d_ff) for _ in range(n_experts))
        self.top_k, self.coeff, self.capacity_factor = top_k, coeff, capacity_factor

    def dropped(self, p, chosen, B, T):
        """(B T, k) bool: the pairs past their expert's capacity in their sequence."""
        E, k = len(self.experts), self.top_k
        out = torch.zeros_like(chosen, dtype=torch.bool)
        if not (self.capacity_factor and self.training):
            return out
        capacity = math.ceil(self.capacity_factor * (T * k) / E)
        for b in range(B):
            rows = slice(b * T, (b + 1) * T)
            for e in range(E):
                token, slot = (chosen[rows] == e).nonzero(as_tuple=True)
                pairs = sorted(zip(token.tolist(), slot.tolist()), key=lambda ts: (-p[b * T + ts[0], e].item(), ts[0]))
                for t, s in pairs[capacity:]:
                    out[b * T + t, s] = True
        return out

    def forward(self, g):
        B, T, d = g.shape
        E, k = len(self.experts), self.top_k
        x = g.reshape(B * T, d)
        p = torch.softmax(self.gate(x).float(), dim=-1)
        chosen = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
        picked = p.gather(1, chosen)
        w = picked / picked.sum(1, keepdim=True)
        kept = ~self.dropped(p.detach(), chosen, B, T)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = ((chosen == e) & kept).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * w[token, slot].unsqueeze(1).to(x.dtype))
        f = F.one_hot(chosen, E).float().view(B, T * k, E).sum(1) / (k * T)
        P = p.view(B, T, E).mean(1)
        aux = self.coeff * E * (f * P).sum(1).mean()
        return out.view(B, T, d), aux


class Layer(nn.Module):
    def __init__(self, d, n_head, n_kv_head, d_ff, eps, experts=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, n_head * self.hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.self_attn.o_proj = nn.Linear(n_head * self.hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if experts:  # (n_experts, d_ff of each, top_k, coeff, every[, capacity factor])
            self.block_sparse_moe = SparseMoe(d, experts[1], experts[0], experts[2], experts[3], *experts[5:])
        else:
            self.mlp = nn.Module()
            self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
            self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
            self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, cos, sin, causal):
        """The layer's output and its load-balancing loss (0 without experts)."""
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.n_kv_head, self.hd
        a = self.input_layernorm(x)
        q = self.self_attn.q_proj(a).view(B, T, H, hd).transpose(1, 2)
        k = self.self_attn.k_proj(a).view(B, T, KV, hd).transpose(1, 2)
        v = self.self_attn.v_proj(a).view(B, T, KV, hd).transpose(1, 2)
        c, s = cos[:T].to(q.dtype), sin[:T].to(q.dtype)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        k = k.repeat_interleave(H // KV, dim=1)  # query head h uses key/value head h // (H / KV)
        v = v.repeat_interleave(H // KV, dim=1)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(causal[:T, :T].logical_not(), float("-inf"))
        y = torch.matmul(torch.softmax(att, dim=-1), v).transpose(1, 2).contiguous().view(B, T, H * hd)
        h = x + self.self_attn.o_proj(y)
        g = self.post_attention_layernorm(h)
        if hasattr(self, "block_sparse_moe"):
            y, aux = self.block_sparse_moe(g)
            return h + y, aux
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(g)) * self.mlp.up_proj(g)), 0.0


class Llama(nn.Module):
    def __init__(self, n_layer=8, n_head=4, n_kv_head=2, d=128, d_ff=384, seq_len=128, vocab=256,
                 theta=10000.0, eps=1e-5, experts=None):
        """experts: (n_experts, d_ff of each, top_k, coeff, every[, capacity factor]) for moe-tiny;
        None: dense."""
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        # Experts in layers 0, every, 2 every, ... (the others dense).
        self.model.layers = nn.ModuleList(
            Layer(d, n_head, n_kv_head, d_ff, eps, experts if experts and i % experts[4] == 0 else None)
            for i in range(n_layer))
        self.experts = experts
        self.model.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        cos, sin = rope_tables(d // n_head, seq_len, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("causal", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # the norms
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        """The mean loss against `targets` (with experts: and the load-balancing loss summed
        over the layers); without them, the logits."""
        x = self.model.embed_tokens(idx)
        aux = 0.0
        for layer in self.model.layers:
            x, a = layer(x, self.cos, self.sin, self.causal)
            aux = aux + a
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return (loss, aux) if self.experts else loss


def make_optimizer(model, lr=1e-3):
    """AdamW with weight decay on every 2-D weight (embedding, projections, lm_head)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)
