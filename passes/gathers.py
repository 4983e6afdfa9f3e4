"""FSDP gathers: the parameters gathered whole from their storage shard for their use, in buckets.

Shared by the rewrite pass (which emits one all-gather per bucket, one bucket in flight ahead
of the one in use) and the cost model (which prices the buckets' transient memory), so both
see the same buckets.

The buckets are fixed by the model, not by the plan, as FSDP2's groups are (one `fully_shard`
module each): the uses of parameters (an op's input slot fed by a parameter), in program order,
fall into groups of at most `limit` bytes of whole parameters (`use_groups`); a plan's bucket
on a mesh dimension is what one group gathers there. So a bucket's bytes are a sum over the
group's uses of what each gathers, linear in the plan's choices: the ILP bounds the largest
bucket exactly (solver/ilp.py) instead of guessing which parameters a plan will pack together.
"""

from __future__ import annotations

import math

import torch

from autopar.passes.reshard import BUCKET_BYTES, single_gather

from .placement import Placements
from .strategies import PARAM, Strategy, StrategyGraph

# (parameter node, placement it is used at, tensor dimension gathered)
Use = tuple[str, Placements, int]
# (consumer node, input slot) fed by a parameter
Edge = tuple[str, int]


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the gradients of gathered parameters of `dtype` are reduce-scattered in:
    float32 for bfloat16 and float16 (FSDP2's `reduce_dtype` under mixed precision: one
    rounding of the sum, not one per rank's addend), else their own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def use_groups(graph: StrategyGraph, limit: float = BUCKET_BYTES,
               stage_of: dict[str, int] | None = None) -> dict[Edge, int]:
    """Every use of a parameter (consumer, slot), in program order, numbered by its group: the
    uses grouped so that the whole parameters a group uses take at most `limit` bytes (in their
    traced dtype; a parameter used twice in a group counts once; one larger than `limit` is a
    group of its own). With `stage_of` (every op's pipeline stage) a group never spans two
    stages: each stage's program gathers its own buckets."""
    out: dict[Edge, int] = {}
    group, size, members, stage = -1, 0, set(), None
    for v in graph.nodes.values():
        for slot, (u, _) in enumerate(v.inputs):
            if graph.nodes[u].kind != PARAM:
                continue
            b = 0 if u in members else _whole_bytes(graph, u)
            here = stage_of.get(v.name, 0) if stage_of is not None else None
            if group < 0 or size + b > limit or here != stage:
                group, size, members, stage = group + 1, 0, set(), here
                b = _whole_bytes(graph, u)
            members.add(u)
            size += b
            out[(v.name, slot)] = group
    return out


def _whole_bytes(graph: StrategyGraph, param: str) -> int:
    v = graph.nodes[param]
    return math.prod(v.out_shapes[0]) * v.out_dtypes[0].itemsize


def gathered_uses(graph: StrategyGraph, choice: dict[str, Strategy],
                  groups: dict[Edge, int], stage_of: dict[str, int] | None = None
                  ) -> dict[int, list[tuple[int, Use]]]:
    """Per mesh dimension, the (parameter, use placement, tensor dim) whose resharding from
    storage is a single all-gather there, in program order, each with the group (`groups`) of
    its first use. With `stage_of` (pipeline stages) a parameter used in more than one stage
    (tied weights) is left out: each stage gathers it alone where it uses it."""
    out: dict[int, list[tuple[int, Use]]] = {}
    seen = set()
    shared = _shared_across_stages(graph, stage_of) if stage_of is not None else set()
    for v in graph.nodes.values():
        for slot, (u, idx) in enumerate(v.inputs):
            if graph.nodes[u].kind != PARAM or u in shared:
                continue
            dst = choice[v.name].inputs[slot]
            if (u, dst) in seen:
                continue
            seen.add((u, dst))
            step = single_gather(v.in_shapes[slot], choice[u].out(idx), dst, graph.mesh_shape)
            if step is not None:
                out.setdefault(step.mesh_dim, []).append((groups[(v.name, slot)],
                                                          (u, dst, step.dim)))
    return out


def _shared_across_stages(graph: StrategyGraph, stage_of: dict[str, int]) -> set[str]:
    stages: dict[str, set[int]] = {}
    for v in graph.nodes.values():
        for u, _ in v.inputs:
            if graph.nodes[u].kind == PARAM:
                stages.setdefault(u, set()).add(stage_of.get(v.name, 0))
    return {u for u, ks in stages.items() if len(ks) > 1}


def gather_buckets(graph: StrategyGraph, choice: dict[str, Strategy],
                   limit: float = BUCKET_BYTES, stage_of: dict[str, int] | None = None
                   ) -> dict[int, list[list[Use]]]:
    """Per mesh dimension, the gathered uses in buckets, in order of first use: one all-gather
    each, holding what one group of `use_groups(graph, limit, stage_of)` gathers there (with
    `stage_of`, every op's pipeline stage: buckets within one stage, parameters of several
    stages in none)."""
    groups = use_groups(graph, limit, stage_of)
    out: dict[int, list[list[Use]]] = {}
    for k, uses in gathered_uses(graph, choice, groups, stage_of).items():
        chain: dict[int, list[Use]] = {}
        for j, use in uses:
            chain.setdefault(j, []).append(use)
        out[k] = list(chain.values())
    return out
