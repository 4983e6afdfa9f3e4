"""Views, reshapes and data movement: a Shard is tracked through the op to the output dimension
holding the same elements.

A reshape keeps a shard only on the outermost dimension of each group of dimensions it merges or
splits (then every rank still holds one contiguous block of the group's elements); all these ops
are linear, so Partial passes through. Ops that take a shape argument get it made local.
"""

from __future__ import annotations

from .registry import (
    PASSES_ALL,
    SAVES_NOTHING,
    LocalContext,
    OpCall,
    P,
    R,
    Rule1D,
    Shard,
    aten,
    dedupe,
    facts,
    lowering,
    norm_dim,
    register,
)


def view_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair the non-unit dimensions of shapes `a` and `b` into groups of equal element count."""
    ai = [d for d in range(len(a)) if a[d] != 1]
    bi = [d for d in range(len(b)) if b[d] != 1]
    groups, i, j = [], 0, 0
    while i < len(ai) and j < len(bi):
        ins, outs = [ai[i]], [bi[j]]
        pa, pb = a[ai[i]], b[bi[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(ai[i])
                pa *= a[ai[i]]
                i += 1
            else:
                outs.append(bi[j])
                pb *= b[bi[j]]
                j += 1
        groups.append((ins, outs))
    return groups


def dim_map_rules(call: OpCall, mapping: dict[int, int]) -> list[Rule1D]:
    """Rules for a single-input op whose input dimension d lands on output dimension mapping[d]."""
    rules = [Rule1D((Shard(d),), Shard(o)) for d, o in sorted(mapping.items())]
    return rules + [Rule1D((R,), R), Rule1D((P,), P)]


# Views: no compute, no bytes of their own in forward (a reshape of an expanded tensor copies
# it: the memory model sees that from the graph). A reshape's or a transpose's gradient is a
# view of the output's; the gradient of a part (split, slice, select) is written into a whole
# tensor of the input's size, and an expansion's is summed, by a kernel.
facts(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
      aten.flatten.using_ints, aten.unflatten.int, aten.transpose.int, aten.permute.default,
      aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
      aten.squeeze.default, aten.view_as.default, view=True, saves=SAVES_NOTHING,
      grad_passes=(0,))
facts(aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
      aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.narrow.default,
      aten.as_strided.default, aten.expand_as.default, view=True, saves=SAVES_NOTHING)
# Copies that keep nothing for backward: a concatenation's or a padding's gradient is a view
# of the output's; a repetition's is summed, a roll's rolled back.
facts(aten.cat.default, aten.stack.default, aten.constant_pad_nd.default, aten.pad.default,
      saves=SAVES_NOTHING, grad_passes=PASSES_ALL)
facts(aten.repeat.default, aten.repeat_interleave.self_int, aten.roll.default,
      saves=SAVES_NOTHING)


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, aten.unflatten.int)
def reshape(call: OpCall) -> list[Rule1D]:
    """Shard the outermost dimension of a merged or split group."""
    groups = view_groups(call.inputs[0].shape, call.out_shape)
    return dim_map_rules(call, {ins[0]: outs[0] for ins, outs in groups})


@register(aten.transpose.int)
def transpose(call: OpCall) -> list[Rule1D]:
    """Swap two dimensions."""
    n = call.inputs[0].ndim
    d0, d1 = norm_dim(call.args[1], n), norm_dim(call.args[2], n)
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return dim_map_rules(call, {perm[o]: o for o in range(n)})


@register(aten.permute.default)
def permute(call: OpCall) -> list[Rule1D]:
    """Reorder dimensions."""
    n = call.inputs[0].ndim
    perm = [norm_dim(d, n) for d in call.args[1]]
    return dim_map_rules(call, {perm[o]: o for o in range(n)})


@register(aten.t.default)
def t(call: OpCall) -> list[Rule1D]:
    """Transpose of a matrix (or a vector, unchanged)."""
    n = call.inputs[0].ndim
    return dim_map_rules(call, {0: 1, 1: 0} if n == 2 else {0: 0})


@register(aten.unsqueeze.default)
def unsqueeze(call: OpCall) -> list[Rule1D]:
    """Insert a unit dimension."""
    n = call.inputs[0].ndim
    d = norm_dim(call.args[1], n + 1)
    return dim_map_rules(call, {j: j if j < d else j + 1 for j in range(n)})


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(call: OpCall) -> list[Rule1D]:
    """Drop unit dimensions; the others keep their order."""
    shape = call.inputs[0].shape
    if call.target == aten.squeeze.default:
        gone = {d for d, s in enumerate(shape) if s == 1}
    else:
        dims = call.args[1] if isinstance(call.args[1], (list, tuple)) else [call.args[1]]
        gone = {norm_dim(d, len(shape)) for d in dims if shape[norm_dim(d, len(shape))] == 1}
    kept = [d for d in range(len(shape)) if d not in gone]
    return dim_map_rules(call, {d: o for o, d in enumerate(kept)})


@register(aten.expand.default)
def expand(call: OpCall) -> list[Rule1D]:
    """Broadcast to a larger shape: dimensions that are not broadcast may stay sharded."""
    x = call.inputs[0]
    lead = call.out_ndim - x.ndim
    return dim_map_rules(call, {j: j + lead for j in range(x.ndim)
                                if x.shape[j] == call.out_shape[j + lead] and x.shape[j] != 1})


@register(aten.constant_pad_nd.default, aten.pad.default)
def pad(call: OpCall) -> list[Rule1D]:
    """Constant padding (`pad` lists (before, after) pairs from the last dimension back):
    dimensions it does not pad may be sharded. Other modes (reflect, replicate, circular)
    read the edges of the padded dimensions only, so the same holds for them."""
    x = call.inputs[0]
    widths = list(call.args[1])
    padded = {x.ndim - 1 - k // 2 for k in range(len(widths)) if widths[k] != 0}
    rules = dim_map_rules(call, {j: j for j in range(x.ndim) if j not in padded})
    return [r for r in rules if r.inputs[0] != P]  # a pending sum would pad every piece


@register(aten.roll.default)
def roll(call: OpCall) -> list[Rule1D]:
    """Rotate the elements along `dims` (Swin's cyclic window shift): the other dimensions
    may be sharded. Without dims it rotates the flattened tensor, which moves every
    dimension."""
    x = call.inputs[0]
    dims = call.arg(2, "dims", [])
    rolled = {norm_dim(d, x.ndim) for d in dims} if dims else set(range(x.ndim))
    return dim_map_rules(call, {j: j for j in range(x.ndim) if j not in rolled})


@register(aten.expand_as.default)
def expand_as(call: OpCall) -> list[Rule1D]:
    """Broadcast to the shape of `other`, whose values are not read: each dimension of the
    output may be sharded as `other` is, with the input sharded alike where it is not
    broadcast there (and whole where it is)."""
    x, other = call.inputs[0], call.inputs[1]
    lead = other.ndim - x.ndim
    rules = [Rule1D((R, R), R)]
    for j in range(other.ndim):
        i = j - lead
        if i >= 0 and x.shape[i] == other.shape[j] and x.shape[i] != 1:
            rules.append(Rule1D((Shard(i), Shard(j)), Shard(j)))
        else:
            rules.append(Rule1D((R, Shard(j)), Shard(j)))
    return rules


@register(aten.slice.Tensor)
def slice_(call: OpCall) -> list[Rule1D]:
    """A slice along one dimension: the others may be sharded."""
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    return dim_map_rules(call, {j: j for j in range(x.ndim)
                                if j != dim or x.shape[j] == call.out_shape[j]})


@register(aten.narrow.default)
def narrow(call: OpCall) -> list[Rule1D]:
    """`length` elements from `start` along one dimension: the others may be sharded."""
    return slice_(call)


@register(aten.select.int)
def select(call: OpCall) -> list[Rule1D]:
    """Pick one index along a dimension, which disappears."""
    x = call.inputs[0]
    dim = norm_dim(call.args[1], x.ndim)
    return dim_map_rules(call, {j: j if j < dim else j - 1 for j in range(x.ndim) if j != dim})


# Writes into a part of a tensor, made functional (passes/functionalize.py): the whole tensor
# with the part replaced. Linear in (base, part) together; backward slices the gradient.
facts(aten.slice_scatter.default, aten.select_scatter.default, saves=SAVES_NOTHING)


@register(aten.slice_scatter.default)
def slice_scatter(call: OpCall) -> list[Rule1D]:
    """The base with a slice along one dimension replaced by the part: the base and the part
    sharded alike on any other dimension."""
    x = call.inputs[0]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    rules = [Rule1D((Shard(j), Shard(j)), Shard(j)) for j in range(x.ndim)
             if j != dim or x.shape[j] == call.inputs[1].shape[j]]
    return rules + [Rule1D((R, R), R), Rule1D((P, P), P)]


@register(aten.select_scatter.default)
def select_scatter(call: OpCall) -> list[Rule1D]:
    """The base with one index along a dimension replaced by the part (which lacks that
    dimension): the base and the part sharded alike on any other dimension."""
    x = call.inputs[0]
    dim = norm_dim(call.args[2], x.ndim)
    rules = [Rule1D((Shard(j), Shard(j if j < dim else j - 1)), Shard(j))
             for j in range(x.ndim) if j != dim]
    return rules + [Rule1D((R, R), R), Rule1D((P, P), P)]


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
def split(call: OpCall) -> list[Rule1D]:
    """Several outputs cut along one dimension: the other dimensions may be sharded."""
    x = call.inputs[0]
    if call.target == aten.unbind.int:
        dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
        shift = 1
    else:
        dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
        shift = 0
    k = len(call.out_shapes)
    rules = []
    for j in range(x.ndim):
        if j != dim:
            o = j - shift if j > dim else j
            rules.append(Rule1D((Shard(j),), tuple(Shard(o) for _ in range(k))))
    rules.append(Rule1D((R,), tuple(R for _ in range(k))))
    rules.append(Rule1D((P,), tuple(P for _ in range(k))))
    return rules


def _joined(k: int, out_dim: dict[int, int]) -> list[Rule1D]:
    """Rules of an op joining `k` inputs alike: each input sharded on dimension j gives the
    output sharded on `out_dim[j]`; all replicated, or all pending sums."""
    rules = [Rule1D(tuple(Shard(j) for _ in range(k)), Shard(o)) for j, o in out_dim.items()]
    rules += [Rule1D(tuple(R for _ in range(k)), R), Rule1D(tuple(P for _ in range(k)), P)]
    return dedupe(rules)


@register(aten.cat.default)
def cat(call: OpCall) -> list[Rule1D]:
    """Concatenate along one dimension: all inputs sharded alike on another dimension."""
    n = call.out_ndim
    dim = norm_dim(call.arg(1, "dim", 0), n)
    k = len(call.inputs)
    if any(t.ndim != n for t in call.inputs):  # legacy empty 1-D tensors: keep it simple
        return [Rule1D(tuple(R for _ in range(k)), R)]
    return _joined(k, {j: j for j in range(n) if j != dim})


@register(aten.stack.default)
def stack(call: OpCall) -> list[Rule1D]:
    """Stack along a new dimension."""
    n = call.out_ndim
    dim = norm_dim(call.arg(1, "dim", 0), n)
    return _joined(len(call.inputs), {j: j if j < dim else j + 1 for j in range(n - 1)})


@register(aten.repeat_interleave.self_int)
def repeat_interleave(call: OpCall) -> list[Rule1D]:
    """Each element repeated `repeats` times in a row along `dim` (the flattened input when dim
    is None): a block of the input becomes the block of the output, on every dimension. Along
    `dim`, only without `output_size` (the global size, which a shard does not have)."""
    x = call.inputs[0]
    dim = call.arg(2, "dim", None)
    whole_size = call.arg(3, "output_size", None) is not None
    if dim is None:
        return dim_map_rules(call, {} if whole_size or not x.ndim else {0: 0})
    dim = norm_dim(dim, x.ndim)
    return dim_map_rules(call, {j: j for j in range(x.ndim) if j != dim or not whole_size})


def _with_local_shape(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext, i: int):
    args = list(args)
    args[i] = list(ctx.local_out_shapes[0])
    return call.target, tuple(args), kwargs


@lowering(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.expand.default)
def lower_shape_arg(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """The shape argument becomes the local output shape. A view becomes a reshape: the global
    tensor was contiguous, but a local shard (a slice of it) need not be, and the program is
    functional, so a copy where a view is impossible changes nothing."""
    target, args, kwargs = _with_local_shape(call, args, kwargs, ctx, 1)
    if target in (aten.view.default, aten._unsafe_view.default):
        target = aten.reshape.default
    return target, args, kwargs


@lowering(aten.unflatten.int)
def lower_unflatten(call: OpCall, args: tuple, kwargs: dict, ctx: LocalContext):
    """The sizes argument becomes the local sizes of the new dimensions."""
    dim = norm_dim(args[1], call.inputs[0].ndim)
    args = (args[0], args[1], list(ctx.local_out_shapes[0][dim:dim + len(args[2])]))
    return call.target, args, kwargs

