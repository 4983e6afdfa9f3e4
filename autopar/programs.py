"""Building a rank's programs: the program a parallelized model runs for a call's mode (train or
eval) and input shapes, found among those built or built for it.

`program_for` checks the call on this rank (device, gradients, hooks, the changes made on the
user's model since the last call) and has every rank agree that all passed, on the same inputs
(autopar/agreements.py), before any collective of the model; then finds the program or builds
it. `build_program` reads as the build's steps, each one call:

1. trace the model's meta copy (`trace_call`) on the whole batch, on every rank;
2. plan (`plan_for`): rank 0 solves (with gradient accumulation when the batch must be cut),
   every rank receives the plan and compares its hash;
3. trace at the plan's microbatch and match the plan to the traced program;
4. at the first build, place the parameters (autopar/placing.py);
5. rewrite the program for this rank (`local_programs`: collectives, microbatch draws,
   recomputed blocks);
6. wrap it in a ParallelModule (runtime/module.py), which runs it.

Also here, for the pipeline's driver too: the modules' modes and the key a program is found by
(`model_key`), and the checks of the changes made on the model since the last call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.passes.batch_local import batch_dims
from autopar.passes.loss_weights import LossWeights, microbatch_weights, of_program
from autopar.passes.recompute_regions import wrap_recomputed
from autopar.passes.rewrite import LocalPrograms, rewrite
from autopar.passes.trace import TracedProgram, TraceError, trace
from autopar.runtime.module import ParallelModule

from .choice import choice_from_plan
from .context import BuildContext
from .inputs import (
    Call,
    batch_of,
    check_device,
    check_no_input_grads,
    global_call,
    microbatch,
    on_meta,
    pieces_of,
)
from .placing import constants, place_parameters, rebound_buffers
from .plan import Plan
from .planner import input_placement, solve_accumulated, strategy_graph


@dataclass
class Built:
    """One program built for a call: its runner, the target it was traced with (None: no
    loss_fn), and the random draws it makes."""

    runner: ParallelModule
    target: tuple | None
    random_ops: list[str]
    loss_weights: LossWeights = LossWeights()

    @property
    def plan(self) -> Plan:
        """The plan the program runs."""
        return self.runner.plan


class Programs:
    """The programs built for one parallelized model on this rank, by key (`model_key`): a
    key holds a training program per target, and an inference one."""

    def __init__(self):
        self.by_key: dict[tuple, list[Built]] = {}

    def find(self, key: tuple, call: Call, step: bool) -> Built | None:
        """The program built for `key` that runs `call` (a training one for its target; an
        inference one traced for the whole batch), or None."""
        target = None if call.target is None else (tuple(call.target.shape), call.target.dtype)
        for built in self.by_key.get(key, []):
            if step and built.runner.trains and built.target == target:
                return built
            if not step and built.plan.accumulation == 1:  # traced for the whole batch
                return built
        return None

    def add(self, key: tuple, built: Built) -> None:
        """Keep `built` for calls of `key`."""
        self.by_key.setdefault(key, []).append(built)

    def plans(self) -> list[Plan]:
        """Every program's plan, in the order built."""
        return [b.plan for bs in self.by_key.values() for b in bs]


# -- the model's modes and changes ----------------------------------------------------------

def module_modes(tree: nn.Module) -> dict[str, bool]:
    """The train / eval flag of every module of `tree` (the parallelized model), by its name
    in the model ("" the model)."""
    return {name: m.training for name, m in tree.named_modules()}


def set_modes(tree: nn.Module, model: nn.Module) -> None:
    """Each module of `model` (the meta copy) in the mode its module in `tree` has, before a
    trace."""
    modes = module_modes(tree)
    for name, m in model.named_modules():
        m.training = modes.get(name, tree.training)


def _modes(tree: nn.Module) -> tuple:
    """The modules' train / eval flags: the model's, and the names of the modules in the
    other mode (usually none)."""
    if all(m.training == tree.training for m in tree.modules()):
        return (tree.training, ())
    return (tree.training, tuple(name for name, m in tree.named_modules()
                                 if m.training != tree.training))


def model_key(ctx: BuildContext, tree: nn.Module, call: Call) -> tuple:
    """What a program for `call` is found by: the modules' modes, the values the traces read
    (as they are now on `tree`) and the inputs' names, shapes and dtypes."""
    return call.key((_modes(tree), ctx.guards.fingerprint(tree)))


