"""Convolutions, pooling and resampling: the vision family.

A convolution's input is (N, C_in, *spatial) (or unbatched (C_in, *spatial)) and its weight
(C_out, C_in / groups, *kernel); a transposed one's weight is (C_in, C_out / groups, *kernel).
Each sample is convolved alone, so the batch may be sharded with the weight whole (data
parallel); each output channel is a filter of its own, so the output channels may be sharded
with the weight's (and bias's) filters (tensor parallel); and without groups the input
channels may be sharded with the weight's, each rank's output a pending sum (no bias: it would
be added once per rank). A grouped convolution shards channels only where each shard holds
whole groups, which holds for every split of a depthwise one (one input channel per group):
the local op then runs groups / shards groups.

A spatial dimension may be sharded too (spatial parallelism, for images larger than the batch
is wide): each rank computes the output rows of its own input rows, which needs the kernel's
overlap from its neighbours, a halo (`passes/rules/halo.py`): the rows before and after its
shard, exchanged in forward and their gradients sent back in backward. That holds where the
output has one row per `stride` input rows (padding "same"-like, the shard a multiple of the
stride), as in ResNet's convolutions and its max pool; the other spatial dimensions keep
their padding. Priced by the halo's bytes (`OpFacts.exchanges`).

Pooling, adaptive pooling and upsampling work on each (sample, channel) plane alone: every
dimension before the spatial ones may be sharded; a max pool also spatially with its halo,
a nearest upsampling by whole factors spatially without one (each shard of rows makes its
own block of output rows), and an average pool to one position from each rank's partial
mean (a pending sum).
"""

from __future__ import annotations

import math

from . import halo
from .registry import (
    SAVES_INPUTS,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    aten,
    facts,
    lowering,
    register,
)

_CONV = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
         aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)
_TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input,
               aten.conv_transpose3d.input)
_GENERIC = (aten.convolution.default,)


def _transposed(call: OpCall) -> bool:
    if call.target in _TRANSPOSED:
        return True
    return call.target in _GENERIC and bool(call.arg(6, "transposed", False))


def _groups_slot(call: OpCall) -> int:
    """Where the overload keeps `groups` among its arguments."""
    return 8 if call.target in _GENERIC else 6


def _groups(call: OpCall) -> int:
    return int(call.arg(_groups_slot(call), "groups", 1))


def _has_bias(call: OpCall) -> bool:
    return len(call.inputs) > 2


def _conv_flops(call: OpCall, in_local, out_local) -> float:
    """2 x output elements x (input channels per group x kernel elements) for a convolution;
    a transposed one does the same products scattered (2 x input elements x output channels
    per group x kernel elements)."""
    weight = in_local[1]
    kernel = math.prod(weight[2:])
    if _transposed(call):
        return 2.0 * math.prod(in_local[0]) * weight[1] * kernel
    return 2.0 * math.prod(out_local[0]) * weight[1] * kernel


def _first_spatial(call: OpCall) -> int:
    """A convolution input's first spatial dimension: (N, C, *spatial) against the weight's
    (C_out, C_in/g, *kernel), or unbatched (C, *spatial)."""
    return 2 if call.inputs[0].ndim == call.inputs[1].ndim else 1


def _conv_geometry(call: OpCall) -> dict[int, halo.Window]:
    """The spatial dimensions of a (non-transposed, numerically padded) convolution whose
    output has one row per stride input rows, each with its window (`halo.Window`)."""
    if _transposed(call) or call.target not in (*_CONV[:3], *_GENERIC):
        return {}
    x, w = call.inputs[0], call.inputs[1]
    return halo.windows(x.shape, call.out_shapes[0], _first_spatial(call), list(w.shape[2:]),
                        call.arg(3, "stride", 1), call.arg(4, "padding", 0),
                        call.arg(5, "dilation", 1))


def _conv_exchanges(call: OpCall, inputs, mesh_shape, itemsize) -> list:
    """A spatially sharded convolution's halo, gathered over the mesh dimensions that shard
    its spatial dimensions."""
    return halo.exchanges(_conv_geometry(call), call.inputs[0], inputs[0], mesh_shape, itemsize)


def _conv_halo_saved(call: OpCall, in_local, out_local, itemsize) -> float:
    return halo.saved_bytes(_conv_geometry(call), call.inputs[0], in_local[0], itemsize)


facts(*_CONV, *_TRANSPOSED, *_GENERIC, flops=_conv_flops, backward_factor=2.0,
      saves=SAVES_INPUTS, kernel="conv", exchanges=_conv_exchanges,
      extra_saved=_conv_halo_saved)


