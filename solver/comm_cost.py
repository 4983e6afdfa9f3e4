"""Communication prices, a part of the cost model (solver/cost.py `CostModel`): one collective
(alpha-beta per mesh dimension with the ring algorithm's factors), the resharding on an edge
(FSDP gathers in buckets, issued again where backward recomputes or regathers), and a
parameter's gradient synchronization (all-reduce, or ZeRO's reduce-scatter and all-gather).

`CommPrices` holds no state of its own: it reads the CostModel's mesh, shape, graph, precision,
bucket size, recomputation, resharding and accumulation.
"""

from __future__ import annotations

import torch

from autopar.passes.gathers import reduce_dtype
from autopar.passes.placement import Placements, Replicate, as_tuple, local_shape, same
from autopar.passes.reshard import ReshardError, Step, plan_steps, single_gather
from autopar.passes.strategies import CONSTANT, OP, PARAM, SNode, StrategyGraph
from autopar.passes.zero import zero_shard

from .graph_facts import graph_facts
from .specs import numel

ALGO_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
        "all_reduce": "all_reduce", "all_to_all": "all_to_all"}
INFEASIBLE = float("inf")


class CommPrices:
    """Seconds of collectives, for CostModel (see the module docstring)."""

    def collective_time(self, kind: str, mesh_dim: int, nbytes: float,
                        latency: float = 1.0) -> float:
        """Seconds for one collective of `nbytes` (the gathered size for gathers and scatters),
        paying `latency` times the link's alpha (a share of it for bucketed collectives)."""
        n = self.shape[mesh_dim]
        if n == 1 or kind == "slice":
            return 0.0
        alpha, bandwidth = self.mesh.link(mesh_dim).for_kind(kind)
        return alpha * latency + ALGO_FACTOR[kind](n) * nbytes / bandwidth

    def _priced_steps(self, steps: list[Step], dtype: torch.dtype, grad: bool,
                      latency: float = 1.0):
        """(kind, mesh dimension, bytes, seconds, phase) of each collective of `steps` and,
        for a tensor carrying a gradient, of its dual in backward (same bytes)."""
        for s in steps:
            if s.kind == "slice" or self.shape[s.mesh_dim] == 1:
                continue
            nbytes = self.step_bytes(s, dtype)
            kinds = [(s.kind, "forward")] + ([(DUAL[s.kind], "backward")] if grad else [])
            for kind, phase in kinds:
                yield (kind, s.mesh_dim, nbytes,
                       self.collective_time(kind, s.mesh_dim, nbytes, latency), phase)

    def step_bytes(self, step: Step, dtype: torch.dtype) -> int:
        """The size a step's algorithm factor applies to."""
        shape = step.in_shape if step.kind in ("reduce_scatter", "all_reduce", "all_to_all") \
            else step.out_shape
        return self.nbytes(shape, dtype)

    def reshard_time(self, shape, dtype, src: Placements, dst: Placements, grad: bool) -> float:
        """Forward (+ backward dual when the tensor carries a gradient) seconds of an edge."""
        return self._reshard(tuple(shape), dtype, as_tuple(src), as_tuple(dst), grad)

    def _reshard_uncached(self, shape, dtype, src, dst, grad) -> float:
        if same(src, dst):
            return 0.0
        try:
            steps = plan_steps(shape, src, dst, self.shape)
        except ReshardError:
            return INFEASIBLE
        return sum(c[3] for c in self._priced_steps(steps, dtype, grad))

    def edge_collectives(self, graph: StrategyGraph, consumer: SNode, slot: int,
                         src: Placements, dst: Placements) -> list[tuple[str, int, int, float,
                                                                         str]]:
        """The collectives input `slot` of `consumer` costs when produced at `src` and consumed
        at `dst`: (kind, mesh dimension, bytes, seconds, "forward" or "backward"); raises
        ReshardError when there is no such resharding.

        Parameters whose use is one all-gather from their storage (FSDP) are gathered
        together in buckets, one collective per bucket and mesh dimension (one reduce-scatter
        of their gradients in backward, in `reduce_dtype`: float32 under mixed precision),
        so such a gather pays the link latency in proportion to its share of a bucket (see
        `_bucket_share`); and once per placement, whichever ops use it, so each of the k ops
        using the parameter pays 1/k (exact when they use it alike, as tied weights do). A
        gathered parameter freed after forward (`regathered`) is gathered once more in
        backward. Other tensors pay each consumer's resharding in full (the runtime reshards
        once per target placement: consumers that want the same placement of one tensor,
        such as q, k and v projections of one input, are counted once each, an
        overestimate)."""
        producer = graph.nodes[consumer.inputs[slot][0]]
        idx = consumer.inputs[slot][1]
        dtype = producer.out_dtypes[idx or 0]
        grad = producer.requires_grad and dtype.is_floating_point
        if as_tuple(src) == as_tuple(dst):
            return []
        steps = [s for s in plan_steps(consumer.in_shapes[slot], src, dst, self.shape)
                 if self.shape[s.mesh_dim] > 1]
        grouped = producer.kind == PARAM and len(steps) == 1 and steps[0].kind == "all_gather"
        if not grouped:
            priced = list(self._priced_steps(steps, dtype, grad))
            if self.recollected(graph, consumer, slot):
                priced += [(kind, k, nbytes, t, "backward")
                           for kind, k, nbytes, t, phase in priced if phase == "forward"]
            return priced
        whole = self.step_bytes(steps[0], dtype)
        latency = self._bucket_share(graph, producer, whole)
        share = 1.0 / max(1, graph_facts(graph).consumers[consumer.inputs[slot]])
        k = steps[0].mesh_dim
        gather = share * self.collective_time("all_gather", k, whole, latency)
        priced = [("all_gather", k, whole, gather, "forward")]
        if grad:
            compute = self.dtype(dtype)
            scattered = whole // compute.itemsize * reduce_dtype(compute).itemsize
            priced.append(("reduce_scatter", k, scattered,
                           share * self.collective_time("reduce_scatter", k, scattered, latency),
                           "backward"))
        if self.regathered(graph, consumer, slot, src, dst):
            priced.append(("all_gather", k, whole, gather, "backward"))
        return priced

    def recollected(self, graph: StrategyGraph, consumer: SNode, slot: int) -> bool:
        """Whether the resharding of input `slot` of `consumer` runs again in backward: the
        collectives moving a value the program computes (an op's or a constant's, not a
        parameter or input) to an op recomputed in full are inside its recomputed run, so
        backward issues them again before running the block (passes/recompute_regions.py), as
        Megatron-LM's and torchtitan's full activation checkpointing do; their results are
        not kept."""
        return self.recompute.mode_of.get(consumer.name) == "full" and \
            graph.nodes[consumer.inputs[slot][0]].kind in (OP, CONSTANT)

    def regathered(self, graph: StrategyGraph, consumer: SNode, slot: int, src: Placements,
                   dst: Placements) -> bool:
        """Whether input `slot` of `consumer` is a parameter gathered whole from its storage
        shard (FSDP) that is freed after forward and gathered again for backward: one in
        `reshard` (a recomputed run keeps a token for it, and backward gathers it again before
        running the block again: passes/recompute_regions.py)."""
        u = consumer.inputs[slot][0]
        if u not in self.reshard:
            return False
        return graph.nodes[u].kind == PARAM and \
            single_gather(consumer.in_shapes[slot], src, dst, self.shape) is not None

    def grad_sync_time(self, node: SNode, storage: Placements, zero: int = 0) -> float:
        """Seconds to synchronize the gradient over the mesh dimensions where it is replicated
        (see `grad_sync_steps`)."""
        return sum(t for *_, t in self.grad_sync_steps(node, storage, zero))

    def grad_sync_steps(self, node: SNode, storage: Placements, zero: int = 0
                        ) -> list[tuple[str, int, int, float]]:
        """(collective, mesh dimension, bytes, seconds) of each collective a step spends on
        the gradient: an all-reduce over each mesh dimension where the parameter is
        replicated; under ZeRO (`zero`, passes/zero.py) a reduce-scatter of the gradient (one
        per microbatch for ZeRO-2) and an all-gather of the stepped shards instead.

        The gradient is synchronized in the dtype of the parameter's leaf (`leaf_dtype`: the
        float32 master under mixed precision, FSDP2's reduce_dtype), and ZeRO's stepped
        shards are gathered in it. Gradients are synchronized in buckets of `bucket_bytes`,
        so a parameter pays the bandwidth term in full and its share of one bucket's latency:
        bytes / bucket_bytes of it, or (a model smaller than one bucket: one collective for
        all) its share of all parameters, when the cost model knows the graph."""
        if not node.requires_grad:  # frozen: no gradient to synchronize
            return []
        nbytes = numel(local_shape(node.out_shapes[0], storage, self.shape)) * \
            self.leaf_dtype(node).itemsize
        share = self._bucket_share(self.graph, node, nbytes)
        if zero:
            k = zero_shard(node.out_shapes[0], storage, self.shape).mesh_dim
            scatters = self.accumulation if zero >= 2 else 1
            return [("reduce_scatter", k, nbytes,
                     scatters * self.collective_time("reduce_scatter", k, nbytes, share)),
                    ("all_gather", k, nbytes, self.collective_time("all_gather", k, nbytes, share))]
        return [("all_reduce", k, nbytes, self.collective_time("all_reduce", k, nbytes, share))
                for k, p in enumerate(storage) if isinstance(p, Replicate) and self.shape[k] > 1]

    def _bucket_share(self, graph: StrategyGraph | None, node: SNode, nbytes: float) -> float:
        """The share of one bucketed collective's latency a parameter of `nbytes` pays:
        bytes / bucket_bytes, or (a model smaller than one bucket: one collective for all) its
        share of all parameters, when the graph is known."""
        share = nbytes / self.bucket_bytes
        if graph is not None and node.name in graph.nodes:
            share = max(share, graph_facts(graph).param_share[node.name])
        return min(1.0, share)
