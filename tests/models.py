"""Small, plain test models (nanoGPT style, no dropout)."""


import torch
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
