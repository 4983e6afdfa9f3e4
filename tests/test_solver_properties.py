"""Solver-level properties on small drawn graphs: the ILP's optimum equals brute-force
enumeration of every assignment under the same cost model (collectives overlapping compute
included), and the objective the solver reports equals the cost model's price of the plan it
returns."""

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import autopar
from autopar.passes import strategies
from autopar.passes.trace import trace
from autopar.solver.cost import INFEASIBLE, NO_TIME, CostModel, step_seconds
from autopar.solver.ilp import (
    edges,
    node_splits,
    plan_split,
    plan_time,
    priced_problem,
    relaxed_bound,
    solve,
)
from autopar.solver.memory import plan_memory
from tests.models import MLP

LIMIT = 60_000  # assignments enumerated at most per example


def _tables(graph, cost):
    """The node names, each node's prices by strategy, the edges and each edge's prices by
    (producer strategy, consumer strategy), keyed by id(edge)."""
    names = list(graph.nodes)
    es = edges(graph)
    table = {}
    for e in es:
        u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
        table[id(e)] = [[cost.edge_split(graph, v, e.slot, su.out(e.out_index),
                                         sv.inputs[e.slot]) for sv in v.strategies]
                        for su in u.strategies]
    return names, node_splits(graph, cost), es, table


def _combos(graph, names):
    for combo in itertools.product(*(range(len(graph.nodes[n].strategies)) for n in names)):
        yield dict(zip(names, combo))


def _summed(tables, choice, bound=None):
    """The prices of `choice` summed (a cost.Split), or None once the passes alone reach
    `bound` (a step is never shorter)."""
    names, t, es, table = tables
    total = NO_TIME
    for n in names:
        total = total.plus(t[n][choice[n]])
    for e in es:
        total = total.plus(table[id(e)][choice[e.producer]][choice[e.consumer]])
        if bound is not None and total.forward + total.backward >= bound:
            return None
    return total


def brute_force(graph, cost) -> float:
    """The cheapest complete assignment, by enumeration: each one's prices summed by where
    they run (compute path or beside it, cost.Split) and made a step (cost.step_seconds)."""
    tables = _tables(graph, cost)
    best = INFEASIBLE
    for choice in _combos(graph, tables[0]):
        total = _summed(tables, choice, best)
        if total is not None:
            best = min(best, step_seconds(total, cost.overlap, cost.edge_share())[0])
    return best


def priced_assignments(graph, cost) -> list[tuple[float, dict]]:
    """Every complete assignment with its step (priced as brute_force prices them), fastest
    first."""
    tables = _tables(graph, cost)
    steps = [(step_seconds(_summed(tables, choice), cost.overlap, cost.edge_share())[0], choice)
             for choice in _combos(graph, tables[0])]
    return sorted(steps, key=lambda tc: tc[0])


@st.composite
def small_problems(draw):
    depth = draw(st.integers(1, 2))
    widths = draw(st.lists(st.sampled_from([2, 3, 4, 6, 8]), min_size=depth + 1,
                           max_size=depth + 1))
    batch = draw(st.sampled_from([2, 3, 4, 8, 64]))
    mesh = draw(st.sampled_from([(2,), (4,)]))
    # "cpu-overlapped": slow links under overlap, where the fastest plans' collectives outlast
    # compute (the ILP's exact rows for each pass's longer side)
    hardware = draw(st.sampled_from(["cpu", "h100", "cpu-overlapped"]))
    if hardware == "cpu-overlapped":
        hardware = dataclasses.replace(autopar.CPU, name=hardware, overlap=True)
    # small buckets: on the H100, whose collectives overlap compute, most of the gradient
    # synchronization and FSDP gathers can hide
    bucket = draw(st.sampled_from([64, 2**20, 2**25]))
    return widths, batch, mesh, hardware, bucket


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), backend=st.sampled_from(["HIGHS", "SCIP", "CP_SAT"]))
def test_ilp_optimum_equals_brute_force(problem, backend):
    widths, batch, mesh, hardware, bucket = problem
    torch.manual_seed(0)
    model = MLP(widths, activation="relu")
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    graph = strategies.build(trace(model, (x,), torch.nn.functional.cross_entropy, y), mesh)
    assume(math.prod(len(v.strategies) for v in graph.nodes.values()) <= LIMIT)
    cost = CostModel(autopar.MeshSpec(mesh, hardware=hardware), bucket_bytes=bucket,
                     graph=graph)
    sol = solve(graph, cost, backend=backend)
    assert sol.objective == pytest.approx(brute_force(graph, cost), rel=1e-5, abs=1e-12)
    assert plan_time(graph, cost, sol.choice) == pytest.approx(sol.objective, rel=1e-5,
                                                               abs=1e-12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([8192, 16384, 32768]), batch=st.sampled_from([4096, 65536]),
       mesh=st.sampled_from([(4,), (8,)]), share=st.floats(0.0, 1.0))
