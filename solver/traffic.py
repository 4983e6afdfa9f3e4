"""Bytes a memory-bound op moves in backward, from how autograd computes its gradients.

For an op that is neither a matrix product nor attention (elementwise ops, norms, casts, copies
and views), backward runs one kernel per input that needs a gradient, unless the op hands the
output's gradient on as it is (`OpFacts.grad_passes`: a sum's operands, a reshape's or a
concatenation's input). That kernel reads the output's gradient and what autograd kept for that
input's formula (`OpFacts.saves`: a product's partner operand, an activation's input, a norm's
input), and writes the input's gradient; an elementwise op's input that was broadcast gets its
gradient at the output's size first, then summed down to its own (one more write and read of an
output-sized tensor; a fused norm reduces its weight's gradient in its own kernel). A tensor that
several ops read gets one gradient from each, summed by autograd: one addition per extra reader
(`accumulation_bytes`).

Measured on an H200 with PyTorch 2.11 (benchmarks/gpu_check.py, "timeline"; each ratio is the
backward's kernel time over the forward's in one profiled eager step of Llama-3 at 8B width):
a product of two activations 2.0 (two kernels of three passes against one of three), SiLU 1.5
(three passes against two), a fused RMS norm 2.6 (the input's gradient, three passes, and the
weight's, two, against two), a sum 0 (no kernel), a cast 1.0 (the cast back); a split (a view
forward) concatenates its parts' gradients; and 12 additions per four layers sum the gradients
of the tensors several ops read (1% of the step).

A kernel casting to a wider float type, and one reading a broadcast operand, run at a share of
the copy bandwidth on GPUs (`HardwareProfile.widening_efficiency`, `broadcast_efficiency`):
each kernel says whether it does either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.passes.rules.registry import PASSES_ALL, SAVES_DIVISOR, SAVES_OPERANDS
from autopar.passes.strategies import SNode

from .flops import facts
from .memory import saved_slots, saves_output

__all__ = ["GradKernel", "accumulation_bytes", "broadcasts", "grad_kernels",
           "kernel_bytes", "widens"]


def broadcasts(shape: tuple, out: tuple) -> bool:
    """Whether an operand of `shape` is broadcast to `out` (a dimension of 1, or fewer
    dimensions, against a larger output; a 0-dimensional scalar is not)."""
    if not shape or math.prod(shape) >= math.prod(out):
        return False
    if len(shape) < len(out):
        return True
    return any(a == 1 and b > 1 for a, b in zip(shape[::-1], out[::-1]))


def widens(src_itemsize: int, dst_itemsize: int) -> bool:
    """Whether a cast from `src_itemsize` to `dst_itemsize` bytes per element widens."""
    return dst_itemsize > src_itemsize


@dataclass(frozen=True)
class GradKernel:
    """One kernel of an op's backward, by the tensors it moves: it writes the gradient of
    input `slot` and reads the output's gradient (and the output itself when `output` is
    set) and the inputs in `reads`; `temp`: the gradient is made at the output's size and
    summed down (an output-sized tensor written and read once more)."""

    slot: int
    reads: tuple[int, ...] = ()
    output: bool = False
    temp: bool = False
    widens: bool = False
    broadcast: bool = False


def _reads(node: SNode, f, slot: int, grads: tuple[bool, ...]) -> tuple[int, ...]:
    """Input slots the gradient formula of input `slot` reads (what autograd kept for it)."""
    n = len(node.inputs)
    if f.saves == SAVES_OPERANDS:
        pair = f.product or (0, 1)
        return tuple(j for j in pair if j != slot and j < n)
    if f.saves == SAVES_DIVISOR and n >= 2:
        return (1,) if slot == 0 else (0, 1)
    return tuple(j for j in saved_slots(node, grads) if j < n)


def grad_kernels(node: SNode, grads: tuple[bool, ...], in_size: list[int],
                 out_size: list[int]) -> tuple[GradKernel, ...]:
    """The kernels autograd runs for `node`'s backward (see the module docstring), whatever
    its placements: `grads` says which inputs need a gradient, `in_size` / `out_size` are
    the bytes per element of each input and output under the plan's precision."""
    f = facts(node)
    out0 = node.out_shapes[0] if node.out_shapes else ()
    pointwise = not f.kernel
    kernels = []
    for i, needs in enumerate(grads):
        if not needs or i >= len(node.in_shapes):
            continue
        shape = node.in_shapes[i]
        spread = broadcasts(shape, out0)
        if f.grad_passes == PASSES_ALL or i in f.grad_passes:
            if spread and not f.view:
                kernels.append(GradKernel(i))  # summed down to its shape
            continue
        reads = _reads(node, f, i, grads)
        kernels.append(GradKernel(
            i, reads, saves_output(node), temp=pointwise and bool(reads) and spread,
            widens=bool(out_size) and widens(out_size[0], in_size[i]),
            broadcast=pointwise and any(broadcasts(node.in_shapes[j], out0) for j in reads)))
    return tuple(kernels)


def kernel_bytes(kernel: GradKernel, in_local: list[tuple], out_local: list[tuple],
                 in_size: list[int], out_size: list[int]) -> float:
    """Bytes `kernel` reads and writes on local shapes."""
    grad_out = sum(math.prod(s) * k for s, k in zip(out_local, out_size))
    i = kernel.slot
    nbytes = grad_out * (2 if kernel.output else 1) + math.prod(in_local[i]) * in_size[i]
    for j in kernel.reads:
        nbytes += math.prod(in_local[j]) * in_size[j]
    if kernel.temp:
        nbytes += 2 * math.prod(out_local[0]) * out_size[0]
    return float(nbytes)


def accumulation_bytes(readers: int, nbytes: float) -> float:
    """Bytes autograd moves summing the gradients of a tensor of `nbytes` that `readers` ops
    send one each: an addition (two reads, one write) per reader after the first."""
    return 3.0 * nbytes * max(0, readers - 1)
