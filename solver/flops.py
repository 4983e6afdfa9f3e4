"""What an op computes, from its facts (passes/rules, next to its sharding rule): whether it is a
view, its forward flops on local shapes, its backward-to-forward ratio and the random numbers it
draws. A leaf of the solver: the cost and memory models both read it."""

from __future__ import annotations

from autopar.passes.rules import OpFacts
from autopar.passes.rules.attention import attention_flops
from autopar.passes.strategies import SNode

from .specs import numel

__all__ = ["attention_flops", "backward_factor", "drawn_elements", "facts", "is_view",
           "op_flops"]


def facts(node: SNode) -> OpFacts:
    """The facts of the op `node` runs (UNKNOWN for placeholders and ops nobody described)."""
    return node.facts


def is_view(node: SNode) -> bool:
    """Whether `node` is an alias of its input (no compute, no bytes of its own)."""
    return facts(node).view


def backward_factor(node: SNode) -> float:
    """Backward flops per forward flop, without knowing which inputs need gradients: 2 for
    products and attention, 1 otherwise."""
    f = facts(node)
    return 2.0 if f.product is not None else f.backward_factor


def drawn_elements(node: SNode) -> int:
    """Random numbers `node` draws on every rank (0 for ops that draw none)."""
    f = facts(node)
    return f.draws(node.call) if f.draws is not None else 0


def op_flops(node: SNode, in_local: list[tuple], out_local: list[tuple]) -> float:
    """Floating-point operations of the forward op on local shapes."""
    f = facts(node)
    if f.view:
        return 0.0
    if f.product is not None:
        k = in_local[f.product[0]][-1] if in_local[f.product[0]] else 1
        return 2.0 * numel(out_local[0]) * k
    if f.flops is not None:
        return f.flops(node.call, in_local, out_local)
    if f.flops_per_element != 1.0:
        return f.flops_per_element * numel(in_local[0])
    return float(sum(numel(s) for s in out_local))
