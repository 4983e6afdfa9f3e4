"""The loss as the ranks hold it: what backward starts from and what the reported loss sums.

The training program returns the loss at its placement. On a mesh dimension where it is
Replicate every rank holds the whole loss and its backward adds a whole gradient, so backward
is seeded with 1 / (the product of those dimensions' sizes): the contributions then sum to the
gradient of one loss. On a dimension where it is Partial the ranks hold addends, which seed
backward as they are and are summed over that dimension for the loss the step reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate

from autopar.passes.placement import Placements


@dataclass(frozen=True)
class LossSeeding:
    """`seed`: the gradient backward starts from; `pending_dims`: the mesh dimensions (of more
    than one rank) the reported loss is summed over."""

    seed: float
    pending_dims: tuple[int, ...]


def loss_seeding(placement: Placements | None, mesh_shape: Sequence[int]) -> LossSeeding:
    """How to seed backward from, and report, a loss held at `placement` on a mesh of
    `mesh_shape` (None: a program without loss)."""
    if placement is None:
        return LossSeeding(1.0, ())
    copies = math.prod(mesh_shape[k] for k, p in enumerate(placement) if isinstance(p, Replicate))
    pending = tuple(k for k, p in enumerate(placement)
                    if isinstance(p, Partial) and mesh_shape[k] > 1)
    return LossSeeding(1.0 / copies, pending)
