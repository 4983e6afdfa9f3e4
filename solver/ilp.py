"""Intra-op ILP: one strategy per node, minimum predicted step time, memory within budget.

Sets
  V        nodes of the strategy graph; S_v the candidate strategies of v
  E        edges (u -> v, input slot i); A_e the placements u's strategies give the edge's
           tensor, B_e the placements v's strategies require of it
Variables
  x[v,s] in {0,1}   node v runs strategy s
  y[e,a,b] in [0,1] edge e carries placement a into required placement b
Constraints
  sum_s x[v,s] = 1                                   (every node picks one strategy)
  sum_b y[e,a,b] = sum_{s in S_u: out_e(s) = a} x[u,s]   (transport, producer side)
  sum_a y[e,a,b] = sum_{s in S_v: in_e(s) = b}  x[v,s]   (transport, consumer side)
  g >= sum_{e in B} sum_{a,b} g[e,a,b] y[e,a,b]     for each FSDP bucket B (passes/gathers.py)
  sum_v sum_s m[v,s] x[v,s] + sum_e sum_{a,b} m[e,a,b] y[e,a,b] + g <= M
                                                     (bytes per device; M = memory budget)
Objective (seconds; scaled to microseconds for the solver)
  min sum_v sum_s t[v,s] x[v,s] + sum_e sum_{a,b} c[e,a,b] y[e,a,b]
where t is compute (+ gradient synchronization for parameters), c the resharding time of the
edge (forward and backward), m[v,s] parameter/gradient/optimizer bytes and what autograd
keeps of v's own outputs, m[e,a,b] what it keeps of the edge's tensor as resharded from a to b,
g[e,a,b] the FSDP gathers in flight when the edge gathers a parameter whole from its storage
shard, and g the largest bucket's (solver/memory.py; an edge that re-uses a parameter gathered
for another use in its bucket is counted again: g bounds the plan's from above).
Overlap (hardware whose collectives run beside compute, cost.Split): each price splits into
critical seconds (forward f, backward b) and seconds beside compute (side, forward sf and
backward sb); with q the share of side seconds nothing hides (CostModel.edge_share)
  min sum crit * x + E_f + E_b,   E_p >= sum (s_p - c_p) * x,  E_p >= q * sum s_p * x,  E_p >= 0
for each pass p: each pass takes the longer of its critical path and its side collectives.
It is solved relaxed first (E_p = q * sum s_p folded into the prices, no rows: a lower
bound, exact when the plan's side seconds fit under its critical ones). When they do not, it
is solved again (`_refined`): with the rows, on small problems; then with E_p = w * sum s_p for
a weight w between q and 1 (SCALARIZED), each plan priced exactly and the fastest kept.
With x integral the transport constraints force y[e,a,b] = [out_e = a][in_e = b], so y may be
continuous. An edge whose producer (or consumer) has one placement class costs a constant per
consumer (producer) strategy and is folded into t. The loss must reach every rank: its node pays
the resharding to Replicate, except from a pending sum (see `loss_sink_time`).

Where it is built: t and c per node and edge in solver/plan_prices.py, aggregated onto owners
(with m and g) in solver/owner_problem.py, the columns and rows in solver/ilp_rows.py (one
function per family, in this order), solved and refined here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

from autopar.passes.cluster import Clustering, identity
from autopar.passes.strategies import StrategyGraph

from . import ilp_rows, mip
from .assignments import greedy, random_choice
from .cost import INFEASIBLE, NO_TIME, CostModel, Split, step_seconds
from .ilp_rows import GIB, IlpProgram
from .memory import draw_bytes, plan_memory
from .owner_problem import PENALTY, OwnerProblem, priced_problem
from .plan_prices import (
    Edge,
    compute_floor,
    edge_key,
    edges,
    loss_sink_time,
    node_costs,
    node_splits,
    plan_split,
    plan_time,
    price_key,
)

__all__ = [  # (what other modules import from here, with what is defined here)
    "INFEASIBLE", "Edge", "compute_floor", "edge_key", "edges", "greedy", "loss_sink_time",
    "node_costs", "node_splits", "plan_memory", "plan_split", "plan_time", "price_key",
    "priced_problem", "random_choice", "NoFeasiblePlan", "Solution", "relaxed_bound",
    "side_bound", "solve",
]

BACKENDS = ("HIGHS", "SCIP", "CBC", "CP_SAT")


class Outpaced(Exception):
    """Plans none of which can step faster than a plan found already: a level of the memory
    search (autopar/planner.py `solve_plan`'s `beat`), or a mesh a search's other mesh
    beats (autopar/pipeline_plan.py `relaxed_step`)."""

    @classmethod
    def by_relaxed_pipeline(cls, floor: float, beat: float) -> "Outpaced":
        """A pipelined mesh whose relaxed step, `floor` seconds, is no faster than `beat`,
        another mesh's plan."""
        return cls(f"not even its relaxed pipeline steps under {floor:.4g} s, where another "
                   f"mesh's plan steps in {beat:.4g} s")


class NoFeasiblePlan(RuntimeError):
    """No assignment of strategies satisfies the memory budget. `dominant` names what
    dominates the smallest peak any plan reaches ("activations", "parameters", ...), when
    solver/diagnose.py found out; `activations_matter`, whether that peak would fit without
    its activations."""

    def __init__(self, message: str, dominant: str | None = None,
                 activations_matter: bool | None = None, bound: float | None = None):
        super().__init__(message)
        self.dominant = dominant
        self.bound = bound  # Solution.bound of the problem, where the solve got that far
        # whether fewer activations alone could make a plan fit (recomputation, microbatches)
        self.activations_matter = dominant == "activations" if activations_matter is None \
            else activations_matter


@dataclass
class Solution:
    """The chosen strategy index per node and what the solver reported."""

    choice: dict[str, int]
    objective: float          # seconds, as the solver computed it
    solve_time: float         # seconds spent in the solver
    backend: str
    status: str
    num_variables: int
    num_constraints: int
    # Seconds no plan of the problem steps faster than, whatever the budget: the solver's
    # proven bound on the optimum without the budget, relaxed where collectives overlap
    # (every side second hidden but the unhidden share; within the tie-break's 0.1% of side
    # seconds). None where unknown (penalized strategies, a solve stopped by its time limit).
    bound: float | None = None
    # With overlap: the plan's prices summed by where they run (cost.Split), as solved.
    split: Split | None = None


def solve(graph: StrategyGraph, cost: CostModel, memory_budget: float | None = None,
          backend: str = "HIGHS", time_limit: float = 60.0, gap: float = 1e-4,
          forced: dict[str, list[int]] | None = None,
          discouraged: dict[str, list[int]] | None = None,
          clustering: Clustering | None = None, minimize: str = "time",
          unbounded_only: bool = False, exact_overlap: bool = False,
          fastest: list[dict[str, int]] | None = None, problem=None,
          binding: bool = False) -> Solution:
    """Solve the intra-op ILP. `forced` restricts nodes to the listed strategy indices;
    `discouraged` strategies carry a penalty of PENALTY seconds each (reported objectives
    exclude it); `clustering` (passes.cluster) says which nodes share decisions.
    `minimize="memory"` minimises bytes per device instead of seconds (the objective is then
    in bytes; no budget applies): the smallest peak any plan reaches. Raises NoFeasiblePlan
    when no plan fits the budget (solver/diagnose.py says why).

    Under a budget the ILP is solved without it first; only when that plan does not fit (its
    exact memory, solver/memory.py `plan_memory`) is it solved again under the budget, or,
    with `unbounded_only`, NoFeasiblePlan raised (activations mattering: a search that has
    another way to free memory next).

    On hardware whose collectives overlap compute (cost.overlap) the objective is the step of
    cost.step_seconds: relaxed first, exactly only when needed (see `_refined`);
    `exact_overlap` solves with the exact rows from the start.

    `fastest` carries the plans solved without the budget across the levels of a memory
    search (the same graph, each level adding work or freeing memory): this solve appends
    its own, and when the last one does not fit at this problem's prices either, the budget
    is taken to bind and solved under at once (the same plan comes out; only the solve
    without it, and the bound it gives, are skipped).

    `problem`: the ILP's prices for these graph, cost, clustering, forced and discouraged
    (`priced_problem`), to solve them again under another budget without pricing again.
    `binding`: the caller knows the budget binds (a plan under a larger one did not fit):
    solved under it at once, as when `fastest` shows it."""
    if minimize not in ("time", "memory"):
        raise ValueError(f"minimize must be 'time' or 'memory', not {minimize!r}")
    backend = backend.upper()
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend}; choose from {BACKENDS}")
    c = clustering or identity(graph)
    if problem is None:
        problem = priced_problem(graph, cost, c, forced, discouraged)
    binds = not unbounded_only and memory_budget is not None and minimize == "time" and (
        binding or bool(fastest) and plan_memory(graph, cost, fastest[-1], c.twin) > memory_budget)
    return _solve(_Instance(graph, cost, problem, c, forced, discouraged),
                  _Settings(memory_budget, backend, time_limit, gap, minimize, unbounded_only,
                            exact_overlap, binds=binds), fastest)


