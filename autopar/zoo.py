"""Models from config, no downloads: what the example, the tests, the benchmarks and calibration
plan and train.

- `GPT`: a whole GPT in one short class, nanoGPT style: token + position embedding, pre-LayerNorm
  blocks with causal scaled-dot-product attention and a GELU MLP, and an LM head tied to the
  embedding (`GPTConfig.tie_weights`); `lm_loss` is its next-token loss.
- `Llama3`: torchtitan's Llama 3 in one short class (RMSNorm, rotary positions, grouped-query
  attention by causal SDPA, SwiGLU, an untied output layer), with torchtitan's sizes
  (`Llama3Config`; `LLAMA3["8B"]`, `LLAMA3["70B"]`).
- `hf_gpt2`, `hf_llama`: Hugging Face GPT-2 and Llama built from a config (the `transformers`
  package is needed for these only), wrapped so that forward(input_ids) returns the logits.
  Traced, Hugging Face's attention passes SDPA an explicit causal mask (it skips the mask
  only when not tracing), which GPUs run with the memory-efficient kernel over every block;
  `Llama3` calls SDPA with `is_causal=True`, as torchtitan does (the flash kernel, masked
  blocks skipped).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """The GPT's sizes (nanoGPT's names)."""

    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True  # the LM head shares the token embedding's weight


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = GPTMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """(batch, sequence) token ids -> (batch, sequence, vocabulary) logits."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


@dataclass
class Llama3Config:
    """torchtitan's Llama 3 sizes (its model args' names)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 128
    ffn_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


LLAMA3 = {
    "8B": Llama3Config(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       ffn_dim=14336),
    "70B": Llama3Config(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                        ffn_dim=28672),
}


class _Llama3Attention(nn.Module):
    def __init__(self, c: Llama3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _rotate(x, cos, sin):
    """Rotary positions on (B, T, heads, head_dim), pairs as (first half, second half), in
    the angles' precision and back to x's (as torchtitan does)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class _Llama3Block(nn.Module):
    def __init__(self, c: Llama3Config):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = _Llama3Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama3(nn.Module):
    """torchtitan's Llama 3 (torchtitan/models/llama3/model): forward(tokens) -> logits."""

    def __init__(self, config: Llama3Config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([_Llama3Block(config) for _ in range(config.n_layers)])
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens):
        c = self.config
        half = c.dim // c.n_heads // 2
        freqs = c.rope_theta ** (-torch.arange(half, device=tokens.device) / half)
        angles = torch.arange(tokens.shape[1], device=tokens.device)[:, None] * freqs
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # (T, 1, half)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def lm_loss(logits, targets):
    """Next-token cross-entropy of (batch, sequence, vocabulary) logits."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class LogitsOnly(nn.Module):
    """Wraps a Hugging Face causal LM so that forward(input_ids) returns just the logits tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def import_transformers(needed_by: str):
    """The `transformers` module, an optional dependency; an ImportError that says how to
    install it when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{needed_by} is a Hugging Face model and needs the transformers "
                          "package, which autopar does not install by default: pip install "
                          "transformers (or pip install -e '.[hf]' in autopar's checkout)"
                          ) from None
    return transformers


def hf_causal_lm(kind: str, **fields) -> LogitsOnly:
    """A Hugging Face causal LM built from config, no downloads: `kind` is the transformers
    prefix ("GPT2", "Llama", "Mixtral", ...) of its `<kind>Config` and `<kind>ForCausalLM` (or
    `<kind>LMHeadModel`), `fields` its config fields. No KV cache, no special tokens, SDPA
    attention: what autopar traces."""
    transformers = import_transformers(f"the zoo's {kind} model")
    config = getattr(transformers, f"{kind}Config")(
        **{"bos_token_id": None, "eos_token_id": None, "use_cache": False,
           "attn_implementation": "sdpa", **fields})
    model = getattr(transformers, f"{kind}ForCausalLM", None) or \
        getattr(transformers, f"{kind}LMHeadModel")
    return LogitsOnly(model(config))


def hf_gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, dropout=0.0):
    """GPT-2 from config; `dropout` is its embedding, residual and attention dropout."""
    return hf_causal_lm("GPT2", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        vocab_size=vocab_size, n_positions=n_positions, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, summary_first_dropout=0.0)


def hf_llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=32):
    """Llama (grouped-query attention, RMSNorm, SwiGLU, rotary positions) from config."""
    return hf_causal_lm("Llama", num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads,
                        intermediate_size=intermediate_size, vocab_size=vocab_size,
                        max_position_embeddings=max_position_embeddings,
                        attention_dropout=0.0, pad_token_id=None)
