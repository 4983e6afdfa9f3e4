"""Compute prices, a part of the cost model (solver/cost.py `CostModel`): the roofline of each
op on its local shapes (or its measured time), forward and backward, with what backward adds
(recomputation, summing gradients several ops send, mixed precision's casts, gradient
accumulation) and what random ops spend drawing.

`ComputePrices` holds no state of its own: it reads the CostModel's hardware, shape, graph and
its analyses, precision, measured times, recomputation, accumulation and randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.passes.placement import Placements, fmt, local_shape
from autopar.passes.recompute import saved_under_selective
from autopar.passes.rules import LOWERINGS, TensorArg
from autopar.passes.rules.attention import is_causal
from autopar.passes.rules.random import counter_traffic
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, SNode, Strategy
from autopar.passes.torch_compat import tree_map

from .efficiency import attention_rate, matmul_efficiency, product_dims
from .flops import backward_factor, drawn_elements, facts, is_view, op_flops
from .graph_facts import graph_facts
from .memory import block_share
from .specs import numel
from .traffic import accumulation_bytes, broadcasts, grad_kernels, kernel_bytes, widens

# A random number costs about what a transcendental does (a Philox or Mersenne-Twister step and
# a conversion), and is written to memory.
DRAW_FLOPS = 20.0
# Counter randomness (passes/rules/counter_rng.py): about 16 int64 elementwise kernels per
# number (a quarter of them per dropout mask element); their bytes: `counter_traffic`.
COUNTER_DRAW_OPS = 16.0


class ComputePrices:
    """Seconds of compute, for CostModel (see the module docstring)."""

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
        exchanged = self.exchange_time(node, strategy)
        fwd, bwd = fwd + exchanged, bwd + (exchanged if bwd else 0.0)
        mode = self.recompute.mode_of.get(node.name)
        if mode == "full" or mode == "selective" and not saved_under_selective(
                node, facts(node).product):
            bwd += fwd
        if bwd:
            bwd += self.accumulation_time(node, strategy)
        return fwd, bwd

    def exchange_time(self, node: SNode, strategy: Strategy) -> float:
        """Seconds of the collectives an op runs inside itself under `strategy`, each way
        (`OpFacts.exchanges`: BatchNorm's batch statistics over a sharded batch)."""
        exchanges = facts(node).exchanges
        if exchanges is None or node.call is None:
            return 0.0
        return sum(self.collective_time(kind, k, nbytes)
                   for kind, k, nbytes in exchanges(node.call, strategy.inputs, self.shape,
                                                    lambda dt: self.dtype(dt).itemsize))

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
        readers = graph_facts(self.graph).grad_readers
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

    def _kinds(self, node: SNode) -> OpKinds:
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
        got = OpKinds(
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
        their rates are in), a convolution at a matrix product's (`matmul_efficiency`),
        anything else at peak (solver/efficiency.py)."""
        if facts(node).kernel == "attention":
            rate = attention_rate(self.hw, in_local[1][-2], causal=is_causal(node.call),
                                  backward=backward)
            if rate is not None:
                return (2.5 if backward else 1.0) * flops / rate
            return (backward_factor(node) if backward else 1.0) * flops / (
                peak * self.hw.matmul_efficiency)
        if facts(node).kernel == "conv":  # convolutions run at a matrix product's rate
            return flops / (peak * self.hw.matmul_efficiency)
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
            n = n * block_share(self, node, strategy)
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


@dataclass
class OpKinds:
    """What pricing an op's kernels reads of it under the plan's precision (`_kinds`)."""

    in_size: list[int]          # bytes per element of each input under the plan's precision
    out_size: list[int]         # and of each output
    widens: bool                # a pointwise op casting to a wider float type
    broadcast: bool             # a pointwise op reading a broadcast operand
    grad_kernels: tuple         # its backward's kernels (solver/traffic.py)


def _args_text(tree, tensor_type) -> str:
    leaves = tree_map(lambda a: "T" if isinstance(a, tensor_type) else a, tree)
    return repr(leaves)
