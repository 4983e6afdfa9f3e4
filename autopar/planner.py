"""From a traced model to a Plan: strategies, cost model, solver, and the Plan's description."""

from __future__ import annotations

import hashlib
import random
import time

from autopar.passes import strategies as strat_pass
from autopar.passes.cluster import cluster
from autopar.passes.pipeline_split import layer_blocks
from autopar.passes.placement import R, fmt, local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, Strategy, StrategyGraph
from autopar.passes.styles import allowed_strategies
from autopar.passes.trace import TracedProgram
from autopar.solver import stages as pipe
from autopar.solver.cost import CostModel, numel
from autopar.solver.ilp import (
    NoFeasiblePlan,
    Solution,
    loss_sink_time,
    plan_time,
    random_choice,
    solve,
)

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
               fold_layers: bool = True) -> tuple[Plan, StrategyGraph]:
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
    clusters = cluster(graph, program.graph_module, fold_layers=fold_layers)
    sol = solve(graph, cost, memory_budget=budget, backend=solver, time_limit=time_limit,
                forced=forced, discouraged=discouraged, clustering=clusters)
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
                        loss_reduction: str = "mean") -> Plan:
    """Plan a model over a mesh with a "pp" dimension: cut it into pipeline stages
    (solver/stages.py), then solve each stage's intra-op ILP on the other dimensions, identical
    stages once, each stage's inputs fixed to the placements the previous stage produces.

    `trace_at(m)` returns the model traced at the microbatch size `batch // m`. Without
    `microbatches` the model is first traced at the whole batch to choose it.
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', not {loss_reduction!r}")
    pp = mesh.pipeline_dim
    p = mesh.shape[pp]
    sub = mesh.without(pp)
    cost = CostModel(sub)
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
    blocks = layer_blocks(program, graph)
    priced = pipe.price_blocks(graph, cost, blocks.of_node, blocks.names, link,
                               backend=solver, time_limit=time_limit)
    best = pipe.choose(priced, p, batch, batch // m0, budget, microbatches=microbatches,
                       schedule=schedule, virtual_stages=virtual_stages, backend=solver,
                       time_limit=time_limit)
    m, v, sched = best.microbatches, best.virtual_stages, best.schedule
    if m != m0:
        program = trace_at(m)
        graph = strat_pass.build(program, sub.shape)
        again = layer_blocks(program, graph)
        if again.names != blocks.names:
            raise RuntimeError("the model traces into different layer blocks at the microbatch "
                               f"size ({again.names} vs {blocks.names})")
        blocks = again
    num_stages = p * v
    first = [0, *best.cuts]
    stage_of = {n: max(k for k in range(num_stages) if first[k] <= b)
                for n, b in blocks.of_node.items()}

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
        forced, discouraged = allowed_strategies(g, styles) if styles else (None, {})
        for name, ks in _sharded_on_trivial_dims(g).items():
            discouraged[name] = sorted(set(discouraged.get(name, ())) | set(ks))
        try:
            picked = pipe.solve_subgraph(g, scaled, cache,
                                         memory_budget=pipe.stage_budget(budget, v),
                                         backend=solver if draw is None else "HIGHS",
                                         time_limit=time_limit, forced=forced,
                                         discouraged=discouraged, draw=draw)
        except NoFeasiblePlan:
            names = blocks.names[first[s]:(first + [len(blocks.names)])[s + 1]]
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

    base = describe(program, graph, sub, cost, choice)
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
        t_send = pipe.transfer_time(graph, sends.get(s, []), choice, link, sub.shape)[0]
        for u, idx in sends.get(s, []):
            v_ = graph.nodes[u]
            dtype = v_.out_dtypes[idx or 0]
            nbytes = numel(local_shape(v_.out_shapes[idx or 0], choice[u].out(idx), sub.shape)) \
                * dtype.itemsize
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
                PlanCost(total, compute, comm, dict(peak), best.objective), base.strategies,
                base.graph_fingerprint, time.perf_counter() - start,
                "random" if draw else solver.upper(), base.unsupported_ops, pipeline)


def _sharded_on_trivial_dims(graph: StrategyGraph) -> dict[str, list[int]]:
    """Strategies that shard or leave pending sums on mesh dimensions of size 1 (the stand-in
    dimension of a mesh that is pp alone): no different from replicating, and less clear."""
    trivial = [k for k, n in enumerate(graph.mesh_shape) if n == 1]
    out: dict[str, list[int]] = {}
    if not trivial:
        return out
    for name, v in graph.nodes.items():
        ks = []
        for i, st in enumerate(v.strategies):
            outs = st.output if v.multi_output else (st.output,)
            if any(not isinstance(pl[k], type(R)) for pl in (*st.inputs, *outs)
                   for k in trivial):
                ks.append(i)
        if ks and len(ks) < len(v.strategies):
            out[name] = ks
    return out
