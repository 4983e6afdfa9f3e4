"""The memory model: bytes per device of a plan, per strategy, so the ILP's constraint is linear.

    peak = parameters + gradients + optimizer state + activations kept for backward
           + FSDP gathers in flight + the largest random draw

Parameters, gradients and optimizer state follow each parameter's storage placement: a local
shard of the parameter and of its gradient (in the compute dtype), the optimizer's states
(AdamW: two, SGD with momentum: one) and, under mixed precision, a float32 master copy, plus
the optimizer's per-tensor scalars (AdamW's `step`).

Activations are what autograd saves during the forward pass and frees in backward; all of them
are alive when the forward pass ends, which is the peak (gradients are counted in full on top, a
safe bound: they grow as activations are freed). Each op saves what its derivative needs
(`saved_slots`, `saves_output`): a product keeps each operand whose partner needs a gradient,
attention its inputs, output and log-sum-exp, a norm its input and statistics, gelu/silu their
input, tanh/relu/softmax their output; sums, views and reshapes keep nothing. A kept input is
the tensor the op consumes: the producer's output, or what the resharding on the edge made of
it (the output of its last collective: a local slice is a view and keeps what it slices). So
a kept input costs bytes on the edge (producer placement a, consumer placement b), and nothing
when it is a parameter, user input or constant used where it lives (a replicated DDP weight
kept by its product is the parameter itself; an FSDP weight gathered for its product costs its
full size). A view keeps its base alive: views and split parts of one tensor count as that
tensor (attention's q, k and v are one projection), and a tensor kept by k ops counts 1/k at
each (one tensor when they use it alike). Measured on gloo ranks, this is within a few percent
of the storages autograd really saves (tests/test_memory.py).

A random op draws its whole tensor on every rank, whatever its sharding, and under gradient
accumulation or a pipeline's microbatches the whole batch's (passes/rules/random.py), then keeps
its block: the draw is live while the op runs, on top of what forward has kept by then
(`draw_bytes`: the largest, a constant of the graph that the ILP takes off the budget). In
the counter mode of randomness a rank computes only its block, in chunks of at most
counter_rng.CHUNK elements: what the draw holds besides its result is DRAW_BYTES_PER_ELEMENT
per element of a chunk.

Every other term is a function of one node's strategy or of one edge's pair of placements, so
memory is linear in the ILP's variables:
sum_v sum_s m[v,s] x[v,s] + sum_e sum_{a,b} m[e,a,b] y[e,a,b]. The ILP can minimise that
instead of time (solver/ilp.py), for the smallest peak any plan reaches (solver/diagnose.py
reports it when no plan fits); `zero_memory` prices the standard ZeRO setups in closed form.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from autopar.passes.gathers import use_groups
from autopar.passes.placement import as_tuple, local_shape, same
from autopar.passes.recompute import Recompute, saved_under_selective
from autopar.passes.reshard import ReshardError, plan_steps, single_gather
from autopar.passes.rules.counter_rng import CHUNK, DRAW_BYTES_PER_ELEMENT
from autopar.passes.rules.registry import (
    SAVES_DIVISOR,
    SAVES_FIRST,
    SAVES_INDICES,
    SAVES_INPUTS,
    SAVES_OPERANDS,
    SAVES_OUTPUT,
)
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, SNode, Strategy, StrategyGraph
from autopar.passes.zero import zero_shard

from .flops import facts, is_view
from .specs import optimizer_spec, precision_spec

GiB = 2**30
KINDS = ("parameters", "gradients", "optimizer", "activations", "recomputed", "gathered",
         "workspace", "draws")


class Prices(Protocol):
    """What the memory model needs of the cost model (solver/cost.py's CostModel)."""

    shape: tuple[int, ...]
    info: dict
    precision: Any
    optimizer: Any
    recompute: Recompute
    region_uses: Counter   # see region_input_uses
    accumulation: int      # microbatches a step accumulates gradients over
    randomness: str        # how random ops draw: "eager" or "counter" (passes/rules/random.py)
    activation_factor: float  # microbatches in flight (pipeline stages)
    cast_once: bool        # mixed precision: a parameter's cast made once a step (see cost.py)

    def dtype(self, dtype: torch.dtype) -> torch.dtype: ...
    def leaf_dtype(self, node: SNode) -> torch.dtype: ...
    def nbytes(self, shape, dtype: torch.dtype) -> int: ...
    def local_shapes(self, node: SNode, strategy: Strategy) -> tuple[list, list]: ...
    def param_memory_split(self, node: SNode, storage, zero: int = 0) -> dict[str, float]: ...
    def activation_memory(self, node: SNode, strategy: Strategy) -> float: ...
    def edge_memory(self, graph: StrategyGraph, consumer: SNode, slot: int, src, dst
                    ) -> float: ...

    def regathered(self, graph: StrategyGraph, consumer: SNode, slot: int, src, dst
                   ) -> bool: ...
    def recollected(self, graph: StrategyGraph, consumer: SNode, slot: int) -> bool: ...

    reshard: frozenset[str]  # parameters whose gathered copies are freed after forward
    bucket_bytes: float      # FSDP gathers and gradient sync go in buckets of this size


def saved_slots(node: SNode, grads: tuple[bool, ...]) -> tuple[int, ...]:
    """Input slots whose tensors autograd keeps for `node`'s backward, given which inputs need
    gradients (the op's facts, passes/rules)."""
    f, n = facts(node), len(node.inputs)
    saves = f.saves
    if callable(saves):
        return saves(node.call)
    if saves == SAVES_INPUTS:
        return tuple(range(n))
    if saves == SAVES_FIRST:
        return (0,) if n else ()
    if saves == SAVES_OPERANDS:
        return _product_slots(grads, *(f.product or (0, 1))) if n >= 2 else ()
    if saves == SAVES_INDICES:
        return tuple(range(1, n))
    if saves == SAVES_DIVISOR:
        return tuple(sorted({1} | ({0} if grads[1] else set()))) if n >= 2 and any(grads) \
            else ()
    return ()  # SAVES_OUTPUT, SAVES_NOTHING


def saves_output(node: SNode) -> bool:
    """Whether autograd keeps `node`'s own output(s) for its backward."""
    f = facts(node)
    return f.saves == SAVES_OUTPUT or f.saves_output


def _product_slots(grads: tuple[bool, ...], a: int, b: int) -> tuple[int, ...]:
    out = []
    if b < len(grads) and grads[b]:
        out.append(a)  # d/dB needs A
    if a < len(grads) and grads[a]:
        out.append(b)  # d/dA needs B
    return tuple(sorted(out))


def extra_saved_bytes(cost: Prices, node: SNode, strategy: Strategy) -> float:
    """Bytes of the small tensors an op makes only for its backward (a norm's statistics,
    attention's log-sum-exp, a dropout mask: the op's facts), of this rank's block."""
    f = facts(node)
    if f.extra_saved is None or node.call is None:
        return 0.0
    in_local, out_local = cost.local_shapes(node, strategy)
    return f.extra_saved(node.call, in_local, out_local, lambda dt: cost.dtype(dt).itemsize)


def draw_bytes(graph: StrategyGraph, cost: Prices,
               choice: dict[str, Strategy] | None = None) -> float:
    """Bytes of the largest draw a random op makes while it runs, besides its result.

    Eager randomness, whatever the plan: its drawn elements (the whole batch's under
    accumulation: `cost.accumulation`) times what the lowering holds of each at most
    (passes/rules/random.py: a stand-in of the input's dtype, and the op's outputs on it: for
    GPU dropout the whole output and its boolean mask, 2 x itemsize + 1). An overcount where
    attention with dropout runs whole on every rank without accumulation (the fused kernel
    draws without holding the weights' mask): in any other plan it runs as the math kernel on
    the whole draw's block.

    Counter randomness: DRAW_BYTES_PER_ELEMENT per element of its largest chunk, at most
    CHUNK elements and at most the rank's block under `choice` (without one: the whole
    tensor of a microbatch, an upper bound of any block)."""
    most = 0.0
    counter = cost.randomness == "counter"
    for v in graph.nodes.values():
        f = facts(v)
        if f.draws is None or v.call is None or not v.out_dtypes:
            continue
        n = f.draws(v.call)
        if n and counter:
            if choice is not None:
                n = n * block_share(cost, v, choice[v.name])
            most = max(most, min(n, CHUNK) * DRAW_BYTES_PER_ELEMENT)
        elif n:
            size = cost.dtype(v.out_dtypes[0]).itemsize
            most = max(most, n * cost.accumulation * (2 * size + 1))
    return float(most)


def block_share(cost: Prices, v: SNode, s: Strategy) -> float:
    """The fraction of `v`'s (first) output this rank holds under `s`."""
    _, out_local = cost.local_shapes(v, s)
    whole = math.prod(v.out_shapes[0])
    return math.prod(out_local[0]) / whole if whole else 0.0


def workspace_bytes(cost: Prices, node: SNode, strategy: Strategy) -> float:
    """Bytes of the gradient buffers an op's backward allocates while everything saved is
    still alive (the op's facts: a loss, the first op backward runs), of this rank's block."""
    f = facts(node)
    if f.workspace is None or node.call is None or node.kind != OP or not node.requires_grad:
        return 0.0
    in_local, out_local = cost.local_shapes(node, strategy)
    return f.workspace(node.call, in_local, out_local, lambda dt: cost.dtype(dt).itemsize)


@dataclass(frozen=True)
class Kept:
    """One tensor an op keeps for backward, as the graph sees it: the storage it lives in is
    its view root's (`scale` x its own elements; `held` when that is a parameter, user input
    or constant), which `share` ops keep in all; `direct` ops keep this very tensor; `root`:
    that view root, (node, output index)."""

    share: int
    direct: int
    scale: float
    held: bool
    root: tuple = ()


@dataclass(frozen=True)
class NodeInfo:
    """What pricing a node needs to know of its neighbours."""

    grad_inputs: tuple[bool, ...]          # input slot needs a gradient
    kept_inputs: tuple[Kept | None, ...]   # per input slot: kept for backward (or None)
    kept_outputs: tuple[Kept | None, ...]  # per output: kept by this op's own backward


def node_infos(graph: StrategyGraph) -> dict[str, NodeInfo]:
    """Gradient flags and kept tensors of every node of `graph`, with view roots: a view (or a
    split part) of a tensor lives in that tensor's storage, so ops keeping several views of one
    tensor keep it once (attention's q, k, v are parts of one projection)."""
    grads: dict[str, tuple[bool, ...]] = {}
    for v in graph.nodes.values():
        grads[v.name] = tuple(graph.nodes[u].requires_grad
                              and graph.nodes[u].out_dtypes[idx or 0].is_floating_point
                              for u, idx in v.inputs)
    root: dict[tuple, tuple] = {}  # (node, out index) -> its view root

    def root_of(ref: tuple) -> tuple:
        if ref not in root:
            v = graph.nodes[ref[0]]
            r = ref
            if v.kind == OP and is_view(v) and v.inputs and not _copies(graph, v):
                r = root_of(v.inputs[0])
            root[ref] = r
        return root[ref]

    saved_in: dict[str, tuple[int, ...]] = {}
    uses: Counter = Counter()     # per root: ops keeping some view of it
    direct: Counter = Counter()   # per tensor: ops keeping it
    for v in graph.nodes.values():
        keeps = v.kind == OP and v.requires_grad
        saved_in[v.name] = saved_slots(v, grads[v.name]) if keeps else ()
        for i in saved_in[v.name]:
            uses[root_of(v.inputs[i])] += 1
            direct[v.inputs[i]] += 1
        if keeps and saves_output(v):
            for k in range(len(v.out_shapes)):
                ref = (v.name, k if v.multi_output else None)
                uses[root_of(ref)] += 1
                direct[ref] += 1

    def kept(ref: tuple) -> Kept:
        r = root_of(ref)
        rv, tv = graph.nodes[r[0]], graph.nodes[ref[0]]
        scale = math.prod(rv.out_shapes[r[1] or 0]) / max(1, math.prod(tv.out_shapes[ref[1] or 0]))
        return Kept(uses[r], direct[ref], scale, rv.kind in (PARAM, INPUT, CONSTANT), r)

    out = {}
    for v in graph.nodes.values():
        ins = tuple(kept(v.inputs[i]) if i in saved_in[v.name] else None
                    for i in range(len(v.inputs)))
        keeps_out = v.kind == OP and v.requires_grad and saves_output(v)
        outs = tuple(kept((v.name, k if v.multi_output else None)) if keeps_out else None
                     for k in range(len(v.out_shapes)))
        out[v.name] = NodeInfo(grads[v.name], ins, outs)
    return out


def _copies(graph: StrategyGraph, v: SNode) -> bool:
    """A reshape of an expanded tensor materializes it (a copy, not a view)."""
    if not v.op.startswith(("reshape", "_unsafe_view")):
        return False
    u = graph.nodes[v.inputs[0][0]]
    while u.kind == OP and is_view(u):
        if u.op.startswith("expand"):
            return True
        u = graph.nodes[u.inputs[0][0]]
    return False


def recomputed(cost: Prices, node: SNode) -> str | None:
    """The recomputation mode of `node` ("selective" or "full"), None when it is not
    recomputed."""
    return cost.recompute.mode_of.get(node.name)


def relived(cost: Prices, node: SNode) -> bool:
    """Whether `node` is in the block whose activations are priced as live again: backward
    recomputes one block at a time, so at the peak one block holds what it would have kept
    without recomputation, besides what every recomputed block keeps from forward."""
    return node.name in cost.recompute.transient


def region_input_uses(graph: StrategyGraph, r: Recompute) -> Counter:
    """How many recomputed ops of each block read each value made outside that block's
    recomputed ops: (producer, output index, block) -> uses. A recomputed run keeps its
    inputs, each once, whatever its ops' backward needs."""
    uses: Counter = Counter()
    for n, b in r.block_of.items():
        for u, idx in graph.nodes[n].inputs:
            if r.block_of.get(u) != b:
                uses[(u, idx, b)] += 1
    return uses


def _output_bytes(cost: Prices, node: SNode, strategy: Strategy) -> float:
    outs = strategy.output if node.multi_output else (strategy.output,)
    return sum(cost.nbytes(local_shape(shape, p, cost.shape), dtype)
               for shape, p, dtype in zip(node.out_shapes, outs, node.out_dtypes))


def saved_bytes(cost: Prices, node: SNode, strategy: Strategy) -> float:
    """Bytes per device autograd keeps on account of `node` under `strategy` that depend on
    its strategy alone: its own output when its backward needs it, and the small tensors it
    creates for backward. (Its kept inputs are priced on the edges: `edge_saved_bytes`.) A
    recomputed op keeps nothing, except that a selectively recomputed block keeps the outputs
    of its products and attention."""
    if node.kind != OP or not node.requires_grad:
        return 0.0
    mode = recomputed(cost, node)
    if mode is None:
        return kept_bytes(cost, node, strategy)
    live = kept_bytes(cost, node, strategy) if relived(cost, node) else 0.0
    if mode == "selective" and saved_under_selective(node, facts(node).product):
        return live + _output_bytes(cost, node, strategy)
    return live


def kept_bytes(cost: Prices, node: SNode, strategy: Strategy) -> float:
    """`saved_bytes` without recomputation."""
    info = cost.info.get(node.name)
    total = 0.0
    if saves_output(node):
        for j in range(len(node.out_shapes)):
            kept = info.kept_outputs[j] if info is not None else Kept(1, 1, 1.0, False)
            total += _kept_output_bytes(cost, node, strategy, j, kept)
    return total + extra_saved_bytes(cost, node, strategy)


def _kept_output_bytes(cost: Prices, node: SNode, strategy: Strategy, j: int,
                       kept: Kept) -> float:
    """Output `j`'s share of the storage it is kept in (1/`share` of its view root)."""
    p = strategy.output[j] if node.multi_output else strategy.output
    return cost.nbytes(local_shape(node.out_shapes[j], p, cost.shape), node.out_dtypes[j]) * \
        kept.scale / kept.share


def edge_saved_bytes(cost: Prices, graph: StrategyGraph, consumer: SNode, slot: int,
                     src, dst) -> float:
    """Bytes per device autograd keeps of input `slot` of `consumer`, produced at placements
    `src` and consumed at `dst`. The kept tensor's storage is the output of the last collective
    of the resharding (a local slice is a view of what it slices), or the producer's own
    output when nothing is communicated; a parameter's or user input's own storage is not
    counted again. A tensor kept by k ops counts 1/k at each. A parameter gathered for its use
    and freed after forward (reshard after forward: `regathered`) is not kept."""
    if consumer.kind != OP or not consumer.requires_grad:
        return 0.0
    if cost.regathered(graph, consumer, slot, src, dst):
        return 0.0
    if recomputed(cost, consumer):
        live = kept_edge_bytes(cost, graph, consumer, slot, src, dst) \
            if relived(cost, consumer) else 0.0
        return live + _region_input_bytes(cost, graph, consumer, slot, src, dst)
    return kept_edge_bytes(cost, graph, consumer, slot, src, dst)


def relived_bytes(cost: Prices, graph: StrategyGraph, node: SNode, strategy: Strategy,
                  inputs: list) -> float:
    """Of `node`'s activation and edge bytes (its inputs at `inputs`: (src, dst) per slot),
    the part live again while backward recomputes its block (see `relived`). A parameter
    gathered again for the recomputation is not: its gathers in flight are priced as such."""
    if node.kind != OP or not node.requires_grad or not relived(cost, node):
        return 0.0
    return kept_bytes(cost, node, strategy) + sum(
        kept_edge_bytes(cost, graph, node, slot, src, dst)
        for slot, (src, dst) in enumerate(inputs)
        if not cost.regathered(graph, node, slot, src, dst))


def kept_edge_bytes(cost: Prices, graph: StrategyGraph, consumer: SNode, slot: int,
                    src, dst) -> float:
    """`edge_saved_bytes` without recomputation."""
    info = cost.info.get(consumer.name)
    if info is not None:
        kept = info.kept_inputs[slot]
    else:  # without the graph's analysis: every kept tensor counted at each op, no views
        grads = tuple(graph.nodes[u].requires_grad for u, _ in consumer.inputs)
        held = graph.nodes[consumer.inputs[slot][0]].kind in (PARAM, INPUT, CONSTANT)
        kept = Kept(1, 1, 1.0, held) if slot in saved_slots(consumer, grads) else None
    if kept is None:
        return 0.0
    u, idx = consumer.inputs[slot]
    dtype = graph.nodes[u].out_dtypes[idx or 0]
    shape = consumer.in_shapes[slot]
    try:
        moved = _collective_output(cost, shape, src, dst)
    except ValueError:  # no such resharding: the edge is infeasible anyway
        return 0.0
    if moved is not None:  # a new tensor, shared by the ops that reshard this one alike
        return cost.nbytes(moved, dtype) / kept.direct
    if kept.held and not _cast_for_compute(cost, graph.nodes[u], dtype):
        return 0.0
    return cost.nbytes(local_shape(shape, src, cost.shape), dtype) * kept.scale / kept.share


def _region_input_bytes(cost: Prices, graph: StrategyGraph, consumer: SNode, slot: int,
                        src, dst) -> float:
    """Input `slot` of a recomputed op: nothing when its producer is recomputed in the same
    block (backward makes it again); else an input of the recomputed run, kept once for the
    block (a share per reading op): the producer's own output (a parameter's or user input's
    own storage is not counted again). A resharding collective on the way is inside the run
    of an op recomputed in full (`CostModel.recollected`: backward issues it again), so the
    run keeps what the collective reads; under selective recomputation it is not, and the
    run keeps what its last collective made."""
    r = cost.recompute
    u, idx = consumer.inputs[slot]
    block = r.block_of.get(consumer.name)
    producer = graph.nodes[u]
    dtype = producer.out_dtypes[idx or 0]
    shape = consumer.in_shapes[slot]
    try:
        moved = _collective_output(cost, shape, src, dst)
    except ValueError:
        return 0.0
    if moved is not None and not cost.recollected(graph, consumer, slot):
        return float(cost.nbytes(moved, dtype))
    if r.block_of.get(u) == block:
        return 0.0
    if producer.kind in (PARAM, INPUT, CONSTANT) and not _cast_for_compute(cost, producer, dtype):
        return 0.0
    share = max(1, cost.region_uses.get((u, idx, block), 1))
    return cost.nbytes(local_shape(shape, src, cost.shape), dtype) / share


def _collective_output(cost: Prices, shape, src, dst):
    """The local shape the last collective of resharding `shape` from `src` to `dst` makes
    (a new tensor), or None when nothing is communicated (a local slice is a view); raises
    ValueError when there is no such resharding."""
    if same(src, dst):
        return None
    moved = _moved(tuple(shape), as_tuple(src), as_tuple(dst), tuple(cost.shape))
    if isinstance(moved, ReshardError):
        raise ReshardError(*moved.args)
    return moved


@functools.lru_cache(maxsize=1 << 16)
def _moved(shape: tuple[int, ...], src, dst, mesh_shape: tuple[int, ...]):
    """`_collective_output` for hashable arguments, memoized (pricing a 70B-shaped model's
    level asks it 30,000 times, of a few thousand reshardings), the ReshardError returned."""
    try:
        steps = plan_steps(shape, src, dst, mesh_shape)
    except ReshardError as e:
        return e.with_traceback(None)  # kept in the cache: not with the frames it unwound
    collectives = [s for s in steps if s.kind != "slice"]
    return collectives[-1].out_shape if collectives else None


def _cast_for_compute(cost: Prices, node: SNode, dtype: torch.dtype) -> bool:
    """Under mixed precision a floating-point parameter is used as its cast to the compute
    dtype, a tensor of its own kept where autograd keeps the parameter (made once a step
    instead, `cast_once`, it is priced with the parameter: `parameter_bytes`)."""
    return node.kind == PARAM and cost.precision.master is not None and \
        dtype.is_floating_point and not cost.cast_once


def parameter_bytes(cost: Prices, node: SNode, storage, zero: int = 0) -> dict[str, float]:
    """Bytes per device of one parameter stored at `storage`, as the runtime keeps it: the
    parameter and its gradient, the optimizer's states and scalars; a frozen parameter
    (requires_grad=False) only itself (in the compute dtype). Under ZeRO (`zero`, see
    passes/zero.py) the optimizer's states (and from stage 2 the gradient) are this rank's
    shard of them; ZeRO-1's gradient is whole when a step accumulates several microbatches.

    Under mixed precision (FSDP2's MixedPrecisionPolicy(param_dtype=compute,
    reduce_dtype=master)) the stored parameter is the master copy (float32, what the optimizer
    steps; its cast to the compute dtype is priced where autograd keeps it:
    `edge_saved_bytes`, or here, once, where a step casts once: `cast_once`); the gradient is
    in the master dtype (reduced in it), and so is the optimizer's state."""
    local = math.prod(local_shape(node.out_shapes[0], storage, cost.shape))
    shard = local
    if zero:
        shard = local // cost.shape[zero_shard(node.out_shapes[0], storage, cost.shape).mesh_dim]
    # ZeRO-1 accumulates the whole gradient over a step's microbatches; with one it frees each
    # bucket's once reduce-scattered, as ZeRO-2 does
    grad = shard if zero >= 2 or (zero == 1 and cost.accumulation == 1) else local
    if not node.requires_grad:  # frozen (fine-tuning): stored, never stepped
        return {"parameters": float(local * cost.dtype(node.out_dtypes[0]).itemsize),
                "gradients": 0.0, "optimizer": 0.0}
    size, opt = cost.leaf_dtype(node).itemsize, cost.optimizer  # the master, if any
    cast = cost.dtype(node.out_dtypes[0]).itemsize if cost.cast_once and \
        cost.precision.master is not None and node.out_dtypes[0].is_floating_point else 0
    return {"parameters": float(local * (size + cast)), "gradients": float(grad * size),
            "optimizer": float(shard * size * opt.states + opt.scalar_bytes)}


def memory_split(graph: StrategyGraph, cost: Prices, choice: dict[str, Strategy],
                 twin: dict[str, str] | None = None) -> dict[str, float]:
    """Bytes per device of a complete assignment, by kind (KINDS; "recomputed" only when
    something recomputes, "gathered" only when FSDP gathers parameters, "workspace" only when
    a loss's backward allocates gradient buffers at the peak, "draws" only when a random op
    draws: `draw_bytes`); sums to the ILP's
    memory, but for "gathered": the ILP counts the largest parameter gathered, this its
    bucket (`gathered_bytes`). Twins (`twin`: a folded node -> its first layer's, as the
    clustering has them) alike (`alike`) are counted once each, as in the ILP."""
    out = dict.fromkeys(KINDS, 0.0)
    shared: dict[tuple, tuple] = {}
    for v in graph.nodes.values():
        s = choice[v.name]
        key = alike(cost, twin, v, s, choice) if twin else None
        got = shared.get(key) if key is not None else None
        if got is None:
            got = _node_split(graph, cost, v, s, choice)
            if key is not None:
                shared[key] = got
        params, act, again, work = got
        for k, b in params:
            out[k] += b
        out["activations"] += act - again - work
        out["recomputed"] += again
        out["workspace"] += work
    out["gathered"] = gathered_bytes(graph, cost, choice)
    out["draws"] = draw_bytes(graph, cost, choice)
    for kind in ("recomputed", "gathered", "workspace", "draws"):  # only plans that have them
        if not out[kind]:
            del out[kind]
    return out


def _node_split(graph: StrategyGraph, cost: Prices, v: SNode, s: Strategy,
                choice: dict[str, Strategy]) -> tuple:
    """What `v` at `s` adds to `memory_split`: (its parameter's bytes by kind, as pairs),
    activation bytes with its inputs', the part of them live again, workspace bytes."""
    params = tuple(cost.param_memory_split(v, s.output, s.zero).items()) \
        if v.kind == PARAM else ()
    act = cost.activation_memory(v, s) + sum(
        cost.edge_memory(graph, v, slot, choice[u].out(idx), s.inputs[slot])
        for slot, (u, idx) in enumerate(v.inputs))
    # the block backward recomputes, live again at the peak, apart from what forward keeps
    again = relived_bytes(cost, graph, v, s, [
        (tuple(choice[u].out(idx)), tuple(s.inputs[slot]))
        for slot, (u, idx) in enumerate(v.inputs)])
    return params, act, again, workspace_bytes(cost, v, s)


def recompute_state(cost: Prices, name: str) -> tuple:
    """What of a node's recomputation changes its prices: its mode, and whether it is in the
    block priced as live again (passes/recompute.py)."""
    r = cost.recompute
    return r.mode_of.get(name), name in r.transient


def alike(cost: Prices, twin: dict[str, str], v: SNode, s: Strategy,
          choice: dict[str, Strategy]) -> tuple:
    """Nodes of one key keep the same bytes (`memory_split`): twins (identical nodes of
    repeated layers; `twin` maps a node to its first layer's) at the same strategy,
    recomputed alike, whose inputs come from twins alike at the same placements (a
    parameter's freed after forward or not)."""
    return (twin.get(v.name, v.name), recompute_state(cost, v.name), s.inputs, s.output,
            s.zero, tuple((twin.get(u, u), idx, choice[u].out(idx), u in cost.reshard,
                           recompute_state(cost, u)) for u, idx in v.inputs))


def kept_once(graph: StrategyGraph, cost: Prices, choice: dict[str, Strategy]) -> float:
    """What a complete assignment's kept tensors weigh counted once per storage, less what
    the per-op shares count (`kept_bytes`, `kept_edge_bytes`: a tensor kept by k ops counts
    1/k at each, exact when all k keep the same storage). Where some keep a tensor as
    produced and others a collective's copy of it (one projection reading a norm's sharded
    output, another its all-gather), each storage weighs its whole bytes: the reported memory
    adds the difference (the ILP's memory row keeps the shares: it is linear in each op's
    choice). Ops recomputed in backward are left as priced."""
    if not cost.info:
        return 0.0
    whole: dict[tuple, float] = {}
    shared = 0.0

    def keep(key: tuple, nbytes: float) -> None:
        whole[key] = max(whole.get(key, 0.0), nbytes)

    for v in graph.nodes.values():
        info = cost.info.get(v.name)
        if v.kind != OP or not v.requires_grad or info is None or \
                recomputed(cost, v) is not None:
            continue
        s = choice[v.name]
        for j, kept in enumerate(info.kept_outputs):
            if kept is None:
                continue
            part = _kept_output_bytes(cost, v, s, j, kept)
            shared += part
            keep(("root", kept.root), part * kept.share)  # the view root's storage
        for slot, kept in enumerate(info.kept_inputs):
            if kept is None:
                continue
            u, idx = v.inputs[slot]
            src, dst = tuple(choice[u].out(idx)), tuple(s.inputs[slot])
            if cost.regathered(graph, v, slot, src, dst):
                continue
            part = kept_edge_bytes(cost, graph, v, slot, src, dst)
            if not part:
                continue
            shared += part
            if _collective_output(cost, v.in_shapes[slot], src, dst) is not None:
                keep(("moved", (u, idx), src, dst), part * kept.direct)  # the collective's
            else:
                keep(("root", kept.root), part * kept.share)
    return cost.activation_factor * (sum(whole.values()) - shared)


def exact_memory(graph: StrategyGraph, cost: Prices, choice: dict[str, Strategy],
                 twin: dict[str, str] | None = None) -> dict[str, float]:
    """Bytes per device by kind for a complete assignment of strategies, each kept storage
    counted once (`memory_split` plus `kept_once`; what a plan reports as its memory, whose
    sum is its peak); `twin` as for memory_split."""
    memory = memory_split(graph, cost, choice, twin)
    memory["activations"] += kept_once(graph, cost, choice)
    return memory


def in_flight(size: float, freed: bool) -> float:
    """Bytes of FSDP gathers in flight, on top of what autograd keeps, for a bucket of `size`
    gathered bytes (`freed`: its parameters are freed after forward and gathered again).

    Forward waits for a bucket (its rows and the tensors copied out of them) while the next
    bucket's all-gather is in flight: the bucket's own tensors are what autograd keeps, so two
    more. Backward, for a bucket kept gathered, holds its gradients and the buffer they are
    reduce-scattered from: two. For a bucket freed after forward, backward holds it gathered
    again, the next one's prefetch, its gradients and their reduce-scatter buffer: four."""
    return (4 if freed else 2) * size


def gathered_use_bytes(cost: Prices, graph: StrategyGraph, consumer: SNode, slot: int, src,
                       dst) -> float:
    """Bytes per device (compute dtype) input `slot` of `consumer` gathers when it is a
    parameter gathered whole from its storage `src` for its use at `dst` (FSDP); else 0."""
    u = graph.nodes[consumer.inputs[slot][0]]
    if u.kind != PARAM or single_gather(consumer.in_shapes[slot], src, dst, cost.shape) is None:
        return 0.0
    return float(cost.nbytes(local_shape(u.out_shapes[0], dst, cost.shape), u.out_dtypes[0]))


def gathered_bytes(graph: StrategyGraph, cost: Prices, choice: dict[str, Strategy]) -> float:
    """Bytes per device of FSDP gathers in flight at the worst bucket (passes/gathers.py
    `use_groups`: the buckets the rewrite emits), in the compute dtype; 0 when nothing is
    gathered. Every gathered use counts, as in the ILP's constraint: a parameter used again at
    the same placement (tied weights), which the runtime gathers once, counts again, so this
    bounds the runtime's from above."""
    size: dict[int, float] = {}
    freed: set[int] = set()
    for (name, slot), j in use_groups(graph, cost.bucket_bytes).items():
        v, u = graph.nodes[name], graph.nodes[name].inputs[slot]
        b = gathered_use_bytes(cost, graph, v, slot, choice[u[0]].out(u[1]),
                               choice[name].inputs[slot])
        if b:
            size[j] = size.get(j, 0.0) + b
            if u[0] in cost.reshard:
                freed.add(j)
    return max((in_flight(b, j in freed) for j, b in size.items()), default=0.0)


def plan_memory(graph: StrategyGraph, cost: Prices, choice: dict[str, int],
                twin: dict[str, str] | None = None) -> float:
    """Bytes per device of a complete assignment (strategy index per node): the memory
    constraint's left-hand side evaluated directly; `twin` as for memory_split."""
    return sum(memory_split(graph, cost, {n: graph.nodes[n].strategies[k]
                                          for n, k in choice.items()}, twin).values())


# -- the standard setups in closed form ---------------------------------------------------------

ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}


