"""Matrix products: linear, addmm, mm, bmm, baddbmm, matmul.

On one mesh dimension a product x @ w can be split four ways: by the rows of x (data or sequence
parallel), by the columns of w (Megatron column parallel), by the contracted dimension (row
parallel: each rank holds a pending sum), or not at all. A bias is added once: under a pending
sum only the rank at coordinate 0 adds it.
"""

from __future__ import annotations

import torch

from .registry import (
    SAVES_OPERANDS,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    aten,
    dedupe,
    facts,
    lowering,
    register,
)

# Products: 2 x output x inner flops; backward computes one product per operand needing a
# gradient and keeps each operand whose partner needs one.
facts(aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
      product=(0, 1), backward_factor=2.0, saves=SAVES_OPERANDS)
facts(aten.addmm.default, aten.baddbmm.default, product=(1, 2), backward_factor=2.0,
      saves=SAVES_OPERANDS)


def _has_partial_output(ctx: LocalContext) -> bool:
    """The output is a pending sum on some mesh dimension."""
    return any(isinstance(p, type(P)) for p in ctx.out_placements)


def _bias_keep(ctx: LocalContext) -> float:
    """1 on the rank that adds the bias (coordinate 0 of every pending-sum dimension), else 0."""
    return float(all(ctx.coords[k] == 0 for k, p in enumerate(ctx.out_placements)
                     if isinstance(p, type(P))))


@register(aten.linear.default)
def linear(call: OpCall) -> list[Rule1D]:
    """y = x @ w.T + b with x (..., K), w (N, K), b (N)."""
    x = call.inputs[0]
    has_bias = len(call.inputs) == 3
    b = (R,) if has_bias else ()
    rules = []
    for d in range(x.ndim - 1):  # batch-like dimensions of x
        rules.append(Rule1D((Shard(d), R, *b), Shard(d)))
    rules.append(Rule1D((R, Shard(0), *((Shard(0),) if has_bias else ())), Shard(x.ndim - 1)))
    rules.append(Rule1D((Shard(x.ndim - 1), Shard(1), *b), P))
    rules.append(Rule1D((P, R, *b), P))
    rules.append(Rule1D((R, R, *b), R))
    return rules


@register(aten.addmm.default)
def addmm(call: OpCall) -> list[Rule1D]:
    """y = b + x @ w with b (N) or (M, N), x (M, K), w (K, N)."""
    b = call.inputs[0]
    b_rows = Shard(0) if b.ndim == 2 else R
    b_cols = Shard(b.ndim - 1)
    return [
        Rule1D((b_rows, Shard(0), R), Shard(0)),
        Rule1D((b_cols, R, Shard(1)), Shard(1)),
        Rule1D((R, Shard(1), Shard(0)), P),
        Rule1D((R, P, R), P),
        Rule1D((R, R, R), R),
    ]


@register(aten.mm.default)
def mm(call: OpCall) -> list[Rule1D]:
    """y = a @ b with a (M, K), b (K, N)."""
    return [
        Rule1D((Shard(0), R), Shard(0)),
        Rule1D((R, Shard(1)), Shard(1)),
        Rule1D((Shard(1), Shard(0)), P),
        Rule1D((P, R), P),
        Rule1D((R, P), P),
        Rule1D((R, R), R),
    ]


@register(aten.bmm.default, aten.matmul.default)
def batched(call: OpCall) -> list[Rule1D]:
    """Batched product with broadcast batch dimensions: a (..., M, K), b (..., K, N)."""
    a, b = call.inputs
    n = call.out_ndim
    # A vector operand has no batch dimensions and contributes no output dimension (matmul
    # drops its M or N), so the output is (*batch, M if a.ndim >= 2, N if b.ndim >= 2).
    a_batch, b_batch = max(a.ndim - 2, 0), max(b.ndim - 2, 0)
    nb = max(a_batch, b_batch)
    rules = []
    for d in range(nb):  # batch dimensions, aligned from the right
        ja, jb = d - (nb - a_batch), d - (nb - b_batch)
        pa = Shard(ja) if ja >= 0 and a.shape[ja] == call.out_shape[d] else R
        pb = Shard(jb) if jb >= 0 and b.shape[jb] == call.out_shape[d] else R
        rules.append(Rule1D((pa, pb), Shard(d)))
    if a.ndim >= 2:
        rules.append(Rule1D((Shard(a.ndim - 2), R), Shard(nb)))
        if b.ndim >= 2:
            rules.append(Rule1D((Shard(a.ndim - 1), Shard(b.ndim - 2)), P))
    if b.ndim >= 2:
        rules.append(Rule1D((R, Shard(b.ndim - 1)), Shard(n - 1)))
    rules += [Rule1D((P, R), P), Rule1D((R, P), P), Rule1D((R, R), R)]
    return dedupe(rules)


@register(aten.baddbmm.default)
def baddbmm(call: OpCall) -> list[Rule1D]:
    """y = beta * c + alpha * (a @ b) with a (B, M, K), b (B, K, N) and c broadcast to
    (B, M, N) (Bloom's attention scores: ALiBi biases plus the scaled q @ k). Each output
    dimension splits a, b and c alike (c replicated where it broadcasts that dimension); the
    contracted dimension leaves a pending sum that adds c once."""
    c = call.inputs[0]
    out = call.out_shape

    def c_at(d: int):  # c's placement when output dimension d is split
        j = d - (len(out) - c.ndim)
        return Shard(j) if j >= 0 and c.shape[j] == out[d] else R

    return dedupe([
        Rule1D((c_at(0), Shard(0), Shard(0)), Shard(0)),
        Rule1D((c_at(1), Shard(1), R), Shard(1)),
        Rule1D((c_at(2), R, Shard(2)), Shard(2)),
        Rule1D((R, Shard(2), Shard(1)), P),
        Rule1D((R, P, R), P),
        Rule1D((R, R, P), P),
        Rule1D((R, R, R), R),
    ])


def _linear_bias_scaled(x, w, b, keep: float):
    return torch.ops.aten.linear.default(x, w, b * keep)


def _addmm_bias_scaled(b, x, w, keep: float, *, beta=1, alpha=1):
    return torch.ops.aten.addmm.default(b * keep, x, w, beta=beta, alpha=alpha)


def _baddbmm_scaled(c, a, b, keep: float, *, beta=1, alpha=1):
    return torch.ops.aten.baddbmm.default(c * keep, a, b, beta=beta, alpha=alpha)


# The bias of a product whose output is a pending sum must count once: it is scaled by 1 on the
# first rank of those mesh dimensions and by 0 elsewhere. Every rank runs the same ops (never a
# different program): backward issues collectives in graph order, so ranks whose autograd
# graphs differed in shape could issue them in different orders and deadlock.
@lowering(aten.linear.default)
def lower_linear(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Count the bias once when the output is a pending sum."""
    if len(args) >= 3 and args[2] is not None and _has_partial_output(ctx):
        return _linear_bias_scaled, (*args[:3], _bias_keep(ctx)), {}
    return call.target, args, kwargs


@lowering(aten.addmm.default)
def lower_addmm(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Count the bias once when the output is a pending sum."""
    if _has_partial_output(ctx):
        return _addmm_bias_scaled, (*args[:3], _bias_keep(ctx)), kwargs
    return call.target, args, kwargs


@lowering(aten.baddbmm.default)
def lower_baddbmm(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Add the added term once when the output is a pending sum."""
    if _has_partial_output(ctx):
        return _baddbmm_scaled, (*args[:3], _bias_keep(ctx)), kwargs
    return call.target, args, kwargs
