"""Facts of indexing, gathering and top-k (their sharding rules, where they have one, are in
embedding_loss.py and reductions.py; the others run replicated).

Their backward scatters the incoming gradient back to the indexed positions, so it keeps the
indices (small integer tensors), not the values.
"""

from __future__ import annotations

from .registry import SAVES_INDICES, SAVES_NOTHING, aten, facts

facts(aten.index.Tensor, aten.gather.default, aten.index_select.default,
      aten.embedding_dense_backward.default, aten.take_along_dim.default,
      aten.index_add.default, aten.scatter_add.default, aten.scatter.src,
      aten.scatter.value, aten.index_put.default, saves=SAVES_INDICES)
facts(aten.topk.default, aten.sort.default, aten.argsort.default, aten.one_hot.default,
      aten.bincount.default, aten.histc.default, saves=SAVES_NOTHING)
