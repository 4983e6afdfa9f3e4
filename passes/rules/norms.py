"""Normalization layers: the normalized dimensions stay whole, leading dimensions may be sharded."""

from __future__ import annotations

from .registry import OpCall, R, Rule1D, Shard, aten, register


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(call: OpCall) -> list[Rule1D]:
    """layer_norm(x, normalized_shape, weight, bias, ...) and rms_norm(x, shape, weight, eps)."""
    x = call.inputs[0]
    lead = x.ndim - len(call.args[1])
    weights = tuple(R for _ in call.inputs[1:])
    rules = [Rule1D((Shard(j), *weights), Shard(j)) for j in range(lead)]
    return rules + [Rule1D((R, *weights), R)]
