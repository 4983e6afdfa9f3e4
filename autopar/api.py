"""autopar's entry points: `plan` (no processes needed) and `parallelize` (on a DeviceMesh)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.passes import strategies as strat_pass
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import TracedProgram, trace
from autopar.runtime.collectives import MeshComm
from autopar.runtime.module import ParallelModule

from .mesh import MeshSpec
from .plan import Plan
from .planner import choice_from_plan, solve_plan


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans; raised on every rank before any collective of the model."""


def _split_example(example_inputs, loss_fn):
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    if loss_fn is None:
        return example_inputs, None
    if len(example_inputs) < 2:
        raise ValueError("with loss_fn, example_inputs are the model inputs followed by the "
                         "target, as passed to step(*inputs, target)")
    return example_inputs[:-1], example_inputs[-1]


def _trace(model, example_inputs, loss_fn) -> TracedProgram:
    inputs, target = _split_example(example_inputs, loss_fn)
    return trace(model, inputs, loss_fn, target)


def plan(model: nn.Module, mesh: MeshSpec, example_inputs, loss_fn=None, *,
         memory_budget: float | None = None, force=None, solver: str = "HIGHS",
         time_limit: float = 60.0, seed: int = 0) -> Plan:
    """Plan `model` for `mesh` without running it: trace, enumerate strategies, solve.

    `example_inputs` are the model's inputs (followed by the target when `loss_fn` is given:
    exactly what `step` will receive); they may live on the meta device. `memory_budget` is in
    bytes per device (default: the hardware's memory less its reserve). `force` pins mesh
    dimensions to a standard style ("data", "fsdp", "tensor"; see autopar.passes.styles), by
    dimension name or index, for comparisons and tests. `solver` is an OR-Tools backend
    ("HIGHS", "SCIP", "CBC", "CP_SAT"), or "random" for a valid plan drawn with `seed`.
    """
    if not isinstance(mesh, MeshSpec):
        mesh = MeshSpec.from_device_mesh(mesh)
    program = _trace(model, example_inputs, loss_fn)
    result, _ = solve_plan(program, mesh, memory_budget=memory_budget, force=force,
                           solver=solver, time_limit=time_limit, seed=seed)
    return result


def parallelize(model: nn.Module, mesh, *, loss_fn=None, example_inputs=None,
                plan: Plan | None = None, force=None, hardware=None,
                memory_budget: float | None = None, solver: str = "HIGHS") -> nn.Module:
    """Parallelize `model` over a torch `DeviceMesh`; every rank calls this with the same model.

    Returns a module with `step(*inputs, target)` (forward + backward, returns the loss),
    `__call__` (inference; returns what the model returns), `parameters()` (this rank's
    shards, for any elementwise optimizer) and `.plan`. Without `example_inputs` the plan is
    made at the first call. The plan is solved on rank 0 and broadcast (or taken from `plan=`);
    all ranks compare its hash before the model's first collective.
    """
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed initialized (torchrun, or "
                           "init_process_group); use autopar.plan to plan without processes")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the device mesh has {mesh.size()} devices {tuple(mesh.shape)} but the "
                         f"world has {dist.get_world_size()} ranks; build the mesh over the "
                         "whole world, e.g. init_device_mesh(device, shape) with prod(shape) = "
                         "world size")
    spec = MeshSpec.from_device_mesh(mesh, hardware)
    if plan is not None and tuple(plan.mesh.shape) != tuple(mesh.shape):
        raise ValueError(f"the plan is for mesh {plan.mesh.shape}, the device mesh is "
                         f"{tuple(mesh.shape)}")
    lazy = _Lazy(model, mesh, spec, loss_fn, plan, force, memory_budget, solver)
    if example_inputs is not None:
        lazy.build(example_inputs)
    return lazy


class _Lazy(nn.Module):
    """Plans at the first call, then behaves as the ParallelModule it built."""

    def __init__(self, model, mesh, spec, loss_fn, plan, force, memory_budget, solver):
        super().__init__()
        self._model = [model]  # a list: do not register the full model's parameters here
        self._mesh, self._spec, self._loss_fn = mesh, spec, loss_fn
        self._given_plan, self._force, self._budget, self._solver = (
            plan, force, memory_budget, solver)
        self.module: ParallelModule | None = None

    def build(self, example_inputs) -> ParallelModule:
        """Trace, plan (rank 0, broadcast), check plan hashes, rewrite, shard parameters."""
        model = self._model[0]
        program = _trace(model, example_inputs, self._loss_fn)
        chosen = self._given_plan
        if chosen is None:
            box: list = [None]
            if dist.get_rank() == 0:
                try:
                    solved, _ = solve_plan(program, self._spec, memory_budget=self._budget,
                                           force=self._force, solver=self._solver)
                    box = [solved.to_dict()]
                except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
                    box = [e]
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], Exception):
                raise box[0]
            chosen = Plan.from_dict(box[0])
        hashes = [None] * dist.get_world_size()
        dist.all_gather_object(hashes, chosen.hash())
        if len(set(hashes)) != 1:
            raise PlanMismatchError(
                "ranks hold different plans (hashes by rank: " + ", ".join(hashes) + "); pass "
                "the same plan (or the same model, inputs and options) on every rank")
        graph = strat_pass.build(program, self._spec.shape)
        choice = choice_from_plan(chosen, graph)
        coords = tuple(self._mesh.get_coordinate())
        comm = MeshComm([self._mesh.get_group(k) for k in range(self._mesh.ndim)])
        programs = rewrite(program, graph, choice, coords, comm)
        kinds = {name: v.kind for name, v in graph.nodes.items()}
        full = {program.params[n]: model.get_parameter(program.params[n])
                for n in program.params}
        constants = {}
        for ph, key in program.buffers.items():
            constants[ph] = program.constants[key] if key.startswith("constant:") \
                else model.get_buffer(key)
        if any(t.is_meta for t in list(full.values()) + list(constants.values())):
            raise ValueError("the model's parameters are on the meta device: materialize them "
                             "(e.g. model.to_empty(device=...) and initialize) before "
                             "parallelize; autopar.plan works on meta models")
        num_inputs = len(program.inputs) - (1 if program.has_loss else 0)
        self.module = ParallelModule(chosen, programs, kinds, program.params, full, constants,
                                     comm, coords, program.out_spec, num_inputs,
                                     program.has_loss)
        return self.module

    def _built(self) -> ParallelModule:
        if self.module is None:
            raise RuntimeError("not planned yet: call step() or the model once, or pass "
                               "example_inputs= to parallelize, before asking for parameters "
                               "or the plan")
        return self.module

    @property
    def plan(self) -> Plan:
        """The plan that is running."""
        return self._built().plan

    def step(self, *inputs) -> torch.Tensor:
        """Forward + backward on the global batch; returns the loss."""
        if self.module is None:
            self.build(inputs)
        return self.module.step(*inputs)

    def forward(self, *inputs):
        """Inference: returns what the original model returns."""
        if self.module is None:
            if self._loss_fn is not None:
                warnings.warn("planning from an inference call: the plan includes no loss, so "
                              "step() will not be available", stacklevel=2)
                self._loss_fn = None
            self.build(inputs)
        return self.module(*inputs)

    def parameters(self, recurse: bool = True):
        """This rank's parameter shards."""
        return self._built().parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._built().named_parameters(*args, **kwargs)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (collective)."""
        return self._built().full_parameters()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient reassembled whole (collective)."""
        return self._built().full_grads()

    def named_local_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's shard of every parameter, by the model's names."""
        return self._built().named_local_parameters()
