"""Forced parallel styles: restrict the candidates of one mesh dimension to a standard setup.

The solver normally mixes strategies freely. For comparisons with hand-written parallelism (and
for tests that must exercise each kind of plan), a mesh dimension can be pinned to a style; the
ILP still chooses everything the style leaves open.

- "data"   (DDP): parameters stored and used replicated; floating-point ops that depend on the
           batch run sharded on this dimension wherever some plan allows it (replicated
           strategies carry a penalty rather than a ban, so shapes that split evenly nowhere
           still have a plan).
- "zero1", "zero2" (ZeRO-1 / ZeRO-2): as "data", but the optimizer state (and for "zero2" the
           gradients) of parameters that can take ZeRO there (passes/zero.py) are sharded.
- "fsdp"   (ZeRO-3 / FSDP): as "data", but parameters with a dimension that splits evenly are
           stored sharded and all-gathered for use (gradients reduce-scattered): the first
           such dimension that no other mesh dimension shards (dim 0 where it can, as FSDP2).
- "tensor" (Megatron): matrix and embedding parameters are stored sharded on this dimension and
           used where they live (column/row/vocabulary parallel); the ILP places activations.
- "auto":  no restriction.
"""

from __future__ import annotations

from autopar.passes.placement import Replicate, Shard

from .strategies import INPUT, OP, PARAM, StrategyGraph
from .zero import zero_shard

STYLES = ("auto", "data", "zero1", "zero2", "fsdp", "tensor")
DATA_PARALLEL = ("data", "zero1", "zero2", "fsdp")  # the batch is split on the dimension


def allowed_strategies(graph: StrategyGraph, styles: dict[int, str]
                       ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """For each node whose candidates a style restricts, the indices it may use; and for each
    node, the indices the style discourages (replicated compute under data/fsdp)."""
    for k, style in styles.items():
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r} for mesh dimension {k}; choose from "
                             f"{', '.join(STYLES)}")
    batch_dependent = _depends_on_inputs(graph)
    param_uses: dict[str, list[tuple[str, int]]] = {}
    for v in graph.nodes.values():
        for slot, (u, _) in enumerate(v.inputs):
            if graph.nodes[u].kind == PARAM:
                param_uses.setdefault(u, []).append((v.name, slot))
    allowed: dict[str, set[int]] = {n: set(range(len(v.strategies)))
                                    for n, v in graph.nodes.items()}
    discouraged: dict[str, set[int]] = {}
    for k, style in styles.items():
        if style == "auto":
            continue
        for v in graph.nodes.values():
            keep = set()
            for i, s in enumerate(v.strategies):
                if _ok(graph, v, s, k, style):
                    keep.add(i)
                if _replicated_compute(graph, v, s, k, style, batch_dependent):
                    discouraged.setdefault(v.name, set()).add(i)
            if style == "fsdp" and v.kind == PARAM:
                # FSDP shards the first dimension that splits evenly (dim 0 as FSDP2 does,
                # where it can), when the other dimensions' styles leave that choice open.
                first = [i for i in keep & allowed[v.name] if _first_split(v, graph, k, i)]
                keep = set(first) or keep
            if keep & allowed[v.name]:  # never leave a node without a strategy
                allowed[v.name] &= keep
    out = {n: sorted(ix) for n, ix in allowed.items()
           if len(ix) < len(graph.nodes[n].strategies)}
    return out, {n: sorted(ix) for n, ix in discouraged.items()}


def _replicated_compute(graph, v, s, k, style, batch_dependent) -> bool:
    if style not in DATA_PARALLEL or v.name not in batch_dependent or \
            graph.mesh_shape[k] == 1:
        return False
    outs = s.output if v.multi_output else (s.output,)
    return any(isinstance(o[k], Replicate) for o in outs)


def _ok(graph, v, s, k, style) -> bool:
    if v.kind == PARAM:
        p = s.output[k]
        big = len(v.out_shapes[0]) >= 2
        if style in ("data", "zero1", "zero2"):
            return isinstance(p, Replicate) and _zero_ok(
                graph, v, s, k, {"data": 0, "zero1": 1, "zero2": 2}[style])
        if style == "fsdp":
            return isinstance(p, Shard) or graph.mesh_shape[k] == 1 or not _splits(v, graph, k)
        if style == "tensor":
            return isinstance(p, Shard) if big and _splits(v, graph, k) else isinstance(
                p, Replicate)
        return True
    if v.kind != OP:
        return True
    for slot, (u, _) in enumerate(v.inputs):
        if graph.nodes[u].kind == PARAM:
            want = s.inputs[slot][k]
            if style in DATA_PARALLEL and not isinstance(want, Replicate):
                return False
    if style == "tensor":
        # Parameters are used where they are stored: the use must match some shard of it.
        for slot, (u, _) in enumerate(v.inputs):
            if graph.nodes[u].kind == PARAM and len(graph.nodes[u].out_shapes[0]) >= 2 and \
                    _splits(graph.nodes[u], graph, k) and \
                    not isinstance(s.inputs[slot][k], Shard):
                return False
    return True


def _zero_ok(graph, v, s, k, stage: int) -> bool:
    """Whether strategy `s` of parameter `v` is at ZeRO `stage` over mesh dimension `k`; one
    that cannot take ZeRO there (or takes it over another dimension) always is, so that every
    style leaves a parameter a strategy."""
    if s.zero == 0 and stage == 0:
        return True
    z = zero_shard(v.out_shapes[0], s.output, graph.mesh_shape)
    if z is None or z.mesh_dim != k:
        return s.zero == 0 or stage == 0
    return s.zero == stage


def _first_split(v, graph, k, i) -> bool:
    """Whether strategy `i` of parameter `v` shards, on mesh dimension `k`, the first tensor
    dimension that splits evenly there among those no other mesh dimension shards. (FSDP2 over
    a tensor-parallel shard of dim 0 shards dim 0 again, strided: each data-parallel rank
    holds a piece of the tensor-parallel rank's rows. Placements here nest mesh dimensions
    the other way, outer first, so gathering the data-parallel dimension of such a storage
    would not give the tensor-parallel shard; sharding the next dimension does, with one
    all-gather of the same bytes.)"""
    placements = v.strategies[i].output
    p = placements[k]
    if not isinstance(p, Shard):
        return False
    n = graph.mesh_shape[k]
    taken = {q.dim for j, q in enumerate(placements) if j != k and isinstance(q, Shard)}
    dims = [d for d, size in enumerate(v.out_shapes[0])
            if size % n == 0 and size > 1 and d not in taken]
    return bool(dims) and p.dim == dims[0]


def _splits(v, graph, k) -> bool:
    n = graph.mesh_shape[k]
    return any(d % n == 0 and d > 1 for d in v.out_shapes[0])


def _depends_on_inputs(graph: StrategyGraph) -> set[str]:
    """Floating-point op nodes computed from a user input."""
    dep: set[str] = set()
    for v in graph.nodes.values():
        if v.kind == INPUT or any(u in dep for u, _ in v.inputs):
            dep.add(v.name)
    return {n for n in dep if graph.nodes[n].kind == OP
            and graph.nodes[n].out_dtypes and graph.nodes[n].out_dtypes[0].is_floating_point}
