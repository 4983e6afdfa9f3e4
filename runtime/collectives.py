"""Autograd-aware collectives over one mesh dimension.

Each forward collective carries its adjoint as backward, so plain autograd over the local
program computes the right gradients (the gradient of a replicated value is a pending sum, of a
pending sum a replicated value, of a shard the same shard):

    all_gather(dim)      <->  reduce_scatter(dim)
    reduce_scatter(dim)  <->  all_gather(dim)
    all_reduce           <->  all_reduce
    all_to_all(a -> b)   <->  all_to_all(b -> a)
    all_gather_many      <->  one reduce-scatter of all the gradients
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.passes import torch_compat
from autopar.passes.gathers import reduce_dtype


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    buf = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch_compat.all_gather_single(buf, x, group=group)
    if dim == 0:
        return buf
    full = torch.empty(_gathered(x.shape, dim, n), dtype=x.dtype, device=x.device)
    _blocks(full, x.shape, dim, n).copy_(buf.view(n, *x.shape))
    return full


def _scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    shape = list(x.shape)
    shape[dim] //= n
    if dim == 0:
        src = x.contiguous()
    else:
        src = _blocks(x, shape, dim, n).reshape(n * shape[0], *shape[1:])
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    torch_compat.reduce_scatter_single(out, src, group=group)
    return out


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    torch_compat.all_reduce(out, group=group)
    return out


def _swap(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    src = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
    out = torch.empty_like(src)
    torch_compat.all_to_all_single(out, src, group=group)
    shape = list(src.shape[1:])
    shape[cat_dim] *= n
    return out.movedim(0, cat_dim).reshape(shape)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _swap(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _swap(grad, cat_dim, split_dim, ctx.group), None, None, None


class _AllGatherMany(torch.autograd.Function):
    """Several shards gathered in one collective (FSDP parameters): each tensor i is
    concatenated along dims[i]. Backward: one reduce-scatter of all their gradients.

    The gathered buffer is rank-major (every rank's shards in a row), so each parameter is
    copied out of it once, and each gradient copied into the reduce-scatter buffer once,
    whichever dimension it is sharded on (as FSDP2's copy-in / copy-out)."""

    @staticmethod
    def forward(ctx, dims, group, started, *xs):
        n = dist.get_world_size(group)
        ctx.dims, ctx.group, ctx.shapes = dims, group, [x.shape for x in xs]
        ctx.set_materialize_grads(False)  # see backward
        if started is None:
            started = Gathering(xs, group)
        out = copy_out(started.wait(), xs, dims, n)
        # A frozen parameter's gathered copy carries no gradient, though its bucket's others do.
        ctx.mark_non_differentiable(*[o for x, o in zip(xs, out) if not x.requires_grad])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        # A parameter that got no gradient (used only under no_grad) gets none, as on one
        # device, so that optimizers skip it; every rank runs the same program, so the same
        # ones on every rank, and their slots are reduced as zeros.
        n = dist.get_world_size(ctx.group)
        some = next(g for g in grads if g is not None)
        sizes = [torch.Size(s).numel() for s in ctx.shapes]
        dtype = some.dtype
        src = rank_major(grads, ctx.shapes, ctx.dims, n, reduce_dtype(dtype))
        out = torch.empty(src.shape[1], dtype=src.dtype, device=src.device)
        torch_compat.reduce_scatter_single(out, src.view(-1), group=ctx.group)
        grads_in, offset = [], 0
        for g, shape, size in zip(grads, ctx.shapes, sizes):
            grads_in.append(None if g is None else out[offset:offset + size].view(shape).to(dtype))
            offset += size
        return (None, None, None, *grads_in)


def copy_out(rows: torch.Tensor, xs, dims, n: int) -> list[torch.Tensor]:
    """The whole tensors of shards `xs` (each concatenated along dims[i]) from the rows an
    all-gather of their flattened concatenation made: (ranks, total shard elements)."""
    out = [torch.empty(_gathered(x.shape, d, n), dtype=x.dtype, device=x.device)
           for x, d in zip(xs, dims)]
    copy_into(rows, out, [x.shape for x in xs], dims, n)
    return out


def copy_into(rows: torch.Tensor, wholes, shard_shapes, dims, n: int) -> None:
    """Write the gathered `rows` (ranks, total shard elements) into the whole tensors
    `wholes`, each the concatenation of n shards of shard_shapes[i] along dims[i]."""
    offset = 0
    for whole, shape, d in zip(wholes, shard_shapes, dims):
        size = torch.Size(shape).numel()
        _blocks(whole, shape, d, n).copy_(rows[:, offset:offset + size].view(n, *shape))
        offset += size


def rank_major(wholes, shard_shapes, dims, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The buffer a reduce-scatter of several tensors takes: (ranks, total shard elements),
    row r holding rank r's block (along dims[i], of shard_shapes[i]) of each of `wholes` one
    after another, in `dtype`; a None entry contributes zeros (copy-in, as FSDP2's)."""
    sizes = [torch.Size(s).numel() for s in shard_shapes]
    some = next(w for w in wholes if w is not None)
    src = torch.empty(n, sum(sizes), dtype=dtype, device=some.device)
    offset = 0
    for w, shape, d, size in zip(wholes, shard_shapes, dims, sizes):
        if w is None:
            src[:, offset:offset + size].zero_()
        else:
            src[:, offset:offset + size].view(n, *shape).copy_(_blocks(w, shape, d, n))
        offset += size
    return src


class Gathering:
    """An all-gather of several shards in flight (launched asynchronously): `wait()` returns
    the gathered rows, (ranks, total shard elements)."""

    def __init__(self, xs, group):
        n = dist.get_world_size(group)
        with torch.no_grad():
            self.flat = torch.cat([x.detach().reshape(-1) for x in xs])
        self.buf = torch.empty(n * self.flat.numel(), dtype=self.flat.dtype,
                               device=self.flat.device)
        self.work = torch_compat.all_gather_single(self.buf, self.flat, group=group, async_op=True)
        self.n = n

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.flat = None
        return self.buf.view(self.n, -1)


def _gathered(shape, dim: int, n: int) -> list[int]:
    full = list(shape)
    full[dim] *= n
    return full


def _blocks(full: torch.Tensor, shard_shape, dim: int, n: int) -> torch.Tensor:
    """`full` (gathered along `dim`) as (n, *shard_shape): block r is rank r's shard (a view when
    `full` is contiguous)."""
    split = [*shard_shape[:dim], n, *shard_shape[dim:]]
    return full.reshape(split).movedim(dim, 0)


class MeshComm:
    """The collectives of one device mesh, by mesh dimension (what `passes.rewrite` calls)."""

    def __init__(self, groups: list):
        self.groups = groups
        # while a training forward runs with parameters resharded after forward: the
        # runtime.regather.Regathering that frees their gathered copies (see `all_gather_many`)
        self.session = None

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        """Concatenate the shards of mesh dimension `mesh_dim` along `dim`."""
        return _AllGather.apply(x, dim, self.groups[mesh_dim])

    def reduce_scatter(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        """Sum over `mesh_dim` and keep this rank's block of `dim`."""
        return _ReduceScatter.apply(x, dim, self.groups[mesh_dim])

    def all_reduce(self, x: torch.Tensor, mesh_dim: int) -> torch.Tensor:
        """Sum over `mesh_dim`."""
        return _AllReduce.apply(x, self.groups[mesh_dim])

    def all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int,
                   mesh_dim: int) -> torch.Tensor:
        """Trade a shard of `cat_dim` for a shard of `split_dim`."""
        return _AllToAll.apply(x, split_dim, cat_dim, self.groups[mesh_dim])

    def all_gather_start(self, xs: list[torch.Tensor], dims: list[int],
                         mesh_dim: int) -> Gathering:
        """Launch the gather of several shards asynchronously (a prefetch); pass the result to
        `all_gather_many` where the shards are first needed."""
        return Gathering(xs, self.groups[mesh_dim])

    def all_gather_many(self, xs: list[torch.Tensor], dims: list[int], mesh_dim: int,
                        started: Gathering | None = None, reshard: tuple[bool, ...] = ()
                        ) -> tuple[torch.Tensor, ...]:
        """Gather several shards in one collective (FSDP parameters), each along its dim; with
        `started` (from all_gather_start) only wait for it. The gathered tensors flagged in
        `reshard` are freed after forward and gathered again in backward, when a training
        forward runs under `runtime.regather.resharding`."""
        group = self.groups[mesh_dim]
        out = _AllGatherMany.apply(tuple(dims), group, started, *xs)
        if self.session is not None and any(reshard):
            self.session.register(
                [o for o, r in zip(out, reshard) if r], [x for x, r in zip(xs, reshard) if r],
                [d for d, r in zip(dims, reshard) if r], group)
        return out
