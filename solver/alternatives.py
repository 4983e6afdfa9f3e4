"""Why a node's strategy was chosen: each candidate's cost with the rest of the plan fixed.

For node v and a candidate strategy s, with every other node keeping its chosen strategy:
  compute      seconds of v's op forward + backward (0 for a parameter)
  collectives  seconds by kind: resharding v's inputs from their producers' placements into
               what s requires, and v's output from s into what its consumers require
               (forward + backward), plus gradient synchronization of a parameter
  memory       bytes per device: parameter, gradient and optimizer state of a parameter, or
               what autograd keeps of the op's output and of its resharded inputs
The chosen strategy is reported with the next best candidates (by compute + collectives) and
what ruled each out: a forced style, no resharding between it and its neighbours, the memory
budget (the plan's peak with v's bytes replaced), or a worse cost. The ILP decides all nodes
together, so a candidate that is cheaper here alone was ruled out by its neighbours' choices.
"""

from __future__ import annotations

import json
from collections import defaultdict

from autopar.passes.placement import fmt
from autopar.passes.reshard import ReshardError
from autopar.passes.strategies import OP, PARAM, SNode, Strategy, StrategyGraph

from .cost import INFEASIBLE, CostModel

FORCED = "forced style excludes it"
NO_RESHARD = "no resharding to or from its neighbours' placements"
TIED = "tied to an identical layer's choice, or cheaper alone but not with its neighbours"


def candidate_cost(graph: StrategyGraph, cost: CostModel, choice: dict[str, Strategy],
                   consumers: dict[str, list], v: SNode, s: Strategy) -> dict | None:
    """Compute, collectives by kind, and memory of `v` under `s` (see the module docstring);
    None when some edge cannot be resharded."""
    comm: dict[str, float] = defaultdict(float)
    compute = sum(cost.compute_times(v, s))
    memory = cost.node_memory(v, s)
    if v.kind == PARAM:
        for *_, t in cost.grad_sync_steps(v, s.output, s.zero):
            comm["gradient_sync"] += t
    edges = [(v, slot, choice[u].out(idx), s.inputs[slot])
             for slot, (u, idx) in enumerate(v.inputs)]
    edges += [(w, slot, s.out(idx), choice[w.name].inputs[slot])
              for w, slot, idx in consumers.get(v.name, [])]
    for w, slot, src, dst in edges:
        try:
            for kind, _, _, t, _ in cost.edge_collectives(graph, w, slot, src, dst):
                comm[kind] += t
        except ReshardError:
            return None
        memory += cost.edge_memory(graph, w, slot, src, dst)
    if compute >= INFEASIBLE:
        return None
    return {"compute": compute, "collectives": dict(comm), "memory": memory,
            "total": compute + sum(comm.values())}


def consumers_of(graph: StrategyGraph) -> dict[str, list[tuple[SNode, int, int | None]]]:
    """For each node, (consumer, input slot, output index) of every use of its outputs."""
    out: dict[str, list] = defaultdict(list)
    for w in graph.nodes.values():
        for slot, (u, idx) in enumerate(w.inputs):
            out[u].append((w, slot, idx))
    return out


def alternatives(graph: StrategyGraph, cost: CostModel, choice: dict[str, Strategy], *,
                 keep: int = 3, forced: dict[str, list[int]] | None = None,
                 discouraged: dict[str, list[int]] | None = None,
                 memory_budget: float | None = None, peak: float = 0.0,
                 twin: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """For every op and parameter node: its chosen strategy's entry, then the `keep` best
    other candidates, each with "inputs", "output" (placements as text), "compute",
    "collectives", "memory", "total" and "ruled_out" ("" for the chosen). Nodes with a
    `twin` (the same node of an earlier identical layer) share its list."""
    consumers = consumers_of(graph)
    out: dict[str, list[dict]] = {}
    for v in graph.nodes.values():
        if v.kind not in (OP, PARAM):
            continue
        if twin and twin.get(v.name) in out:
            out[v.name] = out[twin[v.name]]
            continue
        chosen = choice[v.name]
        mine = candidate_cost(graph, cost, choice, consumers, v, chosen)
        if mine is None:
            continue
        rows = [dict(_placements(v, chosen), **mine, ruled_out="")]
        others = []
        for k, s in enumerate(v.strategies):
            if s == chosen:
                continue
            priced = candidate_cost(graph, cost, choice, consumers, v, s)
            why = _ruled_out(v, k, priced, mine, forced, discouraged, memory_budget, peak)
            others.append(dict(_placements(v, s), **(priced or _unpriced()), ruled_out=why))
        others.sort(key=lambda r: (r["ruled_out"] == NO_RESHARD, r["total"]))
        out[v.name] = rows + others[:keep]
    return out


def _ruled_out(v: SNode, k: int, priced: dict | None, mine: dict, forced, discouraged,
               budget: float | None, peak: float) -> str:
    if forced and v.name in forced and k not in forced[v.name]:
        return FORCED
    if priced is None:
        return NO_RESHARD
    over = peak - mine["memory"] + priced["memory"] - (budget or float("inf"))
    if over > 0:
        return f"memory budget ({over / 2**20:.1f} MiB over)"
    if discouraged and k in discouraged.get(v.name, ()):
        return "forced style discourages it"
    extra = priced["total"] - mine["total"]
    if extra <= 0:
        return TIED
    return f"worse cost (+{extra * 1e3:.3f} ms)"


def _placements(v: SNode, s: Strategy) -> dict:
    out = fmt(s.output) if not v.multi_output else [fmt(o) for o in s.output]
    if s.zero:  # a parameter stored at `output` with sharded optimizer state (passes/zero.py)
        out += f" ZeRO-{s.zero}"
    return {"inputs": [fmt(p) for p in s.inputs], "output": out}


def _unpriced() -> dict:
    return {"compute": 0.0, "collectives": {}, "memory": 0.0, "total": float("inf")}


def compact(per_node: dict[str, list[dict]]) -> dict:
    """`alternatives`' result as plain data with each distinct list stored once:
    {"nodes": {name: index}, "tables": [list, ...]} (infinite totals as None)."""
    tables: list[list[dict]] = []
    seen: dict[str, int] = {}
    nodes = {}
    for name, rows in per_node.items():
        clean = [dict(r, total=None if r["total"] == float("inf") else r["total"])
                 for r in rows]
        key = json.dumps(clean, sort_keys=True)
        if key not in seen:
            seen[key] = len(tables)
            tables.append(clean)
        nodes[name] = seen[key]
    return {"nodes": nodes, "tables": tables}
