"""What the rewrite emitted: a record on every node of a rank's program.

`passes.rewrite` writes one `Emitted` into `node.meta[META_KEY]` of each node it emits, saying
what the node is for. Later passes (the pipeline split) and the runtime read these records;
they never recognise generated code by its call targets.

    role          what the node is                          origin
    placeholder   a program input                           the traced placeholder
    op            a traced op on local shards               the traced node it computes
    getitem       one output of a multi-output op           the traced node
    collective    one resharding collective                 the traced node whose value it moves
    slice         a local slice (Replicate -> Shard)        the traced node whose value it slices
    gather_start  the asynchronous start of a bucket of     None (a bucket of parameters)
                  parameter all-gathers (FSDP prefetch)
    gather_wait   the wait for that bucket, gathering all   None
    gathered      one parameter gathered by gather_wait     the parameter's placeholder

`shape` and `dtype` are the node's local value (None for tuples and handles); `requires_grad`
whether a gradient flows back through it. Collectives (and `gather_wait` / `gathered`) name
their `collective` kind and `mesh_dim`; resharding nodes name the `consumer` op they were first
emitted for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

META_KEY = "autopar"

ROLES = ("placeholder", "op", "getitem", "collective", "slice", "gather_start", "gather_wait",
         "gathered")


@dataclass(frozen=True)
class Emitted:
    """What one node of a rank's program computes or serves (see the module docstring)."""

    role: str
    origin: str | None
    index: int | None = None                 # which output of a multi-output origin
    shape: tuple[int, ...] | None = None     # the local shape; None for tuples and handles
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    collective: str | None = None            # all_gather | reduce_scatter | all_reduce | ...
    mesh_dim: int | None = None
    consumer: str | None = None              # resharding: the op it was first emitted for

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; one of {ROLES}")


def emitted(node: fx.Node) -> Emitted:
    """The record the rewrite left on `node`; KeyError for a node it did not emit."""
    return node.meta[META_KEY]
