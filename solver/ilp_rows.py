"""The intra-op ILP (solver/ilp.py's docstring) as columns and rows of a solver/mip.py Program,
one function per family of the formulation, added in this order: the strategy columns x[v,s]
with each owner's row (`strategy_columns`), each edge block's columns y[e,a,b] with its
transport rows (`edge_columns`), each pass's exposed side seconds E_p (`overlapped_passes`),
the largest FSDP bucket's g (`largest_bucket`), and the memory constraint (`budget_row`).
The order of columns and rows is part of the plan: HiGHS's answer among plans of one price
depends on it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from . import mip
from .cost import INFEASIBLE, CostModel, Split
from .owner_problem import OwnerProblem, classes

SCALE = 1e6  # seconds -> microseconds inside the solver
GIB = 1.0 / 2**30  # bytes -> GiB in the memory constraint and the least-memory objective

# Collectives hidden under compute cost the step nothing, so plans that differ only in them
# tie; the one that moves less wins (this share of their seconds is added to the objective,
# not to the reported one).
SIDE_TIEBREAK = 1e-3


@dataclass(frozen=True)
class Objective:
    """How the columns are priced. `by_memory`: bytes (in GiB) instead of seconds
    (microseconds: `scale`). `split`: with overlap, side seconds priced at the share
    `relaxed` (and `tiebreak`) unless the exact rows price them. `once`: the share of each
    strategy's gradient synchronization a step of several microbatches leaves out of the
    price of one (it synchronizes once: ilp.py `relaxed_bound`, planner `accumulated`).
    `integral`: x columns integral (not for a relaxation)."""

    by_memory: bool
    scale: float
    split: bool
    edge: float      # the share of side seconds nothing hides (cost.edge_share)
    relaxed: float
    tiebreak: float
    once: float
    integral: bool


@dataclass
class IlpProgram:
    """The program built, and its columns: x[o] per owner strategy, `side` (column, its price
    by where it runs) for the overlap rows and the plan's split, `wholes` the same with
    gradient sync whole (for a relaxation), the memory constraint's edge terms `y_terms`
    (block, (a, b), column) and `y_of` by (block, pair), `gathered` the largest bucket's g."""

    prog: mip.Program
    objective: Objective
    x: dict[str, list[int]]
    side: list[tuple[int, Split]]
    wholes: list[tuple[int, Split]]
    y_terms: list[tuple[int, tuple, int]]
    y_of: dict[tuple[int, tuple], int]
    gathered: int | None


def objective(problem: OwnerProblem, cost: CostModel, minimize: str, exact_overlap: bool,
              side_share: float | None, relax: int) -> Objective:
    """How ilp.py's `_solve` prices the columns: see its `side_share` and `relax`. A step of
    m microbatches (`relax`, else `cost.accumulation`) synchronizes gradients once: each
    strategy's synchronization is priced 1/m per microbatch (`once` = (m-1)/m left out), or
    a plan that synchronizes (data parallel) would pay m times what it does against one
    that gathers every microbatch (FSDP)."""
    m = relax or cost.accumulation
    by_memory = minimize == "memory"
    split = problem.node_split is not None and not by_memory
    edge = cost.edge_share() if split else 0.0
    return Objective(
        by_memory, GIB if by_memory else SCALE, split, edge,
        # relaxed (the first solve): side seconds priced at their unhidden share only
        0.0 if not split or exact_overlap else edge if side_share is None else side_share,
        0.0 if relax else SIDE_TIEBREAK,
        (m - 1) / m if m > 1 and problem.sync and not by_memory else 0.0,
        not relax)


def build(problem: OwnerProblem, obj: Objective, exact_overlap: bool,
          backend: str) -> IlpProgram:
    """Every column and row but the memory constraint's (`budget_row`), in order."""
    prog = mip.Program()
    x, side, wholes = strategy_columns(prog, problem, obj)
    y_terms, y_of = edge_columns(prog, problem, obj, x, side, wholes)
    if obj.split and exact_overlap:
        unit = 1e-3 if backend == "CP_SAT" else 1.0
        if obj.once:
            overlapped_passes(prog, side, obj.scale, obj.edge, unit, wholes=wholes,
                              share=1 - obj.once)
        else:
            overlapped_passes(prog, side, obj.scale, obj.edge, unit)
    gathered = largest_bucket(prog, problem.buckets, x, y_of)  # in GiB
    if obj.by_memory and gathered is not None:
        prog.cost[gathered] = 1.0
    return IlpProgram(prog, obj, x, side, wholes, y_terms, y_of, gathered)


def strategy_columns(prog: mip.Program, problem: OwnerProblem, obj: Objective
                     ) -> tuple[dict[str, list[int]], list, list]:
    """x[v,s] (one column per owner strategy, fixed at 0 where INFEASIBLE) priced t[v,s]
    (m[v,s] when minimizing memory), each owner followed by its row sum_s x[v,s] = 1. Also
    the columns' prices by where they run (`side`, `wholes`: see IlpProgram)."""
    x: dict[str, list[int]] = {}
    side: list[tuple[int, Split]] = []
    wholes: list[tuple[int, Split]] = []
    once, split = obj.once, obj.split
    for o, costs in problem.node_cost.items():
        row = []
        for k, (t, m) in enumerate(zip(costs, problem.memory[o])):
            if t == INFEASIBLE:
                row.append(prog.var(0.0, 0.0, obj.integral))
                continue
            price = m if obj.by_memory else t
            if once:
                price -= once * sum(problem.sync[o][k])
            if split:  # side seconds: only their unhidden share
                sp = whole = problem.node_split[o][k]
                if once:  # (the critical seconds stay whole in the rows: see relaxed_bound)
                    sp = sp.plus(Split(0.0, 0.0, 0.0, problem.sync[o][k].side_backward), -once)
                price -= (1 - obj.tiebreak - obj.relaxed) * (sp.side_forward + sp.side_backward)
            row.append(prog.var(0.0, 1.0, obj.integral, price * obj.scale))
            if split:
                side.append((row[-1], sp))
                if once:
                    wholes.append((row[-1], whole))
        prog.row(((var, 1.0) for var in row), 1.0, 1.0)
        x[o] = row
    return x, side, wholes


