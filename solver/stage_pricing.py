"""Pricing pipeline stages on the stage mesh (the mesh's dimensions but "pp").

A layer block or a stage is a subgraph of the model's strategy graph (`subgraph`: its ops,
with what it reads from earlier stages as free boundary inputs); the intra-op ILP solves it
(`solve_subgraph`, identical subgraphs once) and `price` prices the choice as the ILP does:
seconds per microbatch (with the part that does not shrink with it), gradient sync, memory
and the FSDP gathers hidden under compute. `price_blocks` gives the stage cut
(solver/stages.py) its data: every block priced and every cut's sends (`crossing`,
`transfer_time`) on the pp link; `price_pipeline` prices a pipelined plan from its stages'
prices under solver/stages.py's step model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

from autopar.passes.cluster import cluster
from autopar.passes.placement import local_shape
from autopar.passes.strategies import CONSTANT, INPUT, OP, PARAM, Strategy, StrategyGraph

from .cost import NO_TIME, CostModel, Split, step_seconds
from .flops import is_view
from .ilp import loss_sink_time, solve
from .memory import draw_bytes, recompute_state
from .stages import Block, hides_sends, in_flight, objective_weights, rank_pace, step_time


def subgraph(graph: StrategyGraph, members: list[str], fixed: dict[str, Strategy]
             ) -> StrategyGraph:
    """The strategy graph of one block or stage: its op nodes (`members`), the constants they
    use (recomputed in each stage), the parameters they use, and every other producer as a
    boundary input of no cost. Producers in `fixed` (decided by an earlier stage) keep that one
    strategy; other boundary inputs may take any placement their producer could give."""
    member = set(members)
    need: set[str] = set()
    todo = list(members)
    while todo:
        name = todo.pop()
        for u, _ in graph.nodes[name].inputs:
            if u not in need and u not in member:
                need.add(u)
                if graph.nodes[u].kind == CONSTANT:
                    todo.append(u)  # computed from constants: rebuilt in this stage
    nodes = {}
    for name, v in graph.nodes.items():
        if name in member:
            nodes[name] = v
        elif name in need:
            if v.kind in (CONSTANT, PARAM):
                if name in fixed:
                    v = dataclasses.replace(v, strategies=[fixed[name]])
                nodes[name] = v
            else:
                outs = [fixed[name]] if name in fixed else list(
                    {s.output: s for s in v.strategies}.values())
                nodes[name] = dataclasses.replace(
                    v, kind=INPUT, op="", inputs=[], in_shapes=[], call=None, source="",
                    strategies=[Strategy((), s.output) for s in outs])
    # Boundary inputs first: they have no producers here.
    order = [n for n in nodes if nodes[n].kind == INPUT] + \
        [n for n in nodes if nodes[n].kind != INPUT]
    loss = graph.loss if graph.loss and graph.loss[0] in member else None
    return StrategyGraph({n: nodes[n] for n in order}, graph.mesh_shape, loss, [],
                         graph.compute_dtype)


def signature(sub: StrategyGraph) -> tuple:
    """Structure of a subgraph without node names: equal signatures, interchangeable plans."""
    index = {name: i for i, name in enumerate(sub.nodes)}
    out = []
    for v in sub.nodes.values():
        call = (repr(v.call.args), repr(v.call.kwargs)) if v.call is not None else None
        out.append((v.kind, v.op, tuple(v.in_shapes), tuple(v.out_shapes),
                    tuple(map(str, v.out_dtypes)), v.requires_grad,
                    tuple((index[u], i) for u, i in v.inputs), tuple(v.strategies), call,
                    sub.loss is not None and sub.loss[0] == v.name))
    return tuple(out)


@dataclass
class Priced:
    """What a subgraph costs under one choice of strategies (see the module docstring)."""

    time: float = 0.0          # seconds per microbatch, forward + backward
    time_fixed: float = 0.0
    compute: float = 0.0
    communication: dict[str, float] = field(default_factory=dict)
    grad_sync: float = 0.0
    memory: dict[str, float] = field(default_factory=lambda: {
        "parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0})
    hidden: dict[str, float] = field(default_factory=dict)  # per microbatch, by kind
    draws: float = 0.0         # seconds of its random draws per microbatch (in compute)
    accumulate: float = 0.0    # seconds of adding a microbatch's gradients to the step's
    drawn: float = 0.0         # bytes of its largest random draw (memory.draw_bytes)


def price(sub: StrategyGraph, cost: CostModel, choice: dict[str, Strategy]) -> Priced:
    """Per-microbatch time (with its fixed part), gradient sync and memory of `sub`, priced as
    the intra-op ILP prices them. Where collectives overlap compute (cost.overlap) the stage's
    prefetched FSDP gathers hide under its forward and their gradients' reduce-scatters under
    its backward, each microbatch, but for its first bucket's share (`stage_share`); `hidden`
    says how many seconds of each kind, and `time` leaves them out."""
    out = Priced(drawn=draw_bytes(sub, cost))
    launch = cost.hw.launch
    total = NO_TIME  # the microbatch's prices by where they run (cost.Split)
    for v in sub.nodes.values():
        s = choice[v.name]
        if v.kind == PARAM:
            out.grad_sync += cost.grad_sync_time(v, s.output, s.zero)
            for key, b in cost.param_memory_split(v, s.output, s.zero).items():
                out.memory[key] = out.memory.get(key, 0.0) + b
            fwd, bwd = cost.compute_times(v, s)  # mixed precision's casts (and accumulation)
            if v.requires_grad:
                out.accumulate += cost.grad_accumulation_seconds(v, s.output, s.zero)
            out.compute += fwd + bwd
            total = total.plus(Split(fwd, bwd, 0.0, 0.0))
            continue
        if v.kind == INPUT:
            continue
        ct = cost.compute_time(v, s)
        out.compute += ct
        out.draws += cost.draw_time(v)
        total = total.plus(cost.node_split(v, s))
        if not is_view(v):
            grad = v.requires_grad and v.kind != CONSTANT
            out.time_fixed += launch * (2 if grad else 1)
        out.memory["activations"] += cost.activation_memory(v, s)
        for slot, (u, idx) in enumerate(v.inputs):
            src, dst = choice[u].out(idx), s.inputs[slot]
            out.memory["activations"] += cost.edge_memory(sub, v, slot, src, dst)
            total = total.plus(cost.edge_split(sub, v, slot, src, dst))
            # The intra-op ILP's price of the edge (forward and backward collectives), whose
            # latency part does not shrink with the microbatch.
            for kind, k, _, t, _ in cost.edge_collectives(sub, v, slot, src, dst):
                out.communication[kind] = out.communication.get(kind, 0.0) + t
                out.time_fixed += min(t, cost.collective_time(kind, k, 0))
    if sub.loss is not None:
        name, idx = sub.loss
        t = loss_sink_time(cost, sub.nodes[name], choice[name].out(idx), idx)
        out.communication["all_gather"] = out.communication.get("all_gather", 0.0) + t
    _, hid_f, hid_b = step_seconds(total, cost.overlap, stage_share(sub, cost))
    out.hidden = {k: t for k, t in (("all_gather", hid_f), ("reduce_scatter", hid_b)) if t}
    out.time = out.compute + sum(out.communication.values()) - hid_f - hid_b
    return out


def without_zero(sub: StrategyGraph, forced: dict[str, list[int]] | None = None
                 ) -> dict[str, list[int]]:
    """`forced` (node: the strategy indices it may take) with no parameter sharding its
    optimizer state (ZeRO candidates, which `strategies.build(..., zero=True)` adds)."""
    out = dict(forced or {})
    for n, node in sub.nodes.items():
        if node.kind == PARAM and any(st.zero for st in node.strategies):
            out[n] = [k for k in out.get(n, range(len(node.strategies)))
                      if not node.strategies[k].zero]
    return out


def stage_share(sub: StrategyGraph, cost: CostModel) -> float:
    """The share of a stage's FSDP gathers that nothing hides, each microbatch: its first
    bucket's (passes/gathers.py, buckets within the stage), before any of its compute; and
    of their reduce-scatters, the last bucket's, after its backward compute."""
    total = sum(cost.nbytes(v.out_shapes[0], v.out_dtypes[0])
                for v in sub.nodes.values() if v.kind == PARAM and v.requires_grad)
    return min(1.0, cost.bucket_bytes / total) if total else 1.0


