"""The memory model: bytes per device of a plan, per strategy, so the ILP's constraint is linear.

    peak = parameters + gradients + optimizer state + activations kept for backward

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

Every term is a function of one node's strategy or of one edge's pair of placements, so memory
is linear in the ILP's variables: sum_v sum_s m[v,s] x[v,s] + sum_e sum_{a,b} m[e,a,b] y[e,a,b].
`min_memory` solves the ILP with that objective instead of time, for the smallest peak any plan
reaches (what NoFeasiblePlan reports); `zero_memory` prices the standard ZeRO setups in closed
form.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autopar.passes.placement import local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, SNode, Strategy, StrategyGraph

if TYPE_CHECKING:
    from .cost import CostModel

GiB = 2**30
KINDS = ("parameters", "gradients", "optimizer", "activations")

_PRODUCTS = ("linear", "mm.", "bmm", "matmul", "mul.Tensor")
_SAVE_INPUT = ("gelu", "silu", "pow.Tensor_Scalar", "sin", "cos", "log.", "log1p", "abs",
               "leaky_relu", "softplus", "hardswish", "mish", "erf", "atan", "reciprocal")
_SAVE_OUTPUT = ("relu", "tanh", "sigmoid", "exp.", "rsqrt", "sqrt", "_softmax", "softmax",
                "_log_softmax", "log_softmax", "elu.", "scaled_dot_product_attention")
_SAVE_NOTHING = ("add", "sub", "neg", "cat", "stack", "to.", "_to_copy", "clone", "contiguous",
                 "mean", "sum", "zeros_like", "ones_like", "full_like", "embedding", "dropout",
                 "masked_fill.Scalar", "fill", "copy", "where", "pad", "constant_pad_nd",
                 "repeat", "roll", "tril", "triu")


def saved_slots(node: SNode, grads: tuple[bool, ...]) -> tuple[int, ...]:
    """Input slots whose tensors autograd keeps for `node`'s backward, given which inputs need
    gradients."""
    op, n = node.op, len(node.inputs)
    if op.startswith("addmm"):
        return _product_slots(grads, 1, 2)
    if op.startswith(_PRODUCTS):
        return _product_slots(grads, 0, 1) if n >= 2 else ()
    if op.startswith("div.Tensor") and n >= 2:
        return tuple(sorted({1} | ({0} if grads[1] else set()))) if any(grads) else ()
    if op.startswith("scaled_dot_product_attention"):
        # A boolean mask is kept as the float mask SDPA makes of it (`extra_saved_bytes`).
        return tuple(i for i in range(n) if not (i == 3 and _is_bool_input(node, i)))
    if op.startswith(("layer_norm", "native_layer_norm", "rms_norm", "group_norm")):
        return tuple(range(n))  # input, weight, bias (statistics: `extra_saved_bytes`)
    if op.startswith(("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                      "huber_loss", "binary_cross_entropy")):
        return tuple(range(n))  # the input (cross-entropy: its log-softmax, same size), target
    if op.startswith(("index", "gather", "index_select", "embedding_dense")):
        return tuple(range(1, n))  # the indices
    if op.startswith(_SAVE_INPUT):
        return (0,) if n else ()
    if op.startswith(_SAVE_OUTPUT) or op.startswith(_SAVE_NOTHING) or _is_view(node):
        return ()
    return tuple(range(n))  # unknown op: assume it keeps every input


def saves_output(node: SNode) -> bool:
    """Whether autograd keeps `node`'s own output(s) for its backward."""
    return node.op.startswith(_SAVE_OUTPUT)


def _product_slots(grads: tuple[bool, ...], a: int, b: int) -> tuple[int, ...]:
    out = []
    if b < len(grads) and grads[b]:
        out.append(a)  # d/dB needs A
    if a < len(grads) and grads[a]:
        out.append(b)  # d/dA needs B
    return tuple(sorted(out))


def _is_bool_input(node: SNode, slot: int) -> bool:
    call = node.call
    return call is not None and slot < len(call.inputs) and call.inputs[slot].dtype == torch.bool


def _is_view(node: SNode) -> bool:
    from .cost import is_view
    return is_view(node)


def extra_saved_bytes(cost: CostModel, node: SNode, strategy: Strategy) -> float:
    """Small tensors an op creates only for its backward: a norm's statistics, attention's
    log-sum-exp (float32 per row) and the additive mask it makes of a boolean one, dropout's
    mask (one byte per element)."""
    in_local, out_local = cost.local_shapes(node, strategy)
    op = node.op
    if op.startswith(("layer_norm", "native_layer_norm", "rms_norm")) and node.call is not None:
        normalized = len(node.call.arg(1, "normalized_shape", ()) or ())
        rows = math.prod(in_local[0][:len(in_local[0]) - normalized])
        return rows * 4 * (2 if "layer_norm" in op else 1)
    if op.startswith("scaled_dot_product_attention"):
        lse = math.prod(in_local[0][:-1]) * 4
        if len(in_local) > 3 and _is_bool_input(node, 3):
            # SDPA turns a boolean mask into an additive mask of the query's dtype, at the
            # mask's full (broadcast) shape, and keeps that for backward.
            lse += math.prod(in_local[3]) * cost.dtype(node.call.inputs[0].dtype).itemsize
        return lse
    if op.startswith("dropout") and node.call is not None and node.call.arg(1, "p", 0.0):
        return math.prod(out_local[0])
    return 0.0


