"""ZeRO-1 and ZeRO-2 at run time (passes/zero.py says what they are).

Each ZeRO parameter has a whole copy (its leaf, what the programs use and autograd gives a
gradient) and a shard (`ZeroParam.view`, this rank's slice of the leaf's memory, which the
user's optimizer steps through a DTensor parameter). `ZeroSync` reduce-scatters the leaves'
gradients into the shards' gradients, in buckets, launched from a post-accumulate-grad hook as
soon as a bucket's gradients are complete (overlapped with backward, as DDP does), and frees
the whole gradients once they are copied out. ZeRO-2 buckets do so in every microbatch;
ZeRO-1 buckets let the whole gradients accumulate over a step's microbatches and
reduce-scatter in the last one. `gather_stepped` all-gathers the shards back into the whole
copies before each step or inference call, whatever changed them: no counter tells reliably
that an optimizer stepped a shard (foreach and fused optimizers update the DTensor's local
tensor below autograd, and `p.data` updates share no version counter with the parameter), and
a whole copy left stale would train on old weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.passes import torch_compat
from autopar.passes.zero import ZeroShard

from .collectives import Gathering, copy_into, rank_major
from .grad_sync import param_buckets


@dataclass
class ZeroParam:
    """One ZeRO parameter on this rank: its stage, where its shard lives, the shard (a slice of
    the leaf) and the shard's gradient."""

    stage: int
    shard: ZeroShard
    view: torch.Tensor
    grad: torch.Tensor | None = None


def shard_view(leaf: torch.Tensor, shard: ZeroShard, coord: int, n: int) -> torch.Tensor:
    """This rank's slice (at `coord` of `n` ranks) of `leaf`, sharing its memory through a
    storage of its own that spans the slice. (A DTensor takes its local tensor's
    storage offset for its own, as if it were the same on every rank; a slice at a
    rank-dependent offset then makes `torch.save` and `copy.deepcopy` of the parameter, its
    state_dict included, fail on every rank but the first.)"""
    size = leaf.shape[shard.dim] // n
    return at_offset_zero(leaf.detach().narrow(shard.dim, coord * size, size))