def test_ilp_optimum_under_a_budget_equals_brute_force(width, batch, mesh, share):
    """GPU-sized MLPs (meta device) under a budget drawn between the least memory any plan
    needs and what the fastest plan needs: the ILP's optimum is the fastest assignment that
    fits, by enumeration, and fits itself."""
    with torch.device("meta"):
        model = MLP([width, width, width], activation="relu")
    x = torch.empty(batch, width, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    graph = strategies.build(trace(model, (x,), torch.nn.functional.cross_entropy, y), mesh)
    assume(math.prod(len(v.strategies) for v in graph.nodes.values()) <= LIMIT)
    cost = CostModel(autopar.MeshSpec(mesh, hardware="h100"))
    least = solve(graph, cost, minimize="memory").objective
    fastest = plan_memory(graph, cost, solve(graph, cost).choice)
    budget = least + share * (fastest - least)
    # the fastest assignment that fits: the first in order of step that does
    best = next((t for t, choice in priced_assignments(graph, cost)
                 if plan_memory(graph, cost, choice) <= budget), INFEASIBLE)
    sol = solve(graph, cost, memory_budget=budget)
    assert plan_memory(graph, cost, sol.choice) <= budget
    assert sol.objective == pytest.approx(best, rel=1e-5)


def _accumulated_step(graph, cost, choice, m) -> float:
    """The step of assignment `choice` over `m` microbatches as the planner reports it
    (planner `accumulated`): m x the microbatch's step, gradient synchronization once (what
    of it backward hides shared by seconds among backward's side collectives)."""
    total = plan_split(graph, cost, choice)
    step, _, hidden_b = step_seconds(total, cost.overlap, cost.edge_share())
    crit = side = 0.0
    for v in graph.nodes.values():
        if v.kind == strategies.PARAM:
            s = v.strategies[choice[v.name]]
            for kind, _, _, t in cost.grad_sync_steps(v, s.output, s.zero):
                crit, side = (crit + t, side) if kind == "all_gather" else (crit, side + t)
    hidden = hidden_b * side / total.side_backward if total.side_backward else 0.0
    return m * step - (m - 1) * (crit + side - hidden)


# slow links, both parameters best kept gathered at the budget: without the kept-gathered
# columns the relaxation is above the best plan; two microbatches on the H100 with one
# bucket: charged per microbatch, gradient synchronization puts it above too
@example(width=4096, batch=2048, mesh=(8,), m=2, hardware="cpu-overlapped", bucket=2**20,
         share=1.0)
@example(width=4096, batch=32768, mesh=(8,), m=2, hardware="h100", bucket=2**28, share=0.5)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([4096, 16384]), batch=st.sampled_from([2048, 32768]),
       mesh=st.sampled_from([(8,), (2, 2)]), m=st.sampled_from([1, 2, 4]),
       hardware=st.sampled_from(["h100", "cpu-overlapped"]),
       bucket=st.sampled_from([2**20, 2**28]), share=st.floats(0.0, 1.0))
def test_relaxed_bound_is_below_every_plan_that_fits(width, batch, mesh, m, hardware, bucket,
                                                     share):
    """The relaxation a memory search skips levels by (ilp.relaxed_bound) is below the step
    of every assignment that fits the budget over m microbatches (gradient synchronization
    once), ZeRO candidates included, with each parameter freed after forward or kept
    gathered (solver/resharding.py's choice after the ILP, which prices them freed): by
    enumeration of both."""
    if hardware == "cpu-overlapped":
        hardware = dataclasses.replace(autopar.CPU, name=hardware, overlap=True)
    with torch.device("meta"):
        model = MLP([width, width], activation="relu")
    x = torch.empty(batch, width, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    graph = strategies.build(trace(model, (x,), torch.nn.functional.cross_entropy, y), mesh,
                             zero=True)
    params = [n for n, v in graph.nodes.items() if v.kind == strategies.PARAM]
    freed = CostModel(autopar.MeshSpec(mesh, hardware=hardware), bucket_bytes=bucket,
                      graph=graph, accumulation=m, reshard=frozenset(params))
    least = solve(graph, freed, minimize="memory").objective
    fastest = plan_memory(graph, freed, solve(graph, freed).choice)
    budget = least + share * (fastest - least)
    bound = relaxed_bound(graph, freed, priced_problem(graph, freed, relaxation=True),
                          budget, accumulation=m) * m
    costs = {kept: freed.copy(reshard=frozenset(params) - kept)
             for r in range(len(params) + 1) for kept in map(frozenset,
                                                             itertools.combinations(params, r))}
    best = INFEASIBLE
    for choice in _combos(graph, list(graph.nodes)):
        if plan_memory(graph, freed, choice) > budget:
            continue  # (keeping parameters gathered never lowers the memory row)
        best = min(best, min(_accumulated_step(graph, cost, choice, m)
                             for cost in costs.values()
                             if plan_memory(graph, cost, choice) <= budget))
    assert bound <= best * (1 + 1e-6)
    assert bound >= 0.8 * best  # (and close: the search's skipping relies on it)
