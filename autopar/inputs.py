"""What a call of a parallelized model passes: split into model inputs and target, checked, and
summarized as the key of the program that runs it.

A call `step(*args, **kwargs)` (or `model(*args, **kwargs)`) passes the model's positional
inputs, its keyword inputs and, for `step` with a `loss_fn`, the target as the last positional
argument. Keyword inputs are kept sorted by name, so that the order a caller writes them in
does not matter. The `Call` is that split plus what identifies the program for it: the mode
(train or eval), shapes and dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autopar.passes.placement import Placements, R, Shard
from autopar.passes.trace import TraceError

if TYPE_CHECKING:
    from .mesh import MeshSpec
    from .options import PlanOptions


@dataclass(frozen=True)
class TensorKind:
    """Shape and dtype of one input, as a program is traced for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Call:
    """One call's inputs: `args` (positional model inputs), `kwargs` (sorted by name), the
    `target` (None without a loss_fn or for inference)."""

    args: tuple[torch.Tensor, ...]
    kwargs: tuple[tuple[str, torch.Tensor], ...]
    target: torch.Tensor | None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor in traced order: positional inputs, target, keyword inputs."""
        return [*self.args, *([self.target] if self.target is not None else []),
                *(t for _, t in self.kwargs)]

    def key(self, modes) -> tuple:
        """What identifies the model's program for this call: the modules' modes (`modes`,
        their train / eval flags) and the model inputs' names, shapes and dtypes (the target
        is matched separately)."""
        kinds = tuple(TensorKind(tuple(t.shape), t.dtype)
                      for t in [*self.args, *(t for _, t in self.kwargs)])
        return (modes, tuple(k for k, _ in self.kwargs), len(self.args), kinds)

    def describe(self) -> str:
        """The inputs in words, for errors."""
        parts = [f"input {i}: {TensorKind(tuple(t.shape), t.dtype)}"
                 for i, t in enumerate(self.args)]
        parts += [f"{k}: {TensorKind(tuple(t.shape), t.dtype)}" for k, t in self.kwargs]
        if self.target is not None:
            parts.append(f"target: {TensorKind(tuple(self.target.shape), self.target.dtype)}")
        return ", ".join(parts) or "no inputs"


def split_call(args: tuple, kwargs: dict, with_target: bool) -> Call:
    """The call's model inputs and target; a non-tensor input is an error naming it."""
    if with_target:
        if not args:
            raise TypeError("step() with a loss_fn takes the model inputs followed by the "
                            "target: step(*inputs, target)")
        *args, target = args
    else:
        target = None
    for where, t in [*((f"input {i}", a) for i, a in enumerate(args)),
                     *((f"keyword input {k!r}", v) for k, v in kwargs.items()),
                     *((("target", target),) if with_target else ())]:
        if not isinstance(t, torch.Tensor):
            raise TraceError(
                f"{where} is a {type(t).__name__}, not a tensor: autopar shards tensors only. "
                "Pass non-tensor settings to the model's constructor, or wrap the model so "
                "that its forward takes tensors only.")
    return Call(tuple(args), tuple(sorted(kwargs.items())), target)


def check_device(call: Call, device: torch.device) -> str | None:
    """An error message if an input is not on the device the model runs on."""
    for t in call.tensors:
        if t.device.type != device.type or (device.index is not None and
                                            t.device.index not in (None, device.index)):
            return (f"an input is on {t.device}, the model runs on {device}: move the batch "
                    f"to {device} before the call")
    return None


def check_no_input_grads(call: Call) -> str | None:
    """An error message if an input asks for its gradient (requires_grad=True): a step
    computes the gradients of the parameters only (each rank would get only its rows of an
    input's)."""
    names = [*(f"input {i}" for i in range(len(call.args))),
             *(["the target"] if call.target is not None else []),
             *(f"input {k!r}" for k, _ in call.kwargs)]
    wants = [n for n, t in zip(names, call.tensors) if t.requires_grad]
    if not wants:
        return None
    return (f"{', '.join(wants)} requires grad: step() computes the gradients of the model's "
            "parameters, not of its inputs (each rank would hold only its rows of them). "
            "Pass the inputs detached (x.detach()); for gradients with respect to an input, "
            "make it a parameter of the model")