def solve_subgraph(sub: StrategyGraph, cost: CostModel, cache: dict, *,
                   memory_budget: float | None = None, backend: str = "HIGHS",
                   time_limit: float = 60.0, forced=None, discouraged=None, draw=None,
                   program=None, shape: tuple | None = None) -> dict[str, Strategy]:
    """The intra-op ILP on one subgraph; identical subgraphs (by `signature`) are solved once
    and share the solution position by position. `draw(sub)` replaces the ILP (random plans).
    With the traced `program` (its module hierarchy), the subgraph's repeated layers share
    their decisions (passes.cluster), as in a whole-model solve. `shape`: `signature(sub)`,
    where the caller has it."""
    position = {name: i for i, name in enumerate(sub.nodes)}  # (names differ between twins)
    key = (shape or signature(sub), memory_budget,
           *(tuple(sorted((position[n], tuple(ks)) for n, ks in (d or {}).items()))
             for d in (forced, discouraged)))
    if key not in cache:
        if draw is not None:
            index = draw(sub)
        else:
            index = solve(sub, cost, memory_budget=memory_budget, backend=backend,
                          time_limit=time_limit, forced=forced, discouraged=discouraged,
                          **_clustering(sub, program)).choice
        cache[key] = [index[n] for n in sub.nodes]
    return {n: v.strategies[k] for (n, v), k in zip(sub.nodes.items(), cache[key])}


