"""Rewrite the traced graph into the program one rank runs: local shapes, explicit collectives.

Every node runs its chosen strategy on local shards (through its rule's lowering when the op
cannot run unchanged). On each edge whose producer's placement differs from what the consumer
requires, the resharding steps of `autopar.passes.reshard` are emitted as calls to the
collective functions the caller supplies (`CommOps`), so this pass never imports the runtime.
A producer resharded to the same placement for several consumers is resharded once.

Two programs come out of one plan: the training program returns the loss as each rank holds it
(its placement tells the runtime how to seed backward and report it), and the inference program
returns the model's outputs whole.

Every node emitted carries an `Emitted` record (`autopar.passes.emitted`) in its meta: its
role, the traced node it computes or serves, its local shape and dtype, and for collectives
their kind and mesh dimension. Later passes read those records, never the call targets.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.fx as fx

from autopar.passes.reshard import BUCKET_BYTES, plan_steps

from .emitted import META_KEY, Emitted
from .gathers import gather_buckets
from .placement import Placements, R, local_shape
from .rules import LOWERINGS, LocalContext, TensorArg
from .strategies import CONSTANT, SNode, Strategy, StrategyGraph
from .torch_compat import tree_map
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
                        started=None, reshard: tuple[bool, ...] = ()
                        ) -> tuple[torch.Tensor, ...]: ...


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
            coords: tuple[int, ...], comm: CommOps,
            per_rank: tuple[Placements, int] | None = None,
            free_after_forward: frozenset[str] = frozenset(),
            bucket_bytes: float | None = None,
            stage_of: dict[str, int] | None = None,
            microbatches: tuple[int, dict[str, int]] | None = None) -> LocalPrograms:
    """Build the local programs for the rank at mesh `coords`. Outputs come back whole; with
    `per_rank` (the placement per-rank inputs arrive in, and the global batch), an output
    whose dimension 0 is the batch comes back as this rank's rows, as its inputs were.
    Parameters gathered whole for their use (FSDP) are gathered in buckets, each bucket's
    gather started when the previous bucket's is first waited for (one bucket in flight
    ahead of the one in use, as FSDP2 prefetches). With `stage_of` (every op's pipeline
    stage, for a program passes.pipeline_split cuts into stages) buckets stay within a
    stage, so that each stage's program gathers and prefetches its own parameters; a
    parameter used in several stages is gathered alone in each. The gathered copies of the
    parameters in `free_after_forward` (graph node names) are marked to be freed after
    forward and gathered again for backward (the runtime's regathering,
    runtime/regather.py). Buckets hold about `bucket_bytes` (default BUCKET_BYTES).
    `microbatches` (m, {op: dimension}): the program runs once per microbatch of a batch m
    times larger, and these ops' outputs carry the batch on that dimension
    (passes/batch_local.py batch_dims; random ops then draw the whole batch's tensor)."""
    mesh_shape = graph.mesh_shape
    g = fx.Graph()
    local: dict[tuple[str, Any], fx.Node] = {}  # (node, out index) -> local value node
    resharded: dict[tuple[str, Any, Placements], fx.Node] = {}
    placeholders = []

    def emit(target, args: tuple, record: Emitted, kwargs: dict | None = None) -> fx.Node:
        node = g.call_function(target, args, kwargs)
        node.meta[META_KEY] = record
        return node

    def value(name: str, idx) -> fx.Node:
        key = (name, idx)
        if key not in local:
            base = local[(name, None)]
            local[key] = emit(operator.getitem, (base, idx),
                              _value_record("getitem", graph, choice, name, idx))
        return local[key]

    def reshard(name: str, idx, shape, src: Placements, dst: Placements,
                consumer: str | None) -> fx.Node:
        key = (name, idx, dst)
        if key not in resharded and key in prefetched:
            # The first use of a gathered bucket: start the next bucket's all-gather, then
            # wait for this one's here.
            k, j = prefetched[key]
            bucket = chains[k][j]
            start(k, j + 1)
            group = emit(comm.all_gather_many,
                         ([local[(p, None)] for p, _, _ in bucket], [d for _, _, d in bucket],
                          k, started[(k, j)], tuple(p in free_after_forward for p, _, _ in bucket)),
                         Emitted("gather_wait", None, collective="all_gather", mesh_dim=k,
                                 consumer=consumer))
            for i, (p, d, _) in enumerate(bucket):
                resharded[(p, None, d)] = emit(
                    operator.getitem, (group, i),
                    _value_record("gathered", graph, choice, p, None, placements=d,
                                  collective="all_gather", mesh_dim=k, consumer=consumer))
        if key in resharded:
            return resharded[key]
        x = value(name, idx)
        record = _value_record("collective", graph, choice, name, idx, consumer=consumer)
        for step in plan_steps(shape, src, dst, mesh_shape):
            k = step.mesh_dim
            if mesh_shape[k] == 1:  # one rank: every step is the identity
                continue
            if step.kind == "all_gather":
                target, args = comm.all_gather, (x, step.dim, k)
            elif step.kind == "reduce_scatter":
                target, args = comm.reduce_scatter, (x, step.dim, k)
            elif step.kind == "all_reduce":
                target, args = comm.all_reduce, (x, k)
            elif step.kind == "all_to_all":
                target, args = comm.all_to_all, (x, step.dim, step.src_dim, k)
            else:
                length = step.out_shape[step.dim]
                target, args = _slice, (x, step.dim, coords[k] * length, length)
            x = emit(target, args, replace(
                record, role="slice" if step.kind == "slice" else "collective",
                shape=tuple(step.out_shape), mesh_dim=k,
                collective=None if step.kind == "slice" else step.kind))
        resharded[key] = x
        return x

    # Parameters whose use is one all-gather from their storage shard (FSDP) are gathered
    # together in buckets, one collective per bucket and mesh dimension (and one
    # reduce-scatter of their gradients in backward) instead of one per parameter, in order of
    # first use: the first bucket's gather starts before the first op, asynchronously, and
    # each next one when the program first waits for the one before (prefetching).
    limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    chains = gather_buckets(graph, choice, limit, stage_of)
    prefetched: dict[tuple[str, Any, Placements], tuple[int, int]] = {
        (p, None, dst): (k, j) for k, chain in chains.items()
        for j, bucket in enumerate(chain) for p, dst, _ in bucket}
    started: dict[tuple[int, int], fx.Node] = {}

    def start(k: int, j: int) -> None:
        if j < len(chains[k]) and (k, j) not in started:
            bucket = chains[k][j]
            started[(k, j)] = emit(comm.all_gather_start,
                                   ([local[(p, None)] for p, _, _ in bucket],
                                    [d for _, _, d in bucket], k),
                                   Emitted("gather_start", None, collective="all_gather",
                                           mesh_dim=k))

    gathered = False
    for node in program.graph.nodes:
        if node.op != "placeholder" and not gathered:
            for k in chains:
                start(k, 0)
            gathered = True
        if node.op == "placeholder":
            placeholders.append(node.name)
            ph = g.placeholder(node.name)
            # Parameters arrive as their local storage shard, constants and user inputs whole.
            ph.meta[META_KEY] = _value_record("placeholder", graph, choice, node.name, None) \
                if node.name in graph.nodes else Emitted("placeholder", node.name)
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
                                        strat.inputs[slot], node.name))
        call = snode.call
        args, kwargs = _substitute((call.args, call.kwargs), local_inputs)
        ctx = local_context(snode, strat, mesh_shape, coords)
        if microbatches is not None and node.name in microbatches[1]:
            ctx = replace(ctx, microbatches=(microbatches[1][node.name], microbatches[0]))
        lower = LOWERINGS.get(node.target) if snode.kind != CONSTANT else None
        target, args, kwargs = lower(call, args, kwargs, ctx) if lower else (
            node.target, args, kwargs)
        new = emit(target, tuple(args), _value_record("op", graph, choice, node.name, None),
                   dict(kwargs))
        new.meta["source"] = snode.source
        local[(node.name, None)] = new

    def finish(outputs: list, unused: str | None = None) -> fx.GraphModule:
        """The program computing `outputs`, without dead code or placeholder `unused` (when
        nothing reads it); compiled once (a GraphModule compiles its graph when made)."""
        gg = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in g.nodes:
            env[n] = gg.node_copy(n, lambda a: env[a])
        gg.output(tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, outputs))
        gg.eliminate_dead_code()
        for n in list(gg.nodes):
            if n.op == "placeholder" and n.name == unused and not n.users:
                gg.erase_node(n)
        return fx.GraphModule(torch.nn.Module(), gg)

    model_outs = []
    for ref in graph.outputs:
        name, idx = ref
        sn = graph.nodes[name]
        shape = sn.out_shapes[idx or 0]
        src = choice[name].out(idx)
        dst = tuple(R for _ in mesh_shape)
        if per_rank is not None and shape and shape[0] == per_rank[1]:
            dst = per_rank[0]
        model_outs.append(reshard(name, idx, shape, src, dst, None))
    # the inference program takes no target
    infer = finish(model_outs, program.inputs[-1] if program.has_loss else None)
    train, loss_placement = None, None
    if graph.loss is not None:
        name, idx = graph.loss
        loss_placement = choice[name].out(idx)
        train = finish([value(name, idx)])
    return LocalPrograms(train, infer, placeholders, loss_placement)


