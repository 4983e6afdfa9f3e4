"""Copies of a model for tracing: storage-free (meta) and fake-tensor copies, and the plain
tensors and computed attributes a copy must not lose."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .trace_error import TraceError


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no storage
    copied; tied parameters stay tied). Raises TraceError for a module holding a tensor
    computed from its parameters as a plain attribute (`computed_attribute`)."""
    why = computed_attribute(model)
    if why:
        raise TraceError(why)
    memo: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else m
    return copy.deepcopy(model, memo)


def computed_attribute(model: nn.Module) -> str | None:
    """Why `model` cannot be copied and traced, or None: a module keeps, as a plain attribute,
    a tensor autograd computed from its parameters (the deprecated torch.nn.utils.weight_norm
    recomputes its `weight` that way in a forward pre-hook). Such a tensor is neither a
    parameter nor a buffer: it cannot be copied, and a trace would freeze it."""
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                where = f"module {name or type(m).__name__} ({type(m).__name__})"
                if any(type(h).__name__ == "WeightNorm" for h in m._forward_pre_hooks.values()):
                    return (f"{where} uses torch.nn.utils.weight_norm, which is deprecated and "
                            f"keeps `{attr}` as a tensor computed by a hook; use "
                            "torch.nn.utils.parametrizations.weight_norm instead (autopar "
                            "traces and shards it): torch.nn.utils.remove_weight_norm(module) "
                            "then torch.nn.utils.parametrizations.weight_norm(module)")
                return (f"{where} keeps `{attr}`, a tensor computed from its parameters, as a "
                        "plain attribute: autopar copies the model to trace it and cannot copy "
                        "it, and a trace would freeze it. Compute it in forward, or register "
                        "it as a parametrization (torch.nn.utils.parametrize)")
    return None


def plain_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors `model`'s modules hold as plain attributes (not parameters or buffers)."""
    return [v for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]


def fake_copy(model: nn.Module, mode, device: torch.device,
              param_dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `model` whose parameters and buffers are `mode`'s fake tensors on `device`
    (shapes, strides and dtypes, no storage; tied parameters stay tied); floating-point
    parameters in `param_dtype` when given (mixed precision). A module's plain tensor
    attributes are shared, not copied: the program lifts them as constants, and the caller
    follows their changes (autopar/guards.py)."""
    memo: dict[int, torch.Tensor] = {id(t): t for t in plain_tensors(model)}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        dtype = param_dtype if isinstance(t, nn.Parameter) and param_dtype is not None \
            and t.is_floating_point() else t.dtype
        f = fake_tensor(t, mode, device, dtype)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


def fake_tensor(t, mode, device: torch.device, dtype: torch.dtype | None = None):
    """A fake tensor of `t`'s shape and strides on `device`, in `dtype` (default: `t`'s);
    anything else unchanged."""
    if not isinstance(t, torch.Tensor):
        return t
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device=device)