def _clustering(sub: StrategyGraph, program) -> dict:
    """solve()'s `clustering` for a subgraph: layers folded over the subgraph's own op nodes
    (boundary inputs, copies of other stages' nodes, must not count as layer members)."""
    if program is None:
        return {}
    own = [n for n in program.graph.nodes if n.name in sub.nodes
           and sub.nodes[n.name].kind != INPUT]
    view = SimpleNamespace(graph=SimpleNamespace(nodes=own))
    return {"clustering": cluster(sub, view)}


def _priced_alike(cost: CostModel, name: str) -> tuple:
    """What, besides a block's structure (`signature`), its node `name`'s prices depend on:
    its recomputation, how many ops send its outputs gradients (the last layer's output has
    fewer readers: solver/plan_prices.py `price_key`), and whether it is freed after forward."""
    return recompute_state(cost, name), cost.gradient_readers(name), name in cost.reshard


def crossing(graph: StrategyGraph, stage_of: dict[str, int]
             ) -> dict[int, list[tuple[str, int | None]]]:
    """For each cut after unit u (a block or a stage), the values that cross it: outputs of
    ops in units <= u used by ops in later units, or returned by the model (constants are
    rebuilt where needed, user inputs reach every stage directly)."""
    last = max(stage_of.values())
    use: dict[tuple[str, int | None], int] = {}
    for v in graph.nodes.values():
        if v.name not in stage_of:
            continue
        for u, idx in v.inputs:
            if graph.nodes[u].kind == OP and u in stage_of:
                use[(u, idx)] = max(use.get((u, idx), -1), stage_of[v.name])
    for ref in list(graph.outputs) + ([graph.loss] if graph.loss else []):
        if ref is not None and graph.nodes[ref[0]].kind == OP:
            use[ref] = last
    out: dict[int, list] = {k: [] for k in range(last)}
    for (u, idx), end in use.items():
        for k in range(stage_of[u], end):
            out[k].append((u, idx))
    return out