@dataclass(frozen=True)
class Kept:
    """One tensor an op keeps for backward, as the graph sees it: the storage it lives in is
    its view root's (`scale` x its own elements; `held` when that is a parameter, user input
    or constant), which `share` ops keep in all; `direct` ops keep this very tensor."""

    share: int
    direct: int
    scale: float
    held: bool


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
            if v.kind == OP and _is_view(v) and v.inputs and not _copies(graph, v):
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
        return Kept(uses[r], direct[ref], scale, rv.kind in (PARAM, INPUT, CONSTANT))

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
    while u.kind == OP and _is_view(u):
        if u.op.startswith("expand"):
            return True
        u = graph.nodes[u.inputs[0][0]]
    return False


def saved_bytes(cost: CostModel, node: SNode, strategy: Strategy) -> float:
    """Bytes per device autograd keeps on account of `node` under `strategy` that depend on
    its strategy alone: its own output when its backward needs it, and the small tensors it
    creates for backward. (Its kept inputs are priced on the edges: `edge_saved_bytes`.)"""
    if node.kind != OP or not node.requires_grad:
        return 0.0
    info = cost.info.get(node.name)
    total = 0.0
    if saves_output(node):
        outs = strategy.output if node.multi_output else (strategy.output,)
        for j, (shape, p, dtype) in enumerate(zip(node.out_shapes, outs, node.out_dtypes)):
            kept = info.kept_outputs[j] if info is not None else Kept(1, 1, 1.0, False)
            total += cost.nbytes(local_shape(shape, p, cost.shape), dtype) * kept.scale / \
                kept.share
    return total + extra_saved_bytes(cost, node, strategy)


def edge_saved_bytes(cost: CostModel, graph: StrategyGraph, consumer: SNode, slot: int,
                     src, dst) -> float:
    """Bytes per device autograd keeps of input `slot` of `consumer`, produced at placements
    `src` and consumed at `dst`. The kept tensor's storage is the output of the last collective
    of the resharding (a local slice is a view of what it slices), or the producer's own
    output when nothing is communicated; a parameter's or user input's own storage is not
    counted again. A tensor kept by k ops counts 1/k at each."""
    if consumer.kind != OP or not consumer.requires_grad:
        return 0.0
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
        steps = cost.reshard_steps(shape, src, dst) if src != dst else []
    except ValueError:  # no such resharding: the edge is infeasible anyway
        return 0.0
    collectives = [s for s in steps if s.kind != "slice"]
    if collectives:  # a new tensor, shared by the ops that reshard this one alike
        return cost.nbytes(collectives[-1].out_shape, dtype) / kept.direct
    if kept.held:
        return 0.0
    return cost.nbytes(local_shape(shape, src, cost.shape), dtype) * kept.scale / kept.share


def parameter_bytes(cost: CostModel, node: SNode, storage) -> dict[str, float]:
    """Bytes per device of one parameter stored at `storage`: the parameter and its gradient
    (compute dtype), the optimizer's states and master copy (master dtype) and scalars."""
    local = math.prod(local_shape(node.out_shapes[0], storage, cost.shape))
    dtype = node.out_dtypes[0]
    compute = cost.dtype(dtype)
    master = cost.precision.master if dtype.is_floating_point else None
    opt = cost.optimizer
    state_size = (master or dtype).itemsize
    copies = opt.states + (1 if master is not None else 0)
    return {"parameters": float(local * compute.itemsize),
            "gradients": float(local * compute.itemsize),
            "optimizer": float(local * state_size * copies + opt.scalar_bytes)}


def memory_split(graph: StrategyGraph, cost: CostModel, choice: dict[str, Strategy]
                 ) -> dict[str, float]:
    """Bytes per device of a complete assignment, by kind; sums to the ILP's memory."""
    out = dict.fromkeys(KINDS, 0.0)
    for v in graph.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            for k, b in cost.param_memory_split(v, s.output).items():
                out[k] += b
        out["activations"] += cost.activation_memory(v, s)
        for slot, (u, idx) in enumerate(v.inputs):
            out["activations"] += cost.edge_memory(graph, v, slot, choice[u].out(idx),
                                                   s.inputs[slot])
    return out


def plan_memory(graph: StrategyGraph, cost: CostModel, choice: dict[str, int]) -> float:
    """Bytes per device of a complete assignment (strategy index per node): the memory
    constraint's left-hand side evaluated directly."""
    return sum(memory_split(graph, cost, {n: graph.nodes[n].strategies[k]
                                          for n, k in choice.items()}).values())


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
    from .cost import optimizer_spec, precision_spec
    stage = ZERO_STAGES[setup] if isinstance(setup, str) else int(setup)
    prec, opt = precision_spec(precision), optimizer_spec(optimizer)
    p = prec.compute.itemsize
    k = (prec.master or prec.compute).itemsize * (opt.states + (1 if prec.master else 0))

    def share(sharded: bool) -> float:
        return num_params / devices if sharded else num_params

    scalars = opt.scalar_bytes * tensors  # per parameter tensor, on every rank
    return {"parameters": p * share(stage >= 3), "gradients": p * share(stage >= 2),
            "optimizer": k * share(stage >= 1) + scalars}


