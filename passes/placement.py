"""Placements of a tensor on a device mesh, and the shapes and slices they imply.

A tensor's placement is a tuple with one entry per mesh dimension, using PyTorch's own classes:
`Replicate()`, `Shard(dim)` or `Partial("sum")`. When several mesh dimensions shard the same tensor
dimension, the lower mesh dimension is the outer one (as in DTensor): the chunk a rank holds is
numbered ``i_a * n_b + i_b`` for mesh dimensions ``a < b``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

R = Replicate()
P = Partial()
Placements = tuple[Placement, ...]

__all__ = [
    "P", "Partial", "Placement", "Placements", "R", "Replicate", "Shard", "as_tuple", "fmt",
    "interned", "is_partial", "is_shard", "local_shape", "local_slices", "parse", "same",
    "shard_dims", "shard_factor",
]


class _Interned(tuple):
    """A placements tuple shared by every strategy that names it, its hash computed once:
    PyTorch's placements hash in Python, and pricing a plan hashes them millions of times
    (cache keys, placement-pair tables). Equal to, and hashing as, the plain tuple."""

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return interned, (tuple(self),)  # hashed again where it is unpickled


_INTERNED: dict[tuple, _Interned] = {}


def interned(placements: Placements) -> Placements:
    """The one shared, hash-once instance of `placements` (see _Interned)."""
    key = tuple(placements)
    got = _INTERNED.get(key)
    if got is None:
        got = _INTERNED[key] = _Interned(key)
        got._hash = hash(key)
    return got


def same(a: Placements, b: Placements) -> bool:
    """Whether two placements are equal; without comparing PyTorch's placements (in Python)
    when both are interned: each interned value has one instance."""
    return a is b or not (type(a) is _Interned and type(b) is _Interned) and a == b


def as_tuple(placements: Placements) -> Placements:
    """`placements` as a tuple, itself when it is one (an interned tuple stays interned)."""
    return placements if isinstance(placements, tuple) else tuple(placements)


def is_shard(p: Placement, dim: int | None = None) -> bool:
    """True if `p` is Shard (on `dim`, when given)."""
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def is_partial(p: Placement) -> bool:
    """True if `p` is a pending sum."""
    return isinstance(p, Partial)


def shard_dims(placements: Placements, dim: int) -> list[int]:
    """Mesh dimensions that shard tensor dimension `dim`, outer first."""
    return [k for k, p in enumerate(placements) if is_shard(p, dim)]


def shard_factor(placements: Placements, mesh_shape: Sequence[int], dim: int) -> int:
    """Number of pieces tensor dimension `dim` is cut into."""
    f = 1
    for k in shard_dims(placements, dim):
        f *= mesh_shape[k]
    return f


def _factors(ndim: int, placements: Placements, mesh_shape: Sequence[int],
             strict: bool = True) -> list[int] | None:
    """`shard_factor` of each of `ndim` tensor dimensions. A placement sharding a dimension
    the tensor lacks makes it None (`strict`), or is ignored (as `shard_factor` ignores it)."""
    factors = [1] * ndim
    for k, p in enumerate(placements):
        if isinstance(p, Shard):
            if not 0 <= p.dim < ndim:
                if strict:
                    return None
                continue
            factors[p.dim] *= mesh_shape[k]
    return factors


def divisible(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """True if every sharded dimension splits evenly (autopar only plans even splits)."""
    factors = _factors(len(shape), placements, mesh_shape)
    return factors is not None and all(s % f == 0 for s, f in zip(shape, factors))


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple:
    """The shape each rank holds of a tensor of global `shape` (even splits)."""
    return tuple(s // f for s, f in
                 zip(shape, _factors(len(shape), placements, mesh_shape, strict=False)))


def local_slices(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int],
                 coords: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) per tensor dimension of the block held by the rank at mesh `coords`."""
    out = []
    for d, size in enumerate(shape):
        index, pieces = 0, 1
        for k in shard_dims(placements, d):
            index = index * mesh_shape[k] + coords[k]
            pieces *= mesh_shape[k]
        length = size // pieces
        out.append((index * length, length))
    return out


def fmt(placements: Placements) -> str:
    """Compact text: 'S(0)R' for (Shard(0), Replicate()), 'P' for Partial."""
    return "".join("R" if isinstance(p, Replicate) else "P" if isinstance(p, Partial)
                   else f"S({p.dim})" for p in placements)


def parse(text: str) -> Placements:
    """Inverse of `fmt`."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text[i] == "R":
            out.append(R)
            i += 1
        elif text[i] == "P":
            out.append(P)
            i += 1
        elif text.startswith("S(", i):
            j = text.index(")", i)
            out.append(Shard(int(text[i + 2:j])))
            i = j + 1
        else:
            raise ValueError(f"cannot parse placements {text!r}")
    return tuple(out)
