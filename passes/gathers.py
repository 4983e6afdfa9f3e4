"""FSDP gathers: the parameters gathered whole from their storage shard for their use, in buckets.

Shared by the rewrite pass (which emits one all-gather per bucket, one bucket in flight ahead
of the one in use) and the cost model (which prices the buckets' transient memory), so both
see the same buckets.
"""

from __future__ import annotations

import math

from autopar.passes.reshard import BUCKET_BYTES, buckets, single_gather

from .placement import Placements, local_shape
from .strategies import PARAM, Strategy, StrategyGraph

# (parameter node, placement it is used at, tensor dimension gathered)
Use = tuple[str, Placements, int]


def gathered_uses(graph: StrategyGraph, choice: dict[str, Strategy]) -> dict[int, list[Use]]:
    """Per mesh dimension, the (parameter, use placement, tensor dim) whose resharding from
    storage is a single all-gather there, in graph order."""
    out: dict[int, list[Use]] = {}
    seen = set()
    for v in graph.nodes.values():
        for slot, (u, idx) in enumerate(v.inputs):
            if graph.nodes[u].kind != PARAM:
                continue
            dst = choice[v.name].inputs[slot]
            if (u, dst) in seen:
                continue
            seen.add((u, dst))
            step = single_gather(v.in_shapes[slot], choice[u].out(idx), dst, graph.mesh_shape)
            if step is not None:
                out.setdefault(step.mesh_dim, []).append((u, dst, step.dim))
    return out


def use_bytes(use: Use, graph: StrategyGraph) -> int:
    """Bytes of a parameter gathered to its use placement (in its traced dtype)."""
    v = graph.nodes[use[0]]
    return math.prod(local_shape(v.out_shapes[0], use[1], graph.mesh_shape)) * \
        v.out_dtypes[0].itemsize


def gather_buckets(graph: StrategyGraph, choice: dict[str, Strategy],
                   limit: float = BUCKET_BYTES) -> dict[int, list[list[Use]]]:
    """Per mesh dimension, the gathered uses grouped into buckets of at most `limit` bytes, in
    order of first use: one all-gather each."""
    return {k: buckets(uses, lambda use: use_bytes(use, graph), limit)
            for k, uses in gathered_uses(graph, choice).items()}