def relaxed_bound(graph: StrategyGraph, cost: CostModel, problem: OwnerProblem,
                  memory_budget: float | None, clustering: Clustering | None = None,
                  accumulation: int = 1, time_limit: float = 60.0) -> float:
    """Seconds per microbatch below which no plan of `problem` (`priced_problem(...,
    relaxation=True)`) that fits `memory_budget` steps, `accumulation` microbatches a step
    (the step over the count): the
    optimum of its linear relaxation with each pass's exact overlap rows (the objective
    `cost.step_seconds` takes, which the relaxed solves drop), gradient synchronization
    counted once per step, and each use of a parameter freed after forward priced freed or
    kept gathered, each at its own seconds and bytes (`OwnerProblem.kept_gathered`, when
    `problem` has it: solver/resharding.py keeps gathered what the budget holds after the
    ILP). Raises NoFeasiblePlan when not even the relaxation fits the budget; 0 when the
    time limit passes first. `problem` must carry no penalties (`discouraged`): they are no
    seconds of a step.

    Over m microbatches a step takes m x compute, m x the collectives not hidden, but
    gradient synchronization once (planner `accumulated`, which shares each pass's hidden
    seconds among its collectives by their seconds): with C the backward's critical
    seconds, S its side ones of which G synchronize gradients (N = S - G) and E >= S - C,
    E >= qS, E >= 0 its exposed ones (cost.step_seconds), the step over m is the forward's
    and C - (m-1)/m x the critical synchronization, plus E (N + G/m) / S, which is at least
    (N + G/m) - C, q (N + G/m), (S - C) / m and 0 (as E >= 0 and 1/m <= (N + G/m) / S <= 1):
    the relaxation's objective counts (m-1)/m of the synchronization less, its rows count
    G at 1/m against the whole C, and backward's exposed column is also bounded by
    (S - C) / m. On Llama-3 70B levels over 1,024 H100s it is 1-7% below the plans found
    (16% at one), in 0.05-0.5 s where a level's integer solves take 1-9 s."""
    if problem.sync is None:
        raise ValueError("relaxed_bound needs the problem priced with relaxation=True")
    problem = problem.kept_gathered or problem
    return _solve(_Instance(graph, cost, problem, clustering or identity(graph)),
                  _Settings(memory_budget, "HIGHS", time_limit, 0.0, "time", False, True,
                            relax=max(1, accumulation))).objective


