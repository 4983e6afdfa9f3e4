"""Whether a model keeps the samples of its batch apart until the loss adds them up.

Gradient accumulation runs a batch as m microbatches and adds up their gradients. That
computes what the whole batch does only when no op mixes samples before the loss sums or
averages over them: BatchNorm's batch statistics, a contrastive loss comparing every sample
with every other, a feature centred on the batch's mean, a (B, 1) prediction broadcast
against a (B,) target all mix them. The sharding rules know which ops keep samples apart: an
op does when one of its strategies takes each input that carries the batch sharded as it
arrives (no collective, inside the op either: BatchNorm in training mode shards the batch
only by combining its statistics over the ranks), and every other input whole or sliced (which
needs none). `mixing`
starts from the inputs whose first dimension is the batch, sharded on it over one mesh
dimension (of the planner's strategy graph, or of a mesh of m devices), propagates the
placements each value can have that way, and names the first op that has none; an op
without a sharding rule counts as one (autopar cannot tell). The loss's own last op (and
the casts and views after it) is left out: passes/loss_weights.py weighs each microbatch's
loss so that they add up to the batch's, or refuses; the propagation checks that the
weights it reads hold (`_loss_reduction`: the samples reach that op unreduced, or, for a loss
`loss_reduction` weighs, the op adds up sums over the batch). A forward that writes buffers
writes them once per microbatch (`_buffer_writes`).

The same propagation says on which dimension each random op's output carries the batch
(`batch_dims`): under microbatches such an op draws the whole batch's numbers and keeps the
running microbatch's block (passes/rules/random.py).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from . import strategies
from .graph_queries import drawing_ops, source_line, state_writes
from .loss_weights import loss_tail, of_program
from .placement import R, interned, is_partial
from .rules import facts_of
from .rules.random import RANDOM_OPS
from .trace import TracedProgram


def mixing(program: TracedProgram, m: int, graph: strategies.StrategyGraph | None = None,
           mean: bool = True) -> str:
    """Where the model traced as `program` (on the whole batch: its first input's first
    dimension) mixes the samples of its batch, as words naming the op and its model line, or
    "" when no op does and m microbatches add up to the batch. `graph` is a strategy graph of
    `program` already built (the planner's, on its mesh): one of its mesh dimensions that
    divides the batch serves, else one is built on a mesh of m. Kept on the program
    (`TracedProgram.mixing`)."""
    if mean in program.mixing:
        return program.mixing[mean]
    first = next((n for n in program.graph.nodes if program.inputs and
                  n.name == program.inputs[0]), None)
    shape = tuple(first.meta["val"].shape) if first is not None else ()
    if not shape:  # no input, or a 0-dimensional first one: no batch to split
        return ""
    batch = int(shape[0])
    dim = next((k for k, n in enumerate(graph.mesh_shape) if n > 1 and batch % n == 0),
               None) if graph is not None else None
    if dim is None:
        graph, dim = strategies.build(program, (m,)), 0
    tail = loss_tail(program)
    possible, why = _propagate(graph, program.inputs, batch, dim, set(tail))
    if not why and tail:
        why = _loss_reduction(graph, possible, graph.nodes.get(tail[-1]),
                              of_program(program).kind, dim, mean)
    program.mixing[mean] = why
    return why


def split_problem(whole: TracedProgram, m: int, per_rank_inputs: bool = False,
                  loss_reduction: str | None = None) -> str:
    """Why m microbatches of the model traced as `whole` (on the whole batch) would not add
    up to the whole batch's step, or "": BatchNorm in training mode or a loss whose
    microbatches cannot be weighted (passes/loss_weights.py: one autopar cannot read when
    `loss_reduction`, the user's word on it, is None), random numbers drawn in a shape of
    their own, else an op mixing the samples (`mixing`). Gradient accumulation and pipeline
    schedules both split the batch this way."""
    if m <= 1:
        return ""
    weights = of_program(whole, per_rank_inputs, loss_reduction)
    # a loss autopar cannot read is refused last: a reason no loss_reduction answers first
    unread = weights.refused if not weights.kind else ""
    return (weights.coupled if unread else weights.exact()) or _unsplit_draws(whole) or \
        _buffer_writes(whole, m) or \
        mixing(whole, m, next(iter(whole.strategy_graphs.values()), None),
               loss_reduction != "sum") or unread


def _buffer_writes(whole: TracedProgram, m: int) -> str:
    """Why the buffers `whole`'s forward writes cannot be split into microbatches, or "":
    each microbatch's forward would write them once more (a step counter m times), where the
    whole batch writes them once."""
    writes = state_writes(whole.graph_module, whole.writes)
    for node in whole.graph.nodes:
        target = next((t for t in sorted(writes.get(node.name, ())) if t not in whole.inputs),
                      None)
        if target is not None:
            line = source_line(node)
            return (f"op {node.target}{f' ({line})' if line else ''} writes the model's buffer "
                    f"{whole.buffers.get(target, target)} in forward, once per call: {m} "
                    f"microbatches would write it {m} times where the whole batch writes it "
                    "once")
    return ""



# Random ops that can draw the whole batch's numbers in each microbatch (batch_dims);
# attention draws over its weights (B, H, L, S), which share the output's first 3 dimensions
_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default}
_SPLIT_DRAWS = {*RANDOM_OPS, *_ATTENTION}


def _unsplit_draws(whole: TracedProgram) -> str:
    """Why the random draws of `whole` cannot be split into microbatches, or "": an op
    drawing a shape of its own (torch.rand(batch, ...)) cannot draw the whole batch's
    numbers in each microbatch."""
    for node in drawing_ops(whole.graph_module):
        if node.target not in _SPLIT_DRAWS:
            line = source_line(node)
            return (f"op {node.target}{f' ({line})' if line else ''} draws random numbers in "
                    "a shape of its own, which microbatches cannot draw as the whole batch "
                    "does; draw them with torch.rand_like / randn_like of a tensor that "
                    "carries the batch")
    return ""


def _local(placements) -> bool:
    """Whether a value the batch does not reach can take `placements` without a collective:
    whole, or a slice of it (a mask broadcast to the batch, cut to each rank's rows)."""
    return not any(is_partial(p) for p in placements)


def batch_dims(whole: TracedProgram, m: int, program: TracedProgram) -> dict[str, int]:
    """For each random op of `program` (traced on 1/m of the batch `whole` is traced on,
    which names its ops alike) whose output carries the batch (a weight's noise does not),
    the dimension whose m equal blocks are the m microbatches' shares of its whole-batch
    output. Read from the placements the sharding rules propagate from the batch split m
    ways (see `mixing`)."""
    names = [n.name for n in drawing_ops(program.graph_module) if n.target in _SPLIT_DRAWS]
    first = next((n for n in whole.graph.nodes if whole.inputs and n.name == whole.inputs[0]),
                 None)
    shape = tuple(first.meta["val"].shape) if first is not None else ()
    if not names or not shape or m <= 1:
        return {}
    graph = strategies.build(whole, (m,))
    possible, _ = _propagate(graph, whole.inputs, int(shape[0]), 0, set(loss_tail(whole)))
    dims, at = {}, {n.name: n for n in whole.graph.nodes}
    for node in (n for n in program.graph.nodes if n.name in names):
        shards = sorted(p[0].dim for k in (None, 0) for p in possible.get((node.name, k), ())
                        if isinstance(p[0], Shard) and (p[0].dim < 3 or node.target
                                                        not in _ATTENTION))
        if shards:
            dims[node.name] = shards[0]
        elif node.name not in at or _shape(at[node.name]) != _shape(node):
            line = source_line(node)
            raise ValueError(
                f"op {node.target}{f' ({line})' if line else ''} draws random numbers over "
                "the batch in a shape autopar cannot relate to the batch's samples, so "
                f"{m} microbatches cannot draw what the whole batch draws; draw them with "
                "torch.rand_like / randn_like of a tensor that carries the batch, or pass "
                "microbatches=1")
    return dims


def _shape(node) -> tuple:
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    return tuple(getattr(val, "shape", ()))


def _propagate(graph: strategies.StrategyGraph, inputs: list[str], batch: int, dim: int,
               tail: set[str]) -> tuple[dict, str]:
    """The placements each value can take with the batch sharded over mesh dimension `dim`
    and no collective, and the first op that has none (as words; "" when none)."""
    ndim = len(graph.mesh_shape)
    start = interned(tuple(Shard(0) if k == dim else R for k in range(ndim)))
    possible: dict[tuple[str, int | None], set] = {}
    for name in inputs:
        v = graph.nodes.get(name)
        if v is not None and v.out_shapes and v.out_shapes[0] and v.out_shapes[0][0] == batch:
            possible[(name, None)] = {start}
    for v in graph.nodes.values():
        if v.kind != strategies.OP:
            continue
        carried = [i for i, edge in enumerate(v.inputs) if edge in possible]
        if not carried or v.name in tail:  # the loss: loss_weights weighs its microbatches
            continue
        outs = range(len(v.out_shapes)) if v.multi_output else [None]
        found = False
        exchanges = facts_of(v.call.target).exchanges if v.call is not None else None
        for s in v.strategies:
            if exchanges is not None and exchanges(v.call, s.inputs, graph.mesh_shape,
                                                   lambda dt: dt.itemsize):
                continue  # its ranks exchange statistics of the batch (BatchNorm's)
            if all((s.inputs[i] in possible[edge]) if i in carried else _local(s.inputs[i])
                   for i, edge in enumerate(v.inputs)):
                found = True
                for k in outs:
                    possible.setdefault((v.name, k), set()).add(s.out(k))
        if not found:
            return possible, _mixing_op(v)
    return possible, ""


def _loss_reduction(graph: strategies.StrategyGraph, possible: dict, read, kind: str,
                    dim: int, mean: bool) -> str:
    """Why the loss's last op `read` (whose reduction passes/loss_weights.py reads as `kind`)
    does not say how microbatches' losses add up, or "". A kind read from it ("sum", "mean",
    "targets") holds only when the op reduces the samples themselves: when what reaches it
    was already summed or averaged over the batch (`loss.mean(0).sum()`), the weights come
    from that earlier op. Without a kind (`loss_reduction` decides: `mean` is its "mean")
    the op must add up what reaches it (sums of sums over the batch); a ratio of two sums
    over the batch (a masked mean, `(loss * mask).sum() / mask.sum()`) is not a weighted sum
    of microbatches'. A term the batch does not reach (a regulariser) added to a mean adds up
    under weights 1/m (they sum to 1), not under "sum" weights (m times). `dim`: the mesh
    dimension the batch is sharded over in `possible`."""
    if read is None:
        return ""
    carried = [i for i, edge in enumerate(read.inputs) if edge in possible]
    if not carried:
        return ""

    def reduced(edge) -> bool:  # summed or averaged over the batch before `read`
        return all(is_partial(placements[dim]) for placements in possible[edge])

    if kind:
        for i in carried:
            if reduced(read.inputs[i]):
                early = graph.nodes[_first_reduction(graph, possible, read.inputs[i][0], dim)]
                return (f"the loss reduces the batch's samples{_where(early)} ({early.op}) "
                        f"before its last op {read.op}{_where(read)}, whose reduction autopar "
                        "reads to weight each microbatch's loss; reduce the samples in the "
                        "loss's last op (one mean or sum over every dimension)")
        return ""
    if any(all(s.inputs[i] in possible[edge] if i in carried else _local(s.inputs[i])
               for i, edge in enumerate(read.inputs)) for s in read.strategies):
        return ""
    affine = read.op.split(".")[0] in ("add", "sub") and \
        all(reduced(read.inputs[i]) for i in carried)
    if affine and mean:
        return ""
    if affine:
        return (f"the loss's last op {read.op}{_where(read)} adds a term the batch does not "
                "reach to sums over the batch: with loss_reduction=\"sum\" every microbatch's "
                "loss would add it once more (with \"mean\", each weighted 1/m, it adds up)")
    return (f"the loss's last op {read.op}{_where(read)} combines sums or means over the "
            "batch in a way that is not their sum (a ratio of two sums over the batch, as a "
            "masked mean or a sum over tokens divided by their count is), so microbatches' "
            "losses cannot be weighted to add up to it; a cross-entropy's own mean "
            "(F.cross_entropy(..., ignore_index=-100)) divides by the targets it counts and is "
            "weighted by each microbatch's count")


def _first_reduction(graph: strategies.StrategyGraph, possible: dict, name: str,
                     dim: int) -> str:
    """The op that summed or averaged the batch's samples into value `name` (or the first
    such op upstream): the first, going back, whose input still holds samples."""
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n in seen or n not in graph.nodes:
            continue
        seen.add(n)
        v = graph.nodes[n]
        ins = [e for e in v.inputs if e in possible]
        if any(not is_partial(placements[dim]) for e in ins for placements in possible[e]):
            return n
        stack.extend(e[0] for e in ins)
    return name


def _where(v) -> str:
    return " in the loss function" if "self.loss_fn(" in v.source else \
        (f" in module {v.module}" if v.module else "") + (f" ({v.source})" if v.source else "")


def _mixing_op(v) -> str:
    """Why op `v` mixes the samples of the batch, with where the model makes it."""
    where = _where(v)
    if v.replicated_only:
        return (f"op {v.op}{where} has no sharding rule, so autopar cannot tell whether it "
                "keeps the samples of the batch apart")
    return (f"op {v.op}{where} mixes the samples of the batch (no strategy computes it from "
            "each sample's own rows: batch statistics, a comparison of every sample with "
            "every other, a shape broadcast across the batch, a mean over the whole batch's "
            "targets inside a larger loss)")
