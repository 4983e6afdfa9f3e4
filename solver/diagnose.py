"""Why no plan fits: the smallest peak any plan reaches, what dominates it, what to change.

Called by the planner when the intra-op ILP finds no plan within the memory budget: it solves
the same ILP for the least memory instead of the least time (solver/ilp.py, minimize="memory"),
splits that plan's peak by kind (solver/memory.py) and names the largest contributors. That
ILP is solved with the planner's clustering (passes/cluster.py: repeated layers decided alike,
what keeps it small for deep models) and, when its plan fits the budget after all, again
without, so that a clustering which excluded every plan is told apart from a budget no plan
meets.
"""

from __future__ import annotations

from autopar.passes.cluster import Clustering
from autopar.passes.strategies import PARAM, StrategyGraph

from .cost import CostModel
from .ilp import NoFeasiblePlan, solve
from .memory import GiB, memory_split, plan_memory


def min_memory(graph: StrategyGraph, cost: CostModel, forced: dict[str, list[int]] | None = None,
               time_limit: float = 30.0, clustering: Clustering | None = None
               ) -> tuple[float, dict[str, int]]:
    """The smallest memory per device over every valid plan (the intra-op ILP with memory as
    its objective; with `clustering`, over the plans that decide its clusters alike), and one
    plan that reaches it (strategy index per node)."""
    try:
        sol = solve(graph, cost, forced=forced, time_limit=time_limit, minimize="memory",
                    clustering=clustering)
    except NoFeasiblePlan as e:
        raise RuntimeError(f"the minimum-memory ILP found no plan ({e})") from None
    return plan_memory(graph, cost, sol.choice), sol.choice


def infeasible(graph: StrategyGraph, cost: CostModel, budget: float,
               forced: dict[str, list[int]] | None = None,
               clustering: Clustering | None = None) -> NoFeasiblePlan:
    """The NoFeasiblePlan error to raise when no plan fits `budget` (found with `clustering`):
    its message says why (see `explain_infeasible`), its `dominant` what dominates the smallest
    peak."""
    try:
        peak, index = min_memory(graph, cost, forced, clustering=clustering)
        if peak <= budget and clustering is not None:  # did the clustering exclude them all?
            peak, index = min_memory(graph, cost, forced)
    except RuntimeError as e:
        return NoFeasiblePlan(f"no plan fits the memory budget of {gib(budget)} per device "
                              f"({e})")
    if peak <= budget:  # memory is not the reason: nothing to dominate
        return NoFeasiblePlan(explain_infeasible(graph, cost, budget, forced, (peak, index)))
    choice = {n: graph.nodes[n].strategies[k] for n, k in index.items()}
    split = memory_split(graph, cost, choice)
    dominant = _dominant(split)
    # Activations matter when the least parameter state any plan keeps fits: it is a sum of
    # per-parameter choices, so its minimum is each parameter's least (the smallest peak's own
    # parameter state may be larger, traded for fewer activations).
    least = sum(min(cost.node_memory(v, v.strategies[k]) for k in
                    (forced or {}).get(v.name, range(len(v.strategies))))
                for v in graph.nodes.values() if v.kind == PARAM)
    return NoFeasiblePlan(explain_infeasible(graph, cost, budget, forced, (peak, index)),
                          dominant, least < budget)


def explain_infeasible(graph: StrategyGraph, cost: CostModel, budget: float,
                       forced: dict[str, list[int]] | None = None, smallest=None) -> str:
    """Why no plan fits `budget`: the smallest peak any plan reaches (`smallest`, (peak,
    choice), when known), its split, what dominates it (the largest contributors) and what
    to change; or, when some plan fits after all, that memory is not the reason."""
    try:
        peak, index = smallest or min_memory(graph, cost, forced)
    except RuntimeError as e:
        return f"no plan fits the memory budget of {gib(budget)} per device ({e})"
    styles = " under the forced styles" if forced else ""
    if peak <= budget:
        return (f"no plan was found, and memory is not the reason: a plan{styles} peaks at "
                f"{gib(peak)}, within the budget of {gib(budget)}. The clustering of the "
                "graph (passes/cluster.py) excluded every plan the forced styles allow: an "
                "autopar bug; please report it with the model.")
    choice = {n: graph.nodes[n].strategies[k] for n, k in index.items()}
    split = memory_split(graph, cost, choice)
    dominant = _dominant(split)
    items = []
    for v in graph.nodes.values():
        s = choice[v.name]
        if dominant == "activations":
            b = cost.activation_memory(v, s) + sum(
                cost.edge_memory(graph, v, slot, choice[u].out(idx), s.inputs[slot])
                for slot, (u, idx) in enumerate(v.inputs))
            what = f"{v.name} ({v.op})"
        elif v.kind == PARAM:
            # FSDP's gathered copies are the parameters' whole copies: ranked by their shards
            b = cost.param_memory_split(v, s.output, s.zero).get(
                "parameters" if dominant == "gathered" else dominant, 0.0)
            what = v.param_name or v.name
        else:
            continue
        if b > 0:
            items.append((b, what))
    items.sort(key=lambda bw: -bw[0])
    top = "; ".join(f"{what} {gib(b)}" for b, what in items[:3])
    parts = ", ".join(f"{k} {gib(v)}" for k, v in split.items())
    if dominant == "activations":
        advice = ("use a smaller batch or sequence, gradient accumulation (microbatches=), "
                  "more devices, or pipeline stages (a mesh dimension named \"pp\")")
    elif dominant == "gathered":
        advice = ("gather FSDP's parameters in smaller buckets (bucket_bytes=), shard the "
                  "largest layers with tensor parallelism, or use mixed precision "
                  "(precision=\"bf16-mixed\")")
    else:
        advice = ("shard over more devices, use mixed precision (precision=\"bf16-mixed\") or an "
                  "optimizer with less state (optimizer=\"sgd-momentum\")")
    return (f"no plan fits the memory budget of {gib(budget)} per device: the smallest peak any "
            f"plan reaches{styles} is {gib(peak)} ({parts}), dominated by {dominant} (largest: "
            f"{top}). Raise memory_budget, or {advice}.")


def _dominant(split: dict[str, float]) -> str:
    """The kind of memory that dominates `split` (activations live again while backward
    recomputes them, the loss's backward buffers and the largest random draw count as
    activations: the batch sets them all)."""
    merged = dict(split)
    merged["activations"] = merged.get("activations", 0.0) + merged.pop("recomputed", 0.0) \
        + merged.pop("workspace", 0.0) + merged.pop("draws", 0.0)
    return max(merged, key=lambda k: merged[k])


def gib(b: float) -> str:
    """Bytes for people: MiB below a GiB, GiB above."""
    if abs(b) < GiB:
        return f"{b / 2**20:.3f} MiB"
    return f"{b / GiB:.3f} GiB"