# -- the smallest peak any plan reaches -----------------------------------------------------------

def min_memory(graph: StrategyGraph, cost: CostModel, forced: dict[str, list[int]] | None = None,
               time_limit: float = 30.0) -> tuple[float, dict[str, int]]:
    """The smallest memory per device over every valid plan (the intra-op ILP with memory as
    its objective), and one plan that reaches it (strategy index per node)."""
    from ortools.linear_solver import pywraplp

    from .cost import INFEASIBLE
    from .ilp import _classes, edges, node_costs

    solver = pywraplp.Solver.CreateSolver("HIGHS")
    solver.SetTimeLimit(int(time_limit * 1000))
    t = node_costs(graph, cost)
    objective = solver.Objective()
    x: dict[str, list] = {}
    for v in graph.nodes.values():
        allowed = set(forced[v.name]) if forced and v.name in forced else None
        row = []
        for k, s in enumerate(v.strategies):
            var = solver.BoolVar("")
            if (allowed is not None and k not in allowed) or t[v.name][k] == INFEASIBLE:
                var.SetUb(0)
            m = cost.node_memory(v, s)
            if m:
                objective.SetCoefficient(var, m / GiB)
            row.append(var)
        solver.Add(sum(row) == 1)
        x[v.name] = row
    for e in edges(graph):
        u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
        a_cls = _classes([s.out(e.out_index) for s in u.strategies])
        b_cls = _classes([s.inputs[e.slot] for s in v.strategies])
        y = {}
        for a in a_cls:
            for b in b_cls:
                if cost.edge_time(graph, v, e.slot, a, b) == INFEASIBLE:
                    continue
                y[(a, b)] = solver.NumVar(0, 1, "")
                m = cost.edge_memory(graph, v, e.slot, a, b)
                if m:
                    objective.SetCoefficient(y[(a, b)], m / GiB)
        for a, ks in a_cls.items():
            solver.Add(sum(y[(a, b)] for b in b_cls if (a, b) in y)
                       == sum(x[u.name][k] for k in ks))
        for b, js in b_cls.items():
            solver.Add(sum(y[(a, b)] for a in a_cls if (a, b) in y)
                       == sum(x[v.name][j] for j in js))
    objective.SetMinimization()
    status = solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise RuntimeError(f"the minimum-memory ILP found no plan (status {status})")
    choice = {n: max(range(len(row)), key=lambda k, row=row: row[k].solution_value())
              for n, row in x.items()}
    return plan_memory(graph, cost, choice), choice


def explain_infeasible(graph: StrategyGraph, cost: CostModel, budget: float,
                       forced: dict[str, list[int]] | None = None) -> str:
    """Why no plan fits `budget`: the smallest peak any plan reaches, its split, what dominates
    it (the largest contributors) and what to change."""
    try:
        peak, index = min_memory(graph, cost, forced)
    except RuntimeError as e:
        return f"no plan fits the memory budget of {_gib(budget)} per device ({e})"
    choice = {n: graph.nodes[n].strategies[k] for n, k in index.items()}
    split = memory_split(graph, cost, choice)
    dominant = max(split, key=lambda k: split[k])
    items = []
    for v in graph.nodes.values():
        s = choice[v.name]
        if dominant == "activations":
            b = cost.activation_memory(v, s) + sum(
                cost.edge_memory(graph, v, slot, choice[u].out(idx), s.inputs[slot])
                for slot, (u, idx) in enumerate(v.inputs))
            what = f"{v.name} ({v.op})"
        elif v.kind == PARAM:
            b = cost.param_memory_split(v, s.output)[dominant]
            what = v.param_name or v.name
        else:
            continue
        if b > 0:
            items.append((b, what))
    items.sort(key=lambda bw: -bw[0])
    top = "; ".join(f"{what} {_gib(b)}" for b, what in items[:3])
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in split.items())
    if dominant == "activations":
        advice = ("use a smaller batch or sequence, more devices, or pipeline stages (a mesh "
                  "dimension named \"pp\")")
    else:
        advice = ("shard over more devices, use mixed precision (precision=\"bf16-mixed\") or an "
                  "optimizer with less state (optimizer=\"sgd-momentum\")")
    styles = " under the forced styles" if forced else ""
    return (f"no plan fits the memory budget of {_gib(budget)} per device: the smallest peak any "
            f"plan reaches{styles} is {_gib(peak)} ({parts}), dominated by {dominant} (largest: "
            f"{top}). Raise memory_budget, or {advice}.")


def _gib(b: float) -> str:
    """Bytes for people: MiB below a GiB, GiB above."""
    if abs(b) < GiB:
        return f"{b / 2**20:.3f} MiB"
    return f"{b / GiB:.3f} GiB"


