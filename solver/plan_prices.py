"""What nodes, edges and whole plans cost, as the intra-op ILP prices them (solver/ilp.py's
t[v,s] and c[e,a,b]): the edges of a strategy graph, each node's prices per strategy (shared
between twins of repeated layers: `price_key`, `edge_key`), the loss's final resharding, the
compute floor no plan goes below, and a complete assignment priced directly (`plan_time`,
`plan_split`)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.placement import Partial, R
from autopar.passes.strategies import CONSTANT, OP, SNode, StrategyGraph

from .cost import INFEASIBLE, NO_TIME, CostModel, Split, step_seconds
from .memory import recompute_state


@dataclass
class Edge:
    """Input `slot` of node `consumer`, made by output `out_index` of `producer`."""

    consumer: str
    slot: int
    producer: str
    out_index: int | None


def edges(graph: StrategyGraph) -> list[Edge]:
    """Every tensor input of every node, as an edge from its producer."""
    return [Edge(v.name, i, u, idx) for v in graph.nodes.values()
            for i, (u, idx) in enumerate(v.inputs)]


def node_costs(graph: StrategyGraph, cost: CostModel,
               twin: dict[str, str] | None = None) -> dict[str, list[float]]:
    """t[v,s]: compute (+ gradient sync) seconds of every strategy, plus the loss's final
    resharding to Replicate. Nodes with a `twin` (an identical node of an earlier repeated
    layer) share the prices of the first of them recomputed alike."""
    return _node_prices(graph, cost, twin, cost.node_time, lambda t, sink: t + sink)


def node_splits(graph: StrategyGraph, cost: CostModel,
                twin: dict[str, str] | None = None) -> dict[str, list[Split]]:
    """`node_costs` by where the seconds run (cost.Split), shared between twins alike."""
    return _node_prices(graph, cost, twin, cost.node_split,
                        lambda sp, sink: sp.plus(Split(sink, 0.0, 0.0, 0.0)))


def _node_prices(graph: StrategyGraph, cost: CostModel, twin: dict[str, str] | None,
                 price, with_sink) -> dict[str, list]:
    """`price(node, strategy)` of every strategy, shared between twins alike; the loss's
    prices `with_sink(price, seconds of its final resharding)`."""
    out = {}
    priced: dict[tuple, list] = {}
    for v in graph.nodes.values():
        key = price_key(cost, twin, v.name)
        if key not in priced:
            priced[key] = [price(v, s) for s in v.strategies]
        out[v.name] = priced[key]
    for name, idx in ([graph.loss] if graph.loss else []):
        v = graph.nodes[name]  # its own prices: the loss alone pays the final resharding
        out[name] = [with_sink(p, loss_sink_time(cost, v, s.out(idx), idx))
                     for p, s in zip(out[name], v.strategies)]
    return out


def compute_floor(graph: StrategyGraph, cost: CostModel,
                  twin: dict[str, str] | None = None) -> float:
    """Seconds of compute no plan of `graph` under `cost` goes below: each op at its cheapest
    strategy (forward and backward, and the forward again where it recomputes), whatever its
    neighbours and memory. A plan's step is at least its compute (collectives only add: what
    hides under compute is at most their own seconds), so a search can skip a setting whose
    floor is no better than a plan already found."""
    prices = _node_prices(graph, cost, twin, cost.compute_time, lambda t, sink: t)
    return sum(min((t for t in prices[v.name] if t != INFEASIBLE), default=0.0)
               for v in graph.nodes.values() if v.kind in (OP, CONSTANT))


def loss_sink_time(cost: CostModel, node: SNode, placement, idx) -> float:
    """Seconds to bring the loss to every rank. A pending-sum loss seeds the backward pass
    locally (the gradient of a pending sum is replicated) and is all-reduced only for reporting,
    overlapped with the backward pass: free on the critical path."""
    if all(isinstance(p, (type(R), Partial)) for p in placement):
        return 0.0
    return cost.reshard_time(node.out_shapes[idx or 0], node.out_dtypes[idx or 0], placement,
                             tuple(R for _ in cost.shape), False)


def plan_time(graph: StrategyGraph, cost: CostModel, choice: dict[str, int]) -> float:
    """Predicted seconds of a complete assignment: the objective evaluated directly."""
    return step_seconds(plan_split(graph, cost, choice), cost.overlap, cost.edge_share())[0]


def plan_split(graph: StrategyGraph, cost: CostModel, choice: dict[str, int],
               twin: dict[str, str] | None = None) -> Split:
    """The seconds of a complete assignment by where they run (cost.Split), summed: each
    node's chosen strategy only, the loss's final resharding on the forward path. Twins
    (`twin`, see `price_key`) choosing alike share their prices, as in the ILP."""
    total = NO_TIME
    nodes: dict[tuple, Split] = {}
    for v in graph.nodes.values():
        key = (price_key(cost, twin, v.name), choice[v.name])
        if key not in nodes:
            nodes[key] = cost.node_split(v, v.strategies[choice[v.name]])
        total = total.plus(nodes[key])
    for name, idx in ([graph.loss] if graph.loss else []):
        v = graph.nodes[name]
        sink = loss_sink_time(cost, v, v.strategies[choice[name]].out(idx), idx)
        total = total.plus(Split(sink, 0.0, 0.0, 0.0))
    moved: dict[tuple, Split] = {}
    for e in edges(graph):
        u, v = graph.nodes[e.producer], graph.nodes[e.consumer]
        src = u.strategies[choice[u.name]].out(e.out_index)
        dst = v.strategies[choice[v.name]].inputs[e.slot]
        key = (edge_key(cost, twin, e), src, dst)
        if key not in moved:
            moved[key] = cost.edge_split(graph, v, e.slot, src, dst)
        total = total.plus(moved[key])
    return total


def price_key(cost: CostModel, twin: dict[str, str] | None, v: str) -> tuple:
    """Nodes with one key have the same prices: twins (identical nodes of repeated layers,
    `twin` maps a node to its earliest one) recomputed alike whose outputs as many ops read
    (the last layer's output is read by fewer: autograd sums fewer gradients)."""
    return (twin.get(v, v) if twin else v, recompute_state(cost, v), cost.gradient_readers(v))


def edge_key(cost: CostModel, twin: dict[str, str] | None, e: Edge) -> tuple:
    """Edges with one key have the same prices at the same placements: between the same
    twins (see `price_key`), recomputed alike."""
    return (twin.get(e.producer, e.producer) if twin else e.producer, e.out_index,
            twin.get(e.consumer, e.consumer) if twin else e.consumer, e.slot,
            recompute_state(cost, e.producer), recompute_state(cost, e.consumer))