@register(*_CONV, *_TRANSPOSED, *_GENERIC)
def convolution(call: OpCall) -> list[Rule1D]:
    """Batch, output channels (with the weight's filters) and, ungrouped and without a bias,
    input channels (a pending sum); grouped: channels only for a depthwise convolution."""
    x, w = call.inputs[0], call.inputs[1]
    batched = x.ndim == w.ndim  # (N, C, *spatial) against (C_out, C_in/g, *kernel)
    c = 1 if batched else 0  # the channel dimension of input and output
    bias = _has_bias(call)
    groups = _groups(call)
    transposed = _transposed(call)
    whole = (R,) * len(call.inputs)
    rules = []
    if batched:
        rules.append(Rule1D((Shard(0),) + whole[1:], Shard(0)))
    # the weight's output-channel and input-channel dimensions
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    if groups == 1:
        rules.append(Rule1D((R, Shard(out_dim)) + ((Shard(0),) if bias else ()), Shard(c)))
        if not bias:
            rules.append(Rule1D((Shard(c), Shard(in_dim)), P))
    elif not transposed and groups == x.shape[c]:  # depthwise: each shard whole groups
        rules.append(Rule1D((Shard(c), Shard(0)) + ((Shard(0),) if bias else ()), Shard(c)))
    rules += [Rule1D((Shard(d),) + whole[1:], Shard(d)) for d in _conv_geometry(call)]
    return rules + [Rule1D(whole, R)]


