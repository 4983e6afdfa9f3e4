"""Small, plain test models (nanoGPT style): MLPs, residual blocks, a drawn tiny transformer
(grouped-query attention, RMSNorm) and its mixture-of-experts variant, a ResNet (torchvision's
layout), and the Hugging Face models only the tests use (Llama with LoRA adapters, Mixtral).
The GPT, Llama and GPT-2 are autopar.zoo's."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import LogitsOnly, hf_causal_lm, lm_loss

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
    def __init__(self, width, norm="layernorm", activation="gelu", dropout=0.0):
        super().__init__()
        self.norm = make_norm(norm, width)
        self.fc1 = nn.Linear(width, width)
        self.act = make_activation(activation)
        self.fc2 = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class StatefulBlock(nn.Module):
    """x + tanh(state(Linear(x))), where `state` updates a buffer in forward: BatchNorm in
    training mode ("batchnorm": its running statistics), or an offset added to the features
    and then advanced by `step` under torch.no_grad() ("offset")."""

    def __init__(self, width, state="batchnorm", step=0.1):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.state, self.step = state, step
        if state == "batchnorm":
            self.bn = nn.BatchNorm1d(width)
        else:
            self.register_buffer("offset", torch.zeros(width))

    def forward(self, x):
        h = self.fc(x)
        if self.state == "batchnorm":
            return x + torch.tanh(self.bn(h))
        h = torch.tanh(h + self.offset)
        with torch.no_grad():
            self.offset.add_(self.step)
        return x + h


class StatefulMLP(nn.Module):
    """An input layer, `depth` StatefulBlocks and an output layer. The offset blocks advance by
    different steps (the layers are not copies of each other)."""

    def __init__(self, d_in, width, d_out, depth, state="batchnorm"):
        super().__init__()
        self.inp, self.out = nn.Linear(d_in, width), nn.Linear(width, d_out)
        self.blocks = nn.ModuleList([StatefulBlock(width, state, 0.1 * (i + 1))
                                     for i in range(depth)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class ResidualMLP(nn.Module):
    """depth blocks of x = x + dropout(Linear(act(Linear(norm(x)))))."""

    def __init__(self, width, depth, norm="layernorm", activation="gelu", dropout=0.0):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock(width, norm, activation, dropout)
                                     for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x




def hf_llama_lora(rank: int = 4, **llama):
    """A Hugging Face Llama with peft LoRA adapters on q_proj and v_proj: only the adapters
    train (the base weights are frozen); adapters start random, not zero, so that every one
    of them gets a gradient from the first step."""
    from peft import LoraConfig, get_peft_model

    from autopar.zoo import hf_llama

    base = hf_llama(**llama).model
    lora = get_peft_model(base, LoraConfig(r=rank, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    return LogitsOnly(lora)


def hf_mixtral(experts_implementation="batched_mm", num_hidden_layers=2, hidden_size=32,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
               num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
               max_position_embeddings=16):
    """Mixtral from config. Its eager experts pick tokens with nonzero (a data-dependent shape);
    "batched_mm" gathers each token's expert weights, "grouped_mm" sorts tokens by expert."""
    return hf_causal_lm("Mixtral", num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads,
                        intermediate_size=intermediate_size, num_local_experts=num_local_experts,
                        num_experts_per_tok=num_experts_per_tok, vocab_size=vocab_size,
                        max_position_embeddings=max_position_embeddings, attention_dropout=0.0,
                        pad_token_id=None, experts_implementation=experts_implementation)


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
    dropout: float = 0.0  # on each block's attention and MLP outputs (residual dropout)


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
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.n1(x)))
        return x + self.drop(self.down(F.silu(self.up(self.n2(x)))))


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


@dataclass
class MoEConfig(TinyConfig):
    """A TinyTransformer whose MLPs are mixtures of SwiGLU experts, top-k chosen per token."""

    experts: int = 4
    top_k: int = 2
    ffn: int = 8                # inner width of every expert
    shared_expert: bool = True  # one more expert that every token goes through
    # False: a loop over the experts, each on every token, weighted by the router score (0 where
    # the token did not choose it). True: one batched matmul with the weights each token chose.
    grouped: bool = False
    # "loss": the model also returns the auxiliary load-balancing loss (see moe_loss);
    # "count": a buffer counts the tokens each expert got, updated in place while training.
    balance: str = "loss"


