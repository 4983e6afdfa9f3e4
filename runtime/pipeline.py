"""PipelineModule: runs a pipelined plan's stages on one rank with torch.distributed.pipelining.

Each rank holds the stages the plan puts on its pp coordinate (one, or `virtual_stages` for
interleaved 1F1B) as `PipelineStage`s over the pp process group; a stage's module is the FX
program `passes.pipeline_split` cut from this rank's local program, so inside a stage the ops
run on local shards with the plan's collectives over the other mesh dimensions, exactly as in a
non-pipelined plan. The schedule (GPipe, 1F1B, interleaved 1F1B) splits the global batch into
microbatches along dimension 0.

Gradients: the last stage's loss is seeded like ParallelModule's (1 / the product of the mesh
sizes where it is replicated) and divided by the number of microbatches when losses are means,
so the accumulated gradients equal those of the whole batch. After the schedule, gradients of
parameters stored replicated are summed over those mesh dimensions, and a parameter used by
stages on several pp ranks (tied embeddings) has its copies' gradients summed over the pp group:
every copy then takes the same optimizer step.

Buffers written in forward (BatchNorm's running statistics) are written by the one stage that
runs the op; after each call that stage's pp rank broadcasts them over the pp group, so every
rank holds one device's buffers.

A PipelineModule is made of the plan, the build's program cut into `Stages`, the store of this
rank's shards, where the rank is (`PipelineRank`) and what it knows of the model (`ModelFacts`).
The stages are those of the program traced in the modules' modes at the build; a model that
computes other ops in other modes (dropout, BatchNorm) gets training and inference stages of
its own for them (`add_training`, `add_inference`), on the same stages' cuts, schedule and
microbatches, reading and training the same parameters and buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import Replicate

from autopar.passes import torch_compat
from autopar.passes.pipeline_split import StageProgram, ValueMeta
from autopar.passes.placement import local_shape
from autopar.passes.rules.random import draws_of, replay
from autopar.passes.rules.random_stream import STREAM
from autopar.passes.zero import zero_shard

from .collectives import MeshComm
from .flat import flatten, unflatten, write_grads
from .generator import generator_state, set_generator_state
from .grad_sync import sum_grads
from .loss import LossSeeding, loss_seeding
from .params import ParameterStore
from .zero import ZeroSync

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved": ScheduleInterleaved1F1B}


class SubmeshComm(MeshComm):
    """The collectives of the mesh dimensions other than pp. A dimension of size 1 (a mesh
    that is pp alone) needs no communication: its collectives are the identity."""

    def __init__(self, groups: list, shape: tuple[int, ...]):
        super().__init__(groups)
        self.shape = tuple(shape)

    def all_gather(self, x, dim, mesh_dim):
        return x if self.shape[mesh_dim] == 1 else super().all_gather(x, dim, mesh_dim)

    def reduce_scatter(self, x, dim, mesh_dim):
        return x if self.shape[mesh_dim] == 1 else super().reduce_scatter(x, dim, mesh_dim)

    def all_reduce(self, x, mesh_dim):
        return x if self.shape[mesh_dim] == 1 else super().all_reduce(x, mesh_dim)

    def all_to_all(self, x, split_dim, cat_dim, mesh_dim):
        return x if self.shape[mesh_dim] == 1 else super().all_to_all(x, split_dim, cat_dim,
                                                                      mesh_dim)


class StepCasts:
    """Mixed precision in a pipeline: each parameter cast to the compute dtype once a call
    (a step's schedule, or an inference), the copy every microbatch of the call uses. A
    microbatch's backward casts its gradient back through the shared copy, so the gradients
    add up in the master dtype as when each microbatch casts its own; but one copy is held
    where the schedule keeps several microbatches in flight, not one per microbatch (the
    planner prices it so: solver/cost.py `cast_once`)."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self._copies: dict[int, torch.Tensor] = {}

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` as the program takes it: its cast, made at its first use in the call."""
        if self.dtype is None or not weight.is_floating_point() or weight.dtype == self.dtype:
            return weight
        got = self._copies.get(id(weight))
        if got is None:
            got = self._copies[id(weight)] = weight.to(self.dtype)
        return got

    def clear(self) -> None:
        """After a call: its copies are freed (the optimizer steps the masters next)."""
        self._copies.clear()


class _StageModule(nn.Module):
    """One stage's program with its parameters and constants: forward(*received, **inputs),
    where `inputs` holds every user input of the microbatch by placeholder name."""

    def __init__(self, program: StageProgram, params: dict[str, nn.Parameter],
                 constants: dict[str, torch.Tensor], scalar_output: bool, sink=None,
                 casts: StepCasts | None = None, before=None):
        super().__init__()
        self._before = before  # called with the stage's index before each microbatch
        self._casts = casts  # mixed precision: weights cast once a call for the program
        self.program = program.module
        self.weights = nn.ParameterList([params[n] for n in program.params])
        self._constants = [constants[n] for n in program.constants]
        self._inputs = program.inputs
        self._first = program.index == 0
        self._scalar = scalar_output
        self._sink = sink
        self._index = program.index

    def forward(self, *received, **inputs):
        if self._before is not None:
            self._before(self._index)
        if self._first:  # the first stage's positional arguments are the model inputs
            received = ()
        weights = [self._casts.of(w) for w in self.weights] if self._casts is not None \
            else list(self.weights)
        out = self.program(*received, *[inputs[n] for n in self._inputs], *weights,
                           *self._constants)
        if self._sink is not None:  # pipelined inference: keep the outputs of the microbatch
            self._sink.append([t.detach() for t in out])
        return out[0] if self._scalar else tuple(out)


@dataclass
class _Run:
    """One schedule of a pipeline (its training or inference stages for one key) and what a
    call through it needs: its microbatch count, the buffers its stages write (with the pp
    rank that writes each), its random ops and each stage's draws; a training run's loss
    seeding and dtype, an inference run's last stage's outputs."""

    microbatches: int
    written: list
    random_ops: list[str]
    draws: list
    schedule: object = None
    seeding: LossSeeding | None = None
    loss_dtype: torch.dtype | None = None
    sent: list = field(default_factory=list)


def _written(constants: dict[str, torch.Tensor], written: dict[str, int] | None) -> list:
    """(buffer, pp rank of the stage that writes it) of the buffer placeholders `written`,
    in one order on every rank."""
    return [(constants[ph], src) for ph, src in sorted((written or {}).items())]


def _draws(programs: list[StageProgram]) -> list:
    """The random draws of each stage's program, in stage order; an error for a draw a
    pipeline cannot make as one device does."""
    out = []
    for prog in programs:
        nodes, why = draws_of(prog.module)
        if why:
            raise ValueError(f"pipeline stage {prog.index}: {why}, which a pipeline cannot "
                             "draw as one device does; plan without a pp mesh dimension, or "
                             "draw such noise with rand_like of a tensor that carries the "
                             "batch")
        out.append(nodes)
    return out


def stage_parameters(programs: list[StageProgram], param_names: dict[str, str], p: int,
                     coord: int) -> tuple[list[str], dict[str, int], list[str]]:
    """Which parameters the stages of pp rank `coord` use (of `p` pp ranks), the pp rank that
    owns each parameter (its first stage's), and those used on several pp ranks (tied
    embeddings: their gradients are summed over pp)."""
    holders: dict[str, set[int]] = {}
    for prog in programs:
        for ph in prog.params:
            holders.setdefault(param_names[ph], set()).add(prog.index)
    mine = sorted(n for n, stages in holders.items() if any(s % p == coord for s in stages))
    owner = {n: min(stages) % p for n, stages in holders.items()}
    shared = sorted(n for n, stages in holders.items() if len({s % p for s in stages}) > 1)
    return mine, owner, shared


@dataclass(frozen=True)
class Stages:
    """One traced program cut into pipeline stages, as a rank runs them: its training and
    inference stage programs (passes/pipeline_split.py), its parameter placeholders' names,
    its constants' tensors by placeholder (the model's buffers, shared between programs), the
    buffer placeholders its stages write in forward with the pp rank of the stage that writes
    each (after a call that rank sends the buffer's value to the others), the random ops it
    draws, where its loss lives, the first stage's inputs (one microbatch's) and the number
    of microbatches its schedule runs."""

    train: list[StageProgram]
    infer: list[StageProgram]
    param_names: dict[str, str]
    constants: dict[str, torch.Tensor]
    written: dict[str, int]
    random_ops: list[str]
    loss_placement: object
    roots: list[ValueMeta]
    microbatches: int


@dataclass(frozen=True)
class PipelineRank:
    """Where this rank is in the pipeline: the collectives of the mesh dimensions other than
    pp (`comm`), the pp process group, its pp coordinate and its device."""

    comm: SubmeshComm
    pp_group: object
    pp_coord: int
    device: torch.device


@dataclass(frozen=True)
class ModelFacts:
    """What the pipeline knows of the model it runs: the input placeholders (model
    inputs, then the target), how many are model inputs, the outputs' pytree spec, every
    parameter's whole shape and dtype by name, and the dtype the stage programs compute in
    (mixed precision; None: the parameters' own)."""

    input_names: list[str]
    num_inputs: int
    out_spec: object
    full_meta: dict[str, tuple]
    compute_dtype: torch.dtype | None = None


class PipelineModule:
    """The pipelined model on one rank: `step(*inputs, target)` trains, `__call__` infers."""

    def __init__(self, plan, stages: Stages, store: ParameterStore, rank: PipelineRank,
                 model: ModelFacts):
        """`stages` are the plan's program (the build's) cut into stages; `store` holds this
        rank's shards of the parameters its stages use (see `stage_parameters`)."""
        pipe = plan.pipeline
        self._casts = StepCasts(model.compute_dtype)
        self.plan = plan
        self._pipe = pipe
        self._comm = rank.comm
        self._group = rank.pp_group
        self._p = plan.mesh.shape[pipe.mesh_dim]
        self._coord = rank.pp_coord
        self._sub_shape = rank.comm.shape
        self._input_names = model.input_names  # placeholders: model inputs, then the target
        self._num_inputs = model.num_inputs
        self._out_spec = model.out_spec
        self._device = rank.device
        self._store = store
        num_stages = pipe.num_stages
        self._local = [s for s in range(num_stages) if s % self._p == rank.pp_coord]
        self._last_rank = (num_stages - 1) % self._p
        self._full_meta = model.full_meta
        _, self._owner, self._shared = stage_parameters(stages.train + stages.infer,
                                                        stages.param_names, self._p,
                                                        rank.pp_coord)
        self._by_name = store.leaves
        # Gradients of parameters stored replicated are summed once per step, after the last
        # microbatch (summing after each would add partial sums).
        self._replicated = [
            (k, [p for n, p in self._by_name.items() if p.requires_grad and n not in store.zero
                 and isinstance(plan.parameters[n][k], Replicate)])
            for k in range(len(self._sub_shape)) if self._sub_shape[k] > 1]
        # ZeRO parameters' gradients are reduce-scattered into their shards instead: ZeRO-2's
        # each microbatch, as a bucket of a stage completes in backward, ZeRO-1's once the
        # schedule ends (runtime/zero.py)
        trained = [(store.leaves[n], z) for n, z in store.zero.items()
                   if store.leaves[n].requires_grad]
        self._zero_sync = ZeroSync(trained, rank.comm.groups, store.bucket_bytes) \
            if trained else None

        # Random draws: each stage draws, for every microbatch, what the whole batch draws in
        # it on one device (passes/rules/random.py), from the generator state one device
        # reaches at the stage's first op; every rank moves its generator past the other
        # stages' draws (`_start_draws`), and leaves it where one device's step does. In
        # counter randomness every rank draws the step's key instead, and nothing is replayed.
        self._counter = plan.randomness == "counter"
        self._starts: dict[int, torch.Tensor] | None = None
        self._count: dict[int, int] = {}
        self._end: torch.Tensor | None = None

        self._root = tuple(meta.empty() for meta in stages.roots)
        self._m = pipe.microbatches  # of the schedule running
        self._sink: list = []
        self._trainings: dict = {}
        self._inferences: dict = {}
        self.add_training(None, stages)
        self.add_inference(None, stages)

    def add_training(self, key, stages: Stages) -> None:
        """The training stages of `stages` for `key` (None: the program of the build; else
        the modules' modes and input shapes of another, traced in them and planned on this
        pipeline's stages with its parameters where they are: autopar's solve_pipeline_plan
        `running`). `step(..., key=key)` runs them."""
        train = stages.train
        pipeline_stages, run = self._run(train, stages, True)
        run.seeding = loss_seeding(stages.loss_placement, self._sub_shape)
        run.loss_dtype = train[-1].sent[0].dtype

        def loss_fn(output, weight):  # the schedule hands each microbatch its weight's chunk
            return output * (weight.sum() * run.seeding.seed)

        cls = SCHEDULES[self._pipe.schedule]
        args = pipeline_stages if self._pipe.schedule == "interleaved" else pipeline_stages[0]
        run.schedule = cls(args, run.microbatches, loss_fn=loss_fn, scale_grads=False)
        self._trainings[key] = run

    def add_inference(self, key, stages: Stages) -> None:
        """The inference stages of `stages` for `key`, as `add_training`'s, reading and
        training the same parameters and buffers. `infer(..., key=key)` runs them."""
        infer = stages.infer
        pipeline_stages, run = self._run(infer, stages, False)
        run.sent = infer[-1].sent
        run.schedule = ScheduleInterleaved1F1B(pipeline_stages, run.microbatches) \
            if self._pipe.schedule == "interleaved" \
            else ScheduleGPipe(pipeline_stages[0], run.microbatches)
        self._inferences[key] = run

    def _run(self, programs: list[StageProgram], stages: Stages,
             train: bool) -> tuple[list, _Run]:
        """This rank's `PipelineStage`s of `programs` (`stages`' training or inference
        programs), and the run record their schedule joins (`add_training`,
        `add_inference`)."""
        by_placeholder = {ph: self._by_name[n] for ph, n in stages.param_names.items()
                          if n in self._by_name}
        root = tuple(meta.empty() for meta in stages.roots)
        made = [self._stage(programs[s], by_placeholder, stages.constants, train,
                            len(programs), root) for s in self._local]
        return made, _Run(stages.microbatches, _written(stages.constants, stages.written),
                          list(stages.random_ops), _draws(programs))

    def has(self, key, train: bool) -> bool:
        """Whether training (or inference) stages for `key` were added."""
        return key in (self._trainings if train else self._inferences)

    def draws(self, key, train: bool) -> list[str]:
        """The random ops of the training (or inference) stages for `key`."""
        return (self._trainings if train else self._inferences)[key].random_ops

    def _stage(self, program: StageProgram, params, constants, train: bool,
               num_stages: int, root: tuple) -> PipelineStage:
        last = program.index == num_stages - 1
        sink = self._sink if last and not train else None
        module = _StageModule(program, params, constants, last and train, sink,
                              self._casts, self._before_microbatch)
        inputs = root if program.index == 0 else tuple(m.empty() for m in program.received)
        outputs = tuple(m.empty() for m in program.sent)
        if last and train:
            outputs = outputs[0]
        return PipelineStage(module, program.index, num_stages, self._device,
                             input_args=inputs, output_args=outputs, group=self._group)

    # -- random draws --------------------------------------------------------------------------
    def _start_draws(self, draws: list) -> None:
        """Before a schedule runs (its stages' `draws`, `_Run.draws`): the generator state one
        device has at each of this rank's stages (moving past the draws of the stages before,
        in order) and at the step's end."""
        if self._counter:
            STREAM.begin(self._device, True)
            self._starts, self._count, self._end = {}, {s: 0 for s in self._local}, None
            return
        if not any(draws):
            self._starts = None
            return
        start = generator_state(self._device)
        self._starts, self._count = {}, {s: 0 for s in self._local}
        for s, nodes in enumerate(draws):
            if s in self._count:
                self._starts[s] = generator_state(self._device)
            for node in nodes:
                replay(node, self._device)
        self._end = generator_state(self._device)
        set_generator_state(self._device, start)

    def _before_microbatch(self, stage: int) -> None:
        """Before stage `stage` runs its next microbatch: the generator where one device's
        whole batch is at the stage, and the microbatch's index for its draws' rows."""
        if self._starts is None:
            return
        if self._count[stage] >= self._m:  # each forward once, in order
            raise RuntimeError(f"pipeline stage {stage} ran more forwards than microbatches")
        if stage in self._starts:
            set_generator_state(self._device, self._starts[stage])
        STREAM.at_microbatch(self._count[stage])
        self._count[stage] += 1

    def _end_draws(self) -> None:
        if self._starts is not None and self._end is not None:
            set_generator_state(self._device, self._end)
        self._starts = None
        STREAM.end()
        self._casts.clear()

    # -- running -------------------------------------------------------------------------------
    def check(self, inputs: tuple) -> str | None:
        """Why `inputs` (model inputs, without the target) cannot run through this pipeline,
        or None: it takes as many inputs as it was traced with, of as many dimensions, each
        carrying the batch along dimension 0 (other shapes get stages of their own)."""
        if len(inputs) != self._num_inputs:
            return f"expected {self._num_inputs} model input(s) as traced, got {len(inputs)}"
        for t, meta in zip(inputs, self._root):
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.dim() != meta.dim()):
                return (f"this pipelined model was traced with inputs of shape "
                        f"{tuple(meta.shape)} per microbatch, batched along dimension 0; got "
                        f"an input of shape {tuple(t.shape)}")
        return None

    def step(self, *inputs, weights: list[float], key=None) -> torch.Tensor:
        """Forward and backward of the global batch through the pipeline schedule of the
        training stages for `key` (see `add_training`), each microbatch's loss times its
        weight (`weights`, passes/loss_weights.py: their sum is the whole batch's loss);
        returns that loss (the same on every rank). Gradients of the local shards are
        complete on return."""
        run = self._trainings[key]
        self._m = run.microbatches
        *inputs, target = inputs
        feeds = dict(zip(self._input_names, [*inputs, target]))
        first = tuple(inputs) if 0 in self._local else ()
        losses: list = []
        self._store.refresh()  # ZeRO shards stepped since the last call
        self._store.pull_grads()
        if self._zero_sync is not None:
            self._zero_sync.begin(hold=True)
        self._start_draws(run.draws)
        try:
            run.schedule.step(*first, target=torch.tensor(weights, dtype=run.loss_dtype,
                                                          device=self._device),
                              losses=losses, return_outputs=False, **feeds)
        finally:
            self._end_draws()
        for k, params in self._replicated:
            sum_grads(params, self._comm.groups[k])
        if self._zero_sync is not None:
            self._zero_sync.finish()
        self._sync_shared()
        self._store.push_grads()
        self._sync_buffers(run.written)
        loss = torch.zeros((), dtype=run.loss_dtype, device=self._device)
        if self._coord == self._last_rank:
            # a microbatch of weight 0 (all its targets ignored: its mean is 0 / 0) adds
            # nothing, as in the whole batch's mean (the schedule keeps microbatch order)
            loss = torch.stack([x.detach() for x, w in zip(losses, weights) if w] or
                               [loss]).sum() / run.seeding.seed
            for k in run.seeding.pending_dims:
                dist.all_reduce(loss, group=self._comm.groups[k])
        dist.broadcast(loss, src=dist.get_global_rank(self._group, self._last_rank),
                       group=self._group)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of every gradient of
        every stage (each parameter counted once: by its owning pp rank, and once per set of
        replicas), summed over all ranks; every rank scales its gradients alike. Returns the
        total norm before clipping, the same on every rank."""
        norm_type = float(norm_type)
        inf = norm_type == float("inf")
        acc = torch.zeros((), dtype=torch.float64, device=self._device)
        store = self._store
        # (a ZeRO parameter's gradient is its shard's, split over one more mesh dimension)
        grads = {n: (store.zero[n] if n in store.zero else leaf).grad
                 for n, leaf in self._by_name.items()}
        for name, grad in grads.items():
            if grad is None or self._owner[name] != self._coord:
                continue
            g = grad.detach().double()
            if inf:
                acc = torch.maximum(acc, g.abs().max())
                continue
            copies = math.prod(self._sub_shape[k] for k, p in
                               enumerate(store.user_placements(name)) if isinstance(p, Replicate))
            acc = acc + g.abs().pow(norm_type).sum() / copies
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        total = acc if inf else acc.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads.values():
            if grad is not None:
                grad.mul_(coef.to(grad.dtype))
        return total.float()

    def _sync_shared(self) -> None:
        """Sum the gradients of parameters used on several pp ranks over pp (zeros where a
        rank holds no gradient of one)."""
        if not self._shared:
            return
        # (a ZeRO parameter's gradient is its shard's: the ZeroParam holds it)
        params = [self._store.zero.get(name, self._by_name.get(name)) for name in self._shared]
        shapes = [self._grad_shape(name) for name in self._shared]
        flat = flatten([p.grad if p is not None and p.grad is not None else
                        torch.zeros(shape, device=self._device, dtype=self._full_meta[name][1])
                        for name, p, shape in zip(self._shared, params, shapes)])
        torch_compat.all_reduce(flat, group=self._group)
        write_grads(params, unflatten(flat, shapes))

    def _sync_buffers(self, written: list) -> None:
        """Every pp rank's copy of each buffer written in forward (`written`: (buffer, pp rank
        of the stage that writes it)) takes the value of the pp rank whose stage wrote it (in
        one order on every rank), so that state_dict() and checkpoints hold one device's
        buffers on every rank."""
        for buffer, src in written:
            dist.broadcast(buffer, src=dist.get_global_rank(self._group, src), group=self._group)

    def _local_shape(self, name: str) -> tuple[int, ...]:
        return tuple(local_shape(self._full_meta[name][0], self.plan.parameters[name],
                                 self._sub_shape))

    def _grad_shape(self, name: str) -> tuple[int, ...]:
        """The shape of this rank's gradient of parameter `name`: its block's, or under ZeRO
        its shard's (on every pp rank alike, holding the parameter or not)."""
        shape = list(self._local_shape(name))
        if name in self.plan.zero:
            shard = zero_shard(self._full_meta[name][0], self.plan.parameters[name],
                               self._sub_shape)
            shape[shard.dim] //= self._sub_shape[shard.mesh_dim]
        return tuple(shape)

    def infer(self, *inputs, key=None):
        """Inference on the global batch through the pipeline (no autograd), with the stages
        for `key` (see `add_inference`): returns what the original model returns, whole, on
        every rank (outputs are the microbatches' outputs concatenated along dimension 0)."""
        run = self._inferences[key]
        self._store.refresh()  # ZeRO shards stepped since the last call
        m = self._m = run.microbatches
        feeds = dict(zip(self._input_names, inputs))
        first = tuple(inputs) if 0 in self._local else ()
        self._sink.clear()
        self._start_draws(run.draws)
        try:
            with torch.no_grad():
                run.schedule.step(*first, return_outputs=False, **feeds)
        finally:
            self._end_draws()
        self._sync_buffers(run.written)
        outs = []
        for i, meta in enumerate(run.sent):
            if self._coord == self._last_rank:
                t = torch.cat([mb[i] for mb in self._sink]) if meta.shape else self._sink[0][i]
                t = t.contiguous()
            else:
                shape = (meta.shape[0] * m, *meta.shape[1:]) if meta.shape else ()
                t = torch.empty(shape, dtype=meta.dtype, device=self._device)
            dist.broadcast(t, src=dist.get_global_rank(self._group, self._last_rank),
                           group=self._group)
            outs.append(t)
        self._sink.clear()
        return torch_compat.tree_unflatten(outs, self._out_spec)

    # -- whole tensors, for checking and checkpoints -------------------------------------------
    def _whole(self, name: str, gathered) -> torch.Tensor:
        """The whole tensor on every rank: `gathered()` in the owner's stage (a collective
        over the stage mesh), broadcast over pp."""
        shape, dtype = self._full_meta[name]
        if self._coord == self._owner[name]:
            x = gathered().contiguous()
        else:
            x = torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(x, src=dist.get_global_rank(self._group, self._owner[name]),
                       group=self._group)
        return x

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call on all ranks; a ZeRO
        parameter from its shards, which the optimizer stepped)."""
        return {n: self._whole(n, lambda n=n: self._store.whole(n))
                for n in self.plan.parameters if n in self._owner}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient reassembled whole (a collective: call on all ranks; zeros for a
        parameter without one)."""
        return {n: self._whole(n, lambda n=n: self._store.whole_grad(n))
                for n in self.plan.parameters if n in self._owner}


