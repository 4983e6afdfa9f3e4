"""Normalization layers: the normalized dimensions stay whole, leading dimensions may be sharded."""

from __future__ import annotations

import math

from .registry import SAVES_INPUTS, OpCall, R, Rule1D, Shard, aten, facts, register


def _statistics(call: OpCall, in_local, out_local, itemsize) -> float:
    """A norm keeps float32 statistics per normalized row: mean and rstd (layer norm), rstd
    (RMS norm)."""
    normalized = len(call.arg(1, "normalized_shape", ()) or ())
    rows = math.prod(in_local[0][:len(in_local[0]) - normalized])
    return rows * 4 * (2 if call.target in (aten.layer_norm.default,
                                            aten.native_layer_norm.default) else 1)


facts(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default,
      flops_per_element=20.0, saves=SAVES_INPUTS, extra_saved=_statistics, kernel="norm")
facts(aten.group_norm.default, aten.native_group_norm.default, aten.batch_norm.default,
      aten._native_batch_norm_legit_functional.default, flops_per_element=20.0,
      saves=SAVES_INPUTS, kernel="norm")


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(call: OpCall) -> list[Rule1D]:
    """layer_norm(x, normalized_shape, weight, bias, ...) and rms_norm(x, shape, weight, eps)."""
    x = call.inputs[0]
    lead = x.ndim - len(call.args[1])
    weights = tuple(R for _ in call.inputs[1:])
    rules = [Rule1D((Shard(j), *weights), Shard(j)) for j in range(lead)]
    return rules + [Rule1D((R, *weights), R)]


@register(aten.batch_norm.default)
def batch_norm(call: OpCall) -> list[Rule1D]:
    """batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, ...):
    in eval mode (training=False) each sample is normalized by the running statistics alone,
    so the batch and spatial dimensions may be sharded, and the channels (dimension 1) with
    the per-channel weight, bias and statistics sharded alike (a BatchNorm frozen for
    fine-tuning). In training mode the batch's statistics mix every sample: it runs whole
    (and one that updates running statistics runs whole on every rank anyway)."""
    per_channel = tuple(R for _ in call.inputs[1:])
    whole = Rule1D((R, *per_channel), R)
    if call.arg(5, "training", False):
        return [whole]
    rules = [Rule1D((Shard(d), *per_channel), Shard(d)) for d in range(call.inputs[0].ndim)
             if d != 1]  # (the input is (N, C, ...))
    channels = Rule1D((Shard(1), *(Shard(0) for _ in call.inputs[1:])), Shard(1))
    return rules + [channels, whole]
