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
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from autopar.passes.gathers import reduce_dtype
from autopar.passes.placement import Placements, Replicate, as_tuple, fmt, local_shape, same
from autopar.passes.recompute import NONE as NO_RECOMPUTE
from autopar.passes.recompute import Recompute, saved_under_selective
from autopar.passes.reshard import BUCKET_BYTES, ReshardError, Step, plan_steps, single_gather
from autopar.passes.rules import LOWERINGS, TensorArg
from autopar.passes.rules.attention import is_causal
from autopar.passes.rules.random import counter_traffic
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, SNode, Strategy, StrategyGraph
from autopar.passes.torch_compat import tree_map
from autopar.passes.zero import zero_shard

from . import memory as mem
from .efficiency import attention_rate, matmul_efficiency, product_dims
from .flops import backward_factor, drawn_elements, facts, is_view, op_flops
from .specs import OptimizerSpec, Precision, numel, optimizer_spec, precision_spec
from .traffic import accumulation_bytes, broadcasts, grad_kernels, kernel_bytes, widens

ALGO_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
        "all_reduce": "all_reduce", "all_to_all": "all_to_all"}
INFEASIBLE = float("inf")
# A random number costs about what a transcendental does (a Philox or Mersenne-Twister step and
# a conversion), and is written to memory.
DRAW_FLOPS = 20.0
# Counter randomness (passes/rules/counter_rng.py): about 16 int64 elementwise kernels per
# number (a quarter of them per dropout mask element); their bytes: `counter_traffic`.
COUNTER_DRAW_OPS = 16.0


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