def global_call(call: Call, pieces: int) -> Call:
    """The global batch a per-rank call is a slice of (`pieces` slices along dimension 0), as
    zeros of the global shape: what the program is traced for."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            raise ValueError("per-rank inputs split dimension 0 of every input; a scalar input "
                             "cannot be split")
        return torch.zeros((t.shape[0] * pieces, *t.shape[1:]), dtype=t.dtype, device="meta")
    return Call(tuple(whole(t) for t in call.args), tuple((k, whole(t)) for k, t in call.kwargs),
                None if call.target is None else whole(call.target))


def on_meta(call: Call) -> Call:
    """The call's tensors as meta tensors of the same shapes (what tracing needs)."""
    def meta(t):
        return t if t.device.type == "meta" else torch.empty_like(t, device="meta")
    return Call(tuple(meta(t) for t in call.args), tuple((k, meta(t)) for k, t in call.kwargs),
                None if call.target is None else meta(call.target))


def pieces_of(mesh_shape, names, per_rank: tuple[str, ...]) -> int:
    """How many per-rank slices the global batch is cut into."""
    return math.prod(s for n, s in zip(names, mesh_shape) if n in per_rank)


def batch_of(call: Call) -> int | None:
    """The batch size every tensor of the call carries as dimension 0 (what gradient
    accumulation splits), or None when they share none."""
    sizes = {t.shape[0] if t.dim() else None for t in call.tensors}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def indivisible(batch: int | None, m: int, shapes: str = "") -> str:
    """Why a batch of `batch` (None: the inputs share none; `shapes` names theirs) cannot run
    as `m` microbatches, or ""."""
    if m == 1 or (batch is not None and batch % m == 0):
        return ""
    if batch is None:
        return (f"{m} microbatches split every input and the target along dimension 0, which "
                f"must be the batch in each{f'; the shapes are {shapes}' if shapes else ''}. "
                "Pass microbatches=1, or hold a tensor without a batch dimension (a mask every "
                "sample shares) in a buffer of the model")
    return (f"microbatches={m} must divide the batch (dimension 0 of every input and the "
            f"target, {batch}); choose a divisor of {batch}: "
            + ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0))


def unsplittable(call: Call, m: int) -> str:
    """Why the call cannot run as `m` microbatches, or "" (`indivisible`)."""
    return indivisible(batch_of(call), m,
                       ", ".join(str(tuple(t.shape)) for t in call.tensors))


def microbatch(call: Call, m: int, i: int = 0) -> Call:
    """The `i`-th of `m` equal microbatches of the call (dimension 0 of every tensor); the
    call itself for one. A ValueError where the tensors share no batch m divides (a mask
    without a batch dimension, a 0-dimensional input)."""
    if m == 1:
        return call
    why = unsplittable(call, m)
    if why:
        raise ValueError(why)

    def part(t: torch.Tensor) -> torch.Tensor:
        size = t.shape[0] // m
        return t.narrow(0, i * size, size)
    return Call(tuple(part(t) for t in call.args), tuple((k, part(t)) for k, t in call.kwargs),
                None if call.target is None else part(call.target))


def input_placement(mesh: MeshSpec, options: PlanOptions) -> Placements | None:
    """Where per-rank inputs arrive: dimension 0 split over the named mesh dimensions (None:
    global inputs)."""
    if not options.per_rank_inputs:
        return None
    for name in options.per_rank_inputs:
        if name not in mesh.names:
            raise ValueError(f"per_rank_inputs names mesh dimension {name!r}; the mesh has "
                             f"{', '.join(mesh.names)}")
    if len(set(options.per_rank_inputs)) != len(options.per_rank_inputs):
        raise ValueError(f"per_rank_inputs names a dimension twice: {options.per_rank_inputs}")
    return tuple(Shard(0) if n in options.per_rank_inputs and s > 1 else R
                 for n, s in zip(mesh.names, mesh.shape))

