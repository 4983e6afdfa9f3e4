"""The cost model: seconds of compute and communication, bytes of memory, per strategy and edge.

Everything is seconds or bytes, per device, for one training step (forward + backward).

- compute: roofline per op on local shapes, max(flops / peak, bytes / memory bandwidth) plus a
  launch floor, forward and backward priced separately. A product (linear, mm, bmm, addmm,
  matmul) computes one product per operand that needs a gradient in backward (2x its forward
  flops for a hidden layer, 1x for the first layer, whose input needs none); attention
  (QK^T and PV, 4 B H L S E flops, half of it under a causal mask) costs 2x its forward in
  backward; other ops cost their forward again. A random op (dropout, rand_like, SDPA with
  dropout) also draws: in eager randomness its whole tensor on every rank, whatever the
  sharding (each rank keeps its block of the single-device draw), DRAW_FLOPS per element in
  forward; in counter randomness its block (`draw_time`). A profile of measured op times
  (autopar.profile, keyed by `op_key`: op, local shapes, dtypes, arguments) replaces the
  roofline for every op it holds.
- communication: alpha-beta per mesh dimension: alpha + factor * bytes / bandwidth with the ring
  algorithm factors all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n on the gathered
  size, all-to-all (n-1)/n on the local size. A tensor that carries a gradient pays each
  collective's dual in backward as well (same bytes).
- gradient synchronization: a parameter stored replicated on a mesh dimension gets its gradient
  all-reduced there (the local gradient of a replicated value is a pending sum), in buckets;
  under ZeRO (passes/zero.py) reduce-scattered, and its stepped shards all-gathered.
- memory (solver/memory.py): parameters, gradients and optimizer state per storage placement,
  plus the tensors autograd keeps for backward, per strategy and per resharding edge.
- precision: "fp32", or "bf16-mixed" (parameters, activations, gradients and collectives in
  bfloat16; float32 master weights and optimizer state).

`CostModel` holds the settings and puts the parts together: compute prices
(solver/compute_cost.py `ComputePrices`), communication prices (solver/comm_cost.py
`CommPrices`), memory (solver/memory.py) and what a whole node or edge costs, by where it runs
(here).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple

import torch

from autopar.passes.placement import Placements, as_tuple
from autopar.passes.recompute import NONE as NO_RECOMPUTE
from autopar.passes.recompute import Recompute
from autopar.passes.reshard import BUCKET_BYTES, ReshardError
from autopar.passes.strategies import PARAM, SNode, Strategy, StrategyGraph

from . import memory as mem
from .comm_cost import ALGO_FACTOR, DUAL, INFEASIBLE, CommPrices
from .compute_cost import COUNTER_DRAW_OPS, DRAW_FLOPS, ComputePrices, OpKinds
from .flops import backward_factor, drawn_elements, is_view, op_flops
from .specs import OptimizerSpec, Precision, numel, optimizer_spec, precision_spec


class Split(NamedTuple):
    """Seconds of one price by where they run: on the critical path (compute, and collectives
    compute waits for) in forward and backward, and beside compute (collectives the runtime
    issues ahead of need on their own stream) in forward and backward. Their sum is the
    price; a step takes `step_seconds` of the sums."""

    forward: float
    backward: float
    side_forward: float
    side_backward: float

    def plus(self, other: Split, times: float = 1.0) -> Split:
        """The sum with `times` x `other`."""
        # spelled out, and made without the named constructor's Python-level __new__:
        # building the ILP adds hundreds of thousands of these
        a0, a1, a2, a3 = self
        b0, b1, b2, b3 = other
        return _new_tuple(Split, (a0 + times * b0, a1 + times * b1, a2 + times * b2,
                                  a3 + times * b3))


_new_tuple = tuple.__new__


NO_TIME = Split(0.0, 0.0, 0.0, 0.0)


def step_seconds(total: Split, overlap: bool, edge: float = 0.0) -> tuple[float, float, float]:
    """(step seconds, seconds hidden in forward, in backward) of a step whose prices add up
    to `total`. With `overlap` each pass takes the longer of its critical path and its side
    collectives (a collective beside compute hides under it), except that the share `edge`
    of the side collectives has nothing to hide under: the first bucket's gathers come
    before any forward compute, the last bucket's gradients are complete only when backward
    compute ends (`CostModel.edge_share`). Without `overlap`, everything adds up."""
    if not overlap:
        return sum(total), 0.0, 0.0
    hidden_f = total.side_forward - max(edge * total.side_forward,
                                        total.side_forward - total.forward, 0.0)
    hidden_b = total.side_backward - max(edge * total.side_backward,
                                         total.side_backward - total.backward, 0.0)
    return sum(total) - hidden_f - hidden_b, hidden_f, hidden_b


class CostModel(ComputePrices, CommPrices):
    """Prices strategies and resharding edges for one mesh (a MeshSpec).

    `graph` (the strategy graph being priced) tells which inputs of each node need gradients
    and which tensors several ops keep; without it every floating-point input of a node that
    needs a gradient is assumed to need one and every kept tensor is counted per op.
    `measured` maps `op_key`s to measured (forward, backward) seconds (autopar.profile).
    """

    def __init__(self, mesh, optimizer: str | OptimizerSpec | None = None,
                 bucket_bytes: float = BUCKET_BYTES, *, graph: StrategyGraph | None = None,
                 precision: str | Precision | None = None,
                 measured: Mapping[str, tuple[float, float]] | None = None,
                 activation_factor: float = 1.0, recompute: Recompute | None = None,
                 reshard: frozenset[str] = frozenset(), accumulation: int = 1,
                 info: dict[str, mem.NodeInfo] | None = None, randomness: str = "eager",
                 cast_once: bool = False):
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.hw = mesh.profile
        self.shape = tuple(mesh.shape)
        self.optimizer = optimizer_spec(optimizer)
        self.precision = precision_spec(precision)
        self.measured = dict(measured or {})
        self.graph = graph
        self.activation_factor = activation_factor  # microbatches in flight (pipeline stages)
        # what pricing each node needs of its neighbours (`info`: already worked out for
        # `graph`, as `copy` passes it)
        self.info: dict[str, mem.NodeInfo] = info if info is not None else \
            mem.node_infos(graph) if graph is not None else {}
        self.traced_in = graph.compute_dtype if graph is not None else None
        self.recompute = recompute or NO_RECOMPUTE  # ops recomputed in backward (passes/recompute)
        self.region_uses = mem.region_input_uses(graph, self.recompute) \
            if graph is not None else Counter()
        # parameters whose gathered copies are freed after forward (see `regathered`)
        self.reshard = frozenset(reshard)
        # microbatches a step accumulates gradients over (ZeRO-2 reduce-scatters each one's)
        self.accumulation = accumulation
        # how random ops draw: "eager" (the whole tensor on every rank) or "counter" (the
        # rank's block: passes/rules/random.py)
        self.randomness = randomness
        # mixed precision: each parameter cast to the compute dtype once a step, the copy its
        # microbatches share (pipeline stages, runtime/pipeline.py), rather than once a run
        self.cast_once = cast_once
        self._reshard = lru_cache(maxsize=None)(self._reshard_uncached)
        self._node_kinds: dict[int, tuple[SNode, OpKinds]] = {}  # by node (see `_kinds`)
        self._edge_share: float | None = None

    def copy(self, **changes) -> CostModel:
        """The same model with some settings changed (mesh, optimizer, bucket_bytes, graph,
        precision, measured, activation_factor, recompute, reshard, accumulation,
        randomness, cast_once). On the
        same mesh, graph and precision it shares this model's resharding prices (they
        depend on nothing else): the levels of a memory search price the same reshardings."""
        kw = dict(mesh=self.mesh, optimizer=self.optimizer, bucket_bytes=self.bucket_bytes,
                  graph=self.graph, precision=self.precision, measured=self.measured,
                  activation_factor=self.activation_factor, recompute=self.recompute,
                  reshard=self.reshard, accumulation=self.accumulation,
                  randomness=self.randomness, cast_once=self.cast_once)
        kw.update(changes)
        if kw["graph"] is self.graph:
            kw["info"] = self.info  # the same graph's analysis (0.07 s on Llama-3 70B)
        out = copy.copy(self)  # keeps a subclass's own state
        CostModel.__init__(out, **kw)
        if out.mesh is self.mesh and out.graph is self.graph and \
                out.precision == self.precision:
            out._reshard = self._reshard
        return out

    # -- dtypes ----------------------------------------------------------------------------------
    def dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a traced tensor has when the plan runs. A graph traced in the plan's
        compute dtype (as the planner and the runtime trace under mixed precision) runs as
        traced: its float32 tensors are the ones the model computes in float32 on purpose
        (rotary angles, the loss on float32 logits). On a graph traced in float32, float32
        tensors take the compute dtype."""
        if dtype == torch.float32 and self.precision.compute != torch.float32 and \
                self.traced_in != self.precision.compute:
            return self.precision.compute
        return dtype

    def nbytes(self, shape, dtype: torch.dtype) -> int:
        """Bytes of a tensor of `shape` and traced `dtype` under the plan's precision."""
        return numel(shape) * self.dtype(dtype).itemsize

    # -- parameters ----------------------------------------------------------------------------
    def leaf_dtype(self, node: SNode) -> torch.dtype:
        """The dtype of parameter `node` as the runtime stores it, and of the gradient the
        runtime synchronizes for it (runtime/params.py, runtime/grad_sync.py,
        runtime/zero.py): the master dtype under mixed precision, else its compute dtype."""
        dtype = node.out_dtypes[0]
        master = self.precision.master
        return master if master is not None and dtype.is_floating_point else self.dtype(dtype)

    def param_memory_split(self, node: SNode, storage: Placements,
                           zero: int = 0) -> dict[str, float]:
        """Bytes per device of a parameter, its gradient and its optimizer state (stored at
        `storage`, at ZeRO stage `zero`)."""
        return mem.parameter_bytes(self, node, storage, zero)

    def param_memory(self, node: SNode, storage: Placements, zero: int = 0) -> float:
        """Bytes per device of a parameter, its gradient and its optimizer state."""
        return sum(self.param_memory_split(node, storage, zero).values())

    def activation_memory(self, node: SNode, strategy: Strategy) -> float:
        """Bytes per device autograd keeps for backward on account of this node's strategy: its
        own output when its backward needs it, and statistics (solver/memory.py), times the
        microbatches in flight (`activation_factor`); plus the gradient buffers a loss's
        backward allocates at the peak (`memory.workspace_bytes`, once)."""
        return self.activation_factor * mem.saved_bytes(self, node, strategy) + \
            mem.workspace_bytes(self, node, strategy)

    def edge_memory(self, graph: StrategyGraph, consumer: SNode, slot: int,
                    src: Placements, dst: Placements) -> float:
        """Bytes per device autograd keeps of input `slot` of `consumer` when it is produced at
        `src` and consumed at `dst` (solver/memory.py)."""
        return self.activation_factor * mem.edge_saved_bytes(self, graph, consumer, slot,
                                                             as_tuple(src), as_tuple(dst))

    def gather_memory(self, graph: StrategyGraph, consumer: SNode, slot: int,
                      src: Placements, dst: Placements) -> float:
        """What input `slot` of `consumer` adds to its bucket's FSDP gathers in flight
        (solver/memory.py `in_flight`, bytes per device) when it is a parameter gathered whole
        from its storage `src` for its use at `dst`; 0 otherwise. The ILP bounds every
        bucket's sum of these (solver/ilp.py)."""
        b = mem.gathered_use_bytes(self, graph, consumer, slot, src, dst)
        return mem.in_flight(b, consumer.inputs[slot][0] in self.reshard) if b else 0.0

    # -- whole nodes ---------------------------------------------------------------------------
    def node_time(self, node: SNode, strategy: Strategy) -> float:
        """Compute plus (for parameters) gradient synchronization."""
        if node.kind == PARAM:
            return self.grad_sync_time(node, strategy.output, strategy.zero) + \
                self.compute_time(node, strategy)
        return self.compute_time(node, strategy)

    def node_memory(self, node: SNode, strategy: Strategy) -> float:
        """Bytes per device of `node` under `strategy`: the ILP's memory coefficient."""
        if node.kind == PARAM:
            return self.param_memory(node, strategy.output, strategy.zero)
        return self.activation_memory(node, strategy)

    # -- overlap -------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        """Whether collectives issued ahead of need run beside compute on this hardware."""
        return self.hw.overlap

    def edge_share(self) -> float:
        """The share of the side collectives no compute can hide: one bucket of the
        parameters that train (the first bucket's gathers in forward, the last bucket's
        gradients in backward: runtime/grad_sync.py, runtime/params.py), 1 for a model
        within one bucket (its gradients are synchronized once backward ends)."""
        if self.graph is None:
            return 1.0
        if self._edge_share is None:
            total = sum(self.nbytes(v.out_shapes[0], v.out_dtypes[0])
                        for v in self.graph.nodes.values() if v.kind == PARAM and v.requires_grad)
            self._edge_share = min(1.0, self.bucket_bytes / total) if total else 1.0
        return self._edge_share

    def grad_sync_split(self, node: SNode, storage: Placements, zero: int = 0) -> Split:
        """A parameter's gradient synchronization (`grad_sync_steps`) by where it runs: the
        all-gather of ZeRO's stepped shards on backward's critical path, the rest beside
        backward."""
        crit = side = 0.0
        for kind, _, _, t in self.grad_sync_steps(node, storage, zero):
            if kind == "all_gather":
                crit += t
            else:
                side += t
        return Split(0.0, crit, 0.0, side)

    def node_split(self, node: SNode, strategy: Strategy) -> Split:
        """`node_time` by where it runs (see Split): an op's compute (a parameter's casts) on
        the critical path, a parameter's gradient all-reduce or reduce-scatter beside
        backward (the runtime launches each bucket when its gradients are complete:
        runtime/grad_sync.py, runtime/zero.py); ZeRO's all-gather of the stepped shards runs
        before the next step, on the critical path."""
        if node.kind == PARAM:
            sync = self.grad_sync_split(node, strategy.output, strategy.zero)
            fwd, bwd = self.compute_times(node, strategy)  # mixed precision's casts
            return Split(fwd, sync.backward + bwd, 0.0, sync.side_backward)
        fwd, bwd = self.compute_times(node, strategy)
        return Split(fwd, bwd, 0.0, 0.0)

    def edge_split(self, graph: StrategyGraph, consumer: SNode, slot: int,
                   src: Placements, dst: Placements) -> Split:
        """`edge_time` by where it runs (see Split): a parameter's gathers from its storage
        (FSDP; the runtime gathers the next bucket while the current one computes,
        runtime/params.py, pipeline stages included) and their gradients' reduce-scatters
        beside compute; an activation's resharding (tensor and sequence parallel) on the
        critical path, issued once more in backward when its consumer is recomputed in full
        (`recollected`)."""
        producer = graph.nodes[consumer.inputs[slot][0]]
        if producer.kind != PARAM:
            index = consumer.inputs[slot][1]
            dtype = producer.out_dtypes[index or 0]
            shape = consumer.in_shapes[slot]
            grad = producer.requires_grad and dtype.is_floating_point
            whole = self.reshard_time(shape, dtype, src, dst, grad)
            if whole == INFEASIBLE:
                return Split(INFEASIBLE, 0.0, 0.0, 0.0)
            fwd = self.reshard_time(shape, dtype, src, dst, False) if grad else whole
            again = fwd if self.recollected(graph, consumer, slot) else 0.0
            return Split(fwd, whole - fwd + again, 0.0, 0.0)
        try:
            steps = self.edge_collectives(graph, consumer, slot, src, dst)
        except ReshardError:
            return Split(INFEASIBLE, 0.0, 0.0, 0.0)
        return Split(0.0, 0.0, sum(t for *_, t, phase in steps if phase == "forward"),
                     sum(t for *_, t, phase in steps if phase != "forward"))

    def edge_time(self, graph: StrategyGraph, consumer: SNode, slot: int,
                  src: Placements, dst: Placements) -> float:
        """Resharding seconds on input `slot` of `consumer` from `src` to `dst`, forward and
        backward (see `edge_collectives`)."""
        return sum(self.edge_split(graph, consumer, slot, src, dst))


__all__ = ["ALGO_FACTOR", "COUNTER_DRAW_OPS", "DRAW_FLOPS", "DUAL",
           "INFEASIBLE", "NO_TIME", "CostModel",
           "OptimizerSpec", "Precision", "Split", "backward_factor", "drawn_elements", "is_view",
           "op_flops", "step_seconds"]
