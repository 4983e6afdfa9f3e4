"""Embedding lookups and the cross-entropy loss.

An embedding table can be split by rows (vocabulary parallel: each rank looks up the tokens it
owns, zeros elsewhere, and the output is a pending sum), by columns (hidden), or the lookups can be
split with the indices. Indexing a tensor with one index tensor (the expert weights each token
chose), gathering along a dimension and one-hot encoding are lookups too.

Cross-entropy with a mean over the batch is a pending sum when the batch is sharded: each rank
sums its rows' losses and divides by the global count of counted targets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import local_slices
from .registry import (
    SAVES_INDICES,
    SAVES_INPUTS,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    TensorArg,
    aten,
    facts,
    lowering,
    norm_dim,
    register,
)


def _bytes(shape, dtype, itemsize) -> float:
    return float(math.prod(shape) * itemsize(dtype))


def _lookup_traffic(call: OpCall, in_local, out_local, itemsize) -> tuple[float, float]:
    """A lookup reads the rows it gathers and writes them (forward); its backward zeroes the
    whole table's gradient, sorts the indices and adds the rows into it (about four passes
    over the table) after reading the output's gradient. Measured on an H200 (torch 2.11,
    128,256 x 4,096 bf16 table, 16,384 random tokens): 0.09 ms forward, 1.37 ms backward
    (benchmarks/RESULTS.md, "One GPU")."""
    w, idx = call.inputs[0], call.inputs[1]
    out = _bytes(out_local[0], w.dtype, itemsize)
    table = _bytes(in_local[0], w.dtype, itemsize)
    return 2 * out + _bytes(in_local[1], idx.dtype, itemsize), 4 * table + out


def _cross_entropy_traffic(call: OpCall, in_local, out_local, itemsize) -> tuple[float, float]:
    """Cross-entropy over classes is a log-softmax (a pass for the maximum, one for the sum
    of exponentials, one reading and one writing: four passes over its input) and a gather;
    backward writes the gather's gradient (zeros and a scatter), reads it and the saved
    log-probabilities and writes the input's gradient: five. Measured on an H200 (torch
    2.11, 16,384 x 128,256 float32 logits, 8.4 GB): 7.9 ms forward, 10.1 ms backward."""
    x = _bytes(in_local[0], call.inputs[0].dtype, itemsize)
    return 4 * x, 5 * x


def _cross_entropy_workspace(call: OpCall, in_local, out_local, itemsize) -> float:
    """Backward holds the gather's gradient and the input's gradient, each the input's size,
    next to the saved log-probabilities: with a large vocabulary (logits of 16,384 tokens x
    128,256 classes in float32 are 8.4 GB) this is the step's peak."""
    return 2 * _bytes(in_local[0], call.inputs[0].dtype, itemsize)


# A lookup keeps its indices; losses keep their input (cross-entropy: its log-softmax, the
# same size) and target.
facts(aten.embedding.default, saves=SAVES_INDICES, traffic=_lookup_traffic)
facts(aten.cross_entropy_loss.default, saves=SAVES_INPUTS, flops_per_element=20.0,
      traffic=_cross_entropy_traffic, workspace=_cross_entropy_workspace)
facts(aten.nll_loss.default, aten.nll_loss_nd.default, saves=SAVES_INPUTS,
      flops_per_element=20.0)
facts(aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
      aten.huber_loss.default, aten.binary_cross_entropy.default,
      aten.binary_cross_entropy_with_logits.default, saves=SAVES_INPUTS)


@register(aten.embedding.default)
def embedding(call: OpCall) -> list[Rule1D]:
    """embedding(weight (V, H), indices (...), padding_idx, scale_grad_by_freq, sparse)."""
    idx = call.inputs[1]
    if call.arg(3, "scale_grad_by_freq", False):
        # The gradient is scaled by each token's count among all the indices: every rank must
        # see all of them and look them all up in full rows.
        return [Rule1D((Shard(1), R), Shard(idx.ndim)), Rule1D((R, R), R)]
    rules = [Rule1D((R, Shard(j)), Shard(j)) for j in range(idx.ndim)]
    rules += [
        Rule1D((Shard(1), R), Shard(idx.ndim)),
        Rule1D((Shard(0), R), P),
        Rule1D((R, R), R),
    ]
    return rules


@register(aten.one_hot.default)
def one_hot(call: OpCall) -> list[Rule1D]:
    """one_hot(indices, num_classes): rows of the identity table, so the indices' dimensions may
    be sharded. With num_classes=-1 the class count is the largest index of all: whole only."""
    idx = call.inputs[0]
    rules = [Rule1D((R,), R)]
    if call.arg(1, "num_classes", -1) < 0:
        return rules
    return [Rule1D((Shard(j),), Shard(j)) for j in range(idx.ndim)] + rules


@register(aten.index.Tensor)
def index(call: OpCall) -> list[Rule1D]:
    """x[indices] with one integer index tensor, at position p of `indices` (None before it:
    whole dimensions). The output is x.shape[:p] + idx.shape + x.shape[p + 1:]: the lookups may
    be split with idx (x whole), or x on a dimension that is not indexed (idx whole). Several
    index tensors broadcast together, and boolean masks: whole only."""
    x = call.inputs[0]
    rules = [Rule1D(tuple(R for _ in call.inputs), R)]
    used = [(p, a) for p, a in enumerate(call.args[1]) if a is not None]
    if len(used) != 1 or not isinstance(used[0][1], TensorArg) or \
            used[0][1].dtype not in (torch.int64, torch.int32):
        return rules
    p, idx = used[0]
    rules = [Rule1D((R, Shard(j)), Shard(p + j)) for j in range(idx.ndim)]
    rules += [Rule1D((Shard(d), R), Shard(d if d < p else d - 1 + idx.ndim))
              for d in range(x.ndim) if d != p]
    return rules + [Rule1D((P, R), P), Rule1D((R, R), R)]


