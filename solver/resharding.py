"""Reshard after forward, per parameter: which FSDP-gathered parameters are freed after forward.

A parameter stored sharded and gathered whole for its use is, by default, kept gathered from
its use in forward until backward (autograd keeps it for the input's gradient). Freeing it
after forward and gathering it again for backward (FSDP2's `reshard_after_forward=True`)
trades one more all-gather for the bytes of the gathered copy over the whole forward-backward
span. With the placements fixed, the choice is separate per parameter: the ILP prices every
gathered parameter as freed (solver/cost.py `regathered`), and `choose` then keeps gathered
what the memory budget still holds, the parameters used last in forward first: backward needs
them first, so freeing them would buy the least (FSDP2 likewise leaves its last group
gathered).
"""

from __future__ import annotations

import random

from autopar.passes.reshard import single_gather
from autopar.passes.strategies import PARAM, Strategy, StrategyGraph

from .cost import CostModel
from .memory import exact_memory


def gathered_parameters(graph: StrategyGraph, choice: dict[str, Strategy]) -> list[str]:
    """Parameters (graph node names) with a use gathered whole from their storage shard,
    ordered by their last such use in forward, last first."""
    last: dict[str, int] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for v in graph.nodes.values():
        for slot, (u, idx) in enumerate(v.inputs):
            if graph.nodes[u].kind == PARAM and single_gather(
                    v.in_shapes[slot], choice[u].out(idx), choice[v.name].inputs[slot],
                    graph.mesh_shape) is not None:
                last[u] = order[v.name]
    return sorted(last, key=lambda u: -last[u])


def _kept_gathered(graph: StrategyGraph, cost: CostModel, choice: dict[str, Strategy],
                   uses: list[tuple]) -> float:
    """Bytes autograd keeps under `cost` of a parameter's `uses` ((consumer, slot, output
    index) each)."""
    return sum(cost.edge_memory(graph, v, slot, choice[v.inputs[slot][0]].out(idx),
                                choice[v.name].inputs[slot]) for v, slot, idx in uses)


def choose(graph: StrategyGraph, cost: CostModel, choice: dict[str, Strategy],
           budget: float | None, mode: bool | None,
           rng: random.Random | None = None,
           twin: dict[str, str] | None = None) -> frozenset[str]:
    """The parameters whose gathered copies are freed after forward, for the placements
    `choice`: every gathered one (`mode` True), none (False), or (None) all but those kept
    gathered within `budget`, last used first; with `rng` (random plans), a random subset.
    `twin`: the clustering's (solver/memory.py `memory_split`)."""
    params = gathered_parameters(graph, choice)
    if mode is False or not params:
        return frozenset()
    if mode is True:
        return frozenset(params)
    if rng is not None:
        return frozenset(p for p in params if rng.random() < 0.5)
    freed = cost.copy(reshard=frozenset(params))
    kept = cost.copy(reshard=frozenset())
    # the plan's exact peak with every gathered parameter freed (each kept storage once, as
    # the plan reports it), so that what is kept gathered fits what the plan reports
    peak = sum(exact_memory(graph, freed, choice, twin).values())
    out = set(params)
    uses: dict[str, list[tuple]] = {p: [] for p in params}
    for v in graph.nodes.values():
        for slot, (u, idx) in enumerate(v.inputs):
            if u in uses:
                uses[u].append((v, slot, idx))
    for p in params:
        extra = _kept_gathered(graph, kept, choice, uses[p]) - \
            _kept_gathered(graph, freed, choice, uses[p])
        if budget is None or peak + extra <= budget:
            out.discard(p)
            peak += extra
    return frozenset(out)
