"""Normalization layers: the normalized dimensions stay whole, leading dimensions may be sharded."""

from __future__ import annotations

import math

import torch

from .registry import (
    SAVES_INPUTS,
    LocalContext,
    OpCall,
    R,
    Rule1D,
    Shard,
    TensorArg,
    aten,
    facts,
    lowering,
    register,
)


def _statistics(call: OpCall, in_local, out_local, itemsize) -> float:
    """A norm keeps float32 statistics per normalized row: mean and rstd (layer norm), rstd
    (RMS norm)."""
    normalized = len(call.arg(1, "normalized_shape", ()) or ())
    rows = math.prod(in_local[0][:len(in_local[0]) - normalized])
    return rows * 4 * (2 if call.target in (aten.layer_norm.default,
                                            aten.native_layer_norm.default) else 1)


facts(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default,
      flops_per_element=20.0, saves=SAVES_INPUTS, extra_saved=_statistics, kernel="norm")


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(call: OpCall) -> list[Rule1D]:
    """layer_norm(x, normalized_shape, weight, bias, ...) and rms_norm(x, shape, weight, eps)."""
    x = call.inputs[0]
    lead = x.ndim - len(call.args[1])
    weights = tuple(R for _ in call.inputs[1:])
    rules = [Rule1D((Shard(j), *weights), Shard(j)) for j in range(lead)]
    return rules + [Rule1D((R, *weights), R)]


def _statistics_dims(placements, mesh_shape) -> list[int]:
    """The mesh dimensions (of more than one rank) that split BatchNorm's input other than by
    its channels: the ranks whose statistics are combined (`sync_batch_norm`)."""
    return [k for k, p in enumerate(placements)
            if isinstance(p, Shard) and p.dim != 1 and mesh_shape[k] > 1]


def _batch_norm_exchanges(call: OpCall, inputs, mesh_shape, itemsize) -> list:
    """In training mode with the batch (or a spatial dimension) sharded: every rank's
    per-channel mean and variance all-gathered over each mesh dimension that shards them
    (`sync_batch_norm`; the gathered bytes)."""
    if not call.arg(5, "training", False):
        return []
    x = call.inputs[0]
    nbytes = 2 * x.shape[1] * max(itemsize(x.dtype), 4)  # (statistics in float32 at least)
    return [("all_gather", k, nbytes * mesh_shape[k])
            for k in _statistics_dims(inputs[0], mesh_shape)]