def transfer_time(graph: StrategyGraph, cost: CostModel, values, choice: dict[str, Strategy],
                  link) -> tuple[float, float]:
    """Seconds (total, fixed part) to send `values` to the next stage and their gradients
    back: one message each way per tensor, latency + bytes / bandwidth."""
    total = fixed = 0.0
    shape = cost.shape
    for u, idx in values:
        v = graph.nodes[u]
        dtype = v.out_dtypes[idx or 0]
        nbytes = cost.nbytes(local_shape(v.out_shapes[idx or 0], choice[u].out(idx), shape),
                             dtype)
        ways = 2 if v.requires_grad and dtype.is_floating_point else 1
        total += ways * (link.alpha + nbytes / link.bandwidth)
        fixed += ways * link.alpha
    return total, fixed


def price_blocks(graph: StrategyGraph, cost: CostModel, block_of: dict[str, int],
                 names: list[str], link, *, backend: str = "HIGHS", time_limit: float = 60.0
                 ) -> list[Block]:
    """Price every block on the submesh (intra-op ILP per distinct block, no memory limit, its
    boundary inputs free, no ZeRO: as the free stages are solved) and every cut between
    blocks on the pp `link`."""
    cache: dict = {}
    prices: dict[tuple, Priced] = {}  # blocks alike (most of a model's layers) priced once
    members: dict[int, list[str]] = {b: [] for b in range(len(names))}
    for name, b in block_of.items():
        members[b].append(name)
    choice: dict[str, Strategy] = {}
    blocks = []
    for b, name in enumerate(names):
        sub = subgraph(graph, members[b], {})
        shape = signature(sub)
        picked = solve_subgraph(sub, cost, cache, backend=backend, time_limit=time_limit,
                                forced=without_zero(sub), shape=shape)
        choice.update({n: s for n, s in picked.items() if n in members[b]
                       or graph.nodes[n].kind == PARAM})
        key = (shape, tuple(_priced_alike(cost, n) for n in sub.nodes))
        if key not in prices:
            prices[key] = price(sub, cost, picked)
        p = prices[key]
        blocks.append(Block(name, p.time, p.time_fixed, p.grad_sync,
                            sum(v for k, v in p.memory.items() if k != "activations"),
                            p.memory["activations"], draw=p.draws, accumulate=p.accumulate,
                            **({"drawn_fixed": p.drawn} if cost.randomness == "counter"
                               else {"drawn": p.drawn})))
    for b, values in crossing(graph, {n: block_of[n] for n in block_of
                                      if graph.nodes[n].kind == OP}).items():
        blocks[b].cut_time, blocks[b].cut_fixed = transfer_time(graph, cost, values, choice,
                                                                link)
    return blocks


@dataclass
class PipelinePrice:
    """What a pipelined plan costs, from its stages' prices (the module docstring's model):
    per stage, seconds per microbatch (with its sends), gradient sync, send seconds and
    microbatches in flight; per pp rank, bytes per device by kind; the step, and the busiest pp
    rank's compute and communication by kind (its bubble as "pipeline_bubble") and the seconds
    of each kind hidden under compute (`hides_sends`: its sends, "p2p"); and every send, as
    (value, bytes, seconds, "forward" or "backward")."""

    stage_time: list[float]
    grad_sync: list[float]
    transfer: list[float]
    held: list[float]
    rank_memory: list[dict[str, float]]
    step: float
    compute: float
    communication: dict[str, float]
    sends: list[tuple[str, int, float, str]]
    hidden: dict[str, float] = field(default_factory=dict)