@dataclass(frozen=True)
class _Instance:
    """What one solve works on: the graph and cost model, their ILP prices
    (`priced_problem`), the clustering that priced them, and the strategies `forced` and
    `discouraged` in them."""

    graph: StrategyGraph
    cost: CostModel
    problem: OwnerProblem
    clustering: Clustering
    forced: dict[str, list[int]] | None = None
    discouraged: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class _Settings:
    """How one solve runs: `solve`'s arguments of the same names, and

    - `fallback`: without it a solve that runs out of time before any plan returns None
      instead of the greedy plan (the re-solves of `_refined`, whose caller keeps the plan it
      has then);
    - `side_share`: the share of side seconds the objective prices without the exact rows
      (default: the unhidden share, the relaxation; 1: every side second, as if nothing
      overlapped);
    - `binds`: the budget is known to bind (a re-solve after the fastest plan did not fit):
      solved under it at once;
    - `relax` (a step's microbatch count m): the linear relaxation instead (see `_solve`)."""

    memory_budget: float | None
    backend: str
    time_limit: float
    gap: float
    minimize: str = "time"
    unbounded_only: bool = False
    exact_overlap: bool = False
    fallback: bool = True
    side_share: float | None = None
    binds: bool = False
    relax: int = 0


def _solve(task: _Instance, how: _Settings,
           fastest: list[dict[str, int]] | None = None) -> Solution | None:
    """`solve` on a built problem: the program built (solver/ilp_rows.py), solved without the
    budget first where that may do, then under it, and refined where collectives overlap
    (`_refined`). `fastest`: see `solve`.

    With `how.relax` (a step's microbatch count m), the linear relaxation (no integral
    columns) is solved under the budget instead, without the tie-break, each strategy's
    gradient synchronization counted 1/m (a step synchronizes once: planner `accumulated`),
    and returned as a Solution without a choice whose objective is its optimum in seconds:
    below the step of every plan of the problem, over m (see `relaxed_bound`); 0 when the
    time limit passes first."""
    graph, cost, problem, budget = task.graph, task.cost, task.problem, how.memory_budget
    start = time.perf_counter()
    obj = ilp_rows.objective(problem, cost, how.minimize, how.exact_overlap, how.side_share,
                             how.relax)
    ilp = ilp_rows.build(problem, obj, how.exact_overlap, how.backend)
    hint = None
    if how.backend != "HIGHS":  # a feasible start (HiGHS is given none: see solver/mip.py)
        choice = greedy(graph, cost)
        hint = {var: float(k == choice[o]) for o, row in ilp.x.items()
                for k, var in enumerate(row)}
    drawn = draw_bytes(graph, cost)  # a constant of the graph: off the budget

    def run() -> tuple[Solution | None, float]:
        return _run(task, how, ilp, hint, start)

    if how.relax:
        if budget is not None and budget != float("inf"):
            ilp_rows.budget_row(ilp, problem, budget, drawn)
        return run()[0]
    if budget is None or obj.by_memory or budget == float("inf"):
        sol, proven = run()
        bound = _lower_bound(task, how, sol, proven)
        return _bounded(_refined(task, how, ilp, sol, False), bound)
    bound = None
    if not how.binds:
        # Without the budget first: several times faster, and when that plan fits, no plan
        # that fits is faster.
        sol, proven = run()
        if sol is None:  # out of time without a plan, and no fallback asked for
            return None
        bound = _lower_bound(task, how, sol, proven)
        if fastest is not None:
            fastest.append(sol.choice)
        peak = plan_memory(graph, cost, sol.choice, task.clustering.twin)
        if peak <= budget:
            return _bounded(_refined(task, how, ilp, sol, False), bound)
    if how.unbounded_only:
        raise NoFeasiblePlan(f"the fastest plan ({peak / 2**30:.3f} GiB per device) does not "
                             f"fit the budget of {budget / 2**30:.3f} GiB",
                             "activations", True, bound)
    memory_row = ilp_rows.budget_row(ilp, problem, budget, drawn)
    try:
        sol = run()[0]
        over = plan_memory(graph, cost, sol.choice, task.clustering.twin) - budget
        if over > 0 and not sol.status.startswith("greedy"):
            # The solver accepts rows violated within its feasibility tolerance (HiGHS: 1e-7
            # in the row's units): on a budget of a few MB a plan 256 bytes over it came
            # back. Solved again with the row that much tighter, twice over.
            ilp.prog.row_upper[memory_row] = (budget - drawn - 2 * over) * GIB
            sol = run()[0]
    except NoFeasiblePlan as e:
        e.bound = bound
        raise
    return _bounded(_refined(task, how, ilp, sol, True), bound)


