"""The cost model: seconds of compute and communication, bytes of memory, per strategy and edge.

- compute: roofline per op on local shapes, max(flops / peak, bytes / memory bandwidth) plus a
  launch floor; the backward pass costs `backward_factor` times the forward (2 for products and
  attention, whose backward computes two products per forward one; 1 otherwise).
- communication: alpha-beta per mesh dimension: alpha + factor * bytes / bandwidth with the ring
  algorithm factors all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n on the gathered
  size, all-to-all (n-1)/n on the local size. A tensor that carries a gradient pays each
  collective's dual in backward as well (same bytes).
- gradient synchronization: a parameter stored replicated on a mesh dimension gets its gradient
  all-reduced there (the local gradient of a replicated value is a pending sum).
- memory: parameters, gradients and optimizer state per storage placement, plus the outputs the
  backward pass keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from autopar.passes.placement import Placements, Replicate, local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, SNode, Strategy, StrategyGraph

from .reshard import ReshardError, Step, plan_steps

ALGO_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
_MATMUL = ("linear", "addmm", "mm.", "bmm", "matmul", "scaled_dot_product_attention")
_VIEWS = ("view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "slice",
          "select", "split", "alias", "t.default", "unflatten", "flatten", "detach")
INFEASIBLE = float("inf")


@dataclass(frozen=True)
class OptimizerSpec:
    """Bytes of optimizer state per parameter byte (AdamW: two moments)."""

    name: str = "adamw"
    states: int = 2


def numel(shape) -> int:
    return math.prod(shape) if shape else 1


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class CostModel:
    """Prices strategies and resharding edges for one mesh (a MeshSpec)."""

    def __init__(self, mesh, optimizer: OptimizerSpec | None = None,
                 bucket_bytes: float = 25 * 2**20):
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.hw = mesh.profile
        self.shape = tuple(mesh.shape)
        self.optimizer = optimizer or OptimizerSpec()
        self._reshard = lru_cache(maxsize=None)(self._reshard_uncached)

    # -- communication -------------------------------------------------------------------------
    def collective_time(self, kind: str, mesh_dim: int, nbytes: float) -> float:
        """Seconds for one collective of `nbytes` (the gathered size for gathers and scatters)."""
        n = self.shape[mesh_dim]
        if n == 1 or kind == "slice":
            return 0.0
        link = self.mesh.link(mesh_dim)
        return link.alpha + ALGO_FACTOR[kind](n) * nbytes / link.bandwidth

    def step_bytes(self, step: Step, dtype: torch.dtype) -> int:
        """The size a step's algorithm factor applies to."""
        shape = step.in_shape if step.kind in ("reduce_scatter", "all_reduce", "all_to_all") \
            else step.out_shape
        return numel(shape) * itemsize(dtype)

    def reshard_time(self, shape, dtype, src: Placements, dst: Placements, grad: bool) -> float:
        """Forward (+ backward dual when the tensor carries a gradient) seconds of an edge."""
        return self._reshard(tuple(shape), dtype, tuple(src), tuple(dst), grad)

    def _reshard_uncached(self, shape, dtype, src, dst, grad) -> float:
        if src == dst:
            return 0.0
        try:
            steps = plan_steps(shape, src, dst, self.shape)
        except ReshardError:
            return INFEASIBLE
        t = sum(self.collective_time(s.kind, s.mesh_dim, self.step_bytes(s, dtype))
                for s in steps)
        return t * (2 if grad else 1)

    def reshard_steps(self, shape, src, dst) -> list[Step]:
        return plan_steps(shape, src, dst, self.shape)

    # -- compute -------------------------------------------------------------------------------
    def compute_time(self, node: SNode, strategy: Strategy) -> float:
        """Forward + backward seconds of `node` under `strategy` on one device."""
        if node.kind in (INPUT, PARAM):
            return 0.0
        in_local = [local_shape(s, p, self.shape) for s, p in zip(node.in_shapes, strategy.inputs)]
        outs = strategy.output if node.multi_output else (strategy.output,)
        out_local = [local_shape(s, p, self.shape) for s, p in zip(node.out_shapes, outs)]
        flops = op_flops(node, in_local, out_local)
        dtype = node.out_dtypes[0] if node.out_dtypes else torch.float32
        nbytes = 0 if is_view(node) else (
            sum(numel(s) for s in in_local) + sum(numel(s) for s in out_local)) * itemsize(dtype)
        fwd = max(flops / self.hw.peak_flops(dtype), nbytes / self.hw.memory_bandwidth)
        fwd += 0.0 if is_view(node) else self.hw.launch
        if not node.requires_grad or node.kind == CONSTANT:
            return fwd
        return fwd * (1 + backward_factor(node))

    # -- parameters ----------------------------------------------------------------------------
    def grad_sync_time(self, node: SNode, storage: Placements) -> float:
        """Seconds to all-reduce the gradient over the mesh dimensions where it is replicated.

        Gradients are synchronized in buckets of `bucket_bytes`, so a parameter pays the
        bandwidth term in full and its share of one bucket's latency.
        """
        local = numel(local_shape(node.out_shapes[0], storage, self.shape))
        nbytes = local * itemsize(node.out_dtypes[0])
        share = min(1.0, nbytes / self.bucket_bytes)
        total = 0.0
        for k, p in enumerate(storage):
            if isinstance(p, Replicate) and self.shape[k] > 1:
                link = self.mesh.link(k)
                total += link.alpha * share + ALGO_FACTOR["all_reduce"](self.shape[k]) * \
                    nbytes / link.bandwidth
        return total

    def param_memory(self, node: SNode, storage: Placements) -> float:
        """Bytes per device of a parameter, its gradient and its optimizer state."""
        local = numel(local_shape(node.out_shapes[0], storage, self.shape))
        return local * itemsize(node.out_dtypes[0]) * (2 + self.optimizer.states)

    def activation_memory(self, node: SNode, strategy: Strategy) -> float:
        """Bytes per device the backward pass keeps of this node's output."""
        if node.kind != OP or not node.requires_grad or is_view(node):
            return 0.0
        outs = strategy.output if node.multi_output else (strategy.output,)
        return sum(numel(local_shape(s, p, self.shape)) * itemsize(dt)
                   for s, p, dt in zip(node.out_shapes, outs, node.out_dtypes))

    # -- whole nodes ---------------------------------------------------------------------------
    def node_time(self, node: SNode, strategy: Strategy) -> float:
        """Compute plus (for parameters) gradient synchronization."""
        if node.kind == PARAM:
            return self.grad_sync_time(node, strategy.output)
        return self.compute_time(node, strategy)

    def node_memory(self, node: SNode, strategy: Strategy) -> float:
        if node.kind == PARAM:
            return self.param_memory(node, strategy.output)
        return self.activation_memory(node, strategy)

    def edge_time(self, graph: StrategyGraph, consumer: SNode, slot: int,
                  src: Placements, dst: Placements) -> float:
        """Resharding seconds on input `slot` of `consumer` from `src` to `dst`."""
        producer = graph.nodes[consumer.inputs[slot][0]]
        index = consumer.inputs[slot][1]
        dtype = producer.out_dtypes[index or 0]
        return self.reshard_time(consumer.in_shapes[slot], dtype, src, dst,
                                 producer.requires_grad and dtype.is_floating_point)


