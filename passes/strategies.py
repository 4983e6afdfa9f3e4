"""Candidate strategies for every node of a traced graph, from the sharding-rule registry.

The result, a `StrategyGraph`, is plain data for the solver: nodes in topological order, each with
its shapes, the producers of its tensor inputs and its list of n-D strategies (one placement per
mesh dimension for every input and output). A strategy on an n-D mesh is a product of the op's
1-D rules, kept when every sharded dimension divides evenly by the number of pieces.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .graph_queries import module_path, source_line
from .placement import P, Placements, R, Shard, divisible, fmt, interned
from .rules import RULES, OpCall, OpFacts, Rule1D, TensorArg, facts_of, replicate_all
from .rules.registry import UNKNOWN
from .torch_compat import tree_leaves, tree_map
from .trace import TracedProgram
from .zero import STAGES, zero_shard

INPUT, PARAM, CONSTANT, OP = "input", "param", "constant", "op"
# Why an op has no sharded strategy (SNode.replicated_only).
NO_RULE = "no sharding rule"
INDIVISIBLE = "no sharded strategy divides its shapes by the mesh"
WRITES = "updates state in place"
RULE_REPLICATES = "its rule shards no input for these arguments"

# Ops that create tensors from nothing but shapes; they and everything computed only from them
# (and from buffers) are constants, computed whole on every rank.
_CREATION = {
    torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step,
    torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default,
    torch.ops.aten.empty.memory_format, torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.eye.default, torch.ops.aten.rand.default, torch.ops.aten.randn.default,
    torch.ops.aten.tensor.default if hasattr(torch.ops.aten, "tensor") else None,
}


@dataclass(frozen=True)
class Strategy:
    """Placements (one per mesh dimension) of each tensor input and of the output(s)."""

    inputs: tuple[Placements, ...]
    output: Placements | tuple[Placements, ...]
    # a parameter stored at `output` whose optimizer state (1), and gradient (2), are sharded
    # over its data-parallel ranks: ZeRO (passes/zero.py); 0 for everything else
    zero: int = 0

    def out(self, index: int | None) -> Placements:
        """Placements of output `index` (None for single-output nodes)."""
        return self.output if index is None else self.output[index]


@dataclass
class SNode:
    """One node of the strategy graph."""

    name: str
    kind: str                      # input | param | constant | op
    op: str                        # printable op name ('' for placeholders)
    inputs: list[tuple[str, int | None]]  # producer name, output index (None: single output)
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    out_dtypes: list[torch.dtype]
    multi_output: bool
    requires_grad: bool
    strategies: list[Strategy]
    call: OpCall | None = None     # what the rule saw (None for placeholders)
    source: str = ""               # the model line, when FX recorded it
    param_name: str | None = None  # the model's parameter name (PARAM nodes)
    module: str = ""               # the model's module that runs it ("" for the model itself)
    # why every candidate is replicated, when none shards: NO_RULE, INDIVISIBLE or WRITES
    replicated_only: str = ""

    @property
    def facts(self) -> OpFacts:
        """What pricing needs to know of the op this node runs (passes/rules; UNKNOWN for
        placeholders and ops nobody described)."""
        return facts_of(self.call.target) if self.call is not None else UNKNOWN


@dataclass
class StrategyGraph:
    """Nodes in topological order, plus what the program must return."""

    nodes: dict[str, SNode]
    mesh_shape: tuple[int, ...]
    loss: tuple[str, int | None] | None     # the loss value, required replicated
    outputs: list[tuple[str, int | None]]   # the model's flattened outputs
    unsupported: list[str] = field(default_factory=list)
    # the dtype the program was traced in under mixed precision (None: the model's own): its
    # float32 tensors are the ones the model computes in float32 on purpose
    compute_dtype: torch.dtype | None = None
    # what later stages work out once per graph (solver/cost.py: consumers per tensor,
    # parameter shares); not copied by dataclasses.replace
    analyses: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def _vals(node: fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def op_call(node: fx.Node) -> tuple[OpCall, list[fx.Node]]:
    """Describe a call_function node to the rules: tensor arguments become `TensorArg`s, numbered
    in flattened-argument order."""
    tensors: list[fx.Node] = []

    def to_arg(a):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            val = a.meta["val"]
            t = TensorArg(len(tensors), tuple(int(s) for s in val.shape), val.dtype,
                          tuple(int(s) for s in val.stride())
                          if val.layout == torch.strided else None)
            tensors.append(a)
            return t
        return a

    args = tree_map(to_arg, node.args)
    kwargs = tree_map(to_arg, dict(node.kwargs))
    vals = _vals(node)
    multi = isinstance(node.meta.get("val"), (list, tuple))
    shapes = [tuple(int(s) for s in v.shape) for v in vals if isinstance(v, torch.Tensor)]
    call = OpCall(node.name, node.target, args, kwargs, _tensor_args(args, kwargs), shapes, multi)
    return call, tensors


def _tensor_args(args, kwargs) -> list[TensorArg]:
    leaves = tree_leaves((args, kwargs))
    return [a for a in leaves if isinstance(a, TensorArg)]


def expand_to_mesh(rules: list[Rule1D], mesh_shape: tuple[int, ...], in_shapes, out_shapes,
                   multi: bool) -> list[Strategy]:
    """n-D strategies: the product of the 1-D rules, filtered to even splits."""
    out = []
    seen = set()
    # On a mesh dimension of one device every placement is the whole tensor: keep the
    # replicated strategy only (its lowering is the plain op).
    whole = [r for r in rules if _all_replicated(r)] or rules
    for combo in itertools.product(*(whole if n == 1 else rules for n in mesh_shape)):
        inputs = tuple(tuple(r.inputs[i] for r in combo) for i in range(len(in_shapes)))
        if multi:
            output = tuple(tuple(r.output[i] for r in combo) for i in range(len(out_shapes)))
            outs = list(output)
        else:
            output = tuple(r.output for r in combo)
            outs = [output]
        if not all(divisible(s, p, mesh_shape) for s, p in zip(in_shapes, inputs)):
            continue
        if not all(divisible(s, p, mesh_shape) for s, p in zip(out_shapes, outs)):
            continue
        s = Strategy(inputs, output)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def replicated(strategy: Strategy) -> bool:
    """Whether a strategy runs its op whole on every rank: every input and output
    replicated on every mesh dimension."""
    outs = strategy.output if isinstance(strategy.output[0], tuple) else (strategy.output,)
    return all(isinstance(p, type(R)) for ps in (*strategy.inputs, *outs) for p in ps)


def _all_replicated(rule: Rule1D) -> bool:
    outs = rule.output if isinstance(rule.output, tuple) else (rule.output,)
    return all(isinstance(p, type(R)) for p in (*rule.inputs, *outs))


def build(program: TracedProgram, mesh_shape: tuple[int, ...],
          input_placement: Placements | None = None, zero: bool = False) -> StrategyGraph:
    """Candidate strategies for every node of `program` on a mesh of `mesh_shape`.

    User inputs arrive whole on every rank (consumers cut their block for free), or, with
    `input_placement`, as each rank's block of that placement (per-rank inputs). With `zero`,
    a parameter that trains also has its ZeRO-1 and ZeRO-2 candidates (passes/zero.py) after
    the plain ones."""
    mesh_shape = tuple(mesh_shape)
    nodes: dict[str, SNode] = {}
    unsupported: list[str] = []
    constant: set[str] = set()
    grad: set[str] = set()
    output_node = None
    memo: dict = {}  # candidates by call (or parameter shape)
    for node in program.graph.nodes:
        if node.op == "output":
            output_node = node
            continue
        if node.op == "get_attr":
            raise ValueError(f"unexpected get_attr node {node.name} in the traced graph")
        if node.op == "placeholder":
            nodes[node.name] = _input_node(node, program, mesh_shape, input_placement, zero,
                                           memo, constant, grad)
            continue
        if node not in program.op_calls:  # the same on every mesh
            call, tensor_nodes = op_call(node)
            program.op_calls[node] = call, tensor_nodes, repr(
                (node.target, call.args, call.kwargs, call.out_shapes))
        call, tensor_nodes, key = program.op_calls[node]
        # getitem nodes are folded into their consumers' edges (producer, output index).
        if node.target is operator.getitem:
            src = node.args[0]
            nodes[node.name] = None  # placeholder, removed after the loop
            if src.name in constant:
                constant.add(node.name)
            if src.name in grad:
                grad.add(node.name)
            continue
        inputs = [_resolve(a) for a in tensor_nodes]
        is_const = all(name in constant for name, _ in inputs) and (
            inputs or node.target in _CREATION or not call.inputs)
        req_grad = any(name in grad for name, _ in inputs) and any(
            v.dtype.is_floating_point for v in _vals(node) if isinstance(v, torch.Tensor))
        in_shapes = [t.shape for t in call.inputs]
        if is_const:
            constant.add(node.name)
            outs = tuple(tuple(R for _ in mesh_shape) for _ in call.out_shapes)
            strategies = [Strategy(tuple(tuple(R for _ in mesh_shape) for _ in in_shapes),
                                   outs if call.multi_output else outs[0])]
            kind = CONSTANT
            why = ""
        else:
            kind = OP
            why = INDIVISIBLE
            if node.target not in RULES:
                unsupported.append(str(node.target))
                why = NO_RULE
            # Repeated layers make the same calls: enumerate each distinct call once (`key`).
            if node.name in program.writes:
                # An op that writes into a buffer or input runs whole on every rank, so that
                # every rank's copy takes the single-device update.
                strategies = expand_to_mesh(replicate_all(call), mesh_shape, in_shapes,
                                            call.out_shapes, call.multi_output)
                why = WRITES
            else:
                if key not in memo:
                    memo[key] = _candidates(call, mesh_shape, in_shapes)
                strategies = memo[key]
        if req_grad:
            grad.add(node.name)
        vals = [v for v in _vals(node) if isinstance(v, torch.Tensor)]
        nodes[node.name] = SNode(
            node.name, kind, _op_name(node.target), inputs, in_shapes, call.out_shapes,
            [v.dtype for v in vals], call.multi_output, req_grad, strategies, call,
            source_line(node), module=module_path(node, program.module_prefix),
            replicated_only=_why_replicated(why, call) if kind == OP and all(
                map(replicated, strategies)) else "")
    nodes = {k: v for k, v in nodes.items() if v is not None}
    _intern(nodes)
    flat_out = [_resolve(a) if isinstance(a, fx.Node) else None
                for a in tree_leaves(output_node.args[0])]
    loss = flat_out[-1] if program.has_loss else None
    outputs = flat_out[:program.num_outputs]
    for name in sorted(set(unsupported)):
        warnings.warn(f"autopar: no sharding rule for {name}; it runs replicated: every rank "
                      "computes it whole, which is exact but gains nothing from the mesh. "
                      "print(plan) marks the modules that run it ('no rule'); written with "
                      "other torch ops, the plan may shard them.", stacklevel=2)
    return StrategyGraph(nodes, mesh_shape, loss, outputs, sorted(set(unsupported)),
                         program.compute_dtype)


def _input_node(node: fx.Node, program: TracedProgram, mesh_shape: tuple[int, ...],
                input_placement: Placements | None, zero: bool, memo: dict, constant: set[str],
                grad: set[str]) -> SNode:
    """The node of a graph input: a parameter (its storage candidates; ZeRO's with `zero`),
    a buffer (a constant, whole) or a user input (whole, or per rank at `input_placement`).
    Adds trained parameters to `grad` and buffers to `constant`."""
    val = node.meta["val"]
    shape = tuple(int(s) for s in val.shape)
    if node.name in program.params:
        # An inference program (no loss) needs no gradient: priced as such (no backward,
        # nothing kept for it, parameters stored only).
        trains = node.name not in program.frozen and program.has_loss
        if trains:
            grad.add(node.name)
        # parameters of one shape share their list (as ops of one call do)
        key = ("param", shape, trains and zero)
        if key not in memo:
            cands = _storage_placements(shape, mesh_shape)
            memo[key] = [Strategy((), c) for c in cands] + (
                [Strategy((), c, stage) for c in cands for stage in STAGES
                 if zero_shard(shape, c, mesh_shape) is not None]
                if trains and zero else [])
        return SNode(node.name, PARAM, "", [], [], [shape], [val.dtype], False, trains,
                     memo[key], None, "", program.params.get(node.name))
    if node.name in program.buffers:
        kind = CONSTANT
        cands = [tuple(R for _ in mesh_shape)]
        constant.add(node.name)
    else:
        kind = INPUT
        cands = [input_placement or tuple(R for _ in mesh_shape)]
        if not divisible(shape, cands[0], mesh_shape):
            raise ValueError(
                f"input {node.name} of shape {shape} does not split evenly into "
                f"per-rank slices over mesh {mesh_shape} ({fmt(cands[0])}); use a "
                "batch divisible by the number of slices")
    return SNode(node.name, kind, "", [], [], [shape], [val.dtype], False, node.name in grad,
                 [Strategy((), c) for c in cands], None, "")


def _intern(nodes: dict[str, SNode]) -> None:
    """Every strategy's placements interned (passes/placement.py `interned`), in place; nodes
    that share one list of strategies keep sharing it."""
    done: dict[int, tuple[list, list[Strategy]]] = {}  # id -> (the list, its interned one)
    for v in nodes.values():
        if id(v.strategies) not in done:
            done[id(v.strategies)] = v.strategies, [Strategy(
                tuple(interned(p) for p in s.inputs),
                tuple(interned(o) for o in s.output) if v.multi_output else interned(s.output),
                s.zero) for s in v.strategies]
        v.strategies = done[id(v.strategies)][1]


def _candidates(call: OpCall, mesh_shape: tuple[int, ...], in_shapes) -> list[Strategy]:
    """The n-D strategies of one call: its rule's (or replicate-all) expanded to the mesh."""
    rule = RULES.get(call.target)
    rules1d = rule(call) if rule is not None else replicate_all(call)
    rules1d = [r for r in rules1d if ints_not_partial(r, call)]
    strategies = expand_to_mesh(rules1d, mesh_shape, in_shapes, call.out_shapes,
                                call.multi_output)
    if not strategies:  # nothing divides evenly: replicate
        strategies = expand_to_mesh(replicate_all(call), mesh_shape, in_shapes,
                                    call.out_shapes, call.multi_output)
    return strategies


def _why_replicated(why: str, call: OpCall) -> str:
    """Why an op whose every candidate is replicated has no sharded one."""
    if why == INDIVISIBLE and not any(not _all_replicated(r) for r in RULES[call.target](call)):
        return RULE_REPLICATES
    return why


def _resolve(a: fx.Node) -> tuple[str, int | None]:
    """The (producer, output index) a graph value refers to."""
    if a.op == "call_function" and a.target is operator.getitem:
        return (a.args[0].name, a.args[1])
    return (a.name, None)


def _op_name(target) -> str:
    name = str(target)
    return name.removeprefix("aten.")


def ints_not_partial(rule: Rule1D, call: OpCall) -> bool:
    """A pending sum of integers or booleans is never what a rule means."""
    outs = rule.output if isinstance(rule.output, tuple) else (rule.output,)
    if any(isinstance(p, type(P)) for p in outs):
        return all(t.dtype.is_floating_point for t in call.inputs
                   if isinstance(rule.inputs[t.index], type(P)))
    return True


def _storage_placements(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Placements]:
    """Where a parameter may live (or how an input may be split): replicated or sharded on any
    dimension, per mesh dimension; never a pending sum."""
    one = [R] + [Shard(d) for d in range(len(shape)) if shape[d] > 1]
    out = []
    for combo in itertools.product(*([R] if n == 1 else one for n in mesh_shape)):
        if divisible(shape, combo, mesh_shape):
            out.append(tuple(combo))
    return out