def _run(task: _Instance, how: _Settings, ilp: IlpProgram, hint: dict | None,
         start: float) -> tuple[Solution | None, float]:
    """Solve the program as it stands: the Solution (the greedy plan when the time limit
    passes before any, or None without `how.fallback`; without a choice for a relaxation),
    and the solver's bound on its optimum (scaled; its objective where it reports none, 0
    where it found nothing): with a relative gap its plan may be that much above it."""
    prog, obj, backend = ilp.prog, ilp.objective, how.backend
    # HiGHS's presolve doubles the root's work on these problems and never shrinks them
    # (Llama-3 70B on (8, 8) under a binding budget: 8.7 s with it, 4.7 s without, same
    # optimum).
    # A relaxation is given RELAX_SECONDS without presolve, then the rest of its time with it.
    first = min(how.time_limit, RELAX_SECONDS) if how.relax else how.time_limit
    with silenced_stdout():
        try:
            result = mip.solve(prog, backend, first, how.gap, hint, "presolve = off")
        except mip.SolverTrouble:
            # Without presolve HiGHS ends some problems in an unknown state (the relaxation
            # of a Llama-3 70B level over 512 x 2 H100s, gradients priced in float32); with
            # it they solve
            result = mip.solve(prog, backend, how.time_limit, how.gap, hint, "")
        else:
            if result.status == mip.NO_SOLUTION and first < how.time_limit:
                result = mip.solve(prog, backend, how.time_limit - first, how.gap, hint, "")
    elapsed = time.perf_counter() - start
    sizes = (prog.num_variables, prog.num_constraints)
    if result.status == mip.NO_SOLUTION:
        if how.relax:  # out of time: no bound known
            return Solution({}, 0.0, elapsed, backend, "relaxed (time limit)", *sizes), 0.0
        # the time limit passes before any plan: take the greedy one
        if not how.fallback:
            return None, 0.0
        choice = greedy(task.graph, task.cost, task.forced)
        return Solution(choice, plan_time(task.graph, task.cost, choice), elapsed, backend,
                        "greedy (time limit)", *sizes), 0.0
    if result.status == mip.INFEASIBLE:
        raise NoFeasiblePlan(f"no plan fits the memory budget of {how.memory_budget:.0f} "
                             "bytes per device" if how.memory_budget is not None else
                             "no plan exists")
    if how.relax:
        return Solution({}, result.objective / obj.scale, elapsed, backend, "relaxed",
                        *sizes), 0.0
    values = result.values
    owner_choice = {o: max(range(len(row)), key=lambda k, row=row: values[row[k]])
                    for o, row in ilp.x.items()}
    choice = task.clustering.expand(owner_choice)
    value = result.objective / obj.scale
    total = _chosen(ilp, values) if obj.split else None
    if obj.split:  # the step of the chosen prices (no tie-break, no penalties)
        value = step_seconds(total, True, obj.edge)[0]
    elif task.discouraged and not obj.by_memory:
        value -= PENALTY * sum(1 for n, ks in task.discouraged.items() if choice[n] in ks)
    proven = result.objective if result.bound is None else result.bound
    return Solution(choice, value, elapsed, backend, result.status, *sizes,
                    split=total), proven


