"""Row-wise ops on a flattened batch computed on the unflattened tensor, so the batch stays a
dimension of its own.

`nn.MultiheadAttention` (and code written like it) flattens its (L, N, E) output to (L*N, E)
for the output projection and unflattens the result:

    a = reshape(o, [L*N, E]);  b = linear(a, w, bias);  c = view(b, [L, N, E'])

The rows of `a` interleave the samples (sequence-major), so a batch shard of `o` is no
contiguous shard of `a`: the sharding rules find no strategy that keeps the samples apart,
gradient accumulation is refused and data parallelism reshards through the flattening. A
linear maps every row alone, so the same values come out of

    a = reshape(o, [L, N, E]);  b = linear(a, w, bias)      (c is b)

which is what this pass rewrites it to, wherever a reshape to two dimensions feeds a chain of
row-wise ops (each the only user of the one before) whose last result is reshaped back to
leading dimensions of the same number of rows. Reshapes compose in row-major order, so the
rewrite computes the same numbers, forward and backward, on one device.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .functionalize import fake_value

aten = torch.ops.aten
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# ops whose input 0 row r alone makes output row r (when the other inputs carry no rows:
# `_per_column`)
ROW_WISE = {aten.linear.default}


def unflatten_row_chains(gm: fx.GraphModule) -> int:
    """Rewrite every flatten -> row-wise ops -> unflatten chain of `gm` as described above;
    returns how many were rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        chain = _chain(node)
        if chain is None:
            continue
        *ops, close = chain
        lead = list(close.meta["val"].shape[:-1])
        node.target = aten.reshape.default
        node.args = (node.args[0], [*lead, node.meta["val"].shape[-1]])
        for n in (node, *ops):
            fake_value(n)
        close.replace_all_uses_with(ops[-1])
        gm.graph.erase_node(close)
        done += 1
    if done:
        gm.recompile()
    return done


def _per_column(linear: fx.Node) -> bool:
    """Whether a linear's other inputs carry no rows: a 2-D weight and a bias of one value
    per output column (or none); a bias of one row per row broadcasts otherwise once the
    rows are unflattened."""
    def dims(a) -> int | None:
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        return v.dim() if isinstance(v, torch.Tensor) else None

    weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    return dims(weight) == 2 and (bias is None or dims(bias) in (0, 1))


def _chain(node: fx.Node) -> list[fx.Node] | None:
    """The row-wise ops after `node` (a reshape to two dimensions) and the reshape closing
    them, or None when `node` starts no chain this pass rewrites."""
    if node.op != "call_function" or node.target not in RESHAPES:
        return None
    flat = node.meta.get("val")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 2:
        return None
    chain, last = [], node
    while len(last.users) == 1:
        (user,) = last.users
        if user.op == "call_function" and user.target in ROW_WISE and user.args[0] is last \
                and last not in user.args[1:] and last not in user.kwargs.values() \
                and _per_column(user):
            chain.append(user)
            last = user
            continue
        if not chain or user.target not in RESHAPES or user.args[0] is not last:
            return None
        whole, out = user.meta.get("val"), last.meta["val"]
        if not isinstance(whole, torch.Tensor) or whole.dim() < 3 or \
                math.prod(whole.shape[:-1]) != flat.shape[0] or whole.shape[-1] != out.shape[-1]:
            return None
        return [*chain, user]
    return None