class CostModel:
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
                 info: dict[str, mem.NodeInfo] | None = None, randomness: str = "eager"):
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
        self._reshard = lru_cache(maxsize=None)(self._reshard_uncached)
        self._node_kinds: dict[int, tuple[SNode, _Kinds]] = {}  # by node (see `_kinds`)
        self._edge_share: float | None = None

    def copy(self, **changes) -> CostModel:
        """The same model with some settings changed (mesh, optimizer, bucket_bytes, graph,
        precision, measured, activation_factor, recompute, reshard, accumulation,
        randomness). On the
        same mesh, graph and precision it shares this model's resharding prices (they
        depend on nothing else): the levels of a memory search price the same reshardings."""
        kw = dict(mesh=self.mesh, optimizer=self.optimizer, bucket_bytes=self.bucket_bytes,
                  graph=self.graph, precision=self.precision, measured=self.measured,
                  activation_factor=self.activation_factor, recompute=self.recompute,
                  reshard=self.reshard, accumulation=self.accumulation,
                  randomness=self.randomness)
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

    # -- communication -------------------------------------------------------------------------
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
        share = 1.0 / max(1, _graph_facts(graph).consumers[consumer.inputs[slot]])
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

    # -- compute -------------------------------------------------------------------------------
    def grad_inputs(self, node: SNode) -> tuple[bool, ...]:
        """Which inputs of `node` need a gradient (all floating-point ones without the graph)."""
        info = self.info.get(node.name)
        if info is not None:
            return info.grad_inputs
        if not node.requires_grad or node.call is None:
            return tuple(False for _ in node.inputs)
        return tuple(t.dtype.is_floating_point for t in node.call.inputs)

    def local_shapes(self, node: SNode, strategy: Strategy) -> tuple[list[tuple], list[tuple]]:
        """Local input and output shapes of `node` under `strategy`."""
        in_local = [local_shape(s, p, self.shape) for s, p in zip(node.in_shapes, strategy.inputs)]
        outs = strategy.output if node.multi_output else (strategy.output,)
        out_local = [local_shape(s, p, self.shape) for s, p in zip(node.out_shapes, outs)]
        return in_local, out_local

    def op_key(self, node: SNode, strategy: Strategy) -> str:
        """What identifies one measured op: the op, its local input shapes and dtypes, its other
        arguments, which inputs need gradients, and (for ops that run differently on shards)
        its placements."""
        in_local, _ = self.local_shapes(node, strategy)
        dtypes = [str(self.dtype(t.dtype)).removeprefix("torch.") for t in node.call.inputs]
        grads = "".join("g" if g else "-" for g in self.grad_inputs(node)) \
            if node.requires_grad and node.kind != CONSTANT else ""
        args = _args_text(node.call.args, TensorArg) + _args_text(node.call.kwargs, TensorArg)
        key = f"{node.op}|{in_local}|{dtypes}|{args}|{grads}"
        if node.call.target in LOWERINGS:
            outs = strategy.output if node.multi_output else (strategy.output,)
            key += "|" + " ".join(fmt(p) for p in strategy.inputs) + "->" + \
                " ".join(fmt(p) for p in outs)
        return key

    def is_measurable(self, node: SNode) -> bool:
        """Nodes a profile times: ops (not placeholders)."""
        return node.kind in (OP, CONSTANT) and node.call is not None

    def compute_time(self, node: SNode, strategy: Strategy) -> float:
        """Forward + backward seconds of `node` under `strategy` on one device."""
        fwd, bwd = self.compute_times(node, strategy)
        return fwd + bwd

    def compute_times(self, node: SNode, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of `node` under `strategy`; backward is 0 for nodes that
        need no gradient. Backward includes the forward once more for an op recomputed in
        backward (passes/recompute.py), and the sums of its outputs' gradients when several
        ops read them (solver/traffic.py). A parameter's are the casts of its float32 master
        to the compute dtype and of its gradient back, under mixed precision, and its share of
        adding each further microbatch's gradient into the one the step accumulates
        (`grad_accumulation_seconds`: the step prices m microbatches as m times one)."""
        if node.kind == PARAM:
            fwd, bwd = self.master_cast_times(node, strategy.output)
            if self.accumulation > 1 and node.requires_grad:
                bwd += (self.accumulation - 1) / self.accumulation * \
                    self.grad_accumulation_seconds(node, strategy.output, strategy.zero)
            return fwd, bwd
        fwd, bwd = self._compute_times(node, strategy)
        mode = self.recompute.mode_of.get(node.name)
        if mode == "full" or mode == "selective" and not saved_under_selective(
                node, facts(node).product):
            bwd += fwd
        if bwd:
            bwd += self.accumulation_time(node, strategy)
        return fwd, bwd

    def master_cast_times(self, node: SNode, storage: Placements) -> tuple[float, float]:
        """(forward, backward) seconds of a parameter's casts under mixed precision: its local
        block of the float32 master to the compute dtype for each microbatch
        (runtime/params.py), and its gradient back (a widening cast); 0 without a master
        copy."""
        master, compute = self.precision.master, self.precision.compute
        dtype = node.out_dtypes[0]
        if master is None or not dtype.is_floating_point or master == compute:
            return 0.0, 0.0
        n = numel(local_shape(node.out_shapes[0], storage, self.shape))
        nbytes = n * (master.itemsize + compute.itemsize)
        fwd = self.kernel_seconds(nbytes) + self.hw.launch
        if not node.requires_grad:
            return fwd, 0.0
        return fwd, self.kernel_seconds(nbytes, widens=True) + self.hw.launch

    def grad_accumulation_seconds(self, node: SNode, storage: Placements,
                                  zero: int = 0) -> float:
        """Seconds of adding one microbatch's gradient of a parameter into the gradient the
        step accumulates (autograd's AccumulateGrad from the second microbatch on: read both,
        write one), on the gradient as this rank keeps it (`param_memory_split`: whole, or
        its ZeRO shard, in the master dtype under mixed precision). Measured on an H100: 2 x
        8,192 tokens of an 8B-wide Llama with eight layers over two microbatches add 11 ms
        for the second (benchmarks/RESULTS.md, "One GPU, session 20")."""
        nbytes = self.param_memory_split(node, storage, zero)["gradients"]
        return self.kernel_seconds(3 * nbytes) + self.hw.launch if nbytes else 0.0

    def kernel_seconds(self, nbytes: float, widens: bool = False,
                       broadcast: bool = False) -> float:
        """Seconds of a memory-bound kernel moving `nbytes`: at the profile's bandwidth, at a
        share of it for a cast to a wider float type or a broadcast operand
        (autopar/hardware.py)."""
        share = self.hw.memory_efficiency
        if widens:
            share *= self.hw.widening_efficiency
        if broadcast:
            share *= self.hw.broadcast_efficiency
        return nbytes / (self.hw.memory_bandwidth * share)

    def gradient_readers(self, name: str) -> tuple[int, ...]:
        """How many ops send a gradient to each output of node `name` (autograd sums them:
        `accumulation_time`); () for a node not in the cost model's graph."""
        v = self.graph.nodes.get(name) if self.graph is not None else None
        if v is None:
            return ()
        readers = _graph_facts(self.graph).grad_readers
        if not v.multi_output:
            return (readers.get((name, None), 0),)
        return tuple(readers.get((name, k), 0) for k in range(len(v.out_shapes)))

    def accumulation_time(self, node: SNode, strategy: Strategy) -> float:
        """Seconds autograd spends summing the gradients of `node`'s outputs that several ops
        read (an addition per reader after the first)."""
        if self.graph is None or node.kind != OP:
            return 0.0
        total = 0.0
        for k, n in enumerate(self.gradient_readers(node.name)):
            if n > 1:
                shape, dtype = node.out_shapes[k], node.out_dtypes[k]
                outs = strategy.output if node.multi_output else (strategy.output,)
                nbytes = self.nbytes(local_shape(shape, outs[k], self.shape), dtype)
                total += self.kernel_seconds(accumulation_bytes(n, nbytes)) + \
                    (n - 1) * self.hw.launch
        return total

    def _compute_times(self, node: SNode, strategy: Strategy) -> tuple[float, float]:
        if node.kind in (INPUT, PARAM):
            return 0.0, 0.0
        grad = node.requires_grad and node.kind != CONSTANT
        if self.measured and self.is_measurable(node):
            got = self.measured.get(self.op_key(node, strategy))
            if got is not None:
                return got[0], (got[1] if grad else 0.0)
        in_local, out_local = self.local_shapes(node, strategy)
        flops = op_flops(node, in_local, out_local)
        view = is_view(node)
        f = facts(node)
        kinds = self._kinds(node)
        in_size, out_size = kinds.in_size, kinds.out_size
        nbytes = 0 if view else (
            sum(numel(s) * k for s, k in zip(in_local, in_size))
            + sum(numel(s) * k for s, k in zip(out_local, out_size)))
        dtype = self.dtype(node.out_dtypes[0] if node.out_dtypes else torch.float32)
        peak = self.hw.peak_flops(dtype)
        product = f.product
        moved = self.kernel_seconds(nbytes, kinds.widens, kinds.broadcast)
        traffic = f.traffic
        moved_back = None  # backward's bytes, for a kernel that does not move its tensors once
        if traffic is not None and not view:
            fwd_bytes, bwd_bytes = traffic(node.call, in_local, out_local,
                                           lambda dt: self.dtype(dt).itemsize)
            moved, moved_back = self.kernel_seconds(fwd_bytes), self.kernel_seconds(bwd_bytes)
        launch = self.hw.view_launch if view else self.hw.launch
        if product is not None:
            a, b = (in_local[i] for i in product)
            m, n, k = product_dims(a, b, out_local[0])
            roof = max(flops / (peak * matmul_efficiency(self.hw, m, n, k)), moved)
        else:
            roof = max(self.kernel_time(node, flops, peak, in_local), moved)
        fwd = roof + launch + self.draw_time(node, strategy)
        if not grad:
            return fwd, 0.0
        if product is not None:
            # One product per operand that needs a gradient (the bias gradient is a sum): the
            # input's gradient is M x N times N x K, the weight's N x M times M x K.
            needs = self.grad_inputs(node)
            shapes = ((m, k, n), (n, k, m))
            g = [shapes[j] for j, i in enumerate(product) if needs[i]]
            bwd = sum(max(2.0 * mm * nn * kk / (peak * matmul_efficiency(self.hw, mm, nn, kk)),
                          moved) for mm, nn, kk in g)
            return fwd, bwd + max(len(g), 1) * launch
        if f.kernel == "attention" and self.hw.attention:
            bwd = self.kernel_time(node, flops, peak, in_local, backward=True)
            return fwd, max(bwd, moved * backward_factor(node)) + launch
        if moved_back is None:  # the kernels autograd runs (solver/traffic.py)
            if not kinds.grad_kernels:  # the gradient handed on: the autograd node's host time
                return fwd, launch
            moved_back = sum(self.kernel_seconds(
                kernel_bytes(k, in_local, out_local, in_size, out_size), k.widens, k.broadcast)
                for k in kinds.grad_kernels)
        return fwd, max(backward_factor(node) * self.kernel_time(node, flops, peak, in_local),
                        moved_back) + launch

    def _kinds(self, node: SNode) -> _Kinds:
        """What pricing `node` needs of its dtypes and kernels whatever its placements
        (computed once per node)."""
        got = self._node_kinds.get(id(node))
        if got is not None and got[0] is node:
            return got[1]
        f = facts(node)
        dtypes = [t.dtype for t in node.call.inputs] if node.call is not None else \
            [node.out_dtypes[0]] * len(node.in_shapes)
        in_size = [self.dtype(dt).itemsize for dt in dtypes]
        out_size = [self.dtype(dt).itemsize for dt in node.out_dtypes]
        pointwise = f.product is None and not f.kernel and not f.view
        out0 = node.out_shapes[0] if node.out_shapes else ()
        got = _Kinds(
            in_size, out_size,
            widens=pointwise and bool(out_size) and any(
                widens(k, out_size[0]) for k, dt in zip(in_size, dtypes)
                if dt.is_floating_point),
            broadcast=pointwise and any(broadcasts(s, out0) for s in node.in_shapes),
            grad_kernels=grad_kernels(node, self.grad_inputs(node), in_size, out_size)
            if node.kind == OP and f.product is None else ())
        self._node_kinds[id(node)] = (node, got)
        return got

    def kernel_time(self, node: SNode, flops: float, peak: float, in_local: list[tuple],
                    backward: bool = False) -> float:
        """Seconds of the arithmetic of a non-product op: attention at its fused kernel's
        measured rate (backward: 2.5x the forward flops, the FlashAttention papers' count
        their rates are in), anything else at peak (solver/efficiency.py)."""
        if facts(node).kernel == "attention":
            rate = attention_rate(self.hw, in_local[1][-2], causal=is_causal(node.call),
                                  backward=backward)
            if rate is not None:
                return (2.5 if backward else 1.0) * flops / rate
            return (backward_factor(node) if backward else 1.0) * flops / (
                peak * self.hw.matmul_efficiency)
        return flops / peak

    def draw_time(self, node: SNode, strategy: Strategy | None = None) -> float:
        """Seconds a random op spends drawing; 0 for other ops. Eager randomness: the whole
        tensor on every rank, whatever the sharding, and under gradient accumulation or a
        pipeline's m microbatches the whole batch's in every microbatch. Counter randomness:
        the rank's block under `strategy` (0 without one), COUNTER_DRAW_OPS integer ops and
        the bytes `counter_traffic` moves per element (passes/rules/counter_rng.py,
        unfused)."""
        n = drawn_elements(node)
        if not n:
            return 0.0
        if self.randomness == "counter":
            if strategy is None:
                return 0.0
            _, out_local = self.local_shapes(node, strategy)
            whole = numel(node.out_shapes[0])
            n = n * numel(out_local[0]) / whole if whole else 0
            return max(n * COUNTER_DRAW_OPS / self.hw.peak_flops(torch.float32),
                       n * counter_traffic(node.call) / self.hw.memory_bandwidth)
        n *= self.accumulation
        dtype = self.dtype(node.out_dtypes[0])
        return max(n * DRAW_FLOPS / self.hw.peak_flops(dtype),
                   n * dtype.itemsize / self.hw.memory_bandwidth)

    def training_flops(self, node: SNode, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) floating-point operations of `node` under `strategy`."""
        if node.kind in (INPUT, PARAM) or is_view(node):
            return 0.0, 0.0
        in_local, out_local = self.local_shapes(node, strategy)
        f = op_flops(node, in_local, out_local)
        if not node.requires_grad or node.kind == CONSTANT:
            return f, 0.0
        product = facts(node).product
        if product is not None:
            return f, f * sum(self.grad_inputs(node)[i] for i in product)
        return f, f * backward_factor(node)

    # -- parameters ----------------------------------------------------------------------------
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
            share = max(share, _graph_facts(graph).param_share[node.name])
        return min(1.0, share)

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


@dataclass
class _Kinds:
    in_size: list[int]          # bytes per element of each input under the plan's precision
    out_size: list[int]         # and of each output
    widens: bool                # a pointwise op casting to a wider float type
    broadcast: bool             # a pointwise op reading a broadcast operand
    grad_kernels: tuple         # its backward's kernels (solver/traffic.py)


@dataclass
class _GraphFacts:
    consumers: Counter         # (producer, output index) -> number of ops consuming it
    param_share: dict          # parameter -> its share of all parameters' elements
    grad_readers: Counter      # (producer, output index) -> ops sending it a gradient


def _graph_facts(graph: StrategyGraph) -> _GraphFacts:
    """Consumers per tensor and parameter shares of a graph (computed once per graph, kept
    in its `analyses`)."""
    got = graph.analyses.get("cost")
    if got is not None:
        return got
    consumers: Counter = Counter()
    grad_readers: Counter = Counter()
    for v in graph.nodes.values():
        for ref in v.inputs:
            consumers[ref] += 1
            u = graph.nodes[ref[0]]
            if v.requires_grad and v.kind == OP and u.requires_grad and \
                    u.out_dtypes[ref[1] or 0].is_floating_point:
                grad_readers[ref] += 1
    params = {n: numel(v.out_shapes[0]) for n, v in graph.nodes.items() if v.kind == PARAM}
    total = sum(params.values()) or 1
    found = _GraphFacts(consumers, {n: k / total for n, k in params.items()}, grad_readers)
    graph.analyses["cost"] = found
    return found


def _args_text(tree, tensor_type) -> str:
    leaves = tree_map(lambda a: "T" if isinstance(a, tensor_type) else a, tree)
    return repr(leaves)


__all__ = ["ALGO_FACTOR", "COUNTER_DRAW_OPS", "DRAW_FLOPS", "DUAL",
           "INFEASIBLE", "NO_TIME", "CostModel",
           "OptimizerSpec", "Precision", "Split", "backward_factor", "drawn_elements", "is_view",
           "op_flops", "step_seconds"]
