"""The pipeline, read as one story: a model planned over a mesh with a "pp" dimension runs as
stages, each on the ranks of one pp coordinate, under a pipeline schedule.

1. Planning (autopar/pipeline_plan.py `solve_pipeline_plan`): the model traced at a microbatch
   (`pipeline_tracer` below), coarsened into layer blocks, cut into stages for the fastest
   schedule (solver/stages.py), each stage planned on the mesh's other dimensions.
2. Cutting (passes/pipeline_split.py `split_stages`): a rank's rewritten program cut into one
   FX program per stage, with what each sends to the next.
3. Building (this module, `Pipeline.build`): every rank traces the model, receives rank 0's
   plan and checks that the model still traces into the plan's layer blocks and that its
   microbatches add up to the batch (`_cut`); rewrites its program for its coordinates on the
   other dimensions and cuts it into stages; places its stages' parameters (autopar/placing.py)
   and hands the stages to the runtime. A call in other modules' modes or at other input
   shapes gets a program of its own (`_add_variant`), planned on the running stages with the
   parameters where they are, whose stages are added when a call needs them (`_add_stages`).
4. Running (runtime/pipeline.py `PipelineModule`): each rank runs its stages under the plan's
   schedule (GPipe, 1F1B, interleaved 1F1B) with torch.distributed.pipelining.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.passes import strategies as strat_pass
from autopar.passes.batch_local import batch_dims
from autopar.passes.graph_queries import source_line, state_writes
from autopar.passes.loss_weights import LossWeights, of_program
from autopar.passes.pipeline_split import ValueMeta, buffer_writes, split_stages
from autopar.passes.recompute_regions import wrap_recomputed
from autopar.passes.rewrite import rewrite
from autopar.passes.trace import TracedProgram, TraceError, trace
from autopar.passes.trace_values import Fingerprint, changed
from autopar.passes.zero import zero_shard
from autopar.runtime.control import agreed
from autopar.runtime.pipeline import (
    ModelFacts,
    PipelineModule,
    PipelineRank,
    Stages,
    SubmeshComm,
    stage_parameters,
)
from autopar.solver.stages import StageError, schedule_problem

from .choice import choice_from_plan
from .context import BuildContext
from .inputs import Call, check_no_input_grads, microbatch, split_call
from .pipeline_plan import microbatch_problem, planned_blocks, solve_pipeline_plan
from .placing import constants, place
from .plan import Plan
from .programs import (
    followed,
    model_key,
    module_hooks,
    module_modes,
    not_captured,
    set_modes,
    weigh_microbatches,
)


@dataclass
class Variant:
    """A pipelined model's program for one set of modules' modes and input shapes: its plan,
    how its microbatches' losses add up, the target (shape, dtype) it was traced with and,
    but for the build's own (whose stages the PipelineModule made), the stages added from it
    (`Pipeline._add_stages`)."""

    plan: Plan
    loss_weights: LossWeights
    target: tuple
    stages: Stages | None = None


@dataclass
class Traced:
    """What the build's program was traced with: the values it read, the modules' modes, the
    example inputs and target (meta tensors), and its ops (another mode tracing to the same
    ops runs the build's stages)."""

    values: Fingerprint
    modes: dict[str, bool]
    example: tuple
    ops: list


@dataclass
class _Cut:
    """A pipelined program cut for this rank: the traced program, its training and inference
    stages, the buffers written in forward (by pp rank), the collectives of the other mesh
    dimensions and where the loss lives."""

    program: TracedProgram
    train: list
    infer: list
    written: dict[str, int]
    comm: SubmeshComm
    loss_placement: object

    def stages(self, ctx: BuildContext, microbatches: int) -> Stages:
        """The stages the runtime runs, with the program's constants (placed buffers and
        lifted constants)."""
        program = self.program
        return Stages(self.train, self.infer, program.params, constants(ctx, program),
                      self.written, program.random_ops, self.loss_placement, _roots(program),
                      microbatches)


@dataclass
class Pipeline:
    """A pipelined model's driver on this rank: `module`, the running PipelineModule (None
    until the build), what the build's program was traced with, the programs of each key
    (the modules' modes and input shapes; None: the build's) and, for each set of modes met,
    whether the build's program runs in them (`_in_modes`)."""

    module: PipelineModule | None = None
    traced: Traced | None = None
    variants: dict = field(default_factory=dict)
    in_modes: dict = field(default_factory=dict)

    def plans(self) -> list[Plan]:
        """Every program's plan, in the order built."""
        return [v.plan for v in self.variants.values()]

    # -- a call ------------------------------------------------------------------------------
    def call(self, ctx: BuildContext, tree: nn.Module, args: tuple, kwargs: dict, step: bool):
        """A training step (returning the loss) or an inference call (returning the model's
        outputs, whole) through the stages; the first call builds them. Every rank checks
        the call and agrees on its inputs first."""
        agree = ctx.setting.agree
        call, error, moved = self._checked(ctx, tree, args, kwargs, step)
        tracer, key = None, None  # the stages to run: the build's (None) or another's
        if error is None and self.module is not None:
            tracer, key, error = self._key(ctx, tree, call, step)
        rows = agree.inputs(call, error, "step()" if step else "the forward call",
                            model_key(ctx, tree, call), moved)
        if self.module is None:
            self.build(ctx, tree, args)
        if key is not None and key not in self.variants:
            self._add_variant(ctx, tree, key, tracer, call)
        plan = ctx.last_plan = self.variants[key].plan
        if not self.module.has(key, step):
            self._add_stages(ctx, key, step)
        agree.random_states(self.module.draws(key, step), rows)
        if not step:
            return self.module.infer(*args, key=key)
        m = plan.pipeline.microbatches
        parts = [microbatch(call, m, i).tensors for i in range(m)]
        weights = weigh_microbatches(self.variants[key].loss_weights, parts,
                                     plan.pipeline.loss_reduction or
                                     ctx.setting.options.loss_reduction)
        return self.module.step(*args, weights=weights, key=key)

    def _checked(self, ctx: BuildContext, tree: nn.Module, args: tuple, kwargs: dict,
                 step: bool) -> tuple[Call, str | None, list]:
        """(the call's inputs, this rank's error, the tensors ranks must agree on): a
        pipelined model takes positional inputs; a step's need no gradient; the model's
        changes since the last call are followed, and the values its program was traced
        with must not have changed."""
        error = None
        if kwargs:
            error = "a pipelined model takes positional inputs only"
        elif self.module is None and not step:
            error = ("a pipelined model is planned for training: call step() first (or pass "
                     "example_inputs= with the target to parallelize)")
        call = Call((), (), None)
        if error is None:
            try:
                call = split_call(args, {}, with_target=step)
            except TraceError as e:
                error = str(e)
        if error is None and step:
            error = check_no_input_grads(call) or module_hooks(tree)
        if error is None and self.module is not None:
            error = self.module.check(call.args)
        original = ctx.original.follow(tree)
        error, moved = followed(ctx, tree, error or original)
        if error is None and self.module is not None:
            lines = changed(self.traced.values, ctx.guards.fingerprint(tree))
            if lines:
                error = ("values the pipelined program was traced with changed (" +
                         "; ".join(lines[:4]) + "); a pipelined model is traced once: set "
                         "them before its first step, or hold a value that changes in a "
                         "tensor (a buffer of the model, or a tensor the loss function "
                         "captures, changed in place)")
        return call, error, moved

    def _key(self, ctx: BuildContext, tree: nn.Module, call: Call, step: bool) -> tuple:
        """(tracer, key, error) of the program that runs `call`: key None (the build's) at
        the build's input shapes in modes its program runs in; else the modules' modes and
        the input shapes, with the tracer in other modes when the build's shapes are traced
        in them; an error when no program can run the call."""
        example = self.traced.example
        shapes = tuple(tuple(t.shape) for t in call.args if isinstance(t, torch.Tensor))
        planned = tuple(tuple(t.shape) for t in example[:-1])
        modes = tuple(sorted(module_modes(tree).items()))
        tracer, key, error = None, (modes, shapes), None
        if shapes == planned:
            tracer, error = self._in_modes(ctx, tree)  # None: the build's program runs
            key = key if tracer is not None else None
        elif key not in self.variants:
            if ctx.setting.options.on_new_shape == "raise":
                error = (f"inputs of shapes {list(shapes)} differ from the "
                         f"{list(planned)} this pipeline was planned for (on_new_shape="
                         "'raise'); pass inputs of the planned shapes, or parallelize "
                         "with on_new_shape='replan'")
            elif _target_like(call, example) is None:
                error = ("this pipelined model infers at new input shapes after a step "
                         "at them: its program is traced with the loss, whose target's "
                         "shape at these inputs cannot be told from the build's")
        traced = self.variants[key].target if key in self.variants else None
        if error is None and step and traced is not None and \
                (tuple(call.target.shape), call.target.dtype) != traced:
            error = (f"the target ({tuple(call.target.shape)} {call.target.dtype}) differs "
                     f"from the {traced[0]} {traced[1]} this pipelined model's program at "
                     "these inputs was traced with; a pipeline keeps one target shape per "
                     "input shapes")
        return tracer, key, error

    def _in_modes(self, ctx: BuildContext, tree: nn.Module) -> tuple:
        """(tracer, error) for the modules' modes now: (None, None) when they are those the
        pipelined program was traced in, or when the model traces to the same program in them
        (a model without dropout or BatchNorm); else the model's pipeline_tracer in them, for
        the stages of these modes, or why the model does not trace in them. Found once for
        each set of modes."""
        now = module_modes(tree)
        key = tuple(sorted(now.items()))
        if key not in self.in_modes:
            self.in_modes[key] = self._modes_problem(ctx, tree, self.traced.modes, now)
        return self.in_modes[key]

    def _modes_problem(self, ctx: BuildContext, tree: nn.Module, then: dict[str, bool],
                       now: dict[str, bool]) -> tuple:
        """`_in_modes` for modes it has not met: the meta copy traced in `now`, compared op
        by op with the pipelined program (traced in `then`)."""
        setting, model = ctx.setting, ctx.meta
        m = self.module.plan.pipeline.microbatches
        try:
            set_modes(tree, model)
            ctx.guards.sync(tree, model)
            tracer = pipeline_tracer(model, self.traced.example, setting.loss_fn,
                                     setting.device, setting.compute_dtype,
                                     ctx.original.model())
            return (None if _ops_of(tracer(m)) == self.traced.ops else tracer), None
        except Exception as e:  # noqa: BLE001 - reported on every rank as the reason
            return None, (
                f"the modules' train / eval modes changed since this pipelined model was "
                f"traced ({_modes_changed(then, now)}) and the model does not trace in them "
                f"({type(e).__name__}: {e}). Set the modes before parallelize (model.train() "
                "or model.eval(), and a submodule's own)")

    # -- the build ---------------------------------------------------------------------------
    def build(self, ctx: BuildContext, tree: nn.Module, example_inputs) -> None:
        """Build the stages for these inputs (and target): plan (rank 0 solves unless a plan
        was passed; every rank compares its hash), cut this rank's program into stages, place
        their parameters and hand them to a PipelineModule."""
        setting = ctx.setting
        if setting.loss_fn is None:
            raise agreed(ValueError("a pipelined model trains through step(): pass loss_fn= to "
                                    "parallelize (pipelined inference alone is not supported)"))
        example_inputs = tuple(example_inputs)
        set_modes(tree, ctx.meta)  # traced in the modes set on the model now
        ctx.guards.sync(tree, ctx.meta)
        with ctx.guards.reading(ctx.meta):
            tracer = pipeline_tracer(ctx.meta, example_inputs, setting.loss_fn, setting.device,
                                     setting.compute_dtype, ctx.original.model())
            plan = self._plan(ctx, tracer, example_inputs)
            cut = _cut(ctx, tracer, plan)
            self._place_stages(ctx, tree, plan, cut)
            target = example_inputs[-1]
            self.variants[None] = Variant(plan, of_program(cut.program, whole=tracer(1)),
                                          (tuple(target.shape), target.dtype))
            ctx.last_plan = plan
        modes = module_modes(tree)
        self.traced = Traced(ctx.guards.fingerprint(tree),  # with what the trace read
                             modes,
                             tuple(torch.empty_like(t, device="meta") for t in example_inputs),
                             _ops_of(cut.program))
        self.in_modes = {tuple(sorted(modes.items())): (None, None)}

    @staticmethod
    def _plan(ctx: BuildContext, tracer, example_inputs: tuple) -> Plan:
        """The plan passed to parallelize, or rank 0's; every rank compares its hash."""
        setting = ctx.setting
        plan = setting.given_plan
        if plan is None:
            plan = setting.agree.plan_from_rank0(lambda: solve_pipeline_plan(
                tracer, batch_size(example_inputs), setting.spec, setting.options))
        setting.agree.same_plan(plan)
        return plan

    def _place_stages(self, ctx: BuildContext, tree: nn.Module, plan: Plan,
                      cut: _Cut) -> None:
        """Place the parameters this rank's stages use, stored as `plan` says on the mesh's
        other dimensions, and start the PipelineModule running the stages."""
        setting = ctx.setting
        mesh, coords, pipe = setting.mesh, setting.coords, plan.pipeline
        pp, dims = pipe.mesh_dim, pipe.stage_dims(mesh.ndim)
        mine, _, _ = stage_parameters(cut.train + cut.infer, cut.program.params,
                                      mesh.shape[pp], coords[pp])
        submesh = mesh[tuple(mesh.mesh_dim_names[k] for k in dims)] if dims else None
        full_meta = {n: (tuple(t.shape), t.dtype) for n, t in ctx.source.named_parameters()}
        sub_shape = setting.spec.without(pp).shape
        placements = {n: tuple(plan.parameters[n]) for n in mine}
        # ZeRO: the optimizer steps this rank's shard over the stage mesh (runtime/zero.py)
        zero = {n: (plan.zero[n], zero_shard(full_meta[n][0], placements[n], sub_shape))
                for n in mine if n in plan.zero}
        place(ctx, tree, placements, submesh, sub_shape, pipe.stage_coords(coords), zero)
        program = cut.program
        self.module = PipelineModule(
            plan, cut.stages(ctx, pipe.microbatches), ctx.store,
            PipelineRank(cut.comm, mesh.get_group(pp), coords[pp], setting.device),
            ModelFacts(list(program.inputs), len(program.inputs) - 1, program.out_spec,
                       full_meta, setting.compute_dtype))

    # -- other modes and input shapes --------------------------------------------------------
    def _add_variant(self, ctx: BuildContext, tree: nn.Module, key: tuple, tracer,
                     call: Call) -> None:
        """The program for `key`, the modules' modes and the input shapes of `call` (the model
        traced in them by `tracer`, or here at the call's inputs and target: `_target_like`
        for an inference call), planned on the running pipeline's stages and schedule with the
        parameters where they are stored (solve_pipeline_plan's `running`), over as many
        microbatches as the build's or the most under that the batch splits into (and the
        schedule runs), rewritten and cut as the pipeline's own. Its training and inference
        stages are added when a call needs them (`_add_stages`)."""
        setting = ctx.setting
        running = self.module.plan
        set_modes(tree, ctx.meta)  # the tracer traces the meta copy in these modes
        ctx.guards.sync(tree, ctx.meta)
        batch = batch_size(call.args)
        example = self.traced.example
        target = example[-1]  # (the build's inputs: a tracer in other modes)
        if tracer is None:
            target = _target_like(call, example)
            inputs = (*[torch.empty_like(t, device="meta") for t in call.args], target)
            tracer = pipeline_tracer(ctx.meta, inputs, setting.loss_fn, setting.device,
                                     setting.compute_dtype, ctx.original.model())
        options = dataclasses.replace(setting.options, microbatches=_microbatches(
            running, setting.spec.shape[running.pipeline.mesh_dim], batch))
        plan = setting.agree.plan_from_rank0(lambda: solve_pipeline_plan(
            tracer, batch, setting.spec, options, running=running))
        setting.agree.same_plan(plan)
        cut = _cut(ctx, tracer, plan)
        self.variants[key] = Variant(plan, of_program(cut.program, whole=tracer(1)),
                                     (tuple(target.shape), target.dtype),
                                     cut.stages(ctx, plan.pipeline.microbatches))

    def _add_stages(self, ctx: BuildContext, key: tuple, train: bool) -> None:
        """The training (or inference) stages of `key`'s program (`_add_variant`), added to
        the pipeline; an error on every rank when the pipeline's schedule cannot train on so
        few microbatches."""
        v = self.variants[key]
        pipe = v.plan.pipeline
        # (inference runs GPipe, which takes any count, but for interleaved stages)
        why = schedule_problem(pipe.schedule, ctx.setting.spec.shape[pipe.mesh_dim],
                               pipe.microbatches, pipe.virtual_stages) \
            if train or pipe.schedule == "interleaved" else None
        if why:
            raise agreed(ValueError(
                f"this pipeline {'trains' if train else 'infers'} with its {pipe.schedule} "
                f"schedule, and a batch of {pipe.batch_size} splits into no microbatch count "
                f"it runs ({why}): pass larger batches"
                + (" (inference takes any)" if pipe.schedule != "interleaved" else "")))
        if train:
            self.module.add_training(key, v.stages)
        else:
            self.module.add_inference(key, v.stages)


def _microbatches(running: Plan, p: int, batch: int) -> int:
    """The microbatches of a program planned on the running pipeline (of `p` pp ranks) for
    `batch`: as many as its own, or the most under that the batch splits into, preferring
    those its schedule runs."""
    pipe = running.pipeline
    splits = [d for d in range(min(pipe.microbatches, batch), 0, -1) if batch % d == 0]
    runs = [d for d in splits
            if not schedule_problem(pipe.schedule, p, d, pipe.virtual_stages)]
    return (runs or splits)[0]


def _cut(ctx: BuildContext, tracer, plan: Plan) -> _Cut:
    """The model traced by `tracer` (pipeline_tracer), matched to the pipelined `plan`,
    rewritten for this rank and cut into its stages."""
    setting = ctx.setting
    agree, mesh, pipe = setting.agree, setting.mesh, plan.pipeline
    program, graph, choice, blocks = agree.on_every_rank(
        "matching the plan to the model", lambda: _matched(ctx, tracer, plan))
    pp = pipe.mesh_dim
    stage_of = blocks.stage_of(pipe.cuts, pipe.num_stages)
    dims = pipe.stage_dims(mesh.ndim)
    comm = SubmeshComm([mesh.get_group(k) for k in dims] or [None],
                       setting.spec.without(pp).shape)
    m = pipe.microbatches
    batch_of_draws = {}
    if program.random_ops:  # each microbatch draws the whole batch's numbers (any m:
        # SDPA's dropout then runs as autopar's math kernel, whose draws a rank replays)
        batch = pipe.batch_size
        k = m if m > 1 else next((d for d in range(2, batch + 1) if batch % d == 0), 1)
        batch_of_draws = agree.on_every_rank("tracing the model",
                                             lambda: batch_dims(tracer(1), k, program))
    programs = rewrite(program, graph, choice, pipe.stage_coords(setting.coords), comm,
                       bucket_bytes=setting.options.bucket_bytes, stage_of=stage_of,
                       microbatches=(m, batch_of_draws) if batch_of_draws else None,
                       randomness=plan.randomness or "eager")
    kinds = {name: v.kind for name, v in graph.nodes.items()}
    train = split_stages(programs.train, graph, stage_of, kinds, pipe.num_stages)
    for stage in train:  # each stage runs the blocks the plan recomputes under checkpoint
        wrap_recomputed(stage.module, plan.recompute)
    infer = split_stages(programs.infer, graph, stage_of, kinds, pipe.num_stages)
    written = agree.on_every_rank("matching the plan to the model", lambda: written_buffers(
        program, train + infer, mesh.shape[pp]))
    return _Cut(program, train, infer, written, comm, programs.loss_placement)


def _matched(ctx: BuildContext, tracer, plan: Plan) -> tuple:
    """(program, strategy graph, the plan's strategy of each node, layer blocks) of the model
    traced at the plan's microbatch, checked against the plan: pipelined, the same layer
    blocks, microbatches that add up to the batch."""
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("the mesh has a pp dimension but the plan is not pipelined; "
                         "re-plan with autopar.plan on this mesh")
    program = not_captured(ctx, tracer(pipe.microbatches))
    graph = strat_pass.build(program, ctx.setting.spec.without(pipe.mesh_dim).shape, zero=True)
    choice = choice_from_plan(plan, graph)
    why = microbatch_problem(tracer, pipe.microbatches, pipe.loss_reduction)
    if why:
        raise ValueError(f"a pipeline runs the batch as {pipe.microbatches} "
                         "microbatches, which would not compute what the whole batch "
                         f"does: {why}. Plan it without a pp mesh dimension")
    blocks = planned_blocks(program, graph, pipe.blocks, "than the plan's",
                            "; re-plan with autopar.plan")
    return program, graph, choice, blocks


# -- tracing a pipelined model ------------------------------------------------------------------

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
