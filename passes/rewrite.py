"""Rewrite the traced graph into the program one rank runs: local shapes, explicit collectives.

Every node runs its chosen strategy on local shards (through its rule's lowering when the op
cannot run unchanged). On each edge whose producer's placement differs from what the consumer
requires, the resharding steps of `autopar.solver.reshard` are emitted as calls to the
collective functions the caller supplies (`CommOps`), so this pass never imports the runtime.
A producer resharded to the same placement for several consumers is resharded once.

Two programs come out of one plan: the training program returns the loss as each rank holds it
(its placement tells the runtime how to seed backward and report it), and the inference program
returns the model's outputs whole.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.solver.reshard import BUCKET_BYTES, buckets, plan_steps

from .placement import Placements, R, local_shape
from .rules import LOWERINGS, LocalContext, TensorArg
from .strategies import CONSTANT, PARAM, SNode, Strategy, StrategyGraph
from .trace import TracedProgram


class CommOps(Protocol):
    """Autograd-aware collectives over one mesh dimension, supplied by the runtime."""

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor: ...
    def all_reduce(self, x: torch.Tensor, mesh_dim: int) -> torch.Tensor: ...
    def all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int,
                   mesh_dim: int) -> torch.Tensor: ...
    def all_gather_start(self, xs: list[torch.Tensor], dims: list[int], mesh_dim: int): ...
    def all_gather_many(self, xs: list[torch.Tensor], dims: list[int], mesh_dim: int,
                        started=None) -> tuple[torch.Tensor, ...]: ...


@dataclass
class LocalPrograms:
    """The per-rank programs and what the runtime needs to call them."""

    train: fx.GraphModule | None      # (*placeholders) -> local loss
    infer: fx.GraphModule             # (*placeholders without the target) -> flat outputs
    placeholders: list[str]           # traced placeholder names, in call order
    loss_placement: Placements | None


def _slice(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return x.narrow(dim, start, length)


def rewrite(program: TracedProgram, graph: StrategyGraph, choice: dict[str, Strategy],
            coords: tuple[int, ...], comm: CommOps) -> LocalPrograms:
    """Build the local programs for the rank at mesh `coords`."""
    mesh_shape = graph.mesh_shape
    g = fx.Graph()
    local: dict[tuple[str, Any], fx.Node] = {}  # (node, out index) -> local value node
    resharded: dict[tuple[str, Any, Placements], fx.Node] = {}
    placeholders = []

    def value(name: str, idx) -> fx.Node:
        key = (name, idx)
        if key not in local:
            base = local[(name, None)]
            local[key] = g.call_function(operator.getitem, (base, idx))
        return local[key]

    def reshard(name: str, idx, shape, src: Placements, dst: Placements) -> fx.Node:
        key = (name, idx, dst)
        if key not in resharded and key in prefetched:
            # The first use of a gathered bucket: wait for its all-gather here.
            k, started, bucket = prefetched[key]
            group = g.call_function(comm.all_gather_many,
                                    ([local[(p, None)] for p, _, _ in bucket],
                                     [d for _, _, d in bucket], k, started))
            for i, (p, d, _) in enumerate(bucket):
                resharded[(p, None, d)] = g.call_function(operator.getitem, (group, i))
        if key in resharded:
            return resharded[key]
        x = value(name, idx)
        for step in plan_steps(shape, src, dst, mesh_shape):
            k = step.mesh_dim
            if mesh_shape[k] == 1:  # one rank: every step is the identity
                continue
            if step.kind == "all_gather":
                x = g.call_function(comm.all_gather, (x, step.dim, k))
            elif step.kind == "reduce_scatter":
                x = g.call_function(comm.reduce_scatter, (x, step.dim, k))
            elif step.kind == "all_reduce":
                x = g.call_function(comm.all_reduce, (x, k))
            elif step.kind == "all_to_all":
                x = g.call_function(comm.all_to_all, (x, step.dim, step.src_dim, k))
            else:
                length = step.out_shape[step.dim]
                x = g.call_function(_slice, (x, step.dim, coords[k] * length, length))
        resharded[key] = x
        return x

    fsdp = _fsdp_gathers(graph, choice, mesh_shape)
    prefetched: dict[tuple[str, Any, Placements], tuple[int, fx.Node, list]] = {}
    gathered = False
    for node in program.graph.nodes:
        if node.op != "placeholder" and not gathered:
            # Parameters whose use is one all-gather from their storage shard (FSDP) are
            # gathered together in buckets, one collective per bucket and mesh dimension (and
            # one reduce-scatter of their gradients in backward) instead of one per parameter.
            # Every bucket's gather starts here, asynchronously, in order of first use; the
            # program waits for a bucket just before its first use (prefetching).
            for k, uses in fsdp.items():
                for bucket in buckets(uses, lambda use: _use_bytes(use, graph, mesh_shape),
                                      BUCKET_BYTES):
                    started = g.call_function(comm.all_gather_start,
                                              ([local[(p, None)] for p, _, _ in bucket],
                                               [d for _, _, d in bucket], k))
                    for p, dst, _ in bucket:
                        prefetched[(p, None, dst)] = (k, started, bucket)
            gathered = True
        if node.op == "placeholder":
            placeholders.append(node.name)
            ph = g.placeholder(node.name)
            # Parameters arrive as their local storage shard, constants and user inputs whole.
            local[(node.name, None)] = ph
            continue
        if node.op == "output":
            continue
        if node.target is operator.getitem:
            continue
        snode = graph.nodes[node.name]
        strat = choice[node.name]
        local_inputs = []
        for slot, (src_name, idx) in enumerate(snode.inputs):
            src = choice[src_name].out(idx)
            local_inputs.append(reshard(src_name, idx, snode.in_shapes[slot], src,
                                        strat.inputs[slot]))
        call = snode.call
        args, kwargs = _substitute((call.args, call.kwargs), local_inputs)
        ctx = local_context(snode, strat, mesh_shape, coords)
        lower = LOWERINGS.get(node.target) if snode.kind != CONSTANT else None
        target, args, kwargs = lower(call, args, kwargs, ctx) if lower else (
            node.target, args, kwargs)
        new = g.call_function(target, tuple(args), dict(kwargs))
        new.meta["source"] = snode.source
        new.meta["autopar_node"] = node.name  # which traced node (pipeline_split reads it)
        local[(node.name, None)] = new

    def finish(outputs: list) -> fx.GraphModule:
        gg = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in g.nodes:
            env[n] = gg.node_copy(n, lambda a: env[a])
        gg.output(pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, outputs))
        gm = fx.GraphModule(torch.nn.Module(), gg)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    model_outs = []
    for ref in graph.outputs:
        name, idx = ref
        sn = graph.nodes[name]
        shape = sn.out_shapes[idx or 0]
        src = choice[name].out(idx)
        model_outs.append(reshard(name, idx, shape, src, tuple(R for _ in mesh_shape)))
    infer = finish(model_outs)
    train, loss_placement = None, None
    if graph.loss is not None:
        name, idx = graph.loss
        loss_placement = choice[name].out(idx)
        train = finish([value(name, idx)])
    if program.has_loss:  # the inference program takes no target
        target = program.inputs[-1]
        for n in list(infer.graph.nodes):
            if n.op == "placeholder" and n.name == target and not n.users:
                infer.graph.erase_node(n)
        infer.recompile()
    return LocalPrograms(train, infer, placeholders, loss_placement)


def local_context(node: SNode, strategy: Strategy, mesh_shape: tuple[int, ...],
                  coords: tuple[int, ...]) -> LocalContext:
    """What a lowering of `node` under `strategy` needs to know of the rank at `coords`."""
    outs = strategy.output if node.multi_output else (strategy.output,)
    return LocalContext(mesh_shape, coords, strategy.inputs, strategy.output,
                        [local_shape(s, p, mesh_shape) for s, p in zip(node.out_shapes, outs)])


def _fsdp_gathers(graph: StrategyGraph, choice: dict[str, Strategy],
                  mesh_shape: tuple[int, ...]) -> dict[int, list[tuple[str, Placements, int]]]:
    """Per mesh dimension, the (parameter, use placement, tensor dim) whose resharding from
    storage is a single all-gather there, in graph order."""
    out: dict[int, list] = {}
    seen = set()
    for v in graph.nodes.values():
        for slot, (u, idx) in enumerate(v.inputs):
            if graph.nodes[u].kind != PARAM:
                continue
            dst = choice[v.name].inputs[slot]
            if (u, dst) in seen:
                continue
            seen.add((u, dst))
            steps = [s for s in plan_steps(v.in_shapes[slot], choice[u].out(idx), dst,
                                           mesh_shape) if mesh_shape[s.mesh_dim] > 1]
            if len(steps) == 1 and steps[0].kind == "all_gather":
                out.setdefault(steps[0].mesh_dim, []).append((u, dst, steps[0].dim))
    return out


def _use_bytes(use: tuple[str, Placements, int], graph: StrategyGraph,
               mesh_shape: tuple[int, ...]) -> int:
    """Bytes of a parameter gathered to its use placement."""
    v = graph.nodes[use[0]]
    return math.prod(local_shape(v.out_shapes[0], use[1], mesh_shape)) * \
        v.out_dtypes[0].itemsize


def _substitute(tree, values: list):
    """Replace the TensorArgs of an argument tree by `values`, in flattened order."""
    it = iter(values)
    return pytree.tree_map(lambda a: next(it) if isinstance(a, TensorArg) else a, tree)
