"""From a traced model to a Plan: strategies, cost model, solver, and the Plan's description."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections import defaultdict

from autopar.passes import strategies as strat_pass
from autopar.passes.batch_local import split_problem
from autopar.passes.cluster import cluster
from autopar.passes.pipeline_split import layer_blocks
from autopar.passes.placement import Placements, R, Shard, fmt, local_shape
from autopar.passes.recompute import NONE as NO_RECOMPUTE
from autopar.passes.recompute import recompute_plan
from autopar.passes.strategies import (
    CONSTANT,
    INPUT,
    OP,
    PARAM,
    SNode,
    Strategy,
    StrategyGraph,
    replicated,
)
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver import resharding
from autopar.solver import stages as pipe
from autopar.solver.alternatives import alternatives, compact
from autopar.solver.cost import CostModel, Split, step_seconds
from autopar.solver.diagnose import infeasible
from autopar.solver.ilp import (
    Edge,
    NoFeasiblePlan,
    Solution,
    compute_floor,
    edge_key,
    loss_sink_time,
    plan_split,
    plan_time,
    price_key,
    priced_problem,
    random_choice,
    relaxed_bound,
    solve,
)
from autopar.solver.memory import exact_memory, node_infos

from .collector import planning
from .inputs import indivisible
from .mesh import MeshSpec
from .options import RECOMPUTE, PlanOptions
from .plan import Collective, OpEntry, PipelinePlan, Plan, PlanCost
from .progress import Progress

CHEAPER = "replicated is cheaper"
DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
        "all_reduce": "all_reduce", "all_to_all": "all_to_all"}


def fingerprint(graph: StrategyGraph) -> str:
    """Identity of a traced graph: node names, ops and shapes."""
    text = "|".join(f"{v.name}:{v.op}:{v.in_shapes}:{v.out_shapes}" for v in graph.nodes.values())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def styles_by_dim(mesh: MeshSpec, force) -> dict[int, str]:
    """`force` as {mesh dimension index: style}; accepts one style for every dimension, or a
    dict keyed by dimension names or indices (0 to ndim - 1). Raises ValueError for a dimension
    the mesh lacks or one named twice."""
    if force is None:
        return {}
    if isinstance(force, str):
        return {k: force for k in range(mesh.ndim)}
    if not isinstance(force, dict):
        raise ValueError(f"force must be a style name or a dict from mesh dimension to style, "
                         f"not a {type(force).__name__}; the mesh has {_dims(mesh)}")
    out: dict[int, str] = {}
    given: dict[int, object] = {}
    for key, style in force.items():
        k = _dim_index(mesh, key)
        if k in out:
            raise ValueError(f"force names mesh dimension {k} ({mesh.names[k]!r}) twice, as "
                             f"{given[k]!r} and as {key!r}; give each dimension one style")
        out[k], given[k] = style, key
    return out


def _stage_styles(mesh: MeshSpec, pp: int, force) -> dict[int, str]:
    """`force` on a pipelined mesh, keyed as for the whole mesh, as styles of the stage mesh
    (the mesh without "pp", whose dimensions keep their order)."""
    styles = styles_by_dim(mesh, force)
    if pp in styles and not isinstance(force, str):
        others = ", ".join(repr(n) for k, n in enumerate(mesh.names) if k != pp)
        raise ValueError(f"force gives the pipeline dimension {pp} ('pp') the style "
                         f"{styles[pp]!r}; 'pp' carries pipeline stages, so force only the "
                         f"other dimensions ({others})")
    zero = sorted({s for k, s in styles.items() if k != pp and s in ("zero1", "zero2")})
    if zero:
        raise ValueError(f"force asks for {', '.join(zero)} on a pipelined mesh; pipeline "
                         "stages do not shard optimizer state yet: use 'fsdp' (or 'data') "
                         "there, or a mesh without 'pp'")
    return {k - (k > pp): style for k, style in styles.items() if k != pp}


def _dim_index(mesh: MeshSpec, key) -> int:
    if isinstance(key, str) and key in mesh.names:
        return mesh.names.index(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < mesh.ndim:
        return key
    what = "names mesh dimension" if isinstance(key, str) else "has mesh dimension index"
    raise ValueError(f"force {what} {key!r}, which the mesh does not have; the mesh has "
                     f"{_dims(mesh)}: key force by one of those names or indices")


def _dims(mesh: MeshSpec) -> str:
    """"dimensions 0 ('dp', size 2) and 1 ('tp', size 4)"."""
    dims = [f"{k} ({n!r}, size {s})" for k, (n, s) in enumerate(zip(mesh.names, mesh.shape))]
    if len(dims) == 1:
        return f"dimension {dims[0]}"
    return f"dimensions {', '.join(dims[:-1])} and {dims[-1]}"


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
               beat: float | None = None) -> tuple[Plan, StrategyGraph]:
    """Build strategies, solve the ILP and describe the result.

    With a finite `beat` (seconds of a whole step: the fastest plan a search found so far),
    the ILP's linear relaxation is solved first (solver/ilp.py `relaxed_bound`): when no
    plan of this level can step LEVEL_GAP faster than `beat` it raises Outpaced, and when
    not even the relaxation fits the budget, NoFeasiblePlan (unless `diagnose`, which
    solves the ILP to say why), without the integer solves.

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
    report = Progress(options.progress)
    styles = styles_by_dim(mesh, options.force)  # a bad force fails before the work
    shape = "x".join(map(str, mesh.shape))
    report(f"strategies for {len(program.graph.nodes)} graph nodes on mesh {shape}")
    graph, cost = priced_level(program, mesh, options, recompute, reshard, accumulation)
    mode = options.reshard_after_forward
    freed = frees_after_forward(options, reshard)
    budget = options.memory_budget
    if budget is None:
        budget = mesh.profile.memory * (1 - mesh.profile.memory_reserve)
    kept = kept_storage(graph, program, storage, zero)
    if options.solver == "random":
        rng = random.Random(options.seed)
        drawn = random_choice(graph, cost, rng, kept)
        choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
        cost = cost.copy(reshard=resharding.choose(graph, cost, choice, budget, mode, rng))
        return describe(program, graph, mesh, cost, choice, memory_budget=budget,
                        options=options), graph
    forced, discouraged = allowed_strategies(graph, styles)
    for n, ks in kept.items():
        forced[n] = sorted(set(ks) & set(forced.get(n, ks))) or ks
    clusters = clustered(program, graph, fold_layers and not kept)
    report(f"solving: {len(graph.nodes)} nodes, "
           f"{sum(len(v.strategies) for v in graph.nodes.values())} candidate strategies, "
           f"{len(set(clusters.owner.values()))} decisions ({options.solver}, at most "
           f"{options.time_limit:g} s)")
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
    ilp_budget, priced = budget, cost
    # (a level's relaxation once a plan is found: penalties are no seconds of a step)
    relax = beat is not None and beat < float("inf") and not discouraged
    problem = priced_problem(graph, priced, clusters, forced, discouraged, relaxation=relax)
    if relax:
        try:
            floor = relaxed_bound(graph, priced, problem, budget, clusters, accumulation,
                                  options.time_limit) * accumulation
        except NoFeasiblePlan as e:
            if not diagnose:
                raise NoFeasiblePlan(str(e), "activations", True) from e
            floor = None  # the integer solve below says why
        if floor is not None and floor * (1 + LEVEL_GAP) >= beat:
            raise Outpaced(f"no plan recomputing {recompute or options.recompute or 'none'}"
                           f" over {accumulation} microbatch(es) steps under {floor:.4g} s")
    fastest = fastest if fastest is not None else []
    for attempt in range(RESOLVES + 1):
        try:
            sol = solve(graph, priced, memory_budget=ilp_budget, backend=options.solver,
                        time_limit=options.time_limit, gap=PLAN_GAP, forced=forced,
                        discouraged=discouraged, clustering=clusters,
                        unbounded_only=unbounded, fastest=fastest, problem=problem,
                        binding=attempt > 0)
        except NoFeasiblePlan as e:
            if bounds is not None and e.bound is not None:
                bounds.append(e.bound)
            if unbounded:
                raise
            if not diagnose:
                raise NoFeasiblePlan(str(e), "activations", True) from e
            raise infeasible(graph, priced, budget, forced, clusters) from e
        if bounds is not None and sol.bound is not None:
            bounds.append(sol.bound)
        choice = {n: graph.nodes[n].strategies[i] for n, i in sol.choice.items()}
        cost = priced.copy(reshard=resharding.choose(graph, priced, choice, budget,
                                                     mode if mode is not None else
                                                     (None if freed else False),
                                                     twin=clusters.twin))
        # a plan solved again is not described
        memory = exact_memory(graph, cost, choice, clusters.twin)
        over = sum(memory.values()) - budget
        if over <= budget * 1e-6 or attempt == RESOLVES:
            break
        ilp_budget -= over / 2 if attempt == 0 else over
    plan = describe(program, graph, mesh, cost, choice, sol, memory_budget=budget,
                    options=options, memory=memory, twin=clusters.twin)
    if plan.cost.peak_memory > budget * (1 + 1e-6):
        # the re-solves bring the exact peak within the budget: only the solver's numerics
        # can break this, and a plan over the budget must never reach the user as fitting
        raise RuntimeError(
            f"autopar: the {options.solver} solver returned a plan of "
            f"{plan.cost.peak_memory / 2**30:.3f} GiB per device for a budget of "
            f"{budget / 2**30:.3f} GiB (numerical trouble in the solver); this is a bug in "
            "autopar: please report it with the model's shapes and the mesh")
    found = alternatives(graph, cost, choice, forced=forced, discouraged=discouraged,
                         memory_budget=budget, peak=plan.cost.peak_memory, twin=clusters.twin)
    plan.alternatives = compact({program.params.get(n, n): rows for n, rows in found.items()})
    report(f"solved in {sol.solve_time:.1f} s: predicted step {plan.cost.step_time * 1e3:.1f} ms")
    return plan, graph


