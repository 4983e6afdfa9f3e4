"""A mixed-integer linear program held as arrays, solved by HiGHS (highspy) or by one of
OR-Tools' backends.

The intra-op ILP (solver/ilp.py) is built here column by column and row by row, then handed
to the solver whole: HiGHS through its own Python module (`highspy`), which takes the arrays
as they are, and is 1.7x faster than the HiGHS OR-Tools 9.15 bundles on the same models
(Llama-3 70B levels over 256 x 4 and 512 x 2 H100s: 3.7 against 6.6 s, 5.5 against 9.3 s);
SCIP, CBC and CP-SAT through OR-Tools' pywraplp, which also takes a starting hint. HiGHS
is given none: started from the relaxed plan on a Llama-3 70B level with the exact overlap
rows and presolve off, it declared that start optimal at its root, 2.5% slower than the
plan it found unstarted with presolve on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INF = float("inf")

OPTIMAL, FEASIBLE, INFEASIBLE, NO_SOLUTION = "optimal", "feasible", "infeasible", "no solution"


@dataclass
class Program:
    """Columns (bounds, integrality, objective coefficient) and rows (bounds, terms); the
    objective is minimized."""

    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def var(self, lower: float = 0.0, upper: float = 1.0, integer: bool = False,
            cost: float = 0.0) -> int:
        """A new column; its index."""
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        self.cost.append(cost)
        return len(self.cost) - 1

    def bool_var(self, cost: float = 0.0) -> int:
        """A new 0/1 column; its index."""
        return self.var(0.0, 1.0, True, cost)

    def row(self, terms, lower: float = -INF, upper: float = INF) -> None:
        """`lower <= sum coefficient * column <= upper` over `terms`, (column, coefficient)
        pairs (a column named twice adds up)."""
        merged: dict[int, float] = {}
        for j, a in terms:
            merged[j] = merged.get(j, 0.0) + a
        for j, a in merged.items():
            if a:
                self.index.append(j)
                self.value.append(a)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_variables(self) -> int:
        return len(self.cost)

    @property
    def num_constraints(self) -> int:
        return len(self.row_lower)


class SolverTrouble(RuntimeError):
    """The solver ended without a plan, an infeasibility proof or a limit reached (HiGHS's
    model status "Unknown": numerical trouble)."""


@dataclass
class Result:
    """What the solver reported: its status (OPTIMAL, FEASIBLE: a plan, not proven best;
    INFEASIBLE; NO_SOLUTION: stopped, by the time limit, before any), each column's value
    and the objective (with a solution), and the bound it proved on the optimum (None where
    unknown)."""

    status: str
    values: np.ndarray | None = None
    objective: float | None = None
    bound: float | None = None


def solve(program: Program, backend: str, time_limit: float, gap: float,
          hint: dict[int, float] | None = None, options: str = "") -> Result:
    """Minimize `program` with `backend` ("HIGHS", or an OR-Tools backend: "SCIP", "CBC",
    "CP_SAT") within `time_limit` seconds, stopping at relative gap `gap`. `hint`, a start
    for some columns, is given to the OR-Tools backends; `options` are HiGHS options,
    "name = value" per line."""
    if backend == "HIGHS":
        return _highs(program, time_limit, gap, options)
    return _ortools(program, backend, time_limit, gap, hint)


def _highs(program: Program, time_limit: float, gap: float, options: str) -> Result:
    import highspy  # imported when first solving

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    for line in options.splitlines():
        if line.strip():
            name, value = (s.strip() for s in line.split("=", 1))
            if h.setOptionValue(name, _option(value)) != highspy.HighsStatus.kOk:
                raise ValueError(f"HiGHS refused the option {name} = {value}")
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("threads", 1)  # one worker per core already (autopar.search)
    n = program.num_variables
    h.addVars(n, np.asarray(program.lower, dtype=np.float64),
              np.asarray(program.upper, dtype=np.float64))
    cols = np.arange(n, dtype=np.int32)
    h.changeColsCost(n, cols, np.asarray(program.cost, dtype=np.float64))
    integer = np.asarray(program.integer, dtype=bool)
    if integer.any():
        which = cols[integer]
        h.changeColsIntegrality(len(which), which,
                                np.full(len(which), int(highspy.HighsVarType.kInteger),
                                        dtype=np.uint8))
    m = program.num_constraints
    if m:
        h.addRows(m, np.asarray(program.row_lower, dtype=np.float64),
                  np.asarray(program.row_upper, dtype=np.float64), len(program.index),
                  np.asarray(program.starts[:-1], dtype=np.int32),
                  np.asarray(program.index, dtype=np.int32),
                  np.asarray(program.value, dtype=np.float64))
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    kind = highspy.HighsModelStatus
    if status in (kind.kInfeasible, kind.kUnboundedOrInfeasible):
        return Result(INFEASIBLE)  # (every column here is bounded or costs more as it grows)
    has_plan = info.primal_solution_status == 2  # kSolutionStatusFeasible
    stopped = tuple(getattr(kind, name) for name in ("kTimeLimit", "kIterationLimit",
                                                     "kSolutionLimit", "kInterrupt",
                                                     "kMemoryLimit")
                    if hasattr(kind, name))  # (kMemoryLimit: newer highspy only)
    if not (has_plan and (status == kind.kOptimal or status in stopped)):
        if status in stopped:
            return Result(NO_SOLUTION)
        raise SolverTrouble(f"HiGHS stopped without a plan: {h.modelStatusToString(status)}")
    values = np.asarray(h.getSolution().col_value)
    bound = info.mip_dual_bound if integer.any() else info.objective_function_value
    return Result(OPTIMAL if status == highspy.HighsModelStatus.kOptimal else FEASIBLE,
                  values, info.objective_function_value,
                  bound if np.isfinite(bound) else None)


def _option(value: str):
    """A HiGHS option's value from its text: a number where it reads as one, else the text
    ("off", "choose")."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _ortools(program: Program, backend: str, time_limit: float, gap: float,
             hint: dict[int, float] | None) -> Result:
    from ortools.linear_solver import pywraplp  # imported when first solving: import is slow

    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise RuntimeError(f"OR-Tools was built without the {backend} backend")
    solver.SuppressOutput()
    solver.SetTimeLimit(int(time_limit * 1000))
    inf = solver.infinity()

    def bound(b: float) -> float:
        return inf if b == INF else -inf if b == -INF else b

    xs = [solver.IntVar(lo, hi, "") if integer else solver.NumVar(bound(lo), bound(hi), "")
          for lo, hi, integer in zip(program.lower, program.upper, program.integer)]
    objective = solver.Objective()
    for var, c in zip(xs, program.cost):
        if c:
            objective.SetCoefficient(var, c)
    objective.SetMinimization()
    for r in range(program.num_constraints):
        row = solver.Constraint(bound(program.row_lower[r]), bound(program.row_upper[r]))
        for k in range(program.starts[r], program.starts[r + 1]):
            row.SetCoefficient(xs[program.index[k]], program.value[k])
    if hint:
        solver.SetHint([xs[j] for j in hint], list(hint.values()))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, gap)
    status = solver.Solve(params)
    if status == pywraplp.Solver.INFEASIBLE:
        return Result(INFEASIBLE)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if status == pywraplp.Solver.MODEL_INVALID:
            raise RuntimeError(f"the {backend} solver found the model invalid")
        return Result(NO_SOLUTION)
    best = objective.BestBound()
    return Result(OPTIMAL if status == pywraplp.Solver.OPTIMAL else FEASIBLE,
                  np.array([v.solution_value() for v in xs]), objective.Value(),
                  best if np.isfinite(best) else None)
