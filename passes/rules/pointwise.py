"""Elementwise ops (with broadcasting): any output dimension can be sharded, inputs follow it.

Ops that are linear in their tensor inputs also pass a pending sum (Partial) through: a sum of
per-rank pieces stays a sum after negation, scaling by a replicated factor, or adding another sum.
"""

from __future__ import annotations

from .registry import (
    SAVES_DIVISOR,
    SAVES_FIRST,
    SAVES_INDICES,
    SAVES_INPUTS,
    SAVES_NOTHING,
    SAVES_OPERANDS,
    SAVES_OUTPUT,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    TensorArg,
    aten,
    dedupe,
    facts,
    register,
)

UNARY = [
    aten.abs.default, aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default,
    aten.sin.default, aten.cos.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.erf.default, aten.reciprocal.default,
    aten.logical_not.default, aten.pow.Tensor_Scalar, aten.leaky_relu.default,
    aten.hardtanh.default, aten.elu.default, aten.softplus.default, aten.log1p.default,
    aten.expm1.default, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.round.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.bitwise_not.default, aten.square.default, aten.mish.default,
    aten.relu6.default if hasattr(aten, "relu6") else aten.relu.default,
    aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.le.Scalar, aten.eq.Scalar,
    aten.ne.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.remainder.Scalar,
    aten.fmod.Scalar,
]
# Linear in the (single) tensor input: Partial passes through.
LINEAR_UNARY = [
    aten.neg.default, aten.clone.default, aten.alias.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
    aten.mul.Scalar, aten.div.Scalar, aten.detach.default,
]
BINARY = [
    aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default, aten.eq.Tensor,
    aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.addcmul.default, aten.addcdiv.default, aten.lerp.Scalar,
    aten.div.Tensor_mode, aten.remainder.Tensor, aten.fmod.Tensor, aten.atan2.default,
    aten.type_as.default,  # the second operand gives only its dtype
]
# Sums and differences: Partial + Partial is Partial (only when both operands are tensors).
ADDITIVE = [aten.add.Tensor, aten.sub.Tensor]
# Products: linear in each argument separately: Partial * Replicate is Partial.
MULTIPLICATIVE = [aten.mul.Tensor]
# Division is linear in the numerator only.
DIVISION = [aten.div.Tensor]

# What backward keeps, and the ops built on exp / erf / rsqrt (about 20 flops per element on
# vector units: a polynomial per transcendental, against one for arithmetic).
TRANSCENDENTAL = 20.0
facts(aten.gelu.default, aten.silu.default, aten.erf.default, aten.log.default,
      aten.log1p.default, aten.softplus.default, aten.mish.default, aten.sin.default,
      aten.cos.default, flops_per_element=TRANSCENDENTAL, saves=SAVES_FIRST)
facts(aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.rsqrt.default,
      aten.expm1.default, flops_per_element=TRANSCENDENTAL, saves=SAVES_OUTPUT)
facts(aten.relu.default, aten.sqrt.default, aten.elu.default, saves=SAVES_OUTPUT)
facts(aten.abs.default, aten.reciprocal.default, aten.pow.Tensor_Scalar,
      aten.leaky_relu.default, aten.hardtanh.default, aten.clamp.default,
      aten.clamp_min.default, aten.clamp_max.default, aten.square.default, saves=SAVES_FIRST)
if hasattr(aten, "relu6"):
    facts(aten.relu6.default, saves=SAVES_FIRST)
# No gradient, or a gradient that needs nothing (constant, or linear in the input):
facts(aten.logical_not.default, aten.sign.default, aten.floor.default, aten.ceil.default,
      aten.round.default, aten.bitwise_not.default, aten.gt.Scalar, aten.lt.Scalar,
      aten.ge.Scalar, aten.le.Scalar, aten.eq.Scalar, aten.ne.Scalar, aten.rsub.Scalar,
      aten.remainder.Scalar, aten.fmod.Scalar, aten.neg.default, aten.to.dtype,
      aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.mul.Scalar,
      aten.div.Scalar, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor,
      aten.gt.Tensor, aten.ge.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
      aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
      aten.logical_or.default, aten.lerp.Scalar, aten.div.Tensor_mode, aten.remainder.Tensor,
      aten.fmod.Tensor, aten.zeros_like.default, aten.ones_like.default,
      aten.full_like.default, aten.fill.Scalar, aten.fill.Tensor, aten.copy.default,
      aten.tril.default,
      aten.triu.default, aten.type_as.default, saves=SAVES_NOTHING)
