"""Small, plain test models (nanoGPT style, no dropout)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: F401  (the demo's model)

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}


def make_activation(name):
    return ACTIVATIONS[name]()


class MLP(nn.Module):
    """Linear layers dims[0] -> dims[1] -> ... -> dims[-1], with the activation between them."""

    def __init__(self, dims, activation="gelu"):
        super().__init__()
        layers = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                layers.append(make_activation(activation))
            layers.append(nn.Linear(d_in, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(name, dim):
    if name == "layernorm":
        return nn.LayerNorm(dim)
    if name == "rmsnorm":
        return RMSNorm(dim)
    raise ValueError(f"unknown norm {name!r}")


class ResidualBlock(nn.Module):
    def __init__(self, width, norm="layernorm", activation="gelu"):
        super().__init__()
        self.norm = make_norm(norm, width)
        self.fc1 = nn.Linear(width, width)
        self.act = make_activation(activation)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """depth blocks of x = x + Linear(act(Linear(norm(x))))."""

    def __init__(self, width, depth, norm="layernorm", activation="gelu"):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock(width, norm, activation) for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x




class LogitsOnly(nn.Module):
    """Wraps a Hugging Face causal LM so that forward(input_ids) returns just the logits tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def hf_gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LogitsOnly(GPT2LMHeadModel(config))


def hf_llama(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=32,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LogitsOnly(LlamaForCausalLM(config))


@dataclass
class TinyConfig:
    """A drawn transformer: depth, width, heads, grouped-query ratio, sequence, head tying."""

    vocab: int = 16
    hidden: int = 8
    heads: int = 2
    kv_heads: int = 1
    depth: int = 1
    seq: int = 4
    tied: bool = True
    norm: str = "rmsnorm"


class TinyAttention(nn.Module):
    """Causal attention with grouped-query heads (kv heads repeated as Llama does)."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.heads, self.kv_heads, self.dim = c.heads, c.kv_heads, c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.heads * self.dim, bias=False)
        self.kv = nn.Linear(c.hidden, 2 * c.kv_heads * self.dim, bias=False)
        self.o = nn.Linear(c.heads * self.dim, c.hidden, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).split(self.kv_heads * self.dim, dim=-1)
        k = k.view(B, T, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.dim).reshape(B, self.heads, T,
                                                                              self.dim)
        v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.dim).reshape(B, self.heads, T,
                                                                              self.dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class TinyBlock(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.n1, self.n2 = make_norm(c.norm, c.hidden), make_norm(c.norm, c.hidden)
        self.attn = TinyAttention(c)
        self.up = nn.Linear(c.hidden, 2 * c.hidden)
        self.down = nn.Linear(2 * c.hidden, c.hidden)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.silu(self.up(self.n2(x))))


class TinyTransformer(nn.Module):
    """Embedding, `depth` blocks, final norm, LM head (tied to the embedding or not)."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList([TinyBlock(c) for _ in range(c.depth)])
        self.norm = make_norm(c.norm, c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))
