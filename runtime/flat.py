"""Flat buffers: many tensors in one, so that one collective moves them all.

Gradient synchronization (runtime/grad_sync.py), the pipeline's shared-parameter sync
(runtime/pipeline.py) and the broadcast of rank 0's model (autopar/materialize.py) each copy
tensors into one flat buffer, run one collective on it, and take the tensors back out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D buffer holding `tensors` one after another (their dtypes promoted alike)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of the leading elements of `flat` as tensors of `shapes`, in order (what
    `flatten` packed; anything after them is left out)."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def write_grads(params: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor]) -> None:
    """Set each parameter's gradient to its tensor of `grads` (a parameter without one takes
    the tensor itself, one with one has it copied in); None entries are skipped."""
    for p, g in zip(params, grads):
        if p is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)
