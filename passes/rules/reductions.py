"""Reductions and softmax.

Reducing over a sharded dimension leaves each rank a pending sum (for a mean, each rank's mean is
scaled by its share of the elements). Max-like reductions have no pending form here and need the
reduced dimension whole. Softmax and top-k need their own dimension whole; other dimensions may be
sharded.
"""

from __future__ import annotations

import torch

from .registry import (
    SAVES_INPUTS,
    SAVES_NOTHING,
    SAVES_OUTPUT,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    aten,
    facts,
    lowering,
    norm_dim,
    register,
)


def _reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    x = call.inputs[0]
    dims = call.arg(1, "dim", None)
    if call.target in (aten.sum.default, aten.mean.default) or dims is None or dims == []:
        return list(range(x.ndim)), False
    if isinstance(dims, int):
        dims = [dims]
    return sorted(norm_dim(d, x.ndim) for d in dims), bool(call.arg(2, "keepdim", False))


def _reduction_rules(call: OpCall, linear: bool, reduced_dims=None) -> list[Rule1D]:
    x = call.inputs[0]
    reduced, keepdim = reduced_dims or _reduced_dims(call)
    rules = []
    kept = 0
    for j in range(x.ndim):
        if j in reduced:
            if linear:
                rules.append(Rule1D((Shard(j),), P))
            if keepdim:
                kept += 1
            continue
        rules.append(Rule1D((Shard(j),), Shard(kept)))
        kept += 1
    rules.append(Rule1D((R,), R))
    if linear:
        rules.append(Rule1D((P,), P))
    return rules


facts(aten.mean.dim, aten.mean.default, aten.any.dim, aten.all.dim, aten.argmax.default,
      aten.argmin.default, aten.cumsum.default, saves=SAVES_NOTHING)
facts(aten.sum.dim_IntList, aten.sum.default, saves=SAVES_NOTHING,
      grad_passes=(0,))  # a sum's gradient: the output's, expanded (a view)
facts(aten.amax.default, aten.amin.default, aten.prod.dim_int, saves=SAVES_INPUTS,
      saves_output=True)
facts(aten.var.correction, aten.std.correction, saves=SAVES_INPUTS)
facts(aten.logsumexp.default, saves=SAVES_INPUTS, saves_output=True, flops_per_element=20.0)
facts(aten.linalg_vector_norm.default, saves=SAVES_INPUTS, saves_output=True)
facts(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
      aten.log_softmax.int, saves=SAVES_OUTPUT, flops_per_element=20.0)


@register(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
def sum_mean(call: OpCall) -> list[Rule1D]:
    """sum/mean: a sharded reduced dimension gives a pending sum."""
    return _reduction_rules(call, linear=True)


@register(aten.amax.default, aten.amin.default, aten.any.dim, aten.all.dim, aten.argmax.default,
          aten.argmin.default, aten.prod.dim_int, aten.var.correction, aten.std.correction,
          aten.logsumexp.default)
def other_reduction(call: OpCall) -> list[Rule1D]:
    """Non-linear reductions: only dimensions that are not reduced may be sharded."""
    return _reduction_rules(call, linear=False)


@register(aten.linalg_vector_norm.default)
def vector_norm(call: OpCall) -> list[Rule1D]:
    """A vector norm (`F.normalize`, `x.norm(dim=-1)`): only dimensions it does not reduce
    may be sharded (a norm of pieces is no sum of the pieces' norms)."""
    x = call.inputs[0]
    dims = call.arg(2, "dim", None)
    if dims is None or dims == []:
        reduced = list(range(x.ndim))
    else:
        reduced = sorted(norm_dim(d, x.ndim) for d in ([dims] if isinstance(dims, int) else dims))
    return _reduction_rules(call, linear=False,
                            reduced_dims=(reduced, bool(call.arg(3, "keepdim", False))))


def _scaled_mean(x, dims, keepdim, scale, dtype=None):
    return torch.ops.aten.mean.dim(x, dims, keepdim, dtype=dtype) * scale


@lowering(aten.mean.dim, aten.mean.default)
def lower_mean(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Each rank's mean counts for its share: scale by 1 / (number of pieces reduced over)."""
    x = call.inputs[0]
    reduced, keepdim = _reduced_dims(call)
    pieces = 1
    for k, p in enumerate(ctx.in_placements[0]):
        if isinstance(p, Shard) and norm_dim(p.dim, x.ndim) in reduced:
            pieces *= ctx.mesh_shape[k]
    if pieces == 1:
        return call.target, args, kwargs
    return _scaled_mean, (args[0], reduced, keepdim, 1.0 / pieces, kwargs.get("dtype")), {}


@register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
          aten.log_softmax.int, aten.cumsum.default)
def softmax(call: OpCall) -> list[Rule1D]:
    """Softmax along one dimension: that dimension whole, the others free."""
    x = call.inputs[0]
    dim = norm_dim(call.args[1], x.ndim)
    rules = [Rule1D((Shard(j),), Shard(j)) for j in range(x.ndim) if j != dim]
    return rules + [Rule1D((R,), R)]


@register(aten.topk.default)
def topk(call: OpCall) -> list[Rule1D]:
    """topk(x, k, dim=-1, largest, sorted) -> (values, indices): each row along `dim` is chosen
    from whole, so that dimension is whole; the others are free."""
    x = call.inputs[0]
    dim = norm_dim(call.arg(2, "dim", -1), x.ndim) if x.ndim else 0
    rules = [Rule1D((Shard(j),), (Shard(j), Shard(j))) for j in range(x.ndim) if j != dim]
    return rules + [Rule1D((R,), (R, R))]
