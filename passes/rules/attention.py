"""Scaled dot-product attention: split by batch, by heads (Megatron attention), or by query
positions (keys and values whole; a causal mask is then offset to the rank's rows).

With dropout (dropout_p > 0) the single-device op draws one mask of the whole (B, H, L, S)
attention weights. A rank that runs the op on its block would draw a mask of the block's shape,
not the block of that mask, so a sharded strategy runs the math kernel on its block with the
dropout drawn whole and sliced (`attention_math_block`); the replicated strategy runs the
unchanged op. In the counter mode of randomness every strategy runs the math kernel with the
mask of its block computed from the op's key (`counter_attention_block`).
"""

from __future__ import annotations

import math

import torch

from ..placement import local_slices
from .random import REPLAYS, counter_dropout_block, draw_mask, drawn_dtype, dropout_block
from .registry import LocalContext, OpCall, R, Rule1D, Shard, aten, facts, lowering, register


@register(aten.scaled_dot_product_attention.default)
def sdpa(call: OpCall) -> list[Rule1D]:
    """q (B, H, L, E), k/v (B, Hkv, S, E), optional mask broadcastable to (B, H, L, S)."""
    q = call.inputs[0]
    if q.ndim != 4 or any(t.ndim != 4 for t in call.inputs[1:3]):
        return [Rule1D(tuple(R for _ in call.inputs), R)]
    mask = call.inputs[3] if len(call.inputs) > 3 else None

    def with_mask(qkv, dim_of_out):
        if mask is None:
            return qkv
        j = dim_of_out - (4 - mask.ndim)
        m = Shard(j) if j >= 0 and mask.shape[j] == q.shape[dim_of_out] else R
        return (*qkv, m)

    rules = [
        Rule1D(with_mask((Shard(0),) * 3, 0), Shard(0)),
        Rule1D(with_mask((Shard(1),) * 3, 1), Shard(1)),
        Rule1D(with_mask((Shard(2), R, R), 2), Shard(2)),
        Rule1D(tuple(R for _ in call.inputs), R),
    ]
    return rules


def _dropout_p(call: OpCall) -> float:
    """SDPA's dropout probability (0.0 when absent)."""
    return float(call.arg(4, "dropout_p", 0.0) or 0.0)


def dropout_weights(call: OpCall) -> int:
    """Elements of the attention weights (B, H, L, S) the dropout mask is drawn for, whole on
    every rank whatever the strategy (0 without dropout)."""
    if _dropout_p(call) <= 0:
        return 0
    q, k = call.inputs[0], call.inputs[1]
    return math.prod(q.shape[:-1]) * k.shape[-2]


def attention_flops(q: tuple, k: tuple, v: tuple | None = None, causal: bool = False) -> float:
    """Forward flops of attention on (..., L, E) queries and (..., S, E) keys / (..., S, Ev)
    values: QK^T (2 L S E per batch and head) and PV (2 L S Ev); a causal mask halves both
    (the kernels skip the masked blocks)."""
    heads = math.prod(q[:-2])
    L, E = q[-2], q[-1]
    S = k[-2]
    Ev = v[-1] if v is not None else E
    return 2.0 * heads * L * S * (E + Ev) * (0.5 if causal else 1.0)


def is_causal(call: OpCall) -> bool:
    """Whether an SDPA call masks causally (its kernels skip the masked half)."""
    return bool(call.arg(5, "is_causal", False))


def _flops(call: OpCall, in_local, out_local) -> float:
    return attention_flops(in_local[0], in_local[1], in_local[2], is_causal(call))


def _saved_slots(call: OpCall) -> tuple[int, ...]:
    """q, k, v and a float mask (a boolean one is kept as the float mask SDPA makes of it:
    `_extra_saved`)."""
    return tuple(i for i in range(len(call.inputs))
                 if not (i == 3 and call.inputs[i].dtype == torch.bool))


def _extra_saved(call: OpCall, in_local, out_local, itemsize) -> float:
    """The log-sum-exp (float32 per query row), the additive mask SDPA makes of a boolean one
    (the query's dtype, at the mask's full broadcast shape) and, with dropout, the attention
    weights, the mask and their product of the rank's block (the math kernel's, in float32 at
    least; the fused GPU kernels keep only the log-sum-exp, so this overestimates the
    replicated strategy on GPUs)."""
    kept = math.prod(in_local[0][:-1]) * 4
    dtype = call.inputs[0].dtype
    if len(in_local) > 3 and call.inputs[3].dtype == torch.bool:
        kept += math.prod(in_local[3]) * itemsize(dtype)
    if dropout_weights(call):
        weights = math.prod(out_local[0][:-1]) * in_local[1][-2]
        kept += 3 * weights * max(4, itemsize(dtype))
    return kept


facts(aten.scaled_dot_product_attention.default, flops=_flops, backward_factor=2.0,
      saves=_saved_slots, saves_output=True, extra_saved=_extra_saved, draws=dropout_weights,
      kernel="attention")


def _sdpa_rows(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, row_offset):
    """Attention for the query rows starting at `row_offset` of the full sequence."""
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        causal = causal.tril(diagonal=row_offset)
        mask = causal if mask is None else mask & causal
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, **kwargs)


