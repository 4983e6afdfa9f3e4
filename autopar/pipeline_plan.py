"""Pipelined plans: the first chapter of the pipeline, planning a model over a mesh with a "pp"
dimension.

`solve_pipeline_plan` reads as its steps: trace the model at a microbatch, check that
microbatches add up to the whole batch (`microbatch_problem`), coarsen the graph into layer
blocks (`planned_blocks`), price every block on the stage mesh (the mesh's dimensions but pp:
autopar/plan.py `stage_dims`) and cut the chain of blocks into stages for the fastest schedule
(solver/stages.py), solve each stage's intra-op ILP with its inputs where the stage before
produced them (solver/stage_pricing.py; freely, and under each style per stage mesh dimension,
the fastest step kept: `_solve_stages`), and describe and price the result (a Plan with its
PipelinePlan). All of it once per recomputation mode tried (`_recomputing`).

The story goes on in:
- cutting: passes/pipeline_split.py `split_stages`, a rank's rewritten program cut into one
  FX program per stage;
- building: autopar/pipeline.py, a rank's stages built from the plan (it checks the model
  against the plan with this module's `check_microbatches` and `planned_blocks`);
- running: runtime/pipeline.py, the stages run under the plan's schedule.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass

from autopar.passes import strategies as strat_pass
from autopar.passes.batch_local import split_problem
from autopar.passes.pipeline_split import LayerBlocks, layer_blocks
from autopar.passes.recompute import MODES, recompute_plan
from autopar.passes.strategies import OP, PARAM, Strategy, StrategyGraph
from autopar.passes.styles import STYLES, allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver.assignments import random_choice
from autopar.solver.cost import CostModel
from autopar.solver.ilp import NoFeasiblePlan, Outpaced
from autopar.solver.stage_pricing import (
    activation_scaled,
    price,
    price_blocks,
    price_pipeline,
    solve_subgraph,
    stage_budget,
    subgraph,
    without_zero,
)
from autopar.solver.stages import (
    StageError,
    StageSolution,
    bubble_fraction,
    candidate_floor,
    choose,
    divisors,
    in_flight,
    schedule_candidates,
    step_time,
)

from .choice import kept_storage
from .collector import planning
from .costing import cost_model, eager_could_fit, measured, profiler
from .describe import describe
from .force import stage_styles
from .mesh import MeshSpec
from .options import PlanOptions
from .plan import Collective, PipelinePlan, Plan, PlanCost, stage_dims

# -- the checks the planner and the build share ---------------------------------------------------

def microbatch_problem(trace_at, microbatches: int, loss_reduction: str | None) -> str:
    """Why a pipeline schedule running the batch as `microbatches` microbatches would not
    compute what the whole batch does, or "" (passes/batch_local.py `split_problem` of the
    model traced at the whole batch, `trace_at(1)`)."""
    return split_problem(trace_at(1), microbatches, loss_reduction=loss_reduction)


def check_microbatches(trace_at, microbatches: int, loss_reduction: str | None) -> None:
    """ValueError saying what to change when the batch run as `microbatches` microbatches
    would not compute what the whole batch does (`microbatch_problem`)."""
    why = microbatch_problem(trace_at, microbatches, loss_reduction)
    if why:
        raise ValueError(f"microbatches={microbatches}: a pipeline schedule would not compute "
                         f"what the whole batch does: {why}. Pass microbatches=1, or plan "
                         "without a pp mesh dimension")


def planned_blocks(program: TracedProgram, graph: StrategyGraph,
                   planned: list[str] | None = None, where: str = "", advice: str = ""
                   ) -> LayerBlocks:
    """The layer blocks of `program` (`graph` its strategy graph; passes/pipeline_split.py
    `layer_blocks`), and with `planned` (a plan's blocks, or a trace's before) a ValueError
    when they differ, saying `where` the model traced otherwise and `advice`."""
    blocks = layer_blocks(program, graph)
    if planned is not None and blocks.names != planned:
        raise ValueError(f"the model traces into other layer blocks {where} "
                         f"({blocks.names} vs {planned}){advice}")
    return blocks


# -- planning ---------------------------------------------------------------------------------

@dataclass
class _Setting:
    """What every step of `solve_pipeline_plan` reads: the mesh, its pp dimension and size,
    the stage mesh, the options, the ILP backend, the memory budget per device, the pp link,
    the forced styles on the stage mesh, the op profiler (None: roofline times) and the
    recomputation mode of every stage's layer blocks."""

    mesh: MeshSpec
    pp: int
    p: int
    sub: MeshSpec
    options: PlanOptions
    backend: str
    budget: float
    link: object
    styles: dict[int, str]
    profile: object
    recompute: str


