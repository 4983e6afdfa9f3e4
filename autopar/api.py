"""autopar's entry points: `plan` (no processes needed) and `parallelize` (on a DeviceMesh)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.passes import strategies as strat_pass
from autopar.passes.pipeline_split import ValueMeta, layer_blocks, split_stages
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import TracedProgram, trace
from autopar.runtime.collectives import MeshComm
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelineModule, SubmeshComm
from autopar.solver.stages import StageError

from .mesh import MeshSpec
from .plan import Plan
from .planner import choice_from_plan, solve_pipeline_plan, solve_plan


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
         time_limit: float = 60.0, seed: int = 0, microbatches: int | None = None,
         schedule: str | None = None, virtual_stages: int | None = None,
         loss_reduction: str = "mean", optimizer: str = "adamw", precision: str = "fp32",
         profile=None) -> Plan:
    """Plan `model` for `mesh` without running it: trace, enumerate strategies, solve.

    `example_inputs` are the model's inputs (followed by the target when `loss_fn` is given:
    exactly what `step` will receive); they may live on the meta device. `memory_budget` is in
    bytes per device (default: the hardware's memory less its reserve). `force` pins mesh
    dimensions to a standard style ("data", "fsdp", "tensor"; see autopar.passes.styles), by
    dimension name or index, for comparisons and tests. `solver` is an OR-Tools backend
    ("HIGHS", "SCIP", "CBC", "CP_SAT"), or "random" for a valid plan drawn with `seed`.

    A mesh dimension named "pp" runs pipeline stages (see autopar.solver.stages): the model is
    cut by depth into stages, each planned on the other dimensions. `microbatches` (a divisor
    of the batch), `schedule` ("gpipe", "1f1b", "interleaved") and `virtual_stages` (stages
    per pp rank, interleaved only) are chosen by the solver unless given; `loss_reduction`
    says how the loss combines a batch ("mean", the default, or "sum"), which fixes how
    microbatch gradients add up.

    The cost model prices the memory of `optimizer` ("adamw", "adam": two states per
    parameter; "sgd-momentum": one; "sgd": none) and of `precision` ("fp32", or "bf16-mixed":
    bfloat16 parameters, activations and gradients with float32 master weights and optimizer
    state; planned only: `parallelize` runs float32 plans). `profile` replaces the roofline
    with measured op times: True to time ops on this machine's device (cached on disk, see
    autopar.profile), or an autopar.profile.OpProfiler.
    """
    if not isinstance(mesh, MeshSpec):
        mesh = MeshSpec.from_device_mesh(mesh)
    if profile is True:
        from .profile import OpProfiler
        profile = OpProfiler()
    if mesh.pipeline_dim is not None:
        return solve_pipeline_plan(
            _pipeline_tracer(model, example_inputs, loss_fn), _batch_size(example_inputs),
            mesh, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
            memory_budget=memory_budget, force=force, solver=solver, time_limit=time_limit,
            seed=seed, loss_reduction=loss_reduction, optimizer=optimizer,
            precision=precision, profile=profile or None)
    _no_pipeline_options(microbatches, schedule, virtual_stages)
    program = _trace(model, example_inputs, loss_fn)
    result, _ = solve_plan(program, mesh, memory_budget=memory_budget, force=force,
                           solver=solver, time_limit=time_limit, seed=seed, optimizer=optimizer,
                           precision=precision, profile=profile or None)
    return result


def parallelize(model: nn.Module, mesh, *, loss_fn=None, example_inputs=None,
                plan: Plan | None = None, force=None, hardware=None,
                memory_budget: float | None = None, solver: str = "HIGHS",
                microbatches: int | None = None, schedule: str | None = None,
                virtual_stages: int | None = None, loss_reduction: str = "mean") -> nn.Module:
    """Parallelize `model` over a torch `DeviceMesh`; every rank calls this with the same model.

    Returns a module with `step(*inputs, target)` (forward + backward, returns the loss),
    `__call__` (inference; returns what the model returns), `parameters()` (this rank's
    shards, for any elementwise optimizer) and `.plan`. Without `example_inputs` the plan is
    made at the first call. The plan is solved on rank 0 and broadcast (or taken from `plan=`);
    all ranks compare its hash before the model's first collective.

    A mesh dimension named "pp" pipelines the model (options as for `plan`): `step` then runs
    the pipeline schedule over microbatches of the batch and returns the loss, and the same
    user code trains it.
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
    if spec.pipeline_dim is None:
        _no_pipeline_options(microbatches, schedule, virtual_stages)
    lazy = _Lazy(model, mesh, spec, loss_fn, plan, force, memory_budget, solver)
    lazy._pipeline_options = dict(microbatches=microbatches, schedule=schedule,
                                  virtual_stages=virtual_stages, loss_reduction=loss_reduction)
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
        self.module: ParallelModule | PipelineModule | None = None
        self._pipeline_options: dict = {}

    def build(self, example_inputs) -> ParallelModule | PipelineModule:
        """Trace, plan (rank 0, broadcast), check plan hashes, rewrite, shard parameters."""
        if self._spec.pipeline_dim is not None:
            return self._build_pipeline(example_inputs)
        model = self._model[0]
        program = _trace(model, example_inputs, self._loss_fn)
        chosen = self._agreed_plan(lambda: solve_plan(
            program, self._spec, memory_budget=self._budget, force=self._force,
            solver=self._solver)[0])
        graph = strat_pass.build(program, self._spec.shape)
        choice = choice_from_plan(chosen, graph)
        coords = tuple(self._mesh.get_coordinate())
        comm = MeshComm([self._mesh.get_group(k) for k in range(self._mesh.ndim)])
        programs = rewrite(program, graph, choice, coords, comm)
        kinds = {name: v.kind for name, v in graph.nodes.items()}
        full, constants = self._full_tensors(program)
        num_inputs = len(program.inputs) - (1 if program.has_loss else 0)
        self.module = ParallelModule(chosen, programs, kinds, program.params, full, constants,
                                     comm, coords, program.out_spec, num_inputs,
                                     program.has_loss)
        return self.module

    def _build_pipeline(self, example_inputs) -> PipelineModule:
        """As `build`, for a mesh with a "pp" dimension: each rank keeps its stages' programs,
        cut from its local program, and runs them under the plan's pipeline schedule."""
        model, spec = self._model[0], self._spec
        if self._loss_fn is None:
            raise ValueError("a pipelined model trains through step(): pass loss_fn= to "
                             "parallelize (pipelined inference alone is not supported)")
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
            else (example_inputs,)
        tracer = _pipeline_tracer(model, example_inputs, self._loss_fn)
        if self._given_plan is None and self._pipeline_options.get("microbatches") and \
                dist.get_rank() != 0:
            try:  # trace while rank 0 plans: the microbatch size is known
                tracer(self._pipeline_options["microbatches"])
            except Exception:  # noqa: BLE001 - rank 0 reports it with the plan
                pass
        chosen = self._agreed_plan(lambda: solve_pipeline_plan(
            tracer, _batch_size(example_inputs), spec, memory_budget=self._budget,
            force=self._force, solver=self._solver, **self._pipeline_options))
        pipe = chosen.pipeline
        if pipe is None:
            raise ValueError("the mesh has a pp dimension but the plan is not pipelined; "
                             "re-plan with autopar.plan on this mesh")
        program = tracer(pipe.microbatches)
        pp = pipe.mesh_dim
        sub = spec.without(pp)
        graph = strat_pass.build(program, sub.shape)
        choice = choice_from_plan(chosen, graph)
        blocks = layer_blocks(program, graph)
        if blocks.names != pipe.blocks:
            raise ValueError("this model traces into other layer blocks than the plan's "
                             f"({blocks.names} vs {pipe.blocks}); re-plan with autopar.plan")
        stage_of = blocks.stage_of(pipe.cuts, pipe.num_stages)
        coords = tuple(self._mesh.get_coordinate())
        dims = [k for k in range(self._mesh.ndim) if k != pp]
        sub_coords = tuple(coords[k] for k in dims) or (0,)
        comm = SubmeshComm([self._mesh.get_group(k) for k in dims] or [None], sub.shape)
        programs = rewrite(program, graph, choice, sub_coords, comm)
        kinds = {name: v.kind for name, v in graph.nodes.items()}
        train = split_stages(programs.train, graph, choice, stage_of, kinds, pipe.num_stages,
                             comm)
        infer = split_stages(programs.infer, graph, choice, stage_of, kinds, pipe.num_stages,
                             comm)
        full, constants = self._full_tensors(program)
        num_inputs = len(program.inputs) - 1
        roots = [ValueMeta(tuple(ph.meta["val"].shape), ph.meta["val"].dtype, False)
                 for ph in program.graph.nodes
                 if ph.op == "placeholder" and ph.name in program.inputs[:num_inputs]]
        device = torch.device(self._mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.module = PipelineModule(
            chosen, train, infer, program.params, full, constants, comm,
            self._mesh.get_group(pp), coords[pp], sub_coords, list(program.inputs), roots,
            program.out_spec, num_inputs, programs.loss_placement, device)
        return self.module

    def _agreed_plan(self, solve: Callable[[], Plan]) -> Plan:
        """The given plan, or the one `solve` makes on rank 0, broadcast (a failure too: every
        rank raises it rather than hang); then every rank checks that all hold the same."""
        chosen = self._given_plan
        if chosen is None:
            box: list = [None]
            if dist.get_rank() == 0:
                try:
                    box = [solve().to_dict()]
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
        return chosen

    def _full_tensors(self, program: TracedProgram) -> tuple[dict, dict]:
        model = self._model[0]
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
        return full, constants

    def _built(self) -> ParallelModule | PipelineModule:
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
        if self.module is None and self._spec.pipeline_dim is not None:
            raise RuntimeError("a pipelined model is planned for training: call step() first "
                               "(or pass example_inputs= with the target to parallelize)")
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


def _no_pipeline_options(microbatches, schedule, virtual_stages) -> None:
    given = [n for n, v in (("microbatches", microbatches), ("schedule", schedule),
                            ("virtual_stages", virtual_stages)) if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to pipelined plans: name a mesh dimension "
                         '"pp" (of size > 1) to cut the model into pipeline stages')


def _batch_size(example_inputs) -> int:
    """The batch every input (and the target) carries as dimension 0, which microbatches
    split."""
    tensors = [t for t in (example_inputs if isinstance(example_inputs, (tuple, list))
                           else (example_inputs,)) if isinstance(t, torch.Tensor)]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError("pipelining splits the batch into microbatches along dimension 0 of "
                         f"every input and the target, which must agree; got shapes {shapes}")
    return sizes.pop()


def _pipeline_tracer(model, example_inputs, loss_fn):
    """trace_at(m): the model traced on the first 1/m of the batch (cached)."""
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    cache: dict[int, TracedProgram] = {}

    def trace_at(m: int) -> TracedProgram:
        if m not in cache:
            batch = _batch_size(example_inputs)
            if m < 1 or batch % m:
                raise StageError(f"the batch of {batch} does not split into {m} microbatches; "
                                 "choose a divisor of the batch size")
            cache[m] = _trace(model, tuple(t[:batch // m] if isinstance(t, torch.Tensor)
                                           else t for t in example_inputs), loss_fn)
        return cache[m]

    return trace_at