def is_view(node: SNode) -> bool:
    return any(node.op.startswith(v) for v in _VIEWS)


def backward_factor(node: SNode) -> float:
    return 2.0 if any(node.op.startswith(m) for m in _MATMUL) else 1.0


def op_flops(node: SNode, in_local: list[tuple], out_local: list[tuple]) -> float:
    """Floating-point operations of the forward op on local shapes."""
    op = node.op
    if op.startswith("linear") or op.startswith("matmul") or op.startswith("bmm"):
        k = in_local[0][-1] if in_local[0] else 1
        return 2.0 * numel(out_local[0]) * k
    if op.startswith("addmm") or op.startswith("mm."):
        x = in_local[1] if op.startswith("addmm") else in_local[0]
        return 2.0 * numel(out_local[0]) * x[-1]
    if op.startswith("scaled_dot_product_attention"):
        q, k = in_local[0], in_local[1]
        b_h_l = numel(q[:-1])
        flops = 4.0 * b_h_l * k[-2] * q[-1]
        causal = node.call is not None and bool(node.call.arg(5, "is_causal", False))
        return flops * (0.5 if causal else 1.0)
    if is_view(node):
        return 0.0
    if op.startswith("layer_norm") or op.startswith("rms_norm") or op.startswith("_softmax") or \
            op.startswith("cross_entropy") or op.startswith("_log_softmax"):
        return 5.0 * numel(in_local[0])
    return float(sum(numel(s) for s in out_local))
