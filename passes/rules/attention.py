"""Scaled dot-product attention: split by batch, by heads (Megatron attention), or by query
positions (keys and values whole; a causal mask is then offset to the rank's rows)."""

from __future__ import annotations

import torch

from ..placement import local_slices
from .registry import LocalContext, OpCall, R, Rule1D, Shard, aten, lowering, register


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


def _sdpa_rows(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, row_offset):
    """Attention for the query rows starting at `row_offset` of the full sequence."""
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        causal = causal.tril(diagonal=row_offset)
        mask = causal if mask is None else mask & causal
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, **kwargs)


@lowering(aten.scaled_dot_product_attention.default)
def lower_sdpa(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Query-sharded causal attention: the causal mask starts at the rank's first row."""
    is_causal = bool(call.arg(5, "is_causal", False))
    q_place = ctx.in_placements[0]
    if not is_causal or not any(isinstance(p, Shard) and p.dim == 2 for p in q_place):
        return call.target, args, kwargs
    start, _ = local_slices(call.inputs[0].shape, q_place, ctx.mesh_shape, ctx.coords)[2]

    def get(i, name, default):
        return args[i] if i < len(args) else kwargs.get(name, default)

    return _sdpa_rows, (args[0], args[1], args[2], get(3, "attn_mask", None),
                        get(4, "dropout_p", 0.0), True, get(6, "scale", None),
                        get(7, "enable_gqa", False), start), {}
