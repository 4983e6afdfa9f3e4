"""What the cost model reads of a whole strategy graph, worked out once per graph and kept in
its `analyses`: how many ops consume each tensor, each parameter's share of all parameters'
elements, and how many ops send a gradient to each tensor."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from autopar.passes.strategies import OP, PARAM, StrategyGraph

from .specs import numel


@dataclass
class GraphFacts:
    """Per-tensor counts and per-parameter shares of one strategy graph."""

    consumers: Counter         # (producer, output index) -> number of ops consuming it
    param_share: dict          # parameter -> its share of all parameters' elements
    grad_readers: Counter      # (producer, output index) -> ops sending it a gradient


def graph_facts(graph: StrategyGraph) -> GraphFacts:
    """Consumers per tensor and parameter shares of a graph (computed once per graph, kept
    in its `analyses`)."""
    got = graph.analyses.get("cost")
    if got is not None:
        return got
    consumers: Counter = Counter()
    grad_readers: Counter = Counter()
    for v in graph.nodes.values():
        for ref in v.inputs:
            consumers[ref] += 1
            u = graph.nodes[ref[0]]
            if v.requires_grad and v.kind == OP and u.requires_grad and \
                    u.out_dtypes[ref[1] or 0].is_floating_point:
                grad_readers[ref] += 1
    params = {n: numel(v.out_shapes[0]) for n, v in graph.nodes.items() if v.kind == PARAM}
    total = sum(params.values()) or 1
    found = GraphFacts(consumers, {n: k / total for n, k in params.items()}, grad_readers)
    graph.analyses["cost"] = found
    return found
