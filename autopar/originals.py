"""The parameters of the models passed to `autopar.parallelize`, which no optimizer may step.

A parallelized model trains its own copies of the parameters (this rank's shards, as DTensor
parameters under the model's names); the model passed to parallelize keeps its tensors, which
never receive a gradient. An optimizer built over `model.parameters()` (before parallelize,
as DistributedDataParallel allows, or after it by mistake) would step nothing, silently: its
parameters have no gradients, so the model would never train. While the parallelized model
lives, a global optimizer step pre-hook refuses such a step on every rank (every rank builds
the same optimizer), naming the parameter and what to build the optimizer over instead.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(parameter) -> (the parameter, the parallelized model, its name), both weakly
_ORIGINALS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
_HOOK = []  # the global pre-hook's handle, once registered


def watch(model: nn.Module, parallelized: nn.Module) -> None:
    """Refuse optimizer steps over `model`'s parameters while `parallelized` (made from it)
    lives."""
    for key in [k for k, (p, owner, _) in _ORIGINALS.items() if p() is None or owner() is None]:
        del _ORIGINALS[key]
    for name, p in model.named_parameters():
        _ORIGINALS[id(p)] = (weakref.ref(p), weakref.ref(parallelized), name)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))


def _refuse(optimizer, args, kwargs) -> None:
    """The pre-hook: raises when `optimizer` holds a parameter of a parallelized model's
    source."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _ORIGINALS.get(id(p))
            if entry is not None and entry[0]() is p and entry[1]() is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() would step parameter {entry[2]} of "
                    "the model passed to autopar.parallelize, which the parallelized model "
                    "does not train (it trains its own copies; these never get a gradient). "
                    "Build the optimizer over pmodel.parameters(), or pmodel.named_parameters() "
                    "for parameter groups by name, after parallelize")