def _chosen(ilp: IlpProgram, values) -> Split:
    """The prices of the solution, summed by where they run."""
    total = NO_TIME
    for var, sp in ilp.side:
        if values[var] > 1e-9:
            total = total.plus(sp, float(values[var]))
    return total


def _lower_bound(task: _Instance, how: _Settings, sol: Solution | None,
                 proven: float) -> float | None:
    """`Solution.bound` of a solve without the budget, from the solver's bound `proven`."""
    if sol is None or how.minimize == "memory" or task.discouraged or how.exact_overlap or \
            how.side_share is not None or sol.status != "optimal":
        return None
    return proven / ilp_rows.SCALE


def _bounded(sol: Solution | None, bound: float | None) -> Solution | None:
    return sol if sol is None else dataclasses.replace(sol, bound=bound)


def _refined(task: _Instance, how: _Settings, ilp: IlpProgram, sol: Solution,
             binding: bool) -> Solution:
    """With overlap the solves above are relaxed: every side second hidden but the unhidden
    share, a lower bound of the step, and its optimum when the plan's side collectives do fit
    under its compute in each pass. Otherwise the ILP (the same problem, priced once) is
    solved again, and the fastest plan that fits, priced exactly, kept:

    - with each pass's longer side priced exactly (the rows of ilp_rows.overlapped_passes),
      on problems of at most EXACT_VARIABLES variables, for EXACT_SECONDS at most; a plan
      proven optimal ends the refinement. On larger ones HiGHS rarely finishes (Llama-3 70B
      over 256 x 4 and 512 x 2 H100s: 8 of 13 levels out of time without a plan) and without
      presolve it may report "optimal" a plan 70% slower than one it missed, so they are not
      tried;
    - with the side seconds weighed against the critical ones (`side_share` SCALARIZED[0] of
      them priced, then, while the plan's side collectives still outlast its compute in a
      pass, the next weight): plans that give up some hidden collectives for less exposed
      ones. On those 70B levels each came within 2.7% of the exact optimum (the first weight
      alone), where pricing every side second, as if nothing overlapped, was up to 14%
      slower.

    When `binding` (the fastest plan did not fit), the re-solves are solved under the budget
    at once."""
    edge = ilp.objective.edge
    if not ilp.objective.split or how.exact_overlap or how.side_share is not None or \
            sol.status.startswith("greedy") or not side_bound(sol.split, edge):
        return sol  # (the re-solves below are not refined again)

    def again(exact: bool, share: float | None = None) -> Solution | None:
        try:  # None: out of time without a plan, or no plan under the budget
            return _solve(task, _Settings(
                how.memory_budget, how.backend,
                min(how.time_limit, EXACT_SECONDS) if exact else how.time_limit,
                how.gap if exact else max(how.gap, SCALARIZED_GAP), how.minimize, False, exact,
                fallback=False, side_share=share, binds=binding))
        except NoFeasiblePlan:
            return None

    def fits(better: Solution | None) -> bool:
        return better is not None and (
            how.memory_budget is None or how.memory_budget == float("inf") or
            plan_memory(task.graph, task.cost, better.choice, task.clustering.twin)
            <= how.memory_budget)

    best = sol
    if ilp.prog.num_variables <= EXACT_VARIABLES:
        better = again(True)
        if fits(better) and better.objective < best.objective:
            best = better
            if better.status == "optimal":
                return best  # proven fastest
    for share in SCALARIZED:
        better = again(False, share)
        if not fits(better):
            break
        if better.objective < best.objective:
            best = better
        if not side_bound(better.split, edge):
            break  # its collectives hide: weighing them more would only cost compute
    return best


