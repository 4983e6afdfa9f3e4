"""The sharding-rule registry: for each ATen op, the placements it can run under on one mesh
dimension.

A rule is a function `rule(call: OpCall) -> list[Rule1D]`, registered for one or more ops with
`@register(aten.op.overload, ...)`. It lists, for the op's shapes, every valid assignment of
placements to its tensor inputs and output(s) on one mesh dimension; strategies for an n-D mesh
are products of these (see `passes.strategies`). A rule may also register a *lowering*
(`@lowering(op)`) when the op cannot run unchanged on local shards (a mean over a sharded
dimension, a bias that must be added once under a pending sum, a vocabulary-parallel embedding).
Ops whose shape arguments must be made local (view, expand, ...) get that from `lowering` too.

Next to its rule, a family file states the op's *facts* (`facts(op, ...)`, an `OpFacts`): what
the cost and memory models need to know of it (a view, a product, its flops, what autograd
keeps for its backward, the random numbers it draws). Adding an op is one place: its family file.
Ops without a rule may have facts too (they run replicated, but are still priced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

aten = torch.ops.aten
__all__ = ["FACTS", "LOWERINGS", "PASSES_ALL", "RULES", "SAVES_DIVISOR", "SAVES_FIRST",
           "SAVES_INDICES", "SAVES_INPUTS", "SAVES_NOTHING", "SAVES_OPERANDS", "SAVES_OUTPUT",
           "UNKNOWN",
           "LocalContext", "OpCall", "OpFacts", "P", "R", "Rule1D", "Shard", "TensorArg", "aten",
           "dedupe", "facts", "facts_of", "lowering", "norm_dim", "register", "replicate_all"]
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
    """A tensor argument: its index among the op's tensor inputs, its shape and dtype, and its
    strides in the single-device program (random ops draw in memory order; None: contiguous)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None

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
    # (dimension, m): the program runs once per microbatch of a batch m times larger, and
    # this op's output carries the batch on that dimension (random ops draw the whole batch's
    # tensor; passes/rules/random.py). None: the program runs on the whole batch.
    microbatches: tuple[int, int] | None = None
    # how random ops draw (passes/rules/random.py): "eager" draws each whole
    # tensor from the default generator, "counter" this rank's block from the step's key
    randomness: str = "eager"
    # the rank's autograd-aware collectives (passes/rewrite.py CommOps), for an op whose
    # local computation exchanges something itself (BatchNorm's batch statistics)
    comm: Any = None


# A lowering returns (callable, args, kwargs) for the local op; args may hold the local input nodes.
LoweringFn = Callable[[OpCall, tuple, dict, LocalContext], tuple[Any, tuple, dict]]

RULES: dict[Any, RuleFn] = {}
LOWERINGS: dict[Any, LoweringFn] = {}
FACTS: dict[Any, OpFacts] = {}

# What autograd keeps of an op's inputs for its backward (`OpFacts.saves`):
SAVES_INPUTS = "inputs"          # every input
SAVES_FIRST = "first"            # the first input (gelu, silu: f'(x) needs x)
SAVES_OUTPUT = "output"          # its own output (relu, tanh, softmax: f'(x) from f(x))
SAVES_NOTHING = "nothing"        # nothing (sums, views, copies, creation)
SAVES_OPERANDS = "operands"      # a product: each operand whose partner needs a gradient
SAVES_INDICES = "indices"        # the inputs after the first (index, gather: the indices)
SAVES_DIVISOR = "divisor"        # the divisor, and the numerator when the divisor needs a grad
# Inputs whose gradient is the output's own, or a view of it (`OpFacts.grad_passes`):
PASSES_ALL = "all"


@dataclass(frozen=True)
class OpFacts:
    """What pricing an op needs to know of it, whatever its placements.

    `view`: an alias of its input (no compute, no bytes; it keeps its base alive).
    `product`: the input slots of a matrix product's two operands (flops 2 x output x inner
    size; backward one product per operand that needs a gradient).
    `flops_per_element`: arithmetic per output element of an elementwise op (about 20 for ops
    built on exp / erf / rsqrt, and norms, softmax and losses, which add reductions).
    `backward_factor`: backward flops per forward flop when it is not a product.
    `saves`: what autograd keeps for its backward (SAVES_*); `saves_output`: also its output.
    `flops(call, in_local, out_local)`: forward flops, when the above do not say (attention).
    `extra_saved(call, in_local, out_local, itemsize)`: bytes of small tensors it makes only
    for backward (statistics, log-sum-exp, a dropout mask), `itemsize(dtype)` giving a traced
    dtype's size under the plan's precision.
    `workspace(call, in_local, out_local, itemsize)`: bytes of the gradient buffers its
    backward allocates while everything forward saved is still alive (a loss: the first op
    backward runs), beyond what it saves.
    `traffic(call, in_local, out_local, itemsize)`: (forward, backward) bytes a memory-bound
    kernel moves, when it is not its inputs and outputs once each (forward) and the same
    again (backward): a lookup reads only the rows it gathers and its backward writes the
    whole table; a loss makes several passes over its input.
    `draws(call)`: random numbers it draws on every rank (the whole tensor, whatever the
    sharding).
    `kernel`: the fused kernel family it runs on GPUs ("attention": priced by the profile's
    attention table, solver/efficiency.py; "norm": one kernel per pass that reduces its
    weight's gradient itself, solver/traffic.py).
    `exchanges(call, inputs, mesh_shape, itemsize)`: (collective, mesh dimension, bytes) of
    each collective its lowering runs inside the op under input placements `inputs` (one
    Placements per tensor input), each once in forward and once more (its adjoint) in
    backward: BatchNorm's batch statistics gathered from the ranks sharing the batch.
    `grad_passes`: the input slots (or PASSES_ALL) whose gradient autograd hands on without a
    kernel: the output's gradient itself or a view of it (a sum's operands, a reshape's or a
    concatenation's input). Every other input that needs a gradient gets a kernel of its own
    in backward (solver/traffic.py)."""

    view: bool = False
    product: tuple[int, int] | None = None
    flops_per_element: float = 1.0
    backward_factor: float = 1.0
    saves: str = SAVES_INPUTS
    saves_output: bool = False
    flops: Callable | None = None
    extra_saved: Callable | None = None
    draws: Callable | None = None
    kernel: str = ""
    workspace: Callable | None = None
    traffic: Callable | None = None
    grad_passes: tuple[int, ...] | str = ()
    exchanges: Callable | None = None


UNKNOWN = OpFacts()  # an op no family states facts for: assume it keeps every input


def facts(*ops, **fields) -> OpFacts:
    """State the facts of the given ATen ops (overloads, or overload packets for every
    overload) in their family file; returns them."""
    fact = OpFacts(**fields)
    for op in ops:
        if op in FACTS:
            raise ValueError(f"two sets of facts for {op}")
        FACTS[op] = fact
    return fact


def facts_of(target) -> OpFacts:
    """The facts of an op (by overload, then by overload packet), or UNKNOWN."""
    got = FACTS.get(target)
    if got is None:
        got = FACTS.get(getattr(target, "overloadpacket", None), UNKNOWN)
    return got


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