@dataclass
class _Cut:
    """The model cut into stages: the program traced at the microbatch, its strategy graph
    and cost model (over the step's microbatches), its layer blocks and the stage solution."""

    program: TracedProgram
    graph: StrategyGraph
    cost: CostModel
    blocks: LayerBlocks
    best: StageSolution


@planning
def solve_pipeline_plan(trace_at, batch: int, mesh: MeshSpec,
                        options: PlanOptions | None = None, running: Plan | None = None,
                        beat: float | None = None) -> Plan:
    """Plan a model over a mesh with a "pp" dimension: cut it into pipeline stages
    (solver/stages.py), then solve each stage's intra-op ILP on the other dimensions, identical
    stages once, each stage's inputs fixed to the placements the previous stage produces.

    `trace_at(m)` returns the model traced at the microbatch size `batch // m`. Without
    `options.microbatches` the model is first traced at the whole batch to choose it.

    With `running`, the plan of a pipelined model already running, the model (traced in other
    modules' modes, eval between training steps, or at another batch size) is planned on
    `running`'s stages and schedule, over `options.microbatches` (else `running`'s), its
    parameters stored where `running` stores them.

    With `beat` (seconds: a mesh search's fastest plan on another mesh), Outpaced when not
    even the relaxed pipeline (`relaxed_step`) steps faster, before any stage is solved.
    """
    options = options or PlanOptions()
    if beat is not None and running is None:
        floor = relaxed_step(trace_at, batch, mesh, options)
        if floor >= beat:
            raise Outpaced.by_relaxed_pipeline(floor, beat)
    plan, graph = _recomputing(trace_at, batch, mesh, options, running)
    if options.randomness != "auto" or running is not None or \
            not eager_could_fit(plan, graph, mesh, options):
        return plan
    try:  # the faster of counter and eager draws (autopar/planner.py solve_accumulated)
        eager, _ = _recomputing(trace_at, batch, mesh,
                                dataclasses.replace(options, randomness="eager"), None)
    except (NoFeasiblePlan, StageError):
        return plan
    return eager if eager.cost.step_time < plan.cost.step_time else plan


def _recomputing(trace_at, batch: int, mesh: MeshSpec, options: PlanOptions,
                 running: Plan | None) -> tuple[Plan, StrategyGraph]:
    """`_solve_pipeline_plan` in the recomputation `options.recompute` asks (a running
    pipeline's: `running`'s), or, when it asks none, the fastest of none, selective and full
    recomputation of every stage's layer blocks (passes/recompute.py), tried in that order
    while no plan fits or memory binds the one found (a peak above BINDING of the budget), as
    the non-pipelined planner's memory search does."""
    if running is not None:
        modes = [running.recompute.mode if running.recompute is not None else "none"]
    else:
        modes = [options.recompute] if options.recompute is not None else list(MODES)
    found, error = None, None
    for mode in modes:
        try:
            plan, graph = _solve_pipeline_plan(trace_at, batch, mesh, options, running, mode)
        except (NoFeasiblePlan, StageError) as e:
            error = e
            continue
        if found is None or plan.cost.step_time < found[0].cost.step_time:
            found = (plan, graph)
        if plan.cost.peak_memory < BINDING * plan.cost.memory_budget:
            break  # memory does not bind: recomputing more would only cost time
    if found is None:
        raise error
    return found


# A plan whose peak is within this share of the budget is held back by memory: recomputation
# (which frees activations) may let the solver choose faster placements, so it is tried too
# (here and in autopar/planner.py's memory search).
BINDING = 0.9