def module_hooks(tree: nn.Module) -> str | None:
    """An error message if a hook was registered on one of the parallelized model's modules
    (they hold the parameters under the model's names; the programs never call them)."""
    for name, m in tree.named_modules():
        if name and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or
                     m._backward_pre_hooks):
            return (f"a hook was registered on module {name} of the parallelized model; "
                    "its programs never call the modules, so it would never run. Register "
                    "forward hooks on the model before parallelize (they are traced)")
    return None


def followed(ctx: BuildContext, tree: nn.Module, error: str | None) -> tuple[str | None, list]:
    """Before a call: tensors rebound on the parallelized model put back (their values copied
    into those the programs read) and lifted tensors changed in place copied again. Returns
    (`error`, else the first problem found, else None; the tensors whose values ranks must
    agree on)."""
    rebound = ctx.guards.rebound()
    moved = ctx.guards.refresh()
    return error or rebound or rebound_buffers(ctx, tree, moved), moved


def not_captured(ctx: BuildContext, program: TracedProgram) -> TracedProgram:
    """`program`, or a TraceError when it holds a tensor of the model as a constant (a
    loss function that captured one: autopar/originals.py `captured`)."""
    error = ctx.original.captured(program.constants) if program.has_target else None
    if error:
        raise TraceError(error)
    return program


def weigh_microbatches(weights: LossWeights, parts: list[list[torch.Tensor]],
                       reduction: str | None) -> list[float]:
    """The weight of each microbatch's loss in the whole batch's (passes/loss_weights.py):
    for a loss that averages the targets it counts, each microbatch's count over the
    batch's, counted before the step (the same on every rank: the inputs agree); for a
    loss autopar cannot read, `reduction` (the plan's or the options' loss_reduction),
    never an assumption."""
    m = len(parts)
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


# -- finding or building the program for a call ----------------------------------------------

def program_for(ctx: BuildContext, tree: nn.Module, programs: Programs, call: Call,
                step: bool) -> Built:
    """The program that runs `call` (a training step, or inference) on the parallelized model
    `tree`: found among `programs`, or built (and kept there). Every rank checks the call and
    agrees on its inputs first: a failure anywhere raises on every rank."""
    setting = ctx.setting
    original = ctx.original.follow(tree)  # before the key: it may change modes
    key = model_key(ctx, tree, call)
    built = programs.find(key, call, step)
    error = check_device(call, setting.device) or (check_no_input_grads(call) if step
                                                   else None) or module_hooks(tree) or original
    error, moved = followed(ctx, tree, error)
    if error is None and built is None:
        error = ctx.guards.check(key[0][1])
    if step and not torch.is_grad_enabled():
        error = ("step() runs the backward pass: call it outside torch.no_grad() / "
                 "torch.inference_mode() (use the forward call for inference)")
    if error is None and built is None and programs.by_key and \
            setting.options.on_new_shape == "raise":
        error = (f"the inputs ({call.describe()}) differ from those the plan was made for "
                 "(on_new_shape='raise'); pass inputs of the planned shapes, or "
                 "parallelize with on_new_shape='replan' to plan for each new shape")
    rows = setting.agree.inputs(call, error, "step()" if step else "the forward call", key,
                                moved)
    if built is None:
        built = build_program(ctx, tree, call, step)
        key = model_key(ctx, tree, call)  # with the values this trace found it reads
        ctx.guards.remember(key[0][1])
        programs.add(key, built)
    setting.agree.random_states(built.random_ops, rows)
    ctx.last_plan = built.plan
    return built


def build_program(ctx: BuildContext, tree: nn.Module, call: Call, step: bool) -> Built:
    """Trace, plan, rewrite and (at the first build) place the parameters (see the module
    docstring): a collective every rank enters together (their inputs agreed)."""
    setting = ctx.setting
    agree, options = setting.agree, setting.options
    traces: dict[int, TracedProgram] = {}

    def trace_at(m: int) -> TracedProgram:  # the model on one of m microbatches
        if m not in traces:
            traces[m] = trace_call(ctx, tree, microbatch(call, m), step)
        return traces[m]

    # Every rank traces the model on the whole batch before rank 0 plans, not after it: the
    # ranks trace side by side instead of waiting for rank 0's planning in turn. (The whole
    # batch's trace says whether microbatches add up to it, before one is traced: one may
    # not trace, as under a loss that captures the whole batch's mask.)
    agree.on_every_rank("tracing the model", lambda: trace_at(1))
    plan = plan_for(ctx, trace_at, batch_of(call), accumulate=bool(step))
    program = agree.on_every_rank("tracing the model", lambda: trace_at(plan.accumulation))
    graph, choice = agree.on_every_rank("matching the plan to the model",
                                        lambda: _matched(ctx, program, plan))
    if ctx.store is None:
        place_parameters(ctx, tree, plan)
    programs = local_programs(ctx, program, graph, choice, plan, trace_at)
    runner = ParallelModule(plan, programs, program.params, ctx.store, constants(ctx, program),
                            list(program.inputs), setting.comm, ctx.grad_sync,
                            program.out_spec, setting.compute_dtype,
                            program.inputs[len(call.args)] if program.has_target else None)
    target = (tuple(call.target.shape), call.target.dtype) if program.has_target else None
    return Built(runner, target, program.random_ops,
                 of_program(program, bool(options.per_rank_inputs), options.loss_reduction,
                            trace_at(1)))


