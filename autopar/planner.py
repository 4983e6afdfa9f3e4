"""From a traced model to a Plan: strategies, cost model, solver, and the Plan's description."""

from __future__ import annotations

import hashlib
import random

from autopar.passes import strategies as strat_pass
from autopar.passes.placement import fmt, local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, Strategy, StrategyGraph
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver.cost import CostModel, numel
from autopar.solver.ilp import Solution, loss_sink_time, plan_time, random_choice, solve

from .mesh import MeshSpec
from .plan import Collective, OpEntry, Plan, PlanCost

DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
        "all_reduce": "all_reduce", "all_to_all": "all_to_all"}


def fingerprint(graph: StrategyGraph) -> str:
    """Identity of a traced graph: node names, ops and shapes."""
    text = "|".join(f"{v.name}:{v.op}:{v.in_shapes}:{v.out_shapes}" for v in graph.nodes.values())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def styles_by_dim(mesh: MeshSpec, force) -> dict[int, str]:
    """`force` as {mesh dimension index: style}; accepts dimension names, indices, or one style
    for every dimension."""
    if force is None:
        return {}
    if isinstance(force, str):
        return {k: force for k in range(mesh.ndim)}
    out = {}
    for key, style in force.items():
        if isinstance(key, str):
            if key not in mesh.names:
                raise ValueError(f"force names mesh dimension {key!r}; the mesh has "
                                 f"{', '.join(mesh.names)}")
            key = mesh.names.index(key)
        out[int(key)] = style
    return out


def solve_plan(program: TracedProgram, mesh: MeshSpec, *, memory_budget=None, force=None,
               solver: str = "HIGHS", time_limit: float = 60.0,
               seed: int = 0) -> tuple[Plan, StrategyGraph]:
    """Build strategies, solve the ILP and describe the result.

    `solver="random"` draws a valid plan instead (seeded by `seed`): any plan the ILP could
    choose may come out, which is what the property tests run.
    """
    graph = strat_pass.build(program, mesh.shape)
    cost = CostModel(mesh)
    if solver == "random":
        drawn = random_choice(graph, cost, random.Random(seed))
        choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
        return describe(program, graph, mesh, cost, choice), graph
    forced, discouraged = allowed_strategies(graph, styles_by_dim(mesh, force))
    budget = memory_budget
    if budget is None:
        budget = mesh.profile.memory * (1 - mesh.profile.memory_reserve)
    sol = solve(graph, cost, memory_budget=budget, backend=solver, time_limit=time_limit,
                forced=forced, discouraged=discouraged)
    choice = {n: graph.nodes[n].strategies[i] for n, i in sol.choice.items()}
    return describe(program, graph, mesh, cost, choice, sol), graph


def describe(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
             choice: dict[str, Strategy], sol: Solution | None = None) -> Plan:
    """The Plan for a complete assignment of strategies (from the solver or given)."""
    index = {n: graph.nodes[n].strategies.index(s) for n, s in choice.items()}
    ops, collectives = [], []
    compute = 0.0
    comm: dict[str, float] = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0,
                              "all_to_all": 0.0, "gradient_sync": 0.0}
    memory = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0}
    for v in graph.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            sync = cost.grad_sync_time(v, s.output)
            comm["gradient_sync"] += sync
            local = numel(_local(v.out_shapes[0], s.output, mesh)) * v.out_dtypes[0].itemsize
            memory["parameters"] += local
            memory["gradients"] += local
            memory["optimizer"] += local * cost.optimizer.states
            for k, p in enumerate(s.output):
                if type(p).__name__ == "Replicate" and mesh.shape[k] > 1:
                    collectives.append(Collective("all_reduce", k, local,
                                                  cost.collective_time("all_reduce", k, local),
                                                  "gradient sync", program.params[v.name]))
            continue
        if v.kind == INPUT:
            continue
        ct = cost.compute_time(v, s)
        compute += ct
        memory["activations"] += cost.activation_memory(v, s)
        if v.kind == OP:
            out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            ops.append(OpEntry(v.name, v.op, [fmt(p) for p in s.inputs], out, 0, ct, v.source))
        for slot, (u, idx) in enumerate(v.inputs):
            producer = graph.nodes[u]
            src, dst = choice[u].out(idx), s.inputs[slot]
            dtype = producer.out_dtypes[idx or 0]
            grad = producer.requires_grad and dtype.is_floating_point
            for step in cost.reshard_steps(v.in_shapes[slot], src, dst):
                if step.kind == "slice":
                    continue
                nbytes = cost.step_bytes(step, dtype)
                st = cost.collective_time(step.kind, step.mesh_dim, nbytes)
                collectives.append(Collective(step.kind, step.mesh_dim, nbytes, st, "forward",
                                              v.name))
                comm[step.kind] += st
                if grad:
                    collectives.append(Collective(DUAL[step.kind], step.mesh_dim, nbytes, st,
                                                  "backward", v.name))
                    comm[DUAL[step.kind]] += st
    if graph.loss is not None:  # a loss that must be gathered (not a pending sum) costs here
        name, idx = graph.loss
        comm["all_gather"] += loss_sink_time(cost, graph.nodes[name], choice[name].out(idx), idx)
    step_time = compute + sum(comm.values())
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
                         sol.objective if sol else plan_time(graph, cost, index)),
                strategies, fingerprint(graph), sol.solve_time if sol else 0.0,
                sol.backend if sol else "given", graph.unsupported)


def choice_from_plan(plan: Plan, graph: StrategyGraph) -> dict[str, Strategy]:
    """The strategies a (loaded) plan prescribes, matched to a freshly traced graph."""
    if plan.graph_fingerprint != fingerprint(graph) or tuple(plan.mesh.shape) != graph.mesh_shape:
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
        for s in v.strategies:
            out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            if [fmt(p) for p in s.inputs] == list(want[0]) and out == want[1]:
                choice[name] = s
                break
        else:
            raise ValueError(f"the plan's strategy for node {name} ({v.op}) is not a valid "
                             f"strategy here: inputs {want[0]} output {want[1]}")
    return choice


def _local(shape, placements, mesh: MeshSpec):
    return local_shape(shape, placements, mesh.shape)

