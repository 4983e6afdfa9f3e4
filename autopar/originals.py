"""The model passed to `autopar.parallelize`, which users may go on touching as they would under
DistributedDataParallel (whose module is the model itself).

A parallelized model trains its own copies of the parameters (this rank's shards, as DTensor
parameters under the model's names); the model passed to parallelize keeps its tensors, which
never receive a gradient. So:

- An optimizer built over `model.parameters()` (before parallelize, as DistributedDataParallel
  allows, or after it by mistake) would step nothing, silently: its parameters have no
  gradients. While the parallelized model lives, a global optimizer step pre-hook refuses
  such a step on every rank (every rank builds the same optimizer), naming the parameter and
  what to build the optimizer over instead (`watch`).
- A mode set on the model (`model.eval()` before a validation pass) or a plain attribute
  (`model.drop.p = 0.0`) changed on it after parallelize would be ignored: `Original.follow`
  applies such changes to the parallelized model, which then runs them as if set there.
- Its parameters and buffers changed in place after the build (`model.load_state_dict(...)`)
  and hooks registered on it after parallelize would be ignored too: `Original.follow` says
  so, an error naming the tensor (and `pmodel.load_state_dict`) or the module.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.passes.trace_values import plain_value, public_values

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


class Original:
    """The model passed to parallelize, followed weakly: its modes and plain attributes as
    last seen, and (after the build) the versions of its parameters and buffers."""

    def __init__(self, model: nn.Module):
        """Snapshot `model` at parallelize."""
        self._model = weakref.ref(model)
        # per module, found once: [name, the module, its mode, hooks and plain attributes]
        self._modules = [[n, weakref.ref(m), m.training, _hooks(m),
                          {a: plain_value(v) for a, v in public_values(m).items()}]
                         for n, m in model.named_modules()]
        self._tensors: list[tuple[str, weakref.ref, int]] = []

    def built(self) -> None:
        """The parallelized model has read the tensors: from now on they are not read again."""
        model = self._model()
        if model is not None:
            named = [*model.named_parameters(), *model.named_buffers()]
            self._tensors = [(n, weakref.ref(t), t._version) for n, t in named]

    def follow(self, tree: nn.Module) -> str | None:
        """Apply to `tree` (the parallelized model's module tree) the modes and plain
        attributes changed on the model since last seen; an error message when one of its
        parameters or buffers was changed in place since the build."""
        model = self._model()
        if model is None:
            return None
        for name, t, version in self._tensors:
            now = t()
            if now is not None and now._version != version:
                return (f"{name} of the model passed to autopar.parallelize was changed in "
                        "place after the parallelized model read it (model.load_state_dict, "
                        "an in-place update); the parallelized model keeps its own copy. "
                        "Change it through the parallelized model: pmodel.load_state_dict(...) "
                        "or in place on pmodel's parameter")
        for entry in self._modules:
            name, m, mode, hooks, seen = entry[0], entry[1](), entry[2], entry[3], entry[4]
            if m is None:
                continue
            if _hooks(m) != hooks:
                return (f"a hook was registered on (or removed from) module "
                        f"{name or type(m).__name__} of the model passed to "
                        "autopar.parallelize after it; the parallelized model's programs were "
                        "traced with the hooks the model had at parallelize. Register hooks "
                        "(and call Hugging Face's gradient_checkpointing_enable(), which "
                        "registers one) before parallelize, or recompute with parallelize's "
                        "recompute=")
            target = None
            if m.training != mode:
                entry[2] = m.training
                target = _submodule(tree, name)
                if target is not None:
                    target.training = m.training
            for attr, value in seen.items():
                now = plain_value(vars(m).get(attr))
                if now is not None and now != value:
                    seen[attr] = now
                    target = target or _submodule(tree, name)
                    if target is not None and attr in vars(target):
                        setattr(target, attr, getattr(m, attr))
        return None


def _hooks(m: nn.Module) -> tuple:
    """The ids of a module's forward, pre-forward and backward hooks."""
    return tuple(tuple(d) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                    m._backward_pre_hooks))


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None
