"""A plan's choice of strategies by stable id: recorded when the plan is described, looked up
when it is built.

`passes/strategies.py` `build` lists each node's candidate strategies in an order fixed by
the program and the mesh, so a candidate's index in its node's list is a stable id: the
planner records each node's chosen index (`Plan.choice`, `strategy_ids`) and the build, on
every rank, looks them up in the strategy graph it builds from the same trace
(`choice_from_plan`), never matching placements back by their printed form. Two fingerprints
guard the lookup: the graph's (`fingerprint`: node names, ops and shapes, part of the plan's
hash) and its candidate lists' (`candidates_fingerprint`: what the ids index, so that a plan
saved by an autopar that lists candidates otherwise is refused rather than misread).
"""

from __future__ import annotations

import hashlib

from autopar.passes.placement import Placements, fmt
from autopar.passes.strategies import PARAM, Strategy, StrategyGraph
from autopar.passes.trace import TracedProgram


def fingerprint(graph: StrategyGraph) -> str:
    """Identity of a traced graph: node names, ops and shapes."""
    text = "|".join(f"{v.name}:{v.op}:{v.in_shapes}:{v.out_shapes}" for v in graph.nodes.values())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def candidates_fingerprint(graph: StrategyGraph) -> str:
    """Identity of `graph`'s candidate lists, in order: what a strategy id indexes."""
    digest: dict[int, str] = {}  # nodes of one call share their list: each written once
    parts = []
    for v in graph.nodes.values():
        key = id(v.strategies)
        if key not in digest:
            digest[key] = hashlib.sha256(";".join(
                f"{[fmt(p) for p in s.inputs]}>"
                f"{[fmt(o) for o in s.output] if v.multi_output else fmt(s.output)}/{s.zero}"
                for s in v.strategies).encode()).hexdigest()[:16]
        parts.append(f"{v.name}:{digest[key]}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def strategy_ids(graph: StrategyGraph, choice: dict[str, Strategy]) -> dict[str, int]:
    """Each node of `choice` by the index of its strategy among the node's candidates."""
    return {n: graph.nodes[n].strategies.index(s) for n, s in choice.items()}


def choice_from_plan(plan, graph: StrategyGraph) -> dict[str, Strategy]:
    """The strategies a (loaded) plan prescribes, looked up by their ids (`Plan.choice`) in
    `graph`, the strategy graph of the program the plan was made for, built afresh. Raises
    ValueError when the plan was made for another model, input shape or mesh, or by an
    autopar that lists the candidates otherwise."""
    if plan.graph_fingerprint != fingerprint(graph) or plan.submesh_shape != graph.mesh_shape:
        raise ValueError(
            "this plan was made for another model, input shape or mesh (graph fingerprint "
            f"{plan.graph_fingerprint}, mesh {plan.mesh.shape}; this model gives "
            f"{fingerprint(graph)} on mesh {graph.mesh_shape}). Re-plan with autopar.plan.")
    if plan.candidates != candidates_fingerprint(graph):
        raise ValueError(
            "this plan's strategies were chosen among other candidates than this autopar "
            "offers for the model (candidate fingerprint "
            f"{plan.candidates} vs {candidates_fingerprint(graph)}): it was made by another "
            "version of autopar. Re-plan with autopar.plan.")
    return {name: v.strategies[plan.choice[name]] for name, v in graph.nodes.items()}


def kept_storage(graph: StrategyGraph, program: TracedProgram,
                 storage: dict[str, Placements] | None,
                 zero: dict[str, int] | None = None) -> dict[str, list[int]]:
    """For each parameter node, the ids of the strategies that keep it stored at
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
