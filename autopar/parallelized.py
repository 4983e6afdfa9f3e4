"""Parallelized: the model users hold, the one `autopar.parallelize` returns.

The model passed to parallelize becomes this model, in place (autopar/originals.py), as FSDP2's
`fully_shard` works: `model(x)` infers, `model.step(x, y)` trains, and once built its
parameters are this rank's shards, as DTensors under the model's own names (runtime/params.py):
optimizers, param groups by name, clip_grad_norm_, state_dict() and
torch.distributed.checkpoint work on them. Until the first build it holds the user's model,
and from then on only a meta copy of it (for tracing) and this rank's shards.

This module holds the user's calls (`step`, `forward`, `build`), the parameters and the state
(state dicts, whole tensors, gradient clipping) and the properties; the work is elsewhere:
- building a rank's programs (autopar/programs.py): at a call, check it, agree with the other
  ranks, then find the program for the call's mode and input shapes or trace, plan and
  rewrite one;
- placing parameters (autopar/placing.py), at the first build;
- the control plane's agreements (autopar/agreements.py);
- the pipeline (autopar/pipeline.py), under a mesh with a "pp" dimension.
What they share is one BuildContext (autopar/context.py), which this model passes them with
itself: its module tree holds the modules' train / eval modes and the model's plain attributes
the programs are traced with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from autopar.passes.graph_queries import untraced_hooks
from autopar.passes.meta_copies import meta_copy
from autopar.passes.trace import TraceError
from autopar.runtime.collectives import MeshComm
from autopar.runtime.control import Control, agreed
from autopar.runtime.inference_outputs import guard_outputs
from autopar.runtime.params import skeleton_child
from autopar.solver.specs import compute_dtype

from .agreements import Agreements, PlanMismatchError
from .context import BuildContext, RankSetting
from .guards import ValueGuards
from .inputs import Call, microbatch, split_call
from .materialize import aliases
from .mesh import MeshSpec
from .options import PlanOptions
from .originals import Original, become, fresh
from .pipeline import Pipeline, batch_size, pipeline_tracer
from .plan import Plan
from .programs import Programs, program_for, weigh_microbatches

# (importers of these names from here: autopar/api.py)
__all__ = ["IncompatibleKeys", "Parallelized", "PlanMismatchError", "batch_size",
           "pipeline_tracer"]


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict` returns (as torch's does): the names it did not find."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Parallelized(nn.Module):
    """The parallelized model on one rank.

    `step(*inputs, target)` (or `step(*inputs, **kwargs)` for a model that returns its loss)
    trains: forward and backward on the batch, returning the loss; `pmodel(*inputs, **kwargs)`
    infers, returning what the model returns, whole. `parameters()` / `named_parameters()` are
    this rank's shards as DTensors under the model's names; `.plan` is the plan that ran last.
    `train()` / `eval()` switch between programs traced in each mode (a pipelined model's on
    the stages of its build). The model passed to parallelize becomes this model, in place
    (autopar/originals.py): `model(x)`, `model.step`, its state dict and, once built, its
    parameters are this model's.
    """

    def __init__(self, model: nn.Module, mesh, spec: MeshSpec, options: PlanOptions, loss_fn,
                 plan: Plan | None, init_fn=None):
        super().__init__()
        fresh(model)
        hooks = untraced_hooks(model)
        if hooks:
            raise ValueError(hooks)
        original = Original(model)  # changes made on it after parallelize follow
        meta = meta_copy(model)  # tracing runs on this copy
        self.training = model.training
        # The model's module tree, empty until the parameters are placed into it under the
        # model's names: its train / eval flags (as the model had them, then as train(),
        # eval() and a submodule's own set them) are the ones the programs are traced with.
        for name, m in model.named_modules():
            if name:
                owner, last = skeleton_child(self, name)
                if last not in owner._modules:
                    owner.add_module(last, _container_like(m))
                owner._modules[last].training = m.training
        # ... and its plain attributes, which the traces read (autopar/guards.py)
        guards = ValueGuards(meta, self, loss_fn)
        device = _device_of(mesh)
        setting = RankSetting(
            spec, options, loss_fn, plan, init_fn, compute_dtype(options.precision), device,
            mesh, tuple(mesh.get_coordinate()),
            MeshComm([mesh.get_group(k) for k in range(mesh.ndim)]),
            Agreements(Control(), mesh, options.per_rank_inputs, device))
        self._ctx = BuildContext(setting, meta, original, aliases(model), model, guards)
        self._programs = Programs()
        self._pipeline = Pipeline() if spec.pipeline_dim is not None else None
        become(model, self)  # the model is this model from now on (autopar/originals.py)

    # -- the user's calls ----------------------------------------------------------------------
    def build(self, example_inputs: tuple, example_kwargs: dict | None = None) -> None:
        """Plan and build now for these inputs (what `step` will receive with a loss_fn; the
        model's inputs otherwise, then planned for training when the model returns its loss)
        instead of at the first call."""
        with self.control.guard("parallelize"):
            if self._pipeline is not None:
                if self._pipeline.module is None:
                    self._pipeline.build(self._ctx, self, tuple(example_inputs))
                return
            step = True if self._ctx.setting.loss_fn is not None else "auto"
            call = self._split(tuple(example_inputs), dict(example_kwargs or {}), step)
            program_for(self._ctx, self, self._programs, call, step)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward on the batch; returns the loss, the same on every rank.

        With a `loss_fn`: `step(*inputs, target)`. Without: `step(*inputs, **kwargs)` for a
        model that returns its loss (a scalar, or an output with a `loss` field). Gradients of
        this rank's shards are complete when it returns: an optimizer over `parameters()`
        can step."""
        with self.control.guard("step()"):
            if self._pipeline is not None:
                return self._pipeline.call(self._ctx, self, args, kwargs, step=True)
            call = self._split(args, kwargs, step=True)
            built = program_for(self._ctx, self, self._programs, call, step=True)
            m = built.plan.accumulation
            parts = [microbatch(call, m, i).tensors for i in range(m)]
            return built.runner.step(parts, weigh_microbatches(
                built.loss_weights, parts, self._ctx.setting.options.loss_reduction))

    def forward(self, *args, **kwargs):
        """Inference: returns what the original model returns, whole, on every rank. Train
        with `step`: while autograd records, backward through these outputs raises (the
        parameters get no gradient from them; runtime/inference_outputs.py)."""
        with self.control.guard("the forward call"):
            if self._pipeline is not None:
                outputs = self._pipeline.call(self._ctx, self, args, kwargs, step=False)
            else:
                call = self._split(args, kwargs, step=False)
                outputs = program_for(self._ctx, self, self._programs, call,
                                      step=False).runner.infer(call.tensors)
        return guard_outputs(outputs, any(p.requires_grad for p in self.parameters()))

    def _split(self, args, kwargs, step) -> Call:
        """The call's inputs; every rank raises when one rank's cannot be split."""
        try:
            return split_call(args, kwargs, with_target=bool(step) and
                              self._ctx.setting.loss_fn is not None)
        except (TypeError, TraceError) as e:
            error = str(e)
        self._ctx.setting.agree.call_inputs(error)
        raise AssertionError("unreachable: the agreement raises when a rank failed")

    # -- parameters and state -------------------------------------------------------------------
    def _built(self):
        """This rank's parameters (a ParameterStore); an error before the first build."""
        if self._ctx.store is None:
            raise RuntimeError("not planned yet: call step() or the model once, or pass "
                               "example_inputs= (or example_kwargs=) to parallelize, before "
                               "asking for parameters, state or the plan")
        return self._ctx.store

    def _running_pipeline(self):
        """The PipelineModule running a pipelined model's stages; None otherwise, or before
        the build."""
        return self._pipeline.module if self._pipeline is not None else None

    @property
    def plan(self) -> Plan:
        """The plan that ran last (or was built last)."""
        self._built()
        return self._ctx.last_plan

    @property
    def plans(self) -> list[Plan]:
        """Every plan built so far (one per mode and input shape), in the order built."""
        self._built()
        if self._pipeline is not None:
            return self._pipeline.plans()
        return self._programs.plans()

    def parameters(self, recurse: bool = True):
        """This rank's shards, as DTensor parameters (what an optimizer steps)."""
        self._built()
        return super().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """This rank's shards, as DTensor parameters, by the model's parameter names."""
        self._built()
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The model's state by its own names: parameters as DTensors (this rank's shards),
        buffers whole."""
        self._built()
        return super().state_dict(*args, **kwargs)

    @property
    def control(self):
        """The control plane all ranks agree on (autopar.runtime.control.Control)."""
        return self._ctx.setting.agree.control

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state as whole plain tensors, under the names (and the order) of the
        model's own state_dict: what a plain `model.load_state_dict` accepts, for handing the
        model to inference (a collective: call on all ranks; every rank gets it)."""
        whole = self.full_parameters()
        own = self.state_dict()  # (a pp rank's holds its stages' parameters, every buffer)
        return {name: whole[param] if param in whole else own[name].detach().clone()
                for name, param in self._state_params().items()}

    def model_state_names(self) -> list[str]:
        """Every name of the model's state dict, in its order: the names `full_state_dict()`
        gives, and a checkpoint of this model holds (under a pipelined plan, every stage's,
        where `state_dict()` holds this rank's)."""
        return list(self._state_params())

    def _state_params(self) -> dict[str, str | None]:
        """Each name of the model's state dict -> the parameter it stands for (a tied one's
        first name; None for a buffer)."""
        model = self._ctx.meta
        first = {alias: p for p, names in self._ctx.aliases.items() for alias in names}
        params = {n for n, _ in model.named_parameters()}
        return {n: n if n in params else first.get(n) for n in model.state_dict(keep_vars=True)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict by the model's names: whole plain tensors (a single-device
        model's state_dict, or `full_state_dict()`; each rank keeps its block) or DTensors
        (this model's `state_dict()` form). Names, shapes and dtypes must match: a mismatch is
        an error naming the tensors, never a silent cast."""
        store = self._built()
        own = self.state_dict()
        missing = sorted(set(own) - set(state_dict))
        # (a pp rank takes the tensors of its stages: the others' are not unexpected)
        unexpected = sorted(set(state_dict) - set(self.model_state_names()))
        problems = []
        if strict and missing:
            problems.append("missing: " + ", ".join(missing))
        if strict and unexpected:
            problems.append("unexpected: " + ", ".join(unexpected))
        for name in sorted(set(own) & set(state_dict)):
            got, want = state_dict[name], own[name]
            if tuple(got.shape) != tuple(want.shape):
                problems.append(f"{name}: shape {tuple(got.shape)}, the model has "
                                f"{tuple(want.shape)}")
            elif got.dtype != want.dtype:
                problems.append(f"{name}: dtype {got.dtype}, the model has {want.dtype}")
        if problems:
            raise ValueError("the state dict does not match the model:\n  " +
                             "\n  ".join(problems))
        duplicated = self._ctx.setting.agree.same_blocks(state_dict, own)
        if duplicated:
            raise agreed(ValueError(duplicated))
        with torch.no_grad():
            for name in sorted(set(own) & set(state_dict)):
                param = store.alias_of(name)
                value = state_dict[name]
                if param is None:
                    own[name].copy_(value.full_tensor() if hasattr(value, "full_tensor")
                                    else value)
                else:
                    store.load_whole(param, value)
        return IncompatibleKeys(missing, unexpected)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call on all ranks)."""
        pipeline = self._running_pipeline()
        if pipeline is not None:
            return pipeline.full_parameters()
        store = self._built()
        return {n: store.whole(n) for n in store.params}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient reassembled whole (a collective: call on all ranks); zeros for a
        parameter without one."""
        pipeline = self._running_pipeline()
        if pipeline is not None:
            return pipeline.full_grads()
        store = self._built()
        return {n: store.whole_grad(n) for n in store.leaves}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most `max_norm`; returns the
        norm before clipping, the same on every rank (as torch.nn.utils.clip_grad_norm_ over
        the single-device model's parameters). Under a pipelined plan, where
        torch.nn.utils.clip_grad_norm_ sees only this rank's stages, this is the one to use."""
        pipeline = self._running_pipeline()
        if pipeline is not None:
            return pipeline.clip_grad_norm_(max_norm, norm_type)
        total = torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def _apply(self, fn, recurse: bool = True):
        raise RuntimeError("a parallelized model cannot change device or dtype: call .to() / "
                           ".double() / .cuda() on the model before autopar.parallelize")


_NOT_COPIED = (
    "a parallelized model cannot be copied or pickled (its programs hold this rank's process "
    "groups and shards). For an average of its weights (EMA, SWA; torch's AveragedModel "
    "deep-copies the model), keep copies of its parameters, this rank's shards: avg = "
    "{n: p.detach().clone() for n, p in pmodel.named_parameters()}, update them after each "
    "step (avg[n].lerp_(p.detach(), 1 - decay)), and evaluate them by loading them with "
    "pmodel.load_state_dict(avg, strict=False) (keep pmodel.state_dict() copies to load the "
    "trained weights back). To save the model use autopar.checkpoint.save or "
    "pmodel.full_state_dict()")


def _container_like(module: nn.Module) -> nn.Module:
    """An empty module for the parallelized model's tree in `module`'s place: a container of
    torch's kind where the model has one (so `pmodel.layers[0]`, `len(pmodel.layers)` and
    iterating work as on the model), a plain module otherwise."""
    for kind in (nn.Sequential, nn.ModuleList, nn.ModuleDict):
        if isinstance(module, kind):
            return kind()
    return nn.Module()


def _device_of(mesh) -> torch.device:
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device
