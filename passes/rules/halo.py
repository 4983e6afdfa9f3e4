"""Halo exchange: a sliding-window op (convolution, max pool) with a spatial dimension sharded.

Along a spatial dimension of H input rows split into shards of L, an op whose window spans
`span = dilation x (kernel - 1) + 1` rows with `stride` s and `padding` p makes H / s output
rows when its padding is "same"-like; then rank r's output rows are those of its own input
rows, [r L / s, (r + 1) L / s), and they read the input rows

    [r L - p, (r + 1) L - s - p + span - 1],

its shard and a halo: `left = p` rows of the shard before, `right = span - p - s` rows of
the shard after (fewer than none: the shard's last rows are not read). The edge shards read
the op's own padding there (zeros for a convolution, -inf for a max pool). So the local op
runs on its shard extended by the halo, unpadded along that dimension, and makes exactly its
output rows.

The halo travels in one all-gather over the mesh dimensions that shard the dimension (each
rank's first `right` and last `left` rows; each rank keeps its neighbours'): an autograd
all-gather whose adjoint reduce-scatters the gradients, so backward sends each halo's
gradient back to the rank that owns its rows. Where the halo is wider than a shard (a wide
kernel over many ranks) the shards themselves are gathered. Sharded spatial dimensions are
extended one after another, the later ones with the earlier ones' halo already in place, so
a 2-D split gets its corners too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .registry import LocalContext, Shard


@dataclass(frozen=True)
class Window:
    """The halo of one spatial dimension: rows before a shard its output reads (`left`) and
    after it (`right`; negative: the shard's last -right rows are not read)."""

    left: int
    right: int


def _per_dim(value, n: int) -> list[int] | None:
    """An int-or-list argument (stride, padding, dilation, kernel) as n ints."""
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    if len(value) == 1:
        return value * n
    return value if len(value) == n and all(isinstance(v, int) for v in value) else None


def windows(in_shape, out_shape, first: int, kernel, stride, padding, dilation
            ) -> dict[int, Window]:
    """The spatial dimensions (from `first`) along which the op makes one output row per
    `stride` input rows, each with its halo; {} for arguments this does not read (string
    padding)."""
    n = len(in_shape) - first
    kernel, stride = _per_dim(kernel, n), _per_dim(stride if stride else kernel, n)
    padding, dilation = _per_dim(padding, n), _per_dim(dilation, n)
    if None in (kernel, stride, padding, dilation):
        return {}
    out = {}
    for i in range(n):
        d = first + i
        span = dilation[i] * (kernel[i] - 1) + 1
        if out_shape[d] * stride[i] == in_shape[d] and padding[i] < span:
            out[d] = Window(padding[i], span - padding[i] - stride[i])
    return out


def sharded(geometry: dict[int, Window], ctx: LocalContext
            ) -> list[tuple[int, Window, list[int]]]:
    """(dimension, its halo, the mesh dimensions sharding it) for each spatial dimension of
    `geometry` this rank's input has sharded."""
    return [(d, w, ks) for d, w in geometry.items()
            if (ks := _mesh_dims(ctx.in_placements[0], ctx.mesh_shape, d))]


def _mesh_dims(placements, mesh_shape, d: int) -> list[int]:
    return [k for k, p in enumerate(placements)
            if isinstance(p, Shard) and p.dim == d and mesh_shape[k] > 1]


def _exchanges_rows(w: Window, length: int) -> int:
    """Rows each rank contributes to the halo's all-gather (0: none needed)."""
    if w.left == 0 and w.right <= 0:
        return 0
    if w.left > length or w.right > length:
        return length  # wider than a shard: the shards themselves
    return w.left + max(w.right, 0)


def exchanges(geometry: dict[int, Window], x, placements, mesh_shape, itemsize) -> list:
    """The all-gathers of the halos of `x` (a TensorArg) placed as `placements`: one per mesh
    dimension sharding a spatial dimension, with the bytes gathered."""
    local = list(x.shape)
    for k, p in enumerate(placements):
        if isinstance(p, Shard):
            local[p.dim] //= mesh_shape[k]
    out = []
    for d, w in geometry.items():  # in `extend`'s order: a later halo carries the earlier ones
        ks = _mesh_dims(placements, mesh_shape, d)
        rows = _exchanges_rows(w, local[d]) if ks else 0
        if not rows:
            continue
        nbytes = rows * math.prod(local) // local[d] * itemsize(x.dtype)
        for k in reversed(ks):  # innermost first, as `extend` gathers
            nbytes *= mesh_shape[k]
            out.append(("all_gather", k, nbytes))
        local[d] += w.left + w.right
    return out


def saved_bytes(geometry: dict[int, Window], x, in_local, itemsize) -> float:
    """Bytes of the extended shard a sliding-window op keeps for its backward (its input,
    which is no other op's output once extended) where `in_local` (its input's local shape)
    splits a dimension of `geometry`; 0 where none is split."""
    local = list(in_local)
    grown = False
    for d, w in geometry.items():
        if local[d] < x.shape[d]:
            local[d] += w.left + w.right
            grown = True
    return math.prod(local) * itemsize(x.dtype) if grown else 0.0


def extend(x: torch.Tensor, d: int, w: Window, ks: list[int], ctx: LocalContext,
           fill: float) -> torch.Tensor:
    """This rank's shard `x` of dimension `d` (sharded over mesh dimensions `ks`, outer first)
    with its halo: the neighbours' rows, or `fill` past the tensor's edges."""
    length = x.shape[d]
    shards = math.prod(ctx.mesh_shape[k] for k in ks)
    index = 0
    for k in ks:
        index = index * ctx.mesh_shape[k] + ctx.coords[k]
    rows = _exchanges_rows(w, length)
    body = x if w.right >= 0 else x.narrow(d, 0, length + w.right)
    if not rows:
        return body

    def gather(t: torch.Tensor) -> torch.Tensor:  # (1, ...) -> (shards, ...), in shard order
        for k in reversed(ks):
            t = ctx.comm.all_gather(t, 0, k)
        return t

    def edge(n: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[d] = n
        return x.new_full(shape, fill)

    right = max(w.right, 0)
    if w.left > length or w.right > length:  # the halo is wider than a shard: all shards
        whole = torch.cat([edge(w.left), *gather(x.unsqueeze(0)).unbind(0), edge(right)], d)
        return whole.narrow(d, index * length, length + w.left + w.right)
    slabs = gather(torch.cat([x.narrow(d, 0, right), x.narrow(d, length - w.left, w.left)],
                             d).unsqueeze(0))
    before = slabs[index - 1].narrow(d, right, w.left) if index > 0 else edge(w.left)
    after = slabs[index + 1].narrow(d, 0, right) if index < shards - 1 else edge(right)
    return torch.cat([before, body, after], d)


def lowered(target, args: tuple, kwargs: dict, pad_slot: int, first: int,
            dims: list[tuple[int, Window, list[int]]], ctx: LocalContext, fill: float):
    """(callable, args, kwargs) running `target` on this rank's input extended by its halo
    along `dims` (see `sharded`), its padding (argument `pad_slot`, or the "padding"
    keyword; spatial dimensions from `first`) dropped along them."""
    n = len(ctx.local_out_shapes[0]) - first
    given = args[pad_slot] if pad_slot < len(args) else kwargs.get("padding", 0)
    padding = [0 if first + i in {d for d, _, _ in dims} else p
               for i, p in enumerate(_per_dim(given, n))]
    if pad_slot < len(args):
        args = (*args[:pad_slot], padding, *args[pad_slot + 1:])
    else:
        kwargs = {**kwargs, "padding": padding}

    def local(x, *rest, **kw):
        for d, w, ks in dims:
            x = extend(x, d, w, ks, ctx, fill)
        return target(x, *rest, **kw)

    local.__name__ = "halo_" + target.__name__.split(".")[0]
    return local, args, kwargs
