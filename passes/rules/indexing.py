"""Facts of indexing, gathering and top-k (their sharding rules, where they have one, are in
embedding_loss.py and reductions.py, and index_put's here; the others run replicated).

Their backward scatters the incoming gradient back to the indexed positions, so it keeps the
indices (small integer tensors), not the values.
"""

from __future__ import annotations

import torch

from .registry import SAVES_INDICES, SAVES_NOTHING, OpCall, R, Rule1D, Shard, aten, facts, register

facts(aten.index.Tensor, aten.gather.default, aten.index_select.default,
      aten.embedding_dense_backward.default, aten.take_along_dim.default,
      aten.index_add.default, aten.scatter_add.default, aten.scatter.src,
      aten.scatter.value, aten.index_put.default, saves=SAVES_INDICES)
facts(aten.topk.default, aten.sort.default, aten.argsort.default, aten.one_hot.default,
      aten.bincount.default, aten.histc.default, saves=SAVES_NOTHING)


@register(aten.index_put.default)
def index_put(call: OpCall) -> list[Rule1D]:
    """Values written at indexed positions (`h[:, pad] = -inf` made functional): the written
    tensor sharded on a dimension no index reads, the values alongside it where they hold
    that dimension whole (else whole), the indices whole."""
    x = call.inputs[0]
    indices = call.args[1]
    indexed = [d for d, i in enumerate(indices) if i is not None]
    n_index = len(indexed)
    values = call.inputs[-1]
    masks = any(t.dtype in (torch.bool, torch.uint8) for t in call.inputs[1:1 + n_index])
    if masks or indexed != list(range(indexed[0], indexed[0] + n_index)):
        # a mask indexes as many dimensions as it has; indexed dimensions apart move first
        return [Rule1D(tuple(R for _ in call.inputs), R)]
    index_ndim = max(t.ndim for t in call.inputs[1:1 + n_index])
    # the shape values broadcast to: x[indices]
    target = (*x.shape[:indexed[0]], *([None] * index_ndim), *x.shape[indexed[-1] + 1:])
    rules = []
    for d in range(x.ndim):
        if d in indexed:
            continue
        pos = d if d < indexed[0] else d - n_index + index_ndim
        j = pos - (len(target) - values.ndim)
        held = j >= 0 and values.shape[j] == x.shape[d] and values.shape[j] != 1
        rules.append(Rule1D((Shard(d), *(R for _ in range(n_index)),
                             Shard(j) if held else R), Shard(d)))
    return rules + [Rule1D(tuple(R for _ in call.inputs), R)]
