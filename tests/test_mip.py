"""solver/mip.py: one program, the same answer from HiGHS and from OR-Tools' backends."""

import pytest

from autopar.solver import mip


def _knapsack(capacity: float) -> mip.Program:
    """Pick items (value, weight) within `capacity`, value maximized (minimized negated),
    plus a continuous column that must cover the chosen weight."""
    prog = mip.Program()
    items = [(10.0, 5.0), (7.0, 4.0), (6.0, 3.0), (3.0, 2.0)]
    xs = [prog.bool_var(-v) for v, _ in items]
    slack = prog.var(0.0, mip.INF, cost=0.01)
    prog.row([(x, w) for x, (_, w) in zip(xs, items)], upper=capacity)
    prog.row([(slack, 1.0)] + [(x, -w) for x, (_, w) in zip(xs, items)], lower=0.0)
    return prog


@pytest.mark.parametrize("backend", ["HIGHS", "SCIP", "CBC"])
def test_backends_agree_on_a_small_program(backend):
    result = mip.solve(_knapsack(9.0), backend, 10.0, 1e-9)
    assert result.status == mip.OPTIMAL
    # items 0 and 1 (weight 9, value 17) beat 0 and 2 (8, 16) and 1, 2, 3 (9, 16)
    assert list(result.values[:4].round()) == [1, 1, 0, 0]
    assert result.values[4] == pytest.approx(9.0)
    assert result.objective == pytest.approx(-17 + 0.09)
    assert result.bound == pytest.approx(result.objective, abs=1e-6)


def test_infeasible_and_merged_terms():
    prog = _knapsack(9.0)
    prog.row([(0, 1.0), (0, 1.0)], lower=3.0)  # 2 x0 >= 3: x0 is at most 1
    assert prog.index[-1:] == [0] and prog.value[-1:] == [2.0]
    assert mip.solve(prog, "HIGHS", 10.0, 1e-9).status == mip.INFEASIBLE
    assert mip.solve(prog, "SCIP", 10.0, 1e-9).status == mip.INFEASIBLE


def test_highs_options_are_applied():
    with pytest.raises(ValueError, match="no_such_option"):
        mip.solve(_knapsack(9.0), "HIGHS", 10.0, 1e-9, options="no_such_option = 1")


def test_a_solve_stopped_before_any_plan_has_no_solution():
    """HiGHS given no time stops before any plan: NO_SOLUTION (solver/ilp.py then falls
    back to its greedy plan), not an error and not a plan."""
    result = mip.solve(_knapsack(9.0), "HIGHS", 0.0, 1e-9)
    assert result.status == mip.NO_SOLUTION and result.values is None


def test_a_solve_in_numerical_trouble_is_solved_again_with_presolve(monkeypatch):
    """HiGHS without presolve ended a Llama-3 70B level's relaxation in an unknown state
    (SolverTrouble, raised as such); the ILP solves it again with presolve, for the plan or
    the bound alike."""
    import torch
    import torch.nn.functional as F

    import autopar
    from autopar.passes import strategies
    from autopar.passes.trace import trace_example
    from autopar.solver.cost import CostModel
    from autopar.solver.ilp import solve
    from tests.models import MLP

    calls = []
    real = mip.solve

    def troubled(program, backend, time_limit, gap, hint=None, options=""):
        calls.append(options)
        if "presolve = off" in options:
            raise mip.SolverTrouble("HiGHS stopped without a plan: Unknown")
        return real(program, backend, time_limit, gap, hint, options)

    monkeypatch.setattr(mip, "solve", troubled)
    model = MLP([16, 32, 8])
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (2,))
    sol = solve(graph, CostModel(autopar.MeshSpec((2,), hardware="cpu"), graph=graph))
    assert calls == ["presolve = off", ""] and sol.choice


def test_a_relaxation_stalled_without_presolve_is_solved_with_it(monkeypatch):
    """Without presolve HiGHS stalled on a Llama-3 405B level's relaxation (no answer in 60 s;
    with presolve, infeasible in 0.55 s): a relaxation gets RELAX_SECONDS without presolve,
    then the rest of its time limit with it, and that answer stands."""
    import torch
    import torch.nn.functional as F

    import autopar
    from autopar.passes import strategies
    from autopar.passes.trace import trace_example
    from autopar.solver import ilp
    from autopar.solver.cost import CostModel
    from autopar.solver.owner_problem import priced_problem
    from tests.models import MLP

    calls = []
    real = mip.solve

    def stalled(program, backend, time_limit, gap, hint=None, options=""):
        calls.append((options, time_limit))
        if "presolve = off" in options:
            return mip.Result(mip.NO_SOLUTION)
        return real(program, backend, time_limit, gap, hint, options)

    monkeypatch.setattr(mip, "solve", stalled)
    model = MLP([16, 32, 8])
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    graph = strategies.build(trace_example(model, (x, y), F.cross_entropy), (2,))
    cost = CostModel(autopar.MeshSpec((2,), hardware="cpu"), graph=graph)
    problem = priced_problem(graph, cost, relaxation=True)
    bound = ilp.relaxed_bound(graph, cost, problem, None, time_limit=10.0)
    assert calls == [("presolve = off", ilp.RELAX_SECONDS), ("", 10.0 - ilp.RELAX_SECONDS)]
    assert bound > 0  # solved (0: out of time)
    calls.clear()
    ilp.solve(graph, cost)  # an integer solve: its whole time without presolve, as before
    assert calls and all(options == "presolve = off" and limit == 60.0
                         for options, limit in calls)