def trace_call(ctx: BuildContext, tree: nn.Module, call: Call, with_loss: bool
               ) -> TracedProgram:
    """The meta copy traced at `call`'s inputs (the global batch's, under per-rank inputs) in
    the modes and with the values set on `tree`, with the loss function when `with_loss`;
    what the trace reads joins the guarded values."""
    setting = ctx.setting
    spec, options, loss_fn = setting.spec, setting.options, setting.loss_fn
    model = ctx.meta
    set_modes(tree, model)
    traced_call = on_meta(call)
    if options.per_rank_inputs:
        traced_call = global_call(call, pieces_of(spec.shape, spec.names,
                                                  options.per_rank_inputs))
    use_loss_fn = bool(with_loss) and loss_fn is not None
    ctx.guards.sync(tree, model)
    with ctx.guards.reading(model):
        program = trace(model, traced_call.args, loss_fn if use_loss_fn else None,
                        traced_call.target, kwargs=dict(traced_call.kwargs),
                        output_loss=with_loss if loss_fn is None else False,
                        device=setting.device, compute_dtype=setting.compute_dtype,
                        source=ctx.original.model())
    return not_captured(ctx, program)


def plan_for(ctx: BuildContext, trace_at, batch: int | None, accumulate: bool) -> Plan:
    """The plan for the model traced by `trace_at(microbatches)` (on `batch`): the plan
    passed to parallelize at the first build, else solved on rank 0 (with the parameters
    where they are stored, after the first build; with gradient accumulation when the batch
    must be cut to fit) and broadcast; every rank checks that all hold the same."""
    setting, store = ctx.setting, ctx.store
    agree = setting.agree
    if store is None and setting.given_plan is not None:
        plan = agree.on_every_rank("planning", lambda: setting.given_plan)
    else:
        storage = store.placements if store is not None else None
        zero = store.zero_stages() if store is not None else None
        plan = agree.plan_from_rank0(lambda: solve_accumulated(
            trace_at, batch, setting.spec, setting.options, storage=storage, zero=zero,
            accumulate=accumulate)[0])
    agree.same_plan(plan)
    return plan


def _matched(ctx: BuildContext, program: TracedProgram, plan: Plan) -> tuple:
    """(the program's strategy graph on the mesh, the plan's strategy of each node): the
    graph the planner built from this trace where this rank planned, else built here."""
    graph = strategy_graph(program, ctx.setting.spec, ctx.setting.options)
    return graph, choice_from_plan(plan, graph)


def local_programs(ctx: BuildContext, program: TracedProgram, graph, choice, plan: Plan,
                   trace_at) -> LocalPrograms:
    """`program` rewritten for this rank under `plan` (`choice` its strategy of each node of
    `graph`): its collectives, its inputs' slices under per-rank inputs, the rows of the
    whole batch's draws each microbatch makes, and the blocks the plan recomputes run under
    checkpoint."""
    setting = ctx.setting
    spec, options, comm = setting.spec, setting.options, setting.comm
    per_rank = None
    placement = input_placement(spec, options)
    if placement is not None:
        first = next(iter(graph.nodes[n] for n in program.inputs))
        per_rank = (placement, first.out_shapes[0][0])
    m = plan.accumulation
    dims = setting.agree.on_every_rank(
        "tracing the model", lambda: batch_dims(trace_at(1), m, program)) \
        if m > 1 and program.random_ops else {}
    programs = rewrite(program, graph, choice, setting.coords, comm, per_rank,
                       free_after_forward=frozenset(
                           n for n, name in program.params.items()
                           if name in set(plan.resharded)),
                       bucket_bytes=options.bucket_bytes,
                       microbatches=(m, dims) if dims else None,
                       randomness=plan.randomness or "eager")
    if programs.train is not None:  # the blocks the plan recomputes run under checkpoint
        # (keeping of the parameters freed after forward only what gathers them again)
        wrap_recomputed(programs.train, plan.recompute,
                        (lambda: comm.session) if plan.resharded else None)
    return programs