def edge_columns(prog: mip.Program, problem: OwnerProblem, obj: Objective,
                 x: dict[str, list[int]], side: list, wholes: list
                 ) -> tuple[list[tuple[int, tuple, int]], dict[tuple[int, tuple], int]]:
    """Per edge block, y[e,a,b] in [0,1] for each placement pair not INFEASIBLE, priced
    c[e,a,b] (m[e,a,b] when minimizing memory), then its transport rows: producer side
    sum_b y[e,a,b] = sum_{s: out_e(s) = a} x[u,s] for each placement a, then consumer side
    sum_a y[e,a,b] = sum_{s: in_e(s) = b} x[v,s] for each b. Appends to `side`, `wholes`."""
    y_terms = []  # (block, (a, b), column): the memory constraint's edge terms
    y_of: dict[tuple[int, tuple], int] = {}
    split = obj.split
    for i, (ou, ov, a_of, b_of, price) in enumerate(problem.edges):
        y = {}
        for ab, cst in price.items():  # ab: (a, b), or (a, b, KEPT) (see owner_problem.py)
            if cst == INFEASIBLE:
                continue
            coefficient = problem.edge_memory[i].get(ab, 0.0) if obj.by_memory else cst
            if split:
                sp = problem.edge_split[i][ab]
                coefficient -= (1 - obj.tiebreak - obj.relaxed) * (
                    sp.side_forward + sp.side_backward)
            var = prog.var(0.0, 1.0, False, coefficient * obj.scale)
            if split:
                side.append((var, sp))
                if obj.once:
                    wholes.append((var, sp))
            y[ab] = var
            y_terms.append((i, ab, var))
            y_of[(i, ab)] = var
        rows: dict = defaultdict(list)
        cols: dict = defaultdict(list)
        for ab, var in y.items():
            rows[ab[0]].append(var)
            cols[ab[1]].append(var)
        for a, ks in classes(a_of).items():
            prog.row([(v, 1.0) for v in rows[a]] + [(x[ou][k], -1.0) for k in ks], 0.0, 0.0)
        for b, js in classes(b_of).items():
            prog.row([(v, 1.0) for v in cols[b]] + [(x[ov][j], -1.0) for j in js], 0.0, 0.0)
    return y_terms, y_of


def overlapped_passes(prog: mip.Program, side: list[tuple[int, Split]], scale: float,
                      edge: float, unit: float = 1.0,
                      wholes: list[tuple[int, Split]] | None = None,
                      share: float = 1.0) -> None:
    """E_f and E_b of the formulation's overlap rows: each pass takes the longer of its
    critical path and the collectives beside it (cost.step_seconds): the objective holds the
    critical seconds, and per pass a column bounded below by the side seconds less the
    critical ones, by the share `edge` of the side seconds that nothing hides, and by 0, adds
    what of the side collectives is not hidden. The column counts `unit`s of the objective
    (CP-SAT makes continuous columns integers: there, thousandths). With `wholes` (the
    columns' prices with gradient sync whole, where `side` counts a share of it: ilp.py
    `relaxed_bound`), backward's column is also bounded below by `share` x what those side
    seconds exceed the critical ones by."""
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


def largest_bucket(prog: mip.Program, buckets: list[list[tuple]], x: dict,
                   y_of: dict) -> int | None:
    """The formulation's g: a column bounded below by every FSDP bucket's gathers in flight,
    g >= sum_{e in B} g[e,a,b] y[e,a,b] (None: no bucket gathers anything in any plan). A
    bucket is a sum of terms ("x", owner, {strategy: bytes}) or ("y", block, {(a, b): bytes});
    buckets alike (repeated layers) give one constraint. The column is in GiB, as the memory
    constraint (bytes make its coefficients 1e10 and HiGHS's feasibility tolerance
    meaningless)."""
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


def budget_row(ilp: IlpProgram, problem: OwnerProblem, memory_budget: float,
               drawn: float) -> int:
    """The memory constraint, in GiB: sum m[v,s] x[v,s] + sum m[e,a,b] y[e,a,b] + g <= M,
    M the budget less the bytes `drawn` whatever the plan; its row's index."""
    prog = ilp.prog
    prog.row([(ilp.x[o][k], m * GIB) for o, ms in problem.memory.items()
              for k, m in enumerate(ms) if m]
             + [(var, problem.edge_memory[i][ab] * GIB) for i, ab, var in ilp.y_terms
                if problem.edge_memory[i].get(ab)]
             + ([(ilp.gathered, 1.0)] if ilp.gathered is not None else []),
             upper=(memory_budget - drawn) * GIB)
    return prog.num_constraints - 1
