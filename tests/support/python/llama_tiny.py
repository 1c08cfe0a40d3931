"""Plain PyTorch reference of WORKLOADS.md's llama-tiny (section 3), written from its text:
RMSNorm (statistics in fp32), rotary embeddings in the rotate_half convention (tables in
fp32), grouped-query attention, SwiGLU, no biases, an untied lm_head, Hugging Face names.
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


class Layer(nn.Module):
    def __init__(self, d, n_head, n_kv_head, d_ff, eps):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, n_head * self.hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.self_attn.o_proj = nn.Linear(n_head * self.hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, cos, sin, causal):
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
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(g)) * self.mlp.up_proj(g))


class Llama(nn.Module):
    def __init__(self, n_layer=8, n_head=4, n_kv_head=2, d=128, d_ff=384, seq_len=128, vocab=256,
                 theta=10000.0, eps=1e-5):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(Layer(d, n_head, n_kv_head, d_ff, eps) for _ in range(n_layer))
        self.model.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        cos, sin = rope_tables(d // n_head, seq_len, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("causal", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # the norms
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        """The mean loss against `targets`; without them, the logits."""
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, self.cos, self.sin, self.causal)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model, lr=1e-3):
    """AdamW with weight decay on every 2-D weight (embedding, projections, lm_head)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)