class Outpaced(Exception):
    """A level of the memory search none of whose plans can step faster than a plan found
    already (`solve_plan`'s `beat`)."""


def priced_level(program: TracedProgram, mesh: MeshSpec, options: PlanOptions,
                 recompute: str | None = None, reshard: bool = False, accumulation: int = 1
                 ) -> tuple[StrategyGraph, CostModel]:
    """The strategy graph of `program` on `mesh` (built once per program and mesh, for every
    level of a search) and its cost model with recomputation `recompute` (else the options'),
    parameters freed after forward (`reshard`, unless the options say) and `accumulation`
    microbatches (see solve_plan)."""
    placed = input_placement(mesh, options)
    key = (tuple(mesh.shape), placed)
    if key not in program.strategy_graphs:  # the same for every level of a search
        program.strategy_graphs.clear()  # one mesh's at a time (a mesh search tries several)
        program.strategy_graphs[key] = strat_pass.build(program, mesh.shape, placed, zero=True)
    graph = program.strategy_graphs[key]
    mode = recompute or options.recompute or "none"
    keep_user = options.recompute != "none"
    r = derived(program, ("recompute", id(graph), mode, keep_user),
                lambda: recompute_plan(program, graph, mode, keep_user=keep_user)) \
        if program.has_loss else NO_RECOMPUTE
    info = derived(program, ("info", id(graph)), lambda: node_infos(graph))
    # every level's model a copy of one per graph, mesh and settings: they share its
    # resharding prices (the entry holds the mesh, so its id names it while the entry lives)
    base = derived(program, ("cost", id(graph), id(mesh), options.optimizer,
                             options.bucket_bytes, options.precision),
                   lambda: (mesh, CostModel(mesh, options.optimizer, options.bucket_bytes,
                                            graph=graph, info=info,
                                            precision=options.precision)))[1]
    cost = base.copy(recompute=r, reshard=frozenset(
        n for n, v in graph.nodes.items() if v.kind == PARAM)
        if frees_after_forward(options, reshard) else (), accumulation=accumulation)
    if options.profile not in (None, False):
        cost = cost.copy(measured=profiler(options.profile).measure(graph, cost))
    return graph, cost


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
    candidates as separate tasks, with the same decisions."""
    options = options or PlanOptions()
    rounds = start_rounds(batch, options, accumulate)
    while not rounds.done:
        rounds = plan_round(trace_at, mesh, options, rounds, storage=storage, zero=zero)
    return rounds.result()


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
        counts = pipe.divisors(batch, batch) if batch else [1]
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
               zero: dict[str, int] | None = None) -> Rounds:
    """`rounds` after planning its next microbatch count (see `solve_accumulated`); raises
    NoFeasiblePlan where nothing can fit."""
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
    program = trace_at(m)
    found, error = list(rounds.found), rounds.error
    plain = False  # a plan fits at this count without recomputing more than levels[0]
    # Each level only adds work to every plan (parameters gathered again, ops recomputed):
    # the first level's lower bound bounds them all at this count.
    bounds: list[float] = []
    unbudgeted: list[dict[str, int]] = []  # each level's fastest plan (one graph per count)
    fastest = float("inf")  # of the plans found at this count, per microbatch
    for i, (level, reshard) in enumerate(levels):
        if i and bounds and bounds[0] * (1 + LEVEL_GAP) >= fastest:
            continue  # no plan at this level can be LEVEL_GAP faster than one that fits
        if found and level != levels[0][0] and \
                m * level_floor(program, mesh, options, level) * (1 + LEVEL_GAP) \
                >= min(f[0].cost.step_time for f in found):
            continue  # no plan recomputing this much can beat one that fits already
        # A budgeted level first solves its relaxation: no faster than a plan found (by
        # LEVEL_GAP), or not fitting at all, and its integer solves are skipped.
        best = min((f[0].cost.step_time for f in found), default=float("inf"))
        try:
            # When the fastest plan keeping every parameter gathered does not fit, freeing
            # (the next level) is where memory is found: no budgeted solve at this one.
            # Why nothing fits is worked out at the last level only (the others go on).
            plan, graph = solve_plan(program, mesh, options, storage=storage, zero=zero,
                                     recompute=level, reshard=reshard, accumulation=m,
                                     unbounded=not reshard and len(levels) > 1 and
                                     levels[1][1], diagnose=i == len(levels) - 1,
                                     bounds=bounds if i == 0 else None,
                                     fastest=unbudgeted,
                                     beat=best if i else None)
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
        found.append((accumulated(plan, m), graph, program, level))
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


def level_floor(program: TracedProgram, mesh: MeshSpec, options: PlanOptions,
                recompute: str) -> float:
    """Seconds of compute per microbatch below which no plan of `program` recomputing
    `recompute` goes (solver/ilp.py `compute_floor`)."""
    graph, cost = priced_level(program, mesh, options, recompute)
    return compute_floor(graph, cost, clustered(program, graph).twin)


# A level of the memory search (parameters freed after forward, recomputation) is not solved
# when the solver's bound or its compute floor says none of its plans can be this much faster
# than a plan already found: the step model is not that precise, and each level costs a solve
# (Llama-3 70B on (8, 8) under the H100's memory: selective recomputation would gain 0.14% for
# 7 s of planning; Llama-3 8B over 32 x 2 H100s: full recomputation's floor is 0.08% below
# the plan found, and its solve took 7 s).
LEVEL_GAP = 0.02

# A plan whose peak is within this share of the budget is held back by memory: recomputation
# (which frees activations) may let the solver choose faster placements, so it is tried too.
BINDING = 0.9


def hidden_seconds(cost: CostModel, total: Split, side: dict[tuple[str, str], float]
                   ) -> dict[str, float]:
    """Seconds of each collective kind hidden under compute (cost.step_seconds): each pass's
    hidden seconds shared among the kinds beside it in proportion to their seconds there."""
    _, hidden_f, hidden_b = step_seconds(total, cost.overlap, cost.edge_share())
    out: dict[str, float] = defaultdict(float)
    for phase, hidden in (("forward", hidden_f), ("backward", hidden_b)):
        there = {k: t for (k, p), t in side.items() if p == phase and t}
        whole = sum(there.values())
        for k, t in there.items():
            out[k] += hidden * t / whole
    return {k: t for k, t in out.items() if t}


def accumulated(plan: Plan, m: int) -> Plan:
    """`plan` (priced for one microbatch) as a step of `m` microbatches: compute and
    collectives m times, gradient synchronization once; memory as for one microbatch."""
    if m == 1:
        return plan
    cost = plan.cost
    comm = {k: v * (1 if k == "gradient_sync" else m) for k, v in cost.communication.items()}
    # what hid under one microbatch's compute hides under each one's (gradient
    # synchronization under the last one's backward)
    hidden = {k: v * (1 if k == "gradient_sync" else m) for k, v in cost.hidden.items()}
    compute = cost.compute * m
    priced = dataclasses.replace(cost, compute=compute, compute_forward=cost.compute_forward * m,
                                 communication=comm, hidden=hidden,
                                 step_time=compute + sum(comm.values()) - sum(hidden.values()))
    return dataclasses.replace(plan, cost=priced, accumulation=m)


def input_placement(mesh: MeshSpec, options: PlanOptions) -> Placements | None:
    """Where per-rank inputs arrive: dimension 0 split over the named mesh dimensions (None:
    global inputs)."""
    if not options.per_rank_inputs:
        return None
    for name in options.per_rank_inputs:
        if name not in mesh.names:
            raise ValueError(f"per_rank_inputs names mesh dimension {name!r}; the mesh has "
                             f"{', '.join(mesh.names)}")
    if len(set(options.per_rank_inputs)) != len(options.per_rank_inputs):
        raise ValueError(f"per_rank_inputs names a dimension twice: {options.per_rank_inputs}")
    return tuple(Shard(0) if n in options.per_rank_inputs and s > 1 else R
                 for n, s in zip(mesh.names, mesh.shape))


def kept_storage(graph: StrategyGraph, program: TracedProgram,
                 storage: dict[str, Placements] | None,
                 zero: dict[str, int] | None = None) -> dict[str, list[int]]:
    """For each parameter node, the indices of the strategies that keep it stored at
    `storage[name]` (at ZeRO stage `zero[name]`, for a program that trains)."""
    if not storage:
        return {}
    out = {}
    for n, v in graph.nodes.items():
        if v.kind != PARAM:
            continue
        want = storage[program.params[n]]
        stage = (zero or {}).get(program.params[n], 0) if program.has_loss else 0
        ks = [k for k, s in enumerate(v.strategies) if s.output == tuple(want)
              and s.zero == stage]
        if not ks:
            raise ValueError(f"parameter {program.params[n]} cannot stay stored at "
                             f"{fmt(want)} in this program")
        out[n] = ks
    return out


def profiler(profile):
    """The op profiler `profile` asks for (True: time ops on this machine)."""
    if profile is True:
        from .profile import OpProfiler
        return OpProfiler()
    return profile


def describe(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
             choice: dict[str, Strategy], sol: Solution | None = None, *,
             memory_budget: float | None = None, options: PlanOptions | None = None,
             memory: dict[str, float] | None = None,
             twin: dict[str, str] | None = None) -> Plan:
    """The Plan for a complete assignment of strategies (from the solver or given);
    `memory`, when given, is its `exact_memory`. Twins (`twin`: the clustering's, see
    solver/ilp.py `price_key`) choosing alike are priced once, as in the ILP."""
    index = {n: graph.nodes[n].strategies.index(s) for n, s in choice.items()}
    times: dict[tuple, tuple[float, float]] = {}  # by price key and strategy

    def compute_times(v: SNode, s: Strategy) -> tuple[float, float]:
        key = (price_key(cost, twin, v.name), index[v.name])
        if key not in times:
            times[key] = cost.compute_times(v, s)
        return times[key]

    moved: dict[tuple, list] = {}  # by edge key and placements

    def edge_collectives(e: Edge, src, dst) -> list:
        key = (edge_key(cost, twin, e), src, dst)
        if key not in moved:
            moved[key] = cost.edge_collectives(graph, graph.nodes[e.consumer], e.slot, src, dst)
        return moved[key]

    ops, collectives = [], []
    compute = forward = 0.0
    comm: dict[str, float] = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0,
                              "all_to_all": 0.0, "gradient_sync": 0.0}
    memory = dict(memory) if memory is not None else exact_memory(graph, cost, choice, twin)
    side: dict[tuple[str, str], float] = defaultdict(float)  # (kind, pass): seconds beside
    for v in graph.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            for kind, k, nbytes, t in cost.grad_sync_steps(v, s.output, s.zero):
                comm["gradient_sync"] += t
                if kind != "all_gather":
                    side["gradient_sync", "backward"] += t
                collectives.append(Collective(kind, k, nbytes, t, "gradient sync",
                                              program.params[v.name]))
            fwd, bwd = compute_times(v, s)  # mixed precision's casts
            compute += fwd + bwd
            forward += fwd
            continue
        if v.kind == INPUT:
            continue
        fwd, bwd = compute_times(v, s)
        ct = fwd + bwd
        compute += ct
        forward += fwd
        if v.kind == OP:
            out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            ops.append(OpEntry(v.name, v.op, [fmt(p) for p in s.inputs], out, 0, ct, v.source,
                               v.module, why_replicated(v, s, mesh)))
        for slot, (u, idx) in enumerate(v.inputs):
            src, dst = choice[u].out(idx), s.inputs[slot]
            beside = graph.nodes[u].kind == PARAM
            for kind, k, nbytes, t, phase in edge_collectives(Edge(v.name, slot, u, idx),
                                                              src, dst):
                collectives.append(Collective(kind, k, nbytes, t, phase, v.name))
                comm[kind] += t
                if beside:
                    side[kind, "forward" if phase == "forward" else "backward"] += t
    if graph.loss is not None:  # a loss that must be gathered (not a pending sum) costs here
        name, idx = graph.loss
        comm["all_gather"] += loss_sink_time(cost, graph.nodes[name], choice[name].out(idx), idx)
    hidden = hidden_seconds(cost, plan_split(graph, cost, index, twin), side)
    step_time = compute + sum(comm.values()) - sum(hidden.values())
    inputs = []
    for name in program.inputs[:len(program.inputs) - (1 if program.has_loss else 0)]:
        uses = [v.strategies[index[v.name]].inputs[i] for v in graph.nodes.values()
                for i, (u, _) in enumerate(v.inputs) if u == name]
        inputs.append(uses[0] if uses else choice[name].output)
    params = {program.params[n]: choice[n].output for n, v in graph.nodes.items()
              if v.kind == PARAM}
    strategies = {n: ([fmt(p) for p in s.inputs],
                      fmt(s.output) if not graph.nodes[n].multi_output
                      else [fmt(o) for o in s.output])
                  for n, s in choice.items() if graph.nodes[n].kind != CONSTANT}
    return Plan(mesh, inputs, params, ops, collectives,
                PlanCost(step_time, compute, comm, memory,
                         sol.objective if sol else plan_time(graph, cost, index),
                         memory_budget=memory_budget or 0.0, compute_forward=forward,
                         precision=cost.precision.name, optimizer=cost.optimizer.name,
                         compute_source="measured" if cost.measured else "roofline",
                         hidden=hidden),
                strategies, fingerprint(graph), sol.solve_time if sol else 0.0,
                sol.backend if sol else "given", graph.unsupported,
                options=options or PlanOptions(), recompute=cost.recompute,
                resharded=sorted(program.params.get(n, n) for n in cost.reshard),
                zero={program.params[n]: s.zero for n, s in choice.items()
                      if graph.nodes[n].kind == PARAM and s.zero})


def why_replicated(node: SNode, strategy: Strategy, mesh: MeshSpec) -> str:
    """Why `node` runs whole on every rank under `strategy` ("" when it shards, or the mesh
    is one device): its candidates' reason (no rule, indivisible shapes, ...) or, when it
    had sharded candidates, that replicating is cheaper."""
    if mesh.size == 1 or not replicated(strategy):
        return ""
    return node.replicated_only or CHEAPER


def choice_from_plan(plan: Plan, graph: StrategyGraph) -> dict[str, Strategy]:
    """The strategies a (loaded) plan prescribes, matched to a freshly traced graph."""
    if plan.graph_fingerprint != fingerprint(graph) or plan.submesh_shape != graph.mesh_shape:
        raise ValueError(
            "this plan was made for another model, input shape or mesh (graph fingerprint "
            f"{plan.graph_fingerprint}, mesh {plan.mesh.shape}; this model gives "
            f"{fingerprint(graph)} on mesh {graph.mesh_shape}). Re-plan with autopar.plan.")
    choice = {}
    for name, v in graph.nodes.items():
        if v.kind == CONSTANT:
            choice[name] = v.strategies[0]
            continue
        want = plan.strategies[name]
        stage = plan.zero.get(v.param_name, 0) if v.kind == PARAM else 0
        for s in v.strategies:
            out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            if [fmt(p) for p in s.inputs] == list(want[0]) and out == want[1] and \
                    s.zero == stage:
                choice[name] = s
                break
        else:
            raise ValueError(f"the plan's strategy for node {name} ({v.op}) is not a valid "
                             f"strategy here: inputs {want[0]} output {want[1]}")
    return choice


def _local(shape, placements, mesh: MeshSpec):
    return local_shape(shape, placements, mesh.shape)



# -- pipelined plans (a "pp" mesh dimension) -----------------------------------------------------

@planning
def solve_pipeline_plan(trace_at, batch: int, mesh: MeshSpec,
                        options: PlanOptions | None = None, running: Plan | None = None
                        ) -> Plan:
    """Plan a model over a mesh with a "pp" dimension: cut it into pipeline stages
    (solver/stages.py), then solve each stage's intra-op ILP on the other dimensions, identical
    stages once, each stage's inputs fixed to the placements the previous stage produces.

    `trace_at(m)` returns the model traced at the microbatch size `batch // m`. Without
    `options.microbatches` the model is first traced at the whole batch to choose it.

    With `running`, the plan of a pipelined model already running, the model (traced in other
    modules' modes, eval between training steps, or at another batch size) is planned on
    `running`'s stages and schedule, over `options.microbatches` (else `running`'s), its
    parameters stored where `running` stores them.
    """
    options = options or PlanOptions()
    if options.per_rank_inputs:
        raise ValueError("per-rank inputs are not supported with a pp mesh dimension yet: pass "
                         "the global batch on every rank")
    if options.recompute not in (None, "none"):
        raise ValueError(f"recompute={options.recompute!r} is not supported with a pp mesh "
                         "dimension yet: pipelined plans keep their activations (more "
                         "microbatches shrink them); drop recompute= or the pp dimension")
    kept = running.pipeline if running is not None else None
    microbatches = options.microbatches
    if kept is not None:
        microbatches = microbatches or kept.microbatches
    schedule, virtual_stages, solver = options.schedule, options.virtual_stages, options.solver
    memory_budget, time_limit = options.memory_budget, options.time_limit
    optimizer, precision = options.optimizer, options.precision
    profile = profiler(options.profile) if options.profile not in (None, False) else None
    loss_reduction = options.loss_reduction
    pp = mesh.pipeline_dim
    p = mesh.shape[pp]
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise pipe.StageError(
            f"the batch of {batch} does not split into {microbatches} microbatches; choose a "
            "divisor of the batch (" + ", ".join(map(str, pipe.divisors(batch, batch))) + ")")
    sub = mesh.without(pp)
    backend = "HIGHS" if solver == "random" else solver
    budget = memory_budget if memory_budget is not None else \
        mesh.profile.memory * (1 - mesh.profile.memory_reserve)
    link = mesh.link(pp)
    styles = _stage_styles(mesh, pp, options.force)
    start = time.perf_counter()

    m0 = microbatches or 1
    program = trace_at(m0)
    if not program.has_loss:
        raise ValueError("a pipelined plan trains through step(); pass loss_fn= (pipelined "
                         "inference alone is not supported)")
    # A schedule runs the batch as microbatches: only where they add up to the whole batch.
    why = split_problem(trace_at(1), microbatches or 2, loss_reduction=loss_reduction) \
        if batch > 1 and microbatches != 1 else ""
    if why and microbatches is not None:
        raise ValueError(f"microbatches={microbatches}: a pipeline schedule would not compute "
                         f"what the whole batch does: {why}. Pass microbatches=1, or plan "
                         "without a pp mesh dimension")
    if why:
        microbatches = 1
    graph = strat_pass.build(program, sub.shape)
    cost = _stage_cost(sub, graph, optimizer, precision, profile, options.bucket_bytes)
    blocks = layer_blocks(program, graph)
    if kept is not None:
        if blocks.names != kept.blocks:
            raise ValueError("the model traces into other layer blocks in these modes "
                             f"({blocks.names} vs {kept.blocks})")
        best = pipe.StageSolution(kept.schedule, microbatches, kept.virtual_stages,
                                  list(kept.cuts), 0.0, [], [], [])
    else:
        priced = pipe.price_blocks(graph, cost, blocks.of_node, blocks.names, link,
                                   backend=backend, time_limit=time_limit)
        best = pipe.choose(priced, p, batch, batch // m0, budget, microbatches=microbatches,
                           schedule=schedule, virtual_stages=virtual_stages,
                           overlap=cost.overlap)
    m, v, sched = best.microbatches, best.virtual_stages, best.schedule
    if m != m0:
        program = trace_at(m)
        graph = strat_pass.build(program, sub.shape)
        cost = _stage_cost(sub, graph, optimizer, precision, profile, options.bucket_bytes)
        again = layer_blocks(program, graph)
        if again.names != blocks.names:
            raise RuntimeError("the model traces into different layer blocks at the microbatch "
                               f"size ({again.names} vs {blocks.names})")
        blocks = again
    # every microbatch draws the whole batch's random numbers (solver/stages.py), and adds
    # its gradients to those of the microbatches before it
    cost = cost.copy(accumulation=m)
    num_stages = p * v
    stage_of = blocks.stage_of(best.cuts, num_stages)

    # Intra-op per stage, in order: a stage's inputs keep the placements they were produced in.
    worst = max(pipe.in_flight(sched, p, m, v, r) for r in range(p))
    scaled = pipe.activation_scaled(cost, worst)
    rng = random.Random(options.seed)
    draw = (lambda g: random_choice(g, cost, rng)) if solver == "random" else None
    choice: dict[str, Strategy] = {}
    cache: dict = {}
    stages = []
    for s in range(num_stages):
        members = [n for n in graph.nodes if stage_of.get(n) == s]
        g = pipe.subgraph(graph, members, choice)
        forced, discouraged = allowed_strategies(g, styles) if styles else (None, None)
        if running is not None:  # parameters stay where the running plan stores them
            stored = kept_storage(g, program, {n: tuple(pl) for n, pl in
                                               running.parameters.items()}, running.zero)
            forced = dict(forced or {})
            for n, ks in stored.items():
                forced[n] = sorted(set(ks) & set(forced.get(n, ks))) or ks
        try:
            picked = pipe.solve_subgraph(g, scaled, cache,
                                         memory_budget=pipe.stage_budget(budget, v),
                                         backend=backend, time_limit=time_limit,
                                         forced=forced, discouraged=discouraged, draw=draw,
                                         program=program.graph_module)
        except NoFeasiblePlan:
            bounds = [0, *best.cuts, len(blocks.names)]
            names = blocks.names[bounds[s]:bounds[s + 1]]
            raise NoFeasiblePlan(
                f"pipeline stage {s} ({', '.join(names)}) fits no plan within "
                f"{pipe.stage_budget(budget, v) / 2**30:.2f} GiB per device with {worst:g} "
                "microbatches in flight; use more pp ranks or more microbatches") from None
        inside = set(members)  # boundary copies of earlier ops carry no strategy of theirs
        choice.update({n: st for n, st in picked.items()
                       if n in inside or graph.nodes[n].kind != OP})
        stages.append((g, picked))
    for name, node in graph.nodes.items():
        choice.setdefault(name, node.strategies[0])  # unused parameters and inputs

    base = describe(program, graph, sub, cost, choice, memory_budget=budget, options=options)
    dims = [k for k in range(mesh.ndim) if k != pp]
    ops = [dataclasses.replace(o, stage=stage_of.get(o.name, 0)) for o in base.ops]
    collectives = [Collective(c.kind, dims[c.mesh_dim] if c.mesh_dim < len(dims) else pp,
                              c.bytes, c.time, c.phase, c.at) for c in base.collectives]
    priced = pipe.price_pipeline(graph, cost, stages, stage_of, choice, link, sched, p, m, v)
    collectives += [Collective("p2p", pp, nbytes, t, phase, u)
                    for u, nbytes, t, phase in priced.sends]
    stage_time, held, rank_memory = priced.stage_time, priced.held, priced.rank_memory
    total, compute, comm = priced.step, priced.compute, priced.communication
    peak = max(rank_memory, key=lambda d: sum(d.values()))
    pipeline = PipelinePlan(pp, sched, m, v, batch, blocks.names, best.cuts,
                            pipe.bubble_fraction(sched, p, m, v), stage_time, held,
                            rank_memory, loss_reduction)
    return Plan(mesh, base.inputs, base.parameters, ops, collectives,
                _pipeline_cost(base.cost, total, compute, comm, peak, best.objective,
                               priced.hidden),
                base.strategies,
                base.graph_fingerprint, time.perf_counter() - start,
                "random" if draw else solver.upper(), base.unsupported_ops, pipeline,
                options=options)


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


def _stage_cost(sub: MeshSpec, graph: StrategyGraph, optimizer, precision, profile,
                bucket_bytes: float) -> CostModel:
    # a stage's program gathers its FSDP parameters in buckets of its own, prefetched within
    # the stage (passes/rewrite.py `stage_of`): priced beside compute, as without stages
    cost = CostModel(sub, optimizer, bucket_bytes, graph=graph, precision=precision)
    if profile is not None:
        cost = cost.copy(measured=profile.measure(graph, cost))
    return cost
