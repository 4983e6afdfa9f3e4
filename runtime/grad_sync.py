"""Gradient synchronization: all-reduce the gradients of parameters stored replicated.

The local gradient of a replicated parameter is a pending sum over every mesh dimension where it
is replicated, so it is summed there. Gradients are flattened into buckets of at most
`bucket_bytes` per mesh dimension and dtype, and each bucket's all-reduce is launched
asynchronously; `wait()` finishes them and writes the sums back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import compat


class GradSync:
    """Bucketed all-reduce of replicated parameters' gradients."""

    def __init__(self, params: list[tuple[torch.nn.Parameter, tuple[int, ...]]], groups: list,
                 mesh_shape: tuple[int, ...], bucket_bytes: int = 25 * 2**20):
        self.buckets: list[tuple[int, list[torch.nn.Parameter]]] = []
        for k in range(len(mesh_shape)):
            if mesh_shape[k] == 1:
                continue
            by_dtype: dict[torch.dtype, list[list[torch.nn.Parameter]]] = {}
            for p, dims in params:
                if k not in dims:
                    continue
                lists = by_dtype.setdefault(p.dtype, [[]])
                if lists[-1] and sum(q.numel() for q in lists[-1]) * p.element_size() + \
                        p.numel() * p.element_size() > bucket_bytes:
                    lists.append([])
                lists[-1].append(p)
            for lists in by_dtype.values():
                self.buckets += [(k, ps) for ps in lists if ps]
        self.groups = groups

    def sync(self) -> None:
        """Sum the gradients over their replicated mesh dimensions (missing gradients count as 0).

        Mesh dimensions are reduced one after the other (a gradient replicated on two
        dimensions is summed over the first, then the result over the second); the buckets of
        one dimension are in flight together.
        """
        for k in sorted({k for k, _ in self.buckets}):
            self._sync_dim([ps for j, ps in self.buckets if j == k], k)

    def _sync_dim(self, buckets: list[list[torch.nn.Parameter]], k: int) -> None:
        pending = []
        for ps in buckets:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in ps])
            work = compat.all_reduce(flat, group=self.groups[k], async_op=True)
            pending.append((work, flat, ps))
        for work, flat, ps in pending:
            work.wait()
            offset = 0
            for p in ps:
                n = p.numel()
                g = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n


def all_reduce_value(x: torch.Tensor, groups: list, dims: list[int]) -> torch.Tensor:
    """Sum a detached tensor over the given mesh dimensions (for reporting, not autograd)."""
    x = x.detach().clone()
    for k in dims:
        dist.all_reduce(x, group=groups[k])
    return x
