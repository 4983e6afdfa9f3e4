"""The sharding-rule registry: for each ATen op, the placements it can run under on one mesh
dimension.

A rule is a function `rule(call: OpCall) -> list[Rule1D]`, registered for one or more ops with
`@register(aten.op.overload, ...)`. It lists, for the op's shapes, every valid assignment of
placements to its tensor inputs and output(s) on one mesh dimension; strategies for an n-D mesh
are products of these (see `passes.strategies`). A rule may also register a *lowering*
(`@lowering(op)`) when the op cannot run unchanged on local shards (a mean over a sharded
dimension, a bias that must be added once under a pending sum, a vocabulary-parallel embedding).
Ops whose shape arguments must be made local (view, expand, ...) get that from `lowering` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

aten = torch.ops.aten
__all__ = ["LOWERINGS", "RULES", "LocalContext", "OpCall", "P", "R", "Rule1D", "Shard",
           "TensorArg", "aten", "dedupe", "lowering", "norm_dim", "register", "replicate_all"]
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class Rule1D:
    """Placements of the tensor inputs (in flattened-argument order) and of the output on one mesh
    dimension. `output` is a tuple of placements for ops that return several tensors."""

    inputs: tuple[Placement, ...]
    output: Placement | tuple[Placement, ...]


@dataclass
class OpCall:
    """What a rule sees of one graph node: the op, its arguments with tensors replaced by
    `TensorArg`, and the shapes of inputs and output(s)."""

    name: str
    target: Any
    args: tuple
    kwargs: dict
    inputs: list[TensorArg]
    out_shapes: list[tuple[int, ...]]
    multi_output: bool

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out_shapes[0]

    @property
    def out_ndim(self) -> int:
        return len(self.out_shapes[0])

    def arg(self, i: int, name: str, default=None):
        """Positional-or-keyword argument lookup."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: its index among the op's tensor inputs, its shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


RuleFn = Callable[[OpCall], list[Rule1D]]


@dataclass(frozen=True)
class LocalContext:
    """What a lowering knows about the rank it emits code for."""

    mesh_shape: tuple[int, ...]
    coords: tuple[int, ...]
    in_placements: tuple[tuple[Placement, ...], ...]
    out_placements: Any
    local_out_shapes: list[tuple[int, ...]]


# A lowering returns (callable, args, kwargs) for the local op; args may hold the local input nodes.
LoweringFn = Callable[[OpCall, tuple, dict, LocalContext], tuple[Any, tuple, dict]]

RULES: dict[Any, RuleFn] = {}
LOWERINGS: dict[Any, LoweringFn] = {}


def register(*ops) -> Callable[[RuleFn], RuleFn]:
    """Register a sharding rule for the given ATen op overloads."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            if op in RULES:
                raise ValueError(f"two sharding rules for {op}")
            RULES[op] = fn
        return fn

    return deco


def lowering(*ops) -> Callable[[LoweringFn], LoweringFn]:
    """Register how an op is emitted on local shards when it cannot run unchanged."""

    def deco(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            LOWERINGS[op] = fn
        return fn

    return deco


def replicate_all(call: OpCall) -> list[Rule1D]:
    """The strategy every op has: all inputs and outputs replicated."""
    out = tuple(R for _ in call.out_shapes) if call.multi_output else R
    return [Rule1D(tuple(R for _ in call.inputs), out)]


def dedupe(rules: Sequence[Rule1D]) -> list[Rule1D]:
    """Drop repeated strategies, keeping the first occurrence (order is deterministic)."""
    seen, out = set(), []
    for r in rules:
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def norm_dim(d: int, ndim: int) -> int:
    """A non-negative dimension index."""
    return d + ndim if d < 0 else d
