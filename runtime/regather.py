"""Reshard after forward: free gathered parameters after forward, gather them again for backward.

A parameter stored sharded and gathered whole for its use (FSDP) is, left alone, kept whole
from its forward use until backward: autograd saves the gathered tensor (or a view of it, such
as the transpose a linear layer multiplies by) for the gradient of the op's input. Under
`resharding(comm)` a training forward saves, in place of such a tensor, a token naming its
gather group and how the saved view sits in the gathered tensor (saved-tensor hooks, as
`torch.utils.checkpoint` uses them), so the gathered copy is freed once forward is done with
it. Backward gathers a group again when it first needs one of its tensors, keeps it while
other saved tensors of the group remain to be used, and prefetches the group gathered before
it in forward (the next backward needs), as FSDP2's `reshard_after_forward=True` does. Every
rank runs the same program and the same backward, so the gathers are issued in the same order
on every rank.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from .collectives import Gathering, copy_out


class _Group:
    """The parameters one bucket gathered in forward and frees after it."""

    def __init__(self, xs, dims, group, previous: _Group | None):
        self.xs = [x.detach() for x in xs]  # the shards: kept (they are the stored parameters)
        self.dims, self.group = list(dims), group
        self.previous = previous  # gathered before this one in forward: the next in backward
        self.pending = 0          # saved references not yet used by backward
        self.whole: list[torch.Tensor] | None = None
        self.started: Gathering | None = None

    def prefetch(self) -> None:
        """Start gathering again (asynchronously), unless done or under way."""
        if self.whole is None and self.started is None and self.pending > 0:
            self.started = Gathering(self.xs, self.group)

    def tensor(self, i: int) -> torch.Tensor:
        """Gathered tensor `i`, gathering the group again when needed."""
        if self.whole is None:
            if self.started is None:
                self.started = Gathering(self.xs, self.group)
            self.whole = copy_out(self.started.wait(), self.xs, self.dims,
                                  dist.get_world_size(self.group))
            self.started = None
            if self.previous is not None:
                self.previous.prefetch()
        t = self.whole[i]
        self.pending -= 1
        if self.pending <= 0:  # backward is done with the group: free it (after this use)
            self.whole = None
        return t


class _Saved:
    """What autograd keeps in place of a view of a gathered parameter."""

    __slots__ = ("group", "index", "size", "stride", "offset")

    def __init__(self, group: _Group, index: int, t: torch.Tensor):
        self.group, self.index = group, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class Regathering:
    """The gathered parameters of one training forward that backward gathers again."""

    def __init__(self):
        self._owner: dict[int, tuple[weakref.ref, _Group, int]] = {}
        self._last: dict[int, _Group] = {}  # per process group: the latest group gathered

    def register(self, whole: list[torch.Tensor], xs, dims, group) -> None:
        """Tensors `whole` were gathered from shards `xs` (along `dims`) over `group`."""
        g = _Group(xs, dims, group, self._last.get(id(group)))
        self._last[id(group)] = g
        for i, t in enumerate(whole):
            self._owner[id(t)] = (weakref.ref(t), g, i)

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        found = self._owner.get(id(base))
        if found is None or found[0]() is not base:
            return t
        found[1].pending += 1
        return _Saved(found[1], found[2], t)

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        whole = saved.group.tensor(saved.index)
        return whole.as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def resharding(comm):
    """Run a training forward whose gathered parameters flagged for it (MeshComm's
    `all_gather_many(..., reshard=...)`) are freed after forward and gathered again in
    backward."""
    session = Regathering()
    comm.session = session
    try:
        with torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack):
            yield session
    finally:
        comm.session = None