@register(aten.gather.default)
def gather(call: OpCall) -> list[Rule1D]:
    """gather(x, dim, index): out[..., j, ...] = x[..., index[..., j, ...], ...] along `dim`,
    which stays whole; another dimension may be sharded on both where x and index have the
    same size there (the output has index's shape)."""
    x, idx = call.inputs[:2]
    dim = norm_dim(call.args[1], x.ndim) if x.ndim else 0
    rules = [Rule1D((Shard(j), Shard(j)), Shard(j)) for j in range(x.ndim)
             if j != dim and x.shape[j] == idx.shape[j]]
    return rules + [Rule1D((P, R), P), Rule1D((R, R), R)]


def _vocab_parallel_embedding(weight, indices, start: int, length: int, padding_idx: int = -1):
    """Look up the rows this rank owns; other tokens give zeros (summed across ranks later).
    The padding row (which gets no gradient) is the owning rank's local row."""
    owned = (indices >= start) & (indices < start + length)
    local = torch.where(owned, indices - start, torch.zeros_like(indices))
    local_pad = padding_idx - start if start <= padding_idx < start + length else -1
    return (torch.ops.aten.embedding.default(weight, local, local_pad)
            * owned.unsqueeze(-1).to(weight.dtype))


@lowering(aten.embedding.default)
def lower_embedding(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Vocabulary-parallel lookup when the table's rows are sharded."""
    if not any(isinstance(p, Shard) and p.dim == 0 for p in ctx.in_placements[0]):
        return call.target, args, kwargs
    start, length = local_slices(call.inputs[0].shape, ctx.in_placements[0], ctx.mesh_shape,
                                 ctx.coords)[0]
    return _vocab_parallel_embedding, (args[0], args[1], start, length,
                                       call.arg(2, "padding_idx", -1)), {}


_MEAN, _SUM, _NONE = 1, 2, 0


@register(aten.cross_entropy_loss.default)
def cross_entropy(call: OpCall) -> list[Rule1D]:
    """cross_entropy(input (N, C), target (N,), weight=None, reduction, ignore_index, smoothing)."""
    x = call.inputs[0]
    rules = [Rule1D(tuple(R for _ in call.inputs), R)]
    if x.ndim != 2 or len(call.inputs) != 2:  # class weights or spatial losses: replicated only
        return rules
    reduction = call.arg(3, "reduction", _MEAN)
    if reduction == _MEAN:
        rules.insert(0, Rule1D((Shard(0), R), P))
    elif reduction == _SUM:
        rules.insert(0, Rule1D((Shard(0), Shard(0)), P))
    else:
        rules.insert(0, Rule1D((Shard(0), Shard(0)), Shard(0)))
    return rules


def _cross_entropy_rows(x, target, start: int, length: int, ignore_index: int, smoothing: float):
    """This rank's share of the mean loss: its rows' sum over the global count of targets
    (the rows not ignored for class indices; all rows for class probabilities)."""
    rows = target.narrow(0, start, length)
    total = F.cross_entropy(x, rows, reduction="sum", ignore_index=ignore_index,
                            label_smoothing=smoothing)
    if target.is_floating_point():
        return total / target.shape[0]
    return total / (target != ignore_index).sum()


@lowering(aten.cross_entropy_loss.default)
def lower_cross_entropy(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """Batch-sharded mean: divide by the global number of counted targets."""
    if call.arg(3, "reduction", _MEAN) != _MEAN or ctx.out_placements == tuple(
            R for _ in ctx.out_placements):
        return call.target, args, kwargs
    start, length = local_slices(call.inputs[0].shape, ctx.in_placements[0], ctx.mesh_shape,
                                 ctx.coords)[0]
    return _cross_entropy_rows, (args[0], args[1], start, length,
                                 call.arg(4, "ignore_index", -100),
                                 call.arg(5, "label_smoothing", 0.0)), {}


@register(aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
          aten.huber_loss.default)
def elementwise_loss(call: OpCall) -> list[Rule1D]:
    """Losses that average an elementwise term: any dimension may be sharded; a mean or sum
    becomes a pending sum (a mean scaled by the rank's share of the elements)."""
    x = call.inputs[0]
    reduction = call.arg(2, "reduction", _MEAN)
    out = (lambda d: Shard(d)) if reduction == _NONE else (lambda d: P)
    rules = [Rule1D(tuple(Shard(d) for _ in call.inputs), out(d)) for d in range(x.ndim)
             if all(t.shape == x.shape for t in call.inputs)]
    return rules + [Rule1D(tuple(R for _ in call.inputs), R)]


def _scaled(fn, scale: float):
    def local(*args, **kwargs):
        return fn(*args, **kwargs) * scale
    local.__name__ = f"{getattr(fn, '__name__', 'op')}_times_{scale:g}"
    return local


@lowering(aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
          aten.huber_loss.default)
def lower_elementwise_loss(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """A sharded mean counts for the rank's share of the elements."""
    if call.arg(2, "reduction", _MEAN) != _MEAN:
        return call.target, args, kwargs
    pieces = 1
    for k, p in enumerate(ctx.in_placements[0]):
        if isinstance(p, Shard):
            pieces *= ctx.mesh_shape[k]
    return (_scaled(call.target, 1.0 / pieces), args, kwargs) if pieces > 1 else (
        call.target, args, kwargs)