def _value_record(role: str, graph: StrategyGraph, choice: dict[str, Strategy], name: str,
                  idx: int | None, placements: Placements | None = None, **more) -> Emitted:
    """The record of a node holding output `idx` of traced node `name` (at `placements`,
    default its chosen output placement); the whole tuple of a multi-output node has no
    shape."""
    v = graph.nodes[name]
    if v.multi_output and idx is None:
        return Emitted(role, name, **more)
    dtype = v.out_dtypes[idx or 0]
    placements = choice[name].out(idx) if placements is None else placements
    shape = tuple(local_shape(v.out_shapes[idx or 0], placements, graph.mesh_shape))
    return Emitted(role, name, idx, shape, dtype, v.requires_grad and dtype.is_floating_point,
                   **more)


def local_context(node: SNode, strategy: Strategy, mesh_shape: tuple[int, ...],
                  coords: tuple[int, ...]) -> LocalContext:
    """What a lowering of `node` under `strategy` needs to know of the rank at `coords`."""
    outs = strategy.output if node.multi_output else (strategy.output,)
    return LocalContext(mesh_shape, coords, strategy.inputs, strategy.output,
                        [local_shape(s, p, mesh_shape) for s, p in zip(node.out_shapes, outs)])


def _substitute(tree, values: list):
    """Replace the TensorArgs of an argument tree by `values`, in flattened order."""
    it = iter(values)
    return tree_map(lambda a: next(it) if isinstance(a, TensorArg) else a, tree)
