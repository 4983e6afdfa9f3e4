"""Plans made without the solver: `greedy` (the ILP's starting hint, and its answer when the
time limit passes before it finds a plan) and `random_choice` (a uniformly drawn valid plan)."""

from __future__ import annotations

import random

from autopar.passes.strategies import StrategyGraph

from .cost import INFEASIBLE, CostModel
from .plan_prices import node_costs


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
