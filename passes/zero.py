"""ZeRO-1 and ZeRO-2: a parameter replicated for compute whose optimizer state (ZeRO-1), and
gradient (ZeRO-2), are sharded over the data-parallel ranks.

Such a parameter is stored like a DDP one (every rank of the data-parallel mesh dimension keeps
the whole of its block, and the programs use it there) and is handed to the user's optimizer
as a shard: a DTensor whose placement shards one more tensor dimension over that mesh
dimension, a view of the rank's slice of the whole copy. The optimizer's state follows that
shard. Its gradient is reduce-scattered into the shard (instead of all-reduced whole); after
the optimizer steps the shards, they are all-gathered into the whole copies before the next
use. ZeRO-1 accumulates the whole gradient over a step's microbatches and reduce-scatters it
once; ZeRO-2 reduce-scatters each microbatch's gradient as soon as it is complete and keeps
only the shard.

A parameter can take ZeRO when its storage replicates it on exactly one mesh dimension with
more than one rank (the one it is sharded over) and some tensor dimension that storage does
not shard splits evenly there (the first such, dimension 0 where it can, as FSDP2 shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .placement import Placements, Replicate, Shard, local_shape, shard_dims

STAGES = (1, 2)


@dataclass(frozen=True)
class ZeroShard:
    """Where a ZeRO parameter's shard lives: over mesh dimension `mesh_dim`, along tensor
    dimension `dim` of the stored block; `placements` as the user's DTensor has them."""

    mesh_dim: int
    dim: int
    placements: Placements


def zero_shard(shape: Sequence[int], storage: Placements,
               mesh_shape: Sequence[int]) -> ZeroShard | None:
    """How a parameter of global `shape` stored at `storage` is sharded under ZeRO, or None
    when it cannot be (see the module docstring)."""
    reduced = [k for k, p in enumerate(storage)
               if isinstance(p, Replicate) and mesh_shape[k] > 1]
    if len(reduced) != 1:
        return None
    k = reduced[0]
    block = local_shape(shape, storage, mesh_shape)
    for d, size in enumerate(block):
        if size > 1 and size % mesh_shape[k] == 0 and not shard_dims(storage, d):
            placements = tuple(Shard(d) if j == k else p for j, p in enumerate(storage))
            return ZeroShard(k, d, placements)
    return None