def _batch_norm_saved(call: OpCall, in_local, out_local, itemsize) -> float:
    """In training mode the per-channel statistics kept for backward: torch's kernel keeps
    the mean and inverse standard deviation; `sync_batch_norm` (the batch or a spatial
    dimension split over `shards` ranks) keeps every rank's gathered statistics and the
    combined mean, variance and scale."""
    if not call.arg(5, "training", False):
        return 0.0
    x = call.inputs[0]
    size = max(itemsize(x.dtype), 4)  # (statistics in float32 at least)
    shards = math.prod(g // n for d, (g, n) in enumerate(zip(x.shape, in_local[0])) if d != 1)
    return (2 if shards == 1 else shards + 3) * x.shape[1] * size


facts(aten.group_norm.default, aten.native_group_norm.default,
      aten._native_batch_norm_legit_functional.default, flops_per_element=20.0,
      saves=SAVES_INPUTS, kernel="norm")
facts(aten.batch_norm.default, flops_per_element=20.0, saves=SAVES_INPUTS, kernel="norm",
      exchanges=_batch_norm_exchanges, extra_saved=_batch_norm_saved)
facts(aten._weight_norm.default, flops_per_element=4.0, saves=SAVES_INPUTS, kernel="norm")


@register(aten.group_norm.default)
def group_norm(call: OpCall) -> list[Rule1D]:
    """group_norm(x, num_groups, weight, bias, ...): x is (N, C, ...), each sample normalized
    over its groups of channels and all its positions, so the batch may be sharded (the
    weight and bias, per channel, whole)."""
    per_channel = tuple(R for _ in call.inputs[1:])
    return [Rule1D((Shard(0), *per_channel), Shard(0)), Rule1D((R, *per_channel), R)]


@register(aten._weight_norm.default)
def weight_norm(call: OpCall) -> list[Rule1D]:
    """_weight_norm(v, g, dim): v scaled to the norm g, each slice along `dim` by its own
    norm (nn.utils.weight_norm; Wav2Vec2's positional convolution), so `dim` may be sharded
    with g; dim -1 takes one norm of all of v."""
    v, dim = call.inputs[0], call.arg(2, "dim", 0)
    rules = [Rule1D((R, R), R)]
    if dim != -1:
        d = dim % v.ndim
        rules.append(Rule1D((Shard(d), Shard(d)), Shard(d)))
    return rules


@register(aten.batch_norm.default)
def batch_norm(call: OpCall) -> list[Rule1D]:
    """batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, ...):
    x is (N, C, ...). Each sample is normalized per channel, so the batch and spatial
    dimensions may be sharded; in training mode the batch's statistics then are combined over
    the ranks that share them (`sync_batch_norm`: SyncBatchNorm's semantics, one device's
    statistics of the whole batch), with the weight, bias and running statistics whole (each
    rank updates its copy of the running statistics alike). The channels may be sharded with
    the per-channel weight, bias and statistics: in eval mode (a BatchNorm frozen for
    fine-tuning), or in training mode without running statistics to write."""
    per_channel = tuple(R for _ in call.inputs[1:])
    whole = Rule1D((R, *per_channel), R)
    rules = [Rule1D((Shard(d), *per_channel), Shard(d)) for d in range(call.inputs[0].ndim)
             if d != 1]
    channels = Rule1D((Shard(1), *(Shard(0) for _ in call.inputs[1:])), Shard(1))
    if call.arg(5, "training", False) and isinstance(call.arg(3, "running_mean"), TensorArg):
        return rules + [whole]
    return rules + [channels, whole]


def sync_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float,
                    count: int, gathers):
    """Training-mode batch norm of a shard of the batch, equal to one device's over the whole
    batch. Each rank takes its shard's per-channel mean and biased variance; each of
    `gathers` (an autograd-aware all-gather over one mesh dimension's ranks sharing the
    batch: its adjoint reduce-scatters the statistics' gradients) brings those ranks', and
    equal shards combine exactly: the mean of the means, and the mean of the variances plus
    the variance of the means. `count` samples x positions per channel in all; the
    running statistics (the unbiased variance) are updated in place as torch's batch norm
    updates them."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    var, mean = torch.var_mean(wide, dims, correction=0)
    for gather in gathers:
        ranks = gather(torch.stack([mean, var]))  # (ranks, 2, C)
        mean, var = ranks[:, 0].mean(0), ranks[:, 1].mean(0) + ranks[:, 0].var(0, correction=0)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    y = torch.addcmul(shift.view(shape), wide, scale.view(shape))
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype),
                                                 alpha=momentum)
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y.to(x.dtype)


@lowering(aten.batch_norm.default)
def lower_batch_norm(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """In training mode with the batch or a spatial dimension sharded: `sync_batch_norm`,
    its statistics gathered over those mesh dimensions."""
    dims = _statistics_dims(ctx.in_placements[0], ctx.mesh_shape)
    if not call.arg(5, "training", False) or not dims:
        return call.target, args, kwargs
    x = call.inputs[0]
    count = math.prod(x.shape) // x.shape[1]
    comm = ctx.comm
    gathers = [lambda stats, k=k: comm.all_gather(stats.unsqueeze(0), 0, k) for k in dims]

    def local(x, weight=None, bias=None, running_mean=None, running_var=None, *_, **__):
        return sync_batch_norm(x, weight, bias, running_mean, running_var,
                               float(call.arg(6, "momentum", 0.1)),
                               float(call.arg(7, "eps", 1e-5)), count, gathers)

    local.__name__ = "sync_batch_norm"
    local.writes_args = (3, 4)  # the running statistics (passes/graph_queries.py state_writes)
    return local, tuple(args[:5]), {}
