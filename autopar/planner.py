"""The planner: from a traced model to a Plan, searching the ways to fit memory.

`solve_accumulated` plans a step (any mesh without "pp") as a search over microbatch counts
(gradient accumulation, `plan_round` one count at a time) and, at each count, over memory
levels cheapest first (`Rounds.levels`: parameters freed after forward, selective then full
recomputation), skipping a level no plan of which can beat one found (`LEVEL_GAP`);
`solve_plan` solves one level: the strategy graph and its cost model (`priced_level`, shared
by every level), the intra-op ILP under the memory budget, solved again while the exact
memory is over it, and the result described (autopar/describe.py).

Pipelined plans are planned in autopar/pipeline_plan.py; a plan's strategies reach the build by
stable id (autopar/choice.py).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from autopar.passes import strategies as strat_pass
from autopar.passes.batch_local import split_problem
from autopar.passes.cluster import cluster
from autopar.passes.placement import Placements
from autopar.passes.recompute import NONE as NO_RECOMPUTE
from autopar.passes.recompute import recompute_plan
from autopar.passes.strategies import PARAM, StrategyGraph
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver import resharding
from autopar.solver.alternatives import alternatives, compact
from autopar.solver.assignments import random_choice
from autopar.solver.cost import CostModel
from autopar.solver.diagnose import infeasible
from autopar.solver.ilp import NoFeasiblePlan, Outpaced, relaxed_bound, solve
from autopar.solver.memory import exact_memory, node_infos
from autopar.solver.owner_problem import priced_problem
from autopar.solver.plan_prices import compute_floor
from autopar.solver.stages import divisors

from .choice import choice_from_plan, kept_storage
from .collector import planning
from .costing import cost_model, eager_could_fit, measured, profiler
from .describe import accumulated, describe
from .force import styles_by_dim
from .foresight import Foresight
from .inputs import indivisible, input_placement
from .mesh import MeshSpec
from .options import RECOMPUTE, PlanOptions
from .pipeline_plan import BINDING, solve_pipeline_plan
from .plan import Plan
from .progress import Progress

# autopar/parallelized.py imports these from here (their homes: autopar/choice.py and
# autopar/pipeline_plan.py)
__all__ = ["choice_from_plan", "input_placement", "solve_accumulated", "solve_pipeline_plan"]

RESOLVES = 4  # solves again when the exact kept memory is over the budget (see solve_plan)

# The relative gap the planner's solves stop at: a plan proven within 0.1% of the fastest
# (the step model is not that precise; LEVEL_GAP below). Closing the last 0.1% took HiGHS as
# long again (Llama-3 70B over 512 x 2 H100s: the budgeted solves 1.2, 2.6 and 1.5 s at
# 1e-4, 0.5, 0.5 and 0.4 s at 1e-3, the same plans).
PLAN_GAP = 1e-3


def solve_plan(program: TracedProgram, mesh: MeshSpec, options: PlanOptions | None = None, *,
               storage: dict[str, Placements] | None = None,
               fold_layers: bool = True, recompute: str | None = None,
               reshard: bool = False, zero: dict[str, int] | None = None,
               accumulation: int = 1, unbounded: bool = False,
               diagnose: bool = True, bounds: list[float] | None = None,
               fastest: list[dict[str, int]] | None = None,
               beat: float | None = None,
               prepared: "_Level | None" = None) -> tuple[Plan, StrategyGraph]:
    """Build strategies, solve the ILP and describe the result.

    With `beat` (seconds of a whole step: the fastest plan a search found so far; infinite
    where none is found yet but memory is known to bind), the ILP's linear relaxation is
    solved first (`relaxed_floor`): when no plan of this level can step LEVEL_GAP faster
    than `beat` it raises Outpaced, and when not even the relaxation fits the budget,
    NoFeasiblePlan (unless `diagnose`, which solves the ILP to say why), without the integer
    solves. `prepared`: this level's problem as `level_problem` built it (its relaxation
    solved already: `beat` is then not looked at).

    With `unbounded` only the plan the ILP chooses without the memory budget is tried
    (solver/ilp.py `solve`'s `unbounded_only`): a search step skipped when memory binds.
    Without `diagnose` a budget no plan meets raises NoFeasiblePlan saying so but not why
    (solver/diagnose.py's least-memory solve skipped), as if activations mattered: a search
    step with a later one to try.

    With `reshard` (and `options.reshard_after_forward` None) the ILP prices every parameter
    gathered for its use as freed after forward, and the plan then keeps gathered what the
    budget holds (solver/resharding.py); `options.reshard_after_forward` True or False
    overrides it.

    `options.solver == "random"` draws a valid plan instead (seeded by `options.seed`): any
    plan the ILP could choose may come out, which is what the property tests run. With
    `storage` (parameter name -> placements; `zero`: name -> ZeRO stage), parameters stay
    where they are stored: a plan for another input shape or mode of a model already
    running. `accumulation` is the number of microbatches a step accumulates over (ZeRO-2
    pays a reduce-scatter for each). The solver's lower bound on the step of any plan at
    this level (solver/ilp.py `Solution.bound`), where it has one, is appended to `bounds`,
    whether or not a plan fits; `fastest` carries the plans without the budget from level to
    level of a search (solver/ilp.py `solve`).
    """
    options = options or PlanOptions()
    if options.solver == "random" and prepared is None:
        styles_by_dim(mesh, options.force)  # a bad force fails before the work
        graph, cost = priced_level(program, mesh, options, recompute, reshard, accumulation)
        kept = kept_storage(graph, program, storage, zero)
        return _drawn(program, graph, mesh, cost, kept, _budget(mesh, options), options), graph
    level = prepared or level_problem(program, mesh, options, storage=storage, zero=zero,
                                      fold_layers=fold_layers, recompute=recompute,
                                      reshard=reshard, accumulation=accumulation,
                                      relax=_relaxes(beat, diagnose))
    if _relaxes(beat, diagnose) and prepared is None and level.relaxed:
        _outpaced(level, beat, accumulation, diagnose, recompute)
    graph, clusters, budget = level.graph, level.clusters, level.budget
    sol, choice, cost, memory = _solve_within(level, reshard, unbounded, diagnose, bounds,
                                              fastest if fastest is not None else [])
    plan = describe(program, graph, mesh, cost, choice, sol, memory_budget=budget,
                    options=options, memory=memory, twin=clusters.twin)
    _check_fits(plan, budget, options)
    found = alternatives(graph, cost, choice, forced=level.forced,
                         discouraged=level.discouraged, memory_budget=budget,
                         peak=plan.cost.peak_memory, twin=clusters.twin)
    plan.alternatives = compact({program.params.get(n, n): rows for n, rows in found.items()})
    Progress(options.progress)(f"solved in {sol.solve_time:.1f} s: predicted step "
                               f"{plan.cost.step_time * 1e3:.1f} ms")
    return plan, graph


def _relaxes(beat: float | None, diagnose: bool) -> bool:
    """Whether a level's relaxation can decide anything: against a plan found (`beat`), or
    as the proof that nothing fits where the integer solve would not say why."""
    return beat is not None and (beat != float("inf") or not diagnose)


def level_problem(program: TracedProgram, mesh: MeshSpec, options: PlanOptions, *,
                  storage: dict[str, Placements] | None = None,
                  zero: dict[str, int] | None = None, fold_layers: bool = True,
                  recompute: str | None = None, reshard: bool = False, accumulation: int = 1,
                  relax: bool = False) -> "_Level":
    """One level's problem for `solve_plan` (its arguments): the strategy graph priced, the
    strategies forced and discouraged, the clustering and the ILP's prices; with `relax`
    priced for its linear relaxation too (`relaxed_floor`), unless styles are forced
    (their penalties are no seconds of a step)."""
    report = Progress(options.progress)
    styles = styles_by_dim(mesh, options.force)  # a bad force fails before the work
    shape = "x".join(map(str, mesh.shape))
    report(f"strategies for {len(program.graph.nodes)} graph nodes on mesh {shape}")
    graph, cost = priced_level(program, mesh, options, recompute, reshard, accumulation)
    kept = kept_storage(graph, program, storage, zero)
    forced, discouraged = allowed_strategies(graph, styles)
    for n, ks in kept.items():
        forced[n] = sorted(set(ks) & set(forced.get(n, ks))) or ks
    clusters = clustered(program, graph, fold_layers and not kept)
    report(f"solving: {len(graph.nodes)} nodes, "
           f"{sum(len(v.strategies) for v in graph.nodes.values())} candidate strategies, "
           f"{len(set(clusters.owner.values()))} decisions ({options.solver}, at most "
           f"{options.time_limit:g} s)")
    relax = relax and not discouraged
    return _Level(graph, cost, _budget(mesh, options), forced, discouraged, clusters, options,
                  priced_problem(graph, cost, clusters, forced, discouraged, relaxation=relax),
                  relax)


def _budget(mesh: MeshSpec, options: PlanOptions) -> float:
    """Bytes per device a plan may use: the options', else the mesh's hardware's."""
    budget = options.memory_budget
    return mesh.profile.memory_budget if budget is None else budget


@dataclass
class _Level:
    """One level's intra-op problem (see solve_plan): the strategy graph, its cost model, the
    memory budget, the strategies forced and discouraged, the clustering, the options and the
    ILP's prices."""

    graph: StrategyGraph
    cost: CostModel
    budget: float
    forced: dict[str, list[int]]
    discouraged: dict[str, list[int]]
    clusters: object
    options: PlanOptions
    problem: object
    relaxed: bool = False  # priced for its linear relaxation too (`relaxed_floor`)


def _drawn(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
           kept: dict[str, list[int]], budget: float, options: PlanOptions) -> Plan:
    """A valid plan drawn at random (`options.solver == "random"`, seeded by `options.seed`),
    parameters kept where `kept` says."""
    rng = random.Random(options.seed)
    drawn = random_choice(graph, cost, rng, kept)
    choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
    cost = cost.copy(reshard=resharding.choose(graph, cost, choice, budget,
                                               options.reshard_after_forward, rng))
    return describe(program, graph, mesh, cost, choice, memory_budget=budget, options=options)


def _outpaced(level: _Level, beat: float, accumulation: int, diagnose: bool,
              recompute: str | None) -> None:
    """Outpaced when the level's linear relaxation says none of its plans steps LEVEL_GAP
    faster than `beat`; NoFeasiblePlan (without `diagnose`) when not even the relaxation fits
    the budget (with it, the integer solve says why)."""
    try:
        floor = relaxed_floor(level, accumulation)
    except NoFeasiblePlan:
        if not diagnose:
            raise
        return
    outpace(floor, beat, recompute or level.options.recompute, accumulation)


def relaxed_floor(level: _Level, accumulation: int) -> float:
    """Seconds of a step of `accumulation` microbatches below which no plan of `level` (built
    with `relax`) goes: its linear relaxation (solver/ilp.py `relaxed_bound`). Raises
    NoFeasiblePlan, as if activations mattered, when not even the relaxation fits."""
    try:
        return relaxed_bound(level.graph, level.cost, level.problem, level.budget,
                             level.clusters, accumulation,
                             level.options.time_limit) * accumulation
    except NoFeasiblePlan as e:
        raise NoFeasiblePlan(str(e), "activations", True) from e


def outpace(floor: float, beat: float, recompute: str | None, accumulation: int) -> None:
    """Outpaced when a level whose plans step no faster than `floor` cannot step LEVEL_GAP
    faster than `beat`."""
    if floor * (1 + LEVEL_GAP) >= beat:
        raise Outpaced(f"no plan recomputing {recompute or 'none'} over {accumulation} "
                       f"microbatch(es) steps under {floor:.4g} s")


def _solve_within(level: _Level, reshard: bool, unbounded: bool, diagnose: bool,
                  bounds: list[float] | None, fastest: list[dict[str, int]]) -> tuple:
    """The level's ILP solved under its budget: (solution, strategies, cost model with the
    parameters kept gathered after forward, exact memory). Raises NoFeasiblePlan (why, with
    `diagnose`) when nothing fits; appends the solver's bounds to `bounds`."""
    # The ILP's memory row counts a tensor kept by k ops as 1/k at each (linear in each
    # choice); the plan's reported memory counts each kept storage once (solver/memory.py
    # `kept_once`), more where some ops keep a tensor as produced and others a collective's
    # copy of it. The parameters kept gathered after forward are chosen by that exact count
    # (solver/resharding.py), so only a plan over the budget with every gathered parameter
    # freed is solved again: under the budget less half the difference, then less each
    # further plan's whole difference: the difference is the plan's own, and a budget cut by
    # all of it can rule out faster plans that fit (an 8B-shaped layer pair on (8, 8) under
    # 2 GiB: 0.165 s at 1.92 GiB against 0.103 s at 1.98 GiB).
    # The re-solves reuse the prices, and are solved under the budget at once (the budget
    # binds: the plan before did not fit).
    graph, priced, budget, options = level.graph, level.cost, level.budget, level.options
    mode = options.reshard_after_forward
    freed = frees_after_forward(options, reshard)
    ilp_budget = budget
    for attempt in range(RESOLVES + 1):
        try:
            sol = solve(graph, priced, memory_budget=ilp_budget, backend=options.solver,
                        time_limit=options.time_limit, gap=PLAN_GAP, forced=level.forced,
                        discouraged=level.discouraged, clustering=level.clusters,
                        unbounded_only=unbounded, fastest=fastest, problem=level.problem,
                        binding=attempt > 0)
        except NoFeasiblePlan as e:
            if bounds is not None and e.bound is not None:
                bounds.append(e.bound)
            if unbounded:
                raise
            if not diagnose:
                raise NoFeasiblePlan(str(e), "activations", True) from e
            raise infeasible(graph, priced, budget, level.forced, level.clusters) from e
        if bounds is not None and sol.bound is not None:
            bounds.append(sol.bound)
        choice = {n: graph.nodes[n].strategies[i] for n, i in sol.choice.items()}
        cost = priced.copy(reshard=resharding.choose(graph, priced, choice, budget,
                                                     mode if mode is not None else
                                                     (None if freed else False),
                                                     twin=level.clusters.twin))
        # a plan solved again is not described
        memory = exact_memory(graph, cost, choice, level.clusters.twin)
        over = sum(memory.values()) - budget
        if over <= budget * 1e-6 or attempt == RESOLVES:
            break
        ilp_budget -= over / 2 if attempt == 0 else over
    return sol, choice, cost, memory


def _check_fits(plan: Plan, budget: float, options: PlanOptions) -> None:
    """RuntimeError (a bug of autopar's) when the plan is over the budget."""
    if plan.cost.peak_memory > budget * (1 + 1e-6):
        # the re-solves bring the exact peak within the budget: only the solver's numerics
        # can break this, and a plan over the budget must never reach the user as fitting
        raise RuntimeError(
            f"autopar: the {options.solver} solver returned a plan of "
            f"{plan.cost.peak_memory / 2**30:.3f} GiB per device for a budget of "
            f"{budget / 2**30:.3f} GiB (numerical trouble in the solver); this is a bug in "
            "autopar: please report it with the model's shapes and the mesh")


def priced_level(program: TracedProgram, mesh: MeshSpec, options: PlanOptions,
                 recompute: str | None = None, reshard: bool = False, accumulation: int = 1
                 ) -> tuple[StrategyGraph, CostModel]:
    """The strategy graph of `program` on `mesh` (built once per program and mesh, for every
    level of a search) and its cost model with recomputation `recompute` (else the options'),
    parameters freed after forward (`reshard`, unless the options say) and `accumulation`
    microbatches (see solve_plan)."""
    graph = strategy_graph(program, mesh, options)
    mode = recompute or options.recompute or "none"
    keep_user = options.recompute != "none"
    r = derived(program, ("recompute", id(graph), mode, keep_user),
                lambda: recompute_plan(program, graph, mode, keep_user=keep_user)) \
        if program.has_loss else NO_RECOMPUTE
    info = derived(program, ("info", id(graph)), lambda: node_infos(graph))
    # every level's model a copy of one per graph, mesh and settings: they share its
    # resharding prices (the entry holds the mesh, so its id names it while the entry lives)
    base = derived(program, ("cost", id(graph), id(mesh), options.optimizer,
                             options.bucket_bytes, options.precision, options.randomness,
                             accumulation),
                   lambda: (mesh, cost_model(mesh, graph, options, info, accumulation)))[1]
    cost = base.copy(recompute=r, reshard=frozenset(
        n for n, v in graph.nodes.items() if v.kind == PARAM)
        if frees_after_forward(options, reshard) else (), accumulation=accumulation)
    return graph, measured(cost, graph, profiler(options.profile))


def strategy_graph(program: TracedProgram, mesh: MeshSpec, options: PlanOptions
                   ) -> StrategyGraph:
    """The strategy graph of `program` on `mesh` (inputs placed as the options say, ZeRO
    candidates included): built once per program and mesh and kept in
    `program.strategy_graphs`, for every level of a search and for a build of the plan in the
    same process (whose ids, `Plan.choice`, index it)."""
    placed = input_placement(mesh, options)
    key = (tuple(mesh.shape), placed)
    if key not in program.strategy_graphs:  # the same for every level of a search
        program.strategy_graphs.clear()  # one mesh's at a time (a mesh search tries several)
        program.strategy_graphs[key] = strat_pass.build(program, mesh.shape, placed, zero=True)
    return program.strategy_graphs[key]


def derived(program: TracedProgram, key: tuple, make):
    """`make()` once per `key` for the strategy graph `program` holds: what the levels of a
    search derive alike from it (its clustering, each recomputation mode's plan, its nodes'
    analysis for the cost model), kept beside it in `program.strategy_graphs` until another
    mesh's graph replaces it. `key` names the graph by id (the graph lives as long as the
    entry)."""
    cache = program.strategy_graphs
    if key not in cache:
        cache[key] = make()
    return cache[key]


def clustered(program: TracedProgram, graph: StrategyGraph, fold_layers: bool = True):
    """passes/cluster.py `cluster` of `graph`, a strategy graph of `program`, once per
    graph."""
    return derived(program, ("cluster", id(graph), fold_layers),
                   lambda: cluster(graph, program.graph_module, fold_layers=fold_layers))


def frees_after_forward(options: PlanOptions, reshard: bool) -> bool:
    """Whether the ILP prices every gathered parameter as freed after forward: as the
    options say, else as the search level (`reshard`) says."""
    mode = options.reshard_after_forward
    return mode is True or (mode is None and reshard)


@planning
def solve_accumulated(trace_at, batch: int | None, mesh: MeshSpec,
                      options: PlanOptions | None = None, *,
                      storage: dict[str, Placements] | None = None,
                      zero: dict[str, int] | None = None, accumulate: bool = True
                      ) -> tuple[Plan, StrategyGraph, TracedProgram]:
    """Plan a step that may accumulate gradients over microbatches (any mesh without "pp"):
    `trace_at(m)` traces the model on 1/m of the batch (`batch`: dimension 0 of every input
    and the target, or None when they share none). With `options.microbatches` that many;
    otherwise the whole batch, and when no plan fits because activations dominate, 2, 3, ...
    microbatches (divisors of the batch), the fewest that fit. Activation recomputation
    (`options.recompute`; when None, none, then selective, then full, for each microbatch
    count, while activations keep the plan from fitting or memory binds its placements: a
    peak above BINDING of the budget) is the other way to fit: of the plans that fit, the one
    with the shortest step wins. A level whose plans the solver bounds, or whose compute alone
    is, within LEVEL_GAP of a plan found, is not solved, nor one whose linear relaxation is
    (solve_plan's `beat`). Returns the plan (its
    `accumulation`; its cost for the whole step, gradients synchronized once), the strategy
    graph and the traced program of one microbatch. Without `accumulate` (an inference
    program) the whole batch, always.

    One microbatch count at a time (`plan_round`): a mesh search plans the counts of its
    candidates as separate tasks, with the same decisions.

    Under `randomness="auto"`, a plan that draws in counter mode is planned once more with
    eager draws where their whole tensors fit (`eager_could_fit`), and the faster of the two
    is kept: the solver is not beaten by the mode a user could have forced."""
    options = options or PlanOptions()

    def accumulated(opts: PlanOptions):
        rounds = start_rounds(batch, opts, accumulate)
        ahead = Foresight(lambda wanted: foreseen(trace_at, mesh, opts, wanted)) \
            if len(rounds.counts) > 1 and len(rounds.levels) > 1 and Foresight.possible() and \
            opts.solver != "random" and not opts.force and storage is None and zero is None \
            else None
        try:
            while not rounds.done:
                rounds = plan_round(trace_at, mesh, opts, rounds, storage=storage, zero=zero,
                                    ahead=ahead)
        finally:
            if ahead is not None:
                ahead.cancel()
        return rounds.result()

    found = accumulated(options)
    if options.randomness != "auto" or not eager_could_fit(found[0], found[1], mesh, options):
        return found
    try:
        eager = accumulated(dataclasses.replace(options, randomness="eager"))
    except NoFeasiblePlan:
        return found
    return eager if eager[0].cost.step_time < found[0].cost.step_time else found


@dataclasses.dataclass
class Rounds:
    """Where `solve_accumulated` stands between microbatch counts: the counts to try, the
    next one, the plans found so far (accumulated, with their strategy graph, traced program
    and recomputation level; the graph and program are None in a plan sent back by a mesh
    search's worker), the last reason no plan fit, and whether it is done."""

    counts: list[int]
    levels: list[tuple[str, bool]]  # (recomputation, parameters freed after forward)
    next: int = 0
    found: list = dataclasses.field(default_factory=list)
    error: NoFeasiblePlan | None = None
    since: int = 0  # counts tried since (and with) the first where a plan fits
    done: bool = False

    def recompute(self) -> list[str]:
        """The recomputation modes of the levels, in order."""
        return list(dict.fromkeys(mode for mode, _ in self.levels))

    def result(self) -> tuple[Plan, StrategyGraph | None, TracedProgram | None]:
        """The fastest plan found, its graph and traced program; NoFeasiblePlan when none
        fits."""
        if self.found:
            best = min(self.found, key=lambda f: f[0].cost.step_time)
            return best[0], best[1], best[2]
        tried = self.counts[min(self.next, len(self.counts)) - 1]
        what = f"recomputation ({', '.join(self.recompute())}) and " \
            if len(self.recompute()) > 1 else ""
        raise NoFeasiblePlan(f"{self.error} (tried {what}gradient accumulation up to {tried} "
                             "microbatches)", self.error.dominant,
                             self.error.activations_matter) from None

    def shipped(self) -> "Rounds":
        """These rounds without the strategy graphs and traced programs (for a process that
        only needs the plans)."""
        return dataclasses.replace(self, found=[(p, None, None, lv) for p, _, _, lv in self.found])


def start_rounds(batch: int | None, options: PlanOptions, accumulate: bool = True) -> Rounds:
    """The microbatch counts and memory levels `solve_accumulated` tries (see there)."""
    if not accumulate:
        counts = [1]
    elif options.microbatches is not None:
        why = indivisible(batch, options.microbatches)
        if why:
            raise ValueError(why)
        counts = [options.microbatches]
    else:
        counts = divisors(batch, batch) if batch else [1]
    # Ways to free memory, cheapest first: only what the model checkpoints itself, then FSDP
    # parameters freed after forward where the budget needs it, then selective, then full
    # recomputation of every layer block (with parameters freed after forward as needed).
    recompute = ["none"] if not accumulate else \
        [options.recompute] if options.recompute is not None else list(RECOMPUTE)
    levels = [(recompute[0], False)] + [(r, True) for r in recompute] \
        if accumulate and options.reshard_after_forward is None else \
        [(r, False) for r in recompute]
    return Rounds(counts, levels)


@planning
def plan_round(trace_at, mesh: MeshSpec, options: PlanOptions, rounds: Rounds, *,
               storage: dict[str, Placements] | None = None,
               zero: dict[str, int] | None = None, ahead: Foresight | None = None) -> Rounds:
    """`rounds` after planning its next microbatch count (see `solve_accumulated`); raises
    NoFeasiblePlan where nothing can fit. With `ahead` (a large program planned on one
    mesh: autopar/foresight.py) the next count's relaxations are worked out in a child
    while this count is planned, and this count's are taken from its child where one
    worked them out: the count is then traced only when a level is left to solve."""
    m = rounds.counts[rounds.next]
    levels, recompute = rounds.levels, rounds.recompute()
    # (checked before tracing a microbatch, which may not trace: a captured whole-batch mask)
    why = split_problem(trace_at(1), m, bool(options.per_rank_inputs),
                        options.loss_reduction) if m > 1 else ""
    if why and options.microbatches is not None:
        raise ValueError(f"microbatches={m}: gradient accumulation would not compute what the "
                         f"whole batch does: {why}. Pass microbatches=1 (and recompute= or a "
                         "larger memory_budget where the batch does not fit)")
    if why:  # no count but the whole batch computes the model's result: stop at it
        error = NoFeasiblePlan(f"{rounds.error}; gradient accumulation would not compute what "
                               f"the whole batch does: {why}",
                               rounds.error.dominant, rounds.error.activations_matter) \
            if rounds.error is not None else rounds.error
        return dataclasses.replace(rounds, error=error, done=True)
    known = ahead.known(m) if ahead is not None else None
    program = functools.cache(lambda: trace_at(m))  # traced when first needed
    # (a count a child works on is a large program's)
    large = known is not None or len(program().graph.nodes) >= LARGE_PROGRAM
    if ahead is not None and not rounds.found and large:
        if known is None:  # (the child shares this count's strategy graph)
            strategy_graph(program(), mesh, options)
        ahead.start(_foreseeable(rounds))  # no plan yet: the next count may follow
        known = ahead.known(m)
    found, error = list(rounds.found), rounds.error
    plain = False  # a plan fits at this count without recomputing more than levels[0]
    # Each level only adds work to every plan (parameters gathered again, ops recomputed):
    # the first level's lower bound bounds them all at this count.
    bounds: list[float] = []
    unbudgeted: list[dict[str, int]] = []  # each level's fastest plan (one graph per count)
    fastest = float("inf")  # of the plans found at this count, per microbatch
    relaxed = _first_freeing(program, mesh, options, rounds, m, storage, zero, known, large)
    for i, (level, reshard) in enumerate(levels):
        if i < 2 and isinstance(relaxed, NoFeasiblePlan):
            error = relaxed
            continue
        if i == 1 and isinstance(relaxed, Outpaced):
            continue
        if i and bounds and bounds[0] * (1 + LEVEL_GAP) >= fastest:
            continue  # no plan at this level can be LEVEL_GAP faster than one that fits
        if found and level != levels[0][0] and \
                m * _known(known, ("floor", level), lambda lv=level: level_floor(
                    program(), mesh, options, lv)) * (1 + LEVEL_GAP) \
                >= min(f[0].cost.step_time for f in found):
            continue  # no plan recomputing this much can beat one that fits already
        # A level after the first first solves its relaxation: no faster than a plan found
        # (by LEVEL_GAP), or not fitting at all (Llama-3 70B on (8, 8): no recomputation and
        # selective, 0.4 s each where their integer solves took 1-1.8 s to say so), and its
        # integer solves are skipped. (The first level's plan without the budget is solved
        # at every count: its relaxation within LEVEL_GAP of a plan found once hid a plan
        # 1.4% faster that forced FSDP found, Megatron's 1.7B over 32 A100s.)
        best = min((f[0].cost.step_time for f in found), default=float("inf"))
        beat = best if i and not (i == 1 and relaxed) else None
        try:
            outcome = known((level, reshard)) if known and beat is not None else None
            if outcome is not None:
                beat = _foreseen_beat(outcome, beat, level, m, diagnose=i == len(levels) - 1)
            # When the fastest plan keeping every parameter gathered does not fit, freeing
            # (the next level) is where memory is found: no budgeted solve at this one.
            # Why nothing fits is worked out at the last level only (the others go on).
            plan, graph = solve_plan(program(), mesh, options, storage=storage, zero=zero,
                                     recompute=level, reshard=reshard, accumulation=m,
                                     unbounded=not reshard and len(levels) > 1 and
                                     levels[1][1], diagnose=i == len(levels) - 1,
                                     bounds=bounds if i == 0 else None,
                                     fastest=unbudgeted, beat=beat,
                                     prepared=relaxed if i == 1 and
                                     isinstance(relaxed, _Level) else None)
        except Outpaced:
            continue
        except NoFeasiblePlan as e:
            error = e
            if e.activations_matter:
                continue  # recompute more, or split the batch further
            if found:
                break
            if m == 1:
                raise
            raise NoFeasiblePlan(f"with gradient accumulation over {m} microbatches (the "
                                 f"fewest that shrink the activations enough): {e}",
                                 e.dominant, e.activations_matter) from None
        found.append((accumulated(plan, m), graph, program(), level))
        fastest = min(fastest, plan.cost.step_time)
        plain = plain or level == recompute[0]
        if plan.cost.peak_memory < BINDING * plan.cost.memory_budget:
            break  # memory does not bind: recomputing more would only cost time
    since = rounds.since + bool(found)
    # More microbatches only cost more once a plan fits without recomputing, or at the
    # count after the first that fits at all.
    done = plain or since >= 2 or rounds.next + 1 == len(rounds.counts)
    return dataclasses.replace(rounds, next=rounds.next + 1, found=found, error=error,
                               since=since, done=done)


def _first_freeing(program, mesh: MeshSpec, options: PlanOptions, rounds: Rounds, m: int,
                   storage, zero, known, large: bool):
    """When the first level keeps every parameter gathered and the second frees them, the
    second's linear relaxation, solved first (`program()` the count's program, `known` its
    relaxations where a child worked them out): NoFeasiblePlan when not even it fits (then
    neither level has a plan that fits: every plan of the first is one of the second's, its
    parameters kept gathered, so its fastest plan without the budget need not be solved),
    Outpaced when the second cannot beat a plan found, the second level's problem (for
    `solve_plan`'s `prepared`) or True when it may; None where it does not apply: at a
    count before any plan was found, unless the program is `large` (LARGE_PROGRAM), where a
    relaxation costs little beside the fastest plan without the budget it may save (Llama-3
    70B on (8, 8) or (256, 4), bf16-mixed: 1.5 s of solving the first level, at each of 1
    and 2 microbatches, where the second level's relaxation took 0.7 s)."""
    levels = rounds.levels
    if not (rounds.found or large) or len(levels) < 2 or levels[0][1] or \
            levels[1] != (levels[0][0], True):
        return None
    best = min((f[0].cost.step_time for f in rounds.found), default=float("inf"))
    key, prepared = levels[1], True
    outcome = known(key) if known else None
    try:
        if outcome is not None:
            _foreseen_beat(outcome, best, key[0], m, diagnose=False)
        else:
            prepared = level_problem(program(), mesh, options, storage=storage, zero=zero,
                                     recompute=key[0], reshard=True, accumulation=m,
                                     relax=True)
            if prepared.relaxed:
                outpace(relaxed_floor(prepared, m), best, key[0], m)
    except (NoFeasiblePlan, Outpaced) as e:
        return e
    return prepared


def _foreseen_beat(outcome: float | str, beat: float, recompute: str, m: int,
                   diagnose: bool) -> float | None:
    """A level's relaxation as a child worked it out (its floor, or why it does not fit):
    raises what `solve_plan` would with `beat` (NoFeasiblePlan without `diagnose`, Outpaced);
    else None, the `beat` to solve the level with (its relaxation is not solved again)."""
    if isinstance(outcome, str):
        if not diagnose:
            raise NoFeasiblePlan(outcome, "activations", True)
        return None  # the integer solve says why
    outpace(outcome, beat, recompute, m)
    return None


def _known(known, key, work):
    """`known(key)` where a child worked it out, else `work()`."""
    value = known(key) if known else None
    return work() if value is None else value


def _foreseeable(rounds: Rounds) -> list[tuple]:
    """What a child can work out for `plan_round` while it plans count m, no plan found yet
    ((count, key) pairs, autopar/foresight.py): the relaxations of m's levels between the
    first two and the last (the second's is solved first, and the last's problem is built
    for its integer solve anyway), then the next count's relaxations and compute floors."""
    m, levels = rounds.counts[rounds.next], rounds.levels
    wanted = [(m, level) for level in levels[2:-1]]
    if rounds.next + 1 < len(rounds.counts):
        n = rounds.counts[rounds.next + 1]
        wanted += [(n, level) for level in levels[1:]]
        wanted += [(n, ("floor", mode)) for mode in
                   dict.fromkeys(lv for lv, _ in levels if lv != levels[0][0])]
    return wanted


def foreseen(trace_at, mesh: MeshSpec, options: PlanOptions,
             wanted: list[tuple]) -> Iterator[tuple]:
    """What `plan_round` takes from a child (autopar/foresight.py): for each (count, key) of
    `wanted` in turn, ((count, key), value): a level's relaxation floor (or why it does not
    fit), or a recomputation mode's compute floor."""
    options = dataclasses.replace(options, progress=False)  # (the planner reports)
    for m, key in wanted:
        program = trace_at(m)
        if key[0] == "floor":
            yield (m, key), level_floor(program, mesh, options, key[1])
            continue
        level = level_problem(program, mesh, options, recompute=key[0], reshard=key[1],
                              accumulation=m, relax=True)
        if not level.relaxed:
            return  # forced styles: no relaxation to work out
        try:
            value = relaxed_floor(level, m)
        except NoFeasiblePlan as e:
            value = str(e)
        del level  # (its prices, before the next is built)
        yield (m, key), value


def level_floor(program: TracedProgram, mesh: MeshSpec, options: PlanOptions,
                recompute: str) -> float:
    """Seconds of compute per microbatch below which no plan of `program` recomputing
    `recompute` goes (solver/plan_prices.py `compute_floor`)."""
    graph, cost = priced_level(program, mesh, options, recompute)
    return compute_floor(graph, cost, clustered(program, graph).twin)


# A level of the memory search (parameters freed after forward, recomputation) is not solved
# when the solver's bound or its compute floor says none of its plans can be this much faster
# than a plan already found: the step model is not that precise, and each level costs a solve
# (Llama-3 70B on (8, 8) under the H100's memory: selective recomputation would gain 0.14% for
# 7 s of planning; Llama-3 8B over 32 x 2 H100s: full recomputation's floor is 0.08% below
# the plan found, and its solve took 7 s).
LEVEL_GAP = 0.02

# A program of this many graph nodes is large: its levels take seconds to solve, their
# relaxations a fraction of that (see `_first_freeing`), and a child is worth its fork
# (autopar/foresight.py); a smaller one plans in about a second (and a test suite's other
# workers use the spare core).
LARGE_PROGRAM = 1000
