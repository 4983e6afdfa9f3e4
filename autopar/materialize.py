"""The model's tensors on the ranks: one model for all ranks, a meta copy for tracing.

`parallelize` must start every rank from the same model, as DistributedDataParallel does: ranks
that built their models differently (seeded per rank, say) would otherwise train replicas that
differ, or a patchwork of several models' shards. `broadcast_from_rank0` sends rank 0's
parameters and buffers to every rank (in buckets, per dtype), and each rank keeps its block.

Tracing and re-tracing (another input shape, eval mode) run on a meta copy of the model
(passes.trace.meta_copy), which has the model's code and structure but no storage, so nothing
keeps the full model alive after the build.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.passes.reshard import BUCKET_BYTES, buckets
from autopar.runtime.flat import flatten, unflatten


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Tied parameters: the first name of each parameter -> its other names."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


def broadcast_from_rank0(tensors: dict[str, torch.Tensor], keep, group=None) -> dict:
    """`keep(name, value)` of rank 0's value of every tensor in `tensors` (same names, shapes
    and dtypes on every rank), on every rank: bucketed broadcasts over `group` (global rank 0
    sends), as DistributedDataParallel does at construction. Only a bucket of whole tensors is
    held at a time beyond what `keep` returns (a rank's block, typically)."""
    if dist.get_world_size() == 1:
        return {n: keep(n, t.detach()) for n, t in tensors.items()}
    out = {}
    by_kind: dict[tuple, list[str]] = {}
    for n, t in tensors.items():
        by_kind.setdefault((t.dtype, t.device), []).append(n)
    for names in by_kind.values():
        for bucket in buckets(names, lambda n: tensors[n].numel() * tensors[n].element_size(),
                              BUCKET_BYTES):
            flat = flatten([tensors[n].detach() for n in bucket])
            wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
            dist.broadcast(wire, src=0, group=group)
            for n, t in zip(bucket, unflatten(flat, [tensors[n].shape for n in bucket])):
                out[n] = keep(n, t)
    return out


def initialize_blocks(model: nn.Module, keep, device: torch.device, init_fn=None,
                      group=None) -> dict[str, torch.Tensor]:
    """`keep(name, value)` of every parameter and buffer of a model built on the meta device,
    initialized with the model's own init: module by module (in `model.modules()` order), the
    module's own tensors are materialized on `device`, initialized by `init_fn(module)` when
    given (as `model.apply(init_fn)` would: Hugging Face's `_init_weights`), else by the
    module's `reset_parameters()`, passed to `keep`, and dropped. So no rank holds more than one
    module's own tensors whole at a time.

    Every rank draws from rank 0's random state (broadcast over `group`; the default generator
    is left as it was), so all ranks compute the same values and keep consistent blocks: the
    values single-device init gives when it initializes module by module from that state.
    A tensor that no init writes (it stays NaN) or that stays on the meta device is an error
    naming it."""
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    state = [torch.get_rng_state() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(state, src=0, group=group)
    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state[0])
        for path, module in model.named_modules():
            own = [(n, t) for n, t in [*module.named_parameters(recurse=False),
                                       *module.named_buffers(recurse=False)]
                   if t.is_meta and names.get(id(t)) not in out]
            if not own:
                continue
            module.to_empty(device=device, recurse=False)
            for _, t in _own_tensors(module):
                if t.is_floating_point():
                    with torch.no_grad():
                        t.fill_(float("nan"))
            _initialize(module, path, init_fn)
            for local_name, t in _own_tensors(module):
                name = names.get(id(_before(own, local_name)))
                if name is None or name in out:
                    continue
                _check_initialized(t, name, init_fn)
                out[name] = keep(name, t.detach())
            module.to_empty(device="meta", recurse=False)  # drop the whole tensors
    return out


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _before(own: list, local_name: str):
    """The tensor a module held under `local_name` before it was materialized."""
    return next((t for n, t in own if n == local_name), None)


def _initialize(module: nn.Module, path: str, init_fn) -> None:
    if init_fn is not None:
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ValueError(
            f"module {path or 'the model'} ({type(module).__name__}) is on the meta device and "
            "has no reset_parameters(): pass init_fn= to parallelize, a function that "
            "initializes one module's own parameters and buffers (as model.apply(fn) calls it; "
            "e.g. a Hugging Face model's _init_weights)")


def _check_initialized(t: torch.Tensor, name: str, init_fn) -> None:
    how = "init_fn" if init_fn is not None else "reset_parameters()"
    if t.is_meta:
        raise ValueError(f"{name} is still on the meta device after {how}: initialize it in "
                         "place (e.g. nn.init.normal_(module.weight)) rather than replacing it")
    if t.is_floating_point() and torch.isnan(t).any():
        raise ValueError(f"{how} left {name} (or part of it) uninitialized: pass init_fn= that "
                         "sets every parameter and buffer of each module it is called on")


def local_values(model: nn.Module, keep, device: torch.device, group=None, init_fn=None
                 ) -> dict[str, torch.Tensor]:
    """`keep(name, value)` of every parameter and buffer of `model`, the same on every rank:
    rank 0's values broadcast for tensors that hold values, the model's own init
    (`initialize_blocks`) for tensors on the meta device."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    real = {n: t for n, t in tensors.items() if not t.is_meta}
    out = broadcast_from_rank0(real, keep, group)
    if len(real) < len(tensors):
        out.update(initialize_blocks(model, keep, device, init_fn, group))
    return out