def at_offset_zero(view: torch.Tensor) -> torch.Tensor:
    """`view` itself when its storage holds just it, else a tensor sharing its memory
    through a storage of its own that spans exactly the elements `view` reaches (see
    `shard_view`; saving it then writes this rank's slice alone)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride())) \
        if view.numel() else 0
    start, size = view.storage_offset() * view.element_size(), view.element_size()
    if start == 0 and view.untyped_storage().nbytes() == extent * size:
        return view
    storage = view.untyped_storage()[start:start + extent * size]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        storage, 0, view.shape, view.stride())


def gather_stepped(entries: list[tuple[torch.Tensor, ZeroParam]], groups: list,
                   bucket_bytes: float) -> None:
    """All-gather every shard (what the optimizer steps) into its whole copy (the leaf), in
    buckets per mesh dimension: a collective on every rank alike. `entries`: (leaf,
    ZeroParam)."""
    by_dim: dict[int, list] = {}
    for leaf, z in entries:
        by_dim.setdefault(z.shard.mesh_dim, []).append((leaf, z))
    for k, pairs in by_dim.items():
        of = {id(leaf): z for leaf, z in pairs}
        for bucket in param_buckets([leaf for leaf, _ in pairs], bucket_bytes):
            zs = [of[id(leaf)] for leaf in bucket]
            rows = Gathering([z.view for z in zs], groups[k]).wait()
            with torch.no_grad():
                copy_into(rows, bucket, [z.view.shape for z in zs], [z.shard.dim for z in zs],
                          groups[k].size())


IN_FLIGHT = 2  # reduce-scatters launched and not yet waited for, at most (their buffers live)


class _Bucket:
    def __init__(self, mesh_dim: int, stage: int, entries: list[tuple[torch.Tensor, ZeroParam]]):
        self.mesh_dim, self.stage, self.entries = mesh_dim, stage, entries
        self.ready = 0


class ZeroSync:
    """Bucketed reduce-scatter of ZeRO parameters' gradients into their shards."""

    def __init__(self, entries: list[tuple[torch.Tensor, ZeroParam]], groups: list,
                 bucket_bytes: float):
        """`entries`: (leaf, ZeroParam) of each ZeRO parameter that trains, in parameter
        order (the same on every rank)."""
        self.groups = groups
        self.buckets: list[_Bucket] = []
        of = {id(leaf): (leaf, z) for leaf, z in entries}
        keys = sorted({(z.shard.mesh_dim, z.stage) for _, z in entries})
        for k, stage in keys:
            # reverse parameter order: the last parameters' gradients are ready first
            leaves = [leaf for leaf, z in reversed(entries)
                      if (z.shard.mesh_dim, z.stage) == (k, stage)]
            for ps in param_buckets(leaves, bucket_bytes):
                self.buckets.append(_Bucket(k, stage, [of[id(p)] for p in ps]))
        self._holding = False
        # launched reduce-scatters, oldest first: (bucket, work, out, src, which had a gradient)
        self._in_flight: list[tuple] = []
        self._hooks = [leaf.register_post_accumulate_grad_hook(lambda _, b=b: self._on_grad(b))
                       for b in self.buckets for leaf, _ in b.entries]

    def begin(self, hold: bool) -> None:
        """Before a step's first backward; with `hold`, ZeRO-1 buckets wait for `release`."""
        self._holding = hold
        for b in self.buckets:
            b.ready = 0

    def release(self) -> None:
        """Before the last microbatch's backward: ZeRO-1 buckets launch in it."""
        self.begin(hold=False)

    def microbatch_done(self) -> None:
        """After a backward that is not the step's last: ZeRO-2 buckets some of whose
        parameters got no gradient are launched now (the rest launched during backward), and
        every reduce-scatter in flight lands in the shards."""
        for b in self.buckets:
            if b.stage >= 2 and b.ready:
                self._launch(b)
        self._land(0)

    def finish(self) -> None:
        """After the last backward: launch what is left (what never became complete, or, for
        ZeRO-1, was held), wait, and add each reduced shard to its parameter's shard gradient
        (a collective: all ranks call it)."""
        for b in self.buckets:
            self._launch(b)
        self._land(0)

    def _on_grad(self, b: _Bucket) -> None:
        if self._holding and b.stage < 2:
            return
        b.ready += 1
        if b.ready == len(b.entries):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        """Copy the bucket's whole gradients into one rank-major buffer, free them, and
        launch its reduce-scatter; at most IN_FLIGHT stay unwaited (ZeRO-2 holds no more
        whole gradients than those)."""
        b.ready = 0
        had = [leaf.grad is not None for leaf, _ in b.entries]
        if not any(had):
            return
        n = self.groups[b.mesh_dim].size()
        grads = [leaf.grad for leaf, _ in b.entries]
        src = rank_major(grads, [z.view.shape for _, z in b.entries],
                         [z.shard.dim for _, z in b.entries], n, grads[had.index(True)].dtype)
        for leaf, _ in b.entries:
            leaf.grad = None
        out = torch.empty(src.shape[1], dtype=src.dtype, device=src.device)
        work = torch_compat.reduce_scatter_single(out, src.view(-1),
                                                  group=self.groups[b.mesh_dim], async_op=True)
        self._in_flight.append((b, work, out, src, had))
        self._land(IN_FLIGHT)

    def _land(self, keep: int) -> None:
        """Wait for the oldest reduce-scatters until `keep` are in flight, adding each
        reduced shard to its parameter's shard gradient."""
        while len(self._in_flight) > keep:
            b, work, out, _, had = self._in_flight.pop(0)
            work.wait()
            offset = 0
            for (leaf, z), got in zip(b.entries, had):
                size = z.view.numel()
                if got:
                    g = out[offset:offset + size].view(z.view.shape).to(leaf.dtype)
                    z.grad = g if z.grad is None else z.grad.add_(g)
                offset += size
