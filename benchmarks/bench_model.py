"""The benchmark GPT: nanoGPT with separate q/k/v projections (so hand-written Megatron tensor
parallelism through DTensor can shard them by heads) and an untied LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BenchConfig:
    vocab: int = 8192
    seq: int = 128
    layers: int = 6
    heads: int = 8
    hidden: int = 512


class Attention(nn.Module):
    def __init__(self, c: BenchConfig):
        super().__init__()
        self.heads, self.dim = c.heads, c.hidden // c.heads
        self.q, self.k, self.v = (nn.Linear(c.hidden, c.hidden) for _ in range(3))
        self.o = nn.Linear(c.hidden, c.hidden)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: hand-written tensor parallelism leaves each rank its share of the heads
        q, k, v = (p(x).view(B, T, -1, self.dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, c: BenchConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.attn = Attention(c)
        self.up, self.down = nn.Linear(c.hidden, 4 * c.hidden), nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class BenchGPT(nn.Module):
    def __init__(self, c: BenchConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.ln = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