class SwiGLU(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w_in = nn.Linear(hidden, 2 * ffn, bias=False)  # gate and up
        self.w_out = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.w_in(x).chunk(2, -1)
        return self.w_out(F.silu(gate) * up)


class MoE(nn.Module):
    """Token-choice top-k mixture of experts: softmax router, top-k, weights renormalised."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(c.experts, c.hidden, 2 * c.ffn) / c.hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(c.experts, c.ffn, c.hidden) / c.ffn ** 0.5)
        self.shared = SwiGLU(c.hidden, c.ffn) if c.shared_expert else None
        self.register_buffer("tokens_per_expert", torch.zeros(c.experts))

    def expert(self, x, e):
        gate, up = (x @ self.w_in[e]).chunk(2, -1)
        return (F.silu(gate) * up) @ self.w_out[e]

    def forward(self, x):
        """x (..., hidden) -> (output, auxiliary load-balancing loss)."""
        c, shape = self.c, x.shape
        x = x.reshape(-1, shape[-1])                                 # (tokens, hidden)
        probs = self.router(x).softmax(-1)                           # (tokens, experts)
        weights, chosen = probs.topk(c.top_k, dim=-1)                # (tokens, top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = F.one_hot(chosen, c.experts)                        # (tokens, top_k, experts)
        if c.grouped:
            gate, up = (x[:, None, None] @ self.w_in[chosen]).squeeze(2).chunk(2, -1)
            y = ((F.silu(gate) * up)[:, :, None] @ self.w_out[chosen]).squeeze(2)
            y = (y * weights[..., None]).sum(1)
        else:
            score = (routed * weights[..., None]).sum(1)             # (tokens, experts)
            y = sum(score[:, e, None] * self.expert(x, e) for e in range(c.experts))
        if self.shared is not None:
            y = y + self.shared(x)
        counts = routed.sum((0, 1))
        if c.balance == "count" and self.training:
            self.tokens_per_expert.add_(counts)
        # Switch Transformer's loss: experts x sum over experts of (share of the routed tokens x
        # mean router probability); smallest when both are uniform.
        aux = c.experts * (counts / chosen.numel() * probs.mean(0)).sum()
        return y.reshape(shape), aux


class MoEBlock(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.n1, self.n2 = make_norm(c.norm, c.hidden), make_norm(c.norm, c.hidden)
        self.attn = TinyAttention(c)
        self.moe = MoE(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.n1(x)))
        y, aux = self.moe(self.n2(x))
        return x + self.drop(y), aux


class MoETransformer(nn.Module):
    """Embedding, `depth` MoE blocks, final norm, LM head. Returns the logits, and with
    balance="loss" also the blocks' summed load-balancing loss."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList([MoEBlock(c) for _ in range(c.depth)])
        self.norm = make_norm(c.norm, c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x, aux = self.emb(idx), 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        logits = self.head(self.norm(x))
        return (logits, aux) if self.c.balance == "loss" else logits


def moe_loss(out, targets, aux_weight=0.1):
    """The language-model loss plus the weighted load-balancing loss (for balance="loss")."""
    logits, aux = out
    return lm_loss(logits, targets) + aux_weight * aux


class ScaledLinear(nn.Module):
    """A linear layer after a bare parameter (a scale): the parameter has no
    reset_parameters() to initialize it on the meta device."""

    def __init__(self, width: int = 16, out: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.fc = nn.Linear(width, out)

    def forward(self, x):
        return self.fc(x * self.scale)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with BatchNorm, a projection
    shortcut where the shape changes, an in-place residual add and ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A ResNet in torchvision's layout at toy widths: a stem (convolution, BatchNorm, ReLU,
    max pool), stages of basic blocks (the later ones halving the resolution), global average
    pooling and a linear classifier."""

    def __init__(self, width: int = 8, blocks: tuple[int, ...] = (1, 1), classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            layers.append(nn.Sequential(*(BasicBlock(cin if j == 0 else cout, cout,
                                                     2 if i and j == 0 else 1)
                                          for j in range(n))))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ShiftedWindows(nn.Module):
    """Swin's habit: forward sets its window shift from the input's size (none when one
    window covers the whole input), a change made once for good, then shifts cyclically
    (`torch.roll`) around a per-position MLP, with a GroupNorm per sample."""

    def __init__(self, width: int = 8, window: int = 4, classes: int = 4):
        super().__init__()
        self.window, self.shift = window, window // 2
        self.mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.norm = nn.GroupNorm(2, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):  # (N, H, W, C)
        self.shift = 0 if min(x.shape[1:3]) <= self.window else self.window // 2
        h = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        h = torch.roll(self.mix(h), (self.shift, self.shift), (1, 2)) + x
        h = self.norm(h.permute(0, 3, 1, 2))
        return self.head(h.mean((2, 3)))


class TorchTransformerLM(nn.Module):
    """A language model around torch.nn.Transformer (encoder and decoder, batch first, the
    decoder causal), whose attention is nn.MultiheadAttention's own code path."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Transformer(width, heads, layers, layers, 2 * width, dropout=0.0,
                                   batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device,
                                                              dtype=h.dtype)
        return self.head(self.body(h, h, tgt_mask=mask, tgt_is_causal=True))
