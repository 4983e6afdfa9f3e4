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
is solved again (`refined`): with the rows, on small problems; then with E_p = w * sum s_p for
a weight w between q and 1 (SCALARIZED), each plan priced exactly and the fastest kept.
With x integral the transport constraints force y[e,a,b] = [out_e = a][in_e = b], so y may be
continuous. An edge whose producer (or consumer) has one placement class costs a constant per
consumer (producer) strategy and is folded into t. The loss must reach every rank: its node pays
the resharding to Replicate, except from a pending sum (see `loss_sink_time`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from autopar.passes.cluster import Clustering, identity
from autopar.passes.gathers import use_groups
from autopar.passes.placement import Partial, R
from autopar.passes.strategies import CONSTANT, OP, PARAM, SNode, StrategyGraph

from . import mip
from .cost import INFEASIBLE, NO_TIME, CostModel, Split, step_seconds
from .memory import draw_bytes, plan_memory, recompute_state

SCALE = 1e6  # seconds -> microseconds inside the solver
GIB = 1.0 / 2**30  # bytes -> GiB in the memory constraint and the least-memory objective
PENALTY = 1.0  # seconds added to a discouraged strategy (forced styles)
BACKENDS = ("HIGHS", "SCIP", "CBC", "CP_SAT")


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


@dataclass
class Edge:
    """Input `slot` of node `consumer`, made by output `out_index` of `producer`."""

    consumer: str
    slot: int
    producer: str
    out_index: int | None


def edges(graph: StrategyGraph) -> list[Edge]:
    """Every tensor input of every node, as an edge from its producer."""
    return [Edge(v.name, i, u, idx) for v in graph.nodes.values()
            for i, (u, idx) in enumerate(v.inputs)]


def node_costs(graph: StrategyGraph, cost: CostModel,
               twin: dict[str, str] | None = None) -> dict[str, list[float]]:
    """t[v,s]: compute (+ gradient sync) seconds of every strategy, plus the loss's final
    resharding to Replicate. Nodes with a `twin` (an identical node of an earlier repeated
    layer) share the prices of the first of them recomputed alike."""
    return _node_prices(graph, cost, twin, cost.node_time, lambda t, sink: t + sink)


def node_splits(graph: StrategyGraph, cost: CostModel,
                twin: dict[str, str] | None = None) -> dict[str, list[Split]]:
    """`node_costs` by where the seconds run (cost.Split), shared between twins alike."""
    return _node_prices(graph, cost, twin, cost.node_split,
                        lambda sp, sink: sp.plus(Split(sink, 0.0, 0.0, 0.0)))


def _node_prices(graph: StrategyGraph, cost: CostModel, twin: dict[str, str] | None,
                 price, with_sink) -> dict[str, list]:
    """`price(node, strategy)` of every strategy, shared between twins alike; the loss's
    prices `with_sink(price, seconds of its final resharding)`."""
    out = {}
    priced: dict[tuple, list] = {}
    for v in graph.nodes.values():
        key = price_key(cost, twin, v.name)
        if key not in priced:
            priced[key] = [price(v, s) for s in v.strategies]
        out[v.name] = priced[key]
    for name, idx in ([graph.loss] if graph.loss else []):
        v = graph.nodes[name]  # its own prices: the loss alone pays the final resharding
        out[name] = [with_sink(p, loss_sink_time(cost, v, s.out(idx), idx))
                     for p, s in zip(out[name], v.strategies)]
    return out


def compute_floor(graph: StrategyGraph, cost: CostModel,
                  twin: dict[str, str] | None = None) -> float:
    """Seconds of compute no plan of `graph` under `cost` goes below: each op at its cheapest
    strategy (forward and backward, and the forward again where it recomputes), whatever its
    neighbours and memory. A plan's step is at least its compute (collectives only add: what
    hides under compute is at most their own seconds), so a search can skip a setting whose
    floor is no better than a plan already found."""
    prices = _node_prices(graph, cost, twin, cost.compute_time, lambda t, sink: t)
    return sum(min((t for t in prices[v.name] if t != INFEASIBLE), default=0.0)
               for v in graph.nodes.values() if v.kind in (OP, CONSTANT))


def loss_sink_time(cost: CostModel, node: SNode, placement, idx) -> float:
    """Seconds to bring the loss to every rank. A pending-sum loss seeds the backward pass
    locally (the gradient of a pending sum is replicated) and is all-reduced only for reporting,
    overlapped with the backward pass: free on the critical path."""
    if all(isinstance(p, (type(R), Partial)) for p in placement):
        return 0.0
    return cost.reshard_time(node.out_shapes[idx or 0], node.out_dtypes[idx or 0], placement,
                             tuple(R for _ in cost.shape), False)


def plan_time(graph: StrategyGraph, cost: CostModel, choice: dict[str, int]) -> float:
    """Predicted seconds of a complete assignment: the objective evaluated directly."""
    return step_seconds(plan_split(graph, cost, choice), cost.overlap, cost.edge_share())[0]


def plan_split(graph: StrategyGraph, cost: CostModel, choice: dict[str, int],
               twin: dict[str, str] | None = None) -> Split:
    """The seconds of a complete assignment by where they run (cost.Split), summed: each
    node's chosen strategy only, the loss's final resharding on the forward path. Twins
    (`twin`, see `price_key`) choosing alike share their prices, as in the ILP."""
    total = NO_TIME
    nodes: dict[tuple, Split] = {}
    for v in graph.nodes.values():
        key = (price_key(cost, twin, v.name), choice[v.name])
        if key not in nodes:
            nodes[key] = cost.node_split(v, v.strategies[choice[v.name]])
        total = total.plus(nodes[key])
    for name, idx in ([graph.loss] if graph.loss else []):
        v = graph.nodes[name]
        sink = loss_sink_time(cost, v, v.strategies[choice[name]].out(idx), idx)
        total = total.plus(Split(sink, 0.0, 0.0, 0.0))
    moved: dict[tuple, Split] = {}
    for e in edges(graph):
        u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
        src = u.strategies[choice[u.name]].out(e.out_index)
        dst = v.strategies[choice[v.name]].inputs[e.slot]
        key = (edge_key(cost, twin, e), src, dst)
        if key not in moved:
            moved[key] = cost.edge_split(graph, v, e.slot, src, dst)
        total = total.plus(moved[key])
    return total


def greedy(graph: StrategyGraph, cost: CostModel,
           forced: dict[str, list[int]] | None = None) -> dict[str, int]:
    """A feasible assignment (ignoring memory): in topological order, each node takes the
    strategy cheapest given its producers' choices (among `forced`, when given). The solver's
    starting hint, and its answer when the time limit passes before it finds a plan."""
    t = node_costs(graph, cost)
    choice: dict[str, int] = {}
    for v in graph.nodes.values():
        best, best_cost = 0, INFEASIBLE
        for k, s in enumerate(v.strategies):
            if forced and v.name in forced and k not in forced[v.name]:
                continue
            c = t[v.name][k]
            for i, (u, idx) in enumerate(v.inputs):
                src = graph.nodes[u].strategies[choice[u]].out(idx)
                c += cost.edge_time(graph, v, i, src, s.inputs[i])
            if c < best_cost:
                best, best_cost = k, c
        choice[v.name] = best
    return choice


def random_choice(graph: StrategyGraph, cost: CostModel, rng: random.Random,
                  forced: dict[str, list[int]] | None = None) -> dict[str, int]:
    """A uniformly drawn valid assignment: in topological order, each node draws among the
    strategies whose inputs can be reached from its producers' drawn placements (nothing is
    ever resharded into a pending sum), among `forced` where given. Any plan the ILP could
    return is a possible draw."""
    choice: dict[str, int] = {}
    for v in graph.nodes.values():
        ok = []
        for k, s in enumerate(v.strategies):
            if forced and v.name in forced and k not in forced[v.name]:
                continue
            if all(cost.edge_time(graph, v, i, graph.nodes[u].strategies[choice[u]].out(idx),
                                  s.inputs[i]) != INFEASIBLE
                   for i, (u, idx) in enumerate(v.inputs)):
                ok.append(k)
        choice[v.name] = rng.choice(ok)
    return choice


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
    cost.step_seconds: relaxed first, exactly only when needed (see `refined` below);
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
        problem = _owner_problem(graph, cost, c, forced, discouraged)
    binds = not unbounded_only and memory_budget is not None and minimize == "time" and (
        binding or bool(fastest) and plan_memory(graph, cost, fastest[-1], c.twin) > memory_budget)
    return _solve(graph, cost, problem, c, memory_budget, backend, time_limit, gap, forced,
                  discouraged, minimize, unbounded_only, exact_overlap, binds=binds,
                  fastest=fastest)


def relaxed_bound(graph: StrategyGraph, cost: CostModel, problem: _OwnerProblem,
                  memory_budget: float | None, clustering: Clustering | None = None,
                  accumulation: int = 1, time_limit: float = 60.0) -> float:
    """Seconds per microbatch below which no plan of `problem` (`priced_problem(...,
    relaxation=True)`) that fits `memory_budget` steps, `accumulation` microbatches a step
    (the step over the count): the
    optimum of its linear relaxation with each pass's exact overlap rows (the objective
    `cost.step_seconds` takes, which the relaxed solves drop), gradient synchronization
    counted once per step, and each use of a parameter freed after forward priced freed or
    kept gathered, each at its own seconds and bytes (`_OwnerProblem.kept_gathered`, when
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
    return _solve(graph, cost, problem, clustering or identity(graph), memory_budget,
                  "HIGHS", time_limit, 0.0, None, None, "time", False, True,
                  relax=max(1, accumulation)).objective


def _solve(graph: StrategyGraph, cost: CostModel, problem: _OwnerProblem, c: Clustering,
           memory_budget: float | None, backend: str, time_limit: float, gap: float,
           forced: dict[str, list[int]] | None, discouraged: dict[str, list[int]] | None,
           minimize: str, unbounded_only: bool, exact_overlap: bool,
           fallback: bool = True, side_share: float | None = None,
           binds: bool = False, fastest: list[dict[str, int]] | None = None,
           relax: int = 0) -> Solution | None:
    """`solve` on a built problem. Without `fallback` a solve that runs out of time before
    any plan returns None instead of the greedy plan (the re-solves of `refined`, whose
    caller keeps the plan it has then). `side_share`: the share of side seconds the
    objective prices without the exact rows (default: the unhidden share, the relaxation;
    1: every side second, as if nothing overlapped). With `binds` the budget is known to
    bind (a re-solve after the fastest plan did not fit): solved under it at once.

    With `relax` (a step's microbatch count m), the linear relaxation (no integral
    columns) is solved under the budget instead, without the tie-break, each strategy's
    gradient synchronization counted 1/m (a step synchronizes once: planner `accumulated`),
    and returned as a Solution without a choice whose objective is its optimum in seconds:
    below the step of every plan of the problem, over m (see `relaxed_bound`); 0 when the
    time limit passes first."""
    by_memory = minimize == "memory"
    scale = GIB if by_memory else SCALE  # GiB or microseconds inside the solver
    start = time.perf_counter()
    prog = mip.Program()
    x: dict[str, list[int]] = {}
    split = problem.node_split is not None and not by_memory
    side: list[tuple[int, Split]] = []  # (column, its price by where it runs)
    wholes: list[tuple[int, Split]] = []  # the same with gradient sync whole (for `relax`)
    edge = cost.edge_share() if split else 0.0
    # relaxed (the first solve): side seconds priced at their unhidden share only
    relaxed = 0.0 if not split or exact_overlap else edge if side_share is None else side_share
    tiebreak = 0.0 if relax else SIDE_TIEBREAK
    # the share of each strategy's gradient synchronization a relaxed step of `relax`
    # microbatches leaves out (see `relaxed_bound`)
    once = (relax - 1) / relax if relax and problem.sync else 0.0
    for o, costs in problem.node_cost.items():
        row = []
        for k, (t, m) in enumerate(zip(costs, problem.memory[o])):
            if t == INFEASIBLE:
                row.append(prog.var(0.0, 0.0, not relax))
                continue
            price = m if by_memory else t
            if once:
                price -= once * sum(problem.sync[o][k])
            if split:  # side seconds: only their unhidden share
                sp = whole = problem.node_split[o][k]
                if once:  # (the critical seconds stay whole in the rows: see relaxed_bound)
                    sp = sp.plus(Split(0.0, 0.0, 0.0, problem.sync[o][k].side_backward), -once)
                price -= (1 - tiebreak - relaxed) * (sp.side_forward + sp.side_backward)
            row.append(prog.var(0.0, 1.0, not relax, price * scale))
            if split:
                side.append((row[-1], sp))
                if once:
                    wholes.append((row[-1], whole))
        prog.row(((var, 1.0) for var in row), 1.0, 1.0)
        x[o] = row
    y_terms = []  # (block, (a, b), column): the memory constraint's edge terms
    y_of: dict[tuple[int, tuple], int] = {}
    for i, (ou, ov, a_of, b_of, price) in enumerate(problem.edges):
        y = {}
        for ab, cst in price.items():  # ab: (a, b), or (a, b, KEPT) (see _owner_problem)
            if cst == INFEASIBLE:
                continue
            coefficient = problem.edge_memory[i].get(ab, 0.0) if by_memory else cst
            if split:
                sp = problem.edge_split[i][ab]
                coefficient -= (1 - tiebreak - relaxed) * (
                    sp.side_forward + sp.side_backward)
            var = prog.var(0.0, 1.0, False, coefficient * scale)
            if split:
                side.append((var, sp))
                if once:
                    wholes.append((var, sp))
            y[ab] = var
            y_terms.append((i, ab, var))
            y_of[(i, ab)] = var
        rows: dict = defaultdict(list)
        cols: dict = defaultdict(list)
        for ab, var in y.items():
            rows[ab[0]].append(var)
            cols[ab[1]].append(var)
        for a, ks in _classes(a_of).items():
            prog.row([(v, 1.0) for v in rows[a]] + [(x[ou][k], -1.0) for k in ks], 0.0, 0.0)
        for b, js in _classes(b_of).items():
            prog.row([(v, 1.0) for v in cols[b]] + [(x[ov][j], -1.0) for j in js], 0.0, 0.0)
    if split and exact_overlap:
        unit = 1e-3 if backend == "CP_SAT" else 1.0
        if once:
            _overlapped_passes(prog, side, scale, edge, unit, wholes=wholes, share=1 - once)
        else:
            _overlapped_passes(prog, side, scale, edge, unit)
    gathered = _largest_bucket(prog, problem.buckets, x, y_of)  # in GiB
    if by_memory and gathered is not None:
        prog.cost[gathered] = 1.0
    hint = None
    if backend != "HIGHS":  # a feasible start (HiGHS is given none: see solver/mip.py)
        choice = greedy(graph, cost)
        hint = {var: float(k == choice[o]) for o, row in x.items()
                for k, var in enumerate(row)}
    # HiGHS's presolve doubles the root's work on these problems and never shrinks them
    # (Llama-3 70B on (8, 8) under a binding budget: 8.7 s with it, 4.7 s without, same
    # optimum).
    options = "presolve = off"

    def run() -> Solution:
        with silenced_stdout():
            try:
                result = mip.solve(prog, backend, time_limit, gap, hint, options)
            except mip.SolverTrouble:
                # Without presolve HiGHS ends some problems in an unknown state (the
                # relaxation of a Llama-3 70B level over 512 x 2 H100s, gradients priced in
                # float32); with it they solve
                result = mip.solve(prog, backend, time_limit, gap, hint, "")
        elapsed = time.perf_counter() - start
        if result.status == mip.NO_SOLUTION:
            if relax:  # out of time: no bound known
                return Solution({}, 0.0, elapsed, backend, "relaxed (time limit)",
                                prog.num_variables, prog.num_constraints)
            # the time limit passed before any plan: take the greedy one
            if not fallback:
                return None
            choice = greedy(graph, cost, forced)
            return Solution(choice, plan_time(graph, cost, choice), elapsed, backend,
                            "greedy (time limit)", prog.num_variables, prog.num_constraints)
        if result.status == mip.INFEASIBLE:
            raise NoFeasiblePlan(f"no plan fits the memory budget of {memory_budget:.0f} "
                                 "bytes per device" if memory_budget is not None else
                                 "no plan exists")
        if relax:
            return Solution({}, result.objective / scale, elapsed, backend, "relaxed",
                            prog.num_variables, prog.num_constraints)
        values = result.values
        owner_choice = {o: max(range(len(row)), key=lambda k, row=row: values[row[k]])
                        for o, row in x.items()}
        choice = c.expand(owner_choice)
        value = result.objective / scale
        total = chosen(values) if split else None
        if split:  # the step of the chosen prices (no tie-break, no penalties)
            value = step_seconds(total, True, edge)[0]
        elif discouraged and not by_memory:
            value -= PENALTY * sum(1 for n, ks in discouraged.items() if choice[n] in ks)
        solver_bound[0] = result.objective if result.bound is None else result.bound
        return Solution(choice, value, elapsed, backend, result.status,
                        prog.num_variables, prog.num_constraints, split=total)

    # the solver's bound on the optimum of the last solve (scaled; its objective where it
    # reports none): with a relative gap its plan may be that much above the optimum
    solver_bound = [0.0]

    def chosen(values) -> Split:  # the prices of the solution, summed by where they run
        total = NO_TIME
        for var, sp in side:
            if values[var] > 1e-9:
                total = total.plus(sp, float(values[var]))
        return total

    def refined(sol: Solution, binding: bool) -> Solution:
        """With overlap the solves above are relaxed: every side second hidden but the
        unhidden share, a lower bound of the step, and its optimum when the plan's side
        collectives do fit under its compute in each pass. Otherwise the ILP (the same
        problem, priced once) is solved again, and the fastest plan that fits, priced
        exactly, kept:

        - with each pass's longer side priced exactly (the rows of `_overlapped_passes`),
          on problems of at most EXACT_VARIABLES variables, for EXACT_SECONDS at most; a
          plan proven optimal ends the refinement. On larger ones HiGHS rarely finishes
          (Llama-3 70B over 256 x 4 and 512 x 2 H100s: 8 of 13 levels out of time without a
          plan) and without presolve it may report "optimal" a plan 70% slower than one it
          missed, so they are not tried;
        - with the side seconds weighed against the critical ones (`side_share` SCALARIZED[0]
          of them priced, then, while the plan's side collectives still outlast its compute in
          a pass, the next weight): plans that give up some hidden collectives for less
          exposed ones. On those 70B levels each came within 2.7% of the exact optimum (the
          first weight alone), where pricing every side second, as if nothing overlapped,
          was up to 14% slower.

        When `binding` (the fastest plan did not fit), the re-solves are solved under the
        budget at once."""
        if not split or exact_overlap or side_share is not None or \
                sol.status.startswith("greedy") or not side_bound(sol.split, edge):
            return sol  # (the re-solves below are not refined again)

        def again(exact: bool, share: float | None = None) -> Solution | None:
            try:  # None: out of time without a plan, or no plan under the budget
                return _solve(graph, cost, problem, c, memory_budget, backend,
                              min(time_limit, EXACT_SECONDS) if exact else time_limit,
                              gap if exact else max(gap, SCALARIZED_GAP), forced, discouraged,
                              minimize, False, exact, fallback=False, side_share=share,
                              binds=binding)
            except NoFeasiblePlan:
                return None

        def fits(better: Solution | None) -> bool:
            return better is not None and (
                memory_budget is None or memory_budget == float("inf") or
                plan_memory(graph, cost, better.choice, c.twin) <= memory_budget)

        best = sol
        if prog.num_variables <= EXACT_VARIABLES:
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

    def lower_bound(sol: Solution | None) -> float | None:  # of a solve without the budget
        if sol is None or by_memory or discouraged or exact_overlap or \
                side_share is not None or sol.status != "optimal":
            return None
        return solver_bound[0] / scale

    def bounded(sol: Solution | None, bound: float | None) -> Solution | None:
        return sol if sol is None else dataclasses.replace(sol, bound=bound)

    drawn = draw_bytes(graph, cost)  # a constant of the graph: off the budget

    def budget_row() -> int:  # the memory constraint; its index
        prog.row([(x[o][k], m * GIB) for o, ms in problem.memory.items()
                  for k, m in enumerate(ms) if m]
                 + [(var, problem.edge_memory[i][ab] * GIB) for i, ab, var in y_terms
                    if problem.edge_memory[i].get(ab)]
                 + ([(gathered, 1.0)] if gathered is not None else []),
                 upper=(memory_budget - drawn) * GIB)
        return prog.num_constraints - 1

    if relax:
        if memory_budget is not None and memory_budget != float("inf"):
            budget_row()
        return run()
    if memory_budget is None or by_memory or memory_budget == float("inf"):
        sol = run()
        bound = lower_bound(sol)
        return bounded(refined(sol, False), bound)
    bound = None
    if not binds:
        # Without the budget first: several times faster, and when that plan fits, no plan
        # that fits is faster.
        sol = run()
        if sol is None:  # out of time without a plan, and no fallback asked for
            return None
        bound = lower_bound(sol)
        if fastest is not None:
            fastest.append(sol.choice)
        peak = plan_memory(graph, cost, sol.choice, c.twin)
        if peak <= memory_budget:
            return bounded(refined(sol, False), bound)
    if unbounded_only:
        raise NoFeasiblePlan(f"the fastest plan ({peak / 2**30:.3f} GiB per device) does not "
                             f"fit the budget of {memory_budget / 2**30:.3f} GiB",
                             "activations", True, bound)
    memory_row = budget_row()
    try:
        sol = run()
        over = plan_memory(graph, cost, sol.choice, c.twin) - memory_budget
        if over > 0 and not sol.status.startswith("greedy"):
            # The solver accepts rows violated within its feasibility tolerance (HiGHS: 1e-7
            # in the row's units): on a budget of a few MB a plan 256 bytes over it came
            # back. Solved again with the row that much tighter, twice over.
            prog.row_upper[memory_row] = (memory_budget - drawn - 2 * over) * GIB
            sol = run()
    except NoFeasiblePlan as e:
        e.bound = bound
        raise
    return bounded(refined(sol, True), bound)


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


# The exact overlap solve is tried on problems of at most this many variables (the tests'
# small models; a Llama-3 70B level over 256 x 4 H100s has about 18,000).
EXACT_VARIABLES = 2000

# The shares of side seconds the re-solves price, in turn, while the plan's side collectives
# outlast its compute (solve's `refined`): between the relaxation's unhidden share (too few:
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

# Collectives hidden under compute cost the step nothing, so plans that differ only in them
# tie; the one that moves less wins (this share of their seconds is added to the objective,
# not to the reported one).
SIDE_TIEBREAK = 1e-3


def side_bound(total: Split, edge: float) -> bool:
    """Whether, in either pass, the side collectives of a plan whose prices sum to `total`
    outlast its critical path (beyond the share `edge` nothing hides: cost.step_seconds), so
    that its step is set by the collectives rather than by compute."""
    return total.side_forward - total.forward > edge * total.side_forward + 1e-12 or \
        total.side_backward - total.backward > edge * total.side_backward + 1e-12


def _overlapped_passes(prog: mip.Program, side: list[tuple[int, Split]], scale: float,
                       edge: float, unit: float = 1.0,
                       wholes: list[tuple[int, Split]] | None = None,
                       share: float = 1.0) -> None:
    """Each pass takes the longer of its critical path and the collectives beside it
    (cost.step_seconds): the objective holds the critical seconds, and per pass a column
    bounded below by the side seconds less the critical ones, by the share `edge` of the side
    seconds that nothing hides, and by 0, adds what of the side collectives is not hidden.
    The column counts `unit`s of the objective (CP-SAT makes continuous columns integers:
    there, thousandths). With `wholes` (the columns' prices with gradient sync whole, where
    `side` counts a share of it: `relaxed_bound`), backward's column is also bounded below by
    `share` x what those side seconds exceed the critical ones by."""
    for crit, beside in (("forward", "side_forward"), ("backward", "side_backward")):
        if not any(getattr(sp, beside) for _, sp in side):
            continue
        exposed = prog.var(0.0, mip.INF, False, unit)
        prog.row([(exposed, unit)] + [(var, -d * scale) for var, sp in side
                                     for d in [getattr(sp, beside) - getattr(sp, crit)] if d],
                 lower=0.0)
        if wholes is not None and crit == "backward":
            prog.row([(exposed, unit)] + [(var, -d * share * scale) for var, sp in wholes
                                         for d in [sp.side_backward - sp.backward] if d],
                     lower=0.0)
        if edge:
            prog.row([(exposed, unit)] + [(var, -getattr(sp, beside) * edge * scale)
                                         for var, sp in side if getattr(sp, beside)],
                     lower=0.0)


def _largest_bucket(prog: mip.Program, buckets: list[list[tuple]], x: dict,
                    y_of: dict) -> int | None:
    """A column bounded below by every FSDP bucket's gathers in flight (None: no bucket
    gathers anything in any plan). A bucket is a sum of terms ("x", owner, {strategy: bytes})
    or ("y", block, {(a, b): bytes}); buckets alike (repeated layers) give one constraint.
    The column is in GiB, as the memory constraint (bytes make its coefficients 1e10 and
    HiGHS's feasibility tolerance meaningless)."""
    seen = set()
    largest = None
    for bucket in buckets:
        coeffs: dict[int, float] = {}
        for kind, where, held in bucket:
            for key, b in held.items():
                var = x[where][key] if kind == "x" else y_of.get((where, key))
                if var is None or not b:
                    continue
                coeffs[var] = coeffs.get(var, 0.0) + b
        if not coeffs:
            continue
        key = tuple(sorted(coeffs.items()))
        if key in seen:
            continue
        seen.add(key)
        if largest is None:
            largest = prog.var(0.0, mip.INF)
        prog.row([(largest, 1.0)] + [(var, -b * GIB) for var, b in coeffs.items()], lower=0.0)
    return largest


@dataclass
class _OwnerProblem:
    node_cost: dict[str, list[float]]         # owner -> seconds per owner strategy
    memory: dict[str, list[float]]            # owner -> bytes per owner strategy
    # edge blocks (producer owner, consumer owner, placement of the edge per producer-owner
    # strategy, required placement per consumer-owner strategy, price per placement pair)
    edges: list[tuple[str, str, list, list, dict]]
    edge_memory: list[dict]                   # per edge block: bytes per placement pair
    # per FSDP bucket (passes/gathers.py), its gathers in flight: terms ("x", owner,
    # {strategy: bytes}) and ("y", edge block, {placement pair: bytes})
    buckets: list[list[tuple]]
    # with overlap (cost.overlap): node_cost and edge prices by where they run (cost.Split)
    node_split: dict[str, list[Split]] | None = None
    edge_split: list[dict] | None = None
    # with a relaxation (`priced_problem`): per owner strategy, the seconds of gradient
    # synchronization its parameters pay, by where they run (a step of several microbatches
    # synchronizes once: planner `accumulated`)
    sync: dict[str, list[Split]] | None = None
    # with parameters freed after forward (cost.reshard): the same problem where each of a
    # parameter's uses may be priced freed or kept gathered (solver/resharding.py keeps
    # gathered what the budget holds), for `relaxed_bound`: its blocks' placement pairs key
    # the kept-gathered column with KEPT last
    kept_gathered: _OwnerProblem | None = None


def priced_problem(graph: StrategyGraph, cost: CostModel, clustering: Clustering | None = None,
                   forced: dict[str, list[int]] | None = None,
                   discouraged: dict[str, list[int]] | None = None,
                   relaxation: bool = False) -> _OwnerProblem:
    """The ILP's prices (`solve`'s `problem`): every owner's and edge block's seconds and
    bytes, priced once for solves under several budgets; with `relaxation` also what
    `relaxed_bound` needs of them (`_OwnerProblem.sync` and `kept_gathered`)."""
    return _owner_problem(graph, cost, clustering or identity(graph), forced, discouraged,
                          relaxation)


def _owner_problem(graph: StrategyGraph, cost: CostModel, c: Clustering, forced,
                   discouraged, relaxation: bool = False) -> _OwnerProblem:
    """Aggregate node and edge costs onto owners. Repeated layers are priced once: a node
    shares its twin's prices and edges between the same twins are priced once and counted."""
    overlap = cost.overlap
    t_split = node_splits(graph, cost, c.twin) if overlap else None
    t = {v: [sum(sp) for sp in splits] for v, splits in t_split.items()} if overlap \
        else node_costs(graph, cost, c.twin)
    owners = c.owners()
    node_split = {o: [NO_TIME] * len(c.index[o]) for o in owners}
    node_cost = {o: [0.0] * len(c.index[o]) for o in owners}
    memory = {o: [0.0] * len(c.index[o]) for o in owners}
    sync = {o: [NO_TIME] * len(c.index[o]) for o in owners} if relaxation else None
    node_memory: dict[tuple, list[float]] = {}
    node_sync: dict[tuple, list[Split]] = {}
    for v, o in c.owner.items():
        node = graph.nodes[v]
        tw = price_key(cost, c.twin, v)
        if tw not in node_memory:
            node_memory[tw] = [cost.node_memory(node, s) for s in node.strategies]
            if node.kind == PARAM and relaxation:
                node_sync[tw] = [cost.grad_sync_split(node, s.output, s.zero)
                                 for s in node.strategies]
        allowed = set(forced[v]) if forced and v in forced else None
        penalized = set(discouraged.get(v, ())) if discouraged else set()
        # (this runs for every node and strategy of every layer: the lists looked up once)
        tv, costs, mem, node_mem = t[v], node_cost[o], memory[o], node_memory[tw]
        splits, tv_split = (node_split[o], t_split[v]) if overlap else (None, None)
        syncs, node_syncs = (sync[o], node_sync[tw]) if tw in node_sync else (None, None)
        for k, j in enumerate(c.index[v]):
            if (allowed is not None and j not in allowed) or tv[j] == INFEASIBLE:
                costs[k] = INFEASIBLE
            elif costs[k] != INFEASIBLE:
                costs[k] += tv[j] + (PENALTY if j in penalized else 0.0)
                if splits is not None:
                    splits[k] = splits[k].plus(tv_split[j])
            mem[k] += node_mem[j]
            if syncs is not None:
                syncs[k] = syncs[k].plus(node_syncs[j])
    # An owner strategy ruled out (by `forced`, or unable to run) is never chosen: its edges'
    # placements become RULED_OUT and are not priced (most of the pricing of a forced plan).
    live = {o: [p != INFEASIBLE for p in costs] for o, costs in node_cost.items()}
    groups: dict[tuple, list] = {}  # edges between the same twins: [edge, count, twins' keys]
    bucket_of = use_groups(graph, cost.bucket_bytes)
    for e in edges(graph):
        key = edge_key(cost, c.twin, e)
        if key not in groups:
            groups[key] = [e, 0, []]
        groups[key][1] += 1
        if graph.nodes[e.producer].kind == PARAM:
            groups[key][2].append(bucket_of[(e.consumer, e.slot)])
    buckets: dict[int, list[tuple]] = defaultdict(list)
    # The kept-gathered variant (`_OwnerProblem.kept_gathered`, for a relaxation where
    # parameters are freed after forward): a parameter's uses are never folded into owner
    # prices but blocks whose every placement pair has two columns, freed (as priced here)
    # and kept gathered (`kept_cost`, the pair's key ending in KEPT); the rest as in the
    # problem.
    kept_cost = cost.copy(reshard=frozenset()) if relaxation and cost.reshard else None
    variant = (_copy_prices(node_cost), _copy_prices(node_split), _copy_prices(memory)) \
        if kept_cost else None
    buckets_kept: dict[int, list[tuple]] = defaultdict(list)
    blocks: list[tuple] = []
    blocks_kept: list[tuple] = []
    for e, count, in_buckets in groups.values():
        u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
        ou, ov = c.owner[u.name], c.owner[v.name]
        a_of = _live([u.strategies[j].out(e.out_index) for j in c.index[u.name]], live[ou])
        b_of = _live([v.strategies[j].inputs[e.slot] for j in c.index[v.name]], live[ov])

        def priced(a, b, v=v, e=e, count=count, cost=cost) -> tuple[float, Split]:
            """The price and (with overlap) the price by where it runs."""
            if a is RULED_OUT or b is RULED_OUT:
                return INFEASIBLE, NO_TIME
            if not overlap:
                p = cost.edge_time(graph, v, e.slot, a, b)
                return (p if p == INFEASIBLE else p * count), NO_TIME
            sp = cost.edge_split(graph, v, e.slot, a, b)  # edge_time is its sum
            p = sum(sp)
            return (p if p == INFEASIBLE else p * count), NO_TIME.plus(sp, count)

        def kept(a, b, v=v, e=e, count=count, cost=cost):  # bytes autograd keeps of the
            if a is RULED_OUT or b is RULED_OUT:             # edge's tensor
                return 0.0
            return cost.edge_memory(graph, v, e.slot, a, b) * count

        def held(a, b, v=v, e=e, cost=cost):  # FSDP gathers in flight, one twin's (its
            if a is RULED_OUT or b is RULED_OUT:  # bucket's share)
                return 0.0
            return cost.gather_memory(graph, v, e.slot, a, b)

        both = kept_cost is not None and u.kind == PARAM  # a use the variant prices twice
        a_cls, b_cls = _classes(a_of, live_only=True), _classes(b_of, live_only=True)

        # where a price on an owner strategy goes: the problem, and the variant unless it
        # has the use's block
        targets = [(node_cost, node_split, memory)] + ([variant] if variant and not both else [])

        def bucketed(term, term_kept=None, in_buckets=in_buckets, both=both):
            if not any(term[2].values()):
                return
            for j in in_buckets:
                buckets[j].append(term)
                if variant and not both:
                    buckets_kept[j].append(term_kept or term)

        def fold(owner, k, p, sp, m, targets=targets):  # a price on an owner strategy
            for costs, splits, mem in targets:
                _add(costs[owner], k, p)
                splits[owner][k] = splits[owner][k].plus(sp)
                mem[owner][k] += m

        if both:  # the variant's block: freed and kept gathered, for each pair
            price2, kept2, split2, held2 = {}, {}, {}, {}
            for a in a_cls:
                for b in b_cls:
                    for key, at in (((a, b), cost), ((a, b, KEPT), kept_cost)):
                        price2[key], split2[key] = priced(a, b, cost=at)
                        kept2[key] = kept(a, b, cost=at)
                        held2[key] = held(a, b, cost=at) if in_buckets else 0.0
            if in_buckets and any(held2.values()):
                for j in in_buckets:
                    buckets_kept[j].append(("y", len(blocks_kept), held2))
            blocks_kept.append((ou, ov, a_of, b_of, price2, kept2, split2))
        if ou == ov:  # both ends decided together: a cost per owner strategy
            for k, (a, b) in enumerate(zip(a_of, b_of)):
                fold(ou, k, *priced(a, b), kept(a, b))
            if in_buckets:
                bucketed(("x", ou, {k: held(a, b) for k, (a, b) in enumerate(zip(a_of, b_of))}))
            continue
        if len(a_cls) == 1 or len(b_cls) == 1:  # one side fixed: a cost per strategy
            owner = ov if len(a_cls) == 1 else ou
            gathers = {}
            for a, ks in a_cls.items():
                for b, js in b_cls.items():
                    idxs = js if len(a_cls) == 1 else ks
                    (p, sp), m = priced(a, b), kept(a, b)
                    g = held(a, b) if in_buckets else 0.0
                    for k in idxs:
                        fold(owner, k, p, sp, m)
                        gathers[k] = g
            if in_buckets:
                bucketed(("x", owner, gathers))
            continue
        pairs = [(a, b) for a in a_cls for b in b_cls]
        if in_buckets:
            term = ("y", len(blocks), {ab: held(*ab) for ab in pairs})
            bucketed(term, ("y", len(blocks_kept), term[2]))
        prices = {ab: priced(*ab) for ab in pairs}
        # (no bytes for a pair never chosen: a quarter of a 70B layer's pairs have no
        # resharding between them)
        block = (ou, ov, a_of, b_of, {ab: p for ab, (p, _) in prices.items()},
                 {ab: 0.0 if p == INFEASIBLE else kept(*ab) for ab, (p, _) in prices.items()},
                 {ab: sp for ab, (_, sp) in prices.items()})
        blocks.append(block)
        if variant and not both:
            blocks_kept.append(block)

    def problem_of(blocks, buckets, node_cost, node_split, memory, known=None):
        """The problem of these prices, and its merged blocks (`_merge_blocks`)."""
        merged, where, table = _merge_blocks(blocks, known)
        terms = [[(kind, where[at] if kind == "y" else at, held) for kind, at, held in bucket]
                 for _, bucket in sorted(buckets.items())]
        return _OwnerProblem(node_cost, memory, [b[:5] for b in merged], [b[5] for b in merged],
                             terms, node_split if overlap else None,
                             [b[6] for b in merged] if overlap else None, sync), table

    problem, merged = problem_of(blocks, buckets, node_cost, node_split, memory)
    if variant:  # (sharing the problem's merged blocks where it merged the same ones)
        problem.kept_gathered = problem_of(blocks_kept, buckets_kept, *variant, merged)[0]
    return problem


def _copy_prices(prices: dict[str, list]) -> dict[str, list]:
    """Per owner, a copy of its list of prices (one per strategy)."""
    return {o: list(ps) for o, ps in prices.items()}


# The last element of the key of a placement pair's column kept gathered (see `_owner_problem`).
KEPT = "kept gathered"


def price_key(cost: CostModel, twin: dict[str, str] | None, v: str) -> tuple:
    """Nodes with one key have the same prices: twins (identical nodes of repeated layers,
    `twin` maps a node to its earliest one) recomputed alike whose outputs as many ops read
    (the last layer's output is read by fewer: autograd sums fewer gradients)."""
    return (twin.get(v, v) if twin else v, recompute_state(cost, v), cost.gradient_readers(v))


def edge_key(cost: CostModel, twin: dict[str, str] | None, e: Edge) -> tuple:
    """Edges with one key have the same prices at the same placements: between the same
    twins (see `price_key`), recomputed alike."""
    return (twin.get(e.producer, e.producer) if twin else e.producer, e.out_index,
            twin.get(e.consumer, e.consumer) if twin else e.consumer, e.slot,
            recompute_state(cost, e.producer), recompute_state(cost, e.consumer))


def _add(costs: list[float], k: int, p: float) -> None:
    costs[k] = INFEASIBLE if INFEASIBLE in (p, costs[k]) else costs[k] + p


def _merge_blocks(blocks: list, known: dict | None = None) -> tuple[list, list[int], dict]:
    """Edge blocks between the same owners with the same placements become one block; also
    the merged block of each given one, and what `known` takes. A block is (producer owner,
    consumer owner, a_of, b_of, then dicts by placement pair: prices and Splits added as such,
    the rest summed). `known`: the third result of an earlier call, whose merged blocks are
    taken as they are where they merged the same blocks (the same objects: a relaxation's
    kept-gathered variant shares most of the problem's)."""
    groups: dict = {}  # key -> its blocks, in first-seen order
    keys = []
    for i, block in enumerate(blocks):
        ou, ov, a_of, b_of, price = block[:5]
        # a block with kept-gathered columns stays alone: its freed-or-kept choice is its
        # own parameter's, which a merged column would tie to another's
        key = (ou, ov, tuple(a_of), tuple(b_of)) if not any(len(ab) > 2 for ab in price) \
            else ("alone", i)
        keys.append(key)
        groups.setdefault(key, []).append(block)
    out, where, table = [], {}, {}
    for key, members in groups.items():
        ids = tuple(map(id, members))
        where[key] = len(out)
        if known is not None and key in known and known[key][0] == ids:
            out.append(known[key][1])
            table[key] = known[key]
            continue
        first = members[0]  # (copied where others are added to it)
        merged = first if len(members) == 1 else (*first[:4], *(dict(f) for f in first[4:]))
        for block in members[1:]:
            for into, field in zip(merged[4:], block[4:]):
                if field and isinstance(next(iter(field.values())), Split):
                    for ab, p in field.items():
                        into[ab] = into[ab].plus(p)
                    continue
                for ab, p in field.items():
                    q = into[ab]
                    into[ab] = INFEASIBLE if p == INFEASIBLE or q == INFEASIBLE else q + p
        out.append(merged)
        table[key] = (ids, merged)
    return out, [where[key] for key in keys], table


def _classes(placements, live_only: bool = False) -> dict:
    """Strategy indices grouped by placement, in first-seen order (with `live_only`, not
    those RULED_OUT)."""
    out: dict = defaultdict(list)
    for k, p in enumerate(placements):
        if not (live_only and p is RULED_OUT):
            out[p].append(k)
    return dict(out)


class _RuledOut:
    """The placement of an edge at an owner strategy the solver can never choose."""

    def __repr__(self) -> str:
        return "RULED_OUT"


RULED_OUT = _RuledOut()


def _live(placements: list, live: list[bool]) -> list:
    """`placements` (one per owner strategy) with those of ruled-out strategies RULED_OUT;
    as they are when every strategy is ruled out (the solver then reports the owner)."""
    if not any(live):
        return placements
    return [p if ok else RULED_OUT for p, ok in zip(placements, live)]
