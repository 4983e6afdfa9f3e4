"""Parallelized: the module `autopar.parallelize` returns, and the driver that builds it.

It holds the user's model until the first build, and from then on only a meta copy of it (for
tracing) and this rank's shards, which the user's model holds too (autopar/originals.py: the
model passed to parallelize becomes the parallelized model). At a call it:

1. splits the call into model inputs, keyword inputs and target (autopar.inputs), checks them on
   this rank (device, the shape the plan was made for) and makes every rank agree, in one small
   all-gather on the control plane (autopar.runtime.control), that all passed their checks,
   that shapes and dtypes are equal, and that global inputs hold equal values (per-rank inputs:
   equal within the ranks that share a slice); a failure anywhere raises on every rank before
   any collective of the model;
2. finds the program for the call's mode (train or eval) and input shapes, or builds it: trace
   the meta copy in that mode, plan (rank 0 solves, every rank receives the plan and compares
   its hash), rewrite, run. The first build places the parameters: rank 0's values are
   broadcast (every rank starts from one model, as with DistributedDataParallel) and each rank
   keeps its shards in a ParameterStore; later builds (another shape, eval mode) are planned
   with the parameters staying where they are;
3. checks, when the program draws random numbers (dropout), that every rank's generator is in
   the same state: each rank draws the slice of what the single-device model would draw from
   that state;
4. runs the program.

Parameters are DTensors under the model's own names (see runtime/params.py): optimizers, param
groups by name, clip_grad_norm_, state_dict() and torch.distributed.checkpoint work on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from autopar.passes import strategies as strat_pass
from autopar.passes.batch_local import batch_dims, split_problem
from autopar.passes.loss_weights import LossWeights, microbatch_weights, of_program
from autopar.passes.pipeline_split import ValueMeta, buffer_writes, layer_blocks, split_stages
from autopar.passes.recompute_regions import wrap_recomputed
from autopar.passes.rewrite import rewrite
from autopar.passes.torch_compat import persistent_buffers
from autopar.passes.trace import (
    TracedProgram,
    TraceError,
    meta_copy,
    source_line,
    state_writes,
    trace,
    untraced_hooks,
)
from autopar.passes.trace_values import changed
from autopar.passes.zero import zero_shard
from autopar.runtime.collectives import MeshComm
from autopar.runtime.control import Control, RankError, agreed, content_hash, signature
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.inference_outputs import guard_outputs
from autopar.runtime.module import ParallelModule
from autopar.runtime.params import ParameterStore, local_block, skeleton_child
from autopar.runtime.pipeline import PipelineModule, SubmeshComm, stage_parameters
from autopar.runtime.zero import ZeroSync
from autopar.solver.specs import compute_dtype
from autopar.solver.stages import StageError, schedule_problem

from .guards import ValueGuards, put_back
from .inputs import (
    Call,
    batch_of,
    check_device,
    check_no_input_grads,
    global_call,
    microbatch,
    on_meta,
    pieces_of,
    split_call,
)
from .materialize import aliases, broadcast_from_rank0, local_values
from .mesh import MeshSpec
from .options import PlanOptions
from .originals import Original, as_given, become, fresh
from .plan import Plan
from .planner import choice_from_plan, input_placement, solve_accumulated, solve_pipeline_plan


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans; raised on every rank before any collective of the model."""


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict` returns (as torch's does): the names it did not find."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class _Hidden:
    """Holds an object without nn.Module registering it (a model, a DeviceMesh)."""

    def __init__(self, obj):
        self.obj = obj


@dataclass
class _Variant:
    """A pipelined model's program for one set of modules' modes and input shapes: its plan,
    how its microbatches' losses add up, the target (shape, dtype) it was traced with and,
    but for the build's own (whose stages the PipelineModule made), the parts its stages are
    added from (`Parallelized._add_pipeline_stages`)."""

    plan: Plan
    loss_weights: LossWeights
    target: tuple
    program: TracedProgram | None = None
    train: list | None = None
    infer: list | None = None
    written: dict | None = None
    loss_placement: object = None
    constants: dict | None = None
    roots: list | None = None


@dataclass
class _Built:
    """One program built for a call: its runner, the target it was traced with (None: no
    loss_fn), and the random draws it makes."""

    runner: ParallelModule
    target: tuple | None
    random_ops: list[str]
    loss_weights: LossWeights = LossWeights()

    @property
    def plan(self) -> Plan:
        return self.runner.plan


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
        self._init_fn = init_fn
        self._compute_dtype = compute_dtype(options.precision)
        self._original = Original(model)  # changes made on it after parallelize follow
        self._source = _Hidden(model)          # the user's model, until the first build
        self._meta = _Hidden(meta_copy(model))  # tracing runs on this copy
        self._aliases = aliases(model)
        self._mesh_holder = _Hidden(mesh)
        self._spec = spec
        self._options = options
        self._loss_fn = loss_fn
        self._given_plan = plan
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
        self._guards = ValueGuards(self._meta.obj, self, loss_fn)
        self._control = Control()
        self._device = _device_of(mesh)
        self._runners: dict[tuple, list[_Built]] = {}
        self._store: ParameterStore | None = None
        self._grad_sync: GradSync | None = None
        self._buffers_whole: dict[str, torch.Tensor] = {}
        self._pipeline: PipelineModule | None = None
        self._pipeline_plans: dict = {}  # (modes, input shapes) (None: the build's) -> _Variant
        self._last_plan: Plan | None = None
        self._coords = tuple(mesh.get_coordinate())
        self._comm = MeshComm([mesh.get_group(k) for k in range(mesh.ndim)])
        self._same_slice = self._slice_groups(mesh)
        become(model, self)  # the model is this model from now on (autopar/originals.py)

    # -- the user's calls ----------------------------------------------------------------------
    def build(self, example_inputs: tuple, example_kwargs: dict | None = None) -> None:
        """Plan and build now for these inputs (what `step` will receive with a loss_fn; the
        model's inputs otherwise, then planned for training when the model returns its loss)
        instead of at the first call."""
        with self._control.guard("parallelize"):
            if self._spec.pipeline_dim is not None:
                if self._pipeline is None:
                    self._build_pipeline(tuple(example_inputs))
                return
            step = True if self._loss_fn is not None else "auto"
            call = self._split(tuple(example_inputs), dict(example_kwargs or {}), step)
            self._program_for(call, step)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward on the batch; returns the loss, the same on every rank.

        With a `loss_fn`: `step(*inputs, target)`. Without: `step(*inputs, **kwargs)` for a
        model that returns its loss (a scalar, or an output with a `loss` field). Gradients of
        this rank's shards are complete when it returns: an optimizer over `parameters()`
        can step."""
        with self._control.guard("step()"):
            if self._spec.pipeline_dim is not None:
                return self._pipeline_call(args, kwargs, step=True)
            call = self._split(args, kwargs, step=True)
            built = self._program_for(call, step=True)
            m = built.plan.accumulation
            parts = [microbatch(call, m, i).tensors for i in range(m)]
            return built.runner.step(parts, self._microbatch_weights(built.loss_weights, parts))

    def forward(self, *args, **kwargs):
        """Inference: returns what the original model returns, whole, on every rank. Train
        with `step`: while autograd records, backward through these outputs raises (the
        parameters get no gradient from them; runtime/inference_outputs.py)."""
        with self._control.guard("the forward call"):
            if self._spec.pipeline_dim is not None:
                outputs = self._pipeline_call(args, kwargs, step=False)
            else:
                call = self._split(args, kwargs, step=False)
                outputs = self._program_for(call, step=False).runner.infer(call.tensors)
        return guard_outputs(outputs, any(p.requires_grad for p in self.parameters()))

    def _module_hooks(self) -> str | None:
        """An error message if a hook was registered on one of this model's modules (they
        hold the parameters under the model's names; the programs never call them)."""
        for name, m in self.named_modules():
            if name and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or
                         m._backward_pre_hooks):
                return (f"a hook was registered on module {name} of the parallelized model; "
                        "its programs never call the modules, so it would never run. Register "
                        "forward hooks on the model before parallelize (they are traced)")
        return None

    def _rebound_buffers(self, moved: list) -> str | None:
        """A buffer replaced on the parallelized model (`pmodel.mask = new`, register_buffer
        again) since the programs took it: its values are copied into the tensor the programs
        read, which takes its place again (and joins `moved`: ranks must agree on it); an
        error message if it cannot be (removed, or another shape or dtype)."""
        for name, whole in self._buffers_whole.items():
            owner, last = skeleton_child(self, name)
            now = owner._buffers.get(last)
            if now is not whole:
                error = put_back(whole, now, f"buffer {name}")
                if error:
                    return error
                owner._buffers[last] = whole
                moved.append(whole)
        return None

    def _microbatch_weights(self, weights: LossWeights, parts: list[list[torch.Tensor]],
                            reduction: str | None = None) -> list[float]:
        """The weight of each microbatch's loss in the whole batch's (passes/loss_weights.py):
        for a loss that averages the targets it counts, each microbatch's count over the
        batch's, counted before the step (the same on every rank: the inputs agree); for a
        loss autopar cannot read, `reduction` (the plan's loss_reduction; the options' when
        not given), never an assumption."""
        m = len(parts)
        reduction = reduction or self._options.loss_reduction
        if m > 1 and not weights.kind and reduction is None:
            raise ValueError(
                f"this plan accumulates gradients over {m} microbatches, but autopar cannot "
                "read how the loss adds up the batch's samples; pass loss_reduction=\"sum\" "
                "or \"mean\", or plan again with microbatches=1")
        if m > 1 and weights.exact():  # a plan given with accumulation (the planner refuses)
            raise ValueError(f"this plan accumulates gradients over {m} microbatches, which "
                             f"would not compute what the whole batch does: "
                             f"{weights.exact()}. Plan again with microbatches=1.")
        counts = None
        if m > 1 and weights.kind == "targets":
            with torch.no_grad():
                counts = [int(weights.counter(*tensors)) for tensors in parts]
        return microbatch_weights(weights, counts, m, reduction == "mean")

    def _split(self, args, kwargs, step) -> Call:
        try:
            return split_call(args, kwargs, with_target=bool(step) and self._loss_fn is not None)
        except (TypeError, TraceError) as e:
            error = str(e)
        self._control.exchange("checking the call's inputs", error, [])
        raise AssertionError("unreachable: exchange raises when a rank failed")

    # -- finding or building the program for a call --------------------------------------------
    def _program_for(self, call: Call, step: bool) -> _Built:
        original = self._original.follow(self)  # before the key: it may change modes
        key = self._model_key(call)
        built = self._find(key, call, step)
        rebound = self._guards.rebound()
        moved = self._guards.refresh()
        error = check_device(call, self._device) or (check_no_input_grads(call) if step
                                                     else None) or self._module_hooks() \
            or original or rebound or self._rebound_buffers(moved)
        if error is None and built is None:
            error = self._guards.check(key[0][1])
        if step and not torch.is_grad_enabled():
            error = ("step() runs the backward pass: call it outside torch.no_grad() / "
                     "torch.inference_mode() (use the forward call for inference)")
        if error is None and built is None and self._runners and \
                self._options.on_new_shape == "raise":
            error = (f"the inputs ({call.describe()}) differ from those the plan was made for "
                     "(on_new_shape='raise'); pass inputs of the planned shapes, or "
                     "parallelize with on_new_shape='replan' to plan for each new shape")
        rows = self._agree_inputs(call, error, "step()" if step else "the forward call", key,
                                  moved)
        if built is None:
            built = self._build(call, step, key)
        self._check_random_states(built.random_ops, rows)
        self._last_plan = built.plan
        return built

    def _agree_inputs(self, call: Call, error: str | None, what: str,
                      key: tuple | None = None, moved: list | None = None) -> list[list[int]]:
        """Every rank learns whether every rank's inputs passed its checks (`error`: this
        rank's failure), and that all passed the same shapes and dtypes and, for global inputs,
        the same values (per-rank inputs: the same within the ranks that share a slice), and
        the same values of captured tensors changed in place (`moved`).
        Returns the agreed rows (shapes, values, random state) of every rank."""
        per_rank = bool(self._options.per_rank_inputs)
        target = call.target
        rows = self._control.exchange(
            f"checking the inputs of {what}", error,
            [signature(key or self._model_key(call), None if target is None else
                       (tuple(target.shape), str(target.dtype))),
             signature(*(content_hash(t) for t in [*call.tensors, *(moved or ())]))
             if error is None else 0,
             _rng_signature(self._device), signature(what)])
        self._control.check_same(
            "ranks are in different calls of the parallelized model (a call on some ranks "
            "only, as DistributedDataParallel code evaluating on rank 0 alone makes): every "
            "rank makes each step() and inference call, whose collectives need them all; "
            "evaluate on every rank and report on one", rows, 3, what)
        self._control.check_same(
            f"ranks passed inputs of different shapes or dtypes to {what}", rows, 0,
            call.describe())
        self._control.check_same(
            f"ranks passed different values to {what}: " + (
                "with per_rank_inputs, ranks that share a slice of the batch (the same "
                "coordinates on " + ", ".join(self._options.per_rank_inputs) + ") must pass "
                "the same tensors" if per_rank else
                "inputs are global (every rank passes the whole batch, as in single-device "
                "code); to pass each rank its own slice, parallelize with per_rank_inputs="
                "(names of the data-parallel mesh dimensions)") + (
                "; or a tensor the loss function captures was changed in place to different "
                "values" if moved else ""),
            rows, 1, "", group_of=self._same_slice if per_rank else None)
        return rows

    def _check_random_states(self, random_ops: list[str], rows: list[list[int]]) -> None:
        """A program that draws random numbers needs every rank's generator in one state."""
        if random_ops:
            self._control.check_same(
                "the model draws random numbers (" + "; ".join(random_ops[:3]) + ") and ranks' "
                "random generators are in different states: seed every rank alike "
                "(torch.manual_seed(seed) on all ranks) so that each rank draws its slice of "
                "what the single-device model would draw; keep per-rank randomness (data "
                "shuffling) on a torch.Generator of its own", rows, 2)

    def _model_key(self, call: Call) -> tuple:
        return call.key((self._modes(), self._guards.fingerprint(self)))

    def _modes(self) -> tuple:
        """The modules' train / eval flags: the model's, and the names of the modules in the
        other mode (usually none)."""
        if all(m.training == self.training for m in self.modules()):
            return (self.training, ())
        return (self.training, tuple(name for name, m in self.named_modules()
                                     if m.training != self.training))

    def _find(self, key, call: Call, step: bool) -> _Built | None:
        target = None if call.target is None else (tuple(call.target.shape), call.target.dtype)
        for built in self._runners.get(key, []):
            if step and built.runner.trains and built.target == target:
                return built
            if not step and built.plan.accumulation == 1:  # traced for the whole batch
                return built
        return None

    def _build(self, call: Call, step: bool, key: tuple) -> _Built:
        """Trace, plan, rewrite and (at the first build) place the parameters: a collective
        every rank enters together (their inputs agreed)."""
        traces: dict[int, TracedProgram] = {}

        def trace_at(m: int) -> TracedProgram:  # the model on one of m microbatches
            if m not in traces:
                traces[m] = self._trace(microbatch(call, m), step)
            return traces[m]

        # Every rank traces the model on the whole batch before rank 0 plans, not after it: the
        # ranks trace side by side instead of waiting for rank 0's planning in turn. (The whole
        # batch's trace says whether microbatches add up to it, before one is traced: one may
        # not trace, as under a loss that captures the whole batch's mask.)
        self._agreed("tracing the model", lambda: trace_at(1))
        plan = self._plan_for(trace_at, batch_of(call), accumulate=bool(step))
        program = self._agreed("tracing the model", lambda: trace_at(plan.accumulation))
        spec = self._spec

        def match():
            graph = strat_pass.build(program, spec.shape, input_placement(spec, self._options),
                                     zero=True)
            return graph, choice_from_plan(plan, graph)

        graph, choice = self._agreed("matching the plan to the model", match)
        if self._store is None:
            self._place_parameters(plan)
        per_rank = None
        placement = input_placement(spec, self._options)
        if placement is not None:
            first = next(iter(graph.nodes[n] for n in program.inputs))
            per_rank = (placement, first.out_shapes[0][0])
        m = plan.accumulation
        dims = self._agreed("tracing the model", lambda: batch_dims(trace_at(1), m, program)) \
            if m > 1 and program.random_ops else {}
        programs = rewrite(program, graph, choice, self._coords, self._comm, per_rank,
                           free_after_forward=frozenset(
                               n for n, name in program.params.items()
                               if name in set(plan.resharded)),
                           bucket_bytes=self._options.bucket_bytes,
                           microbatches=(m, dims) if dims else None)
        if programs.train is not None:  # the blocks the plan recomputes run under checkpoint
            # (keeping of the parameters freed after forward only what gathers them again)
            comm = self._comm
            wrap_recomputed(programs.train, plan.recompute,
                            (lambda: comm.session) if plan.resharded else None)
        constants = self._constants(program)
        runner = ParallelModule(plan, programs, program.params, self._store, constants,
                                list(program.inputs), self._comm, self._grad_sync,
                                program.out_spec, self._compute_dtype,
                                program.inputs[len(call.args)] if program.has_target else None)
        target = None
        if program.has_target:
            target = (tuple(call.target.shape), call.target.dtype)
        built = _Built(runner, target, program.random_ops,
                       of_program(program, bool(self._options.per_rank_inputs),
                                  self._options.loss_reduction, trace_at(1)))
        key = self._model_key(call)  # with the values this trace found it reads
        self._guards.remember(key[0][1])
        self._runners.setdefault(key, []).append(built)
        return built

    def _trace(self, call: Call, with_loss: bool) -> TracedProgram:
        model = self._meta.obj
        self._set_modes(model)
        traced_call = on_meta(call)
        if self._options.per_rank_inputs:
            traced_call = global_call(call, pieces_of(self._spec.shape, self._spec.names,
                                                      self._options.per_rank_inputs))
        use_loss_fn = bool(with_loss) and self._loss_fn is not None
        self._guards.sync(self, model)
        with self._guards.reading(model):
            program = trace(model, traced_call.args, self._loss_fn if use_loss_fn else None,
                            traced_call.target, kwargs=dict(traced_call.kwargs),
                            output_loss=with_loss if self._loss_fn is None else False,
                            device=self._device, compute_dtype=self._compute_dtype,
                            source=self._original.model())
        return self._not_captured(program)

    def _not_captured(self, program: TracedProgram) -> TracedProgram:
        """`program`, or a TraceError when it holds a tensor of the model as a constant (a
        loss function that captured one: autopar/originals.py `captured`)."""
        error = self._original.captured(program.constants) if program.has_target else None
        if error:
            raise TraceError(error)
        return program

    def _module_modes(self) -> dict[str, bool]:
        """The train / eval flag of every module, by its name in the model ("" the model)."""
        return {name: m.training for name, m in self.named_modules()}

    def _set_modes(self, model: nn.Module) -> None:
        """Each module of `model` (the meta copy) in the mode its module here has (see
        __init__), before a trace."""
        modes = self._module_modes()
        for name, m in model.named_modules():
            m.training = modes.get(name, self.training)

    def _plan_for(self, trace_at, batch: int | None, accumulate: bool) -> Plan:
        """The plan for the model traced by `trace_at(microbatches)` (on `batch`): the given
        plan at the first build, else solved on rank 0 (with the parameters where they are
        stored, after the first build; with gradient accumulation when the batch must be cut
        to fit) and broadcast; every rank checks that all hold the same."""
        given = self._plan_given()
        storage = self._store.placements if self._store is not None else None
        zero = self._store.zero_stages() if self._store is not None else None

        def solve() -> Plan:
            if given is not None:
                return given
            return solve_accumulated(trace_at, batch, self._spec, self._options,
                                     storage=storage, zero=zero, accumulate=accumulate)[0]

        plan = self._agreed("planning", solve, on_rank0=given is None)
        self._check_same_plan(plan)
        return plan

    def _plan_given(self) -> Plan | None:
        """The plan passed to parallelize, at the first build (later builds plan with the
        parameters where they are stored)."""
        return self._given_plan if self._store is None else None

    def _check_same_plan(self, plan: Plan) -> None:
        """Every rank holds `plan` (compared by hash), or every rank raises
        PlanMismatchError."""
        hashes = self._control.gather_objects(plan.hash())
        if len(set(hashes)) != 1:
            raise agreed(PlanMismatchError(
                "ranks hold different plans (hashes by rank: " + ", ".join(hashes) + "); pass "
                "the same plan (or the same model, inputs and options) on every rank"))

    def _agreed(self, what: str, fn, on_rank0: bool = False):
        """`fn()` on every rank (or on rank 0, its result, a Plan, broadcast); an error anywhere
        raises on every rank (the raising rank's own error there, a RankError elsewhere)."""
        result, error = None, None
        if not on_rank0 or self._control.rank == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
                error = e
        if on_rank0:
            mine = None
            if self._control.rank == 0:
                mine = ("error", error) if error is not None else ("ok", result.to_dict())
            box = self._control.broadcast_object(mine)
            if box[0] == "error":
                raise agreed(box[1])
            return Plan.from_dict(box[1])
        failed = [r for r, bad in enumerate(self._control.gather_objects(error is not None))
                  if bad]
        if error is not None:
            raise agreed(error)
        if failed:
            raise agreed(RankError(f"{what} failed on rank(s) {failed} (see the error there)"))
        return result

    # -- the parameters, placed once -----------------------------------------------------------
    def _place_parameters(self, plan: Plan) -> None:
        """Rank 0's parameters and buffers, broadcast; each rank keeps its shards."""
        mesh_shape = tuple(self._spec.shape)
        replicated = tuple(Replicate() for _ in mesh_shape)
        names = [n for n, _ in self._source.obj.named_parameters()]
        placements = {n: tuple(plan.parameters.get(n, replicated)) for n in names}
        shapes = {n: tuple(p.shape) for n, p in self._source.obj.named_parameters()}
        zero = {n: (stage, zero_shard(shapes[n], placements[n], mesh_shape))
                for n, stage in plan.zero.items()}
        self._place(placements, self._mesh_holder.obj, mesh_shape, self._coords, zero)
        store = self._store
        trained = [(leaf, tuple(k for k, p in enumerate(placements[n])
                                if isinstance(p, Replicate)))
                   for n, leaf in store.leaves.items() if leaf.requires_grad and n not in zero]
        sharded = ZeroSync([(store.leaves[n], z) for n, z in store.zero.items()
                            if store.leaves[n].requires_grad], self._comm.groups,
                           self._options.bucket_bytes) if zero else None
        self._grad_sync = GradSync(trained, self._comm.groups, mesh_shape,
                                   self._options.bucket_bytes, zero=sharded)

    def _place(self, placements: dict[str, tuple], mesh, mesh_shape, coords,
               zero: dict | None = None) -> None:
        """Rank 0's parameters and buffers, broadcast (every rank starts from one model): this
        rank keeps its block, at mesh `coords`, of each parameter in `placements` (in that
        order: the order gradients are bucketed in, the same on every rank) in a
        ParameterStore over `mesh`, and every buffer whole; all under the model's names. The
        full model is not referenced afterwards."""
        model = self._source.obj
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())

        def keep(name, whole):
            if name in placements:
                return local_block(whole, placements[name], mesh_shape, coords)
            return whole.clone() if name in buffers else None

        with as_given(model):  # (its own class's methods initialize it, module by module)
            local = self._agreed("initializing the parameters", lambda: local_values(
                model, keep, self._device, self._broadcast_group(), self._init_fn))
        self._store = ParameterStore(
            mesh, placements, {n: local[n] for n in placements},
            {n: params[n].requires_grad for n in placements}, self._aliases, zero,
            self._options.bucket_bytes)
        self._store.register(self)
        persistent = persistent_buffers(model)
        for name in buffers:
            owner, last = skeleton_child(self, name)
            owner.register_buffer(last, local[name], persistent=name in persistent)
            self._buffers_whole[name] = local[name]
        self._source = _Hidden(None)
        self._original.built(self)  # the model's tensors are these from now on

    def _broadcast_group(self):
        """The group rank 0's tensors are broadcast over: the gloo control group on CPUs (the
        default group otherwise)."""
        return self._control.group if self._device.type == "cpu" else None

    def _constants(self, program: TracedProgram) -> dict[str, torch.Tensor]:
        """The program's buffers (placed once) and lifted constants (rank 0's)."""
        out, lifted = {}, {}
        for ph, key in program.buffers.items():
            if key.startswith("constant:"):
                lifted[ph] = program.constants[key].to(self._device)
            else:
                out[ph] = self._buffers_whole[key]
        copies = broadcast_from_rank0(lifted, lambda n, t: t.clone(), self._broadcast_group())
        for ph, copy in copies.items():  # copied again when the user's tensor changes in place
            self._guards.follow(program.constants[program.buffers[ph]], copy)
        out.update(copies)
        return out

    def _slice_groups(self, mesh):
        """rank -> its coordinates on the per-rank input dimensions (ranks with equal
        coordinates receive the same slice)."""
        names = mesh.mesh_dim_names or ()
        dims = [k for k, n in enumerate(names) if n in self._options.per_rank_inputs]
        where = {}
        ranks = mesh.mesh
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in ranks.shape]).reshape(
                -1, ranks.dim()).tolist():
            where[int(ranks[tuple(idx)])] = tuple(idx[k] for k in dims)
        return where.__getitem__

    # -- pipelines ------------------------------------------------------------------------------
    def _pipeline_call(self, args, kwargs, step: bool):
        error = None
        if kwargs:
            error = "a pipelined model takes positional inputs only"
        elif self._pipeline is None and not step:
            error = ("a pipelined model is planned for training: call step() first (or pass "
                     "example_inputs= with the target to parallelize)")
        call = Call((), (), None)
        if error is None:
            try:
                call = split_call(args, {}, with_target=step)
            except TraceError as e:
                error = str(e)
        if error is None and step:
            error = check_no_input_grads(call) or self._module_hooks()
        if error is None and self._pipeline is not None:
            error = self._pipeline.check(call.args)
        original = self._original.follow(self)
        rebound = self._guards.rebound()
        moved = self._guards.refresh()
        error = error or original or rebound or self._rebound_buffers(moved)
        if error is None and self._pipeline is not None:
            now = self._guards.fingerprint(self)
            lines = changed(self._pipeline.values, now)
            if lines:
                error = ("values the pipelined program was traced with changed (" +
                         "; ".join(lines[:4]) + "); a pipelined model is traced once: set "
                         "them before its first step, or hold a value that changes in a "
                         "tensor (a buffer of the model, or a tensor the loss function "
                         "captures, changed in place)")
        tracer, key = None, None  # the stages to run: the build's (None) or another's
        if error is None and self._pipeline is not None:
            shapes = tuple(tuple(t.shape) for t in call.args if isinstance(t, torch.Tensor))
            planned = tuple(tuple(t.shape) for t in self._pipeline.example[:-1])
            modes = tuple(sorted(self._module_modes().items()))
            if shapes == planned:
                tracer, error = self._pipeline_modes()  # None: the build's program runs
                key = (modes, shapes) if tracer is not None else None
            elif (modes, shapes) not in self._pipeline_plans:
                key = (modes, shapes)
                if self._options.on_new_shape == "raise":
                    error = (f"inputs of shapes {list(shapes)} differ from the "
                             f"{list(planned)} this pipeline was planned for (on_new_shape="
                             "'raise'); pass inputs of the planned shapes, or parallelize "
                             "with on_new_shape='replan'")
                elif _target_like(call, self._pipeline.example) is None:
                    error = ("this pipelined model infers at new input shapes after a step "
                             "at them: its program is traced with the loss, whose target's "
                             "shape at these inputs cannot be told from the build's")
            else:
                key = (modes, shapes)
            traced = self._pipeline_plans[key].target if key in self._pipeline_plans else None
            if error is None and step and traced is not None and \
                    (tuple(call.target.shape), call.target.dtype) != traced:
                error = (f"the target ({tuple(call.target.shape)} {call.target.dtype}) differs "
                         f"from the {traced[0]} {traced[1]} this pipelined model's program at "
                         "these inputs was traced with; a pipeline keeps one target shape per "
                         "input shapes")
        rows = self._agree_inputs(call, error, "step()" if step else "the forward call",
                                  moved=moved)
        if self._pipeline is None:
            self._build_pipeline(args)
        if key is not None and key not in self._pipeline_plans:
            self._add_pipeline_variant(key, tracer, call)
        self._last_plan = self._pipeline_plans[key].plan
        if not self._pipeline.has(key, step):
            self._add_pipeline_stages(key, step)
        self._check_random_states(self._pipeline.draws(key, step), rows)
        if not step:
            return self._pipeline.infer(*args, key=key)
        m = self._last_plan.pipeline.microbatches
        parts = [microbatch(call, m, i).tensors for i in range(m)]
        weights = self._microbatch_weights(self._pipeline_plans[key].loss_weights, parts,
                                           self._last_plan.pipeline.loss_reduction)
        return self._pipeline.step(*args, weights=weights, key=key)

    def _build_pipeline(self, example_inputs) -> PipelineModule:
        """As `_build`, for a mesh with a "pp" dimension: each rank keeps its stages' programs,
        cut from its local program, and runs them under the plan's pipeline schedule."""
        if self._loss_fn is None:
            raise agreed(ValueError("a pipelined model trains through step(): pass loss_fn= to "
                                    "parallelize (pipelined inference alone is not supported)"))
        example_inputs = tuple(example_inputs)
        self._set_modes(self._meta.obj)  # traced in the modes set on this model now
        self._guards.sync(self, self._meta.obj)
        with self._guards.reading(self._meta.obj):
            pipeline = self._build_pipeline_traced(example_inputs)
        pipeline.values = self._guards.fingerprint(self)  # with what the trace found it reads
        pipeline.modes = self._module_modes()
        pipeline.example = tuple(torch.empty_like(t, device="meta") for t in example_inputs)
        pipeline.in_modes = {tuple(sorted(pipeline.modes.items())): (None, None)}
        return pipeline

    def _pipeline_modes(self) -> tuple:
        """(tracer, error) for the modules' modes now: (None, None) when they are those the
        pipelined program was traced in, or when the model traces to the same program in them
        (a model without dropout or BatchNorm); else the model's pipeline_tracer in them, for
        the stages of these modes (`_add_pipeline_modes`), or why the model does not trace in
        them. Found once for each set of modes."""
        pipeline = self._pipeline
        now = self._module_modes()
        key = tuple(sorted(now.items()))
        if key not in pipeline.in_modes:
            pipeline.in_modes[key] = self._modes_problem(pipeline.modes, now)
        return pipeline.in_modes[key]

    def _modes_problem(self, then: dict[str, bool], now: dict[str, bool]) -> tuple:
        """`_pipeline_modes` for modes it has not met: the meta copy traced in `now`, compared
        op by op with the pipelined program (traced in `then`)."""
        pipeline, model = self._pipeline, self._meta.obj
        m = pipeline.plan.pipeline.microbatches
        try:
            self._set_modes(model)
            self._guards.sync(self, model)
            tracer = pipeline_tracer(model, pipeline.example, self._loss_fn, self._device,
                                     self._compute_dtype, self._original.model())
            return (None if _ops_of(tracer(m)) == pipeline.ops else tracer), None
        except Exception as e:  # noqa: BLE001 - reported on every rank as the reason
            return None, (
                f"the modules' train / eval modes changed since this pipelined model was "
                f"traced ({_modes_changed(then, now)}) and the model does not trace in them "
                f"({type(e).__name__}: {e}). Set the modes before parallelize (model.train() "
                "or model.eval(), and a submodule's own)")

    def _add_pipeline_variant(self, key: tuple, tracer, call: Call) -> None:
        """The program for `key`, the modules' modes and the input shapes of `call` (the model
        traced in them by `tracer`, or here at the call's inputs and target: `_target_like`
        for an inference call), planned on the running pipeline's
        stages and schedule with the parameters where they are stored (solve_pipeline_plan's
        `running`), over as many microbatches as the build's or the most under that the batch
        splits into (and the schedule runs), rewritten and cut as the pipeline's own. Its
        training and inference stages are added when a call needs them
        (`_add_pipeline_stages`)."""
        pipeline = self._pipeline
        running = pipeline.plan.pipeline
        self._set_modes(self._meta.obj)  # the tracer traces the meta copy in these modes
        self._guards.sync(self, self._meta.obj)
        batch = batch_size(call.args)
        target = pipeline.example[-1]  # (the build's inputs: a tracer in other modes)
        if tracer is None:
            target = _target_like(call, pipeline.example)
            example = (*[torch.empty_like(t, device="meta") for t in call.args], target)
            tracer = pipeline_tracer(self._meta.obj, example, self._loss_fn, self._device,
                                     self._compute_dtype, self._original.model())
        p = self._spec.shape[running.mesh_dim]
        splits = [d for d in range(min(running.microbatches, batch), 0, -1) if batch % d == 0]
        runs = [d for d in splits if not schedule_problem(running.schedule, p, d,
                                                          running.virtual_stages)]
        options = dataclasses.replace(self._options, microbatches=(runs or splits)[0])
        plan = self._agreed("planning the model for this call", lambda: solve_pipeline_plan(
            tracer, batch, self._spec, options, running=pipeline.plan), on_rank0=True)
        self._check_same_plan(plan)
        program, train, infer, written, _, loss_placement = self._cut_stages(tracer, plan)
        self._pipeline_plans[key] = _Variant(
            plan, of_program(program, whole=tracer(1)), (tuple(target.shape), target.dtype),
            program, train,
            infer, written, loss_placement, self._constants(program), _roots(program))

    def _add_pipeline_stages(self, key: tuple, train: bool) -> None:
        """The training (or inference) stages of `key`'s program (`_add_pipeline_variant`),
        added to the pipeline; an error on every rank when the pipeline's schedule cannot
        train on so few microbatches."""
        v = self._pipeline_plans[key]
        pipe = v.plan.pipeline
        # (inference runs GPipe, which takes any count, but for interleaved stages)
        why = schedule_problem(pipe.schedule, self._spec.shape[pipe.mesh_dim],
                               pipe.microbatches, pipe.virtual_stages) \
            if train or pipe.schedule == "interleaved" else None
        if why:
            raise agreed(ValueError(
                f"this pipeline {'trains' if train else 'infers'} with its {pipe.schedule} "
                f"schedule, and a batch of {pipe.batch_size} splits into no microbatch count "
                f"it runs ({why}): pass larger batches"
                + (" (inference takes any)" if pipe.schedule != "interleaved" else "")))
        if train:
            self._pipeline.add_training(key, v.train, v.program.params, v.constants,
                                        v.written, v.program.random_ops, v.loss_placement,
                                        pipe.microbatches, v.roots)
        else:
            self._pipeline.add_inference(key, v.infer, v.program.params, v.constants,
                                         v.written, v.program.random_ops, pipe.microbatches,
                                         v.roots)

    def _build_pipeline_traced(self, example_inputs: tuple) -> PipelineModule:
        """`_build_pipeline`, its model's values synced and its reads watched."""
        spec, mesh = self._spec, self._mesh_holder.obj
        tracer = pipeline_tracer(self._meta.obj, example_inputs, self._loss_fn, self._device,
                                 self._compute_dtype, self._original.model())
        if self._given_plan is None:
            chosen = self._agreed("planning", lambda: solve_pipeline_plan(
                tracer, batch_size(example_inputs), spec, self._options), on_rank0=True)
        else:
            chosen = self._given_plan
        self._check_same_plan(chosen)
        pipe = chosen.pipeline
        program, train, infer, written, comm, loss_placement = self._cut_stages(tracer, chosen)
        pp = pipe.mesh_dim
        sub = spec.without(pp)
        coords = self._coords
        dims = [k for k in range(mesh.ndim) if k != pp]
        sub_coords = tuple(coords[k] for k in dims) or (0,)
        p = mesh.shape[pp]
        mine, _, _ = stage_parameters(train + infer, program.params, p, coords[pp])
        submesh = mesh[tuple(mesh.mesh_dim_names[k] for k in dims)] if dims else None
        self._full_meta = {n: (tuple(t.shape), t.dtype)
                           for n, t in self._source.obj.named_parameters()}
        self._place({n: tuple(chosen.parameters[n]) for n in mine}, submesh, sub.shape,
                    sub_coords)
        constants = self._constants(program)
        self._pipeline = PipelineModule(
            chosen, train, infer, program.params, self._store, constants, comm,
            mesh.get_group(pp), coords[pp], list(program.inputs), _roots(program),
            program.out_spec, len(program.inputs) - 1, loss_placement, self._device,
            self._full_meta, self._compute_dtype, written, program.random_ops)
        self._pipeline.ops = _ops_of(program)
        self._pipeline_plans[None] = _Variant(
            chosen, of_program(program, whole=tracer(1)), (tuple(example_inputs[-1].shape),
                                          example_inputs[-1].dtype))
        self._last_plan = chosen
        return self._pipeline

    def _cut_stages(self, tracer, chosen: Plan) -> tuple:
        """The model traced by `tracer` (pipeline_tracer), matched to the pipelined plan
        `chosen`, rewritten for this rank and cut into its stages: (program, train stages,
        inference stages, buffers written in forward by pp rank, the submesh's comm, where
        the loss lives)."""
        spec, mesh = self._spec, self._mesh_holder.obj
        pipe = chosen.pipeline

        def match():
            if pipe is None:
                raise ValueError("the mesh has a pp dimension but the plan is not pipelined; "
                                 "re-plan with autopar.plan on this mesh")
            program = self._not_captured(tracer(pipe.microbatches))
            graph = strat_pass.build(program, spec.without(pipe.mesh_dim).shape)
            choice = choice_from_plan(chosen, graph)
            blocks = layer_blocks(program, graph)
            why = split_problem(tracer(1), pipe.microbatches,
                                loss_reduction=pipe.loss_reduction)
            if why:
                raise ValueError(f"a pipeline runs the batch as {pipe.microbatches} "
                                 "microbatches, which would not compute what the whole batch "
                                 f"does: {why}. Plan it without a pp mesh dimension")
            if blocks.names != pipe.blocks:
                raise ValueError("this model traces into other layer blocks than the plan's "
                                 f"({blocks.names} vs {pipe.blocks}); re-plan with "
                                 "autopar.plan")
            return program, graph, choice, blocks

        program, graph, choice, blocks = self._agreed("matching the plan to the model", match)
        pp = pipe.mesh_dim
        stage_of = blocks.stage_of(pipe.cuts, pipe.num_stages)
        dims = [k for k in range(mesh.ndim) if k != pp]
        sub_coords = tuple(self._coords[k] for k in dims) or (0,)
        comm = SubmeshComm([mesh.get_group(k) for k in dims] or [None],
                           spec.without(pp).shape)
        m = pipe.microbatches
        batch_of_draws = {}
        if program.random_ops:  # each microbatch draws the whole batch's numbers (any m:
            # SDPA's dropout then runs as autopar's math kernel, whose draws a rank replays)
            batch = pipe.batch_size
            k = m if m > 1 else next((d for d in range(2, batch + 1) if batch % d == 0), 1)
            batch_of_draws = self._agreed("tracing the model",
                                          lambda: batch_dims(tracer(1), k, program))
        programs = rewrite(program, graph, choice, sub_coords, comm,
                           bucket_bytes=self._options.bucket_bytes, stage_of=stage_of,
                           microbatches=(m, batch_of_draws) if batch_of_draws else None)
        kinds = {name: v.kind for name, v in graph.nodes.items()}
        train = split_stages(programs.train, graph, stage_of, kinds, pipe.num_stages)
        infer = split_stages(programs.infer, graph, stage_of, kinds, pipe.num_stages)
        written = self._agreed("matching the plan to the model", lambda: written_buffers(
            program, train + infer, mesh.shape[pp]))
        return program, train, infer, written, comm, programs.loss_placement

    # -- parameters and state -------------------------------------------------------------------
    def _built(self):
        if self._store is None:
            raise RuntimeError("not planned yet: call step() or the model once, or pass "
                               "example_inputs= to parallelize, before asking for parameters, "
                               "state or the plan")
        return self._store

    @property
    def plan(self) -> Plan:
        """The plan that ran last (or was built last)."""
        self._built()
        return self._last_plan

    @property
    def plans(self) -> list[Plan]:
        """Every plan built so far (one per mode and input shape), in the order built."""
        self._built()
        if self._pipeline is not None:
            return [v.plan for v in self._pipeline_plans.values()]
        return [b.plan for bs in self._runners.values() for b in bs]

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
        return self._control

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
        model = self._meta.obj
        first = {alias: p for p, names in self._aliases.items() for alias in names}
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
        duplicated = self._one_ranks_blocks(state_dict, own)
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

    def _one_ranks_blocks(self, state_dict, own) -> str | None:
        """An error message when the sharded DTensors of `state_dict` hold the same local
        blocks on every rank: one rank's `state_dict()`, saved by that rank alone
        (torch.save on rank 0, as with DistributedDataParallel) and loaded on all, where each
        rank would take that rank's blocks for its own. Compared by the hash of the start of
        up to 32 such tensors, in one small all-gather on the control plane (every rank calls
        load_state_dict); blocks that are all constant (a model initialized to zeros) say
        nothing."""
        shards = [n for n in sorted(set(own) & set(state_dict))
                  if hasattr(state_dict[n], "to_local") and hasattr(own[n], "placements") and
                  any(getattr(p, "dim", None) is not None and own[n].device_mesh.size(k) > 1
                      for k, p in enumerate(own[n].placements))][:32]
        blocks = [state_dict[n].to_local().detach().reshape(-1)[:1 << 16] for n in shards]
        mine = (tuple(content_hash(b) for b in blocks),
                any(b.numel() > 1 and bool((b != b[0]).any()) for b in blocks))
        rows = self._control.gather_objects(mine)
        if not mine[0] or not mine[1] or any(row != mine for row in rows):
            return None
        return ("the state dict holds the same blocks of its sharded tensors on every rank "
                f"({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}): it is one "
                "rank's pmodel.state_dict() (this rank's shards), saved by that rank alone, "
                "and each rank would load that rank's blocks as its own. Save with "
                "autopar.checkpoint.save(path, pmodel, optimizer) on every rank (any plan "
                "loads it), or torch.save(pmodel.full_state_dict(), path) (a collective: call "
                "it on every rank, save on one)")

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call on all ranks)."""
        if self._pipeline is not None:
            return self._pipeline.full_parameters()
        store = self._built()
        return {n: store.whole(n) for n in store.params}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient reassembled whole (a collective: call on all ranks); zeros for a
        parameter without one."""
        if self._pipeline is not None:
            return self._pipeline.full_grads()
        store = self._built()
        return {n: store.whole_grad(n) for n in store.leaves}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most `max_norm`; returns the
        norm before clipping, the same on every rank (as torch.nn.utils.clip_grad_norm_ over
        the single-device model's parameters). Under a pipelined plan, where
        torch.nn.utils.clip_grad_norm_ sees only this rank's stages, this is the one to use."""
        if self._pipeline is not None:
            return self._pipeline.clip_grad_norm_(max_norm, norm_type)
        total = torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def _apply(self, fn, recurse: bool = True):
        raise RuntimeError("a parallelized model cannot change device or dtype: call .to() / "
                           ".double() / .cuda() on the model before autopar.parallelize")


def _target_like(call: Call, example: tuple) -> torch.Tensor | None:
    """A meta tensor of the target a pipelined program at `call`'s inputs is traced with: the
    call's own (a step), else the build's (`example`: its inputs, then its target) made
    for these inputs: its shape the first input's where it was the first input's (a language
    model's tokens), the build's but for the batch where the inputs differ only in the batch;
    None when it cannot be told."""
    if call.target is not None:
        return torch.empty_like(call.target, device="meta")
    inputs, target = example[:-1], example[-1]
    first = next(t for t in call.args if isinstance(t, torch.Tensor))
    if tuple(target.shape) == tuple(inputs[0].shape):
        shape = tuple(first.shape)
    elif all(tuple(t.shape[1:]) == tuple(e.shape[1:])
             for t, e in zip([t for t in call.args if isinstance(t, torch.Tensor)], inputs)):
        shape = (first.shape[0], *target.shape[1:])
    else:
        return None
    return torch.empty(shape, dtype=target.dtype, device="meta")


def _roots(program: TracedProgram) -> list[ValueMeta]:
    """The model inputs of a pipelined program (its placeholders but the target's), as the
    first stage receives them."""
    num_inputs = len(program.inputs) - 1
    return [ValueMeta(tuple(ph.meta["val"].shape), ph.meta["val"].dtype, False)
            for ph in program.graph.nodes
            if ph.op == "placeholder" and ph.name in program.inputs[:num_inputs]]


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


def _rng_signature(device: torch.device) -> int:
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return signature(bytes(state.numpy()))


def batch_size(example_inputs) -> int:
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


def _ops_of(program: TracedProgram) -> list[tuple[str, str, str, str]]:
    """The program's nodes as (kind, target, arguments, keyword arguments): equal for two
    traces computing the same ops (eval mode may keep an op and change its arguments:
    aten.dropout's `train`). A dropout of p = 0 is the identity in either mode (Hugging
    Face's eager attention keeps one), so its mode is left out."""
    out = []
    for n in program.graph.nodes:
        args = n.args
        if n.target is torch.ops.aten.dropout.default and len(args) > 1 and args[1] == 0:
            args = args[:2]
        out.append((n.op, str(n.target), repr(args), repr(n.kwargs)))
    return out


def _modes_changed(then: dict[str, bool], now: dict[str, bool]) -> str:
    """The modules whose mode differs between `then` and `now`, in words."""
    mode = {True: "training mode", False: "eval mode"}
    moved = [name for name in now if then.get(name, now[name]) != now[name]]
    if len(moved) == len(now) and len(set(now.values())) == 1:
        return f"the model was in {mode[then['']]}, now in {mode[now['']]}"
    shown = ", ".join(f"{name or 'the model'} now in {mode[now[name]]}" for name in moved[:4])
    return shown + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")


def written_buffers(program: TracedProgram, stages: list, p: int) -> dict[str, int]:
    """The buffer placeholders the stage programs write in forward, with the pp rank (of `p`)
    whose stage writes each. A buffer written on two pp ranks, or read on a pp rank other
    than its writer's, is an error naming it and its model line: within a step the ranks'
    copies would differ."""
    nodes = {n.name: n for n in program.graph.nodes}
    out = {}
    for ph, writers in sorted(buffer_writes(stages).items()):
        ranks = {s % p for s in writers}
        readers = {prog.index for prog in stages if ph in prog.constants}
        if len(ranks) == 1 and {s % p for s in readers} <= ranks:
            out[ph] = ranks.pop()
            continue
        writes = state_writes(program.graph_module, program.writes)
        lines = sorted({source_line(nodes[n]) or n for n, written in writes.items()
                        if ph in written and n in nodes})
        raise ValueError(
            f"buffer {program.buffers.get(ph, ph)} is written in forward (at "
            f"{'; '.join(lines)}) by pipeline stage(s) {sorted(writers)} and used by stage(s) "
            f"{sorted(readers)}, which run on more than one pp rank: their copies of it would "
            "differ within a step. Plan this model without a pp mesh dimension")
    return out


def pipeline_tracer(model, example_inputs, loss_fn, device=None, dtype=None, source=None):
    """trace_at(m): the model (a meta copy of `source`, which `loss_fn` may read) traced on
    the first 1/m of the batch (cached), to run on `device`."""
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    cache: dict[int, TracedProgram] = {}

    def trace_at(m: int) -> TracedProgram:
        if m not in cache:
            batch = batch_size(example_inputs)
            if m < 1 or batch % m:
                raise StageError(f"the batch of {batch} does not split into {m} microbatches; "
                                 "choose a divisor of the batch size")
            part = tuple(torch.empty_like(t[:batch // m], device="meta")
                         for t in example_inputs)
            cache[m] = trace(model, part[:-1], loss_fn, part[-1], device=device,
                             compute_dtype=dtype, source=source)
        return cache[m]

    return trace_at