@lowering(*_CONV, *_GENERIC)
def lower_convolution(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """A depthwise convolution with its channels sharded runs its local groups; with spatial
    dimensions sharded, on its shard extended by the halo, unpadded along them."""
    groups = _groups(call)
    shards = math.prod(n for n, p in zip(ctx.mesh_shape, ctx.in_placements[1])
                       if isinstance(p, Shard) and p.dim == 0)
    if groups > 1 and shards > 1:
        slot = _groups_slot(call)
        args = list(args)
        if slot < len(args):
            args[slot] = groups // shards
        else:
            kwargs = {**kwargs, "groups": groups // shards}
        args = tuple(args)
    windows = halo.sharded(_conv_geometry(call), ctx)
    if not windows:
        return call.target, args, kwargs
    return halo.lowered(call.target, args, kwargs, 4, _first_spatial(call), windows, ctx, 0.0)


# -- pooling and resampling: each (sample, channel) plane alone --------------------------------

_SPATIAL = {
    **dict.fromkeys((aten.max_pool1d.default, aten.avg_pool1d.default,
                     aten.adaptive_avg_pool1d.default, aten.adaptive_max_pool1d.default,
                     aten.upsample_nearest1d.vec, aten.upsample_linear1d.vec), 1),
    **dict.fromkeys((aten.max_pool2d.default, aten.max_pool2d_with_indices.default,
                     aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
                     aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool2d.default,
                     aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.vec,
                     aten.upsample_bicubic2d.vec), 2),
    **dict.fromkeys((aten.max_pool3d.default, aten.max_pool3d_with_indices.default,
                     aten.avg_pool3d.default, aten.adaptive_avg_pool3d.default,
                     aten._adaptive_avg_pool3d.default, aten.adaptive_max_pool3d.default,
                     aten.upsample_nearest3d.vec, aten.upsample_trilinear3d.vec), 3),
}


def _window(call: OpCall, in_local, out_local) -> float:
    """One add or compare per window element per output (the adaptive and resampling ops:
    a few per output)."""
    name = str(call.target)
    kernel = call.arg(1, "kernel_size", None)
    if "pool" in name and "adaptive" not in name and isinstance(kernel, (list, tuple)) and kernel:
        size = math.prod(kernel) if len(kernel) > 1 else kernel[0] ** _SPATIAL[call.target]
    else:
        size = 4
    return float(size) * math.prod(out_local[0])


_MAX_POOL = (aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default)
_MEAN_TO_ONE = (aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
                aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default,
                aten._adaptive_avg_pool3d.default)


def _pool_geometry(call: OpCall) -> dict[int, halo.Window]:
    """A max pool's spatial dimensions with one output row per stride input rows, and their
    halos: max_pool(x, kernel_size, stride, padding, dilation, ceil_mode)."""
    x = call.inputs[0]
    if call.target not in _MAX_POOL or not x.dtype.is_floating_point:  # (-inf past the edges)
        return {}
    return halo.windows(x.shape, call.out_shapes[0], x.ndim - _SPATIAL[call.target],
                        call.arg(1, "kernel_size"), call.arg(2, "stride", []),
                        call.arg(3, "padding", 0), call.arg(4, "dilation", 1))


def _pool_exchanges(call: OpCall, inputs, mesh_shape, itemsize) -> list:
    return halo.exchanges(_pool_geometry(call), call.inputs[0], inputs[0], mesh_shape, itemsize)


_NEAREST = (aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec,
            aten.upsample_nearest3d.vec)


def _repeated_rows(call: OpCall) -> list[int]:
    """The spatial dimensions a nearest upsampling repeats each input row of a whole number
    of times: output row i is input row i // s, so each shard of rows makes its own block of
    output rows (no halo)."""
    if call.target not in _NEAREST:
        return []
    x, out = call.inputs[0], call.out_shapes[0]
    scales = call.arg(2, "scale_factors", None)
    dims = range(x.ndim - _SPATIAL[call.target], x.ndim)
    return [d for k, d in enumerate(dims) if out[d] % x.shape[d] == 0 and
            (scales is None or float(scales[k]) == out[d] // x.shape[d])]


def _to_one(call: OpCall) -> list[int]:
    """The spatial dimensions an adaptive average pool reduces to one position."""
    if call.target not in _MEAN_TO_ONE:
        return []
    x, out = call.inputs[0], call.out_shapes[0]
    return [d for d in range(x.ndim - _SPATIAL[call.target], x.ndim) if out[d] == 1]


def _pool_saved(call: OpCall, in_local, out_local, itemsize) -> float:
    """A max pool keeps the int64 indices of its maxima for backward, and with a spatial
    dimension split, its shard extended by the halo."""
    indices = math.prod(out_local[0]) * 8
    return indices + halo.saved_bytes(_pool_geometry(call), call.inputs[0], in_local[0],
                                      itemsize)


facts(*(op for op in _SPATIAL if op not in _MAX_POOL), flops=_window, saves=SAVES_INPUTS,
      saves_output=True)
facts(*_MAX_POOL, flops=_window, saves=SAVES_INPUTS, saves_output=True,
      exchanges=_pool_exchanges, extra_saved=_pool_saved)


@register(*_SPATIAL)
def planewise(call: OpCall) -> list[Rule1D]:
    """Any dimension before the spatial ones, with the output (and a max pool's indices); a
    max pool's spatial dimensions with their halo; an average pool's dimensions it reduces
    to one position into a pending sum (each rank's mean of its rows, scaled by its share)."""
    x = call.inputs[0]
    lead = x.ndim - _SPATIAL[call.target]
    rest = (R,) * (len(call.inputs) - 1)
    rules = []
    for d in range(lead):
        out = (Shard(d), Shard(d)) if call.multi_output else Shard(d)
        rules.append(Rule1D((Shard(d),) + rest, out))
    rules += [Rule1D((Shard(d),) + rest, Shard(d))
              for d in [*_pool_geometry(call), *_repeated_rows(call)]]
    rules += [Rule1D((Shard(d),) + rest, P) for d in _to_one(call)]
    whole = (R, R) if call.multi_output else R
    return rules + [Rule1D((R,) * len(call.inputs), whole)]


@lowering(*_MAX_POOL, *_MEAN_TO_ONE, *_NEAREST)
def lower_spatial(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """A max pool on its shard extended by the halo (-inf past the edges, as its padding); an
    average pool over sharded positions: the local mean over the shards' count; a nearest
    upsampling to a given size: to the size of this rank's block."""
    if call.target in _NEAREST:
        size = call.arg(1, "output_size", None)
        if size is None:  # by scale factors: the local op scales the local rows alike
            return call.target, args, kwargs
        local = list(ctx.local_out_shapes[0][-len(size):])
        args = list(args)
        if len(args) > 1:
            args[1] = local
        else:
            kwargs = {**kwargs, "output_size": local}
        return call.target, tuple(args), kwargs
    if call.target in _MEAN_TO_ONE:
        shards = math.prod(n for n, p in zip(ctx.mesh_shape, ctx.in_placements[0])
                           if isinstance(p, Shard) and p.dim in _to_one(call))
        if shards == 1:
            return call.target, args, kwargs

        def partial_mean(*a, **kw):
            return call.target(*a, **kw) / shards

        return partial_mean, args, kwargs
    windows = halo.sharded(_pool_geometry(call), ctx)
    if not windows:
        return call.target, args, kwargs
    first = call.inputs[0].ndim - _SPATIAL[call.target]
    return halo.lowered(call.target, args, kwargs, 3, first, windows, ctx, float("-inf"))