# The gradient handed on as it is (a sum's operands, a copy's input); a difference negates
# its second operand's in a kernel.
facts(aten.add.Tensor, saves=SAVES_NOTHING, grad_passes=(0, 1))
facts(aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.clone.default,
      aten.contiguous.default, saves=SAVES_NOTHING, grad_passes=(0,))
facts(aten.alias.default, aten.detach.default, view=True, saves=SAVES_NOTHING,
      grad_passes=(0,))
facts(aten.pow.Tensor_Tensor, saves=SAVES_INPUTS, saves_output=True,
      flops_per_element=TRANSCENDENTAL)
facts(aten.maximum.default, aten.minimum.default, aten.addcmul.default, aten.addcdiv.default,
      aten.atan2.default, saves=SAVES_INPUTS)
facts(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
      saves=SAVES_FIRST)  # the condition
facts(aten.masked_fill.Scalar, aten.masked_fill.Tensor, saves=SAVES_INDICES)  # the mask
facts(*MULTIPLICATIVE, saves=SAVES_OPERANDS)
facts(*DIVISION, saves=SAVES_DIVISOR)


def broadcast_rules(call: OpCall) -> list[Rule1D]:
    """Shard(d) of the output with each input sharded on its aligned dimension (or replicated
    where it broadcasts), plus all-replicated."""
    out = call.out_shape
    n = len(out)
    rules = []
    for d in range(n):
        if out[d] == 1:
            continue
        placements = []
        for t in call.inputs:
            j = d - (n - t.ndim)
            placements.append(Shard(j) if j >= 0 and t.shape[j] == out[d] else R)
        rules.append(Rule1D(tuple(placements), Shard(d)))
    rules.append(Rule1D(tuple(R for _ in call.inputs), R))
    return rules


@register(*UNARY, *BINARY)
def pointwise(call: OpCall) -> list[Rule1D]:
    """Elementwise op: follow the output's sharding."""
    return broadcast_rules(call)


def _converts_to_non_float(call: OpCall) -> bool:
    """True for a conversion to an integer or boolean dtype (rounding is not linear)."""
    pos = {aten.to.dtype: 1, aten.to.device: 2}.get(call.target)
    dtype = call.arg(pos, "dtype") if pos is not None else call.kwargs.get("dtype")
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


@register(*LINEAR_UNARY)
def linear_pointwise(call: OpCall) -> list[Rule1D]:
    """Elementwise op linear in its tensor input: also Partial -> Partial."""
    rules = broadcast_rules(call)
    if len(call.inputs) == 1 and not _converts_to_non_float(call):
        rules.append(Rule1D((P,), P))
    return rules


@register(*ADDITIVE)
def additive(call: OpCall) -> list[Rule1D]:
    """add/sub: Partial + Partial -> Partial when both operands are tensors (a number added to a
    pending sum would be counted once per rank)."""
    rules = broadcast_rules(call)
    if len(call.inputs) == 2:
        rules.append(Rule1D((P, P), P))
    return rules


@register(*MULTIPLICATIVE)
def multiplicative(call: OpCall) -> list[Rule1D]:
    """mul: linear in each factor, so one pending-sum factor times a replicated one."""
    rules = broadcast_rules(call)
    if len(call.inputs) == 2:
        rules += [Rule1D((P, R), P), Rule1D((R, P), P)]
    elif len(call.inputs) == 1:
        rules.append(Rule1D((P,), P))
    return rules


@register(*DIVISION)
def division(call: OpCall) -> list[Rule1D]:
    """div: linear in the numerator."""
    rules = broadcast_rules(call)
    if len(call.inputs) == 2:
        rules.append(Rule1D((P, R), P))
    elif len(call.inputs) == 1 and isinstance(call.args[0], TensorArg):
        rules.append(Rule1D((P,), P))
    return dedupe(rules)


facts(aten.broadcast_tensors.default, view=True, saves=SAVES_NOTHING)


@register(aten.fill.Scalar, aten.fill.Tensor, aten.zeros_like.default, aten.ones_like.default,
          aten.full_like.default)
def fill(call: OpCall) -> list[Rule1D]:
    """A tensor of `self`'s shape holding one value (a scalar, or a 0-d tensor): each rank
    makes its block."""
    rest = tuple(R for _ in call.inputs[1:])
    return [Rule1D((Shard(d), *rest), Shard(d)) for d in range(len(call.out_shape))
            if call.out_shape[d] != 1] + [Rule1D((R, *rest), R)]


@register(aten.broadcast_tensors.default)
def broadcast_tensors(call: OpCall) -> list[Rule1D]:
    """Every output has the broadcast shape and follows its sharding."""
    k = len(call.out_shapes)
    return [Rule1D(r.inputs, tuple(r.output for _ in range(k))) for r in broadcast_rules(call)]