def _solve_pipeline_plan(trace_at, batch: int, mesh: MeshSpec, options: PlanOptions,
                         running: Plan | None, recompute: str = "none"
                         ) -> tuple[Plan, StrategyGraph]:
    """`solve_pipeline_plan` in the randomness `options` say, recomputing every stage's
    layer blocks in mode `recompute`; the plan and the graph of one microbatch."""
    refuse_options(options)
    kept = running.pipeline if running is not None else None
    microbatches = options.microbatches
    if kept is not None:
        microbatches = microbatches or kept.microbatches
    at = _setting(mesh, options, batch, microbatches, recompute)
    start = time.perf_counter()
    program = trace_at(microbatches or 1)
    if not program.has_loss:
        raise ValueError("a pipelined plan trains through step(); pass loss_fn= (pipelined "
                         "inference alone is not supported)")
    # A schedule runs the batch as microbatches: only where they add up to the whole batch.
    if microbatches is not None:
        if batch > 1 and microbatches != 1:
            check_microbatches(trace_at, microbatches, options.loss_reduction)
    elif batch > 1 and microbatch_problem(trace_at, 2, options.loss_reduction):
        microbatches = 1
    cut = _cut(trace_at, program, batch, microbatches, at, kept)
    stages, choice, draw = _solve_stages(cut, at, running)
    plan = _pipelined(cut, stages, choice, at, batch)
    return dataclasses.replace(plan, solve_time=time.perf_counter() - start,
                               solver="random" if draw else options.solver.upper()), cut.graph


def refuse_options(options: PlanOptions) -> None:
    """ValueError for the options a pipelined plan does not support yet."""
    if options.per_rank_inputs:
        raise ValueError("per-rank inputs are not supported with a pp mesh dimension yet: pass "
                         "the global batch on every rank")


def _setting(mesh: MeshSpec, options: PlanOptions, batch: int, microbatches: int | None,
             recompute: str) -> _Setting:
    """The setting of a pipelined plan; StageError for a microbatch count that does not
    divide the batch, ValueError for a bad `force` (both before any work)."""
    pp = mesh.pipeline_dim
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise StageError(
            f"the batch of {batch} does not split into {microbatches} microbatches; choose a "
            "divisor of the batch (" + ", ".join(map(str, divisors(batch, batch))) + ")")
    budget = options.memory_budget if options.memory_budget is not None else \
        mesh.profile.memory_budget
    return _Setting(mesh, pp, mesh.shape[pp], mesh.without(pp), options,
                    "HIGHS" if options.solver == "random" else options.solver, budget,
                    mesh.link(pp), stage_styles(mesh, pp, options.force),
                    profiler(options.profile), recompute)


def _stage_cost(at: _Setting, program: TracedProgram, graph: StrategyGraph,
                microbatches: int) -> CostModel:
    """The cost model of `graph` (of `program`, traced at one of `microbatches`) on the
    stage mesh, its layer blocks recomputed as `at` says."""
    # a stage's program gathers its FSDP parameters in buckets of its own, prefetched within
    # the stage (passes/rewrite.py `stage_of`): priced beside compute, as without stages
    cost = cost_model(at.sub, graph, at.options, microbatches=microbatches)
    # (each parameter is cast to the compute dtype once a step: runtime/pipeline.py StepCasts)
    cost = cost.copy(cast_once=True, recompute=recompute_plan(
        program, graph, at.recompute,
        keep_user=at.options.recompute != "none"))
    return measured(cost, graph, at.profile)


