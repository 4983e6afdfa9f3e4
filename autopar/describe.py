"""The plan's description: a complete assignment of strategies as a Plan.

`describe` prices what the solver (or a random draw, or a pipeline's stage solves) chose, op by
op, as the ILP priced it (twins choosing alike priced once), and writes it down for people and
programs: each op's placements, time and why it runs whole (`why_replicated`), every
collective of a step, the cost by kind with the seconds hidden under compute
(`hidden_seconds`), memory per device, and each node's strategy by its stable id
(autopar/choice.py) for the build.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from autopar.passes.placement import fmt
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
from autopar.passes.trace import TracedProgram
from autopar.solver.cost import CostModel, Split, step_seconds
from autopar.solver.ilp import Solution
from autopar.solver.memory import exact_memory
from autopar.solver.plan_prices import (
    Edge,
    edge_key,
    loss_sink_time,
    plan_split,
    plan_time,
    price_key,
)

from .choice import candidates_fingerprint, fingerprint, strategy_ids
from .mesh import MeshSpec
from .options import PlanOptions
from .plan import Collective, OpEntry, Plan, PlanCost

CHEAPER = "replicated is cheaper"


def describe(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
             choice: dict[str, Strategy], sol: Solution | None = None, *,
             memory_budget: float | None = None, options: PlanOptions | None = None,
             memory: dict[str, float] | None = None,
             twin: dict[str, str] | None = None) -> Plan:
    """The Plan for a complete assignment of strategies (from the solver or given);
    `memory`, when given, is its `exact_memory`. Twins (`twin`: the clustering's, see
    solver/plan_prices.py `price_key`) choosing alike are priced once, as in the ILP."""
    index = strategy_ids(graph, choice)
    walk = _walk(program, graph, mesh, cost, choice, index, twin)
    comm = walk.comm
    memory = dict(memory) if memory is not None else exact_memory(graph, cost, choice, twin)
    if graph.loss is not None:  # a loss that must be gathered (not a pending sum) costs here
        name, idx = graph.loss
        comm["all_gather"] += loss_sink_time(cost, graph.nodes[name], choice[name].out(idx), idx)
    hidden = hidden_seconds(cost, plan_split(graph, cost, index, twin), walk.side)
    step_time = walk.compute + sum(comm.values()) - sum(hidden.values())
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
    return Plan(mesh, inputs, params, walk.ops, walk.collectives,
                PlanCost(step_time, walk.compute, comm, memory,
                         sol.objective if sol else plan_time(graph, cost, index),
                         memory_budget=memory_budget or 0.0, compute_forward=walk.forward,
                         precision=cost.precision.name, optimizer=cost.optimizer.name,
                         compute_source="measured" if cost.measured else "roofline",
                         hidden=hidden),
                strategies, fingerprint(graph), sol.solve_time if sol else 0.0,
                sol.backend if sol else "given", graph.unsupported,
                options=options or PlanOptions(), recompute=cost.recompute,
                resharded=sorted(program.params.get(n, n) for n in cost.reshard),
                zero={program.params[n]: s.zero for n, s in choice.items()
                      if graph.nodes[n].kind == PARAM and s.zero},
                choice=index, candidates=candidates_fingerprint(graph),
                randomness=cost.randomness)


@dataclass
class _Walk:
    """What `describe` reads off the nodes: op entries, collectives, seconds of compute (of
    it forward), of communication by kind, and of each (kind, pass) beside compute."""

    ops: list[OpEntry] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    compute: float = 0.0
    forward: float = 0.0
    comm: dict[str, float] = field(default_factory=lambda: {
        "all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "all_to_all": 0.0,
        "gradient_sync": 0.0})
    side: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))


def _walk(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
          choice: dict[str, Strategy], index: dict[str, int], twin) -> _Walk:
    """Every node's compute, op entry and collectives under `choice` (ids `index`), each
    price key's compute and each edge key's collectives priced once (see describe)."""
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

    out = _Walk()
    comm, side = out.comm, out.side
    for v in graph.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            for kind, k, nbytes, t in cost.grad_sync_steps(v, s.output, s.zero):
                comm["gradient_sync"] += t
                if kind != "all_gather":
                    side["gradient_sync", "backward"] += t
                out.collectives.append(Collective(kind, k, nbytes, t, "gradient sync",
                                                  program.params[v.name]))
            fwd, bwd = compute_times(v, s)  # mixed precision's casts
            out.compute += fwd + bwd
            out.forward += fwd
            continue
        if v.kind == INPUT:
            continue
        fwd, bwd = compute_times(v, s)
        ct = fwd + bwd
        out.compute += ct
        out.forward += fwd
        if v.kind == OP:
            shown = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            out.ops.append(OpEntry(v.name, v.op, [fmt(p) for p in s.inputs], shown, 0, ct,
                                   v.source, v.module, why_replicated(v, s, mesh)))
        for slot, (u, idx) in enumerate(v.inputs):
            src, dst = choice[u].out(idx), s.inputs[slot]
            beside = graph.nodes[u].kind == PARAM
            for kind, k, nbytes, t, phase in edge_collectives(Edge(v.name, slot, u, idx),
                                                              src, dst):
                out.collectives.append(Collective(kind, k, nbytes, t, phase, v.name))
                comm[kind] += t
                if beside:
                    side[kind, "forward" if phase == "forward" else "backward"] += t
    return out


def why_replicated(node: SNode, strategy: Strategy, mesh: MeshSpec) -> str:
    """Why `node` runs whole on every rank under `strategy` ("" when it shards, or the mesh
    is one device): its candidates' reason (no rule, indivisible shapes, ...) or, when it
    had sharded candidates, that replicating is cheaper."""
    if mesh.size == 1 or not replicated(strategy):
        return ""
    return node.replicated_only or CHEAPER



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
