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
            microbatches: tuple[int, dict[str, int]] | None = None,
            randomness: str = "eager") -> LocalPrograms:
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
    (passes/batch_local.py batch_dims; random ops then draw the whole batch's tensor).
    `randomness`: how random ops draw ("eager" or "counter": passes/rules/random.py)."""
    rank = _RankProgram(graph, choice, coords, comm, free_after_forward,
                        gather_buckets(graph, choice, BUCKET_BYTES if bucket_bytes is None
                                       else bucket_bytes, stage_of))
    for node in program.graph.nodes:
        if node.op == "placeholder":
            rank.placeholder(node.name)
            continue
        rank.start_buckets()  # before the first op (or the outputs, in a program of none)
        if node.op != "output" and node.target is not operator.getitem:
            rank.op(node, microbatches, randomness)
    return rank.programs(program, per_rank)


class _RankProgram:
    """One rank's program as it is emitted, op by op: each traced op's local op, the
    resharding collectives its inputs need, and the FSDP gathers in buckets.

    Parameters whose use is one all-gather from their storage shard (FSDP) are gathered
    together in buckets (`chains`, per mesh dimension), one collective per bucket and mesh
    dimension (and one reduce-scatter of their gradients in backward) instead of one per
    parameter, in order of first use: the first bucket's gather starts before the first op,
    asynchronously, and each next one when the program first waits for the one before
    (prefetching)."""

    def __init__(self, graph: StrategyGraph, choice: dict[str, Strategy],
                 coords: tuple[int, ...], comm: CommOps, free_after_forward: frozenset[str],
                 chains: dict):
        self.graph, self.choice, self.coords, self.comm = graph, choice, coords, comm
        self.free_after_forward = free_after_forward
        self.mesh_shape = graph.mesh_shape
        self.g = fx.Graph()
        self.local: dict[tuple[str, Any], fx.Node] = {}  # (node, out index) -> local value
        self.resharded: dict[tuple[str, Any, Placements], fx.Node] = {}
        self.placeholders: list[str] = []
        self.chains = chains
        self.prefetched: dict[tuple[str, Any, Placements], tuple[int, int]] = {
            (p, None, dst): (k, j) for k, chain in chains.items()
            for j, bucket in enumerate(chain) for p, dst, _ in bucket}
        self.started: dict[tuple[int, int], fx.Node] = {}
        self.gathering = False

    def emit(self, target, args: tuple, record: Emitted, kwargs: dict | None = None) -> fx.Node:
        node = self.g.call_function(target, args, kwargs)
        node.meta[META_KEY] = record
        return node

    def record(self, role: str, name: str, idx, **more) -> Emitted:
        return _value_record(role, self.graph, self.choice, name, idx, **more)

    def value(self, name: str, idx) -> fx.Node:
        """The local value of output `idx` of traced node `name`."""
        key = (name, idx)
        if key not in self.local:
            base = self.local[(name, None)]
            self.local[key] = self.emit(operator.getitem, (base, idx),
                                        self.record("getitem", name, idx))
        return self.local[key]

    def placeholder(self, name: str) -> None:
        """A program input: parameters arrive as their local storage shard, constants and
        user inputs whole."""
        self.placeholders.append(name)
        ph = self.g.placeholder(name)
        ph.meta[META_KEY] = self.record("placeholder", name, None) \
            if name in self.graph.nodes else Emitted("placeholder", name)
        self.local[(name, None)] = ph

    def start_buckets(self) -> None:
        """Before the first op: start the first bucket's gather on every mesh dimension."""
        if not self.gathering:
            for k in self.chains:
                self.start(k, 0)
            self.gathering = True

    def start(self, k: int, j: int) -> None:
        """Start bucket j's all-gather on mesh dimension k (once)."""
        if j < len(self.chains[k]) and (k, j) not in self.started:
            bucket = self.chains[k][j]
            self.started[(k, j)] = self.emit(
                self.comm.all_gather_start,
                ([self.local[(p, None)] for p, _, _ in bucket], [d for _, _, d in bucket], k),
                Emitted("gather_start", None, collective="all_gather", mesh_dim=k))

    def wait_bucket(self, key, consumer: str | None) -> None:
        """The first use of a gathered bucket: start the next bucket's all-gather, then wait
        for this one's here."""
        k, j = self.prefetched[key]
        bucket = self.chains[k][j]
        self.start(k, j + 1)
        group = self.emit(self.comm.all_gather_many,
                          ([self.local[(p, None)] for p, _, _ in bucket],
                           [d for _, _, d in bucket], k, self.started[(k, j)],
                           tuple(p in self.free_after_forward for p, _, _ in bucket)),
                          Emitted("gather_wait", None, collective="all_gather", mesh_dim=k,
                                  consumer=consumer))
        for i, (p, d, _) in enumerate(bucket):
            self.resharded[(p, None, d)] = self.emit(
                operator.getitem, (group, i),
                self.record("gathered", p, None, placements=d, collective="all_gather",
                            mesh_dim=k, consumer=consumer))

    def reshard(self, name: str, idx, shape, src: Placements, dst: Placements,
                consumer: str | None) -> fx.Node:
        """Output `idx` of `name` at placements `dst`: the collectives (or local slices) of
        the resharding from `src`, emitted once per destination."""
        key = (name, idx, dst)
        if key not in self.resharded and key in self.prefetched:
            self.wait_bucket(key, consumer)
        if key in self.resharded:
            return self.resharded[key]
        x = self.value(name, idx)
        record = self.record("collective", name, idx, consumer=consumer)
        comm, mesh_shape = self.comm, self.mesh_shape
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
                target, args = _slice, (x, step.dim, self.coords[k] * length, length)
            x = self.emit(target, args, replace(
                record, role="slice" if step.kind == "slice" else "collective",
                shape=tuple(step.out_shape), mesh_dim=k,
                collective=None if step.kind == "slice" else step.kind))
        self.resharded[key] = x
        return x

    def op(self, node: fx.Node, microbatches, randomness: str = "eager") -> None:
        """Traced op `node` on this rank: its inputs resharded to the chosen strategy, then
        its lowering (passes/rules) or the op itself on local tensors."""
        snode = self.graph.nodes[node.name]
        strat = self.choice[node.name]
        local_inputs = []
        for slot, (src_name, idx) in enumerate(snode.inputs):
            src = self.choice[src_name].out(idx)
            local_inputs.append(self.reshard(src_name, idx, snode.in_shapes[slot], src,
                                             strat.inputs[slot], node.name))
        call = snode.call
        args, kwargs = _substitute((call.args, call.kwargs), local_inputs)
        ctx = replace(local_context(snode, strat, self.mesh_shape, self.coords),
                      randomness=randomness, comm=self.comm)
        if microbatches is not None and node.name in microbatches[1]:
            ctx = replace(ctx, microbatches=(microbatches[1][node.name], microbatches[0]))
        lower = LOWERINGS.get(node.target) if snode.kind != CONSTANT else None
        target, args, kwargs = lower(call, args, kwargs, ctx) if lower else (
            node.target, args, kwargs)
        new = self.emit(target, tuple(args), self.record("op", node.name, None), dict(kwargs))
        new.meta["source"] = snode.source
        self.local[(node.name, None)] = new

    def finish(self, outputs: list, unused: str | None = None) -> fx.GraphModule:
        """The program computing `outputs`, without dead code or placeholder `unused` (when
        nothing reads it); compiled once (a GraphModule compiles its graph when made)."""
        gg = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.g.nodes:
            env[n] = gg.node_copy(n, lambda a: env[a])
        gg.output(tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, outputs))
        gg.eliminate_dead_code()
        for n in list(gg.nodes):
            if n.op == "placeholder" and n.name == unused and not n.users:
                gg.erase_node(n)
        return fx.GraphModule(torch.nn.Module(), gg)

    def programs(self, program: TracedProgram, per_rank) -> LocalPrograms:
        """The inference program (outputs whole, or per-rank rows as the inputs came; no
        target) and the training program (the local loss)."""
        model_outs = []
        for name, idx in self.graph.outputs:
            shape = self.graph.nodes[name].out_shapes[idx or 0]
            dst = tuple(R for _ in self.mesh_shape)
            if per_rank is not None and shape and shape[0] == per_rank[1]:
                dst = per_rank[0]
            model_outs.append(self.reshard(name, idx, shape, self.choice[name].out(idx), dst,
                                           None))
        infer = self.finish(model_outs, program.inputs[-1] if program.has_loss else None)
        train, loss_placement = None, None
        if self.graph.loss is not None:
            name, idx = self.graph.loss
            loss_placement = self.choice[name].out(idx)
            train = self.finish([self.value(name, idx)])
        return LocalPrograms(train, infer, self.placeholders, loss_placement)


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