def attention_math_block(q, k, v, mask, dropout_p: float, is_causal: bool, scale,
                         enable_gqa: bool, weights: tuple[int, ...],
                         block: tuple[tuple[int, int], ...], shift=None) -> torch.Tensor:
    """SDPA with dropout on this rank's block `block` ((start, length) per dimension) of the
    attention weights, whose whole shape is `weights` (B, H, L, S).

    Computed step for step as ATen's math kernel (`_scaled_dot_product_attention_math`, what
    SDPA runs on a CPU when dropout_p > 0) computes it, except that the dropout mask is the
    block of one drawn for the whole weights, as the single-device kernel draws it
    (`aten.dropout` of the contiguous weights). On a CPU the result is the block of the
    single-device result (tests/test_rules.py checks it against the op bit for bit). Under
    gradient accumulation `weights` are the whole batch's and `shift` moves the block to the
    running microbatch's rows (passes/rules/random.py)."""
    contiguous = tuple(math.prod(weights[i + 1:]) for i in range(len(weights)))
    return _math_attention(q, k, v, mask, is_causal, scale, enable_gqa, block[2][0],
                           lambda a: dropout_block(a, dropout_p, weights, contiguous, block,
                                                   shift))


def counter_attention_block(q, k, v, mask, dropout_p: float, is_causal: bool, scale,
                            enable_gqa: bool, name: str, weights: tuple[int, ...],
                            block: tuple[tuple[int, int], ...], shift=None) -> torch.Tensor:
    """`attention_math_block` in the counter mode of randomness: the dropout mask of the
    rank's block of the weights is computed from the key of op `name` this step
    (passes/rules/random.py), whatever the strategy, replicated included."""
    return _math_attention(q, k, v, mask, is_causal, scale, enable_gqa, block[2][0],
                           lambda a: counter_dropout_block(a, dropout_p, name, weights, block,
                                                           shift))


def _math_attention(q, k, v, mask, is_causal: bool, scale, enable_gqa: bool, first_row: int,
                    drop) -> torch.Tensor:
    """ATen's math kernel on a block of queries whose first row is `first_row` of the whole
    sequence, with `drop(weights)` as the dropout of the attention weights."""
    origin = q.dtype
    if mask is not None and mask.dtype == torch.bool:  # additive, in the input's dtype
        mask = _additive(mask, origin)
    if origin in (torch.float16, torch.bfloat16):  # the kernel computes in float32
        q, k, v = q.float(), k.float(), v.float()
    negative = scale is not None and scale < 0
    root = math.sqrt(abs(scale) if negative else
                     scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    q = q * (0.0 - root if negative else root)
    if is_causal:  # the rows of the whole causal mask this block holds
        rows = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        mask = _additive(rows.tril(diagonal=first_row), q.dtype)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * root)
    if mask is not None:
        attn = attn + mask
    attn = drop(aten._safe_softmax(attn, -1))
    return torch.matmul(attn, v).to(origin)


def _replay_attention(node: torch.fx.Node, device: torch.device) -> None:
    """Draw what an `attention_math_block` node draws (random.py `replay`): the mask of the
    whole contiguous weights, in float32 for half-precision inputs as the kernel computes."""
    p, weights = node.args[4], node.args[8]
    dtype = drawn_dtype(node)
    dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    draw_mask(dtype, device, p, weights,
              tuple(math.prod(weights[i + 1:]) for i in range(len(weights))))


REPLAYS[attention_math_block] = _replay_attention


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA adds it to the scores: 0 where True, -inf where False."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), -math.inf, dtype=dtype, device=mask.device))


@lowering(aten.scaled_dot_product_attention.default)
def lower_sdpa(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Query-sharded causal attention: the causal mask starts at the rank's first row. With
    dropout and a sharded strategy: the math kernel with the whole draw's block."""
    is_causal = bool(call.arg(5, "is_causal", False))
    p = _dropout_p(call)
    q_place = ctx.in_placements[0]
    q = call.inputs[0]

    def get(i, name, default):
        return args[i] if i < len(args) else kwargs.get(name, default)

    if p > 0 and q.ndim == 4:
        B, H, L, _ = q.shape
        S = call.inputs[1].shape[-2]
        block = tuple(local_slices((B, H, L, S), ctx.out_placements, ctx.mesh_shape,
                                   ctx.coords))
        weights, shift = (B, H, L, S), None
        if ctx.microbatches is not None:  # the whole batch's weights, this microbatch's rows
            d, m = ctx.microbatches  # (of the output (B, H, L, E): the weights' first three)
            weights = tuple(n * m if k == d else n for k, n in enumerate(weights))
            shift = (d, (B, H, L)[d])
        if ctx.randomness == "counter":
            return counter_attention_block, (
                args[0], args[1], args[2], get(3, "attn_mask", None), p, is_causal,
                get(6, "scale", None), get(7, "enable_gqa", False), call.name, weights, block,
                shift), {}
        if shift or any(length != size for (_, length), size in zip(block, (B, H, L, S))):
            return attention_math_block, (
                args[0], args[1], args[2], get(3, "attn_mask", None), p, is_causal,
                get(6, "scale", None), get(7, "enable_gqa", False), weights, block, shift), {}
    if not is_causal or not any(isinstance(p, Shard) and p.dim == 2 for p in q_place):
        return call.target, args, kwargs
    row_start, _ = local_slices(q.shape, q_place, ctx.mesh_shape, ctx.coords)[2]
    return _sdpa_rows, (args[0], args[1], args[2], get(3, "attn_mask", None),
                        get(4, "dropout_p", 0.0), True, get(6, "scale", None),
                        get(7, "enable_gqa", False), row_start), {}