def relaxed_step(trace_at, batch: int, mesh: MeshSpec, options: PlanOptions) -> float:
    """Seconds under which no pipelined plan of the model on `mesh` steps: the least, over
    the schedules the stage cut may choose (solver/stages.py `choose`), of their floor
    (`candidate_floor`: whole layer blocks balanced as well as they can be, sends free),
    over layer blocks each priced at its fastest intra-op plan (no recomputation, no memory
    budget: what makes a plan fit only costs time), at the batch traced whole and scaled to
    each microbatch (a smaller one is no more efficient). Each block is solved alone, its
    inputs where it likes them; the stages' ILPs keep the placements the stage before
    produces, which can only cost more."""
    refuse_options(options)  # (a pipeline that cannot run is not bounded: it says why)
    m0 = options.microbatches or 1
    at = _setting(mesh, options, batch, options.microbatches, "none")
    priced = _priced_blocks(trace_at(m0), at, m0)[3]
    return min(candidate_floor(priced, at.p, batch, batch // m0, c)
               for c in schedule_candidates(priced, at.p, batch, options.microbatches,
                                            options.schedule, options.virtual_stages,
                                            split_by=at.sub.shape))


def _priced_blocks(program: TracedProgram, at: _Setting, m0: int) -> tuple:
    """(strategy graph, cost model, layer blocks, the blocks priced for the stage cut) of
    `program`, traced at one of `m0` microbatches, on the stage mesh."""
    graph = strat_pass.build(program, at.sub.shape, zero=True)
    cost = _stage_cost(at, program, graph, m0)
    blocks = planned_blocks(program, graph)
    priced = price_blocks(graph, cost, blocks.of_node, blocks.names, at.link,
                          backend=at.backend, time_limit=at.options.time_limit)
    return graph, cost, blocks, priced


def _cut(trace_at, program: TracedProgram, batch: int, microbatches: int | None,
         at: _Setting, kept: PipelinePlan | None) -> _Cut:
    """Price the layer blocks of `program` (traced at `microbatches`, or the whole batch)
    and cut them into stages for the fastest schedule, or as the running pipeline `kept`
    does; traced again at the microbatch count chosen."""
    m0 = microbatches or 1
    if kept is not None:
        graph = strat_pass.build(program, at.sub.shape, zero=True)
        cost = _stage_cost(at, program, graph, m0)
        blocks = planned_blocks(program, graph, kept.blocks, "in these modes")
        best = StageSolution(kept.schedule, microbatches, kept.virtual_stages,
                             list(kept.cuts), 0.0, [], [], [])
    else:
        graph, cost, blocks, priced = _priced_blocks(program, at, m0)
        options = at.options
        best = choose(priced, at.p, batch, batch // m0, at.budget, microbatches=microbatches,
                      schedule=options.schedule, virtual_stages=options.virtual_stages,
                      overlap=cost.overlap, split_by=at.sub.shape)
    if best.microbatches != m0:
        program = trace_at(best.microbatches)
        graph = strat_pass.build(program, at.sub.shape, zero=True)
        cost = _stage_cost(at, program, graph, best.microbatches)
        blocks = planned_blocks(program, graph, blocks.names, "at the microbatch size")
    # every microbatch draws the whole batch's random numbers (solver/stages.py), and adds
    # its gradients to those of the microbatches before it
    return _Cut(program, graph, cost.copy(accumulation=best.microbatches), blocks, best)


def _solve_stages(cut: _Cut, at: _Setting, running: Plan | None) -> tuple[list, dict, object]:
    """Intra-op per stage, in order: a stage's inputs keep the placements they were produced
    in. Returns each stage's (subgraph, strategies), every node's strategy and the random
    draw that replaced the ILP (None: solved).

    Each stage's ILP prices its own stage, where the step is a schedule's sums and maxima
    over all of them (solver/stages.py `step_time`: the busiest rank, the slowest stage, the
    longest gradient synchronization), so stages solved one by one can miss a plan the step
    prices faster. Without `force`, the plans forced to each style per stage mesh dimension
    (data, fsdp, zero1, zero2, tensor: what `force=` would give on this cut) are solved
    too, each given up once the stages solved so far cannot beat the plan found
    (`_StageSolve.in_order`), and the fastest step wins: the free plan is never slower than
    a forced one by the planner's own prices."""
    stage_of = cut.blocks.stage_of(cut.best.cuts, at.p * cut.best.virtual_stages)
    ctx = _StageSolve(cut, at, running, stage_of)
    # free: ZeRO only where forced (each stage's ILP would price ZeRO's synchronization per
    # stage, where the step counts the longest rank's; the portfolio below tries it)
    best = ctx.styled(at.styles, zero=bool(at.styles) or running is not None)
    if at.styles or running is not None or ctx.draw is not None:
        return best
    dims = [k for k, n in enumerate(at.sub.shape) if n > 1]
    combos = [dict(zip(dims, c)) for c in itertools.product(PIPELINED_STYLES, repeat=len(dims))]
    return ctx.fastest([lambda beat: best] + [lambda beat, styles=styles: ctx.styled(styles, beat)
                                              for styles in combos])


class _Outpaced(Exception):
    """Stages solved under some styles that cannot step faster than a plan found."""


# The styles `force=` may give a stage mesh dimension, which the free pipelined plan is never
# slower than.
PIPELINED_STYLES = tuple(s for s in STYLES if s != "auto")


def _shared_parameters(graph: StrategyGraph, stage_of: dict[str, int]) -> set[str]:
    """The parameters ops of more than one stage read."""
    stages: dict[str, set[int]] = {}
    for v in graph.nodes.values():
        if v.name in stage_of:
            for u, _ in v.inputs:
                if graph.nodes[u].kind == PARAM:
                    stages.setdefault(u, set()).add(stage_of[v.name])
    return {u for u, ss in stages.items() if len(ss) > 1}


class _StageSolve:
    """The stages' intra-op ILPs of one cut (`_solve_stages`), identical stages solved once."""

    def __init__(self, cut: _Cut, at: _Setting, running: Plan | None, stage_of: dict):
        self.cut, self.at, self.running, self.stage_of = cut, at, running, stage_of
        best, options = cut.best, at.options
        self.worst = max(in_flight(best.schedule, at.p, best.microbatches,
                                   best.virtual_stages, r) for r in range(at.p))
        self.scaled = activation_scaled(cut.cost, self.worst)
        rng = random.Random(options.seed)
        self.draw = (lambda g: random_choice(g, cut.cost, rng)) \
            if options.solver == "random" else None
        self.cache: dict = {}

    def styled(self, styles: dict[int, str], beat: float = float("inf"), zero: bool = True
               ) -> tuple[list, dict, object]:
        """Every stage solved in order under `styles` (stage mesh dimension: style);
        _Outpaced once no such plan can step faster than `beat` seconds.

        A parameter several stages use (a tied embedding: the first stage's lookup, the last
        one's head) is stored one way for all of them. Solving in order lets the first stage
        choose it, though a later one may pay far more for that choice (the head gathering
        an embedding sharded for the lookup, every microbatch); so each stage using shared
        parameters is also solved first and its storage of them kept by the others, and the
        pipeline priced fastest wins."""
        graph, stage_of = self.cut.graph, self.stage_of
        if styles:
            self.check_parameters(styles)
        shared = _shared_parameters(graph, stage_of)
        users = sorted({stage_of[v.name] for v in graph.nodes.values() if v.name in stage_of
                        and any(u in shared for u, _ in v.inputs)})
        if self.running is not None or self.draw is not None:
            users = users[:1]

        def first(s: int, to_beat: float):  # stage s's storage of the shared parameters
            picked = self.stage(s, {}, styles, zero)[1]
            return self.in_order({n: picked[n] for n in shared if n in picked}, styles,
                                 to_beat, zero)

        # (the first stage using them chooses in order)
        return self.fastest([lambda b: self.in_order({}, styles, b, zero)] +
                            [lambda b, s=s: first(s, b) for s in users[1:]], beat)

    def fastest(self, attempts, beat: float = float("inf")) -> tuple:
        """The fastest step of what each of `attempts` returns (stages solved), each called
        with the step to beat (`beat`, then the fastest found); one raising NoFeasiblePlan or
        _Outpaced is passed over, and when every one does, the first one's error is
        raised."""
        best, best_step, error = None, beat, None
        for attempt in attempts:
            try:
                other = attempt(best_step)
            except (NoFeasiblePlan, _Outpaced) as e:
                error = error or e
                continue
            step = self.step(other)
            if best is None or step < best_step:
                best, best_step = other, step
        if best is None:
            raise error
        return best

    def check_parameters(self, styles: dict[int, str]) -> None:
        """NoFeasiblePlan when some stage's parameters alone, each stored the cheapest way
        `styles` allow (with its gradient and optimizer state: `CostModel.param_memory`, what
        the stage's ILP counts), exceed a stage's share of the budget: no plan under `styles`
        fits (a stage's other bytes only add). Checked before any stage is solved."""
        graph, cost = self.cut.graph, self.cut.cost
        params = {n: v for n, v in graph.nodes.items() if v.kind == PARAM}
        allowed = allowed_strategies(StrategyGraph(params, graph.mesh_shape, None, []),
                                     styles)[0]
        cheapest = {n: min(cost.param_memory(v, v.strategies[k].output, v.strategies[k].zero)
                           for k in allowed.get(n, range(len(v.strategies))))
                    for n, v in params.items()}
        used: dict[int, set[str]] = {}
        for v in graph.nodes.values():
            if v.name in self.stage_of:
                used.setdefault(self.stage_of[v.name], set()).update(
                    u for u, _ in v.inputs if u in params)
        budget = stage_budget(self.at.budget, self.cut.best.virtual_stages)
        for s, us in sorted(used.items()):
            need = sum(cheapest[u] for u in us)
            if need > budget:
                raise NoFeasiblePlan(
                    f"pipeline stage {s} ({', '.join(self.blocks_of(s))}): its parameters "
                    f"alone, with their gradients and optimizer state stored as the styles "
                    f"{sorted(styles.values())} allow, take {need / 2**30:.2f} GiB of the "
                    f"{budget / 2**30:.2f} GiB per device a stage may use; use more pp ranks "
                    "or a style that shards them (fsdp, zero1, zero2, tensor)")

    def blocks_of(self, s: int) -> list[str]:
        """The names of stage `s`'s layer blocks."""
        bounds = [0, *self.cut.best.cuts, len(self.cut.blocks.names)]
        return self.cut.blocks.names[bounds[s]:bounds[s + 1]]

    def stage(self, s: int, choice: dict[str, Strategy], styles: dict[int, str],
              zero: bool = True) -> tuple[StrategyGraph, dict]:
        """Stage `s`'s subgraph, its producers' strategies fixed as in `choice`, and its
        ILP's strategies under `styles`."""
        cut, at, options = self.cut, self.at, self.at.options
        v = cut.best.virtual_stages
        members = [n for n in cut.graph.nodes if self.stage_of.get(n) == s]
        g = subgraph(cut.graph, members, choice)
        forced, discouraged = allowed_strategies(g, styles) if styles else (None, None)
        if not zero:  # no parameter shards its optimizer state (ZeRO)
            forced = without_zero(g, forced)
        if self.running is not None:  # parameters stay where the running plan stores them
            stored = kept_storage(g, cut.program, {n: tuple(pl) for n, pl in
                                                   self.running.parameters.items()},
                                  self.running.zero)
            forced = dict(forced or {})
            for n, ks in stored.items():
                forced[n] = sorted(set(ks) & set(forced.get(n, ks))) or ks
        try:
            return g, solve_subgraph(g, self.scaled, self.cache,
                                     memory_budget=stage_budget(at.budget, v),
                                     backend=at.backend, time_limit=options.time_limit,
                                     forced=forced, discouraged=discouraged, draw=self.draw,
                                     program=cut.program.graph_module)
        except NoFeasiblePlan:
            raise NoFeasiblePlan(
                f"pipeline stage {s} ({', '.join(self.blocks_of(s))}) fits no plan within "
                f"{stage_budget(at.budget, v) / 2**30:.2f} GiB per device with "
                f"{self.worst:g} microbatches in flight; use more pp ranks or more "
                "microbatches") from None

    def in_order(self, first: dict[str, Strategy], styles: dict[int, str],
                 beat: float = float("inf"), zero: bool = True) -> tuple[list, dict, object]:
        """Every stage solved in order under `styles`, the parameters in `first` stored as
        it says; _Outpaced as soon as the stages solved (priced alone: `price`, no sends)
        put the step (solver/stages.py `step_time`, which only grows with each stage's time
        and synchronization) at `beat` seconds or more. Returns
        (each stage's (subgraph, strategies), every node's strategy, the random draw)."""
        graph = self.cut.graph
        best, at = self.cut.best, self.at
        num_stages = at.p * best.virtual_stages
        choice: dict[str, Strategy] = dict(first)
        stages = []
        times, syncs = [0.0] * num_stages, [0.0] * num_stages
        for s in range(num_stages):
            g, picked = self.stage(s, choice, styles, zero)
            if beat != float("inf"):
                priced = price(g, self.cut.cost, picked)
                times[s], syncs[s] = priced.time, priced.grad_sync
                if step_time(times, syncs, at.p, best.microbatches,
                             best.virtual_stages) >= beat:
                    raise _Outpaced
            # boundary copies of earlier ops carry no strategy of theirs
            choice.update({n: st for n, st in picked.items()
                           if self.stage_of.get(n) == s or graph.nodes[n].kind != OP})
            stages.append((g, picked))
        for name, node in graph.nodes.items():
            choice.setdefault(name, node.strategies[0])  # unused parameters and inputs
        return stages, choice, self.draw

    def step(self, solved: tuple[list, dict, object]) -> float:
        """The predicted step of stages solved by `in_order`."""
        cut, at, best = self.cut, self.at, self.cut.best
        return price_pipeline(cut.graph, cut.cost, solved[0], self.stage_of, solved[1],
                              at.link, best.schedule, at.p, best.microbatches,
                              best.virtual_stages).step


def _pipelined(cut: _Cut, stages: list, choice: dict[str, Strategy], at: _Setting,
               batch: int) -> Plan:
    """The Plan of a pipelined model: the whole graph described on the stage mesh (its
    collectives on the whole mesh's dimensions), each op's stage, the sends between stages,
    and the pipeline's price."""
    program, graph, cost, best = cut.program, cut.graph, cut.cost, cut.best
    p, m, v, sched, pp = at.p, best.microbatches, best.virtual_stages, best.schedule, at.pp
    stage_of = cut.blocks.stage_of(best.cuts, p * v)
    base = describe(program, graph, at.sub, cost, choice, memory_budget=at.budget,
                    options=at.options)
    dims = stage_dims(at.mesh.ndim, pp)
    ops = [dataclasses.replace(o, stage=stage_of.get(o.name, 0)) for o in base.ops]
    collectives = [Collective(c.kind, dims[c.mesh_dim] if c.mesh_dim < len(dims) else pp,
                              c.bytes, c.time, c.phase, c.at) for c in base.collectives]
    priced = price_pipeline(graph, cost, stages, stage_of, choice, at.link, sched, p, m, v)
    collectives += [Collective("p2p", pp, nbytes, t, phase, u)
                    for u, nbytes, t, phase in priced.sends]
    peak = max(priced.rank_memory, key=lambda d: sum(d.values()))
    pipeline = PipelinePlan(pp, sched, m, v, batch, cut.blocks.names, best.cuts,
                            bubble_fraction(sched, p, m, v), priced.stage_time, priced.held,
                            priced.rank_memory, at.options.loss_reduction)
    return dataclasses.replace(
        base, mesh=at.mesh, ops=ops, collectives=collectives, pipeline=pipeline,
        cost=_pipeline_cost(base.cost, priced.step, priced.compute, priced.communication,
                            peak, best.objective, priced.hidden))


def _pipeline_cost(whole: PlanCost, step: float, compute: float, comm: dict, memory: dict,
                   objective: float, hidden: dict) -> PlanCost:
    """The cost of a pipelined plan: the busiest pp rank's step (see solve_pipeline_plan),
    `hidden` the seconds of sends it runs under compute (solver/stages.py `hides_sends`);
    what `whole` (the whole graph priced on the submesh) says of the rest carries over, its
    forward share of compute kept."""
    forward = getattr(whole, "compute_forward", 0.0)
    extra = {"compute_forward": forward * compute / whole.compute} if forward and whole.compute \
        else {}
    # (a stage's own collectives add to its time: only the sends between stages overlap)
    return dataclasses.replace(whole, step_time=step, compute=compute, communication=comm,
                               memory=dict(memory), solver_objective=objective,
                               hidden=dict(hidden), **extra)
