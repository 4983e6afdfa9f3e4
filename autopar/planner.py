"""From a traced model to a Plan: strategies, cost model, solver, and the Plan's description."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time

from autopar.passes import strategies as strat_pass
from autopar.passes.cluster import cluster
from autopar.passes.pipeline_split import layer_blocks
from autopar.passes.placement import fmt, local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, Strategy, StrategyGraph
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver import stages as pipe
from autopar.solver.cost import CostModel
from autopar.solver.ilp import (
    NoFeasiblePlan,
    Solution,
    loss_sink_time,
    plan_time,
    random_choice,
    solve,
)
from autopar.solver.memory import memory_split

from .mesh import MeshSpec
from .plan import Collective, OpEntry, PipelinePlan, Plan, PlanCost

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
               solver: str = "HIGHS", time_limit: float = 60.0, seed: int = 0,
               fold_layers: bool = True, optimizer=None, precision=None,
               profile=None) -> tuple[Plan, StrategyGraph]:
    """Build strategies, solve the ILP and describe the result.

    `solver="random"` draws a valid plan instead (seeded by `seed`): any plan the ILP could
    choose may come out, which is what the property tests run. `optimizer`, `precision` and
    `profile` (an autopar.profile.OpProfiler: measured op times) configure the cost model.
    """
    graph = strat_pass.build(program, mesh.shape)
    cost = CostModel(mesh, optimizer, graph=graph, precision=precision)
    if profile is not None:
        cost = cost.copy(measured=profile.measure(graph, cost))
    budget = memory_budget
    if budget is None:
        budget = mesh.profile.memory * (1 - mesh.profile.memory_reserve)
    if solver == "random":
        drawn = random_choice(graph, cost, random.Random(seed))
        choice = {n: graph.nodes[n].strategies[i] for n, i in drawn.items()}
        return describe(program, graph, mesh, cost, choice, memory_budget=budget), graph
    forced, discouraged = allowed_strategies(graph, styles_by_dim(mesh, force))
    clusters = cluster(graph, program.graph_module, fold_layers=fold_layers)
    sol = solve(graph, cost, memory_budget=budget, backend=solver, time_limit=time_limit,
                forced=forced, discouraged=discouraged, clustering=clusters)
    choice = {n: graph.nodes[n].strategies[i] for n, i in sol.choice.items()}
    return describe(program, graph, mesh, cost, choice, sol, memory_budget=budget), graph


def describe(program: TracedProgram, graph: StrategyGraph, mesh: MeshSpec, cost: CostModel,
             choice: dict[str, Strategy], sol: Solution | None = None, *,
             memory_budget: float | None = None) -> Plan:
    """The Plan for a complete assignment of strategies (from the solver or given)."""
    index = {n: graph.nodes[n].strategies.index(s) for n, s in choice.items()}
    ops, collectives = [], []
    compute = forward = 0.0
    comm: dict[str, float] = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0,
                              "all_to_all": 0.0, "gradient_sync": 0.0}
    memory = memory_split(graph, cost, choice)
    for v in graph.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            for k, nbytes, t in cost.grad_sync_steps(v, s.output):
                comm["gradient_sync"] += t
                collectives.append(Collective("all_reduce", k, nbytes, t, "gradient sync",
                                              program.params[v.name]))
            continue
        if v.kind == INPUT:
            continue
        fwd, bwd = cost.compute_times(v, s)
        ct = fwd + bwd
        compute += ct
        forward += fwd
        if v.kind == OP:
            out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
            ops.append(OpEntry(v.name, v.op, [fmt(p) for p in s.inputs], out, 0, ct, v.source))
        for slot, (u, idx) in enumerate(v.inputs):
            src, dst = choice[u].out(idx), s.inputs[slot]
            for kind, k, nbytes, t, phase in cost.edge_collectives(graph, v, slot, src, dst):
                collectives.append(Collective(kind, k, nbytes, t, phase, v.name))
                comm[kind] += t
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
                         sol.objective if sol else plan_time(graph, cost, index),
                         memory_budget=memory_budget or 0.0, compute_forward=forward,
                         precision=cost.precision.name, optimizer=cost.optimizer.name,
                         compute_source="measured" if cost.measured else "roofline"),
                strategies, fingerprint(graph), sol.solve_time if sol else 0.0,
                sol.backend if sol else "given", graph.unsupported)


def choice_from_plan(plan: Plan, graph: StrategyGraph) -> dict[str, Strategy]:
    """The strategies a (loaded) plan prescribes, matched to a freshly traced graph."""
    if plan.cost.precision != "fp32":
        raise NotImplementedError(
            f"this plan was made for {plan.cost.precision} training, which autopar plans for but "
            "does not execute yet (the runtime trains in float32); re-plan with "
            "precision=\"fp32\" (the default) to run it")
    if plan.graph_fingerprint != fingerprint(graph) or plan.submesh_shape != graph.mesh_shape:
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



# -- pipelined plans (a "pp" mesh dimension) -----------------------------------------------------

def solve_pipeline_plan(trace_at, batch: int, mesh: MeshSpec, *, microbatches: int | None = None,
                        schedule: str | None = None, virtual_stages: int | None = None,
                        memory_budget=None, force=None, solver: str = "HIGHS",
                        time_limit: float = 60.0, seed: int = 0,
                        loss_reduction: str = "mean", optimizer=None, precision=None,
                        profile=None) -> Plan:
    """Plan a model over a mesh with a "pp" dimension: cut it into pipeline stages
    (solver/stages.py), then solve each stage's intra-op ILP on the other dimensions, identical
    stages once, each stage's inputs fixed to the placements the previous stage produces.

    `trace_at(m)` returns the model traced at the microbatch size `batch // m`. Without
    `microbatches` the model is first traced at the whole batch to choose it. `optimizer`,
    `precision` and `profile` configure the cost model as in `solve_plan`.
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', not {loss_reduction!r}")
    pp = mesh.pipeline_dim
    p = mesh.shape[pp]
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise pipe.StageError(
            f"the batch of {batch} does not split into {microbatches} microbatches; choose a "
            "divisor of the batch (" + ", ".join(map(str, pipe.divisors(batch, batch))) + ")")
    sub = mesh.without(pp)
    backend = "HIGHS" if solver == "random" else solver
    budget = memory_budget if memory_budget is not None else \
        mesh.profile.memory * (1 - mesh.profile.memory_reserve)
    link = mesh.link(pp)
    styles = styles_by_dim(sub, force)
    start = time.perf_counter()

    m0 = microbatches or 1
    program = trace_at(m0)
    if not program.has_loss:
        raise ValueError("a pipelined plan trains through step(); pass loss_fn= (pipelined "
                         "inference alone is not supported)")
    graph = strat_pass.build(program, sub.shape)
    cost = _stage_cost(sub, graph, optimizer, precision, profile)
    blocks = layer_blocks(program, graph)
    priced = pipe.price_blocks(graph, cost, blocks.of_node, blocks.names, link,
                               backend=backend, time_limit=time_limit)
    best = pipe.choose(priced, p, batch, batch // m0, budget, microbatches=microbatches,
                       schedule=schedule, virtual_stages=virtual_stages)
    m, v, sched = best.microbatches, best.virtual_stages, best.schedule
    if m != m0:
        program = trace_at(m)
        graph = strat_pass.build(program, sub.shape)
        cost = _stage_cost(sub, graph, optimizer, precision, profile)
        again = layer_blocks(program, graph)
        if again.names != blocks.names:
            raise RuntimeError("the model traces into different layer blocks at the microbatch "
                               f"size ({again.names} vs {blocks.names})")
        blocks = again
    num_stages = p * v
    stage_of = blocks.stage_of(best.cuts, num_stages)

    # Intra-op per stage, in order: a stage's inputs keep the placements they were produced in.
    worst = max(pipe.in_flight(sched, p, m, v, r) for r in range(p))
    scaled = pipe.activation_scaled(cost, worst)
    rng = random.Random(seed)
    draw = (lambda g: random_choice(g, cost, rng)) if solver == "random" else None
    choice: dict[str, Strategy] = {}
    cache: dict = {}
    stages = []
    for s in range(num_stages):
        members = [n for n in graph.nodes if stage_of.get(n) == s]
        g = pipe.subgraph(graph, members, choice)
        forced, discouraged = allowed_strategies(g, styles) if styles else (None, None)
        try:
            picked = pipe.solve_subgraph(g, scaled, cache,
                                         memory_budget=pipe.stage_budget(budget, v),
                                         backend=backend, time_limit=time_limit,
                                         forced=forced, discouraged=discouraged, draw=draw,
                                         program=program.graph_module)
        except NoFeasiblePlan:
            bounds = [0, *best.cuts, len(blocks.names)]
            names = blocks.names[bounds[s]:bounds[s + 1]]
            raise NoFeasiblePlan(
                f"pipeline stage {s} ({', '.join(names)}) fits no plan within "
                f"{pipe.stage_budget(budget, v) / 2**30:.2f} GiB per device with {worst:g} "
                "microbatches in flight; use more pp ranks or more microbatches") from None
        inside = set(members)  # boundary copies of earlier ops carry no strategy of theirs
        choice.update({n: st for n, st in picked.items()
                       if n in inside or graph.nodes[n].kind != OP})
        stages.append((g, picked))
    for name, node in graph.nodes.items():
        choice.setdefault(name, node.strategies[0])  # unused parameters and inputs

    base = describe(program, graph, sub, cost, choice, memory_budget=budget)
    dims = [k for k in range(mesh.ndim) if k != pp]
    ops = [OpEntry(o.name, o.op, o.inputs, o.output, stage_of.get(o.name, 0), o.time, o.source)
           for o in base.ops]
    collectives = [Collective(c.kind, dims[c.mesh_dim] if c.mesh_dim < len(dims) else pp,
                              c.bytes, c.time, c.phase, c.at) for c in base.collectives]
    sends = pipe.crossing(graph, {n: k for n, k in stage_of.items()
                                  if graph.nodes[n].kind == OP})
    stage_time, grad_sync, transfer, priced_stages = [], [], [], []
    for s, (g, picked) in enumerate(stages):
        pr = pipe.price(g, cost, picked)
        t_send = pipe.transfer_time(graph, cost, sends.get(s, []), choice, link)[0]
        for u, idx in sends.get(s, []):
            v_ = graph.nodes[u]
            dtype = v_.out_dtypes[idx or 0]
            nbytes = cost.nbytes(local_shape(v_.out_shapes[idx or 0], choice[u].out(idx),
                                             sub.shape), dtype)
            t = link.alpha + nbytes / link.bandwidth
            collectives.append(Collective("p2p", pp, nbytes, t, "forward", u))
            if v_.requires_grad and dtype.is_floating_point:
                collectives.append(Collective("p2p", pp, nbytes, t, "backward", u))
        stage_time.append(pr.time + t_send)
        grad_sync.append(pr.grad_sync)
        transfer.append(t_send)
        priced_stages.append(pr)
    held = [pipe.in_flight(sched, p, m, v, s % p) for s in range(num_stages)]
    rank_memory = []
    for r in range(p):
        mem = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0}
        for s in range(r, num_stages, p):
            for key, val in priced_stages[s].memory.items():
                mem[key] += val * (held[s] if key == "activations" else 1)
        rank_memory.append(mem)
    total = pipe.step_time(stage_time, grad_sync, p, m, v)
    ranks = [sum(stage_time[r::p]) for r in range(p)]
    busy = max(range(p), key=lambda r: ranks[r])
    mine = range(busy, num_stages, p)
    comm = {k: 0.0 for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    for s in mine:
        for key, val in priced_stages[s].communication.items():
            comm[key] = comm.get(key, 0.0) + m * val
    comm["p2p"] = m * sum(transfer[s] for s in mine)
    comm["gradient_sync"] = sum(grad_sync[s] for s in mine)
    compute = m * sum(priced_stages[s].compute for s in mine)
    comm["pipeline_bubble"] = max(0.0, total - compute - sum(comm.values()))
    peak = max(rank_memory, key=lambda d: sum(d.values()))
    pipeline = PipelinePlan(pp, sched, m, v, batch, blocks.names, best.cuts,
                            pipe.bubble_fraction(sched, p, m, v), stage_time, held,
                            rank_memory, loss_reduction)
    return Plan(mesh, base.inputs, base.parameters, ops, collectives,
                _pipeline_cost(base.cost, total, compute, comm, peak, best.objective),
                base.strategies,
                base.graph_fingerprint, time.perf_counter() - start,
                "random" if draw else solver.upper(), base.unsupported_ops, pipeline)


def _pipeline_cost(whole: PlanCost, step: float, compute: float, comm: dict, memory: dict,
                   objective: float) -> PlanCost:
    """The cost of a pipelined plan: the busiest pp rank's step (see solve_pipeline_plan);
    what `whole` (the whole graph priced on the submesh) says of the rest carries over, its
    forward share of compute kept."""
    forward = getattr(whole, "compute_forward", 0.0)
    extra = {"compute_forward": forward * compute / whole.compute} if forward and whole.compute \
        else {}
    return dataclasses.replace(whole, step_time=step, compute=compute, communication=comm,
                               memory=dict(memory), solver_objective=objective, **extra)


def _stage_cost(sub: MeshSpec, graph: StrategyGraph, optimizer, precision, profile) -> CostModel:
    cost = CostModel(sub, optimizer, graph=graph, precision=precision)
    if profile is not None:
        cost = cost.copy(measured=profile.measure(graph, cost))
    return cost