def price_pipeline(graph: StrategyGraph, cost: CostModel, stages: list, stage_of: dict,
                   choice: dict[str, Strategy], link, schedule: str, p: int, m: int, v: int
                   ) -> PipelinePrice:
    """Price a pipelined plan: `stages` is each stage's (subgraph, strategies) in order,
    `stage_of` every op's stage, `choice` every node's strategy, `link` the pp link; `cost`
    for the microbatch's graph with `accumulation` m (each microbatch draws the whole batch's
    random numbers: `CostModel.draw_time`). The step adds the draws every pp rank runs once
    (`replay_time`) to the busiest rank's compute."""
    num_stages = len(stages)
    crossing_values = crossing(graph, {n: k for n, k in stage_of.items()
                                       if graph.nodes[n].kind == OP})
    stage_time, grad_sync, transfer, priced, sends = [], [], [], [], []
    for s, (g, picked) in enumerate(stages):
        pr = price(g, cost, picked)
        values = crossing_values.get(s, [])
        t_send = transfer_time(graph, cost, values, choice, link)[0]
        for u, idx in values:
            node = graph.nodes[u]
            dtype = node.out_dtypes[idx or 0]
            nbytes = cost.nbytes(local_shape(node.out_shapes[idx or 0], choice[u].out(idx),
                                             cost.shape), dtype)
            t = link.alpha + nbytes / link.bandwidth
            sends.append((u, nbytes, t, "forward"))
            if node.requires_grad and dtype.is_floating_point:
                sends.append((u, nbytes, t, "backward"))
        stage_time.append(pr.time + t_send)
        grad_sync.append(pr.grad_sync)
        transfer.append(t_send)
        priced.append(pr)
    held = [in_flight(schedule, p, m, v, s % p) for s in range(num_stages)]
    rank_memory = []
    for r in range(p):
        mem = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0}
        for s in range(r, num_stages, p):
            for key, val in priced[s].memory.items():
                mem[key] += val * (held[s] if key == "activations" else 1)
        drawn = max(priced[s].drawn for s in range(r, num_stages, p))
        if drawn:  # the largest whole-batch draw among its stages, while its op runs
            mem["draws"] = drawn
        rank_memory.append(mem)
    hide = hides_sends(schedule, cost.overlap)
    replay = sum(pr.draws for pr in priced)  # every stage's, for the whole batch, once
    total = step_time(stage_time, grad_sync, p, m, v, transfer if hide else None, replay)
    ranks = rank_pace(stage_time, p, transfer if hide else None)
    busy = max(range(p), key=lambda r: ranks[r])
    mine = range(busy, num_stages, p)
    comm = {k: 0.0 for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    for s in mine:
        for key, val in priced[s].communication.items():
            comm[key] = comm.get(key, 0.0) + m * val
    comm["p2p"] = m * sum(transfer[s] for s in mine)
    comm["gradient_sync"] = sum(grad_sync[s] for s in mine)
    compute = m * sum(priced[s].compute for s in mine) + replay
    hidden = {}
    for s in mine:  # each stage's prefetched FSDP gathers, every microbatch
        for key, val in priced[s].hidden.items():
            hidden[key] = hidden.get(key, 0.0) + m * val
    if hide and objective_weights(p, m, v)[1]:  # the steady state's sends beside the rank's work
        hidden["p2p"] = m * (sum(stage_time[s] for s in mine) - ranks[busy])
    comm["pipeline_bubble"] = max(0.0, total - compute - sum(comm.values())
                                  + sum(hidden.values()))
    return PipelinePrice(stage_time, grad_sync, transfer, held, rank_memory, total, compute,
                         comm, sends, {k: t for k, t in hidden.items() if t})


def activation_scaled(cost: CostModel, factor: float) -> CostModel:
    """A copy of `cost` whose kept activations count `factor` microbatches in flight (what the
    intra-op ILP's memory constraint must see for one pipeline stage)."""
    return cost.copy(activation_factor=factor)


def stage_budget(memory_budget: float, v: int) -> float:
    """Bytes per device one of a rank's v stages may use."""
    return memory_budget / v