def zero_memory(num_params: int, devices: int, setup: str | int, precision="bf16-mixed",
                optimizer="adamw", tensors: int = 0) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state for a model of
    `num_params` parameters (`tensors` tensors) data-parallel over `devices`, for a standard
    setup: "ddp" (ZeRO stage 0), "zero1" (optimizer state sharded), "zero2" (and gradients),
    "zero3" / "fsdp" (and parameters). With mixed-precision AdamW (2 bytes of parameter, 2 of
    gradient, 12 of master weight and moments per parameter) these are ZeRO's 16 Psi,
    4 Psi + 12 Psi / N, 2 Psi + 14 Psi / N and 16 Psi / N (plus AdamW's `step` scalars, one
    per tensor on every rank, as sharding per parameter keeps them)."""
    stage = ZERO_STAGES[setup] if isinstance(setup, str) else int(setup)
    prec, opt = precision_spec(precision), optimizer_spec(optimizer)
    p = prec.compute.itemsize
    k = (prec.master or prec.compute).itemsize * (opt.states + (1 if prec.master else 0))

    def share(sharded: bool) -> float:
        return num_params / devices if sharded else num_params

    scalars = opt.scalar_bytes * tensors  # per parameter tensor, on every rank
    return {"parameters": p * share(stage >= 3), "gradients": p * share(stage >= 2),
            "optimizer": k * share(stage >= 1) + scalars}