@contextlib.contextmanager
def silenced_stdout():
    """Discard what native code writes to file descriptor 1 meanwhile: HiGHS prints its
    banner ("Running HiGHS ... Copyright ...") when constructed, before any option can say
    otherwise."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (a detached process): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


# Seconds a linear relaxation is solved without presolve before it is solved with it: without,
# HiGHS solves these in 0.1-1.8 s (Llama-3 70B and 405B levels), 1.5-9x faster than with
# (70B on (8, 8)), but it can stall on one (405B over 256 x 8 H100s, selective recomputation
# over 2 microbatches: no answer in 60 s, where with presolve it proves it infeasible in
# 0.55 s).
RELAX_SECONDS = 3.0

# The exact overlap solve is tried on problems of at most this many variables (the tests'
# small models; a Llama-3 70B level over 256 x 4 H100s has about 18,000).
EXACT_VARIABLES = 2000

# The shares of side seconds the re-solves price, in turn, while the plan's side collectives
# outlast its compute (`_refined`): between the relaxation's unhidden share (too few:
# its plans gather more than compute hides) and every second (too many: its plans give up
# overlap that was free).
SCALARIZED = (0.5, 1.0)

# The relative gap the weighted re-solves stop at: their objective only stands in for the
# step (each plan is then priced exactly), and closing the last percents took HiGHS longer
# than finding the plan (Llama-3 70B levels over 512 x 2 H100s: 8.2 and 10.6 s at 1e-4, 2.8
# and 3.4 s at 1e-2, the same plans; the whole candidate's solves 18.3 s at 1e-2, 13.2 s at
# 2e-2, and the mesh searches for 70B over 1,024 and 8B over 64 H100s rank the same plans).
SCALARIZED_GAP = 2e-2

# Seconds the exact overlap solve may take (its max rows make HiGHS's bound weak: Llama-3 70B
# on (512, 2) under the H100 budget took minutes); the relaxed plan stays when it runs out.
EXACT_SECONDS = 10.0

def side_bound(total: Split, edge: float) -> bool:
    """Whether, in either pass, the side collectives of a plan whose prices sum to `total`
    outlast its critical path (beyond the share `edge` nothing hides: cost.step_seconds), so
    that its step is set by the collectives rather than by compute."""
    return total.side_forward - total.forward > edge * total.side_forward + 1e-12 or \
        total.side_backward - total.backward > edge * total.side_backward + 1e-12
