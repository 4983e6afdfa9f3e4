"""Resharding: the collectives that turn one placement of a tensor into another.

Used by the cost model (to price an edge) and by the rewrite pass (to emit it), so both always
agree. Per mesh dimension:

    Shard(d) -> Replicate   all-gather          (backward: reduce-scatter)
    Partial  -> Replicate   all-reduce          (backward: all-reduce)
    Partial  -> Shard(d)    reduce-scatter      (backward: all-gather)
    Replicate-> Shard(d)    local slice, free   (backward: zero padding, free)
    Shard(a) -> Shard(b)    all-to-all          (backward: all-to-all)

Nothing becomes Partial. When several mesh dimensions shard one tensor dimension, mesh dimensions
are undone innermost first and applied outermost first, keeping only the shards that the source
and target share as a common outer prefix (so every step acts on contiguous blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.passes.placement import (
    Placements,
    R,
    Replicate,
    Shard,
    as_tuple,
    is_partial,
    same,
    shard_dims,
    shard_factor,
)

# Collectives over many small tensors (gradient synchronization, FSDP parameter gathers) are
# grouped into buckets of about this many bytes, as DDP does: one latency per bucket, and
# buffers small enough for the allocator to reuse from step to step.
BUCKET_BYTES = 25 * 2**20


def buckets(items: list, nbytes, limit: float = BUCKET_BYTES) -> list[list]:
    """`items` in order, grouped so that each group's `nbytes(item)` sum stays within `limit`
    (an item larger than `limit` is a group of its own)."""
    out: list[list] = []
    size = 0
    for item in items:
        b = nbytes(item)
        if not out or size + b > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += b
    return out


class ReshardError(ValueError):
    """A placement change autopar does not express (to a pending sum)."""


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one mesh dimension.

    `in_shape`/`out_shape` are the local shapes before and after the step.
    """

    kind: str                   # all_gather | reduce_scatter | all_reduce | all_to_all | slice
    mesh_dim: int
    dim: int | None             # tensor dimension gathered / scattered / sliced (all_to_all: split)
    src_dim: int | None         # all_to_all: the dimension that is concatenated
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def plan_steps(shape: Sequence[int], src: Placements, dst: Placements,
               mesh_shape: Sequence[int]) -> list[Step]:
    """The steps from `src` to `dst` for a tensor of global `shape` (a new list each call)."""
    src, dst = as_tuple(src), as_tuple(dst)
    if same(src, dst):
        return []
    steps = _memoized(tuple(shape), src, dst, tuple(mesh_shape))
    if isinstance(steps, ReshardError):
        raise ReshardError(*steps.args)
    return list(steps)


@functools.lru_cache(maxsize=1 << 16)
def _memoized(shape: tuple[int, ...], src: Placements, dst: Placements,
              mesh_shape: tuple[int, ...]) -> tuple[Step, ...] | ReshardError:
    """`_steps`, or the ReshardError it raises, memoized: pricing asks for the same few
    thousand reshardings hundreds of thousands of times on a large model (repeated layers,
    every candidate pair), a quarter of them impossible ones."""
    try:
        return _steps(shape, src, dst, mesh_shape)
    except ReshardError as e:
        return e.with_traceback(None)  # kept in the cache: not with the frames it unwound


def _steps(shape: tuple[int, ...], src: Placements, dst: Placements,
           mesh_shape: tuple[int, ...]) -> tuple[Step, ...]:
    """`plan_steps` for hashable arguments."""
    m = len(mesh_shape)
    for k in range(m):
        if is_partial(dst[k]) and not is_partial(src[k]):
            raise ReshardError(f"cannot make a pending sum from {src[k]} on mesh dimension {k}")
    local = [s for s in shape]
    for d in range(len(shape)):
        local[d] //= shard_factor(src, mesh_shape, d)
    cur = list(src)
    steps: list[Step] = []

    # A lone Shard(a) -> Shard(b) on one mesh dimension, with no other mesh dimension touching
    # a or b, is one all-to-all.
    swap = set()
    for k in range(m):
        if isinstance(src[k], Shard) and isinstance(dst[k], Shard) and src[k].dim != dst[k].dim:
            a, b = src[k].dim, dst[k].dim
            others = [j for j in range(m) if j != k]
            if all(not isinstance(src[j], Shard) or src[j].dim not in (a, b) for j in others) and \
               all(not isinstance(dst[j], Shard) or dst[j].dim not in (a, b) for j in others) and \
               shape[b] % mesh_shape[k] == 0:
                swap.add(k)

    keep = set()
    for d in range(len(shape)):
        s, t = shard_dims(src, d), shard_dims(dst, d)
        for a, b in zip(s, t):
            if a != b:
                break
            keep.add(a)

    for k in reversed(range(m)):
        if isinstance(cur[k], Shard) and k not in keep and k not in swap:
            d = cur[k].dim
            before = tuple(local)
            local[d] *= mesh_shape[k]
            steps.append(Step("all_gather", k, d, None, before, tuple(local)))
            cur[k] = R
    for k in range(m):
        if cur[k] == dst[k]:
            continue
        before = tuple(local)
        if k in swap:
            a, b = cur[k].dim, dst[k].dim
            local[a] *= mesh_shape[k]
            local[b] //= mesh_shape[k]
            steps.append(Step("all_to_all", k, b, a, before, tuple(local)))
        elif is_partial(cur[k]) and isinstance(dst[k], Replicate):
            steps.append(Step("all_reduce", k, None, None, before, before))
        elif is_partial(cur[k]) and isinstance(dst[k], Shard):
            d = dst[k].dim
            local[d] //= mesh_shape[k]
            steps.append(Step("reduce_scatter", k, d, None, before, tuple(local)))
        elif isinstance(cur[k], Replicate) and isinstance(dst[k], Shard):
            d = dst[k].dim
            local[d] //= mesh_shape[k]
            steps.append(Step("slice", k, d, None, before, tuple(local)))
        else:
            raise ReshardError(f"no step from {cur[k]} to {dst[k]} on mesh dimension {k}")
        cur[k] = dst[k]
    return tuple(steps)


def single_gather(shape: Sequence[int], src: Placements, dst: Placements,
                  mesh_shape: Sequence[int]) -> Step | None:
    """The one all-gather that reshards `shape` from `src` to `dst`, when that is all the
    resharding does on mesh dimensions of more than one device (a parameter gathered whole
    from its storage shard for its use, FSDP's gather); else None."""
    if as_tuple(src) == as_tuple(dst):
        return None
    try:
        steps = [s for s in plan_steps(shape, src, dst, mesh_shape) if mesh_shape[s.mesh_dim] > 1]
    except ReshardError:
        return None
    return steps[0] if len(steps) == 1 and steps[0].kind == "all_gather" else None
